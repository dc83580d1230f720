//! Metrics of the peers: what crossed between workers instead of from the
//! images' sources, and how the peer listener and queries fared.

use super::Registrar;
use prometheus::{IntCounter, IntCounterVec};

/// The peers' figures, beside the source's `download_bytes`.
pub struct PeerMetrics {
    /// Master bytes received whole from peers, before their check (a
    /// master that fails it counts in `fetch_failures` too; a transfer cut
    /// short only there).
    pub received_bytes: IntCounter,
    /// Peer queries by result ([`QueryResult`]; counted by
    /// [`PeerMetrics::query_ended`]).
    queries: IntCounterVec,
    /// Fetches from a peer that failed, by reason (`digest_mismatch`,
    /// `unreachable`, `busy`, `refused`, `format`, ...).
    pub fetch_failures: IntCounterVec,
    /// Requests to the peer listener, by HTTP status.
    pub served_requests: IntCounterVec,
    /// Master bytes sent to peers.
    pub served_bytes: IntCounter,
    /// Peer messages (queries, offers) dropped unread, by kind and reason
    /// (`unsigned`, `bad_signature`, `stale`, `replayed`, `too_large`).
    pub refused_messages: IntCounterVec,
    /// Offers whose seal held but that cannot be used, by reason
    /// ([`OfferRefusal`]; counted by [`PeerMetrics::offer_refused`]).
    refused_offers: IntCounterVec,
    /// Waits on another worker's claim given up because its holder showed
    /// nothing (no `downloading` answer): the master is then downloaded
    /// from its source here.
    pub silent_claims: IntCounter,
}

/// Why an offer whose seal held is not used: the reason label of
/// `peer_refused_offers_total`, typed so that no call site spells it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OfferRefusal {
    /// It names a listener URL of another shape than `http(s)://host[:port]`
    /// or an address the rules refuse.
    Url,
}

impl OfferRefusal {
    fn label(self) -> &'static str {
        match self {
            OfferRefusal::Url => "url",
        }
    }
}

/// How a peer query ended: the result label of `peer_queries_total`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QueryResult {
    /// Some peer offered a usable master.
    Answered,
    /// No usable offer came.
    Missed,
}

impl QueryResult {
    fn label(self) -> &'static str {
        match self {
            QueryResult::Answered => "answered",
            QueryResult::Missed => "missed",
        }
    }
}

impl PeerMetrics {
    /// Counts a peer query by how it ended.
    pub fn query_ended(&self, result: QueryResult) {
        self.queries.with_label_values(&[result.label()]).inc();
    }

    /// Makes every result's series visible at zero.
    pub(super) fn show_query_results(&self) {
        for result in [QueryResult::Answered, QueryResult::Missed] {
            self.queries.with_label_values(&[result.label()]);
        }
    }

    /// Counts an offer not used, and why.
    pub fn offer_refused(&self, why: OfferRefusal) {
        self.refused_offers.with_label_values(&[why.label()]).inc();
    }

    /// Creates and registers the peers' metrics.
    pub(super) fn register(r: &Registrar<'_>) -> PeerMetrics {
        PeerMetrics {
            received_bytes: r.counter(
                "peer_received_bytes_total",
                "Master bytes received from peers instead of from the image's source.",
            ),
            queries: r.counter_vec(
                "peer_queries_total",
                "Peer queries by result (answered, missed).",
                &["result"],
            ),
            fetch_failures: r.counter_vec(
                "peer_fetch_failures_total",
                "Fetches of a master from a peer that failed, by reason.",
                &["reason"],
            ),
            served_requests: r.counter_vec(
                "peer_served_requests_total",
                "Requests to the peer listener, by status code.",
                &["status"],
            ),
            served_bytes: r.counter("peer_served_bytes_total", "Master bytes sent to peers."),
            refused_messages: r.counter_vec(
                "peer_refused_messages_total",
                "Peer queries and offers dropped unread, by kind and reason.",
                &["kind", "reason"],
            ),
            refused_offers: r.counter_vec(
                "peer_refused_offers_total",
                "Sealed peer offers that cannot be used, by reason.",
                &["reason"],
            ),
            silent_claims: r.counter(
                "peer_silent_claims_total",
                "Waits on another worker's download claim given up because its holder showed nothing.",
            ),
        }
    }
}
