//! The peer listener's answer for a master still being written (see
//! `crate::peers::live`): the bytes already in its file go out at once, the
//! rest as they land, and the last piece only once the master is committed,
//! so a complete body stands for a committed master. The body fails (the
//! connection is cut) as soon as the master fails, or when its file is
//! removed uncommitted; one that stops growing is cut by the listener's
//! idle timeout. Ranges are answered as for a committed master, against the
//! publication's own ETag (a retried download publishes a new one).

use crate::http::body::PIECE;
use crate::http::ranges::{self, Decision, Validators};
use crate::peers::live::{LiveState, LiveView};
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// How often a file that has not grown is looked at again.
const POLL: Duration = Duration::from_millis(10);

/// How long the file may take to appear (its writer is starting).
const APPEAR: Duration = Duration::from_secs(5);

/// What a GET/HEAD asks of a master being written, taken from the request
/// before anything is awaited.
pub(crate) struct Asked {
    range: Option<String>,
    if_range: Option<String>,
    head: bool,
}

impl Asked {
    /// The range, its condition and the method of `req`.
    pub(crate) fn of(req: &Request) -> Asked {
        let value = |name| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        Asked {
            range: value(header::RANGE),
            if_range: value(header::IF_RANGE),
            head: req.method() == Method::HEAD,
        }
    }
}

/// The answer for the master `view` describes, its pieces shared through
/// `followed`; `None` when it was committed meanwhile (the committed master
/// answers).
pub(crate) async fn respond(asked: Asked, view: LiveView, followed: &Followed) -> Option<Response> {
    let size = view.size;
    let etag = format!("\"live-{}-{size:x}\"", view.id);
    let current = Validators {
        etag: &etag,
        modified: SystemTime::now(),
        date_is_strong: false,
    };
    let (status, first, end) = match ranges::decide(
        asked.range.as_deref(),
        asked.if_range.as_deref(),
        size,
        &current,
    ) {
        Decision::Unsatisfiable => {
            let mut r = StatusCode::RANGE_NOT_SATISFIABLE.into_response();
            put(&mut r, header::CONTENT_RANGE, format!("bytes */{size}"));
            return Some(r);
        }
        Decision::Full => (StatusCode::OK, 0, size),
        Decision::Partial(first, last) => (StatusCode::PARTIAL_CONTENT, first, last + 1),
    };
    let file = match open(&view).await {
        Opened::File(file) => file,
        Opened::Committed => return None,
        Opened::Missing => return Some(StatusCode::NOT_FOUND.into_response()),
    };
    let body = match asked.head || first == end {
        true => Body::empty(),
        false => body(Follow {
            file,
            pieces: followed.pieces(view.id),
            view,
            at: first,
            end,
        }),
    };
    let mut r = Response::new(body);
    *r.status_mut() = status;
    put(&mut r, header::ETAG, etag.clone());
    put(&mut r, header::ACCEPT_RANGES, "bytes".into());
    put(&mut r, header::CONTENT_LENGTH, (end - first).to_string());
    put(
        &mut r,
        header::CONTENT_TYPE,
        "application/octet-stream".into(),
    );
    if status == StatusCode::PARTIAL_CONTENT {
        let range = format!("bytes {first}-{}/{size}", end - 1);
        put(&mut r, header::CONTENT_RANGE, range);
    }
    Some(r)
}

fn put(r: &mut Response, name: header::HeaderName, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        r.headers_mut().insert(name, v);
    }
}

/// What opening a master being written came to.
enum Opened {
    File(Arc<std::fs::File>),
    /// It became the committed master (its file moved there).
    Committed,
    /// Gone, failed, or not a regular file.
    Missing,
}

/// The master's file, waited for while its writer starts.
async fn open(view: &LiveView) -> Opened {
    let started = Instant::now();
    loop {
        match crate::http::open::open_regular(&view.path) {
            Ok(Some(file)) => return Opened::File(Arc::new(file)),
            Ok(None) => return Opened::Missing,
            Err(rustix::io::Errno::NOENT) => match *view.state.borrow() {
                LiveState::Committed => return Opened::Committed,
                LiveState::Writing if started.elapsed() < APPEAR => {}
                _ => return Opened::Missing,
            },
            Err(_) => return Opened::Missing,
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The body of a [`Follow`], read as the file grows.
fn body(follow: Follow) -> Body {
    let stream = futures_util::stream::try_unfold(follow, |mut follow| async move {
        Ok::<_, std::io::Error>(follow.next().await?.map(|bytes| (bytes, follow)))
    });
    Body::from_stream(stream)
}

/// A follower's place in the file: bytes `at..end` are still to be sent.
struct Follow {
    file: Arc<std::fs::File>,
    view: LiveView,
    pieces: Arc<Pieces>,
    at: u64,
    end: u64,
}

impl Follow {
    /// The next piece, once written (the master's last one once it is
    /// committed); `None` at the end. Pieces are read whole, at multiples
    /// of [`PIECE`], and shared with the other followers of the same
    /// master (see [`Pieces`]).
    async fn next(&mut self) -> std::io::Result<Option<Bytes>> {
        if self.at >= self.end {
            return Ok(None);
        }
        let start = self.at - self.at % PIECE as u64;
        let stop = (start + PIECE as u64).min(self.view.size);
        loop {
            let state = *self.view.state.borrow();
            let meta = self.file.metadata()?;
            if state == LiveState::Failed || meta.nlink() == 0 && state != LiveState::Committed {
                return Err(std::io::Error::other("the master being written failed"));
            }
            if meta.len() >= stop {
                break;
            }
            tokio::time::sleep(POLL).await;
        }
        if stop == self.view.size {
            self.settled().await?;
        }
        let piece = match self.pieces.get(start) {
            Some(piece) => piece,
            None => self.read(start, stop).await?,
        };
        let from = (self.at - start) as usize;
        let to = (stop.min(self.end) - start) as usize;
        self.at = start + to as u64;
        Ok(Some(piece.slice(from..to)))
    }

    /// Waits until the master is committed; fails when it is not.
    async fn settled(&mut self) -> std::io::Result<()> {
        match self.view.state.wait_for(|s| *s != LiveState::Writing).await {
            Ok(s) if *s == LiveState::Committed => Ok(()),
            _ => Err(std::io::Error::other(
                "the master being written was not committed",
            )),
        }
    }

    /// Bytes `start..stop` of the file, into a buffer of the pool, kept
    /// for the other followers.
    async fn read(&self, start: u64, stop: u64) -> std::io::Result<Bytes> {
        let (file, pieces) = (self.file.clone(), self.pieces.clone());
        let piece = tokio::task::spawn_blocking(move || {
            let mut buf = pieces.buffer();
            buf.resize((stop - start) as usize, 0);
            file.read_exact_at(&mut buf, start)?;
            Ok::<_, std::io::Error>(pieces.keep(start, buf))
        })
        .await
        .map_err(std::io::Error::other)??;
        Ok(piece)
    }
}

/// Pieces kept of one master being written.
const KEPT: usize = 16;

/// The pieces of one master being written that its followers read, kept
/// for a while: followers move together behind the writer, so each piece
/// is read from the file once, not once per follower. Their buffers are
/// reused (a fresh buffer costs its pages' first touch).
#[derive(Default)]
pub(crate) struct Pieces {
    recent: std::sync::Mutex<std::collections::VecDeque<(u64, Bytes)>>,
    spare: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

impl Pieces {
    fn get(&self, start: u64) -> Option<Bytes> {
        let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent
            .iter()
            .find(|(at, _)| *at == start)
            .map(|(_, b)| b.clone())
    }

    fn buffer(&self) -> Vec<u8> {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        let mut buf = spare.pop().unwrap_or_else(|| Vec::with_capacity(PIECE));
        buf.clear();
        buf
    }

    /// Keeps `buf`, read at `start`, and returns it as a piece whose
    /// buffer comes back to the pool when its last holder drops it.
    fn keep(&self, start: u64, buf: Vec<u8>) -> Bytes {
        let piece = Bytes::from_owner(Pooled {
            buf,
            spare: Arc::downgrade(&self.spare),
        });
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if recent.len() == KEPT {
            recent.pop_front();
        }
        recent.push_back((start, piece.clone()));
        piece
    }
}

/// A piece's buffer, back to its pool when dropped.
struct Pooled {
    buf: Vec<u8>,
    spare: std::sync::Weak<std::sync::Mutex<Vec<Vec<u8>>>>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(spare) = self.spare.upgrade() {
            let mut spare = spare.lock().unwrap_or_else(|p| p.into_inner());
            if spare.len() < 2 * KEPT {
                spare.push(std::mem::take(&mut self.buf));
            }
        }
    }
}

/// The [`Pieces`] of each master being written, by publication, while it
/// has followers.
#[derive(Default)]
pub(crate) struct Followed {
    by_publication: std::sync::Mutex<std::collections::HashMap<u64, std::sync::Weak<Pieces>>>,
}

impl Followed {
    /// The pieces of publication `id`, shared with its other followers.
    pub(crate) fn pieces(&self, id: u64) -> Arc<Pieces> {
        let mut all = self
            .by_publication
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        all.retain(|_, w| w.strong_count() > 0);
        if let Some(p) = all.get(&id).and_then(std::sync::Weak::upgrade) {
            return p;
        }
        let p = Arc::new(Pieces::default());
        all.insert(id, Arc::downgrade(&p));
        p
    }
}
