//! Named locks that hold within the process (tokio mutexes, so waiting tasks
//! do not block threads) and across processes sharing the directories
//! (`flock` on a lock file, released by the kernel if the holder crashes).
//!
//! A lock file stays while what it guards exists (a master, a node's files)
//! and this process keeps it open between uses, so taking a free lock is one
//! `flock` and one `statx`: no file is created, opened or removed per use.
//! The holder whose work removed what the lock guards removes the file too
//! ([`LockGuard::remove_file`]). That is safe because a file is removed only
//! by a holder of its lock, and only while the path still names the locked
//! file, and a taker checks after locking that the path still names the
//! file it locked (else it locked a removed file and opens the path again).

use crate::error::{Error, ErrorCode, Result};
use crate::fsutil;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::OwnedMutexGuard;

/// Idle names whose lock file this process keeps open, per family; beyond
/// that the idle ones are closed (their files stay).
const KEEP_OPEN: usize = 64;

/// A family of named locks backed by files in one directory.
pub struct Locks {
    dir: PathBuf,
    local: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Slot>>>>,
}

/// The lock file this process has open for one name, between uses.
#[derive(Default)]
struct Slot {
    open: Option<Opened>,
}

/// An open lock file and the identity of its inode.
struct Opened {
    file: File,
    dev: u64,
    ino: u64,
}

impl Opened {
    /// True while `path` still names this file.
    fn named_by(&self, path: &Path) -> bool {
        fsutil::path_names(path, self.dev, self.ino)
    }
}

/// Holds a named lock until dropped.
pub struct LockGuard {
    slot: OwnedMutexGuard<Slot>,
    path: PathBuf,
    remove: bool,
}

impl LockGuard {
    /// Removes the lock file when the lock is let go: what it guards is gone
    /// (the master was evicted, the node's files were removed).
    pub fn remove_file(&mut self) {
        self.remove = true;
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(opened) = self.slot.open.take() else {
            return;
        };
        if self.remove {
            // Still holding the flock here: nobody else can be between
            // locking and checking this inode, and later takers see it gone
            // and open the path again. Closing the file lets go.
            if opened.named_by(&self.path) {
                let _ = std::fs::remove_file(&self.path);
            }
        } else if opened.file.unlock().is_ok() {
            self.slot.open = Some(opened);
        }
    }
}

impl Locks {
    /// Lock files live in `dir` (created 0755).
    pub fn new(dir: PathBuf) -> Result<Locks> {
        fsutil::ensure_dir(&dir)?;
        Ok(Locks {
            dir,
            local: Mutex::new(HashMap::new()),
        })
    }

    fn local(&self, key: &str) -> Arc<tokio::sync::Mutex<Slot>> {
        let mut map = self.local.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() > KEEP_OPEN && !map.contains_key(key) {
            map.retain(|_, m| Arc::strong_count(m) > 1);
        }
        map.entry(key.to_string()).or_default().clone()
    }

    /// The names that have a lock file.
    pub fn names(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".lock"))
                    .filter(|n| !n.starts_with('.'))
                    .map(str::to_string)
            })
            .collect()
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.lock"))
    }

    /// Opens (creating) the lock file; the directory is recreated if it was
    /// deleted.
    fn open(&self, path: &Path) -> std::io::Result<Opened> {
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(path)
        };
        let file = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fsutil::ensure_dir(&self.dir).map_err(|e| std::io::Error::other(e.to_string()))?;
                open()
            }
            other => other,
        }?;
        let meta = file.metadata()?;
        Ok(Opened {
            file,
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// The file to lock: the one kept open, or the path opened now.
    fn opened(&self, slot: &mut Slot, path: &Path) -> std::io::Result<Opened> {
        match slot.open.take() {
            Some(opened) => Ok(opened),
            None => self.open(path),
        }
    }

    /// Takes the lock named `key` only if nobody holds it now.
    pub fn try_acquire(&self, key: &str) -> Option<LockGuard> {
        let mut slot = self.local(key).try_lock_owned().ok()?;
        let path = self.path(key);
        for _ in 0..8 {
            let opened = self.opened(&mut slot, &path).ok()?;
            if opened.file.try_lock().is_err() {
                slot.open = Some(opened);
                return None;
            }
            if opened.named_by(&path) {
                slot.open = Some(opened);
                return Some(LockGuard {
                    slot,
                    path,
                    remove: false,
                });
            }
        }
        None
    }

    /// Waits for the lock named `key` (a file-name-safe string).
    pub async fn acquire(&self, key: &str) -> Result<LockGuard> {
        let mut slot = self.local(key).lock_owned().await;
        let path = self.path(key);
        loop {
            let opened = self
                .opened(&mut slot, &path)
                .map_err(|e| Error::io(format!("open lock {key}"), e))?;
            // Free (the usual case): taken here, without a trip to a
            // blocking thread. Only the wait for another process's lock
            // blocks a thread.
            let opened = match opened.file.try_lock() {
                Ok(()) => opened,
                Err(std::fs::TryLockError::WouldBlock) => {
                    tokio::task::spawn_blocking(move || opened.file.lock().map(|()| opened))
                        .await
                        .map_err(|e| Error::new(ErrorCode::Internal, format!("lock task: {e}")))?
                        .map_err(|e| Error::io(format!("lock {key}"), e))?
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::io(format!("lock {key}"), e));
                }
            };
            // A file removed by its last holder is closed (letting go of
            // its lock) and the path opened again.
            if opened.named_by(&path) {
                slot.open = Some(opened);
                return Ok(LockGuard {
                    slot,
                    path,
                    remove: false,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lock_files_stay_until_removed_and_locks_still_exclude() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Locks::new(dir.path().join("l")).unwrap();
        let other = Locks::new(dir.path().join("l")).unwrap();
        let file = dir.path().join("l/a.lock");
        let held = locks.acquire("a").await.unwrap();
        assert!(file.exists());
        assert!(other.try_acquire("a").is_none(), "second family excluded");
        drop(held);
        assert!(file.exists(), "lock file kept while unused");
        let mut again = other.try_acquire("a").expect("free again");
        assert!(locks.try_acquire("a").is_none(), "kept file still locks");
        again.remove_file();
        drop(again);
        assert!(!file.exists(), "lock file removed by its holder");
        // The first family still has the removed file open: it must notice
        // and lock the new file that the path names now.
        let first = locks.acquire("a").await.unwrap();
        assert!(file.exists());
        assert!(other.try_acquire("a").is_none(), "excluded on the new file");
        drop(first);
        assert!(other.try_acquire("a").is_some());
    }

    #[tokio::test]
    async fn idle_files_kept_open_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Locks::new(dir.path().join("l")).unwrap();
        for i in 0..(KEEP_OPEN * 3) {
            drop(locks.acquire(&format!("n{i}")).await.unwrap());
        }
        let kept = locks.local.lock().unwrap().len();
        assert!(kept <= KEEP_OPEN + 1, "{kept} names kept open");
    }
}
