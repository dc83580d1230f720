//! The per-node command ledger: a small record per node, on disk, shared by
//! every worker process of the host and kept across restarts.
//!
//! Why it exists: the broker delivers a command again after a crash or a
//! lost acknowledgement, possibly to another process of the same host, and
//! a deferred prepare can come back after a later cleanup of its node. What
//! one process remembers in memory does not help the next one, so four
//! facts about each node are kept here:
//!
//! * when the node last *moved on* (a cleanup, a `deployed`, a notification
//!   of a later provision-state transition), so that a prepare older than
//!   that is refused instead of linking files for a deploy that is over;
//! * which deliveries were answered recently, so that a copy redelivered to
//!   any process is acknowledged without a second answer;
//! * which deliveries are being worked on, and by which process (a
//!   *claim*, made when the work starts), so that a copy redelivered to
//!   another process while the first still runs it waits for that answer
//!   instead of being worked and answered a second time. A process is
//!   alive while it holds the `flock` on its token's file in
//!   `.ledger/.owners/` ([`TempOwner`]): a claim of a process that died is
//!   not honoured. A claim is a small file of its own
//!   (`.ledger/claims/<key>`), created and removed, never synced: it counts
//!   only while its process lives, which a crash of the host ends anyway;
//! * the work accepted before its answer (a prepare moved to the slow lane
//!   and acknowledged to the broker, a JSON-RPC cast): nobody else holds a
//!   copy of it, so each is kept whole (opaque bytes the transport writes)
//!   on its transport's [`Shelf`], `.ledger/accepted/<key>.<owner>` or
//!   `.ledger/accepted-json-rpc-<port>/<key>.<owner>`, until answered, and
//!   a process finds those of a process that died and runs them again
//!   ([`Ledger::adopt_parked`]).
//!
//! `<images_path>/.ledger/<node>.json`, replaced atomically (temporary and
//! rename) under a short `flock` of the node's stripe (`.ledger/.locks/<n>`,
//! one of [`LOCK_STRIPES`], held for one read and one write, so the updates
//! of different nodes run side by side). A record that holds a move is
//! synced before it counts (the move must survive a crash of the host); one
//! that holds only answers is not: after a crash of the host only the copies
//! answered in the instant before their acknowledgement come back, and the
//! sync cost a cache hit most of its time. Bounded: at most
//! [`MAX_ANSWERED`] answers per node, a record past [`TTL`] is ignored and
//! removed by [`Ledger::expire`], a file
//! larger than [`MAX_RECORD_BYTES`] is not read. It outlives the node's
//! files on purpose: a cleanup of a node with nothing to remove is exactly
//! what must be remembered.

use crate::error::{Error, Result};
use crate::fsutil::{self, TempOwner};
use crate::node::NodeUuid;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// The directory of the claims, a file per delivery key.
const CLAIMS_DIR: &str = "claims";

/// How many lock files the nodes' records are spread over.
pub const LOCK_STRIPES: u8 = 64;

/// Temporaries left by a writer that died are removed after this long.
const STALE_TEMP_AFTER: Duration = Duration::from_secs(3600);

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What is known of one node.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// When the node last moved on (ms since the epoch; 0: never).
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
        let ttl = TTL.as_millis() as u64;
        let alive = |at: u64| at.saturating_add(ttl) >= now;
        if !alive(self.moved_ms) {
            self.moved_ms = 0;
        }
        self.answered.retain(|(_, at)| alive(*at));
        let excess = self.answered.len().saturating_sub(MAX_ANSWERED);
        self.answered.drain(..excess);
    }
}

/// A node's stripe lock, held until dropped: what an update of the node's
/// record or of its deliveries' claims is made under ([`Ledger::lock`],
/// [`Ledger::try_lock`]), so that no update of another process is lost.
pub struct Stripe {
    _file: File,
    node: NodeUuid,
}

/// The ledger directory of one host.
#[derive(Clone)]
pub struct Ledger {
    dir: PathBuf,
    /// This process, as its claims name it.
    owner: Arc<TempOwner>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("dir", &self.dir).finish()
    }
}

impl Ledger {
    /// The ledger in `dir` (created 0755).
    pub fn open(dir: PathBuf) -> Result<Ledger> {
        fsutil::ensure_dir(&dir)?;
        let owner = Arc::new(TempOwner::new(dir.join(".owners")));
        Ok(Ledger { dir, owner })
    }

    fn path(&self, node: &NodeUuid) -> PathBuf {
        self.dir.join(format!("{node}.json"))
    }

    /// The node's record as it stands (empty when there is none, it is
    /// unreadable or past its TTL). Blocking: one small read.
    pub fn read(&self, node: &NodeUuid) -> Record {
        let mut record = read_record(&self.path(node)).unwrap_or_default();
        record.trim(now_ms());
        record
    }

    /// The node moved on at `at_ms` (kept if later than what is recorded).
    pub fn note_moved(&self, node: &NodeUuid, at_ms: u64) -> Result<()> {
        let _lock = self.lock(node)?;
        self.update(node, |r| r.moved_ms = r.moved_ms.max(at_ms))
    }

    /// The delivery `key` of the node `held` locks was answered at `at_ms`.
    pub fn note_answered(&self, held: &Stripe, key: &str, at_ms: u64) -> Result<()> {
        if !is_file_name(key) {
            return Ok(());
        }
        self.update(&held.node, |r| {
            r.answered.retain(|(k, _)| k != key);
            r.answered.push((key.to_string(), at_ms));
        })?;
        self.drop_claim(key);
        Ok(())
    }

    /// Takes the turn to work on the delivery `key` of the node `held`
    /// locks at `at_ms`:
    /// [`Turn::Elsewhere`] while another process that is alive claims it,
    /// [`Turn::Answered`] when it was answered (looked at only when
    /// `answered_counts`: a command its sender publishes again is new
    /// work), else it is claimed for this process. A key too long to record
    /// is this process's without a claim.
    pub fn claim(
        &self,
        held: &Stripe,
        key: &str,
        at_ms: u64,
        answered_counts: bool,
    ) -> Result<Turn> {
        if !is_file_name(key) {
            return Ok(Turn::Mine);
        }
        self.owner.register()?;
        let node = &held.node;
        if answered_counts && self.read(node).answered.iter().any(|(k, _)| k == key) {
            return Ok(Turn::Answered);
        }
        let path = self.dir.join(CLAIMS_DIR).join(key);
        let elsewhere = read_claim(&path)
            .is_some_and(|owner| owner != self.owner.token() && self.owner.is_alive(&owner));
        if elsewhere {
            return Ok(Turn::Elsewhere);
        }
        let body = format!("{} {at_ms} {node}", self.owner.token());
        making_dir(&self.dir.join(CLAIMS_DIR), "write a ledger claim", || {
            std::fs::write(&path, &body)
        })?;
        Ok(Turn::Mine)
    }

    /// This process no longer works on the delivery `key` of the node
    /// `held` locks without having answered it (taken back, needing no
    /// answer).
    pub fn release(&self, _held: &Stripe, key: &str) {
        if is_file_name(key) {
            self.drop_claim(key);
        }
    }

    /// Removes this process's claim on `key`, if it holds one (called under
    /// the node's lock).
    fn drop_claim(&self, key: &str) {
        let path = self.dir.join(CLAIMS_DIR).join(key);
        if read_claim(&path).is_some_and(|owner| owner == self.owner.token()) {
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Reads, changes and writes back the node's record; the caller holds
    /// the node's lock, so no update of another process is lost. Synced
    /// when the record holds a move (see the module's documentation).
    fn update(&self, node: &NodeUuid, change: impl FnOnce(&mut Record)) -> Result<()> {
        let path = self.path(node);
        let mut record = read_record(&path).unwrap_or_default();
        change(&mut record);
        record.trim(now_ms());
        let body = serde_json::to_vec(&record).unwrap_or_default();
        let temp = fsutil::temp_path(&path);
        if record.moved_ms != 0 {
            fsutil::write_file_atomically(&path, &temp, &body, 0o644)
        } else {
            fsutil::write_file_unsynced(&path, &temp, &body, 0o644)
        }
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

    /// Removes records past their TTL, claims of processes that are gone
    /// and temporaries of writers that died; returns how many files went.
    /// Blocking.
    pub fn expire(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let now = now_ms();
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let gone = if name.starts_with(fsutil::TEMP_PREFIX) {
                is_older_than(&path, STALE_TEMP_AFTER) && std::fs::remove_file(&path).is_ok()
            } else if let Some(stem) = name.strip_suffix(".json") {
                // A name that is no node's is nobody's to update: no lock.
                let _lock = match NodeUuid::parse(stem).map(|node| self.lock(&node)) {
                    Ok(Err(_)) => continue,
                    Ok(Ok(lock)) => Some(lock),
                    Err(_) => None,
                };
                read_record(&path)
                    .is_none_or(|r| r.newest().saturating_add(TTL.as_millis() as u64) < now)
                    && std::fs::remove_file(&path).is_ok()
            } else {
                false
            };
            removed += usize::from(gone);
        }
        removed += self.expire_claims();
        self.owner.remove_dead_owners();
        removed + self.expire_parked()
    }

    /// Removes the claims of processes that are gone (each under its node's
    /// lock, so a claim just made in their place stays).
    fn expire_claims(&self) -> usize {
        let dir = self.dir.join(CLAIMS_DIR);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(claim) = read_claim_line(&path) else {
                continue;
            };
            let Some(node) = claim
                .split(' ')
                .nth(2)
                .and_then(|n| NodeUuid::parse(n).ok())
            else {
                removed += usize::from(std::fs::remove_file(&path).is_ok());
                continue;
            };
            let Ok(_lock) = self.lock(&node) else {
                continue;
            };
            let dead = read_claim(&path).is_some_and(|owner| !self.owner.is_alive(&owner));
            removed += usize::from(dead && std::fs::remove_file(&path).is_ok());
        }
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

/// A claim file's line, `<owner> <at_ms> <node>`; `None` when there is none.
fn read_claim_line(path: &Path) -> Option<String> {
    let file = File::open(path).ok()?;
    let mut line = String::new();
    file.take(256).read_to_string(&mut line).ok()?;
    Some(line)
}

/// The owner of the claim in `path`, if there is one.
fn read_claim(path: &Path) -> Option<String> {
    read_claim_line(path)?.split(' ').next().map(str::to_string)
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

    fn claims(dir: &tempfile::TempDir) -> usize {
        std::fs::read_dir(dir.path().join("l").join(CLAIMS_DIR)).map_or(0, |d| d.count())
    }

    #[test]
    fn records_moves_and_answers_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path().join("l")).unwrap();
        let other = Ledger::open(dir.path().join("l")).unwrap();
        assert_eq!(ledger.read(&node()), Record::default());
        let now = now_ms();
        ledger.note_moved(&node(), now).unwrap();
        ledger.note_moved(&node(), now - 5).unwrap();
        assert_eq!(other.read(&node()).moved_ms, now, "the latest move is kept");
        for i in 0..(MAX_ANSWERED + 10) {
            let held = other.lock(&node()).unwrap();
            other.note_answered(&held, &format!("k{i}"), now).unwrap();
        }
        let r = ledger.read(&node());
        assert_eq!(r.answered.len(), MAX_ANSWERED);
        assert_eq!(
            r.answered.last().unwrap().0,
            format!("k{}", MAX_ANSWERED + 9)
        );
        assert!(!r.answered.iter().any(|(k, _)| k == "k0"), "oldest dropped");
        let size = std::fs::metadata(ledger.path(&node())).unwrap().len();
        assert!(size < MAX_RECORD_BYTES, "{size}");
        // Nothing else in the directory but the record and the locks.
        let mut names: Vec<_> = std::fs::read_dir(dir.path().join("l"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [".locks".to_string(), format!("{}.json", node())]);
    }

    #[test]
    fn a_claim_holds_while_its_process_lives_and_an_answer_ends_it() {
        let dir = tempfile::tempdir().unwrap();
        let first = Ledger::open(dir.path().join("l")).unwrap();
        // Another process: another owner over the same directory.
        let second = Ledger::open(dir.path().join("l")).unwrap();
        let now = now_ms();
        let claim = |ledger: &Ledger, key: &str, answered_counts: bool| {
            let held = ledger.lock(&node()).unwrap();
            ledger.claim(&held, key, now, answered_counts).unwrap()
        };
        assert_eq!(claim(&first, "k", true), Turn::Mine);
        assert_eq!(claim(&first, "k", true), Turn::Mine, "its own again");
        assert_eq!(claim(&second, "k", true), Turn::Elsewhere);
        first
            .note_answered(&first.lock(&node()).unwrap(), "k", now)
            .unwrap();
        assert_eq!(claims(&dir), 0, "the answer ends the claim");
        assert_eq!(claim(&second, "k", true), Turn::Answered);
        assert_eq!(
            claim(&second, "k", false),
            Turn::Mine,
            "sent again on purpose: new work"
        );
        second.release(&second.lock(&node()).unwrap(), "k");
        assert_eq!(claims(&dir), 0);
        // A claim of a process that is gone is not honoured.
        claim(&second, "j", true);
        drop(second);
        let third = Ledger::open(dir.path().join("l")).unwrap();
        assert_eq!(claim(&third, "j", true), Turn::Mine);
    }

    #[test]
    fn processes_racing_for_copies_of_a_delivery_answer_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l");
        let answers = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                let ledger = Ledger::open(path.clone()).unwrap();
                let answers = &answers;
                s.spawn(move || {
                    for i in 0..200 {
                        // A node each: a record keeps only MAX_ANSWERED answers.
                        let node =
                            NodeUuid::parse(&format!("1be26c0b-03f2-4d2e-ae87-c02d7f33{i:04x}"))
                                .unwrap();
                        let key = format!("k{i}");
                        loop {
                            let held = ledger.lock(&node).unwrap();
                            match ledger.claim(&held, &key, now_ms(), true).unwrap() {
                                Turn::Mine => {
                                    drop(held);
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
                });
            }
        });
        assert_eq!(answers.into_inner(), 200, "each delivery answered once");
        assert_eq!(claims(&dir), 0);
    }

    #[test]
    fn a_parked_delivery_goes_to_another_process_once_its_own_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let first = Ledger::open(dir.path().join("l")).unwrap();
        let second = Ledger::open(dir.path().join("l")).unwrap();
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
        let third = Ledger::open(dir.path().join("l")).unwrap();
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
        let ledger = Ledger::open(dir.path().join("l")).unwrap();
        let old = now_ms() - TTL.as_millis() as u64 - 1000;
        let record = Record {
            moved_ms: old,
            answered: vec![("k".into(), old)],
        };
        std::fs::write(ledger.path(&node()), serde_json::to_vec(&record).unwrap()).unwrap();
        assert_eq!(ledger.read(&node()), Record::default(), "past the TTL");
        let big = dir
            .path()
            .join("l/0e4c5a8e-03f2-4d2e-ae87-c02d7f33c123.json");
        std::fs::write(&big, vec![b' '; MAX_RECORD_BYTES as usize + 1]).unwrap();
        ledger.note_moved(&node(), now_ms()).unwrap();
        assert_eq!(ledger.expire(), 1, "only the oversized one goes");
        assert!(!big.exists());
        assert!(ledger.path(&node()).exists(), "a live record stays");
    }
}
