//! Publishing completion events with publisher confirms.

use crate::error::{Error, ErrorCode, Result};
use crate::messages::Completion;
use crate::seal::Sealer;
use lapin::options::*;
use lapin::{BasicProperties, Channel, Confirmation};
use std::sync::Arc;
use std::time::Duration;

/// The longest wait for the broker to take or refuse one message. Past it
/// the publish counts as failed, so its caller renews the connection and
/// publishes again: a confirmation the broker never sends (a cluster node
/// paused or stopped while it held the message) must not hold an answer,
/// and the node's later commands behind it, for ever. A publish that was
/// taken after all is then delivered twice, which its reader skips.
const CONFIRM_WAIT: Duration = Duration::from_secs(30);

/// Why a publish failed: the broker refused this one message (a nack, or
/// no queue took a mandatory one), which says nothing of the connection, or
/// the channel or connection failed.
#[derive(Debug)]
pub enum PublishError {
    /// The broker refused the message (e.g. a full `reject-publish` queue).
    Refused(String),
    /// The channel or the connection failed.
    Failed(String),
}

impl std::fmt::Display for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PublishError::Refused(e) | PublishError::Failed(e) => f.write_str(e),
        }
    }
}

/// Publishes completion events with publisher confirms.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    events_exchange: String,
    /// Seals every completion when set (`[amqp]seal` is not `off`).
    seal: Option<Arc<Sealer>>,
}

impl Publisher {
    /// Puts `channel` in confirm mode; completions are sealed with `seal`.
    pub(crate) async fn new(
        channel: Channel,
        events_exchange: &str,
        seal: Option<Arc<Sealer>>,
    ) -> lapin::Result<Publisher> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Publisher {
            channel,
            events_exchange: events_exchange.to_string(),
            seal,
        })
    }

    /// Publishes `done` to `reply_to` (default exchange) with `correlation_id`,
    /// or to the events exchange as `node.<action>.<status>` (`image.warm.<status>`
    /// for a warm, which names no node), persistent, sealed with key
    /// `seal_key` (the one its command came with), and
    /// waits for the broker's confirmation.
    pub async fn publish(
        &self,
        done: &Completion,
        reply_to: Option<&str>,
        correlation_id: Option<&str>,
        seal_key: usize,
    ) -> std::result::Result<(), PublishError> {
        let body = done
            .to_json()
            .map_err(|e| PublishError::Failed(format!("completion to JSON: {e}")))?;
        let kind = done.event_kind();
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_app_id("ironic-image-worker".into())
            .with_type(kind.as_str().into());
        if let Some(id) = correlation_id {
            props = props.with_correlation_id(id.into());
        }
        let (exchange, key) = match reply_to {
            Some(queue) => (String::new(), queue.to_string()),
            None => (self.events_exchange.clone(), kind),
        };
        let props = super::sealed::seal_answer(self.seal.as_deref(), seal_key, props, &key, &body);
        self.confirmed(&exchange, &key, false, &body, props).await
    }

    /// Puts a copy of a delivery back at the tail of `queue` (through the
    /// default exchange, so nobody else receives it), persistent, and
    /// waits for the broker's confirmation.
    pub async fn requeue_copy(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<()> {
        self.confirmed("", queue, true, body, properties.with_delivery_mode(2))
            .await
            .map_err(|e| Error::new(ErrorCode::Internal, format!("requeue: {e}")))
    }

    /// Publishes one message and waits for the broker's confirmation: a
    /// refusal (nack) or, when `mandatory`, a message no queue took is
    /// [`PublishError::Refused`]; a failed channel [`PublishError::Failed`].
    async fn confirmed(
        &self,
        exchange: &str,
        key: &str,
        mandatory: bool,
        body: &[u8],
        props: BasicProperties,
    ) -> std::result::Result<(), PublishError> {
        let options = BasicPublishOptions {
            mandatory,
            ..BasicPublishOptions::default()
        };
        let chain = |e: lapin::Error| PublishError::Failed(crate::error::error_chain(&e));
        let published = async {
            self.channel
                .basic_publish(exchange.into(), key.into(), options, body, props)
                .await?
                .await
        };
        let confirm = tokio::time::timeout(CONFIRM_WAIT, published)
            .await
            .map_err(|_| {
                PublishError::Failed(format!(
                    "no confirmation from the broker within {CONFIRM_WAIT:?}"
                ))
            })?
            .map_err(chain)?;
        match confirm {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(_)) => {
                Err(PublishError::Refused("no queue took the message".into()))
            }
            Confirmation::Nack(_) => Err(PublishError::Refused(
                "the broker refused the message".into(),
            )),
        }
    }
}
