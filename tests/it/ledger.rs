//! The per-node command ledger: a prepare never runs after a later cleanup
//! or transition of its node, and a command is answered once across the
//! worker processes of a host.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

fn assert_nothing_for(env: &Env, node: &str) {
    assert!(
        !env.images_dir().join(node).exists(),
        "no files for the node"
    );
    assert!(
        env.link_dir().join(node).symlink_metadata().is_err(),
        "nothing published for the node"
    );
}

/// Slots busy -> the prepare waits for a download slot, set aside -> a
/// cleanup of its node is answered (the waiting prepare lets it by) ->
/// the waiting prepare is refused (`stale_request`): nothing linked,
/// nothing published, nothing downloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_prepare_never_runs_after_a_later_cleanup() {
    // prefetch 2: one download slot.
    let env = Env::new("[amqp]\nprefetch = 2\n");
    let src = env.root().join("src");
    random_file(&src.join("block.img"), 2 << 20, 61);
    random_file(&src.join("disk.img"), 1 << 20, 62);
    // About 100 KiB/s: the slot stays busy for some 20 s.
    let faults = FaultServer::start(&src, 100_000).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    broker
        .command(
            &env.host,
            prepare_cmd(&node(), &faults.url("slow", "block.img")),
        )
        .await;
    env.wait_for_temporary(WAIT).await;

    let x = node();
    let prepare = broker
        .command(&env.host, prepare_cmd(&x, &faults.url("fast", "disk.img")))
        .await;
    // Set aside: recorded, its delivery acknowledged.
    let accepted = env.images_dir().join(".ledger/accepted");
    let deadline = tokio::time::Instant::now() + WAIT;
    while list_visible(&accepted).is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "set aside");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cleanup = broker
        .command(
            &env.host,
            json!({"action": "cleanup", "node_uuid": x, "request_id": "c"}),
        )
        .await;
    let (got, ev) = broker.next_reply(WAIT).await;
    assert_eq!(
        got.as_deref(),
        Some(cleanup.as_str()),
        "cleanup first: {ev}"
    );
    assert_eq!(ev["status"], "success", "{ev}");

    // The prepare, behind the cleanup now, is refused.
    let answers = broker.replies(1, WAIT).await;
    let ev = &answers[&prepare];
    assert_eq!(ev["status"], "error", "{ev}");
    assert_eq!(ev["error"]["code"], "stale_request", "{ev}");
    assert_nothing_for(&env, &x);
    assert_eq!(faults.count("fast", "disk.img"), 0, "nothing downloaded");
}

/// The notifications of a deploy that failed while the worker was stopped
/// (`deploying`, then `deploy failed`): started again, the worker does not
/// link or publish the image of a node in `deploy failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_notification_is_dropped_when_the_node_moved_on() {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 4 << 20, 63);
    // 1 MiB/s: the download outlasts the delivery of the next notification.
    let faults = FaultServer::start(&src, 1 << 20).await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    // The queue and its bindings exist; then the worker is down.
    assert!(env.serve().await.terminate().await.success());
    let x = node();
    let info = json!({"image_source": faults.url("slow", "a.img")});
    emit_notifications(
        &env.host,
        &[
            notification(&x, "start", "available", "deploying", "deploy", &info),
            notification(&x, "error", "deploying", "deploy failed", "fail", &info),
        ],
    );
    let worker = env.serve().await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev.len(), 1, "the prepare is answered");
    assert_eq!(ev[0]["action"], "prepare", "{}", ev[0]);
    assert_eq!(ev[0]["error"]["code"], "stale_request", "{}", ev[0]);
    assert_nothing_for(&env, &x);
    let text = worker.metrics_text().await;
    assert_eq!(
        metric(
            &text,
            "ironic_image_worker_ignored_messages_total{reason=\"no_action\"}"
        ),
        Some(1.0),
        "{text}"
    );
}

/// The same as a cache hit: the image is cached already, so the stale
/// `deploying` notification could link at once, a millisecond after the
/// worker starts consuming; the node's later `deploy failed`, already in
/// the queue, counts first: nothing linked, `stale_request`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_notification_of_a_cached_image_is_dropped_when_the_node_moved_on() {
    let env = Env::new("");
    random_file(&env.root().join("src/a.img"), 1 << 20, 65);
    let server = SourceServer::start(&env.root().join("src")).await;
    let url = server.url("a.img");
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    // The image is cached (by another node's prepare); then the worker is
    // down, and the queue keeps what Ironic publishes meanwhile.
    let first = env.serve().await;
    let other = node();
    broker.command(&env.host, prepare_cmd(&other, &url)).await;
    let (_, ev) = broker.next_reply(WAIT).await;
    assert_eq!(ev["status"], "success", "{ev}");
    assert!(first.terminate().await.success());
    let x = node();
    let info = json!({"image_source": url});
    emit_notifications(
        &env.host,
        &[
            notification(&x, "start", "available", "deploying", "deploy", &info),
            notification(&x, "error", "deploying", "deploy failed", "fail", &info),
        ],
    );
    let _worker = env.serve().await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev.len(), 1, "the prepare is answered");
    assert_eq!(ev[0]["action"], "prepare", "{}", ev[0]);
    assert_eq!(ev[0]["error"]["code"], "stale_request", "{}", ev[0]);
    assert_nothing_for(&env, &x);
    assert_eq!(
        server.count("GET", "a.img"),
        1,
        "downloaded once, for the other node"
    );
}

/// A notification older than `[notifications]max_age` (the deploy
/// interface gave up on it) starts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_past_its_age_starts_nothing() {
    let env = Env::new("[notifications]\nmax_age = 1\n");
    random_file(&env.root().join("src/a.img"), 1 << 20, 64);
    let server = SourceServer::start(&env.root().join("src")).await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    assert!(env.serve().await.terminate().await.success());
    let x = node();
    let info = json!({"image_source": server.url("a.img")});
    emit_notifications(
        &env.host,
        &[notification(
            &x,
            "start",
            "available",
            "deploying",
            "deploy",
            &info,
        )],
    );
    // Setting up the age, not measuring anything.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let _worker = env.serve().await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0]["error"]["code"], "stale_request", "{}", ev[0]);
    assert!(
        ev[0]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_age")),
        "{}",
        ev[0]
    );
    assert_nothing_for(&env, &x);
    assert_eq!(server.count("GET", "a.img"), 0, "nothing downloaded");
}

/// A command answered by one worker process and redelivered (the process
/// died before its acknowledgement) to another process of the same host,
/// on the same queue and directories, is not answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_is_answered_once_across_the_processes_of_a_host() {
    let env = Env::new("");
    let first = env
        .serve_with(&[], &[("IRONIC_IMAGE_WORKER_TEST_ACK_DELAY_MS", "600000")])
        .await;
    let broker = Broker::connect().await;
    let x = node();
    let corr = broker
        .command(
            &env.host,
            json!({"action": "cleanup", "node_uuid": x, "request_id": "once"}),
        )
        .await;
    let (got, ev) = broker.next_reply(WAIT).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_eq!(ev["status"], "success", "{ev}");
    // Answered, not acknowledged: the second process cannot have it yet.
    let second = env.serve_another(&[]).await;
    first.kill9().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let consumed = |outcome: &str, action: &str| {
        format!(
            "ironic_image_worker_messages_consumed_total{{action=\"{action}\",outcome=\"{outcome}\",source=\"command\"}}"
        )
    };
    loop {
        let text = second.metrics_text().await;
        assert_eq!(
            metric(&text, &consumed("success", "cleanup")),
            None,
            "answered a second time"
        );
        if metric(&text, &consumed("ignored", "none")) == Some(1.0) {
            assert_eq!(
                metric(
                    &text,
                    "ironic_image_worker_ignored_messages_total{reason=\"answered_elsewhere\"}"
                ),
                Some(1.0),
                "{text}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the redelivered copy never reached the second process: {text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let extra = tokio::time::timeout(Duration::from_secs(2), broker.next_reply(WAIT)).await;
    assert!(extra.is_err(), "answered once");
}

/// A prepare moved to the slow lane is acknowledged early (the broker
/// holds no copy of it any more); its worker is then killed (`kill -9`).
/// Started again, the worker runs it again from what it recorded and
/// answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_lane_prepare_is_answered_after_its_worker_is_killed() {
    // slow_rate is 1 MiB/s: a source at 256 KiB/s is slow after 1 s.
    let env = Env::new("slow_after = 1\n");
    let src = env.root().join("src");
    random_file(&src.join("slow.img"), 2 << 20, 67);
    let faults = FaultServer::start(&src, 256 << 10).await;
    let first = env.serve().await;
    let broker = Broker::connect().await;
    let x = node();
    let corr = broker
        .command(&env.host, prepare_cmd(&x, &faults.url("slow", "slow.img")))
        .await;
    first
        .wait_metric("ironic_image_worker_slow_downloads_total", 1.0)
        .await;
    first.kill9().await;
    let _worker = env.serve().await;
    let answers = broker
        .answers(
            std::slice::from_ref(&corr),
            WAIT * 2,
            Duration::from_secs(3),
        )
        .await;
    let got = answers.get(&corr).map_or(&[][..], |v| v.as_slice());
    assert_eq!(got.len(), 1, "answered once after the restart: {got:?}");
    assert_eq!(got[0]["status"], "success", "{}", got[0]);
    assert!(
        env.link_dir().join(&x).symlink_metadata().is_ok(),
        "the node's image is published"
    );
    // Removed just after the answer is confirmed.
    let parked = env.images_dir().join(".ledger/accepted");
    let started = std::time::Instant::now();
    while !list_visible(&parked).is_empty() {
        assert!(started.elapsed() < WAIT, "answered: its record goes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The files under `root` (not under `skip`) whose bytes hold `secret`,
/// as it is or hex-encoded (as a parked delivery keeps its body).
fn files_holding(
    root: &std::path::Path,
    secret: &[u8],
    skip: &std::path::Path,
) -> Vec<std::path::PathBuf> {
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let holds = |bytes: &[u8], s: &[u8]| bytes.windows(s.len()).any(|w| w == s);
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let (path, kind) = (entry.path(), entry.file_type().unwrap());
            if path.starts_with(skip) || kind.is_symlink() {
                continue;
            }
            if kind.is_dir() {
                dirs.push(path);
            } else if std::fs::read(&path)
                .is_ok_and(|bytes| holds(&bytes, secret) || holds(&bytes, hex.as_bytes()))
            {
                found.push(path);
            }
        }
    }
    found
}

/// A prepare moved to the slow lane is recorded whole, its source's
/// credentials included: it must run again after a crash, and the broker
/// holds it no more. That record is the only file of the worker holding
/// them, 0600 in a 0700 directory, one the contract names among the files
/// that hold credentials; it goes once the prepare is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_lane_record_is_the_one_file_holding_its_credentials() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new("slow_after = 1\n");
    let src = env.root().join("src");
    random_file(&src.join("slow.img"), 2 << 20, 68);
    // 32 s of download at 64 KiB/s: its record certainly outlives the checks below.
    let faults = FaultServer::start(&src, 64 << 10).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let url = faults
        .url("slow", "slow.img")
        .replacen("http://", "http://ironic:S3cretPw@", 1);
    let corr = broker.command(&env.host, prepare_cmd(&node(), &url)).await;
    worker
        .wait_metric("ironic_image_worker_slow_downloads_total", 1.0)
        .await;
    let holding = files_holding(env.root(), b"S3cretPw", &src);
    let parked = env.images_dir().join(".ledger/accepted");
    assert_eq!(holding.len(), 1, "{holding:?}");
    assert_eq!(holding[0].parent(), Some(parked.as_path()), "{holding:?}");
    let contract =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/contract.md")).unwrap();
    let paragraph = contract
        .split("\n\n")
        .find(|p| p.contains("No file the worker writes holds a credential"))
        .unwrap();
    assert!(
        paragraph.contains("`<images_path>/.ledger/accepted/`"),
        "the contract does not name the slow lane's records: {paragraph}"
    );
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&holding[0]), 0o600);
    assert_eq!(mode(&parked), 0o700);
    let answers = broker
        .answers(std::slice::from_ref(&corr), WAIT, Duration::from_secs(1))
        .await;
    assert_eq!(answers[&corr][0]["status"], "success", "{answers:?}");
    let started = std::time::Instant::now();
    while !files_holding(env.root(), b"S3cretPw", &src).is_empty() {
        assert!(started.elapsed() < WAIT, "answered: its record goes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `rabbitmqctl` for the shared broker: the packaged wrapper, which runs
/// as the broker's user (with its Erlang cookie).
const SHARED_CTL: &str = "/usr/sbin/rabbitmqctl";

/// The connections of the worker processes of `host` on the shared
/// broker, oldest first: (pid, connected_at).
fn worker_connections(host: &str) -> Vec<(String, u64)> {
    let out = std::process::Command::new(SHARED_CTL)
        .args([
            "-q",
            "list_connections",
            "--no-table-headers",
            "pid",
            "connected_at",
            "client_properties",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let mut found: Vec<(String, u64)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&format!("ironic-image-worker@{host}\"")))
        .map(|l| {
            let mut f = l.split('\t');
            let pid = f.next().unwrap().trim().to_string();
            (pid, f.next().unwrap().trim().parse().unwrap())
        })
        .collect();
    found.sort_by_key(|(_, at)| *at);
    found
}

/// Once the first process of `env` downloads `slow.img` from `faults`,
/// starts a second one (with `extra` arguments) consuming the same queue
/// and has the broker close the first one's connection, so that the
/// broker delivers the command again, to the second process: that one.
async fn copy_to_a_second_process(env: &Env, extra: &[&str], faults: &FaultServer) -> Worker {
    let started = std::time::Instant::now();
    while faults.count("slow", "slow.img") == 0 {
        assert!(started.elapsed() < WAIT, "the prepare starts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = env.serve_another(extra).await;
    // Consuming (connected is set once its consumer is registered), so the
    // copy the broker takes back goes to it, not to the first process
    // reconnecting.
    second
        .wait_metric("ironic_image_worker_amqp_connected", 1.0)
        .await;
    let started = std::time::Instant::now();
    let connections = loop {
        let c = tokio::task::block_in_place(|| worker_connections(&env.host));
        if c.len() == 2 {
            break c;
        }
        assert!(started.elapsed() < WAIT, "both processes consume: {c:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The first process's connection: the older one.
    let closed = std::process::Command::new(SHARED_CTL)
        .args(["close_connection", &connections[0].0, "closed by the test"])
        .output()
        .unwrap();
    assert!(closed.status.success(), "{closed:?}");
    second
}

/// The first process of `env` (started with `args`) downloading `slow.img`
/// (`seed`'s bytes) for a prepare: at 64 KiB/s, some 25 s of download, so
/// that it still runs once a second process, started on a loaded machine,
/// consumes. The source, the process, the broker and the command's
/// correlation id.
async fn slow_prepare(
    env: &Env,
    args: &[&str],
    seed: u64,
) -> (FaultServer, Worker, Broker, String) {
    let src = env.root().join("src");
    random_file(&src.join("slow.img"), 1600 << 10, seed);
    let faults = FaultServer::start(&src, 64 << 10).await;
    let first = env.serve_with(args, &[]).await;
    let broker = Broker::connect().await;
    let corr = broker
        .command(
            &env.host,
            prepare_cmd(&node(), &faults.url("slow", "slow.img")),
        )
        .await;
    (faults, first, broker, corr)
}

/// A prepare runs in one worker process; its connection is closed by the
/// broker mid-download, so the broker redelivers the command to the other
/// process of the host, consuming the same queue. That process waits for
/// the first one's answer instead of working the command again: one
/// answer, given by the first process through its next connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_redelivered_while_another_process_runs_it_is_answered_once() {
    let env = Env::new("");
    let (faults, first, broker, corr) = slow_prepare(&env, &[], 66).await;
    let second = copy_to_a_second_process(&env, &[], &faults).await;
    let answers = broker
        .answers(
            std::slice::from_ref(&corr),
            WAIT * 2,
            Duration::from_secs(5),
        )
        .await;
    let got = answers.get(&corr).map_or(&[][..], |v| v.as_slice());
    assert_eq!(got.len(), 1, "answered once: {got:?}");
    assert_eq!(got[0]["status"], "success", "{}", got[0]);
    let text = second
        .wait_metric(
            "ironic_image_worker_ignored_messages_total{reason=\"answered_elsewhere\"}",
            1.0,
        )
        .await;
    assert_eq!(
        metric(
            &text,
            "ironic_image_worker_messages_consumed_total{action=\"prepare\",outcome=\"success\",source=\"command\"}"
        ),
        None,
        "the second process did not work it: {text}"
    );
    drop(first);
}

fn notification(
    node: &str,
    status: &str,
    prev: &str,
    state: &str,
    event: &str,
    info: &Value,
) -> Value {
    json!({"node": node, "status": status, "prev_state": prev, "state": state,
           "target": if state == "deploying" { json!("active") } else { Value::Null },
           "event": event, "instance_info": info})
}

/// Fills the file system of `dir` (a small tmpfs) to its last block.
fn fill(dir: &std::path::Path) {
    use std::io::Write;
    let mut file = std::fs::File::create(dir.join("fill")).unwrap();
    let chunk = vec![0xa5u8; 64 << 10];
    while file.write_all(&chunk).is_ok() {}
    for _ in 0..64 {
        let _ = file.write_all(&chunk[..4096]);
    }
}

/// As above, but the file system is full when the first process answers,
/// so its answer cannot be recorded in the ledger: its claim on the
/// delivery still ends, and the second process, waiting for it, works its
/// copy and answers it (the second answer the deploy interface skips)
/// instead of waiting, unanswered, for the first process's end. Before,
/// the claim outlived the failed record and the copy was never answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_waiting_for_an_answer_that_could_not_be_recorded_is_answered() {
    let env = Env::new("");
    let small = env.root().join("small");
    let mount = Tmpfs::mount(&small, "24m");
    let flags = mount.worker_flags();
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (faults, first, broker, corr) = slow_prepare(&env, &args, 67).await;
    let second = copy_to_a_second_process(&env, &args, &faults).await;
    // The first process's download, and then its answer's record, run
    // into a full file system.
    fill(&small);
    let answers = broker
        .answers(std::slice::from_ref(&corr), WAIT, Duration::from_secs(20))
        .await;
    let got = answers.get(&corr).map_or(&[][..], |v| v.as_slice());
    assert_eq!(
        got.len(),
        2,
        "the first process's answer, then the second's: {got:?}"
    );
    second
        .wait_metric(
            "ironic_image_worker_messages_consumed_total{action=\"prepare\",outcome=\"error\",source=\"command\"}",
            1.0,
        )
        .await;
    drop(first);
}
