//! Metrics of finished transfers: downloads from the sources, conversions
//! to raw and the hashing beside them.

use super::{DURATION_BUCKETS, Registrar};
use prometheus::{Histogram, IntCounter, IntCounterVec};

/// The transfers' figures.
pub struct TransferMetrics {
    /// Bytes downloaded from sources.
    pub download_bytes: IntCounter,
    /// Download durations.
    pub download_seconds: Histogram,
    /// Raw bytes produced by conversions.
    pub convert_bytes: IntCounter,
    /// Conversions by mode: `while_downloading` or `after_download`.
    pub conversions: IntCounterVec,
    /// Conversion durations.
    pub convert_seconds: Histogram,
    /// Time the slowest hasher of a pass spent hashing.
    pub hash_seconds: Histogram,
}

impl TransferMetrics {
    /// Creates and registers the transfers' metrics.
    pub(super) fn register(r: &Registrar<'_>) -> TransferMetrics {
        TransferMetrics {
            download_bytes: r.counter(
                "download_bytes_total",
                "Bytes downloaded from image sources.",
            ),
            download_seconds: r.histogram(
                "download_duration_seconds",
                "Duration of image downloads.",
                DURATION_BUCKETS,
            ),
            convert_bytes: r.counter(
                "conversion_bytes_total",
                "Raw bytes produced by conversions.",
            ),
            conversions: r.counter_vec(
                "conversions_total",
                "Conversions to raw by mode (while_downloading, after_download).",
                &["mode"],
            ),
            convert_seconds: r.histogram(
                "conversion_duration_seconds",
                "Duration of conversions to raw.",
                DURATION_BUCKETS,
            ),
            hash_seconds: r.histogram(
                "hashing_duration_seconds",
                "Time the slowest hasher of a pass spent hashing (it runs beside the I/O).",
                DURATION_BUCKETS,
            ),
        }
    }

    /// Records a finished conversion (`mode`: `while_downloading` or
    /// `after_download`) that wrote `bytes` in `took`, `hashing` of it
    /// spent hashing.
    pub fn conversion(
        &self,
        mode: &str,
        bytes: u64,
        hashing: std::time::Duration,
        took: std::time::Duration,
    ) {
        self.conversions.with_label_values(&[mode]).inc();
        self.convert_bytes.inc_by(bytes);
        self.convert_seconds.observe(took.as_secs_f64());
        self.hash_seconds.observe(hashing.as_secs_f64());
    }
}
