//! The accept loop of the image server and of the metrics listener: a cap
//! on open connections, a header-read timeout and an idle timeout. Without
//! them, clients that open connections and send nothing (or half a header)
//! keep them open for ever, exhaust the process's file descriptors, and then
//! image downloads, `/readyz` and prepares all fail.
//!
//! At the cap, the connection that has waited longest for a request (half a
//! header, or an idle keep-alive) is closed to make room; only when every
//! open connection is in the middle of a request is the new one refused (a
//! `503` and close). Each listener has its own cap, so image clients never
//! starve `/healthz`, `/readyz` or `/metrics`.

use axum::body::{Body, HttpBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// How a listener bounds its connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Time to receive a complete request header (also the longest wait of
    /// a keep-alive connection for its next request).
    pub header_timeout: Duration,
    /// Time without a byte received or sent before a connection is closed.
    pub idle_timeout: Duration,
    /// Connections kept open at once.
    pub max_connections: usize,
}

/// Counters of what the limits did, for `/metrics`.
#[derive(Clone)]
pub(crate) struct Stats {
    /// Connections open now.
    pub(crate) open: prometheus::IntGauge,
    /// Connections closed by the server, by reason.
    pub(crate) dropped: prometheus::IntCounterVec,
}

impl Stats {
    fn dropped(&self, reason: &str) {
        self.dropped.with_label_values(&[reason]).inc();
    }
}

/// Descriptors kept free beside the image server's connections: the
/// pipeline's files, sockets and converter pipes per message handled at
/// once, the broker, the metrics listener and the process's own.
pub fn descriptor_headroom(prefetch: u16) -> u64 {
    256 + 16 * u64::from(prefetch) + OPS_MAX_CONNECTIONS as u64
}

/// Connections of the metrics/health listener (a scraper and probes).
pub const OPS_MAX_CONNECTIONS: usize = 64;

/// Raises the soft open-file limit to the hard one (at most 65,536) and
/// returns the limit now in force.
pub fn raise_open_file_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read/write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        let want = lim.rlim_max.min(65_536);
        if want > lim.rlim_cur {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = want;
            }
        }
    }
    lim.rlim_cur
}

/// The image server's connection cap: `configured` (0 = derived), never
/// more than the descriptors left after `headroom` out of `fd_limit`.
pub fn connection_cap(configured: usize, fd_limit: u64, headroom: u64) -> usize {
    const DEFAULT_MAX: usize = 4096;
    const FLOOR: usize = 16;
    let available = usize::try_from(fd_limit.saturating_sub(headroom))
        .unwrap_or(usize::MAX)
        .max(FLOOR);
    match configured {
        0 => available.min(DEFAULT_MAX),
        n if n > available => {
            tracing::warn!(
                configured = n,
                used = available,
                fd_limit,
                "[http]max_connections leaves too few file descriptors; lowered"
            );
            available
        }
        n => n,
    }
}

/// One open connection as the accept loop sees it.
struct Entry {
    /// Requests being answered on it (0: waiting for a request).
    busy: Arc<AtomicUsize>,
    /// Told when the connection must make room for a new one.
    close: Arc<Notify>,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    open: BTreeMap<u64, Entry>,
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes,
/// then lets the requests in progress finish.
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: Limits,
    stats: Option<Stats>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let registry = Arc::new(Mutex::new(Registry::default()));
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or a connection reset before
                    // accept: wait a little rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Some((id, entry)) = admit(&registry, limits.max_connections, stats.as_ref()) else {
            refuse(stream);
            if let Some(s) = &stats {
                s.dropped("refused");
            }
            continue;
        };
        if let Some(s) = &stats {
            s.open.inc();
        }
        let conn = Connection {
            app: app.clone(),
            limits,
            busy: entry.0,
            close: entry.1,
            stop: stop.clone(),
            stats: stats.clone(),
        };
        let registry = registry.clone();
        tracker.spawn(async move {
            let stats = conn.stats.clone();
            conn.run(stream).await;
            registry
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .open
                .remove(&id);
            if let Some(s) = stats {
                s.open.dec();
            }
        });
    }
    drop(listener);
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// Registers a new connection, closing the longest-waiting idle one when
/// the cap is reached; `None` when every open connection is busy.
#[allow(clippy::type_complexity)]
fn admit(
    registry: &Mutex<Registry>,
    max: usize,
    stats: Option<&Stats>,
) -> Option<(u64, (Arc<AtomicUsize>, Arc<Notify>))> {
    let mut reg = registry.lock().unwrap_or_else(|p| p.into_inner());
    if reg.open.len() >= max.max(1) {
        let idle = reg
            .open
            .iter()
            .find(|(_, e)| e.busy.load(Ordering::Acquire) == 0)
            .map(|(id, _)| *id)?;
        if let Some(evicted) = reg.open.remove(&idle) {
            evicted.close.notify_one();
            if let Some(s) = stats {
                s.dropped("evicted");
            }
        }
    }
    let id = reg.next_id;
    reg.next_id += 1;
    let entry = Entry {
        busy: Arc::default(),
        close: Arc::default(),
    };
    let handles = (entry.busy.clone(), entry.close.clone());
    reg.open.insert(id, entry);
    Some((id, handles))
}

/// Answers 503 without waiting (the socket buffer takes it) and closes.
fn refuse(stream: TcpStream) {
    let _ = stream.try_write(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
}

struct Connection {
    app: axum::Router,
    limits: Limits,
    busy: Arc<AtomicUsize>,
    close: Arc<Notify>,
    stop: CancellationToken,
    stats: Option<Stats>,
}

impl Connection {
    async fn run(self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let start = Instant::now();
        let activity = Arc::new(AtomicU64::new(0));
        let io = TokioIo::new(Watched {
            inner: stream,
            start,
            activity: activity.clone(),
        });
        let (app, busy) = (self.app.clone(), self.busy.clone());
        let service = hyper::service::service_fn(move |req: axum::http::Request<Incoming>| {
            let guard = InFlight::enter(&busy);
            let app = app.clone();
            async move {
                let response = app.oneshot(req.map(Body::new)).await?;
                Ok::<_, Infallible>(response.map(|body| {
                    Body::new(Guarded {
                        body,
                        _guard: guard,
                    })
                }))
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_timeout)
            .keep_alive(true);
        let conn = builder.serve_connection(io, service);
        tokio::pin!(conn);
        let mut stopping = false;
        let reason = loop {
            let last = Duration::from_millis(activity.load(Ordering::Relaxed));
            let idle_until = start + last + self.limits.idle_timeout;
            tokio::select! {
                done = conn.as_mut() => break match done {
                    Err(e) if e.is_timeout() => Some("header_timeout"),
                    _ => None,
                },
                _ = tokio::time::sleep_until(idle_until) => {
                    let last = Duration::from_millis(activity.load(Ordering::Relaxed));
                    if start.elapsed() >= last + self.limits.idle_timeout {
                        break Some("idle_timeout");
                    }
                }
                _ = self.close.notified() => break None,
                _ = self.stop.cancelled(), if !stopping => {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        };
        if let (Some(reason), Some(s)) = (reason, &self.stats) {
            s.dropped(reason);
        }
    }
}

/// Counts a request as in progress on its connection until its response
/// body is finished or dropped (such a connection is never evicted).
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn enter(busy: &Arc<AtomicUsize>) -> InFlight {
        busy.fetch_add(1, Ordering::AcqRel);
        InFlight(busy.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in progress.
struct Guarded {
    body: Body,
    _guard: InFlight,
}

impl HttpBody for Guarded {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A socket that records when it last moved a byte (milliseconds after
/// `start`), for the idle timeout.
struct Watched {
    inner: TcpStream,
    start: Instant,
    activity: Arc<AtomicU64>,
}

impl Watched {
    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.activity.store(ms, Ordering::Relaxed);
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_keeps_descriptors_free() {
        assert_eq!(connection_cap(0, 1024, 768), 256);
        assert_eq!(connection_cap(0, 1_000_000, 768), 4096);
        assert_eq!(connection_cap(100, 1024, 768), 100);
        assert_eq!(connection_cap(5000, 1024, 768), 256);
        assert_eq!(connection_cap(0, 256, 768), 16);
    }
}
