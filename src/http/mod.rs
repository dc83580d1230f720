//! The two HTTP listeners: the image server (serves `http_root`, following
//! symlinks only into the worker's own directories) and the metrics/health
//! listener (`/metrics`, `/healthz`, `/readyz`). Connections are bounded by
//! [`crate::http::listener`]; which bytes a GET answers by [`crate::http::ranges`].
//!
//! # This folder
//!
//! Holds the image server and the operations listener (this module), the
//! bounded connection acceptor with its timeouts (`listener`) and the Range /
//! If-Range rules (`ranges`). Must not know the broker or the pipeline's
//! internals.

pub(crate) mod listener;
pub(crate) mod ranges;

pub use crate::http::listener::Limits;
use crate::metrics::Metrics;
use axum::Router;
use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use tokio::net::TcpListener;
use tower::ServiceExt;

/// Directories the image server may serve from, all canonical.
#[derive(Debug, Clone)]
pub struct ImageRoots {
    http_root: PathBuf,
    allowed: Vec<PathBuf>,
}

impl ImageRoots {
    /// `http_root` is served; symlinks may lead into it or into `cache_dirs`
    /// (the master cache and per-node directories) and nowhere else.
    pub fn new(http_root: &Path, cache_dirs: &[&Path]) -> std::io::Result<ImageRoots> {
        let http_root = std::fs::canonicalize(http_root)?;
        let mut allowed = vec![http_root.clone()];
        for dir in cache_dirs {
            allowed.push(std::fs::canonicalize(dir)?);
        }
        Ok(ImageRoots { http_root, allowed })
    }

    /// Maps a request path to the canonical file it may serve, with its
    /// metadata, or the status to answer: `..`, encoded separators and NULs
    /// are refused, directories are never listed, symlinks out of the
    /// allowed directories are refused.
    async fn resolve_file(
        &self,
        raw_path: &str,
    ) -> Result<(PathBuf, std::fs::Metadata), StatusCode> {
        let mut rel = PathBuf::new();
        for segment in raw_path
            .strip_prefix('/')
            .ok_or(StatusCode::BAD_REQUEST)?
            .split('/')
        {
            let bytes: Vec<u8> = percent_encoding::percent_decode_str(segment).collect();
            if bytes.is_empty()
                || bytes == b"."
                || bytes == b".."
                || bytes.iter().any(|b| matches!(b, b'/' | b'\\' | 0))
            {
                return Err(StatusCode::NOT_FOUND);
            }
            rel.push(std::ffi::OsStr::from_bytes(&bytes));
        }
        let real = tokio::fs::canonicalize(self.http_root.join(rel))
            .await
            .map_err(|_| StatusCode::NOT_FOUND)?;
        if !self.allowed.iter().any(|dir| real.starts_with(dir)) {
            return Err(StatusCode::FORBIDDEN);
        }
        let meta = tokio::fs::metadata(&real)
            .await
            .map_err(|_| StatusCode::NOT_FOUND)?;
        if meta.is_dir() {
            return Err(StatusCode::FORBIDDEN);
        }
        if !meta.is_file() {
            return Err(StatusCode::NOT_FOUND);
        }
        Ok((real, meta))
    }
}

struct ImageState {
    roots: ImageRoots,
    metrics: Arc<Metrics>,
}

/// Serves images from `roots` on `listener` within `limits` until
/// `shutdown` completes.
pub async fn serve_images(
    listener: TcpListener,
    roots: ImageRoots,
    metrics: Arc<Metrics>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stats = crate::http::listener::Stats {
        open: metrics.http_connections.clone(),
        dropped: metrics.http_connections_dropped.clone(),
    };
    let state = Arc::new(ImageState { roots, metrics });
    let app = Router::new().fallback(serve_image).with_state(state);
    crate::http::listener::serve(listener, app, limits, Some(stats), shutdown).await
}

async fn serve_image(State(state): State<Arc<ImageState>>, mut req: Request) -> Response {
    let response = if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = StatusCode::METHOD_NOT_ALLOWED.into_response();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        r
    } else {
        match state.roots.resolve_file(req.uri().path()).await {
            Err(status) => status.into_response(),
            Ok((path, meta)) => {
                select_range(&mut req, &meta);
                // 512 KiB pieces: fewer trips to the blocking pool and the
                // socket per byte (about 0.8-0.9 -> 1.0-1.1 of nginx's
                // sendfile throughput against 256 KiB) for about 1 MiB of
                // buffers per download in progress.
                match tower_http::services::ServeFile::new(path)
                    .with_buf_chunk_size(512 * 1024)
                    .oneshot(req)
                    .await
                {
                    Ok(r) => r.map(Body::new),
                    Err(never) => match never {},
                }
            }
        }
    };
    let status = response.status().as_u16().to_string();
    state
        .metrics
        .http_requests
        .with_label_values(&[&status])
        .inc();
    let sent = state.metrics.http_bytes.with_label_values(&[&status]);
    response.map(|body| Body::new(Counted { body, sent }))
}

/// Replaces the request's `Range` by the one the file server must answer
/// (see [`crate::http::ranges`]): dropped for the whole file, a single canonical
/// byte range, or one beyond the end for 416.
fn select_range(req: &mut Request, meta: &std::fs::Metadata) {
    let headers = req.headers_mut();
    let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
    let etag = file_etag(meta.len(), modified);
    let decision = crate::http::ranges::decide(
        headers.get(header::RANGE).and_then(|v| v.to_str().ok()),
        headers.get(header::IF_RANGE).and_then(|v| v.to_str().ok()),
        meta.len(),
        &crate::http::ranges::Validators {
            etag: &etag,
            modified,
        },
    );
    headers.remove(header::IF_RANGE);
    match decision
        .range_header(meta.len())
        .and_then(|r| HeaderValue::from_str(&r).ok())
    {
        Some(range) => {
            headers.insert(header::RANGE, range);
        }
        None => {
            headers.remove(header::RANGE);
        }
    }
}

/// The strong ETag the file server sends for a file of `len` bytes
/// modified at `modified` (a test checks the two agree).
fn file_etag(len: u64, modified: std::time::SystemTime) -> String {
    let t = modified
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("\"{:x}.{:08x}-{:x}\"", t.as_secs(), t.subsec_nanos(), len)
}

/// A response body that adds the bytes handed to the connection to
/// `http_response_bytes_total` as they go: nothing for HEAD, only the part
/// sent of an aborted download.
struct Counted {
    body: Body,
    sent: prometheus::IntCounter,
}

impl HttpBody for Counted {
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
            self.sent.inc_by(data.len() as u64);
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
            let probe = crate::store::fsutil::temp_path(&dir.join("readyz"));
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
                let problems = tokio::task::spawn_blocking(move || s.health.problems())
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
    crate::http::listener::serve(listener, app, limits, None, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `If-Range` compares with the ETag the file server sends.
    #[tokio::test]
    async fn etag_is_the_file_servers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let req = axum::http::Request::get("/f").body(Body::empty()).unwrap();
        let resp = tower_http::services::ServeFile::new(&path)
            .oneshot(req)
            .await
            .unwrap();
        assert_eq!(
            resp.headers()[header::ETAG].to_str().unwrap(),
            file_etag(meta.len(), meta.modified().unwrap())
        );
    }
}
