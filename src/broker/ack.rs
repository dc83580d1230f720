//! The acknowledgement state of one job, apart from AMQP so that its
//! races can be tested with plain values.
//!
//! A job holds at most one delivery copy to settle (its connection and
//! acker). The copy changes hands: a redelivered copy is adopted when the
//! connection that brought the first one died, the job's end takes it to
//! acknowledge it, an early acknowledgement takes it before the end.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// One job's acknowledgement state; `A` is the acker of a copy.
pub(super) struct Tracked<A> {
    /// The copy to acknowledge when done: its connection and acker.
    acker: Mutex<Option<(u64, A)>>,
    /// The answer was published (confirmed by the broker).
    answered: AtomicBool,
    /// Acknowledged before the answer (long work, consumer timeout).
    acked_early: AtomicBool,
    /// Settled by dead-lettering (an unusable message), not by an ack.
    pub(super) dead_letter: bool,
    /// When the answer went out, for forgetting it.
    answered_at: Mutex<Option<Instant>>,
}

/// What became of a redelivered copy offered to a job.
pub(super) enum Adoption<A> {
    /// The job's own copy is of this connection: the copy is not its.
    NotStale(A),
    /// The job holds the copy now and settles it when done.
    Adopted,
    /// The job was answered or acknowledged early: settle the copy now.
    SettleNow(A),
}

impl<A> Tracked<A> {
    /// A job holding the copy of connection `session`.
    pub(super) fn new(session: u64, acker: A, dead_letter: bool) -> Tracked<A> {
        Tracked {
            acker: Mutex::new(Some((session, acker))),
            answered: AtomicBool::new(false),
            acked_early: AtomicBool::new(false),
            dead_letter,
            answered_at: Mutex::new(None),
        }
    }

    /// Takes the copy to acknowledge, so exactly one path settles it.
    pub(super) fn take_acker(&self) -> Option<(u64, A)> {
        self.acker.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Whether the copy held is not of connection `session` (or none is).
    fn is_stale(&self, session: u64) -> bool {
        self.acker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_none_or(|(s, _)| *s != session)
    }

    /// When the answer went out, if it did.
    pub(super) fn answered_at(&self) -> Option<Instant> {
        *self.answered_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the job was answered.
    pub(super) fn answered(&self) -> bool {
        self.answered.load(Ordering::Acquire)
    }

    /// Offers a redelivered copy of connection `session`. `racer` runs
    /// where another task could slip in (tests).
    pub(super) fn adopt_with(&self, session: u64, acker: A, racer: impl FnOnce()) -> Adoption<A> {
        if !self.is_stale(session) {
            return Adoption::NotStale(acker);
        }
        if self.answered.load(Ordering::Acquire) || self.acked_early.load(Ordering::Acquire) {
            return Adoption::SettleNow(acker);
        }
        racer();
        *self.acker.lock().unwrap_or_else(|p| p.into_inner()) = Some((session, acker));
        Adoption::Adopted
    }

    /// Offers a redelivered copy of connection `session`.
    pub(super) fn adopt(&self, session: u64, acker: A) -> Adoption<A> {
        self.adopt_with(session, acker, || {})
    }

    /// Acknowledged before the end: takes the copy held, if any.
    pub(super) fn ack_early(&self) -> Option<(u64, A)> {
        self.acked_early.store(true, Ordering::Release);
        self.take_acker()
    }

    /// The answer went out: takes the copy to settle. `Err(acked_early)`
    /// when there is none.
    pub(super) fn finish(&self) -> Result<(u64, A), bool> {
        *self.answered_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.answered.store(true, Ordering::Release);
        self.take_acker()
            .ok_or_else(|| self.acked_early.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The job ends (answered, its copy's acknowledgement failing on the
    /// dead connection) just while a redelivered copy is being adopted:
    /// that copy must still be settled, by the adoption or by the end.
    #[test]
    fn a_copy_adopted_while_the_job_ends_is_settled() {
        let job = std::sync::Arc::new(Tracked::new(1, "first", false));
        let mut ended = None;
        let adoption = job.adopt_with(2, "second", || ended = Some(job.finish()));
        let settled_by_adoption = matches!(adoption, Adoption::SettleNow("second"));
        let settled_by_end = matches!(ended, Some(Ok((2, "second"))));
        let still_held = job.take_acker();
        assert!(
            settled_by_adoption || settled_by_end,
            "the redelivered copy is left unacknowledged (still held: {still_held:?})"
        );
        assert!(still_held.is_none());
    }
}
