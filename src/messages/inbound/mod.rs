//! What arrives on the per-host queue and what it asks for: explicit
//! commands (`schemas/command.v1.json`) and Ironic's own versioned
//! notifications (`baremetal.node.provision_set.*` in the oslo.messaging v2
//! envelope; docs/contract.md, "Ironic notifications").
//! Parsing never fails silently: an unreadable message becomes an error
//! completion plus a dead-letter, never a dropped message.
//!
//! One file per kind of message: explicit commands (`command`), Ironic's
//! notifications and the transitions they report (`notification`); this
//! file tells them apart and holds what both read with (`Text`, `invalid`).

use crate::error::{Error, ErrorCode};
use crate::messages::Request;
use crate::messages::{Action, Completion, IgnoreReason};
use serde::Deserialize;
use serde::de::IgnoredAny;

mod command;
mod notification;

pub use command::parse_command;
use notification::parse_notification;
pub use notification::unsealed as unsealed_notification;

/// The meaning of one inbound message.
#[derive(Debug)]
pub enum Inbound {
    /// Work for the pipeline.
    Work(Box<Request>),
    /// Unusable: answer with this error event and dead-letter the original.
    Invalid(Box<Completion>),
    /// Not for this worker (another conductor, an irrelevant notification):
    /// acknowledge without answering, counted by why.
    Ignore(IgnoreReason),
    /// A notification of a delegating node's transition that asks for no
    /// work (`deploy failed`, `wait call-back`, ...): nothing to answer, but
    /// the node moved on at `at_ms`, so a prepare issued before that is
    /// stale (docs/contract.md, "Order of a node's commands").
    Moved {
        /// The node.
        node: crate::node::NodeUuid,
        /// The notification's `timestamp`, ms since the epoch.
        at_ms: u64,
    },
}

/// Parses a delivery: notifications (from Ironic's exchange, or shaped like
/// one) and commands. Notifications act only on nodes whose deploy
/// interface is one of `deploy_interfaces` (`*`: every node). A body longer
/// than `max_bytes` (`[amqp]max_message_bytes`) is refused unread.
///
/// Bodies are read into typed structs only: the values the worker uses are
/// built, everything else (a configdrive, fields of newer Ironic versions)
/// is skipped by the parser without being built.
pub fn parse(
    body: &[u8],
    from_notification_exchange: bool,
    host: &str,
    deploy_interfaces: &[String],
    max_bytes: usize,
) -> Inbound {
    if body.len() > max_bytes {
        return invalid(
            Action::Unknown,
            None,
            None,
            host,
            format!(
                "message body is {} bytes, more than [amqp]max_message_bytes = {max_bytes}: not read",
                body.len()
            ),
        );
    }
    if from_notification_exchange || looks_like_notification(body) {
        parse_notification(body, host, deploy_interfaces)
    } else {
        parse_command(body, host)
    }
}

/// The two keys that tell a notification from a command, the rest skipped.
#[derive(Deserialize)]
struct Shape {
    #[serde(rename = "oslo.version")]
    oslo_version: Option<IgnoredAny>,
    event_type: Option<IgnoredAny>,
}

fn looks_like_notification(body: &[u8]) -> bool {
    serde_json::from_slice::<Shape>(body)
        .is_ok_and(|s| s.oslo_version.is_some() || s.event_type.is_some())
}

/// is skipped, not built): for fields only echoed or compared.
#[derive(Debug, Default)]
pub(super) struct Text(pub(super) Option<String>);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E>(self, v: &str) -> Result<Text, E> {
                Ok(Text(Some(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Text, E> {
                Ok(Text(Some(v)))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_unit<E>(self) -> Result<Text, E> {
                Ok(Text(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Text, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Text(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Text, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Text(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// The error answer to an unusable message: `invalid_message` with `why`,
/// echoing what could be read of it.
pub(super) fn invalid(
    action: Action,
    node: Option<String>,
    request_id: Option<String>,
    host: &str,
    message: String,
) -> Inbound {
    let err = Error::new(ErrorCode::InvalidMessage, message);
    Inbound::Invalid(Box::new(
        Completion::new(action, node, request_id, host).failed(&err),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: &str = "1be26c0b-03f2-4d2e-ae87-c02d7f33c123";

    #[test]
    fn bodies_over_the_limit_are_refused_unread() {
        let body = format!(r#"{{"action":"cleanup","node_uuid":"{NODE}","request_id":"r"}}"#);
        let limit = body.len() - 1;
        match super::parse(body.as_bytes(), false, "h", &[], limit) {
            Inbound::Invalid(c) => {
                assert_eq!(c.error.as_ref().unwrap().code, ErrorCode::InvalidMessage);
                assert!(c.request_id.is_none());
            }
            other => panic!("{other:?}"),
        }
        let fits = super::parse(body.as_bytes(), false, "h", &[], body.len());
        assert!(matches!(fits, Inbound::Work(_)));
    }
}
