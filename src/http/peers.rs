//! The peer listener: serves committed masters to the other workers of the
//! deployment, and nothing to anybody else. It listens apart from the image
//! port (bound to the management network), answers only URLs signed with
//! the shared secret (`crate::peers::token`), opens only a regular file
//! named like a master directly in the master directory (never following a
//! symlink), and serves at most `max_uploads` masters at once: a peer asked
//! to come back (503) takes the master from another holder.

use crate::http::Holding;
use crate::peers::token;
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What the peer listener serves and how many at once.
pub struct PeerServer {
    /// The master directory (`[pxe]instance_master_path`).
    pub masters: PathBuf,
    /// The shared secret of the deployment.
    pub secret: Vec<u8>,
    /// Masters served at once.
    pub max_uploads: usize,
}

struct PeerState {
    masters: PathBuf,
    secret: Vec<u8>,
    uploads: Arc<Semaphore>,
    metrics: Arc<crate::metrics::Metrics>,
}

/// Serves `server`'s masters on `listener` within `limits` until
/// `shutdown` completes.
pub async fn serve_peers(
    listener: TcpListener,
    server: PeerServer,
    metrics: Arc<crate::metrics::Metrics>,
    limits: crate::http::Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let state = Arc::new(PeerState {
        masters: server.masters,
        secret: server.secret,
        uploads: Arc::new(Semaphore::new(server.max_uploads)),
        metrics,
    });
    let app = Router::new().fallback(serve_master).with_state(state);
    let listener = crate::http::listener::Listener {
        listener,
        tls: None,
    };
    crate::http::listener::serve(listener, app, limits, None, shutdown).await
}

async fn serve_master(State(state): State<Arc<PeerState>>, req: Request) -> Response {
    let (response, slot) = answer(&state, req).await;
    let peers = &state.metrics.peers;
    peers
        .served_requests
        .with_label_values(&[response.status().as_str()])
        .inc();
    let sent = peers.served_bytes.clone();
    response.map(|body| {
        Body::new(Holding {
            body,
            sent: Some(sent),
            _held: slot,
        })
    })
}

/// The answer to `req`, with the upload slot its body holds.
async fn answer(state: &PeerState, req: Request) -> (Response, Option<OwnedSemaphorePermit>) {
    let now = token::now();
    let name = match token::verify(&state.secret, req.uri().path(), req.uri().query(), now) {
        Ok(name) => name.to_string(),
        Err(refusal) => {
            tracing::warn!(?refusal, path = req.uri().path(), "peer request refused");
            return (StatusCode::UNAUTHORIZED.into_response(), None);
        }
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = StatusCode::METHOD_NOT_ALLOWED.into_response();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return (r, None);
    }
    let Ok(slot) = state.uploads.clone().try_acquire_owned() else {
        let mut r = StatusCode::SERVICE_UNAVAILABLE.into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return (r, None);
    };
    let masters = state.masters.clone();
    match tokio::task::spawn_blocking(move || open_master(&masters, &name)).await {
        Ok(Ok((file, meta))) => (crate::http::body::respond(&req, file, &meta), Some(slot)),
        Ok(Err(status)) => (status.into_response(), None),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR.into_response(), None),
    }
}

/// Opens master `name`: a regular file directly in `masters`, never
/// through a symlink.
fn open_master(
    masters: &std::path::Path,
    name: &str,
) -> Result<(std::fs::File, std::fs::Metadata), StatusCode> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::open(masters.join(name), flags, Mode::empty())
        .map_err(|_| StatusCode::NOT_FOUND)?;
    let file = std::fs::File::from(fd);
    let meta = file.metadata().map_err(|_| StatusCode::NOT_FOUND)?;
    if !meta.is_file() {
        return Err(StatusCode::NOT_FOUND);
    }
    Ok((file, meta))
}
