//! A peer's master received here: its bytes fetched from the holders the
//! caller chose, into a temporary and hashed in the same pass; checked
//! against the holder's record and the request (size and digests, Ironic's
//! checksum for bytes served as fetched, an inspection as a download gets);
//! then committed as our master with the digests computed here. The
//! choosing of offers is `peers`' business: this module is handed the peer
//! fetcher and knows nothing of queries, offers or claims.

use super::admit::Admission;
use super::attempt::{Attempts, DELIVERY_DEPTH};
use super::job::MasterFetch;
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil::TempGuard;
use crate::image::inspect;
use crate::metrics::Metrics;
use crate::peers::wire::OfferedMaster;
use crate::sources::peer::{Holder, PeerFetcher, Reason};
use crate::store::cache::{Master, MasterMeta, md5s_agree};
use crate::store::sink::Digests;
use std::sync::Arc;
use std::time::Duration;

/// How long a worker waits for another's download when no
/// `[source]download_deadline` bounds it.
const WAIT_LIMIT: Duration = Duration::from_secs(6 * 3600);

/// How long a wait for another worker's download, or a transfer from
/// peers, may last under `source`: `[source]download_deadline`, else
/// [`WAIT_LIMIT`].
pub(super) fn wait_limit(source: &crate::config::SourceSection) -> Duration {
    match source.download_deadline {
        0 => WAIT_LIMIT,
        s => Duration::from_secs(s),
    }
}

/// Receives, checks and adopts peers' masters (see the module): it holds
/// the download attempts its bytes go through, the admission that
/// inspects and commits them, the metrics and the bound of a transfer
/// (`[source]download_deadline`), nothing else.
pub(super) struct PeerReceiver {
    attempts: Arc<Attempts>,
    admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    /// How long a transfer from peers may last ([`wait_limit`]).
    limit: Duration,
}

impl PeerReceiver {
    /// A receiver writing through `attempts`, admitting with `admission`,
    /// its transfers bounded as `source` says.
    pub(super) fn new(
        attempts: Arc<Attempts>,
        admission: Arc<Admission>,
        metrics: Arc<Metrics>,
        source: &crate::config::SourceSection,
    ) -> PeerReceiver {
        PeerReceiver {
            attempts,
            admission,
            metrics,
            limit: wait_limit(source),
        }
    }

    /// Makes a peer's checked bytes our master, with the digests computed
    /// here, or counts and logs why they were refused.
    pub(super) async fn adopt(
        &self,
        job: &MasterFetch<'_>,
        checked: PeerBytes,
    ) -> Result<(Master, TempGuard)> {
        let (file, own, facts) = match checked {
            Ok(got) => got,
            Err((reason, e)) => {
                // Failures of the holders themselves are counted as they occur.
                if reason != Reason::Unreachable {
                    self.metrics
                        .peers
                        .fetch_failures
                        .with_label_values(&[reason.as_str()])
                        .inc();
                }
                tracing::warn!(master = job.name, reason = reason.as_str(), error = %e, "a peer's master failed its checks: not used");
                return Err(e);
            }
        };
        // Every digest of the served bytes is ours. What the holder
        // recorded of the source (it converted or decompressed it) is taken
        // from its record, which bound the request's checksum; bytes served
        // as fetched are the source's, so their digests are ours too.
        let record = meta_of(&facts);
        let as_fetched = record.served_as_fetched();
        let mut meta = MasterMeta {
            sha256: own.served_sha256()?,
            size: own.size,
            md5: own.md5,
            sha512: own.sha512,
            ..record
        };
        if as_fetched {
            meta.source_size = meta.size;
            meta.source_md5 = meta.md5.clone();
            meta.source_sha256 = Some(meta.sha256.clone());
            meta.source_sha512 = meta.sha512.clone();
        }
        self.admission.commit_master(job.name, file, meta).await
    }

    /// Receives `size` bytes of master `job.name` from `holders` (through
    /// `fetcher`) into a temporary, hashed in the same pass.
    pub(super) async fn receive_bytes(
        &self,
        fetcher: &PeerFetcher,
        job: &MasterFetch<'_>,
        size: u64,
        holders: &[Holder],
    ) -> std::result::Result<(TempGuard, Digests), Refusal> {
        // Peer bytes are never converted while they arrive, nor hashed
        // lazily: every digest is computed here, in the same pass.
        let plain = MasterFetch {
            force_raw: false,
            ..*job
        };
        let (tx, rx) = tokio::sync::mpsc::channel(DELIVERY_DEPTH);
        let failed = |h: &Holder, why: Reason| {
            tracing::warn!(peer = %h.host, reason = why.as_str(), "fetch from a peer failed");
            self.metrics
                .peers
                .fetch_failures
                .with_label_values(&[why.as_str()])
                .inc();
        };
        let limit = self.limit;
        let feed = async {
            let transfer = fetcher.download(job.name, size, holders, tx, &failed);
            tokio::time::timeout(limit, transfer)
                .await
                .unwrap_or_else(|_| {
                    Err(Error::new(
                        ErrorCode::SourceUnreachable,
                        format!(
                            "master {} from peers: not done within {}s",
                            job.name,
                            limit.as_secs()
                        ),
                    ))
                })
        };
        let (written, _) = self
            .attempts
            .receive_from(&plain, rx, feed)
            .await
            .map_err(|e| (Reason::Unreachable, e))?;
        self.metrics
            .peers
            .received_bytes
            .inc_by(written.digests.size);
        Ok((written.file, written.digests))
    }

    /// The received bytes (`own` digests, in the file at `path`) are the
    /// bytes `facts` records (size, SHA-256 and MD5), and what the request
    /// wants: Ironic's checksum for bytes served as fetched (neither
    /// converted nor decompressed), a file that inspects as recorded.
    pub(super) async fn check_received(
        &self,
        job: &MasterFetch<'_>,
        facts: &OfferedMaster,
        path: &std::path::Path,
        own: &Digests,
    ) -> std::result::Result<(), Refusal> {
        let sha256 = own.sha256.as_deref();
        let md5s_agree = md5s_agree(own.md5.as_deref(), facts.md5.as_deref());
        if own.size != facts.size || sha256 != Some(&facts.sha256) || !md5s_agree {
            let e = Error::new(
                ErrorCode::ChecksumMismatch,
                format!(
                    "master {} from a peer: {} bytes, sha256 {}; the peer recorded {} bytes, sha256 {}",
                    job.name,
                    own.size,
                    sha256.unwrap_or("not computed"),
                    facts.size,
                    facts.sha256
                ),
            );
            return Err((Reason::DigestMismatch, e));
        }
        if let Some(e) = job.expected.filter(|_| meta_of(facts).served_as_fetched())
            && own.get(e.algo) != Some(e.hex.as_str())
        {
            let err = Error::new(
                ErrorCode::ChecksumMismatch,
                format!(
                    "master {} from a peer: {} is not {}",
                    job.name, e.algo, e.hex
                ),
            );
            return Err((Reason::DigestMismatch, err));
        }
        self.inspect_peer_bytes(job, facts, path)
            .await
            .map_err(|e| (Reason::Format, e))
    }

    /// The received file is what the offer says: a converted master is
    /// raw; unconverted bytes are the declared, permitted format and pass
    /// the safety checks a download passes.
    async fn inspect_peer_bytes(
        &self,
        job: &MasterFetch<'_>,
        facts: &OfferedMaster,
        path: &std::path::Path,
    ) -> Result<()> {
        let found = match facts.converted {
            true => inspect::inspect_file(path)?,
            false => self.admission.inspect_download(job, path).await?.0,
        };
        let ok = match facts.converted {
            true => found.format.is_raw(),
            false => {
                found.format == facts.source_format
                    && !(job.force_raw && found.format.needs_conversion())
            }
        };
        if ok {
            return Ok(());
        }
        Err(Error::new(
            ErrorCode::CorruptImage,
            format!(
                "master {} from a peer is {}, its holder recorded {}",
                job.name,
                found.format.name(),
                facts.disk_format
            ),
        ))
    }
}

/// Peer bytes with their digests and the record they were checked
/// against, or why they were refused (the metric's reason).
pub(super) type PeerBytes = std::result::Result<(TempGuard, Digests, OfferedMaster), Refusal>;

/// Why a peer's bytes were refused: the metric's reason and the error. A
/// transfer that did not complete (the holders busy, unreachable or too
/// slow) is [`Reason::Unreachable`]: no fault of the bytes, so no holder is
/// found bad for it.
pub(super) type Refusal = (Reason, Error);

/// The sidecar an offered master would have here (inode set on commit).
pub(super) fn meta_of(m: &OfferedMaster) -> MasterMeta {
    MasterMeta {
        source: m.source.clone(),
        fetched_at: m.fetched_at,
        source_last_modified: m.source_last_modified,
        source_size: m.source_size,
        source_md5: m.source_md5.clone(),
        source_sha256: m.source_sha256.clone(),
        source_sha512: m.source_sha512.clone(),
        source_format: m.source_format,
        converted: m.converted,
        disk_format: m.disk_format,
        size: m.size,
        md5: m.md5.clone(),
        sha256: m.sha256.clone(),
        sha512: m.sha512.clone(),
        inode: 0,
    }
}
