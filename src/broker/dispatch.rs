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

use super::ack::{Adoption, Tracked};
use super::deadline;
use super::publisher::Publisher;
use crate::error::{Error, ErrorCode};
use crate::messages::inbound::{self, Inbound};
use crate::messages::{Action, Completion};
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::*;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

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
    /// `[notifications]deploy_interfaces`: the nodes notifications act on.
    deploy_interfaces: Vec<String>,
    /// `[amqp]max_message_bytes`: the longest body read.
    max_message_bytes: usize,
    /// The broker's consumer timeout in force, in milliseconds (0: none):
    /// `[amqp]consumer_timeout`, or the value the broker reported when it
    /// closed a channel over it. A delivery still unacknowledged three
    /// quarters of it after it arrived is acknowledged early.
    consumer_timeout_ms: AtomicU64,
    /// Per-node FIFO queues: deliveries for one node run in order (a warm's
    /// queue is keyed by its image source, see [`order_key`]).
    nodes: Mutex<HashMap<String, mpsc::UnboundedSender<Job>>>,
    /// Jobs not yet acknowledged, by delivery identity (see [`identity`]).
    pending: Mutex<HashMap<u64, Vec<Arc<Tracked<Acker>>>>>,
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

/// A delivery and what it was parsed into.
pub(super) struct Job {
    inbound: Inbound,
    source: &'static str,
    reply_to: Option<String>,
    correlation_id: Option<String>,
    identity: u64,
    tracked: Arc<Tracked<Acker>>,
    /// When the sender stops waiting for the answer (see [`deadline`]).
    deadline: Option<u64>,
    /// The delivery's bytes and properties, to put a deferred prepare back.
    body: Vec<u8>,
    properties: lapin::BasicProperties,
    /// The broker delivered it before (to this process or another one).
    redelivered: bool,
    /// When this process received it (ms since the epoch).
    received_ms: u64,
    /// The span of every line written about it: its node, request id and
    /// action, once parsed.
    span: tracing::Span,
}

/// Prepare slots for a prefetch: a quarter of the deliveries (at least one)
/// stays free for other actions.
fn prepare_slots(prefetch: u16) -> usize {
    let prefetch = usize::from(prefetch.max(1));
    prefetch.saturating_sub((prefetch / 4).max(1)).max(1)
}

impl Dispatcher {
    pub(super) fn new(
        pipeline: Arc<Pipeline>,
        metrics: Arc<Metrics>,
        settings: &super::Settings,
    ) -> Dispatcher {
        let amqp = &settings.amqp;
        let timeout = amqp.consumer_timeout;
        let slots = prepare_slots(amqp.prefetch);
        let queue = super::Topology::new(&settings.host, amqp).queue;
        Dispatcher {
            host: settings.host.clone(),
            notification_exchange: amqp.notification_exchange.clone(),
            deploy_interfaces: settings.notifications.deploy_interfaces.clone(),
            max_message_bytes: amqp.max_message_bytes,
            consumer_timeout_ms: AtomicU64::new(timeout.saturating_mul(1000)),
            pipeline,
            metrics,
            nodes: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            link: watch::Sender::new(None),
            next_session: AtomicU64::new(1),
            tracker: TaskTracker::new(),
            prepare_slots: Arc::new(tokio::sync::Semaphore::new(slots)),
            slow_lane: Arc::new(tokio::sync::Semaphore::new(settings.slow_downloads)),
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

    /// The broker closed a channel over its consumer timeout and said which
    /// value it enforces: from now on early acknowledgements follow it.
    pub(super) fn broker_consumer_timeout(&self, enforced: Duration) {
        let ms = u64::try_from(enforced.as_millis()).unwrap_or(u64::MAX);
        let before = self.consumer_timeout_ms.swap(ms, Ordering::Relaxed);
        if before != ms {
            tracing::warn!(
                enforced_ms = ms,
                configured_ms = before,
                "the broker enforces another consumer_timeout than [amqp]consumer_timeout: \
                 acting on the broker's from now on (set [amqp]consumer_timeout to it)"
            );
        }
    }

    /// Jobs acknowledged early and not answered yet (lost if the process
    /// stops before they end: the broker holds no copy of them).
    pub(super) fn accepted_unanswered(&self) -> usize {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending
            .values()
            .flatten()
            .filter(|t| t.accepted_unanswered())
            .count()
    }

    /// How long after its arrival a delivery is acknowledged early.
    fn ack_early_after(&self) -> Option<Duration> {
        let ms = self.consumer_timeout_ms.load(Ordering::Relaxed);
        (ms > 0).then(|| Duration::from_millis(ms) * 3 / 4)
    }

    /// Routes a delivery of connection `session`: a redelivered copy of a
    /// known job is adopted, unusable and ignored messages are settled at
    /// once, work goes to its node's FIFO queue. Each copy held is
    /// acknowledged early once it has been unacknowledged for three
    /// quarters of the consumer timeout, queued or running.
    pub(super) fn dispatch(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let received = Instant::now();
        let identity = identity(&delivery);
        if delivery.redelivered && self.adopt(session, identity, &delivery.acker, received) {
            return;
        }
        let job = self.job(session, identity, delivery);
        let node = match &job.inbound {
            Inbound::Work(req) => order_key(req),
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
        self.arm_early_ack(&job.tracked, session, received, &job.span);
        self.enqueue(node, job);
    }

    /// A delivery parsed into a job holding its copy.
    fn job(&self, session: u64, identity: u64, delivery: Delivery) -> Job {
        let from_ironic = delivery.exchange.as_str() == self.notification_exchange;
        let received_ms = super::stamp::now_ms();
        let mut inbound = inbound::parse(
            &delivery.data,
            from_ironic,
            &self.host,
            &self.deploy_interfaces,
            self.max_message_bytes,
        );
        if let Inbound::Work(req) = &mut inbound {
            let command_time = super::stamp::issued_ms(&delivery.properties, received_ms);
            req.issued_ms.get_or_insert(command_time);
        }
        let dead_letter = matches!(inbound, Inbound::Invalid(_));
        let text = |s: &Option<lapin::types::ShortString>| s.as_ref().map(|s| s.to_string());
        let span = match &inbound {
            Inbound::Work(req) => tracing::info_span!(
                "delivery",
                node = %req.node_uuid,
                request_id = req.request_id.as_deref().unwrap_or(""),
                action = req.action.as_str()
            ),
            _ => tracing::info_span!("delivery"),
        };
        Job {
            span,
            source: if from_ironic {
                "notification"
            } else {
                "command"
            },
            reply_to: text(delivery.properties.reply_to()),
            correlation_id: text(delivery.properties.correlation_id()),
            inbound,
            identity,
            tracked: Arc::new(Tracked::new(session, delivery.acker, dead_letter)),
            deadline: deadline::of(&delivery.properties, received_ms),
            body: delivery.data,
            properties: delivery.properties,
            redelivered: delivery.redelivered,
            received_ms,
        }
    }

    /// Puts `job` at the tail of its node's FIFO queue, starting the
    /// queue's task when the node has none.
    fn enqueue(self: &Arc<Self>, node: String, job: Job) {
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

    /// Starts the early acknowledgement of the copy of `session` held by
    /// `tracked`, due three quarters of the consumer timeout after the copy
    /// was `received`, whether the job runs by then or still waits behind
    /// another of its node (the broker counts from the delivery). From
    /// then on the job is answered when done, and a crash loses it.
    fn arm_early_ack(
        &self,
        tracked: &Arc<Tracked<Acker>>,
        session: u64,
        received: Instant,
        span: &tracing::Span,
    ) {
        let Some(after) = self.ack_early_after() else {
            return;
        };
        let t = tracked.clone();
        let timer = tokio::spawn(
            async move {
                tokio::time::sleep_until((received + after).into()).await;
                if let Some((_, acker)) = t.ack_early(Some(session)) {
                    tracing::info!(
                        "unacknowledged for three quarters of the consumer timeout: acknowledged early"
                    );
                    let _ = acker.ack(BasicAckOptions::default()).await;
                }
            }
            .instrument(span.clone()),
        );
        tracked.arm(session, timer.abort_handle());
    }

    /// Registers a job as awaiting acknowledgement, forgetting answered
    /// ones older than [`ANSWERED_MEMORY`].
    fn remember(&self, job: &Job) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|_, jobs| {
            jobs.retain(|t| {
                t.answered_at()
                    .is_none_or(|at| at.elapsed() < ANSWERED_MEMORY)
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
    fn adopt(&self, session: u64, identity: u64, acker: &Acker, received: Instant) -> bool {
        let (tracked, adoption) = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let Some(jobs) = pending.get_mut(&identity) else {
                return false;
            };
            let found =
                jobs.iter()
                    .enumerate()
                    .find_map(|(i, t)| match t.adopt(session, acker.clone()) {
                        Adoption::NotStale(_) => None,
                        adoption => Some((i, adoption)),
                    });
            let Some((i, adoption)) = found else {
                return false;
            };
            let t = jobs[i].clone();
            if t.answered() {
                jobs.remove(i);
            }
            (t, adoption)
        };
        self.metrics
            .ignored
            .with_label_values(&["redelivered_in_progress"])
            .inc();
        if let Adoption::SettleNow(acker) = adoption {
            tracing::info!("a redelivered copy of work already answered or accepted: settled");
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
            self.arm_early_ack(&tracked, session, received, &tracing::Span::current());
        }
        true
    }

    /// Handles one job to the end: answer, then ack (or dead-letter).
    async fn settle(&self, job: Job) {
        let span = job.span.clone();
        self.settle_in_span(job).instrument(span).await
    }

    /// [`Dispatcher::settle`], inside the job's span.
    async fn settle_in_span(&self, mut job: Job) {
        let inbound = std::mem::replace(&mut job.inbound, Inbound::Ignore("settled"));
        match inbound {
            Inbound::Work(request) => self.work(*request, &job).await,
            Inbound::Invalid(done) => {
                tracing::warn!(source = job.source, error = ?done.error, "dead-lettering an unusable message");
                self.metrics.record(&done);
                self.metrics
                    .consumed(job.source, done.action.as_str(), "invalid");
                if self.answer(&done, &job).await {
                    self.finish(job.identity, &job.tracked, false).await;
                }
            }
            Inbound::Ignore(why) => {
                self.ignore(job.source, why, job.identity, &job.tracked)
                    .await
            }
            Inbound::Moved { node, at_ms } => {
                self.pipeline.note_moved(&node, at_ms).await;
                self.ignore(job.source, "no_action", job.identity, &job.tracked)
                    .await;
            }
        }
    }

    /// Runs a command or notification: waits for a prepare slot (or
    /// defers the prepare), refuses it past its deadline, runs it, answers.
    async fn work(&self, mut request: crate::messages::Request, job: &Job) {
        let key = format!("{:016x}", job.identity);
        if job.redelivered
            && self
                .pipeline
                .answered_before(&request.node_uuid, &key)
                .await
        {
            tracing::info!("a redelivered copy of work answered by a process of this host");
            return self
                .ignore(job.source, "answered_elsewhere", job.identity, &job.tracked)
                .await;
        }
        let expired = || job.deadline.is_some_and(|at| super::stamp::now_ms() >= at);
        // A warm downloads like a prepare: it shares the prepare slots.
        let slot = if matches!(request.action, Action::Prepare | Action::Warm) {
            match self.prepare_slot().await {
                Some(slot) => Some(slot),
                None if !expired() => return self.defer(job).await,
                None => None,
            }
        } else {
            None
        };
        let done = if expired() {
            drop(slot);
            let done = expired_answer(&request, &self.host);
            self.metrics.record(&done);
            done
        } else {
            // A stray cleanup (node not prepared here) is decided under
            // the node lock, inside the pipeline.
            let slow = slot.as_ref().map(|_| {
                let (signal, slow) = crate::messages::SlowSignal::new();
                request.slow = signal;
                slow
            });
            let Some(done) = self.run(&request, &job.tracked, slot, slow).await else {
                return self
                    .ignore(job.source, "not_prepared_here", job.identity, &job.tracked)
                    .await;
            };
            done
        };
        self.metrics
            .consumed(job.source, done.action.as_str(), done.status.as_str());
        if self.answer(&done, job).await {
            self.pipeline.note_answered(&request.node_uuid, &key).await;
            self.finish(job.identity, &job.tracked, true).await;
        }
    }

    /// Acknowledges a message that needs no answer, counted by reason.
    async fn ignore(
        &self,
        source: &'static str,
        why: &'static str,
        identity: u64,
        tracked: &Arc<Tracked<Acker>>,
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
    /// to the tail of the queue (a confirmed copy carrying the command's
    /// deadline, then this delivery is acknowledged), so the delivery slot
    /// serves other actions meanwhile. A copy whose connection is gone
    /// comes back by itself, as new work; if putting it back fails on the
    /// live connection, that connection is renewed and the copy comes back.
    async fn defer(&self, job: &Job) {
        let link = self.link.borrow().clone();
        let acker = job.tracked.take_acker();
        // The redelivered copy is new work, not a copy of running work.
        self.forget(job.identity, &job.tracked);
        let (Some(link), Some((session, acker))) = (link, acker) else {
            return;
        };
        if session != link.session {
            tracing::info!("a prepare to defer came through a connection now gone: it comes back");
            return;
        }
        let issued = super::stamp::with_issue_time(job.properties.clone(), job.received_ms);
        let copy = deadline::carried(&issued, job.deadline);
        let put_back = match link
            .publisher
            .requeue_copy(&self.queue, &job.body, copy)
            .await
        {
            Ok(()) => acker
                .ack(BasicAckOptions::default())
                .await
                .map(|_| ())
                .map_err(|e| crate::error::error_chain(&e)),
            Err(e) => Err(e.to_string()),
        };
        match put_back {
            Ok(()) => self
                .metrics
                .ignored
                .with_label_values(&["deferred_prepare"])
                .inc(),
            Err(e) => {
                tracing::warn!(error = %e, "could not defer a prepare; reconnecting, it will be redelivered");
                link.broken.notify_one();
            }
        }
    }

    /// Runs the work of a delivery, holding `slot` (a prepare's) while it
    /// runs. Beside it, a prepare whose download is slow (`slow` notified)
    /// moves to the slow lane when it has room: it gives back its prepare
    /// slot and is acknowledged early, so that neither prepare slots nor
    /// the prefetch fill with slow sources. (Work outlasting the consumer
    /// timeout is acknowledged by its copy's timer, see `arm_early_ack`.)
    async fn run(
        &self,
        request: &crate::messages::Request,
        tracked: &Tracked<Acker>,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
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
                    if let Some((_, acker)) = tracked.ack_early(None) {
                        tracing::info!("slow download moved to the slow lane: acknowledged early");
                        let _ = acker.ack(BasicAckOptions::default()).await;
                    }
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
    async fn handle_retrying(&self, request: &crate::messages::Request) -> Option<Completion> {
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

    /// Publishes `done` through the live connection, waiting for one and
    /// trying again on the next if publishing fails. False only when the
    /// worker stops first (the copy is then redelivered after a restart).
    async fn answer(&self, done: &Completion, job: &Job) -> bool {
        let (reply_to, correlation_id) = (job.reply_to.as_deref(), job.correlation_id.as_deref());
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
    async fn finish(&self, identity: u64, tracked: &Arc<Tracked<Acker>>, ack: bool) {
        if let Some(delay) = test_ack_delay() {
            tokio::time::sleep(delay).await;
        }
        let settled = match tracked.finish() {
            Err(acked_early) => acked_early,
            Ok((session, acker)) => {
                let result = if ack {
                    acker.ack(BasicAckOptions::default()).await
                } else {
                    acker.reject(BasicRejectOptions { requeue: false }).await
                }
                .map(|_| ())
                .map_err(|e| crate::error::error_chain(&e));
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
    fn forget(&self, identity: u64, tracked: &Arc<Tracked<Acker>>) {
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

/// Whether an I/O failure's OS error is a file-system condition that goes
/// away (read-only file system, I/O error, no space, quota).
fn is_transient_io(os_error: Option<i32>) -> bool {
    os_error.is_some_and(|e| [libc::EROFS, libc::EIO, libc::ENOSPC, libc::EDQUOT].contains(&e))
}

/// The answer to a command whose sender stopped waiting before its work
/// could start.
fn expired_answer(request: &crate::messages::Request, host: &str) -> Completion {
    let err = Error::new(
        ErrorCode::Expired,
        "the command's deadline (its expiration, counted from its first delivery) \
         passed before its work could start",
    );
    tracing::warn!(node = %request.node_uuid, action = request.action.as_str(), "refusing a command past its deadline");
    let node = (request.action != Action::Warm).then(|| request.node_uuid.clone());
    Completion::new(request.action, node, request.request_id.clone(), host).failed(&err)
}

/// The key of the FIFO queue a request waits in: its node, so a node's
/// commands run in order; a warm, which names no node, waits behind the
/// warms of the same image source (two warms of one image never download
/// it twice at once here, the master lock serialises across processes) and
/// never behind a node's commands (a key with a space is never a UUID).
fn order_key(request: &crate::messages::Request) -> String {
    match request.action {
        Action::Warm => format!(
            "warm {}",
            request
                .instance_info
                .image_source
                .as_deref()
                .unwrap_or("")
                .trim()
        ),
        _ => request.node_uuid.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_file_system_errors() {
        let io = |errno| {
            let e = crate::error::Error::io("remove x", std::io::Error::from_raw_os_error(errno));
            e.os_error
        };
        assert!(is_transient_io(io(libc::EROFS)));
        assert!(is_transient_io(io(libc::EIO)));
        assert!(is_transient_io(io(libc::ENOSPC)));
        assert!(!is_transient_io(io(libc::EACCES)));
        assert!(!is_transient_io(None));
    }
}
