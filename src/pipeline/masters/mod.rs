//! The masters: obtaining the one verified image a request is served from,
//! owned by one component. It holds the master cache, the sources, the
//! other conductors' workers and the background compression, and knows no
//! node: the pipeline above links what it obtains. Its modules, each using
//! only those listed after it (`tests/architecture.rs` holds them to one
//! direction):
//!
//! * a request without a node: caching an image for no node (`warm`),
//!   `http` mode's answers, passed through or validated first
//!   (`validated`);
//! * what requests share: the image a request names, resolved before any
//!   lock by the [`Resolver`] (`resolve`); its master under the master
//!   lock, the cached one when it fits or a new one (`obtain`);
//! * making a new master: download, verify, decompress, inspect, convert,
//!   commit (`fetch`); the other conductors' workers first, the
//!   [`peers::PeerSource`] (`peers`), a peer's master received, checked and
//!   adopted by the [`peer_bytes::PeerReceiver`] it holds (`peer_bytes`); each
//!   download attempt's file, sink and conversion, the [`attempt::Attempts`]
//!   (`attempt`); converting a qcow2 while it downloads, the
//!   [`stream::StreamConverter`] the attempts hold (`stream`);
//! * below them all: whether a master's record fits a request, a pure
//!   function (`verdict`); what lets bytes stand as a master, the inspection
//!   and the commit (`admit`); one master to obtain (`job`); the cache
//!   housekeeping (`keeper`); compressing masters in the background
//!   (`gzip`).

use super::{Request, blocking};
use crate::config::Config;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::sources::Fetcher;
use crate::sources::peer::PeerFetcher;
use crate::store::cache::Cache;
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
mod warm;

pub(super) use job::MasterFetch;
pub(super) use obtain::{Obtained, fill_image};
pub(super) use resolve::{Mode, Resolver};

/// The master cache and everything that fills it (see the module).
pub struct Masters {
    config: Arc<Config>,
    cache: Cache,
    fetcher: Fetcher,
    /// What a request's image is, decided before any lock.
    resolver: Resolver,
    /// What lets bytes stand as a master, and their commit.
    admission: Arc<admit::Admission>,
    metrics: Arc<Metrics>,
    /// The other conductors' workers, a source of masters once `serve`
    /// turned them on.
    peers: peers::PeerSource,
    /// The cache housekeeping, with the policy and bounds of its sections.
    keeper: keeper::Keeper,
    /// The download attempts: each one's file, sink and conversion.
    attempts: Arc<attempt::Attempts>,
    /// The background compression of masters (`[http] gzip`).
    compressor: gzip::Compressor,
}

impl Masters {
    /// Opens the master cache (removing nothing); transfers and evictions
    /// are recorded in `metrics`.
    pub(super) fn open(config: Arc<Config>, metrics: Arc<Metrics>) -> Result<Masters> {
        let cache = Cache::open(&config.pxe.instance_master_path)?;
        let keeper = keeper::Keeper::new(cache.clone(), &config, metrics.clone());
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
        let peers = peers::PeerSource::new(
            &config.default.host,
            &config.source,
            cache.clone(),
            admission.clone(),
            receiver,
            metrics.clone(),
        );
        Ok(Masters {
            attempts,
            resolver: Resolver::new(
                fetcher.clone(),
                &config.agent,
                &config.conductor,
                config.default.force_raw_images,
            ),
            admission,
            fetcher,
            compressor: gzip::Compressor::new(&config.http, keeper.clone()),
            keeper,
            cache,
            config,
            metrics,
            peers,
        })
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

    /// What requests' images are (the sources resolved, the checksums and
    /// the masters' names decided).
    pub(super) fn resolver(&self) -> &Resolver {
        &self.resolver
    }

    /// The master cache (its directory, locks and records).
    pub(super) fn cache(&self) -> &Cache {
        &self.cache
    }
}
