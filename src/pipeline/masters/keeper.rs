//! The cache housekeeping the pipeline runs on a blocking thread: eviction
//! under the cache policy, room before a download or conversion (and,
//! with [`Room`], ahead of a file whose final length nobody announced), the
//! cache gauges, and the pipeline's ways of running it off the async
//! threads. It knows the cache directory and the policy, not requests,
//! nodes, the broker or HTTP serving.

use super::blocking;
use crate::error::{Error, ErrorCode, Result};
use crate::fsutil;
use crate::metrics::Metrics;
use crate::store::cache::Cache;
use std::sync::Arc;

/// How much free space a file of unannounced length makes sure of ahead.
pub(super) const GROWTH_STEP: u64 = 256 << 20;

/// The cache housekeeping (eviction, free space, gauges): cheap to clone,
/// so it runs on a blocking thread.
#[derive(Clone)]
pub(super) struct Keeper {
    /// The master cache it keeps (its directory, where temporaries go).
    pub(super) cache: Cache,
    /// Ironic's eviction policy, from `[pxe]`.
    pub(super) policy: crate::store::eviction::Policy,
    /// Where evictions and the cache gauges are counted.
    pub(super) metrics: Arc<Metrics>,
    /// The largest image the configuration admits
    /// (`[convert]max_virtual_size_gib`, whatever the format): the most a
    /// file of unannounced length may have room made for by eviction.
    pub(super) unannounced_cap: u64,
}

impl Keeper {
    /// The housekeeping of `cache` under the policy of `pxe` and the
    /// bound of `convert`, counting in `metrics`.
    pub(super) fn new(
        cache: Cache,
        pxe: &crate::config::PxeSection,
        convert: &crate::config::ConvertSection,
        metrics: Arc<Metrics>,
    ) -> Keeper {
        Keeper {
            cache,
            policy: pxe.eviction_policy(),
            metrics,
            unannounced_cap: convert.qcow2_limits().max_virtual_size,
        }
    }

    /// Runs `work` with this housekeeping on a blocking thread, so the
    /// async threads keep serving images and messages (statvfs, listing,
    /// unlinks).
    pub(super) async fn off_thread<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Keeper) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let keeper = self.clone();
        blocking(move || work(&keeper)).await
    }

    /// After the cache grew: enforces the size limit and TTL, then
    /// refreshes the cache gauges, in one trip off the async threads (a new
    /// master is protected by its link to the node or its hold, made before
    /// this runs).
    pub(super) async fn after_growth(&self) {
        let cleaned = self
            .off_thread(|k| {
                let cleaned = k.clean(0, false, false);
                k.refresh_cache_gauges();
                cleaned
            })
            .await;
        if let Err(e) = cleaned {
            tracing::warn!(error = %e, "cache clean-up failed");
        }
    }

    /// Refreshes the cache gauges off the async threads.
    pub(super) async fn refresh_gauges_off_thread(&self) {
        let _ = self
            .off_thread(|k| {
                k.refresh_cache_gauges();
                Ok(())
            })
            .await;
    }

    /// Applies the cache policy, reclaiming at least `amount` bytes if it can.
    pub(super) fn clean(
        &self,
        amount: u64,
        all_unused: bool,
        dry_run: bool,
    ) -> Result<crate::store::eviction::Report> {
        let report =
            crate::store::eviction::clean(&self.cache, self.policy, amount, all_unused, dry_run)?;
        if !dry_run {
            self.metrics
                .cache
                .evictions
                .inc_by(report.evicted.len() as u64);
        }
        Ok(report)
    }

    /// Makes sure `needed` bytes are free in the cache, evicting unused
    /// masters first, as Ironic does before a download or conversion.
    pub(super) fn make_room(&self, needed: u64) -> Result<()> {
        let dir = self.cache.dir();
        let free = fsutil::free_space(dir)?;
        if needed > free {
            let report = self.clean(needed - free, false, false)?;
            if !report.evicted.is_empty() {
                tracing::info!(
                    evicted = report.evicted.len(),
                    freed = report.freed,
                    "evicted to make room"
                );
            }
        }
        fsutil::check_space(dir, needed)
    }

    /// Makes sure the next `step` bytes of a file of unannounced length
    /// are free, the file having had room made for its first `covered`
    /// bytes. Eviction makes room only while `covered` is under
    /// [`Keeper::unannounced_cap`]: a source that never ends (or a
    /// decompression bomb) cannot empty the cache before it is refused;
    /// past the cap, the file only goes on in space already free. What it
    /// evicted is counted and logged.
    pub(super) fn make_room_unannounced(&self, covered: u64, step: u64) -> Result<()> {
        let dir = self.cache.dir();
        let free = fsutil::free_space(dir)?;
        if step > free && covered < self.unannounced_cap {
            let amount = (step - free).min(self.unannounced_cap - covered);
            let report = self.clean(amount, false, false)?;
            if !report.evicted.is_empty() {
                self.metrics.cache.unannounced_evicted.inc_by(report.freed);
                tracing::warn!(
                    evicted = ?report.evicted,
                    freed = report.freed,
                    covered,
                    cap = self.unannounced_cap,
                    "evicted to make room for a file of unannounced length"
                );
            }
        }
        fsutil::check_space(dir, step).map_err(|e| match covered >= self.unannounced_cap {
            true => Error::new(
                ErrorCode::InsufficientDiskSpace,
                format!(
                    "{e}; a file of unannounced length past {} MiB \
                     ([convert]max_virtual_size_gib, the largest image admitted) \
                     evicts nothing more",
                    self.unannounced_cap >> 20
                ),
            ),
            false => e,
        })
    }

    /// Refreshes the cache gauges from the directory.
    pub(super) fn refresh_cache_gauges(&self) {
        self.metrics
            .cache
            .limit
            .set(self.policy.size_limit.min(i64::MAX as u64) as i64);
        if let Ok(entries) = crate::store::eviction::list(&self.cache) {
            let bytes = entries.iter().map(|e| e.size).sum();
            let linked = entries.iter().filter(|e| e.linked_nodes > 0).count();
            self.metrics.cache.state(bytes, entries.len(), linked);
        }
    }
}

/// Room made ahead of a file that grows to a length nobody announced: a
/// download without `Content-Length` (or decoded from gzip as it arrives),
/// an image decompressed from zstd. Every such writer in the pipeline goes
/// through it, so one rule holds for all of them: once the file is within
/// half a [`GROWTH_STEP`] of the room made sure of, a background eviction
/// makes sure of a step more (unlinking large masters takes a while: the
/// writer goes on meanwhile), and the writer waits for it only when it
/// reaches the end of the room made sure of, so it never writes past room
/// that was not made: it fails with `insufficient_disk_space` while the
/// file system still has space, never by filling it. Eviction makes room
/// for at most the largest image admitted (see
/// [`Keeper::make_room_unannounced`]).
pub(super) struct Room {
    keeper: Keeper,
    /// Bytes covered by the free space made sure of so far.
    until: u64,
    /// Room being made ahead: the bytes it covers once made, and the
    /// eviction making it.
    ahead: Option<(u64, tokio::task::JoinHandle<Result<()>>)>,
}

impl Room {
    /// Room for a file whose first `made` bytes have room made already.
    pub(super) fn ahead_of(keeper: Keeper, made: u64) -> Room {
        Room {
            keeper,
            until: made,
            ahead: None,
        }
    }

    /// The file is now `size` bytes: makes sure of more room ahead, and
    /// waits for it once the file reaches the end of the room made.
    pub(super) async fn grow_to(&mut self, size: u64) -> Result<()> {
        if self.ahead.is_none() && size.saturating_add(GROWTH_STEP / 2) > self.until {
            let (keeper, covered) = (self.keeper.clone(), self.until);
            let task = tokio::task::spawn_blocking(move || {
                keeper.make_room_unannounced(covered, GROWTH_STEP)
            });
            self.ahead = Some((size.saturating_add(GROWTH_STEP), task));
        }
        if size > self.until
            && let Some((until, task)) = self.ahead.take()
        {
            task.await
                .map_err(|e| Error::new(ErrorCode::Internal, format!("eviction task: {e}")))??;
            self.until = until;
        }
        Ok(())
    }
}

impl crate::image::convert::Growth for Room {
    fn grown_to(&mut self, size: u64) -> futures_util::future::BoxFuture<'_, Result<()>> {
        Box::pin(self.grow_to(size))
    }
}
