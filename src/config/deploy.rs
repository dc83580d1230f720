//! `[deploy]`: where the published symlinks live, the URL nodes reach
//! them under, and the credentials of the user's image servers (Ironic's
//! own names and meaning).

use super::check::Report;
use super::choice::AuthStrategy;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `http_root` of a worker configured by its own file without an
/// ironic.conf (with one, Ironic's own `http_root` is shared).
pub const SYSTEM_HTTP_ROOT: &str = "/var/lib/ironic-image-worker/httpboot";

/// `[deploy]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeploySection {
    /// Root directory served over HTTP.
    pub http_root: PathBuf,
    /// Base URL under which `http_root` is reachable by the nodes.
    pub http_url: String,
    /// Subdirectory of `http_root` holding the per-node symlinks.
    pub http_image_subdir: String,
    // The credentials of the user's image servers, as Ironic 39 reads
    // them: sent with the downloads of http(s) sources (and as the
    // fallback credential of an OCI registry) to the hosts they are
    // permitted for. Not the worker's own image port: `[http]auth_*`.
    /// `noauth` or `http_basic`.
    pub image_server_auth_strategy: AuthStrategy,
    /// User name of `http_basic`.
    pub image_server_user: String,
    /// Password of `http_basic` (never logged).
    pub image_server_password: String,
    /// Hosts the credentials may be sent to (`.example.com` matches its
    /// subdomains); empty: see `image_server_auth_permit_unknown_hosts`.
    #[serde(deserialize_with = "super::value::list_opt")]
    pub image_server_auth_hosts: Vec<String>,
    /// With no `image_server_auth_hosts`: send the credentials to every
    /// host (true, Ironic 39's default) or to none.
    pub image_server_auth_permit_unknown_hosts: bool,
}

impl Default for DeploySection {
    fn default() -> Self {
        DeploySection {
            http_root: super::default_state_dir().join("httpboot"),
            http_url: String::new(),
            http_image_subdir: "agent_images".into(),
            image_server_auth_strategy: AuthStrategy::NoAuth,
            image_server_user: String::new(),
            image_server_password: String::new(),
            image_server_auth_hosts: Vec::new(),
            image_server_auth_permit_unknown_hosts: true,
        }
    }
}

impl DeploySection {
    /// A plain directory name for the symlinks, and the credentials
    /// `http_basic` needs.
    pub(super) fn check(&self, report: &mut Report) {
        if !self.http_url.is_empty() && !is_http_url(&self.http_url) {
            report.error(
                "deploy",
                "http_url",
                format!(
                    "{:?} is not an http:// or https:// URL with a host (nodes download from it)",
                    self.http_url
                ),
            );
        }
        if !crate::node::is_valid_segment(&self.http_image_subdir) {
            report.error(
                "deploy",
                "http_image_subdir",
                "must be one plain directory name",
            );
        }
        report.basic_auth(
            "deploy",
            [
                "image_server_auth_strategy",
                "image_server_user",
                "image_server_password",
            ],
            self.image_server_auth_strategy,
            [&self.image_server_user, &self.image_server_password],
        );
    }

    /// The user and password to send to the image source `url`
    /// (`[deploy]image_server_*`), as Ironic 39 sends them with its own
    /// downloads: `http_basic` only, http(s) only, to a permitted host.
    pub fn source_credentials(&self, url: &str) -> Option<(String, String)> {
        (self.image_server_auth_strategy == AuthStrategy::HttpBasic && self.auth_permitted(url))
            .then(|| self.credentials())
    }

    /// The fallback credential of the OCI registry of `image_source`
    /// (Ironic 39: `[deploy]image_server_user` / `_password` when both are
    /// set and the host is permitted, whatever the strategy).
    pub fn oci_fallback_credentials(&self, image_source: &str) -> Option<(String, String)> {
        (!self.image_server_user.is_empty()
            && !self.image_server_password.is_empty()
            && self.auth_permitted(image_source))
        .then(|| self.credentials())
    }

    fn credentials(&self) -> (String, String) {
        (
            self.image_server_user.clone(),
            self.image_server_password.clone(),
        )
    }

    /// Ironic 39's `is_host_auth_permitted`: schemes that carry no
    /// credential to a remote host are permitted; http, https and oci go
    /// to a host of `image_server_auth_hosts` (exact, or `.suffix`), or to
    /// any host when that list is empty and
    /// `image_server_auth_permit_unknown_hosts` is true.
    pub fn auth_permitted(&self, href: &str) -> bool {
        let Some((scheme, rest)) = href.split_once("://") else {
            return true;
        };
        if !["http", "https", "oci"].contains(&scheme.to_ascii_lowercase().as_str()) {
            return true;
        }
        if self.image_server_auth_hosts.is_empty() {
            return self.image_server_auth_permit_unknown_hosts;
        }
        let Some(host) = url_host(rest) else {
            return false;
        };
        self.image_server_auth_hosts.iter().any(|entry| {
            let entry = entry.trim().to_ascii_lowercase();
            if entry.starts_with('.') {
                host.ends_with(&entry)
            } else {
                host == entry
            }
        })
    }
}

impl DeploySection {
    /// Whether `http_url` names this host's loopback (`localhost`,
    /// `127.0.0.0/8`, `::1`), which no node can reach.
    pub(super) fn http_url_is_loopback(&self) -> bool {
        let host = self
            .http_url
            .split_once("://")
            .and_then(|(_, rest)| url_host(rest));
        match host.as_deref() {
            Some("localhost") => true,
            Some(host) => host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback()),
            None => false,
        }
    }
}

/// The host name of a URL's authority (`rest` is what follows `://`),
/// lower-cased, without user info, port or IPv6 brackets.
fn url_host(rest: &str) -> Option<String> {
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit('@').next()?;
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next()?
    } else {
        authority.split(':').next()?
    };
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

/// Whether `url` is `http://host...` or `https://host...`.
fn is_http_url(url: &str) -> bool {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    rest.is_some_and(|rest| {
        let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
        !host.is_empty() && !host.starts_with(':') && !host.contains(char::is_whitespace)
    })
}
