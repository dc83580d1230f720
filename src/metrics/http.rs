//! Metrics of the image server: requests, bytes sent, connections and TLS
//! reloads, apart from the registry so that it stays one line a metric.

use super::Registrar;
use prometheus::{IntCounterVec, IntGauge};

/// The image server's figures.
pub struct HttpMetrics {
    /// Image server requests by HTTP status.
    pub requests: IntCounterVec,
    /// Image server response body bytes sent (as they are handed to the
    /// connection: nothing for HEAD, the sent part of an aborted download).
    pub bytes: IntCounterVec,
    /// Image server response body bytes sent, by content coding (`gzip`
    /// or `identity`).
    pub encoded_bytes: IntCounterVec,
    /// Connections open on the image server.
    pub connections: IntGauge,
    /// Image server connections closed by its limits, by reason.
    pub connections_dropped: IntCounterVec,
    /// Reloads of the image server's TLS certificate, by result.
    pub tls_reloads: IntCounterVec,
}

impl HttpMetrics {
    /// Creates and registers the image server's metrics.
    pub(super) fn register(r: &Registrar<'_>) -> HttpMetrics {
        HttpMetrics {
            requests: r.counter_vec(
                "http_requests_total",
                "Image server requests by status code.",
                &["status"],
            ),
            bytes: r.counter_vec(
                "http_response_bytes_total",
                "Image server response body bytes sent, by status code.",
                &["status"],
            ),
            encoded_bytes: r.counter_vec(
                "http_response_encoding_bytes_total",
                "Image server response body bytes sent, by content coding: gzip or identity.",
                &["encoding"],
            ),
            connections: r.gauge(
                "http_connections_open",
                "Connections open on the image server.",
            ),
            connections_dropped: r.counter_vec(
                "http_connections_dropped_total",
                "Image server connections closed by the server: header_timeout, idle_timeout, \
                 evicted (to make room at the cap), refused (at the cap, all busy), \
                 tls_handshake_timeout, tls_handshake_failed.",
                &["reason"],
            ),
            tls_reloads: r.counter_vec(
                "http_tls_reloads_total",
                "Reloads of the image server's certificate after its files changed: ok, or \
                 error (the previous certificate stays in use).",
                &["result"],
            ),
        }
    }
}
