//! Requests in, answers out, whatever carried them: the part of taking
//! work that both transports share (the broker's AMQP deliveries and the
//! JSON-RPC listener's calls).
//!
//! * one FIFO queue per node (a warm's per image source), so a node's
//!   requests run in order, whichever transport brought them;
//! * the prepare slots and the slow lane that bound downloads at once;
//! * a request's deadline, checked before its work starts;
//! * running it through the pipeline (`work`), retrying a release on a
//!   transient file-system error;
//! * the answers given lately, by node and `request_id` (`answers`), so a
//!   request answered on one transport is answered again, not worked again,
//!   when it also comes on the other, and `status` can tell them;
//! * claiming each delivery in the node's ledger when its work starts, so
//!   a copy of it delivered to another process of the host meanwhile waits
//!   for that answer, and recording each answer there once the transport
//!   delivered it, under the key the transport gives it.
//!
//! What a transport does around that (acknowledging, putting a deferred
//! prepare back, publishing or returning the answer) is its [`Carrier`].
//!
//! # This folder
//!
//! Must not know AMQP or HTTP: a transport is a `Carrier`.

pub(crate) mod answers;
mod work;

/// Where a transport keeps the work it accepted before answering it.
pub(crate) use crate::pipeline::Shelf;
pub(crate) use answers::{AnswerKey, Answers, Lookup};

use crate::messages::{Completion, IgnoreReason, Request};
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use futures_util::future::BoxFuture;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

/// The transports requests come by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// RabbitMQ: commands and Ironic's notifications (`broker/`).
    Amqp,
    /// The JSON-RPC listener (`rpc/`).
    JsonRpc,
}

/// What a prepare that found every prepare slot busy became.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deferral {
    /// The transport took it back (the broker queue holds a copy): this
    /// job ends here.
    TakenBack,
    /// The transport cannot take it back: it waits for a slot.
    Wait,
}

/// The key under which a transport's delivery is recorded as answered in
/// the node's ledger (so a copy of it delivered again, to any process of
/// the host, is not answered twice), and whether this copy was delivered
/// before.
#[derive(Debug, Clone)]
pub(crate) struct DeliveryKey {
    /// The ledger key (opaque to this layer).
    pub(crate) key: String,
    /// The key an earlier version of the transport recorded the same
    /// delivery under, looked up (never written) so a copy answered just
    /// before an upgrade is still recognised.
    pub(crate) legacy: Option<String>,
    /// The transport delivered this copy before (a redelivery), or may
    /// deliver it again elsewhere (the broker: its connection is gone).
    pub(crate) redelivered: bool,
}

/// A transport's side of one job: what it does around the shared work.
/// Each method is called at most once per job, except `answer`.
pub(crate) trait Carrier: Send + Sync {
    /// Which transport brought the request.
    fn transport(&self) -> Transport;
    /// The metrics label of where the request came from (`command`,
    /// `notification`, `json-rpc`).
    fn source(&self) -> &'static str;
    /// When the sender stops waiting (ms since the epoch), if it does.
    fn deadline(&self) -> Option<u64>;
    /// The ledger key of this delivery, if the transport redelivers.
    fn delivery_key(&self) -> Option<DeliveryKey>;
    /// Every prepare slot stayed busy: take the prepare back, or let it
    /// wait.
    fn defer(&self) -> BoxFuture<'_, Deferral>;
    /// Resolves once the transport has taken in the messages it already
    /// holds that came after this one (the broker: every delivery received
    /// is dispatched, a node's move recorded), so that a node's later
    /// transition already queued counts before a prepare takes effect.
    fn caught_up(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// The request's download is slow and left the prepare slots for the
    /// slow lane (the broker acknowledges it early).
    fn slowed(&self) -> BoxFuture<'_, ()>;
    /// Delivers the answer; false when it could not (the worker stops):
    /// the answer is then not recorded as given.
    fn answer<'a>(&'a self, done: &'a Completion) -> BoxFuture<'a, bool>;
    /// The answer was delivered and recorded: settle the delivery.
    fn finish(&self) -> BoxFuture<'_, ()>;
    /// The request needs no answer (`why`, counted): settle it.
    fn unanswered(&self, why: IgnoreReason) -> BoxFuture<'_, ()>;
}

/// One request and its transport's side.
pub(crate) struct Job {
    /// What to do.
    pub(crate) request: Request,
    /// Who to answer, and how.
    pub(crate) carrier: Box<dyn Carrier>,
}

/// What bounds the dispatch, from the configuration the service hands it.
#[derive(Debug, Clone)]
pub(crate) struct Bounds {
    /// `[DEFAULT]host`: the conductor the answers name.
    pub(crate) host: String,
    /// `[amqp]prefetch`: requests taken at once; a quarter of them (at
    /// least one) stays free of prepares.
    pub(crate) prefetch: u16,
    /// `[source]slow_downloads`: the width of the slow lane.
    pub(crate) slow_downloads: usize,
}

/// State shared by both transports for the life of the process.
pub(crate) struct Dispatch {
    /// `[DEFAULT]host`: the conductor the answers name.
    host: String,
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    /// Per-node FIFO queues (see [`order_key`]).
    nodes: Mutex<HashMap<String, mpsc::UnboundedSender<Job>>>,
    /// Prepares (and warms) running at once: fewer than the broker's
    /// prefetch, so cleanups and `deployed` always find a delivery slot
    /// free of downloads.
    prepare_slots: Arc<tokio::sync::Semaphore>,
    /// Places in the slow lane: prepares whose download is slow give back
    /// their prepare slot (see `work`).
    slow_lane: Arc<tokio::sync::Semaphore>,
    /// The answers given lately, and the requests under way.
    answers: Answers,
    /// Every job's task, so a stop can wait for them.
    pub(crate) tracker: TaskTracker,
}

/// Prepare slots for a prefetch: a quarter of the deliveries (at least one)
/// stays free for other actions.
fn prepare_slots(prefetch: u16) -> usize {
    let prefetch = usize::from(prefetch.max(1));
    prefetch.saturating_sub((prefetch / 4).max(1)).max(1)
}

impl Dispatch {
    /// The dispatch of `pipeline`'s requests for conductor `bounds.host`,
    /// bounded as `bounds` says.
    pub(crate) fn new(pipeline: Arc<Pipeline>, metrics: Arc<Metrics>, bounds: Bounds) -> Dispatch {
        let slots = prepare_slots(bounds.prefetch);
        Dispatch {
            host: bounds.host,
            pipeline,
            metrics,
            nodes: Mutex::new(HashMap::new()),
            prepare_slots: Arc::new(tokio::sync::Semaphore::new(slots)),
            slow_lane: Arc::new(tokio::sync::Semaphore::new(bounds.slow_downloads)),
            answers: Answers::default(),
            tracker: TaskTracker::new(),
        }
    }

    /// The conductor host the answers name.
    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// The pipeline requests run through.
    pub(crate) fn pipeline(&self) -> &Arc<Pipeline> {
        &self.pipeline
    }

    /// The metrics every transport counts in.
    pub(crate) fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The answers given lately and the requests under way.
    pub(crate) fn answers(&self) -> &Answers {
        &self.answers
    }

    /// Puts `job` at the tail of its node's FIFO queue, starting the
    /// queue's task when the node has none.
    pub(crate) fn submit(self: &Arc<Self>, job: Job) {
        let node = order_key(&job.request);
        if let Some(key) = AnswerKey::of(&job.request) {
            self.answers.begin(key);
        }
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
                    d.work(job).await;
                }
                let mut nodes = d.nodes.lock().unwrap_or_else(|p| p.into_inner());
                if rx.is_empty() {
                    nodes.remove(&node);
                    return;
                }
            }
        });
    }

    /// Counts a request that needs no answer and lets its carrier settle it.
    pub(crate) async fn unanswered(&self, carrier: &dyn Carrier, why: IgnoreReason) {
        self.metrics.ignored(why);
        self.metrics.consumed(carrier.source(), "none", "ignored");
        carrier.unanswered(why).await;
    }
}

/// The key of the FIFO queue a request waits in: its node (canonical), so
/// a node's commands run in order; a warm, which names no node, waits
/// behind the warms of the same image source (two warms of one image never
/// download it twice at once here, the master lock serialises across
/// processes) and never behind a node's commands (a key with a space is
/// never a UUID).
pub(crate) fn order_key(request: &Request) -> String {
    match &request.node {
        Some(node) => node.to_string(),
        None => format!(
            "warm {}",
            request
                .instance_info
                .image_source
                .as_deref()
                .unwrap_or("")
                .trim()
        ),
    }
}
