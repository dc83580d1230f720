//! Image sources: where the bytes of an image come from (`http(s)://` with
//! reqwest, streamed; `file://` under the allowed paths; Glance image ids
//! through the Image API, see `glance`), with bounded
//! retries and the metadata Ironic uses to revalidate a cached copy.

use crate::config::{Config, redact_url};
use crate::error::{Error, ErrorCode, Result};
use crate::glance::Glance;
use crate::sink::{Digests, Hashes, Sink};
use backon::{ExponentialBuilder, Retryable};
use futures_util::StreamExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::io::AsyncReadExt;

/// A parsed `image_source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An `http://` or `https://` URL.
    Http(reqwest::Url),
    /// A local regular file, already resolved and checked against
    /// `[conductor]file_url_allowed_paths`.
    File(PathBuf),
    /// A Glance image id, fetched through the Image API.
    Glance(String),
}

/// What a source says about its image without sending it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceStat {
    /// Last modification time, when the source tells it.
    pub last_modified: Option<SystemTime>,
    /// Size in bytes, when the source tells it.
    pub size: Option<u64>,
}

/// HTTP client and policy for fetching sources, shared by all requests.
#[derive(Clone)]
pub struct Fetcher {
    client: reqwest::Client,
    retries: u32,
    glance: Arc<Glance>,
}

enum Failure {
    Retry(Error),
    Fatal(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Fatal(e)
    }
}

impl Source {
    /// Parses `href`, refusing schemes the worker cannot fetch and `file://`
    /// paths outside the allowed directories or that are not regular files.
    pub fn parse(href: &str, config: &Config) -> Result<Source> {
        if let Some(id) = crate::cache::glance_id(href) {
            return Ok(Source::Glance(id));
        }
        let url = reqwest::Url::parse(href).map_err(|e| {
            Error::new(
                ErrorCode::InvalidMessage,
                format!("image_source {:?} is not a URL: {e}", redact_url(href)),
            )
        })?;
        match url.scheme() {
            "http" | "https" => Ok(Source::Http(url)),
            "file" => {
                let path = url.to_file_path().map_err(|()| {
                    Error::new(ErrorCode::InvalidMessage, format!("bad file URL {href:?}"))
                })?;
                Ok(Source::File(check_file_path(
                    &path,
                    &config.conductor.file_url_allowed_paths,
                )?))
            }
            other => Err(Error::new(
                ErrorCode::SourceNotAllowed,
                format!("image_source scheme {other:?} is not supported (http, https, file)"),
            )),
        }
    }

    /// The last path component, used to find the image in a checksum file.
    pub fn file_name(&self) -> String {
        match self {
            Source::Http(url) => url
                .path_segments()
                .and_then(|mut s| s.next_back())
                .unwrap_or_default()
                .to_string(),
            Source::File(path) => path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            Source::Glance(id) => id.clone(),
        }
    }

    /// The source for log and error messages (credentials masked).
    pub fn display(&self) -> String {
        match self {
            Source::Http(url) => redact_url(url.as_str()),
            Source::File(path) => format!("file://{}", path.display()),
            Source::Glance(id) => format!("glance://{id}"),
        }
    }
}

/// Resolves `path` (symlinks, `..`) and checks it is a regular file below one
/// of the allowed directories: `file:///dev/zero`, FIFOs and directories are
/// refused before anything is opened for reading.
fn check_file_path(path: &Path, allowed: &[PathBuf]) -> Result<PathBuf> {
    let real = std::fs::canonicalize(path).map_err(|e| {
        let code = if e.kind() == std::io::ErrorKind::NotFound {
            ErrorCode::SourceNotFound
        } else {
            ErrorCode::SourceUnreachable
        };
        Error::new(code, format!("{}: {e}", path.display()))
    })?;
    let inside = allowed.iter().any(|dir| {
        std::fs::canonicalize(dir)
            .map(|dir| real.starts_with(dir))
            .unwrap_or(false)
    });
    if !inside {
        return Err(Error::new(
            ErrorCode::SourceNotAllowed,
            format!(
                "{} is not under [conductor]file_url_allowed_paths",
                path.display()
            ),
        ));
    }
    let meta = std::fs::metadata(&real).map_err(|e| Error::io(path.display(), e))?;
    if !meta.is_file() {
        return Err(Error::new(
            ErrorCode::SourceNotAllowed,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(real)
}

impl Fetcher {
    /// Builds the shared client from `[source]`.
    pub fn new(config: &Config) -> Result<Fetcher> {
        let s = &config.source;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(s.connect_timeout))
            .read_timeout(Duration::from_secs(s.read_timeout))
            .tls_danger_accept_invalid_certs(!s.verify_tls)
            .user_agent(concat!("ironic-image-worker/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::new(ErrorCode::Internal, format!("HTTP client: {e}")))?;
        let glance = Arc::new(Glance::new(
            config.glance.clone(),
            if config.glance.insecure {
                reqwest::Client::builder()
                    .connect_timeout(Duration::from_secs(s.connect_timeout))
                    .read_timeout(Duration::from_secs(s.read_timeout))
                    .tls_danger_accept_invalid_certs(true)
                    .build()
                    .map_err(|e| Error::new(ErrorCode::Internal, format!("HTTP client: {e}")))?
            } else {
                client.clone()
            },
        ));
        Ok(Fetcher {
            client,
            retries: s.retries.max(1),
            glance,
        })
    }

    /// The Glance client, for image metadata.
    pub fn glance(&self) -> &Glance {
        &self.glance
    }

    fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(10))
            .with_jitter()
            .with_max_times(self.retries.saturating_sub(1) as usize)
    }

    async fn retrying<T, F, Fut>(&self, op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, Failure>>,
    {
        op.retry(self.backoff())
            .when(|f| matches!(f, Failure::Retry(_)))
            .notify(|f, delay| {
                if let Failure::Retry(e) = f {
                    tracing::warn!(error = %e, ?delay, "source attempt failed, retrying");
                }
            })
            .await
            .map_err(|f| match f {
                Failure::Retry(e) | Failure::Fatal(e) => e,
            })
    }

    /// Asks the source for its metadata (HTTP `HEAD`, file `stat`).
    pub async fn stat(&self, source: &Source) -> Result<SourceStat> {
        match source {
            Source::Glance(id) => {
                let meta = self.glance.image(id).await?;
                Ok(SourceStat {
                    last_modified: meta.updated(),
                    size: meta.size,
                })
            }
            Source::File(path) => {
                let meta = tokio::fs::metadata(path)
                    .await
                    .map_err(|e| Error::io(path.display(), e))?;
                Ok(SourceStat {
                    last_modified: meta.modified().ok(),
                    size: Some(meta.len()),
                })
            }
            Source::Http(url) => {
                self.retrying(|| async {
                    let resp = self
                        .client
                        .head(url.clone())
                        .send()
                        .await
                        .map_err(|e| request_failure(source, e))?;
                    check_status(source, resp.status())?;
                    let header = |name| {
                        resp.headers()
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string)
                    };
                    Ok(SourceStat {
                        last_modified: header(reqwest::header::LAST_MODIFIED)
                            .and_then(|v| httpdate::parse_http_date(&v).ok()),
                        size: header(reqwest::header::CONTENT_LENGTH).and_then(|v| v.parse().ok()),
                    })
                })
                .await
            }
        }
    }

    /// Fetches a small text document (a checksum file), at most 1 MiB.
    pub async fn fetch_text(&self, url: &str) -> Result<String> {
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| Error::new(ErrorCode::InvalidMessage, format!("checksum URL: {e}")))?;
        let source = Source::Http(parsed.clone());
        self.retrying(|| async {
            let resp = self
                .client
                .get(parsed.clone())
                .send()
                .await
                .map_err(|e| request_failure(&source, e))?;
            check_status(&source, resp.status())?;
            if resp.content_length().unwrap_or(0) > 1 << 20 {
                return Err(Failure::Fatal(Error::new(
                    ErrorCode::ChecksumMismatch,
                    "checksum file is larger than 1 MiB",
                )));
            }
            resp.text().await.map_err(|e| request_failure(&source, e))
        })
        .await
    }

    /// Downloads `source` into the new file `dest`, hashing in the same pass.
    /// `room` is called with the announced size before any byte is written
    /// (to check or make free space), `progress` with the bytes received so
    /// far (0 when an attempt starts). On any failure `dest` is removed.
    pub async fn download(
        &self,
        source: &Source,
        dest: &Path,
        hashes: Hashes,
        room: &(dyn Fn(u64) -> Result<()> + Sync),
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(Digests, SourceStat)> {
        let result = self
            .retrying(|| async {
                let _ = crate::fsutil::remove_file_if_exists(dest);
                progress(0);
                match source {
                    Source::File(path) => {
                        Ok(self.copy_file(path, dest, hashes, room, progress).await?)
                    }
                    Source::Http(url) => {
                        let req = self.client.get(url.clone());
                        self.get_http(source, req, dest, hashes, room, progress)
                            .await
                    }
                    Source::Glance(id) => {
                        let req = self.glance.data_request(id).await?;
                        self.get_http(source, req, dest, hashes, room, progress)
                            .await
                    }
                }
            })
            .await;
        if result.is_err() {
            let _ = crate::fsutil::remove_file_if_exists(dest);
        }
        result
    }

    async fn copy_file(
        &self,
        path: &Path,
        dest: &Path,
        hashes: Hashes,
        room: &(dyn Fn(u64) -> Result<()> + Sync),
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(Digests, SourceStat)> {
        let mut file = tokio::fs::File::open(path)
            .await
            .map_err(|e| Error::io(path.display(), e))?;
        let meta = file
            .metadata()
            .await
            .map_err(|e| Error::io(path.display(), e))?;
        room(meta.len())?;
        let mut sink = Sink::create_hashing(dest, hashes)?;
        let mut buf = vec![0u8; crate::sink::CHUNK];
        loop {
            let n = file
                .read(&mut buf)
                .await
                .map_err(|e| Error::io(path.display(), e))?;
            if n == 0 {
                break;
            }
            sink.write(&buf[..n]).await?;
            progress(sink.size());
        }
        let digests = sink.finish().await?;
        Ok((
            digests,
            SourceStat {
                last_modified: meta.modified().ok(),
                size: Some(meta.len()),
            },
        ))
    }

    async fn get_http(
        &self,
        source: &Source,
        req: reqwest::RequestBuilder,
        dest: &Path,
        hashes: Hashes,
        room: &(dyn Fn(u64) -> Result<()> + Sync),
        progress: &(dyn Fn(u64) + Sync),
    ) -> std::result::Result<(Digests, SourceStat), Failure> {
        let resp = req.send().await.map_err(|e| request_failure(source, e))?;
        if let Source::Glance(_) = source
            && resp.status() == reqwest::StatusCode::UNAUTHORIZED
        {
            // The cached token was revoked or expired early: renew, retry.
            self.glance.forget_token().await;
            return Err(Failure::Retry(crate::glance::status_error(
                "Glance",
                "image data",
                401,
            )));
        }
        check_status(source, resp.status())?;
        let stat = SourceStat {
            last_modified: resp
                .headers()
                .get(reqwest::header::LAST_MODIFIED)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| httpdate::parse_http_date(v).ok()),
            size: resp.content_length(),
        };
        if let Some(len) = stat.size {
            room(len)?;
        }
        let mut sink = Sink::create_hashing(dest, hashes)?;
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| request_failure(source, e))?;
            sink.write(&chunk).await?;
            progress(sink.size());
        }
        if let Some(len) = stat.size
            && sink.size() != len
        {
            return Err(Failure::Retry(Error::new(
                ErrorCode::SourceUnreachable,
                format!("{}: got {} of {len} bytes", source.display(), sink.size()),
            )));
        }
        let digests = sink.finish().await?;
        Ok((digests, stat))
    }
}

fn request_failure(source: &Source, e: reqwest::Error) -> Failure {
    let e = e.without_url();
    Failure::Retry(Error::new(
        ErrorCode::SourceUnreachable,
        format!("{}: {}", source.display(), error_chain(&e)),
    ))
}

/// The error and its causes on one line, for messages.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cur = inner.source();
    }
    text
}

fn check_status(source: &Source, status: reqwest::StatusCode) -> std::result::Result<(), Failure> {
    if status.is_success() {
        return Ok(());
    }
    let err = |code| Error::new(code, format!("{} answered {status}", source.display()));
    Err(match status.as_u16() {
        404 | 410 => Failure::Fatal(err(ErrorCode::SourceNotFound)),
        401 | 403 => Failure::Fatal(err(ErrorCode::SourceNotAllowed)),
        408 | 429 | 500..=599 => Failure::Retry(err(ErrorCode::SourceUnreachable)),
        _ => Failure::Fatal(err(ErrorCode::SourceUnreachable)),
    })
}
