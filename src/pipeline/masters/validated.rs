//! `image_download_source = http` with `[conductor]conductor_always_validates_images`:
//! the agent still downloads an http(s) source itself, but the worker first
//! downloads it, verifies and inspects it (format declared and permitted,
//! qcow2 safety), as Ironic 39's conductor does in that mode. The verified
//! bytes stay in the cache as a master of their own (never converted, linked
//! to no node), so a repeated request does not download them again; eviction
//! treats them like any unlinked master.

use super::job::MasterFetch;
use super::obtain::Obtained;
use super::resolve::ImagePlan;
use super::{Masters, Request};
use crate::error::Result;
use crate::messages::{CacheOutcome, Completion, InstanceInfo};
use crate::sources::Source;
use crate::store::cache;
use crate::store::checksum::{Algo, ChecksumSpec, Expected};

impl Masters {
    /// `http` mode with validation: the image downloaded, verified and
    /// inspected (or found so in the cache) and the source's own URL
    /// answered; whether it was found in the cache.
    pub(in crate::pipeline) async fn validate_image(
        &self,
        image: ImagePlan,
        req: &Request,
        done: &mut Completion,
    ) -> Result<CacheOutcome> {
        let expected =
            Box::pin(self.resolver.expected_of(image.spec.clone(), &image.source)).await?;
        let validated = self.validated_pass_through(
            &image.source,
            &image.href,
            expected,
            req,
            &image.info,
            done,
        );
        Box::pin(validated).await
    }

    /// `image_download_source = http` with an http(s) source: the agent
    /// downloads from the source itself, after a HEAD check, as Ironic does.
    pub(in crate::pipeline) async fn pass_through(
        &self,
        source: &Source,
        href: &str,
        spec: Option<ChecksumSpec>,
        done: &mut Completion,
    ) -> Result<()> {
        let stat = self.fetcher.stat(source).await?;
        let expected = match spec {
            None => None,
            Some(spec) => Some(self.resolver.resolve_checksum(spec, source).await?),
        };
        done.image_url = Some(href.to_string());
        if let Some(e) = expected {
            if e.algo == Algo::Md5 {
                done.image_checksum = Some(e.hex);
            } else {
                done.image_os_hash_algo = Some(e.algo.name().into());
                done.image_os_hash_value = Some(e.hex);
            }
        }
        done.image_size = stat.size;
        done.converted = Some(false);
        Ok(())
    }

    /// Downloads, verifies and inspects `source` (or finds it verified in
    /// the cache), then answers its own URL as [`Masters::pass_through`]
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
            served: super::job::served(self.config.agent.served_md5, expected.as_ref()),
            force_raw: false,
            info,
            slow: &req.slow,
            turn: &req.turn,
        };
        // Only the source's own bytes will do: the agent downloads them.
        let obtained = self.obtain_master(&job, true, &|_| false);
        let Obtained {
            master, outcome, ..
        } = self.locked(&name, obtained).await?;
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
        done.image_disk_format = Some(meta.source_format.name().into());
        done.image_size = Some(meta.size);
        done.converted = Some(false);
        tracing::info!(format = %meta.source_format, "inspected, the agent downloads from the source");
        Ok(outcome)
    }
}
