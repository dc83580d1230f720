//! One job, from its turn in its node's queue to its answer: the checks
//! before any work (the worker stopping, answered already, past its
//! deadline), the pipeline with, beside a download, the slow lane and the
//! watch on its download turn, the answer and its record.

use super::turn::{self, Stand};
use super::{AnswerKey, Carrier, Deferral, DeliveryKey, Dispatch, Job};
use crate::clock::now_ms;
use crate::error::{Error, ErrorCode};
use crate::messages::{Action, Completion, DownloadTurn, IgnoreReason, Request, SlowSignal};
use crate::node::NodeUuid;
use crate::pipeline::Turn;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tracing::Instrument;

/// How long a cleanup or `deployed` failing on a transient file-system
/// error (read-only, I/O error, full) is retried before it is answered with
/// the error.
const RELEASE_RETRY_FOR: Duration = Duration::from_secs(600);

/// How long a download job that is not downloading, nor waiting for a
/// download slot (set aside at once), may hold its transport's delivery
/// before it is set aside (recorded, the delivery acknowledged), so that
/// other work gets the delivery slots; and how long one that could not be
/// set aside waits for a slot before it is taken back.
const HOLD_AFTER: Duration = Duration::from_secs(2);

/// How often a copy of work another process runs looks for its answer.
const CLAIM_POLL: Duration = Duration::from_millis(500);

/// How often a job waiting for a download slot looks for a cleanup or
/// `deployed` of its node queued behind it.
const RELEASE_POLL: Duration = Duration::from_millis(200);

/// How a job's run ended.
enum Ran {
    /// With its answer.
    Answered(Box<Completion>),
    /// A stray cleanup: nothing to answer.
    Stray,
    /// Taken back by its transport, or given back as the worker stops.
    Returned,
    /// Waiting for a download slot, it goes behind its node's cleanup or
    /// `deployed`: to be run again.
    Yielded,
}

impl Dispatch {
    /// Runs a job to its end: given back when the worker stops before it
    /// starts, answered before (by a process of this host, or here on
    /// either transport), refused past its deadline, or run (waiting for a
    /// download slot only to download, set aside or taken back meanwhile),
    /// answered and recorded.
    pub(super) async fn work(self: &Arc<Self>, job: Job) {
        let span = job.request.span();
        self.work_in_span(job).instrument(span).await
    }

    /// [`Dispatch::work`], inside the request's span.
    async fn work_in_span(self: &Arc<Self>, job: Job) {
        let Job {
            mut request,
            carrier: boxed,
        } = job;
        let carrier = &*boxed;
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
        let done = match self.outcome(&mut request, carrier).await {
            Ran::Answered(done) => *done,
            ended => {
                if let Some((d, node)) = claimed {
                    self.pipeline.order().release_delivery(node, &d.key).await;
                }
                if let Ran::Yielded = ended {
                    // Behind its node's cleanup or `deployed` now; queued
                    // again before this run ends, so that it is never seen
                    // as unknown meanwhile (a JSON-RPC call waits on it).
                    self.submit(Job {
                        request,
                        carrier: boxed,
                    });
                }
                self.answers.end(key.as_ref(), None);
                return;
            }
        };
        self.answers.end(key.as_ref(), Some((&done, transport)));
        self.metrics
            .consumed(carrier.source(), done.action.as_str(), done.status.as_str());
        self.deliver(&done, carrier, node.as_ref(), delivery).await
    }

    /// How `request`'s run ended: its answer, or none (a stray cleanup,
    /// taken back by its transport, given back as the worker stops), or
    /// yielded to its node's cleanup or `deployed`.
    async fn outcome(&self, request: &mut Request, carrier: &dyn Carrier) -> Ran {
        if self.stopping.is_cancelled() {
            tracing::info!("the worker stops: not started, given back");
            carrier.give_back().await;
            return Ran::Returned;
        }
        let deadline = carrier.deadline();
        if deadline.is_some_and(|at| now_ms() >= at) {
            let done = expired_answer(request, &self.host);
            self.metrics.record(&done);
            return Ran::Answered(Box::new(done));
        }
        // The node's later messages already at hand count first: a prepare
        // issued before its node moved on is then refused (`stale_request`).
        if request.action == Action::Prepare {
            carrier.caught_up().await;
        }
        // A warm downloads like a prepare: both take a download turn, when
        // they download.
        let download = matches!(request.action, Action::Prepare | Action::Warm).then(|| {
            let turn = turn::Turn::new(self.download_slots.clone(), deadline);
            request.turn = DownloadTurn::new(turn.clone());
            let (signal, slow) = SlowSignal::new();
            request.slow = signal;
            (turn, slow)
        });
        // A stray cleanup (node not prepared here) is decided under the
        // node lock, inside the pipeline.
        let ran = self.run(request, carrier, download).await;
        if let Ran::Stray = ran {
            self.unanswered(carrier, IgnoreReason::NotPreparedHere)
                .await;
        }
        ran
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

    /// Runs the work of a request. Beside a download job's work (`download`:
    /// its turn and its slow signal), the slow lane (`slow_lane`) and the
    /// watch on its turn (`watch`), which may end the job here.
    async fn run(
        &self,
        request: &Request,
        carrier: &dyn Carrier,
        download: Option<(Arc<turn::Turn>, Arc<Notify>)>,
    ) -> Ran {
        let ran =
            |done: Option<Completion>| done.map_or(Ran::Stray, |d| Ran::Answered(Box::new(d)));
        let Some((turn, slow)) = download else {
            return ran(self.handle_retrying(request).await);
        };
        let fifo = super::order_key(request);
        tokio::select! {
            done = self.handle_retrying(request) => ran(done),
            () = self.slow_lane(carrier, &turn, slow) => Ran::Returned,
            ended = self.watch(carrier, &turn, &fifo) => ended,
        }
    }

    /// A download that turns out slow (`slow` notified) moves to the slow
    /// lane when it has room: it gives back its download slot and its
    /// carrier is told (the broker acknowledges it early), so that neither
    /// download slots nor the prefetch fill with slow sources. Never ends.
    async fn slow_lane(&self, carrier: &dyn Carrier, turn: &turn::Turn, slow: Arc<Notify>) {
        slow.notified().await;
        let _lane = match self.slow_lane.clone().try_acquire_owned() {
            Ok(lane) => {
                turn.to_slow_lane();
                self.metrics.slow_lane.inc();
                carrier.slowed().await;
                Some(lane)
            }
            Err(_) => None,
        };
        std::future::pending::<()>().await
    }

    /// Watches a download job's turn. A job waiting for a download slot,
    /// or one not downloading [`HOLD_AFTER`] after it began (it waits for
    /// a master another job is making, for its source's metadata), holds
    /// its transport's delivery no longer (`hold`: the broker records it in
    /// the ledger and acknowledges it), so that waiting jobs never fill the
    /// broker's prefetch; when its carrier cannot, a job waiting for a
    /// slot is taken back (`defer`) once it began [`HOLD_AFTER`] ago. Once the worker stops, a job waiting
    /// for a slot (nothing downloaded) is given back. A job waiting for a
    /// slot while a cleanup or `deployed` of its node waits behind it in
    /// its FIFO queue (`fifo`) yields to it: it goes behind it, so that the
    /// node is released at once (the prepare is then refused as stale, as
    /// a deferred one would be). Ends only when the job ends here.
    async fn watch(&self, carrier: &dyn Carrier, turn: &turn::Turn, fifo: &str) -> Ran {
        let mut stand = turn.watch();
        let hold_at = tokio::time::Instant::now() + HOLD_AFTER;
        let (mut held, mut may_defer) = (false, false);
        loop {
            let now = *stand.borrow_and_update();
            if now == Stand::Waiting && self.stopping.is_cancelled() {
                tracing::info!("the worker stops: waiting for a download slot, given back");
                carrier.give_back().await;
                return Ran::Returned;
            }
            if now == Stand::Waiting && self.release_waits(fifo) {
                tracing::info!("waiting for a download slot: behind its node's release now");
                return Ran::Yielded;
            }
            // Waiting for a slot: set aside at once; not downloading yet
            // (maybe a cache hit under way): after a while.
            let due = tokio::time::Instant::now() >= hold_at;
            if !held && (now == Stand::Waiting || (due && now == Stand::NotAsked)) {
                held = true;
                may_defer = !carrier.hold().await;
            }
            if due && may_defer && now == Stand::Waiting {
                match carrier.defer().await {
                    Deferral::TakenBack => return Ran::Returned,
                    Deferral::Wait => may_defer = false,
                }
            }
            let (stopping, timer) = (self.stopping.is_cancelled(), !due && (!held || may_defer));
            tokio::select! {
                changed = stand.changed() => if changed.is_err() {
                    return std::future::pending().await;
                },
                () = self.stopping.cancelled(), if !stopping => {}
                () = tokio::time::sleep_until(hold_at), if timer => {}
                () = tokio::time::sleep(RELEASE_POLL), if now == Stand::Waiting => {}
            }
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
