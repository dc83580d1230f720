//! Masters fetched from the other workers' peer listeners: one signed GET
//! (`peers::token`) per holder, resumed with `Range` from the same or
//! another holder of the same bytes after a reset or a timeout, never more
//! than the offered size, at `[source]min_rate` at least, as a download
//! is. A holder answering 503 (busy serving others) is asked again after
//! its `Retry-After` (bounded), without counting against it. Peer
//! listeners are reached under the address rules of message URLs
//! (`http_client`), local addresses only where every worker is on one
//! host. The bytes go to the receiver as one attempt (see [`Delivery`]),
//! so they are written and hashed in the same pass as a download's;
//! whether they are the offered bytes is the receiver's to check.

use super::gunzip::Gunzip;
use super::{Delivery, RateCheck, SourceStat, deliver};
use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::peers::token;
use bytes::Bytes;
use futures_util::StreamExt;
use reqwest::header;
use std::time::Duration;
use tokio::sync::mpsc;

/// Failed tries of one holder before it is given up for this transfer.
const STRIKES: u32 = 3;

/// The longest `Retry-After` obeyed (a longer one is taken as this).
const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);

/// How long one transfer waits in all for busy holders before it leaves
/// the master to the source.
const MAX_BUSY_WAIT: Duration = Duration::from_secs(600);

/// A worker offering the master: its peer listener and its host name.
#[derive(Debug, Clone)]
pub struct Holder {
    /// The peer listener's URL, without a trailing slash.
    pub url: String,
    /// The holder's conductor host (for logs).
    pub host: String,
}

/// Why a fetch from a peer failed: the `reason` label of
/// `peer_fetch_failures_total`. The transfer's own reasons come from one
/// request to a holder; the last three from the checks of the bytes received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The holder answered 503: it serves others now.
    Busy,
    /// The holder answered a size other than the master's.
    Size,
    /// Its compressed body did not decompress.
    Corrupt,
    /// Slower than the minimum rate.
    TooSlow,
    /// The body ended before its length.
    Short,
    /// No connection, a reset, a timeout: no fault of the bytes.
    Unreachable,
    /// An unexpected status or content encoding.
    Status,
    /// The holder refused the signature (401, 403).
    Refused,
    /// The holder no longer has the master (404).
    Gone,
    /// The bytes received are not the ones the holder recorded, or not the
    /// request's checksum.
    DigestMismatch,
    /// The bytes received do not inspect as the holder recorded.
    Format,
    /// A download followed while it ran ended with no usable record of
    /// the master on its holder.
    Uncommitted,
}

impl Reason {
    /// The metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Busy => "busy",
            Reason::Size => "size",
            Reason::Corrupt => "corrupt",
            Reason::TooSlow => "too_slow",
            Reason::Short => "short",
            Reason::Unreachable => "unreachable",
            Reason::Status => "status",
            Reason::Refused => "refused",
            Reason::Gone => "gone",
            Reason::DigestMismatch => "digest_mismatch",
            Reason::Format => "format",
            Reason::Uncommitted => "uncommitted",
        }
    }
}

/// The client that fetches masters from peers, with the shared secret.
#[derive(Clone)]
pub struct PeerFetcher {
    client: reqwest::Client,
    secret: std::sync::Arc<Vec<u8>>,
    url_ttl: u64,
    allow_local: bool,
    min_rate: u64,
    min_rate_window: Duration,
}

/// How one GET from a holder ended, short of every byte.
enum Short {
    /// Try this holder again later (reset, timeout, too slow), with the
    /// transport's own error when there was one (refused, TLS, DNS and
    /// timeouts all count as `unreachable` for the metric; the log line
    /// tells them apart).
    Again(Reason, Option<String>),
    /// The holder is busy: come back after this long (no strike).
    Busy(Duration),
    /// This holder cannot serve these bytes.
    Drop(Reason),
    /// The receiver stopped: so does the transfer.
    Stop(Error),
}

impl PeerFetcher {
    /// A client with the `[source]` timeouts, the address rules of
    /// message URLs (see [`PeerFetcher::allow_local`]), no redirects, and
    /// the `[peers]` secret.
    pub fn new(config: &Config) -> Result<PeerFetcher> {
        let allow_local = local_peers_allowed(config);
        let purpose = super::http_client::Purpose::Peer { allow_local };
        // Compressed answers are decoded here, in bounded chunks, and only
        // from the first byte (a resumed transfer is identity).
        let client = super::http_client::build_with(config, purpose, false, |b| {
            b.redirect(reqwest::redirect::Policy::none()).no_gzip()
        })?;
        Ok(PeerFetcher {
            client,
            secret: std::sync::Arc::new(config.peers.load_secret()?),
            url_ttl: config.peers.url_ttl,
            allow_local,
            min_rate: config.source.min_rate,
            min_rate_window: Duration::from_secs(config.source.min_rate_window.max(1)),
        })
    }

    /// Whether a peer listener may be at a local address (a loopback,
    /// link-local or unspecified one): only when this worker's own is
    /// (every worker of the deployment on one host), or with
    /// `[source]allow_local_redirects`.
    pub fn allow_local(&self) -> bool {
        self.allow_local
    }

    /// Streams master `name`, `size` bytes, from `holders` as one attempt:
    /// each holder in turn from the first byte not yet received, a busy or
    /// failing one left for the next, each given up after [`STRIKES`] (or
    /// at once when it refuses or lacks the master). `failed` hears each
    /// failure's reason.
    pub async fn download(
        &self,
        name: &str,
        size: u64,
        holders: &[Holder],
        to: mpsc::Sender<Delivery>,
        failed: &(dyn Fn(&Holder, Reason) + Sync),
    ) -> Result<SourceStat> {
        let stat = SourceStat {
            last_modified: None,
            size: Some(size),
        };
        deliver(&to, Delivery::Attempt(stat.clone())).await?;
        let mut strikes = vec![0u32; holders.len()];
        let mut got = 0u64;
        let mut turn = 0usize;
        let mut busy = Duration::ZERO;
        while got < size {
            let Some(i) = (0..holders.len())
                .map(|k| (turn + k) % holders.len())
                .find(|&i| strikes[i] < STRIKES)
            else {
                return Err(Error::new(
                    ErrorCode::SourceUnreachable,
                    format!("master {name}: no peer could serve it ({got} of {size} bytes)"),
                ));
            };
            let holder = &holders[i];
            match self.get_from(holder, name, size, &mut got, &to).await {
                Ok(()) => {}
                Err(Short::Stop(e)) => return Err(e),
                Err(Short::Again(why, cause)) => {
                    tracing::warn!(
                        holder = %holder.host,
                        url = %crate::secrets::redact_url(&holder.url),
                        master = name,
                        reason = why.as_str(),
                        cause = cause.as_deref().unwrap_or(why.as_str()),
                        "peer transfer broke off; trying again"
                    );
                    failed(holder, why);
                    strikes[i] += 1;
                    turn = i + 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(Short::Busy(after)) => {
                    failed(holder, Reason::Busy);
                    busy += after;
                    if busy > MAX_BUSY_WAIT {
                        return Err(Error::new(
                            ErrorCode::SourceUnreachable,
                            format!(
                                "master {name}: its holders stayed busy for {}s",
                                busy.as_secs()
                            ),
                        ));
                    }
                    turn = i + 1;
                    tokio::time::sleep(after).await;
                }
                Err(Short::Drop(why)) => {
                    failed(holder, why);
                    strikes[i] = STRIKES;
                    turn = i + 1;
                }
            }
        }
        deliver(&to, Delivery::Complete).await?;
        Ok(stat)
    }

    /// The signed GET of master `name` from `holder`, from byte `from` on:
    /// the compressed form accepted from the first byte, identity with
    /// `Range` after it.
    fn request(&self, holder: &Holder, name: &str, from: u64) -> reqwest::RequestBuilder {
        let expires = token::now() + self.url_ttl;
        let path = token::signed_path(&self.secret, name, expires);
        let req = self.client.get(format!("{}{path}", holder.url));
        match from {
            0 => req.header(header::ACCEPT_ENCODING, "gzip"),
            from => req.header(header::RANGE, format!("bytes={from}-")),
        }
    }

    /// One GET from `holder` from byte `got` on, delivering what arrives;
    /// Ok when `size` bytes are in. From the first byte it asks for the
    /// holder's compressed form and decodes it as it arrives
    /// ([`Gunzip`]); a resumed transfer (`Range`) is identity, from the
    /// first decoded byte not yet delivered.
    async fn get_from(
        &self,
        holder: &Holder,
        name: &str,
        size: u64,
        got: &mut u64,
        to: &mpsc::Sender<Delivery>,
    ) -> std::result::Result<(), Short> {
        let resp = self
            .request(holder, name, *got)
            .send()
            .await
            .map_err(unreachable)?;
        let gzip = check_response(&resp, *got, size)?;
        let mut gunzip = gzip.then(Gunzip::new);
        let mut body = resp.bytes_stream();
        let mut rate = RateCheck::new(self.min_rate, self.min_rate_window);
        let mut wire = 0u64;
        let pass = async |bytes: Bytes, got: &mut u64, rate: &mut RateCheck| {
            if *got + bytes.len() as u64 > size {
                return Err(Short::Drop(Reason::Size));
            }
            *got += bytes.len() as u64;
            rate.add(bytes.len() as u64);
            deliver(to, Delivery::Bytes(bytes))
                .await
                .map_err(Short::Stop)
        };
        loop {
            let chunk = match tokio::time::timeout_at(rate.window_end(), body.next()).await {
                Err(_) => None,
                Ok(None) => break,
                Ok(Some(Ok(chunk))) => Some(chunk),
                Ok(Some(Err(e))) => {
                    // Cut: what was decoded is the master's all the same.
                    if let Some(gunzip) = &mut gunzip {
                        pass(gunzip.take_all().into(), got, &mut rate).await?;
                    }
                    return Err(unreachable(e));
                }
            };
            match (chunk, &mut gunzip) {
                (None, _) => {}
                (Some(chunk), None) => pass(chunk, got, &mut rate).await?,
                (Some(chunk), Some(gunzip)) => {
                    wire += chunk.len() as u64;
                    if wire > max_compressed(size) {
                        return Err(Short::Drop(Reason::Size));
                    }
                    let mut input = &chunk[..];
                    while !input.is_empty() {
                        let used = gunzip
                            .feed(input)
                            .map_err(|_| Short::Drop(Reason::Corrupt))?;
                        input = &input[used..];
                        if let Some(out) = gunzip.take() {
                            pass(out.into(), got, &mut rate).await?;
                        }
                    }
                }
            }
            if rate.too_slow().is_some() {
                return Err(Short::Again(Reason::TooSlow, None));
            }
        }
        if let Some(gunzip) = &mut gunzip {
            // A stream cut short leaves `got` short (resumed identity); a
            // wrong trailer with every byte in is the digests' to refuse.
            let last = gunzip.finish().unwrap_or_else(|_| gunzip.take_all());
            pass(last.into(), got, &mut rate).await?;
        }
        match *got == size {
            true => Ok(()),
            false => Err(Short::Again(Reason::Short, None)),
        }
    }
}

/// The most bytes a holder may send for the compressed form of `size`
/// bytes: a holder compresses only what halves at least (by default), so
/// this is far above any real one, and bounds a hostile one.
fn max_compressed(size: u64) -> u64 {
    size + size / 8 + (1 << 20)
}

/// A transport failure: retried, its cause (with the library's own
/// sources: refused, TLS, DNS, timeout) kept for the log line, without the
/// URL (its signature is a credential while it lasts).
fn unreachable(e: reqwest::Error) -> Short {
    Short::Again(
        Reason::Unreachable,
        Some(crate::error::error_chain(&e.without_url())),
    )
}

/// The status and headers a holder must answer for bytes `from..size`:
/// true when the body is their compressed form (asked for from the first
/// byte only), to be decoded.
fn check_response(
    resp: &reqwest::Response,
    from: u64,
    size: u64,
) -> std::result::Result<bool, Short> {
    let status = resp.status().as_u16();
    let coding = resp.headers().get(header::CONTENT_ENCODING);
    let gzip = match coding.map(|c| c.as_bytes().to_ascii_lowercase()) {
        None => false,
        Some(c) if c == b"identity" => false,
        Some(c) if c == b"gzip" && status == 200 && from == 0 => true,
        Some(_) => return Err(Short::Drop(Reason::Status)),
    };
    match status {
        // Its length is bounded as it arrives (`max_compressed`).
        200 if gzip => Ok(true),
        200 if from == 0 => match resp.content_length() {
            Some(len) if len == size => Ok(false),
            _ => Err(Short::Drop(Reason::Size)),
        },
        206 => {
            let range = resp
                .headers()
                .get(header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            let want = format!("bytes {from}-{}/{size}", size.saturating_sub(1));
            match range == want {
                true => Ok(false),
                false => Err(Short::Drop(Reason::Size)),
            }
        }
        503 => Err(Short::Busy(retry_after(resp))),
        401 | 403 => Err(Short::Drop(Reason::Refused)),
        404 => Err(Short::Drop(Reason::Gone)),
        500..=599 => Err(Short::Again(
            Reason::Status,
            Some(resp.status().to_string()),
        )),
        _ => Err(Short::Drop(Reason::Status)),
    }
}

/// How long a busy holder asks to be left alone (`Retry-After` in
/// seconds), between one second and [`MAX_RETRY_AFTER`].
fn retry_after(resp: &reqwest::Response) -> Duration {
    let secs = resp
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(1);
    Duration::from_secs(secs.max(1)).min(MAX_RETRY_AFTER)
}

/// See [`PeerFetcher::allow_local`].
fn local_peers_allowed(config: &Config) -> bool {
    let own = config
        .peers
        .advertised_url()
        .and_then(|u| crate::config::listener_url(&u));
    config.source.allow_local_redirects
        || own.is_some_and(|u| super::http_client::is_local_host(&u))
}
