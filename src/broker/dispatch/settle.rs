//! The end of a job: its answer published through the live connection,
//! then the copy it holds acknowledged, or rejected when the message was
//! unusable (dead-lettered); how any copy is settled.
//!
//! Knows nothing of routing, adoption or the early acknowledgement: it
//! settles the copy a job holds when it ends.

use super::super::ack::Tracked;
use super::super::publisher::PublishError;
use super::{Delivered, Dispatcher};
use crate::dispatch::Shelf;
use crate::messages::Completion;
use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicRejectOptions};
use std::sync::Arc;
use std::time::Duration;

/// How often a completion the broker refuses is published again on one
/// route (its `reply_to`, then the events exchange) before the next.
const REFUSALS: u32 = 3;

/// Settles a copy: acknowledged, or rejected without requeueing when it is
/// to be dead-lettered; the error chain when the broker did not take it.
/// The one place a copy is settled, whatever settles it.
pub(super) async fn settle(acker: Acker, dead_letter: bool) -> Result<(), String> {
    if dead_letter {
        acker.reject(BasicRejectOptions { requeue: false }).await
    } else {
        acker.ack(BasicAckOptions::default()).await
    }
    .map(|_| ())
    .map_err(|e| crate::error::error_chain(&e))
}

impl Dispatcher {
    /// Publishes `done` through the live connection, waiting for one and
    /// trying again on the next if the connection fails. False only when
    /// the worker stops first (the copy is then redelivered after a
    /// restart).
    ///
    /// A refusal of the message itself (a nack: the `reply_to` queue a
    /// command named is full with `reject-publish`, or has lost its
    /// majority) says nothing of the connection, and renewing it would
    /// only loop: it is tried [`REFUSALS`] times a second apart, then the
    /// answer goes to the events exchange instead, tried as often; a
    /// completion refused there too is logged and given up, so that one
    /// message chosen by anyone on the broker cannot hold a delivery slot,
    /// nor the connection, for ever.
    pub(super) async fn answer(&self, done: &Completion, job: &Delivered) -> bool {
        let correlation_id = job.correlation_id.as_deref();
        let mut reply_to = job.reply_to.as_deref();
        let mut refused = 0;
        let mut links = self.link.subscribe();
        loop {
            let link = match links.wait_for(|l| l.is_some()).await {
                Ok(l) => l.clone(),
                Err(_) => return false,
            };
            let Some(link) = link else { continue };
            let sealed_with = job.seal_key;
            match (link.publisher)
                .publish(done, reply_to, correlation_id, sealed_with)
                .await
            {
                Ok(()) => return true,
                Err(PublishError::Refused(e)) => {
                    refused += 1;
                    if refused < REFUSALS {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    let Some(queue) = reply_to.take() else {
                        tracing::error!(error = %e, "the broker refused a completion {REFUSALS} times, to the events exchange too: given up");
                        return true;
                    };
                    tracing::warn!(error = %e, reply_to = queue, "the broker refused a completion to its reply_to {REFUSALS} times: published to the events exchange instead");
                    refused = 0;
                }
                Err(PublishError::Failed(e)) => {
                    tracing::warn!(error = %e, "could not publish a completion; reconnecting");
                    link.broken.notify_one();
                    self.disconnected(link.session);
                }
            }
        }
    }

    /// After the answer: acknowledge or dead-letter the copy held now. If
    /// that copy's connection is gone, the job stays known as answered, so
    /// its redelivered copy is acknowledged without a second answer.
    pub(super) async fn finish(&self, identity: &str, tracked: &Arc<Tracked<Acker>>) {
        if let Some(delay) = test_ack_delay() {
            tokio::time::sleep(delay).await;
        }
        let settled = match tracked.finish() {
            Err(acked_early) => {
                if acked_early {
                    self.work
                        .pipeline()
                        .order()
                        .unpark_delivery(&Shelf::broker(), identity)
                        .await;
                }
                acked_early
            }
            Ok((session, acker)) => match settle(acker, tracked.dead_letter).await {
                Ok(()) => true,
                Err(e) => {
                    let link = self.link.borrow().clone();
                    if let Some(link) = link.filter(|l| l.session == session) {
                        tracing::warn!(error = %e, "could not settle a delivery; reconnecting");
                        link.broken.notify_one();
                    }
                    false
                }
            },
        };
        if settled {
            self.forget(identity, tracked);
        }
    }
}

impl Delivered {
    /// An unusable message: its error event, then a dead-letter.
    pub(super) async fn dead_letter(&self, done: &Completion) {
        let d = &self.dispatcher;
        tracing::warn!(source = self.source, error = ?done.error, "dead-lettering an unusable message");
        d.work.metrics().record(done);
        d.work
            .metrics()
            .consumed(self.source, done.action.as_str(), "invalid");
        if d.answer(done, self).await {
            d.finish(&self.identity, &self.tracked).await;
        }
    }
}

/// Test-only: `IRONIC_IMAGE_WORKER_TEST_ACK_DELAY_MS` delays every
/// acknowledgement after an answer by that long, so a test can kill a
/// worker between its answer and its ack (docs/architecture.md, Tests).
fn test_ack_delay() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("IRONIC_IMAGE_WORKER_TEST_ACK_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    })
}
