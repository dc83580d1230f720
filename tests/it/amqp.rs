//! The worker on the real RabbitMQ: commands in, completion events out,
//! images served over HTTP, bad input dead-lettered.

use crate::common;

use common::*;
use serde_json::json;
use std::time::Duration;

const MINUTE: Duration = Duration::from_secs(60);

fn same_answer(a: &serde_json::Value, b: &serde_json::Value) {
    for key in [
        "status",
        "node_uuid",
        "image_url",
        "image_checksum",
        "image_os_hash_algo",
        "image_os_hash_value",
        "image_size",
        "image_disk_format",
        "converted",
    ] {
        assert_eq!(a[key], b[key], "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_deployed_cleanup_through_the_broker() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 4 * 1024 * 1024 + 5, 21);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();

    let cmd = prepare_cmd(&node, &server.url("disk.img"));
    let first = broker.call(&env.host, cmd.clone()).await;
    assert_eq!(first["status"], "success", "{first}");
    assert_eq!(first["request_id"], cmd["request_id"]);
    assert_eq!(first["conductor_host"], env.host);
    assert_served(&first, &fetch_served(&first, env.root()).await);
    assert_served(&first, &src);

    // The same command again: the same answer, no second download.
    let again = broker.call(&env.host, cmd).await;
    same_answer(&first, &again);
    assert_eq!(again["request_id"], first["request_id"]);
    assert_eq!(server.count("GET", "disk.img"), 1);

    let done = broker
        .call(
            &env.host,
            json!({"action": "deployed", "node_uuid": node, "request_id": "d1"}),
        )
        .await;
    assert_eq!(done["status"], "success", "{done}");
    assert_eq!(get(first["image_url"].as_str().unwrap()).await.0, 404);
    let done = broker
        .call(
            &env.host,
            json!({"action": "cleanup", "node_uuid": node, "request_id": "c1"}),
        )
        .await;
    assert_eq!(done["status"], "success");
    assert!(!env.images_dir().join(&node).exists());

    // Without reply_to the event goes to the events exchange as node.<action>.<status>.
    let tap = EventTap::new(&broker).await;
    let body =
        json!({"action": "cleanup", "node_uuid": node, "request_id": "no-reply"}).to_string();
    broker
        .publish_raw(&env.host, "cleanup", body.as_bytes(), "x", None, false)
        .await;
    let (key, mode, ev) = tap
        .next(&env.host, MINUTE)
        .await
        .expect("event on the events exchange");
    assert_eq!(key, "node.cleanup.success");
    assert_eq!(mode, Some(2), "persistent");
    assert_eq!(ev["request_id"], "no-reply");

    let readyz = reqwest::get(worker.metrics_url("/readyz")).await.unwrap();
    assert_eq!(readyz.status(), 200);
    assert!(worker.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_nodes_one_image_one_download() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 8 * 1024 * 1024, 22);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let checksum = md5sum(&src);

    let mut sent = std::collections::HashMap::new();
    for _ in 0..100 {
        let node = node();
        let mut cmd = prepare_cmd(&node, &server.url("disk.img"));
        cmd["instance_info"]["image_checksum"] = checksum.clone().into();
        sent.insert(broker.command(&env.host, cmd).await, node);
    }
    let replies = broker.replies(100, 2 * MINUTE).await;
    for (corr, node) in &sent {
        let r = &replies[corr];
        assert_eq!(r["status"], "success", "{r}");
        assert_eq!(r["node_uuid"], node.as_str());
        assert_eq!(r["image_checksum"], checksum);
    }
    assert_eq!(server.count("GET", "disk.img"), 1);
    assert_eq!(std::fs::read_dir(env.link_dir()).unwrap().count(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_answered_and_dead_lettered() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1024 * 1024, 23);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();

    let cases: Vec<(&str, Vec<u8>, &str, Option<&str>)> = vec![
        ("prepare", b"{not json".to_vec(), "invalid_message", None),
        ("prepare", json!({"action": "prepare", "node_uuid": node, "request_id": "r-schema", "instance_info": {}}).to_string().into_bytes(), "invalid_message", Some("r-schema")),
        ("prepare", json!({"action": "explode", "node_uuid": node, "request_id": "r-action"}).to_string().into_bytes(), "invalid_message", Some("r-action")),
        ("cleanup", json!({"action": "cleanup", "node_uuid": "../../etc", "request_id": "r-uuid"}).to_string().into_bytes(), "invalid_node_uuid", Some("r-uuid")),
        ("prepare", json!({"action": "prepare", "node_uuid": node, "request_id": "r-type", "instance_info": {"image_source": 42}}).to_string().into_bytes(), "invalid_message", Some("r-type")),
    ];
    let mut wrong = Vec::new();
    for (i, (action, body, code, request_id)) in cases.iter().enumerate() {
        let mut headers = lapin::types::FieldTable::default();
        headers.insert(
            "x-test-case".into(),
            lapin::types::AMQPValue::LongInt(i as i32),
        );
        let corr = format!("bad-{i}");
        broker
            .publish_raw(&env.host, action, body, &corr, Some(headers), true)
            .await;
        let (got, ev) = broker.next_reply(MINUTE).await;
        let want = (Some(corr.as_str()), "error", *code, *request_id);
        let seen = (
            got.as_deref(),
            ev["status"].as_str().unwrap_or(""),
            ev["error"]["code"].as_str().unwrap_or(""),
            ev["request_id"].as_str(),
        );
        if seen != want {
            wrong.push(format!("case {i}: want {want:?}, got {ev}"));
        }
    }
    // Every case is checked before one failure is reported.
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Each original is in the dead-letter queue, bytes and headers intact.
    let dead_queue = format!("ironic-image-worker.{}.dead", env.host);
    let mut dead = Vec::new();
    for _ in 0..100 {
        dead.extend(broker.drain(&dead_queue).await);
        if dead.len() >= cases.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(dead.len(), cases.len());
    for m in &dead {
        let headers = m.delivery.properties.headers().as_ref().unwrap();
        let case = match headers.inner().get("x-test-case") {
            Some(lapin::types::AMQPValue::LongInt(i)) => *i as usize,
            other => panic!("header lost: {other:?}"),
        };
        assert_eq!(m.delivery.data, cases[case].1, "case {case} body intact");
        assert!(
            headers.inner().contains_key("x-death"),
            "dead-lettered by the broker"
        );
    }
    // And the worker still answers a good command.
    let ok = broker
        .call(&env.host, prepare_cmd(&node, &server.url("disk.img")))
        .await;
    assert_eq!(ok["status"], "success", "{ok}");
}

/// A prepare that fails on its source is answered and acknowledged, not
/// dead-lettered: dead letters are for messages that cannot be worked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prepare_is_answered_not_dead_lettered() {
    let env = Env::new("");
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let dead_queue = format!("ironic-image-worker.{}.dead", env.host);
    let missing = broker
        .call(&env.host, prepare_cmd(&node(), &server.url("missing.img")))
        .await;
    assert_eq!(missing["error"]["code"], "source_not_found", "{missing}");
    // Proved without a timed wait: an unusable message sent after that answer
    // is dead-lettered on the same channel, so once it is in the dead-letter
    // queue the failed prepare was settled before it, and it is the only one.
    broker
        .publish_raw(&env.host, "prepare", b"sentinel", "sentinel", None, true)
        .await;
    let (got, _) = broker.next_reply(MINUTE).await;
    assert_eq!(got.as_deref(), Some("sentinel"));
    let deadline = std::time::Instant::now() + MINUTE;
    let mut dead = Vec::new();
    while dead.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "sentinel never dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        dead = broker.drain(&dead_queue).await;
    }
    let bodies: Vec<&[u8]> = dead.iter().map(|m| &m.delivery.data[..]).collect();
    assert_eq!(
        bodies,
        vec![&b"sentinel"[..]],
        "only the unusable message is dead-lettered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_subcommand_waits_for_the_answer() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1024 * 1024, 24);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let node = node();
    let url = server.url("disk.img");
    let out = env
        .run(&[
            "send",
            "prepare",
            "--node",
            &node,
            "--image-source",
            &url,
            "--request-id",
            "cli-1",
            "--wait",
            "--timeout",
            "60",
        ])
        .await;
    let (ok, ev) = completion_of(&out);
    assert!(ok, "{ev}");
    assert_eq!(ev["request_id"], "cli-1");
    assert_served(&ev, &src);
    // No worker for that host: a clear failure, not a silent loss.
    let out = env
        .run(&[
            "send",
            "cleanup",
            "--node",
            &node,
            "--conductor",
            "no-such-host-xyz",
        ])
        .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no queue is bound"));
}

/// A cleanup that meets a read-only file system is retried, not answered
/// `internal` and forgotten: once the file system is writable again the
/// node's link is gone and the cleanup is answered once, with success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_on_a_read_only_file_system_waits_for_it() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1024 * 1024, 25);
    let server = SourceServer::start(&env.root().join("src")).await;
    let http_root = Tmpfs::mount(&env.root().join("httpboot"), "16m");
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    let ok = broker
        .call(&env.host, prepare_cmd(&node, &server.url("disk.img")))
        .await;
    assert_eq!(ok["status"], "success", "{ok}");
    let link = env.link_dir().join(&node);
    assert!(link.symlink_metadata().is_ok());

    http_root.remount("ro");
    let corr = broker
        .command(
            &env.host,
            json!({"action": "cleanup", "node_uuid": node, "request_id": "ro-1"}),
        )
        .await;
    // The first attempt failed (counted), yet no answer went out.
    worker
        .wait_metrics("a failed cleanup counted", |text| {
            text.lines().any(|l| {
                l.starts_with("ironic_image_worker_completions_total{")
                    && l.contains("action=\"cleanup\"")
                    && l.contains("status=\"error\"")
            })
        })
        .await;
    assert!(link.symlink_metadata().is_ok(), "read-only: still there");
    http_root.remount("rw");
    let (got, ev) = broker.next_reply(MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_eq!(ev["status"], "success", "{ev}");
    assert!(link.symlink_metadata().is_err(), "link removed");
    let extra = tokio::time::timeout(Duration::from_secs(2), broker.next_reply(MINUTE)).await;
    assert!(extra.is_err(), "answered once");
    assert!(worker.terminate().await.success());
}

/// Downloads never hold every delivery slot: with 32 prepares trickling in
/// (the prefetch), a cleanup for another node is still answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanups_do_not_wait_behind_trickling_prepares() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 26);
    for i in 0..32 {
        std::fs::hard_link(
            env.root().join("src/disk.img"),
            env.root().join(format!("src/disk{i}.img")),
        )
        .unwrap();
    }
    // About 1 KiB every 100 ms: each download would take minutes.
    let faults = FaultServer::start(&env.root().join("src"), 10_000).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    for i in 0..32 {
        broker
            .command(
                &env.host,
                prepare_cmd(&node(), &faults.url("slow", &format!("disk{i}.img"))),
            )
            .await;
    }
    let started = std::time::Instant::now();
    let corr = broker
        .command(
            &env.host,
            json!({"action": "cleanup", "node_uuid": node(), "request_id": "c-fast"}),
        )
        .await;
    let (got, ev) = broker.next_reply(Duration::from_secs(30)).await;
    assert_eq!(
        got.as_deref(),
        Some(corr.as_str()),
        "the cleanup is answered first"
    );
    assert_eq!(ev["status"], "success", "{ev}");
    eprintln!("cleanup answered after {:?}", started.elapsed());
}

/// Slow sources never hold every prepare slot: with three prepares of
/// sources a little above `[source]min_rate` in the three slots a prefetch
/// of 4 gives, a fourth prepare of a fast source is still answered, and the
/// slow ones go on in the slow lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_sources_give_back_their_prepare_slots() {
    let env =
        Env::new("min_rate = 100\nmin_rate_window = 5\nslow_after = 3\n[amqp]\nprefetch = 4\n");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 27);
    for i in 0..3 {
        std::fs::hard_link(
            env.root().join("src/disk.img"),
            env.root().join(format!("src/slow{i}.img")),
        )
        .unwrap();
    }
    // 160 bytes/s: each slow download would take about two hours.
    let faults = FaultServer::start(&env.root().join("src"), 150).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    for i in 0..3 {
        broker
            .command(
                &env.host,
                prepare_cmd(&node(), &faults.url("slow", &format!("slow{i}.img"))),
            )
            .await;
    }
    // The slow ones have their slots before the fast one arrives.
    let begun = || (0..3).all(|i| faults.count("slow", &format!("slow{i}.img")) > 0);
    let deadline = tokio::time::Instant::now() + MINUTE;
    while !begun() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slow downloads begin"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let corr = broker
        .command(
            &env.host,
            prepare_cmd(&node(), &faults.url("fast", "disk.img")),
        )
        .await;
    let (got, ev) = broker.next_reply(MINUTE).await;
    assert_eq!(
        got.as_deref(),
        Some(corr.as_str()),
        "the fast prepare is answered: {ev}"
    );
    assert_eq!(ev["status"], "success", "{ev}");
    // Each slow download moves once its own `slow_after` has passed; on a
    // loaded machine the last may move after the fast one was answered.
    let mut text = worker.metrics_text().await;
    for _ in 0..60 {
        if metric(&text, "ironic_image_worker_slow_downloads_total") >= Some(3.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        text = worker.metrics_text().await;
    }
    assert_eq!(
        metric(&text, "ironic_image_worker_slow_downloads_total"),
        Some(3.0),
        "{text}"
    );
}

/// A body over `[amqp]max_message_bytes` (default 4 MiB) is refused unread:
/// `invalid_message`, dead-lettered intact. One under it, whose size is an
/// `instance_info` key the worker does not read (a configdrive), is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_refused_unread_and_dead_lettered() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 24);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let body_of = |node: &str, pad: usize| {
        let mut cmd = prepare_cmd(node, &server.url("disk.img"));
        cmd["instance_info"]["configdrive"] = "H4sI".repeat(pad / 4).into();
        cmd.to_string().into_bytes()
    };
    let under = body_of(&node(), 3 << 20);
    broker
        .publish_raw(&env.host, "prepare", &under, "under", None, true)
        .await;
    let (got, ev) = broker.next_reply(MINUTE).await;
    assert_eq!(got.as_deref(), Some("under"));
    assert_eq!(ev["status"], "success", "{ev}");

    let over = body_of(&node(), 4 << 20);
    assert!(over.len() > 4 << 20);
    broker
        .publish_raw(&env.host, "prepare", &over, "over", None, true)
        .await;
    let (got, ev) = broker.next_reply(MINUTE).await;
    assert_eq!(got.as_deref(), Some("over"));
    assert_eq!(ev["status"], "error", "{ev}");
    assert_eq!(ev["error"]["code"], "invalid_message", "{ev}");
    assert!(
        ev["request_id"].is_null(),
        "nothing of the body is read: {ev}"
    );
    let dead_queue = format!("ironic-image-worker.{}.dead", env.host);
    let deadline = std::time::Instant::now() + MINUTE;
    let mut dead = Vec::new();
    while dead.is_empty() {
        assert!(std::time::Instant::now() < deadline, "never dead-lettered");
        tokio::time::sleep(Duration::from_millis(50)).await;
        dead = broker.drain(&dead_queue).await;
    }
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].delivery.data, over, "dead-lettered intact");
}

/// A command whose `reply_to` is a queue that refuses every message (full,
/// with `reject-publish`: anyone on the broker can make one and name it)
/// is answered on the events exchange once its deadline (here the
/// command's 3 s `expiration`) has passed, and the refusals are not taken
/// for a broken connection: before, the worker renewed its connection and
/// published again in a tight loop, for as long as that queue existed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_its_reply_queue_refuses_goes_to_the_events_exchange() {
    use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let env = Env::new("");
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    let full = format!("refusing-{}", uuid::Uuid::new_v4().simple());
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let options = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    broker
        .channel
        .queue_declare(full.as_str().into(), options, args)
        .await
        .unwrap();
    let cleanup = json!({"action": "cleanup", "node_uuid": node(), "request_id": "refused-1"});
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_correlation_id("refused-1".into())
        .with_expiration("3000".into())
        .with_reply_to(full.as_str().into());
    broker
        .channel
        .basic_publish(
            "ironic-image-worker".into(),
            format!("{}.node.cleanup", env.host).as_str().into(),
            BasicPublishOptions::default(),
            cleanup.to_string().as_bytes(),
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let (key, _, event) = tap
        .next(&env.host, Duration::from_secs(30))
        .await
        .expect("the answer its reply queue refused, on the events exchange");
    assert_eq!(key, "node.cleanup.success");
    assert_eq!(event["request_id"], "refused-1");
    let metrics = worker.metrics_text().await;
    assert_eq!(
        metric(&metrics, "ironic_image_worker_amqp_reconnects_total"),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "ironic_image_worker_amqp_answers_given_up_total"),
        Some(1.0),
        "{metrics}"
    );
    let refusals = metric(&metrics, "ironic_image_worker_amqp_answer_refusals_total");
    // Backoff from 0.25 s, at most every 5 s, over 3 s: a handful, not a
    // loop.
    assert!(
        refusals.is_some_and(|n| (2.0..=12.0).contains(&n)),
        "{refusals:?}"
    );
    let after = json!({"action": "cleanup", "node_uuid": node(), "request_id": "after"});
    assert_eq!(broker.call(&env.host, after).await["status"], "success");
}

/// A reply queue that refuses answers for a while (as a quorum queue does
/// while a broker node fails over; here a policy makes it reject every
/// publish, cleared after 4 s) gets its answer once it takes messages
/// again: published again until the command's deadline, once, and not to
/// the events exchange. Before, three refusals a second apart sent the
/// answer to the events exchange, and its sender never heard it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_refused_for_a_while_reaches_its_reply_queue() {
    use lapin::options::QueueDeclareOptions;
    let env = Env::new("");
    let worker = env.serve().await;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let queue = format!("refusing-for-a-while-{id}");
    let policy = format!("iiw-test-refuse-{id}");
    tool(
        "rabbitmqctl",
        &[
            "-q",
            "set_policy",
            "--apply-to",
            "queues",
            &policy,
            &format!("^{queue}$"),
            r#"{"max-length":0,"overflow":"reject-publish"}"#,
        ],
    );
    let declarer = Broker::connect().await;
    let options = QueueDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    declarer
        .channel
        .queue_declare(queue.as_str().into(), options, Default::default())
        .await
        .unwrap();
    let client = Broker::connect_replying_to(AMQP_URL, &queue).await;
    let tap = EventTap::new(&client).await;
    let cleanup = json!({"action": "cleanup", "node_uuid": node(), "request_id": "later"});
    let corr = client.send(&env.host, &cleanup, Some(60_000)).await;
    let metric_now = |name: &'static str| {
        let worker = &worker;
        async move { metric(&worker.metrics_text().await, name).unwrap_or(0.0) }
    };
    let refusals = "ironic_image_worker_amqp_answer_refusals_total";
    let started = std::time::Instant::now();
    while metric_now(refusals).await < 2.0 {
        assert!(started.elapsed() < Duration::from_secs(20), "refused twice");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    tool("rabbitmqctl", &["-q", "clear_policy", &policy]);
    let answers = client
        .answers(
            std::slice::from_ref(&corr),
            Duration::from_secs(30),
            Duration::from_secs(2),
        )
        .await;
    let got = answers.get(&corr).expect("answered on its reply queue");
    assert_eq!(got.len(), 1, "{answers:?}");
    assert_eq!(got[0]["status"], "success");
    assert!(
        tap.next(&env.host, Duration::from_millis(500))
            .await
            .is_none(),
        "nothing on the events exchange"
    );
    assert_eq!(
        metric_now("ironic_image_worker_amqp_answers_given_up_total").await,
        0.0
    );
    assert!(metric_now(refusals).await >= 3.0);
}
