//! The jobs awaiting acknowledgement, by delivery identity: remembered
//! when routed, forgotten once settled, answered ones kept for a while;
//! what a redelivered copy of one of them becomes (adopted by it, or
//! settled at once when it was answered or acknowledged early), decided
//! with plain values so that it can be tested without a broker.
//!
//! Knows nothing of AMQP, of what a delivery asks, of the ledger, nor of
//! answers.

use super::super::ack::{Adoption, Tracked};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long a job answered but not acknowledged (its connection died) is
/// remembered, so that its redelivered copy is acknowledged silently.
pub(super) const ANSWERED_MEMORY: Duration = Duration::from_secs(600);

/// The jobs awaiting acknowledgement, by delivery identity
/// (`identity::key`), each holding its copy's acker `A`; answered ones are
/// kept for a while, so that a redelivered copy of one is settled, not run.
pub(super) struct Pending<A> {
    jobs: Mutex<HashMap<String, Vec<Arc<Tracked<A>>>>>,
    /// How long an answered job is remembered ([`ANSWERED_MEMORY`]).
    memory: Duration,
}

impl<A: Clone> Pending<A> {
    /// None yet; answered jobs remembered for `memory`.
    pub(super) fn new(memory: Duration) -> Pending<A> {
        Pending {
            jobs: Mutex::default(),
            memory,
        }
    }

    fn jobs(&self) -> MutexGuard<'_, HashMap<String, Vec<Arc<Tracked<A>>>>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Jobs acknowledged early and not answered yet (lost if the process
    /// stops before they end: the broker holds no copy of them).
    pub(super) fn accepted_unanswered(&self) -> usize {
        self.jobs()
            .values()
            .flatten()
            .filter(|t| t.accepted_unanswered())
            .count()
    }

    /// Registers a job as awaiting acknowledgement, forgetting answered
    /// ones older than the memory.
    pub(super) fn remember(&self, identity: &str, tracked: Arc<Tracked<A>>) {
        let mut jobs = self.jobs();
        jobs.retain(|_, same| {
            same.retain(|t| t.answered_at().is_none_or(|at| at.elapsed() < self.memory));
            !same.is_empty()
        });
        jobs.entry(identity.to_string()).or_default().push(tracked);
    }

    /// Offers a redelivered copy of connection `session`: the job of its
    /// identity from an earlier connection takes it (or, answered already
    /// or acknowledged early, says to settle it now, and an answered job
    /// is forgotten). `None`: no job takes it.
    pub(super) fn offer(
        &self,
        session: u64,
        identity: &str,
        acker: &A,
    ) -> Option<(Arc<Tracked<A>>, Adoption<A>)> {
        let mut jobs = self.jobs();
        let same = jobs.get_mut(identity)?;
        let (i, adoption) =
            same.iter()
                .enumerate()
                .find_map(|(i, t)| match t.adopt(session, acker.clone()) {
                    Adoption::NotStale(_) => None,
                    adoption => Some((i, adoption)),
                })?;
        let tracked = same[i].clone();
        if tracked.answered() {
            same.remove(i);
        }
        Some((tracked, adoption))
    }

    /// Drops a settled job.
    pub(super) fn forget(&self, identity: &str, tracked: &Arc<Tracked<A>>) {
        let mut jobs = self.jobs();
        if let Some(same) = jobs.get_mut(identity) {
            same.retain(|t| !Arc::ptr_eq(t, tracked));
            if same.is_empty() {
                jobs.remove(identity);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(session: u64, acker: &'static str) -> Arc<Tracked<&'static str>> {
        Arc::new(Tracked::new(session, acker, false, tracing::Span::none()))
    }

    #[test]
    fn a_redelivered_copy_is_adopted_by_the_job_of_its_identity() {
        let pending = Pending::new(ANSWERED_MEMORY);
        let first = job(1, "first");
        pending.remember("k", first.clone());
        assert!(pending.offer(2, "other", &"x").is_none());
        let (by, adoption) = pending.offer(2, "k", &"second").unwrap();
        assert!(Arc::ptr_eq(&by, &first));
        assert!(matches!(adoption, Adoption::Adopted));
        assert_eq!(first.session(), Some(2));
        // A copy of the connection the job holds a copy of is not stale.
        assert!(pending.offer(2, "k", &"third").is_none());
    }

    #[test]
    fn a_copy_of_an_answered_job_is_settled_now_and_the_job_forgotten() {
        let pending = Pending::new(ANSWERED_MEMORY);
        let first = job(1, "first");
        pending.remember("k", first.clone());
        assert!(matches!(first.finish(), Ok((1, "first"))));
        let (_, adoption) = pending.offer(2, "k", &"second").unwrap();
        assert!(matches!(adoption, Adoption::SettleNow("second")));
        assert!(pending.offer(3, "k", &"third").is_none());
    }

    #[test]
    fn a_copy_of_a_job_acknowledged_early_is_settled_and_the_job_kept() {
        let pending = Pending::new(ANSWERED_MEMORY);
        let first = job(1, "first");
        pending.remember("k", first.clone());
        assert!(first.ack_early(None).is_some());
        assert_eq!(pending.accepted_unanswered(), 1);
        for session in [2, 3] {
            let (_, adoption) = pending.offer(session, "k", &"copy").unwrap();
            assert!(matches!(adoption, Adoption::SettleNow("copy")));
        }
        assert!(first.finish().is_err());
        assert_eq!(pending.accepted_unanswered(), 0);
    }

    #[test]
    fn answered_jobs_are_forgotten_past_the_memory_and_settled_ones_at_once() {
        let pending = Pending::new(Duration::ZERO);
        let answered = job(1, "a");
        pending.remember("answered", answered.clone());
        let _ = answered.finish();
        let settled = job(1, "b");
        pending.remember("settled", settled.clone());
        let running = job(1, "c");
        pending.remember("settled", running.clone());
        pending.forget("settled", &settled);
        // The next job remembered prunes the answered one.
        pending.remember("next", job(1, "d"));
        assert!(pending.offer(2, "answered", &"x").is_none());
        let (by, _) = pending.offer(2, "settled", &"y").unwrap();
        assert!(Arc::ptr_eq(&by, &running));
    }
}
