//! Progress of long transfers (downloads, conversions): in-flight byte
//! gauges that `/metrics` and the CLI progress bar read, and progress log
//! lines (percent, rate, ETA) at a bounded rate.

use crate::metrics::Metrics;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a transfer logs its progress at most.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// One running transfer; its bytes leave the in-flight gauges when dropped.
pub struct Transfer {
    metrics: Arc<Metrics>,
    stage: &'static str,
    expected: u64,
    done: Mutex<(u64, Instant)>,
    started: Instant,
}

impl Transfer {
    /// Starts tracking a `stage` ("download", "convert") of `expected` bytes
    /// (0 when unknown).
    pub fn start(metrics: &Arc<Metrics>, stage: &'static str, expected: u64) -> Transfer {
        metrics
            .in_flight_expected
            .with_label_values(&[stage])
            .add(expected as i64);
        let now = Instant::now();
        Transfer {
            metrics: metrics.clone(),
            stage,
            expected,
            done: Mutex::new((0, now)),
            started: now,
        }
    }

    /// Sets the expected size once it is known (after response headers).
    pub fn set_expected(&mut self, expected: u64) {
        let gauge = self
            .metrics
            .in_flight_expected
            .with_label_values(&[self.stage]);
        gauge.add(expected as i64 - self.expected as i64);
        self.expected = expected;
    }

    /// Sets the bytes done so far (monotonic), logging now and then.
    pub fn set_done(&self, total_done: u64) {
        let mut state = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let delta = total_done.saturating_sub(state.0);
        state.0 = total_done.max(state.0);
        self.metrics
            .in_flight_done
            .with_label_values(&[self.stage])
            .add(delta as i64);
        if state.1.elapsed() >= LOG_EVERY {
            state.1 = Instant::now();
            let secs = self.started.elapsed().as_secs_f64().max(1e-3);
            let rate = state.0 as f64 / secs;
            let (percent, eta) = if self.expected > 0 && rate > 0.0 {
                let left = self.expected.saturating_sub(state.0) as f64 / rate;
                (
                    format!("{:.1}", state.0 as f64 * 100.0 / self.expected as f64),
                    format!("{left:.0}s"),
                )
            } else {
                ("?".into(), "?".into())
            };
            tracing::info!(
                stage = self.stage,
                done = state.0,
                expected = self.expected,
                percent = %percent,
                rate_mib_s = format!("{:.1}", rate / 1048576.0),
                eta = %eta,
                "progress"
            );
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner()).0;
        self.metrics
            .in_flight_done
            .with_label_values(&[self.stage])
            .sub(done as i64);
        self.metrics
            .in_flight_expected
            .with_label_values(&[self.stage])
            .sub(self.expected as i64);
    }
}
