//! The slow lane's side of the broker: a prepare whose download is slow is
//! recorded whole in its node's ledger (`parked`), then acknowledged early
//! so the broker does not take it back; after a crash, the parked
//! deliveries of this host are run again.
//!
//! Knows nothing of routing, adoption or the consumer timeout.

use super::super::ack::Tracked;
use super::super::parked::Parked;
use super::settle::settle;
use super::{Delivered, Dispatcher};
use crate::dispatch::{Job, Shelf};
use crate::messages::inbound::Inbound;
use std::sync::Arc;

impl Dispatcher {
    /// `job`'s download is slow: its delivery is recorded, then
    /// acknowledged early (kept unacknowledged when it could not be
    /// recorded, or when it holds no copy).
    pub(super) async fn slowed(&self, job: &Delivered) {
        if job.tracked.session().is_none() || !self.park(job).await {
            return;
        }
        if let Some((_, acker)) = job.tracked.ack_early(None) {
            tracing::info!("slow download moved to the slow lane: recorded, acknowledged early");
            let _ = settle(acker, false).await;
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
        let pipeline = self.work.pipeline();
        match pipeline
            .order()
            .park_delivery(&Shelf::broker(), &job.identity, parked.to_bytes())
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
        let order = self.work.pipeline().order();
        for (key, bytes) in order.adopt_parked(&Shelf::broker()).await {
            let Some((parked, body)) = Parked::from_bytes(&bytes) else {
                tracing::warn!(key, "an unreadable parked delivery: dropped");
                order.unpark_delivery(&Shelf::broker(), &key).await;
                continue;
            };
            let (inbound, source) = self.read(&body, &parked.exchange);
            let Inbound::Work(mut request) = inbound else {
                order.unpark_delivery(&Shelf::broker(), &key).await;
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
