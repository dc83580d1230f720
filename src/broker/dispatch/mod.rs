//! Deliveries in, answers out: parsing each delivery, handing its work to
//! the transport-neutral dispatch (`crate::dispatch`: per-node order,
//! download slots, deadlines, the answer's record), answering through the
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
//!
//! # This folder
//!
//! This file holds the state that outlives connections ([`Dispatcher`]),
//! a delivery as the shared dispatch's [`Carrier`] ([`Delivered`]) and the
//! routing of each delivery. Around it, one concern a file:
//!
//! * `read`: how a delivery reads (a command or a notification) and
//!   whether its seal lets it be worked;
//! * `intake`: when the backlog of a new connection is taken in;
//! * `adopt`: the jobs awaiting acknowledgement, and a redelivered copy
//!   adopted by the job of its identity;
//! * `early_ack`: a copy acknowledged before the broker's consumer timeout;
//! * `slow_lane`: a slow download's delivery, or one of a download job
//!   that waits, parked in the ledger and acknowledged early, and parked
//!   deliveries run again after a restart;
//! * `refuse`: a command whose seal does not hold, dead-lettered unworked;
//! * `defer`: a prepare put back at the tail of the queue, and work not
//!   started given back that way when the worker stops;
//! * `settle`: the answer published, then the copy acknowledged or
//!   dead-lettered.
//!
//! The files use each other in one direction (`tests/architecture.rs`).

mod adopt;
mod defer;
mod early_ack;
mod intake;
mod read;
mod refuse;
mod settle;
mod slow_lane;

use super::ack::Tracked;
use super::deadline;
use super::identity;
use super::publisher::Publisher;
use crate::dispatch::{Carrier, Deferral, DeliveryKey, Dispatch, Job, Transport};
use crate::messages::inbound::Inbound;
use crate::messages::{Completion, IgnoreReason};
use crate::seal::Sealed;
use futures_util::future::BoxFuture;
use intake::Intake;
use lapin::Acker;
use lapin::message::Delivery;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{Notify, watch};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

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
    /// How deliveries read (commands, notifications, seals).
    reader: read::Reader,
    /// The broker's consumer timeout in force: a delivery still
    /// unacknowledged three quarters of it after it arrived is acknowledged
    /// early.
    consumer_timeout: early_ack::ConsumerTimeout,
    /// Jobs not yet acknowledged, by delivery identity (`identity::key`).
    pending: adopt::Pending<Acker>,
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
struct Delivered {
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
    /// Until when its seal lets it be acted on (a deferred copy is sealed
    /// again until then); `None`: it came unsealed.
    sealed_until: Option<u64>,
    /// Which key sealed it (0: the current one, or none): its answer is
    /// sealed with the same key.
    seal_key: usize,
}

impl Dispatcher {
    /// The dispatcher of one worker's deliveries, over the shared dispatch
    /// `work`, for its whole life (connections come and go under it).
    pub(super) fn new(work: Arc<Dispatch>, settings: &super::Settings) -> Dispatcher {
        let amqp = &settings.amqp;
        let timeout = amqp.consumer_timeout;
        let queue = super::Topology::new(&settings.host, amqp).queue;
        Dispatcher {
            reader: read::Reader::new(settings, &queue),
            consumer_timeout: early_ack::ConsumerTimeout::configured(timeout),
            work,
            pending: adopt::Pending::new(adopt::ANSWERED_MEMORY),
            link: watch::Sender::new(None),
            next_session: AtomicU64::new(1),
            queue,
            intake: Mutex::new(Intake::new()),
        }
    }

    /// Jobs acknowledged early and not answered yet (lost if the process
    /// stops before they end: the broker holds no copy of them).
    pub(in crate::broker) fn accepted_unanswered(&self) -> usize {
        self.pending.accepted_unanswered()
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
        self.backlog_begins();
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
    /// once, work goes to its node's FIFO queue, and a notification of a
    /// node's move is recorded in its ledger before the next delivery is
    /// taken in (see [`Dispatcher::caught_up`]). Each copy held is
    /// acknowledged early once it has been unacknowledged for three
    /// quarters of the consumer timeout, queued or running.
    pub(super) async fn dispatch(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let _taking_in = self.taking_in();
        self.route(session, delivery).await;
    }

    /// [`Dispatcher::dispatch`], counted as being dispatched.
    async fn route(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let received = Instant::now();
        let identity = identity::key(&identity::Parts::of(&delivery));
        if delivery.redelivered && self.adopt(session, &identity, &delivery.acker, received) {
            return;
        }
        let sealed = match self.reader.admit(&delivery) {
            Ok(sealed) => sealed,
            Err(why) => return self.refuse(delivery, why),
        };
        let (inbound, job) = self.job(session, identity, delivery, sealed);
        match inbound {
            Inbound::Work(request) => {
                self.pending.remember(&job.identity, job.tracked.clone());
                self.arm_early_ack(&job.tracked, session, received);
                self.work.submit(Job {
                    request: *request,
                    carrier: Box::new(job),
                });
            }
            Inbound::Invalid(done) => {
                self.pending.remember(&job.identity, job.tracked.clone());
                let span = job.tracked.span.clone();
                self.work
                    .tracker
                    .spawn(async move { job.dead_letter(&done).await }.instrument(span));
            }
            Inbound::Ignore(why) => {
                let work = self.work.clone();
                self.work
                    .tracker
                    .spawn(async move { work.unanswered(&job, why).await });
            }
            Inbound::Moved { node, at_ms } => {
                // Recorded before the next delivery is taken in.
                self.work.node_moved(&node, at_ms).await;
                let work = self.work.clone();
                self.work
                    .tracker
                    .spawn(async move { work.unanswered(&job, IgnoreReason::NoAction).await });
            }
        }
    }

    /// A delivery parsed: what it asks, and the job holding its copy.
    fn job(
        self: &Arc<Self>,
        session: u64,
        identity: String,
        delivery: Delivery,
        sealed: Option<Sealed>,
    ) -> (Inbound, Delivered) {
        let legacy_identity = Some(identity::legacy(&identity::Parts::of(&delivery)));
        let received_ms = crate::clock::now_ms();
        let (mut inbound, source) = self.reader.read(&delivery.data, delivery.exchange.as_str());
        // A sealed command was issued no later than it was sealed: an issue
        // time header set later is not taken.
        let issued_ms = super::stamp::issued_ms(&delivery.properties, received_ms)
            .min(sealed.map_or(u64::MAX, |s| s.sealed_at));
        if let Inbound::Work(req) = &mut inbound {
            req.issued_ms.get_or_insert(issued_ms);
        }
        let (dead_letter, span) = match &inbound {
            Inbound::Work(request) => (false, request.span()),
            Inbound::Invalid(done) => (true, done.span()),
            Inbound::Ignore(_) | Inbound::Moved { .. } => (false, tracing::Span::none()),
        };
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
            tracked: Arc::new(Tracked::new(session, delivery.acker, dead_letter, span)),
            deadline: deadline::of(&delivery.properties, received_ms),
            body: delivery.data,
            properties: delivery.properties,
            redelivered: delivery.redelivered,
            received_ms,
            sealed_until: sealed.map(|s| s.until),
            seal_key: sealed.map_or(0, |s| s.key),
        };
        (inbound, job)
    }

    /// Whether the copy `tracked` holds came through a connection now gone:
    /// the broker gives that message to another consumer (possibly another
    /// process of the host), so it counts as delivered twice.
    fn copy_gone(&self, tracked: &Tracked<Acker>) -> bool {
        let live = self.link.borrow().as_ref().map(|l| l.session);
        tracked.session().is_some_and(|s| Some(s) != live)
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

    fn hold(&self) -> BoxFuture<'_, bool> {
        Box::pin(self.dispatcher.hold(self))
    }

    fn give_back(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.give_back(self))
    }

    fn caught_up(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.caught_up())
    }

    fn slowed(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.slowed(self))
    }

    fn answer<'a>(&'a self, done: &'a Completion) -> BoxFuture<'a, bool> {
        Box::pin(self.dispatcher.answer(done, self))
    }

    fn finish(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.finish(&self.identity, &self.tracked))
    }

    /// Acknowledges a message that needs no answer (a lost acknowledgement
    /// only means the message comes back and is ignored again).
    fn unanswered(&self, _why: IgnoreReason) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some((_, acker)) = self.tracked.take_acker() {
                let _ = settle::settle(acker, false).await;
            }
            self.dispatcher
                .pending
                .forget(&self.identity, &self.tracked);
        })
    }
}
