//! A backlog of downloads against the rest of the work: what waits for a
//! download slot holds neither a delivery of the broker's prefetch nor
//! anything a cleanup, a `deployed` or a cache hit needs; and on SIGTERM
//! what has not started is given back (to the broker, or to the JSON-RPC
//! caller with an error), never started during the grace period.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const MINUTE: Duration = Duration::from_secs(60);

/// A JSON-RPC call (with an `id`) to the listener on `port`: its HTTP
/// status and body.
async fn rpc(port: u16, method: &str, params: Value) -> (u16, Value) {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A JSON-RPC cast (no `id`, answered with nothing) to the listener on
/// `port`.
async fn cast(port: u16, method: &str, params: Value) {
    let body = json!({"jsonrpc": "2.0", "method": method, "params": params});
    let r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
}

/// Requests `faults` saw for `mode`/`names`, all together.
fn requests(faults: &FaultServer, mode: &str, names: &[String]) -> usize {
    names.iter().map(|n| faults.count(mode, n)).sum()
}

/// Waits until `faults` saw `n` requests for `mode`/`names`.
async fn downloads_begun(faults: &FaultServer, mode: &str, names: &[String], n: usize) {
    let started = Instant::now();
    while requests(faults, mode, names) < n {
        assert!(started.elapsed() < MINUTE, "{n} downloads begin");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// 20 prepares of other nodes trickle in at about 2 KiB/s each (minutes a
/// download) through the broker, 4 more through JSON-RPC, with
/// `[amqp]prefetch = 4` (3 download slots): a cleanup, a `deployed` and a
/// prepare of an image already cached are still answered at once, on both
/// transports. (The bound is loose: the point is "not behind minutes of
/// downloads".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_work_does_not_wait_behind_trickling_downloads() {
    let port = free_port();
    let env = Env::new(&format!(
        "[amqp]\nprefetch = 4\n[json_rpc]\nlisten = \"127.0.0.1:{port}\"\n"
    ));
    let src = env.root().join("src");
    random_file(&src.join("disk.img"), 1 << 20, 81);
    let trickles: Vec<String> = (0..24).map(|i| format!("trickle{i}.img")).collect();
    for name in &trickles {
        std::fs::hard_link(src.join("disk.img"), src.join(name)).unwrap();
    }
    random_file(&src.join("cached.img"), 1 << 20, 82);
    // About 2 KiB every second per download.
    let faults = FaultServer::start(&src, 2000).await;
    let server = SourceServer::start(&src).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let first = broker
        .call(&env.host, prepare_cmd(&node(), &server.url("cached.img")))
        .await;
    assert_eq!(first["status"], "success", "{first}");
    assert_eq!(first["cache"], "miss", "{first}");

    for name in &trickles[..20] {
        let cmd = prepare_cmd(&node(), &faults.url("slow", name));
        broker.command(&env.host, cmd).await;
    }
    for name in &trickles[20..] {
        let params = json!({"node_uuid": node(), "request_id": uuid::Uuid::new_v4().to_string(),
                            "instance_info": {"image_source": faults.url("slow", name)}});
        cast(port, "prepare", params).await;
    }
    // Every download slot taken, the rest waiting (past the 2 s after
    // which a waiting prepare used to be deferred).
    downloads_begun(&faults, "slow", &trickles, 3).await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let started = Instant::now();
    let hit = || prepare_cmd(&node(), &server.url("cached.img"));
    let timed = |method: &'static str, params: Value| async move {
        let started = Instant::now();
        let answer = rpc(port, method, params).await;
        (answer, started.elapsed())
    };
    let rpc_hit = tokio::spawn(timed("prepare", hit()));
    let cleanup = json!({"node_uuid": node(), "request_id": "c2"});
    let rpc_cleanup = tokio::spawn(timed("cleanup", cleanup));
    let sent = [
        broker
            .command(
                &env.host,
                json!({"action": "cleanup", "node_uuid": node(), "request_id": "c1"}),
            )
            .await,
        broker
            .command(
                &env.host,
                json!({"action": "deployed", "node_uuid": node(), "request_id": "d1"}),
            )
            .await,
        broker.command(&env.host, hit()).await,
    ];
    let answers = broker
        .answers(&sent, Duration::from_secs(30), Duration::from_millis(100))
        .await;
    let took = started.elapsed();
    let ((rpc_hit, hit_took), (rpc_cleanup, cleanup_took)) =
        (rpc_hit.await.unwrap(), rpc_cleanup.await.unwrap());
    eprintln!(
        "broker: answered after {took:?}; JSON-RPC: cached prepare {hit_took:?}, \
         cleanup {cleanup_took:?}"
    );
    for (corr, what) in sent.iter().zip(["cleanup", "deployed", "cached prepare"]) {
        let got = answers.get(corr).map_or(&[][..], |v| v.as_slice());
        assert_eq!(
            got.len(),
            1,
            "the {what} is answered (in 30 s): {answers:?}"
        );
        assert_eq!(got[0]["status"], "success", "{what}: {:?}", got[0]);
    }
    assert_eq!(answers[&sent[2]][0]["cache"], "hit");
    assert_eq!(rpc_hit.1["result"]["status"], "success", "{rpc_hit:?}");
    assert_eq!(rpc_hit.1["result"]["cache"], "hit", "{rpc_hit:?}");
    assert_eq!(
        rpc_cleanup.1["result"]["status"], "success",
        "{rpc_cleanup:?}"
    );
    for waited in [took, hit_took, cleanup_took] {
        assert!(
            waited < Duration::from_secs(20),
            "answered behind the downloads: {waited:?}"
        );
    }
    // The downloads go on, three at a time.
    assert!(requests(&faults, "slow", &trickles) <= 3 + 2, "bounded");
}

/// Each of `sent` answered exactly once, successfully.
fn answered_once(answers: &HashMap<String, Vec<Value>>, sent: &[String]) {
    for corr in sent {
        let got = answers.get(corr).map_or(&[][..], |v| v.as_slice());
        assert_eq!(got.len(), 1, "{corr} answered once: {got:?}");
        assert_eq!(got[0]["status"], "success", "{:?}", got[0]);
    }
}

/// SIGTERM while downloads run and other work waits: the downloads finish
/// within `[amqp]shutdown_grace` and are answered; the work not started
/// (a prepare behind its node's download, one waiting for a download slot)
/// is never started by the stopping worker (its source sees no request),
/// stays with the broker and is answered once by the next worker; a
/// JSON-RPC call not started gets the documented error at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_not_started_is_given_back_on_stop() {
    let port = free_port();
    let env = Env::new(&format!(
        "[amqp]\nprefetch = 4\nshutdown_grace = 60\n[json_rpc]\nlisten = \"127.0.0.1:{port}\"\n"
    ));
    let src = env.root().join("src");
    let slow: Vec<String> = (0..3).map(|i| format!("slow{i}.img")).collect();
    for (i, name) in slow.iter().enumerate() {
        random_file(&src.join(name), 1600 << 10, 90 + i as u64);
    }
    for name in ["queued.img", "waiting.img", "called.img"] {
        random_file(&src.join(name), 256 << 10, 95);
    }
    // 200 KiB/s: some 8 s a slow download.
    let faults = FaultServer::start(&src, 200 << 10).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let nodes: Vec<String> = (0..3).map(|_| node()).collect();
    let mut sent = Vec::new();
    for (n, name) in nodes.iter().zip(&slow) {
        sent.push(
            broker
                .command(&env.host, prepare_cmd(n, &faults.url("slow", name)))
                .await,
        );
    }
    downloads_begun(&faults, "slow", &slow, 3).await;
    // Behind node 0's download; waiting for a download slot; a call behind
    // node 1's download.
    let queued = prepare_cmd(&nodes[0], &faults.url("fast", "queued.img"));
    let waiting = prepare_cmd(&node(), &faults.url("fast", "waiting.img"));
    let not_started = [
        broker.command(&env.host, queued).await,
        broker.command(&env.host, waiting).await,
    ];
    let params = json!({"node_uuid": nodes[1], "request_id": "called",
                        "instance_info": {"image_source": faults.url("fast", "called.img")}});
    let call = tokio::spawn(async move { rpc(port, "prepare", params).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        requests(&faults, "slow", &slow) == 3,
        "the slow downloads still run"
    );
    let stopping = Instant::now();
    let stopped = tokio::spawn(worker.terminate());
    let (status, body) = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call is answered at once")
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["error"]["code"], -32000, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("stopping"), "{body}");
    assert!(stopped.await.unwrap().success(), "a clean stop");
    eprintln!("stopped after {:?}", stopping.elapsed());
    let fast: Vec<String> = ["queued.img", "waiting.img", "called.img"]
        .map(String::from)
        .to_vec();
    assert_eq!(
        requests(&faults, "fast", &fast),
        0,
        "nothing not started was started during the grace period"
    );
    let answers = broker
        .answers(&sent, Duration::from_secs(10), Duration::from_millis(100))
        .await;
    answered_once(&answers, &sent);
    assert!(
        not_started.iter().all(|c| !answers.contains_key(c)),
        "not answered by the stopping worker: {answers:?}"
    );

    let _next = env.serve().await;
    let answers = broker
        .answers(&not_started, 2 * MINUTE, Duration::from_secs(3))
        .await;
    answered_once(&answers, &not_started);
    assert_eq!(faults.count("fast", "queued.img"), 1);
    assert_eq!(faults.count("fast", "waiting.img"), 1);
    assert_eq!(
        faults.count("fast", "called.img"),
        0,
        "the caller asks again"
    );
}
