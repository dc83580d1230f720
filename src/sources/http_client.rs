//! The HTTP client shared by image sources, checksum files, Glance and
//! Keystone, and the limits every fetch of a URL from the queue obeys:
//! bounded redirects (count, scheme, and by default never to this host's
//! loopback or link-local addresses, where the metrics port listens) and
//! bounded bodies for everything read into memory.

use crate::config::SourceSection;
use crate::error::{Error, ErrorCode, Result};
use futures_util::StreamExt;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

/// Largest checksum file read (Ironic's own limit is of the same order).
pub(crate) const MAX_CHECKSUM_FILE: usize = 1 << 20;

/// Largest JSON document read from Glance or Keystone (a token with a big
/// service catalog is a few hundred KiB).
pub(crate) const MAX_JSON_BODY: usize = 8 << 20;

/// Why a redirect was not followed; found again in the reqwest error's
/// sources to answer `source_not_allowed`.
#[derive(Debug)]
pub(crate) struct RedirectRefused(String);

impl std::fmt::Display for RedirectRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RedirectRefused {}

/// Builds a client with the `[source]` timeouts and redirect policy;
/// `accept_invalid_certs` skips TLS verification.
pub(crate) fn build(s: &SourceSection, accept_invalid_certs: bool) -> Result<reqwest::Client> {
    let max = s.max_redirects as usize;
    let allow_local = s.allow_local_redirects;
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        let url = attempt.url();
        let refuse = if attempt.previous().len() > max {
            Some(format!("more than {max} redirects ([source]max_redirects)"))
        } else if !matches!(url.scheme(), "http" | "https") {
            Some(format!(
                "redirect to scheme {:?} refused (only http and https)",
                url.scheme()
            ))
        } else if !allow_local && is_local_host(url) {
            Some(format!(
                "redirect to the local address {} refused ([source]allow_local_redirects)",
                url.host_str().unwrap_or_default()
            ))
        } else {
            None
        };
        match refuse {
            Some(why) => attempt.error(RedirectRefused(why)),
            None => attempt.follow(),
        }
    });
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(s.connect_timeout))
        .read_timeout(Duration::from_secs(s.read_timeout))
        .tls_danger_accept_invalid_certs(accept_invalid_certs)
        .redirect(policy)
        .user_agent(concat!("ironic-image-worker/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| Error::new(ErrorCode::Internal, format!("HTTP client: {e}")))
}

/// True for loopback, link-local and unspecified addresses (and the
/// `localhost` names): targets a source must not redirect the worker to.
pub(crate) fn is_local_host(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return true;
    };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<IpAddr>() {
        Ok(ip) => is_local_ip(ip),
        Err(_) => {
            let name = bare.trim_end_matches('.').to_ascii_lowercase();
            name == "localhost" || name.ends_with(".localhost")
        }
    }
}

fn is_local_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified(),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_local_ip(IpAddr::V4(v4));
            }
            v6.is_loopback() || v6.is_unspecified() || is_unicast_link_local(v6)
        }
    }
}

fn is_unicast_link_local(ip: Ipv6Addr) -> bool {
    ip.segments()[0] & 0xffc0 == 0xfe80
}

/// The redirect refusal among the sources of `e`, if that is why it failed.
pub(crate) fn redirect_refusal(e: &reqwest::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<RedirectRefused>() {
            return Some(r.0.clone());
        }
        cur = err.source();
    }
    None
}

/// Why a bounded body could not be read.
pub(crate) enum BodyError {
    /// The body is larger than the limit (announced or as it streamed).
    TooLarge,
    /// The transfer broke off.
    Transport(reqwest::Error),
}

/// Reads a response body of at most `limit` bytes, refusing a larger
/// announced length at once and stopping a longer stream as soon as it
/// passes the limit: memory stays bounded whatever the server sends.
pub(crate) async fn read_limited(
    resp: reqwest::Response,
    limit: usize,
) -> std::result::Result<Vec<u8>, BodyError> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(BodyError::Transport)?;
        if body.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Reads a JSON document of Glance or Keystone (`service`), bounded by
/// [`MAX_JSON_BODY`].
pub(crate) async fn read_json<T: serde::de::DeserializeOwned>(
    resp: reqwest::Response,
    service: &str,
) -> Result<T> {
    let body = match read_limited(resp, MAX_JSON_BODY).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            return Err(Error::new(
                ErrorCode::SourceUnreachable,
                format!(
                    "{service} answered a document larger than {} MiB",
                    MAX_JSON_BODY >> 20
                ),
            ));
        }
        Err(BodyError::Transport(e)) => {
            return Err(Error::new(
                ErrorCode::SourceUnreachable,
                format!("{service}: {}", crate::error::error_chain(&e.without_url())),
            ));
        }
    };
    serde_json::from_slice(&body).map_err(|e| {
        Error::new(
            ErrorCode::SourceUnreachable,
            format!("{service}: unreadable answer: {e}"),
        )
    })
}
