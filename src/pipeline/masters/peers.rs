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
//!
//! The [`PeerSource`] does all this, and answers the other workers' queries
//! from this worker's cache and the masters it is writing.

use super::admit::Admission;
use super::job::MasterFetch;
use super::peer_bytes::{PeerReceiver, meta_of, wait_limit};
use super::verdict::{self, Verdict};
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil::TempGuard;
use crate::metrics::Metrics;
use crate::metrics::peers::{OfferRefusal, QueryResult};
use crate::peers::live::LiveMasters;
use crate::peers::wire::{Offer, OfferState, OfferedMaster};
use crate::sources::http_client;
use crate::sources::peer::{Holder, PeerFetcher, Reason};
use crate::store::cache::{Cache, Master, md5s_agree};
use futures_util::future::BoxFuture;
use std::collections::HashSet;
use std::sync::{Arc, OnceLock};
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
struct Peers {
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

/// The other conductors' workers as a source of masters, and this worker
/// as theirs (see the module). It holds this worker's host
/// (`[DEFAULT]host`), the rule of a wait (`[source]`), the cache whose
/// masters it offers, the masters being written that its listener streams,
/// the admission that judges offers, the receiver of their bytes, the
/// metrics, and the directory and fetcher once `serve` turned it on.
pub(super) struct PeerSource {
    /// `[DEFAULT]host`: offers from it are our own.
    host: String,
    /// How long a wait for another worker's download may last, and when
    /// it gives back its download slot.
    wait: WaitRule,
    cache: Cache,
    live: Arc<LiveMasters>,
    admission: Arc<Admission>,
    receiver: PeerReceiver,
    metrics: Arc<Metrics>,
    /// The directory and the fetcher, once turned on.
    on: OnceLock<Peers>,
}

impl PeerSource {
    /// The peer source of `cache` for this worker's `host`, its waits
    /// bounded by `source`, offers judged by `admission` and their bytes
    /// received by `receiver`; off until [`PeerSource::enable`].
    pub(super) fn new(
        host: &str,
        source: &crate::config::SourceSection,
        cache: Cache,
        admission: Arc<Admission>,
        receiver: PeerReceiver,
        metrics: Arc<Metrics>,
    ) -> PeerSource {
        PeerSource {
            host: host.to_string(),
            wait: WaitRule::new(source),
            cache,
            live: Arc::default(),
            admission,
            receiver,
            metrics,
            on: OnceLock::new(),
        }
    }

    /// Turns the peers on: misses ask `directory` first and fetch through
    /// `fetcher`.
    pub(super) fn enable(&self, directory: Arc<dyn PeerDirectory>, fetcher: PeerFetcher) {
        let _ = self.on.set(Peers { directory, fetcher });
    }

    /// The masters this process is writing, for the peer listener to
    /// stream as they grow.
    pub(super) fn live_masters(&self) -> Arc<LiveMasters> {
        self.live.clone()
    }

    /// The size master `name` will have, when the peer listener streams it
    /// as it is written here.
    pub(super) fn live_size(&self, name: &str) -> Option<u64> {
        self.live.get(name).map(|v| v.size)
    }

    /// What this worker offers of master `name`: its sidecar's facts, when
    /// the master is committed and its sidecar describes it.
    pub(super) fn peer_offer(&self, name: &str) -> Option<OfferedMaster> {
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
    pub(super) async fn through(&self, job: &MasterFetch<'_>) -> Result<PeerTurn> {
        let Some(peers) = self.on.get() else {
            return Ok(PeerTurn::Source(None));
        };
        let mut waiting = Waiting::new(self.wait);
        let mut bad = BadHolders::default();
        let mut followed = HashSet::new();
        loop {
            let offers = self.ask(peers, job.name).await;
            let downloading = offers.iter().any(|o| o.state == OfferState::Downloading);
            let live = offers
                .iter()
                .find(|o| followable(o, &self.host, &followed))
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
                    self.metrics.peers.offer_refused(OfferRefusal::Url);
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
        self.metrics.peers.query_ended(if usable.is_empty() {
            QueryResult::Missed
        } else {
            QueryResult::Answered
        });
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
        if o.state != OfferState::Verified || o.name != job.name || o.host == self.host {
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
                .receiver
                .receive_bytes(&peers.fetcher, job, facts.size, &holders)
                .await?;
            self.receiver
                .check_received(job, facts, file.path(), &own)
                .await?;
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
        self.receiver.adopt(job, checked).await
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
                .receiver
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
            self.receiver
                .check_received(job, &facts, file.path(), &own)
                .await?;
            Ok((file, own, facts))
        };
        let checked = checked.await;
        self.receiver.adopt(job, checked).await.ok()
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

/// What bounds a wait for another worker's download: `limit` in all
/// ([`wait_limit`]), and, when `[source]slow_rate` is set, `[source]
/// slow_after`, past which the download slot is given back.
#[derive(Debug, Clone, Copy)]
struct WaitRule {
    limit: Duration,
    slow_after: Option<Duration>,
}

impl WaitRule {
    fn new(source: &crate::config::SourceSection) -> WaitRule {
        WaitRule {
            limit: wait_limit(source),
            slow_after: (source.slow_rate > 0).then(|| Duration::from_secs(source.slow_after)),
        }
    }
}

/// A wait for another worker's download: bounded in all by its rule's
/// `limit`, and given up when the claim's holder stays silent for
/// [`CLAIM_SILENCE`]; after its rule's `slow_after` it gives back the
/// download slot, as a slow download does (it moves no bytes at all).
struct Waiting {
    started: Instant,
    limit: Duration,
    /// When a holder last answered `downloading`.
    heard: Instant,
    /// How long a claim may stand with nobody `downloading`.
    silence: Duration,
    slow_after: Option<Duration>,
    told: bool,
}

impl Waiting {
    fn new(rule: WaitRule) -> Waiting {
        Waiting {
            started: Instant::now(),
            limit: rule.limit,
            heard: Instant::now(),
            silence: CLAIM_SILENCE,
            slow_after: rule.slow_after,
            told: false,
        }
    }

    /// Whether the claim stood this round with nobody `downloading` for
    /// longer than [`CLAIM_SILENCE`].
    fn silent(&mut self, downloading: bool) -> bool {
        if downloading {
            self.heard = Instant::now();
        }
        self.heard.elapsed() > self.silence
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

#[cfg(test)]
mod tests {
    use super::super::job::TestJob;
    use super::*;
    use crate::config::Config;
    use crate::image_format::Format;
    use crate::messages::SlowSignal;
    use crate::store::checksum::{Algo, Expected};

    const HREF: &str = "https://images.example/disk.qcow2";
    const NAME: &str = "m";

    /// The peer source of a worker on host `me` whose cache is `dir`.
    fn source(dir: &std::path::Path) -> Arc<PeerSource> {
        super::super::Masters::for_test(dir, "me").peers
    }

    /// A qcow2 master of `HREF` served as fetched, its source's SHA-256
    /// `sha256`, fetched at `fetched_at`.
    fn master(sha256: &str, fetched_at: u64) -> OfferedMaster {
        OfferedMaster {
            size: 10,
            md5: Some("md5".into()),
            sha256: sha256.into(),
            sha512: None,
            converted: false,
            disk_format: Format::Qcow2.served(),
            source_format: Format::Qcow2,
            source: HREF.into(),
            fetched_at,
            source_last_modified: None,
            source_size: 10,
            source_md5: Some("md5".into()),
            source_sha256: Some(sha256.into()),
            source_sha512: None,
        }
    }

    fn offer(host: &str, state: OfferState, master: Option<OfferedMaster>) -> Offer {
        Offer {
            name: NAME.into(),
            host: host.into(),
            process: "p".into(),
            url: format!("http://{host}.example:8089"),
            state,
            master,
            live_size: None,
        }
    }

    /// A request for master [`NAME`] of [`HREF`], declared qcow2, whose
    /// download raises `slow` when slow.
    fn fixture(slow: SlowSignal) -> TestJob {
        let mut fixture = TestJob::new(HREF);
        fixture.info.image_disk_format = Some("qcow2".into());
        fixture.slow = slow;
        fixture
    }

    /// The checksum the requests of these tests expect.
    fn expected() -> Expected {
        Expected {
            algo: Algo::Sha256,
            hex: "aa11".into(),
        }
    }

    /// The master fetched is the one most recently fetched from its source,
    /// and among those the lowest SHA-256, whatever the offers' order or
    /// count; offers without a master (still downloading) are not chosen.
    #[test]
    fn the_master_chosen_is_the_latest_fetched_then_the_lowest_sha256() {
        let offers = vec![
            offer("a", OfferState::Verified, Some(master("11", 10))),
            offer("b", OfferState::Verified, Some(master("33", 20))),
            offer("c", OfferState::Verified, Some(master("22", 20))),
            offer("d", OfferState::Verified, Some(master("33", 20))),
            offer("e", OfferState::Downloading, None),
        ];
        assert_eq!(chosen(&offers).unwrap().sha256, "22");
        let reversed: Vec<Offer> = offers.iter().rev().cloned().collect();
        assert_eq!(chosen(&reversed).unwrap().sha256, "22");
        assert!(chosen(&offers[4..]).is_none());
        assert!(same(&offers[1], offers[3].master.as_ref().unwrap()));
        assert!(!same(&offers[1], offers[2].master.as_ref().unwrap()));
    }

    /// An offer is usable when it is another host's verified master of the
    /// same name whose record fits the request, and its holder was not
    /// found bad for those bytes.
    #[test]
    fn an_offer_is_usable_only_when_it_fits_and_is_not_bad() {
        let dir = tempfile::tempdir().unwrap();
        let peers = source(dir.path());
        let (fixture, expected) = (fixture(SlowSignal::default()), expected());
        let job = fixture.job(Some(&expected), false, false);
        let good = offer("other", OfferState::Verified, Some(master("aa11", 1)));
        let mut bad = BadHolders::default();
        assert!(peers.usable(&job, &good, &bad));
        let own = offer("me", OfferState::Verified, Some(master("aa11", 1)));
        assert!(!peers.usable(&job, &own, &bad), "our own offer");
        let downloading = Offer {
            state: OfferState::Downloading,
            ..good.clone()
        };
        assert!(!peers.usable(&job, &downloading, &bad));
        let renamed = Offer {
            name: "another".into(),
            ..good.clone()
        };
        assert!(!peers.usable(&job, &renamed, &bad));
        let differs = offer("other", OfferState::Verified, Some(master("ffff", 1)));
        assert!(!peers.usable(&job, &differs, &bad), "another checksum");
        let elsewhere = OfferedMaster {
            source: "https://images.example/other.qcow2".into(),
            ..master("aa11", 1)
        };
        let elsewhere = offer("other", OfferState::Verified, Some(elsewhere));
        assert!(!peers.usable(&job, &elsewhere, &bad), "another source");
        bad.insert("other", "bb22");
        assert!(peers.usable(&job, &good, &bad), "found bad for other bytes");
        bad.insert("other", "aa11");
        assert!(
            !peers.usable(&job, &good, &bad),
            "found bad for these bytes"
        );
        let third = offer("third", OfferState::Verified, Some(master("aa11", 1)));
        assert!(
            peers.usable(&job, &third, &bad),
            "another holder, judged afresh"
        );
    }

    /// Only another host's download streamed as it is written, not
    /// followed before, is followed.
    #[test]
    fn only_another_hosts_live_download_is_followed_once() {
        let live = Offer {
            live_size: Some(10),
            ..offer("other", OfferState::Downloading, None)
        };
        let mut followed = HashSet::new();
        assert!(followable(&live, "me", &followed));
        assert!(!followable(&live, "other", &followed), "our own");
        let not_live = offer("other", OfferState::Downloading, None);
        assert!(!followable(&not_live, "me", &followed));
        followed.insert("other".to_string());
        assert!(!followable(&live, "me", &followed));
    }

    /// A waiting turn gives back its download slot once `slow_after` has
    /// passed (once), and fails past its limit.
    #[tokio::test]
    async fn a_waiting_turn_gives_back_its_slot_then_ends_at_its_limit() {
        let (slow, raised) = SlowSignal::new();
        let (fixture, expected) = (fixture(slow), expected());
        let job = fixture.job(Some(&expected), false, false);
        let rule = WaitRule {
            limit: Duration::from_secs(3600),
            slow_after: Some(Duration::ZERO),
        };
        let mut waiting = Waiting::new(rule);
        waiting.step(&job).unwrap();
        let told = tokio::time::timeout(Duration::from_secs(1), raised.notified());
        assert!(told.await.is_ok(), "the slot was given back");
        waiting.step(&job).unwrap();
        let again = tokio::time::timeout(Duration::from_millis(50), raised.notified());
        assert!(again.await.is_err(), "given back once");
        let patient = WaitRule {
            limit: Duration::from_secs(3600),
            slow_after: None,
        };
        Waiting::new(patient).step(&job).unwrap();
        let over = WaitRule {
            limit: Duration::ZERO,
            slow_after: None,
        };
        let mut waiting = Waiting::new(over);
        std::thread::sleep(Duration::from_millis(2));
        let e = waiting.step(&job).unwrap_err();
        assert_eq!(e.code, ErrorCode::SourceUnreachable);
    }

    /// A claim is silent once nobody answered `downloading` for its
    /// silence; an answer starts it again.
    #[test]
    fn a_claim_nobody_downloads_for_goes_silent() {
        let rule = WaitRule {
            limit: Duration::from_secs(3600),
            slow_after: None,
        };
        let mut waiting = Waiting::new(rule);
        // Time passed without a sleep: the last answer heard moved back.
        let long_ago = |w: &Waiting| Instant::now() - w.silence - Duration::from_secs(1);
        assert!(!waiting.silent(false));
        waiting.heard = long_ago(&waiting);
        assert!(!waiting.silent(true), "an answer starts it again");
        assert!(!waiting.silent(false));
        waiting.heard = long_ago(&waiting);
        assert!(waiting.silent(false));
    }

    /// Without `[source]download_deadline` a wait lasts up to six hours;
    /// with it, that long; the slot is given back after `slow_after` only
    /// with a slow rate.
    #[test]
    fn the_wait_rule_comes_from_source() {
        let config = Config::default();
        let unbounded = crate::config::SourceSection {
            download_deadline: 0,
            ..config.source.clone()
        };
        let rule = WaitRule::new(&unbounded);
        assert_eq!(rule.limit, Duration::from_secs(6 * 3600));
        assert_eq!(
            rule.slow_after,
            Some(Duration::from_secs(config.source.slow_after))
        );
        let deadline = crate::config::SourceSection {
            download_deadline: 60,
            slow_rate: 0,
            ..config.source.clone()
        };
        let bounded = WaitRule::new(&deadline);
        assert_eq!(bounded.limit, Duration::from_secs(60));
        assert_eq!(bounded.slow_after, None);
    }
}
