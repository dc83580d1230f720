//! The pipeline for one node: source -> verify -> inspect -> cache -> link.
//! It knows nothing of AMQP or HTTP serving: the broker layer, the one-shot
//! CLI and the tests all call [`Pipeline::handle`] and get a [`Completion`].
//!
//! This file holds the request-level API and the order of a request's steps
//! (prepare, deployed, cleanup; cache hits, digests, node links); making a
//! new master is in `fetch`, converting while downloading in `stream`, the
//! cache housekeeping in `keeper`.

use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::image::inspect;
use crate::messages::{Action, CacheOutcome, Completion, InstanceInfo, Options};
use crate::metrics::Metrics;
use crate::node::NodeUuid;
use crate::sources::{Fetcher, Source};
use crate::store::cache::{self, Cache, Master, MasterMeta};
use crate::store::checksum::{Algo, ChecksumSpec, Expected, parse_checksum_file};
use crate::store::fsutil;
use crate::store::link::NodeLinks;
use crate::store::lock::Locks;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

mod fetch;
mod keeper;
mod stream;

use fetch::MasterFetch;
use keeper::Keeper;

/// Everything needed to serve nodes on this conductor host.
pub struct Pipeline {
    config: Config,
    http_url: String,
    cache: Cache,
    links: NodeLinks,
    node_locks: Locks,
    fetcher: Fetcher,
    metrics: Arc<Metrics>,
}

/// A request as the pipeline sees it, whatever carried it.
#[derive(Debug, Clone)]
pub struct Request {
    /// What to do.
    pub action: Action,
    /// The node UUID as received (validated by the pipeline).
    pub node_uuid: String,
    /// Command `request_id` or notification `message_id`.
    pub request_id: Option<String>,
    /// Ironic's `instance_info` (prepare only).
    pub instance_info: InstanceInfo,
    /// Per-request overrides.
    pub options: Options,
    /// A cleanup inferred from a notification that is only wanted when the
    /// node has files here (stray cleaning/available transitions of nodes
    /// this worker never prepared are not answered).
    pub only_if_prepared: bool,
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
        )?;
        let node_locks = Locks::new(config.pxe.images_path.join(".locks"))?;
        Ok(Pipeline {
            http_url: config.http_url(),
            fetcher: Fetcher::new(&config)?,
            config,
            cache,
            links,
            node_locks,
            metrics,
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
        let removed = cache.temporaries + self.links.remove_stale_temps()?;
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
    pub fn has_node_files(&self, node: &str) -> bool {
        NodeUuid::parse(node).is_ok_and(|n| {
            self.links.symlink_path(&n).symlink_metadata().is_ok()
                || self.links.node_dir(&n).exists()
        })
    }

    /// Applies the cache policy (see `eviction`), reclaiming at least
    /// `amount` bytes if it can (blocking: file-system work).
    pub fn clean_cache(
        &self,
        amount: u64,
        all_unused: bool,
        dry_run: bool,
    ) -> Result<crate::store::eviction::Report> {
        self.keeper().clean(amount, all_unused, dry_run)
    }

    /// Refreshes the cache and link gauges from the directories (blocking).
    pub fn refresh_gauges(&self) {
        self.keeper().refresh_cache_gauges();
        self.metrics
            .active_links
            .set(self.links.count_published() as i64);
    }

    /// The masters in the cache, oldest-used first.
    pub fn cache_entries(&self) -> Result<Vec<crate::store::eviction::Entry>> {
        crate::store::eviction::list(&self.cache)
    }

    /// The cache housekeeping, to run on a blocking thread.
    fn keeper(&self) -> Keeper {
        Keeper {
            cache: self.cache.clone(),
            policy: self.config.eviction_policy(),
            metrics: self.metrics.clone(),
        }
    }

    /// Runs cache housekeeping on a blocking thread, so the async threads
    /// keep serving images and messages (statvfs, listing, unlinks).
    async fn off_thread<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Keeper) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let keeper = self.keeper();
        blocking(move || work(&keeper)).await
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
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
        if req.action == Action::Prepare {
            // Credentials in the URL never leave in an event, nor a source
            // too long to be one.
            done.image_source = req
                .instance_info
                .image_source
                .as_deref()
                .filter(|s| s.len() <= crate::sources::MAX_URL_LEN)
                .map(crate::config::redact_url);
        }
        let result = match NodeUuid::parse(&req.node_uuid) {
            Err(e) => Err(e),
            Ok(node) => {
                done.node_uuid = Some(node.to_string());
                match req.action {
                    Action::Prepare => self.prepare(&node, req, &mut done).await,
                    Action::Deployed => self.release(&node, false, false).await,
                    Action::Cleanup => self.release(&node, true, req.only_if_prepared).await,
                    Action::Unknown => Err(Error::new(ErrorCode::InvalidMessage, "unknown action")),
                }
            }
        };
        if matches!(result, Ok(Released::Stray)) {
            return None;
        }
        if let Err(e) = result {
            tracing::warn!(error = %e, "request failed");
            done = done.failed(&e);
        }
        done.duration_ms = started.elapsed().as_millis() as u64;
        Some(done)
    }

    /// deployed: withdraw the URL and the node's link; cleanup: also remove
    /// the node's directory. Doing it twice changes nothing. With
    /// `only_if_prepared`, a node without files here is left alone (decided
    /// under the node lock).
    async fn release(
        &self,
        node: &NodeUuid,
        whole_dir: bool,
        only_if_prepared: bool,
    ) -> Result<Released> {
        let _node = self.node_locks.acquire(node.as_str()).await?;
        if only_if_prepared && !self.has_node_files(node.as_str()) {
            return Ok(Released::Stray);
        }
        if self.links.unpublish(node)? {
            self.metrics.active_links.dec();
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
        self.refresh_cache_gauges().await;
        Ok(Released::Done)
    }

    async fn prepare(
        &self,
        node: &NodeUuid,
        req: &Request,
        done: &mut Completion,
    ) -> Result<Released> {
        let info = &req.instance_info;
        let href = info
            .image_source
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::InvalidMessage,
                    "instance_info.image_source is required",
                )
            })?;
        let source = Source::parse(href, &self.config)?;
        // `<id>` and `glance://<id>` are one image: recorded by its id.
        let href = match &source {
            Source::Glance(id) => id.as_str(),
            _ => href,
        };
        let mut info = info.clone();
        self.complete_from_glance(&source, &mut info).await?;
        let info = &info;
        let spec = ChecksumSpec::from_fields(
            info.image_checksum.as_deref(),
            info.image_os_hash_algo.as_deref(),
            info.image_os_hash_value.as_deref(),
        )?;
        let mode = info
            .image_download_source
            .as_deref()
            .unwrap_or(&self.config.agent.image_download_source);
        match (mode, &source) {
            ("swift", _) => {
                return Err(Error::new(
                    ErrorCode::SourceNotAllowed,
                    "image_download_source=swift is not handled by this worker",
                ));
            }
            ("http", Source::Http(_)) => {
                return self
                    .pass_through(&source, href, spec, done)
                    .await
                    .map(|()| Released::Done);
            }
            ("local" | "http", _) => {}
            (other, _) => {
                return Err(Error::new(
                    ErrorCode::InvalidMessage,
                    format!("unknown image_download_source {other:?}"),
                ));
            }
        }
        let expected = match spec {
            None => None,
            Some(spec) => Some(self.resolve_checksum(spec, &source).await?),
        };
        let force_raw = req
            .options
            .force_raw
            .unwrap_or(self.config.default.force_raw_images)
            && req
                .options
                .stream_raw
                .unwrap_or(self.config.agent.stream_raw_images)
            && info.is_whole_disk();
        let name = cache::master_name(href, force_raw);
        let want_sha512 = expected.as_ref().is_some_and(|e| e.algo == Algo::Sha512);

        let _node = self.node_locks.acquire(node.as_str()).await?;
        let _master = self.cache.lock(&name).await?;
        let cached = match self.cache.load(&name).filter(|m| m.meta.source == href) {
            Some(m) => Some(
                self.complete_digests(&name, m, expected.as_ref(), want_sha512)
                    .await?,
            ),
            None => None,
        }
        .filter(|m| matches_expected(&m.meta, expected.as_ref()));
        // `_hold` keeps a new master linked (st_nlink > 1) until the node
        // links it, so no sweeper of unlinked files removes it in between.
        let (master, outcome, _hold) = match cached {
            // The node already links this verified master: a repeated event.
            Some(m) if self.links.disk_is(node, &m.path) => (m, CacheOutcome::Hit, None),
            Some(m) if expected.is_some() || self.is_fresh(&source, &m.meta).await? => {
                (m, CacheOutcome::Hit, None)
            }
            _ => {
                let job = MasterFetch {
                    source: &source,
                    href,
                    name: &name,
                    expected: expected.as_ref(),
                    sha512: want_sha512,
                    force_raw,
                    info,
                };
                let (m, hold) = self.fetch_master(&job).await?;
                (m, CacheOutcome::Miss, Some(hold))
            }
        };
        if outcome == CacheOutcome::Hit {
            // Declared format and policy are checked on every request, not
            // only when the master was made.
            let format =
                inspect::Format::from_name(&master.meta.source_format).ok_or_else(|| {
                    Error::new(ErrorCode::Internal, "cache sidecar names an unknown format")
                })?;
            inspect::check_format(
                format,
                info.image_disk_format.as_deref(),
                &self.config.conductor.permitted_image_formats,
            )?;
        }
        let linked_here = !self.links.disk_is(node, &master.path);
        if linked_here {
            let (links, node, path) = (self.links.clone(), node.clone(), master.path.clone());
            blocking(move || links.link_disk(&node, &path)).await?;
        }
        match self.links.publish(node) {
            Ok(true) => self.metrics.active_links.inc(),
            Ok(false) => {}
            Err(e) => {
                // The link made for this prepare would keep its master from
                // ever being evicted.
                if linked_here {
                    let _ = self.links.remove_disk(node);
                }
                return Err(e);
            }
        }
        if outcome == CacheOutcome::Miss {
            self.after_growth().await;
            self.refresh_cache_gauges().await;
        }
        tracing::info!(cache = ?outcome, master = %master.path.display(), "prepared");

        let meta = &master.meta;
        done.image_url = Some(format!(
            "{}/{}/{}",
            self.http_url, self.config.deploy.http_image_subdir, node
        ));
        done.image_checksum = Some(meta.md5.clone());
        let (algo, value) = match (&meta.sha512, want_sha512) {
            (Some(v), true) => ("sha512", v.clone()),
            _ => ("sha256", meta.sha256.clone()),
        };
        done.image_os_hash_algo = Some(algo.into());
        done.image_os_hash_value = Some(value);
        done.image_disk_format = Some(meta.disk_format.clone());
        done.image_size = Some(meta.size);
        done.converted = Some(meta.converted);
        done.cache = Some(outcome);
        Ok(Released::Done)
    }

    /// Computes from the master the digests its sidecar lacks and this
    /// request needs (the expected algorithm over the source bytes when the
    /// master is those very bytes; SHA-512 of the served bytes), instead of
    /// downloading again, and records them.
    async fn complete_digests(
        &self,
        name: &str,
        mut master: Master,
        expected: Option<&Expected>,
        want_sha512: bool,
    ) -> Result<Master> {
        let meta = &master.meta;
        let source_missing = expected
            .map(|e| e.algo)
            .filter(|&algo| source_digest(meta, algo).is_none() && meta.served_as_fetched());
        let served_missing = (want_sha512 && meta.sha512.is_none()).then_some(Algo::Sha512);
        let mut learnt = false;
        let mut missing: Vec<Algo> = [source_missing, served_missing]
            .into_iter()
            .flatten()
            .collect();
        missing.dedup();
        for algo in missing {
            let path = master.path.clone();
            let hex = blocking(move || cache::hash_file(&path, algo)).await?;
            tracing::info!(%algo, "computed a missing digest from the cached master");
            let meta = &mut master.meta;
            if meta.served_as_fetched() {
                set_source_digest(meta, algo, hex.clone());
            }
            if algo == Algo::Sha512 && (served_missing.is_some() || meta.served_as_fetched()) {
                meta.sha512 = Some(hex);
            }
            learnt = true;
        }
        if learnt {
            let (cache, name, meta) = (self.cache.clone(), name.to_string(), master.meta.clone());
            blocking(move || cache.write_meta(&name, &meta)).await?;
        }
        Ok(master)
    }

    /// For a Glance image, what Glance says completes `instance_info`: its
    /// checksums when Ironic passed none, its disk format when none was
    /// declared (Ironic copies both from Glance when it deploys).
    async fn complete_from_glance(&self, source: &Source, info: &mut InstanceInfo) -> Result<()> {
        let Source::Glance(id) = source else {
            return Ok(());
        };
        let meta = self.fetcher.glance().image(id).await?;
        let no_checksum = info.image_checksum.is_none()
            && info.image_os_hash_algo.is_none()
            && info.image_os_hash_value.is_none();
        if no_checksum {
            if meta.os_hash_algo.is_some() && meta.os_hash_value.is_some() {
                info.image_os_hash_algo = meta.os_hash_algo;
                info.image_os_hash_value = meta.os_hash_value;
            } else {
                info.image_checksum = meta.checksum;
            }
        }
        if info.image_disk_format.is_none() {
            info.image_disk_format = meta.disk_format;
        }
        Ok(())
    }

    /// `image_download_source = http` with an http(s) source: the agent
    /// downloads from the source itself, after a HEAD check, as Ironic does.
    async fn pass_through(
        &self,
        source: &Source,
        href: &str,
        spec: Option<ChecksumSpec>,
        done: &mut Completion,
    ) -> Result<()> {
        let stat = self.fetcher.stat(source).await?;
        let expected = match spec {
            None => None,
            Some(spec) => Some(self.resolve_checksum(spec, source).await?),
        };
        done.image_url = Some(href.to_string());
        if let Some(e) = expected {
            if e.algo == Algo::Md5 {
                done.image_checksum = Some(e.hex);
            } else {
                done.image_os_hash_algo = Some(e.algo.name().into());
                done.image_os_hash_value = Some(e.hex);
            }
        }
        done.image_size = stat.size;
        done.converted = Some(false);
        Ok(())
    }

    async fn resolve_checksum(&self, spec: ChecksumSpec, source: &Source) -> Result<Expected> {
        match spec {
            ChecksumSpec::Value(e) => Ok(e),
            ChecksumSpec::Url { url, algo } => {
                let text = self.fetcher.fetch_text(&url).await?;
                parse_checksum_file(&text, &source.file_name(), algo)
            }
        }
    }

    /// Ironic's staleness rule for a master without an expected checksum: the
    /// source must say when it changed, and not after the master was fetched.
    async fn is_fresh(&self, source: &Source, meta: &MasterMeta) -> Result<bool> {
        let stat = self.fetcher.stat(source).await?;
        Ok(stat
            .last_modified
            .is_some_and(|t| cache::unix_secs(t) <= meta.fetched_at))
    }

    /// After the cache grew: enforce the size limit and TTL (the new master is
    /// protected by its link to the node, made before this runs).
    async fn after_growth(&self) {
        if let Err(e) = self.off_thread(|k| k.clean(0, false, false)).await {
            tracing::warn!(error = %e, "cache clean-up failed");
        }
    }

    async fn refresh_cache_gauges(&self) {
        let _ = self
            .off_thread(|k| {
                k.refresh_cache_gauges();
                Ok(())
            })
            .await;
    }
}

/// True when the master's recorded source digest equals what Ironic expects
/// (or nothing is expected).
fn matches_expected(meta: &MasterMeta, expected: Option<&Expected>) -> bool {
    let Some(e) = expected else { return true };
    source_digest(meta, e.algo) == Some(e.hex.as_str())
}

/// The recorded digest of the source bytes for `algo`, when computed.
fn source_digest(meta: &MasterMeta, algo: Algo) -> Option<&str> {
    match algo {
        Algo::Md5 => meta.source_md5.as_deref(),
        Algo::Sha256 => meta.source_sha256.as_deref(),
        Algo::Sha512 => meta.source_sha512.as_deref(),
    }
}

fn set_source_digest(meta: &mut MasterMeta, algo: Algo, hex: String) {
    match algo {
        Algo::Md5 => meta.source_md5 = Some(hex),
        Algo::Sha256 => meta.source_sha256 = Some(hex),
        Algo::Sha512 => meta.source_sha512 = Some(hex),
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
