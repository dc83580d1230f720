//! Masters still being written, which the peer listener streams to the
//! other workers as they grow: the worker holding the cloud-wide claim on a
//! download publishes the file its master will be (a qcow2's raw output,
//! converted while it downloads) with the master's final size, and the
//! outcome once it is known. The listener sends a follower the bytes as
//! they land and the last of them only once the master is committed, so a
//! body that ends complete stands for a committed master; a failed or
//! abandoned one cuts the transfer. The follower still checks every byte
//! against the digests the holder records at its commit.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Where a master being written stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveState {
    /// Bytes are still landing.
    Writing,
    /// Verified and committed as the master.
    Committed,
    /// Given up: its bytes will never be a master.
    Failed,
}

/// One master being written, as the listener follows it.
#[derive(Debug, Clone)]
pub struct LiveView {
    /// This publication's number in the process (a retried download's
    /// output is another publication).
    pub id: u64,
    /// The file its bytes land in (a temporary in the master directory).
    pub path: PathBuf,
    /// Its size once complete.
    pub size: u64,
    /// Its state, updated as it changes.
    pub state: watch::Receiver<LiveState>,
}

/// The masters this process is writing, by name.
#[derive(Debug, Default)]
pub struct LiveMasters {
    writing: Mutex<HashMap<String, LiveView>>,
}

/// A published master being written: [`LiveGuard::committed`] once it is
/// the master; dropped before that, it counts as failed. Either way it is
/// no longer offered.
#[must_use]
pub struct LiveGuard {
    masters: Arc<LiveMasters>,
    name: String,
    id: u64,
    state: watch::Sender<LiveState>,
}

impl LiveMasters {
    /// Offers `path`, to become master `name` of `size` bytes, to the
    /// listener until the guard is settled (a later publication of the same
    /// name replaces it).
    pub fn publish(self: &Arc<Self>, name: &str, path: PathBuf, size: u64) -> LiveGuard {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (state, watching) = watch::channel(LiveState::Writing);
        let view = LiveView {
            id,
            path,
            size,
            state: watching,
        };
        self.lock().insert(name.to_string(), view);
        LiveGuard {
            masters: self.clone(),
            name: name.to_string(),
            id,
            state,
        }
    }

    /// Master `name`, when it is being written here.
    pub fn get(&self, name: &str) -> Option<LiveView> {
        self.lock().get(name).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, LiveView>> {
        self.writing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl LiveGuard {
    /// The bytes are the committed master now.
    pub fn committed(self) {
        self.state.send_replace(LiveState::Committed);
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.state.send_if_modified(|s| {
            let failed = *s == LiveState::Writing;
            if failed {
                *s = LiveState::Failed;
            }
            failed
        });
        let mut writing = self.masters.lock();
        if writing.get(&self.name).is_some_and(|e| e.id == self.id) {
            writing.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guard_dropped_unsettled_fails_and_unpublishes() {
        let masters = Arc::new(LiveMasters::default());
        let guard = masters.publish("m", "/x".into(), 10);
        let view = masters.get("m").unwrap();
        assert_eq!(*view.state.borrow(), LiveState::Writing);
        drop(guard);
        assert_eq!(*view.state.borrow(), LiveState::Failed);
        assert!(masters.get("m").is_none());
    }

    #[test]
    fn a_committed_guard_says_so_and_a_replaced_one_leaves_its_successor() {
        let masters = Arc::new(LiveMasters::default());
        let first = masters.publish("m", "/a".into(), 10);
        let old = masters.get("m").unwrap();
        let second = masters.publish("m", "/b".into(), 10);
        drop(first);
        assert_eq!(*old.state.borrow(), LiveState::Failed);
        let new = masters.get("m").unwrap();
        assert_eq!(new.path, PathBuf::from("/b"));
        second.committed();
        assert_eq!(*new.state.borrow(), LiveState::Committed);
        assert!(masters.get("m").is_none());
    }
}
