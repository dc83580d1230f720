//! When the backlog of a new connection is taken in: the consumer's
//! intake, counted so that a prepare waits until the deliveries the queue
//! held before it are dispatched (a node's later move recorded).
//!
//! Knows nothing of what a delivery asks, nor of acknowledgements.

use super::Dispatcher;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long the consumer must have handed in no delivery for the
/// dispatcher to count as caught up (see [`Dispatcher::caught_up`]).
const QUIET: Duration = Duration::from_millis(50);

/// The longest the backlog of a new connection is waited for (a steady
/// stream of deliveries is never quiet).
const CATCH_UP_AT_MOST: Duration = Duration::from_secs(2);

/// The consumer's intake, for [`Dispatcher::caught_up`].
pub(super) struct Intake {
    /// Deliveries being dispatched now.
    dispatching: usize,
    /// When the last one was dispatched.
    last: Instant,
    /// Since when the current connection's backlog is being taken in;
    /// `None` once it was (the intake was quiet, or the wait timed out).
    backlog_since: Option<Instant>,
}

impl Intake {
    /// The intake of a process that just started: its first connection's
    /// backlog is to be taken in.
    pub(super) fn new() -> Intake {
        Intake {
            dispatching: 0,
            last: Instant::now(),
            backlog_since: Some(Instant::now()),
        }
    }
}

impl Dispatcher {
    /// A new connection began: its backlog is to be taken in.
    pub(super) fn backlog_begins(&self) {
        let mut intake = self.lock_intake();
        (intake.backlog_since, intake.last) = (Some(Instant::now()), Instant::now());
    }

    /// Resolves once what the queue held when the connection began is
    /// taken in: the consumer has handed in nothing for [`QUIET`] and
    /// every delivery it handed in is dispatched (a node's move recorded),
    /// or [`CATCH_UP_AT_MOST`] after the connection began. Why: after a
    /// restart, a node's `deploying` notification and its later `deploy
    /// failed` wait in the queue together; the broker sends both at once,
    /// and a prepare that found its image cached would otherwise link
    /// before the later message is read. A prepare waits for this before
    /// it starts; once the backlog is in, deliveries are dispatched in
    /// order as they come and a prepare waits for nothing (a steady stream
    /// of cache hits is never quiet).
    pub(super) async fn caught_up(&self) {
        loop {
            let quiet = {
                let mut intake = self.lock_intake();
                let Some(since) = intake.backlog_since else {
                    return;
                };
                let quiet = match intake.dispatching {
                    0 => intake.last.elapsed(),
                    _ => Duration::ZERO,
                };
                if quiet >= QUIET || since.elapsed() >= CATCH_UP_AT_MOST {
                    intake.backlog_since = None;
                    return;
                }
                quiet
            };
            tokio::time::sleep(QUIET - quiet).await;
        }
    }

    fn lock_intake(&self) -> std::sync::MutexGuard<'_, Intake> {
        self.intake.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a delivery as being dispatched until the guard is dropped.
    pub(super) fn taking_in(&self) -> impl Drop + '_ {
        struct TakingIn<'a>(&'a Mutex<Intake>);
        impl Drop for TakingIn<'_> {
            fn drop(&mut self) {
                let mut intake = self.0.lock().unwrap_or_else(|p| p.into_inner());
                intake.dispatching = intake.dispatching.saturating_sub(1);
                intake.last = Instant::now();
            }
        }
        self.lock_intake().dispatching += 1;
        TakingIn(&self.intake)
    }
}
