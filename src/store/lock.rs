//! Named locks that hold within the process (tokio mutexes, so waiting tasks
//! do not block threads) and across processes sharing the directories
//! (`flock` on a lock file, released by the kernel if the holder crashes).
//!
//! A lock file is removed when its holder lets go (unless another task of
//! this process is queued for the same name: it takes the same file next), so
//! lock files do not pile up (one per image and node ever seen). That is safe because the holder
//! removes it only while holding it and only while the path still names the
//! locked file, and a taker checks after locking that the path still names
//! the file it locked (else it locked a removed file and tries again).

use crate::error::{Error, ErrorCode, Result};
use crate::store::fsutil;
use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::OwnedMutexGuard;

/// A family of named locks backed by files in one directory.
pub struct Locks {
    dir: PathBuf,
    local: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Holds a named lock until dropped; dropping it removes the lock file.
pub struct LockGuard {
    file: File,
    path: PathBuf,
    _local: OwnedMutexGuard<()>,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // Tasks of this process queued for the same name take the lock next
        // and would only create the file again: leave it to the last one
        // (the map holds one reference, this guard another, each waiter one).
        if Arc::strong_count(OwnedMutexGuard::mutex(&self._local)) > 2 {
            return;
        }
        // Still holding the flock here: nobody else can be between locking
        // and checking this inode, and later takers see it gone and retry.
        if fsutil::names_inode(&self.path, &self.file) {
            let _ = std::fs::remove_file(&self.path);
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

    fn local(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.local.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() > 1024 {
            map.retain(|_, m| Arc::strong_count(m) > 1);
        }
        map.entry(key.to_string()).or_default().clone()
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.lock"))
    }

    /// Opens (creating) the lock file; the directory is recreated if it was
    /// deleted.
    fn open(&self, key: &str) -> std::io::Result<File> {
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(self.path(key))
        };
        match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fsutil::ensure_dir(&self.dir).map_err(|e| std::io::Error::other(e.to_string()))?;
                open()
            }
            other => other,
        }
    }

    /// Takes the lock named `key` only if nobody holds it now.
    pub fn try_acquire(&self, key: &str) -> Option<LockGuard> {
        let local = self.local(key).try_lock_owned().ok()?;
        let path = self.path(key);
        for _ in 0..8 {
            let file = self.open(key).ok()?;
            file.try_lock().ok()?;
            if fsutil::names_inode(&path, &file) {
                return Some(LockGuard {
                    file,
                    path,
                    _local: local,
                });
            }
        }
        None
    }

    /// Waits for the lock named `key` (a file-name-safe string).
    pub async fn acquire(&self, key: &str) -> Result<LockGuard> {
        let local = self.local(key).lock_owned().await;
        let path = self.path(key);
        loop {
            let file = self
                .open(key)
                .map_err(|e| Error::io(format!("open lock {key}"), e))?;
            // Free (the usual case): taken here, without a trip to a
            // blocking thread. Only the wait for another process's lock
            // blocks a thread.
            match file.try_lock() {
                Ok(()) => {
                    if fsutil::names_inode(&path, &file) {
                        return Ok(LockGuard {
                            file,
                            path,
                            _local: local,
                        });
                    }
                    continue;
                }
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::io(format!("lock {key}"), e));
                }
            }
            let check = path.clone();
            let (file, current) = tokio::task::spawn_blocking(move || {
                file.lock().map(|()| {
                    let current = fsutil::names_inode(&check, &file);
                    (file, current)
                })
            })
            .await
            .map_err(|e| Error::new(ErrorCode::Internal, format!("lock task: {e}")))?
            .map_err(|e| Error::io(format!("lock {key}"), e))?;
            if current {
                return Ok(LockGuard {
                    file,
                    path,
                    _local: local,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lock_files_go_away_and_locks_still_exclude() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Locks::new(dir.path().join("l")).unwrap();
        let other = Locks::new(dir.path().join("l")).unwrap();
        let held = locks.acquire("a").await.unwrap();
        assert!(dir.path().join("l/a.lock").exists());
        assert!(other.try_acquire("a").is_none(), "second family excluded");
        drop(held);
        assert!(!dir.path().join("l/a.lock").exists(), "lock file removed");
        let again = other.try_acquire("a").expect("free again");
        assert!(locks.try_acquire("a").is_none());
        drop(again);
        assert_eq!(std::fs::read_dir(dir.path().join("l")).unwrap().count(), 0);
    }
}
