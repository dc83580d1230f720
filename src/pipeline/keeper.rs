//! The cache housekeeping the pipeline runs on a blocking thread: eviction
//! under the cache policy, room before a download or conversion, the cache
//! gauges. It knows the cache directory and the policy, not requests, nodes,
//! the broker or HTTP serving.

use crate::error::Result;
use crate::fsutil;
use crate::metrics::Metrics;
use crate::store::cache::Cache;
use std::sync::Arc;

/// The cache housekeeping (eviction, free space, gauges): cheap to clone,
/// so it runs on a blocking thread.
pub(super) struct Keeper {
    pub(super) cache: Cache,
    pub(super) policy: crate::store::eviction::Policy,
    pub(super) metrics: Arc<Metrics>,
}

impl Keeper {
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
