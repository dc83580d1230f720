//! A redelivered copy (its first copy's connection died) of a job still
//! known here: adopted by that job instead of being run again, or settled
//! at once when the job was answered or acknowledged early.
//!
//! Knows nothing of what a delivery asks, of the ledger, nor of answers.

use super::super::ack::Adoption;
use super::early_ack::ConsumerTimeout;
use super::pending::Pending;
use super::settle::settle;
use crate::messages::IgnoreReason;
use crate::metrics::Metrics;
use lapin::Acker;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::task::TaskTracker;

/// Where a redelivered copy goes: to the job of its identity, which holds
/// it from then on (its early acknowledgement armed again), or settled at
/// once when that job was answered or acknowledged early. Holds the jobs
/// awaiting acknowledgement, the consumer timeout in force, the metrics
/// the copy is counted in and the tracker its settling runs under.
pub(super) struct Adopter {
    pending: Arc<Pending<Acker>>,
    consumer_timeout: Arc<ConsumerTimeout>,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
}

impl Adopter {
    /// Adoption among `pending`, a copy adopted acknowledged early as
    /// `consumer_timeout` says; counted in `metrics`, settled under
    /// `tracker`.
    pub(super) fn new(
        pending: Arc<Pending<Acker>>,
        consumer_timeout: Arc<ConsumerTimeout>,
        metrics: Arc<Metrics>,
        tracker: TaskTracker,
    ) -> Adopter {
        Adopter {
            pending,
            consumer_timeout,
            metrics,
            tracker,
        }
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
        let Some((tracked, adoption)) = self.pending.offer(session, identity, acker) else {
            return false;
        };
        self.metrics.ignored(IgnoreReason::RedeliveredInProgress);
        let _in_request = tracked.span.enter();
        if let Adoption::SettleNow(acker) = adoption {
            tracing::info!("a redelivered copy of work already answered or accepted: settled");
            let dead_letter = tracked.dead_letter;
            self.tracker.spawn(async move {
                let _ = settle(acker, dead_letter).await;
            });
        } else {
            tracing::info!("a redelivered copy of work still running here: adopted");
            self.consumer_timeout.arm(&tracked, session, received);
        }
        true
    }
}
