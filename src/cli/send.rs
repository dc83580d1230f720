//! `send`: the operator's (and the tests') client. Publishes one command to
//! a worker through the broker, with a temporary reply queue, and can wait
//! for the completion event.

use crate::broker::{Brokers, Topology};
use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::messages::Request;
use crate::messages::{Action, Completion};
use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, ConnectionProperties, ExchangeKind};
use std::time::Duration;

/// The JSON body of a command (`schemas/command.v1.json`) for `req`.
pub fn command_body(req: &Request) -> serde_json::Value {
    let mut body = serde_json::json!({
        "action": req.action.as_str(),
        "node_uuid": req.node_uuid,
    });
    if let Some(id) = &req.request_id {
        body["request_id"] = id.clone().into();
    }
    if req.action == Action::Prepare {
        body["instance_info"] = serde_json::to_value(&req.instance_info).unwrap_or_default();
        body["options"] = serde_json::to_value(req.options).unwrap_or_default();
    }
    body
}

/// Publishes `req` to the worker of conductor `host`; with `wait`, returns
/// its completion event (or fails after that long).
pub async fn send(
    config: &Config,
    host: &str,
    req: &Request,
    wait: Option<Duration>,
) -> Result<Option<Completion>> {
    let (conn, name) = connect_first(config).await?;
    let broker = |e: lapin::Error| {
        Error::new(
            ErrorCode::Internal,
            format!("broker {name}: {}", crate::error::error_chain(&e)),
        )
    };
    let channel = conn.create_channel().await.map_err(broker)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)?;
    let topology = Topology::new(config);
    let (reply, replies) = reply_queue(&channel, &topology).await.map_err(broker)?;
    let correlation = req.request_id.clone().unwrap_or_default();
    // When it was issued, so the worker orders it against the node's other
    // commands (docs/contract.md, "Order of a node's commands").
    let sent = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut headers = FieldTable::default();
    headers.insert(
        "timestamp_in_ms".into(),
        lapin::types::AMQPValue::LongLongInt(sent.as_millis() as i64),
    );
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(sent.as_secs())
        .with_headers(headers)
        .with_reply_to(reply)
        .with_correlation_id(correlation.as_str().into());
    let key = format!("{host}.node.{}", req.action.as_str());
    let body = serde_json::to_vec(&command_body(req)).unwrap_or_default();
    let confirm = channel
        .basic_publish(
            topology.command_exchange.as_str().into(),
            key.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &body,
            props,
        )
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
    refused(confirm, &key, host)?;
    let answer = match wait {
        Some(limit) => Some(await_answer(replies, &correlation, limit, broker).await?),
        None => None,
    };
    let _ = conn.close(200, "bye".into()).await;
    Ok(answer)
}

/// Declares the command exchange (so a publish before any worker started is
/// not an error) and a temporary reply queue, consumed: its name and its
/// deliveries.
async fn reply_queue(
    channel: &lapin::Channel,
    topology: &Topology,
) -> std::result::Result<(lapin::types::ShortString, lapin::Consumer), lapin::Error> {
    channel
        .exchange_declare(
            topology.command_exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let reply = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let replies = channel
        .basic_consume(
            reply.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((reply.name().clone(), replies))
}

/// A connection to the first broker of the configured list that answers.
async fn connect_first(config: &Config) -> Result<(lapin::Connection, String)> {
    let brokers = Brokers::new(config)?;
    let mut failures = Vec::new();
    for index in 0..brokers.len() {
        let attempt = tokio::time::timeout(
            Duration::from_secs(config.amqp.connect_timeout.max(1)),
            brokers.connect(index, ConnectionProperties::default()),
        )
        .await;
        match attempt {
            Ok(Ok(c)) => return Ok((c, brokers.name(index).to_string())),
            Ok(Err(e)) => failures.push(format!(
                "{}: {}",
                brokers.name(index),
                crate::error::error_chain(&e)
            )),
            Err(_) => failures.push(format!("{}: no connection in time", brokers.name(index))),
        }
    }
    Err(Error::new(
        ErrorCode::Internal,
        format!("no broker reachable: {}", failures.join("; ")),
    ))
}

/// The broker's confirm of a mandatory publish, as an error when the
/// command reached no queue or was refused.
fn refused(confirm: Confirmation, key: &str, host: &str) -> Result<()> {
    match confirm {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(_)) => Err(Error::new(
            ErrorCode::Internal,
            format!("no queue is bound for {key}: is the worker of {host} running?"),
        )),
        Confirmation::Nack(_) => Err(Error::new(
            ErrorCode::Internal,
            "the broker refused the command",
        )),
    }
}

/// The completion on the reply queue whose correlation id is `correlation`,
/// waited for at most `limit`.
async fn await_answer(
    mut replies: lapin::Consumer,
    correlation: &str,
    limit: Duration,
    broker: impl Fn(lapin::Error) -> Error,
) -> Result<Completion> {
    tokio::time::timeout(limit, async {
        while let Some(delivery) = replies.next().await {
            let delivery = delivery.map_err(&broker)?;
            let matches = delivery
                .properties
                .correlation_id()
                .as_ref()
                .is_some_and(|c| c.as_str() == correlation);
            if matches {
                return serde_json::from_slice::<Completion>(&delivery.data).map_err(|e| {
                    Error::new(ErrorCode::Internal, format!("unreadable completion: {e}"))
                });
            }
        }
        Err(Error::new(
            ErrorCode::Internal,
            "the broker closed the reply queue",
        ))
    })
    .await
    .map_err(|_| Error::new(ErrorCode::Internal, format!("no answer within {limit:?}")))?
}
