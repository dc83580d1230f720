//! Converting a qcow2 while it downloads: the conversion waits on the
//! download's progress ([`DownloadState`]), checks the header and tables of
//! the bytes already there, and runs the converter on the growing file. Its
//! result is only used once the whole download is verified (see `fetch`).
//! The [`StreamConverter`] holds what it uses: its `[convert]` rules
//! ([`ConvertRules`]), the housekeeping that makes room for its output and,
//! once the peers are on, the masters being written, where its output is
//! offered. It knows nothing of requests, nodes, the broker or HTTP
//! serving.

use super::keeper::Keeper;
use crate::config::ConvertSection;
use crate::error::{Error, ErrorCode, Result};
use crate::image::convert;
use crate::image::inspect;
use crate::image::qcow2;
use crate::image_format::Format;
use crate::metrics::Metrics;
use crate::metrics::progress::Transfer;
use crate::peers::live::{LiveGuard, LiveMasters};
use crate::store::sink::{Digests, Served};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// How conversions to raw are bounded, whenever they run: `[convert]`'s
/// limits and Ironic's raw size estimate (its growth factor, from
/// `[DEFAULT]` or `[convert]`). Shared by the conversion while downloading
/// and the one after it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ConvertRules {
    /// The converter's memory and time limits.
    pub(super) limits: convert::Limits,
    /// The bounds on a qcow2 header (the largest virtual size admitted).
    pub(super) qcow2: qcow2::Limits,
    /// `raw_image_growth_factor`.
    growth: f64,
}

impl ConvertRules {
    /// The rules of `[convert]`, with the growth factor the configuration
    /// settled on ([`crate::config::Config::raw_image_growth_factor`]).
    pub(super) fn new(convert: &ConvertSection, growth: f64) -> ConvertRules {
        ConvertRules {
            limits: convert.limits(),
            qcow2: convert.qcow2_limits(),
            growth,
        }
    }

    /// The room to make before converting an image of `file_size` bytes
    /// describing `virtual_size` bytes: Ironic's estimate of its raw size.
    pub(super) fn raw_size_estimate(&self, file_size: u64, virtual_size: u64) -> u64 {
        ((file_size as f64 * self.growth) as u64).min(virtual_size)
    }
}

/// Converting qcow2 downloads to raw while they download: whether it is on
/// (`[convert]stream_while_downloading`), its rules, the housekeeping that
/// makes room for the output, and, once the peers are on, where the output
/// is offered to the workers waiting for it.
pub(super) struct StreamConverter {
    /// `[convert]stream_while_downloading`.
    on: bool,
    rules: ConvertRules,
    keeper: Keeper,
    metrics: Arc<Metrics>,
    /// The masters being written, once the peers are on.
    live: OnceLock<Arc<LiveMasters>>,
}

impl StreamConverter {
    /// The conversion `convert` configures, bounded by `rules`, making room
    /// with `keeper` and counting in `metrics`.
    pub(super) fn new(
        convert: &ConvertSection,
        rules: ConvertRules,
        keeper: Keeper,
        metrics: Arc<Metrics>,
    ) -> StreamConverter {
        StreamConverter {
            on: convert.stream_while_downloading,
            rules,
            keeper,
            metrics,
            live: OnceLock::new(),
        }
    }

    /// Whether a download is converted while it downloads: a qcow2 to be
    /// made raw (`force_raw`) from a source that is not a local file.
    pub(super) fn applies(&self, force_raw: bool, source: &crate::sources::Source) -> bool {
        force_raw && self.on && !matches!(source, crate::sources::Source::File(_))
    }

    /// From now on, outputs are offered in `live` while they are written
    /// (when the peers are turned on).
    pub(super) fn publish_to(&self, live: Arc<LiveMasters>) {
        let _ = self.live.set(live);
    }

    /// With peers on: offers `out`, to become master `name` of `size`
    /// bytes, to the workers waiting for it while it is written.
    fn publish_live(&self, name: &str, out: &std::path::Path, size: u64) -> Option<LiveGuard> {
        let live = self.live.get()?;
        (size > 0).then(|| live.publish(name, out.to_path_buf(), size))
    }

    /// Converts a qcow2 while `temp` is still being downloaded: waits for the
    /// announced size, the header and the L1 table, validates them against
    /// the announced size, makes room, then runs the converter on the
    /// growing file, whose output (with peers on) is published to the
    /// workers waiting for master `name`. An error means "convert after the
    /// download", unless the converter hit its limits (then it stands).
    pub(super) async fn convert(
        &self,
        name: &str,
        temp: &std::path::Path,
        out: &std::path::Path,
        state: &DownloadState,
        pace: &crate::store::sink::Pace,
        served: Served,
    ) -> Result<(Digests, Option<LiveGuard>), convert::StreamFailure> {
        let not_now = |why: &str| Error::new(ErrorCode::Internal, why.to_string());
        let wait_for = |len: u64| state.wait_for(temp, len);
        let total = wait_for(inspect::HEADER_LEN as u64).await?;
        let (head, _) = inspect::read_header(temp)?;
        if inspect::detect(&head) != Format::Qcow2 {
            return Err(not_now("not a qcow2").into());
        }
        let header = qcow2::parse(&head, total, self.rules.qcow2)?;
        if !header.converter_reads() || header.nb_snapshots > 0 {
            return Err(not_now("qcow2 features that need the whole file").into());
        }
        wait_for(header.l1_table_offset + header.l1_size as u64 * 8).await?;
        inspect::check_qcow2_tables_blocking(temp, &header, total).await?;
        let needed = self.rules.raw_size_estimate(total, header.virtual_size);
        self.keeper.off_thread(move |k| k.make_room(needed)).await?;
        tracing::info!(
            virtual_size = header.virtual_size,
            "converting to raw while downloading"
        );
        let transfer = Transfer::start(&self.metrics, "convert", header.virtual_size);
        // The output is the master-to-be: the peers waiting for it follow it.
        let live = self.publish_live(name, out, convert::raw_size(header.virtual_size));
        let digests = convert::qcow2_to_raw_streaming(
            temp,
            out,
            total,
            header.virtual_size,
            served,
            self.rules.limits,
            &|done| transfer.set_done(done),
            pace,
        )
        .await?;
        Ok((digests, live))
    }
}

/// What a download tells the conversion running beside it: the announced
/// length, the bytes received, the end; waiters are woken as it advances
/// instead of polling the file.
pub(super) struct DownloadState {
    announced: AtomicU64,
    received: AtomicU64,
    over: AtomicBool,
    advanced: tokio::sync::Notify,
}

impl DownloadState {
    /// A download that has announced nothing and received nothing yet.
    pub(super) fn new() -> DownloadState {
        DownloadState {
            announced: AtomicU64::new(u64::MAX),
            received: AtomicU64::new(0),
            over: AtomicBool::new(false),
            advanced: tokio::sync::Notify::new(),
        }
    }

    /// The source announced `len` bytes.
    pub(super) fn announce(&self, len: u64) {
        self.announced.store(len, Ordering::Release);
        self.advanced.notify_waiters();
    }

    /// `done` bytes were received so far.
    pub(super) fn received(&self, done: u64) {
        self.received.store(done, Ordering::Release);
        self.advanced.notify_waiters();
    }

    /// The download is over (complete or void): waiters stop waiting.
    pub(super) fn finish(&self) {
        self.over.store(true, Ordering::Release);
        self.advanced.notify_waiters();
    }

    /// Waits until the first `len` bytes (at most the announced length) are
    /// in `temp`; the announced length. Fails when the download ends first.
    async fn wait_for(&self, temp: &std::path::Path, len: u64) -> Result<u64> {
        loop {
            let woken = self.advanced.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let total = self.announced.load(Ordering::Acquire);
            let want = len.min(total);
            // The file is looked at only once that many bytes were received
            // (the writer thread lands them shortly after).
            if total != u64::MAX
                && self.received.load(Ordering::Acquire) >= want
                && std::fs::metadata(temp).is_ok_and(|m| m.len() >= want)
            {
                return Ok(total);
            }
            if self.over.load(Ordering::Acquire) {
                return Err(Error::new(
                    ErrorCode::Internal,
                    "download over before the range arrived",
                ));
            }
            // Woken by the next chunk; the bound covers the last bytes the
            // writer lands after the last chunk was announced.
            let _ = tokio::time::timeout(std::time::Duration::from_millis(50), woken).await;
        }
    }
}
