//! Deliveries in, answers out: parsing each delivery, handing its work to
//! the transport-neutral dispatch (`crate::dispatch`: per-node order,
//! prepare slots, deadlines, the answer's record), answering through the
//! broker, then acknowledging (or dead-lettering an unusable message).
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
use super::identity;
use super::parked::Parked;
use super::publisher::Publisher;
use crate::dispatch::{Carrier, Deferral, DeliveryKey, Dispatch, Job, Transport};
use crate::messages::Completion;
use crate::messages::inbound::{self, Inbound};
use crate::pipeline::Shelf;
use futures_util::future::BoxFuture;
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// How long a job answered but not acknowledged (its connection died) is
/// remembered, so that its redelivered copy is acknowledged silently.
const ANSWERED_MEMORY: Duration = Duration::from_secs(600);

/// How long the consumer must have handed in no delivery for the
/// dispatcher to count as caught up (see [`Dispatcher::caught_up`]).
const QUIET: Duration = Duration::from_millis(50);

/// The longest the backlog of a new connection is waited for (a steady
/// stream of deliveries is never quiet).
const CATCH_UP_AT_MOST: Duration = Duration::from_secs(2);

/// The consumer's intake, for [`Dispatcher::caught_up`].
struct Intake {
    /// Deliveries being dispatched now.
    dispatching: usize,
    /// When the last one was dispatched.
    last: Instant,
    /// Since when the current connection's backlog is being taken in;
    /// `None` once it was (the intake was quiet, or the wait timed out).
    backlog_since: Option<Instant>,
}

/// The current connection, as jobs see it: its id and its publisher.
#[derive(Clone)]
pub(super) struct Link {
    pub(super) session: u64,
    pub(super) publisher: Publisher,
    /// Signalled when a broker operation on this connection failed.
    pub(super) broken: Arc<Notify>,
}

/// State that outlives connections: the jobs awaiting acknowledgement,
/// the current connection; the work itself is the shared dispatch's.
pub(super) struct Dispatcher {
    work: Arc<Dispatch>,
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
    /// Jobs not yet acknowledged, by delivery identity (`identity::key`).
    pending: Mutex<HashMap<String, Vec<Arc<Tracked<Acker>>>>>,
    /// The live connection, `None` while disconnected.
    link: watch::Sender<Option<Link>>,
    next_session: AtomicU64,
    /// This host's queue, where deferred prepares go back.
    queue: String,
    /// Deliveries being dispatched, and when the last one was.
    intake: Mutex<Intake>,
}

/// A delivery: the broker's side of its job (the shared dispatch's
/// [`Carrier`]).
pub(super) struct Delivered {
    dispatcher: Arc<Dispatcher>,
    source: &'static str,
    reply_to: Option<String>,
    correlation_id: Option<String>,
    /// Its ledger key (`identity::key`).
    identity: String,
    /// The key earlier versions recorded it under (`identity::legacy`).
    legacy_identity: Option<String>,
    /// The exchange and routing key it came by (kept when it is parked).
    exchange: String,
    routing_key: String,
    /// When it was issued (ms since the epoch), from its properties.
    issued_ms: u64,
    /// Run again from its parked record (its delivery was acknowledged).
    resumed: bool,
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
}

impl Dispatcher {
    pub(super) fn new(work: Arc<Dispatch>, settings: &super::Settings) -> Dispatcher {
        let amqp = &settings.amqp;
        let timeout = amqp.consumer_timeout;
        let queue = super::Topology::new(&settings.host, amqp).queue;
        Dispatcher {
            host: settings.host.clone(),
            notification_exchange: amqp.notification_exchange.clone(),
            deploy_interfaces: settings.notifications.deploy_interfaces.clone(),
            max_message_bytes: amqp.max_message_bytes,
            consumer_timeout_ms: AtomicU64::new(timeout.saturating_mul(1000)),
            work,
            pending: Mutex::new(HashMap::new()),
            link: watch::Sender::new(None),
            next_session: AtomicU64::new(1),
            queue,
            intake: Mutex::new(Intake {
                dispatching: 0,
                last: Instant::now(),
                backlog_since: Some(Instant::now()),
            }),
        }
    }

    /// Every job's task (the shared dispatch's), for a drain on stop.
    pub(super) fn tracker(&self) -> &TaskTracker {
        &self.work.tracker
    }

    /// Makes `publisher` the way out for every job; returns the new link.
    pub(super) fn connected(&self, publisher: Publisher) -> Link {
        let link = Link {
            session: self.next_session.fetch_add(1, Ordering::Relaxed),
            publisher,
            broken: Arc::new(Notify::new()),
        };
        self.link.send_replace(Some(link.clone()));
        let mut intake = self.lock_intake();
        (intake.backlog_since, intake.last) = (Some(Instant::now()), Instant::now());
        drop(intake);
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
    /// once, work goes to its node's FIFO queue, and a notification of a
    /// node's move is recorded in its ledger before the next delivery is
    /// taken in (see [`Dispatcher::caught_up`]). Each copy held is
    /// acknowledged early once it has been unacknowledged for three
    /// quarters of the consumer timeout, queued or running.
    pub(super) async fn dispatch(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let _taking_in = self.taking_in();
        self.route(session, delivery).await;
    }

    /// Resolves once what the queue held when the connection began is
    /// taken in: the consumer has handed in nothing for [`QUIET`] and
    /// every delivery it handed in is dispatched (a node's move recorded),
    /// or [`CATCH_UP_AT_MOST`] after the connection began. Why: after a
    /// restart, a node's `deploying` notification and its later `deploy
    /// failed` wait in the queue together; the broker sends both at once,
    /// and a prepare that found its image cached would otherwise link
    /// before the later message is read. A prepare waits for this before
    /// it starts; once the backlog is in, deliveries are dispatched in
    /// order as they come and a prepare waits for nothing (a steady stream
    /// of cache hits is never quiet).
    pub(super) async fn caught_up(&self) {
        loop {
            let quiet = {
                let mut intake = self.lock_intake();
                let Some(since) = intake.backlog_since else {
                    return;
                };
                let quiet = match intake.dispatching {
                    0 => intake.last.elapsed(),
                    _ => Duration::ZERO,
                };
                if quiet >= QUIET || since.elapsed() >= CATCH_UP_AT_MOST {
                    intake.backlog_since = None;
                    return;
                }
                quiet
            };
            tokio::time::sleep(QUIET - quiet).await;
        }
    }

    fn lock_intake(&self) -> std::sync::MutexGuard<'_, Intake> {
        self.intake.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a delivery as being dispatched until the guard is dropped.
    fn taking_in(&self) -> impl Drop + '_ {
        struct TakingIn<'a>(&'a Mutex<Intake>);
        impl Drop for TakingIn<'_> {
            fn drop(&mut self) {
                let mut intake = self.0.lock().unwrap_or_else(|p| p.into_inner());
                intake.dispatching = intake.dispatching.saturating_sub(1);
                intake.last = Instant::now();
            }
        }
        self.lock_intake().dispatching += 1;
        TakingIn(&self.intake)
    }

    /// [`Dispatcher::dispatch`], counted as being dispatched.
    async fn route(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let received = Instant::now();
        let identity = identity::key(&identity::Parts::of(&delivery));
        if delivery.redelivered && self.adopt(session, &identity, &delivery.acker, received) {
            return;
        }
        let (inbound, job) = self.job(session, identity, delivery);
        match inbound {
            Inbound::Work(request) => {
                self.remember(&job);
                let span = crate::dispatch::span_of(&request);
                self.arm_early_ack(&job.tracked, session, received, &span);
                self.work.submit(Job {
                    request: *request,
                    carrier: Box::new(job),
                });
            }
            Inbound::Invalid(done) => {
                self.remember(&job);
                self.work
                    .tracker
                    .spawn(async move { job.dead_letter(&done).await });
            }
            Inbound::Ignore(why) => {
                let work = self.work.clone();
                self.work
                    .tracker
                    .spawn(async move { work.unanswered(&job, why).await });
            }
            Inbound::Moved { node, at_ms } => {
                // Recorded before the next delivery is taken in.
                self.work.pipeline().order().note_moved(&node, at_ms).await;
                let work = self.work.clone();
                self.work
                    .tracker
                    .spawn(async move { work.unanswered(&job, "no_action").await });
            }
        }
    }

    /// A delivery parsed: what it asks, and the job holding its copy.
    fn job(
        self: &Arc<Self>,
        session: u64,
        identity: String,
        delivery: Delivery,
    ) -> (Inbound, Delivered) {
        let legacy_identity = Some(identity::legacy(&identity::Parts::of(&delivery)));
        let received_ms = super::stamp::now_ms();
        let (mut inbound, source) = self.read(&delivery.data, delivery.exchange.as_str());
        let issued_ms = super::stamp::issued_ms(&delivery.properties, received_ms);
        if let Inbound::Work(req) = &mut inbound {
            req.issued_ms.get_or_insert(issued_ms);
        }
        let dead_letter = matches!(inbound, Inbound::Invalid(_));
        let text = |s: &Option<lapin::types::ShortString>| s.as_ref().map(|s| s.to_string());
        let job = Delivered {
            dispatcher: self.clone(),
            source,
            reply_to: text(delivery.properties.reply_to()),
            correlation_id: text(delivery.properties.correlation_id()),
            identity,
            legacy_identity,
            exchange: delivery.exchange.to_string(),
            routing_key: delivery.routing_key.to_string(),
            issued_ms,
            resumed: false,
            tracked: Arc::new(Tracked::new(session, delivery.acker, dead_letter)),
            deadline: deadline::of(&delivery.properties, received_ms),
            body: delivery.data,
            properties: delivery.properties,
            redelivered: delivery.redelivered,
            received_ms,
        };
        (inbound, job)
    }

    /// A body published to `exchange`, parsed as a notification when the
    /// exchange is Ironic's, else as a command; with the log's name for
    /// which it was. The same for a delivery and for one parked earlier.
    fn read(&self, body: &[u8], exchange: &str) -> (Inbound, &'static str) {
        let from_ironic = exchange == self.notification_exchange;
        let inbound = inbound::parse(
            body,
            from_ironic,
            &self.host,
            &self.deploy_interfaces,
            self.max_message_bytes,
        );
        (
            inbound,
            if from_ironic {
                "notification"
            } else {
                "command"
            },
        )
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
    fn remember(&self, job: &Delivered) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|_, jobs| {
            jobs.retain(|t| {
                t.answered_at()
                    .is_none_or(|at| at.elapsed() < ANSWERED_MEMORY)
            });
            !jobs.is_empty()
        });
        pending
            .entry(job.identity.clone())
            .or_default()
            .push(job.tracked.clone());
    }

    /// A redelivered copy: if a job of an earlier connection has the same
    /// identity, it takes this copy's acker (or, answered already or
    /// acknowledged early, this copy is acknowledged now). True if adopted.
    fn adopt(&self, session: u64, identity: &str, acker: &Acker, received: Instant) -> bool {
        let (tracked, adoption) = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let Some(jobs) = pending.get_mut(identity) else {
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
        self.work
            .metrics()
            .ignored
            .with_label_values(&["redelivered_in_progress"])
            .inc();
        if let Adoption::SettleNow(acker) = adoption {
            tracing::info!("a redelivered copy of work already answered or accepted: settled");
            let dead_letter = tracked.dead_letter;
            self.work.tracker.spawn(async move {
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

    /// Runs again the deliveries that processes of this host (gone now)
    /// acknowledged before answering them (see `parked`): each as a
    /// redelivered copy, so the ledger's claims and answers apply.
    pub(super) async fn resume_parked(self: &Arc<Self>) {
        for (key, bytes) in self
            .work
            .pipeline()
            .order()
            .adopt_parked(&Shelf::broker())
            .await
        {
            let Some((parked, body)) = Parked::from_bytes(&bytes) else {
                tracing::warn!(key, "an unreadable parked delivery: dropped");
                self.work
                    .pipeline()
                    .order()
                    .unpark_delivery(&Shelf::broker(), &key)
                    .await;
                continue;
            };
            let (inbound, source) = self.read(&body, &parked.exchange);
            let Inbound::Work(mut request) = inbound else {
                self.work
                    .pipeline()
                    .order()
                    .unpark_delivery(&Shelf::broker(), &key)
                    .await;
                continue;
            };
            request.issued_ms.get_or_insert(parked.issued_ms);
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
                tracked: Arc::new(Tracked::accepted()),
                deadline: parked.deadline,
                body,
                properties: lapin::BasicProperties::default(),
                redelivered: true,
                received_ms: parked.received_ms,
            };
            crate::dispatch::span_of(&request).in_scope(|| {
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

    /// Every prepare slot is busy (long downloads): the prepare goes back
    /// to the tail of the queue (a confirmed copy carrying the command's
    /// deadline, then this delivery is acknowledged), so the delivery slot
    /// serves other actions meanwhile. A copy whose connection is gone
    /// comes back by itself, as new work; if putting it back fails on the
    /// live connection, that connection is renewed and the copy comes back.
    async fn defer(&self, job: &Delivered) {
        let link = self.link.borrow().clone();
        let acker = job.tracked.take_acker();
        // The redelivered copy is new work, not a copy of running work.
        self.forget(&job.identity, &job.tracked);
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
                .work
                .metrics()
                .ignored
                .with_label_values(&["deferred_prepare"])
                .inc(),
            Err(e) => {
                tracing::warn!(error = %e, "could not defer a prepare; reconnecting, it will be redelivered");
                link.broken.notify_one();
            }
        }
    }

    /// Publishes `done` through the live connection, waiting for one and
    /// trying again on the next if publishing fails. False only when the
    /// worker stops first (the copy is then redelivered after a restart).
    async fn answer(&self, done: &Completion, job: &Delivered) -> bool {
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
    async fn finish(&self, identity: &str, tracked: &Arc<Tracked<Acker>>, ack: bool) {
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

    /// Whether the copy `tracked` holds came through a connection now gone:
    /// the broker gives that message to another consumer (possibly another
    /// process of the host), so it counts as delivered twice.
    fn copy_gone(&self, tracked: &Tracked<Acker>) -> bool {
        let live = self.link.borrow().as_ref().map(|l| l.session);
        tracked.session().is_some_and(|s| Some(s) != live)
    }

    /// Drops a settled job from the jobs awaiting acknowledgement.
    fn forget(&self, identity: &str, tracked: &Arc<Tracked<Acker>>) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(jobs) = pending.get_mut(identity) {
            jobs.retain(|t| !Arc::ptr_eq(t, tracked));
            if jobs.is_empty() {
                pending.remove(identity);
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

impl Delivered {
    /// An unusable message: its error event, then a dead-letter.
    async fn dead_letter(&self, done: &Completion) {
        let d = &self.dispatcher;
        tracing::warn!(source = self.source, error = ?done.error, "dead-lettering an unusable message");
        d.work.metrics().record(done);
        d.work
            .metrics()
            .consumed(self.source, done.action.as_str(), "invalid");
        if d.answer(done, self).await {
            d.finish(&self.identity, &self.tracked, false).await;
        }
    }
}

impl Carrier for Delivered {
    fn transport(&self) -> Transport {
        Transport::Amqp
    }

    fn source(&self) -> &'static str {
        self.source
    }

    fn deadline(&self) -> Option<u64> {
        self.deadline
    }

    fn delivery_key(&self) -> Option<DeliveryKey> {
        Some(DeliveryKey {
            key: self.identity.clone(),
            legacy: self.legacy_identity.clone(),
            redelivered: self.redelivered || self.dispatcher.copy_gone(&self.tracked),
        })
    }

    fn defer(&self) -> BoxFuture<'_, Deferral> {
        Box::pin(async move {
            if self.resumed {
                // Its delivery is acknowledged: nothing to put back.
                return Deferral::Wait;
            }
            self.dispatcher.defer(self).await;
            Deferral::TakenBack
        })
    }

    fn caught_up(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.caught_up())
    }

    fn slowed(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.tracked.session().is_none() || !self.dispatcher.park(self).await {
                return;
            }
            if let Some((_, acker)) = self.tracked.ack_early(None) {
                tracing::info!(
                    "slow download moved to the slow lane: recorded, acknowledged early"
                );
                let _ = acker.ack(BasicAckOptions::default()).await;
            }
        })
    }

    fn answer<'a>(&'a self, done: &'a Completion) -> BoxFuture<'a, bool> {
        Box::pin(self.dispatcher.answer(done, self))
    }

    fn finish(&self) -> BoxFuture<'_, ()> {
        Box::pin(
            self.dispatcher
                .finish(&self.identity, &self.tracked, !self.tracked.dead_letter),
        )
    }

    /// Acknowledges a message that needs no answer (a lost acknowledgement
    /// only means the message comes back and is ignored again).
    fn unanswered(&self, _why: &'static str) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some((_, acker)) = self.tracked.take_acker() {
                let _ = acker.ack(BasicAckOptions::default()).await;
            }
            self.dispatcher.forget(&self.identity, &self.tracked);
        })
    }
}
