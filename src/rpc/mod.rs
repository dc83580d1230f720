//! The JSON-RPC listener: the worker's commands for an Ironic without a
//! broker, called through Ironic's own JSON-RPC client
//! (`ironic.common.json_rpc.client`), as Ironic's out-of-process services
//! are.
//!
//! Methods `prepare`, `deployed`, `cleanup` and `warm` take the command
//! bodies (less `action`) as named params, beside Ironic's `context` and
//! `rpc.version`; they go through the same dispatch as the broker's
//! deliveries (`crate::dispatch`). A call waits for its answer up to
//! `request_timeout`: the completion, an error carrying the completion's
//! error code, or `{"status": "in_progress"}` when the work goes on. A
//! notification (Ironic's `cast`, no `id`) is queued and answered with
//! nothing (`204`). `status` tells what became of a node's request. A
//! request whose `request_id` is under way or answered is not worked again.
//!
//! # This folder
//!
//! Holds the listener and its methods (this module), the envelope and the
//! answers' shapes (`protocol`) and the htpasswd check (`htpasswd`). Must
//! not know the pipeline's internals or AMQP.

pub(crate) mod htpasswd;
mod protocol;

use crate::clock::now_ms;
use crate::dispatch::{
    AnswerKey, Carrier, Deferral, DeliveryKey, Dispatch, Job, Lookup, Shelf, Transport,
};
use crate::http::Limits;
use crate::messages::inbound::{self, Inbound};
use crate::messages::{Completion, IgnoreReason, Request, Status};
use axum::extract::{Request as HttpRequest, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::future::BoxFuture;
use htpasswd::{Htpasswd, Refusal};
use protocol::{Envelope, code};
use serde_json::{Value, json};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// What the listener needs besides its socket.
pub(crate) struct RpcServer {
    /// The dispatch both transports share.
    pub(crate) work: Arc<Dispatch>,
    /// `http_basic`: the users allowed; `None`: `noauth`.
    pub(crate) auth: Option<Arc<Htpasswd>>,
    /// HTTPS with this certificate (reloaded as it changes).
    pub(crate) tls: Option<Arc<crate::http::Tls>>,
    /// Connections and header and idle timeouts.
    pub(crate) limits: Limits,
    /// Largest request body read.
    pub(crate) max_body_bytes: usize,
    /// The longest a call waits for its work before answering
    /// `in_progress`.
    pub(crate) request_timeout: Duration,
}

struct RpcState {
    server: RpcServer,
    host: String,
    /// Where this port's casts are kept until answered.
    shelf: Shelf,
    /// Requests queued or running at once (each job holds one until it
    /// ends): a caller beyond it is told the worker is busy.
    in_flight: Arc<tokio::sync::Semaphore>,
}

/// JSON-RPC requests queued or running at once.
const MAX_IN_FLIGHT: usize = 1024;

/// Serves JSON-RPC on `listener` until `shutdown` completes.
pub(crate) async fn serve(
    listener: TcpListener,
    server: RpcServer,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let host = server.work.host().to_string();
    let (tls, limits) = (server.tls.clone(), server.limits);
    let state = Arc::new(RpcState {
        server,
        host,
        shelf: Shelf::json_rpc(listener.local_addr()?.port()),
        in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
    });
    state.resume_parked().await;
    let app = axum::Router::new().fallback(handle).with_state(state);
    let listener = crate::http::listener::Listener { listener, tls };
    crate::http::listener::serve(listener, app, limits, None, shutdown).await
}

/// One HTTP request: authentication first (cheap when it fails), then the
/// method check, the bounded body, the envelope, the method.
async fn handle(State(state): State<Arc<RpcState>>, req: HttpRequest) -> Response {
    if let Some(auth) = &state.server.auth {
        let header = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        let client = req
            .extensions()
            .get::<crate::http::access::ClientAddr>()
            .map(|c| c.0.ip());
        if let Err(refusal) = auth.check(header, client).await {
            return refused(refusal);
        }
    }
    if req.method() != Method::POST {
        return status_json(
            StatusCode::METHOD_NOT_ALLOWED,
            json!({"error": {"code": 405, "message": "Only POST method can be used"}}),
        );
    }
    let limit = state.server.max_body_bytes;
    let too_large = || {
        let message = format!("request body over {limit} bytes ([json_rpc]max_body_bytes)");
        unreadable(StatusCode::PAYLOAD_TOO_LARGE, &message)
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large();
    }
    // The whole body within the header's time: a body sent a byte at a
    // time would otherwise hold its connection for ever.
    let deadline = state.server.limits.header_timeout;
    let body =
        match tokio::time::timeout(deadline, axum::body::to_bytes(req.into_body(), limit)).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => return too_large(),
            Err(_) => {
                let message = format!(
                    "request body not received within {} s ([http]header_timeout)",
                    deadline.as_secs()
                );
                let mut r = unreadable(StatusCode::REQUEST_TIMEOUT, &message);
                r.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return r;
            }
        };
    let envelope = match protocol::parse(&body) {
        Ok(e) => e,
        Err(r) => return status_json(StatusCode::OK, protocol::error(r.id.as_ref(), r.error)),
    };
    let id = envelope.id.clone();
    let outcome = state.call(envelope).await;
    match id {
        // A cast the worker had no room for is lost unless its sender
        // learns it: Ironic's client ignores a cast's body but raises on
        // an HTTP error. Any other cast is answered with nothing.
        None => match outcome {
            Err(error) if error["code"].as_i64() == Some(code::SERVER_BUSY) => status_json(
                StatusCode::SERVICE_UNAVAILABLE,
                protocol::error(None, error),
            ),
            _ => StatusCode::NO_CONTENT.into_response(),
        },
        Some(id) => {
            let body = match outcome {
                Ok(value) => protocol::result(&id, value),
                Err(error) => protocol::error(Some(&id), error),
            };
            status_json(StatusCode::OK, body)
        }
    }
}

impl RpcState {
    /// Runs one method: the result, or the error object to answer.
    async fn call(&self, envelope: Envelope) -> Result<Value, Value> {
        let method = envelope.method.clone();
        match method.as_str() {
            "status" => self.status(&envelope.params),
            "prepare" | "deployed" | "cleanup" | "warm" => self.command(envelope).await,
            _ => Err(protocol::plain_error(
                code::METHOD_NOT_FOUND,
                &format!("Method {method} was not found"),
            )),
        }
    }

    /// `prepare`, `deployed`, `cleanup`, `warm`: the params as a command
    /// ([`command_body`]), run once per `request_id`.
    async fn command(&self, envelope: Envelope) -> Result<Value, Value> {
        let is_call = envelope.id.is_some();
        let body = command_body(envelope);
        let issued_ms = now_ms();
        let request = match read_command(&body, &self.host, issued_ms) {
            Ok(r) => r,
            Err(done) => return Err(protocol::completion_error(&done)),
        };
        let Some(key) = AnswerKey::of(&request) else {
            return Err(protocol::plain_error(code::INVALID_PARAMS, "no request_id"));
        };
        let (known, _) = self.server.work.answers().lookup(&key);
        if matches!(known, Lookup::Unknown) {
            if self.server.work.stopping() {
                return Err(stopping());
            }
            let Ok(slot) = self.in_flight.clone().try_acquire_owned() else {
                return Err(protocol::plain_error(
                    code::SERVER_BUSY,
                    &format!("{MAX_IN_FLIGHT} requests under way: try again later"),
                ));
            };
            // A cast's sender asks for its answer later, maybe of this
            // port after a restart: it is kept until answered.
            let parked = match is_call {
                true => None,
                false => self.park(&key, &body, issued_ms).await,
            };
            self.server.work.submit(Job {
                request,
                carrier: Box::new(Caller {
                    _slot: slot,
                    parked,
                }),
            });
        }
        if !is_call {
            return Ok(Value::Null);
        }
        match self.wait(&key).await {
            // Ended unanswered: not started, as the worker stops.
            Lookup::Unknown if self.server.work.stopping() => Err(stopping()),
            known => answer(known),
        }
    }

    /// Keeps a cast accepted (its command `body`) on this port's shelf until
    /// its job ends; `None` (with a warning) when it cannot be kept: the
    /// work still runs, but would not outlive this process.
    async fn park(&self, key: &AnswerKey, body: &[u8], issued_ms: u64) -> Option<Parked> {
        let record = json!({"body": String::from_utf8_lossy(body), "issued_ms": issued_ms});
        let parked = Parked {
            work: self.server.work.clone(),
            shelf: self.shelf.clone(),
            key: key.digest(),
        };
        match (self.server.work)
            .park(&parked.shelf, &parked.key, record.to_string().into_bytes())
            .await
        {
            Ok(()) => Some(parked),
            Err(e) => {
                tracing::warn!(error = %e, "could not keep a JSON-RPC cast until its answer");
                None
            }
        }
    }

    /// Runs again the casts of this port that a process now gone accepted
    /// and did not answer (it was stopped or killed meanwhile): their
    /// senders ask this port for the answer.
    async fn resume_parked(&self) {
        let work = &self.server.work;
        for (key, bytes) in work.adopt_parked(&self.shelf).await {
            let record: Option<(String, u64)> = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|v| Some((v["body"].as_str()?.to_string(), v["issued_ms"].as_u64()?)));
            let request =
                record.and_then(|(body, at)| read_command(body.as_bytes(), &self.host, at).ok());
            let (Some(request), Ok(slot)) = (request, self.in_flight.clone().try_acquire_owned())
            else {
                tracing::warn!(
                    key,
                    "an unreadable JSON-RPC cast kept from a process now gone: dropped"
                );
                work.unpark(&self.shelf, &key).await;
                continue;
            };
            tracing::info!(
                node = %request.node_str(),
                request_id = request.request_id.as_deref().unwrap_or(""),
                action = request.action.as_str(),
                "running again a JSON-RPC cast accepted by a process now gone"
            );
            let parked = Parked {
                work: self.server.work.clone(),
                shelf: self.shelf.clone(),
                key,
            };
            self.server.work.submit(Job {
                request,
                carrier: Box::new(Caller {
                    _slot: slot,
                    parked: Some(parked),
                }),
            });
        }
    }

    /// What is known of `key` once answered, or after `request_timeout`.
    async fn wait(&self, key: &AnswerKey) -> Lookup {
        let answers = self.server.work.answers();
        let until = tokio::time::Instant::now() + self.server.request_timeout;
        loop {
            let (now, notify) = answers.lookup(key);
            let Some(notify) = notify else { return now };
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match answers.lookup(key).0 {
                Lookup::InProgress => {}
                other => return other,
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return answers.lookup(key).0;
            }
        }
    }

    /// `status`: the completion of the node's latest request (or of the one
    /// named by `request_id`), `in_progress`, or `unknown`.
    fn status(&self, params: &serde_json::Map<String, Value>) -> Result<Value, Value> {
        let node = params.get("node_uuid").and_then(Value::as_str);
        let Some(node) = node.and_then(|n| crate::node::NodeUuid::parse(n).ok()) else {
            return Err(protocol::plain_error(
                code::INVALID_PARAMS,
                "status needs node_uuid, a node UUID",
            ));
        };
        let request_id = match params.get("request_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) => Some(id.as_str()),
            // Not "the node's latest request": another request's answer.
            Some(_) => {
                return Err(protocol::plain_error(
                    code::INVALID_PARAMS,
                    "status: request_id must be a string",
                ));
            }
        };
        Ok(match self.server.work.answers().status(&node, request_id) {
            Lookup::Done(done) => protocol::completion_value(&done),
            Lookup::InProgress => json!({"status": "in_progress"}),
            Lookup::Unknown => json!({"status": "unknown"}),
        })
    }
}

/// The error of a request the worker did not start because it stops
/// (SIGTERM): the worker's "busy" error, so that Ironic's client raises
/// (and a cast is answered `503`); the request may be sent again.
fn stopping() -> Value {
    protocol::plain_error(
        code::SERVER_BUSY,
        "the worker is stopping: the request was not started; send it again",
    )
}

/// A call's answer: the completion when it succeeded, an error carrying
/// its code when it failed, `in_progress` when the work goes on.
fn answer(known: Lookup) -> Result<Value, Value> {
    match known {
        Lookup::Done(done) if done.status == Status::Success => {
            Ok(protocol::completion_value(&done))
        }
        Lookup::Done(done) => Err(protocol::completion_error(&done)),
        Lookup::InProgress => Ok(json!({"status": "in_progress"})),
        Lookup::Unknown => Ok(json!({"status": "unknown"})),
    }
}

/// The answer to a request whose body could not be read (`status`): an
/// invalid-request error, as no `id` is known.
fn unreadable(status: StatusCode, message: &str) -> Response {
    let error = protocol::plain_error(code::INVALID_REQUEST, message);
    status_json(status, protocol::error(None, error))
}

/// A JSON body with `status`.
fn status_json(status: StatusCode, body: Value) -> Response {
    let mut r = (status, body.to_string()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The answer to a request not let in, shaped as Ironic's
/// `BasicAuthMiddleware` answers.
fn refused(refusal: Refusal) -> Response {
    let (status, message) = match &refusal {
        Refusal::Unauthorized(m) => (StatusCode::UNAUTHORIZED, m.to_string()),
        Refusal::BadRequest(m) => (StatusCode::BAD_REQUEST, m.to_string()),
        Refusal::Busy => (
            StatusCode::TOO_MANY_REQUESTS,
            "Too many password checks pending from this address; try again".to_string(),
        ),
        Refusal::Unreadable(e) => {
            tracing::error!(error = %e, "cannot read [json_rpc]http_basic_auth_user_file");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Problem reading auth user file".to_string(),
            )
        }
    };
    let mut r = status_json(
        status,
        json!({"error": {"message": message, "code": status.as_u16()}}),
    );
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"ironic-image-worker\""),
        );
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// The params of a call as a command body: `action` set to the method; its
/// `request_id`, when missing, is the context's, else the call's id, else a
/// new one.
fn command_body(envelope: Envelope) -> Vec<u8> {
    let Envelope {
        id,
        method,
        mut params,
        context,
    } = envelope;
    if !params.contains_key("request_id") {
        let from_context = context
            .as_ref()
            .and_then(|c| c.get("request_id"))
            .filter(|v| v.is_string())
            .cloned();
        let fallback = from_context
            .or(id.filter(|v| v.is_string()))
            .unwrap_or_else(|| Value::String(uuid::Uuid::new_v4().to_string()));
        params.insert("request_id".into(), fallback);
    }
    params.insert("action".into(), Value::String(method));
    serde_json::to_vec(&params).unwrap_or_default()
}

/// The command `body` as a request for conductor `host` issued at
/// `issued_ms` (its node read there, as a broker command's), or the error
/// completion of one that does not read.
fn read_command(body: &[u8], host: &str, issued_ms: u64) -> Result<Request, Box<Completion>> {
    match inbound::parse_command(body, host) {
        Inbound::Work(mut request) => {
            request.issued_ms = Some(issued_ms);
            Ok(*request)
        }
        Inbound::Invalid(done) => Err(done),
        Inbound::Ignore(_) | Inbound::Moved { .. } => Err(Box::new(
            Completion::new(crate::messages::Action::Unknown, None, None, host).failed(
                &crate::error::Error::new(crate::error::ErrorCode::InvalidMessage, "not a command"),
            ),
        )),
    }
}

/// A JSON-RPC request's side of its job: the answer is what the shared
/// dispatch records (the caller reads it there); nothing to settle, no
/// copy to put back or set aside, no deadline of its own. Holds its place
/// among the requests in flight until the job ends, and a cast's record
/// until then.
struct Caller {
    _slot: tokio::sync::OwnedSemaphorePermit,
    parked: Option<Parked>,
}

/// A cast kept on its port's shelf (`store::ledger`) until its job ends.
struct Parked {
    work: Arc<Dispatch>,
    shelf: Shelf,
    key: String,
}

impl Caller {
    /// The job ended: its record, if any, is no longer needed.
    async fn forget(&self) {
        if let Some(p) = &self.parked {
            p.work.unpark(&p.shelf, &p.key).await;
        }
    }
}

impl Carrier for Caller {
    fn transport(&self) -> Transport {
        Transport::JsonRpc
    }

    fn source(&self) -> &'static str {
        "json-rpc"
    }

    fn deadline(&self) -> Option<u64> {
        None
    }

    fn delivery_key(&self) -> Option<DeliveryKey> {
        None
    }

    fn defer(&self) -> BoxFuture<'_, Deferral> {
        Box::pin(async { Deferral::Wait })
    }

    /// A call or a cast holds no delivery: nothing to set aside.
    fn hold(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { true })
    }

    /// A cast keeps its record (the next process on this port runs it); a
    /// call is told by [`stopping`], its job having ended unanswered.
    fn give_back(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    fn slowed(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    fn answer<'a>(&'a self, _done: &'a Completion) -> BoxFuture<'a, bool> {
        Box::pin(async { true })
    }

    fn finish(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.forget())
    }

    fn unanswered(&self, _why: IgnoreReason) -> BoxFuture<'_, ()> {
        Box::pin(self.forget())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command a call carries, read as the listener reads it.
    fn read(call: Value) -> Result<Request, Box<Completion>> {
        let envelope = protocol::parse(call.to_string().as_bytes()).unwrap();
        read_command(&command_body(envelope), "h", 7)
    }

    /// A call whose node is read once, as a canonical node UUID; one whose
    /// node is not a node UUID is answered `invalid_node_uuid` (a 400 with
    /// Ironic's `InvalidParameterValue`) echoing it as received, as on the
    /// broker.
    #[test]
    fn a_called_node_is_read_once_and_a_bad_one_answered() {
        let node = "1be26c0b-03f2-4d2e-ae87-c02d7f33c123";
        let call = |node: &str| {
            json!({"jsonrpc": "2.0", "method": "cleanup", "id": 1,
                   "params": {"node_uuid": node, "context": {"request_id": "req-1"}}})
        };
        let request = read(call(&node.to_uppercase())).unwrap();
        assert_eq!(request.node_str(), node);
        assert_eq!(request.issued_ms, Some(7));
        let done = read(call("not-a-uuid")).unwrap_err();
        let want_completion = json!({"action": "cleanup", "status": "error",
            "node_uuid": "not-a-uuid", "request_id": "req-1", "conductor_host": "h",
            "duration_ms": 0, "error": {"code": "invalid_node_uuid",
                "message": "node UUID \"not-a-uuid\" is not a canonical UUID"}});
        assert_eq!(
            protocol::completion_error(&done),
            json!({"code": 400,
                   "message": "invalid_node_uuid: node UUID \"not-a-uuid\" is not a canonical UUID",
                   "data": {"class": "ironic.common.exception.InvalidParameterValue",
                            "error_code": "invalid_node_uuid",
                            "completion": want_completion}})
        );
    }
}
