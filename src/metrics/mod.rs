//! Prometheus metrics of the worker, registered in one registry that the
//! metrics listener renders in the text exposition format.
//!
//! # This folder
//!
//! Holds the registry (this module), the peers' figures (`peers`) and
//! in-flight progress of long transfers (`progress`). Must not know who produces the figures.

pub(crate) mod peers;
pub(crate) mod progress;

use crate::messages::Completion;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
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
    /// Image server response body bytes sent (as they are handed to the
    /// connection: nothing for HEAD, the sent part of an aborted download).
    pub http_bytes: IntCounterVec,
    /// Connections open on the image server.
    pub http_connections: IntGauge,
    /// Image server connections closed by its limits, by reason.
    pub http_connections_dropped: IntCounterVec,
    /// Reloads of the image server's TLS certificate, by result.
    pub http_tls_reloads: IntCounterVec,
    /// 1 while connected to the broker.
    pub amqp_connected: IntGauge,
    /// Reconnection attempts to the broker.
    pub amqp_reconnects: IntCounter,
    /// Messages waiting in this host's dead-letter queue (read every few
    /// seconds while connected), for alerting.
    pub amqp_dead_letters: IntGauge,
    /// Messages acknowledged without an answer, by reason.
    pub ignored: IntCounterVec,
    /// Prepares whose slow download gave back its prepare slot.
    pub slow_lane: IntCounter,
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
    pub evictions: IntCounter,
    /// Nodes whose files expired (`[cache]node_files_ttl`).
    pub node_files_expired: IntCounter,
    /// Published node symlinks.
    pub active_links: IntGauge,
    /// Requests being handled, by action.
    pub in_flight: IntGaugeVec,
    /// Bytes done of in-flight transfers, by stage (download, convert).
    pub in_flight_done: IntGaugeVec,
    /// Bytes expected of in-flight transfers, by stage (0 when unknown).
    pub in_flight_expected: IntGaugeVec,
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
    /// What crossed between workers (`[peers]`).
    pub peers: peers::PeerMetrics,
}

const PREFIX: &str = "ironic_image_worker_";

/// Buckets of the transfer and conversion durations, seconds.
const DURATION_BUCKETS: &[f64] = &[0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1200.0, 3600.0];

/// Buckets of the prepare duration (cache hits take milliseconds), seconds.
const PREPARE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.02, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1200.0,
];

/// Creates metrics named `ironic_image_worker_<name>` and registers them,
/// so that each metric is declared in one line.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    /// Registers `metric`; names and labels are fixed in this file, so a
    /// failure is a programming error that every test run would show.
    fn add<M: prometheus::core::Collector + Clone + 'static>(
        &self,
        metric: prometheus::Result<M>,
    ) -> M {
        let metric = metric.expect("valid metric");
        self.0
            .register(Box::new(metric.clone()))
            .expect("unique metric");
        metric
    }

    fn opts(name: &str, help: &str) -> Opts {
        Opts::new(format!("{PREFIX}{name}"), help)
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::with_opts(Self::opts(name, help)))
    }

    fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Self::opts(name, help), labels))
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::with_opts(Self::opts(name, help)))
    }

    fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Self::opts(name, help), labels))
    }

    fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Histogram {
        self.add(Histogram::with_opts(
            HistogramOpts::from(Self::opts(name, help)).buckets(buckets.to_vec()),
        ))
    }

    fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        buckets: &[f64],
    ) -> HistogramVec {
        self.add(HistogramVec::new(
            HistogramOpts::from(Self::opts(name, help)).buckets(buckets.to_vec()),
            labels,
        ))
    }
}

impl Metrics {
    /// Creates and registers every metric (plus process metrics on Linux).
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let r = Registrar(&registry);
        let metrics = Metrics {
            completions: r.counter_vec(
                "completions_total",
                "Completion events by action, status and error code.",
                &["action", "status", "code"],
            ),
            prepare_seconds: r.histogram_vec(
                "prepare_duration_seconds",
                "Prepare duration by cache outcome.",
                &["cache"],
                PREPARE_BUCKETS,
            ),
            http_requests: r.counter_vec(
                "http_requests_total",
                "Image server requests by status code.",
                &["status"],
            ),
            http_bytes: r.counter_vec(
                "http_response_bytes_total",
                "Image server response body bytes sent, by status code.",
                &["status"],
            ),
            http_connections: r.gauge(
                "http_connections_open",
                "Connections open on the image server.",
            ),
            http_connections_dropped: r.counter_vec(
                "http_connections_dropped_total",
                "Image server connections closed by the server: header_timeout, idle_timeout, \
                 evicted (to make room at the cap), refused (at the cap, all busy), \
                 tls_handshake_timeout, tls_handshake_failed.",
                &["reason"],
            ),
            http_tls_reloads: r.counter_vec(
                "http_tls_reloads_total",
                "Reloads of the image server's certificate after its files changed: ok, or \
                 error (the previous certificate stays in use).",
                &["result"],
            ),
            amqp_connected: r.gauge(
                "amqp_connected",
                "1 while the worker is connected to the broker.",
            ),
            amqp_reconnects: r.counter(
                "amqp_reconnects_total",
                "Reconnection attempts to the broker.",
            ),
            amqp_dead_letters: r.gauge(
                "amqp_dead_letter_messages",
                "Messages in this host's dead-letter queue.",
            ),
            ignored: r.counter_vec(
                "ignored_messages_total",
                "Messages acknowledged without an answer (other conductors, irrelevant notifications), by reason.",
                &["reason"],
            ),
            slow_lane: r.counter(
                "slow_downloads_total",
                "Prepares moved to the slow lane: their download was slower than [source]slow_rate after [source]slow_after seconds.",
            ),
            messages: r.counter_vec(
                "messages_consumed_total",
                "Messages consumed from the broker by source, action and outcome.",
                &["source", "action", "outcome"],
            ),
            cache_bytes: r.gauge(
                "cache_size_bytes",
                "Bytes allocated by the master image cache.",
            ),
            cache_limit: r.gauge(
                "cache_limit_bytes",
                "The cache size limit ([pxe]image_cache_size).",
            ),
            cache_files: r.gauge("cache_files", "Masters in the image cache."),
            cache_linked: r.gauge(
                "cache_linked_files",
                "Masters linked by at least one node (never evicted).",
            ),
            evictions: r.counter("cache_evictions_total", "Masters evicted from the cache."),
            node_files_expired: r.counter(
                "node_files_expired_total",
                "Nodes whose files no command asked for within [cache]node_files_ttl, removed.",
            ),
            active_links: r.gauge("active_links", "Published node symlinks under http_root."),
            in_flight: r.gauge_vec(
                "operations_in_flight",
                "Requests being handled, by action.",
                &["action"],
            ),
            in_flight_done: r.gauge_vec(
                "in_flight_bytes_done",
                "Bytes done of in-flight downloads and conversions, by stage.",
                &["stage"],
            ),
            in_flight_expected: r.gauge_vec(
                "in_flight_bytes_expected",
                "Bytes expected of in-flight downloads and conversions, by stage (0 when unknown).",
                &["stage"],
            ),
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
            peers: peers::PeerMetrics::register(&r),
            registry: registry.clone(),
        };
        let _ = registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
        metrics
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

    /// Counts a completion event.
    pub fn record(&self, done: &Completion) {
        let code = done.error.as_ref().map(|e| e.code.as_str()).unwrap_or("");
        self.completions
            .with_label_values(&[done.action.as_str(), done.status.as_str(), code])
            .inc();
        // The prepare duration is a deploy's wait; a warm is counted in
        // `completions` under its own action label only.
        let prepared = done.action == crate::messages::Action::Prepare;
        if let Some(cache) = done.cache.filter(|_| prepared) {
            let label = match cache {
                crate::messages::CacheOutcome::Hit => "hit",
                crate::messages::CacheOutcome::Miss => "miss",
                crate::messages::CacheOutcome::PassThrough => "pass_through",
            };
            self.prepare_seconds
                .with_label_values(&[label])
                .observe(done.duration_ms as f64 / 1000.0);
        }
    }

    /// Sets the cache gauges: total `bytes` of `files` masters, `linked` of
    /// them linked by a node.
    pub fn cache_state(&self, bytes: u64, files: usize, linked: usize) {
        self.cache_bytes.set(bytes.min(i64::MAX as u64) as i64);
        self.cache_files.set(files as i64);
        self.cache_linked.set(linked as i64);
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
