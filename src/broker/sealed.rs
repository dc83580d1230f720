//! The broker's side of the seal on commands and answers (`crate::seal`):
//! the header read from a delivery and written into the properties of an
//! answer; a delivered command checked, and checked to be aimed at this
//! worker; a deferred prepare's copy sealed again by the worker itself.
//!
//! Knows nothing of routing work, the ledger or what a command asks.

use super::topology::WARM_ALL_KEY;
use crate::messages::IgnoreReason;
use crate::seal::{self, Envelope, Kind, Refusal, Replays, Sealed, Sealer};
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use std::sync::{Arc, Mutex};

/// The seal header of `properties`, if there is one that is text.
fn header(properties: &BasicProperties) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(seal::HEADER)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        // Any other type is a seal that does not read.
        _ => Some(String::new()),
    }
}

/// `properties` carrying `seal_header` (replacing any seal they had).
fn with_header(properties: BasicProperties, seal_header: String) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(
        seal::HEADER.into(),
        AMQPValue::LongString(seal_header.into()),
    );
    properties.with_headers(headers)
}

/// The metric's reason for a refused command: `unsealed`, or `bad_seal`
/// for every seal that does not hold (the operator's two cases; which
/// check failed is logged beside it).
pub(super) fn reason(why: Refusal) -> IgnoreReason {
    match why {
        Refusal::Unsealed => IgnoreReason::Unsealed,
        Refusal::BadSeal | Refusal::ExpiredSeal | Refusal::ReplayedSeal => IgnoreReason::BadSeal,
    }
}

/// How long a deferred copy of a command that came unsealed (`send`
/// mode) stays valid once the worker seals it: the deploy interface's
/// default `prepare_timeout`.
const UNSEALED_COPY_VALID_MS: u64 = 1800 * 1000;

/// The seal policy of one worker's command queue.
pub(super) struct Gate {
    sealer: Arc<Sealer>,
    host: String,
    /// This worker's queue: a deferred copy comes back to it directly.
    queue: String,
    /// The seals taken within their window.
    replays: Mutex<Replays>,
}

impl Gate {
    /// The gate of the worker of `host`, whose queue is `queue`.
    pub(super) fn new(sealer: Arc<Sealer>, host: &str, queue: &str) -> Gate {
        Gate {
            sealer,
            host: host.to_string(),
            queue: queue.to_string(),
            replays: Mutex::new(Replays::default()),
        }
    }

    /// Whether a command may be worked: `Ok(Some)` sealed with a known key
    /// over this very delivery, within its window, aimed at this worker and
    /// not taken before (unless the broker redelivers it); `Ok(None)`
    /// unsealed, taken in `send` mode; else why it is refused.
    pub(super) fn admit(&self, delivery: &Delivery) -> Result<Option<Sealed>, Refusal> {
        let p = &delivery.properties;
        let routing_key = delivery.routing_key.as_str();
        let env = Envelope {
            kind: Kind::Command,
            routing_key,
            reply_to: p.reply_to().as_ref().map(|s| s.as_str()),
            correlation_id: p.correlation_id().as_ref().map(|s| s.as_str()),
        };
        let header = header(p);
        let now = crate::clock::now_ms();
        let sealed = self
            .sealer
            .admit(header.as_deref(), &env, &delivery.data, now)?;
        let Some(sealed) = sealed else {
            return Ok(None);
        };
        if !self.aimed_here(delivery.exchange.as_str(), routing_key) {
            // A genuine command re-published to reach another worker.
            return Err(Refusal::BadSeal);
        }
        let mut replays = self.replays.lock().unwrap_or_else(|e| e.into_inner());
        if !replays.first_time(&sealed, now) && !delivery.redelivered {
            return Err(Refusal::ReplayedSeal);
        }
        Ok(Some(sealed))
    }

    /// Whether a routing key addresses this worker: its node commands and
    /// warms, a warm for every conductor, or its own queue (a deferred
    /// copy, sealed by this worker, through the default exchange).
    fn aimed_here(&self, exchange: &str, routing_key: &str) -> bool {
        let own = |rest: &str| {
            rest == "image.warm" || rest.strip_prefix("node.").is_some_and(|a| !a.contains('.'))
        };
        routing_key == WARM_ALL_KEY
            || routing_key
                .strip_prefix(self.host.as_str())
                .and_then(|r| r.strip_prefix('.'))
                .is_some_and(own)
            || (exchange.is_empty() && routing_key == self.queue)
    }

    /// The properties of a deferred copy of a command, put back on this
    /// worker's queue: sealed again by this worker for the queue it goes
    /// to, with the key the original came with (`key`), valid until the
    /// original seal was (`until`), or for [`UNSEALED_COPY_VALID_MS`] when
    /// it came unsealed.
    pub(super) fn reseal(
        &self,
        properties: BasicProperties,
        body: &[u8],
        (key, until): (usize, Option<u64>),
    ) -> BasicProperties {
        let now = crate::clock::now_ms();
        let valid_ms = until.map_or(UNSEALED_COPY_VALID_MS, |u| u.saturating_sub(now));
        let env = Envelope {
            kind: Kind::Command,
            routing_key: &self.queue,
            reply_to: properties.reply_to().as_ref().map(|s| s.as_str()),
            correlation_id: properties.correlation_id().as_ref().map(|s| s.as_str()),
        };
        let sealed = (self.sealer.keys)
            .seal_with(key, &env, body, now, valid_ms)
            .header();
        with_header(properties, sealed)
    }
}

/// The properties of an answer published with `routing_key` (its
/// `reply_to` queue, or the events exchange's key), sealed when there is
/// a seal policy: with key `key` (the one its command came with; 0, the
/// current one, for anything else).
pub(super) fn seal_answer(
    sealer: Option<&Sealer>,
    key: usize,
    properties: BasicProperties,
    routing_key: &str,
    body: &[u8],
) -> BasicProperties {
    let Some(sealer) = sealer else {
        return properties;
    };
    let env = Envelope {
        kind: Kind::Answer,
        routing_key,
        reply_to: None,
        correlation_id: properties.correlation_id().as_ref().map(|s| s.as_str()),
    };
    let sealed = (sealer.keys)
        .seal_with(key, &env, body, crate::clock::now_ms(), 0)
        .header();
    with_header(properties, sealed)
}

/// The properties of a command published with `routing_key` on the
/// command exchange (`send`), sealed when there is a seal policy, valid
/// `valid_ms`.
pub(crate) fn seal_command(
    sealer: Option<&Sealer>,
    properties: BasicProperties,
    routing_key: &str,
    body: &[u8],
    valid_ms: u64,
) -> BasicProperties {
    let Some(sealer) = sealer else {
        return properties;
    };
    let env = Envelope {
        kind: Kind::Command,
        routing_key,
        reply_to: properties.reply_to().as_ref().map(|s| s.as_str()),
        correlation_id: properties.correlation_id().as_ref().map(|s| s.as_str()),
    };
    let sealed = sealer
        .keys
        .seal(&env, body, crate::clock::now_ms(), valid_ms)
        .header();
    with_header(properties, sealed)
}

/// Whether an answer `send` received (on `queue`) may be taken under
/// `sealer`: `Err` says why not.
pub(crate) fn admit_answer(
    sealer: Option<&Sealer>,
    delivery: &Delivery,
    queue: &str,
) -> Result<(), Refusal> {
    let Some(sealer) = sealer else {
        return Ok(());
    };
    let env = Envelope {
        kind: Kind::Answer,
        routing_key: queue,
        reply_to: None,
        correlation_id: delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|s| s.as_str()),
    };
    let header = header(&delivery.properties);
    sealer
        .admit(
            header.as_deref(),
            &env,
            &delivery.data,
            crate::clock::now_ms(),
        )
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seal::Keys;

    fn gate() -> Gate {
        let keys = Keys::parse(&"11".repeat(32)).unwrap();
        let sealer = Arc::new(Sealer {
            keys,
            require: true,
        });
        Gate::new(sealer, "cond-1", "ironic-image-worker.cond-1")
    }

    #[test]
    fn commands_are_aimed_at_this_worker_only() {
        let g = gate();
        let x = "ironic-image-worker";
        assert!(g.aimed_here(x, "cond-1.node.prepare"));
        assert!(g.aimed_here(x, "cond-1.node.cleanup"));
        assert!(g.aimed_here(x, "cond-1.image.warm"));
        assert!(g.aimed_here(x, WARM_ALL_KEY));
        assert!(g.aimed_here("", "ironic-image-worker.cond-1"));
        for other in [
            "cond-2.node.prepare",
            "cond-1x.node.prepare",
            "cond-1.node.prepare.more",
            "cond-1.other",
            "cond-1",
        ] {
            assert!(!g.aimed_here(x, other), "{other}");
        }
        assert!(
            !g.aimed_here(x, "ironic-image-worker.cond-1"),
            "the queue's name only through the default exchange"
        );
    }

    #[test]
    fn a_resealed_copy_keeps_the_original_end() {
        let g = gate();
        let now = crate::clock::now_ms();
        let props = BasicProperties::default().with_correlation_id("c".into());
        let copy = g.reseal(props, b"{}", (0, Some(now + 60_000)));
        let text = header(&copy).unwrap();
        let valid: u64 = text.split(':').nth(3).unwrap().parse().unwrap();
        assert!((50_000..=60_000).contains(&valid), "{text}");
    }
}
