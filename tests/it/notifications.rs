//! Driving the worker from Ironic's own versioned notifications: emitted by
//! Ironic's notification code through oslo.messaging to the real broker.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::time::Duration;

fn transition(
    node: &str,
    status: &str,
    prev: &str,
    state: &str,
    event: &str,
    info: &Value,
) -> Value {
    json!({"node": node, "status": status, "prev_state": prev, "state": state,
           "target": if state == "deploying" || state == "wait call-back" { json!("active") } else { Value::Null },
           "event": event, "instance_info": info})
}

/// The notification of a node that starts deploying from `available`.
fn deploy_starts(node: &str, info: &Value) -> Value {
    transition(node, "start", "available", "deploying", "deploy", info)
}

/// The notifications Ironic sends for a successful direct deploy.
fn deploy(node: &str, info: &Value, from: &str, event: &str) -> Vec<Value> {
    vec![
        transition(node, "start", from, "deploying", event, info),
        transition(node, "success", "deploying", "wait call-back", "wait", info),
        transition(
            node,
            "success",
            "wait call-back",
            "deploying",
            "resume",
            info,
        ),
        transition(node, "end", "deploying", "active", "done", info),
    ]
}

const WAIT: Duration = Duration::from_secs(60);

/// A worker listening to Ironic's notifications and a tap on its events,
/// with one random 1 MiB image `a.img` (made from `seed`) served over HTTP.
async fn one_image(seed: u64) -> (Env, SourceServer, Worker, Broker, EventTap) {
    let env = Env::new("");
    random_file(&env.root().join("src/a.img"), 1 << 20, seed);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    (env, server, worker, broker, tap)
}

/// As [`one_image`], with a random 4 MiB image `a.img` (made from `seed`) behind a
/// [`FaultServer`] whose `slow` mode sends 1 MiB/s.
async fn slow_image(seed: u64) -> (Env, FaultServer, Worker, Broker, EventTap) {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 4 << 20, seed);
    let faults = FaultServer::start(&src, 1 << 20).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    (env, faults, worker, broker, tap)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_deploy_then_rebuild_then_teardown() {
    let env = Env::new("");
    let mut ironic = Notifier::start(&env.host);
    let a = env.root().join("src/a.img");
    let b = env.root().join("src/b.img");
    random_file(&a, 2 << 20, 31);
    random_file(&b, 2 << 20, 32);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    let node = node();
    let link = env.link_dir().join(&node);
    let info_a = json!({"image_source": server.url("a.img"), "image_checksum": md5sum(&a), "image_url": "******"});

    // deploying (start): prepared. Symlink there until active (end).
    let steps = deploy(&node, &info_a, "available", "deploy");
    ironic.emit(&steps[..1]).await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0]["action"], "prepare");
    assert_served(&ev[0], &a);
    assert!(
        ev[0]["request_id"]
            .as_str()
            .is_some_and(|id| id.len() == 36),
        "message_id echoed"
    );
    assert!(link.symlink_metadata().is_ok());
    let (status, body) = get(ev[0]["image_url"].as_str().unwrap()).await;
    assert_eq!((status, body), (200, std::fs::read(&a).unwrap()));
    ironic.emit(&steps[1..]).await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev[0]["action"], "deployed", "{ev:?}");
    assert!(link.symlink_metadata().is_err(), "symlink gone once active");

    // Rebuild with another image.
    let info_b = json!({"image_source": server.url("b.img"), "image_url": "******"});
    ironic
        .emit(&deploy(&node, &info_b, "active", "rebuild")[..1])
        .await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev[0]["action"], "prepare");
    assert_served(&ev[0], &b);
    assert_eq!(
        get(ev[0]["image_url"].as_str().unwrap()).await.1,
        std::fs::read(&b).unwrap()
    );

    // Teardown: deleting cleans up once; the cleaning/available that follow are quiet.
    ironic
        .emit(&[
            transition(&node, "start", "active", "deleting", "deleted", &info_b),
            transition(
                &node,
                "success",
                "deleting",
                "cleaning",
                "clean",
                &json!({}),
            ),
            transition(&node, "end", "cleaning", "available", "done", &json!({})),
        ])
        .await;
    let ev = tap.collect(&env.host, 3, Duration::from_secs(5)).await;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0]["action"], "cleanup");
    assert!(!env.images_dir().join(&node).exists());
    assert!(link.symlink_metadata().is_err());
    assert_eq!(server.count("GET", "a.img"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_deploy_keeps_the_link_until_teardown() {
    let (env, server, _worker, _broker, tap) = one_image(33).await;
    let mut ironic = Notifier::start(&env.host);
    let node = node();
    let link = env.link_dir().join(&node);
    let info = json!({"image_source": server.url("a.img")});

    // The start arrives twice (redelivery): the same answer, one download.
    let start = deploy_starts(&node, &info);
    ironic.emit(&[start.clone(), start]).await;
    let ev = tap.collect(&env.host, 2, WAIT).await;
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0]["image_url"], ev[1]["image_url"]);
    assert_eq!(ev[0]["image_checksum"], ev[1]["image_checksum"]);
    assert_eq!(server.count("GET", "a.img"), 1);

    ironic
        .emit(&[transition(
            &node,
            "error",
            "wait call-back",
            "deploy failed",
            "fail",
            &info,
        )])
        .await;
    assert!(
        tap.collect(&env.host, 1, Duration::from_secs(3))
            .await
            .is_empty()
    );
    assert!(
        link.symlink_metadata().is_ok(),
        "deploy failed keeps the symlink for debugging"
    );

    ironic
        .emit(&[transition(
            &node,
            "start",
            "deploy failed",
            "deleting",
            "deleted",
            &info,
        )])
        .await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev[0]["action"], "cleanup");
    assert!(link.symlink_metadata().is_err());
    // A cleanup for a node never prepared here: answered, harmless.
    let other = common::node();
    ironic
        .emit(&[transition(
            &other,
            "start",
            "active",
            "deleting",
            "deleted",
            &json!({}),
        )])
        .await;
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(
        (ev[0]["action"].as_str(), ev[0]["status"].as_str()),
        (Some("cleanup"), Some("success"))
    );
}

/// As [`one_image`], the worker reading notifications on an exchange of
/// the test's own (returned): what other tests send on Ironic's reaches
/// every running worker, and would be counted or dead-lettered here too.
async fn one_image_alone(seed: u64) -> (Env, SourceServer, Worker, Broker, EventTap, String) {
    let env = Env::notified_alone("");
    let exchange = env.notification_exchange().to_string();
    random_file(&env.root().join("src/a.img"), 1 << 20, seed);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    (env, server, worker, broker, tap, exchange)
}

/// Another conductor's deploy is counted as ignored and leaves the node
/// alone: no answer, nothing on disk; the same notification from this
/// conductor is then worked (its answer the first event about the node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_conductors_notification_is_counted_and_left_alone() {
    let (env, server, worker, _broker, tap, exchange) = one_image_alone(34).await;
    let node = node();
    let info = json!({"image_source": server.url("a.img")});
    let start = |host: &str| emit_notifications_on(&exchange, host, &[deploy_starts(&node, &info)]);
    start(&format!("{}-other", env.host));
    worker
        .wait_metric(
            "ironic_image_worker_ignored_messages_total{reason=\"other_publisher\"}",
            1.0,
        )
        .await;
    assert!(!env.link_dir().join(&node).exists());
    assert_eq!(server.count("GET", "a.img"), 0, "nothing downloaded");
    start(&env.host);
    let ev = tap.collect(&env.host, 1, WAIT).await;
    assert_eq!(ev[0]["status"], "success", "{ev:?}");
    assert_eq!(ev[0]["node_uuid"], node.as_str(), "{ev:?}");
}

/// Malformed notifications on Ironic's exchange are each answered with
/// `invalid_message` and dead-lettered; the worker works the next command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_notifications_are_answered_and_dead_lettered() {
    let (env, server, _worker, broker, tap, exchange) = one_image_alone(36).await;
    let bodies = [
        b"{\"oslo.version\": \"2.0\", \"oslo.message\": \"{not json\"}".to_vec(),
        json!({"oslo.version": "2.0", "oslo.message": json!({"message_id": "m-1",
            "publisher_id": format!("ironic-conductor.{}", env.host),
            "event_type": "baremetal.node.provision_set.start", "priority": "INFO",
            "payload": {"ironic_object.data": {"provision_state": "deploying", "event": "deploy"}}}).to_string()})
            .to_string()
            .into_bytes(),
    ];
    for body in &bodies {
        broker.publish_notification_on(&exchange, body).await;
    }
    let events = tap.collect_any(&env.host, 2, WAIT).await;
    assert_eq!(events.len(), 2, "{events:?}");
    for ev in &events {
        assert_eq!(ev["error"]["code"], "invalid_message", "{ev}");
    }
    assert!(
        events.iter().any(|e| e["request_id"] == "m-1"),
        "{events:?}"
    );
    let dead = format!("ironic-image-worker.{}.dead", env.host);
    let mut got = Vec::new();
    for _ in 0..60 {
        got.extend(broker.drain(&dead).await);
        if got.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut got: Vec<&[u8]> = got.iter().map(|m| &m.delivery.data[..]).collect();
    got.sort();
    let mut bodies: Vec<&[u8]> = bodies.iter().map(|b| &b[..]).collect();
    bodies.sort();
    assert_eq!(got, bodies, "both dead-lettered, bytes intact");
    let ok = broker
        .call(&env.host, prepare_cmd(&node(), &server.url("a.img")))
        .await;
    assert_eq!(ok["status"], "success", "{ok}");
}

/// The next `n` events about `node` (within the usual wait).
async fn node_events(tap: &EventTap, host: &str, node: &str, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut out = Vec::new();
    while out.len() < n {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tap.next(host, left).await {
            Some((_, _, v)) if v["node_uuid"] == node => out.push(v),
            Some(_) => {}
            None => break,
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_ironic_prepares_itself_are_never_touched() {
    let (env, server, worker, _broker, tap) = one_image(35).await;
    let node = node();
    let info = json!({"image_source": server.url("a.img")});
    let stock = |mut t: Value| {
        t["deploy_interface"] = json!("direct");
        t
    };
    // A whole deploy and teardown of a stock `direct` node.
    let mut steps: Vec<Value> = deploy(&node, &info, "available", "deploy")
        .into_iter()
        .map(stock)
        .collect();
    steps.push(stock(transition(
        &node, "start", "active", "deleting", "deleted", &info,
    )));
    steps.push(stock(transition(
        &node,
        "end",
        "cleaning",
        "available",
        "done",
        &json!({}),
    )));
    emit_notifications(&env.host, &steps);
    let sample = "ironic_image_worker_ignored_messages_total{reason=\"other_deploy_interface\"}";
    // deploying(start), active(end), deleting, available: each ignored.
    worker.wait_metric(sample, 4.0).await;
    assert!(
        tap.next(&env.host, Duration::from_millis(200))
            .await
            .is_none()
    );
    assert_eq!(server.count("GET", "a.img"), 0);
    assert_eq!(server.count("HEAD", "a.img"), 0);
    assert!(env.masters().is_empty());
    assert!(!env.images_dir().join(&node).exists());
    assert!(env.link_dir().join(&node).symlink_metadata().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_starts_early_and_the_command_is_answered_from_the_cache() {
    let (env, faults, worker, broker, tap) = slow_image(36).await;
    let node = node();
    let url = faults.url("slow", "a.img");
    emit_notifications(
        &env.host,
        &[deploy_starts(&node, &json!({"image_source": url}))],
    );
    // The deploy interface's own prepare, right after (the download at
    // 1 MiB/s is still running, or just over: one download either way).
    let reply = broker.call(&env.host, prepare_cmd(&node, &url)).await;
    let early = node_events(&tap, &env.host, &node, 1).await;
    assert_eq!(early[0]["status"], "success", "{early:?}");
    assert_eq!(early[0]["cache"], "miss");
    assert_eq!(reply["status"], "success", "{reply}");
    assert_eq!(reply["cache"], "hit", "{reply}");
    assert_served(&reply, &env.root().join("src/a.img"));
    let metrics = worker.metrics_text().await;
    assert_eq!(
        metric(&metrics, "ironic_image_worker_download_bytes_total"),
        Some((4 << 20) as f64),
        "one download in all: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_cleanup_is_decided_under_the_node_lock() {
    // A one-shot prepare (another process on the same directories) is
    // running when a cleaning/available notification for the node arrives:
    // the worker must wait for it and clean up, not call the node a stranger.
    let (env, faults, _worker, _broker, tap) = slow_image(37).await;
    let node = node();
    let url = faults.url("slow", "a.img");
    let prepare = {
        let (config, node, url) = (env.config.clone(), node.clone(), url.clone());
        tokio::spawn(async move {
            tokio::process::Command::new(BIN)
                .arg("--config")
                .arg(config)
                .args(["prepare", "--node", &node, "--image-source", &url])
                .env_remove("IRONIC_IMAGE_WORKER_CONFIG")
                .output()
                .await
                .unwrap()
        })
    };
    env.wait_for_temporary(WAIT).await;
    emit_notifications(
        &env.host,
        &[transition(
            &node,
            "end",
            "cleaning",
            "available",
            "done",
            &json!({}),
        )],
    );
    let out = prepare.await.unwrap();
    let (ok, ev) = completion_of(&out);
    assert!(ok, "{ev}");
    // (Only this node's events: malformed notifications other tests publish
    // on Ironic's exchange are answered by every worker.)
    let ev = node_events(&tap, &env.host, &node, 1).await;
    assert_eq!(ev.len(), 1, "the cleanup was dropped as not prepared here");
    assert_eq!(
        (ev[0]["action"].as_str(), ev[0]["status"].as_str()),
        (Some("cleanup"), Some("success"))
    );
    assert!(env.link_dir().join(&node).symlink_metadata().is_err());
    assert!(!env.images_dir().join(&node).exists());
}
