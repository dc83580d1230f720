//! The pipeline for one node: source -> verify -> inspect -> cache -> link.
//! It knows nothing of AMQP or HTTP serving: the broker layer, the one-shot
//! CLI and the tests all call [`Pipeline::handle`] and get a [`Completion`].
//!
//! This file holds the request-level API: the dispatch of every action,
//! `deployed` and `cleanup`, over three components that each own their
//! state, each using only those listed after it:
//!
//! * preparing a node: its master obtained, linked and published
//!   (`prepare`);
//! * the masters: obtaining the verified image a request is served from,
//!   and everything a request without a node does (`masters`);
//! * the node's files: link, publish, take back, expire (`nodes`);
//! * the order of a node's commands, from its ledger (`order`).

use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil;
use crate::messages::{Action, CacheOutcome, Completion, InstanceInfo, Request};
use crate::metrics::Metrics;
use crate::node::NodeUuid;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

mod masters;
mod nodes;
mod order;
mod prepare;

pub use crate::store::ledger::{Shelf, Turn};
pub use masters::{Masters, peers};
pub use order::Order;

/// Everything needed to serve nodes on this conductor host: the three
/// components a request goes through.
pub struct Pipeline {
    config: Arc<Config>,
    masters: Masters,
    nodes: nodes::Nodes,
    order: Order,
    metrics: Arc<Metrics>,
}

impl Pipeline {
    /// Opens the directories (removing nothing: read-only commands build a
    /// pipeline too; see [`Pipeline::recover`]). Transfers and evictions are
    /// recorded in `metrics`.
    pub fn new(config: Config, metrics: Arc<Metrics>) -> Result<Pipeline> {
        let config = Arc::new(config);
        let masters = Masters::open(config.clone(), metrics.clone())?;
        let nodes = nodes::Nodes::open(&config, masters.cache(), metrics.clone())?;
        Ok(Pipeline {
            order: Order::open(&config)?,
            config,
            masters,
            nodes,
            metrics,
        })
    }

    /// The masters: where `serve` turns on the peers and compression, and
    /// the peer listener and image server find what they serve.
    pub fn masters(&self) -> &Masters {
        &self.masters
    }

    /// The order of the nodes' commands: what the transports ask before
    /// running a delivery and record after answering it.
    pub fn order(&self) -> &Order {
        &self.order
    }

    /// Start-up recovery for commands that write (`serve`, one-shot
    /// prepare, `cache clean`): removes temporaries whose writer is gone
    /// (never those of a process still running), brings a master directory
    /// of the earlier layout into the current one, and says clearly when
    /// the master directory and `images_path` are on different file systems
    /// (node images are then copies, not hard links).
    pub fn recover(&self) -> Result<()> {
        let cache = self.masters.cache().recover()?;
        let removed = cache.temporaries + self.nodes.remove_stale_temps()? + self.order.expire();
        if removed > 0 {
            tracing::info!(
                removed,
                "removed temporaries left by processes that are gone"
            );
        }
        if cache.sidecars_moved > 0 {
            tracing::info!(
                moved = cache.sidecars_moved,
                "moved cache sidecars of the earlier layout into .meta/"
            );
        }
        let (master, images) = (
            &self.config.pxe.instance_master_path,
            &self.config.pxe.images_path,
        );
        if fsutil::device_of(master) != fsutil::device_of(images) {
            tracing::warn!(
                master = %master.display(),
                images = %images.display(),
                "[pxe]instance_master_path and [pxe]images_path are on different file systems: \
                 node images cannot be hard links and will be full copies of the masters"
            );
        }
        Ok(())
    }

    /// Applies the cache policy (see `eviction`), reclaiming at least
    /// `amount` bytes if it can (blocking: file-system work).
    pub fn clean_cache(
        &self,
        amount: u64,
        all_unused: bool,
        dry_run: bool,
    ) -> Result<crate::store::eviction::Report> {
        if !dry_run {
            self.order.expire();
        }
        self.masters.clean(amount, all_unused, dry_run)
    }

    /// Removes the worker's files of nodes no command asked for within
    /// `[cache]node_files_ttl` (files a conductor takeover left here; see
    /// `store::expiry`), skipping nodes whose lock is held; returns how
    /// many nodes (blocking: file-system work).
    pub fn expire_node_files(&self) -> Result<usize> {
        let ttl = self.config.cache.node_files_ttl;
        if ttl == 0 {
            return Ok(0);
        }
        self.nodes
            .expire(std::time::Duration::from_secs(ttl), self.masters.cache())
    }

    /// Refreshes the cache and link gauges from the directories (blocking).
    pub fn refresh_gauges(&self) {
        self.masters.refresh_gauges();
        self.nodes.refresh_gauge();
    }

    /// The masters in the cache of `config`, oldest-used first, read
    /// without opening the pipeline (which makes its directories): a
    /// listing changes nothing, so anyone who can read may run it, root
    /// included.
    pub fn list_cache(config: &Config) -> Result<Vec<crate::store::eviction::Entry>> {
        crate::store::eviction::list_dir(&config.pxe.instance_master_path)
    }

    /// Handles one request and always answers with a completion event. Every
    /// log line inside carries the node, request id and action.
    /// `only_if_prepared` is not looked at: see [`Pipeline::handle_unless_stray`].
    pub async fn handle(&self, req: &Request) -> Completion {
        let mut req = req.clone();
        req.only_if_prepared = false;
        match self.handle_unless_stray(&req).await {
            Some(done) => done,
            None => Completion::for_request(&req, ""),
        }
    }

    /// Handles one request; `None` when it is a cleanup wanted only if the
    /// node was prepared here (`only_if_prepared`) and the node has no files
    /// here. That is decided under the node lock, so a prepare of the node
    /// in progress in any process sharing the directories is waited for
    /// and then cleaned up, never missed.
    pub async fn handle_unless_stray(&self, req: &Request) -> Option<Completion> {
        let span = req.span_once();
        let gauge = self
            .metrics
            .in_flight
            .with_label_values(&[req.action.as_str()]);
        gauge.inc();
        let done = self.handle_inner(req).instrument(span).await;
        gauge.dec();
        if let Some(done) = &done {
            self.metrics.record(done);
        }
        done
    }

    async fn handle_inner(&self, req: &Request) -> Option<Completion> {
        let started = Instant::now();
        let mut done = Completion::for_request(req, &self.config.default.host);
        done.image_source = echoed_source(req.action, &req.instance_info);
        let result = self.run(req, &mut done).await;
        if matches!(result, Ok(Released::Stray)) {
            return None;
        }
        done.duration_ms = started.elapsed().as_millis() as u64;
        // One line per action answered, inside the request's span (node,
        // request id, action): what to grep for a node.
        match result {
            Err(e) => {
                log_failed(&e, done.duration_ms);
                done = done.failed(&e);
            }
            Ok(_) => tracing::info!(
                duration_ms = done.duration_ms,
                cache = done.cache.map_or("", CacheOutcome::as_str),
                image_url = done.image_url.as_deref().unwrap_or(""),
                "request done"
            ),
        }
        Some(done)
    }

    /// Does what `req` asks of its node (none for a warm).
    async fn run(&self, req: &Request, done: &mut Completion) -> Result<Released> {
        match (req.action, &req.node) {
            (Action::Warm, _) => Box::pin(self.masters.warm(req, done))
                .await
                .map(|()| Released::Done),
            (Action::Prepare, Some(node)) => self.prepare(node, req, done).await,
            (Action::Deployed, Some(node)) => self.release(node, req, false).await,
            (Action::Cleanup, Some(node)) => self.release(node, req, true).await,
            (Action::Unknown, _) => Err(Error::new(ErrorCode::InvalidMessage, "unknown action")),
            // Never built: every reader of a message gives these a node.
            (action, None) => Err(Error::new(
                ErrorCode::InvalidMessage,
                format!("{} names no node", action.as_str()),
            )),
        }
    }

    /// deployed: withdraw the URL and the node's link; cleanup: also remove
    /// the node's directory. Doing it twice changes nothing. With
    /// `only_if_prepared`, a node without files here is left alone (decided
    /// under the node lock). Either way the node's ledger records that it
    /// moved on, so an older prepare still queued is refused (`order`).
    async fn release(&self, node: &NodeUuid, req: &Request, whole_dir: bool) -> Result<Released> {
        let only_if_prepared = whole_dir && req.only_if_prepared;
        let mut node_lock = self.nodes.lock(node).await?;
        self.order.note_released(node, req).await;
        // The node's lock file goes with its files (when it never had any
        // here, or has none left); a failed removal keeps it.
        if only_if_prepared && !self.nodes.has_files(node) {
            node_lock.remove_file();
            return Ok(Released::Stray);
        }
        self.nodes.take_back(node, whole_dir).await?;
        if whole_dir || !self.nodes.has_files(node) {
            node_lock.remove_file();
        }
        self.masters.refresh_cache_gauges().await;
        Ok(Released::Done)
    }

    /// Runs `work` (a prepare's) under `node`'s lock and then master
    /// `name`'s. Lock files stay only while what they guard exists: a
    /// failure that leaves no master, or no files of the node, removes them.
    async fn locked<T>(
        &self,
        node: &NodeUuid,
        name: &str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let mut node_lock = self.nodes.lock(node).await?;
        let result = self.masters.locked(name, work).await;
        if result.is_err() && !self.nodes.has_files(node) {
            node_lock.remove_file();
        }
        result
    }
}

/// The answer to a one-shot request whose node does not read (`err`),
/// from `done` (who asked, the node as given): the command line reads its
/// `--node` itself, before any request, and answers and logs that as a
/// request failing here is answered and logged.
pub fn refused(mut done: Completion, info: &InstanceInfo, err: &Error) -> Completion {
    done.image_source = echoed_source(done.action, info);
    done.span().in_scope(|| log_failed(err, done.duration_ms));
    done.failed(err)
}

/// The line of a request answered with an error (inside its span).
fn log_failed(e: &Error, duration_ms: u64) {
    tracing::warn!(error = %e, duration_ms, "request failed");
}

/// The `image_source` the answer to a prepare or a warm echoes: the source
/// asked for with its credentials masked, none when too long to be a URL
/// (and none for the other actions).
fn echoed_source(action: Action, info: &InstanceInfo) -> Option<String> {
    if !matches!(action, Action::Prepare | Action::Warm) {
        return None;
    }
    info.image_source
        .as_deref()
        .filter(|s| s.len() <= crate::messages::MAX_URL_LEN)
        .map(crate::secrets::redact_url)
}

/// What a request did to the node's files.
enum Released {
    /// The work was done.
    Done,
    /// A cleanup only wanted if the node was prepared here, and it was not.
    Stray,
}

/// Runs blocking file-system work (fsync, copies, hashing) on a blocking
/// thread, so the async threads keep serving images and messages.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::new(ErrorCode::Internal, format!("blocking task: {e}")))?
}
