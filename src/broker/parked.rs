//! A delivery acknowledged before its answer, as the node ledger keeps it
//! (`store/ledger.rs`, `accepted/`): the broker holds no copy of it any
//! more, so after a crash this record alone brings it back.
//!
//! Why: a prepare moved to the slow lane is acknowledged early (so slow
//! sources do not fill the prefetch); a `kill -9` of its worker would
//! otherwise lose it, and Ironic would wait its whole `prepare_timeout`.
//! The record is written (and synced) before the early acknowledgement,
//! removed once the answer is confirmed; a process that finds the record of
//! a process that is gone runs the delivery again, as a redelivered copy.

use serde::{Deserialize, Serialize};

/// Everything needed to run and answer a delivery again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Parked {
    /// The exchange it came from (Ironic's notification exchange or not).
    pub(super) exchange: String,
    /// Its routing key.
    pub(super) routing_key: String,
    /// Its body, hex.
    pub(super) body: String,
    /// Where its answer goes.
    pub(super) reply_to: Option<String>,
    /// The answer's correlation id.
    pub(super) correlation_id: Option<String>,
    /// When its sender stops waiting (ms since the epoch).
    pub(super) deadline: Option<u64>,
    /// When it was issued (ms since the epoch), from its properties.
    pub(super) issued_ms: u64,
    /// When the worker first received it (ms since the epoch).
    pub(super) received_ms: u64,
}

impl Parked {
    /// The record's bytes.
    pub(super) fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record read back, with its body; `None` when it is not one.
    pub(super) fn from_bytes(bytes: &[u8]) -> Option<(Parked, Vec<u8>)> {
        let parked: Parked = serde_json::from_slice(bytes).ok()?;
        let body = hex::decode(&parked.body).ok()?;
        Some((parked, body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back() {
        let p = Parked {
            exchange: "x".into(),
            routing_key: "h.node.prepare".into(),
            body: hex::encode(b"{}"),
            reply_to: Some("r".into()),
            correlation_id: None,
            deadline: Some(5),
            issued_ms: 1,
            received_ms: 2,
        };
        let (back, body) = Parked::from_bytes(&p.to_bytes()).unwrap();
        assert_eq!(back, p);
        assert_eq!(body, b"{}");
        assert!(Parked::from_bytes(b"junk").is_none());
    }
}
