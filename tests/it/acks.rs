//! Acknowledgements against the broker's consumer timeout and a command's
//! deadline. The consumer-timeout scenarios run against a RabbitMQ node of
//! their own (a node name, ports, cookie and data under a temporary
//! directory; `consumer_timeout` 4 s, checked every second), stopped at the
//! end; the default node on 5672 is never touched. The deadline test uses
//! the default node.

use crate::common;

use common::rabbit;
use common::*;
use lapin::options::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The node's consumer timeout (ms).
const CONSUMER_TIMEOUT_MS: u64 = 4000;
const MINUTE: Duration = Duration::from_secs(60);

/// One RabbitMQ node of this test's own, its files in `_dir`.
struct Node {
    node: rabbit::OwnNode,
    _dir: tempfile::TempDir,
}

impl Node {
    /// Starts node `tag` (its name: `iiw<tag><pid>@localhost`).
    fn start(tag: &str) -> Node {
        let dir = tempfile::Builder::new()
            .prefix("iiw-acks-")
            .tempdir()
            .unwrap();
        let home = dir.path();
        rabbit::write_cookie(home, "IIWACKSTESTCOOKIE");
        let name = format!("iiw{tag}{}@localhost", std::process::id());
        let conf = format!("consumer_timeout = {CONSUMER_TIMEOUT_MS}\n");
        let ports = (free_port(), free_port());
        let mut node = rabbit::OwnNode::new(home, home, &name, ports, &conf);
        node.start();
        Node { node, _dir: dir }
    }

    fn url(&self) -> String {
        self.node.url()
    }

    /// Closes, from the broker's side, the connections named after the
    /// worker of `host`.
    fn close_worker_connections(&self, host: &str) {
        let listing = self.node.ctl(&[
            "-q",
            "list_connections",
            "--no-table-headers",
            "pid",
            "client_properties",
        ]);
        let mut closed = 0;
        for line in listing.lines() {
            if line.contains(&format!("ironic-image-worker@{host}")) {
                let pid = line.split('\t').next().unwrap().trim();
                self.node
                    .ctl(&["close_connection", pid, "closed by the test"]);
                closed += 1;
            }
        }
        assert_eq!(closed, 1, "one worker connection: {listing}");
    }
}

/// The worker's reconnections so far.
async fn reconnects(worker: &Worker) -> f64 {
    let text = worker.metrics_text().await;
    metric(&text, "ironic_image_worker_amqp_reconnects_total").unwrap_or(0.0)
}

/// Each of `sent` answered exactly once, successfully.
fn answered_once(answers: &HashMap<String, Vec<serde_json::Value>>, sent: &[String]) {
    for corr in sent {
        let got = answers.get(corr).map_or(&[][..], |v| v.as_slice());
        assert_eq!(got.len(), 1, "{corr} answered once: {got:?}");
        assert_eq!(got[0]["status"], "success", "{:?}", got[0]);
    }
}

/// A worker on `node`, with `extra` TOML lines in `[amqp]`.
fn env_on(node: &Node, extra: &str) -> Env {
    Env::new(&format!(
        "[amqp]\nurl = \"{}\"\nheartbeat = 5\n{extra}",
        node.url()
    ))
}

/// A source serving `name` (1600 KiB) at 100 KiB/s: about 16 s, four
/// times the node's consumer timeout.
async fn slow_source(env: &Env, name: &str) -> FaultServer {
    let dir = env.root().join("src");
    random_file(&dir.join(name), 1600 << 10, 171);
    FaultServer::start(&dir, 100 << 10).await
}

/// Waits until the prepare of `slow/slow.img` holds its download slot (its
/// download has begun). Commands of two nodes start in no set order (the
/// later one may take the slot first), so the tests that need the slot
/// taken send their second prepare only then.
async fn slot_taken(faults: &FaultServer) {
    let started = Instant::now();
    while faults.count("slow", "slow.img") == 0 {
        assert!(started.elapsed() < MINUTE, "the slow prepare starts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A node of this test's own, `tag` naming it.
fn own_node(tag: &'static str) -> Node {
    tokio::task::block_in_place(|| Node::start(tag))
}

/// The worker does not know the broker's consumer timeout (its own
/// default is 30 min): one channel close teaches it, the redelivered copy
/// is adopted and acknowledged early, no second close follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_brokers_consumer_timeout_is_learned() {
    let node = own_node("learn");
    {
        let env = env_on(&node, "");
        let faults = slow_source(&env, "slow.img").await;
        let worker = env.serve().await;
        let client = Broker::connect_to(&node.url()).await;
        let cmd = prepare_cmd(&common::node(), &faults.url("slow", "slow.img"));
        let sent = [client.send(&env.host, &cmd, None).await];
        let answers = client
            .answers(&sent, 2 * MINUTE, Duration::from_secs(3))
            .await;
        answered_once(&answers, &sent);
        assert_eq!(faults.count("slow", "slow.img"), 1, "downloaded once");
        let closes = reconnects(&worker).await;
        assert!(
            closes <= 1.0,
            "the broker closed the channel {closes} times"
        );
    }
}

/// A cleanup queued behind its node's slow prepare: its delivery is
/// acknowledged early too (counted from its delivery, not from when it
/// runs), so the broker never closes the channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_work_is_acknowledged_early() {
    let node = own_node("queued");
    {
        let env = env_on(
            &node,
            &format!("consumer_timeout = {}\n", CONSUMER_TIMEOUT_MS / 1000),
        );
        let faults = slow_source(&env, "slow.img").await;
        let worker = env.serve().await;
        let client = Broker::connect_to(&node.url()).await;
        let n = common::node();
        let prepare = prepare_cmd(&n, &faults.url("slow", "slow.img"));
        let cleanup = serde_json::json!({"action": "cleanup", "node_uuid": n, "request_id": "c1"});
        let sent = [
            client.send(&env.host, &prepare, None).await,
            client.send(&env.host, &cleanup, None).await,
        ];
        let answers = client
            .answers(&sent, 2 * MINUTE, Duration::from_secs(3))
            .await;
        answered_once(&answers, &sent);
        assert_eq!(
            reconnects(&worker).await,
            0.0,
            "the broker never closed the channel"
        );
    }
}

/// A prepare waiting for a download slot when the connection is lost: set
/// aside already (recorded, its delivery acknowledged), so no copy of it
/// goes to another consumer; it is answered once, through the new
/// connection, which stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_prepare_outlives_a_lost_connection() {
    let node = own_node("defer");
    let env = env_on(
        &node,
        &format!(
            "consumer_timeout = {}\nprefetch = 2\n",
            CONSUMER_TIMEOUT_MS / 1000
        ),
    );
    let faults = slow_source(&env, "slow.img").await;
    std::fs::write(env.root().join("src/fast.img"), b"fast image bytes").unwrap();
    let worker = env.serve().await;
    let client = Broker::connect_to(&node.url()).await;
    // One download slot (prefetch 2): the slow prepare holds it, the other
    // one waits and is set aside after 2 s.
    let slow = prepare_cmd(&common::node(), &faults.url("slow", "slow.img"));
    let fast = prepare_cmd(&common::node(), &faults.url("fast", "fast.img"));
    let first = client.send(&env.host, &slow, None).await;
    slot_taken(&faults).await;
    let sent = [first, client.send(&env.host, &fast, None).await];
    let accepted = env.images_dir().join(".ledger/accepted");
    let started = Instant::now();
    while list_visible(&accepted).is_empty() {
        assert!(
            started.elapsed() < MINUTE,
            "the waiting prepare is set aside"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Another consumer takes what the lost connection leaves, so the
    // waiting prepare's copy is not redelivered to the worker. It never
    // acknowledges, so the broker closes its channel at the consumer
    // timeout: on a connection of its own, apart from the answers'.
    let thief_conn = lapin::Connection::connect(&node.url(), Default::default())
        .await
        .unwrap();
    let thief = thief_conn.create_channel().await.unwrap();
    let queue = format!("ironic-image-worker.{}", env.host);
    let _held = thief
        .basic_consume(
            queue.as_str().into(),
            "thief".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        )
        .await
        .unwrap();
    tokio::task::block_in_place(|| node.close_worker_connections(&env.host));
    let answers = client
        .answers(&sent, 2 * MINUTE, Duration::from_secs(3))
        .await;
    answered_once(&answers, &sent);
    assert_eq!(
        reconnects(&worker).await,
        1.0,
        "one reconnection, for the connection the test closed"
    );
}

/// A command's `expiration` is its deadline: a prepare waiting for a
/// download slot (every one busy), set aside meanwhile, keeps the deadline
/// of its first delivery, and is answered `expired` once it passed instead
/// of starting then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_prepare_keeps_its_deadline() {
    let env = Env::new("[amqp]\nprefetch = 2\n");
    let faults = slow_source(&env, "slow.img").await;
    std::fs::write(env.root().join("src/late.img"), b"late image bytes").unwrap();
    let _worker = env.serve().await;
    let client = Broker::connect().await;
    let slow = prepare_cmd(&common::node(), &faults.url("slow", "slow.img"));
    let late = prepare_cmd(&common::node(), &faults.url("fast", "late.img"));
    let first = client.send(&env.host, &slow, None).await;
    slot_taken(&faults).await;
    // 5 s: set aside while the slow one (16 s) holds the only slot.
    let second = client.send(&env.host, &late, Some(5000)).await;
    let answers = client
        .answers(
            &[first.clone(), second.clone()],
            2 * MINUTE,
            Duration::from_secs(1),
        )
        .await;
    answered_once(&answers, &[first]);
    let got = &answers[&second];
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["status"], "error", "{:?}", got[0]);
    assert_eq!(got[0]["error"]["code"], "expired", "{:?}", got[0]);
    assert_eq!(faults.count("fast", "late.img"), 0, "never started");
}
