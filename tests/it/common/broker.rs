//! The tests' client of the real broker: commands published, their
//! completion events collected, and a tap on the events exchange.

use super::*;

/// A test client of the real broker: publishes commands and collects the
/// completion events that come back on its temporary reply queue.
pub struct Broker {
    pub conn: lapin::Connection,
    pub channel: lapin::Channel,
    pub reply_queue: String,
    replies: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<(Option<String>, Value)>>,
}

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

impl Broker {
    /// A client of the default broker on 127.0.0.1:5672.
    pub async fn connect() -> Broker {
        Broker::connect_to(AMQP_URL).await
    }

    /// A client of the broker at `url` (a test's own RabbitMQ node).
    pub async fn connect_to(url: &str) -> Broker {
        use lapin::options::*;
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {url}: {e}"));
        let channel = conn.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        let reply_queue = q.name().as_str().to_string();
        Broker::replying(conn, channel, reply_queue).await
    }

    /// A client of the broker at `url` whose answers come to `reply_queue`,
    /// a queue declared elsewhere (a durable quorum queue, as a deploy
    /// interface's).
    pub async fn connect_replying_to(url: &str, reply_queue: &str) -> Broker {
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {url}: {e}"));
        let channel = conn.create_channel().await.unwrap();
        Broker::replying(conn, channel, reply_queue.to_string()).await
    }

    /// The client of `conn` consuming `reply_queue`, publishing on `channel`
    /// (put in confirm mode).
    async fn replying(
        conn: lapin::Connection,
        channel: lapin::Channel,
        reply_queue: String,
    ) -> Broker {
        use futures_util::StreamExt;
        use lapin::options::*;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let consume = conn.create_channel().await.unwrap();
        let mut consumer = consume
            .basic_consume(
                reply_queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let _keep = consume;
            loop {
                let d = match consumer.next().await {
                    Some(Ok(d)) => d,
                    // Said, so that a test missing its answers tells why.
                    end => return eprintln!("the reply consumer stopped: {end:?}"),
                };
                let corr = d
                    .properties
                    .correlation_id()
                    .as_ref()
                    .map(|c| c.as_str().to_string());
                let v: Value = serde_json::from_slice(&d.data).expect("completion is JSON");
                assert_valid_completion(&v);
                if tx.send((corr, v)).is_err() {
                    break;
                }
            }
        });
        Broker {
            conn,
            channel,
            reply_queue,
            replies: tokio::sync::Mutex::new(rx),
        }
    }

    /// Publishes raw `body` for `host` with routing key `<host>.node.<action>`.
    pub async fn publish_raw(
        &self,
        host: &str,
        action: &str,
        body: &[u8],
        correlation_id: &str,
        headers: Option<lapin::types::FieldTable>,
        reply: bool,
    ) {
        let reply_to = reply.then_some(self.reply_queue.as_str());
        let props = Broker::properties(correlation_id, headers, reply_to);
        self.publish_props(host, action, body, props).await;
    }

    /// A persistent JSON command's properties.
    pub fn properties(
        correlation_id: &str,
        headers: Option<lapin::types::FieldTable>,
        reply_to: Option<&str>,
    ) -> lapin::BasicProperties {
        let mut props = lapin::BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_correlation_id(correlation_id.into());
        if let Some(queue) = reply_to {
            props = props.with_reply_to(queue.into());
        }
        if let Some(h) = headers {
            props = props.with_headers(h);
        }
        props
    }

    /// Publishes `body` with `props` to `<host>.node.<action>`, mandatory and
    /// confirmed: the command must reach a queue.
    pub async fn publish_props(
        &self,
        host: &str,
        action: &str,
        body: &[u8],
        props: lapin::BasicProperties,
    ) {
        self.publish_routed(&format!("{host}.node.{action}"), body, props)
            .await;
    }

    /// Publishes `body` with `props` to the command exchange under
    /// `routing_key`, mandatory and confirmed: it must reach a queue.
    pub async fn publish_routed(
        &self,
        routing_key: &str,
        body: &[u8],
        props: lapin::BasicProperties,
    ) {
        use lapin::options::*;
        let confirm = self
            .channel
            .basic_publish(
                "ironic-image-worker".into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(
            confirm,
            lapin::Confirmation::Ack(None),
            "{routing_key} routed"
        );
    }

    /// Publishes raw bytes as a notification on `exchange`, as Ironic's
    /// (`ironic_versioned_notifications.info`), confirmed by the broker.
    /// Always an exchange of the test's own: Ironic's `ironic`, which every
    /// running test's worker binds, routes to queues other tests are
    /// deleting, and the broker closes the publisher's connection for that
    /// (INTERNAL_ERROR).
    pub async fn publish_notification_on(&self, exchange: &str, body: &[u8]) {
        self.channel
            .basic_publish(
                exchange.into(),
                "ironic_versioned_notifications.info".into(),
                lapin::options::BasicPublishOptions::default(),
                body,
                Default::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Publishes `body` on exchange `exchange` with routing `key`, answered
    /// to this client's reply queue when `reply`; returns its correlation id.
    pub async fn publish_to(&self, exchange: &str, key: &str, body: &Value, reply: bool) -> String {
        use lapin::options::*;
        let corr = uuid::Uuid::new_v4().to_string();
        let mut props = lapin::BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_correlation_id(corr.as_str().into());
        if reply {
            props = props.with_reply_to(self.reply_queue.as_str().into());
        }
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.to_string().as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(confirm, lapin::Confirmation::Ack(None), "{key} was routed");
        corr
    }

    /// Publishes a command JSON and returns its correlation id.
    pub async fn command(&self, host: &str, body: Value) -> String {
        self.send(host, &body, None).await
    }

    /// Sends command `body` to `host` with a reply queue and, when given, an
    /// AMQP `expiration` in ms; returns its correlation id.
    pub async fn send(&self, host: &str, body: &Value, expiration: Option<u64>) -> String {
        let corr = uuid::Uuid::new_v4().to_string();
        let action = body["action"].as_str().unwrap_or("prepare").to_string();
        let mut props = Broker::properties(&corr, None, Some(&self.reply_queue));
        if let Some(ms) = expiration {
            props = props.with_expiration(ms.to_string().as_str().into());
        }
        self.publish_props(host, &action, body.to_string().as_bytes(), props)
            .await;
        corr
    }

    /// The answers to `sent`, waiting up to `within` for all of them and
    /// then `quiet` longer for duplicates: answers per correlation id.
    pub async fn answers(
        &self,
        sent: &[String],
        within: Duration,
        quiet: Duration,
    ) -> HashMap<String, Vec<Value>> {
        let mut seen: HashMap<String, Vec<Value>> = HashMap::new();
        let deadline = tokio::time::Instant::now() + within;
        let mut rx = self.replies.lock().await;
        loop {
            let all = sent.iter().all(|c| seen.contains_key(c));
            let until = if all {
                tokio::time::Instant::now() + quiet
            } else {
                deadline
            };
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some((corr, v))) => seen.entry(corr.unwrap_or_default()).or_default().push(v),
                _ => return seen,
            }
        }
    }

    /// The next completion event (with its correlation id).
    pub async fn next_reply(&self, within: Duration) -> (Option<String>, Value) {
        let mut rx = self.replies.lock().await;
        tokio::time::timeout(within, rx.recv())
            .await
            .expect("a completion event in time")
            .expect("reply consumer alive")
    }

    /// Waits for `n` replies, keyed by correlation id.
    pub async fn replies(&self, n: usize, within: Duration) -> HashMap<String, Value> {
        let deadline = tokio::time::Instant::now() + within;
        let mut out = HashMap::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let (corr, v) = self.next_reply(left).await;
            out.insert(corr.unwrap_or_default(), v);
        }
        out
    }

    /// Sends one command and waits for its answer.
    pub async fn call(&self, host: &str, body: Value) -> Value {
        let corr = self.command(host, body).await;
        let (got, v) = self.next_reply(Duration::from_secs(60)).await;
        assert_eq!(
            got.as_deref(),
            Some(corr.as_str()),
            "correlation_id honoured"
        );
        v
    }

    /// Takes every message from `queue` (acknowledging them).
    pub async fn drain(&self, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
        use lapin::options::*;
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            out.push(m);
        }
        out
    }
}

/// A prepare command body.
pub fn prepare_cmd(node: &str, source: &str) -> Value {
    serde_json::json!({
        "action": "prepare",
        "node_uuid": node,
        "request_id": uuid::Uuid::new_v4().to_string(),
        "instance_info": {"image_source": source},
    })
}

/// A queue receiving the completion events published without reply_to.
pub struct EventTap {
    channel: lapin::Channel,
    queue: String,
}

impl EventTap {
    pub async fn new(broker: &Broker) -> EventTap {
        use lapin::options::*;
        let channel = broker.conn.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        // Node events, and the warms' (which name an image).
        for key in ["node.#", "image.#"] {
            channel
                .queue_bind(
                    q.name().clone(),
                    "ironic-image-worker.events".into(),
                    key.into(),
                    Default::default(),
                    Default::default(),
                )
                .await
                .unwrap();
        }
        EventTap {
            channel,
            queue: q.name().as_str().to_string(),
        }
    }

    /// The next event of conductor `host` within `wait`, with its routing key
    /// and delivery mode. Answers to messages that could not be parsed at all
    /// (`action` "unknown") are skipped: every worker answers a malformed
    /// notification on Ironic's shared exchange, so such an event belongs to
    /// the test that published it, which reads it with [`EventTap::collect_any`].
    pub async fn next(&self, host: &str, wait: Duration) -> Option<(String, Option<u8>, Value)> {
        self.next_where(host, wait, |v| v["action"] != "unknown")
            .await
    }

    /// The next event of conductor `host` within `wait` that `keep` accepts.
    async fn next_where(
        &self,
        host: &str,
        wait: Duration,
        keep: impl Fn(&Value) -> bool,
    ) -> Option<(String, Option<u8>, Value)> {
        use lapin::options::*;
        let deadline = tokio::time::Instant::now() + wait;
        while tokio::time::Instant::now() < deadline {
            let got = self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap();
            match got {
                Some(m) => {
                    let v: Value = serde_json::from_slice(&m.delivery.data).unwrap();
                    assert_valid_completion(&v);
                    if v["conductor_host"] == host && keep(&v) {
                        let mode = *m.delivery.properties.delivery_mode();
                        return Some((m.delivery.routing_key.as_str().to_string(), mode, v));
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        None
    }

    /// Events of conductor `host` seen within `wait` (stops early at `n`),
    /// without answers to unparsable messages (see [`EventTap::next`]).
    pub async fn collect(&self, host: &str, n: usize, wait: Duration) -> Vec<Value> {
        self.collect_where(host, n, wait, |v| v["action"] != "unknown")
            .await
    }

    /// Every event of conductor `host` seen within `wait` (stops early at `n`).
    pub async fn collect_any(&self, host: &str, n: usize, wait: Duration) -> Vec<Value> {
        self.collect_where(host, n, wait, |_| true).await
    }

    async fn collect_where(
        &self,
        host: &str,
        n: usize,
        wait: Duration,
        keep: impl Fn(&Value) -> bool,
    ) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut out = Vec::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_where(host, left, &keep).await {
                Some((_, _, v)) => out.push(v),
                None => break,
            }
        }
        out
    }
}
