//! The slow lane's side of the broker: a prepare whose download is slow,
//! or a download job that waits (for a download slot, for a master another
//! job makes), is recorded whole in the ledger (`parked`), then
//! acknowledged early so its delivery slot serves other work and the
//! broker does not take it back; after a crash, the parked deliveries of
//! this host are run again.
//!
//! Knows nothing of routing, adoption or the consumer timeout.

use super::super::ack::Tracked;
use super::super::parked::Parked;
use super::settle::settle;
use super::{Delivered, Dispatcher};
use crate::dispatch::{Job, Shelf};
use crate::messages::inbound::Inbound;
use std::sync::Arc;

/// The most jobs acknowledged before their answer at once: past it, a
/// download job that waits keeps its delivery (and is deferred, as before
/// there was a ledger to keep it in), so one process never takes in a
/// whole backlog that other processes of the host could share.
const SET_ASIDE_AT_MOST: usize = 1024;

impl Dispatcher {
    /// `job`'s download is slow: its delivery is recorded, then
    /// acknowledged early (kept unacknowledged when it could not be
    /// recorded, or when it holds no copy).
    pub(super) async fn slowed(&self, job: &Delivered) {
        if self.set_aside(job).await {
            tracing::info!("slow download moved to the slow lane: recorded, acknowledged early");
        }
    }

    /// `job` waits (for a download slot, for a master another job makes):
    /// its delivery is recorded, then acknowledged early, so that waiting
    /// jobs never fill the prefetch. True when it holds no delivery now;
    /// false when it could not be recorded or [`SET_ASIDE_AT_MOST`] jobs
    /// are set aside already.
    pub(super) async fn hold(&self, job: &Delivered) -> bool {
        if job.tracked.session().is_none() {
            return true;
        }
        if self.pending.accepted_unanswered() >= SET_ASIDE_AT_MOST {
            return false;
        }
        let set_aside = self.set_aside(job).await;
        if set_aside {
            tracing::info!(
                "waiting: recorded, acknowledged early (its delivery slot serves others)"
            );
        }
        set_aside
    }

    /// Records `job`'s delivery, then acknowledges it early; true when
    /// done (false: it could not be recorded, or it holds no copy).
    async fn set_aside(&self, job: &Delivered) -> bool {
        if job.tracked.session().is_none() || !self.park(job).await {
            return false;
        }
        match job.tracked.ack_early(None) {
            Some((_, acker)) => {
                let _ = settle(acker, false).await;
                true
            }
            None => false,
        }
    }

    /// Records the whole delivery of `job` before it is acknowledged early;
    /// false when it could not be (it is then kept unacknowledged).
    async fn park(&self, job: &Delivered) -> bool {
        let parked = Parked {
            exchange: job.exchange.clone(),
            routing_key: job.routing_key.clone(),
            body: hex::encode(&job.body),
            reply_to: job.reply_to.clone(),
            correlation_id: job.correlation_id.clone(),
            deadline: job.deadline,
            issued_ms: job.issued_ms,
            received_ms: job.received_ms,
        };
        match (self.work)
            .park(&Shelf::broker(), &job.identity, parked.to_bytes())
            .await
        {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "could not record a slow prepare: kept unacknowledged");
                false
            }
        }
    }

    /// Runs again the deliveries that processes of this host (gone now)
    /// acknowledged before answering them (see `parked`): each as a
    /// redelivered copy, so the ledger's claims and answers apply.
    pub(in crate::broker) async fn resume_parked(self: &Arc<Self>) {
        for (key, bytes) in self.work.adopt_parked(&Shelf::broker()).await {
            let Some((parked, body)) = Parked::from_bytes(&bytes) else {
                tracing::warn!(key, "an unreadable parked delivery: dropped");
                self.work.unpark(&Shelf::broker(), &key).await;
                continue;
            };
            let (inbound, source) = self.reader.read(&body, &parked.exchange);
            let Inbound::Work(mut request) = inbound else {
                self.work.unpark(&Shelf::broker(), &key).await;
                continue;
            };
            request.issued_ms.get_or_insert(parked.issued_ms);
            let span = request.span();
            let job = Delivered {
                dispatcher: self.clone(),
                source,
                reply_to: parked.reply_to,
                correlation_id: parked.correlation_id,
                identity: key,
                legacy_identity: None,
                exchange: parked.exchange,
                routing_key: parked.routing_key,
                issued_ms: parked.issued_ms,
                resumed: true,
                tracked: Arc::new(Tracked::accepted(span.clone())),
                deadline: parked.deadline,
                body,
                properties: lapin::BasicProperties::default(),
                redelivered: true,
                received_ms: parked.received_ms,
                // Checked when it was received; never deferred again.
                sealed_until: None,
                seal_key: 0,
            };
            span.in_scope(|| {
                tracing::info!(
                    "acknowledged early by a process that is gone, never answered: run again"
                );
            });
            self.work.submit(Job {
                request: *request,
                carrier: Box::new(job),
            });
        }
    }
}
