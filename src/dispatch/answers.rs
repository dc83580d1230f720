//! The answers given lately and the requests under way, by action, node
//! and `request_id`, in this process's memory.
//!
//! Why: the deploy interface may send one request on either transport (a
//! retry after a failover), and the JSON-RPC caller asks for an answer it
//! did not wait for (`status`). A request whose answer is remembered is
//! answered again with it instead of being worked again, unless both copies
//! came through the broker: there the delivery identity and the node's
//! ledger decide (a command sent again on purpose is worked again).
//! Bounded: at most [`MAX_KEPT`] answers, each for at most [`KEPT_FOR`].

use super::Transport;
use crate::messages::{Action, Completion, Request};
use crate::node::NodeUuid;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How long an answer is remembered.
pub(crate) const KEPT_FOR: Duration = Duration::from_secs(3600);

/// How many answers are remembered at most (the oldest go first).
pub(crate) const MAX_KEPT: usize = 4096;

/// What identifies one request across transports: its action, its node
/// (a warm's: its image source; both as its FIFO queue's key, see
/// `order_key`) and its `request_id`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct AnswerKey {
    action: Action,
    node: String,
    request_id: String,
}

impl AnswerKey {
    /// The key of `request`; `None` without a `request_id` (nothing
    /// identifies it across deliveries then).
    pub(crate) fn of(request: &Request) -> Option<AnswerKey> {
        let id = request.request_id.as_deref().filter(|r| !r.is_empty())?;
        Some(AnswerKey {
            action: request.action,
            node: super::order_key(request),
            request_id: id.to_string(),
        })
    }

    /// The key as a name a file may carry: the hex SHA-256 of its parts.
    pub(crate) fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let text = format!(
            "{}\n{}\n{}",
            self.action.as_str(),
            self.node,
            self.request_id
        );
        hex::encode(Sha256::digest(text.as_bytes()))
    }
}

/// What is known of a request.
#[derive(Debug, Clone)]
pub(crate) enum Lookup {
    /// Answered: the answer.
    Done(Arc<Completion>),
    /// Queued or running here.
    InProgress,
    /// Neither (never seen, or forgotten).
    Unknown,
}

/// One request's record.
struct Entry {
    /// Jobs of this key queued or running.
    running: usize,
    /// Its answer, when given, and the transport it was worked for.
    done: Option<(Arc<Completion>, Transport)>,
    /// When it last changed.
    at: Instant,
    /// Order of the last change (the latest of a node wins `status`).
    seq: u64,
    /// Woken when an answer is recorded.
    notify: Arc<Notify>,
}

/// The answers given lately and the requests under way.
#[derive(Default)]
pub(crate) struct Answers {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<AnswerKey, Entry>,
    seq: u64,
}

impl Inner {
    fn touch(&mut self, key: &AnswerKey) -> &mut Entry {
        self.seq += 1;
        let seq = self.seq;
        let entry = self.entries.entry(key.clone()).or_insert_with(|| Entry {
            running: 0,
            done: None,
            at: Instant::now(),
            seq,
            notify: Arc::default(),
        });
        entry.at = Instant::now();
        entry.seq = seq;
        entry
    }

    /// Forgets answers past [`KEPT_FOR`], then the oldest answers beyond
    /// three quarters of [`MAX_KEPT`]; never a request under way.
    fn prune(&mut self) {
        if self.entries.len() <= MAX_KEPT {
            return;
        }
        self.entries
            .retain(|_, e| e.running > 0 || e.at.elapsed() < KEPT_FOR);
        let keep = MAX_KEPT * 3 / 4;
        if self.entries.len() > keep {
            let mut seqs: Vec<u64> = self
                .entries
                .values()
                .filter(|e| e.running == 0)
                .map(|e| e.seq)
                .collect();
            seqs.sort_unstable();
            let excess = self.entries.len() - keep;
            if let Some(&cut) = seqs.get(excess.min(seqs.len()).saturating_sub(1)) {
                self.entries.retain(|_, e| e.running > 0 || e.seq > cut);
            }
        }
    }
}

impl Answers {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A job of `key` was queued.
    pub(crate) fn begin(&self, key: AnswerKey) {
        let mut inner = self.inner();
        inner.touch(&key).running += 1;
        inner.prune();
    }

    /// A job of `key` ended, with `answer` (worked for that transport) or
    /// without one (taken back, not for this worker).
    pub(crate) fn end(&self, key: Option<&AnswerKey>, answer: Option<(&Completion, Transport)>) {
        let Some(key) = key else { return };
        let mut inner = self.inner();
        let entry = inner.touch(key);
        entry.running = entry.running.saturating_sub(1);
        if let Some((done, transport)) = answer {
            entry.done = Some((Arc::new(done.clone()), transport));
            entry.notify.notify_waiters();
        }
        if entry.running == 0 && entry.done.is_none() {
            // A caller waiting for it learns it ended unanswered.
            entry.notify.notify_waiters();
            inner.entries.remove(key);
        }
    }

    /// The answer of `key` to give a request that came by `transport`
    /// instead of working it again; none when both came through the
    /// broker (its own redelivery rules decide there).
    pub(crate) fn done(&self, key: &AnswerKey, transport: Transport) -> Option<Arc<Completion>> {
        let inner = self.inner();
        let (done, by) = inner.entries.get(key)?.done.as_ref()?;
        let both_amqp = *by == Transport::Amqp && transport == Transport::Amqp;
        (!both_amqp && fresh(inner.entries.get(key)?)).then(|| done.clone())
    }

    /// What is known of `key`, and what to wait on for its answer.
    pub(crate) fn lookup(&self, key: &AnswerKey) -> (Lookup, Option<Arc<Notify>>) {
        let inner = self.inner();
        match inner.entries.get(key) {
            Some(e) => (state(e), Some(e.notify.clone())),
            None => (Lookup::Unknown, None),
        }
    }

    /// The latest request of `node` (with `request_id`, when given) and
    /// what is known of it.
    pub(crate) fn status(&self, node: &NodeUuid, request_id: Option<&str>) -> Lookup {
        let inner = self.inner();
        inner
            .entries
            .iter()
            .filter(|(k, _)| {
                k.node == node.as_str() && request_id.is_none_or(|r| k.request_id == r)
            })
            .max_by_key(|(_, e)| e.seq)
            .map_or(Lookup::Unknown, |(_, e)| state(e))
    }
}

fn fresh(e: &Entry) -> bool {
    e.at.elapsed() < KEPT_FOR
}

fn state(e: &Entry) -> Lookup {
    match &e.done {
        Some((done, _)) if fresh(e) => Lookup::Done(done.clone()),
        _ if e.running > 0 => Lookup::InProgress,
        _ => Lookup::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(action: Action, node: &str, id: &str) -> Request {
        let body = serde_json::json!({
            "action": action.as_str(), "node_uuid": node, "request_id": id,
            "instance_info": {"image_source": "http://x/y"},
        });
        match crate::messages::inbound::parse_command(body.to_string().as_bytes(), "h") {
            crate::messages::inbound::Inbound::Work(r) => *r,
            other => panic!("{other:?}"),
        }
    }

    const NODE: &str = "1be26c0b-03f2-4d2e-ae87-c02d7f33c123";

    fn node() -> NodeUuid {
        NodeUuid::parse(NODE).unwrap()
    }

    /// The keys' digests name the JSON-RPC casts kept on disk across
    /// restarts and upgrades: a node's key is its canonical UUID (however
    /// the request spelt it), a warm's its image source.
    #[test]
    fn the_digest_of_a_fixed_request_never_changes() {
        let prepare = "a007275e6a6d6eb8f08a7baafe47c5d827c04e8604d3ceaeaeeb9808df430f69";
        for node in [NODE.to_string(), NODE.to_uppercase()] {
            let key = AnswerKey::of(&request(Action::Prepare, &node, "r1")).unwrap();
            assert_eq!(key.digest(), prepare, "{node}");
        }
        let warm = serde_json::json!({"action": "warm", "request_id": "w1",
            "instance_info": {"image_source": " http://x/y "}});
        let warm = match crate::messages::inbound::parse_command(warm.to_string().as_bytes(), "h") {
            crate::messages::inbound::Inbound::Work(r) => *r,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            AnswerKey::of(&warm).unwrap().digest(),
            "d4b95bede686eb25d5076d4bdbb0e52904befbd332473bbdbe0172d69f45543d"
        );
    }

    #[test]
    fn an_answer_is_given_again_unless_both_came_by_the_broker() {
        let answers = Answers::default();
        let r = request(Action::Prepare, NODE, "r1");
        let key = AnswerKey::of(&r).unwrap();
        answers.begin(key.clone());
        assert!(matches!(
            answers.status(&node(), Some("r1")),
            Lookup::InProgress
        ));
        let done = Completion::new(Action::Prepare, Some(NODE.into()), Some("r1".into()), "h");
        answers.end(Some(&key), Some((&done, Transport::Amqp)));
        assert!(answers.done(&key, Transport::JsonRpc).is_some());
        assert!(answers.done(&key, Transport::Amqp).is_none());
        assert!(matches!(answers.status(&node(), None), Lookup::Done(_)));
        assert!(matches!(
            answers.status(&node(), Some("other")),
            Lookup::Unknown
        ));
        let other = request(Action::Cleanup, NODE, "r1");
        assert!(
            answers
                .done(&AnswerKey::of(&other).unwrap(), Transport::JsonRpc)
                .is_none(),
            "another action is another request"
        );
    }

    #[test]
    fn a_job_ended_without_answer_is_forgotten_and_the_memory_is_bounded() {
        let answers = Answers::default();
        let key = AnswerKey::of(&request(Action::Prepare, NODE, "gone")).unwrap();
        answers.begin(key.clone());
        answers.end(Some(&key), None);
        assert!(matches!(answers.lookup(&key).0, Lookup::Unknown));
        for i in 0..(MAX_KEPT + 10) {
            let key = AnswerKey::of(&request(Action::Prepare, NODE, &format!("r{i}"))).unwrap();
            answers.begin(key.clone());
            let done = Completion::new(Action::Prepare, None, None, "h");
            answers.end(Some(&key), Some((&done, Transport::JsonRpc)));
        }
        assert!(answers.inner().entries.len() <= MAX_KEPT);
        assert!(matches!(
            answers.status(&node(), Some(&format!("r{}", MAX_KEPT + 9))),
            Lookup::Done(_)
        ));
    }
}
