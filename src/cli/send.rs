//! `send`: the operator's (and the tests') client. Publishes one command to
//! a worker through the broker, with a temporary reply queue, and can wait
//! for the completion event.

use crate::broker::{Brokers, Topology};
use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::messages::{Action, Completion};
use crate::pipeline::Request;
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
    let brokers = Brokers::new(config)?;
    let mut conn = None;
    let mut failures = Vec::new();
    for index in 0..brokers.len() {
        let attempt = tokio::time::timeout(
            Duration::from_secs(config.amqp.connect_timeout.max(1)),
            brokers.connect(index, ConnectionProperties::default()),
        )
        .await;
        match attempt {
            Ok(Ok(c)) => {
                conn = Some((c, brokers.name(index).to_string()));
                break;
            }
            Ok(Err(e)) => failures.push(format!(
                "{}: {}",
                brokers.name(index),
                crate::error::error_chain(&e)
            )),
            Err(_) => failures.push(format!("{}: no connection in time", brokers.name(index))),
        }
    }
    let Some((conn, name)) = conn else {
        return Err(Error::new(
            ErrorCode::Internal,
            format!("no broker reachable: {}", failures.join("; ")),
        ));
    };
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
        .await
        .map_err(broker)?;
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
        .await
        .map_err(broker)?;
    let mut replies = channel
        .basic_consume(
            reply.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(broker)?;
    let correlation = req.request_id.clone().unwrap_or_default();
    let body = serde_json::to_vec(&command_body(req)).unwrap_or_default();
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_reply_to(reply.name().clone())
        .with_correlation_id(correlation.as_str().into());
    let key = format!("{host}.node.{}", req.action.as_str());
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
    match confirm {
        Confirmation::Ack(None) | Confirmation::NotRequested => {}
        Confirmation::Ack(Some(_)) => {
            return Err(Error::new(
                ErrorCode::Internal,
                format!("no queue is bound for {key}: is the worker of {host} running?"),
            ));
        }
        Confirmation::Nack(_) => {
            return Err(Error::new(
                ErrorCode::Internal,
                "the broker refused the command",
            ));
        }
    }
    let Some(limit) = wait else {
        let _ = conn.close(200, "bye".into()).await;
        return Ok(None);
    };
    let answer = tokio::time::timeout(limit, async {
        while let Some(delivery) = replies.next().await {
            let delivery = delivery.map_err(broker)?;
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
    .map_err(|_| Error::new(ErrorCode::Internal, format!("no answer within {limit:?}")))??;
    let _ = conn.close(200, "bye".into()).await;
    Ok(Some(answer))
}
