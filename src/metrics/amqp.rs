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
    /// Answers the broker refused for as long as their command could use
    /// them (its deadline, or the answer patience when it set none),
    /// given up on their `reply_to` (see `broker/dispatch/settle.rs`).
    pub answers_given_up: IntCounter,
    /// Refusals of an answer's publish by the broker (a nack: a reply
    /// queue full with `reject-publish`, or without a leader during a
    /// failover), each tried again with backoff.
    pub answer_refusals: IntCounter,
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
            answers_given_up: r.counter(
                "amqp_answers_given_up_total",
                "Answers the broker refused until their command's deadline passed: given up on their reply_to.",
            ),
            answer_refusals: r.counter(
                "amqp_answer_refusals_total",
                "Publishes of an answer the broker refused (tried again with backoff).",
            ),
        }
    }
}
