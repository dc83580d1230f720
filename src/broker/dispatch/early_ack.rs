//! The early acknowledgement of a copy the broker would otherwise take
//! back: three quarters of the consumer timeout after its arrival, queued
//! or running, the copy is acknowledged and the job answered when done
//! (a crash then loses it); the timeout in force, configured or the one
//! the broker enforces.
//!
//! Knows nothing of what a delivery asks, of the ledger, nor of answers.

use super::super::ack::Tracked;
use super::Dispatcher;
use super::settle::settle;
use lapin::Acker;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tracing::Instrument;

impl Dispatcher {
    /// The broker closed a channel over its consumer timeout and said which
    /// value it enforces: from now on early acknowledgements follow it.
    pub(in crate::broker) fn broker_consumer_timeout(&self, enforced: Duration) {
        let ms = u64::try_from(enforced.as_millis()).unwrap_or(u64::MAX);
        let before = self.consumer_timeout_ms.swap(ms, Ordering::Relaxed);
        if before != ms {
            tracing::warn!(
                enforced_ms = ms,
                configured_ms = before,
                "the broker enforces another consumer_timeout than [amqp]consumer_timeout: \
                 acting on the broker's from now on (set [amqp]consumer_timeout to it)"
            );
        }
    }

    /// How long after its arrival a delivery is acknowledged early.
    fn ack_early_after(&self) -> Option<Duration> {
        let ms = self.consumer_timeout_ms.load(Ordering::Relaxed);
        (ms > 0).then(|| Duration::from_millis(ms) * 3 / 4)
    }

    /// Starts the early acknowledgement of the copy of `session` held by
    /// `tracked`, due three quarters of the consumer timeout after the copy
    /// was `received`, whether the job runs by then or still waits behind
    /// another of its node (the broker counts from the delivery). From
    /// then on the job is answered when done, and a crash loses it. Its
    /// line is in the request's span.
    pub(super) fn arm_early_ack(
        &self,
        tracked: &Arc<Tracked<Acker>>,
        session: u64,
        received: Instant,
    ) {
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
