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
use super::Delivered;
use super::link::{Link, Links, gone};
use super::pending::Pending;
use super::read::Reader;
use super::settle::settle;
use crate::dispatch::{Deferral, Dispatch, Shelf};
use crate::messages::IgnoreReason;
use lapin::Acker;
use std::sync::Arc;

/// Puts work back at the tail of this host's queue: a deferred prepare,
/// or work not started when the worker stops. Holds the queue's name, the
/// connection in force, the reader that seals a copy again, the jobs
/// awaiting acknowledgement, and the shared dispatch (its metrics, and the
/// ledger's parked deliveries).
pub(super) struct Requeue {
    /// This host's queue, where the copies go.
    queue: String,
    links: Arc<Links>,
    reader: Arc<Reader>,
    pending: Arc<Pending<Acker>>,
    work: Arc<Dispatch>,
}

impl Requeue {
    /// Copies put back on `queue` through `links`, sealed again by
    /// `reader`; jobs forgotten from `pending`, counted and unparked in
    /// `work`.
    pub(super) fn new(
        queue: String,
        links: Arc<Links>,
        reader: Arc<Reader>,
        pending: Arc<Pending<Acker>>,
        work: Arc<Dispatch>,
    ) -> Requeue {
        Requeue {
            queue,
            links,
            reader,
            pending,
            work,
        }
    }

    /// Every download slot is busy and the prepare could not be set
    /// aside: it goes back to the tail of the queue (a confirmed copy
    /// carrying the command's deadline, then this delivery is
    /// acknowledged), so the delivery slot serves other actions
    /// meanwhile. A copy whose connection is gone comes back by itself, as
    /// new work; if putting it back fails on the live connection, that
    /// connection is renewed and the copy comes back. A job run again from
    /// its parked record has no delivery to put back: it waits.
    pub(super) async fn defer(&self, job: &Delivered) -> Deferral {
        if job.resumed {
            // Its delivery is acknowledged: nothing to put back.
            return Deferral::Wait;
        }
        let link = self.links.current();
        let acker = job.tracked.take_acker();
        // The redelivered copy is new work, not a copy of running work.
        self.pending.forget(&job.identity, &job.tracked);
        let session = acker.as_ref().map(|(s, _)| *s);
        let (Some(link), Some((_, acker))) = (link, acker) else {
            return Deferral::TakenBack;
        };
        if gone(Some(link.session), session) {
            tracing::info!("a prepare to defer came through a connection now gone: it comes back");
            return Deferral::TakenBack;
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
        Deferral::TakenBack
    }

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
        let Some(link) = self.links.current() else {
            return;
        };
        let acker = job.tracked.take_acker();
        self.pending.forget(&job.identity, &job.tracked);
        let session = acker.as_ref().map(|(s, _)| *s);
        if gone(Some(link.session), session) {
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
