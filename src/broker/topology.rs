//! The broker objects the worker declares: exchanges, the per-host queue with
//! its dead-letter queue, and the bindings to Ironic's notification exchange.

use crate::config::{AmqpSection, QueueType};
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};

/// The routing key of a warm for every conductor: each worker's queue binds
/// it beside its own keys, so one message reaches every worker of the
/// command exchange (docs/contract.md, "Warming the cache").
pub const WARM_ALL_KEY: &str = "all.image.warm";

/// Names of everything the worker declares, derived from `[amqp]` and the host.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Command exchange (topic).
    pub command_exchange: String,
    /// The per-host work queue.
    pub queue: String,
    /// Routing keys binding commands for this host: its node commands
    /// (`<host>.node.*`), its warms (`<host>.image.warm`) and the warms of
    /// every conductor ([`WARM_ALL_KEY`]).
    pub command_bindings: Vec<String>,
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
    /// Derives the names for conductor `host` from `[amqp]`.
    pub fn new(host: &str, a: &AmqpSection) -> Topology {
        let queue = format!("{}.{host}", a.queue_prefix);
        Topology {
            command_exchange: a.command_exchange.clone(),
            command_bindings: vec![
                format!("{host}.node.*"),
                format!("{host}.image.warm"),
                WARM_ALL_KEY.to_string(),
            ],
            dead_letter_exchange: a.dead_letter_exchange.clone(),
            dead_letter_queue: format!("{queue}.dead"),
            events_exchange: a.events_exchange.clone(),
            queue,
            notification_exchange: a.notification_exchange.clone(),
            notification_bindings: if a.binds_notifications() {
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
        amqp: &AmqpSection,
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
        self.declare_queues(channel, amqp).await?;
        if self.notification_bindings.is_empty() {
            return Ok(());
        }
        self.bind_notifications(conn, channel, amqp).await
    }

    /// The dead-letter queue, then the work queue dead-lettering into it,
    /// bound to the command exchange.
    async fn declare_queues(&self, channel: &Channel, amqp: &AmqpSection) -> lapin::Result<()> {
        let queue_type = AMQPValue::LongString(amqp.queue_type.as_str().into());
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
        if amqp.queue_type == QueueType::Quorum {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongInt(amqp.delivery_limit as i32),
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
        for key in &self.command_bindings {
            channel
                .queue_bind(
                    self.queue.as_str().into(),
                    self.command_exchange.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }

    /// Binds the work queue to Ironic's notification exchange, creating the
    /// exchange (as oslo.messaging would) only when it does not exist.
    async fn bind_notifications(
        &self,
        conn: &Connection,
        channel: &Channel,
        amqp: &AmqpSection,
    ) -> lapin::Result<()> {
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
                durable: amqp.notification_exchange_durable,
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
