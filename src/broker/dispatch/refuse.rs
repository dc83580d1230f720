//! A command refused for its seal (`[amqp]seal`): checked before it is
//! parsed, dead-lettered without an answer (an answer would be published
//! to a `reply_to` the sender chose, sealed by this worker) and counted
//! under its reason; never worked.
//!
//! Knows nothing of routing work, the ledger or answers.

use super::super::sealed;
use super::settle::settle;
use crate::metrics::Metrics;
use crate::seal::Refusal;
use lapin::message::Delivery;
use std::sync::Arc;
use tokio_util::task::TaskTracker;

/// Refuses commands whose seal does not hold: holds the metrics they are
/// counted in and the tracker their dead-lettering runs under.
pub(super) struct Refuser {
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
}

impl Refuser {
    /// Refusals counted in `metrics`, dead-lettered under `tracker`.
    pub(super) fn new(metrics: Arc<Metrics>, tracker: TaskTracker) -> Refuser {
        Refuser { metrics, tracker }
    }

    /// Dead-letters `delivery`, refused for `why`, and counts it.
    pub(super) fn refuse(&self, delivery: Delivery, why: Refusal) {
        let reason = sealed::reason(why);
        let correlation_id = delivery.properties.correlation_id().clone();
        tracing::warn!(
            reason = reason.as_str(),
            check = ?why,
            exchange = %delivery.exchange,
            routing_key = %delivery.routing_key,
            correlation_id = correlation_id.as_ref().map_or("", |c| c.as_str()),
            "refused a command whose seal does not hold: dead-lettered, not worked"
        );
        self.metrics.ignored(reason);
        self.metrics.consumed("command", "none", "refused");
        self.tracker.spawn(async move {
            if let Err(e) = settle(delivery.acker, true).await {
                tracing::warn!(error = %e, "could not dead-letter a refused command; it comes back and is refused again");
            }
        });
    }
}
