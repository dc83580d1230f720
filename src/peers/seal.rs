//! The seal on every message the workers of a deployment exchange over the
//! broker. The broker is shared by every service of a cloud, so anyone who
//! can publish could otherwise answer a query, or ask one: a message counts
//! only when it carries an HMAC-SHA256, keyed with the `[peers]` secret,
//! over what it is (query or offer), the query it asks or answers
//! (correlation id), where answers go (`reply_to`), when it was sent and
//! its body, exactly as sent. The seal is checked, in constant time, before
//! the body is parsed; a message without one, with a wrong one, sent too
//! long ago (or too far ahead: [`MAX_SKEW_MS`]) or seen before is dropped.
//!
//! The same secret names the cloud-wide claim on a download
//! ([`claim_queue`]): a name nobody without the secret can compute, so
//! nobody else can take the claim first and make every worker wait.

use crate::seal::Fields;
use hmac::{KeyInit, Mac};
use std::collections::HashMap;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The header carrying when a message was sealed (unix milliseconds, as a
/// decimal string).
pub(crate) const TIME_HEADER: &str = "x-iiw-peer-time";

/// The header carrying the seal (lowercase hex).
pub(crate) const MAC_HEADER: &str = "x-iiw-peer-mac";

/// How far a message's time may be from the receiver's clock, either way:
/// beyond it the message is stale (or from a clock too far off to trust).
pub(crate) const MAX_SKEW_MS: u64 = 30_000;

/// The largest body of a peers' message read at all: a query is a hundred
/// bytes, an offer a few hundred plus the image source's URL.
pub(crate) const MAX_MESSAGE_BYTES: usize = 64 << 10;

/// What a message is: sealed into it, so one kind never passes for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Who holds this master?
    Query,
    /// An answer to one query.
    Offer,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Kind::Query => "query",
            Kind::Offer => "offer",
        }
    }
}

/// What a seal covers besides the body.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Envelope<'a> {
    /// Query or offer.
    pub kind: Kind,
    /// The query's correlation id (an offer carries the one it answers).
    pub correlation: &'a str,
    /// Where answers go (a query's `reply_to`; empty for an offer).
    pub reply_to: &'a str,
    /// When it was sealed, unix milliseconds.
    pub time_ms: u64,
}

/// Why a message was dropped: the metric's `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No seal, or one that cannot be read.
    Unsigned,
    /// A seal that does not match (not made with our secret, or over
    /// something else).
    BadSignature,
    /// Sealed longer ago (or further ahead) than [`MAX_SKEW_MS`].
    Stale,
    /// A seal seen before.
    Replayed,
    /// A body over [`MAX_MESSAGE_BYTES`], not read.
    TooLarge,
}

impl Refusal {
    /// The metric's label.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Refusal::Unsigned => "unsigned",
            Refusal::BadSignature => "bad_signature",
            Refusal::Stale => "stale",
            Refusal::Replayed => "replayed",
            Refusal::TooLarge => "too_large",
        }
    }
}

fn keyed(secret: &[u8]) -> HmacSha256 {
    HmacSha256::new_from_slice(secret).expect("HMAC takes any key length")
}

/// Each field with its length first (`crate::seal::Fields`, without the
/// presence byte of later records), so no two envelopes read the same.
fn mac_of(secret: &[u8], env: &Envelope<'_>, body: &[u8]) -> HmacSha256 {
    let time = env.time_ms.to_string();
    let mut fields = Fields::new(keyed(secret));
    for field in [
        b"iiw-peers-v1".as_slice(),
        env.kind.tag().as_bytes(),
        env.correlation.as_bytes(),
        env.reply_to.as_bytes(),
        time.as_bytes(),
        body,
    ] {
        fields.field(field);
    }
    fields.finish()
}

/// The seal of `body` in `env`, as the [`MAC_HEADER`] carries it.
pub(crate) fn seal(secret: &[u8], env: &Envelope<'_>, body: &[u8]) -> String {
    hex::encode(mac_of(secret, env, body).finalize().into_bytes())
}

/// Checks the seal `mac` (hex) of `body` in `env` at `now_ms`; returns the
/// seal's bytes (what a replay would repeat) when it holds.
pub(crate) fn check(
    secret: &[u8],
    env: &Envelope<'_>,
    body: &[u8],
    mac: Option<&str>,
    now_ms: u64,
) -> Result<[u8; 32], Refusal> {
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(Refusal::TooLarge);
    }
    let mac = mac
        .and_then(|m| hex::decode(m).ok())
        .and_then(|m| <[u8; 32]>::try_from(m).ok())
        .ok_or(Refusal::Unsigned)?;
    mac_of(secret, env, body)
        .verify_slice(&mac)
        .map_err(|_| Refusal::BadSignature)?;
    if now_ms.abs_diff(env.time_ms) > MAX_SKEW_MS {
        return Err(Refusal::Stale);
    }
    Ok(mac)
}

/// The exclusive queue that is the cloud-wide claim on downloading master
/// `name`: `<exchange>.claim.<HMAC of the name>`, which only holders of
/// the secret can compute (and so declare before the others).
pub(crate) fn claim_queue(secret: &[u8], exchange: &str, name: &str) -> String {
    let mut mac = keyed(secret);
    mac.update(b"iiw-peers-claim-v1\n");
    mac.update(name.as_bytes());
    let tag = hex::encode(&mac.finalize().into_bytes()[..16]);
    format!("{exchange}.claim.{tag}")
}

/// The seals seen within the skew window, so a message repeated by anyone
/// who saw it counts once; bounded (beyond [`Replays::LIMIT`] live seals a
/// new one is refused, which only makes its sender's peers miss).
#[derive(Default)]
pub(crate) struct Replays {
    seen: HashMap<[u8; 32], u64>,
}

impl Replays {
    /// Seals remembered at most.
    const LIMIT: usize = 16_384;

    /// Records `mac`, sealed at `time_ms`; false when it was seen before
    /// (or no more can be remembered).
    pub(crate) fn first_time(&mut self, mac: [u8; 32], time_ms: u64, now_ms: u64) -> bool {
        if self.seen.len() >= Self::LIMIT {
            self.seen.retain(|_, t| now_ms.abs_diff(*t) <= MAX_SKEW_MS);
        }
        if self.seen.len() >= Self::LIMIT || self.seen.contains_key(&mac) {
            return false;
        }
        self.seen.insert(mac, time_ms);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"a secret of the whole deployment";

    fn env(time_ms: u64) -> Envelope<'static> {
        Envelope {
            kind: Kind::Offer,
            correlation: "c0ffee",
            reply_to: "",
            time_ms,
        }
    }

    #[test]
    fn a_seal_holds_for_its_message_only() {
        let body = br#"{"name":"m"}"#;
        let mac = seal(SECRET, &env(1_000_000), body);
        assert!(check(SECRET, &env(1_000_000), body, Some(&mac), 1_000_000).is_ok());
        let check_at = |e: &Envelope<'_>, b: &[u8], m: Option<&str>, now| {
            check(SECRET, e, b, m, now).unwrap_err()
        };
        assert_eq!(
            check_at(&env(1_000_000), body, None, 1_000_000),
            Refusal::Unsigned
        );
        assert_eq!(
            check_at(&env(1_000_000), b"{\"name\":\"n\"}", Some(&mac), 1_000_000),
            Refusal::BadSignature
        );
        let other_query = Envelope {
            correlation: "c0ffef",
            ..env(1_000_000)
        };
        assert_eq!(
            check_at(&other_query, body, Some(&mac), 1_000_000),
            Refusal::BadSignature
        );
        let as_query = Envelope {
            kind: Kind::Query,
            ..env(1_000_000)
        };
        assert_eq!(
            check_at(&as_query, body, Some(&mac), 1_000_000),
            Refusal::BadSignature
        );
        let other_key = seal(b"another secret, not ours", &env(1_000_000), body);
        assert_eq!(
            check_at(&env(1_000_000), body, Some(&other_key), 1_000_000),
            Refusal::BadSignature
        );
        assert_eq!(
            check_at(
                &env(1_000_000),
                body,
                Some(&mac),
                1_000_000 + MAX_SKEW_MS + 1
            ),
            Refusal::Stale
        );
        let big = vec![b' '; MAX_MESSAGE_BYTES + 1];
        assert_eq!(
            check_at(&env(1_000_000), &big, Some(&mac), 1_000_000),
            Refusal::TooLarge
        );
    }

    #[test]
    fn a_seal_counts_once() {
        let mut replays = Replays::default();
        assert!(replays.first_time([1; 32], 10, 10));
        assert!(!replays.first_time([1; 32], 10, 11));
        assert!(replays.first_time([2; 32], 10, 11));
    }

    #[test]
    fn claim_queues_need_the_secret() {
        let ours = claim_queue(SECRET, "x", "m.converted");
        assert!(ours.starts_with("x.claim."), "{ours}");
        assert!(!ours.contains("m.converted"));
        assert_ne!(
            ours,
            claim_queue(b"another secret, not ours", "x", "m.converted")
        );
        assert_ne!(ours, claim_queue(SECRET, "x", "m"));
    }
}
