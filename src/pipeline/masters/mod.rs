//! The masters: obtaining the one verified image a request is served from,
//! owned by one component. It knows no node: the pipeline above links what
//! it obtains. [`Masters`] is the thin owner of its parts, each a type
//! beside its methods that holds only what they use and is built here from
//! only its configuration sections; its own methods (this file) compose
//! them for a prepare, a warm and `http` mode's answers. Its modules, each
//! using only those listed after it (`tests/architecture.rs` holds them to
//! one direction):
//!
//! * `http` mode's answers, passed through or validated first, a pure
//!   function of what was found (`validated`);
//! * what requests share: the image a request names, resolved before any
//!   lock by the [`Resolver`] (`resolve`); its master under the master
//!   lock, the cached one when it fits or a new one, by the
//!   [`obtain::Obtainer`] (`obtain`);
//! * making a new master: download, verify, decompress, inspect, convert,
//!   commit, by the [`fetch::Maker`] (`fetch`); the other conductors'
//!   workers first, the [`peers::PeerSource`] (`peers`), a peer's master
//!   received, checked and adopted by the [`peer_bytes::PeerReceiver`] it
//!   holds (`peer_bytes`); each download attempt's file, sink and
//!   conversion, the [`attempt::Attempts`] (`attempt`); converting a qcow2
//!   while it downloads, the [`stream::StreamConverter`] the attempts hold
//!   (`stream`);
//! * below them all: whether a master's record fits a request, a pure
//!   function (`verdict`); what lets bytes stand as a master, the inspection
//!   and the commit, the [`admit::Admission`] (`admit`); one master to
//!   obtain (`job`); the cache housekeeping, the [`keeper::Keeper`]
//!   (`keeper`); compressing masters in the background, the
//!   [`gzip::Compressor`] (`gzip`).

use super::{Request, blocking};
use crate::config::Config;
use crate::error::Result;
use crate::messages::{CacheOutcome, Completion};
use crate::metrics::Metrics;
use crate::sources::peer::PeerFetcher;
use crate::sources::{Fetcher, Source};
use crate::store::cache::{Cache, Master};
use crate::store::checksum::ChecksumSpec;
use std::sync::Arc;

mod admit;
mod attempt;
mod fetch;
mod gzip;
mod job;
mod keeper;
mod obtain;
mod peer_bytes;
pub mod peers;
mod resolve;
mod stream;
mod validated;
mod verdict;

pub(super) use job::MasterFetch;
pub(super) use obtain::{Obtained, fill_image};
pub(super) use resolve::{Mode, Resolver};

/// The master cache and the parts that fill it (see the module).
pub struct Masters {
    /// The master cache (its directory, locks and records).
    cache: Cache,
    /// The source client, for a pass-through's HEAD check.
    fetcher: Fetcher,
    /// What a request's image is, decided before any lock.
    resolver: Resolver,
    /// A request's master, cached or made.
    obtainer: obtain::Obtainer,
    /// The other conductors' workers, a source of masters once `serve`
    /// turned them on.
    peers: Arc<peers::PeerSource>,
    /// The download attempts, whose conversions the waiting peers follow.
    attempts: Arc<attempt::Attempts>,
    /// The cache housekeeping, with the policy and bounds of its sections.
    keeper: keeper::Keeper,
    /// The background compression of masters (`[http] gzip`).
    compressor: gzip::Compressor,
}

impl Masters {
    /// Opens the master cache (removing nothing) and builds each part from
    /// its sections of `config`; transfers and evictions are recorded in
    /// `metrics`.
    pub(super) fn open(config: Arc<Config>, metrics: Arc<Metrics>) -> Result<Masters> {
        let cache = Cache::open(&config.pxe.instance_master_path)?;
        let keeper =
            keeper::Keeper::new(cache.clone(), &config.pxe, &config.convert, metrics.clone());
        let fetcher = Fetcher::new(&config)?;
        let rules = stream::ConvertRules::new(&config.convert, config.raw_image_growth_factor());
        let converter =
            stream::StreamConverter::new(&config.convert, rules, keeper.clone(), metrics.clone());
        let attempts = Arc::new(attempt::Attempts::new(
            fetcher.clone(),
            keeper.clone(),
            metrics.clone(),
            &config.source,
            converter,
        ));
        let admission = Arc::new(admit::Admission::new(
            cache.clone(),
            fetcher.clone(),
            &config.conductor,
            &config.convert,
        ));
        let receiver = peer_bytes::PeerReceiver::new(
            attempts.clone(),
            admission.clone(),
            metrics.clone(),
            &config.source,
        );
        let peers = Arc::new(peers::PeerSource::new(
            &config.default.host,
            &config.source,
            cache.clone(),
            admission.clone(),
            receiver,
            metrics.clone(),
        ));
        let maker = fetch::Maker::new(
            peers.clone(),
            attempts.clone(),
            admission.clone(),
            keeper.clone(),
            rules,
            metrics,
        );
        Ok(Masters {
            resolver: Resolver::new(
                fetcher.clone(),
                &config.agent,
                &config.conductor,
                config.default.force_raw_images,
            ),
            obtainer: obtain::Obtainer::new(cache.clone(), admission, maker),
            fetcher,
            compressor: gzip::Compressor::new(&config.http, keeper.clone()),
            keeper,
            cache,
            peers,
            attempts,
        })
    }

    /// What requests' images are (the sources resolved, the checksums and
    /// the masters' names decided).
    pub(super) fn resolver(&self) -> &Resolver {
        &self.resolver
    }

    /// The master cache (its directory, locks and records).
    pub(super) fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The master of `job` (see [`obtain::Obtainer::obtain`]), to run
    /// under its master lock ([`Masters::locked`]).
    pub(in crate::pipeline) async fn obtain_master(
        &self,
        job: &MasterFetch<'_>,
        as_fetched: bool,
        linked: &(dyn Fn(&Master) -> bool + Sync),
    ) -> Result<Obtained> {
        self.obtainer.obtain(job, as_fetched, linked).await
    }

    /// Runs `work` (a prepare's, a warm's or a validation's) under master
    /// `name`'s lock (see [`obtain::Obtainer::locked`]).
    pub(in crate::pipeline) async fn locked<T>(
        &self,
        name: &str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.obtainer.locked(name, work).await
    }

    /// Caches `req`'s image as a prepare would and fills `done` with what a
    /// prepare answers of it, without a URL: the very master a prepare of
    /// that image with the same options would use (same name, conversion
    /// rule, checksum and format checks), so the first deploy of it is a
    /// cache hit. It links nothing for any node and touches no node's files
    /// or ledger: the master stays unlinked, and Ironic's eviction policy
    /// may take it again like any unlinked master; a warm that finds it
    /// cached counts as a use of it (its last use is now). In
    /// `image_download_source = http` mode nothing is cached: the source is
    /// checked as a prepare checks it (reachable, its checksum resolved;
    /// downloaded and inspected with `conductor_always_validates_images`,
    /// whose verified bytes are cached as a prepare caches them), and
    /// `cache` says `pass_through` (`hit`/`miss` of the validated bytes
    /// when validating).
    pub(in crate::pipeline) async fn warm(
        &self,
        req: &Request,
        done: &mut Completion,
    ) -> Result<()> {
        let image = Box::pin(self.resolver.resolve_image(req, done)).await?;
        match image.mode {
            Mode::Cache => {}
            Mode::PassThrough => {
                let checked = self.pass_through(&image.source, &image.href, image.spec, done);
                Box::pin(checked).await?;
                done.image_url = None;
                done.cache = Some(CacheOutcome::PassThrough);
                return Ok(());
            }
            Mode::Validate => {
                let outcome = Box::pin(self.validate_image(image, req, done)).await?;
                done.image_url = None;
                done.cache = Some(outcome);
                return Ok(());
            }
        }
        let expected =
            Box::pin(self.resolver.expected_of(image.spec.clone(), &image.source)).await?;
        let (name, force_raw) = self.resolver.master_of(&image, req);
        let job = image.job(&name, expected.as_ref(), force_raw, req);
        let warmed = async {
            let obtained = self.obtain_master(&job, false, &|_| false).await?;
            match obtained.outcome {
                // Linking nothing, a hit would not count as a use for eviction.
                CacheOutcome::Hit => self.cache.mark_used(&obtained.master.path),
                // Enforce the size limit and TTL while the hold (and the
                // master lock) keep the new master from being the one evicted.
                CacheOutcome::Miss => self.after_growth().await,
                CacheOutcome::PassThrough => {}
            }
            Ok(obtained)
        };
        let Obtained {
            master, outcome, ..
        } = self.locked(&name, warmed).await?;
        tracing::info!(cache = ?outcome, master = %master.path.display(), "warmed");
        self.compress_later(&name);
        fill_image(&master.meta, job.served, outcome, done);
        Ok(())
    }

    /// `image_download_source = http` with an http(s) source: the agent
    /// downloads from the source itself, after a HEAD check, as Ironic does
    /// (the answer: [`validated::pass_through`]).
    pub(in crate::pipeline) async fn pass_through(
        &self,
        source: &Source,
        href: &str,
        spec: Option<ChecksumSpec>,
        done: &mut Completion,
    ) -> Result<()> {
        let stat = self.fetcher.stat(source).await?;
        let expected = match spec {
            None => None,
            Some(spec) => Some(self.resolver.resolve_checksum(spec, source).await?),
        };
        validated::pass_through(href, expected, stat.size, done);
        Ok(())
    }

    /// `http` mode with validation (`[conductor]
    /// conductor_always_validates_images`, as Ironic 39's conductor does):
    /// the source's own bytes downloaded, verified and inspected (or found
    /// so in the cache, kept as a master of their own, never converted and
    /// linked to no node), then its own URL answered
    /// ([`validated::validated`]); whether they were found in the cache.
    pub(in crate::pipeline) async fn validate_image(
        &self,
        image: resolve::ImagePlan,
        req: &Request,
        done: &mut Completion,
    ) -> Result<CacheOutcome> {
        let expected =
            Box::pin(self.resolver.expected_of(image.spec.clone(), &image.source)).await?;
        let name = validated::master_name(&image.href);
        // The master may serve a prepare later: its digests as a prepare's.
        let job = image.job(&name, expected.as_ref(), false, req);
        // Only the source's own bytes will do: the agent downloads them.
        let obtained = self.obtain_master(&job, true, &|_| false);
        let Obtained {
            master, outcome, ..
        } = Box::pin(self.locked(&name, obtained)).await?;
        validated::validated(&image.href, expected, &master.meta, done);
        tracing::info!(format = %master.meta.source_format, "inspected, the agent downloads from the source");
        Ok(outcome)
    }

    /// Turns the peers on: misses ask `directory` first and fetch through
    /// `fetcher`, and conversions while downloading are offered to the
    /// workers waiting for them (`serve` does this when `[peers]` is
    /// configured).
    pub fn enable_peers(&self, directory: Arc<dyn peers::PeerDirectory>, fetcher: PeerFetcher) {
        self.peers.enable(directory, fetcher);
        self.attempts.publish_to(self.peers.live_masters());
    }

    /// The masters this process is writing, for the peer listener to
    /// stream as they grow.
    pub fn live_masters(&self) -> Arc<crate::peers::live::LiveMasters> {
        self.peers.live_masters()
    }

    /// The size master `name` will have, when the peer listener streams it
    /// as it is written here.
    pub fn live_size(&self, name: &str) -> Option<u64> {
        self.peers.live_size(name)
    }

    /// What this worker offers of master `name` to the other workers: its
    /// sidecar's facts, when the master is committed and its sidecar
    /// describes it.
    pub fn peer_offer(&self, name: &str) -> Option<crate::peers::wire::OfferedMaster> {
        self.peers.peer_offer(name)
    }

    /// Turns compression on (`serve` does this with `[http] gzip =
    /// static`).
    pub fn start_compressing(&self) {
        self.compressor.start();
    }

    /// Where the image server finds the compressed forms of masters, when
    /// compression is on (`[http] gzip = static`).
    pub fn gzip_dir(&self) -> Option<std::path::PathBuf> {
        self.compressor.dir()
    }

    /// Asks for master `name` to be compressed (see
    /// [`gzip::Compressor::later`]).
    pub(in crate::pipeline) fn compress_later(&self, name: &str) {
        self.compressor.later(name);
    }

    /// Applies the cache policy (see `eviction`), reclaiming at least
    /// `amount` bytes if it can (blocking: file-system work).
    pub(in crate::pipeline) fn clean(
        &self,
        amount: u64,
        all_unused: bool,
        dry_run: bool,
    ) -> Result<crate::store::eviction::Report> {
        self.keeper.clean(amount, all_unused, dry_run)
    }

    /// Refreshes the cache gauges from the directory (blocking).
    pub(in crate::pipeline) fn refresh_gauges(&self) {
        self.keeper.refresh_cache_gauges();
    }

    /// After the cache grew: enforce the size limit and TTL, and refresh
    /// the cache gauges (see [`keeper::Keeper::after_growth`]).
    pub(in crate::pipeline) async fn after_growth(&self) {
        self.keeper.after_growth().await;
    }

    /// Refreshes the cache gauges from the directory, off the async
    /// threads.
    pub(in crate::pipeline) async fn refresh_cache_gauges(&self) {
        self.keeper.refresh_gauges_off_thread().await;
    }
}

#[cfg(test)]
impl Masters {
    /// The masters of a worker on host `host` whose cache is `dir`, built
    /// as `serve` builds them: the parts' unit tests take theirs from it.
    pub(super) fn for_test(dir: &std::path::Path, host: &str) -> Masters {
        let flags = [
            format!("pxe.instance_master_path={}", dir.display()),
            format!("DEFAULT.host={host}"),
        ];
        let files = crate::config::Files::default();
        let config = Config::load_from(&files, &[], &flags).unwrap();
        Masters::open(Arc::new(config), Arc::new(Metrics::new())).unwrap()
    }
}
