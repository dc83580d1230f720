//! Image sources: where the bytes of an image come from (`http(s)://` with
//! reqwest, streamed; `file://` under the allowed paths, opened once; Glance
//! image ids through the Image API, see `glance`), with bounded retries, a
//! minimum rate and a deadline per download, and the metadata Ironic uses to
//! revalidate a cached copy.
//!
//! # This folder
//!
//! Holds `http(s)://` sources and the download loop every source shares
//! (this module), `file://` sources opened beneath an allowed directory
//! (`file`), the shared HTTP client with its redirect policy and bounded
//! body reads (`http_client`), Glance with its Keystone token (`glance`),
//! OCI registries: references, credentials and the artifact choice (`oci`),
//! their HTTP side (`oci_registry`, its authentication as values in
//! `oci_registry/auth`), and masters from peers (`peer`, decoding a
//! compressed answer: `gunzip`). Must not know the cache layout or
//! conversion.

mod file;
pub(crate) mod glance;
mod gunzip;
pub(crate) mod http_client;
pub(crate) mod oci;
pub(crate) mod oci_registry;
pub mod peer;

pub use file::FileSource;

use crate::config::Config;
use crate::error::{Error, ErrorCode, Result, error_chain};
use crate::secrets::redact_url;
use crate::sources::glance::Glance;
use backon::{ExponentialBuilder, Retryable};
use futures_util::StreamExt;
use http_client::{BodyError, Purpose};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;

use crate::messages::MAX_URL_LEN;

/// A parsed `image_source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An `http://` or `https://` URL.
    Http(reqwest::Url),
    /// A local regular file under `[conductor]file_url_allowed_paths`,
    /// already open: it is read from this descriptor, never opened again by
    /// path (a symlink swapped in later changes nothing).
    File(FileSource),
    /// A Glance image id, fetched through the Image API.
    Glance(String),
    /// An `oci://` reference, to be resolved to a blob
    /// ([`Fetcher::resolve_oci`]) before anything is fetched.
    Oci(oci::OciRef),
    /// The blob an `oci://` reference resolved to.
    OciBlob(oci_registry::OciBlob),
}

impl PartialEq for oci_registry::OciBlob {
    fn eq(&self, other: &Self) -> bool {
        self.url == other.url && self.digest == other.digest
    }
}

impl Eq for oci_registry::OciBlob {}

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
    min_rate: u64,
    min_rate_window: Duration,
    deadline: Option<Duration>,
    /// Whole-request limit for small documents (checksum files, HEAD).
    small_timeout: Duration,
    glance: Arc<Glance>,
    oci: Arc<oci_registry::Registry>,
    /// `[deploy]image_server_*`: the credentials of the user's image
    /// servers, and the hosts they may go to.
    image_servers: crate::config::DeploySection,
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

/// The image id when `href` names a Glance image (`<uuid>` or `glance://<uuid>`).
fn glance_id(href: &str) -> Option<String> {
    let id = href.strip_prefix("glance://").unwrap_or(href);
    uuid::Uuid::try_parse(id)
        .ok()
        .filter(|_| id.len() == 36)
        .map(|u| u.to_string())
}

impl Source {
    /// Parses `href`, refusing schemes the worker cannot fetch and `file://`
    /// paths outside the allowed directories or that are not regular files.
    pub fn parse(href: &str, file_url_allowed_paths: &[std::path::PathBuf]) -> Result<Source> {
        if href.len() > MAX_URL_LEN {
            return Err(Error::new(
                ErrorCode::InvalidMessage,
                format!(
                    "image_source is {} bytes long, more than {MAX_URL_LEN}",
                    href.len()
                ),
            ));
        }
        if let Some(id) = glance_id(href) {
            return Ok(Source::Glance(id));
        }
        if href.starts_with("oci://") {
            return Ok(Source::Oci(oci::OciRef::parse(href)?));
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
                    Error::new(
                        ErrorCode::InvalidMessage,
                        format!("bad file URL {:?}", redact_url(href)),
                    )
                })?;
                Ok(Source::File(file::open_allowed(
                    &path,
                    file_url_allowed_paths,
                )?))
            }
            other => Err(Error::new(
                ErrorCode::SourceNotAllowed,
                format!("image_source scheme {other:?} is not supported (http, https, file, oci)"),
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
            Source::File(f) => f
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            Source::Glance(id) => id.clone(),
            Source::Oci(r) => r.repo.rsplit('/').next().unwrap_or_default().to_string(),
            Source::OciBlob(b) => b.digest.hex.clone(),
        }
    }

    /// The source for log and error messages (credentials masked).
    pub fn display(&self) -> String {
        match self {
            Source::Http(url) => redact_url(url.as_str()),
            Source::File(f) => format!("file://{}", f.path.display()),
            Source::Glance(id) => format!("glance://{id}"),
            Source::Oci(r) => r.display(),
            Source::OciBlob(b) => b.display(),
        }
    }
}

impl Fetcher {
    /// Builds the shared client from `[source]`.
    pub fn new(config: &Config) -> Result<Fetcher> {
        let s = &config.source;
        let insecure_sources = config.source_tls() == crate::config::SourceTls::Insecure;
        let client = http_client::build(config, Purpose::Message, insecure_sources)?;
        let (connect, read) = config.source_timeouts();
        let small_timeout = Duration::from_secs(connect.saturating_add(read));
        let insecure = config.glance.insecure || !s.verify_tls;
        let glance = Arc::new(Glance::new(
            config.glance.clone(),
            http_client::build(config, Purpose::Operator, insecure)?,
            small_timeout,
        ));
        let secs = |n: u64| (n > 0).then(|| Duration::from_secs(n));
        Ok(Fetcher {
            client,
            retries: s.retries,
            min_rate: s.min_rate,
            min_rate_window: Duration::from_secs(s.min_rate_window.max(1)),
            deadline: secs(s.download_deadline),
            small_timeout,
            glance,
            oci: Arc::new(oci_registry::Registry::new(config)?),
            image_servers: config.deploy.clone(),
        })
    }

    /// A request to the http(s) source `url`, with the credentials of the
    /// user's image servers when they may go to its host (as Ironic 39
    /// sends them; reqwest drops them on a redirect to another host).
    fn to_source(&self, method: reqwest::Method, url: &reqwest::Url) -> reqwest::RequestBuilder {
        let req = self.client.request(method, url.clone());
        match self.image_servers.source_credentials(url.as_str()) {
            Some((user, password)) => req.basic_auth(user, Some(password)),
            None => req,
        }
    }

    /// The Glance client, for image metadata.
    pub fn glance(&self) -> &Glance {
        &self.glance
    }

    /// Resolves an `oci://` reference to its blob (see
    /// [`oci_registry::Registry`]), retrying what may pass (timeouts, 5xx).
    pub async fn resolve_oci(
        &self,
        r: &oci::OciRef,
        credential: Option<oci::Credential>,
        local: bool,
        cpu_arch: Option<&str>,
    ) -> Result<oci_registry::Resolved> {
        // Without a pull secret, the image servers' credentials when they
        // may go to this registry (Ironic 39's fallback, before
        // `[oci]authentication_config`).
        let credential = credential.or_else(|| {
            let href = format!("oci://{}/{}", r.registry, r.repo);
            self.image_servers
                .oci_fallback_credentials(&href)
                .map(|(user, password)| oci::Credential::from_secret(&format!("{user}:{password}")))
        });
        self.retrying(|| self.oci.resolve(r, credential.clone(), local, cpu_arch))
            .await
    }

    fn backoff(&self) -> ExponentialBuilder {
        crate::retry::jittered(
            Duration::from_millis(200),
            Duration::from_secs(10),
            Some(self.retries as usize),
        )
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
            Source::Oci(_) => Err(unresolved(source)),
            Source::OciBlob(b) => Ok(SourceStat {
                last_modified: None,
                size: Some(b.size),
            }),
            Source::Glance(id) => {
                let meta = self.glance.image(id).await?;
                Ok(SourceStat {
                    last_modified: meta.updated(),
                    size: meta.size,
                })
            }
            Source::File(f) => f.stat(),
            Source::Http(url) => {
                self.retrying(|| async {
                    let resp = self
                        .to_source(reqwest::Method::HEAD, url)
                        .timeout(self.small_timeout)
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

    /// Fetches a checksum file: at most [`http_client::MAX_CHECKSUM_FILE`]
    /// bytes, whether announced or streamed without a length (a larger
    /// document is no checksum file: `invalid_message`, the request's
    /// checksum reference is wrong).
    pub async fn fetch_text(&self, url: &str) -> Result<String> {
        if url.len() > MAX_URL_LEN {
            return Err(Error::new(
                ErrorCode::InvalidMessage,
                format!("checksum URL is longer than {MAX_URL_LEN} bytes"),
            ));
        }
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| Error::new(ErrorCode::InvalidMessage, format!("checksum URL: {e}")))?;
        let source = Source::Http(parsed.clone());
        self.retrying(|| async {
            let resp = self
                .to_source(reqwest::Method::GET, &parsed)
                .timeout(self.small_timeout)
                .send()
                .await
                .map_err(|e| request_failure(&source, e))?;
            check_status(&source, resp.status())?;
            let limit = http_client::MAX_CHECKSUM_FILE;
            match http_client::read_limited(resp, limit).await {
                Ok(body) => Ok(String::from_utf8_lossy(&body).into_owned()),
                Err(BodyError::TooLarge) => Err(Failure::Fatal(Error::new(
                    ErrorCode::InvalidMessage,
                    format!(
                        "checksum file {} is larger than {} MiB: not a checksum file",
                        source.display(),
                        limit >> 20
                    ),
                ))),
                Err(BodyError::Transport(e)) => Err(request_failure(&source, e)),
            }
        })
        .await
    }

    /// Streams `source` to `to`, attempt by attempt: each attempt begins
    /// with [`Delivery::Attempt`] (everything delivered before it is void),
    /// then its bytes, and the one that got every byte ends with
    /// [`Delivery::Complete`]; then the download returns what the source
    /// said of it. Every attempt must keep `[source]min_rate`, and all
    /// attempts together end within `[source]download_deadline`. When the
    /// receiver goes away the download stops (its error is the receiver's
    /// to tell).
    pub async fn download(
        &self,
        source: &Source,
        to: mpsc::Sender<Delivery>,
    ) -> Result<SourceStat> {
        let to = &to;
        let attempts = self.retrying(|| async move {
            match source {
                Source::File(f) => Ok(f.stream(to).await?),
                Source::Http(url) => {
                    let req = self.to_source(reqwest::Method::GET, url);
                    self.get_http(source, req, to).await
                }
                Source::Glance(id) => {
                    let req = self.glance.data_request(id).await?;
                    self.get_http(source, req, to).await
                }
                Source::OciBlob(b) => {
                    let resp = self.oci.blob_response(b, source).await?;
                    self.stream_response(source, resp, to).await
                }
                Source::Oci(_) => Err(Failure::Fatal(unresolved(source))),
            }
        });
        match self.deadline {
            None => attempts.await,
            Some(limit) => match tokio::time::timeout(limit, attempts).await {
                Ok(r) => r,
                Err(_) => Err(Error::new(
                    ErrorCode::SourceUnreachable,
                    format!(
                        "{}: download deadline of {}s passed ([source]download_deadline)",
                        source.display(),
                        limit.as_secs()
                    ),
                )),
            },
        }
    }

    async fn get_http(
        &self,
        source: &Source,
        req: reqwest::RequestBuilder,
        to: &mpsc::Sender<Delivery>,
    ) -> std::result::Result<SourceStat, Failure> {
        let resp = req.send().await.map_err(|e| request_failure(source, e))?;
        if let Source::Glance(_) = source
            && resp.status() == reqwest::StatusCode::UNAUTHORIZED
        {
            // The cached token was revoked or expired early: renew, retry.
            self.glance.forget_token().await;
            return Err(Failure::Retry(crate::sources::glance::status_error(
                "Glance",
                "image data",
                401,
            )));
        }
        check_status(source, resp.status())?;
        self.stream_response(source, resp, to).await
    }

    /// Streams a successful response's body as one attempt.
    async fn stream_response(
        &self,
        source: &Source,
        resp: reqwest::Response,
        to: &mpsc::Sender<Delivery>,
    ) -> std::result::Result<SourceStat, Failure> {
        let stat = SourceStat {
            last_modified: resp
                .headers()
                .get(reqwest::header::LAST_MODIFIED)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| httpdate::parse_http_date(v).ok()),
            size: resp.content_length(),
        };
        deliver(to, Delivery::Attempt(stat.clone())).await?;
        let mut body = resp.bytes_stream();
        let mut rate = RateCheck::new(self.min_rate, self.min_rate_window);
        let mut got = 0u64;
        loop {
            let next = tokio::time::timeout_at(rate.window_end(), body.next()).await;
            match next {
                Err(_) => {}
                Ok(None) => break,
                Ok(Some(chunk)) => {
                    let chunk = chunk.map_err(|e| request_failure(source, e))?;
                    rate.add(chunk.len() as u64);
                    got += chunk.len() as u64;
                    deliver(to, Delivery::Bytes(chunk)).await?;
                }
            }
            if let Some(got) = rate.too_slow() {
                return Err(Failure::Retry(Error::new(
                    ErrorCode::SourceUnreachable,
                    format!(
                        "{}: too slow: {got} bytes in the last {}s, [source]min_rate is {} bytes/s",
                        source.display(),
                        self.min_rate_window.as_secs(),
                        self.min_rate
                    ),
                )));
            }
        }
        if let Some(len) = stat.size
            && got != len
        {
            return Err(Failure::Retry(Error::new(
                ErrorCode::SourceUnreachable,
                format!("{}: got {got} of {len} bytes", source.display()),
            )));
        }
        deliver(to, Delivery::Complete).await?;
        Ok(stat)
    }
}

/// What a download hands its receiver, in this order per attempt.
#[derive(Debug)]
pub enum Delivery {
    /// An attempt begins, with what the source said of it: bytes delivered
    /// before are void (the receiver owns each attempt's file).
    Attempt(SourceStat),
    /// The next bytes of the current attempt.
    Bytes(bytes::Bytes),
    /// The current attempt got every byte: nothing more follows.
    Complete,
}

/// The error of an `oci://` reference used before it was resolved (a bug).
fn unresolved(source: &Source) -> Error {
    Error::new(
        ErrorCode::Internal,
        format!(
            "{}: OCI reference used before it was resolved",
            source.display()
        ),
    )
}

/// The error of a download whose receiver went away (it reports its own).
fn receiver_gone() -> Error {
    Error::new(ErrorCode::Internal, "the download's receiver stopped")
}

async fn deliver(to: &mpsc::Sender<Delivery>, piece: Delivery) -> Result<()> {
    to.send(piece).await.map_err(|_| receiver_gone())
}

/// The minimum-rate rule of a download: in every window of
/// `[source]min_rate_window` seconds at least `min_rate` bytes per second
/// must arrive (a source trickling a byte now and then never trips the
/// read timeout, but would hold a worker slot for ever).
struct RateCheck {
    min_bytes: u64,
    window: Duration,
    started: tokio::time::Instant,
    got: u64,
}

impl RateCheck {
    fn new(min_rate: u64, window: Duration) -> RateCheck {
        RateCheck {
            min_bytes: min_rate.saturating_mul(window.as_secs()),
            window,
            started: tokio::time::Instant::now(),
            got: 0,
        }
    }

    /// When the current window ends (far away without a limit).
    fn window_end(&self) -> tokio::time::Instant {
        if self.min_bytes == 0 {
            self.started + Duration::from_secs(86400 * 365)
        } else {
            self.started + self.window
        }
    }

    fn add(&mut self, n: u64) {
        self.got = self.got.saturating_add(n);
    }

    /// At the end of a window: the bytes it got if too few; then a new
    /// window starts.
    fn too_slow(&mut self) -> Option<u64> {
        if self.min_bytes == 0 || tokio::time::Instant::now() < self.window_end() {
            return None;
        }
        let got = self.got;
        self.started = tokio::time::Instant::now();
        self.got = 0;
        (got < self.min_bytes).then_some(got)
    }
}

fn request_failure(source: &Source, e: reqwest::Error) -> Failure {
    if let Some(why) = http_client::refusal(&e) {
        return Failure::Fatal(Error::new(
            ErrorCode::SourceNotAllowed,
            format!("{}: {why}", source.display()),
        ));
    }
    if e.is_builder() {
        return Failure::Fatal(Error::new(
            ErrorCode::InvalidMessage,
            format!("{}: not a usable URL", source.display()),
        ));
    }
    let e = e.without_url();
    Failure::Retry(Error::new(
        ErrorCode::SourceUnreachable,
        format!("{}: {}", source.display(), error_chain(&e)),
    ))
}

fn check_status(source: &Source, status: reqwest::StatusCode) -> std::result::Result<(), Failure> {
    if status.is_success() {
        return Ok(());
    }
    if status.is_redirection() {
        // A redirect reqwest could not follow (a Location that is no http(s)
        // URL, such as file://).
        return Err(Failure::Fatal(Error::new(
            ErrorCode::SourceNotAllowed,
            format!(
                "{} answered {status} with a redirect that is not followed (only http and https)",
                source.display()
            ),
        )));
    }
    let err = Error::new(
        crate::error::http_status_code(status.as_u16()),
        format!("{} answered {status}", source.display()),
    );
    Err(match status.as_u16() {
        408 | 429 | 500..=599 => Failure::Retry(err),
        _ => Failure::Fatal(err),
    })
}
