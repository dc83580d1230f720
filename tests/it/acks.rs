//! Acknowledgements against the broker's consumer timeout and a command's
//! deadline. The consumer-timeout scenarios run against a RabbitMQ node of
//! their own (a node name, ports, cookie and data under a temporary
//! directory; `consumer_timeout` 4 s, checked every second), stopped at the
//! end; the default node on 5672 is never touched. The deadline test uses
//! the default node.

use crate::common;

use common::*;
use futures_util::StreamExt;
use lapin::options::*;
use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
/// The node's consumer timeout (ms).
const CONSUMER_TIMEOUT_MS: u64 = 4000;
const MINUTE: Duration = Duration::from_secs(60);

/// One RabbitMQ node of this test's own.
struct Node {
    dir: tempfile::TempDir,
    name: String,
    port: u16,
    dist_port: u16,
    child: Option<Child>,
}

impl Node {
    /// Starts node `tag` (its name: `iiw<tag><pid>@localhost`).
    fn start(tag: &str) -> Node {
        let dir = tempfile::Builder::new()
            .prefix("iiw-acks-")
            .tempdir()
            .unwrap();
        let home = dir.path();
        let cookie = home.join(".erlang.cookie");
        std::fs::write(&cookie, "IIWACKSTESTCOOKIE").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cookie, std::fs::Permissions::from_mode(0o400)).unwrap();
        std::fs::write(home.join("enabled_plugins"), "[].\n").unwrap();
        let (port, dist_port) = (free_port(), free_port());
        std::fs::write(
            home.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = {port}\nloopback_users = none\nconsumer_timeout = {CONSUMER_TIMEOUT_MS}\n"
            ),
        )
        .unwrap();
        // The consumer timeout is checked on every channel tick: every
        // second here instead of every minute.
        std::fs::write(
            home.join("advanced.config"),
            "[{rabbit, [{channel_tick_interval, 1000}]}].\n",
        )
        .unwrap();
        let name = format!("iiw{tag}{}@localhost", std::process::id());
        let mut node = Node {
            dir,
            name,
            port,
            dist_port,
            child: None,
        };
        let log = std::fs::File::create(node.dir.path().join("node.out")).unwrap();
        let mut cmd = Command::new(SERVER);
        node.env(&mut cmd);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        node.child = Some(cmd.spawn().expect("rabbitmq-server"));
        node.await_startup();
        node
    }

    /// Waits until the node runs its application (the first attempts
    /// find no node to ask yet).
    fn await_startup(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let mut cmd = Command::new(CTL);
            self.env(&mut cmd);
            let args = ["-n", &self.name, "-q", "await_startup", "--timeout", "60"];
            if cmd.args(args).output().is_ok_and(|o| o.status.success()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {} did not start; see {}",
                self.name,
                self.dir.path().display()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn env(&self, cmd: &mut Command) {
        let home = self.dir.path();
        cmd.env("HOME", home)
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", home.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", home.join("log"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                home.join("enabled_plugins"),
            )
            .env("RABBITMQ_CONFIG_FILE", home.join("rabbitmq.conf"))
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                home.join("advanced.config"),
            );
    }

    /// `rabbitmqctl -n <node> ARGS`, which must succeed; its stdout.
    fn ctl(&self, args: &[&str]) -> String {
        let mut cmd = Command::new(CTL);
        self.env(&mut cmd);
        let out = cmd.arg("-n").arg(&self.name).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?}: {}{} (see {})",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.dir.path().display()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Closes, from the broker's side, the connections named after the
    /// worker of `host`.
    fn close_worker_connections(&self, host: &str) {
        let listing = self.ctl(&[
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
                self.ctl(&["close_connection", pid, "closed by the test"]);
                closed += 1;
            }
        }
        assert_eq!(closed, 1, "one worker connection: {listing}");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let mut cmd = Command::new(CTL);
            self.env(&mut cmd);
            let stopped = cmd
                .args(["-n", &self.name, "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !stopped {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// A client of `url`: commands out, replies in (counted per correlation id).
struct Client {
    channel: lapin::Channel,
    reply_queue: String,
    replies: tokio::sync::mpsc::UnboundedReceiver<(String, serde_json::Value)>,
    conn: lapin::Connection,
}

impl Client {
    async fn connect(url: &str) -> Client {
        let conn = lapin::Connection::connect(url, Default::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let exclusive = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        };
        let q = channel
            .queue_declare("".into(), exclusive, Default::default())
            .await
            .unwrap();
        let reply_queue = q.name().as_str().to_string();
        let consume = conn.create_channel().await.unwrap();
        let no_ack = BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        };
        let mut consumer = consume
            .basic_consume(
                reply_queue.as_str().into(),
                "".into(),
                no_ack,
                Default::default(),
            )
            .await
            .unwrap();
        let (tx, replies) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let _keep = consume;
            while let Some(Ok(d)) = consumer.next().await {
                let corr = d
                    .properties
                    .correlation_id()
                    .as_ref()
                    .map(|c| c.to_string());
                let v: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
                assert_valid_completion(&v);
                if tx.send((corr.unwrap_or_default(), v)).is_err() {
                    break;
                }
            }
        });
        Client {
            channel,
            reply_queue,
            replies,
            conn,
        }
    }

    /// Sends `body` to `host` (its `expiration` in ms when given); returns
    /// the correlation id.
    async fn send(&self, host: &str, body: &serde_json::Value, expiration: Option<u64>) -> String {
        let corr = uuid::Uuid::new_v4().to_string();
        let mut props = lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_reply_to(self.reply_queue.as_str().into())
            .with_correlation_id(corr.as_str().into());
        if let Some(ms) = expiration {
            props = props.with_expiration(ms.to_string().as_str().into());
        }
        let action = body["action"].as_str().unwrap();
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let key = format!("{host}.node.{action}");
        let confirm = self
            .channel
            .basic_publish(
                "ironic-image-worker".into(),
                key.as_str().into(),
                mandatory,
                body.to_string().as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(confirm, lapin::Confirmation::Ack(None), "routed");
        corr
    }

    /// The answers to `sent`, waiting up to `within` for all of them and
    /// then `quiet` longer for duplicates: answers per correlation id.
    async fn answers(
        &mut self,
        sent: &[String],
        within: Duration,
        quiet: Duration,
    ) -> HashMap<String, Vec<serde_json::Value>> {
        let mut seen: HashMap<String, Vec<serde_json::Value>> = HashMap::new();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let all = sent.iter().all(|c| seen.contains_key(c));
            let until = if all {
                tokio::time::Instant::now() + quiet
            } else {
                deadline
            };
            match tokio::time::timeout_at(until, self.replies.recv()).await {
                Ok(Some((corr, v))) => seen.entry(corr).or_default().push(v),
                _ => return seen,
            }
        }
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

/// A node of this test's own, `tag` naming it.
fn own_node(tag: &'static str) -> Node {
    assert!(
        Path::new(SERVER).exists(),
        "{SERVER} missing: install rabbitmq-server"
    );
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
        let mut client = Client::connect(&node.url()).await;
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
        let mut client = Client::connect(&node.url()).await;
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

/// A prepare waiting for a prepare slot when the connection is lost, whose
/// redelivered copy goes to another consumer: deferring it must not tear
/// down the new, healthy connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferring_a_copy_of_a_lost_connection_keeps_the_new_one() {
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
    let mut client = Client::connect(&node.url()).await;
    // One prepare slot (prefetch 2): the slow prepare holds it, the other
    // one waits and is deferred every 2 s.
    let slow = prepare_cmd(&common::node(), &faults.url("slow", "slow.img"));
    let fast = prepare_cmd(&common::node(), &faults.url("fast", "fast.img"));
    let sent = [
        client.send(&env.host, &slow, None).await,
        client.send(&env.host, &fast, None).await,
    ];
    let deferred = || async {
        let text = worker.metrics_text().await;
        metric(
            &text,
            "ironic_image_worker_ignored_messages_total{reason=\"deferred_prepare\"}",
        )
        .unwrap_or(0.0)
    };
    let started = Instant::now();
    while deferred().await < 1.0 {
        assert!(
            started.elapsed() < MINUTE,
            "the waiting prepare is deferred"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Another consumer takes what the lost connection leaves, so the
    // waiting prepare's copy is not redelivered to the worker.
    let thief = client.conn.create_channel().await.unwrap();
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

/// A command's `expiration` is its deadline: a prepare deferred (every
/// prepare slot busy) keeps the deadline of its first delivery, and is
/// answered `expired` once it passed instead of starting then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_prepare_keeps_its_deadline() {
    let env = Env::new("[amqp]\nprefetch = 2\n");
    let faults = slow_source(&env, "slow.img").await;
    std::fs::write(env.root().join("src/late.img"), b"late image bytes").unwrap();
    let _worker = env.serve().await;
    let mut client = Client::connect(AMQP_URL).await;
    let slow = prepare_cmd(&common::node(), &faults.url("slow", "slow.img"));
    let late = prepare_cmd(&common::node(), &faults.url("fast", "late.img"));
    let first = client.send(&env.host, &slow, None).await;
    // 5 s: deferred twice while the slow one (16 s) holds the only slot.
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
