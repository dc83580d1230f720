//! Making a new master, step by step: download and verify against the
//! expected checksum (with a qcow2 converted alongside when it can be, see
//! `stream`), decompress zstd, inspect, convert after the download when it
//! must be, commit to the cache. Nothing partial becomes a master: every
//! step works on temporaries that are removed unless committed. The
//! [`Maker`] does it, with the parts it holds. It knows
//! nothing of nodes (linking is the request's business), the broker or HTTP
//! serving.

use super::admit::Admission;
use super::attempt::{Attempts, Streamed, Written};
use super::job::MasterFetch;
use super::keeper::{Keeper, Room};
use super::peers::{PeerSource, PeerTurn};
use super::stream::ConvertRules;
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil::TempGuard;
use crate::image::convert;
use crate::image::inspect;
use crate::image_format::Format;
use crate::metrics::Metrics;
use crate::metrics::progress::Transfer;
use crate::sources::SourceStat;
use crate::store::cache::{self, Master, MasterMeta};
use crate::store::sink::Digests;
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

/// A verified download: its digests, what the source said about it, when
/// the download started.
struct Downloaded {
    digests: Digests,
    stat: SourceStat,
    fetched_at: u64,
}

/// Makes new masters (see the module): it holds the peers asked first,
/// the download attempts, the admission that inspects and commits, the
/// housekeeping that makes room, the conversion rules of `[convert]` and
/// the metrics, nothing else.
pub(super) struct Maker {
    peers: Arc<PeerSource>,
    attempts: Arc<Attempts>,
    admission: Arc<Admission>,
    keeper: Keeper,
    rules: ConvertRules,
    metrics: Arc<Metrics>,
}

impl Maker {
    /// The making of masters from these parts.
    pub(super) fn new(
        peers: Arc<PeerSource>,
        attempts: Arc<Attempts>,
        admission: Arc<Admission>,
        keeper: Keeper,
        rules: ConvertRules,
        metrics: Arc<Metrics>,
    ) -> Maker {
        Maker {
            peers,
            attempts,
            admission,
            keeper,
            rules,
            metrics,
        }
    }

    /// Downloads `job.source` into a new master (committed) and returns it
    /// with a hold: a hard link that keeps the file until the caller linked
    /// it to the node, so no eviction can take it in between.
    pub(super) async fn make(&self, job: &MasterFetch<'_>) -> Result<(Master, TempGuard)> {
        // A download (from a peer or the source) waits for its turn among
        // the worker's download slots; nothing before it does.
        job.turn.take().await?;
        // With peers on: a peer's master, or the cloud-wide claim on the
        // download, held until this master is committed (when this returns).
        let _claim = match self.peers.through(job).await? {
            PeerTurn::Fetched(got) => return Ok(*got),
            PeerTurn::Source(claim) => claim,
        };
        tracing::info!(source = %job.source.display(), master = job.name, "downloading");
        // A qcow2 to be converted is converted while it downloads when it can
        // be (see `attempt`); that result is only used after the download is
        // verified and the complete file passes every check.
        let (downloaded, download, streamed) = self.download_verified(job).await?;
        // zstd-compressed downloads are decompressed, as Ironic does, and
        // the result is what gets inspected and served.
        let (temp, served) = match self.decompress_zstd(job, download.path()).await? {
            Some(unpacked) => unpacked,
            None => (download, downloaded.digests.clone()),
        };
        let (found, qcow2) = self.admission.inspect_download(job, temp.path()).await?;
        let streamed = streamed.filter(|_| found.format == Format::Qcow2);
        let mut live = None;
        let (temp, served, converted) = match streamed {
            // The converter hit its limits on these very bytes: no second try.
            Some(Streamed { result: Err(e), .. }) => return Err(e),
            Some(Streamed {
                out,
                result: Ok((d, took)),
                live: followed,
            }) => {
                live = followed;
                self.metrics
                    .transfer
                    .conversion("while_downloading", d.size, d.hashing(), took);
                check_converted(out.path(), &d, &found)?;
                (out, d, true)
            }
            None if job.force_raw && found.format.needs_conversion() => {
                let (out, d) = self
                    .convert_after_download(job, temp.path(), &found, qcow2.as_ref())
                    .await?;
                (out, d, true)
            }
            None => (temp, served, false),
        };
        let meta = master_meta(job.href, downloaded, &found, served, converted)?;
        let committed = self.admission.commit_master(job.name, temp, meta).await?;
        if let Some(live) = live {
            live.committed();
        }
        Ok(committed)
    }

    /// Downloads (see `attempt`) and checks the completed attempt's bytes
    /// against the expected checksum; returns them with their file and the
    /// conversion that read that file, if one ran.
    async fn download_verified(
        &self,
        job: &MasterFetch<'_>,
    ) -> Result<(Downloaded, TempGuard, Option<Streamed>)> {
        let fetched_at = cache::unix_secs(SystemTime::now());
        let started = Instant::now();
        let (written, streamed) = self.attempts.download(job).await?;
        let Written {
            file,
            digests,
            stat,
            ..
        } = written;
        self.metrics.transfer.download_bytes.inc_by(digests.size);
        self.metrics
            .transfer
            .download_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics
            .transfer
            .hash_seconds
            .observe(digests.hash_micros as f64 / 1e6);
        if let Some(e) = job.expected {
            let got = digests.get(e.algo).unwrap_or_default();
            if got != e.hex {
                return Err(Error::new(
                    ErrorCode::ChecksumMismatch,
                    format!(
                        "{}: {} is {got}, expected {}",
                        job.source.display(),
                        e.algo,
                        e.hex
                    ),
                ));
            }
        }
        let downloaded = Downloaded {
            digests,
            stat,
            fetched_at,
        };
        Ok((downloaded, file, streamed))
    }

    /// A zstd-compressed download, decompressed into a new temporary with
    /// its digests; `None` when the download is not zstd.
    async fn decompress_zstd(
        &self,
        job: &MasterFetch<'_>,
        temp: &Path,
    ) -> Result<Option<(TempGuard, Digests)>> {
        let (header, _) = inspect::read_header(temp)?;
        if !inspect::is_zstd(&header) {
            return Ok(None);
        }
        let out = TempGuard::new(self.keeper.cache.temp_path(job.name)?);
        let max = self.rules.qcow2.max_virtual_size;
        // Its length is nobody's announcement: room is made as it grows,
        // as for a download without one.
        let mut room = Room::ahead_of(self.keeper.clone(), 0);
        let d = convert::decompress_zstd(temp, out.path(), job.served, max, &mut room).await?;
        Ok(Some((out, d)))
    }

    /// Converts the complete download to raw (after making room for it)
    /// into a new temporary, and checks the result.
    async fn convert_after_download(
        &self,
        job: &MasterFetch<'_>,
        temp: &Path,
        found: &inspect::Inspection,
        qcow2: Option<&crate::image::qcow2::Header>,
    ) -> Result<(TempGuard, Digests)> {
        let needed = self
            .rules
            .raw_size_estimate(found.file_size, found.virtual_size);
        self.keeper.off_thread(move |k| k.make_room(needed)).await?;
        let out = TempGuard::new(self.keeper.cache.temp_path(job.name)?);
        tracing::info!(
            format = found.format.name(),
            virtual_size = found.virtual_size,
            "converting to raw"
        );
        let transfer = Transfer::start(&self.metrics, "convert", found.virtual_size);
        let started = Instant::now();
        let d = convert::to_raw(
            temp,
            out.path(),
            found,
            qcow2,
            job.served,
            self.rules.limits,
            &|done| transfer.set_done(done),
        )
        .await?;
        drop(transfer);
        self.metrics
            .transfer
            .conversion("after_download", d.size, d.hashing(), started.elapsed());
        check_converted(out.path(), &d, found)?;
        Ok((out, d))
    }
}

/// The sidecar of a new master: what was downloaded, what is served.
fn master_meta(
    href: &str,
    downloaded: Downloaded,
    found: &inspect::Inspection,
    served: Digests,
    converted: bool,
) -> Result<MasterMeta> {
    let Downloaded {
        digests,
        stat,
        fetched_at,
    } = downloaded;
    Ok(MasterMeta {
        source: crate::secrets::redact_url(href),
        fetched_at,
        source_last_modified: stat.last_modified.map(cache::unix_secs),
        source_size: digests.size,
        source_md5: digests.md5,
        source_sha256: digests.sha256,
        source_sha512: digests.sha512,
        source_format: found.format,
        converted,
        disk_format: match converted {
            true => Format::Raw.served(),
            false => found.format.served(),
        },
        sha256: served.served_sha256()?,
        size: served.size,
        md5: served.md5,
        sha512: served.sha512,
        inode: 0,
    })
}

/// The converted file must be raw and, for qcow2, exactly the virtual size.
fn check_converted(path: &std::path::Path, d: &Digests, found: &inspect::Inspection) -> Result<()> {
    let now = inspect::inspect_file(path)?;
    let size_ok = found.format != Format::Qcow2 || d.size == convert::raw_size(found.virtual_size);
    if now.format.is_raw() && size_ok {
        return Ok(());
    }
    Err(Error::new(
        ErrorCode::CorruptImage,
        format!(
            "converted to raw, but the result is {} of {} bytes (virtual size {})",
            now.format.name(),
            d.size,
            found.virtual_size
        ),
    ))
}
