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

use crate::dispatch::{
    AnswerKey, Carrier, Deferral, DeliveryKey, Dispatch, Job, Lookup, Transport,
};
use crate::http::Limits;
use crate::messages::inbound::{self, Inbound};
use crate::messages::{Completion, Request, Status};
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
        in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
    });
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
        if let Err(refusal) = auth.check(header).await {
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
    let body = match axum::body::to_bytes(req.into_body(), limit).await {
        Ok(b) => b,
        Err(_) => {
            let message = format!("request body over {limit} bytes ([json_rpc]max_body_bytes)");
            let error =
                protocol::error(None, protocol::plain_error(code::INVALID_REQUEST, &message));
            return status_json(StatusCode::PAYLOAD_TOO_LARGE, error);
        }
    };
    let envelope = match protocol::parse(&body) {
        Ok(e) => e,
        Err(r) => return status_json(StatusCode::OK, protocol::error(r.id.as_ref(), r.error)),
    };
    let id = envelope.id.clone();
    let outcome = state.call(envelope).await;
    match id {
        None => StatusCode::NO_CONTENT.into_response(),
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

    /// `prepare`, `deployed`, `cleanup`, `warm`: the command body is the
    /// params with `action` set to the method; its `request_id`, when
    /// missing, is the context's, else the call's id, else a new one.
    async fn command(&self, envelope: Envelope) -> Result<Value, Value> {
        let is_call = envelope.id.is_some();
        let request = match self.request(envelope) {
            Ok(r) => r,
            Err(done) => return Err(protocol::completion_error(&done)),
        };
        let Some(key) = AnswerKey::of(&request) else {
            return Err(protocol::plain_error(code::INVALID_PARAMS, "no request_id"));
        };
        let (known, _) = self.server.work.answers().lookup(&key);
        if matches!(known, Lookup::Unknown) {
            let Ok(slot) = self.in_flight.clone().try_acquire_owned() else {
                return Err(protocol::plain_error(
                    code::SERVER_BUSY,
                    &format!("{MAX_IN_FLIGHT} requests under way: try again later"),
                ));
            };
            self.server.work.submit(Job {
                request,
                carrier: Box::new(Caller { _slot: slot }),
            });
        }
        if !is_call {
            return Ok(Value::Null);
        }
        answer(self.wait(&key).await)
    }

    /// The params as a command, or the error completion of one that does
    /// not read.
    fn request(&self, envelope: Envelope) -> Result<Request, Box<Completion>> {
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
        let body = serde_json::to_vec(&params).unwrap_or_default();
        match inbound::parse_command(&body, &self.host) {
            Inbound::Work(mut request) => {
                request.issued_ms = Some(now_ms());
                Ok(*request)
            }
            Inbound::Invalid(done) => Err(done),
            Inbound::Ignore(_) | Inbound::Moved { .. } => Err(Box::new(
                Completion::new(crate::messages::Action::Unknown, None, None, &self.host).failed(
                    &crate::error::Error::new(
                        crate::error::ErrorCode::InvalidMessage,
                        "not a command",
                    ),
                ),
            )),
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
        let request_id = params.get("request_id").and_then(Value::as_str);
        Ok(
            match self.server.work.answers().status(node.as_str(), request_id) {
                Lookup::Done(done) => protocol::completion_value(&done),
                Lookup::InProgress => json!({"status": "in_progress"}),
                Lookup::Unknown => json!({"status": "unknown"}),
            },
        )
    }
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
    r
}

/// A JSON-RPC request's side of its job: the answer is what the shared
/// dispatch records (the caller reads it there); nothing to settle, no
/// copy to put back, no deadline of its own. Holds its place among the
/// requests in flight until the job ends.
struct Caller {
    _slot: tokio::sync::OwnedSemaphorePermit,
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

    fn slowed(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    fn answer<'a>(&'a self, _done: &'a Completion) -> BoxFuture<'a, bool> {
        Box::pin(async { true })
    }

    fn finish(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    fn unanswered(&self, _why: &'static str) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Milliseconds since the Unix epoch, now: a call is issued when it
/// arrives.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
