//! A request as the pipeline sees it, whatever carried it (a command, a
//! notification, the one-shot CLI): what the broker layer and the CLI build
//! and the pipeline runs.

use crate::messages::{Action, InstanceInfo, NodeInfo, Options};
use crate::node::NodeUuid;
use std::sync::Arc;

/// A request as the pipeline sees it.
#[derive(Debug, Clone)]
pub struct Request {
    /// What to do.
    pub action: Action,
    /// The node, read once where the message was (a command, a
    /// notification, the command line): a node UUID that does not read is
    /// answered there and never becomes a request. `None` only for a
    /// `warm`, which names an image, not a node.
    pub node: Option<NodeUuid>,
    /// Command `request_id` or notification `message_id`.
    pub request_id: Option<String>,
    /// Ironic's `instance_info` (prepare only).
    pub instance_info: InstanceInfo,
    /// Per-request overrides.
    pub options: Options,
    /// What the command says of the node beyond `instance_info`.
    pub node_info: NodeInfo,
    /// A cleanup inferred from a notification that is only wanted when the
    /// node has files here (stray cleaning/available transitions of nodes
    /// this worker never prepared are not answered).
    pub only_if_prepared: bool,
    /// Raised when the request's download turns out slow (see
    /// [`SlowSignal`]).
    pub slow: SlowSignal,
    /// Its turn among the worker's download slots, taken only when it
    /// downloads (see [`DownloadTurn`]).
    pub turn: DownloadTurn,
    /// When the request was issued, in ms since the epoch: the sender's
    /// stamp on a command, a notification's `timestamp`, else when it
    /// arrived; `None` is now (one-shot commands). Orders it against the
    /// node's cleanups (see the pipeline's `order`).
    pub issued_ms: Option<u64>,
    /// Inferred from an Ironic notification (whose prepare is not started
    /// past `[notifications]max_age`).
    pub notified: bool,
}

impl Request {
    /// The request as a command's JSON body (`schemas/command.v1.json`),
    /// as the CLI sends it on either transport; a warm names no node.
    pub fn command_body(&self) -> serde_json::Value {
        let mut body = serde_json::json!({"action": self.action.as_str()});
        if let Some(node) = &self.node {
            body["node_uuid"] = node.as_str().into();
        }
        if let Some(id) = &self.request_id {
            body["request_id"] = id.clone().into();
        }
        if matches!(self.action, Action::Prepare | Action::Warm) {
            body["instance_info"] = serde_json::to_value(&self.instance_info).unwrap_or_default();
            body["options"] = serde_json::to_value(self.options).unwrap_or_default();
        }
        body
    }

    /// The node as every log line about the request names it (its `node`
    /// field): the canonical UUID, empty for a warm.
    pub fn node_str(&self) -> &str {
        self.node.as_ref().map_or("", NodeUuid::as_str)
    }

    /// The span of every line written about the request, whichever
    /// transport brought it and whoever works on it.
    pub fn span(&self) -> tracing::Span {
        super::request_span(self.node_str(), self.request_id.as_deref(), self.action)
    }

    /// [`Request::span`] for work that may already run inside it (the
    /// pipeline, called by the dispatcher that entered it): no span when a
    /// request's span is current, so that every line carries the
    /// request's fields once, not once per layer.
    pub fn span_once(&self) -> tracing::Span {
        match super::in_request_span() {
            true => tracing::Span::none(),
            false => self.span(),
        }
    }
}

/// How a slow download tells whoever runs its request that it no longer
/// needs its share of the worker's download slots: the broker layer then
/// moves it to its slow lane, so a few slow sources never hold every slot.
/// Requests run without a listener (one-shot commands) ignore it.
#[derive(Debug, Clone, Default)]
pub struct SlowSignal(Option<Arc<tokio::sync::Notify>>);

impl SlowSignal {
    /// A signal and the notification its listener waits on.
    pub fn new() -> (SlowSignal, Arc<tokio::sync::Notify>) {
        let notify = Arc::new(tokio::sync::Notify::new());
        (SlowSignal(Some(notify.clone())), notify)
    }

    /// The download is slow (raised once per download).
    pub(crate) fn raise(&self) {
        if let Some(n) = &self.0 {
            n.notify_one();
        }
    }
}

/// A request's turn among the worker's download slots: the pipeline takes
/// it right before it downloads, so that only downloads wait for one (a
/// cache hit, a pass-through, a cleanup never do). Requests run without a
/// runner that bounds downloads (one-shot commands) have it at once.
#[derive(Clone, Default)]
pub struct DownloadTurn(Option<Arc<dyn Turns>>);

/// What hands out download turns (the worker's dispatch), so that the
/// pipeline knows none of how they are bounded.
pub trait Turns: Send + Sync {
    /// Resolves once the request may download; an error (its deadline
    /// passed while it waited) is the request's answer.
    fn take(&self) -> futures_util::future::BoxFuture<'_, crate::error::Result<()>>;
}

impl DownloadTurn {
    /// A turn handed out by `turns`.
    pub fn new(turns: Arc<dyn Turns>) -> DownloadTurn {
        DownloadTurn(Some(turns))
    }

    /// Waits for the turn to download (at once without a runner).
    pub(crate) async fn take(&self) -> crate::error::Result<()> {
        match &self.0 {
            Some(turns) => turns.take().await,
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for DownloadTurn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Some(_) => "DownloadTurn(bounded)",
            None => "DownloadTurn(free)",
        })
    }
}
