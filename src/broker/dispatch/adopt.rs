//! The jobs awaiting acknowledgement, by delivery identity: remembered
//! when routed, forgotten once settled; a redelivered copy of one of them
//! (its first copy's connection died) is adopted by it instead of being
//! run again, or settled at once when it was answered or acknowledged
//! early.
//!
//! Knows nothing of what a delivery asks, of the ledger, nor of answers.

use super::super::ack::{Adoption, Tracked};
use super::settle::settle;
use super::{Delivered, Dispatcher};
use crate::messages::IgnoreReason;
use lapin::Acker;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a job answered but not acknowledged (its connection died) is
/// remembered, so that its redelivered copy is acknowledged silently.
const ANSWERED_MEMORY: Duration = Duration::from_secs(600);

impl Dispatcher {
    /// Jobs acknowledged early and not answered yet (lost if the process
    /// stops before they end: the broker holds no copy of them).
    pub(in crate::broker) fn accepted_unanswered(&self) -> usize {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending
            .values()
            .flatten()
            .filter(|t| t.accepted_unanswered())
            .count()
    }

    /// Registers a job as awaiting acknowledgement, forgetting answered
    /// ones older than [`ANSWERED_MEMORY`].
    pub(super) fn remember(&self, job: &Delivered) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|_, jobs| {
            jobs.retain(|t| {
                t.answered_at()
                    .is_none_or(|at| at.elapsed() < ANSWERED_MEMORY)
            });
            !jobs.is_empty()
        });
        pending
            .entry(job.identity.clone())
            .or_default()
            .push(job.tracked.clone());
    }

    /// A redelivered copy: if a job of an earlier connection has the same
    /// identity, it takes this copy's acker (or, answered already or
    /// acknowledged early, this copy is acknowledged now). True if adopted.
    pub(super) fn adopt(
        &self,
        session: u64,
        identity: &str,
        acker: &Acker,
        received: Instant,
    ) -> bool {
        let (tracked, adoption) = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let Some(jobs) = pending.get_mut(identity) else {
                return false;
            };
            let found =
                jobs.iter()
                    .enumerate()
                    .find_map(|(i, t)| match t.adopt(session, acker.clone()) {
                        Adoption::NotStale(_) => None,
                        adoption => Some((i, adoption)),
                    });
            let Some((i, adoption)) = found else {
                return false;
            };
            let t = jobs[i].clone();
            if t.answered() {
                jobs.remove(i);
            }
            (t, adoption)
        };
        self.work
            .metrics()
            .ignored(IgnoreReason::RedeliveredInProgress);
        let _in_request = tracked.span.enter();
        if let Adoption::SettleNow(acker) = adoption {
            tracing::info!("a redelivered copy of work already answered or accepted: settled");
            let dead_letter = tracked.dead_letter;
            self.work.tracker.spawn(async move {
                let _ = settle(acker, dead_letter).await;
            });
        } else {
            tracing::info!("a redelivered copy of work still running here: adopted");
            self.arm_early_ack(&tracked, session, received);
        }
        true
    }

    /// Drops a settled job from the jobs awaiting acknowledgement.
    pub(super) fn forget(&self, identity: &str, tracked: &Arc<Tracked<Acker>>) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(jobs) = pending.get_mut(identity) {
            jobs.retain(|t| !Arc::ptr_eq(t, tracked));
            if jobs.is_empty() {
                pending.remove(identity);
            }
        }
    }
}
