//! The order of a node's commands, across the processes of a host and
//! across restarts, decided from the node's ledger record
//! (`store/ledger.rs`).
//!
//! Why: a prepare can be handled long after it was issued (deferred while
//! every download slot was busy, queued while the worker was stopped) and
//! after its node moved on: Ironic timed the deploy out and cleaned up, or
//! the node reached `deploy failed`. Linking and publishing its image then
//! would answer nobody and pin the master against eviction. So a prepare
//! issued before the node's last cleanup, `deployed` or later transition is
//! refused with `stale_request`, checked when it starts and again, under
//! the node lock, just before it links; and a notification's prepare older
//! than `[notifications]max_age` (the deploy interface gave up on it) is
//! refused too. The same record keeps the deliveries answered, so that a
//! copy redelivered to any process of the host is not answered twice.

use super::{Request, Shelf, Turn, blocking};
use crate::clock::now_ms;
use crate::error::{Error, ErrorCode, Result};
use crate::node::NodeUuid;
use crate::store::ledger::{self, Ledger, Stripe};

/// The order of the nodes' commands: the host's ledger and how old a
/// notification's prepare may be (`[notifications]max_age`, seconds).
pub struct Order {
    ledger: Ledger,
    max_age: u64,
}

impl Order {
    /// Opens the ledger of `images_path` (`<images_path>/.ledger/`).
    pub(super) fn open(config: &crate::config::Config) -> Result<Order> {
        Ok(Order {
            ledger: Ledger::open(config.pxe.images_path.join(".ledger"))?,
            max_age: config.notifications.max_age,
        })
    }

    /// Removes the records past the ledger's bounds; how many (blocking).
    pub(super) fn expire(&self) -> usize {
        self.ledger.expire()
    }

    /// When `req` was issued, never later than now (a sender's clock ahead
    /// of ours must not refuse the node's later prepares).
    pub(super) fn issued_ms(req: &Request) -> u64 {
        let now = now_ms();
        req.issued_ms.map_or(now, |at| at.min(now))
    }

    /// Fails with `stale_request` when the prepare `req` of `node` was
    /// issued before the node last moved on, is a notification's prepare
    /// past `[notifications]max_age`, or is older than the ledger keeps
    /// records. Blocking: one small read.
    pub(super) fn check_not_stale(&self, node: &NodeUuid, req: &Request) -> Result<()> {
        let issued = Self::issued_ms(req);
        let age_s = now_ms().saturating_sub(issued) / 1000;
        let max_age = self.max_age;
        if req.notified && age_s > max_age {
            return Err(stale(format!(
                "the notification is {age_s} s old, more than [notifications]max_age = {max_age}"
            )));
        }
        if age_s > ledger::TTL.as_secs() {
            return Err(stale(format!(
                "the request is {age_s} s old, older than the node records kept"
            )));
        }
        let moved = self.ledger.moved_ms(node);
        if issued < moved {
            return Err(stale(format!(
                "issued {} ms before a later cleanup, deployed or transition of the node",
                moved - issued
            )));
        }
        Ok(())
    }

    /// Records that `node` moved on when `req` (a cleanup or `deployed`)
    /// was issued; called under the node lock. A failure is logged: the
    /// release itself goes on.
    pub(super) async fn note_released(&self, node: &NodeUuid, req: &Request) {
        self.note_moved(node, Self::issued_ms(req)).await;
    }

    /// A notification says `node` moved on at `at_ms` (a transition that asks
    /// for no work): its prepares issued before that are stale from now on.
    /// On a blocking thread: the move is synced.
    pub async fn note_moved(&self, node: &NodeUuid, at_ms: u64) {
        let (ledger, owned) = (self.ledger.clone(), node.clone());
        let at_ms = at_ms.min(now_ms());
        if let Err(e) = blocking(move || ledger.note_moved(&owned, at_ms)).await {
            tracing::warn!(%node, error = %e, "could not record the node's move in its ledger");
        }
    }

    /// Whether the delivery `key` of `node` was answered already, by any
    /// process of this host (within the ledger's bounds).
    pub async fn answered_before(&self, node: &NodeUuid, key: &str) -> bool {
        let (ledger, node, key) = (self.ledger.clone(), node.clone(), key.to_string());
        blocking(move || Ok(ledger.answered(&node, &key)))
            .await
            .unwrap_or(false)
    }

    /// Records that the delivery `key` of `node` was answered (after the
    /// broker confirmed the answer, before the delivery is acknowledged),
    /// which ends this process's claim on it. When it cannot be recorded
    /// (a full file system) the claim ends all the same: left held, it
    /// would make a copy delivered to another process of the host wait,
    /// unanswered, for this process's end; unrecorded, that copy is worked
    /// and answered again, and the deploy interface skips the second answer.
    pub async fn note_answered(&self, node: &NodeUuid, key: &str) {
        let owned = key.to_string();
        let noted = self
            .update(node, move |ledger, held| {
                ledger.note_answered(held, &owned, now_ms())
            })
            .await;
        if let Err(e) = noted {
            tracing::warn!(%node, error = %e, "could not record an answer in the node's ledger");
            self.ledger.release(key);
        }
    }

    /// Takes this process's turn to work on the delivery `key` of `node`
    /// (see [`ledger::Ledger::claim`]); a ledger that fails gives the turn
    /// (the work is idempotent). On this thread: a non-blocking lock (and,
    /// for a copy that may have been answered, one small read).
    pub async fn claim_delivery(&self, node: &NodeUuid, key: &str, answered_counts: bool) -> Turn {
        self.ledger.claim(node, key, answered_counts).unwrap_or_else(|e| {
            tracing::warn!(%node, error = %e, "could not claim a delivery in the node's ledger");
            Turn::Mine
        })
    }

    /// Keeps the whole delivery `key` (`bytes`, the transport's) on `shelf`
    /// until it is answered: it was accepted before its answer, so after a
    /// crash only this record can bring it back.
    pub async fn park_delivery(&self, shelf: &Shelf, key: &str, bytes: Vec<u8>) -> Result<()> {
        let (ledger, shelf, key) = (self.ledger.clone(), shelf.clone(), key.to_string());
        blocking(move || ledger.park(&shelf, &key, &bytes)).await
    }

    /// The delivery `key` parked on `shelf` was answered.
    pub async fn unpark_delivery(&self, shelf: &Shelf, key: &str) {
        let (ledger, shelf, key) = (self.ledger.clone(), shelf.clone(), key.to_string());
        let _ = blocking(move || {
            ledger.unpark(&shelf, &key);
            Ok(())
        })
        .await;
    }

    /// The deliveries parked on `shelf` by processes of the host that are
    /// gone, now this process's to run: their key and bytes.
    pub async fn adopt_parked(&self, shelf: &Shelf) -> Vec<(String, Vec<u8>)> {
        let (ledger, shelf) = (self.ledger.clone(), shelf.clone());
        blocking(move || Ok(ledger.adopt_parked(&shelf)))
            .await
            .unwrap_or_default()
    }

    /// This process stopped working on the delivery `key` of `node`
    /// without answering it (on this thread: one non-blocking unlock).
    pub async fn release_delivery(&self, _node: &NodeUuid, key: &str) {
        self.ledger.release(key);
    }

    /// Runs `update` on `node`'s answers under the node's stripe lock: on
    /// this thread when the lock is free now (the usual case), else on a
    /// blocking thread that waits for it. Why: the update is a few calls on
    /// a small file that is never synced (`Ledger::note_answered`), and a
    /// hop to the blocking pool for each cache hit cost more of the
    /// worker's CPU than the calls themselves (docs/benchmarks.md, "Cache
    /// hits"). A move, which syncs, never runs here.
    async fn update<T: Send + 'static>(
        &self,
        node: &NodeUuid,
        update: impl FnOnce(&Ledger, &Stripe) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        if let Some(held) = self.ledger.try_lock(node)? {
            return update(&self.ledger, &held);
        }
        let (ledger, node) = (self.ledger.clone(), node.clone());
        blocking(move || update(&ledger, &ledger.lock(&node)?)).await
    }
}

fn stale(message: String) -> Error {
    Error::new(ErrorCode::StaleRequest, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn node() -> NodeUuid {
        NodeUuid::parse("1be26c0b-03f2-4d2e-ae87-c02d7f33c123").unwrap()
    }

    /// The order kept in the ledger `l` of `dir`.
    fn order_in(dir: &tempfile::TempDir) -> Order {
        Order {
            ledger: Ledger::open(dir.path().join("l")).unwrap(),
            max_age: 60,
        }
    }

    /// An answer noted right after a move of its node runs on the async
    /// thread that asks (its stripe is free) and syncs nothing there: the
    /// move, synced, was written on a blocking thread.
    #[tokio::test(flavor = "current_thread")]
    async fn an_answer_after_a_move_syncs_nothing_on_the_async_thread() {
        let dir = tempfile::tempdir().unwrap();
        let order = order_in(&dir);
        order.note_moved(&node(), now_ms()).await;
        assert_eq!(order.claim_delivery(&node(), "k", false).await, Turn::Mine);
        let before = crate::fsutil::syncs_on_this_thread();
        order.note_answered(&node(), "k").await;
        assert_eq!(crate::fsutil::syncs_on_this_thread(), before);
        assert!(order.ledger.answered(&node(), "k"), "noted");
        assert!(order.ledger.moved_ms(&node()) > 0, "the move stays");
    }

    /// An answer that cannot be recorded (here its record's name is taken
    /// by a directory; in the soak, a full file system) still ends the
    /// claim: a copy delivered to another process of the host is worked,
    /// not left waiting for this process's end.
    #[tokio::test(flavor = "current_thread")]
    async fn an_answer_not_recorded_still_ends_its_claim() {
        let dir = tempfile::tempdir().unwrap();
        let order = order_in(&dir);
        let other = Ledger::open(dir.path().join("l")).unwrap();
        std::fs::create_dir(dir.path().join(format!("l/{}.json", node()))).unwrap();
        assert_eq!(order.claim_delivery(&node(), "k", false).await, Turn::Mine);
        order.note_answered(&node(), "k").await;
        assert!(!order.ledger.answered(&node(), "k"), "not recorded");
        assert_eq!(other.claim(&node(), "k", true).unwrap(), Turn::Mine);
    }

    /// An update whose stripe another process holds waits for it on a
    /// blocking thread (the only async thread stays free) and then runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn an_update_waits_for_a_stripe_held_elsewhere_off_the_async_threads() {
        let dir = tempfile::tempdir().unwrap();
        let order = order_in(&dir);
        // Another process of the host over the same ledger.
        let other = Ledger::open(dir.path().join("l")).unwrap();
        assert_eq!(order.claim_delivery(&node(), "k", true).await, Turn::Mine);
        let held = other.lock(&node()).unwrap();
        assert!(order.ledger.try_lock(&node()).unwrap().is_none());
        let order = std::sync::Arc::new(order);
        let o = order.clone();
        let answer = tokio::spawn(async move { o.note_answered(&node(), "k").await });
        // Waited for on this thread, not the runtime's: its one async
        // thread may be the one blocked.
        std::thread::sleep(Duration::from_millis(200));
        let (tx, rx) = std::sync::mpsc::channel();
        tokio::spawn(async move { tx.send(()) });
        let probe = rx.recv_timeout(Duration::from_secs(1));
        let waited = !answer.is_finished();
        drop(held);
        assert!(waited, "the answer waits for the stripe");
        assert!(probe.is_ok(), "the async thread runs other tasks meanwhile");
        tokio::time::timeout(Duration::from_secs(5), answer)
            .await
            .expect("the answer is noted once the stripe is free")
            .unwrap();
        assert_eq!(
            order.claim_delivery(&node(), "k", true).await,
            Turn::Answered
        );
        assert!(order.answered_before(&node(), "k").await);
    }
}
