//! The peers of the pipeline: before a miss goes to the image's source, the
//! other conductors' workers are asked for the master (`PeerDirectory`,
//! which the broker layer implements: the pipeline knows nothing of AMQP),
//! and a cloud-wide claim on the master's name makes one worker download
//! from the source while the others wait for its master and fetch it from
//! that worker.
//!
//! Only the deployment's own workers count: the broker layer drops every
//! query and offer not sealed with the `[peers]` secret. What a holder
//! records is then trusted as far as the deployment is, and no further: an
//! offer stands for a request only when its recorded source checksum is the
//! one Ironic asked for (or, for bytes served as fetched, when the bytes
//! themselves have it); its URL must be a peer listener's at an address the
//! rules allow; among usable offers the bytes are chosen by rule, never by
//! how many offer them. Every digest of the new master (size, MD5, SHA-256,
//! SHA-512) is computed from the bytes received, checked against the
//! holder's record, and the file is inspected as a download is, before it
//! becomes a master (`peer_bytes`, handed the peer fetcher).

use super::Masters;
use super::job::MasterFetch;
use super::peer_bytes::meta_of;
use super::verdict::{self, Verdict};
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil::TempGuard;
use crate::peers::live::LiveMasters;
use crate::peers::wire::{Offer, OfferState, OfferedMaster};
use crate::sources::http_client;
use crate::sources::peer::{Holder, PeerFetcher, Reason};
use crate::store::cache::{Master, md5s_agree};
use futures_util::future::BoxFuture;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a worker that lost the claim waits between two looks at who
/// holds the master (plus the query's own timeout).
const WAIT_STEP: Duration = Duration::from_millis(500);

/// How long another worker's claim may stand with nobody answering
/// `downloading` before this worker stops waiting and downloads from the
/// source itself: the holder of a claim answers so at once, every query,
/// so a silent claim is held by something that is not one of ours (or
/// has stopped working).
const CLAIM_SILENCE: Duration = Duration::from_secs(10);

/// What the pipeline asks of the other workers; the broker layer answers.
pub trait PeerDirectory: Send + Sync {
    /// The offers of the other workers for master `name`, collected for
    /// `[peers]query_timeout_ms` (none when the broker is unreachable).
    fn offers<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Vec<Offer>>;
    /// Takes the cloud-wide claim on downloading master `name` from its
    /// source.
    fn claim<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Claim>;
}

/// The answer to a claim.
pub enum Claim {
    /// Ours until the guard is dropped.
    Held(ClaimGuard),
    /// Another worker holds it: it is downloading the master.
    Taken,
    /// No claim can be taken (the broker is unreachable): download alone.
    Unavailable,
}

/// A held claim; dropping it releases the claim.
pub struct ClaimGuard {
    _held: Box<dyn Send + Sync>,
}

impl ClaimGuard {
    /// Wraps what releases the claim when dropped.
    pub fn new(held: Box<dyn Send + Sync>) -> ClaimGuard {
        ClaimGuard { _held: held }
    }
}

/// The peers as the pipeline uses them, once `serve` turned them on.
pub(super) struct Peers {
    directory: Arc<dyn PeerDirectory>,
    fetcher: PeerFetcher,
}

/// What asking the peers came to.
pub(super) enum PeerTurn {
    /// A peer's master, verified and committed here.
    Fetched(Box<(Master, TempGuard)>),
    /// Go to the source, holding the claim when there is one.
    Source(Option<ClaimGuard>),
}

impl Masters {
    /// Turns the peers on: misses ask `directory` first (`serve` does
    /// this when `[peers]` is configured).
    pub fn enable_peers(&self, directory: Arc<dyn PeerDirectory>) -> Result<()> {
        let peers = Peers {
            directory,
            fetcher: PeerFetcher::new(&self.config)?,
        };
        let _ = self.peers.set(peers);
        // Conversions while downloading are followed by the waiting peers.
        self.attempts.publish_to(self.live.clone());
        Ok(())
    }

    /// The masters this process is writing, for the peer listener to
    /// stream as they grow.
    pub fn live_masters(&self) -> Arc<LiveMasters> {
        self.live.clone()
    }

    /// The size master `name` will have, when the peer listener streams it
    /// as it is written here.
    pub fn live_size(&self, name: &str) -> Option<u64> {
        self.live.get(name).map(|v| v.size)
    }

    /// What this worker offers of master `name`: its sidecar's facts, when
    /// the master is committed and its sidecar describes it.
    pub fn peer_offer(&self, name: &str) -> Option<OfferedMaster> {
        if !crate::peers::token::is_master_name(name) {
            return None;
        }
        let m = self.cache.load(name)?.meta;
        Some(OfferedMaster {
            size: m.size,
            md5: m.md5,
            sha256: m.sha256,
            sha512: m.sha512,
            converted: m.converted,
            disk_format: m.disk_format,
            source_format: m.source_format,
            source: m.source,
            fetched_at: m.fetched_at,
            source_last_modified: m.source_last_modified,
            source_size: m.source_size,
            source_md5: m.source_md5,
            source_sha256: m.source_sha256,
            source_sha512: m.source_sha512,
        })
    }

    /// Before a download from the source: the peers' offers; a verified
    /// one is fetched. While another worker is downloading it, this one
    /// follows that download as it is written when its listener streams it,
    /// else waits for its master (giving back its download slot as a slow
    /// download does); when none is, it takes the cloud-wide claim and goes
    /// to the source (or, its holder gone or silent, goes there anyway).
    pub(super) async fn through_peers(&self, job: &MasterFetch<'_>) -> Result<PeerTurn> {
        let Some(peers) = self.peers.get() else {
            return Ok(PeerTurn::Source(None));
        };
        let mut waiting = Waiting::new(self.wait_limit(), &self.config.source);
        let mut bad = BadHolders::default();
        let mut followed = HashSet::new();
        loop {
            let offers = self.ask(peers, job.name).await;
            let downloading = offers.iter().any(|o| o.state == OfferState::Downloading);
            let live = offers
                .iter()
                .find(|o| followable(o, &self.config.default.host, &followed))
                .cloned();
            if let Some(got) = self.fetch_usable(peers, job, offers, &mut bad).await {
                return Ok(PeerTurn::Fetched(Box::new(got)));
            }
            if let Some(offer) = live
                && job.force_raw
                && followed.insert(offer.host.clone())
                && let Some(got) = self.follow(peers, job, &offer, &bad).await
            {
                return Ok(PeerTurn::Fetched(Box::new(got)));
            }
            if !downloading {
                match peers.directory.claim(job.name).await {
                    Claim::Held(guard) => {
                        // A master committed (and its claim released) since
                        // the query is taken from its holder.
                        let offers = self.ask(peers, job.name).await;
                        if let Some(got) = self.fetch_usable(peers, job, offers, &mut bad).await {
                            return Ok(PeerTurn::Fetched(Box::new(got)));
                        }
                        return Ok(PeerTurn::Source(Some(guard)));
                    }
                    Claim::Unavailable => return Ok(PeerTurn::Source(None)),
                    Claim::Taken => {}
                }
            }
            if waiting.silent(downloading) {
                self.metrics.peers.silent_claims.inc();
                tracing::warn!(
                    master = job.name,
                    "another worker's claim on the download stands but nobody is downloading: \
                     downloading from the source"
                );
                return Ok(PeerTurn::Source(None));
            }
            waiting.step(job)?;
            tokio::time::sleep(WAIT_STEP).await;
        }
    }

    /// The other workers' offers for master `name`, less those naming a
    /// URL that is not a peer listener's (`http(s)://host[:port]`) or an
    /// address the rules refuse (counted): a signed URL goes nowhere else.
    async fn ask(&self, peers: &Peers, name: &str) -> Vec<Offer> {
        let offers = peers.directory.offers(name).await;
        offers
            .into_iter()
            .filter(|o| {
                let url = crate::config::listener_url(&o.url);
                let ok = url.is_some_and(|u| {
                    let allow_local = peers.fetcher.allow_local();
                    http_client::check_followed(&u, allow_local, "peer listener").is_ok()
                });
                if !ok {
                    self.metrics
                        .peers
                        .refused_offers
                        .with_label_values(&["url"])
                        .inc();
                    tracing::warn!(peer = %o.host, url = %crate::secrets::redact_url(&o.url), "an offer names no usable peer listener URL: not used");
                }
                ok
            })
            .collect()
    }

    /// The master fetched from the usable offers among `offers`, if any
    /// (counted as an answered or missed query).
    async fn fetch_usable(
        &self,
        peers: &Peers,
        job: &MasterFetch<'_>,
        offers: Vec<Offer>,
        bad: &mut BadHolders,
    ) -> Option<(Master, TempGuard)> {
        let usable: Vec<Offer> = offers
            .into_iter()
            .filter(|o| self.usable(job, o, bad))
            .collect();
        let result = if usable.is_empty() {
            "missed"
        } else {
            "answered"
        };
        self.metrics
            .peers
            .queries
            .with_label_values(&[result])
            .inc();
        if usable.is_empty() {
            return None;
        }
        match self.fetch_from_peers(peers, job, &usable, bad).await {
            Ok(got) => Some(got),
            Err(e) => {
                tracing::warn!(master = job.name, error = %e, "no master from the peers");
                None
            }
        }
    }

    /// Whether offer `o` may stand for what `job` wants and was not found
    /// bad before.
    fn usable(&self, job: &MasterFetch<'_>, o: &Offer, bad: &BadHolders) -> bool {
        !bad.holds(o) && self.acceptable(job, o)
    }

    /// Whether a peer's master `m` is fresh enough for `job`: always with an
    /// expected checksum, else when its source has not changed since the
    /// holder fetched it (as a cache hit without checksum is judged).
    async fn fresh_for(&self, job: &MasterFetch<'_>, m: &OfferedMaster) -> Result<bool> {
        match job.expected {
            Some(_) => Ok(true),
            None => self.admission.is_fresh(job.source, &meta_of(m)).await,
        }
    }

    /// Whether an offer may stand for what the request wants: a verified
    /// master of the same name from another host, whose record fits the
    /// request as a cache hit's sidecar would ([`verdict::judge`]; an
    /// expected checksum not recorded is checked on the bytes received,
    /// freshness before they are fetched).
    fn acceptable(&self, job: &MasterFetch<'_>, o: &Offer) -> bool {
        let Some(m) = o.master.as_ref() else {
            return false;
        };
        if o.state != OfferState::Verified
            || o.name != job.name
            || o.host == self.config.default.host
        {
            return false;
        }
        matches!(
            verdict::judge(&meta_of(m), &self.admission.wanted(job, false)),
            Verdict::Fits(_)
        )
    }

    /// Fetches the master chosen among `offers` by rule (see [`chosen`])
    /// from its holders and makes it ours; a holder whose bytes fail a
    /// check goes into `bad` (one that is busy or unreachable does not).
    async fn fetch_from_peers(
        &self,
        peers: &Peers,
        job: &MasterFetch<'_>,
        offers: &[Offer],
        bad: &mut BadHolders,
    ) -> Result<(Master, TempGuard)> {
        let facts = chosen(offers).ok_or_else(|| Error::new(ErrorCode::Internal, "no offer"))?;
        let holders: Vec<Holder> = offers
            .iter()
            .filter(|o| same(o, facts))
            .map(holder_of)
            .collect();
        if !self.fresh_for(job, facts).await? {
            return Err(Error::new(
                ErrorCode::SourceUnreachable,
                "the peers' master is older than its source",
            ));
        }
        tracing::info!(master = job.name, holders = ?holders.iter().map(|h| &h.host).collect::<Vec<_>>(), size = facts.size, "fetching from peers");
        let checked = async {
            let (file, own) = self
                .receive_bytes(&peers.fetcher, job, facts.size, &holders)
                .await?;
            self.check_received(job, facts, file.path(), &own).await?;
            Ok((file, own, facts.clone()))
        };
        let checked = checked.await;
        if let Err((reason, _)) = &checked
            && *reason != Reason::Unreachable
        {
            for h in &holders {
                bad.insert(&h.host, &facts.sha256);
            }
        }
        self.adopt(job, checked).await
    }

    /// Follows the master the holder of `offer` is still downloading (a
    /// conversion: only for a request that converts): its bytes as they
    /// land, checked once the holder has committed them against what it
    /// recorded, as any peer's master is.
    async fn follow(
        &self,
        peers: &Peers,
        job: &MasterFetch<'_>,
        offer: &Offer,
        bad: &BadHolders,
    ) -> Option<(Master, TempGuard)> {
        let size = offer.live_size?;
        let holder = holder_of(offer);
        tracing::info!(master = job.name, peer = %holder.host, size, "following a peer's download");
        let checked = async {
            let holders = std::slice::from_ref(&holder);
            let (file, own) = self
                .receive_bytes(&peers.fetcher, job, size, holders)
                .await?;
            let Some(facts) = self.record_of(peers, job, &holder.host, bad).await else {
                let e = Error::new(
                    ErrorCode::SourceUnreachable,
                    format!("{}: no usable record of the master it sent", holder.host),
                );
                return Err((Reason::Uncommitted, e));
            };
            // A mismatch does not condemn the holder's master: a retried
            // download's output may have been resumed into these bytes. Its
            // master is checked on its own when it is fetched.
            self.check_received(job, &facts, file.path(), &own).await?;
            Ok((file, own, facts))
        };
        let checked = checked.await;
        self.adopt(job, checked).await.ok()
    }

    /// The record the holder `host` keeps of master `job.name` once it has
    /// committed it, when that master may stand for what `job` wants (as
    /// an offer is judged, fresh, and not one found bad before).
    async fn record_of(
        &self,
        peers: &Peers,
        job: &MasterFetch<'_>,
        host: &str,
        bad: &BadHolders,
    ) -> Option<OfferedMaster> {
        for _ in 0..3 {
            let offers = self.ask(peers, job.name).await;
            let verified = offers
                .into_iter()
                .find(|o| o.host == host && o.state == OfferState::Verified);
            if let Some(o) = verified {
                let m = o.master.clone()?;
                let usable = self.usable(job, &o, bad) && self.fresh_for(job, &m).await.ok()?;
                return usable.then_some(m);
            }
            tokio::time::sleep(WAIT_STEP).await;
        }
        None
    }
}

/// A wait for another worker's download: bounded in all by `limit`, and
/// given up when the claim's holder stays silent for [`CLAIM_SILENCE`];
/// after `[source]slow_after` it gives back the download slot, as a slow
/// download does (it moves no bytes at all).
struct Waiting {
    started: Instant,
    limit: Duration,
    /// When a holder last answered `downloading`.
    heard: Instant,
    slow_after: Option<Duration>,
    told: bool,
}

impl Waiting {
    fn new(limit: Duration, source: &crate::config::SourceSection) -> Waiting {
        Waiting {
            started: Instant::now(),
            limit,
            heard: Instant::now(),
            slow_after: (source.slow_rate > 0).then(|| Duration::from_secs(source.slow_after)),
            told: false,
        }
    }

    /// Whether the claim stood this round with nobody `downloading` for
    /// longer than [`CLAIM_SILENCE`].
    fn silent(&mut self, downloading: bool) -> bool {
        if downloading {
            self.heard = Instant::now();
        }
        self.heard.elapsed() > CLAIM_SILENCE
    }

    /// One more round of waiting: logged the first time, the download slot
    /// given back once it lasted `slow_after`, an error past `limit`.
    fn step(&mut self, job: &MasterFetch<'_>) -> Result<()> {
        if !self.told {
            tracing::info!(
                master = job.name,
                "another worker is downloading it: waiting"
            );
            self.told = true;
        }
        if self
            .slow_after
            .is_some_and(|after| self.started.elapsed() >= after)
        {
            tracing::info!(
                master = job.name,
                "waiting for another worker's download: giving back the download slot"
            );
            job.slow.raise();
            self.slow_after = None;
        }
        if self.started.elapsed() > self.limit {
            return Err(Error::new(
                ErrorCode::SourceUnreachable,
                format!(
                    "master {}: waited {}s for another worker's download",
                    job.name,
                    self.limit.as_secs()
                ),
            ));
        }
        Ok(())
    }
}

/// The bytes to fetch among usable offers, by rule rather than by count
/// (each holder of the secret speaks for itself only): the master most
/// recently fetched from its source, and among those the lowest SHA-256,
/// so every worker makes the same choice.
fn chosen(offers: &[Offer]) -> Option<&OfferedMaster> {
    offers
        .iter()
        .filter_map(|o| o.master.as_ref())
        .max_by(|a, b| {
            a.fetched_at
                .cmp(&b.fetched_at)
                .then_with(|| b.sha256.cmp(&a.sha256))
        })
}

/// Whether `o` is a download another host's listener streams as it is
/// written, whose holder was not `followed` before.
fn followable(o: &Offer, host: &str, followed: &HashSet<String>) -> bool {
    o.state == OfferState::Downloading
        && o.live_size.is_some()
        && o.host != host
        && !followed.contains(&o.host)
}

/// Where the holder of `o` serves it.
fn holder_of(o: &Offer) -> Holder {
    Holder {
        url: o.url.clone(),
        host: o.host.clone(),
    }
}

/// The holders whose bytes failed a check, with the SHA-256 they offered:
/// such an offer is not used again while this request waits (a holder
/// offering other bytes later is judged afresh).
#[derive(Default)]
struct BadHolders(HashSet<(String, String)>);

impl BadHolders {
    /// `host`'s master of `sha256` failed a check.
    fn insert(&mut self, host: &str, sha256: &str) {
        self.0.insert((host.to_string(), sha256.to_string()));
    }

    /// Whether offer `o` is of bytes its holder was found bad for (never
    /// one without a master: it is still downloading).
    fn holds(&self, o: &Offer) -> bool {
        o.master
            .as_ref()
            .is_some_and(|m| self.0.contains(&(o.host.clone(), m.sha256.clone())))
    }
}

/// Whether offer `o` holds exactly the bytes `m` describes.
fn same(o: &Offer, m: &OfferedMaster) -> bool {
    o.master.as_ref().is_some_and(|x| {
        x.size == m.size && x.sha256 == m.sha256 && md5s_agree(x.md5.as_deref(), m.md5.as_deref())
    })
}
