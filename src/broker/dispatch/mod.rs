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
//! This file holds the owner of one worker's deliveries ([`Dispatcher`]),
//! which routes each delivery to the part that deals with it, and a
//! delivery as the shared dispatch's [`Carrier`] ([`Delivered`]), whose
//! methods hand each step to that part. Around it, one concern a file,
//! each a type that holds only what its methods use:
//!
//! * `read`: how a delivery reads (a command or a notification) and
//!   whether its seal lets it be worked (`Reader`);
//! * `link`: the live connection jobs answer and settle through, replaced
//!   as connections come and go (`Links`);
//! * `intake`: when the backlog of a new connection is taken in
//!   (`Intake`);
//! * `pending`: the jobs awaiting acknowledgement by delivery identity,
//!   and what a redelivered copy of one becomes (`Pending`);
//! * `adopt`: a redelivered copy adopted by the job of its identity, or
//!   settled at once (`Adopter`);
//! * `early_ack`: a copy acknowledged before the broker's consumer timeout
//!   (`ConsumerTimeout`);
//! * `slow_lane`: a slow download's delivery, or one of a download job
//!   that waits, parked in the ledger and acknowledged early, and parked
//!   deliveries read back after a restart (`SlowLane`);
//! * `refuse`: a command whose seal does not hold, dead-lettered unworked
//!   (`Refuser`);
//! * `defer`: a prepare put back at the tail of the queue, and work not
//!   started given back that way when the worker stops (`Requeue`);
//! * `settle`: the answer published, then the copy acknowledged or
//!   dead-lettered (`Settler`), and how any copy is settled.
//!
//! The parts that need the same state share it (the connection, the jobs
//! awaiting acknowledgement, the consumer timeout, the reader); the files
//! use each other in one direction (`tests/architecture.rs`).

mod adopt;
mod defer;
mod early_ack;
mod intake;
mod link;
mod pending;
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
use crate::messages::{Completion, IgnoreReason, Request};
use crate::seal::Sealed;
use futures_util::future::BoxFuture;
use lapin::Acker;
use lapin::message::Delivery;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// The connection jobs see (`link`), as the session that opened it holds
/// it: to hand deliveries in and to hear when an operation on it failed.
pub(super) use link::Link;

/// The owner of one worker's deliveries for its whole life (connections
/// come and go under it): it routes each delivery to the part that deals
/// with it, and holds what routing itself uses; each part holds only what
/// its own work uses, shared where two use the same (the connection, the
/// jobs awaiting acknowledgement).
pub(super) struct Dispatcher {
    /// The shared dispatch: where work goes, and every job's task.
    work: Arc<Dispatch>,
    /// How deliveries read (commands, notifications, seals).
    reader: Arc<read::Reader>,
    /// The live connection, replaced as connections come and go.
    links: Arc<link::Links>,
    /// Jobs not yet acknowledged, by delivery identity (`identity::key`).
    pending: Arc<pending::Pending<Acker>>,
    /// The broker's consumer timeout in force: a delivery still
    /// unacknowledged three quarters of it after it arrived is acknowledged
    /// early.
    consumer_timeout: Arc<early_ack::ConsumerTimeout>,
    /// Deliveries being dispatched, and when the last one was.
    intake: intake::Intake,
    /// A redelivered copy adopted by the job of its identity.
    adopter: adopt::Adopter,
    /// Commands whose seal does not hold, dead-lettered.
    refuser: refuse::Refuser,
    /// Prepares deferred, and work not started given back, to the queue.
    requeue: defer::Requeue,
    /// Deliveries parked and acknowledged early, read back after a crash.
    slow_lane: slow_lane::SlowLane,
    /// Answers published, then copies acknowledged or dead-lettered.
    settler: settle::Settler,
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
        let queue = super::Topology::new(&settings.host, amqp).queue;
        let reader = Arc::new(read::Reader::new(settings, &queue));
        let links = Arc::new(link::Links::new());
        let pending = Arc::new(pending::Pending::new(pending::ANSWERED_MEMORY));
        let timeout = early_ack::ConsumerTimeout::configured(amqp.consumer_timeout);
        let consumer_timeout = Arc::new(timeout);
        let (metrics, tracker) = (work.metrics().clone(), work.tracker.clone());
        Dispatcher {
            adopter: adopt::Adopter::new(
                pending.clone(),
                consumer_timeout.clone(),
                metrics.clone(),
                tracker.clone(),
            ),
            refuser: refuse::Refuser::new(metrics, tracker),
            requeue: defer::Requeue::new(
                queue,
                links.clone(),
                reader.clone(),
                pending.clone(),
                work.clone(),
            ),
            slow_lane: slow_lane::SlowLane::new(pending.clone(), work.clone()),
            settler: settle::Settler::new(links.clone(), pending.clone(), work.clone()),
            intake: intake::Intake::new(),
            work,
            reader,
            links,
            pending,
            consumer_timeout,
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
    /// Its backlog is to be taken in before a prepare starts.
    pub(super) fn connected(&self, publisher: Publisher) -> Link {
        let link = self.links.connected(publisher);
        self.intake.backlog_begins();
        link
    }

    /// The connection of `session` is gone: jobs wait for the next one.
    pub(super) fn disconnected(&self, session: u64) {
        self.links.disconnected(session);
    }

    /// The broker closed a channel over its consumer timeout and said which
    /// value it enforces: from now on early acknowledgements follow it.
    pub(in crate::broker) fn broker_consumer_timeout(&self, enforced: Duration) {
        self.consumer_timeout.broker_enforces(enforced);
    }

    /// Runs again the deliveries that processes of this host (gone now)
    /// acknowledged before answering them (see `parked`): each as a
    /// redelivered copy, so the ledger's claims and answers apply.
    pub(in crate::broker) async fn resume_parked(self: &Arc<Self>) {
        for resumed in self.slow_lane.resumable(&self.reader).await {
            let (request, job) = Delivered::resumed(self.clone(), resumed);
            job.tracked.span.in_scope(|| {
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

    /// Routes a delivery of connection `session`: a redelivered copy of a
    /// known job is adopted, unusable and ignored messages are settled at
    /// once, work goes to its node's FIFO queue, and a notification of a
    /// node's move is recorded in its ledger before the next delivery is
    /// taken in (see `Intake::caught_up`). Each copy held is
    /// acknowledged early once it has been unacknowledged for three
    /// quarters of the consumer timeout, queued or running.
    pub(super) async fn dispatch(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let _taking_in = self.intake.taking_in();
        self.route(session, delivery).await;
    }

    /// [`Dispatcher::dispatch`], counted as being dispatched.
    async fn route(self: &Arc<Self>, session: u64, delivery: Delivery) {
        let received = Instant::now();
        let identity = identity::key(&identity::Parts::of(&delivery));
        let adopter = &self.adopter;
        if delivery.redelivered && adopter.adopt(session, &identity, &delivery.acker, received) {
            return;
        }
        let sealed = match self.reader.admit(&delivery) {
            Ok(sealed) => sealed,
            Err(why) => return self.refuser.refuse(delivery, why),
        };
        let (inbound, job) = self.job(session, identity, delivery, sealed);
        match inbound {
            Inbound::Work(request) => {
                self.pending.remember(&job.identity, job.tracked.clone());
                self.consumer_timeout.arm(&job.tracked, session, received);
                self.work.submit(Job {
                    request: *request,
                    carrier: Box::new(job),
                });
            }
            Inbound::Invalid(done) => {
                self.pending.remember(&job.identity, job.tracked.clone());
                let span = job.tracked.span.clone();
                let dead_letter = async move {
                    let settler = &job.dispatcher.settler;
                    settler.dead_letter(&job, &done).await;
                };
                self.work.tracker.spawn(dead_letter.instrument(span));
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
}

impl Delivered {
    /// A parked delivery run again: its delivery was acknowledged, so it
    /// holds no copy; it counts as redelivered. With the request it asks.
    fn resumed(dispatcher: Arc<Dispatcher>, r: slow_lane::Resumed) -> (Box<Request>, Delivered) {
        let span = r.request.span();
        let parked = r.parked;
        let job = Delivered {
            dispatcher,
            source: r.source,
            reply_to: parked.reply_to,
            correlation_id: parked.correlation_id,
            identity: r.key,
            legacy_identity: None,
            exchange: parked.exchange,
            routing_key: parked.routing_key,
            issued_ms: parked.issued_ms,
            resumed: true,
            tracked: Arc::new(Tracked::accepted(span)),
            deadline: parked.deadline,
            body: r.body,
            properties: lapin::BasicProperties::default(),
            redelivered: true,
            received_ms: parked.received_ms,
            // Checked when it was received; never deferred again.
            sealed_until: None,
            seal_key: 0,
        };
        (r.request, job)
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
        // A copy whose connection is gone is given to another consumer too.
        let gone = self.dispatcher.links.gone(self.tracked.session());
        Some(DeliveryKey {
            key: self.identity.clone(),
            legacy: self.legacy_identity.clone(),
            redelivered: self.redelivered || gone,
        })
    }

    fn defer(&self) -> BoxFuture<'_, Deferral> {
        Box::pin(self.dispatcher.requeue.defer(self))
    }

    fn hold(&self) -> BoxFuture<'_, bool> {
        Box::pin(self.dispatcher.slow_lane.hold(self))
    }

    fn give_back(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.requeue.give_back(self))
    }

    fn caught_up(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.intake.caught_up())
    }

    fn slowed(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.slow_lane.slowed(self))
    }

    fn answer<'a>(&'a self, done: &'a Completion) -> BoxFuture<'a, bool> {
        Box::pin(self.dispatcher.settler.answer(done, self))
    }

    fn finish(&self) -> BoxFuture<'_, ()> {
        Box::pin(
            self.dispatcher
                .settler
                .finish(&self.identity, &self.tracked),
        )
    }

    /// Acknowledges a message that needs no answer (a lost acknowledgement
    /// only means the message comes back and is ignored again).
    fn unanswered(&self, _why: IgnoreReason) -> BoxFuture<'_, ()> {
        Box::pin(self.dispatcher.settler.unanswered(self))
    }
}
