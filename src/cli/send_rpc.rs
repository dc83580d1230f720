//! `send` over the worker's JSON-RPC listener: the operator's tool for a
//! worker without a broker (`[amqp]enabled = false`, Metal3, Bifrost), or
//! any worker with `--transport json-rpc`. It speaks the listener's
//! protocol as Ironic's client does (docs/contract.md, "JSON-RPC"): a
//! command without `--wait` is a cast (`204`), with `--wait` a call,
//! repeated with the same `request_id` while the worker answers
//! `in_progress` (the worker joins a repeated call to the work under way).

use crate::config::{AuthStrategy, Config};
use crate::error::{Error, ErrorCode, Result};
use crate::messages::{Completion, Request};
use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use std::time::Duration;
use tokio::time::Instant;

/// The environment variable holding the listener's HTTP Basic password
/// (never a flag: a command line is visible to every user of the host).
pub const PASSWORD_ENV: &str = "IRONIC_IMAGE_WORKER_RPC_PASSWORD";

/// How `send` reaches the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// Through the broker (`[amqp]`).
    Amqp,
    /// Through the worker's JSON-RPC listener (`[json_rpc]listen`).
    JsonRpc,
}

/// The options of `send` that choose and reach the JSON-RPC listener.
#[derive(Debug, Args)]
pub struct RpcArgs {
    /// amqp or json-rpc; default json-rpc when `[amqp]enabled = false`,
    /// else amqp.
    #[arg(long, value_enum)]
    transport: Option<Transport>,
    /// The JSON-RPC listener's URL (default from `[json_rpc]listen`, its
    /// wildcard address as loopback, https when `[json_rpc]tls_cert_file`
    /// is set).
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// HTTP Basic user of the listener (`[json_rpc]auth_strategy =
    /// "http_basic"`); the password from $IRONIC_IMAGE_WORKER_RPC_PASSWORD
    /// or --password-file.
    #[arg(long, env = "IRONIC_IMAGE_WORKER_RPC_USER")]
    user: Option<String>,
    /// A file whose first line is the password of --user.
    #[arg(long, value_name = "FILE")]
    password_file: Option<std::path::PathBuf>,
    /// CA certificates (PEM) trusted for the listener's certificate, alone
    /// (default: the system's).
    #[arg(long, value_name = "FILE")]
    cafile: Option<std::path::PathBuf>,
}

impl RpcArgs {
    /// The transport `send` uses: the flag's, else JSON-RPC exactly when
    /// the configuration has no broker.
    pub fn transport(&self, config: &Config) -> Transport {
        match (self.transport, config.amqp.enabled) {
            (Some(t), _) => t,
            (None, true) => Transport::Amqp,
            (None, false) => Transport::JsonRpc,
        }
    }
}

/// Sends `req` to the listener: a cast without `wait` (no answer), else
/// its completion, asked again while it is in progress, at most for
/// `wait`. `routed` (`--conductor`, `--all-conductors`: a broker's
/// routing) is refused: a listener is one worker's.
pub async fn send(
    config: &Config,
    args: &RpcArgs,
    routed: bool,
    req: &Request,
    wait: Option<Duration>,
) -> Result<Vec<Completion>> {
    if routed {
        return Err(bad_use(
            "--conductor and --all-conductors route through the broker; the JSON-RPC listener \
             is one worker's (--url)",
        ));
    }
    let listener = Listener::of(config, args)?;
    let mut params = req.command_body();
    if let Some(body) = params.as_object_mut() {
        body.remove("action");
    }
    let method = req.action.as_str();
    let Some(limit) = wait else {
        let cast = json!({"jsonrpc": "2.0", "method": method, "params": params});
        listener.post(&cast, listener.call_timeout()).await?;
        return Ok(Vec::new());
    };
    let id = req.request_id.clone().unwrap_or_default();
    let call = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": id});
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                ErrorCode::Internal,
                format!("no answer within {limit:?} (the work goes on)"),
            ));
        }
        let answer = listener
            .post(&call, left.min(listener.call_timeout()))
            .await?;
        if let Some(done) = completion_of(&answer)? {
            return Ok(vec![done]);
        }
    }
}

/// The completion a call's answer carries (a result, or an error made of a
/// failed completion); `None` while the work is in progress; a protocol
/// error as an error.
fn completion_of(answer: &Value) -> Result<Option<Completion>> {
    let unreadable = |e: serde_json::Error| {
        Error::new(ErrorCode::Internal, format!("unreadable completion: {e}"))
    };
    if let Some(result) = answer.get("result") {
        if result.get("status").and_then(Value::as_str) == Some("in_progress") {
            return Ok(None);
        }
        return serde_json::from_value(result.clone())
            .map(Some)
            .map_err(unreadable);
    }
    let error = answer.get("error").cloned().unwrap_or(Value::Null);
    match error.pointer("/data/completion") {
        Some(done) => serde_json::from_value(done.clone())
            .map(Some)
            .map_err(unreadable),
        None => Err(Error::new(
            ErrorCode::Internal,
            format!("the listener refused the call: {error}"),
        )),
    }
}

/// The listener as configured, and how to reach it.
struct Listener {
    url: String,
    client: reqwest::Client,
    basic: Option<(String, String)>,
    /// The listener's own wait before it answers `in_progress`.
    request_timeout: Duration,
}

impl Listener {
    /// The listener of `config` (or `--url`), with the credentials its
    /// `auth_strategy` needs.
    fn of(config: &Config, args: &RpcArgs) -> Result<Listener> {
        let rpc = &config.json_rpc;
        let url = match (&args.url, rpc.listen) {
            (Some(url), _) => url.clone(),
            (None, Some(listen)) => {
                let ip = match listen.ip() {
                    std::net::IpAddr::V4(ip) if ip.is_unspecified() => {
                        std::net::Ipv4Addr::LOCALHOST.into()
                    }
                    std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
                        std::net::Ipv6Addr::LOCALHOST.into()
                    }
                    ip => ip,
                };
                let scheme = if rpc.tls_enabled() { "https" } else { "http" };
                format!(
                    "{scheme}://{}/",
                    std::net::SocketAddr::new(ip, listen.port())
                )
            }
            (None, None) => {
                return Err(bad_use(
                    "no [json_rpc]listen in the configuration: name the worker's listener \
                     with --url",
                ));
            }
        };
        let basic = credentials(args)?;
        if basic.is_none() && rpc.auth_strategy == AuthStrategy::HttpBasic {
            return Err(bad_use(
                "[json_rpc]auth_strategy is http_basic: give --user and the password \
                 ($IRONIC_IMAGE_WORKER_RPC_PASSWORD or --password-file)",
            ));
        }
        let mut builder = reqwest::Client::builder().no_proxy();
        if let Some(path) = &args.cafile {
            let pem = std::fs::read(path)
                .map_err(|e| bad_use(&format!("--cafile {}: {e}", path.display())))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| bad_use(&format!("--cafile {}: {e}", path.display())))?;
            builder = builder.tls_certs_only(certs);
        }
        let client = builder
            .build()
            .map_err(|e| Error::new(ErrorCode::Internal, format!("HTTP client: {e}")))?;
        Ok(Listener {
            url,
            client,
            basic,
            request_timeout: Duration::from_secs(rpc.request_timeout),
        })
    }

    /// How long one call may take: the listener answers `in_progress` at
    /// its `request_timeout`.
    fn call_timeout(&self) -> Duration {
        self.request_timeout + Duration::from_secs(30)
    }

    /// Posts one request; a call's answer, `Null` for a cast's `204`.
    async fn post(&self, body: &Value, timeout: Duration) -> Result<Value> {
        let mut request = self.client.post(&self.url).timeout(timeout).json(body);
        if let Some((user, password)) = &self.basic {
            request = request.basic_auth(user, Some(password));
        }
        let failed = |why: String| Error::new(ErrorCode::Internal, format!("{}: {why}", self.url));
        let response = request
            .send()
            .await
            .map_err(|e| failed(crate::error::error_chain(&e)))?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| failed(crate::error::error_chain(&e)))?;
        match status.as_u16() {
            204 => Ok(Value::Null),
            200 => serde_json::from_str(&text).map_err(|e| failed(format!("not JSON: {e}"))),
            401 => Err(failed(format!(
                "401: the listener refused the credentials (--user, the password): {text}"
            ))),
            _ => Err(failed(format!("{status}: {text}"))),
        }
    }
}

/// `--user` with its password (environment, else `--password-file`).
fn credentials(args: &RpcArgs) -> Result<Option<(String, String)>> {
    let Some(user) = &args.user else {
        return Ok(None);
    };
    let password = match (std::env::var(PASSWORD_ENV), &args.password_file) {
        (Ok(p), _) => p,
        (Err(_), Some(path)) => std::fs::read_to_string(path)
            .map_err(|e| bad_use(&format!("--password-file {}: {e}", path.display())))?
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        (Err(_), None) => {
            return Err(bad_use(&format!(
                "--user {user} needs a password: ${PASSWORD_ENV} or --password-file"
            )));
        }
    };
    Ok(Some((user.clone(), password)))
}

/// An error of the command line's use.
fn bad_use(message: &str) -> Error {
    Error::new(ErrorCode::InvalidMessage, message)
}
