//! The two HTTP listeners: the image server (serves `http_root`, following
//! symlinks out of it only into the worker's own directories) and the
//! metrics/health listener (`/metrics`, `/healthz`, `/readyz`). Connections
//! are bounded by [`crate::http::listener`]; a request's file is opened once
//! by [`crate::http::open`], and answered from that descriptor by
//! [`crate::http::body`] (which bytes: [`crate::http::ranges`]).
//!
//! # This folder
//!
//! Holds the image server and the operations listener (this module), the
//! bounded connection acceptor with its timeouts (`listener`), the open of a
//! request's file beneath the served directories (`open`), the response
//! from that file (`body`), gzip or identity by `Accept-Encoding`
//! (`encoding`) and the conditional / Range / If-Range rules
//! (`ranges`), HTTPS with certificates reloaded as they change (`tls`) and
//! HTTP Basic authentication (`auth`), the access log (`access`), and the
//! peer listener that serves
//! masters to the other workers on URLs signed with their shared secret
//! (`peers`), a master still being written included (`live`). Must not
//! know the broker or the
//! pipeline's internals.

pub mod access;
pub mod auth;
pub(crate) mod body;
mod encoding;
pub(crate) mod listener;
mod live;
mod open;
pub mod peers;
pub(crate) mod ranges;
pub mod tls;

pub use crate::http::access::AccessLog;
pub use crate::http::auth::BasicAuth;
pub use crate::http::listener::Limits;
pub use crate::http::tls::Tls;
use crate::metrics::Metrics;
use axum::Router;
use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use tokio::net::TcpListener;

/// Directories the image server may serve from (see [`crate::http::open`]).
#[derive(Debug, Clone)]
pub struct ImageRoots {
    beneath: Arc<crate::http::open::Beneath>,
    /// Where the compressed forms of masters are, when they are served.
    gzip: Option<Arc<PathBuf>>,
}

impl ImageRoots {
    /// `http_root` is served; a node's symlink may lead out of it into
    /// `cache_dirs` (the master cache and per-node directories) and nowhere
    /// else.
    pub fn new(http_root: &Path, cache_dirs: &[&Path]) -> std::io::Result<ImageRoots> {
        Ok(ImageRoots {
            beneath: Arc::new(crate::http::open::Beneath::new(http_root, cache_dirs)?),
            gzip: None,
        })
    }

    /// Serves the compressed forms of masters found in `dir` (see
    /// [`crate::gzip`]) to the clients that accept gzip; `None`: never.
    pub fn with_gzip(mut self, dir: Option<PathBuf>) -> ImageRoots {
        self.gzip = dir.map(Arc::new);
        self
    }

    /// Opens the file `raw_path` names, once, and reads its metadata from
    /// that descriptor, with its compressed form when it has one; or the
    /// status to answer.
    async fn open(&self, raw_path: &str) -> Result<crate::http::body::Opened, StatusCode> {
        let beneath = self.beneath.clone();
        let gzip = self.gzip.clone();
        let raw_path = raw_path.to_string();
        tokio::task::spawn_blocking(move || {
            let file = beneath.open(&raw_path)?;
            let meta = file.metadata().map_err(|_| StatusCode::NOT_FOUND)?;
            let gzip = gzip.and_then(|dir| crate::gzip::open_in(&dir, &meta));
            Ok(crate::http::body::Opened { file, meta, gzip })
        })
        .await
        .unwrap_or(Err(StatusCode::INTERNAL_SERVER_ERROR))
    }
}

/// What the image server asks of its clients beyond plain HTTP (nothing by
/// default).
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// HTTPS with this certificate (reloaded as it changes).
    pub tls: Option<Arc<Tls>>,
    /// HTTP Basic credentials every request must carry.
    pub auth: Option<BasicAuth>,
}

struct ImageState {
    roots: ImageRoots,
    metrics: Arc<Metrics>,
    auth: Option<BasicAuth>,
    access: AccessLog,
}

/// Serves images from `roots` on `listener` within `limits`, with
/// `security`, logging each request as `access` says, until `shutdown`
/// completes.
pub async fn serve_images(
    listener: TcpListener,
    roots: ImageRoots,
    metrics: Arc<Metrics>,
    (limits, security, access): (Limits, Security, AccessLog),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stats = crate::http::listener::Stats {
        open: metrics.http.connections.clone(),
        dropped: metrics.http.connections_dropped.clone(),
    };
    let state = Arc::new(ImageState {
        roots,
        metrics,
        auth: security.auth,
        access,
    });
    let app = Router::new().fallback(serve_image).with_state(state);
    let listener = crate::http::listener::Listener {
        listener,
        tls: security.tls,
    };
    crate::http::listener::serve(listener, app, limits, Some(stats), shutdown).await
}

async fn serve_image(State(state): State<Arc<ImageState>>, req: Request) -> Response {
    let mut entry = access::Entry::start(state.access, &req);
    let response = if let Some(auth) = &state.auth
        && !auth.allows(req.headers())
    {
        BasicAuth::challenge()
    } else if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = StatusCode::METHOD_NOT_ALLOWED.into_response();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        r
    } else {
        match state.roots.open(req.uri().path()).await {
            Err(status) => status.into_response(),
            Ok(opened) => crate::http::body::respond(&req, opened),
        }
    };
    let encoding = match response.headers().contains_key(header::CONTENT_ENCODING) {
        true => "gzip",
        false => "identity",
    };
    if let Some(entry) = &mut entry {
        entry.answered(response.status().as_u16());
    }
    let status = response.status().as_u16().to_string();
    state
        .metrics
        .http
        .requests
        .with_label_values(&[&status])
        .inc();
    let sent = [
        state.metrics.http.bytes.with_label_values(&[&status]),
        state
            .metrics
            .http
            .encoded_bytes
            .with_label_values(&[encoding]),
    ];
    response.map(|body| {
        Body::new(Holding {
            body,
            sent: sent.into(),
            log: entry,
            _held: (),
        })
    })
}

/// A response body that holds `_held` (a bounded slot, a request counted
/// as in progress) until it is sent or dropped, and adds the bytes handed to
/// the connection to each counter of `sent`, as they go (nothing for HEAD, only
/// the part sent of an aborted download): one wrapper for every listener.
pub(crate) struct Holding<H> {
    pub(crate) body: Body,
    pub(crate) sent: Vec<prometheus::IntCounter>,
    /// The request's access-log entry, which counts the bytes too and is
    /// logged when the body is done with.
    pub(crate) log: Option<access::Entry>,
    pub(crate) _held: H,
}

impl<H: Unpin + Send + 'static> HttpBody for Holding<H> {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &frame
            && let Some(data) = f.data_ref()
        {
            let len = data.len() as u64;
            for sent in &self.sent {
                sent.inc_by(len);
            }
            if let Some(entry) = &mut self.log {
                entry.bytes += len;
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// What `/readyz` checks.
pub struct Health {
    /// Directories that must be writable.
    pub dirs: Vec<PathBuf>,
    /// Broker connection state, when the process talks to a broker.
    pub broker: Option<Arc<AtomicBool>>,
}

impl Health {
    /// Returns the problems found (empty when ready).
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(broker) = &self.broker
            && !broker.load(Ordering::Relaxed)
        {
            problems.push("broker: not connected".to_string());
        }
        for dir in &self.dirs {
            let probe = crate::fsutil::temp_path(&dir.join("readyz"));
            match std::fs::File::create(&probe) {
                Ok(_) => {
                    let _ = std::fs::remove_file(&probe);
                }
                Err(e) => problems.push(format!("{}: not writable: {e}", dir.display())),
            }
        }
        problems
    }
}

struct OpsState {
    metrics: Arc<Metrics>,
    health: Health,
}

impl OpsState {
    /// What `/readyz` finds, also set as the readiness gauge.
    fn problems(&self) -> Vec<String> {
        let problems = self.health.problems();
        self.metrics.ready.set(i64::from(problems.is_empty()));
        problems
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` until `shutdown` completes,
/// with the timeouts of `limits` and a small connection cap of its own.
pub async fn serve_ops(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Health,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let state = Arc::new(OpsState { metrics, health });
    let limits = Limits {
        max_connections: crate::http::listener::OPS_MAX_CONNECTIONS,
        ..limits
    };
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Arc<OpsState>>| async move {
                // The readiness gauge is what /readyz would answer now.
                let ready = s.clone();
                let _ = tokio::task::spawn_blocking(move || ready.problems()).await;
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    s.metrics.render(),
                )
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(s): State<Arc<OpsState>>| async move {
                let problems = tokio::task::spawn_blocking(move || s.problems())
                    .await
                    .unwrap_or_else(|e| vec![format!("readiness check failed: {e}")]);
                if problems.is_empty() {
                    (StatusCode::OK, "ready\n".to_string())
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, problems.join("\n") + "\n")
                }
            }),
        )
        .with_state(state);
    let listener = crate::http::listener::Listener {
        listener,
        tls: None,
    };
    crate::http::listener::serve(listener, app, limits, None, shutdown).await
}
