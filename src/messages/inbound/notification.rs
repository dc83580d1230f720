//! Ironic's versioned notifications (`baremetal.node.provision_set.*` in
//! the oslo.messaging v2 envelope; docs/contract.md, "Ironic
//! notifications"): which transitions ask the worker for work, for which
//! nodes, and the request each one becomes.

use super::{Inbound, Text, invalid};
use crate::messages::{Action, Completion, IgnoreReason, InstanceInfo, NodeInfo, Options, Request};
use crate::node::NodeUuid;
use serde::Deserialize;
use serde_json::value::RawValue;

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

/// An oslo.messaging notification: the v2 envelope (`oslo.message`, a JSON
/// string holding the message) or the message itself. The payload is kept
/// as raw text, read only once the notification is known to be ours.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Notification<'a> {
    #[serde(rename = "oslo.message", borrow)]
    wrapped: Option<&'a RawValue>,
    message_id: Text,
    publisher_id: Text,
    event_type: Text,
    timestamp: Text,
    #[serde(borrow)]
    payload: Option<&'a RawValue>,
}

/// The node fields of a provision_set payload (Ironic's versioned object,
/// `ironic_object.data`, or the fields themselves).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct NodeData<'a> {
    #[serde(rename = "ironic_object.data", borrow)]
    data: Option<Box<NodeData<'a>>>,
    uuid: Text,
    provision_state: Text,
    previous_provision_state: Text,
    event: Text,
    deploy_interface: Text,
    #[serde(borrow)]
    instance_info: Option<&'a RawValue>,
    #[serde(borrow)]
    properties: Option<&'a RawValue>,
}

/// The node's `properties` in a provision_set payload (Ironic sends them
/// whole; `driver_info` is not in the payload at all): only the key that
/// chooses an OCI artifact, read leniently (any other key, any type).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct NotifiedProperties {
    cpu_arch: Text,
}

/// What a notified prepare knows of the node beyond `instance_info`: its
/// `properties.cpu_arch`, when the payload has it (an unreadable
/// `properties` is no reason to refuse the deploy: the artifact is then
/// chosen as for a node without one). Never a pull secret: `driver_info`
/// is not in the payload.
fn notified_node_info(properties: Option<&RawValue>) -> NodeInfo {
    let props = properties
        .and_then(|p| serde_json::from_str::<Option<NotifiedProperties>>(p.get()).ok())
        .flatten()
        .unwrap_or_default();
    NodeInfo {
        cpu_arch: props.cpu_arch.0.filter(|a| !a.trim().is_empty()),
        image_pull_secret: None,
    }
}

/// Ironic masks every `instance_info` key naming a secret before a
/// notification leaves the conductor (`image_pull_secret` becomes
/// `******`): a mask is no credential, so the worker falls back to
/// `[oci]authentication_config` as if the node had none.
fn drop_masked_secret(info: &mut InstanceInfo) {
    if info
        .image_pull_secret
        .as_ref()
        .is_some_and(|s| s.0.chars().all(|c| c == '*'))
    {
        info.image_pull_secret = None;
    }
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
    let outer: Notification = match serde_json::from_slice(body) {
        Ok(n) => n,
        Err(e) => return bad(None, format!("notification is not JSON: {e}")),
    };
    let inner: String;
    let msg = match outer.wrapped {
        None => outer,
        Some(raw) => {
            inner = match serde_json::from_str(raw.get()) {
                Ok(s) => s,
                Err(_) => return bad(None, "oslo.message is not a JSON string".into()),
            };
            match serde_json::from_str(&inner) {
                Ok(n) => n,
                Err(e) => return bad(None, format!("oslo.message is not JSON: {e}")),
            }
        }
    };
    let message_id = msg.message_id.0;
    let Some(publisher) = msg.publisher_id.0 else {
        return bad(message_id, "notification has no publisher_id".into());
    };
    let Some(event_type) = msg.event_type.0 else {
        return bad(message_id, "notification has no event_type".into());
    };
    match publisher.split_once('.') {
        Some(("ironic-conductor", h)) if h == host => {}
        _ => return Inbound::Ignore(IgnoreReason::OtherPublisher),
    }
    if !event_type.starts_with("baremetal.node.provision_set.") {
        return Inbound::Ignore(IgnoreReason::OtherEvent);
    }
    let payload = msg.payload.map_or("null", RawValue::get);
    let data = match serde_json::from_str::<Option<NodeData>>(payload) {
        Ok(Some(mut d)) => match d.data.take() {
            Some(inner) => *inner,
            None => d,
        },
        Ok(None) => NodeData::default(),
        Err(e) => return bad(message_id, format!("provision_set payload: {e}")),
    };
    let at_ms = msg.timestamp.0.as_deref().and_then(notification_time_ms);
    node_notification(data, message_id, at_ms, host, deploy_interfaces)
}

/// oslo.messaging's notification `timestamp` (`2026-11-30 04:06:26.656506`,
/// UTC without an offset) in ms since the epoch.
fn notification_time_ms(s: &str) -> Option<u64> {
    use time::format_description::well_known::Rfc3339;
    let iso = s.trim().replacen(' ', "T", 1);
    let parsed = time::OffsetDateTime::parse(&iso, &Rfc3339)
        .or_else(|_| time::OffsetDateTime::parse(&format!("{iso}Z"), &Rfc3339))
        .ok()?;
    u64::try_from(parsed.unix_timestamp_nanos() / 1_000_000).ok()
}

/// The rest of [`parse_notification`], once the notification is a
/// provision_set of this conductor: what the node's transition asks for.
fn node_notification(
    data: NodeData,
    message_id: Option<String>,
    at_ms: Option<u64>,
    host: &str,
    deploy_interfaces: &[String],
) -> Inbound {
    let node = data.uuid.0;
    let Some(read) = node.as_deref().map(NodeUuid::parse) else {
        let why = "provision_set payload has no node uuid".to_string();
        return invalid(Action::Unknown, None, message_id, host, why);
    };
    let transition = Transition {
        state: data.provision_state.0.unwrap_or_default(),
        previous: data.previous_provision_state.0.unwrap_or_default(),
        event: data.event.0.unwrap_or_default(),
    };
    let delegating = delegates(data.deploy_interface.0.as_deref(), deploy_interfaces);
    let Some((action, only_if_prepared)) = action_for(&transition) else {
        return moved_or_ignored(read.ok(), at_ms, delegating);
    };
    // A node that does not read is answered echoing it as received.
    let node_uuid = match read {
        Ok(node_uuid) => node_uuid,
        Err(e) => {
            return Inbound::Invalid(Box::new(
                Completion::new(action, node, message_id, host).failed(&e),
            ));
        }
    };
    if !delegating {
        return Inbound::Ignore(IgnoreReason::OtherDeployInterface);
    }
    let (instance_info, node_info) =
        match notified_content(action, data.instance_info, data.properties) {
            Ok(content) => content,
            Err(why) => return invalid(action, node, message_id, host, why),
        };
    Inbound::Work(Box::new(Request {
        action,
        node: Some(node_uuid),
        request_id: message_id,
        instance_info,
        options: Options::default(),
        node_info,
        only_if_prepared,
        slow: Default::default(),
        turn: Default::default(),
        issued_ms: at_ms,
        notified: true,
    }))
}

/// What a notification may still do when commands and answers are sealed:
/// Ironic emits notifications, nobody seals them, so anyone on the broker
/// could publish one. Its prepare only warms the image (the master is
/// cached, no node's file is linked or replaced); its `deployed`,
/// `cleanup` and transitions are ignored (no node's file is withdrawn, no
/// node's order changed). Anything else (a command, an ignored or
/// unusable message) is as it was.
pub fn unsealed(inbound: Inbound) -> Inbound {
    match inbound {
        Inbound::Work(mut req) if req.notified => {
            if req.action != Action::Prepare {
                return Inbound::Ignore(IgnoreReason::UnsealedNotification);
            }
            req.action = Action::Warm;
            req.node = None;
            Inbound::Work(req)
        }
        Inbound::Moved { .. } => Inbound::Ignore(IgnoreReason::UnsealedNotification),
        other => other,
    }
}

/// A transition that asks for no work: the node moved on when it is a
/// delegating node's and the notification says when; otherwise nothing.
fn moved_or_ignored(node: Option<NodeUuid>, at_ms: Option<u64>, delegating: bool) -> Inbound {
    match (node, at_ms) {
        (Some(node), Some(at_ms)) if delegating => Inbound::Moved { node, at_ms },
        _ => Inbound::Ignore(IgnoreReason::NoAction),
    }
}

/// What a notified request works with: its `instance_info` (a masked pull
/// secret dropped) and what it knows of the node, checked as a command's
/// are; a prepare needs an image source.
fn notified_content(
    action: Action,
    instance_info: Option<&RawValue>,
    properties: Option<&RawValue>,
) -> Result<(InstanceInfo, NodeInfo), String> {
    let raw = instance_info.map_or("null", RawValue::get);
    let mut instance_info = serde_json::from_str::<Option<InstanceInfo>>(raw)
        .map_err(|e| format!("instance_info: {e}"))?
        .unwrap_or_default();
    drop_masked_secret(&mut instance_info);
    let node_info = notified_node_info(properties);
    instance_info.check_lengths()?;
    node_info.check_lengths()?;
    if action == Action::Prepare
        && instance_info
            .image_source
            .as_deref()
            .is_none_or(|s| s.trim().is_empty())
    {
        return Err("deploy notification without instance_info.image_source".to_string());
    }
    Ok((instance_info, node_info))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::inbound;

    /// Bodies captured from Ironic 39.0.0's notifier (messagingv2), so the
    /// parsing is tested without Python too.
    const START: &str = include_str!("../../../tests/fixtures/provision_set_start.json");
    const END: &str = include_str!("../../../tests/fixtures/provision_set_end_active.json");
    const ERROR: &str =
        include_str!("../../../tests/fixtures/provision_set_error_deploy_failed.json");

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
        inbound::parse(body, from, host, &["*".into()], 1 << 20)
    }

    #[test]
    fn only_delegating_nodes_are_acted_on() {
        let start = with_interface(START, "direct-worker");
        assert_ne!(start, START);
        let req = work(inbound::parse(
            start.as_bytes(),
            true,
            "testhost",
            &ours(),
            1 << 20,
        ));
        assert_eq!(req.action, Action::Prepare);
        for other in [with_interface(START, "direct"), START.to_string()] {
            assert!(matches!(
                inbound::parse(other.as_bytes(), true, "testhost", &ours(), 1 << 20),
                Inbound::Ignore(IgnoreReason::OtherDeployInterface)
            ));
        }
        let teardown = with_interface(END, "direct");
        assert!(matches!(
            inbound::parse(teardown.as_bytes(), true, "testhost", &ours(), 1 << 20),
            Inbound::Ignore(IgnoreReason::OtherDeployInterface)
        ));
        // `*` takes every node.
        assert!(matches!(
            inbound::parse(START.as_bytes(), true, "testhost", &["*".into()], 1 << 20),
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
        assert_eq!(start.node_str(), "1be26c0b-03f2-4d2e-ae87-c02d7f33c199");
        assert_eq!(
            start.instance_info.image_source.as_deref(),
            Some("http://x/y.img")
        );
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

        // deploy failed asks for nothing, but the node moved on then.
        match parse(ERROR.as_bytes(), true, "testhost") {
            Inbound::Moved { node, at_ms } => {
                assert_eq!(node.as_str(), "1be26c0b-03f2-4d2e-ae87-c02d7f33c199");
                assert!(at_ms > start.issued_ms.unwrap(), "{at_ms}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            start.issued_ms,
            notification_time_ms("2026-11-30 04:06:26.656506")
        );
        assert_eq!(
            notification_time_ms("1970-01-01 00:00:01.5"),
            Some(1500),
            "UTC, milliseconds"
        );
        assert!(start.notified);
        assert!(matches!(
            parse(START.as_bytes(), true, "otherhost"),
            Inbound::Ignore(IgnoreReason::OtherPublisher)
        ));
    }

    /// The node is read once, where the notification is: a UUID in upper
    /// case is the canonical node; one that is not a UUID is answered
    /// `invalid_node_uuid`, echoing it as received, as a command's is.
    #[test]
    fn a_notified_node_is_read_once_and_a_bad_one_answered() {
        let outer: serde_json::Value = serde_json::from_str(START).unwrap();
        let mut msg: serde_json::Value =
            serde_json::from_str(outer["oslo.message"].as_str().unwrap()).unwrap();
        let node = "1be26c0b-03f2-4d2e-ae87-c02d7f33c199";
        msg["payload"]["ironic_object.data"]["uuid"] = node.to_uppercase().into();
        let req = work(parse(msg.to_string().as_bytes(), false, "testhost"));
        assert_eq!(req.node_str(), node);
        msg["payload"]["ironic_object.data"]["uuid"] = "../x".into();
        match parse(msg.to_string().as_bytes(), false, "testhost") {
            Inbound::Invalid(c) => {
                let wire: serde_json::Value =
                    serde_json::from_slice(&c.to_json().unwrap()).unwrap();
                let want = serde_json::json!({"action": "prepare", "status": "error",
                    "node_uuid": "../x", "request_id": "86931059-05c3-4f24-b329-5ae1bcb7cd04",
                    "conductor_host": "testhost", "duration_ms": 0,
                    "error": {"code": "invalid_node_uuid",
                        "message": "node UUID \"../x\" is not a canonical UUID"}});
                assert_eq!(wire, want);
            }
            other => panic!("{other:?}"),
        }
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
    fn notified_cpu_arch_is_read_and_a_masked_secret_dropped() {
        let outer: serde_json::Value = serde_json::from_str(START).unwrap();
        let mut msg: serde_json::Value =
            serde_json::from_str(outer["oslo.message"].as_str().unwrap()).unwrap();
        let data = &mut msg["payload"]["ironic_object.data"];
        data["properties"] = serde_json::json!({"cpu_arch": "aarch64", "memory_mb": 4096});
        data["instance_info"]["image_pull_secret"] = "******".into();
        let req = work(parse(msg.to_string().as_bytes(), false, "testhost"));
        assert_eq!(req.node_info.cpu_arch.as_deref(), Some("aarch64"));
        assert!(req.node_info.image_pull_secret.is_none());
        assert!(req.instance_info.image_pull_secret.is_none());
        // An unmasked one (an Ironic that did not mask it) is used as sent;
        // a `properties` of another shape is no reason to refuse.
        let data = &mut msg["payload"]["ironic_object.data"];
        data["instance_info"]["image_pull_secret"] = "u:p".into();
        data["properties"] = serde_json::json!({"cpu_arch": ["odd"]});
        let req = work(parse(msg.to_string().as_bytes(), false, "testhost"));
        assert_eq!(req.instance_info.image_pull_secret.unwrap().0, "u:p");
        assert!(req.node_info.cpu_arch.is_none());
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

    /// With sealed commands, a notification warms at most: its prepare
    /// names no node any more, the rest is ignored.
    #[test]
    fn unsealed_notifications_only_warm() {
        let start = with_interface(START, "direct-worker");
        let prepare = inbound::parse(start.as_bytes(), true, "testhost", &ours(), 1 << 20);
        assert!(matches!(&prepare, Inbound::Work(r) if r.action == Action::Prepare));
        match unsealed(prepare) {
            Inbound::Work(r) => {
                assert_eq!(r.action, Action::Warm);
                assert!(r.node.is_none());
                assert!(r.instance_info.image_source.is_some());
            }
            other => panic!("{other:?}"),
        }
        let end = with_interface(END, "direct-worker");
        let deployed = inbound::parse(end.as_bytes(), true, "testhost", &ours(), 1 << 20);
        assert!(matches!(&deployed, Inbound::Work(r) if r.action == Action::Deployed));
        assert!(matches!(
            unsealed(deployed),
            Inbound::Ignore(IgnoreReason::UnsealedNotification)
        ));
        let node = NodeUuid::parse("1be26c0b-03f2-4d2e-ae87-c02d7f33c123").unwrap();
        assert!(matches!(
            unsealed(Inbound::Moved { node, at_ms: 1 }),
            Inbound::Ignore(IgnoreReason::UnsealedNotification)
        ));
        let command = br#"{"action":"cleanup","node_uuid":"1be26c0b-03f2-4d2e-ae87-c02d7f33c123","request_id":"r"}"#;
        let cleanup = inbound::parse(command, false, "testhost", &ours(), 1 << 20);
        assert!(matches!(unsealed(cleanup), Inbound::Work(r) if r.action == Action::Cleanup));
    }
}
