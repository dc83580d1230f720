//! Prometheus metrics of the worker, registered in one registry that the
//! metrics listener renders in the text exposition format.

use crate::events::Completion;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// All metrics; cheap to clone handles are kept inside.
pub struct Metrics {
    registry: Registry,
    /// Completion events by action, status and error code.
    pub completions: IntCounterVec,
    /// Prepare duration by cache outcome.
    pub prepare_seconds: HistogramVec,
    /// Image server requests by HTTP status.
    pub http_requests: IntCounterVec,
    /// Image server response bytes (Content-Length of answered requests).
    pub http_bytes: IntCounterVec,
    /// 1 while connected to the broker.
    pub amqp_connected: IntGauge,
    /// Reconnection attempts to the broker.
    pub amqp_reconnects: prometheus::IntCounter,
    /// Messages waiting in this host's dead-letter queue (read every few
    /// seconds while connected), for alerting.
    pub amqp_dead_letters: IntGauge,
    /// Messages acknowledged without an answer, by reason.
    pub ignored: IntCounterVec,
    /// Messages consumed, by source (command/notification), action, outcome.
    pub messages: IntCounterVec,
    /// Bytes allocated by the master cache.
    pub cache_bytes: IntGauge,
    /// `[pxe]image_cache_size` in bytes, for alerting on the ratio.
    pub cache_limit: IntGauge,
    /// Masters in the cache.
    pub cache_files: IntGauge,
    /// Masters linked by at least one node.
    pub cache_linked: IntGauge,
    /// Masters evicted.
    pub evictions: prometheus::IntCounter,
    /// Published node symlinks.
    pub active_links: IntGauge,
    /// Requests being handled, by action.
    pub in_flight: IntGaugeVec,
    /// Bytes done of in-flight transfers, by stage (download, convert).
    pub in_flight_done: IntGaugeVec,
    /// Bytes expected of in-flight transfers, by stage (0 when unknown).
    pub in_flight_expected: IntGaugeVec,
    /// Bytes downloaded from sources.
    pub download_bytes: prometheus::IntCounter,
    /// Download durations.
    pub download_seconds: prometheus::Histogram,
    /// Raw bytes produced by conversions.
    pub convert_bytes: prometheus::IntCounter,
    /// Conversions by mode: `while_downloading` or `after_download`.
    pub conversions: IntCounterVec,
    /// Conversion durations.
    pub convert_seconds: prometheus::Histogram,
    /// Time the slowest hasher of a pass spent hashing.
    pub hash_seconds: prometheus::Histogram,
}

const PREFIX: &str = "ironic_image_worker_";

impl Metrics {
    /// Creates and registers every metric (plus process metrics on Linux).
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(format!("{PREFIX}{name}"), help), labels)
                .expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let completions = counter(
            "completions_total",
            "Completion events by action, status and error code.",
            &["action", "status", "code"],
        );
        let http_requests = counter(
            "http_requests_total",
            "Image server requests by status code.",
            &["status"],
        );
        let http_bytes = counter(
            "http_response_bytes_total",
            "Image server response body bytes announced, by status code.",
            &["status"],
        );
        let messages = counter(
            "messages_consumed_total",
            "Messages consumed from the broker by source, action and outcome.",
            &["source", "action", "outcome"],
        );
        let conversions = counter(
            "conversions_total",
            "Conversions to raw by mode (while_downloading, after_download).",
            &["mode"],
        );
        let ignored = counter(
            "ignored_messages_total",
            "Messages acknowledged without an answer (other conductors, irrelevant notifications), by reason.",
            &["reason"],
        );
        let prepare_seconds = HistogramVec::new(
            HistogramOpts::new(
                format!("{PREFIX}prepare_duration_seconds"),
                "Prepare duration by cache outcome.",
            )
            .buckets(vec![
                0.001, 0.005, 0.02, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1200.0,
            ]),
            &["cache"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(prepare_seconds.clone()))
            .expect("unique metric");
        let amqp_connected = IntGauge::new(
            format!("{PREFIX}amqp_connected"),
            "1 while the worker is connected to the broker.",
        )
        .expect("valid metric");
        registry
            .register(Box::new(amqp_connected.clone()))
            .expect("unique metric");
        let amqp_reconnects = prometheus::IntCounter::new(
            format!("{PREFIX}amqp_reconnects_total"),
            "Reconnection attempts to the broker.",
        )
        .expect("valid metric");
        registry
            .register(Box::new(amqp_reconnects.clone()))
            .expect("unique metric");
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(format!("{PREFIX}{name}"), help).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let cache_bytes = gauge(
            "cache_size_bytes",
            "Bytes allocated by the master image cache.",
        );
        let cache_files = gauge("cache_files", "Masters in the image cache.");
        let amqp_dead_letters = gauge(
            "amqp_dead_letter_messages",
            "Messages in this host's dead-letter queue.",
        );
        let cache_limit = gauge(
            "cache_limit_bytes",
            "The cache size limit ([pxe]image_cache_size).",
        );
        let cache_linked = gauge(
            "cache_linked_files",
            "Masters linked by at least one node (never evicted).",
        );
        let evictions = prometheus::IntCounter::new(
            format!("{PREFIX}cache_evictions_total"),
            "Masters evicted from the cache.",
        )
        .expect("valid metric");
        registry
            .register(Box::new(evictions.clone()))
            .expect("unique metric");
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(format!("{PREFIX}{name}"), help), labels)
                .expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let active_links = gauge("active_links", "Published node symlinks under http_root.");
        let in_flight = gauge_vec(
            "operations_in_flight",
            "Requests being handled, by action.",
            &["action"],
        );
        let in_flight_done = gauge_vec(
            "in_flight_bytes_done",
            "Bytes done of in-flight downloads and conversions, by stage.",
            &["stage"],
        );
        let in_flight_expected = gauge_vec(
            "in_flight_bytes_expected",
            "Bytes expected of in-flight downloads and conversions, by stage (0 when unknown).",
            &["stage"],
        );
        let counter1 = |name: &str, help: &str| {
            let c =
                prometheus::IntCounter::new(format!("{PREFIX}{name}"), help).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let download_bytes = counter1(
            "download_bytes_total",
            "Bytes downloaded from image sources.",
        );
        let convert_bytes = counter1(
            "conversion_bytes_total",
            "Raw bytes produced by conversions.",
        );
        let histogram = |name: &str, help: &str| {
            let h = prometheus::Histogram::with_opts(
                HistogramOpts::new(format!("{PREFIX}{name}"), help).buckets(vec![
                    0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1200.0, 3600.0,
                ]),
            )
            .expect("valid metric");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let download_seconds =
            histogram("download_duration_seconds", "Duration of image downloads.");
        let convert_seconds = histogram(
            "conversion_duration_seconds",
            "Duration of conversions to raw.",
        );
        let hash_seconds = histogram(
            "hashing_duration_seconds",
            "Time the slowest hasher of a pass spent hashing (it runs beside the I/O).",
        );
        let _ = registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
        Metrics {
            registry,
            completions,
            prepare_seconds,
            http_requests,
            http_bytes,
            amqp_connected,
            amqp_reconnects,
            amqp_dead_letters,
            ignored,
            messages,
            cache_bytes,
            cache_limit,
            cache_files,
            cache_linked,
            evictions,
            active_links,
            in_flight,
            in_flight_done,
            in_flight_expected,
            download_bytes,
            download_seconds,
            convert_bytes,
            conversions,
            convert_seconds,
            hash_seconds,
        }
    }

    /// Records a finished conversion (`mode`: `while_downloading` or
    /// `after_download`) that produced `d` in `took`.
    pub fn conversion(&self, mode: &str, d: &crate::sink::Digests, took: std::time::Duration) {
        self.conversions.with_label_values(&[mode]).inc();
        self.convert_bytes.inc_by(d.size);
        self.convert_seconds.observe(took.as_secs_f64());
        self.hash_seconds.observe(d.hash_micros as f64 / 1e6);
    }

    /// Counts a completion event.
    pub fn record(&self, done: &Completion) {
        let code = done.error.as_ref().map(|e| e.code.as_str()).unwrap_or("");
        self.completions
            .with_label_values(&[done.action.as_str(), done.status.as_str(), code])
            .inc();
        if let Some(cache) = done.cache {
            let label = match cache {
                crate::events::CacheOutcome::Hit => "hit",
                crate::events::CacheOutcome::Miss => "miss",
            };
            self.prepare_seconds
                .with_label_values(&[label])
                .observe(done.duration_ms as f64 / 1000.0);
        }
    }

    /// Sets the cache gauges from a listing.
    pub fn cache_state(&self, entries: &[crate::eviction::Entry]) {
        self.cache_bytes
            .set(entries.iter().map(|e| e.size as i64).sum());
        self.cache_files.set(entries.len() as i64);
        self.cache_linked
            .set(entries.iter().filter(|e| e.linked_nodes > 0).count() as i64);
    }

    /// Counts a consumed message.
    pub fn consumed(&self, source: &str, action: &str, outcome: &str) {
        self.messages
            .with_label_values(&[source, action, outcome])
            .inc();
    }

    /// Renders all metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
