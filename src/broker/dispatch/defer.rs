//! A deferred prepare: it waits for a download slot and could not be set
//! aside, so it goes back to the tail of this host's queue, carrying its
//! deadline and issue time (and, with a seal policy, sealed again by this
//! worker for its own queue, valid as long as the original seal), and the
//! delivery slot serves other actions meanwhile. Work not started when
//! the worker stops goes back the same way, for another worker.
//!
//! Knows nothing of routing nor of answers; of the ledger, only that a
//! job given back has its parked record dropped.

use super::super::{deadline, stamp};
use super::Link;
use super::settle::settle;
use super::{Delivered, Dispatcher};
use crate::dispatch::Shelf;
use crate::messages::IgnoreReason;

impl Dispatcher {
    /// Every download slot is busy and the prepare could not be set
    /// aside: it goes back to the tail of the queue (a confirmed copy
    /// carrying the command's deadline, then this delivery is
    /// acknowledged), so the delivery slot
    /// serves other actions meanwhile. A copy whose connection is gone
    /// comes back by itself, as new work; if putting it back fails on the
    /// live connection, that connection is renewed and the copy comes back.
    pub(super) async fn defer(&self, job: &Delivered) {
        let link = self.link.borrow().clone();
        let acker = job.tracked.take_acker();
        // The redelivered copy is new work, not a copy of running work.
        self.pending.forget(&job.identity, &job.tracked);
        let (Some(link), Some((session, acker))) = (link, acker) else {
            return;
        };
        if session != link.session {
            tracing::info!("a prepare to defer came through a connection now gone: it comes back");
            return;
        }
        let put_back = match self.put_back(&link, job).await {
            Ok(()) => settle(acker, false).await,
            Err(e) => Err(e),
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

impl Dispatcher {
    /// A copy of `job`'s delivery at the tail of this host's queue,
    /// confirmed, carrying its deadline and issue time (sealed again).
    async fn put_back(&self, link: &Link, job: &Delivered) -> Result<(), String> {
        let issued = stamp::with_issue_time(job.properties.clone(), job.received_ms);
        let copy = deadline::carried(&issued, job.deadline);
        let copy = (self.reader).reseal(copy, &job.body, (job.seal_key, job.sealed_until));
        link.publisher
            .requeue_copy(&self.queue, &job.body, copy)
            .await
            .map_err(|e| e.to_string())
    }

    /// The worker stops before `job` started: a copy goes back to the
    /// queue (as a deferred prepare's), so that another worker takes it,
    /// then the copy it holds is acknowledged, or, acknowledged early, its
    /// parked record is dropped. A copy of a connection now gone comes
    /// back by itself; a job run again from a parked record, or one whose
    /// copy could not be put back, stays parked for the next process of
    /// the host (or, unacknowledged, returns to the queue when the
    /// connection closes).
    pub(super) async fn give_back(&self, job: &Delivered) {
        if job.resumed {
            tracing::info!("not started as the worker stops: parked, for the next process");
            return;
        }
        let link = self.link.borrow().clone();
        let Some(link) = link else {
            return;
        };
        let acker = job.tracked.take_acker();
        self.pending.forget(&job.identity, &job.tracked);
        if acker.as_ref().is_some_and(|(s, _)| *s != link.session) {
            return;
        }
        if let Err(e) = self.put_back(&link, job).await {
            tracing::warn!(error = %e, "could not give back work not started: the broker or the next process has it");
            return;
        }
        match acker {
            Some((_, acker)) => {
                let _ = settle(acker, false).await;
            }
            None => {
                self.work.unpark(&Shelf::broker(), &job.identity).await;
            }
        }
        tracing::info!("not started as the worker stops: given back to the queue");
    }
}
