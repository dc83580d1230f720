//! What arrives on the per-host queue and what it asks for: explicit
//! commands (`schemas/command.v1.json`) today, Ironic notifications too.
//! Parsing never fails silently: an unreadable message becomes an error
//! completion plus a dead-letter, never a dropped message.

use crate::error::{Error, ErrorCode};
use crate::events::{Action, Completion, InstanceInfo, Options};
use crate::node::NodeUuid;
use crate::pipeline::Request;
use serde::Deserialize;

/// The meaning of one inbound message.
#[derive(Debug)]
pub enum Inbound {
    /// Work for the pipeline.
    Work(Box<Request>),
    /// Unusable: answer with this error event and dead-letter the original.
    Invalid(Box<Completion>),
    /// Not for this worker (another conductor, an irrelevant notification):
    /// acknowledge without answering. The string says why, for metrics.
    Ignore(&'static str),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandBody {
    /// Already read from the raw value; declared so the schema is complete.
    #[serde(rename = "action")]
    _action: String,
    node_uuid: String,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    instance_info: Option<InstanceInfo>,
    #[serde(default)]
    options: Option<Options>,
}

/// Parses a command body for the worker of conductor `host`.
pub fn parse_command(body: &[u8], host: &str) -> Inbound {
    let value: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return invalid(
                Action::Unknown,
                None,
                None,
                host,
                format!("body is not JSON: {e}"),
            );
        }
    };
    let request_id = value
        .get("request_id")
        .and_then(|v| v.as_str())
        .map(str::to_string);
    let node = value
        .get("node_uuid")
        .and_then(|v| v.as_str())
        .map(str::to_string);
    let action = match value.get("action").and_then(|v| v.as_str()) {
        Some("prepare") => Action::Prepare,
        Some("deployed") => Action::Deployed,
        Some("cleanup") => Action::Cleanup,
        other => {
            return invalid(
                Action::Unknown,
                node,
                request_id,
                host,
                format!("unknown action {other:?}"),
            );
        }
    };
    let cmd: CommandBody = match serde_json::from_value(value) {
        Ok(c) => c,
        Err(e) => {
            return invalid(
                action,
                node,
                request_id,
                host,
                format!("command does not fit the schema: {e}"),
            );
        }
    };
    if let Err(e) = NodeUuid::parse(&cmd.node_uuid) {
        return Inbound::Invalid(Box::new(
            Completion::new(action, node, request_id, host).failed(&e),
        ));
    }
    let instance_info = cmd.instance_info.unwrap_or_default();
    let has_source = instance_info
        .image_source
        .as_deref()
        .is_some_and(|s| !s.trim().is_empty());
    if action == Action::Prepare && !has_source {
        return invalid(
            action,
            node,
            request_id,
            host,
            "prepare needs instance_info.image_source".into(),
        );
    }
    Inbound::Work(Box::new(Request {
        action,
        node_uuid: cmd.node_uuid,
        request_id: cmd.request_id,
        instance_info,
        options: cmd.options.unwrap_or_default(),
    }))
}

fn invalid(
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

    fn code(i: &Inbound) -> Option<ErrorCode> {
        match i {
            Inbound::Invalid(c) => c.error.as_ref().map(|e| e.code),
            _ => None,
        }
    }

    #[test]
    fn good_command() {
        let body = format!(
            r#"{{"action":"prepare","node_uuid":"{NODE}","request_id":"r1",
                "instance_info":{{"image_source":"http://x/y","extra":1}},
                "options":{{"force_raw":false}}}}"#
        );
        match parse_command(body.as_bytes(), "h") {
            Inbound::Work(r) => {
                assert_eq!(r.action, Action::Prepare);
                assert_eq!(r.options.force_raw, Some(false));
                assert_eq!(r.instance_info.other["extra"], 1);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_commands() {
        assert_eq!(
            code(&parse_command(b"not json", "h")),
            Some(ErrorCode::InvalidMessage)
        );
        let unknown = format!(r#"{{"action":"explode","node_uuid":"{NODE}","request_id":"r"}}"#);
        let i = parse_command(unknown.as_bytes(), "h");
        assert_eq!(code(&i), Some(ErrorCode::InvalidMessage));
        if let Inbound::Invalid(c) = i {
            assert_eq!(c.request_id.as_deref(), Some("r"));
        }
        let bad_node = r#"{"action":"cleanup","node_uuid":"../x"}"#;
        assert_eq!(
            code(&parse_command(bad_node.as_bytes(), "h")),
            Some(ErrorCode::InvalidNodeUuid)
        );
        let no_source = format!(r#"{{"action":"prepare","node_uuid":"{NODE}"}}"#);
        assert_eq!(
            code(&parse_command(no_source.as_bytes(), "h")),
            Some(ErrorCode::InvalidMessage)
        );
        let extra = format!(r#"{{"action":"cleanup","node_uuid":"{NODE}","bogus":1}}"#);
        assert_eq!(
            code(&parse_command(extra.as_bytes(), "h")),
            Some(ErrorCode::InvalidMessage)
        );
        let bad_type = format!(
            r#"{{"action":"prepare","node_uuid":"{NODE}","instance_info":{{"image_source":5}}}}"#
        );
        assert_eq!(
            code(&parse_command(bad_type.as_bytes(), "h")),
            Some(ErrorCode::InvalidMessage)
        );
    }
}
