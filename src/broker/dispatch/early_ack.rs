//! The early acknowledgement of a copy the broker would otherwise take
//! back: three quarters of the consumer timeout after its arrival, queued
//! or running, the copy is acknowledged and the job answered when done
//! (a crash then loses it); the timeout in force, configured or the one
//! the broker enforces.
//!
//! Knows nothing of what a delivery asks, of the ledger, nor of answers.

use super::super::ack::Tracked;
use super::settle::settle;
use lapin::Acker;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// The broker's consumer timeout in force, in milliseconds (0: none):
/// `[amqp]consumer_timeout`, or the value the broker reported when it
/// closed a channel over it.
pub(super) struct ConsumerTimeout {
    ms: AtomicU64,
}

impl ConsumerTimeout {
    /// `[amqp]consumer_timeout` (seconds, 0: none) until the broker says
    /// otherwise.
    pub(super) fn configured(secs: u64) -> ConsumerTimeout {
        ConsumerTimeout {
            ms: AtomicU64::new(secs.saturating_mul(1000)),
        }
    }

    /// The broker enforces `enforced`: returns the value it replaces.
    fn enforced(&self, enforced: Duration) -> (u64, u64) {
        let ms = u64::try_from(enforced.as_millis()).unwrap_or(u64::MAX);
        (self.ms.swap(ms, Ordering::Relaxed), ms)
    }

    /// How long after its arrival a delivery is acknowledged early: three
    /// quarters of the timeout, none without one.
    fn ack_early_after(&self) -> Option<Duration> {
        let ms = self.ms.load(Ordering::Relaxed);
        (ms > 0).then(|| Duration::from_millis(ms) * 3 / 4)
    }

    /// The broker closed a channel over its consumer timeout and said which
    /// value it enforces: from now on early acknowledgements follow it.
    pub(super) fn broker_enforces(&self, enforced: Duration) {
        let (before, ms) = self.enforced(enforced);
        if before != ms {
            tracing::warn!(
                enforced_ms = ms,
                configured_ms = before,
                "the broker enforces another consumer_timeout than [amqp]consumer_timeout: \
                 acting on the broker's from now on (set [amqp]consumer_timeout to it)"
            );
        }
    }

    /// Starts the early acknowledgement of the copy of `session` held by
    /// `tracked`, due three quarters of the consumer timeout after the copy
    /// was `received`, whether the job runs by then or still waits behind
    /// another of its node (the broker counts from the delivery). From
    /// then on the job is answered when done, and a crash loses it. Its
    /// line is in the request's span.
    pub(super) fn arm(&self, tracked: &Arc<Tracked<Acker>>, session: u64, received: Instant) {
        let Some(after) = self.ack_early_after() else {
            return;
        };
        let t = tracked.clone();
        let timer = tokio::spawn(
            async move {
                tokio::time::sleep_until((received + after).into()).await;
                if let Some((_, acker)) = t.ack_early(Some(session)) {
                    tracing::info!(
                        "unacknowledged for three quarters of the consumer timeout: acknowledged early"
                    );
                    let _ = settle(acker, false).await;
                }
            }
            .instrument(tracked.span.clone()),
        );
        tracked.arm(session, timer.abort_handle());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_acknowledged_at_three_quarters_of_the_timeout_in_force() {
        let t = ConsumerTimeout::configured(1800);
        assert_eq!(t.ack_early_after(), Some(Duration::from_secs(1350)));
        // The broker's own value wins from the moment it says it.
        assert_eq!(t.enforced(Duration::from_secs(60)), (1_800_000, 60_000));
        assert_eq!(t.ack_early_after(), Some(Duration::from_secs(45)));
    }

    #[test]
    fn without_a_timeout_nothing_is_acknowledged_early() {
        assert_eq!(ConsumerTimeout::configured(0).ack_early_after(), None);
    }
}
