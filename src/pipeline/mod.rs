//! The pipeline for one node: source -> verify -> inspect -> cache -> link.
//! It knows nothing of AMQP or HTTP serving: the broker layer, the one-shot
//! CLI and the tests all call [`Pipeline::handle`] and get a [`Completion`].
//!
//! This file holds the request-level API: the dispatch of every action,
//! `deployed` and `cleanup`. Its modules, each using only those listed
//! after it (`tests/architecture.rs` holds them to one direction):
//!
//! * a request: preparing a node (`prepare`), caching an image for no node
//!   (`warm`), `http` mode's answers, passed through or validated first
//!   (`validated`);
//! * what those share: the image a request names, resolved before any lock
//!   (`resolve`); its master under the locks, the cached one when it fits
//!   or a new one (`obtain`);
//! * making a new master: download, verify, decompress, inspect, convert,
//!   commit (`fetch`); the other conductors' workers first (`peers`); each
//!   download attempt's file, sink and conversion (`attempt`); converting a
//!   qcow2 while it downloads (`stream`);
//! * below them all: whether a master's record fits a request, a pure
//!   function (`verdict`); what lets bytes stand as a master, the inspection
//!   and the commit (`admit`); one master to obtain (`job`); the cache
//!   housekeeping (`keeper`); compressing masters in the background
//!   (`gzip`); the order of a node's commands, from its
//!   ledger (`order`).

use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil;
use crate::messages::{Action, Completion, Request};
use crate::metrics::Metrics;
use crate::node::NodeUuid;
use crate::sources::Fetcher;
use crate::store::cache::Cache;
use crate::store::ledger::Ledger;
use crate::store::link::NodeLinks;
use crate::store::lock::Locks;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

mod admit;
mod attempt;
mod fetch;
mod gzip;
mod job;
mod keeper;
mod obtain;
mod order;
pub mod peers;
mod prepare;
mod resolve;
mod stream;
mod validated;
mod verdict;
mod warm;

pub use crate::store::ledger::{Shelf, Turn};

/// Everything needed to serve nodes on this conductor host.
pub struct Pipeline {
    config: Config,
    http_url: String,
    cache: Cache,
    links: NodeLinks,
    node_locks: Locks,
    /// Per-node records of moves and answers (see `order`).
    ledger: Ledger,
    fetcher: Fetcher,
    metrics: Arc<Metrics>,
    /// The other conductors' workers, once `serve` turned them on.
    peers: std::sync::OnceLock<peers::Peers>,
    /// Masters being written that the peer listener streams as they grow.
    live: Arc<crate::peers::live::LiveMasters>,
    /// Masters waiting to be compressed, once `serve` turned it on.
    compressions: std::sync::OnceLock<Arc<gzip::Compressions>>,
}

impl Pipeline {
    /// Opens the directories (removing nothing: read-only commands build a
    /// pipeline too; see [`Pipeline::recover`]). Transfers and evictions are
    /// recorded in `metrics`.
    pub fn new(config: Config, metrics: Arc<Metrics>) -> Result<Pipeline> {
        let cache = Cache::open(&config.pxe.instance_master_path)?;
        let links = NodeLinks::open(
            &config.pxe.images_path,
            &config.deploy.http_root,
            &config.deploy.http_image_subdir,
            cache.owner(),
            config.cache.shared_dirs()?,
        )?;
        let node_locks = Locks::new(config.pxe.images_path.join(".locks"))?;
        let ledger = Ledger::open(config.pxe.images_path.join(".ledger"))?;
        Ok(Pipeline {
            http_url: config.http_url(),
            fetcher: Fetcher::new(&config)?,
            config,
            cache,
            links,
            node_locks,
            ledger,
            metrics,
            peers: std::sync::OnceLock::new(),
            live: Arc::default(),
            compressions: std::sync::OnceLock::new(),
        })
    }

    /// Start-up recovery for commands that write (`serve`, one-shot
    /// prepare, `cache clean`): removes temporaries whose writer is gone
    /// (never those of a process still running), brings a master directory
    /// of the earlier layout into the current one, and says clearly when
    /// the master directory and `images_path` are on different file systems
    /// (node images are then copies, not hard links).
    pub fn recover(&self) -> Result<()> {
        let cache = self.cache.recover()?;
        let removed = cache.temporaries + self.links.remove_stale_temps()? + self.ledger.expire();
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

    /// True when the node has a published link or a cached image here.
    fn has_node_files(&self, node: &NodeUuid) -> bool {
        self.links.symlink_path(node).symlink_metadata().is_ok()
            || self.links.node_dir(node).exists()
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
            self.ledger.expire();
        }
        self.keeper().clean(amount, all_unused, dry_run)
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
        let expired = crate::store::expiry::NodeFiles {
            links: &self.links,
            cache: &self.cache,
            locks: &self.node_locks,
        }
        .expire(std::time::Duration::from_secs(ttl))?;
        self.metrics
            .cache
            .node_files_expired
            .inc_by(expired.len() as u64);
        Ok(expired.len())
    }

    /// Refreshes the cache and link gauges from the directories (blocking).
    pub fn refresh_gauges(&self) {
        self.keeper().refresh_cache_gauges();
        self.metrics
            .cache
            .active_links
            .set(self.links.count_published() as i64);
    }

    /// The masters in the cache, oldest-used first.
    pub fn cache_entries(&self) -> Result<Vec<crate::store::eviction::Entry>> {
        crate::store::eviction::list(&self.cache)
    }

    /// Handles one request and always answers with a completion event. Every
    /// log line inside carries the node, request id and action.
    /// `only_if_prepared` is not looked at: see [`Pipeline::handle_unless_stray`].
    pub async fn handle(&self, req: &Request) -> Completion {
        let mut req = req.clone();
        req.only_if_prepared = false;
        match self.handle_unless_stray(&req).await {
            Some(done) => done,
            None => Completion::new(req.action, Some(req.node_uuid.clone()), req.request_id, ""),
        }
    }

    /// Handles one request; `None` when it is a cleanup wanted only if the
    /// node was prepared here (`only_if_prepared`) and the node has no files
    /// here. That is decided under the node lock, so a prepare of the node
    /// in progress in any process sharing the directories is waited for
    /// and then cleaned up, never missed.
    pub async fn handle_unless_stray(&self, req: &Request) -> Option<Completion> {
        let span = tracing::error_span!(
            "request",
            node = %req.node_uuid,
            request_id = req.request_id.as_deref().unwrap_or(""),
            action = req.action.as_str()
        );
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
        let mut done = Completion::new(
            req.action,
            Some(req.node_uuid.clone()),
            req.request_id.clone(),
            &self.config.default.host,
        );
        if matches!(req.action, Action::Prepare | Action::Warm) {
            // Credentials in the URL never leave in an event, nor a source
            // too long to be one.
            done.image_source = req
                .instance_info
                .image_source
                .as_deref()
                .filter(|s| s.len() <= crate::messages::MAX_URL_LEN)
                .map(crate::secrets::redact_url);
        }
        let result = match node_of(req) {
            Ok(node) => {
                done.node_uuid = node.as_ref().map(NodeUuid::to_string);
                self.run(req, node.as_ref(), &mut done).await
            }
            Err(e) => Err(e),
        };
        if matches!(result, Ok(Released::Stray)) {
            return None;
        }
        done.duration_ms = started.elapsed().as_millis() as u64;
        // One line per action answered, inside the request's span (node,
        // request id, action): what to grep for a node.
        match result {
            Err(e) => {
                tracing::warn!(error = %e, duration_ms = done.duration_ms, "request failed");
                done = done.failed(&e);
            }
            Ok(_) => tracing::info!(
                duration_ms = done.duration_ms,
                image_url = done.image_url.as_deref().unwrap_or(""),
                "request done"
            ),
        }
        Some(done)
    }

    /// Does what `req` asks of `node` (none for a warm).
    async fn run(
        &self,
        req: &Request,
        node: Option<&NodeUuid>,
        done: &mut Completion,
    ) -> Result<Released> {
        match (req.action, node) {
            (Action::Warm, _) => Box::pin(self.warm(req, done))
                .await
                .map(|()| Released::Done),
            (Action::Prepare, Some(node)) => self.prepare(node, req, done).await,
            (Action::Deployed, Some(node)) => self.release(node, req, false).await,
            (Action::Cleanup, Some(node)) => self.release(node, req, true).await,
            _ => Err(Error::new(ErrorCode::InvalidMessage, "unknown action")),
        }
    }

    /// deployed: withdraw the URL and the node's link; cleanup: also remove
    /// the node's directory. Doing it twice changes nothing. With
    /// `only_if_prepared`, a node without files here is left alone (decided
    /// under the node lock). Either way the node's ledger records that it
    /// moved on, so an older prepare still queued is refused (`order`).
    async fn release(&self, node: &NodeUuid, req: &Request, whole_dir: bool) -> Result<Released> {
        let only_if_prepared = whole_dir && req.only_if_prepared;
        let mut node_lock = self.node_locks.acquire(node.as_str()).await?;
        self.note_released(node, req).await;
        // The node's lock file goes with its files (when it never had any
        // here, or has none left); a failed removal keeps it.
        if only_if_prepared && !self.has_node_files(node) {
            node_lock.remove_file();
            return Ok(Released::Stray);
        }
        if self.links.unpublish(node)? {
            self.metrics.cache.active_links.dec();
        }
        // Removing a node's directory and listing the cache touch the disk:
        // off the async threads.
        let (links, owned) = (self.links.clone(), node.clone());
        blocking(move || {
            if whole_dir {
                links.remove_node_dir(&owned)?;
            } else {
                links.remove_disk(&owned)?;
            }
            Ok(())
        })
        .await?;
        if whole_dir || !self.has_node_files(node) {
            node_lock.remove_file();
        }
        self.refresh_cache_gauges().await;
        Ok(Released::Done)
    }
}

/// The node `req` is about, parsed once here: `None` for a warm, which
/// names an image, not a node.
fn node_of(req: &Request) -> Result<Option<NodeUuid>> {
    match req.action {
        Action::Warm => Ok(None),
        _ => NodeUuid::parse(&req.node_uuid).map(Some),
    }
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
