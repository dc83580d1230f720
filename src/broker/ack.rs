//! The acknowledgement state of one job, apart from AMQP so that its
//! races can be tested with plain values.
//!
//! A job holds at most one delivery copy to settle (its connection and
//! acker). The copy changes hands: a redelivered copy is adopted when the
//! connection that brought the first one died, the job's end takes it to
//! acknowledge it, an early acknowledgement (the copy's consumer-timeout
//! timer, or a slow download) takes it before the end. Every change is made
//! under one lock, so a copy is never installed after the job has ended,
//! and exactly one path settles each copy.

use std::sync::Mutex;
use std::time::Instant;
use tokio::task::AbortHandle;

/// One job's acknowledgement state; `A` is the acker of a copy.
pub(super) struct Tracked<A> {
    state: Mutex<State<A>>,
    /// Settled by dead-lettering (an unusable message), not by an ack.
    pub(super) dead_letter: bool,
    /// The span of the request the job is (node, request id, action): the
    /// lines written about it outside its work (a redelivered copy
    /// adopted, its early acknowledgement, its dead-lettering) are in it.
    pub(super) span: tracing::Span,
}

struct State<A> {
    /// The copy to acknowledge when done: its connection and acker.
    copy: Option<(u64, A)>,
    /// When the answer went out (confirmed by the broker), if it did.
    answered_at: Option<Instant>,
    /// Acknowledged before the answer (consumer timeout, slow download).
    acked_early: bool,
    /// The early-acknowledgement timer of the copy held.
    timer: Option<AbortHandle>,
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
    /// A job holding the copy of connection `session`, of the request of
    /// `span`.
    pub(super) fn new(
        session: u64,
        acker: A,
        dead_letter: bool,
        span: tracing::Span,
    ) -> Tracked<A> {
        Tracked {
            state: Mutex::new(State {
                copy: Some((session, acker)),
                answered_at: None,
                acked_early: false,
                timer: None,
            }),
            dead_letter,
            span,
        }
    }

    /// A job whose delivery was acknowledged already (run again from its
    /// parked record) of the request of `span`: nothing to settle.
    pub(super) fn accepted(span: tracing::Span) -> Tracked<A> {
        Tracked {
            state: Mutex::new(State {
                copy: None,
                answered_at: None,
                acked_early: true,
                timer: None,
            }),
            dead_letter: false,
            span,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<A>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the copy to acknowledge (and stops its timer), so exactly one
    /// path settles it.
    pub(super) fn take_acker(&self) -> Option<(u64, A)> {
        let mut st = self.state();
        if let Some(timer) = st.timer.take() {
            timer.abort();
        }
        st.copy.take()
    }

    /// The connection of the copy held, if one is held.
    pub(super) fn session(&self) -> Option<u64> {
        self.state().copy.as_ref().map(|(s, _)| *s)
    }

    /// When the answer went out, if it did.
    pub(super) fn answered_at(&self) -> Option<Instant> {
        self.state().answered_at
    }

    /// Whether the job was answered.
    pub(super) fn answered(&self) -> bool {
        self.state().answered_at.is_some()
    }

    /// Acknowledged early and not answered yet: the broker holds no copy,
    /// so only this process can still answer it.
    pub(super) fn accepted_unanswered(&self) -> bool {
        let st = self.state();
        st.acked_early && st.answered_at.is_none()
    }

    /// Offers a redelivered copy of connection `session`, deciding and
    /// installing in one critical section. `racer` runs where another task
    /// could slip in: before it (tests).
    pub(super) fn adopt_with(&self, session: u64, acker: A, racer: impl FnOnce()) -> Adoption<A> {
        racer();
        let mut st = self.state();
        if st.copy.as_ref().is_some_and(|(s, _)| *s == session) {
            return Adoption::NotStale(acker);
        }
        if st.answered_at.is_some() || st.acked_early {
            return Adoption::SettleNow(acker);
        }
        if let Some(timer) = st.timer.take() {
            timer.abort();
        }
        st.copy = Some((session, acker));
        Adoption::Adopted
    }

    /// Offers a redelivered copy of connection `session`.
    pub(super) fn adopt(&self, session: u64, acker: A) -> Adoption<A> {
        self.adopt_with(session, acker, || {})
    }

    /// Makes `timer` the early acknowledgement of the copy of `session`;
    /// stopped at once if that copy is no longer held.
    pub(super) fn arm(&self, session: u64, timer: AbortHandle) {
        let mut st = self.state();
        if st.copy.as_ref().is_some_and(|(s, _)| *s == session) {
            if let Some(old) = st.timer.replace(timer) {
                old.abort();
            }
        } else {
            timer.abort();
        }
    }

    /// Acknowledged before the end: takes the copy held (only the copy of
    /// `session`, when given: a timer's own copy). The timer is let go,
    /// not stopped: it may be the caller.
    pub(super) fn ack_early(&self, session: Option<u64>) -> Option<(u64, A)> {
        let mut st = self.state();
        let mine = match (&st.copy, session) {
            (Some((s, _)), Some(want)) => *s == want,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if !mine || st.answered_at.is_some() {
            return None;
        }
        st.acked_early = true;
        st.timer = None;
        st.copy.take()
    }

    /// The answer went out: takes the copy to settle. `Err(acked_early)`
    /// when there is none.
    pub(super) fn finish(&self) -> Result<(u64, A), bool> {
        let mut st = self.state();
        st.answered_at = Some(Instant::now());
        if let Some(timer) = st.timer.take() {
            timer.abort();
        }
        st.copy.take().ok_or(st.acked_early)
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
        let job = std::sync::Arc::new(Tracked::new(1, "first", false, tracing::Span::none()));
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

    /// An early acknowledgement settles the copy once; the end then has
    /// nothing to settle and a later copy is settled at once.
    #[test]
    fn acked_early_is_settled_once() {
        let job = Tracked::new(1, "first", false, tracing::Span::none());
        assert!(job.ack_early(Some(2)).is_none(), "not the timer's copy");
        assert_eq!(job.ack_early(Some(1)), Some((1, "first")));
        assert_eq!(job.ack_early(None), None);
        assert!(matches!(
            job.adopt(2, "second"),
            Adoption::SettleNow("second")
        ));
        assert_eq!(job.finish(), Err(true));
    }
}
