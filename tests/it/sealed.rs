//! Sealed commands and answers on the real broker (`[amqp]seal_secret_file`,
//! docs/contract.md "Sealed commands and answers"): a participant of the
//! broker without the key gets no command worked. Unsealed, forged,
//! tampered, re-aimed, expired and replayed commands are dead-lettered
//! with their reason, counted and never worked (no download, no file
//! linked); a genuine command is worked and its answer sealed for its
//! reply queue;
//! `send` seals with the worker's own key; Ironic's notifications, which
//! nobody seals, only warm.
//!
//! The seals are made here with the documented wire form, written again
//! for the test (HMAC-SHA256 over the length-prefixed fields).

use crate::common;

use common::*;
use hmac::{KeyInit, Mac};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Duration;

const KEY: [u8; 32] = [7; 32];
const OTHER_KEY: [u8; 32] = [9; 32];

/// A key file of `keys` (hex, one a line), mode 0600.
fn key_file(dir: &Path, name: &str, keys: &[[u8; 32]]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let text: Vec<String> = keys.iter().map(hex::encode).collect();
    std::fs::write(&path, text.join("\n") + "\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// One field of the canonical encoding: absent, or present with its length.
fn field(out: &mut Vec<u8>, value: Option<&[u8]>) {
    match value {
        None => out.push(0),
        Some(v) => {
            out.push(1);
            out.extend_from_slice(&(v.len() as u64).to_be_bytes());
            out.extend_from_slice(v);
        }
    }
}

/// What a seal covers besides the body.
#[derive(Clone, Copy)]
struct Aim<'a> {
    kind: &'a str,
    routing_key: &'a str,
    reply_to: Option<&'a str>,
    correlation_id: Option<&'a str>,
}

/// The `x-iiw-seal` header of `body` in `aim`, sealed with `key` at `at`,
/// valid `valid` ms (docs/contract.md).
fn seal(key: &[u8], aim: Aim<'_>, body: &[u8], at: u64, valid: u64) -> String {
    let id = hex::encode(
        &Sha256::digest([b"ironic-image-worker seal key v1\n".as_slice(), key].concat())[..8],
    );
    let mut text = b"ironic-image-worker seal v1\n".to_vec();
    for value in [
        Some(aim.kind.as_bytes()),
        Some(id.as_bytes()),
        Some(aim.routing_key.as_bytes()),
        aim.reply_to.map(str::as_bytes),
        aim.correlation_id.map(str::as_bytes),
        Some(at.to_string().as_bytes()),
        Some(valid.to_string().as_bytes()),
        Some(body),
    ] {
        field(&mut text, value);
    }
    let mut mac = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(key).unwrap();
    mac.update(&text);
    format!(
        "1:{id}:{at}:{valid}:{}",
        hex::encode(mac.finalize().into_bytes())
    )
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Command properties answered to `reply_to`, carrying `sealed` when given.
fn props(correlation: &str, reply_to: &str, sealed: Option<String>) -> lapin::BasicProperties {
    let mut headers = FieldTable::default();
    if let Some(s) = sealed {
        headers.insert("x-iiw-seal".into(), AMQPValue::LongString(s.into()));
    }
    Broker::properties(correlation, Some(headers), Some(reply_to))
}

/// `ironic_image_worker_ignored_messages_total{reason=...}` of `worker`.
async fn ignored(worker: &Worker, reason: &str) -> f64 {
    let (_, text) = get(&worker.metrics_url("/metrics")).await;
    let text = String::from_utf8_lossy(&text);
    let line = format!("ironic_image_worker_ignored_messages_total{{reason=\"{reason}\"}}");
    metric(&text, &line).unwrap_or(0.0)
}

/// Waits until `worker` counted `n` messages ignored for `reason`.
async fn counted(worker: &Worker, reason: &str, n: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while ignored(worker, reason).await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{reason}: {} counted, {n} expected",
            ignored(worker, reason).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An answer on the test's reply queue, as published.
struct Answer {
    seal: Option<String>,
    body: Vec<u8>,
    done: Value,
    correlation_id: String,
}

/// A sealed worker, its broker client, a source serving `disk.img`, a
/// queue of the test's own for answers (read with their headers) and an
/// exchange of its own for Ironic's notifications ([`Env::notified_alone`]).
struct Sealed {
    env: Env,
    server: SourceServer,
    worker: Worker,
    broker: Broker,
    replies: String,
    _keys: tempfile::TempDir,
}

impl Sealed {
    /// A worker sealing with [`KEY`], `lines` more in its `[amqp]`.
    async fn start(lines: &str) -> Sealed {
        let keys = tempfile::tempdir().unwrap();
        let file = key_file(keys.path(), "seal.key", &[KEY]);
        let env = Env::notified_alone(&format!(
            "seal_secret_file = \"{}\"\n{lines}",
            file.display()
        ));
        random_file(&env.root().join("src/disk.img"), 1 << 20, 58);
        let server = SourceServer::start(&env.root().join("src")).await;
        let worker = env.serve().await;
        let broker = Broker::connect().await;
        let replies = format!("seal-test-replies-{}", uuid::Uuid::new_v4().simple());
        broker
            .channel
            .queue_declare(
                replies.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        Sealed {
            env,
            server,
            worker,
            broker,
            replies,
            _keys: keys,
        }
    }

    /// The routing key of `action` to this worker.
    fn key(&self, action: &str) -> String {
        format!("{}.node.{action}", self.env.host)
    }

    /// A command to `routing_key`, answered to the test's queue.
    fn aim<'a>(&'a self, routing_key: &'a str, correlation: &'a str) -> Aim<'a> {
        Aim {
            kind: "command",
            routing_key,
            reply_to: Some(&self.replies),
            correlation_id: Some(correlation),
        }
    }

    /// Up to `n` answers on the test's reply queue within `wait`.
    async fn answers(&self, n: usize, wait: Duration) -> Vec<Answer> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut out = Vec::new();
        while out.len() < n && tokio::time::Instant::now() < deadline {
            for m in self.broker.drain(&self.replies).await {
                let p = &m.delivery.properties;
                let seal = p
                    .headers()
                    .as_ref()
                    .and_then(|h| match h.inner().get("x-iiw-seal") {
                        Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                        _ => None,
                    });
                out.push(Answer {
                    seal,
                    done: serde_json::from_slice(&m.delivery.data).unwrap(),
                    body: m.delivery.data.clone(),
                    correlation_id: p.correlation_id().as_ref().unwrap().to_string(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        out
    }

    fn node_files(&self, node: &str) -> Vec<PathBuf> {
        [
            self.env.images_dir().join(node).join("disk"),
            self.env.link_dir().join(node),
        ]
        .into_iter()
        .filter(|p| p.symlink_metadata().is_ok())
        .collect()
    }

    /// Binds (or unbinds) this worker's queue to `routing_key` on the
    /// command exchange, as anyone on the broker may.
    async fn bind(&self, routing_key: &str, bind: bool) {
        let ch = &self.broker.channel;
        let queue = format!("ironic-image-worker.{}", self.env.host);
        let (q, x, k) = (
            queue.as_str().into(),
            "ironic-image-worker".into(),
            routing_key.into(),
        );
        if bind {
            ch.queue_bind(q, x, k, Default::default(), FieldTable::default())
                .await
                .unwrap();
        } else {
            ch.queue_unbind(q, x, k, FieldTable::default())
                .await
                .unwrap();
        }
    }

    /// Publishes `body` with `props` to `routing_key` on the command
    /// exchange, confirmed.
    async fn publish(&self, routing_key: &str, body: &[u8], props: lapin::BasicProperties) {
        self.broker.publish_routed(routing_key, body, props).await;
    }
}

/// Checks the seal of `answer` as the deploy interface checks it: made
/// with [`KEY`] over the body as published, for the test's reply queue and
/// the answer's correlation id.
fn assert_answer_sealed(s: &Sealed, answer: &Answer) {
    let header = answer.seal.as_deref().expect("the answer is sealed");
    let at: u64 = header.split(':').nth(2).unwrap().parse().unwrap();
    let aim = Aim {
        kind: "answer",
        routing_key: &s.replies,
        reply_to: None,
        correlation_id: Some(&answer.correlation_id),
    };
    assert_eq!(header, seal(&KEY, aim, &answer.body, at, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_without_a_good_seal_are_dead_lettered_unworked() {
    let s = Sealed::start("").await;
    let node = node();
    let body = prepare_cmd(&node, &s.server.url("disk.img")).to_string();
    let body = body.as_bytes();
    let now = now_ms();
    let corr = "c-refused";
    let key = s.key("prepare");
    let aim = s.aim(&key, corr);
    let elsewhere = format!("other-{}.node.prepare", s.env.host);
    let sealed =
        |aim: Aim<'_>, body: &[u8], at: u64, valid: u64| Some(seal(&KEY, aim, body, at, valid));
    let cases: Vec<(&str, Option<String>, &str)> = vec![
        ("unsealed", None, "unsealed"),
        (
            "sealed with another key",
            Some(seal(&OTHER_KEY, aim, body, now, 60_000)),
            "bad_seal",
        ),
        (
            "sealed over another body",
            sealed(aim, b"{}", now, 60_000),
            "bad_seal",
        ),
        (
            "sealed for another routing key",
            sealed(
                Aim {
                    routing_key: &elsewhere,
                    ..aim
                },
                body,
                now,
                60_000,
            ),
            "bad_seal",
        ),
        (
            "sealed for another reply_to",
            sealed(
                Aim {
                    reply_to: Some("someone-elses"),
                    ..aim
                },
                body,
                now,
                60_000,
            ),
            "bad_seal",
        ),
        (
            "sealed for another correlation_id",
            sealed(
                Aim {
                    correlation_id: Some("c-other"),
                    ..aim
                },
                body,
                now,
                60_000,
            ),
            "bad_seal",
        ),
        (
            "a genuine command after its window (a late replay)",
            sealed(aim, body, now - 40 * 60_000, 30 * 60_000),
            "bad_seal",
        ),
        (
            "sealed an hour ahead",
            sealed(aim, body, now + 3_600_000, 60_000),
            "bad_seal",
        ),
    ];
    let mut expected = std::collections::HashMap::new();
    for (what, seal_header, reason) in &cases {
        s.publish(&key, body, props(corr, &s.replies, seal_header.clone()))
            .await;
        *expected.entry(*reason).or_insert(0.0) += 1.0;
        counted(&s.worker, reason, expected[reason]).await;
        eprintln!("refused as {reason}: {what}");
    }
    // A genuine command of another conductor, routed to this worker's
    // queue by a binding anyone may add: its seal holds for its routing
    // key, but it is not this worker's.
    s.bind(&elsewhere, true).await;
    let theirs = sealed(
        Aim {
            routing_key: &elsewhere,
            ..aim
        },
        body,
        now,
        60_000,
    );
    s.publish(&elsewhere, body, props(corr, &s.replies, theirs))
        .await;
    counted(&s.worker, "bad_seal", expected["bad_seal"] + 1.0).await;
    s.bind(&elsewhere, false).await;

    let dead = s
        .broker
        .drain(&format!("ironic-image-worker.{}.dead", s.env.host))
        .await;
    assert_eq!(
        dead.len(),
        cases.len() + 1,
        "every refused command is dead-lettered"
    );
    assert!(
        s.answers(1, Duration::from_secs(1)).await.is_empty(),
        "none answered"
    );
    assert!(s.node_files(&node).is_empty(), "nothing linked");
    assert_eq!(s.server.count("GET", "disk.img"), 0, "nothing downloaded");
    assert!(s.env.masters().is_empty());

    // The genuine command is worked; its answer is sealed for its queue.
    let genuine = props(corr, &s.replies, sealed(aim, body, now, 60_000));
    s.publish(&key, body, genuine.clone()).await;
    let answers = s.answers(1, Duration::from_secs(60)).await;
    assert_eq!(answers[0].done["status"], "success", "{}", answers[0].done);
    assert_eq!(s.node_files(&node).len(), 2);
    assert_answer_sealed(&s, &answers[0]);

    // Cleaned up, then the very same sealed prepare again within its
    // window, as anyone who saw it may publish it: refused, nothing linked
    // again.
    let cleanup = json!({"action": "cleanup", "node_uuid": node, "request_id": "r-clean"});
    let cleanup = cleanup.to_string();
    let ckey = s.key("cleanup");
    let caim = s.aim(&ckey, "c-clean");
    let cp = props(
        "c-clean",
        &s.replies,
        sealed(caim, cleanup.as_bytes(), now_ms(), 60_000),
    );
    s.publish(&ckey, cleanup.as_bytes(), cp).await;
    let cleaned = s.answers(1, Duration::from_secs(30)).await;
    assert_eq!(cleaned[0].done["status"], "success");
    assert!(s.node_files(&node).is_empty());
    let refused = ignored(&s.worker, "bad_seal").await;
    s.publish(&key, body, genuine).await;
    // Refused when read: counted, dead-lettered, never worked.
    counted(&s.worker, "bad_seal", refused + 1.0).await;
    assert!(s.answers(1, Duration::from_millis(200)).await.is_empty());
    assert!(
        s.node_files(&node).is_empty(),
        "a replay links nothing again"
    );
    assert_eq!(s.server.count("GET", "disk.img"), 1, "downloaded once");
}

/// `[amqp]seal = "send"` (a rolling upgrade: the deploy interface does
/// not seal yet): an unsealed command is worked and answered sealed; a
/// command carrying a seal that does not hold is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_mode_takes_unsealed_commands_but_no_forged_one() {
    let s = Sealed::start("seal = \"send\"\n").await;
    let node = node();
    let body = prepare_cmd(&node, &s.server.url("disk.img")).to_string();
    let key = s.key("prepare");
    let forged = seal(
        &OTHER_KEY,
        s.aim(&key, "c-1"),
        body.as_bytes(),
        now_ms(),
        60_000,
    );
    s.publish(
        &key,
        body.as_bytes(),
        props("c-1", &s.replies, Some(forged)),
    )
    .await;
    counted(&s.worker, "bad_seal", 1.0).await;
    assert!(s.node_files(&node).is_empty());
    s.publish(&key, body.as_bytes(), props("c-2", &s.replies, None))
        .await;
    let answers = s.answers(1, Duration::from_secs(60)).await;
    assert_eq!(answers[0].done["status"], "success", "{}", answers[0].done);
    assert_eq!(answers[0].correlation_id, "c-2");
    assert_answer_sealed(&s, &answers[0]);
    assert_eq!(s.node_files(&node).len(), 2);
    assert_eq!(ignored(&s.worker, "unsealed").await, 0.0);
}

/// The worker's own `send` seals with the worker's key, so it works
/// against a worker that requires seals (and checks the answer's seal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_send_seals_with_the_workers_key() {
    let s = Sealed::start("").await;
    let node = node();
    let url = s.server.url("disk.img");
    let out = s
        .env
        .run(&[
            "send",
            "prepare",
            "--node",
            &node,
            "--image-source",
            &url,
            "--wait",
            "--timeout",
            "60",
        ])
        .await;
    let (ok, done) = completion_of(&out);
    assert!(ok, "{done}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(s.node_files(&node).len(), 2);
    assert_eq!(ignored(&s.worker, "unsealed").await, 0.0);
}

/// An oslo.messaging notification (unwrapped) of a provision-state
/// change of `node` by this host's conductor.
fn notification(host: &str, node: &str, states: (&str, &str, &str), url: &str) -> Vec<u8> {
    let (previous, state, event) = states;
    json!({
        "message_id": uuid::Uuid::new_v4().to_string(),
        "publisher_id": format!("ironic-conductor.{host}"),
        "event_type": "baremetal.node.provision_set.start",
        "timestamp": "2099-01-01 00:00:00.000000",
        "payload": {"ironic_object.data": {
            "uuid": node, "provision_state": state,
            "previous_provision_state": previous, "event": event,
            "deploy_interface": "direct-worker",
            "instance_info": {"image_source": url},
        }},
    })
    .to_string()
    .into_bytes()
}

/// Nobody seals Ironic's notifications: with a seal, a notification's
/// prepare only warms the image (no node's file is linked), its deployed
/// and cleanup change nothing (counted `unsealed_notification`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsealed_notifications_only_warm() {
    let s = Sealed::start("").await;
    let url = s.server.url("disk.img");
    let tap = EventTap::new(&s.broker).await;
    let fresh = node();
    let deploy = ("available", "deploying", "deploy");
    s.broker
        .publish_notification_on(
            s.env.notification_exchange(),
            &notification(&s.env.host, &fresh, deploy, &url),
        )
        .await;
    let (key, _, warmed) = tap
        .next(&s.env.host, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(key, "image.warm.success", "{warmed}");
    assert_eq!(s.env.masters().len(), 1, "the image is cached");
    assert!(s.node_files(&fresh).is_empty(), "no node's file linked");

    // A node prepared by a sealed command keeps its files whatever
    // notifications say of it.
    let node = node();
    let body = prepare_cmd(&node, &url).to_string();
    let key = s.key("prepare");
    let sealed = seal(&KEY, s.aim(&key, "c-n"), body.as_bytes(), now_ms(), 60_000);
    s.publish(
        &key,
        body.as_bytes(),
        props("c-n", &s.replies, Some(sealed)),
    )
    .await;
    assert_eq!(s.answers(1, Duration::from_secs(60)).await.len(), 1);
    assert_eq!(s.node_files(&node).len(), 2);
    for states in [
        ("deploying", "active", "done"),
        ("active", "deleting", "delete"),
        ("deploying", "deploy failed", "fail"),
    ] {
        s.broker
            .publish_notification_on(
                s.env.notification_exchange(),
                &notification(&s.env.host, &node, states, &url),
            )
            .await;
    }
    counted(&s.worker, "unsealed_notification", 3.0).await;
    assert_eq!(s.node_files(&node).len(), 2, "nothing withdrawn");
    assert_eq!(s.server.count("GET", "disk.img"), 1, "one download");
}

/// The deploy interface in Ironic 39 against a sealed worker
/// (`ironic-plugin/.../tests/test_sealed.py`, which starts the worker of
/// this environment with its seal options): forged and unsealed answers
/// ahead of the genuine one skipped, a key rotation and a rolling upgrade
/// without a lost prepare. The plug-in runs from this checkout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_deploy_interface_in_ironic() {
    let python = tokio::task::spawn_blocking(ironic_python).await.unwrap();
    let plugin = crate::common::plugin::plugin_dir();
    let env = Env::new("");
    let dir = |p: &Path| p.display().to_string();
    let (passed, text) = crate::common::plugin::pytest(
        &python,
        &["ironic_image_worker_deploy/tests/test_sealed.py"],
        &env,
        &[
            ("PYTHONPATH", dir(&plugin)),
            ("IIW_GLANCE_PORT", free_port().to_string()),
            ("IIW_SEALED_CONFIG", dir(&env.config)),
            ("IIW_SEALED_METRICS_PORT", env.metrics_port.to_string()),
        ],
    )
    .await;
    assert!(passed, "pytest failed:\n{text}");
    assert!(text.contains("3 passed"), "every case ran:\n{text}");
}
