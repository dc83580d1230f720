//! The peer listener: serves committed masters to the other workers of the
//! deployment (in their compressed form to a peer that accepts gzip, as
//! the image server does; a master still being written, as it grows:
//! `live`), and nothing to anybody else. It listens apart from the image
//! port (bound to the management network), answers only URLs signed with
//! the shared secret (`crate::peers::token`), opens only a regular file
//! named like a master directly in the master directory (never following a
//! symlink), and serves at most `max_uploads` masters at once: a peer asked
//! to come back (503) takes the master from another holder.

use crate::http::Holding;
use crate::peers::live::{LiveMasters, LiveState};
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
    /// Committed masters served at once, and apart from them masters being
    /// written followed at once.
    pub max_uploads: usize,
    /// The masters this process is writing, streamed as they grow.
    pub live: Arc<LiveMasters>,
    /// Where the masters' compressed forms are (`[http] gzip = static`):
    /// a committed master is sent in it to a peer that accepts gzip, as
    /// the image server sends it to an agent; `None`: always identity.
    pub gzip: Option<PathBuf>,
}

struct PeerState {
    masters: PathBuf,
    secret: Vec<u8>,
    uploads: Arc<Semaphore>,
    /// Slots of the masters being written that peers follow, apart from
    /// `uploads` (a follow lasts the whole download).
    follows: Arc<Semaphore>,
    live: Arc<LiveMasters>,
    gzip: Option<PathBuf>,
    /// What the followers of each master being written share.
    followed: crate::http::live::Followed,
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
        follows: Arc::new(Semaphore::new(server.max_uploads)),
        live: server.live,
        gzip: server.gzip,
        followed: Default::default(),
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
            sent: vec![sent],
            log: None,
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
    let live = state
        .live
        .get(&name)
        .filter(|v| *v.state.borrow() == LiveState::Writing);
    if let Some(view) = live {
        let Ok(slot) = state.follows.clone().try_acquire_owned() else {
            return (busy(), None);
        };
        let asked = crate::http::live::Asked::of(&req);
        if let Some(r) = crate::http::live::respond(asked, view, &state.followed).await {
            return (r, Some(slot));
        }
        // Committed meanwhile: the master answers.
    }
    let Ok(slot) = state.uploads.clone().try_acquire_owned() else {
        return (busy(), None);
    };
    let (masters, gzip) = (state.masters.clone(), state.gzip.clone());
    let opened = move || -> Result<_, StatusCode> {
        let (file, meta) = open_master(&masters, &name)?;
        let gzip = gzip.and_then(|dir| crate::gzip::open_in(&dir, &meta));
        Ok(crate::http::body::Opened { file, meta, gzip })
    };
    match tokio::task::spawn_blocking(opened).await {
        Ok(Ok(opened)) => (crate::http::body::respond(&req, opened), Some(slot)),
        Ok(Err(status)) => (status.into_response(), None),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR.into_response(), None),
    }
}

/// 503 with `Retry-After`: the peer takes the master from another holder
/// or comes back.
fn busy() -> Response {
    let mut r = StatusCode::SERVICE_UNAVAILABLE.into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// Opens master `name`: a regular file directly in `masters`, never
/// through a symlink.
fn open_master(
    masters: &std::path::Path,
    name: &str,
) -> Result<(std::fs::File, std::fs::Metadata), StatusCode> {
    let file = super::open::open_regular(&masters.join(name))
        .ok()
        .flatten()
        .ok_or(StatusCode::NOT_FOUND)?;
    let meta = file.metadata().map_err(|_| StatusCode::NOT_FOUND)?;
    Ok((file, meta))
}
