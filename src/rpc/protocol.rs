//! JSON-RPC 2.0 as Ironic's `ironic.common.json_rpc` speaks it: the
//! request envelope, and the answers its client reads (a result; an error
//! whose `data.class` names an exception of `ironic.common.exception`,
//! which the client raises with the error's message).

use crate::error::ErrorCode;
use crate::messages::Completion;
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// The protocol's own error codes (Ironic's server uses the same).
pub(crate) mod code {
    /// The body is not JSON.
    pub(crate) const PARSE_ERROR: i64 = -32700;
    /// Not a JSON-RPC 2.0 request object.
    pub(crate) const INVALID_REQUEST: i64 = -32600;
    /// No such method.
    pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
    /// The params do not fit the method.
    pub(crate) const INVALID_PARAMS: i64 = -32602;
    /// Too many requests under way (a server error of JSON-RPC's range).
    pub(crate) const SERVER_BUSY: i64 = -32000;
}

/// One request, as far as the envelope goes.
#[derive(Debug)]
pub(crate) struct Envelope {
    /// `None` for a notification (Ironic's `cast`): nothing is answered.
    pub(crate) id: Option<Value>,
    /// The method name.
    pub(crate) method: String,
    /// The named params, `context` and `rpc.version` removed.
    pub(crate) params: Map<String, Value>,
    /// The caller's `context` (Ironic's request context), if any.
    pub(crate) context: Option<Map<String, Value>>,
}

#[derive(Deserialize)]
struct Raw {
    jsonrpc: Option<Value>,
    method: Option<Value>,
    #[serde(default)]
    params: Option<Value>,
    id: Option<Value>,
}

/// An envelope that cannot be read: the error to answer, with whatever id
/// could be read.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) id: Option<Value>,
    pub(crate) error: Value,
}

/// Reads one request; positional params and batches are refused, as
/// Ironic's server refuses them.
pub(crate) fn parse(body: &[u8]) -> Result<Envelope, Refused> {
    let value: Value = serde_json::from_slice(body).map_err(|_| Refused {
        id: None,
        error: plain_error(code::PARSE_ERROR, "Invalid JSON received by RPC server"),
    })?;
    let invalid = |id: Option<Value>| Refused {
        id,
        error: plain_error(
            code::INVALID_REQUEST,
            "Invalid request object received by RPC server",
        ),
    };
    if !value.is_object() {
        return Err(invalid(None));
    }
    let raw: Raw = serde_json::from_value(value).map_err(|_| invalid(None))?;
    let id = raw.id.filter(|v| !v.is_null());
    let method = match (&raw.jsonrpc, raw.method) {
        (Some(Value::String(v)), Some(Value::String(m))) if v == "2.0" && !m.is_empty() => m,
        _ => return Err(invalid(id)),
    };
    let mut params = match raw.params {
        None => Map::new(),
        Some(Value::Object(p)) => p,
        Some(_) => return Err(invalid(id)),
    };
    params.remove("rpc.version");
    let context = match params.remove("context") {
        None => None,
        Some(Value::Object(c)) => Some(c),
        Some(_) => {
            return Err(Refused {
                id,
                error: plain_error(
                    code::INVALID_PARAMS,
                    "Context must be a dictionary, if provided",
                ),
            });
        }
    };
    Ok(Envelope {
        id,
        method,
        params,
        context,
    })
}

/// An error of the protocol itself (no `data`, as Ironic's server sends
/// them: its client raises a plain error for them).
pub(crate) fn plain_error(code: i64, message: &str) -> Value {
    json!({"code": code, "message": message})
}

/// The Ironic exception class the client raises for a worker's error
/// code: a request the worker cannot read is the caller's invalid
/// parameter, anything else a failure of the work.
fn ironic_class(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::InvalidMessage | ErrorCode::InvalidNodeUuid => {
            "ironic.common.exception.InvalidParameterValue"
        }
        _ => "ironic.common.exception.IronicException",
    }
}

/// The error answering a failed completion: the message starts with the
/// worker's error code (the client keeps only the message), and `data`
/// holds the code and the whole completion.
pub(crate) fn completion_error(done: &Completion) -> Value {
    let (code, message) = done
        .error
        .as_ref()
        .map_or((ErrorCode::Internal, "failed"), |e| {
            (e.code, e.message.as_str())
        });
    let http = match code {
        ErrorCode::InvalidMessage | ErrorCode::InvalidNodeUuid => 400,
        _ => 500,
    };
    json!({
        "code": http,
        "message": format!("{}: {message}", code.as_str()),
        "data": {
            "class": ironic_class(code),
            "error_code": code.as_str(),
            "completion": completion_value(done),
        },
    })
}

/// A completion as its JSON object (a warm's without `node_uuid`, as on
/// the broker).
pub(crate) fn completion_value(done: &Completion) -> Value {
    done.to_json()
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

/// A response carrying `result`.
pub(crate) fn result(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "result": result, "id": id})
}

/// A response carrying `error`.
pub(crate) fn error(id: Option<&Value>, error: Value) -> Value {
    json!({"jsonrpc": "2.0", "error": error, "id": id})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ironic_call_is_read_and_bad_envelopes_are_refused() {
        let body = br#"{"jsonrpc": "2.0", "method": "prepare", "id": "req-1",
            "params": {"node_uuid": "n", "context": {"request_id": "req-1"},
                       "rpc.version": "1.0"}}"#;
        let e = parse(body).unwrap();
        assert_eq!(e.method, "prepare");
        assert_eq!(e.id, Some(json!("req-1")));
        assert_eq!(e.params.keys().collect::<Vec<_>>(), vec!["node_uuid"]);
        assert_eq!(e.context.unwrap()["request_id"], "req-1");
        let cast = parse(br#"{"jsonrpc": "2.0", "method": "warm", "params": {}}"#).unwrap();
        assert_eq!(cast.id, None);
        let refused = |b: &[u8]| parse(b).unwrap_err().error["code"].as_i64().unwrap();
        assert_eq!(refused(b"{nope"), code::PARSE_ERROR);
        assert_eq!(refused(b"[]"), code::INVALID_REQUEST);
        assert_eq!(
            refused(br#"{"jsonrpc": "1.0", "method": "x", "id": 1}"#),
            code::INVALID_REQUEST
        );
        assert_eq!(
            refused(br#"{"jsonrpc": "2.0", "method": "x", "params": [1], "id": 1}"#),
            code::INVALID_REQUEST
        );
        assert_eq!(
            refused(br#"{"jsonrpc": "2.0", "method": "x", "params": {"context": 1}}"#),
            code::INVALID_PARAMS
        );
    }
}
