//! Named locks that hold within the process (tokio mutexes, so waiting tasks
//! do not block threads) and across processes sharing the directories
//! (`flock` on a lock file, released by the kernel if the holder crashes).

use crate::error::{Error, Result};
use crate::fsutil;
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

/// Holds a named lock until dropped.
pub struct LockGuard {
    _file: File,
    _local: OwnedMutexGuard<()>,
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

    fn open(&self, key: &str) -> std::io::Result<File> {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join(format!("{key}.lock")))
    }

    /// Takes the lock named `key` only if nobody holds it now.
    pub fn try_acquire(&self, key: &str) -> Option<LockGuard> {
        let local = self.local(key).try_lock_owned().ok()?;
        let file = self.open(key).ok()?;
        file.try_lock().ok()?;
        Some(LockGuard {
            _file: file,
            _local: local,
        })
    }

    /// Waits for the lock named `key` (a file-name-safe string).
    pub async fn acquire(&self, key: &str) -> Result<LockGuard> {
        let local = self.local(key).lock_owned().await;
        let file = self
            .open(key)
            .map_err(|e| Error::io(format!("open lock {key}"), e))?;
        // Only the wait for another process's lock blocks a thread.
        let file = tokio::task::spawn_blocking(move || file.lock().map(|()| file))
            .await
            .map_err(|e| Error::new(crate::error::ErrorCode::Internal, format!("lock task: {e}")))?
            .map_err(|e| Error::io(format!("lock {key}"), e))?;
        Ok(LockGuard {
            _file: file,
            _local: local,
        })
    }
}
