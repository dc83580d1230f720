//! One download, attempt by attempt. The source (`sources`) streams each
//! attempt's bytes; here each attempt gets a file of its own, written and
//! hashed in one pass by a `store` sink, and, when the image is converted
//! while it downloads, a conversion bound to that file alone. A new attempt
//! voids the one before: its file is removed, its conversion stopped and
//! thrown away. So the only bytes that can become a master are those of the
//! attempt that completed (and is then verified), or the conversion that
//! read exactly that attempt's file. The [`Attempts`] own this, for the
//! image's source and for a peer's master alike. It knows nothing of nodes,
//! the broker or HTTP serving.

use super::job::MasterFetch;
use super::keeper::{GROWTH_STEP, Keeper, Room};
use super::stream::{DownloadState, StreamConverter};
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil::TempGuard;
use crate::image::convert;
use crate::metrics::Metrics;
use crate::metrics::progress::Transfer;
use crate::peers::live::LiveMasters;
use crate::sources::{Delivery, Fetcher, SourceStat};
use crate::store::sink::{Digests, Pace, Plan, Sink, WritePolicy};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// Deliveries queued between the source and the attempt's writer.
pub(super) const DELIVERY_DEPTH: usize = 8;

/// The attempt that completed: its file, its digests, what the source said.
pub(super) struct Written {
    /// The attempt's file (removed when dropped unless committed).
    pub(super) file: TempGuard,
    /// The digests of its bytes, computed as they were written.
    pub(super) digests: Digests,
    /// What the source said of it (length, last modification).
    pub(super) stat: SourceStat,
    id: u64,
}

/// A conversion that ran beside the completed attempt, on its file: its
/// output and how it ended (digests and time taken, or why not).
pub(super) struct Streamed {
    /// The conversion's output (removed when dropped unless committed).
    pub(super) out: TempGuard,
    /// The output's digests and the time the conversion took, or the
    /// error that stands (the converter hit its limits on these bytes).
    pub(super) result: Result<(Digests, Duration)>,
    /// The output as the peers waiting for it follow it (settled by the
    /// commit; failed when dropped before).
    pub(super) live: Option<crate::peers::live::LiveGuard>,
}

/// One attempt as the conversion beside it sees it.
struct AttemptView {
    id: u64,
    path: PathBuf,
    state: DownloadState,
    pace: Arc<Pace>,
}

/// The attempt being written.
struct Current {
    view: Arc<AttemptView>,
    file: TempGuard,
    sink: Sink,
    stat: SourceStat,
    /// Room made ahead of a download of unannounced length (see
    /// [`Room`]); `None` when its whole length had room made first.
    room: Option<Room>,
}

/// The views the conversion follows: `None` while no attempt is valid.
type Views = watch::Sender<Option<Arc<AttemptView>>>;

/// The download attempts of masters (see the module): each attempt's file
/// in the cache and its room (through the housekeeping), the sink that
/// writes and hashes it, and the conversion beside it. It holds the source
/// client, the housekeeping, the metrics, the slow-download rule of
/// `[source]` and the conversion of `[convert]`, nothing else.
pub(super) struct Attempts {
    fetcher: Fetcher,
    keeper: Keeper,
    metrics: Arc<Metrics>,
    /// `[source]slow_after` and `slow_rate`.
    slow: SlowRule,
    converter: StreamConverter,
}

impl Attempts {
    /// The attempts of downloads through `fetcher`, under the rule of
    /// `source` for slow ones, converted as `converter` does.
    pub(super) fn new(
        fetcher: Fetcher,
        keeper: Keeper,
        metrics: Arc<Metrics>,
        source: &crate::config::SourceSection,
        converter: StreamConverter,
    ) -> Attempts {
        Attempts {
            fetcher,
            keeper,
            metrics,
            slow: SlowRule {
                after: Duration::from_secs(source.slow_after),
                rate: source.slow_rate,
            },
            converter,
        }
    }

    /// From now on, conversions while downloading are offered in `live`
    /// (the peers are on).
    pub(super) fn publish_to(&self, live: Arc<LiveMasters>) {
        self.converter.publish_to(live);
    }

    /// Downloads `job.source` attempt by attempt (see the module
    /// documentation) and returns the completed attempt with the
    /// conversion that read it, if one ran to its end. Nothing is verified
    /// here: the caller checks the digests.
    pub(super) async fn download(
        &self,
        job: &MasterFetch<'_>,
    ) -> Result<(Written, Option<Streamed>)> {
        let (tx, rx) = mpsc::channel(DELIVERY_DEPTH);
        let source = self.fetcher.download(job.source, tx);
        self.receive_from(job, rx, source).await
    }

    /// [`Attempts::download`] from any feed of deliveries (`rx`, filled by
    /// `source`): the image's source, or a peer.
    pub(super) async fn receive_from(
        &self,
        job: &MasterFetch<'_>,
        rx: mpsc::Receiver<Delivery>,
        source: impl std::future::Future<Output = Result<SourceStat>>,
    ) -> Result<(Written, Option<Streamed>)> {
        let (views, watching) = watch::channel(None);
        let mut transfer = Transfer::start(&self.metrics, "download", 0);
        let converting = self.converter.applies(job.force_raw, job.source);
        let receive = self.receive_attempts(job, rx, views, &mut transfer, converting);
        let convert = async {
            match converting {
                true => self.convert_attempts(job, watching).await,
                false => None,
            }
        };
        let (sourced, received, streamed) = tokio::join!(source, receive, convert);
        // The receiver's own failure (disk full...) is the cause of the
        // source's "receiver stopped".
        let written = received?;
        sourced?;
        let written = written.ok_or_else(|| {
            Error::new(
                ErrorCode::Internal,
                "the download ended without a complete attempt",
            )
        })?;
        let streamed = streamed.filter(|(id, _)| *id == written.id).map(|(_, s)| s);
        Ok((written, streamed))
    }

    /// Writes each attempt to a file of its own; the completed one is
    /// returned (`None` when the deliveries ended without one). Whatever
    /// way it ends without one, the conversion is told no attempt is valid.
    async fn receive_attempts(
        &self,
        job: &MasterFetch<'_>,
        mut rx: mpsc::Receiver<Delivery>,
        views: Views,
        transfer: &mut Transfer,
        converting: bool,
    ) -> Result<Option<Written>> {
        let mut current: Option<Current> = None;
        let mut next_id = 0;
        let mut pace = SlowCheck::new(self.slow);
        let outcome = async {
            while let Some(piece) = rx.recv().await {
                match piece {
                    Delivery::Attempt(stat) => {
                        if let Some(old) = current.take() {
                            old.abandon().await;
                        }
                        views.send_replace(None);
                        transfer.set_expected(stat.size.unwrap_or(0));
                        transfer.set_done(0);
                        let cur = self.begin_attempt(job, stat, next_id, converting).await?;
                        next_id += 1;
                        views.send_replace(Some(cur.view.clone()));
                        current = Some(cur);
                    }
                    Delivery::Bytes(bytes) => {
                        let cur = current.as_mut().ok_or_else(out_of_order)?;
                        self.write_bytes(cur, &bytes).await?;
                        transfer.set_done(cur.sink.size());
                        if pace.is_slow(bytes.len()) {
                            tracing::info!(
                                source = %job.source.display(),
                                "slow download: giving back its download slot"
                            );
                            job.slow.raise();
                        }
                    }
                    Delivery::Complete => {
                        let cur = current.take().ok_or_else(out_of_order)?;
                        let digests = cur.sink.finish().await?;
                        cur.view.state.finish();
                        return Ok(Some(Written {
                            file: cur.file,
                            digests,
                            stat: cur.stat,
                            id: cur.view.id,
                        }));
                    }
                }
            }
            Ok(None)
        }
        .await;
        if let Some(cur) = current {
            cur.abandon().await;
        }
        if !matches!(outcome, Ok(Some(_))) {
            views.send_replace(None);
        }
        outcome
    }

    /// A new attempt: room for what the source announced (or a first
    /// step), a new file and its sink, and what its conversion will see.
    async fn begin_attempt(
        &self,
        job: &MasterFetch<'_>,
        stat: SourceStat,
        id: u64,
        converting: bool,
    ) -> Result<Current> {
        let announced = stat.size;
        self.keeper
            .off_thread(move |k| match announced {
                Some(len) => k.make_room(len),
                None => k.make_room_unannounced(0, GROWTH_STEP),
            })
            .await?;
        let file = TempGuard::new(self.keeper.cache.temp_path(job.name)?);
        let pace = Arc::new(Pace::default());
        let plan = attempt_plan(job, converting.then(|| pace.clone()));
        let sink = Sink::deciding(file.path(), plan)?;
        let state = DownloadState::new();
        if let Some(len) = stat.size {
            state.announce(len);
        }
        let view = Arc::new(AttemptView {
            id,
            path: file.path().to_path_buf(),
            state,
            pace,
        });
        Ok(Current {
            view,
            file,
            sink,
            room: match stat.size {
                Some(_) => None,
                None => Some(Room::ahead_of(self.keeper.clone(), GROWTH_STEP)),
            },
            stat,
        })
    }

    /// Writes (and hashes) the next bytes of the attempt, making sure of
    /// more room as it grows when the length was not announced.
    async fn write_bytes(&self, cur: &mut Current, bytes: &[u8]) -> Result<()> {
        cur.sink.write(bytes).await?;
        let size = cur.sink.size();
        cur.view.state.received(size);
        match cur.room.as_mut() {
            Some(room) => room.grow_to(size).await,
            None => Ok(()),
        }
    }

    /// Converts each attempt while it downloads, on that attempt's file: a
    /// conversion is stopped (its child killed, its output removed) as soon
    /// as its attempt is void. Returns the last conversion that ran to its
    /// end, with the id of the attempt it read, when that attempt is still
    /// the valid one once the deliveries are over.
    async fn convert_attempts(
        &self,
        job: &MasterFetch<'_>,
        mut views: watch::Receiver<Option<Arc<AttemptView>>>,
    ) -> Option<(u64, Streamed)> {
        let mut done: Option<(u64, Streamed)> = None;
        let mut tried = None;
        loop {
            let view = views.borrow_and_update().clone();
            if let Some(view) = view.filter(|v| tried != Some(v.id)) {
                tried = Some(view.id);
                done = None;
                let out = TempGuard::new(self.keeper.cache.temp_path(job.name).ok()?);
                let started = Instant::now();
                tokio::select! {
                    r = self.converter.convert(job.name, &view.path, out.path(), &view.state, &view.pace, job.served) => {
                        view.pace.finish();
                        done = match r {
                            Ok((d, live)) => Some((view.id, Streamed { out, result: Ok((d, started.elapsed())), live })),
                            Err(convert::StreamFailure::Conclusive(e)) => {
                                Some((view.id, Streamed { out, result: Err(e), live: None }))
                            }
                            Err(convert::StreamFailure::Retryable(e)) => {
                                tracing::debug!(error = %e, "no conversion during the download");
                                None
                            }
                        };
                    }
                    () = superseded(&mut views, view.id) => {
                        view.pace.finish();
                        continue;
                    }
                }
            }
            let valid = views.borrow().as_ref().map(|v| v.id);
            if done.as_ref().is_some_and(|d| Some(d.0) != valid) {
                done = None;
            }
            if views.changed().await.is_err() {
                let valid = views.borrow().as_ref().map(|v| v.id);
                return done.filter(|d| Some(d.0) == valid);
            }
        }
    }
}

/// How an attempt's file is written and hashed, decided on its first
/// chunk: bytes that will be converted (or decompressed) are read back at
/// once; with `force_raw` they are scratch, hashed only with the algorithm
/// the source is verified with (the conversion hashes what is served) and
/// kept within reach of the conversion reading them (`pace`). Anything
/// else is served as it is, with every digest the request wants.
fn attempt_plan(
    job: &MasterFetch<'_>,
    pace: Option<Arc<Pace>>,
) -> impl FnOnce(&[u8]) -> Plan + Send + 'static {
    let (served, verified, scratch) = (job.served, job.expected.map(|e| e.algo), job.force_raw);
    move |first| {
        let write = match crate::image::inspect::will_be_converted(first) {
            false => WritePolicy::Served,
            true if scratch => {
                return Plan {
                    digests: verified.into_iter().collect(),
                    write: WritePolicy::Scratch(pace),
                };
            }
            true => WritePolicy::ReadBack,
        };
        Plan {
            digests: served.algos(verified),
            write,
        }
    }
}

impl Current {
    /// Gives the attempt up: its conversion is told, its writer and
    /// hashers are waited for, and its file is removed, all before the
    /// caller goes on (so a failure is answered with its space given back).
    async fn abandon(self) {
        self.view.state.finish();
        self.sink.abandon().await;
        drop(self.file);
    }
}

/// Resolves when the attempt `id` is no longer the valid one (never when
/// the deliveries are over with it still valid).
async fn superseded(views: &mut watch::Receiver<Option<Arc<AttemptView>>>, id: u64) {
    loop {
        if views.changed().await.is_err() {
            return std::future::pending().await;
        }
        if views.borrow().as_ref().map(|v| v.id) != Some(id) {
            return;
        }
    }
}

/// When a download counts as slow: fewer than `[source]slow_rate` bytes
/// per second on average once `[source]slow_after` has passed (never with
/// a rate of 0).
#[derive(Debug, Clone, Copy)]
struct SlowRule {
    after: Duration,
    rate: u64,
}

/// Whether a download is slow by its [`SlowRule`], every attempt counted.
/// Says so once.
struct SlowCheck {
    rule: SlowRule,
    started: Instant,
    bytes: u64,
    told: bool,
}

impl SlowCheck {
    fn new(rule: SlowRule) -> SlowCheck {
        SlowCheck {
            rule,
            started: Instant::now(),
            bytes: 0,
            told: rule.rate == 0,
        }
    }

    /// Counts `n` more bytes; true the first time the download is slow.
    fn is_slow(&mut self, n: usize) -> bool {
        self.bytes += n as u64;
        let took = self.started.elapsed();
        if self.told || took < self.rule.after {
            return false;
        }
        self.told = (self.bytes as f64) < self.rule.rate as f64 * took.as_secs_f64();
        self.told
    }
}

fn out_of_order() -> Error {
    Error::new(ErrorCode::Internal, "download bytes outside an attempt")
}

#[cfg(test)]
mod tests {
    use super::super::job::TestJob;
    use super::*;
    use std::path::Path;

    /// The attempts of a worker whose master cache is `dir`.
    fn attempts(dir: &Path) -> Arc<Attempts> {
        super::super::Masters::for_test(dir, "me").attempts
    }

    /// The temporaries of the cache `dir` (its `.tmp`; the owner's lock
    /// file is elsewhere).
    fn files(dir: &Path) -> Vec<std::path::PathBuf> {
        let Ok(entries) = std::fs::read_dir(dir.join(".tmp")) else {
            return Vec::new();
        };
        entries.map(|e| e.unwrap().path()).collect()
    }

    /// Runs `attempts` on the deliveries `feed` sends, in order.
    async fn receive(
        attempts: &Attempts,
        job: &MasterFetch<'_>,
        feed: Vec<Delivery>,
    ) -> Result<(Written, Option<Streamed>)> {
        let (tx, rx) = mpsc::channel(DELIVERY_DEPTH);
        let source = async move {
            for d in feed {
                if tx.send(d).await.is_err() {
                    break;
                }
            }
            Ok(SourceStat::default())
        };
        attempts.receive_from(job, rx, source).await
    }

    fn attempt(size: Option<usize>) -> Delivery {
        Delivery::Attempt(SourceStat {
            size: size.map(|s| s as u64),
            last_modified: None,
        })
    }

    fn bytes(b: &[u8]) -> Delivery {
        Delivery::Bytes(bytes::Bytes::copy_from_slice(b))
    }

    /// A new attempt voids the one before: its file is gone, and what is
    /// returned is the last attempt's bytes, hashed; dropped, it leaves
    /// nothing.
    #[tokio::test]
    async fn a_voided_attempt_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let attempts = attempts(dir.path());
        let fixture = TestJob::new("http://images.invalid/disk.img");
        let feed = vec![
            attempt(Some(11)),
            bytes(b"first "),
            attempt(None),
            bytes(b"second"),
            bytes(b" try"),
            Delivery::Complete,
        ];
        let (written, streamed) = receive(&attempts, &fixture.job(None, false, false), feed)
            .await
            .unwrap();
        assert!(streamed.is_none(), "nothing to convert");
        assert_eq!(written.digests.size, 10);
        assert_eq!(
            written.digests.sha256.as_deref(),
            Some(hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"second try")).as_str())
        );
        assert_eq!(written.stat.size, None, "the last attempt's stat");
        assert_eq!(files(dir.path()), [written.file.path().to_path_buf()]);
        assert_eq!(std::fs::read(written.file.path()).unwrap(), b"second try");
        drop(written);
        assert!(files(dir.path()).is_empty());
    }

    /// Deliveries that end without a complete attempt are an error, and
    /// the incomplete attempt's file is removed.
    #[tokio::test]
    async fn no_complete_attempt_fails_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let attempts = attempts(dir.path());
        let fixture = TestJob::new("http://images.invalid/disk.img");
        let feed = vec![attempt(Some(100)), bytes(b"part of it")];
        let Err(e) = receive(&attempts, &fixture.job(None, false, false), feed).await else {
            panic!("an incomplete download was returned");
        };
        assert_eq!(e.code, ErrorCode::Internal);
        assert!(files(dir.path()).is_empty());
        let feed = vec![bytes(b"no attempt begun")];
        assert!(
            receive(&attempts, &fixture.job(None, false, false), feed)
                .await
                .is_err()
        );
        assert!(files(dir.path()).is_empty());
    }

    /// A qcow2 made by `qemu-img`, of `virtual_size` bytes.
    fn qcow2(dir: &Path, virtual_size: &str) -> Vec<u8> {
        let path = dir.join("image.qcow2");
        let status = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&path)
            .arg(virtual_size)
            .status()
            .unwrap();
        assert!(status.success());
        let image = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        image
    }

    /// A conversion whose attempt was voided is never returned, however it
    /// ended: the bytes that completed are another attempt's. (The
    /// converter child is the worker's own binary, so a conversion that
    /// succeeds is exercised by the integration tests, not here.)
    #[tokio::test]
    async fn a_voided_attempts_conversion_is_not_returned() {
        let dir = tempfile::tempdir().unwrap();
        let image = qcow2(dir.path(), "4M");
        let attempts = attempts(dir.path());
        let fixture = TestJob::new("http://images.invalid/disk.img");
        let feed = vec![
            attempt(Some(image.len())),
            bytes(&image),
            attempt(Some(9)),
            bytes(b"not qcow2"),
            Delivery::Complete,
        ];
        let (written, streamed) = receive(&attempts, &fixture.job(None, false, true), feed)
            .await
            .unwrap();
        assert!(streamed.is_none());
        assert_eq!(std::fs::read(written.file.path()).unwrap(), b"not qcow2");
        assert_eq!(files(dir.path()), [written.file.path().to_path_buf()]);
    }

    /// A download is slow once its grace is over and it stays under the
    /// rate, said once; a rate of 0 is never slow.
    #[test]
    fn a_download_is_slow_once_past_its_grace_under_the_rate() {
        let rule = |after, rate| SlowRule {
            after: Duration::from_secs(after),
            rate,
        };
        let mut off = SlowCheck::new(rule(0, 0));
        assert!(!off.is_slow(1));
        let mut grace = SlowCheck::new(rule(3600, u64::MAX));
        assert!(!grace.is_slow(1), "within its grace");
        let mut slow = SlowCheck::new(rule(0, u64::MAX));
        assert!(slow.is_slow(1));
        assert!(!slow.is_slow(1), "said once");
        let mut fast = SlowCheck::new(rule(0, 1));
        assert!(!fast.is_slow(1 << 30));
    }
}
