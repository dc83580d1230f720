//! One job, from its turn in its node's queue to its answer: the checks
//! before any work (answered already, past its deadline), a prepare slot,
//! the pipeline, the answer and its record.

use super::{AnswerKey, Carrier, Deferral, DeliveryKey, Dispatch, Job};
use crate::error::{Error, ErrorCode};
use crate::messages::{Action, Completion, IgnoreReason, Request, SlowSignal};
use crate::node::NodeUuid;
use crate::pipeline::Turn;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tracing::Instrument;

/// How long a cleanup or `deployed` failing on a transient file-system
/// error (read-only, I/O error, full) is retried before it is answered with
/// the error.
const RELEASE_RETRY_FOR: Duration = Duration::from_secs(600);

/// How long a prepare waits for a free prepare slot before its transport
/// is asked to take it back (so that other actions get the delivery slots).
const DEFER_AFTER: Duration = Duration::from_secs(2);

/// How often a copy of work another process runs looks for its answer.
const CLAIM_POLL: Duration = Duration::from_millis(500);

/// Milliseconds since the Unix epoch, now.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Dispatch {
    /// Runs a job to its end: answered before (by a process of this host,
    /// or here on either transport), or waits for a prepare slot (or is
    /// taken back), is refused past its deadline, runs, is answered and
    /// recorded.
    pub(super) async fn work(&self, job: Job) {
        let span = job.request.span();
        self.work_in_span(job).instrument(span).await
    }

    /// [`Dispatch::work`], inside the request's span.
    async fn work_in_span(&self, job: Job) {
        let Job {
            mut request,
            carrier,
        } = job;
        let carrier = &*carrier;
        let key = AnswerKey::of(&request);
        let delivery = carrier.delivery_key();
        // The node whose ledger records the delivery (none for a warm).
        let node = request.node.clone();
        if let (Some(d), Some(node)) = (delivery.as_ref().filter(|d| d.redelivered), &node)
            && self.answered_before(node, d).await
        {
            tracing::info!("a redelivered copy of work answered by a process of this host");
            self.answers.end(key.as_ref(), None);
            return self
                .unanswered(carrier, IgnoreReason::AnsweredElsewhere)
                .await;
        }
        let transport = carrier.transport();
        if let Some(done) = key.as_ref().and_then(|k| self.answers.done(k, transport)) {
            tracing::info!(
                node = %request.node_str(),
                action = request.action.as_str(),
                "a request answered already (on either transport): the same answer, no work"
            );
            self.answers.end(key.as_ref(), None);
            self.metrics
                .consumed(carrier.source(), done.action.as_str(), done.status.as_str());
            return self.deliver(&done, carrier, node.as_ref(), delivery).await;
        }
        let claimed = delivery
            .as_ref()
            .filter(|_| request.action != Action::Warm)
            .zip(node.as_ref());
        if let Some((d, node)) = claimed
            && !self.take_turn(node, d).await
        {
            tracing::info!("a copy of work answered by another process of this host");
            self.answers.end(key.as_ref(), None);
            return self
                .unanswered(carrier, IgnoreReason::AnsweredElsewhere)
                .await;
        }
        let Some(done) = self.outcome(&mut request, carrier).await else {
            if let Some((d, node)) = claimed {
                self.pipeline.order().release_delivery(node, &d.key).await;
            }
            self.answers.end(key.as_ref(), None);
            return;
        };
        self.answers.end(key.as_ref(), Some((&done, transport)));
        self.metrics
            .consumed(carrier.source(), done.action.as_str(), done.status.as_str());
        self.deliver(&done, carrier, node.as_ref(), delivery).await
    }

    /// The answer to `request`, or `None` when the job ended without one
    /// (taken back by its transport, a stray cleanup).
    async fn outcome(&self, request: &mut Request, carrier: &dyn Carrier) -> Option<Completion> {
        let deadline = carrier.deadline();
        let expired = || deadline.is_some_and(|at| now_ms() >= at);
        // A warm downloads like a prepare: it shares the prepare slots.
        let slot = if matches!(request.action, Action::Prepare | Action::Warm) {
            match self.prepare_slot(DEFER_AFTER).await {
                Some(slot) => Some(slot),
                None if expired() => None,
                None => match carrier.defer().await {
                    Deferral::TakenBack => return None,
                    Deferral::Wait => self.slot_until(deadline).await,
                },
            }
        } else {
            None
        };
        if expired() {
            drop(slot);
            let done = expired_answer(request, &self.host);
            self.metrics.record(&done);
            return Some(done);
        }
        // The node's later messages already at hand count first: a prepare
        // issued before its node moved on is then refused (`stale_request`).
        if request.action == Action::Prepare {
            carrier.caught_up().await;
        }
        // A stray cleanup (node not prepared here) is decided under the
        // node lock, inside the pipeline.
        let slow = slot.as_ref().map(|_| {
            let (signal, slow) = SlowSignal::new();
            request.slow = signal;
            slow
        });
        let done = self.run(request, carrier, slot, slow).await;
        if done.is_none() {
            self.unanswered(carrier, IgnoreReason::NotPreparedHere)
                .await;
        }
        done
    }

    /// Gives the answer through the carrier, then records it in the node's
    /// ledger under the delivery's key and lets the carrier settle.
    async fn deliver(
        &self,
        done: &Completion,
        carrier: &dyn Carrier,
        node: Option<&NodeUuid>,
        delivery: Option<DeliveryKey>,
    ) {
        if carrier.answer(done).await {
            if let (Some(d), Some(node)) = (delivery, node) {
                self.pipeline.order().note_answered(node, &d.key).await;
            }
            carrier.finish().await;
        }
    }

    /// Claims the delivery `d` of `node` for this process (in the node's
    /// ledger, shared by the processes of the host) before its work starts.
    /// While another live process works on it (the broker gave this process
    /// a copy after that one's connection dropped), waits for its answer.
    /// False: answered by another process, nothing to do.
    async fn take_turn(&self, node: &NodeUuid, d: &DeliveryKey) -> bool {
        let mut waited = false;
        loop {
            let answered_counts = d.redelivered || waited;
            match self
                .pipeline
                .order()
                .claim_delivery(node, &d.key, answered_counts)
                .await
            {
                Turn::Mine => return true,
                Turn::Answered => return false,
                Turn::Elsewhere => {
                    if !waited {
                        tracing::info!(
                            "another process of this host works on this delivery: waiting for its answer"
                        );
                    }
                    waited = true;
                    tokio::time::sleep(CLAIM_POLL).await;
                }
            }
        }
    }

    /// Whether the delivery `d` of `node` was answered already by a process
    /// of this host, under its key or the key an earlier version gave it.
    async fn answered_before(&self, node: &NodeUuid, d: &DeliveryKey) -> bool {
        let keys = std::iter::once(&d.key).chain(d.legacy.as_ref());
        for key in keys {
            if self.pipeline.order().answered_before(node, key).await {
                return true;
            }
        }
        false
    }

    /// A prepare slot, waiting up to `wait` for one.
    async fn prepare_slot(&self, wait: Duration) -> Option<OwnedSemaphorePermit> {
        let slots = self.prepare_slots.clone();
        tokio::time::timeout(wait, slots.acquire_owned())
            .await
            .ok()
            .and_then(|p| p.ok())
    }

    /// A prepare slot, waiting for one until `deadline` (ms since the
    /// epoch; forever without one); `None` when the deadline passed first.
    async fn slot_until(&self, deadline: Option<u64>) -> Option<OwnedSemaphorePermit> {
        let Some(at) = deadline else {
            return self.prepare_slots.clone().acquire_owned().await.ok();
        };
        let wait = Duration::from_millis(at.saturating_sub(now_ms()));
        self.prepare_slot(wait).await
    }

    /// Runs the work of a request, holding `slot` (a prepare's) while it
    /// runs. Beside it, a prepare whose download is slow (`slow` notified)
    /// moves to the slow lane when it has room: it gives back its prepare
    /// slot and its carrier is told (the broker acknowledges it early), so
    /// that neither prepare slots nor the prefetch fill with slow sources.
    async fn run(
        &self,
        request: &Request,
        carrier: &dyn Carrier,
        slot: Option<OwnedSemaphorePermit>,
        slow: Option<Arc<Notify>>,
    ) -> Option<Completion> {
        let slowed = async move {
            let Some(slow) = slow else {
                return std::future::pending().await;
            };
            slow.notified().await;
            let _held = match self.slow_lane.clone().try_acquire_owned() {
                Ok(lane) => {
                    drop(slot);
                    self.metrics.slow_lane.inc();
                    carrier.slowed().await;
                    Some(lane)
                }
                Err(_) => slot,
            };
            std::future::pending::<()>().await
        };
        tokio::select! {
            done = self.handle_retrying(request) => done,
            () = slowed => None,
        }
    }

    /// The pipeline's answer; a cleanup or `deployed` failing because the
    /// file system is read-only, failing or full is tried again with
    /// backoff for up to [`RELEASE_RETRY_FOR`], so the node is released once
    /// the file system is back instead of being answered and forgotten.
    async fn handle_retrying(&self, request: &Request) -> Option<Completion> {
        let started = Instant::now();
        let mut delay = Duration::from_millis(500);
        loop {
            let done = self.pipeline.handle_unless_stray(request).await?;
            let transient = matches!(request.action, Action::Cleanup | Action::Deployed)
                && done
                    .error
                    .as_ref()
                    .is_some_and(|e| is_transient_io(e.os_error));
            if !transient || started.elapsed() + delay > RELEASE_RETRY_FOR {
                return Some(done);
            }
            tracing::warn!(
                node = %request.node_str(),
                action = request.action.as_str(),
                error = ?done.error,
                retry_in = ?delay,
                "releasing failed on a transient file-system error; retrying"
            );
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(15));
        }
    }
}

/// Whether an I/O failure's OS error is a file-system condition that goes
/// away (read-only file system, I/O error, no space, quota).
fn is_transient_io(os_error: Option<i32>) -> bool {
    os_error.is_some_and(|e| [libc::EROFS, libc::EIO, libc::ENOSPC, libc::EDQUOT].contains(&e))
}

/// The answer to a request whose sender stopped waiting before its work
/// could start.
fn expired_answer(request: &Request, host: &str) -> Completion {
    let err = Error::new(
        ErrorCode::Expired,
        "the command's deadline (its expiration, counted from its first delivery) \
         passed before its work could start",
    );
    tracing::warn!(node = %request.node_str(), action = request.action.as_str(), "refusing a command past its deadline");
    Completion::for_request(request, host).failed(&err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_file_system_errors() {
        let io = |errno| {
            let e = crate::error::Error::io("remove x", std::io::Error::from_raw_os_error(errno));
            e.os_error()
        };
        assert!(is_transient_io(io(libc::EROFS)));
        assert!(is_transient_io(io(libc::EIO)));
        assert!(is_transient_io(io(libc::ENOSPC)));
        assert!(!is_transient_io(io(libc::EACCES)));
        assert!(!is_transient_io(None));
    }
}
