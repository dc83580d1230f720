//! Converting a qcow2 while it downloads: the conversion waits on the
//! download's progress ([`DownloadState`]), checks the header and tables of
//! the bytes already there, and runs the converter on the growing file. Its
//! result is only used once the whole download is verified (see `fetch`).
//! It knows nothing of requests, nodes, the broker or HTTP serving.

use super::Masters;
use crate::error::{Error, ErrorCode, Result};
use crate::image::convert;
use crate::image::inspect;
use crate::image_format::Format;
use crate::metrics::progress::Transfer;
use crate::peers::live::LiveGuard;
use crate::store::sink::{Digests, Served};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

impl Masters {
    /// With peers on: offers `out`, to become master `name` of `size`
    /// bytes, to the workers waiting for it while it is written.
    pub(super) fn publish_live(
        &self,
        name: &str,
        out: &std::path::Path,
        size: u64,
    ) -> Option<LiveGuard> {
        self.peers.get()?;
        (size > 0).then(|| self.live.publish(name, out.to_path_buf(), size))
    }

    /// Converts a qcow2 while `temp` is still being downloaded: waits for the
    /// announced size, the header and the L1 table, validates them against
    /// the announced size, makes room, then runs the converter on the
    /// growing file, whose output (with peers on) is published to the
    /// workers waiting for master `name`. An error means "convert after the
    /// download", unless the converter hit its limits (then it stands).
    pub(super) async fn stream_convert(
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
        let limits = self.config.convert.qcow2_limits();
        let header = crate::image::qcow2::parse(&head, total, limits)?;
        if !header.converter_reads() || header.nb_snapshots > 0 {
            return Err(not_now("qcow2 features that need the whole file").into());
        }
        wait_for(header.l1_table_offset + header.l1_size as u64 * 8).await?;
        inspect::check_qcow2_tables_blocking(temp, &header, total).await?;
        let needed = self.config.raw_size_estimate(total, header.virtual_size);
        self.off_thread(move |k| k.make_room(needed)).await?;
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
            self.config.convert.limits(),
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
    pub(super) fn new() -> DownloadState {
        DownloadState {
            announced: AtomicU64::new(u64::MAX),
            received: AtomicU64::new(0),
            over: AtomicBool::new(false),
            advanced: tokio::sync::Notify::new(),
        }
    }

    pub(super) fn announce(&self, len: u64) {
        self.announced.store(len, Ordering::Release);
        self.advanced.notify_waiters();
    }

    pub(super) fn received(&self, done: u64) {
        self.received.store(done, Ordering::Release);
        self.advanced.notify_waiters();
    }

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
