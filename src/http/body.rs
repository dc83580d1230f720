//! The image server's answer from one open file: the status, the
//! validators (`Last-Modified`, a strong `ETag`), the conditional and
//! `Range` / `If-Range` decisions (see [`crate::http::ranges`]) are all taken
//! from the metadata of the descriptor that was opened, and the body is read
//! from that same descriptor, so a file replaced meanwhile (a node prepared
//! again) never mixes into the answer. A file with a compressed form is
//! answered with that form to clients that accept gzip
//! ([`crate::http::encoding`]): the same rules, applied to its bytes.

use crate::http::ranges::{self, Conditions, Decision, Precondition, Validators};
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use std::io::{Seek, SeekFrom};
use std::time::SystemTime;
use tokio::io::AsyncReadExt;

/// Bytes read from the file at a time: fewer trips to the blocking pool and
/// the socket per byte (about 0.8-0.9 -> 1.0-1.1 of nginx's sendfile
/// throughput against 256 KiB) for about 1 MiB of buffers per download in
/// progress.
pub(crate) const PIECE: usize = 512 * 1024;

/// The file a request names, opened, and the compressed form of its bytes
/// when it has one (see [`crate::gzip::open_for`]).
pub(crate) struct Opened {
    /// The file, as it is (identity).
    pub(crate) file: std::fs::File,
    /// Its metadata, from the descriptor.
    pub(crate) meta: std::fs::Metadata,
    /// Its compressed form and that file's metadata.
    pub(crate) gzip: Option<(std::fs::File, std::fs::Metadata)>,
}

/// The response to the GET/HEAD `req` of `opened`: its compressed form
/// when it has one and the client accepts gzip (`Content-Encoding: gzip`,
/// its own length, ETag and ranges), else the file as it is; both say
/// `Vary: Accept-Encoding` when a compressed form exists.
pub(crate) fn respond(req: &Request, opened: Opened) -> Response {
    let chosen = Chosen::of(req, opened);
    let mut headers = chosen.headers();
    let current = Validators {
        etag: &chosen.etag,
        modified: chosen.modified,
        date_is_strong: !chosen.varies,
    };
    let h = req.headers();
    match ranges::preconditions(&conditions(h), &current) {
        Precondition::NotModified => {
            return answer(StatusCode::NOT_MODIFIED, headers, Body::empty());
        }
        Precondition::Failed => {
            return answer(StatusCode::PRECONDITION_FAILED, headers, Body::empty());
        }
        Precondition::Proceed => {}
    }
    let value = |name: header::HeaderName| h.get(name).and_then(|v| v.to_str().ok());
    let len = chosen.len;
    let decision = ranges::decide(value(header::RANGE), value(header::IF_RANGE), len, &current);
    put(&mut headers, header::ACCEPT_RANGES, "bytes".into());
    let (status, first, count) = match decision {
        Decision::Unsatisfiable => {
            put(
                &mut headers,
                header::CONTENT_RANGE,
                format!("bytes */{len}"),
            );
            return answer(StatusCode::RANGE_NOT_SATISFIABLE, headers, Body::empty());
        }
        Decision::Full => (StatusCode::OK, 0, len),
        Decision::Partial(first, last) => {
            let range = format!("bytes {first}-{last}/{len}");
            put(&mut headers, header::CONTENT_RANGE, range);
            (StatusCode::PARTIAL_CONTENT, first, last - first + 1)
        }
    };
    let mime = mime_guess::from_path(req.uri().path())
        .first_raw()
        .unwrap_or("application/octet-stream");
    put(&mut headers, header::CONTENT_TYPE, mime.to_string());
    put(&mut headers, header::CONTENT_LENGTH, count.to_string());
    if req.method() == Method::HEAD || count == 0 {
        return answer(status, headers, Body::empty());
    }
    match stream(chosen.file, first, count) {
        Ok(body) => answer(status, headers, body),
        Err(_) => answer(
            StatusCode::INTERNAL_SERVER_ERROR,
            HeaderMap::new(),
            Body::empty(),
        ),
    }
}

/// The representation a request gets: the compressed form (when there is
/// one and the client accepts gzip) or the file as it is.
struct Chosen {
    file: std::fs::File,
    len: u64,
    modified: SystemTime,
    etag: String,
    /// The compressed form was chosen.
    gzip: bool,
    /// A compressed form exists: the answer depends on `Accept-Encoding`.
    varies: bool,
}

impl Chosen {
    fn of(req: &Request, opened: Opened) -> Chosen {
        let varies = opened.gzip.is_some();
        let (file, meta, gzip) = match opened.gzip {
            Some((file, meta)) if crate::http::encoding::accepts_gzip(req.headers()) => {
                (file, meta, true)
            }
            _ => (opened.file, opened.meta, false),
        };
        let len = meta.len();
        let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        let etag = match gzip {
            true => gzip_etag(len, modified),
            false => file_etag(len, modified),
        };
        Chosen {
            file,
            len,
            modified,
            etag,
            gzip,
            varies,
        }
    }

    /// The headers every answer about this representation carries.
    fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let modified = httpdate::fmt_http_date(self.modified);
        put(&mut headers, header::LAST_MODIFIED, modified);
        put(&mut headers, header::ETAG, self.etag.clone());
        if self.varies {
            put(&mut headers, header::VARY, "Accept-Encoding".into());
        }
        if self.gzip {
            put(&mut headers, header::CONTENT_ENCODING, "gzip".into());
        }
        headers
    }
}

/// Sets header `name` to `value` (left out if it is not a valid value).
fn put(headers: &mut HeaderMap, name: header::HeaderName, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert(name, v);
    }
}

/// `count` bytes of `file` from `first`, read in [`PIECE`]s.
fn stream(mut file: std::fs::File, first: u64, count: u64) -> std::io::Result<Body> {
    // lseek only moves the offset: it never waits for the disk.
    file.seek(SeekFrom::Start(first))?;
    let reader = tokio::fs::File::from_std(file).take(count);
    Ok(Body::from_stream(
        tokio_util::io::ReaderStream::with_capacity(reader, PIECE),
    ))
}

/// The conditional request headers of `h`.
fn conditions(h: &HeaderMap) -> Conditions<'_> {
    let value = |name: header::HeaderName| h.get(name).and_then(|v| v.to_str().ok());
    Conditions {
        if_match: value(header::IF_MATCH),
        if_unmodified_since: value(header::IF_UNMODIFIED_SINCE),
        if_none_match: value(header::IF_NONE_MATCH),
        if_modified_since: value(header::IF_MODIFIED_SINCE),
    }
}

fn answer(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

/// The strong ETag of a file of `len` bytes modified at `modified` (the
/// form earlier releases sent, so validators held by clients stay valid).
pub(crate) fn file_etag(len: u64, modified: SystemTime) -> String {
    let t = modified
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    format!("\"{:x}.{:08x}-{:x}\"", t.as_secs(), t.subsec_nanos(), len)
}

/// The strong ETag of a compressed form of `len` bytes modified at
/// `modified`: never equal to an identity ETag (RFC 9110 8.8.3: each
/// representation its own), so a range resumed with `If-Range` never mixes
/// the two.
pub(crate) fn gzip_etag(len: u64, modified: SystemTime) -> String {
    let etag = file_etag(len, modified);
    format!("{}-gzip\"", &etag[..etag.len() - 1])
}
