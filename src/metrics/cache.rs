//! Metrics of the master cache and of the nodes' files made from it: size
//! against its limit, masters, evictions and published links.

use super::Registrar;
use prometheus::{IntCounter, IntCounterVec, IntGauge};

/// The cache's and the node files' figures.
pub struct CacheMetrics {
    /// Bytes allocated by the master cache.
    pub bytes: IntGauge,
    /// `[pxe]image_cache_size` in bytes, for alerting on the ratio.
    pub limit: IntGauge,
    /// Masters in the cache.
    pub files: IntGauge,
    /// Masters linked by at least one node.
    pub linked: IntGauge,
    /// Masters evicted.
    pub evictions: IntCounter,
    /// Bytes evicted to make room for files of unannounced length.
    pub unannounced_evicted: IntCounter,
    /// Nodes whose files expired (`[cache]node_files_ttl`).
    pub node_files_expired: IntCounter,
    /// Published node symlinks.
    pub active_links: IntGauge,
    /// Compressions of masters (`[http] gzip = static`), by result.
    pub compressions: IntCounterVec,
}

impl CacheMetrics {
    /// Creates and registers the cache's metrics.
    pub(super) fn register(r: &Registrar<'_>) -> CacheMetrics {
        CacheMetrics {
            bytes: r.gauge(
                "cache_size_bytes",
                "Bytes allocated by the master image cache.",
            ),
            limit: r.gauge(
                "cache_limit_bytes",
                "The cache size limit ([pxe]image_cache_size).",
            ),
            files: r.gauge("cache_files", "Masters in the image cache."),
            linked: r.gauge(
                "cache_linked_files",
                "Masters linked by at least one node (never evicted).",
            ),
            evictions: r.counter("cache_evictions_total", "Masters evicted from the cache."),
            unannounced_evicted: r.counter(
                "cache_unannounced_evicted_bytes_total",
                "Bytes evicted to make room for downloads and decompressions of unannounced \
                 length (each at most [convert]max_virtual_size_gib).",
            ),
            node_files_expired: r.counter(
                "node_files_expired_total",
                "Nodes whose files no command asked for within [cache]node_files_ttl, removed.",
            ),
            active_links: r.gauge("active_links", "Published node symlinks under http_root."),
            compressions: r.counter_vec(
                "cache_gzip_compressions_total",
                "Masters compressed for serving ([http] gzip = static), by result: compressed, \
                 declined (under [http] gzip_min_ratio: served identity), failed.",
                &["result"],
            ),
        }
    }

    /// Sets the gauges: total `bytes` of `files` masters, `linked` of them
    /// linked by a node.
    pub fn state(&self, bytes: u64, files: usize, linked: usize) {
        self.bytes.set(bytes.min(i64::MAX as u64) as i64);
        self.files.set(files as i64);
        self.linked.set(linked as i64);
    }
}
