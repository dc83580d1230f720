//! A deferred prepare: every prepare slot is busy, so the prepare goes
//! back to the tail of this host's queue, carrying its deadline and issue
//! time (and, with a seal policy, sealed again by this worker for its own
//! queue, valid as long as the original seal), and the delivery slot
//! serves other actions meanwhile.
//!
//! Knows nothing of routing, the ledger, nor of answers.

use super::super::{deadline, stamp};
use super::settle::settle;
use super::{Delivered, Dispatcher};
use crate::messages::IgnoreReason;

impl Dispatcher {
    /// Every prepare slot is busy (long downloads): the prepare goes back
    /// to the tail of the queue (a confirmed copy carrying the command's
    /// deadline, then this delivery is acknowledged), so the delivery slot
    /// serves other actions meanwhile. A copy whose connection is gone
    /// comes back by itself, as new work; if putting it back fails on the
    /// live connection, that connection is renewed and the copy comes back.
    pub(super) async fn defer(&self, job: &Delivered) {
        let link = self.link.borrow().clone();
        let acker = job.tracked.take_acker();
        // The redelivered copy is new work, not a copy of running work.
        self.forget(&job.identity, &job.tracked);
        let (Some(link), Some((session, acker))) = (link, acker) else {
            return;
        };
        if session != link.session {
            tracing::info!("a prepare to defer came through a connection now gone: it comes back");
            return;
        }
        let issued = stamp::with_issue_time(job.properties.clone(), job.received_ms);
        let mut copy = deadline::carried(&issued, job.deadline);
        if let Some(gate) = &self.gate {
            copy = gate.reseal(copy, &job.body, (job.seal_key, job.sealed_until));
        }
        let put_back = match link
            .publisher
            .requeue_copy(&self.queue, &job.body, copy)
            .await
        {
            Ok(()) => settle(acker, false).await,
            Err(e) => Err(e.to_string()),
        };
        match put_back {
            Ok(()) => self.work.metrics().ignored(IgnoreReason::DeferredPrepare),
            Err(e) => {
                tracing::warn!(error = %e, "could not defer a prepare; reconnecting, it will be redelivered");
                link.broken.notify_one();
            }
        }
    }
}
