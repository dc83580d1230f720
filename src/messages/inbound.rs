//! What arrives on the per-host queue and what it asks for: explicit
//! commands (`schemas/command.v1.json`) and Ironic's own versioned
//! notifications (`baremetal.node.provision_set.*` in the oslo.messaging v2
//! envelope; docs/contract.md, "Ironic notifications").
//! Parsing never fails silently: an unreadable message becomes an error
//! completion plus a dead-letter, never a dropped message.

use crate::error::{Error, ErrorCode};
use crate::messages::{Action, Completion, InstanceInfo, MAX_REQUEST_ID_LEN, Options};
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

/// Parses a delivery: notifications (from Ironic's exchange, or shaped like
/// one) and commands. Notifications act only on nodes whose deploy
/// interface is one of `deploy_interfaces` (`*`: every node).
pub fn parse(
    body: &[u8],
    from_notification_exchange: bool,
    host: &str,
    deploy_interfaces: &[String],
) -> Inbound {
    let looks_like_notification = || {
        serde_json::from_slice::<serde_json::Value>(body)
            .is_ok_and(|v| v.get("oslo.version").is_some() || v.get("event_type").is_some())
    };
    if from_notification_exchange || looks_like_notification() {
        parse_notification(body, host, deploy_interfaces)
    } else {
        parse_command(body, host)
    }
}

/// A node id longer than this is not echoed back (a UUID has 36 characters).
const MAX_NODE_ECHO_LEN: usize = 64;

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
    // Echoed in the error event only when of a sane length.
    let request_id = value
        .get("request_id")
        .and_then(|v| v.as_str())
        .filter(|r| r.len() <= MAX_REQUEST_ID_LEN)
        .map(str::to_string);
    let node = value
        .get("node_uuid")
        .and_then(|v| v.as_str())
        .filter(|n| n.len() <= MAX_NODE_ECHO_LEN)
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
    if let Some(long) = cmd
        .request_id
        .as_ref()
        .filter(|r| r.len() > MAX_REQUEST_ID_LEN)
    {
        return invalid(
            action,
            node,
            None,
            host,
            format!(
                "request_id is {} bytes long, more than {MAX_REQUEST_ID_LEN}",
                long.len()
            ),
        );
    }
    let instance_info = cmd.instance_info.unwrap_or_default();
    if let Err(why) = instance_info.check_lengths() {
        return invalid(action, node, request_id, host, why);
    }
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
        only_if_prepared: false,
        slow: Default::default(),
    }))
}

/// Ironic's provision-state transition, as a notification tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The node's new provision state.
    pub state: String,
    /// The state it left.
    pub previous: String,
    /// The FSM event that moved it.
    pub event: String,
}

/// What the worker does for a transition (docs/contract.md, mapping); the flag says the
/// cleanup is only wanted when the node was prepared here.
pub fn action_for(t: &Transition) -> Option<(Action, bool)> {
    match t.state.as_str() {
        "deploying" if t.event == "deploy" || t.event == "rebuild" => {
            Some((Action::Prepare, false))
        }
        "active" if matches!(t.previous.as_str(), "deploying" | "wait call-back") => {
            Some((Action::Deployed, false))
        }
        // Teardown of an active or deploy-failed node always starts here.
        "deleting" => Some((Action::Cleanup, false)),
        "cleaning" | "available" | "manageable" | "error" => Some((Action::Cleanup, true)),
        _ => None,
    }
}

/// True when a node with deploy interface `interface` (the notification
/// payload's `deploy_interface`) delegates its image work to the worker.
pub fn delegates(interface: Option<&str>, deploy_interfaces: &[String]) -> bool {
    deploy_interfaces
        .iter()
        .any(|d| d == "*" || Some(d.as_str()) == interface)
}

/// Parses an oslo.messaging notification (v2 envelope or unwrapped) for the
/// worker of conductor `host`. Notifications of other conductors, other
/// events and nodes that do not delegate to the worker (their deploy
/// interface is not in `deploy_interfaces`: Ironic prepares them itself, and
/// fails if the worker links their files) are ignored; unreadable ones are
/// invalid.
pub fn parse_notification(body: &[u8], host: &str, deploy_interfaces: &[String]) -> Inbound {
    let bad = |request_id: Option<String>, msg: String| {
        invalid(Action::Unknown, None, request_id, host, msg)
    };
    let outer: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return bad(None, format!("notification is not JSON: {e}")),
    };
    let msg = match outer.get("oslo.message") {
        Some(serde_json::Value::String(inner)) => match serde_json::from_str(inner) {
            Ok(v) => v,
            Err(e) => return bad(None, format!("oslo.message is not JSON: {e}")),
        },
        Some(_) => return bad(None, "oslo.message is not a JSON string".into()),
        None => outer,
    };
    let text =
        |v: &serde_json::Value, key: &str| v.get(key).and_then(|x| x.as_str()).map(str::to_string);
    let message_id = text(&msg, "message_id");
    let Some(publisher) = text(&msg, "publisher_id") else {
        return bad(message_id, "notification has no publisher_id".into());
    };
    let Some(event_type) = text(&msg, "event_type") else {
        return bad(message_id, "notification has no event_type".into());
    };
    match publisher.split_once('.') {
        Some(("ironic-conductor", h)) if h == host => {}
        _ => return Inbound::Ignore("other_publisher"),
    }
    if !event_type.starts_with("baremetal.node.provision_set.") {
        return Inbound::Ignore("other_event");
    }
    let payload = msg.get("payload").cloned().unwrap_or_default();
    let data = payload
        .get("ironic_object.data")
        .cloned()
        .unwrap_or(payload);
    let node = text(&data, "uuid");
    let invalid_here =
        |msg: String| invalid(Action::Unknown, node.clone(), message_id.clone(), host, msg);
    let Some(node_uuid) = node.clone() else {
        return invalid_here("provision_set payload has no node uuid".into());
    };
    let transition = Transition {
        state: text(&data, "provision_state").unwrap_or_default(),
        previous: text(&data, "previous_provision_state").unwrap_or_default(),
        event: text(&data, "event").unwrap_or_default(),
    };
    let Some((action, only_if_prepared)) = action_for(&transition) else {
        return Inbound::Ignore("no_action");
    };
    if let Err(e) = NodeUuid::parse(&node_uuid) {
        return Inbound::Invalid(Box::new(
            Completion::new(action, node, message_id, host).failed(&e),
        ));
    }
    if !delegates(
        text(&data, "deploy_interface").as_deref(),
        deploy_interfaces,
    ) {
        return Inbound::Ignore("other_deploy_interface");
    }
    let instance_info: InstanceInfo = match data.get("instance_info") {
        None | Some(serde_json::Value::Null) => InstanceInfo::default(),
        Some(v) => match serde_json::from_value(v.clone()) {
            Ok(i) => i,
            Err(e) => {
                return invalid(
                    action,
                    node,
                    message_id,
                    host,
                    format!("instance_info: {e}"),
                );
            }
        },
    };
    if let Err(why) = instance_info.check_lengths() {
        return invalid(action, node, message_id, host, why);
    }
    if action == Action::Prepare
        && instance_info
            .image_source
            .as_deref()
            .is_none_or(|s| s.trim().is_empty())
    {
        return invalid(
            action,
            node,
            message_id,
            host,
            "deploy notification without instance_info.image_source".into(),
        );
    }
    Inbound::Work(Box::new(Request {
        action,
        node_uuid,
        request_id: message_id,
        instance_info,
        options: Options::default(),
        only_if_prepared,
        slow: Default::default(),
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

    /// Values longer than any real one are refused, and a huge request id
    /// or node id is not echoed back.
    #[test]
    fn overlong_values_are_invalid_and_not_echoed() {
        let huge = "x".repeat(10 << 20);
        let long_id =
            serde_json::json!({"action": "cleanup", "node_uuid": NODE, "request_id": huge});
        match parse_command(long_id.to_string().as_bytes(), "h") {
            Inbound::Invalid(c) => {
                assert_eq!(c.error.as_ref().unwrap().code, ErrorCode::InvalidMessage);
                assert!(c.request_id.is_none());
                assert!(serde_json::to_string(&c).unwrap().len() < 4096);
            }
            other => panic!("{other:?}"),
        }
        let long_node = serde_json::json!({"action": "cleanup", "node_uuid": huge});
        match parse_command(long_node.to_string().as_bytes(), "h") {
            Inbound::Invalid(c) => {
                assert_eq!(c.error.as_ref().unwrap().code, ErrorCode::InvalidNodeUuid);
                assert!(c.node_uuid.is_none());
            }
            other => panic!("{other:?}"),
        }
        for (key, len) in [
            ("image_source", 8193),
            ("image_checksum", 8193),
            ("image_disk_format", 65),
            ("image_os_hash_algo", 65),
        ] {
            let mut info = serde_json::json!({"image_source": "http://x/y"});
            info[key] = "a".repeat(len).into();
            let body = serde_json::json!({"action": "prepare", "node_uuid": NODE,
                "request_id": "r", "instance_info": info});
            let i = parse_command(body.to_string().as_bytes(), "h");
            assert_eq!(code(&i), Some(ErrorCode::InvalidMessage), "{key}");
        }
        let fine = serde_json::json!({"action": "prepare", "node_uuid": NODE,
            "request_id": "r".repeat(255), "instance_info": {"image_source": "a".repeat(8192)}});
        assert!(matches!(
            parse_command(fine.to_string().as_bytes(), "h"),
            Inbound::Work(_)
        ));
    }

    /// Bodies captured from Ironic 39.0.0's notifier (messagingv2), so the
    /// parsing is tested without Python too.
    const START: &str = include_str!("../../tests/fixtures/provision_set_start.json");
    const END: &str = include_str!("../../tests/fixtures/provision_set_end_active.json");
    const ERROR: &str = include_str!("../../tests/fixtures/provision_set_error_deploy_failed.json");

    /// The captured bodies with the node's deploy interface set.
    fn with_interface(body: &str, interface: &str) -> String {
        body.replace(
            r#"\"deploy_interface\": null"#,
            &format!(r#"\"deploy_interface\": \"{interface}\""#),
        )
    }

    fn ours() -> Vec<String> {
        vec!["direct-worker".into()]
    }

    fn parse(body: &[u8], from: bool, host: &str) -> Inbound {
        super::parse(body, from, host, &["*".into()])
    }

    #[test]
    fn only_delegating_nodes_are_acted_on() {
        let start = with_interface(START, "direct-worker");
        assert_ne!(start, START);
        let req = work(super::parse(start.as_bytes(), true, "testhost", &ours()));
        assert_eq!(req.action, Action::Prepare);
        for other in [with_interface(START, "direct"), START.to_string()] {
            assert!(matches!(
                super::parse(other.as_bytes(), true, "testhost", &ours()),
                Inbound::Ignore("other_deploy_interface")
            ));
        }
        let teardown = with_interface(END, "direct");
        assert!(matches!(
            super::parse(teardown.as_bytes(), true, "testhost", &ours()),
            Inbound::Ignore("other_deploy_interface")
        ));
        // `*` takes every node.
        assert!(matches!(
            super::parse(START.as_bytes(), true, "testhost", &["*".into()]),
            Inbound::Work(_)
        ));
    }

    fn work(i: Inbound) -> Request {
        match i {
            Inbound::Work(r) => *r,
            other => panic!("expected work, got {other:?}"),
        }
    }

    #[test]
    fn captured_ironic_notifications() {
        let start = work(parse(START.as_bytes(), true, "testhost"));
        assert_eq!(start.action, Action::Prepare);
        assert_eq!(start.node_uuid, "1be26c0b-03f2-4d2e-ae87-c02d7f33c199");
        assert_eq!(
            start.instance_info.image_source.as_deref(),
            Some("http://x/y.img")
        );
        assert_eq!(start.instance_info.other["image_url"], "******");
        assert_eq!(
            start.request_id.as_deref(),
            Some("86931059-05c3-4f24-b329-5ae1bcb7cd04")
        );

        let end = work(parse(END.as_bytes(), true, "testhost"));
        assert_eq!(end.action, Action::Deployed);
        // Detected by shape even when it arrives through another exchange.
        assert_eq!(
            work(parse(END.as_bytes(), false, "testhost")).action,
            Action::Deployed
        );

        assert!(matches!(
            parse(ERROR.as_bytes(), true, "testhost"),
            Inbound::Ignore("no_action")
        ));
        assert!(matches!(
            parse(START.as_bytes(), true, "otherhost"),
            Inbound::Ignore("other_publisher")
        ));
    }

    #[test]
    fn unwrapped_and_newer_payloads_are_tolerated() {
        let outer: serde_json::Value = serde_json::from_str(START).unwrap();
        let mut msg: serde_json::Value =
            serde_json::from_str(outer["oslo.message"].as_str().unwrap()).unwrap();
        msg["payload"]["ironic_object.version"] = "9.99".into();
        msg["payload"]["ironic_object.data"]["some_future_field"] = serde_json::json!({"x": 1});
        let req = work(parse(msg.to_string().as_bytes(), false, "testhost"));
        assert_eq!(req.action, Action::Prepare);
    }

    #[test]
    fn provision_state_mapping() {
        let t = |state: &str, previous: &str, event: &str| Transition {
            state: state.into(),
            previous: previous.into(),
            event: event.into(),
        };
        assert_eq!(
            action_for(&t("deploying", "available", "deploy")),
            Some((Action::Prepare, false))
        );
        assert_eq!(
            action_for(&t("deploying", "active", "rebuild")),
            Some((Action::Prepare, false))
        );
        assert_eq!(
            action_for(&t("deploying", "wait call-back", "resume")),
            None
        );
        assert_eq!(
            action_for(&t("active", "deploying", "done")),
            Some((Action::Deployed, false))
        );
        assert_eq!(action_for(&t("active", "rescuing", "done")), None);
        assert_eq!(action_for(&t("deploy failed", "deploying", "fail")), None);
        assert_eq!(
            action_for(&t("deleting", "deploy failed", "deleted")),
            Some((Action::Cleanup, false))
        );
        assert_eq!(
            action_for(&t("available", "cleaning", "done")),
            Some((Action::Cleanup, true))
        );
    }
}
