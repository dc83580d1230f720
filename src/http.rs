//! The two HTTP listeners: the image server (serves `http_root`, following
//! symlinks only into the worker's own directories) and the metrics/health
//! listener (`/metrics`, `/healthz`, `/readyz`).

use crate::metrics::Metrics;
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

    /// Maps a request path to the canonical file it may serve, or the status
    /// to answer: `..`, encoded separators and NULs are refused, directories
    /// are never listed, symlinks out of the allowed directories are refused.
    pub async fn resolve(&self, raw_path: &str) -> Result<PathBuf, StatusCode> {
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
        Ok(real)
    }
}

struct ImageState {
    roots: ImageRoots,
    metrics: Arc<Metrics>,
}

/// Serves images from `roots` on `listener` until `shutdown` completes.
pub async fn serve_images(
    listener: TcpListener,
    roots: ImageRoots,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let state = Arc::new(ImageState { roots, metrics });
    let app = Router::new().fallback(serve_image).with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn serve_image(State(state): State<Arc<ImageState>>, req: Request) -> Response {
    let response = if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = StatusCode::METHOD_NOT_ALLOWED.into_response();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        r
    } else {
        match state.roots.resolve(req.uri().path()).await {
            Err(status) => status.into_response(),
            Ok(path) => match tower_http::services::ServeFile::new(path)
                .with_buf_chunk_size(256 * 1024)
                .oneshot(req)
                .await
            {
                Ok(r) => r.map(Body::new),
                Err(never) => match never {},
            },
        }
    };
    let status = response.status().as_u16().to_string();
    state
        .metrics
        .http_requests
        .with_label_values(&[&status])
        .inc();
    if let Some(len) = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        state
            .metrics
            .http_bytes
            .with_label_values(&[&status])
            .inc_by(len);
    }
    response
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

/// Serves `/metrics`, `/healthz` and `/readyz` until `shutdown` completes.
pub async fn serve_ops(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let state = Arc::new(OpsState { metrics, health });
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
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
