//! What arrives on the per-host queue and what it asks for: explicit
//! commands (`schemas/command.v1.json`) and Ironic's own versioned
//! notifications (`baremetal.node.provision_set.*` in the oslo.messaging v2
//! envelope; docs/contract.md, "Ironic notifications").
//! Parsing never fails silently: an unreadable message becomes an error
//! completion plus a dead-letter, never a dropped message.

use crate::error::{Error, ErrorCode};
use crate::messages::Request;
use crate::messages::{Action, Completion, InstanceInfo, MAX_REQUEST_ID_LEN, Options};
use crate::node::NodeUuid;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

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
    /// A notification of a delegating node's transition that asks for no
    /// work (`deploy failed`, `wait call-back`, ...): nothing to answer, but
    /// the node moved on at `at_ms`, so a prepare issued before that is
    /// stale (docs/contract.md, "Order of a node's commands").
    Moved {
        /// The node (a canonical UUID).
        node: String,
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

/// A text value when it is a JSON string, `None` for any other value (which
/// is skipped, not built): for fields only echoed or compared.
#[derive(Debug, Default)]
struct Text(Option<String>);

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

/// A node id longer than this is not echoed back (a UUID has 36 characters).
const MAX_NODE_ECHO_LEN: usize = 64;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandBody {
    action: String,
    /// Required by every action but `warm`, which must not have one.
    #[serde(default)]
    node_uuid: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    instance_info: Option<InstanceInfo>,
    #[serde(default)]
    options: Option<Options>,
    #[serde(default)]
    driver_info: Option<DriverInfo>,
    #[serde(default)]
    properties: Option<Properties>,
}

/// The command's `driver_info`: the keys the worker reads.
#[derive(Debug, Default, Deserialize)]
struct DriverInfo {
    #[serde(default)]
    image_pull_secret: Option<super::Secret>,
}

/// The command's `properties`: the keys the worker reads.
#[derive(Debug, Default, Deserialize)]
struct Properties {
    #[serde(default)]
    cpu_arch: Option<String>,
}

/// What an unusable command echoes: its action, node and request id, read
/// leniently (any other key skipped) when the command itself does not parse.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CommandEcho {
    action: Text,
    node_uuid: Text,
    request_id: Text,
}

fn action_named(name: Option<&str>) -> Option<Action> {
    match name {
        Some("prepare") => Some(Action::Prepare),
        Some("deployed") => Some(Action::Deployed),
        Some("cleanup") => Some(Action::Cleanup),
        Some("warm") => Some(Action::Warm),
        _ => None,
    }
}

/// Parses a command body for the worker of conductor `host`.
pub fn parse_command(body: &[u8], host: &str) -> Inbound {
    let cmd: CommandBody = match serde_json::from_slice(body) {
        Ok(c) => c,
        Err(e) => return unusable_command(body, host, e),
    };
    // Echoed in the error event only when of a sane length.
    let request_id = cmd
        .request_id
        .clone()
        .filter(|r| r.len() <= MAX_REQUEST_ID_LEN);
    let node = cmd
        .node_uuid
        .clone()
        .filter(|n| n.len() <= MAX_NODE_ECHO_LEN);
    let Some(action) = action_named(Some(&cmd.action)) else {
        let why = format!("unknown action {:?}", cmd.action);
        return invalid(Action::Unknown, node, request_id, host, why);
    };
    let node_uuid = match (action, &cmd.node_uuid) {
        (Action::Warm, None) => String::new(),
        (Action::Warm, Some(_)) => {
            let why = "warm names an image, not a node: it has no node_uuid".to_string();
            return invalid(action, None, request_id, host, why);
        }
        (_, None) => {
            let why = "command does not fit the schema: missing field `node_uuid`".to_string();
            return invalid(action, None, request_id, host, why);
        }
        (_, Some(n)) => match NodeUuid::parse(n) {
            Ok(_) => n.clone(),
            Err(e) => {
                return Inbound::Invalid(Box::new(
                    Completion::new(action, node, request_id, host).failed(&e),
                ));
            }
        },
    };
    if let Some(long) = cmd
        .request_id
        .as_ref()
        .filter(|r| r.len() > MAX_REQUEST_ID_LEN)
    {
        let why = format!(
            "request_id is {} bytes long, more than {MAX_REQUEST_ID_LEN}",
            long.len()
        );
        return invalid(action, node, None, host, why);
    }
    let instance_info = cmd.instance_info.unwrap_or_default();
    if let Err(why) = instance_info.check_lengths() {
        return invalid(action, node, request_id, host, why);
    }
    let node_info = super::NodeInfo {
        cpu_arch: cmd.properties.and_then(|p| p.cpu_arch),
        image_pull_secret: cmd.driver_info.and_then(|d| d.image_pull_secret),
    };
    if let Err(why) = node_info.check_lengths() {
        return invalid(action, node, request_id, host, why);
    }
    let has_source = instance_info
        .image_source
        .as_deref()
        .is_some_and(|s| !s.trim().is_empty());
    if matches!(action, Action::Prepare | Action::Warm) && !has_source {
        let why = format!("{} needs instance_info.image_source", action.as_str());
        return invalid(action, node, request_id, host, why);
    }
    Inbound::Work(Box::new(Request {
        action,
        node_uuid,
        request_id: cmd.request_id,
        instance_info,
        options: cmd.options.unwrap_or_default(),
        node_info,
        only_if_prepared: false,
        slow: Default::default(),
        issued_ms: None,
        notified: false,
    }))
}

/// The answer to a command that does not parse: what it can echo is read
/// again leniently, and the error says why.
fn unusable_command(body: &[u8], host: &str, e: serde_json::Error) -> Inbound {
    let echo = match serde_json::from_slice::<CommandEcho>(body) {
        Ok(echo) => echo,
        Err(_) if e.is_syntax() || e.is_eof() => {
            let why = format!("body is not JSON: {e}");
            return invalid(Action::Unknown, None, None, host, why);
        }
        Err(_) => CommandEcho::default(),
    };
    let request_id = echo.request_id.0.filter(|r| r.len() <= MAX_REQUEST_ID_LEN);
    let node = echo.node_uuid.0.filter(|n| n.len() <= MAX_NODE_ECHO_LEN);
    match action_named(echo.action.0.as_deref()) {
        Some(action) => invalid(
            action,
            node,
            request_id,
            host,
            format!("command does not fit the schema: {e}"),
        ),
        None => invalid(
            Action::Unknown,
            node,
            request_id,
            host,
            format!("unknown action {:?}", echo.action.0),
        ),
    }
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
fn notified_node_info(properties: Option<&RawValue>) -> super::NodeInfo {
    let props = properties
        .and_then(|p| serde_json::from_str::<Option<NotifiedProperties>>(p.get()).ok())
        .flatten()
        .unwrap_or_default();
    super::NodeInfo {
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
        _ => return Inbound::Ignore("other_publisher"),
    }
    if !event_type.starts_with("baremetal.node.provision_set.") {
        return Inbound::Ignore("other_event");
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
    let Some(node_uuid) = node.clone() else {
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
        return match (NodeUuid::parse(&node_uuid), at_ms) {
            (Ok(node), Some(at_ms)) if delegating => Inbound::Moved {
                node: node.to_string(),
                at_ms,
            },
            _ => Inbound::Ignore("no_action"),
        };
    };
    if let Err(e) = NodeUuid::parse(&node_uuid) {
        return Inbound::Invalid(Box::new(
            Completion::new(action, node, message_id, host).failed(&e),
        ));
    }
    if !delegating {
        return Inbound::Ignore("other_deploy_interface");
    }
    let instance_info = data.instance_info.map_or("null", RawValue::get);
    let mut instance_info: InstanceInfo =
        match serde_json::from_str::<Option<InstanceInfo>>(instance_info) {
            Ok(i) => i.unwrap_or_default(),
            Err(e) => {
                let why = format!("instance_info: {e}");
                return invalid(action, node, message_id, host, why);
            }
        };
    drop_masked_secret(&mut instance_info);
    let node_info = notified_node_info(data.properties);
    if let Err(why) = instance_info
        .check_lengths()
        .and_then(|()| node_info.check_lengths())
    {
        return invalid(action, node, message_id, host, why);
    }
    if action == Action::Prepare
        && instance_info
            .image_source
            .as_deref()
            .is_none_or(|s| s.trim().is_empty())
    {
        let why = "deploy notification without instance_info.image_source".to_string();
        return invalid(action, node, message_id, host, why);
    }
    Inbound::Work(Box::new(Request {
        action,
        node_uuid,
        request_id: message_id,
        instance_info,
        options: Options::default(),
        node_info,
        only_if_prepared,
        slow: Default::default(),
        issued_ms: at_ms,
        notified: true,
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

    /// A warm names an image and no node; every other action needs a node.
    #[test]
    fn warm_names_no_node() {
        let warm = r#"{"action":"warm","request_id":"w","instance_info":{"image_source":"http://x/i"},"options":{"force_raw":false}}"#;
        match parse_command(warm.as_bytes(), "h") {
            Inbound::Work(r) => {
                assert_eq!(r.action, Action::Warm);
                assert_eq!(r.node_uuid, "");
                assert_eq!(r.options.force_raw, Some(false));
            }
            other => panic!("{other:?}"),
        }
        let with_node = format!(
            r#"{{"action":"warm","node_uuid":"{NODE}","instance_info":{{"image_source":"http://x/i"}}}}"#
        );
        match parse_command(with_node.as_bytes(), "h") {
            Inbound::Invalid(c) => {
                assert_eq!(c.action, Action::Warm);
                assert_eq!(c.error.as_ref().unwrap().code, ErrorCode::InvalidMessage);
                let wire: serde_json::Value =
                    serde_json::from_slice(&c.to_json().unwrap()).unwrap();
                assert!(wire.get("node_uuid").is_none(), "{wire}");
            }
            other => panic!("{other:?}"),
        }
        let no_image = r#"{"action":"warm"}"#;
        assert_eq!(
            code(&parse_command(no_image.as_bytes(), "h")),
            Some(ErrorCode::InvalidMessage)
        );
        let no_node = r#"{"action":"cleanup"}"#;
        match parse_command(no_node.as_bytes(), "h") {
            Inbound::Invalid(c) => {
                assert_eq!(c.action, Action::Cleanup);
                let wire: serde_json::Value =
                    serde_json::from_slice(&c.to_json().unwrap()).unwrap();
                assert_eq!(wire["node_uuid"], serde_json::Value::Null, "{wire}");
            }
            other => panic!("{other:?}"),
        }
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
        super::parse(body, from, host, &["*".into()], 1 << 20)
    }

    #[test]
    fn only_delegating_nodes_are_acted_on() {
        let start = with_interface(START, "direct-worker");
        assert_ne!(start, START);
        let req = work(super::parse(
            start.as_bytes(),
            true,
            "testhost",
            &ours(),
            1 << 20,
        ));
        assert_eq!(req.action, Action::Prepare);
        for other in [with_interface(START, "direct"), START.to_string()] {
            assert!(matches!(
                super::parse(other.as_bytes(), true, "testhost", &ours(), 1 << 20),
                Inbound::Ignore("other_deploy_interface")
            ));
        }
        let teardown = with_interface(END, "direct");
        assert!(matches!(
            super::parse(teardown.as_bytes(), true, "testhost", &ours(), 1 << 20),
            Inbound::Ignore("other_deploy_interface")
        ));
        // `*` takes every node.
        assert!(matches!(
            super::parse(START.as_bytes(), true, "testhost", &["*".into()], 1 << 20),
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
                assert_eq!(node, "1be26c0b-03f2-4d2e-ae87-c02d7f33c199");
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
