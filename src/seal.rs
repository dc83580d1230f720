//! The seal on the commands and answers that cross the broker between the
//! deploy interface (or `send`) and the worker, and the one canonical
//! encoding every keyed or hashed record of the worker is built with.
//!
//! Why: the broker is shared by every service of a cloud (one RabbitMQ user
//! for all of them is common), so anyone on it can publish a command to a
//! worker's exchange or an answer to the interface's reply queue. With a
//! secret shared by the two sides, a message counts only when it carries an
//! HMAC-SHA256, keyed with that secret, over what it is, where it goes and
//! when it was sealed (docs/contract.md, "Sealed commands and answers", is
//! the wire form the Python side implements on its own).
//!
//! # Canonical encoding
//!
//! [`Fields`] writes a record as a tag, then fields each written as one
//! byte `0` when absent, else one byte `1`, its length as an unsigned
//! 64-bit big-endian integer and its bytes (or, for the peers' older
//! seal, the length and bytes without the presence byte). The delivery
//! identity (`broker/identity.rs`), the peers' seal (`peers/seal.rs`) and
//! this seal all use it, so no two records of one kind read the same.
//!
//! # The seal, version 1
//!
//! The header [`HEADER`] holds `1:<key id>:<sealed_at>:<valid_ms>:<mac>`:
//! the key's id ([`Key::id`]), when it was sealed and how long after that
//! a command may be acted on (decimal milliseconds, no leading zeros), and
//! the HMAC-SHA256 (lowercase hex) keyed with that key over [`TAG`] then
//! the fields kind (`command` or `answer`), key id, routing key,
//! `reply_to`, `correlation_id`, sealed_at, valid_ms and the body.

use hmac::{KeyInit, Mac};
use sha2::digest::Update;
use sha2::{Digest, Sha256};

type HmacSha256 = hmac::Hmac<Sha256>;

/// The AMQP header carrying the seal.
pub(crate) const HEADER: &str = "x-iiw-seal";

/// The tag that starts the sealed encoding (its version).
pub(crate) const TAG: &[u8] = b"ironic-image-worker seal v1\n";

/// The tag a key's id is computed with.
const KEY_ID_TAG: &[u8] = b"ironic-image-worker seal key v1\n";

/// How far a command's seal may be from the receiver's clock beyond its
/// validity, either way: clocks of two hosts differ.
pub(crate) const SKEW_MS: u64 = 5 * 60 * 1000;

/// The longest validity a command's seal is taken for: the node ledger
/// remembers a delivery 24 hours, so a replay within the window is always
/// known there and one after it is refused.
pub(crate) const MAX_VALID_MS: u64 = 24 * 3600 * 1000;

/// The shortest key taken, in bytes.
pub(crate) const MIN_KEY_BYTES: usize = 32;

/// Writes a record as the module's canonical encoding into a hash or a
/// MAC: one writer, so every record is length-prefixed the same way.
pub(crate) struct Fields<D: Update>(D);

impl<D: Update> Fields<D> {
    /// A record written into `sink`.
    pub(crate) fn new(sink: D) -> Fields<D> {
        Fields(sink)
    }

    /// Bytes as they are (the record's tag, first).
    pub(crate) fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update(bytes);
        self
    }

    /// A field that is always there: its length, then its bytes.
    pub(crate) fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update(&(bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
        self
    }

    /// A field that may be absent: `0`, or `1` and the field.
    pub(crate) fn optional(&mut self, bytes: Option<&[u8]>) -> &mut Self {
        match bytes {
            None => self.0.update(&[0]),
            Some(bytes) => {
                self.0.update(&[1]);
                self.field(bytes);
            }
        }
        self
    }

    /// The hash or MAC, every field written.
    pub(crate) fn finish(self) -> D {
        self.0
    }
}

/// One secret key and the id the header names it by.
#[derive(Clone)]
pub(crate) struct Key {
    bytes: Vec<u8>,
    /// The first 16 hex digits of SHA-256 over [`KEY_ID_TAG`] and the key:
    /// names the key in a seal (so a receiver with two keys tries the
    /// right one), tells nothing of it.
    id: String,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({})", self.id)
    }
}

impl Key {
    /// A key from its bytes.
    fn new(bytes: Vec<u8>) -> Key {
        let digest = Sha256::new().chain_update(KEY_ID_TAG).chain_update(&bytes);
        let id = hex::encode(&digest.finalize()[..8]);
        Key { bytes, id }
    }
}

/// The keys of a secret file: the current one (seals what is sent), and
/// a previous one still taken while a rotation goes round.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    keys: Vec<Key>,
}

impl Keys {
    /// Reads a key file: one key a line in hex (at least
    /// [`MIN_KEY_BYTES`] bytes), the current one first, at most one
    /// previous one; blank lines and `#` comments skipped.
    pub(crate) fn parse(text: &str) -> Result<Keys, String> {
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bytes = hex::decode(line).map_err(|_| format!("line {}: not a hex key", n + 1))?;
            if bytes.len() < MIN_KEY_BYTES {
                return Err(format!(
                    "line {}: a key of {} bytes, at least {MIN_KEY_BYTES} are needed (64 hex digits)",
                    n + 1,
                    bytes.len()
                ));
            }
            keys.push(Key::new(bytes));
        }
        match keys.len() {
            0 => Err("no key in it".into()),
            1 | 2 => Ok(Keys { keys }),
            n => Err(format!(
                "{n} keys: one (current) or two (current, then previous)"
            )),
        }
    }

    /// Reads and parses the key file at `path`, refusing one that others
    /// may read or anyone but its owner may change (mode 0600 or 0640).
    pub(crate) fn read(path: &std::path::Path) -> Result<Keys, String> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o027 != 0 {
            return Err(format!(
                "{shown}: mode {mode:04o} lets others read it or its group change it: \
                 chmod 0600 (or 0640)"
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
        Keys::parse(&text).map_err(|e| format!("{shown}: {e}"))
    }

    /// The key that seals what is sent.
    pub(crate) fn current(&self) -> &Key {
        &self.keys[0]
    }

    /// The key of id `id`, current or previous.
    fn find(&self, id: &str) -> Option<&Key> {
        self.keys.iter().find(|k| k.id == id)
    }

    /// Whether `other` holds a key these keys take.
    pub(crate) fn shares_a_key_with(&self, other: &Keys) -> bool {
        other.keys.iter().any(|k| self.find(&k.id).is_some())
    }
}

/// What a sealed message is: sealed into it, so an answer never passes
/// for a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A command to a worker.
    Command,
    /// A worker's answer (to a `reply_to` queue or the events exchange).
    Answer,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Kind::Command => "command",
            Kind::Answer => "answer",
        }
    }
}

/// Where a message goes, as sealed with it: re-published elsewhere, it no
/// longer matches its seal.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Envelope<'a> {
    /// Command or answer.
    pub kind: Kind,
    /// The routing key it is published with (an answer's `reply_to`
    /// queue, through the default exchange).
    pub routing_key: &'a str,
    /// Its `reply_to` property (none on an answer).
    pub reply_to: Option<&'a str>,
    /// Its `correlation_id` property.
    pub correlation_id: Option<&'a str>,
}

/// A seal as the header carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seal {
    key_id: String,
    /// When it was sealed, ms since the epoch.
    pub sealed_at: u64,
    /// How long after `sealed_at` a command may be acted on, ms.
    pub valid_ms: u64,
    mac: [u8; 32],
}

impl Seal {
    /// The header's text.
    pub(crate) fn header(&self) -> String {
        format!(
            "1:{}:{}:{}:{}",
            self.key_id,
            self.sealed_at,
            self.valid_ms,
            hex::encode(self.mac)
        )
    }

    /// Reads the header's text; `None` when it is not a version 1 seal.
    fn parse(text: &str) -> Option<Seal> {
        let mut parts = text.split(':');
        let (Some("1"), Some(key_id), Some(at), Some(valid), Some(mac), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return None;
        };
        let number = |s: &str| {
            let n: u64 = s.parse().ok()?;
            (n.to_string() == s).then_some(n)
        };
        Some(Seal {
            key_id: key_id.to_string(),
            sealed_at: number(at)?,
            valid_ms: number(valid)?,
            mac: hex::decode(mac).ok()?.try_into().ok()?,
        })
    }
}

/// Why a message's seal was not taken: the metric's and the log's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No seal.
    Unsealed,
    /// A seal that does not read, names a key not held, or does not match
    /// the message as received (forged, or published somewhere else).
    BadSeal,
    /// A command's seal outside its window ([`SKEW_MS`], [`MAX_VALID_MS`]).
    ExpiredSeal,
    /// A command's seal seen before within its window: the same message
    /// published again by someone who saw it (the broker's own redelivery
    /// is not one).
    ReplayedSeal,
}

/// The MAC of `body` in `env`, sealed with `key` at `at` for `valid_ms`.
fn mac_of(key: &Key, env: &Envelope<'_>, at: u64, valid_ms: u64, body: &[u8]) -> HmacSha256 {
    let mac = <HmacSha256 as KeyInit>::new_from_slice(&key.bytes).expect("HMAC takes any key");
    let mut fields = Fields::new(mac);
    fields
        .raw(TAG)
        .optional(Some(env.kind.tag().as_bytes()))
        .optional(Some(key.id.as_bytes()))
        .optional(Some(env.routing_key.as_bytes()))
        .optional(env.reply_to.map(str::as_bytes))
        .optional(env.correlation_id.map(str::as_bytes))
        .optional(Some(at.to_string().as_bytes()))
        .optional(Some(valid_ms.to_string().as_bytes()))
        .optional(Some(body));
    fields.finish()
}

/// A message's seal that held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sealed {
    /// When it was sealed.
    pub sealed_at: u64,
    /// Until when a command may be acted on ([`MAX_VALID_MS`] at most).
    pub until: u64,
    /// The MAC: what a replay of the message repeats.
    pub mac: [u8; 32],
    /// Which of the keys sealed it (0: the current one), so its answer
    /// is sealed with the same key: a sender still on the previous key
    /// during a rotation takes the answer.
    pub key: usize,
}

impl Keys {
    /// Seals `body` in `env` with the current key at `now`, valid
    /// `valid_ms` (a command) or 0 (an answer).
    pub(crate) fn seal(&self, env: &Envelope<'_>, body: &[u8], now: u64, valid_ms: u64) -> Seal {
        self.seal_with(0, env, body, now, valid_ms)
    }

    /// [`Keys::seal`] with key `index` (0: the current one; the current
    /// one when there is no such key): an answer goes out under the key
    /// its command came with.
    pub(crate) fn seal_with(
        &self,
        index: usize,
        env: &Envelope<'_>,
        body: &[u8],
        now: u64,
        valid_ms: u64,
    ) -> Seal {
        let key = self.keys.get(index).unwrap_or(self.current());
        Seal {
            key_id: key.id.clone(),
            sealed_at: now,
            valid_ms,
            mac: mac_of(key, env, now, valid_ms, body)
                .finalize()
                .into_bytes()
                .into(),
        }
    }

    /// Checks the seal `header` of `body` in `env` at `now`: made with one
    /// of these keys over this very message and, for a command, within its
    /// window. The MAC is compared in constant time.
    pub(crate) fn check(
        &self,
        header: Option<&str>,
        env: &Envelope<'_>,
        body: &[u8],
        now: u64,
    ) -> Result<Sealed, Refusal> {
        let header = header.ok_or(Refusal::Unsealed)?;
        let seal = Seal::parse(header).ok_or(Refusal::BadSeal)?;
        let index = (self.keys.iter())
            .position(|k| k.id == seal.key_id)
            .ok_or(Refusal::BadSeal)?;
        let key = &self.keys[index];
        mac_of(key, env, seal.sealed_at, seal.valid_ms, body)
            .verify_slice(&seal.mac)
            .map_err(|_| Refusal::BadSeal)?;
        let until = seal
            .sealed_at
            .saturating_add(seal.valid_ms.min(MAX_VALID_MS));
        let early = now.saturating_add(SKEW_MS) < seal.sealed_at;
        let late = now > until.saturating_add(SKEW_MS);
        if env.kind == Kind::Command && (early || late) {
            return Err(Refusal::ExpiredSeal);
        }
        Ok(Sealed {
            sealed_at: seal.sealed_at,
            until,
            mac: seal.mac,
            key: index,
        })
    }
}

/// The seals of the commands taken within their window, so a message
/// published again by anyone who saw it is taken once. Bounded: beyond
/// [`Replays::LIMIT`] live seals, the oldest-ending are forgotten first
/// (only genuine seals are remembered, so only the senders' own traffic
/// fills it).
#[derive(Debug, Default)]
pub(crate) struct Replays {
    seen: std::collections::HashMap<[u8; 32], u64>,
}

impl Replays {
    /// Seals remembered at most.
    const LIMIT: usize = 65_536;

    /// Records `sealed` at `now`; false when its seal was taken before and
    /// its window is not over.
    pub(crate) fn first_time(&mut self, sealed: &Sealed, now: u64) -> bool {
        if self.seen.contains_key(&sealed.mac) {
            return false;
        }
        if self.seen.len() >= Self::LIMIT {
            self.seen.retain(|_, until| *until + SKEW_MS >= now);
        }
        if self.seen.len() >= Self::LIMIT
            && let Some(oldest) = self.seen.iter().min_by_key(|(_, u)| **u).map(|(m, _)| *m)
        {
            self.seen.remove(&oldest);
        }
        self.seen.insert(sealed.mac, sealed.until);
        true
    }
}

/// The seal policy in force on one side, from its configuration: the
/// keys, and whether an unsealed message is refused (`require`) or taken
/// (`send`, while the other side is not sealing yet). A message carrying
/// a seal that does not hold is refused either way: a sender that seals
/// has the secret, so a seal that does not match is a forgery or a
/// misconfiguration, never a message to act on.
#[derive(Debug, Clone)]
pub(crate) struct Sealer {
    /// The keys.
    pub keys: Keys,
    /// Whether unsealed messages are refused.
    pub require: bool,
}

impl Sealer {
    /// [`Keys::check`] under this policy: `Ok(None)` for an unsealed
    /// message taken in `send` mode.
    pub(crate) fn admit(
        &self,
        header: Option<&str>,
        env: &Envelope<'_>,
        body: &[u8],
        now: u64,
    ) -> Result<Option<Sealed>, Refusal> {
        match self.keys.check(header, env, body, now) {
            Ok(sealed) => Ok(Some(sealed)),
            Err(Refusal::Unsealed) if !self.require => Ok(None),
            Err(why) => Err(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The golden vector both implementations check (the Python one in
    /// ironic-plugin's unit tests reads the same file).
    const VECTOR: &str = include_str!("../tests/fixtures/seal_v1_vector.json");

    #[derive(serde::Deserialize)]
    struct Vector {
        key: String,
        key_id: String,
        kind: String,
        routing_key: String,
        reply_to: Option<String>,
        correlation_id: Option<String>,
        sealed_at: u64,
        valid_ms: u64,
        body: String,
        header: String,
    }

    fn vector() -> (Vector, Keys) {
        let v: Vector = serde_json::from_str(VECTOR).unwrap();
        let keys = Keys::parse(&v.key).unwrap();
        (v, keys)
    }

    fn env_of(v: &Vector) -> Envelope<'_> {
        Envelope {
            kind: if v.kind == "command" {
                Kind::Command
            } else {
                Kind::Answer
            },
            routing_key: &v.routing_key,
            reply_to: v.reply_to.as_deref(),
            correlation_id: v.correlation_id.as_deref(),
        }
    }

    /// The golden value: a change here breaks every deploy interface that
    /// implements the documented form. Change the version instead.
    #[test]
    fn the_golden_vector_seals_to_its_header() {
        let (v, keys) = vector();
        assert_eq!(keys.current().id, v.key_id);
        let seal = keys.seal(&env_of(&v), v.body.as_bytes(), v.sealed_at, v.valid_ms);
        assert_eq!(seal.header(), v.header);
        let at = v.sealed_at;
        let checked = keys.check(Some(&v.header), &env_of(&v), v.body.as_bytes(), at);
        assert_eq!(checked.unwrap().sealed_at, at);
    }

    #[test]
    fn a_seal_holds_for_its_message_only() {
        let (v, keys) = vector();
        let body = v.body.as_bytes();
        let at = v.sealed_at;
        let h = Some(v.header.as_str());
        let env = env_of(&v);
        let refused = |e: Envelope<'_>, b: &[u8], h: Option<&str>, now| {
            keys.check(h, &e, b, now).unwrap_err()
        };
        assert_eq!(refused(env, body, None, at), Refusal::Unsealed);
        assert_eq!(refused(env, b"{}", h, at), Refusal::BadSeal);
        for aimed in [
            Envelope {
                routing_key: "other-host.node.prepare",
                ..env
            },
            Envelope {
                reply_to: Some("someone-else"),
                ..env
            },
            Envelope {
                reply_to: None,
                ..env
            },
            Envelope {
                correlation_id: Some("another"),
                ..env
            },
            Envelope {
                kind: Kind::Answer,
                ..env
            },
        ] {
            assert_eq!(refused(aimed, body, h, at), Refusal::BadSeal, "{aimed:?}");
        }
        let other = Keys::parse(&"ab".repeat(32)).unwrap();
        let forged = other.seal(&env, body, at, v.valid_ms).header();
        assert_eq!(refused(env, body, Some(&forged), at), Refusal::BadSeal);
        // The key id of ours on a MAC of another key.
        let swapped = format!("1:{}:{}", keys.current().id, &forged[19..]);
        assert_eq!(refused(env, body, Some(&swapped), at), Refusal::BadSeal);
        for garbled in ["", "2:x:1:1:00", "1:a:01:0:00", "1:a:1:0:zz"] {
            assert_eq!(refused(env, body, Some(garbled), at), Refusal::BadSeal);
        }
    }

    #[test]
    fn a_command_is_taken_within_its_window_only() {
        let (v, keys) = vector();
        let (env, body) = (env_of(&v), v.body.as_bytes());
        let at = v.sealed_at;
        let check = |now| keys.check(Some(&v.header), &env, body, now);
        let last = at + v.valid_ms + SKEW_MS;
        assert!(check(at - SKEW_MS).is_ok());
        assert!(check(last).is_ok());
        assert_eq!(check(at - SKEW_MS - 1), Err(Refusal::ExpiredSeal));
        assert_eq!(check(last + 1), Err(Refusal::ExpiredSeal));
        // Validity is capped at what the ledger remembers.
        let long = keys.seal(&env, body, at, 10 * MAX_VALID_MS).header();
        let late = at + MAX_VALID_MS + SKEW_MS + 1;
        assert_eq!(
            keys.check(Some(&long), &env, body, late),
            Err(Refusal::ExpiredSeal)
        );
        // An answer is bound to its request, not to a window.
        let answer = Envelope {
            kind: Kind::Answer,
            ..env
        };
        let sealed = keys.seal(&answer, body, at, 0).header();
        assert!(keys.check(Some(&sealed), &answer, body, late).is_ok());
    }

    #[test]
    fn a_previous_key_is_taken_and_send_mode_takes_the_unsealed() {
        let (v, old) = vector();
        let (env, body) = (env_of(&v), v.body.as_bytes());
        let new = "cd".repeat(32);
        let both = Keys::parse(&format!("{new}\n# previous\n{}\n", v.key)).unwrap();
        let taken = both
            .check(Some(&v.header), &env, body, v.sealed_at)
            .unwrap();
        assert_eq!(taken.key, 1, "sealed with the previous key");
        let answer = Envelope {
            kind: Kind::Answer,
            ..env
        };
        let back = both
            .seal_with(taken.key, &answer, body, v.sealed_at, 0)
            .header();
        assert!(
            old.check(Some(&back), &answer, body, v.sealed_at).is_ok(),
            "answered under the key the command came with"
        );
        assert!(both.shares_a_key_with(&old));
        let only_new = Keys::parse(&new).unwrap();
        assert!(!only_new.shares_a_key_with(&old));
        let sealed = both.seal(&env, body, v.sealed_at, 0).header();
        assert_eq!(
            old.check(Some(&sealed), &env, body, v.sealed_at),
            Err(Refusal::BadSeal),
            "sealed with the new key, which the old side does not hold"
        );
        let send = Sealer {
            keys: old.clone(),
            require: false,
        };
        assert_eq!(send.admit(None, &env, body, v.sealed_at), Ok(None));
        assert_eq!(
            send.admit(Some(&sealed), &env, body, v.sealed_at),
            Err(Refusal::BadSeal)
        );
        let require = Sealer {
            keys: old,
            require: true,
        };
        assert_eq!(
            require.admit(None, &env, body, v.sealed_at),
            Err(Refusal::Unsealed)
        );
    }

    #[test]
    fn a_seal_is_taken_once() {
        let (v, keys) = vector();
        let sealed = keys
            .check(Some(&v.header), &env_of(&v), v.body.as_bytes(), v.sealed_at)
            .unwrap();
        let mut replays = Replays::default();
        assert!(replays.first_time(&sealed, v.sealed_at));
        assert!(!replays.first_time(&sealed, v.sealed_at + 1));
        let other = Sealed {
            mac: [0; 32],
            ..sealed
        };
        assert!(replays.first_time(&other, v.sealed_at + 1));
    }

    #[test]
    fn key_files_are_hex_keys_of_32_bytes_one_or_two() {
        let k = "0f".repeat(32);
        assert!(Keys::parse(&k).is_ok());
        assert!(Keys::parse(&format!("\n# c\n{k}\n{k}\n")).is_ok());
        for (text, why) in [
            ("", "no key"),
            ("zz", "not a hex key"),
            (&"ab".repeat(31), "31 bytes"),
            (&format!("{k}\n{k}\n{k}"), "3 keys"),
        ] {
            let e = Keys::parse(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn key_files_others_may_read_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seal.key");
        std::fs::write(&path, "0f".repeat(32)).unwrap();
        for (mode, ok) in [(0o600, true), (0o640, true), (0o644, false), (0o660, false)] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let read = Keys::read(&path);
            assert_eq!(read.is_ok(), ok, "{mode:o}: {read:?}");
        }
        let e = Keys::read(&path).unwrap_err();
        assert!(e.contains("mode 0660"), "{e}");
    }
}
