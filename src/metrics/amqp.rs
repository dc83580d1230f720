//! Metrics of the broker connection: whether it is up, how often it was
//! made again and what waits in this host's dead-letter queue.

use super::Registrar;
use prometheus::{IntCounter, IntGauge};

/// The broker connection's figures.
pub struct AmqpMetrics {
    /// 1 when the worker has a broker (`[amqp]enabled`), 0 without one: the
    /// broker alerts look at `connected` only where this is not 0.
    pub enabled: IntGauge,
    /// 1 while connected to the broker.
    pub connected: IntGauge,
    /// Reconnection attempts to the broker.
    pub reconnects: IntCounter,
    /// Messages waiting in this host's dead-letter queue (read every few
    /// seconds while connected), for alerting.
    pub dead_letters: IntGauge,
}

impl AmqpMetrics {
    /// Creates and registers the broker connection's metrics.
    pub(super) fn register(r: &Registrar<'_>) -> AmqpMetrics {
        AmqpMetrics {
            enabled: r.gauge(
                "amqp_enabled",
                "1 when a broker is configured ([amqp]enabled), 0 without one.",
            ),
            connected: r.gauge(
                "amqp_connected",
                "1 while the worker is connected to the broker.",
            ),
            reconnects: r.counter(
                "amqp_reconnects_total",
                "Reconnection attempts to the broker.",
            ),
            dead_letters: r.gauge(
                "amqp_dead_letter_messages",
                "Messages in this host's dead-letter queue.",
            ),
        }
    }
}
