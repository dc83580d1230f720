//! Connection loss and a RabbitMQ restart while 500 commands are queued or in
//! flight: the worker reconnects with backoff, reports not-ready meanwhile,
//! and every command is answered (duplicates identical), none lost.
//! Its own test binary: it stops the broker every other test relies on.

#[path = "it/common/mod.rs"]
mod common;

use common::*;
use futures_util::StreamExt;
use lapin::options::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn rabbitmqctl(args: &[&str]) {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts the broker application again when dropped, whatever happened, so
/// a failure here never leaves the other tests without a broker.
struct AppRestart;

impl Drop for AppRestart {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .arg("start_app")
            .status();
        let _ = std::process::Command::new("rabbitmqctl")
            .arg("await_startup")
            .status();
    }
}

async fn connect_retrying() -> lapin::Connection {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default()).await {
            Ok(c) => return c,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await
            }
            Err(e) => panic!("broker did not come back: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_survive_connection_loss_and_broker_restart() {
    const COUNT: usize = 500;
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1 << 20, 81);
    // A slow first download keeps every command queued or in flight when
    // the connections are cut.
    let faults = FaultServer::start(&env.root().join("src"), 256 << 10).await;
    let worker = env.serve().await;
    // A durable reply queue: replies must survive the restart too.
    let replies_queue = format!("iiw-test-replies-{}", env.host);
    let conn = connect_retrying().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.queue_declare(
        replies_queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await
    .unwrap();
    let md5 = md5sum(&src);
    for i in 0..COUNT {
        let mut cmd = prepare_cmd(&node(), &faults.url("slow", "disk.img"));
        cmd["instance_info"]["image_checksum"] = md5.clone().into();
        let props = lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_reply_to(replies_queue.as_str().into())
            .with_correlation_id(format!("c{i}").as_str().into());
        ch.basic_publish(
            "ironic-image-worker".into(),
            format!("{}.node.prepare", env.host).as_str().into(),
            BasicPublishOptions::default(),
            cmd.to_string().as_bytes(),
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    // Cut every connection, then restart the broker application.
    // (Quorum queue counters lag; the classic reply queue's count is exact.)
    let listing = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "name", "messages"])
        .output()
        .unwrap();
    let answered_before: usize = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{replies_queue}\t"))
                .and_then(|n| n.trim().parse().ok())
        })
        .expect("reply queue listed");
    let pending = COUNT - answered_before;
    assert!(pending > 0, "commands were unanswered at the cut");
    rabbitmqctl(&["close_all_connections", "fault test"]);
    let restart = AppRestart;
    rabbitmqctl(&["stop_app"]);
    let readyz = worker.metrics_url("/readyz");
    let mut not_ready = false;
    for _ in 0..50 {
        if reqwest::get(&readyz).await.unwrap().status() == 503 {
            not_ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(not_ready, "/readyz reports the lost broker");
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(restart);

    let conn = connect_retrying().await;
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            replies_queue.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
    let mut seen: HashMap<String, serde_json::Value> = HashMap::new();
    let mut duplicates = 0;
    let deadline = Instant::now() + Duration::from_secs(240);
    while seen.len() < COUNT {
        let left = deadline.saturating_duration_since(Instant::now());
        let d = tokio::time::timeout(left, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {COUNT} answered", seen.len()))
            .unwrap()
            .unwrap();
        let corr = d
            .properties
            .correlation_id()
            .as_ref()
            .unwrap()
            .as_str()
            .to_string();
        let v: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_valid_completion(&v);
        assert_eq!(v["status"], "success", "{v}");
        assert_eq!(v["image_checksum"], md5);
        if let Some(prev) = seen.insert(corr, v.clone()) {
            duplicates += 1;
            assert_eq!(
                prev["image_url"], v["image_url"],
                "duplicates are identical"
            );
        }
    }
    eprintln!(
        "{COUNT} commands, {pending} unanswered at the cut: {} answered, {duplicates} duplicate answers, 0 lost",
        seen.len()
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while reqwest::get(&readyz).await.unwrap().status() != 200 {
        assert!(Instant::now() < deadline, "ready again after reconnecting");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics = worker.metrics_text().await;
    assert!(
        metric(&metrics, "ironic_image_worker_amqp_reconnects_total") >= Some(1.0),
        "{metrics}"
    );
    let _ = ch
        .queue_delete(replies_queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    for q in [
        format!("ironic-image-worker.{}", env.host),
        format!("ironic-image-worker.{}.dead", env.host),
    ] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}
