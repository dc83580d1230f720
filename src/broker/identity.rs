//! What identifies a delivery across redeliveries, as a key written to the
//! node's ledger on disk and read by every worker process of the host.
//!
//! Why a digest of its own: the key outlives the process that wrote it (the
//! ledger keeps it 24 hours, across restarts and upgrades), so it must be
//! the same for every build of the worker. It is the SHA-256 of a canonical
//! encoding of the delivery (below), written as 64 lowercase hex digits;
//! `tests` pins the value of a fixed delivery, so a change of the encoding
//! fails a test instead of breaking "answered once" on a rolling upgrade.
//!
//! Canonical encoding, version 1, the bytes hashed in this order:
//!
//! 1. the tag `ironic-image-worker delivery v1` followed by a newline;
//! 2. then five fields: exchange, routing key, body, `reply_to`,
//!    `correlation_id`. Each is one byte `0` when absent (only the last
//!    two can be), else one byte `1`, its length as an unsigned 64-bit
//!    big-endian integer, and its bytes as received.
//!
//! Earlier versions keyed the ledger with `std`'s `DefaultHasher` (16 hex
//! digits), whose algorithm Rust does not promise to keep. Those keys are
//! still looked up ([`legacy`]) while they can be in a ledger (24 hours
//! after the upgrade); they are never written.

use crate::seal::Fields;
use lapin::message::Delivery;
use sha2::{Digest, Sha256};

/// The tag that starts the canonical encoding (its version).
const TAG: &[u8] = b"ironic-image-worker delivery v1\n";

/// The fields of a delivery that identify it across redeliveries.
#[derive(Debug, Clone, Copy)]
pub(super) struct Parts<'a> {
    pub(super) exchange: &'a [u8],
    pub(super) routing_key: &'a [u8],
    pub(super) body: &'a [u8],
    pub(super) reply_to: Option<&'a [u8]>,
    pub(super) correlation_id: Option<&'a [u8]>,
}

impl<'a> Parts<'a> {
    /// The identifying fields of `delivery`.
    pub(super) fn of(delivery: &'a Delivery) -> Parts<'a> {
        let p = &delivery.properties;
        Parts {
            exchange: delivery.exchange.as_str().as_bytes(),
            routing_key: delivery.routing_key.as_str().as_bytes(),
            body: &delivery.data,
            reply_to: p.reply_to().as_ref().map(|s| s.as_str().as_bytes()),
            correlation_id: p.correlation_id().as_ref().map(|s| s.as_str().as_bytes()),
        }
    }
}

/// The ledger key of a delivery: SHA-256 of its canonical encoding
/// (version 1, see the module's text; written by `crate::seal::Fields`),
/// hex.
pub(super) fn key(parts: &Parts<'_>) -> String {
    let mut fields = Fields::new(Sha256::new());
    fields.raw(TAG);
    for field in [
        Some(parts.exchange),
        Some(parts.routing_key),
        Some(parts.body),
        parts.reply_to,
        parts.correlation_id,
    ] {
        fields.optional(field);
    }
    hex::encode(fields.finish().finalize())
}

/// The key earlier versions wrote (`DefaultHasher`, 16 hex digits): looked
/// up only, so a copy answered by a process of the previous version just
/// before an upgrade is still recognised. Its algorithm may change with
/// the Rust release the worker is built with; it then simply matches
/// nothing and the record expires (the copy is answered again, once).
/// To be removed once no ledger written by such a version can be alive.
pub(super) fn legacy(parts: &Parts<'_>) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::str::from_utf8(parts.exchange)
        .unwrap_or_default()
        .hash(&mut h);
    std::str::from_utf8(parts.routing_key)
        .unwrap_or_default()
        .hash(&mut h);
    parts.body.hash(&mut h);
    parts
        .reply_to
        .map(|s| std::str::from_utf8(s).unwrap_or_default())
        .hash(&mut h);
    parts
        .correlation_id
        .map(|s| std::str::from_utf8(s).unwrap_or_default())
        .hash(&mut h);
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> Parts<'static> {
        Parts {
            exchange: b"ironic-image-worker",
            routing_key: b"conductor-1.node.prepare",
            body: br#"{"action":"cleanup","node_uuid":"1be26c0b-03f2-4d2e-ae87-c02d7f33c123"}"#,
            reply_to: Some(b"amq.gen-reply"),
            correlation_id: Some(b"corr-1"),
        }
    }

    /// The golden value: a change here breaks "answered once" across an
    /// upgrade (every key in every ledger stops matching). Change the tag's
    /// version and keep looking up the old keys instead.
    #[test]
    fn the_key_of_a_fixed_delivery_never_changes() {
        assert_eq!(
            key(&parts()),
            "15db41a82ce4bd6baf8eff37a99a03ae6e9d70e15430bbec7a754426c83413a8"
        );
    }

    #[test]
    fn each_field_and_its_absence_count() {
        let base = key(&parts());
        let mut p = parts();
        p.reply_to = None;
        assert_ne!(key(&p), base, "an absent reply_to");
        p.reply_to = Some(b"");
        assert_ne!(
            key(&p),
            key(&Parts {
                reply_to: None,
                ..p
            }),
            "empty is not absent"
        );
        // Bytes moved from one field to the next give another key.
        let a = Parts {
            exchange: b"ab",
            routing_key: b"c",
            ..parts()
        };
        let b = Parts {
            exchange: b"a",
            routing_key: b"bc",
            ..parts()
        };
        assert_ne!(key(&a), key(&b));
        let mut c = parts();
        c.correlation_id = Some(b"corr-2");
        assert_ne!(key(&c), base);
        assert_eq!(key(&parts()).len(), 64);
        assert_eq!(legacy(&parts()).len(), 16, "the old keys' shape");
    }
}
