//! One download, attempt by attempt. The source (`sources`) streams each
//! attempt's bytes; here each attempt gets a file of its own, written and
//! hashed in one pass by a `store` sink, and, when the image is converted
//! while it downloads, a conversion bound to that file alone. A new attempt
//! voids the one before: its file is removed, its conversion stopped and
//! thrown away. So the only bytes that can become a master are those of the
//! attempt that completed (and is then verified), or the conversion that
//! read exactly that attempt's file. It knows nothing of nodes, the broker
//! or HTTP serving.

use super::Masters;
use super::job::MasterFetch;
use super::keeper::{GROWTH_STEP, Room};
use super::stream::DownloadState;
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil::TempGuard;
use crate::image::convert;
use crate::metrics::progress::Transfer;
use crate::sources::{Delivery, Source, SourceStat};
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
    pub(super) digests: Digests,
    pub(super) stat: SourceStat,
    id: u64,
}

/// A conversion that ran beside the completed attempt, on its file: its
/// output and how it ended (digests and time taken, or why not).
pub(super) struct Streamed {
    pub(super) out: TempGuard,
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

impl Masters {
    /// Whether a qcow2 download is converted while it downloads.
    pub(super) fn streams_while_downloading(&self, job: &MasterFetch<'_>) -> bool {
        job.force_raw
            && self.config.convert.stream_while_downloading
            && !matches!(job.source, Source::File(_))
    }

    /// Downloads `job.source` attempt by attempt (see the module
    /// documentation) and returns the completed attempt with the
    /// conversion that read it, if one ran to its end. Nothing is verified
    /// here: the caller checks the digests.
    pub(super) async fn download_attempts(
        &self,
        job: &MasterFetch<'_>,
    ) -> Result<(Written, Option<Streamed>)> {
        let (tx, rx) = mpsc::channel(DELIVERY_DEPTH);
        let source = self.fetcher.download(job.source, tx);
        self.receive_from(job, rx, source).await
    }

    /// [`Masters::download_attempts`] from any feed of deliveries (`rx`,
    /// filled by `source`): the image's source, or a peer.
    pub(super) async fn receive_from(
        &self,
        job: &MasterFetch<'_>,
        rx: mpsc::Receiver<Delivery>,
        source: impl std::future::Future<Output = Result<SourceStat>>,
    ) -> Result<(Written, Option<Streamed>)> {
        let (views, watching) = watch::channel(None);
        let mut transfer = Transfer::start(&self.metrics, "download", 0);
        let converting = self.streams_while_downloading(job);
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
        let mut pace = SlowCheck::new(&self.config.source);
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
        self.off_thread(move |k| match announced {
            Some(len) => k.make_room(len),
            None => k.make_room_unannounced(0, GROWTH_STEP),
        })
        .await?;
        let file = TempGuard::new(self.cache.temp_path(job.name)?);
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
                None => Some(Room::ahead_of(self.keeper(), GROWTH_STEP)),
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
                let out = TempGuard::new(self.cache.temp_path(job.name).ok()?);
                let started = Instant::now();
                tokio::select! {
                    r = self.stream_convert(job.name, &view.path, out.path(), &view.state, &view.pace, job.served) => {
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

/// Whether a download is slow: fewer than `[source]slow_rate` bytes per
/// second on average (every attempt counted) once `[source]slow_after`
/// seconds have passed. Says so once.
struct SlowCheck {
    started: Instant,
    after: Duration,
    rate: u64,
    bytes: u64,
    told: bool,
}

impl SlowCheck {
    fn new(config: &crate::config::SourceSection) -> SlowCheck {
        SlowCheck {
            started: Instant::now(),
            after: Duration::from_secs(config.slow_after),
            rate: config.slow_rate,
            bytes: 0,
            told: config.slow_rate == 0,
        }
    }

    /// Counts `n` more bytes; true the first time the download is slow.
    fn is_slow(&mut self, n: usize) -> bool {
        self.bytes += n as u64;
        let took = self.started.elapsed();
        if self.told || took < self.after {
            return false;
        }
        self.told = (self.bytes as f64) < self.rate as f64 * took.as_secs_f64();
        self.told
    }
}

fn out_of_order() -> Error {
    Error::new(ErrorCode::Internal, "download bytes outside an attempt")
}
