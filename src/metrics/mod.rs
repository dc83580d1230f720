//! Prometheus metrics of the worker, registered in one registry that the
//! metrics listener renders in the text exposition format.
//!
//! # This folder
//!
//! Holds the registry and the figures of the requests (this module), those
//! of the image server (`http`), the broker connection (`amqp`), the cache
//! (`cache`), finished transfers (`transfer`) and the peers (`peers`), and
//! in-flight progress of long transfers (`progress`). Must not know who produces the figures.

pub(crate) mod amqp;
pub(crate) mod cache;
pub(crate) mod http;
pub(crate) mod peers;
pub(crate) mod progress;
pub(crate) mod transfer;

use crate::messages::{CacheOutcome, Completion, IgnoreReason};
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
    /// The image server's figures.
    pub http: http::HttpMetrics,
    /// The broker connection's figures.
    pub amqp: amqp::AmqpMetrics,
    /// Messages acknowledged without an answer, by reason (counted through
    /// [`Metrics::ignored`], so only an [`IgnoreReason`] labels it).
    ignored: IntCounterVec,
    /// Prepares whose slow download gave back its download slot.
    pub slow_lane: IntCounter,
    /// Messages consumed, by source (command/notification), action, outcome.
    pub messages: IntCounterVec,
    /// The master cache's and the node files' figures.
    pub cache: cache::CacheMetrics,
    /// Requests being handled, by action.
    pub in_flight: IntGaugeVec,
    /// Bytes done of in-flight transfers, by stage (download, convert).
    pub in_flight_done: IntGaugeVec,
    /// Bytes expected of in-flight transfers, by stage (0 when unknown).
    pub in_flight_expected: IntGaugeVec,
    /// Finished downloads and conversions.
    pub transfer: transfer::TransferMetrics,
    /// What crossed between workers (`[peers]`).
    pub peers: peers::PeerMetrics,
    /// 1 while `/readyz` would answer ready, else 0 (set on every scrape
    /// and readiness check).
    pub ready: IntGauge,
    /// CPU seconds of the finished child processes (the qcow2 converter,
    /// `qemu-img`), which `process_cpu_seconds_total` does not count.
    children_cpu: prometheus::Counter,
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
            http: http::HttpMetrics::register(&r),
            amqp: amqp::AmqpMetrics::register(&r),
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
            cache: cache::CacheMetrics::register(&r),
            in_flight: r.gauge_vec(
                "operations_in_flight",
                "Requests being handled, by action.",
                &["action"],
            ),
            in_flight_done: r.gauge_vec(
                "in_flight_done_bytes",
                "Bytes done of in-flight downloads and conversions, by stage.",
                &["stage"],
            ),
            in_flight_expected: r.gauge_vec(
                "in_flight_expected_bytes",
                "Bytes expected of in-flight downloads and conversions, by stage (0 when unknown).",
                &["stage"],
            ),
            transfer: transfer::TransferMetrics::register(&r),
            peers: peers::PeerMetrics::register(&r),
            ready: r.gauge(
                "ready",
                "1 while /readyz answers ready (broker connected, directories writable), else 0.",
            ),
            children_cpu: r.add(prometheus::Counter::with_opts(Registrar::opts(
                "children_cpu_seconds_total",
                "CPU time (user and system) of the finished child processes: the qcow2 converter and qemu-img.",
            ))),
            registry: registry.clone(),
        };
        let build = r.gauge_vec(
            "build_info",
            "Always 1; the version of the running binary as a label.",
            &["version"],
        );
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        metrics.initialise_series();
        let _ = registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
        metrics
    }

    /// Creates the series of every label value known in advance, at 0, so
    /// that every documented series exists from the first scrape (a rate
    /// or an alert over a series that appears only once used misreads).
    fn initialise_series(&self) {
        for stage in ["download", "convert"] {
            self.in_flight_done.with_label_values(&[stage]);
            self.in_flight_expected.with_label_values(&[stage]);
        }
        for action in ["prepare", "deployed", "cleanup", "warm"] {
            self.in_flight.with_label_values(&[action]);
            self.completions.with_label_values(&[action, "success", ""]);
        }
        for cache in [
            CacheOutcome::Hit,
            CacheOutcome::Miss,
            CacheOutcome::PassThrough,
        ] {
            self.prepare_seconds.with_label_values(&[cache.as_str()]);
        }
        for mode in ["after_download", "while_downloading"] {
            self.transfer.conversions.with_label_values(&[mode]);
        }
        for result in ["ok", "error"] {
            self.http.tls_reloads.with_label_values(&[result]);
        }
        self.peers.show_query_results();
        for encoding in ["gzip", "identity"] {
            self.http.encoded_bytes.with_label_values(&[encoding]);
        }
        for result in ["compressed", "declined", "failed"] {
            self.cache.compressions.with_label_values(&[result]);
        }
    }

    /// Brings the child processes' CPU time up to date (the kernel counts
    /// the children a process waited for).
    fn update_children_cpu(&self) {
        // SAFETY: `rusage` is plain data, for which all zeros is a value.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is valid for writes for the whole call.
        if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) } != 0 {
            return;
        }
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        let total = secs(usage.ru_utime) + secs(usage.ru_stime);
        let delta = total - self.children_cpu.get();
        if delta > 0.0 {
            self.children_cpu.inc_by(delta);
        }
    }

    /// Counts a message settled without an answer, under its reason.
    pub fn ignored(&self, reason: IgnoreReason) {
        self.ignored.with_label_values(&[reason.as_str()]).inc();
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
            self.prepare_seconds
                .with_label_values(&[cache.as_str()])
                .observe(done.duration_ms as f64 / 1000.0);
        }
    }

    /// Counts a consumed message.
    pub fn consumed(&self, source: &str, action: &str, outcome: &str) {
        self.messages
            .with_label_values(&[source, action, outcome])
            .inc();
    }

    /// Renders all metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        self.update_children_cpu();
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
