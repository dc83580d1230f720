//! The one shape of backoff used for retries: exponential from a minimum,
//! doubling up to a maximum, with jitter. The broker reconnect loop and the
//! source download retries both build theirs here, so they cannot drift
//! apart; each keeps its own bounds and retry count. It knows nothing of
//! what is retried.

use backon::ExponentialBuilder;
use std::time::Duration;

/// Jittered exponential backoff from `min`, doubling up to `max`, for
/// `times` retries (`None`: without end). Jitter adds up to the delay itself
/// on top of it, so a delay can reach twice `max`: a caller with a hard cap
/// caps each value itself.
pub(crate) fn jittered(min: Duration, max: Duration, times: Option<usize>) -> ExponentialBuilder {
    let builder = ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter();
    match times {
        Some(n) => builder.with_max_times(n),
        None => builder.without_max_times(),
    }
}
