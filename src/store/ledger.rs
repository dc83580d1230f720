//! The per-node command ledger: a small record per node, on disk, shared by
//! every worker process of the host and kept across restarts.
//!
//! Why it exists: the broker delivers a command again after a crash or a
//! lost acknowledgement, possibly to another process of the same host, and
//! a deferred prepare can come back after a later cleanup of its node. What
//! one process remembers in memory does not help the next one, so two
//! facts about each node are kept here:
//!
//! * when the node last *moved on* (a cleanup, a `deployed`, a notification
//!   of a later provision-state transition), so that a prepare older than
//!   that is refused instead of linking files for a deploy that is over;
//! * which deliveries were answered recently, so that a copy redelivered to
//!   any process is acknowledged without a second answer.
//!
//! `<images_path>/.ledger/<node>.json`, replaced atomically (temporary and
//! rename, synced) under one short `flock` (`.ledger/.lock`, held for one
//! read and one write). Bounded: at most [`MAX_ANSWERED`] answers per node,
//! a record past [`TTL`] is ignored and removed by [`Ledger::expire`], a file
//! larger than [`MAX_RECORD_BYTES`] is not read. It outlives the node's
//! files on purpose: a cleanup of a node with nothing to remove is exactly
//! what must be remembered.

use crate::error::{Error, Result};
use crate::fsutil;
use crate::node::NodeUuid;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a record is kept after its newest entry.
pub const TTL: Duration = Duration::from_secs(24 * 3600);

/// Answers remembered per node (the newest ones).
pub const MAX_ANSWERED: usize = 64;

/// Longest key of an answered delivery that is recorded.
const MAX_KEY_LEN: usize = 64;

/// A record file larger than this is not read (it cannot be one of ours).
pub const MAX_RECORD_BYTES: u64 = 16 << 10;

/// Temporaries left by a writer that died are removed after this long.
const STALE_TEMP_AFTER: Duration = Duration::from_secs(3600);

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What is known of one node.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// When the node last moved on (ms since the epoch; 0: never).
    #[serde(default)]
    pub moved_ms: u64,
    /// Deliveries answered, oldest first: their key and when.
    #[serde(default)]
    pub answered: Vec<(String, u64)>,
}

impl Record {
    /// The newest time the record mentions.
    fn newest(&self) -> u64 {
        self.answered
            .iter()
            .map(|(_, at)| *at)
            .fold(self.moved_ms, u64::max)
    }

    /// Drops what is past [`TTL`] at `now` and answers beyond the bound.
    fn trim(&mut self, now: u64) {
        let ttl = TTL.as_millis() as u64;
        let alive = |at: u64| at.saturating_add(ttl) >= now;
        if !alive(self.moved_ms) {
            self.moved_ms = 0;
        }
        self.answered.retain(|(_, at)| alive(*at));
        let excess = self.answered.len().saturating_sub(MAX_ANSWERED);
        self.answered.drain(..excess);
    }
}

/// The ledger directory of one host.
#[derive(Debug, Clone)]
pub struct Ledger {
    dir: PathBuf,
}

impl Ledger {
    /// The ledger in `dir` (created 0755).
    pub fn open(dir: PathBuf) -> Result<Ledger> {
        fsutil::ensure_dir(&dir)?;
        Ok(Ledger { dir })
    }

    fn path(&self, node: &NodeUuid) -> PathBuf {
        self.dir.join(format!("{node}.json"))
    }

    /// The node's record as it stands (empty when there is none, it is
    /// unreadable or past its TTL). Blocking: one small read.
    pub fn read(&self, node: &NodeUuid) -> Record {
        let mut record = read_record(&self.path(node)).unwrap_or_default();
        record.trim(now_ms());
        record
    }

    /// The node moved on at `at_ms` (kept if later than what is recorded).
    pub fn note_moved(&self, node: &NodeUuid, at_ms: u64) -> Result<()> {
        self.update(node, |r| r.moved_ms = r.moved_ms.max(at_ms))
    }

    /// The delivery `key` of `node` was answered at `at_ms`.
    pub fn note_answered(&self, node: &NodeUuid, key: &str, at_ms: u64) -> Result<()> {
        if key.len() > MAX_KEY_LEN {
            return Ok(());
        }
        self.update(node, |r| {
            r.answered.retain(|(k, _)| k != key);
            r.answered.push((key.to_string(), at_ms));
        })
    }

    /// Reads, changes and writes back the node's record under the ledger
    /// lock, so no update of another process is lost.
    fn update(&self, node: &NodeUuid, change: impl FnOnce(&mut Record)) -> Result<()> {
        let _lock = self.lock()?;
        let path = self.path(node);
        let mut record = read_record(&path).unwrap_or_default();
        change(&mut record);
        record.trim(now_ms());
        let body = serde_json::to_vec(&record).unwrap_or_default();
        fsutil::write_file_atomically(&path, &fsutil::temp_path(&path), &body, 0o644)
    }

    /// Holds the ledger's `flock` until dropped: a new open file each time,
    /// so it excludes other threads of this process as well.
    fn lock(&self) -> Result<File> {
        let path = self.dir.join(".lock");
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        };
        let file = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fsutil::ensure_dir(&self.dir)?;
                open()
            }
            other => other,
        }
        .map_err(|e| Error::io("open the ledger lock", e))?;
        file.lock().map_err(|e| Error::io("lock the ledger", e))?;
        Ok(file)
    }

    /// Removes records past their TTL and temporaries of writers that died;
    /// returns how many files went. Blocking.
    pub fn expire(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let Ok(_lock) = self.lock() else {
            return 0;
        };
        let now = now_ms();
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let gone = if name.starts_with(fsutil::TEMP_PREFIX) {
                is_older_than(&path, STALE_TEMP_AFTER)
            } else if name.ends_with(".json") {
                read_record(&path)
                    .is_none_or(|r| r.newest().saturating_add(TTL.as_millis() as u64) < now)
            } else {
                false
            };
            if gone && std::fs::remove_file(&path).is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

/// A record file's contents; `None` when missing, too large or unreadable.
fn read_record(path: &Path) -> Option<Record> {
    let file = File::open(path).ok()?;
    let mut body = Vec::new();
    file.take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut body)
        .ok()?;
    if body.len() as u64 > MAX_RECORD_BYTES {
        tracing::warn!(path = %path.display(), "ledger record too large: ignored");
        return None;
    }
    match serde_json::from_slice(&body) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "unreadable ledger record: ignored");
            None
        }
    }
}

fn is_older_than(path: &Path, age: Duration) -> bool {
    std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|a| a > age)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeUuid {
        NodeUuid::parse("1be26c0b-03f2-4d2e-ae87-c02d7f33c123").unwrap()
    }

    #[test]
    fn records_moves_and_answers_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path().join("l")).unwrap();
        let other = Ledger::open(dir.path().join("l")).unwrap();
        assert_eq!(ledger.read(&node()), Record::default());
        let now = now_ms();
        ledger.note_moved(&node(), now).unwrap();
        ledger.note_moved(&node(), now - 5).unwrap();
        assert_eq!(other.read(&node()).moved_ms, now, "the latest move is kept");
        for i in 0..(MAX_ANSWERED + 10) {
            other.note_answered(&node(), &format!("k{i}"), now).unwrap();
        }
        let r = ledger.read(&node());
        assert_eq!(r.answered.len(), MAX_ANSWERED);
        assert_eq!(
            r.answered.last().unwrap().0,
            format!("k{}", MAX_ANSWERED + 9)
        );
        assert!(!r.answered.iter().any(|(k, _)| k == "k0"), "oldest dropped");
        let size = std::fs::metadata(ledger.path(&node())).unwrap().len();
        assert!(size < MAX_RECORD_BYTES, "{size}");
        // Nothing else in the directory but the record and the lock.
        let mut names: Vec<_> = std::fs::read_dir(dir.path().join("l"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [".lock".to_string(), format!("{}.json", node())]);
    }

    #[test]
    fn expired_and_foreign_records_are_ignored_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path().join("l")).unwrap();
        let old = now_ms() - TTL.as_millis() as u64 - 1000;
        let record = Record {
            moved_ms: old,
            answered: vec![("k".into(), old)],
        };
        std::fs::write(ledger.path(&node()), serde_json::to_vec(&record).unwrap()).unwrap();
        assert_eq!(ledger.read(&node()), Record::default(), "past the TTL");
        let big = dir
            .path()
            .join("l/0e4c5a8e-03f2-4d2e-ae87-c02d7f33c123.json");
        std::fs::write(&big, vec![b' '; MAX_RECORD_BYTES as usize + 1]).unwrap();
        ledger.note_moved(&node(), now_ms()).unwrap();
        assert_eq!(ledger.expire(), 1, "only the oversized one goes");
        assert!(!big.exists());
        assert!(ledger.path(&node()).exists(), "a live record stays");
    }
}
