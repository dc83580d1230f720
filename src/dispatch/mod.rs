//! Requests in, answers out, whatever carried them: the part of taking
//! work that both transports share (the broker's AMQP deliveries and the
//! JSON-RPC listener's calls).
//!
//! * one FIFO queue per node (a warm's per image source), so a node's
//!   requests run in order, whichever transport brought them;
//! * the download slots (`turn`: taken by a download, not by a request
//!   that downloads nothing) and the slow lane that bound downloads at
//!   once; a download job that waits sets its delivery aside;
//! * a request's deadline, checked before its work starts and while it
//!   waits for a download slot;
//! * on stop, work not started given back to its transport;
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
mod fifo;
mod turn;
mod work;

/// Where a transport keeps the work it accepted before answering it.
pub(crate) use crate::pipeline::Shelf;
pub(crate) use answers::{AnswerKey, Answers, Lookup};

use crate::error::Result;
use crate::messages::{Completion, IgnoreReason, Request};
use crate::metrics::Metrics;
use crate::node::NodeUuid;
use crate::pipeline::Pipeline;
use fifo::NodeQueue;
use futures_util::future::BoxFuture;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio_util::task::TaskTracker;

/// The transports requests come by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// RabbitMQ: commands and Ironic's notifications (`broker/`).
    Amqp,
    /// The JSON-RPC listener (`rpc/`).
    JsonRpc,
}

/// What a download job waiting for a download slot, whose carrier could
/// not set it aside (`hold`), became.
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
    /// The job waits for a download slot and could not be set aside
    /// (`hold`): take it back, or let it wait.
    fn defer(&self) -> BoxFuture<'_, Deferral>;
    /// The job waits (for a download slot, for a master another job
    /// makes) and needs its delivery no more: the transport keeps it
    /// another way (the broker: recorded in the ledger, then acknowledged)
    /// so that the delivery serves other work; true when the job holds no
    /// delivery now.
    fn hold(&self) -> BoxFuture<'_, bool>;
    /// The worker stops before the job started (nothing downloaded): give
    /// it back (the broker: a copy back on the queue, for another worker;
    /// JSON-RPC: a cast kept for the next process, a call told). The job
    /// ends with no answer.
    fn give_back(&self) -> BoxFuture<'_, ()>;
    /// Resolves once the transport has taken in the messages it already
    /// holds that came after this one (the broker: every delivery received
    /// is dispatched, a node's move recorded), so that a node's later
    /// transition already queued counts before a prepare takes effect.
    fn caught_up(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// The request's download is slow and left the download slots for the
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
    /// `[amqp]prefetch`: requests taken at once; downloads get three
    /// quarters of it (at least one stays free of them) as download slots.
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
    nodes: Mutex<HashMap<String, NodeQueue>>,
    /// Downloads (of prepares and warms) running at once: fewer than the
    /// broker's prefetch, so cleanups, `deployed` and cache hits always
    /// find a delivery slot free of downloads (see `turn`).
    download_slots: Arc<tokio::sync::Semaphore>,
    /// Places in the slow lane: prepares whose download is slow give back
    /// their download slot (see `work`).
    slow_lane: Arc<tokio::sync::Semaphore>,
    /// Raised when the worker stops: no job starts from then on.
    stopping: tokio_util::sync::CancellationToken,
    /// The answers given lately, and the requests under way.
    answers: Answers,
    /// Every job's task, so a stop can wait for them.
    pub(crate) tracker: TaskTracker,
}

/// Download slots for a prefetch: a quarter of the deliveries (at least
/// one) stays free of downloads.
fn download_slots(prefetch: u16) -> usize {
    let prefetch = usize::from(prefetch.max(1));
    prefetch.saturating_sub((prefetch / 4).max(1)).max(1)
}

impl Dispatch {
    /// The dispatch of `pipeline`'s requests for conductor `bounds.host`,
    /// bounded as `bounds` says.
    pub(crate) fn new(pipeline: Arc<Pipeline>, metrics: Arc<Metrics>, bounds: Bounds) -> Dispatch {
        let slots = download_slots(bounds.prefetch);
        Dispatch {
            host: bounds.host,
            pipeline,
            metrics,
            nodes: Mutex::new(HashMap::new()),
            download_slots: Arc::new(tokio::sync::Semaphore::new(slots)),
            slow_lane: Arc::new(tokio::sync::Semaphore::new(bounds.slow_downloads)),
            stopping: tokio_util::sync::CancellationToken::new(),
            answers: Answers::default(),
            tracker: TaskTracker::new(),
        }
    }

    /// The worker stops (SIGTERM): from now on no job starts; those queued,
    /// or waiting for a download slot, are given back to their transport.
    /// Jobs running go on (the transports drain them within
    /// `[amqp]shutdown_grace`).
    pub(crate) fn stop_taking(self: &Arc<Self>) {
        self.stopping.cancel();
        // The jobs queued behind a running one of their node are given back
        // now, in their order, not once that one ends.
        let queues: Vec<_> = {
            let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
            nodes.values().map(|q| q.fifo.clone()).collect()
        };
        for fifo in queues {
            let d = self.clone();
            self.tracker.spawn(async move {
                while let Some(job) = fifo.next() {
                    d.work(job).await;
                }
            });
        }
    }

    /// Whether the worker stops (see [`Dispatch::stop_taking`]).
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.is_cancelled()
    }

    /// The conductor host the answers name.
    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// Keeps the whole delivery `key` (`bytes`, the transport's) on `shelf`
    /// until it is answered: a transport that accepted work before its
    /// answer (a delivery acknowledged early, a JSON-RPC cast) holds the
    /// only copy, which only this record brings back after a crash.
    pub(crate) async fn park(&self, shelf: &Shelf, key: &str, bytes: Vec<u8>) -> Result<()> {
        self.pipeline.order().park_delivery(shelf, key, bytes).await
    }

    /// The delivery `key` parked on `shelf` was answered (or given back):
    /// its record goes.
    pub(crate) async fn unpark(&self, shelf: &Shelf, key: &str) {
        self.pipeline.order().unpark_delivery(shelf, key).await
    }

    /// The deliveries parked on `shelf` by processes of the host that are
    /// gone, now this process's to run: their key and bytes.
    pub(crate) async fn adopt_parked(&self, shelf: &Shelf) -> Vec<(String, Vec<u8>)> {
        self.pipeline.order().adopt_parked(shelf).await
    }

    /// A notification says `node` moved on at `at_ms` without asking for
    /// work: its prepares issued before then are stale from now on.
    pub(crate) async fn node_moved(&self, node: &NodeUuid, at_ms: u64) {
        self.pipeline.order().note_moved(node, at_ms).await
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
            Some(queue) => match queue.put(job) {
                Ok(()) => return,
                Err(job) => *job,
            },
            None => job,
        };
        let queue = NodeQueue::with(job);
        let fifo = queue.fifo.clone();
        nodes.insert(node.clone(), queue);
        let d = self.clone();
        self.tracker.spawn(async move {
            loop {
                while let Some(job) = fifo.next() {
                    d.work(job).await;
                }
                let mut nodes = d.nodes.lock().unwrap_or_else(|p| p.into_inner());
                if fifo.is_empty() {
                    nodes.remove(&node);
                    return;
                }
            }
        });
    }

    /// Whether a cleanup or `deployed` waits in the FIFO queue `key`
    /// (see [`order_key`]).
    fn release_waits(&self, key: &str) -> bool {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        nodes.get(key).is_some_and(|q| q.fifo.release_waits())
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
