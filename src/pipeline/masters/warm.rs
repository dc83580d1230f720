//! Warming the cache: a `warm` names an image, not a node, and makes the
//! very master a prepare of that image with the same options would use
//! (same name, same conversion rule, same checksum and format checks), so
//! the first deploy of it is a cache hit. It links nothing for any node and
//! touches no node's files or ledger: the master stays unlinked, and
//! Ironic's eviction policy (TTL, size limit) may take it again like any
//! unlinked master; a warm that finds it cached counts as a use of it
//! (its last use is now), so warming again before a rollout keeps it.

use super::obtain::{Obtained, fill_image};
use super::resolve::Mode;
use super::{Masters, Request};
use crate::error::Result;
use crate::messages::{CacheOutcome, Completion};

impl Masters {
    /// Caches `req`'s image as a prepare would and fills `done` with what a
    /// prepare answers of it, without a URL. In `image_download_source =
    /// http` mode an http(s) source is what deploys download from, so
    /// nothing is cached: the source is checked as a prepare checks it
    /// (reachable, its checksum resolved; downloaded and inspected with
    /// `conductor_always_validates_images`, whose verified bytes are
    /// cached as a prepare caches them), and `cache` says `pass_through`
    /// (`hit`/`miss` of the validated bytes when validating).
    pub(in crate::pipeline) async fn warm(
        &self,
        req: &Request,
        done: &mut Completion,
    ) -> Result<()> {
        let image = Box::pin(self.resolver.resolve_image(req, done)).await?;
        match image.mode {
            Mode::Cache => {}
            Mode::PassThrough => {
                let checked = self.pass_through(&image.source, &image.href, image.spec, done);
                Box::pin(checked).await?;
                done.image_url = None;
                done.cache = Some(CacheOutcome::PassThrough);
                return Ok(());
            }
            Mode::Validate => {
                let outcome = Box::pin(self.validate_image(image, req, done)).await?;
                done.image_url = None;
                done.cache = Some(outcome);
                return Ok(());
            }
        }
        let expected =
            Box::pin(self.resolver.expected_of(image.spec.clone(), &image.source)).await?;
        let (name, force_raw) = self.resolver.master_of(&image, req);
        let job = image.job(&name, expected.as_ref(), force_raw, req);
        let warmed = async {
            let obtained = self.obtain_master(&job, false, &|_| false).await?;
            match obtained.outcome {
                // Linking nothing, a hit would not count as a use for eviction.
                CacheOutcome::Hit => self.cache.mark_used(&obtained.master.path),
                // Enforce the size limit and TTL while the hold (and the
                // master lock) keep the new master from being the one evicted.
                CacheOutcome::Miss => {
                    self.after_growth().await;
                    self.refresh_cache_gauges().await;
                }
                CacheOutcome::PassThrough => {}
            }
            Ok(obtained)
        };
        let Obtained {
            master, outcome, ..
        } = self.locked(&name, warmed).await?;
        tracing::info!(cache = ?outcome, master = %master.path.display(), "warmed");
        self.compress_later(&name);
        fill_image(&master.meta, job.served, outcome, done);
        Ok(())
    }
}
