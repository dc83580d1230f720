//! The accept loop of the image server and of the metrics listener: a cap
//! on open connections, a header-read timeout and an idle timeout. Without
//! them, clients that open connections and send nothing (or half a header)
//! keep them open for ever, exhaust the process's file descriptors, and then
//! image downloads, `/readyz` and prepares all fail.
//!
//! At the cap, a connection waiting for a request is closed to make room:
//! first the oldest that never sent a byte (checked on the socket itself, so
//! a request the server has not read yet counts), then the oldest idle
//! keep-alive, then the oldest with half a request. Only when every open
//! connection is in the middle of a request is the new one refused. Either
//! way the connection closed gets a `503` and a graceful close (the server
//! stops sending, then reads what the client still sends for a moment), so a
//! client whose request was cut gets a status line, not a reset. Each
//! listener has its own cap, so image clients never starve `/healthz`,
//! `/readyz` or `/metrics`.
//!
//! Over TLS the same bounds hold: the handshake must end within the header
//! timeout, a connection counts as having sent a request only once its
//! decrypted bytes arrive (so one that shook hands and sent nothing is
//! evicted first), and the `503` of an eviction goes through TLS, followed
//! by a `close_notify`. A connection refused at the cap is closed at once
//! (it cannot be answered before a handshake).
//!
//! One file on purpose (about 700 lines, a third of them tests and the
//! `AsyncRead`/`AsyncWrite` plumbing): a connection's state (`FRESH`,
//! `WAITING`, `REQUEST`), the stream wrappers that set it as bytes pass
//! (`Watched`, `Marked`), and the eviction that reads it (`Registry`) are
//! one decision, "which connection may be closed to make room", and share
//! private atomics that splitting them would have to expose.

use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
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
    /// Whether a request whose handler has not answered yet keeps its
    /// connection from the idle timeout: for the JSON-RPC listener, whose
    /// calls wait for their work (bounded by `request_timeout`); not for
    /// servers whose handlers answer at once.
    pub slow_handlers: bool,
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
    fn dropped(&self, reason: Dropped) {
        self.dropped.with_label_values(&[reason.as_str()]).inc();
    }
}

/// Descriptors kept free beside the image server's connections: the
/// pipeline's files, sockets and converter pipes per message handled at
/// once, the broker, the metrics listener and the process's own.
pub fn descriptor_headroom(prefetch: u16) -> u64 {
    256 + 16 * u64::from(prefetch) + OPS_MAX_CONNECTIONS as u64 + LINGER_MAX as u64
}

/// Connections closed for capacity that may linger at once, both listeners
/// together (beyond them a connection is closed at once).
const LINGER_MAX: usize = 64;

/// The lingering connections' permits (one set for the process, as the
/// descriptors kept for them in [`descriptor_headroom`]).
static LINGERING: Semaphore = Semaphore::const_new(LINGER_MAX);

/// How long a connection closed for capacity keeps reading what the client
/// still sends, so that closing it does not reset it before the client has
/// read the `503`.
const LINGER: Duration = Duration::from_secs(2);

/// What a connection closed for capacity is sent.
const UNAVAILABLE: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

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

/// Where a connection is between requests, as far as eviction goes.
const FRESH: u8 = 0; // accepted, no byte received yet
const WAITING: u8 = 1; // a response finished, no byte received since
const REQUEST: u8 = 2; // bytes of a request received

/// What the accept loop and a connection's task share.
struct Shared {
    /// Requests being answered (0: waiting for a request).
    busy: AtomicUsize,
    /// Requests whose handler has not returned its response yet (a
    /// JSON-RPC call waiting for its work: no byte moves meanwhile; see
    /// [`Limits::slow_handlers`]).
    handling: AtomicUsize,
    /// [`FRESH`], [`WAITING`] or [`REQUEST`].
    state: AtomicU8,
    /// Told when the connection must make room for a new one.
    close: Notify,
    /// The socket (also used to look for unread bytes).
    stream: Arc<TcpStream>,
}

impl Shared {
    /// Whether the client sent bytes not read yet (or closed: no reason to
    /// keep it); never waits.
    fn has_unread(&self) -> bool {
        let mut byte = [0u8; 1];
        let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
        match rustix::net::recv(&*self.stream, &mut byte, flags) {
            Ok((n, _)) => n > 0,
            Err(_) => false,
        }
    }
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    open: BTreeMap<u64, Arc<Shared>>,
}

impl Registry {
    /// The connection to close to make room, if any: the oldest that never
    /// sent a byte, else the oldest idle keep-alive, else the oldest with a
    /// request not complete yet; never one in the middle of a request.
    fn victim(&self) -> Option<u64> {
        let (mut waiting, mut partial) = (None, None);
        for (id, c) in &self.open {
            if c.busy.load(Ordering::Acquire) > 0 {
                continue;
            }
            let state = c.state.load(Ordering::Acquire);
            if state != REQUEST && c.has_unread() {
                c.state.store(REQUEST, Ordering::Release);
            }
            match c.state.load(Ordering::Acquire) {
                FRESH => return Some(*id),
                WAITING => waiting = waiting.or(Some(*id)),
                _ => partial = partial.or(Some(*id)),
            }
        }
        waiting.or(partial)
    }
}

/// A listening socket and whether its connections speak TLS.
pub(crate) struct Listener {
    /// The bound socket.
    pub(crate) listener: TcpListener,
    /// TLS set-up of every connection (`None`: plain HTTP).
    pub(crate) tls: Option<Arc<crate::http::Tls>>,
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes,
/// then lets the requests in progress finish.
pub(crate) async fn serve(
    Listener { listener, tls }: Listener,
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
        let stream = Arc::new(stream);
        let Some((id, shared)) = admit(&registry, &stream, limits.max_connections, stats.as_ref())
        else {
            if tls.is_none() {
                tracker.spawn(unavailable(stream));
            }
            if let Some(s) = &stats {
                s.dropped(Dropped::Refused);
            }
            continue;
        };
        if let Some(s) = &stats {
            s.open.inc();
        }
        let conn = Connection {
            app: app.clone(),
            limits,
            shared,
            stop: stop.clone(),
            stats: stats.clone(),
            tls: tls.clone(),
        };
        let registry = registry.clone();
        tracker.spawn(async move {
            conn.run(&registry, id).await;
        });
    }
    drop(listener);
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// Registers a new connection, closing one waiting for a request (see
/// [`Registry::victim`]) when the cap is reached; `None` when every open
/// connection is in the middle of a request.
fn admit(
    registry: &Mutex<Registry>,
    stream: &Arc<TcpStream>,
    max: usize,
    stats: Option<&Stats>,
) -> Option<(u64, Arc<Shared>)> {
    let mut reg = registry.lock().unwrap_or_else(|p| p.into_inner());
    if reg.open.len() >= max.max(1) {
        let victim = reg.victim()?;
        if let Some(evicted) = reg.open.remove(&victim) {
            evicted.close.notify_one();
            if let Some(s) = stats {
                s.dropped(Dropped::Evicted);
            }
        }
    }
    let id = reg.next_id;
    reg.next_id += 1;
    let shared = Arc::new(Shared {
        busy: AtomicUsize::new(0),
        handling: AtomicUsize::new(0),
        state: AtomicU8::new(FRESH),
        close: Notify::new(),
        stream: stream.clone(),
    });
    reg.open.insert(id, shared.clone());
    Some((id, shared))
}

/// Answers 503 to a connection closed for capacity and closes it
/// gracefully: stops sending, then reads (and drops) what the client still
/// sends for at most [`LINGER`], so that the close does not reset the
/// connection before the client has read the answer. Beyond
/// [`LINGER_MAX`] such connections at once, closes at once.
async fn unavailable(stream: Arc<TcpStream>) {
    let _ = stream.try_write(UNAVAILABLE);
    let _ = rustix::net::shutdown(&*stream, rustix::net::Shutdown::Write);
    let Ok(_permit) = LINGERING.try_acquire() else {
        return;
    };
    let mut sink = [0u8; 4096];
    let mut left: usize = 1 << 20;
    let _ = tokio::time::timeout(LINGER, async {
        while left > 0 {
            if stream.readable().await.is_err() {
                return;
            }
            match stream.try_read(&mut sink) {
                Ok(0) => return,
                Ok(n) => left = left.saturating_sub(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    })
    .await;
}

/// Answers 503 through TLS to a connection closed for capacity, sends its
/// `close_notify`, then reads (and drops) what the client still sends, all
/// within [`LINGER`]; beyond [`LINGER_MAX`] such connections at once,
/// closes at once.
async fn unavailable_tls<I: AsyncRead + AsyncWrite + Unpin>(mut io: I) {
    let Ok(_permit) = LINGERING.try_acquire() else {
        return;
    };
    let _ = tokio::time::timeout(LINGER, async {
        io.write_all(UNAVAILABLE).await?;
        io.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut left: usize = 1 << 20;
        while left > 0 {
            match io.read(&mut sink).await? {
                0 => break,
                n => left = left.saturating_sub(n),
            }
        }
        Ok::<(), std::io::Error>(())
    })
    .await;
}

struct Connection {
    app: axum::Router,
    limits: Limits,
    shared: Arc<Shared>,
    stop: CancellationToken,
    stats: Option<Stats>,
    tls: Option<Arc<crate::http::Tls>>,
}

/// Why the server closed a connection: the `reason` label of
/// `http_connections_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dropped {
    /// Refused at accept: `max_connections` are open and every one is in
    /// the middle of a request.
    Refused,
    /// Closed to make room for a new one (counted when chosen).
    Evicted,
    /// Its request headers did not arrive within the header timeout.
    HeaderTimeout,
    /// Idle past the idle timeout.
    IdleTimeout,
    /// Its TLS handshake failed.
    TlsHandshakeFailed,
    /// Its TLS handshake did not finish within the header timeout.
    TlsHandshakeTimeout,
}

impl Dropped {
    /// The metric's label.
    fn as_str(self) -> &'static str {
        match self {
            Dropped::Refused => "refused",
            Dropped::Evicted => "evicted",
            Dropped::HeaderTimeout => "header_timeout",
            Dropped::IdleTimeout => "idle_timeout",
            Dropped::TlsHandshakeFailed => "tls_handshake_failed",
            Dropped::TlsHandshakeTimeout => "tls_handshake_timeout",
        }
    }
}

/// Why a connection ended: dropped by the server, or `None` when the
/// client or a shutdown ended it.
type Reason = Option<Dropped>;

impl Connection {
    /// Serves the connection until it ends, times out or is closed to make
    /// room (then with a 503, see [`unavailable`]); connection `id` leaves
    /// `registry` before its socket is closed.
    async fn run(self, registry: &Mutex<Registry>, id: u64) {
        let stream = self.shared.stream.clone();
        let _ = stream.set_nodelay(true);
        let clock = Clock {
            start: Instant::now(),
            activity: Arc::new(AtomicU64::new(0)),
        };
        let watched = Watched {
            inner: stream.clone(),
            clock: clock.clone(),
        };
        let (reason, tls_io) = match self.tls.clone() {
            None => (self.drive(self.marked(watched), &clock).await.0, None),
            Some(tls) => match self.handshake(&tls, watched).await {
                Ok(io) => self.drive(self.marked(io), &clock).await,
                Err(reason) => (reason, None),
            },
        };
        registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .open
            .remove(&id);
        // Not counted as open while it lingers.
        if let Some(s) = &self.stats {
            s.open.dec();
        }
        match (reason, &self.stats) {
            // Counted when it was chosen; evicted mid-handshake: nothing
            // can be answered.
            (Some(Dropped::Evicted), _) => match (&self.tls, tls_io) {
                (None, _) => unavailable(stream).await,
                (Some(_), Some(io)) => unavailable_tls(io).await,
                (Some(_), None) => {}
            },
            (Some(reason), Some(s)) => s.dropped(reason),
            _ => {}
        }
    }

    fn marked<T>(&self, inner: T) -> Marked<T> {
        Marked {
            inner,
            shared: self.shared.clone(),
        }
    }

    /// The TLS handshake, within the header timeout; ends early when the
    /// connection is evicted or the server stops.
    async fn handshake(
        &self,
        tls: &Arc<crate::http::Tls>,
        io: Watched,
    ) -> Result<tokio_rustls::server::TlsStream<Watched>, Reason> {
        let accept = async {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.config().await);
            acceptor.accept(io).await
        };
        tokio::select! {
            done = tokio::time::timeout(self.limits.header_timeout, accept) => {
                match done {
                    Ok(Ok(stream)) => Ok(stream),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "TLS handshake failed");
                        Err(Some(Dropped::TlsHandshakeFailed))
                    }
                    Err(_) => Err(Some(Dropped::TlsHandshakeTimeout)),
                }
            }
            _ = self.shared.close.notified() => Err(Some(Dropped::Evicted)),
            _ = self.stop.cancelled() => Err(None),
        }
    }

    /// Serves HTTP/1.1 on `io` until the connection ends; gives `io` back
    /// when the connection is evicted (for its 503).
    async fn drive<I>(&self, io: I, clock: &Clock) -> (Reason, Option<I>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (app, shared) = (self.app.clone(), self.shared.clone());
        let client = self.shared.stream.peer_addr().ok();
        let service = hyper::service::service_fn(move |req: axum::http::Request<Incoming>| {
            let guard = InFlight::enter(&shared);
            let app = app.clone();
            let mut req = req.map(Body::new);
            if let Some(addr) = client {
                req.extensions_mut()
                    .insert(crate::http::access::ClientAddr(addr));
            }
            async move {
                let handling = Handling::enter(&guard.0);
                let response = app.oneshot(req).await?;
                drop(handling);
                Ok::<_, Infallible>(response.map(|body| {
                    Body::new(crate::http::Holding {
                        body,
                        sent: Vec::new(),
                        log: None,
                        _held: guard,
                    })
                }))
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_timeout)
            .keep_alive(true);
        let mut conn = builder.serve_connection(TokioIo::new(io), service);
        let mut stopping = false;
        let reason = loop {
            let idle_until = clock.last() + self.limits.idle_timeout;
            tokio::select! {
                done = &mut conn => break match done {
                    Err(e) if e.is_timeout() => Some(Dropped::HeaderTimeout),
                    _ => None,
                },
                _ = tokio::time::sleep_until(idle_until) => {
                    if self.limits.slow_handlers
                        && self.shared.handling.load(Ordering::Acquire) > 0
                    {
                        clock.touch();
                    } else if Instant::now() >= clock.last() + self.limits.idle_timeout {
                        break Some(Dropped::IdleTimeout);
                    }
                }
                _ = self.shared.close.notified() => break Some(Dropped::Evicted),
                _ = self.stop.cancelled(), if !stopping => {
                    stopping = true;
                    Pin::new(&mut conn).graceful_shutdown();
                }
            }
        };
        if reason == Some(Dropped::Evicted) {
            return (reason, Some(conn.into_parts().io.into_inner()));
        }
        (reason, None)
    }
}

/// Counts a request as in progress on its connection until its response
/// body is finished or dropped (such a connection is never evicted).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn enter(shared: &Arc<Shared>) -> InFlight {
        shared.busy.fetch_add(1, Ordering::AcqRel);
        shared.state.store(REQUEST, Ordering::Release);
        InFlight(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.state.store(WAITING, Ordering::Release);
        }
    }
}

/// Counts a request as being handled until its handler returns the
/// response (see [`Shared::handling`]).
struct Handling(Arc<Shared>);

impl Handling {
    fn enter(shared: &Arc<Shared>) -> Handling {
        shared.handling.fetch_add(1, Ordering::AcqRel);
        Handling(shared.clone())
    }
}

impl Drop for Handling {
    fn drop(&mut self) {
        self.0.handling.fetch_sub(1, Ordering::AcqRel);
    }
}

/// When a connection was accepted and when it last moved a byte
/// (milliseconds after `start`), for the idle timeout.
#[derive(Clone)]
struct Clock {
    start: Instant,
    activity: Arc<AtomicU64>,
}

impl Clock {
    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.activity.store(ms, Ordering::Relaxed);
    }

    /// When the connection last moved a byte.
    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.activity.load(Ordering::Relaxed))
    }
}

/// A socket that records on its [`Clock`] when it last moved a byte, TLS
/// records included. It shares the socket with the accept loop (which only
/// peeks).
struct Watched {
    inner: Arc<TcpStream>,
    clock: Clock,
}

impl Watched {
    /// Writes with `write` once the socket is writable.
    fn poll_write_with(
        &self,
        cx: &mut Context<'_>,
        write: impl Fn(&TcpStream) -> std::io::Result<usize>,
    ) -> Poll<std::io::Result<usize>> {
        loop {
            std::task::ready!(self.inner.poll_write_ready(cx))?;
            match write(&self.inner) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Ok(n) => {
                    if n > 0 {
                        self.clock.touch();
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            std::task::ready!(self.inner.poll_read_ready(cx))?;
            match self.inner.try_read(buf.initialize_unfilled()) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Ok(n) => {
                    buf.advance(n);
                    if n > 0 {
                        self.clock.touch();
                    }
                    return Poll::Ready(Ok(()));
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_write_with(cx, |s| s.try_write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_write_with(cx, |s| s.try_write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(
            rustix::net::shutdown(&*self.inner, rustix::net::Shutdown::Write)
                .map_err(std::io::Error::from),
        )
    }
}

/// The connection's HTTP bytes (decrypted, over TLS): the first of them
/// mark a request as arriving, for eviction.
struct Marked<T> {
    inner: T,
    shared: Arc<Shared>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Marked<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.shared.state.store(REQUEST, Ordering::Release);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Marked<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
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
