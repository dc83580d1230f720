//! One node's FIFO queue of jobs: where `submit` puts them and where the
//! node's task (or, when the worker stops, the one giving them back) takes
//! them, with a count of the cleanups and `deployed` waiting in it, so that
//! a prepare waiting for a download slot lets them by.

use super::Job;
use crate::messages::Action;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// A node's queue: its sending side, and its jobs as they are taken.
pub(super) struct NodeQueue {
    tx: mpsc::UnboundedSender<Job>,
    pub(super) fifo: Arc<Fifo>,
}

/// The taking side of a node's queue.
pub(super) struct Fifo {
    rx: Mutex<mpsc::UnboundedReceiver<Job>>,
    /// Cleanups and `deployed` queued, not yet taken.
    releases: AtomicUsize,
}

/// Whether a job releases its node (a cleanup or `deployed`).
fn releases(job: &Job) -> bool {
    matches!(job.request.action, Action::Cleanup | Action::Deployed)
}

impl NodeQueue {
    /// A new queue holding `job`.
    pub(super) fn with(job: Job) -> NodeQueue {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = NodeQueue {
            tx,
            fifo: Arc::new(Fifo {
                rx: Mutex::new(rx),
                releases: AtomicUsize::new(0),
            }),
        };
        let _ = queue.put(job);
        queue
    }

    /// Puts `job` at the tail; gives it back when the queue's task ended.
    pub(super) fn put(&self, job: Job) -> Result<(), Box<Job>> {
        let counted = releases(&job);
        if counted {
            self.fifo.releases.fetch_add(1, Ordering::AcqRel);
        }
        self.tx.send(job).map_err(|mpsc::error::SendError(job)| {
            if counted {
                self.fifo.releases.fetch_sub(1, Ordering::AcqRel);
            }
            Box::new(job)
        })
    }
}

impl Fifo {
    /// The next job, if one waits.
    pub(super) fn next(&self) -> Option<Job> {
        let job = self.lock().try_recv().ok()?;
        if releases(&job) {
            self.releases.fetch_sub(1, Ordering::AcqRel);
        }
        Some(job)
    }

    /// Whether no job waits.
    pub(super) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Whether a cleanup or `deployed` waits in the queue.
    pub(super) fn release_waits(&self) -> bool {
        self.releases.load(Ordering::Acquire) > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, mpsc::UnboundedReceiver<Job>> {
        self.rx.lock().unwrap_or_else(|p| p.into_inner())
    }
}
