//! When the backlog of a new connection is taken in: the consumer's
//! intake, counted so that a prepare waits until the deliveries the queue
//! held before it are dispatched (a node's later move recorded).
//!
//! Knows nothing of what a delivery asks, nor of acknowledgements.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long the consumer must have handed in no delivery for the
/// dispatcher to count as caught up (see [`Intake::caught_up`]).
const QUIET: Duration = Duration::from_millis(50);

/// The longest the backlog of a new connection is waited for (a steady
/// stream of deliveries is never quiet).
const CATCH_UP_AT_MOST: Duration = Duration::from_secs(2);

/// The consumer's intake: the deliveries being dispatched, so that a
/// prepare can wait until a new connection's backlog is taken in
/// ([`Intake::caught_up`]).
pub(super) struct Intake {
    counts: Mutex<Counts>,
}

/// The intake's state, under one lock.
struct Counts {
    /// Deliveries being dispatched now.
    dispatching: usize,
    /// When the last one was dispatched.
    last: Instant,
    /// Since when the current connection's backlog is being taken in;
    /// `None` once it was (the intake was quiet, or the wait timed out).
    backlog_since: Option<Instant>,
}

impl Counts {
    /// At `now`: `None` once the backlog is taken in (and from then on),
    /// else how long the intake has been quiet so far.
    fn backlog_quiet(&mut self, now: Instant) -> Option<Duration> {
        let since = self.backlog_since?;
        let quiet = match self.dispatching {
            0 => now.saturating_duration_since(self.last),
            _ => Duration::ZERO,
        };
        if quiet >= QUIET || now.saturating_duration_since(since) >= CATCH_UP_AT_MOST {
            self.backlog_since = None;
            return None;
        }
        Some(quiet)
    }
}

impl Intake {
    /// The intake of a process that just started: its first connection's
    /// backlog is to be taken in.
    pub(super) fn new() -> Intake {
        Intake {
            counts: Mutex::new(Counts {
                dispatching: 0,
                last: Instant::now(),
                backlog_since: Some(Instant::now()),
            }),
        }
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new connection began: its backlog is to be taken in.
    pub(super) fn backlog_begins(&self) {
        let mut counts = self.counts();
        (counts.backlog_since, counts.last) = (Some(Instant::now()), Instant::now());
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
            let Some(quiet) = self.counts().backlog_quiet(Instant::now()) else {
                return;
            };
            tokio::time::sleep(QUIET - quiet).await;
        }
    }

    /// Counts a delivery as being dispatched until the guard is dropped.
    pub(super) fn taking_in(&self) -> impl Drop + '_ {
        struct TakingIn<'a>(&'a Intake);
        impl Drop for TakingIn<'_> {
            fn drop(&mut self) {
                let mut counts = self.0.counts();
                counts.dispatching = counts.dispatching.saturating_sub(1);
                counts.last = Instant::now();
            }
        }
        self.counts().dispatching += 1;
        TakingIn(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(dispatching: usize, last_ago: Duration, since_ago: Duration) -> (Counts, Instant) {
        let now = Instant::now() + CATCH_UP_AT_MOST * 2;
        let counts = Counts {
            dispatching,
            last: now - last_ago,
            backlog_since: Some(now - since_ago),
        };
        (counts, now)
    }

    #[test]
    fn the_backlog_is_in_once_the_intake_was_quiet_long_enough() {
        let short = Duration::from_millis(10);
        let (mut c, now) = counts(0, short, short);
        assert_eq!(c.backlog_quiet(now), Some(short));
        let (mut c, now) = counts(0, QUIET, QUIET);
        assert_eq!(c.backlog_quiet(now), None);
        // Taken in once, it stays taken in, whatever comes after.
        c.dispatching = 3;
        assert_eq!(c.backlog_quiet(now), None);
    }

    #[test]
    fn a_delivery_being_dispatched_is_not_quiet_until_the_wait_times_out() {
        let (mut c, now) = counts(1, QUIET * 10, CATCH_UP_AT_MOST / 2);
        assert_eq!(c.backlog_quiet(now), Some(Duration::ZERO));
        let (mut c, now) = counts(1, Duration::ZERO, CATCH_UP_AT_MOST);
        assert_eq!(c.backlog_quiet(now), None);
    }

    #[test]
    fn a_delivery_counts_as_dispatched_while_its_guard_lives() {
        let intake = Intake::new();
        let guard = intake.taking_in();
        assert_eq!(intake.counts().dispatching, 1);
        drop(guard);
        assert_eq!(intake.counts().dispatching, 0);
        assert!(intake.counts().backlog_since.is_some());
    }
}
