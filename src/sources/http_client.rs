//! The HTTP client shared by image sources, checksum files, Glance and
//! Keystone, and the limits every fetch of a URL from the queue obeys:
//! bounded redirects (count, scheme), bounded bodies for everything read
//! into memory, and the addresses a URL from a message may reach (checked
//! on the addresses actually connected, so neither a redirect nor a DNS
//! answer changed between two lookups gets round it):
//!
//! * never one of the worker's own listening sockets (the image server and
//!   the metrics listener), whatever `[source]allow_local_redirects` says;
//! * by default never a loopback, link-local or unspecified address, unless
//!   the message's URL names it itself (an IP literal or a `localhost`
//!   name): a redirect to one is refused, and so is a host name that
//!   resolves only to such addresses (they are dropped from its answer).

use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use futures_util::StreamExt;
use hyper_util::client::legacy::connect::{Connection, HttpInfo};
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

/// Largest checksum file read (Ironic's own limit is of the same order).
pub(crate) const MAX_CHECKSUM_FILE: usize = 1 << 20;

/// Largest JSON document read from Glance or Keystone (a token with a big
/// service catalog is a few hundred KiB).
pub(crate) const MAX_JSON_BODY: usize = 8 << 20;

/// Why a connection or a redirect on a message's behalf was refused; found
/// again in the reqwest error's sources to answer `source_not_allowed`.
#[derive(Debug)]
pub(crate) struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// Whom a client fetches for, which decides the addresses it may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// URLs that come from messages (image sources, checksum files): held to
    /// the address rules of this module.
    Message,
    /// Endpoints the operator configured (Glance, Keystone), which may well
    /// be on this host: no address rule.
    Operator,
    /// The other workers' peer listeners, named by their (sealed) offers:
    /// the operator's timeouts, and the address rules of this module, local
    /// addresses allowed only when `allow_local` (see `sources::peer`).
    Peer {
        /// Whether names may resolve to local addresses.
        allow_local: bool,
    },
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Builds a client with the `[source]` timeouts and redirect policy, and
/// for [`Purpose::Message`] the address rules; `accept_invalid_certs` skips
/// TLS verification.
pub(crate) fn build(
    config: &Config,
    purpose: Purpose,
    accept_invalid_certs: bool,
) -> Result<reqwest::Client> {
    build_with(config, purpose, accept_invalid_certs, |b| b)
}

/// [`build`], with `customize` applied to the builder last (the OCI client
/// follows redirects itself and may trust its own CA bundle).
pub(crate) fn build_with(
    config: &Config,
    purpose: Purpose,
    accept_invalid_certs: bool,
    customize: impl FnOnce(reqwest::ClientBuilder) -> reqwest::ClientBuilder,
) -> Result<reqwest::Client> {
    let s = &config.source;
    // Message URLs follow Ironic's `[DEFAULT]webserver_*` options when set.
    let (connect, read) = match purpose {
        Purpose::Message => config.source_timeouts(),
        Purpose::Operator | Purpose::Peer { .. } => (s.connect_timeout, s.read_timeout),
    };
    let mut builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(connect))
        .read_timeout(Duration::from_secs(read))
        .tls_danger_accept_invalid_certs(accept_invalid_certs)
        .redirect(redirect_policy(s.max_redirects, s.allow_local_redirects))
        .user_agent(concat!("ironic-image-worker/", env!("CARGO_PKG_VERSION")));
    if purpose == Purpose::Message
        && let crate::config::SourceTls::Bundle(path) = config.source_tls()
    {
        builder = builder.tls_certs_only(ca_bundle(&path)?);
    }
    let rules = match purpose {
        Purpose::Message => Some(s.allow_local_redirects),
        Purpose::Peer { allow_local } => Some(allow_local),
        Purpose::Operator => None,
    };
    if let Some(allow_local) = rules {
        for addr in [config.http.listen, config.metrics.listen] {
            note_listener(addr);
        }
        builder = builder
            .dns_resolver(Arc::new(FilteringResolver { allow_local }))
            .connector_layer(OwnListenerGuard);
    }
    customize(builder)
        .build()
        .map_err(|e| Error::new(ErrorCode::Internal, format!("HTTP client: {e}")))
}

/// The certificates of a PEM CA bundle (`[DEFAULT]webserver_verify_ca`).
fn ca_bundle(path: &std::path::Path) -> Result<Vec<reqwest::Certificate>> {
    let bad = |why: String| {
        Error::new(
            ErrorCode::Internal,
            format!(
                "configuration: [DEFAULT]webserver_verify_ca {}: {why}",
                path.display()
            ),
        )
    };
    let pem = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// Redirects: at most `max`, only to http(s), and (unless `allow_local`) not
/// to a URL naming a local address itself; where a redirect's host name
/// leads is the resolver's and the connection guard's to check.
fn redirect_policy(max: u32, allow_local: bool) -> reqwest::redirect::Policy {
    let max = max as usize;
    reqwest::redirect::Policy::custom(move |attempt| {
        let url = attempt.url();
        if attempt.previous().len() > max {
            let why = format!("more than {max} redirects ([source]max_redirects)");
            return attempt.error(Refused(why));
        }
        match check_followed(url, allow_local, "redirect") {
            Err(refused) => attempt.error(refused),
            Ok(()) => attempt.follow(),
        }
    })
}

/// The one address rule for a URL that a connection made on a message's
/// behalf is led to but that the message did not name itself: a
/// redirect's `Location`, an OCI registry's token `realm`, a blob's CDN, a
/// peer's listener (`what` says which, for the refusal). It must be http(s)
/// and, unless `allow_local` (`[source]allow_local_redirects`), must not name
/// a loopback, link-local or unspecified address itself: an IP literal never
/// reaches the resolver, so this is where it is held to the rule. A host name
/// is held to it by the resolver of the message client, and the worker's
/// own listeners are refused by its connector, whatever this says.
pub(crate) fn check_followed(
    url: &reqwest::Url,
    allow_local: bool,
    what: &str,
) -> std::result::Result<(), Refused> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Refused(format!(
            "{what} to scheme {:?} refused (only http and https)",
            url.scheme()
        )));
    }
    if !allow_local && is_local_host(url) {
        return Err(Refused(format!(
            "{what} to the local address {} refused ([source]allow_local_redirects)",
            url.host_str().unwrap_or_default()
        )));
    }
    Ok(())
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
        Err(_) => is_localhost_name(bare),
    }
}

/// `localhost` and the names under it, which name this host by definition.
fn is_localhost_name(name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
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

/// Resolves host names for message URLs, dropping the loopback, link-local
/// and unspecified addresses from the answer (unless allowed, or the name is
/// a `localhost` name) and failing with [`Refused`] when none is left. It
/// runs for every connection reqwest opens to a name, redirects included,
/// and its answer is the one connected to.
struct FilteringResolver {
    allow_local: bool,
}

impl reqwest::dns::Resolve for FilteringResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        let allow_local = self.allow_local || is_localhost_name(&host);
        Box::pin(async move {
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let kept: Vec<SocketAddr> = all
                .iter()
                .copied()
                .filter(|a| allow_local || !is_local_ip(a.ip()))
                .collect();
            if kept.is_empty() && !all.is_empty() {
                let err: BoxError = Box::new(Refused(format!(
                    "{host} resolves only to local addresses ({}), refused \
                     ([source]allow_local_redirects)",
                    all[0].ip()
                )));
                return Err(err);
            }
            Ok(Box::new(kept.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The worker's own listening sockets: the configured ones and those bound
/// by this process (a configured port 0 becomes a real one). Process-wide,
/// as the sockets are.
static OWN_LISTENERS: RwLock<Vec<SocketAddr>> = RwLock::new(Vec::new());

/// Records `addr` as one of the worker's own listening sockets, which no
/// connection on a message's behalf may reach.
pub(crate) fn note_listener(addr: SocketAddr) {
    if addr.port() == 0 {
        return;
    }
    let mut all = OWN_LISTENERS.write().unwrap_or_else(|e| e.into_inner());
    if !all.contains(&addr) {
        all.push(addr);
    }
}

/// True when a connection to `peer` would reach one of the worker's own
/// listening sockets: the same address and port, or the port of a
/// wildcard listener (`0.0.0.0`, `[::]`, which also takes IPv4) on an
/// address of this host.
fn is_own_listener(peer: SocketAddr) -> bool {
    let ip = canonical(peer.ip());
    let all = OWN_LISTENERS.read().unwrap_or_else(|e| e.into_inner());
    all.iter().any(|l| {
        if l.port() != peer.port() {
            return false;
        }
        let lip = canonical(l.ip());
        if lip == ip {
            return true;
        }
        let family_served = match lip {
            IpAddr::V4(_) => ip.is_ipv4(),
            IpAddr::V6(_) => true,
        };
        lip.is_unspecified() && family_served && is_this_host(ip)
    })
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Whether `ip` is an address of this host: loopback, unspecified, or one
/// a socket can be bound to (the kernel's own list of local addresses).
fn is_this_host(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// A connector layer that refuses a connection whose peer is one of the
/// worker's own listening sockets, after it is made and before a byte of
/// the request is sent: it sees the address actually connected, whether the
/// URL named an IP literal or a host name.
#[derive(Clone)]
struct OwnListenerGuard;

impl<S> tower::Layer<S> for OwnListenerGuard {
    type Service = Guarded<S>;

    fn layer(&self, inner: S) -> Guarded<S> {
        Guarded { inner }
    }
}

/// The connector service wrapped by [`OwnListenerGuard`].
#[derive(Clone)]
struct Guarded<S> {
    inner: S,
}

impl<S, R> tower::Service<R> for Guarded<S>
where
    S: tower::Service<R, Error = BoxError>,
    S::Response: Connection + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = std::result::Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        let connecting = self.inner.call(req);
        Box::pin(async move {
            let conn = connecting.await?;
            let mut extras = hyper::http::Extensions::new();
            conn.connected().get_extras(&mut extras);
            let Some(peer) = extras.get::<HttpInfo>().map(HttpInfo::remote_addr) else {
                let err: BoxError = Box::new(std::io::Error::other(
                    "connection closed before its peer address was known",
                ));
                return Err(err);
            };
            if is_own_listener(peer) {
                let err: BoxError = Box::new(Refused(format!(
                    "{peer} is one of the worker's own listening sockets, never a source"
                )));
                return Err(err);
            }
            Ok(conn)
        })
    }
}

/// The refusal (of a redirect or of an address) among the sources of `e`,
/// if that is why it failed.
pub(crate) fn refusal(e: &reqwest::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<Refused>() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_listeners_are_matched_by_address_and_wildcard() {
        note_listener("127.0.0.1:61001".parse().unwrap());
        note_listener("0.0.0.0:61002".parse().unwrap());
        note_listener("[::]:61003".parse().unwrap());
        let own = |s: &str| is_own_listener(s.parse().unwrap());
        assert!(own("127.0.0.1:61001"));
        assert!(own("[::ffff:127.0.0.1]:61001"));
        assert!(!own("127.0.0.2:61001"), "another loopback address");
        assert!(!own("127.0.0.1:61004"), "another port");
        assert!(own("127.0.0.1:61002"), "a wildcard listener takes loopback");
        assert!(own("127.0.0.1:61003"), "[::] takes IPv4 too");
        assert!(!own("192.0.2.1:61002"), "not an address of this host");
    }

    #[test]
    fn localhost_names_and_local_literals() {
        let local = |u: &str| is_local_host(&reqwest::Url::parse(u).unwrap());
        assert!(local("http://LOCALHOST./x"));
        assert!(local("http://a.localhost/x"));
        assert!(local("http://[::1]/x"));
        assert!(local("http://169.254.169.254/x"));
        assert!(!local("http://192.0.2.1/x"));
    }
}
