//! The master image cache: one verified file per image variant, named as
//! Ironic names it, with a sidecar recording the checksums of exactly its
//! bytes so that a cache hit never reads the image again.
//!
//! Layout of the cache directory (the worker's own, never Ironic's):
//! masters as plain files at the top; everything else in hidden
//! subdirectories, so that a sweeper of plain files (Ironic's image-cache
//! clean-up, which skips directories) cannot remove a sidecar or a file
//! being written: `.meta/<name>.json` sidecars, `.tmp/` temporaries (named
//! after their owner process, see [`fsutil::TempOwner`]), `.locks/` and
//! `.owners/` lock files, `.gzip/` compressed forms (`store/compress.rs`).

use crate::error::{Error, ErrorCode, Result};
use crate::fsutil::{self, TempOwner};
use crate::image_format::{Format, ServedFormat};
use crate::optional_digest;
use crate::store::lock::{LockGuard, Locks};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Suffix of a sidecar in the layout of earlier versions (next to the
/// master); such sidecars are moved into `.meta/` on start.
pub const OLD_META_SUFFIX: &str = ".meta.json";
/// Suffix Ironic gives a master that went through the raw-conversion logic.
pub const CONVERTED_SUFFIX: &str = ".converted";
/// Subdirectory of the sidecars.
const META_DIR: &str = ".meta";

/// Sidecars (and their directory, 0700) are the worker's alone: no web
/// server or Ironic reads them, and a source they name is redacted anyway.
const SIDECAR_MODE: u32 = 0o600;
/// Subdirectory of the temporaries.
const TEMP_DIR: &str = ".tmp";

/// The extended attribute every master gets when it is committed (its
/// name): a node's `disk` carrying it is a hard link of a master the worker
/// made, even once that master was replaced, so the expiry of node files
/// knows it for the worker's own.
pub const MASTER_MARK: &str = "user.ironic-image-worker.master";

/// What the sidecar records about a master. A digest that was not computed
/// is `None` (never an empty string in memory), so it can be computed
/// later; on disk it is null, or an empty string for `md5` (see
/// [`crate::optional_digest`]), and an empty string of an earlier version
/// reads as `None`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterMeta {
    /// The `image_source` the master was made from, its secrets masked
    /// ([`crate::secrets::redact_url`]): the sidecar is no place for them.
    pub source: String,
    /// Unix time (s) at which the download started: the source must not be
    /// newer than this for the master to be fresh.
    pub fetched_at: u64,
    /// Source `Last-Modified` / mtime (unix s), when known.
    pub source_last_modified: Option<u64>,
    /// Size of the source bytes.
    pub source_size: u64,
    /// MD5 of the source bytes, when computed.
    #[serde(default, deserialize_with = "optional_digest::deserialize")]
    pub source_md5: Option<String>,
    /// SHA-256 of the source bytes, when computed.
    #[serde(default, deserialize_with = "optional_digest::deserialize")]
    pub source_sha256: Option<String>,
    /// SHA-512 of the source bytes, when computed.
    #[serde(default, deserialize_with = "optional_digest::deserialize")]
    pub source_sha512: Option<String>,
    /// Format detected in the source bytes.
    pub source_format: Format,
    /// Whether the master is a conversion of the source.
    pub converted: bool,
    /// `disk_format` of the master's bytes as announced to the agent.
    pub disk_format: ServedFormat,
    /// Size of the master's bytes.
    pub size: u64,
    /// MD5 of the master's bytes, when computed (not with `[agent]
    /// served_md5 = false`; computed from the master when a request needs
    /// it). Written as an empty string when absent: earlier versions read a
    /// string.
    #[serde(default, with = "optional_digest")]
    pub md5: Option<String>,
    /// SHA-256 of the master's bytes.
    pub sha256: String,
    /// SHA-512 of the master's bytes, when computed.
    #[serde(default, deserialize_with = "optional_digest::deserialize")]
    pub sha512: Option<String>,
    /// Inode of the master the sidecar describes: a replaced master never
    /// inherits an older sidecar.
    pub inode: u64,
}

impl MasterMeta {
    /// True when the source bytes are exactly the master's bytes (neither
    /// converted nor decompressed), so a missing source digest can be
    /// computed from the master.
    pub fn served_as_fetched(&self) -> bool {
        !self.converted
            && self.source_size == self.size
            && self
                .source_sha256
                .as_ref()
                .is_none_or(|s| *s == self.sha256)
    }

    /// Takes every digest `other` knows and `self` does not (both describe
    /// the same bytes).
    fn merge_digests(&mut self, other: &MasterMeta) {
        for (mine, theirs) in [
            (&mut self.source_md5, &other.source_md5),
            (&mut self.source_sha256, &other.source_sha256),
            (&mut self.source_sha512, &other.source_sha512),
            (&mut self.md5, &other.md5),
            (&mut self.sha512, &other.sha512),
        ] {
            if mine.is_none() {
                mine.clone_from(theirs);
            }
        }
    }

    /// True when both describe the same served bytes (see [`md5s_agree`]).
    fn same_bytes(&self, other: &MasterMeta) -> bool {
        self.size == other.size
            && self.sha256 == other.sha256
            && md5s_agree(self.md5.as_deref(), other.md5.as_deref())
    }
}

/// Whether two records of the same bytes agree on their MD5: one not
/// computed on either side is not compared (masters made with `[agent]
/// served_md5 = false` have none).
pub fn md5s_agree(a: Option<&str>, b: Option<&str>) -> bool {
    a.is_none() || b.is_none() || a == b
}

/// A master that passed validation, with its path.
#[derive(Debug, Clone)]
pub struct Master {
    /// Path of the master file.
    pub path: PathBuf,
    /// Its sidecar.
    pub meta: MasterMeta,
}

/// The master cache directory and its locks. Cheap to clone, so blocking
/// work on it can move to a blocking thread.
#[derive(Clone)]
pub struct Cache {
    dir: PathBuf,
    locks: Arc<Locks>,
    owner: Arc<TempOwner>,
    sidecars: Arc<Sidecars>,
    /// The locks of compressions (`store/compress.rs`), made on first use.
    pub(super) gzip_locks: Arc<std::sync::OnceLock<Locks>>,
}

/// Sidecars already read, by master name, each with the identity of the
/// file it was read from: a cache hit stats the sidecar instead of opening,
/// reading and parsing it. Sidecars are only ever replaced by a rename
/// (a new inode, a new change time) or removed, so an unchanged identity
/// means unchanged contents.
#[derive(Default)]
struct Sidecars(
    std::sync::Mutex<std::collections::HashMap<String, (crate::fsutil::FileStamp, MasterMeta)>>,
);

/// Sidecars remembered at most (one per master; beyond that, forgotten).
const SIDECARS_REMEMBERED: usize = 4096;

impl Sidecars {
    /// The sidecar at `path` for master `name`, parsed.
    fn read(&self, name: &str, path: &Path) -> Option<MasterMeta> {
        let stamp = crate::fsutil::FileStamp::of(&std::fs::metadata(path).ok()?);
        let mut known = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((s, meta)) = known.get(name)
            && *s == stamp
        {
            return Some(meta.clone());
        }
        drop(known);
        let mut file = std::fs::File::open(path).ok()?;
        // The identity of what was opened, not of what the path named a
        // moment earlier.
        let stamp = crate::fsutil::FileStamp::of(&file.metadata().ok()?);
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut text).ok()?;
        let meta: MasterMeta = serde_json::from_slice(&text).ok()?;
        known = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= SIDECARS_REMEMBERED {
            known.clear();
        }
        known.insert(name.to_string(), (stamp, meta.clone()));
        Some(meta)
    }
}

/// The master file name Ironic uses: the Glance image id (`glance`), or
/// `uuid5(NAMESPACE_URL, href)`, plus `.converted` when force_raw applies.
pub fn master_name(href: &str, glance: Option<&str>, force_raw: bool) -> String {
    let base = glance.map(str::to_string).unwrap_or_else(|| {
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, href.as_bytes()).to_string()
    });
    if force_raw {
        base + CONVERTED_SUFFIX
    } else {
        base
    }
}

/// Unix seconds of `t`.
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The hex digest `algo` of the file at `path` (blocking: for a digest a
/// sidecar lacks, computed from the master instead of downloading again).
pub fn hash_file(path: &Path, algo: crate::store::checksum::Algo) -> Result<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io("open master", e))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut hasher = crate::store::checksum::Hasher::new(algo);
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| Error::io("read master", e))?;
        if n == 0 {
            return Ok(hasher.finalize_hex());
        }
        hasher.update(&buf[..n]);
    }
}

/// What start-up recovery did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Recovered {
    /// Temporaries of processes that are gone, removed.
    pub temporaries: usize,
    /// Sidecars of the earlier layout moved into `.meta/`.
    pub sidecars_moved: usize,
}

impl Cache {
    /// Opens (creating) the cache directory.
    pub fn open(dir: &Path) -> Result<Cache> {
        fsutil::ensure_dir(dir)?;
        Ok(Cache {
            dir: dir.to_path_buf(),
            locks: Arc::new(Locks::new(dir.join(".locks"))?),
            owner: Arc::new(TempOwner::new(dir.join(".owners"))),
            sidecars: Arc::default(),
            gzip_locks: Arc::default(),
        })
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The owner of this process's temporaries (shared with the node links).
    pub fn owner(&self) -> Arc<TempOwner> {
        self.owner.clone()
    }

    /// Records a use of `master` that links nothing (a warm's cache hit):
    /// its access time becomes now (and so, by the kernel, its change
    /// time), which eviction reads as its last use, so a master warmed
    /// before a rollout is kept another `[pxe]image_cache_ttl`. Its
    /// modification time is left alone: a node's copy of a master is known
    /// by it (`link`). A failure only leaves the older time.
    pub fn mark_used(&self, master: &Path) {
        use rustix::fs::{AtFlags, CWD, Timespec, Timestamps, UTIME_NOW, UTIME_OMIT};
        let times = Timestamps {
            last_access: Timespec {
                tv_sec: 0,
                tv_nsec: UTIME_NOW,
            },
            last_modification: Timespec {
                tv_sec: 0,
                tv_nsec: UTIME_OMIT,
            },
        };
        if let Err(e) = rustix::fs::utimensat(CWD, master, &times, AtFlags::empty()) {
            tracing::debug!(error = %e, master = %master.display(), "cannot record the master's use");
        }
    }

    /// Path of the master called `name`.
    pub fn master_path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Path of the sidecar of master `name`.
    pub fn meta_path(&self, name: &str) -> PathBuf {
        self.dir.join(META_DIR).join(format!("{name}.json"))
    }

    /// A fresh temporary path in `.tmp/` for building `name` (the directory
    /// is recreated if it was deleted).
    pub fn temp_path(&self, name: &str) -> Result<PathBuf> {
        let dir = self.dir.join(TEMP_DIR);
        fsutil::ensure_dir(&dir)?;
        self.owner.temp_next_to(&dir.join(name))
    }

    /// Serialises all work on the master `name`, in this process and others.
    pub async fn lock(&self, name: &str) -> Result<LockGuard> {
        self.locks.acquire(name).await
    }

    /// After a failed attempt to make master `name`: its lock file goes
    /// when the attempt left no master (lock files stay only while what
    /// they guard exists).
    pub fn release_failed(&self, name: &str, lock: &mut LockGuard) {
        if !self.master_path(name).exists() {
            lock.remove_file();
        }
    }

    /// The lock on master `name` if it is free right now (for eviction,
    /// which skips masters in use rather than waiting).
    pub fn try_lock(&self, name: &str) -> Option<LockGuard> {
        self.locks.try_acquire(name)
    }

    /// The master `name` if it exists with a sidecar that describes exactly it.
    pub fn load(&self, name: &str) -> Option<Master> {
        let path = self.master_path(name);
        let stat = std::fs::metadata(&path).ok()?;
        let meta = self.sidecars.read(name, &self.meta_path(name))?;
        (stat.is_file() && meta.inode == stat.ino() && meta.size == stat.len())
            .then_some(Master { path, meta })
    }

    /// Moves the finished file `temp` into place as master `name` and writes
    /// its sidecar. The master is renamed first: a crash in between leaves a
    /// master without a valid sidecar, which is never a hit. When the master
    /// in place already holds exactly these bytes, it is kept (nodes may
    /// hard-link it: replacing it would double the disk used) and only the
    /// sidecar learns the digests it lacked; `temp` is then removed.
    pub fn commit(&self, temp: &Path, name: &str, mut meta: MasterMeta) -> Result<Master> {
        let path = self.master_path(name);
        if let Some(mut current) = self.load(name)
            && current.meta.same_bytes(&meta)
        {
            current.meta.merge_digests(&meta);
            if current.meta.source != meta.source {
                current.meta.source = meta.source;
            }
            current.meta.fetched_at = current.meta.fetched_at.max(meta.fetched_at);
            self.write_meta(name, &current.meta)?;
            fsutil::remove_file_if_exists(temp)?;
            return Ok(current);
        }
        let stat = std::fs::metadata(temp).map_err(|e| Error::io("stat new master", e))?;
        meta.inode = stat.ino();
        if let Err(e) = rustix::fs::setxattr(
            temp,
            MASTER_MARK,
            name.as_bytes(),
            rustix::fs::XattrFlags::empty(),
        ) {
            tracing::debug!(error = %e, "cannot mark the new master as the worker's");
        }
        std::fs::rename(temp, &path)
            .map_err(|e| Error::io(format!("rename into {}", path.display()), e))?;
        self.write_meta(name, &meta)?;
        Ok(Master { path, meta })
    }

    /// Replaces the sidecar of master `name` (after learning a digest).
    pub fn write_meta(&self, name: &str, meta: &MasterMeta) -> Result<()> {
        let meta_path = self.meta_path(name);
        let dir = self.dir.join(META_DIR);
        fsutil::ensure_private_dir(&dir)?;
        let temp = self.owner.temp_next_to(&meta_path)?;
        let body = serde_json::to_vec_pretty(meta)
            .map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        fsutil::write_file_atomically(&meta_path, &temp, &body, SIDECAR_MODE)
    }

    /// Removes the sidecar of master `name`, if any.
    pub fn remove_meta(&self, name: &str) -> Result<bool> {
        fsutil::remove_file_if_exists(&self.meta_path(name))
    }

    /// The sidecars present, by master name.
    pub fn sidecar_names(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.dir.join(META_DIR)) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_suffix(".json")
                    .filter(|m| !m.starts_with('.'))
                    .map(str::to_string)
            })
            .collect()
    }

    /// Device and inode of every master (plain files at the top of the
    /// directory): what a node's `disk` made by the worker links.
    pub fn master_inodes(&self) -> std::collections::HashSet<(u64, u64)> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Default::default();
        };
        entries
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| (m.dev(), m.ino()))
            .collect()
    }

    /// The masters that have a lock file.
    pub fn lock_names(&self) -> Vec<String> {
        self.locks.names()
    }

    /// Start-up recovery, for commands that write (never for read-only
    /// ones): removes the temporaries of processes that are gone and the lock
    /// files of those processes, and brings a directory of the earlier
    /// layout (sidecars `<name>.meta.json` and temporaries `.tmp-*` next to
    /// the masters) into this one.
    pub fn recover(&self) -> Result<Recovered> {
        let mut done = Recovered {
            temporaries: self.owner.remove_orphans_in(&self.dir.join(TEMP_DIR))?,
            ..Recovered::default()
        };
        // Sidecar temporaries live next to the sidecars.
        done.temporaries += self.owner.remove_orphans_in(&self.dir.join(META_DIR))?;
        self.owner.remove_dead_owners();
        let entries = std::fs::read_dir(&self.dir).map_err(|e| Error::io("list cache", e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(fsutil::TEMP_PREFIX) && entry.path().is_file() {
                // The earlier layout's temporaries carry no owner: the
                // process that wrote them is an earlier version, stopped
                // before this one started.
                if fsutil::remove_file_if_exists(&entry.path())? {
                    done.temporaries += 1;
                }
            } else if let Some(master) = name.strip_suffix(OLD_META_SUFFIX)
                && !master.starts_with('.')
            {
                let Some(_guard) = self.try_lock(master) else {
                    continue;
                };
                let target = self.meta_path(master);
                if target.exists() {
                    fsutil::remove_file_if_exists(&entry.path())?;
                } else {
                    fsutil::ensure_private_dir(&self.dir.join(META_DIR))?;
                    std::fs::rename(entry.path(), &target)
                        .map_err(|e| Error::io("move sidecar into .meta", e))?;
                    done.sidecars_moved += 1;
                }
            }
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A master's record, with an MD5.
    fn sample() -> MasterMeta {
        MasterMeta {
            source: "http://example.com/m".into(),
            fetched_at: 1,
            source_last_modified: None,
            source_size: 5,
            source_md5: None,
            source_sha256: None,
            source_sha512: None,
            source_format: Format::Raw,
            converted: false,
            disk_format: Format::Raw.served(),
            size: 5,
            md5: Some("a".into()),
            sha256: "b".into(),
            sha512: None,
            inode: 0,
        }
    }

    #[test]
    fn a_remembered_sidecar_follows_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path()).unwrap();
        let temp = cache.temp_path("m").unwrap();
        std::fs::write(&temp, b"bytes").unwrap();
        let master = cache.commit(&temp, "m", sample()).unwrap();
        assert_eq!(cache.load("m").unwrap().meta, master.meta);
        // Replaced (a digest learnt, by this process or another): the new
        // contents, not the remembered ones.
        let mut learnt = master.meta.clone();
        learnt.sha512 = Some("c".into());
        cache.write_meta("m", &learnt).unwrap();
        assert_eq!(cache.load("m").unwrap().meta, learnt);
        let other = Cache::open(dir.path()).unwrap();
        learnt.source_md5 = Some("d".into());
        other.write_meta("m", &learnt).unwrap();
        assert_eq!(cache.load("m").unwrap().meta, learnt);
        cache.remove_meta("m").unwrap();
        assert!(cache.load("m").is_none());
    }

    /// A sidecar of an earlier version, which wrote an empty string for a
    /// digest not computed, reads with those digests absent, and its MD5
    /// when there is one.
    #[test]
    fn an_earlier_sidecar_reads_with_empty_digests_absent() {
        let mut earlier = serde_json::to_value(sample()).unwrap();
        earlier["md5"] = "".into();
        earlier["source_md5"] = "".into();
        earlier["sha512"] = "".into();
        let meta: MasterMeta = serde_json::from_value(earlier.clone()).unwrap();
        assert_eq!((meta.md5, meta.source_md5, meta.sha512), (None, None, None));
        earlier["md5"] = "a".into();
        let meta: MasterMeta = serde_json::from_value(earlier).unwrap();
        assert_eq!(meta, sample());
    }

    /// A sidecar written now reads back as written, and an earlier version
    /// (which holds `md5` as a plain string) reads it too: an MD5 not
    /// computed is written as an empty string, the optional digests as
    /// null.
    #[test]
    fn a_sidecar_written_now_reads_in_this_and_the_earlier_version() {
        #[derive(Deserialize)]
        struct Earlier {
            md5: String,
            sha256: String,
            sha512: Option<String>,
            source_md5: Option<String>,
        }
        for md5 in [Some("a".to_string()), None] {
            let meta = MasterMeta { md5, ..sample() };
            let text = serde_json::to_vec_pretty(&meta).unwrap();
            assert_eq!(serde_json::from_slice::<MasterMeta>(&text).unwrap(), meta);
            let earlier: Earlier = serde_json::from_slice(&text).unwrap();
            assert_eq!(earlier.md5, meta.md5.unwrap_or_default());
            assert_eq!(earlier.sha256, meta.sha256);
            assert_eq!((earlier.sha512, earlier.source_md5), (None, None));
        }
    }

    /// A sidecar as every earlier version wrote it (formats by their
    /// lower-case names) reads as typed formats and is written back byte
    /// for byte.
    #[test]
    fn a_sidecar_keeps_its_bytes_with_typed_formats() {
        let written = r#"{
  "source": "http://example.com/m",
  "fetched_at": 1,
  "source_last_modified": null,
  "source_size": 5,
  "source_md5": null,
  "source_sha256": "c",
  "source_sha512": null,
  "source_format": "qcow2",
  "converted": true,
  "disk_format": "raw",
  "size": 64,
  "md5": "a",
  "sha256": "b",
  "sha512": null,
  "inode": 7
}"#;
        let meta: MasterMeta = serde_json::from_str(written).unwrap();
        assert_eq!(meta.source_format, Format::Qcow2);
        assert_eq!(meta.disk_format, Format::Raw.served());
        assert_eq!(serde_json::to_string_pretty(&meta).unwrap(), written);
    }

    /// A sidecar naming a format this version does not know (or `gpt` as
    /// served) is unreadable, as any other: its master is no hit, and the
    /// next request makes it again.
    #[test]
    fn a_sidecar_naming_an_unknown_format_is_no_master() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path()).unwrap();
        let temp = cache.temp_path("m").unwrap();
        std::fs::write(&temp, b"bytes").unwrap();
        let master = cache.commit(&temp, "m", sample()).unwrap();
        for (field, name) in [("source_format", "floppy"), ("disk_format", "gpt")] {
            let mut json = serde_json::to_value(&master.meta).unwrap();
            json[field] = name.into();
            std::fs::write(cache.meta_path("m"), json.to_string()).unwrap();
            assert!(cache.load("m").is_none(), "{field} = {name}");
        }
    }

    #[test]
    fn names_match_ironic() {
        // python3 -c "import uuid; print(uuid.uuid5(uuid.NAMESPACE_URL, 'http://example.com/disk.img'))"
        assert_eq!(
            master_name("http://example.com/disk.img", None, false),
            "ba594cc3-f78b-5c7d-b9b7-b04f6357922e"
        );
        assert_eq!(
            master_name(
                "2c2e2c7e-08a4-4f0a-8f8a-6a8f3c9f3a11",
                Some("2c2e2c7e-08a4-4f0a-8f8a-6a8f3c9f3a11"),
                true
            ),
            "2c2e2c7e-08a4-4f0a-8f8a-6a8f3c9f3a11.converted"
        );
    }
}
