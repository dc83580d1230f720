//! The master image cache: one verified file per image variant, named as
//! Ironic names it, with a sidecar recording the checksums of exactly its
//! bytes so that a cache hit never reads the image again.

use crate::error::{Error, ErrorCode, Result};
use crate::fsutil;
use crate::lock::{LockGuard, Locks};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Suffix of the sidecar file next to each master.
pub const META_SUFFIX: &str = ".meta.json";
/// Suffix Ironic gives a master that went through the raw-conversion logic.
pub const CONVERTED_SUFFIX: &str = ".converted";

/// What the sidecar records about a master.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterMeta {
    /// The `image_source` the master was made from.
    pub source: String,
    /// Unix time (s) at which the download started: the source must not be
    /// newer than this for the master to be fresh.
    pub fetched_at: u64,
    /// Source `Last-Modified` / mtime (unix s), when known.
    pub source_last_modified: Option<u64>,
    /// Size of the source bytes.
    pub source_size: u64,
    /// MD5 of the source bytes.
    pub source_md5: String,
    /// SHA-256 of the source bytes.
    pub source_sha256: String,
    /// SHA-512 of the source bytes, when it was asked for.
    pub source_sha512: Option<String>,
    /// Format detected in the source bytes.
    pub source_format: String,
    /// Whether the master is a conversion of the source.
    pub converted: bool,
    /// `disk_format` of the master's bytes as announced to the agent.
    pub disk_format: String,
    /// Size of the master's bytes.
    pub size: u64,
    /// MD5 of the master's bytes.
    pub md5: String,
    /// SHA-256 of the master's bytes.
    pub sha256: String,
    /// SHA-512 of the master's bytes, when it was asked for.
    pub sha512: Option<String>,
    /// Inode of the master the sidecar describes: a replaced master never
    /// inherits an older sidecar.
    pub inode: u64,
}

/// A master that passed validation, with its path.
#[derive(Debug, Clone)]
pub struct Master {
    /// Path of the master file.
    pub path: PathBuf,
    /// Its sidecar.
    pub meta: MasterMeta,
}

/// The master cache directory and its locks.
pub struct Cache {
    dir: PathBuf,
    locks: Locks,
}

/// The master file name Ironic uses: the Glance image id, or
/// `uuid5(NAMESPACE_URL, href)`, plus `.converted` when force_raw applies.
pub fn master_name(href: &str, force_raw: bool) -> String {
    let base = glance_id(href).unwrap_or_else(|| {
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, href.as_bytes()).to_string()
    });
    if force_raw {
        base + CONVERTED_SUFFIX
    } else {
        base
    }
}

/// The image id when `href` names a Glance image (`<uuid>` or `glance://<uuid>`).
pub fn glance_id(href: &str) -> Option<String> {
    let id = href.strip_prefix("glance://").unwrap_or(href);
    uuid::Uuid::try_parse(id)
        .ok()
        .filter(|_| id.len() == 36)
        .map(|u| u.to_string())
}

/// Unix seconds of `t`.
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Cache {
    /// Opens (creating) the cache directory.
    pub fn open(dir: &Path) -> Result<Cache> {
        fsutil::ensure_dir(dir)?;
        Ok(Cache {
            dir: dir.to_path_buf(),
            locks: Locks::new(dir.join(".locks"))?,
        })
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the master called `name`.
    pub fn master_path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Path of the sidecar of master `name`.
    pub fn meta_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}{META_SUFFIX}"))
    }

    /// A fresh temporary path in the cache directory for building `name`.
    pub fn temp_path(&self, name: &str) -> PathBuf {
        fsutil::temp_path(&self.master_path(name))
    }

    /// Serialises all work on the master `name`, in this process and others.
    pub async fn lock(&self, name: &str) -> Result<LockGuard> {
        self.locks.acquire(name).await
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
        let text = std::fs::read(self.meta_path(name)).ok()?;
        let meta: MasterMeta = serde_json::from_slice(&text).ok()?;
        (stat.is_file() && meta.inode == stat.ino() && meta.size == stat.len())
            .then_some(Master { path, meta })
    }

    /// Moves the finished file `temp` into place as master `name` and writes
    /// its sidecar. The master is renamed first: a crash in between leaves a
    /// master without a valid sidecar, which is never a hit.
    pub fn commit(&self, temp: &Path, name: &str, mut meta: MasterMeta) -> Result<Master> {
        let path = self.master_path(name);
        let stat = std::fs::metadata(temp).map_err(|e| Error::io("stat new master", e))?;
        meta.inode = stat.ino();
        std::fs::rename(temp, &path)
            .map_err(|e| Error::io(format!("rename into {}", path.display()), e))?;
        let meta_path = self.meta_path(name);
        let meta_temp = fsutil::temp_path(&meta_path);
        let body = serde_json::to_vec_pretty(&meta)
            .map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        let write = || -> std::io::Result<()> {
            let file = std::fs::File::create(&meta_temp)?;
            std::io::Write::write_all(&mut &file, &body)?;
            file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
            file.sync_all()?;
            std::fs::rename(&meta_temp, &meta_path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&meta_temp);
            Error::io("write cache sidecar", e)
        })?;
        Ok(Master { path, meta })
    }

    /// Removes temporaries left by a crashed run (call before serving).
    pub fn remove_stale_temps(&self) -> Result<usize> {
        fsutil::remove_temps_in(&self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_ironic() {
        // python3 -c "import uuid; print(uuid.uuid5(uuid.NAMESPACE_URL, 'http://example.com/disk.img'))"
        assert_eq!(
            master_name("http://example.com/disk.img", false),
            "ba594cc3-f78b-5c7d-b9b7-b04f6357922e"
        );
        assert_eq!(
            master_name("2c2e2c7e-08a4-4f0a-8f8a-6a8f3c9f3a11", true),
            "2c2e2c7e-08a4-4f0a-8f8a-6a8f3c9f3a11.converted"
        );
    }
}
