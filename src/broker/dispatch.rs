//! Deliveries in, answers out: routing each delivery to its node's work
//! queue, running it, answering, then acknowledging (or dead-lettering an
//! unusable message).
//!
//! Work outlives the connection it arrived on. When the connection drops,
//! running and queued jobs go on; their answers go out through the next
//! connection's publisher. The broker redelivers what was unacknowledged;
//! a redelivered copy of a job still known here is *adopted* (the job
//! acknowledges the new copy when done) instead of being run again, and a
//! copy of a job already answered is acknowledged without a second answer.
//! So a connection flap costs no second download and each command is
//! answered once, even when the quorum queue dead-letters the copy after
//! too many redeliveries.

use super::publisher::Publisher;
use crate::messages::inbound::{self, Inbound};
use crate::messages::{Action, Completion};
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::*;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::task::TaskTracker;

/// How long a job answered but not acknowledged (its connection died) is
/// remembered, so that its redelivered copy is acknowledged silently.
const ANSWERED_MEMORY: Duration = Duration::from_secs(600);

/// How long a cleanup or `deployed` failing on a transient file-system
/// error (read-only, I/O error, full) is retried before it is answered with
/// the error.
const RELEASE_RETRY_FOR: Duration = Duration::from_secs(600);

/// How long a prepare waits for a free prepare slot before it is put back
/// at the tail of the queue (so that other actions get the delivery slots).
const DEFER_AFTER: Duration = Duration::from_secs(2);

/// The current connection, as jobs see it: its id and its publisher.
#[derive(Clone)]
pub(super) struct Link {
    pub(super) session: u64,
    pub(super) publisher: Publisher,
    /// Signalled when a broker operation on this connection failed.
    pub(super) broken: Arc<Notify>,
}

/// State that outlives connections: the per-node work queues, the jobs
/// awaiting acknowledgement, the current connection.
pub(super) struct Dispatcher {
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    host: String,
    /// Ironic's notification exchange (deliveries from it are notifications).
    notification_exchange: String,
    /// Work running longer than this is acknowledged early (the broker's
    /// consumer timeout would otherwise close the channel).
    ack_early_after: Option<Duration>,
    /// Per-node FIFO queues: deliveries for one node run in order.
    nodes: Mutex<HashMap<String, mpsc::UnboundedSender<Job>>>,
    /// Jobs not yet acknowledged, by delivery identity (see [`identity`]).
    pending: Mutex<HashMap<u64, Vec<Arc<Tracked>>>>,
    /// The live connection, `None` while disconnected.
    link: watch::Sender<Option<Link>>,
    next_session: AtomicU64,
    pub(super) tracker: TaskTracker,
    /// Prepares running at once: fewer than the prefetch, so cleanups and
    /// `deployed` always find a delivery slot free of downloads.
    prepare_slots: Arc<tokio::sync::Semaphore>,
    /// Places in the slow lane: prepares whose download is slow give back
    /// their prepare slot and are acknowledged early (see [`Dispatcher::run`]).
    slow_lane: Arc<tokio::sync::Semaphore>,
    /// This host's queue, where deferred prepares go back.
    queue: String,
}

/// The acknowledgement state of one job.
struct Tracked {
    /// The copy to acknowledge when done: its connection and acker.
    acker: Mutex<Option<(u64, Acker)>>,
    /// The answer was published (confirmed by the broker).
    answered: AtomicBool,
    /// Acknowledged before the answer (long work, consumer timeout).
    acked_early: AtomicBool,
    /// Settled by dead-lettering (an unusable message), not by an ack.
    dead_letter: bool,
    /// When the answer went out, for forgetting it.
    answered_at: Mutex<Option<Instant>>,
}

impl Tracked {
    /// Takes the copy to acknowledge, so exactly one path settles it.
    fn take_acker(&self) -> Option<(u64, Acker)> {
        self.acker.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// A delivery and what it was parsed into.
pub(super) struct Job {
    inbound: Inbound,
    source: &'static str,
    reply_to: Option<String>,
    correlation_id: Option<String>,
    identity: u64,
    tracked: Arc<Tracked>,
    /// The delivery's bytes and properties, to put a deferred prepare back.
    body: Vec<u8>,
    properties: lapin::BasicProperties,
    /// The broker delivered it before (to this process or another one).
    redelivered: bool,
    /// When this process received it (ms since the epoch).
    received_ms: u64,
}

/// Prepare slots for a prefetch: a quarter of the deliveries (at least one)
/// stays free for other actions.
fn prepare_slots(prefetch: u16) -> usize {
    let prefetch = usize::from(prefetch.max(1));
    prefetch.saturating_sub((prefetch / 4).max(1)).max(1)
}

impl Dispatcher {
    pub(super) fn new(pipeline: Arc<Pipeline>, metrics: Arc<Metrics>) -> Dispatcher {
        let config = pipeline.config();
        let timeout = config.amqp.consumer_timeout;
        let slots = prepare_slots(config.amqp.prefetch);
        let slow_downloads = config.source.slow_downloads as usize;
        let queue = super::Topology::new(config).queue;
        Dispatcher {
            host: config.default.host.clone(),
            notification_exchange: config.amqp.notification_exchange.clone(),
            ack_early_after: (timeout > 0).then(|| Duration::from_secs(timeout) * 3 / 4),
            pipeline,
            metrics,
            nodes: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            link: watch::Sender::new(None),
            next_session: AtomicU64::new(1),
            tracker: TaskTracker::new(),
            prepare_slots: Arc::new(tokio::sync::Semaphore::new(slots)),
            slow_lane: Arc::new(tokio::sync::Semaphore::new(slow_downloads)),
            queue,
        }
    }

    /// Makes `publisher` the way out for every job; returns the new link.
    pub(super) fn connected(&self, publisher: Publisher) -> Link {
        let link = Link {
            session: self.next_session.fetch_add(1, Ordering::Relaxed),
            publisher,
            broken: Arc::new(Notify::new()),
        };
        self.link.send_replace(Some(link.clone()));
        link
    }

    /// The connection of `session` is gone: jobs wait for the next one.
    pub(super) fn disconnected(&self, session: u64) {
        self.link.send_if_modified(|l| {
            if l.as_ref().is_some_and(|l| l.session == session) {
                *l = None;
                true
            } else {
                false
            }
        });
    }

    /// Routes a delivery of connection `session`: a redelivered copy of a
    /// known job is adopted, unusable and ignored messages are settled at
    /// once, work goes to its node's FIFO queue.
    pub(super) fn dispatch(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let identity = identity(&delivery);
        if delivery.redelivered && self.adopt(session, identity, &delivery.acker) {
            return;
        }
        let from_ironic = delivery.exchange.as_str() == self.notification_exchange;
        let config = self.pipeline.config();
        let received_ms = super::stamp::now_ms();
        let mut inbound = inbound::parse(
            &delivery.data,
            from_ironic,
            &self.host,
            &config.notifications.deploy_interfaces,
            config.amqp.max_message_bytes,
        );
        if let Inbound::Work(req) = &mut inbound {
            let command_time = super::stamp::issued_ms(&delivery.properties, received_ms);
            req.issued_ms.get_or_insert(command_time);
        }
        let tracked = Arc::new(Tracked {
            acker: Mutex::new(Some((session, delivery.acker.clone()))),
            answered: AtomicBool::new(false),
            acked_early: AtomicBool::new(false),
            dead_letter: matches!(inbound, Inbound::Invalid(_)),
            answered_at: Mutex::new(None),
        });
        let job = Job {
            source: if from_ironic {
                "notification"
            } else {
                "command"
            },
            reply_to: delivery
                .properties
                .reply_to()
                .as_ref()
                .map(|s| s.as_str().to_string()),
            correlation_id: delivery
                .properties
                .correlation_id()
                .as_ref()
                .map(|s| s.as_str().to_string()),
            inbound,
            identity,
            tracked,
            body: delivery.data.clone(),
            properties: delivery.properties.clone(),
            redelivered: delivery.redelivered,
            received_ms,
        };
        let node = match &job.inbound {
            Inbound::Work(req) => req.node_uuid.clone(),
            Inbound::Ignore(_) | Inbound::Moved { .. } => {
                let d = self.clone();
                self.tracker.spawn(async move { d.settle(job).await });
                return;
            }
            Inbound::Invalid(_) => {
                self.remember(&job);
                let d = self.clone();
                self.tracker.spawn(async move { d.settle(job).await });
                return;
            }
        };
        self.remember(&job);
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let job = match nodes.get(&node) {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::error::SendError(job)) => job,
            },
            None => job,
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let _ = tx.send(job);
        nodes.insert(node.clone(), tx);
        let d = self.clone();
        self.tracker.spawn(async move {
            loop {
                while let Ok(job) = rx.try_recv() {
                    d.settle(job).await;
                }
                let mut nodes = d.nodes.lock().unwrap_or_else(|p| p.into_inner());
                if rx.is_empty() {
                    nodes.remove(&node);
                    return;
                }
            }
        });
    }

    /// Registers a job as awaiting acknowledgement, forgetting answered
    /// ones older than [`ANSWERED_MEMORY`].
    fn remember(&self, job: &Job) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|_, jobs| {
            jobs.retain(|t| {
                let at = *t.answered_at.lock().unwrap_or_else(|p| p.into_inner());
                at.is_none_or(|at| at.elapsed() < ANSWERED_MEMORY)
            });
            !jobs.is_empty()
        });
        pending
            .entry(job.identity)
            .or_default()
            .push(job.tracked.clone());
    }

    /// A redelivered copy: if a job of an earlier connection has the same
    /// identity, it takes this copy's acker (or, answered already or
    /// acknowledged early, this copy is acknowledged now). True if adopted.
    fn adopt(&self, session: u64, identity: u64, acker: &Acker) -> bool {
        let tracked = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let Some(jobs) = pending.get_mut(&identity) else {
                return false;
            };
            let stale = jobs.iter().position(|t| {
                t.acker
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .is_none_or(|(s, _)| *s != session)
            });
            let Some(i) = stale else {
                return false;
            };
            let t = jobs[i].clone();
            if t.answered.load(Ordering::Acquire) {
                jobs.remove(i);
            }
            t
        };
        self.metrics
            .ignored
            .with_label_values(&["redelivered_in_progress"])
            .inc();
        if tracked.answered.load(Ordering::Acquire) || tracked.acked_early.load(Ordering::Acquire) {
            tracing::info!("a redelivered copy of work already answered or accepted: settled");
            let acker = acker.clone();
            let dead_letter = tracked.dead_letter;
            self.tracker.spawn(async move {
                let _ = if dead_letter {
                    acker.reject(BasicRejectOptions { requeue: false }).await
                } else {
                    acker.ack(BasicAckOptions::default()).await
                };
            });
        } else {
            tracing::info!("a redelivered copy of work still running here: adopted");
            *tracked.acker.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((session, acker.clone()));
        }
        true
    }

    /// Handles one job to the end: answer, then ack (or dead-letter).
    async fn settle(&self, job: Job) {
        let Job {
            inbound,
            source,
            reply_to,
            correlation_id,
            identity,
            tracked,
            body,
            properties,
            redelivered,
            received_ms,
        } = job;
        match inbound {
            Inbound::Work(mut request) => {
                let key = format!("{identity:016x}");
                if redelivered
                    && self
                        .pipeline
                        .answered_before(&request.node_uuid, &key)
                        .await
                {
                    tracing::info!("a redelivered copy of work answered by a process of this host");
                    self.ignore(source, "answered_elsewhere", identity, &tracked)
                        .await;
                    return;
                }
                let slot = if request.action == Action::Prepare {
                    match self.prepare_slot().await {
                        Some(slot) => Some(slot),
                        None => {
                            let properties = super::stamp::with_issue_time(properties, received_ms);
                            self.defer(identity, &tracked, &body, properties).await;
                            return;
                        }
                    }
                } else {
                    None
                };
                // A stray cleanup (node not prepared here) is decided under
                // the node lock, inside the pipeline.
                let slow = slot.as_ref().map(|_| {
                    let (signal, slow) = crate::pipeline::SlowSignal::new();
                    request.slow = signal;
                    slow
                });
                let Some(done) = self.run(&request, &tracked, slot, slow).await else {
                    self.ignore(source, "not_prepared_here", identity, &tracked)
                        .await;
                    return;
                };
                self.metrics
                    .consumed(source, done.action.as_str(), done.status.as_str());
                if self
                    .answer(&done, reply_to.as_deref(), correlation_id.as_deref())
                    .await
                {
                    self.pipeline.note_answered(&request.node_uuid, &key).await;
                    self.finish(identity, &tracked, true).await;
                }
            }
            Inbound::Invalid(done) => {
                tracing::warn!(source, error = ?done.error, "dead-lettering an unusable message");
                self.metrics.record(&done);
                self.metrics
                    .consumed(source, done.action.as_str(), "invalid");
                if self
                    .answer(&done, reply_to.as_deref(), correlation_id.as_deref())
                    .await
                {
                    self.finish(identity, &tracked, false).await;
                }
            }
            Inbound::Ignore(why) => self.ignore(source, why, identity, &tracked).await,
            Inbound::Moved { node, at_ms } => {
                self.pipeline.note_moved(&node, at_ms).await;
                self.ignore(source, "no_action", identity, &tracked).await;
            }
        }
    }

    /// Acknowledges a message that needs no answer, counted by reason.
    async fn ignore(
        &self,
        source: &'static str,
        why: &'static str,
        identity: u64,
        tracked: &Arc<Tracked>,
    ) {
        self.metrics.ignored.with_label_values(&[why]).inc();
        self.metrics.consumed(source, "none", "ignored");
        // A lost acknowledgement only means the message comes back and is
        // ignored again.
        let acker = tracked.take_acker();
        if let Some((_, acker)) = acker {
            let _ = acker.ack(BasicAckOptions::default()).await;
        }
        self.forget(identity, tracked);
    }

    /// A prepare slot, waiting up to [`DEFER_AFTER`] for one.
    async fn prepare_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let slots = self.prepare_slots.clone();
        tokio::time::timeout(DEFER_AFTER, slots.acquire_owned())
            .await
            .ok()
            .and_then(|p| p.ok())
    }

    /// Every prepare slot is busy (long downloads): the prepare goes back
    /// to the tail of the queue (a confirmed copy, then this delivery is
    /// acknowledged), so the delivery slot serves other actions meanwhile.
    /// If that fails, the prepare simply waits for a slot.
    async fn defer(
        &self,
        identity: u64,
        tracked: &Arc<Tracked>,
        body: &[u8],
        properties: lapin::BasicProperties,
    ) {
        let link = self.link.borrow().clone();
        let acker = tracked.take_acker();
        let (Some(link), Some((session, acker))) = (link, acker) else {
            // Disconnected: the delivery comes back as new work.
            self.forget(identity, tracked);
            return;
        };
        if session == link.session
            && link
                .publisher
                .requeue_copy(&self.queue, body, properties)
                .await
                .is_ok()
            && acker.ack(BasicAckOptions::default()).await.is_ok()
        {
            self.metrics
                .ignored
                .with_label_values(&["deferred_prepare"])
                .inc();
            self.forget(identity, tracked);
            return;
        }
        tracing::warn!("could not defer a prepare; it will be redelivered");
        link.broken.notify_one();
        // The redelivered copy is new work, not a copy of running work.
        self.forget(identity, tracked);
    }

    /// Runs the pipeline for `request`. Work still running after
    /// `ack_early_after` is acknowledged then (and answered when done).
    /// Runs the work of a delivery, holding `slot` (a prepare's) while it
    /// runs. Beside it: work running longer than three quarters of the
    /// broker's consumer timeout is acknowledged early, and a prepare whose
    /// download is slow (`slow` notified) moves to the slow lane when it has
    /// room: it gives back its prepare slot and is acknowledged early, so
    /// that neither prepare slots nor the prefetch fill with slow sources.
    async fn run(
        &self,
        request: &crate::pipeline::Request,
        tracked: &Tracked,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
        slow: Option<Arc<Notify>>,
    ) -> Option<Completion> {
        let early = async {
            match self.ack_early_after {
                Some(after) => tokio::time::sleep(after).await,
                None => std::future::pending().await,
            }
            self.ack_early(
                tracked,
                "work running for three quarters of [amqp]consumer_timeout",
            )
            .await;
        };
        let slowed = async move {
            let Some(slow) = slow else {
                return std::future::pending().await;
            };
            slow.notified().await;
            let _held = match self.slow_lane.clone().try_acquire_owned() {
                Ok(lane) => {
                    drop(slot);
                    self.metrics.slow_lane.inc();
                    self.ack_early(tracked, "slow download moved to the slow lane")
                        .await;
                    Some(lane)
                }
                Err(_) => slot,
            };
            std::future::pending::<()>().await
        };
        let beside = async {
            tokio::join!(early, slowed);
        };
        tokio::select! {
            done = self.handle_retrying(request) => done,
            () = beside => None,
        }
    }

    /// The pipeline's answer; a cleanup or `deployed` failing because the
    /// file system is read-only, failing or full is tried again with
    /// backoff for up to [`RELEASE_RETRY_FOR`], so the node is released once
    /// the file system is back instead of being answered and forgotten.
    async fn handle_retrying(&self, request: &crate::pipeline::Request) -> Option<Completion> {
        let started = Instant::now();
        let mut delay = Duration::from_millis(500);
        loop {
            let done = self.pipeline.handle_unless_stray(request).await?;
            let transient = matches!(request.action, Action::Cleanup | Action::Deployed)
                && done
                    .error
                    .as_ref()
                    .is_some_and(|e| is_transient_io(&e.message));
            if !transient || started.elapsed() + delay > RELEASE_RETRY_FOR {
                return Some(done);
            }
            tracing::warn!(
                node = %request.node_uuid,
                action = request.action.as_str(),
                error = ?done.error,
                retry_in = ?delay,
                "releasing failed on a transient file-system error; retrying"
            );
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(15));
        }
    }

    /// Acknowledges a long-running job before it is done, so the broker's
    /// consumer timeout never closes the channel over it (which would
    /// redeliver it again and again). From here a crash loses the command.
    async fn ack_early(&self, tracked: &Tracked, why: &str) {
        tracked.acked_early.store(true, Ordering::Release);
        let acker = tracked.take_acker();
        if let Some((_, acker)) = acker {
            tracing::info!("{why}: acknowledged early");
            let _ = acker.ack(BasicAckOptions::default()).await;
        }
    }

    /// Publishes `done` through the live connection, waiting for one and
    /// trying again on the next if publishing fails. False only when the
    /// worker stops first (the copy is then redelivered after a restart).
    async fn answer(
        &self,
        done: &Completion,
        reply_to: Option<&str>,
        correlation_id: Option<&str>,
    ) -> bool {
        let mut links = self.link.subscribe();
        loop {
            let link = match links.wait_for(|l| l.is_some()).await {
                Ok(l) => l.clone(),
                Err(_) => return false,
            };
            let Some(link) = link else { continue };
            match link.publisher.publish(done, reply_to, correlation_id).await {
                Ok(()) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, "could not publish a completion; reconnecting");
                    link.broken.notify_one();
                    self.disconnected(link.session);
                }
            }
        }
    }

    /// After the answer: acknowledge (`ack`) or dead-letter the copy held
    /// now. If that copy's connection is gone, the job stays known as
    /// answered, so its redelivered copy is acknowledged without a second
    /// answer.
    async fn finish(&self, identity: u64, tracked: &Arc<Tracked>, ack: bool) {
        *tracked
            .answered_at
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        tracked.answered.store(true, Ordering::Release);
        if let Some(delay) = test_ack_delay() {
            tokio::time::sleep(delay).await;
        }
        let held = tracked.take_acker();
        let settled = match held {
            None => tracked.acked_early.load(Ordering::Acquire),
            Some((session, acker)) => {
                let result = if ack {
                    acker.ack(BasicAckOptions::default()).await
                } else {
                    acker.reject(BasicRejectOptions { requeue: false }).await
                }
                .map(|_| ())
                .map_err(|e| super::chain(&e));
                match result {
                    Ok(()) => true,
                    Err(e) => {
                        let link = self.link.borrow().clone();
                        if let Some(link) = link.filter(|l| l.session == session) {
                            tracing::warn!(error = %e, "could not settle a delivery; reconnecting");
                            link.broken.notify_one();
                        }
                        false
                    }
                }
            }
        };
        if settled {
            self.forget(identity, tracked);
        }
    }

    /// Drops a settled job from the jobs awaiting acknowledgement.
    fn forget(&self, identity: u64, tracked: &Arc<Tracked>) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(jobs) = pending.get_mut(&identity) {
            jobs.retain(|t| !Arc::ptr_eq(t, tracked));
            if jobs.is_empty() {
                pending.remove(&identity);
            }
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

/// What identifies a delivery across redeliveries: exchange, routing key,
/// body, `reply_to` and `correlation_id`.
fn identity(delivery: &Delivery) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    delivery.exchange.as_str().hash(&mut h);
    delivery.routing_key.as_str().hash(&mut h);
    delivery.data.hash(&mut h);
    delivery
        .properties
        .reply_to()
        .as_ref()
        .map(|s| s.as_str())
        .hash(&mut h);
    delivery
        .properties
        .correlation_id()
        .as_ref()
        .map(|s| s.as_str())
        .hash(&mut h);
    h.finish()
}

/// Whether an error message reports a file-system condition that goes away
/// (read-only file system, I/O error, no space, quota), as `std::io`
/// formats it.
fn is_transient_io(message: &str) -> bool {
    [
        "(os error 30)",
        "(os error 5)",
        "(os error 28)",
        "(os error 122)",
    ]
    .iter()
    .any(|code| message.contains(code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_file_system_errors() {
        assert!(is_transient_io(
            "remove /httpboot/agent_images/x: Read-only file system (os error 30)"
        ));
        assert!(is_transient_io("write: Input/output error (os error 5)"));
        assert!(!is_transient_io(
            "remove x: Permission denied (os error 13)"
        ));
        assert!(!is_transient_io("unknown action"));
    }
}
