//! The end of a job: its answer published through the live connection,
//! then the copy it holds acknowledged, or rejected when the message was
//! unusable (dead-lettered); how any copy is settled.
//!
//! Knows nothing of routing, adoption or the early acknowledgement: it
//! settles the copy a job holds when it ends.

use super::super::ack::Tracked;
use super::super::publisher::PublishError;
use super::Delivered;
use super::link::Links;
use super::pending::Pending;
use crate::clock::now_ms;
use crate::dispatch::{Dispatch, Shelf};
use crate::messages::Completion;
use backon::BackoffBuilder;
use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicRejectOptions};
use std::sync::Arc;
use std::time::Duration;

/// How long a refused answer is tried again when its command set no
/// deadline (no `expiration`): as long as the deploy interface waits for a
/// prepare by default (`[image_worker]prepare_timeout`). Documented in
/// docs/contract.md ("Completion events").
const ANSWER_PATIENCE: Duration = Duration::from_secs(1800);

/// The first and the longest pause between two publishes of an answer the
/// broker refused: a quorum reply queue refuses for a few seconds while
/// its leader is elected again, so the first retries come quickly; a queue
/// that refuses for longer is asked at most every few seconds, so that one
/// message chosen by anyone on the broker cannot make the worker spin.
const REFUSED_FIRST_PAUSE: Duration = Duration::from_millis(250);
const REFUSED_MAX_PAUSE: Duration = Duration::from_secs(5);

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

/// What follows a refused answer, at `now`, after the `pause` the backoff
/// asks for, when the command can use its answer `until` then (ms since
/// the epoch): tried again while there is time; past it, published once
/// to the events exchange instead of the `reply_to` queue that refused it,
/// or given up when that was done already (or there was none).
fn after_refusal(now: u64, pause: Duration, until: u64, reply_to: Option<&str>) -> Refused<'_> {
    if now + pause.as_millis() as u64 <= until {
        return Refused::Retry;
    }
    match reply_to {
        Some(queue) => Refused::EventsInstead(queue),
        None => Refused::GiveUp,
    }
}

/// What becomes of an answer the broker refused ([`after_refusal`]).
#[derive(Debug, PartialEq)]
enum Refused<'a> {
    /// Published again after the pause.
    Retry,
    /// Given up on its `reply_to` queue: published to the events exchange.
    EventsInstead(&'a str),
    /// Given up: the events exchange refused it too.
    GiveUp,
}

/// Until when a refused answer is tried again: its command's deadline, or
/// [`ANSWER_PATIENCE`] from `now` when it set none.
fn answer_until(deadline: Option<u64>, now: u64) -> u64 {
    deadline.unwrap_or_else(|| now + ANSWER_PATIENCE.as_millis() as u64)
}

/// The end of a job, through the live connection: its answer published,
/// then its copy settled and the job forgotten. Holds the connection in
/// force, the jobs awaiting acknowledgement, and the shared dispatch (its
/// metrics, and the ledger's parked deliveries).
pub(super) struct Settler {
    links: Arc<Links>,
    pending: Arc<Pending<Acker>>,
    work: Arc<Dispatch>,
}

impl Settler {
    /// Answers through `links`, jobs forgotten from `pending`, counted and
    /// unparked in `work`.
    pub(super) fn new(
        links: Arc<Links>,
        pending: Arc<Pending<Acker>>,
        work: Arc<Dispatch>,
    ) -> Settler {
        Settler {
            links,
            pending,
            work,
        }
    }

    /// Publishes `done` through the live connection, waiting for one and
    /// trying again on the next if the connection fails. False only when
    /// the worker stops first (the copy is then redelivered after a
    /// restart).
    ///
    /// A refusal of the message itself (a nack: the `reply_to` queue is
    /// without a leader during a broker node's failover, or full with
    /// `reject-publish`) says nothing of the connection, and renewing it
    /// would only loop: it is tried again with backoff (at most every
    /// [`REFUSED_MAX_PAUSE`]) for as long as the command can use its
    /// answer: until its deadline, or [`ANSWER_PATIENCE`] when it set
    /// none. Only a queue that refuses for that whole window is given up
    /// on: the answer then goes once to the events exchange (for the
    /// record), logged and counted.
    pub(super) async fn answer(&self, done: &Completion, job: &Delivered) -> bool {
        let correlation_id = job.correlation_id.as_deref();
        let mut reply_to = job.reply_to.as_deref();
        let mut until = answer_until(job.deadline, now_ms());
        let mut pauses = crate::retry::jittered(REFUSED_FIRST_PAUSE, REFUSED_MAX_PAUSE, None)
            .build()
            .map(|d| d.min(REFUSED_MAX_PAUSE));
        let mut links = self.links.watch();
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
                    self.work.metrics().amqp.answer_refusals.inc();
                    let pause = pauses.next().unwrap_or(REFUSED_MAX_PAUSE);
                    match after_refusal(now_ms(), pause, until, reply_to) {
                        Refused::Retry => {
                            tracing::info!(error = %e, reply_to, ?pause, "the broker refused a completion; trying again until the command's deadline");
                            tokio::time::sleep(pause).await;
                        }
                        Refused::GiveUp => {
                            tracing::error!(error = %e, "the broker refused a completion until its command's deadline: given up");
                            return true;
                        }
                        Refused::EventsInstead(queue) => {
                            reply_to = None;
                            self.work.metrics().amqp.answers_given_up.inc();
                            tracing::error!(error = %e, reply_to = queue, "the broker refused a completion to its reply_to until its command's deadline: given up there, published to the events exchange instead");
                            until = now_ms();
                        }
                    }
                }
                Err(PublishError::Failed(e)) => {
                    tracing::warn!(error = %e, "could not publish a completion; reconnecting");
                    link.broken.notify_one();
                    self.links.disconnected(link.session);
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
                    self.work.unpark(&Shelf::broker(), identity).await;
                }
                acked_early
            }
            Ok((session, acker)) => match settle(acker, tracked.dead_letter).await {
                Ok(()) => true,
                Err(e) => {
                    let link = self.links.current();
                    if let Some(link) = link.filter(|l| l.session == session) {
                        tracing::warn!(error = %e, "could not settle a delivery; reconnecting");
                        link.broken.notify_one();
                    }
                    false
                }
            },
        };
        if settled {
            self.pending.forget(identity, tracked);
        }
    }

    /// An unusable message: its error event, then a dead-letter.
    pub(super) async fn dead_letter(&self, job: &Delivered, done: &Completion) {
        tracing::warn!(source = job.source, error = ?done.error, "dead-lettering an unusable message");
        self.work.metrics().record(done);
        self.work
            .metrics()
            .consumed(job.source, done.action.as_str(), "invalid");
        if self.answer(done, job).await {
            self.finish(&job.identity, &job.tracked).await;
        }
    }

    /// Acknowledges a message that needs no answer (a lost acknowledgement
    /// only means the message comes back and is ignored again).
    pub(super) async fn unanswered(&self, job: &Delivered) {
        if let Some((_, acker)) = job.tracked.take_acker() {
            let _ = settle(acker, false).await;
        }
        self.pending.forget(&job.identity, &job.tracked);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_answer_is_tried_again_while_its_command_can_use_it() {
        let pause = Duration::from_millis(250);
        assert_eq!(
            after_refusal(1_000, pause, 1_250, Some("q")),
            Refused::Retry
        );
        assert_eq!(after_refusal(1_000, pause, 1_250, None), Refused::Retry);
        // Past the deadline: once to the events exchange, then given up.
        assert_eq!(
            after_refusal(1_001, pause, 1_250, Some("q")),
            Refused::EventsInstead("q")
        );
        assert_eq!(after_refusal(1_001, pause, 1_250, None), Refused::GiveUp);
    }

    #[test]
    fn without_a_deadline_an_answer_is_tried_again_for_the_patience() {
        assert_eq!(answer_until(Some(5), 1_000), 5);
        let patience = ANSWER_PATIENCE.as_millis() as u64;
        assert_eq!(answer_until(None, 1_000), 1_000 + patience);
    }
}
