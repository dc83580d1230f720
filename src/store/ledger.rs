//! The per-node command ledger: what is known of each node, on disk,
//! shared by every worker process of the host and kept across restarts.
//!
//! Why it exists: the broker delivers a command again after a crash or a
//! lost acknowledgement, possibly to another process of the same host, and
//! a deferred prepare can come back after a later cleanup of its node. What
//! one process remembers in memory does not help the next one, so four
//! facts about each node are kept here:
//!
//! * when the node last *moved on* (a cleanup, a `deployed`, a notification
//!   of a later provision-state transition), so that a prepare older than
//!   that is refused instead of linking files for a deploy that is over:
//!   `<node>.moved`, the time alone, synced before it counts (the move must
//!   survive a crash of the host). Only [`Ledger::note_moved`] writes it,
//!   on a blocking thread;
//! * which deliveries were answered recently, so that a copy redelivered to
//!   any process is acknowledged without a second answer: `<node>.json`,
//!   never synced (after a crash of the host only the copies answered in
//!   the instant before their acknowledgement come back, and a sync cost a
//!   cache hit most of its time). Noting an answer therefore never syncs,
//!   whatever the node did before: it may run on an async thread;
//! * which deliveries are being worked on (a *claim*, taken when the work
//!   starts), so that a copy redelivered to another process while the first
//!   still runs it waits for that answer instead of being worked and
//!   answered a second time: a byte-range lock of `.ledger/.claims`, held
//!   by the claiming process and dropped by the kernel when it ends
//!   (`claims.rs`: no file per claim, no liveness check);
//! * the work accepted before its answer (a prepare moved to the slow lane
//!   and acknowledged to the broker, a JSON-RPC cast): nobody else holds a
//!   copy of it, so each is kept whole (opaque bytes the transport writes)
//!   on its transport's [`Shelf`], `.ledger/accepted/<key>.<owner>` or
//!   `.ledger/accepted-json-rpc-<port>/<key>.<owner>`, until answered, and
//!   a process finds those of a process that died and runs them again
//!   ([`Ledger::adopt_parked`]). A process is alive while it holds the
//!   `flock` on its token's file in `.ledger/.owners/` ([`TempOwner`]).
//!
//! A node's files are replaced atomically (temporary and rename) under a
//! short `flock` of the node's stripe (`.ledger/.locks/<n>`, one of
//! [`LOCK_STRIPES`], held for one read and one write, so the updates of
//! different nodes run side by side). A record written by the earlier
//! version may hold the move itself (`moved_ms` in the json): it counts
//! as well, and [`Ledger::expire`] (at start-up and periodically) moves it
//! into `<node>.moved`. Bounded: at most [`MAX_ANSWERED`] answers per node,
//! a record or move past [`TTL`] is ignored and removed by
//! [`Ledger::expire`], a file larger than [`MAX_RECORD_BYTES`] is not read.
//! Both outlive the node's files on purpose: a cleanup of a node with
//! nothing to remove is exactly what must be remembered.

mod claims;

use crate::clock::now_ms;
use crate::error::{Error, Result};
use crate::fsutil::{self, TempOwner};
use crate::node::NodeUuid;
use claims::{CLAIMS_FILE, Claims, Got};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long a record is kept after its newest entry.
pub const TTL: Duration = Duration::from_secs(24 * 3600);

/// Answers remembered per node (the newest ones).
pub const MAX_ANSWERED: usize = 64;

/// Longest key of an answered delivery that is recorded.
const MAX_KEY_LEN: usize = 64;

/// A record file larger than this is not read (it cannot be one of ours).
pub const MAX_RECORD_BYTES: u64 = 16 << 10;

/// Where a transport keeps the work it accepted before answering it: the
/// broker's early-acknowledged deliveries, or the JSON-RPC casts of one
/// listening port (only a process on that port is asked for their answer,
/// so only it may run them again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shelf(String);

impl Shelf {
    /// The broker's: deliveries acknowledged before their answer.
    pub fn broker() -> Shelf {
        Shelf("accepted".into())
    }

    /// The JSON-RPC listener's on `port`: casts not answered yet.
    pub fn json_rpc(port: u16) -> Shelf {
        Shelf(format!("accepted-json-rpc-{port}"))
    }
}

/// The directory of the earlier version's claim files (emptied by
/// [`Ledger::expire`] as their processes end).
const LEGACY_CLAIMS_DIR: &str = "claims";

/// A move file larger than this is not read (it holds one number).
const MAX_MOVED_BYTES: u64 = 64;

/// How many lock files the nodes' records are spread over.
pub const LOCK_STRIPES: u8 = 64;

/// Temporaries left by a writer that died are removed after this long.
const STALE_TEMP_AFTER: Duration = Duration::from_secs(3600);

/// What is known of one node.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// When the node last moved on (ms since the epoch; 0: never). Written
    /// by the earlier version only: a move is now kept in `<node>.moved`.
    #[serde(default)]
    pub moved_ms: u64,
    /// Deliveries answered, oldest first: their key and when.
    #[serde(default)]
    pub answered: Vec<(String, u64)>,
}

/// Whose turn it is to work on a delivery (see [`Ledger::claim`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Turn {
    /// This process's: the delivery is claimed for it now.
    Mine,
    /// It was answered already: nothing to do.
    Answered,
    /// Another process, alive, is working on it.
    Elsewhere,
}

impl Record {
    /// The newest time the record mentions.
    fn newest(&self) -> u64 {
        self.answered
            .iter()
            .map(|(_, at)| *at)
            .fold(self.moved_ms, u64::max)
    }

    /// Drops what is past [`TTL`] at `now` and answers beyond the bound.
    fn trim(&mut self, now: u64) {
        if !is_alive(self.moved_ms, now) {
            self.moved_ms = 0;
        }
        self.answered.retain(|(_, at)| is_alive(*at, now));
        let excess = self.answered.len().saturating_sub(MAX_ANSWERED);
        self.answered.drain(..excess);
    }
}

/// A node's stripe lock, held until dropped: what an update of the node's
/// files is made under ([`Ledger::lock`], [`Ledger::try_lock`]), so that no
/// update of another process is lost.
pub struct Stripe {
    _file: File,
    node: NodeUuid,
}

/// The ledger directory of one host.
#[derive(Clone)]
pub struct Ledger {
    dir: PathBuf,
    /// This process, as its parked deliveries name it.
    owner: Arc<TempOwner>,
    /// The deliveries this process claims.
    claims: Arc<Claims>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("dir", &self.dir).finish()
    }
}

impl Ledger {
    /// The ledger in `dir` (created 0755).
    pub fn open(dir: PathBuf) -> Result<Ledger> {
        Ledger::with_claims(dir.clone(), Claims::new(dir.join(CLAIMS_FILE)))
    }

    fn with_claims(dir: PathBuf, claims: Claims) -> Result<Ledger> {
        fsutil::ensure_dir(&dir)?;
        let owner = Arc::new(TempOwner::new(dir.join(".owners")));
        Ok(Ledger {
            dir,
            owner,
            claims: Arc::new(claims),
        })
    }

    /// The node's answers.
    fn path(&self, node: &NodeUuid) -> PathBuf {
        self.dir.join(format!("{node}.json"))
    }

    /// The node's last move.
    fn moved_path(&self, node: &NodeUuid) -> PathBuf {
        self.dir.join(format!("{node}.moved"))
    }

    /// What is known of the node (empty when nothing is, or it is
    /// unreadable or past its TTL). Blocking: two small reads.
    pub fn read(&self, node: &NodeUuid) -> Record {
        let mut record = read_record(&self.path(node)).unwrap_or_default();
        record.moved_ms = record.moved_ms.max(self.moved_file_ms(node));
        record.trim(now_ms());
        record
    }

    /// When the node last moved on (0: not within [`TTL`]). Blocking: two
    /// small reads (the move, and a move the earlier version recorded with
    /// the answers).
    pub fn moved_ms(&self, node: &NodeUuid) -> u64 {
        self.read(node).moved_ms
    }

    /// Whether the delivery `key` of the node was answered (within the
    /// bounds). Blocking: one small read.
    pub fn answered(&self, node: &NodeUuid, key: &str) -> bool {
        let mut record = read_record(&self.path(node)).unwrap_or_default();
        record.trim(now_ms());
        record.answered.iter().any(|(k, _)| k == key)
    }

    /// The time in the node's move file (0: none, unreadable).
    fn moved_file_ms(&self, node: &NodeUuid) -> u64 {
        read_moved(&self.moved_path(node)).unwrap_or(0)
    }

    /// The node moved on at `at_ms` (kept if later than what is recorded).
    /// Blocking: a small file written and synced.
    pub fn note_moved(&self, node: &NodeUuid, at_ms: u64) -> Result<()> {
        let _lock = self.lock(node)?;
        self.write_moved(node, at_ms)
    }

    /// Writes `at_ms` as the node's move, synced, unless its move file
    /// holds a later one; the caller holds the node's lock.
    fn write_moved(&self, node: &NodeUuid, at_ms: u64) -> Result<()> {
        if self.moved_file_ms(node) >= at_ms {
            return Ok(());
        }
        let path = self.moved_path(node);
        let temp = fsutil::temp_path(&path);
        fsutil::write_file_atomically(&path, &temp, at_ms.to_string().as_bytes(), 0o644)
    }

    /// The delivery `key` of the node `held` locks was answered at `at_ms`:
    /// recorded (never synced), then this process's claim on it ends.
    pub fn note_answered(&self, held: &Stripe, key: &str, at_ms: u64) -> Result<()> {
        if !is_file_name(key) {
            return Ok(());
        }
        self.update(&held.node, |r| {
            r.answered.retain(|(k, _)| k != key);
            r.answered.push((key.to_string(), at_ms));
        })?;
        self.claims.drop_claim(key);
        Ok(())
    }

    /// Takes the turn to work on the delivery `key` of `node`:
    /// [`Turn::Elsewhere`] while another process claims it (or another
    /// delivery of this one shares its claim's byte), [`Turn::Answered`]
    /// when it was answered (looked at only when `answered_counts`: a
    /// command its sender publishes again is new work), else it is claimed
    /// for this process. A key too long to record is this process's without
    /// a claim. No stripe lock: the claim is taken before the answers are
    /// read, and an answer is recorded before its claim ends, so a process
    /// that gets the claim after another answered sees that answer. One
    /// non-blocking `fcntl` (and one small read when `answered_counts`).
    pub fn claim(&self, node: &NodeUuid, key: &str, answered_counts: bool) -> Result<Turn> {
        if !is_file_name(key) {
            return Ok(Turn::Mine);
        }
        let got = self.claims.take(key)?;
        if got == Got::Held {
            return Ok(Turn::Elsewhere);
        }
        if answered_counts && self.answered(node, key) {
            if got == Got::Taken {
                self.claims.drop_claim(key);
            }
            return Ok(Turn::Answered);
        }
        Ok(Turn::Mine)
    }

    /// This process no longer works on the delivery `key` without having
    /// answered it (taken back, needing no answer). One `fcntl`.
    pub fn release(&self, key: &str) {
        if is_file_name(key) {
            self.claims.drop_claim(key);
        }
    }

    /// Reads, changes and writes back the node's answers; the caller holds
    /// the node's lock, so no update of another process is lost. Never
    /// synced (see the module's documentation); a move the earlier version
    /// kept in the record stays in it.
    fn update(&self, node: &NodeUuid, change: impl FnOnce(&mut Record)) -> Result<()> {
        let path = self.path(node);
        let mut record = read_record(&path).unwrap_or_default();
        change(&mut record);
        record.trim(now_ms());
        let body = serde_json::to_vec(&record).unwrap_or_default();
        fsutil::write_file_unsynced(&path, &fsutil::temp_path(&path), &body, 0o644)
    }

    /// Keeps `bytes`, the whole delivery `key` this process accepted
    /// before answering it, on `shelf` until [`Ledger::unpark`]. Blocking:
    /// one small file written and synced.
    pub fn park(&self, shelf: &Shelf, key: &str, bytes: &[u8]) -> Result<()> {
        if !is_file_name(key) {
            return Err(Error::new(
                crate::error::ErrorCode::Internal,
                "a delivery key that cannot name a file",
            ));
        }
        self.owner.register()?;
        let dir = self.dir.join(&shelf.0);
        // It may hold a source's credentials: only the worker reads it.
        fsutil::ensure_private_dir(&dir)?;
        let path = dir.join(format!("{key}.{}", self.owner.token()));
        fsutil::write_file_atomically(&path, &fsutil::temp_path(&path), bytes, 0o600)
    }

    /// The delivery `key` this process parked on `shelf` was answered:
    /// forgotten.
    pub fn unpark(&self, shelf: &Shelf, key: &str) {
        let name = format!("{key}.{}", self.owner.token());
        let _ = std::fs::remove_file(self.dir.join(&shelf.0).join(name));
    }

    /// The deliveries parked by processes that are gone, taken over by this
    /// one (renamed to its token, so one process alone takes each): their
    /// key and bytes. Those past [`TTL`] are removed instead. Blocking.
    pub fn adopt_parked(&self, shelf: &Shelf) -> Vec<(String, Vec<u8>)> {
        let dir = self.dir.join(&shelf.0);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        if self.owner.register().is_err() {
            return Vec::new();
        }
        let me = self.owner.token().to_string();
        let mut adopted = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((key, owner)) = name.split_once('.') else {
                continue;
            };
            if owner == me || name.starts_with(fsutil::TEMP_PREFIX) || self.owner.is_alive(owner) {
                continue;
            }
            let path = entry.path();
            if is_older_than(&path, TTL) {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let mine = dir.join(format!("{key}.{me}"));
            if std::fs::rename(&path, &mine).is_err() {
                continue; // another process took it first
            }
            match std::fs::read(&mine) {
                Ok(bytes) => adopted.push((key.to_string(), bytes)),
                Err(e) => {
                    tracing::warn!(path = %mine.display(), error = %e, "unreadable parked delivery")
                }
            }
        }
        adopted
    }

    /// Waits for the `flock` of `node`'s stripe (a blocking call).
    pub fn lock(&self, node: &NodeUuid) -> Result<Stripe> {
        let file = self.stripe_file(node)?;
        file.lock().map_err(|e| Error::io("lock the ledger", e))?;
        Ok(Stripe {
            _file: file,
            node: node.clone(),
        })
    }

    /// The `flock` of `node`'s stripe if nobody holds it now (a few
    /// microseconds: fit for an async thread); `None` when it is held.
    pub fn try_lock(&self, node: &NodeUuid) -> Result<Option<Stripe>> {
        let file = self.stripe_file(node)?;
        match file.try_lock() {
            Ok(()) => Ok(Some(Stripe {
                _file: file,
                node: node.clone(),
            })),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => Err(Error::io("lock the ledger", e)),
        }
    }

    /// The lock file of `node`'s stripe, opened anew each time so that its
    /// `flock` excludes other threads of this process as well.
    fn stripe_file(&self, node: &NodeUuid) -> Result<File> {
        let stripe = u8::from_str_radix(&node.as_str()[node.as_str().len() - 2..], 16).unwrap_or(0)
            % LOCK_STRIPES;
        let dir = self.dir.join(".locks");
        let path = dir.join(stripe.to_string());
        making_dir(&dir, "open a ledger lock", || {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        })
    }

    /// Removes records and moves past their TTL, the earlier version's
    /// claim files of processes that are gone and temporaries of writers
    /// that died, and moves a move the earlier version kept in a record
    /// into its own file; returns how many files went. Blocking.
    pub fn expire(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let gone = if name.starts_with(fsutil::TEMP_PREFIX) {
                is_older_than(&path, STALE_TEMP_AFTER) && std::fs::remove_file(&path).is_ok()
            } else if let Some(stem) = name.strip_suffix(".json") {
                self.expire_node_file(stem, &path, |path| self.expire_record(stem, path))
            } else if let Some(stem) = name.strip_suffix(".moved") {
                self.expire_node_file(stem, &path, |path| {
                    read_moved(path).is_none_or(|at| !is_alive(at, now_ms()))
                })
            } else {
                false
            };
            removed += usize::from(gone);
        }
        removed += self.expire_legacy_claims();
        self.owner.remove_dead_owners();
        removed + self.expire_parked()
    }

    /// Removes the file `path` of the node named `stem` when `is_over`
    /// says so, under the node's lock (a name that is no node's is
    /// nobody's to update: no lock); whether it went.
    fn expire_node_file(
        &self,
        stem: &str,
        path: &Path,
        is_over: impl FnOnce(&Path) -> bool,
    ) -> bool {
        let _lock = match NodeUuid::parse(stem).map(|node| self.lock(&node)) {
            Ok(Err(_)) => return false,
            Ok(Ok(lock)) => Some(lock),
            Err(_) => None,
        };
        is_over(path) && std::fs::remove_file(path).is_ok()
    }

    /// Whether the record `path` of the node named `stem` is over: past
    /// its TTL, or unreadable. One that holds a move (the earlier version
    /// wrote it) has the move written to the node's move file, synced,
    /// and taken out of it. The caller holds the node's lock.
    fn expire_record(&self, stem: &str, path: &Path) -> bool {
        let Some(mut record) = read_record(path) else {
            return true;
        };
        let now = now_ms();
        if !is_alive(record.newest(), now) {
            return true;
        }
        let Ok(node) = NodeUuid::parse(stem) else {
            return false;
        };
        if record.moved_ms != 0 && is_alive(record.moved_ms, now) {
            if let Err(e) = self.write_moved(&node, record.moved_ms) {
                tracing::warn!(%node, error = %e, "could not move a node's move to its own file");
                return false;
            }
            record.moved_ms = 0;
            let body = serde_json::to_vec(&record).unwrap_or_default();
            let _ = fsutil::write_file_unsynced(path, &fsutil::temp_path(path), &body, 0o644);
        }
        false
    }

    /// Removes the claim files of the earlier version whose process is
    /// gone (a process of that version still running keeps its own), and
    /// their directory once empty.
    fn expire_legacy_claims(&self) -> usize {
        let dir = self.dir.join(LEGACY_CLAIMS_DIR);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let owner = read_legacy_claim_owner(&entry.path()).unwrap_or_default();
            if owner.is_empty() || !self.owner.is_alive(&owner) {
                removed += usize::from(std::fs::remove_file(entry.path()).is_ok());
            }
        }
        let _ = std::fs::remove_dir(&dir);
        removed
    }

    /// Removes, on every shelf, temporaries of parked deliveries whose
    /// writer died and records past [`TTL`] whose process is gone (a port
    /// nobody listens on any more leaves its shelf to this).
    fn expire_parked(&self) -> usize {
        let Ok(shelves) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut removed = 0;
        for shelf in shelves.flatten() {
            if !shelf.file_name().to_string_lossy().starts_with("accepted") {
                continue;
            }
            let Ok(entries) = std::fs::read_dir(shelf.path()) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let gone = if name.starts_with(fsutil::TEMP_PREFIX) {
                    is_older_than(&entry.path(), STALE_TEMP_AFTER)
                } else {
                    let owner = name.split_once('.').map_or("", |(_, o)| o);
                    is_older_than(&entry.path(), TTL) && !self.owner.is_alive(owner)
                };
                removed += usize::from(gone && std::fs::remove_file(entry.path()).is_ok());
            }
        }
        removed
    }
}

/// Runs `op`, which makes a file in `dir`; when `dir` is missing (the
/// first time, or removed meanwhile), makes it and runs `op` again. The
/// directory is looked at only when it is missing: not on every hit.
fn making_dir<T>(dir: &Path, what: &str, op: impl Fn() -> std::io::Result<T>) -> Result<T> {
    match op() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fsutil::ensure_dir(dir)?;
            op()
        }
        other => other,
    }
    .map_err(|e| Error::io(what, e))
}

/// True when `key` can be recorded and name a file: short, alphanumeric.
fn is_file_name(key: &str) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// The owner of the earlier version's claim file `path` (its first word,
/// `<owner> <at_ms> <node>`); `None` when it cannot be read.
fn read_legacy_claim_owner(path: &Path) -> Option<String> {
    let file = File::open(path).ok()?;
    let mut line = String::new();
    file.take(256).read_to_string(&mut line).ok()?;
    line.split(' ').next().map(str::to_string)
}

/// A move file's time; `None` when missing, too large or unreadable.
fn read_moved(path: &Path) -> Option<u64> {
    let file = File::open(path).ok()?;
    let mut body = String::new();
    file.take(MAX_MOVED_BYTES).read_to_string(&mut body).ok()?;
    body.trim().parse().ok()
}

/// Whether a time `at` (ms) is within [`TTL`] of `now`.
fn is_alive(at: u64, now: u64) -> bool {
    at.saturating_add(TTL.as_millis() as u64) >= now
}

/// A record file's contents; `None` when missing, too large or unreadable.
fn read_record(path: &Path) -> Option<Record> {
    let file = File::open(path).ok()?;
    let mut body = Vec::new();
    file.take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut body)
        .ok()?;
    if body.len() as u64 > MAX_RECORD_BYTES {
        tracing::warn!(path = %path.display(), "ledger record too large: ignored");
        return None;
    }
    match serde_json::from_slice(&body) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "unreadable ledger record: ignored");
            None
        }
    }
}

fn is_older_than(path: &Path, age: Duration) -> bool {
    std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|a| a > age)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeUuid {
        NodeUuid::parse("1be26c0b-03f2-4d2e-ae87-c02d7f33c123").unwrap()
    }

    /// Another process of the host: another ledger over the same directory,
    /// its claims spread over `offsets` bytes (all of them: `None`).
    fn process(dir: &tempfile::TempDir, offsets: Option<u64>) -> Ledger {
        let path = dir.path().join("l");
        match offsets {
            None => Ledger::open(path).unwrap(),
            Some(n) => Ledger::with_claims(path.clone(), Claims::spread(path.join(CLAIMS_FILE), n))
                .unwrap(),
        }
    }

    /// Every file under the ledger directory but the stripe locks.
    fn files(dir: &tempfile::TempDir) -> Vec<String> {
        fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
            for entry in std::fs::read_dir(dir).unwrap().flatten() {
                let path = entry.path();
                let name = path.strip_prefix(root).unwrap().display().to_string();
                if name == ".locks" {
                    continue;
                }
                if path.is_dir() {
                    walk(&path, root, out);
                } else {
                    out.push(name);
                }
            }
        }
        let root = dir.path().join("l");
        let mut out = Vec::new();
        walk(&root, &root, &mut out);
        out.sort();
        out
    }

    #[test]
    fn records_moves_and_answers_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = process(&dir, None);
        let other = process(&dir, None);
        assert_eq!(ledger.read(&node()), Record::default());
        let now = now_ms();
        ledger.note_moved(&node(), now).unwrap();
        ledger.note_moved(&node(), now - 5).unwrap();
        assert_eq!(other.moved_ms(&node()), now, "the latest move is kept");
        for i in 0..(MAX_ANSWERED + 10) {
            let held = other.lock(&node()).unwrap();
            other.note_answered(&held, &format!("k{i}"), now).unwrap();
        }
        let r = ledger.read(&node());
        assert_eq!(r.moved_ms, now, "answers keep the move");
        assert_eq!(r.answered.len(), MAX_ANSWERED);
        assert_eq!(
            r.answered.last().unwrap().0,
            format!("k{}", MAX_ANSWERED + 9)
        );
        assert!(!r.answered.iter().any(|(k, _)| k == "k0"), "oldest dropped");
        assert!(ledger.answered(&node(), &format!("k{}", MAX_ANSWERED + 9)));
        assert!(!ledger.answered(&node(), "k0"));
        let size = std::fs::metadata(ledger.path(&node())).unwrap().len();
        assert!(size < MAX_RECORD_BYTES, "{size}");
        // Nothing else in the directory but the record, the move and the locks.
        assert_eq!(
            files(&dir),
            [format!("{}.json", node()), format!("{}.moved", node())]
        );
    }

    /// An answer is noted on the async thread that asks (see
    /// `pipeline/order.rs`): after a move of its node as before it, it
    /// syncs nothing.
    #[test]
    fn an_answer_noted_after_a_move_is_not_synced() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = process(&dir, None);
        let now = now_ms();
        let before = fsutil::syncs_on_this_thread();
        ledger.note_moved(&node(), now).unwrap();
        assert!(fsutil::syncs_on_this_thread() > before, "a move is synced");
        let before = fsutil::syncs_on_this_thread();
        let held = ledger.lock(&node()).unwrap();
        ledger.note_answered(&held, "k", now).unwrap();
        drop(held);
        assert_eq!(
            fsutil::syncs_on_this_thread(),
            before,
            "an answer syncs nothing"
        );
        let record = ledger.read(&node());
        assert_eq!(record.moved_ms, now, "the move still counts");
        assert_eq!(record.answered, [("k".to_string(), now)]);
    }

    /// A claim is a lock of the one claims file: claiming, answering and
    /// releasing many deliveries makes no file (no inode) per delivery.
    #[test]
    fn a_claim_makes_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = process(&dir, None);
        let held = ledger.lock(&node()).unwrap();
        for i in 0..20 {
            let key = format!("k{i}");
            assert_eq!(ledger.claim(&node(), &key, true).unwrap(), Turn::Mine);
            if i % 2 == 0 {
                ledger.note_answered(&held, &key, now_ms()).unwrap();
            } else {
                ledger.release(&key);
            }
            assert_eq!(
                files(&dir),
                [".claims".to_string(), format!("{}.json", node())]
            );
        }
        assert_eq!(ledger.claims.held(), 0);
    }

    #[test]
    fn a_claim_holds_while_its_process_lives_and_an_answer_ends_it() {
        let dir = tempfile::tempdir().unwrap();
        let first = process(&dir, None);
        let second = process(&dir, None);
        let now = now_ms();
        let claim = |ledger: &Ledger, key: &str, answered_counts: bool| {
            ledger.claim(&node(), key, answered_counts).unwrap()
        };
        assert_eq!(claim(&first, "k", true), Turn::Mine);
        assert_eq!(claim(&first, "k", true), Turn::Mine, "its own again");
        assert_eq!(claim(&second, "k", true), Turn::Elsewhere);
        assert_eq!(claim(&second, "k", false), Turn::Elsewhere);
        first
            .note_answered(&first.lock(&node()).unwrap(), "k", now)
            .unwrap();
        assert_eq!(first.claims.held(), 0, "the answer ends the claim");
        assert_eq!(claim(&second, "k", true), Turn::Answered);
        assert_eq!(second.claims.held(), 0, "an answered claim is not kept");
        assert_eq!(
            claim(&second, "k", false),
            Turn::Mine,
            "sent again on purpose: new work"
        );
        second.release("k");
        assert_eq!(second.claims.held(), 0);
        assert_eq!(claim(&first, "k", false), Turn::Mine, "released");
        first.release("k");
        // A claim of a process that is gone is not honoured.
        claim(&second, "j", true);
        assert_eq!(claim(&first, "j", true), Turn::Elsewhere);
        drop(second);
        let third = process(&dir, None);
        assert_eq!(claim(&third, "j", true), Turn::Mine);
    }

    /// Two deliveries whose claims share a byte (the hash of their keys,
    /// here over a single byte) take turns, in one process as across two.
    #[test]
    fn deliveries_sharing_a_claim_byte_take_turns() {
        let dir = tempfile::tempdir().unwrap();
        let first = process(&dir, Some(1));
        let second = process(&dir, Some(1));
        let claim = |ledger: &Ledger, key: &str| ledger.claim(&node(), key, true).unwrap();
        assert_eq!(claim(&first, "a"), Turn::Mine);
        assert_eq!(claim(&first, "b"), Turn::Elsewhere, "this process's a");
        assert_eq!(claim(&second, "b"), Turn::Elsewhere, "the first's a");
        first.release("b");
        assert_eq!(claim(&second, "b"), Turn::Elsewhere, "b held nothing");
        first
            .note_answered(&first.lock(&node()).unwrap(), "a", now_ms())
            .unwrap();
        assert_eq!(claim(&second, "b"), Turn::Mine);
        assert_eq!(claim(&first, "a"), Turn::Elsewhere, "the second's b");
        second.release("b");
        assert_eq!(claim(&first, "a"), Turn::Answered);
    }

    /// Four processes take copies of 200 deliveries: each is answered once
    /// (also when their claims share a few bytes).
    fn race(offsets: Option<u64>) {
        let dir = tempfile::tempdir().unwrap();
        let answers = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                let ledger = process(&dir, offsets);
                let answers = &answers;
                s.spawn(move || {
                    for i in 0..200 {
                        // A node each: a record keeps only MAX_ANSWERED answers.
                        let node =
                            NodeUuid::parse(&format!("1be26c0b-03f2-4d2e-ae87-c02d7f33{i:04x}"))
                                .unwrap();
                        let key = format!("k{i}");
                        loop {
                            match ledger.claim(&node, &key, true).unwrap() {
                                Turn::Mine => {
                                    answers.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                    let held = ledger.lock(&node).unwrap();
                                    ledger.note_answered(&held, &key, now_ms()).unwrap();
                                    break;
                                }
                                Turn::Answered => break,
                                Turn::Elsewhere => std::thread::yield_now(),
                            }
                        }
                    }
                    assert_eq!(ledger.claims.held(), 0);
                });
            }
        });
        assert_eq!(answers.into_inner(), 200, "each delivery answered once");
    }

    #[test]
    fn processes_racing_for_copies_of_a_delivery_answer_it_once() {
        race(None);
    }

    #[test]
    fn processes_racing_for_copies_sharing_claim_bytes_answer_each_once() {
        race(Some(3));
    }

    #[test]
    fn a_parked_delivery_goes_to_another_process_once_its_own_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let first = process(&dir, None);
        let second = process(&dir, None);
        let shelf = Shelf::broker();
        first.park(&shelf, "k1", b"one").unwrap();
        first.park(&shelf, "k2", b"two").unwrap();
        first.park(&Shelf::json_rpc(6189), "k3", b"three").unwrap();
        first.unpark(&shelf, "k2");
        assert!(second.adopt_parked(&shelf).is_empty(), "its process lives");
        drop(first);
        assert_eq!(
            second.adopt_parked(&shelf),
            vec![("k1".to_string(), b"one".to_vec())]
        );
        let third = process(&dir, None);
        assert!(third.adopt_parked(&shelf).is_empty(), "taken by the second");
        assert!(
            third.adopt_parked(&Shelf::json_rpc(6190)).is_empty(),
            "another port's shelf"
        );
        assert_eq!(
            third.adopt_parked(&Shelf::json_rpc(6189)),
            vec![("k3".to_string(), b"three".to_vec())]
        );
        second.unpark(&shelf, "k1");
        drop(second);
        assert!(third.adopt_parked(&shelf).is_empty(), "answered: gone");
    }

    #[test]
    fn expired_and_foreign_records_are_ignored_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = process(&dir, None);
        let old = now_ms() - TTL.as_millis() as u64 - 1000;
        let record = Record {
            moved_ms: old,
            answered: vec![("k".into(), old)],
        };
        std::fs::write(ledger.path(&node()), serde_json::to_vec(&record).unwrap()).unwrap();
        std::fs::write(ledger.moved_path(&node()), old.to_string()).unwrap();
        assert_eq!(ledger.read(&node()), Record::default(), "past the TTL");
        let other = NodeUuid::parse("0e4c5a8e-03f2-4d2e-ae87-c02d7f33c123").unwrap();
        let big = ledger.path(&other);
        std::fs::write(&big, vec![b' '; MAX_RECORD_BYTES as usize + 1]).unwrap();
        let live = NodeUuid::parse("2f4c5a8e-03f2-4d2e-ae87-c02d7f33c124").unwrap();
        ledger.note_moved(&live, now_ms()).unwrap();
        assert_eq!(
            ledger.expire(),
            3,
            "the old record, its move, the oversized one"
        );
        assert!(!big.exists());
        assert_eq!(files(&dir), [format!("{live}.moved")], "a live move stays");
    }

    /// A record the earlier version wrote with the node's move in it: the
    /// move counts, survives answers noted since, and the clean-up moves it
    /// into the node's own move file (synced).
    #[test]
    fn a_move_recorded_by_the_earlier_version_counts_and_is_moved_out() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = process(&dir, None);
        let moved = now_ms() - 1000;
        let legacy = format!(r#"{{"moved_ms":{moved},"answered":[["a",{moved}]]}}"#);
        std::fs::write(ledger.path(&node()), legacy).unwrap();
        // A claim file of the earlier version whose process is gone.
        std::fs::create_dir(dir.path().join("l/claims")).unwrap();
        std::fs::write(dir.path().join("l/claims/k"), format!("gone 1 {}", node())).unwrap();
        assert_eq!(ledger.moved_ms(&node()), moved);
        let held = ledger.lock(&node()).unwrap();
        ledger.note_answered(&held, "b", moved + 1).unwrap();
        drop(held);
        assert_eq!(ledger.moved_ms(&node()), moved, "kept by the answer");
        let before = fsutil::syncs_on_this_thread();
        assert_eq!(ledger.expire(), 1, "the dead process's claim file");
        assert_eq!(
            fsutil::syncs_on_this_thread(),
            before + 1,
            "the move synced"
        );
        assert_eq!(ledger.moved_file_ms(&node()), moved);
        let record = read_record(&ledger.path(&node())).unwrap();
        assert_eq!(record.moved_ms, 0, "out of the record");
        assert_eq!(record.answered.len(), 2);
        assert_eq!(ledger.moved_ms(&node()), moved);
        assert!(!dir.path().join("l/claims").exists());
        assert_eq!(ledger.expire(), 0, "nothing more to do");
    }

    /// What a cache hit's ledger calls cost through the broker (the
    /// staleness check twice, the claim, the answer noted), for
    /// docs/benchmarks.md; by hand, on the file system to measure:
    /// `LEDGER_BENCH_DIR=<dir> cargo test --release --lib -- --ignored
    /// --nocapture ledger_calls_per_hit`. Prints, asserts nothing on time.
    #[test]
    #[ignore]
    fn ledger_calls_per_hit() {
        let Some(dir) = std::env::var_os("LEDGER_BENCH_DIR") else {
            return;
        };
        let dir = tempfile::tempdir_in(dir).unwrap();
        let ledger = Ledger::open(dir.path().join("l")).unwrap();
        let n = 20_000u64;
        let (cpu, wall) = (thread_cpu_us(), std::time::Instant::now());
        for i in 0..n {
            let node = NodeUuid::parse(&format!("1be26c0b-03f2-4d2e-ae87-{i:012x}")).unwrap();
            let key = format!("{i:064x}");
            assert_eq!(ledger.moved_ms(&node), 0);
            assert_eq!(ledger.claim(&node, &key, false).unwrap(), Turn::Mine);
            assert_eq!(ledger.moved_ms(&node), 0);
            let held = ledger.try_lock(&node).unwrap().unwrap();
            ledger.note_answered(&held, &key, now_ms()).unwrap();
        }
        let wall = wall.elapsed().as_micros() as f64 / n as f64;
        let cpu = (thread_cpu_us() - cpu) as f64 / n as f64;
        println!("ledger calls per hit: {cpu:.1} us of CPU, {wall:.1} us wall");
    }

    /// This thread's CPU time (user and system), in microseconds.
    fn thread_cpu_us() -> u64 {
        // SAFETY: getrusage only writes the struct passed.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
        let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        us(usage.ru_utime) + us(usage.ru_stime)
    }
}
