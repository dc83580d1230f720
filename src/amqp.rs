//! The broker side of the worker: topology, consuming, answering.
//!
//! One connection with two channels (consume/ack, and publish with
//! confirms). A delivery is acknowledged only after its completion event is
//! confirmed by the broker; unusable messages are answered and rejected to
//! the dead-letter queue. Deliveries for one node run in order, different
//! nodes concurrently, bounded by the prefetch. Losing the connection means
//! reconnecting with capped, jittered exponential backoff; unacknowledged
//! work is redelivered and answered again idempotently.

use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::events::Completion;
use crate::inbound::{self, Inbound};
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::task::TaskTracker;

/// Names of everything the worker declares, derived from `[amqp]` and the host.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Command exchange (topic).
    pub command_exchange: String,
    /// The per-host work queue.
    pub queue: String,
    /// Routing key binding commands for this host.
    pub command_binding: String,
    /// Dead-letter exchange.
    pub dead_letter_exchange: String,
    /// Dead-letter queue of this host (also its dead-letter routing key).
    pub dead_letter_queue: String,
    /// Exchange for completion events without `reply_to`.
    pub events_exchange: String,
    /// Ironic's notification exchange and the routing keys bound from it
    /// (empty when notifications are not consumed).
    pub notification_exchange: String,
    /// `<topic>.info` and `<topic>.error` for each notification topic.
    pub notification_bindings: Vec<String>,
}

impl Topology {
    /// Derives the names for `config`.
    pub fn new(config: &Config) -> Topology {
        let a = &config.amqp;
        let host = &config.default.host;
        let queue = format!("{}.{host}", a.queue_prefix);
        Topology {
            command_exchange: a.command_exchange.clone(),
            command_binding: format!("{host}.node.*"),
            dead_letter_exchange: a.dead_letter_exchange.clone(),
            dead_letter_queue: format!("{queue}.dead"),
            events_exchange: a.events_exchange.clone(),
            queue,
            notification_exchange: a.notification_exchange.clone(),
            notification_bindings: if a.bind_notifications {
                a.notification_topics
                    .iter()
                    .flat_map(|t| [format!("{t}.info"), format!("{t}.error")])
                    .collect()
            } else {
                Vec::new()
            },
        }
    }

    /// Declares exchanges, queues and bindings (idempotent, durable). Ironic's
    /// exchange is used as it exists (a passive declare, on a channel of its
    /// own because a failed one closes it) and created the way
    /// oslo.messaging creates it otherwise, so neither side ever meets a
    /// PRECONDITION_FAILED.
    pub async fn declare(
        &self,
        conn: &Connection,
        channel: &Channel,
        config: &Config,
    ) -> lapin::Result<()> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        for name in [
            &self.command_exchange,
            &self.dead_letter_exchange,
            &self.events_exchange,
        ] {
            channel
                .exchange_declare(
                    name.as_str().into(),
                    ExchangeKind::Topic,
                    durable,
                    FieldTable::default(),
                )
                .await?;
        }
        let queue_type = AMQPValue::LongString(config.amqp.queue_type.as_str().into());
        let mut dead_args = FieldTable::default();
        dead_args.insert("x-queue-type".into(), queue_type.clone());
        let mut args = dead_args.clone();
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.dead_letter_exchange.as_str().into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.dead_letter_queue.as_str().into()),
        );
        if config.amqp.queue_type == "quorum" {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongInt(config.amqp.delivery_limit as i32),
            );
        }
        let q = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(self.dead_letter_queue.as_str().into(), q, dead_args)
            .await?;
        channel
            .queue_bind(
                self.dead_letter_queue.as_str().into(),
                self.dead_letter_exchange.as_str().into(),
                self.dead_letter_queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_declare(self.queue.as_str().into(), q, args)
            .await?;
        channel
            .queue_bind(
                self.queue.as_str().into(),
                self.command_exchange.as_str().into(),
                self.command_binding.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        if self.notification_bindings.is_empty() {
            return Ok(());
        }
        let probe = conn.create_channel().await?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let name = self.notification_exchange.as_str();
        if probe
            .exchange_declare(
                name.into(),
                ExchangeKind::Topic,
                passive,
                FieldTable::default(),
            )
            .await
            .is_err()
        {
            let create = ExchangeDeclareOptions {
                durable: config.amqp.notification_exchange_durable,
                ..ExchangeDeclareOptions::default()
            };
            channel
                .exchange_declare(
                    name.into(),
                    ExchangeKind::Topic,
                    create,
                    FieldTable::default(),
                )
                .await?;
        } else {
            let _ = probe.close(200, "ok".into()).await;
        }
        for key in &self.notification_bindings {
            channel
                .queue_bind(
                    self.queue.as_str().into(),
                    name.into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }
}

/// Publishes completion events with publisher confirms.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    events_exchange: String,
}

impl Publisher {
    /// Puts `channel` in confirm mode.
    pub async fn new(channel: Channel, events_exchange: &str) -> lapin::Result<Publisher> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Publisher {
            channel,
            events_exchange: events_exchange.to_string(),
        })
    }

    /// Publishes `done` to `reply_to` (default exchange) with `correlation_id`,
    /// or to the events exchange as `node.<action>.<status>`, persistent, and
    /// waits for the broker's confirmation.
    pub async fn publish(
        &self,
        done: &Completion,
        reply_to: Option<&str>,
        correlation_id: Option<&str>,
    ) -> Result<()> {
        let body =
            serde_json::to_vec(done).map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_app_id("ironic-image-worker".into())
            .with_type(
                format!("node.{}.{}", done.action.as_str(), done.status.as_str())
                    .as_str()
                    .into(),
            );
        if let Some(id) = correlation_id {
            props = props.with_correlation_id(id.into());
        }
        let (exchange, key) = match reply_to {
            Some(queue) => (String::new(), queue.to_string()),
            None => (
                self.events_exchange.clone(),
                format!("node.{}.{}", done.action.as_str(), done.status.as_str()),
            ),
        };
        let broker =
            |e: lapin::Error| Error::new(ErrorCode::Internal, format!("publish completion: {e}"));
        let confirm = self
            .channel
            .basic_publish(
                exchange.as_str().into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await
            .map_err(broker)?
            .await
            .map_err(broker)?;
        match confirm {
            Confirmation::Ack(_) | Confirmation::NotRequested => Ok(()),
            Confirmation::Nack(_) => Err(Error::new(
                ErrorCode::Internal,
                "broker refused the completion event",
            )),
        }
    }
}

/// State shared by every delivery of one connection.
struct Session {
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    publisher: Publisher,
    host: String,
    /// Ironic's notification exchange (deliveries from it are notifications).
    notification_exchange: String,
    /// Per-node FIFO queues: deliveries for one node run in order.
    nodes: Mutex<HashMap<String, mpsc::UnboundedSender<Job>>>,
    /// Signalled when a broker operation failed: reconnect.
    broken: Notify,
    tracker: TaskTracker,
}

/// Runs the consumer until `stop` turns true, reconnecting as needed.
/// `connected` mirrors the connection state for `/readyz`.
pub async fn run(
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    connected: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    let config = pipeline.config().clone();
    let mut backoff = reconnect_backoff();
    while !*stop.borrow() {
        let outcome = session(&pipeline, &metrics, &connected, &mut stop, &config).await;
        connected.store(false, Ordering::Relaxed);
        metrics.amqp_connected.set(0);
        match outcome {
            Ok(true) => break,
            Ok(false) => backoff = reconnect_backoff(),
            Err(e) => {
                tracing::warn!(broker = %config.amqp_url_redacted(), error = %e, "broker session ended")
            }
        }
        let delay = backoff.next().unwrap_or(Duration::from_secs(30));
        tracing::info!(?delay, "reconnecting to the broker");
        metrics.amqp_reconnects.inc();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
        .build()
}

/// One connection's lifetime. Ok(true): stopped on request; Ok(false): the
/// connection was lost after working; Err: could not get going.
async fn session(
    pipeline: &Arc<Pipeline>,
    metrics: &Arc<Metrics>,
    connected: &AtomicBool,
    stop: &mut watch::Receiver<bool>,
    config: &Config,
) -> lapin::Result<bool> {
    let props = ConnectionProperties::default()
        .with_connection_name(format!("ironic-image-worker@{}", config.default.host).into());
    let conn = tokio::select! {
        conn = Connection::connect(&config.amqp.url, props) => conn?,
        _ = stop.wait_for(|s| *s) => return Ok(true),
    };
    let consume_channel = conn.create_channel().await?;
    let publish_channel = conn.create_channel().await?;
    let topology = Topology::new(config);
    topology.declare(&conn, &consume_channel, config).await?;
    consume_channel
        .basic_qos(config.amqp.prefetch, BasicQosOptions::default())
        .await?;
    let publisher = Publisher::new(publish_channel, &topology.events_exchange).await?;
    let mut consumer = consume_channel
        .basic_consume(
            topology.queue.as_str().into(),
            ShortString::from(
                format!("ironic-image-worker-{}", uuid::Uuid::new_v4().simple()).as_str(),
            ),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    connected.store(true, Ordering::Relaxed);
    metrics.amqp_connected.set(1);
    tracing::info!(broker = %config.amqp_url_redacted(), queue = %topology.queue, "consuming");

    let session = Arc::new(Session {
        pipeline: pipeline.clone(),
        metrics: metrics.clone(),
        publisher,
        host: config.default.host.clone(),
        notification_exchange: config.amqp.notification_exchange.clone(),
        nodes: Mutex::new(HashMap::new()),
        broken: Notify::new(),
        tracker: TaskTracker::new(),
    });
    let stopped = loop {
        tokio::select! {
            next = consumer.next() => match next {
                Some(Ok(delivery)) => dispatch(&session, delivery),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "consumer failed");
                    break false;
                }
                None => break false,
            },
            _ = session.broken.notified() => break false,
            _ = stop.wait_for(|s| *s) => break true,
        }
    };
    if stopped {
        // Stop taking work, let in-flight work finish within the grace
        // period; whatever is still unacknowledged is requeued by the broker
        // when the connection closes.
        let _ = consume_channel
            .basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await;
        session.tracker.close();
        let grace = Duration::from_secs(config.amqp.shutdown_grace);
        if tokio::time::timeout(grace, session.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                ?grace,
                "in-flight work did not finish in the grace period; it will be redelivered"
            );
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(stopped)
}

/// Routes a delivery: unusable and ignored messages are settled at once,
/// work goes to its node's FIFO queue.
fn dispatch(session: &Arc<Session>, delivery: Delivery) {
    let from_ironic = delivery.exchange.as_str() == session.notification_exchange;
    let interfaces = &session.pipeline.config().notifications.deploy_interfaces;
    let inbound = inbound::parse(&delivery.data, from_ironic, &session.host, interfaces);
    let source = if from_ironic {
        "notification"
    } else {
        "command"
    };
    let node = match &inbound {
        Inbound::Work(req) => req.node_uuid.clone(),
        _ => {
            let s = session.clone();
            session.tracker.spawn(async move {
                s.settle(Job {
                    delivery,
                    inbound,
                    source,
                })
                .await
            });
            return;
        }
    };
    let job = Job {
        delivery,
        inbound,
        source,
    };
    let mut nodes = session.nodes.lock().unwrap_or_else(|p| p.into_inner());
    let job = match nodes.get(&node) {
        Some(tx) => match tx.send(job) {
            Ok(()) => return,
            Err(mpsc::error::SendError(job)) => job,
        },
        None => job,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _ = tx.send(job);
    nodes.insert(node.clone(), tx);
    let s = session.clone();
    session.tracker.spawn(async move {
        loop {
            while let Ok(job) = rx.try_recv() {
                s.settle(job).await;
            }
            let mut nodes = s.nodes.lock().unwrap_or_else(|p| p.into_inner());
            if rx.is_empty() {
                nodes.remove(&node);
                return;
            }
        }
    });
}

/// A delivery and what it was parsed into.
struct Job {
    delivery: Delivery,
    inbound: Inbound,
    source: &'static str,
}

impl Session {
    /// Handles one delivery to the end: answer, then ack (or dead-letter).
    async fn settle(&self, job: Job) {
        if let Err(e) = self.try_settle(job).await {
            tracing::warn!(error = %e, "could not settle a delivery; reconnecting");
            self.broken.notify_one();
        }
    }

    async fn try_settle(&self, job: Job) -> Result<()> {
        let Job {
            delivery,
            inbound,
            source,
        } = job;
        let broker = |e: lapin::Error| Error::new(ErrorCode::Internal, format!("broker: {e}"));
        let reply_to = delivery
            .properties
            .reply_to()
            .as_ref()
            .map(|s| s.as_str().to_string());
        let correlation = delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|s| s.as_str().to_string());
        // A stray cleanup (node not prepared here) is decided under the
        // node lock, inside the pipeline.
        let (inbound, done) = match inbound {
            Inbound::Work(req) => match self.pipeline.handle_unless_stray(&req).await {
                Some(done) => (Inbound::Work(req), Some(done)),
                None => (Inbound::Ignore("not_prepared_here"), None),
            },
            other => (other, None),
        };
        match inbound {
            Inbound::Work(_) => {
                let Some(done) = done else { return Ok(()) };
                self.metrics
                    .consumed(source, done.action.as_str(), done.status.as_str());
                self.publisher
                    .publish(&done, reply_to.as_deref(), correlation.as_deref())
                    .await?;
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(broker)?;
            }
            Inbound::Invalid(done) => {
                tracing::warn!(source, error = ?done.error, "dead-lettering an unusable message");
                self.metrics.record(&done);
                self.metrics
                    .consumed(source, done.action.as_str(), "invalid");
                self.publisher
                    .publish(&done, reply_to.as_deref(), correlation.as_deref())
                    .await?;
                delivery
                    .acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await
                    .map_err(broker)?;
            }
            Inbound::Ignore(why) => {
                self.metrics.ignored.with_label_values(&[why]).inc();
                self.metrics.consumed(source, "none", "ignored");
                delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(broker)?;
            }
        }
        Ok(())
    }
}
