//! Explicit commands (`schemas/command.v1.json`): what a `prepare`,
//! `deployed`, `cleanup` or `warm` asks for, or the error answer of one
//! that cannot be used.

use super::{Inbound, Text, invalid};
use crate::messages::{
    Action, Completion, InstanceInfo, MAX_REQUEST_ID_LEN, NodeInfo, Options, Request, Secret,
};
use crate::node::NodeUuid;
use serde::Deserialize;

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
    image_pull_secret: Option<Secret>,
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
    match command_request(cmd, host) {
        Ok(request) => Inbound::Work(Box::new(request)),
        Err(refused) => refused,
    }
}

/// The request a command that parsed asks for, or the error answer of a
/// command that names an unknown action, a bad node or overlong values.
fn command_request(cmd: CommandBody, host: &str) -> Result<Request, Inbound> {
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
        return Err(invalid(Action::Unknown, node, request_id, host, why));
    };
    let target = command_node(action, cmd.node_uuid.as_deref(), &request_id, host)?;
    if let Some(long) = cmd
        .request_id
        .as_ref()
        .filter(|r| r.len() > MAX_REQUEST_ID_LEN)
    {
        let why = format!(
            "request_id is {} bytes long, more than {MAX_REQUEST_ID_LEN}",
            long.len()
        );
        return Err(invalid(action, node, None, host, why));
    }
    let instance_info = cmd.instance_info.unwrap_or_default();
    let node_info = NodeInfo {
        cpu_arch: cmd.properties.and_then(|p| p.cpu_arch),
        image_pull_secret: cmd.driver_info.and_then(|d| d.image_pull_secret),
    };
    if let Err(why) = check_content(action, &instance_info, &node_info) {
        return Err(invalid(action, node, request_id, host, why));
    }
    Ok(Request {
        action,
        node: target,
        request_id: cmd.request_id,
        instance_info,
        options: cmd.options.unwrap_or_default(),
        node_info,
        only_if_prepared: false,
        slow: Default::default(),
        turn: Default::default(),
        issued_ms: None,
        notified: false,
    })
}

/// The node a command's action works on, read here once: none for a
/// `warm` (it names an image), a valid node UUID for every other action;
/// else the error answer, `invalid_node_uuid` echoing the node as received
/// when it is at most [`MAX_NODE_ECHO_LEN`] bytes long.
fn command_node(
    action: Action,
    node_uuid: Option<&str>,
    request_id: &Option<String>,
    host: &str,
) -> Result<Option<NodeUuid>, Inbound> {
    let refuse = |why: &str| invalid(action, None, request_id.clone(), host, why.to_string());
    match (action, node_uuid) {
        (Action::Warm, None) => Ok(None),
        (Action::Warm, Some(_)) => Err(refuse(
            "warm names an image, not a node: it has no node_uuid",
        )),
        (_, None) => Err(refuse(
            "command does not fit the schema: missing field `node_uuid`",
        )),
        (_, Some(n)) => NodeUuid::parse(n).map(Some).map_err(|e| {
            let echo = Some(n)
                .filter(|n| n.len() <= MAX_NODE_ECHO_LEN)
                .map(str::to_string);
            let answer = Completion::new(action, echo, request_id.clone(), host).failed(&e);
            Inbound::Invalid(Box::new(answer))
        }),
    }
}

/// The checks of a command's content: no value longer than any real one,
/// and an image source for the actions that fetch one.
fn check_content(
    action: Action,
    instance_info: &InstanceInfo,
    node_info: &NodeInfo,
) -> Result<(), String> {
    instance_info.check_lengths()?;
    node_info.check_lengths()?;
    let has_source = instance_info
        .image_source
        .as_deref()
        .is_some_and(|s| !s.trim().is_empty());
    if matches!(action, Action::Prepare | Action::Warm) && !has_source {
        return Err(format!(
            "{} needs instance_info.image_source",
            action.as_str()
        ));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

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
                assert_eq!(r.node.as_ref().map(NodeUuid::as_str), Some(NODE));
                assert_eq!(r.node_str(), NODE);
                assert_eq!(r.options.force_raw, Some(false));
            }
            other => panic!("{other:?}"),
        }
    }

    /// A node that is not a canonical UUID is answered `invalid_node_uuid`
    /// (never a request), echoing it as received up to
    /// `MAX_NODE_ECHO_LEN` bytes, and no further; a UUID in upper case is
    /// read as its canonical form.
    #[test]
    fn a_node_is_read_once_and_a_bad_one_answered() {
        let upper = NODE.to_uppercase();
        let body = format!(r#"{{"action":"cleanup","node_uuid":"{upper}"}}"#);
        match parse_command(body.as_bytes(), "h") {
            Inbound::Work(r) => assert_eq!(r.node_str(), NODE),
            other => panic!("{other:?}"),
        }
        let fits = "x".repeat(MAX_NODE_ECHO_LEN);
        let over = "x".repeat(MAX_NODE_ECHO_LEN + 1);
        for (node, echo) in [
            ("../x", Some("../x")),
            (fits.as_str(), Some(fits.as_str())),
            (over.as_str(), None),
        ] {
            let body = serde_json::json!({"action": "deployed", "node_uuid": node,
                "request_id": "r"});
            match parse_command(body.to_string().as_bytes(), "h") {
                Inbound::Invalid(c) => {
                    assert_eq!(c.action, Action::Deployed);
                    assert_eq!(c.error.as_ref().unwrap().code, ErrorCode::InvalidNodeUuid);
                    assert_eq!(c.node_uuid.as_deref(), echo, "{node}");
                    assert_eq!(c.request_id.as_deref(), Some("r"));
                    assert_eq!(c.conductor_host, "h");
                    assert!(c.image_source.is_none());
                    if node == "../x" {
                        let wire: serde_json::Value =
                            serde_json::from_slice(&c.to_json().unwrap()).unwrap();
                        let want = serde_json::json!({"action": "deployed", "status": "error",
                            "node_uuid": "../x", "request_id": "r", "conductor_host": "h",
                            "duration_ms": 0, "error": {"code": "invalid_node_uuid",
                            "message": "node UUID \"../x\" is not a canonical UUID"}});
                        assert_eq!(wire, want);
                    }
                }
                other => panic!("{other:?}"),
            }
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
                assert!(r.node.is_none());
                assert_eq!(r.node_str(), "");
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
}
