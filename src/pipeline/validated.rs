//! `image_download_source = http` with `[conductor]conductor_always_validates_images`:
//! the agent still downloads an http(s) source itself, but the worker first
//! downloads it, verifies and inspects it (format declared and permitted,
//! qcow2 safety), as Ironic 39's conductor does in that mode. The verified
//! bytes stay in the cache as a master of their own (never converted, linked
//! to no node), so a repeated request does not download them again; eviction
//! treats them like any unlinked master.

use super::fetch::MasterFetch;
use super::{Pipeline, Request};
use crate::error::{Error, ErrorCode, Result};
use crate::image::inspect;
use crate::messages::{CacheOutcome, Completion, InstanceInfo};
use crate::sources::Source;
use crate::store::cache::{self, Master};
use crate::store::checksum::{Algo, Expected};
use crate::store::sink::Served;

impl Pipeline {
    /// Whether an http(s) source in `http` mode is inspected before its URL
    /// is answered: `conductor_always_validates_images`, unless deep image
    /// inspection is disabled (Ironic then inspects nothing).
    pub(super) fn validates_http_sources(&self) -> bool {
        let c = &self.config.conductor;
        c.conductor_always_validates_images && !c.disable_deep_image_inspection
    }

    /// Downloads, verifies and inspects `source` (or finds it verified in
    /// the cache), then answers its own URL as [`Pipeline::pass_through`]
    /// does, with the detected format and the digest of the inspected
    /// bytes when the request gave none (so the agent verifies it gets
    /// the very bytes inspected here). Says whether the verified bytes were
    /// in the cache already.
    pub(super) async fn validated_pass_through(
        &self,
        source: &Source,
        href: &str,
        expected: Option<Expected>,
        req: &Request,
        info: &InstanceInfo,
        done: &mut Completion,
    ) -> Result<CacheOutcome> {
        let name = cache::master_name(href, None, false);
        let job = MasterFetch {
            source,
            href,
            name: &name,
            expected: expected.as_ref(),
            // The master may serve a prepare later: its digests as a
            // prepare's.
            served: Served {
                md5: self.config.agent.served_md5,
                sha512: expected.as_ref().is_some_and(|e| e.algo == Algo::Sha512),
            },
            force_raw: false,
            info,
            slow: &req.slow,
        };
        let mut master_lock = self.cache.lock(&name).await?;
        let result = self.verified_master(&job).await;
        if result.is_err() {
            self.cache.release_failed(&name, &mut master_lock);
        }
        let (master, outcome) = result?;
        let meta = &master.meta;
        done.image_url = Some(href.to_string());
        match expected {
            Some(e) if e.algo == Algo::Md5 => done.image_checksum = Some(e.hex),
            Some(e) => {
                done.image_os_hash_algo = Some(e.algo.name().into());
                done.image_os_hash_value = Some(e.hex);
            }
            None => {
                done.image_os_hash_algo = Some("sha256".into());
                done.image_os_hash_value = Some(meta.sha256.clone());
            }
        }
        done.image_disk_format = Some(meta.source_format.clone());
        done.image_size = Some(meta.size);
        done.converted = Some(false);
        tracing::info!(format = %meta.source_format, "inspected, the agent downloads from the source");
        Ok(outcome)
    }

    /// The cached master of `job` when it holds the expected bytes (or,
    /// without a checksum, the source has not changed since), its format
    /// checked again; else a new one, downloaded, verified and inspected.
    async fn verified_master(&self, job: &MasterFetch<'_>) -> Result<(Master, CacheOutcome)> {
        let cached = self
            .cache
            .load(job.name)
            .filter(|m| m.meta.source == crate::secrets::redact_url(job.href))
            .filter(|m| m.meta.served_as_fetched());
        if let Some(m) = cached {
            let good = match job.expected {
                Some(e) => super::prepare::source_digest(&m.meta, e.algo) == Some(e.hex.as_str()),
                None => Box::pin(self.is_fresh(job.source, &m.meta)).await?,
            };
            if good {
                let format =
                    inspect::Format::from_name(&m.meta.source_format).ok_or_else(|| {
                        Error::new(ErrorCode::Internal, "cache sidecar names an unknown format")
                    })?;
                self.check_declared_format(format, job.info)?;
                return Ok((m, CacheOutcome::Hit));
            }
        }
        let (master, _hold) = Box::pin(self.fetch_master(job)).await?;
        Ok((master, CacheOutcome::Miss))
    }
}
