//! `[peers]`: the other conductors' workers as a source of masters. A miss
//! asks the peers over the broker before it goes to the image's source, and
//! the master crosses between workers on a listener of its own, bound to
//! the management network and authenticated by a secret every worker of a
//! deployment shares.

use super::check::{Report, config_error};
use crate::error::Result;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// `[peers]`: off unless `listen` and a secret (`secret` or
/// `secret_file`) are set.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeersSection {
    /// Where the peer listener binds (the management network, never the
    /// provisioning network the image port faces); unset: peers off.
    pub listen: Option<SocketAddr>,
    /// How the other workers reach this one's peer listener
    /// (`http://<management address>:<port>`); empty: `http://<listen>`.
    pub url: String,
    /// The secret every worker of the deployment shares; it signs the
    /// short-lived URLs masters are fetched with.
    pub secret: String,
    /// A file holding the secret (its first line), instead of `secret`.
    pub secret_file: String,
    /// How long a query waits for the peers' answers, in milliseconds.
    pub query_timeout_ms: u64,
    /// Seconds a signed master URL stays valid.
    pub url_ttl: u64,
    /// Masters served to peers at once; a peer asking beyond it is told
    /// to come back (503) and takes the master from another holder.
    pub max_uploads: usize,
    /// The topic exchange peer queries are published on.
    pub exchange: String,
}

impl Default for PeersSection {
    fn default() -> Self {
        PeersSection {
            listen: None,
            url: String::new(),
            secret: String::new(),
            secret_file: String::new(),
            query_timeout_ms: 500,
            url_ttl: 60,
            max_uploads: 4,
            exchange: "ironic-image-worker.peers".into(),
        }
    }
}

impl PeersSection {
    /// Whether peers are on: a listener and a secret are configured.
    pub fn enabled(&self) -> bool {
        self.listen.is_some() && !(self.secret.is_empty() && self.secret_file.is_empty())
    }

    /// The shared secret (`secret`, else the first line of `secret_file`).
    pub fn load_secret(&self) -> Result<Vec<u8>> {
        self.read_secret()
            .map_err(|(option, why)| config_error(format!("[peers]{option}: {why}")))
    }

    /// [`PeersSection::load_secret`], or the option at fault and why.
    fn read_secret(&self) -> Result<Vec<u8>, (&'static str, String)> {
        let (option, secret) = if self.secret_file.is_empty() {
            ("secret", self.secret.clone())
        } else {
            let text = std::fs::read_to_string(&self.secret_file)
                .map_err(|e| ("secret_file", format!("{}: {e}", self.secret_file)))?;
            let first = text.lines().next().unwrap_or_default().trim().to_string();
            ("secret_file", first)
        };
        if secret.len() < 16 {
            return Err((option, "the secret must be at least 16 characters".into()));
        }
        Ok(secret.into_bytes())
    }

    /// The URL peers reach this worker's listener under, without a
    /// trailing slash.
    pub fn advertised_url(&self) -> Option<String> {
        let listen = self.listen?;
        Some(if self.url.is_empty() {
            format!("http://{listen}")
        } else {
            self.url.trim_end_matches('/').to_string()
        })
    }

    /// Checks a configured `[peers]`: both or neither of listen and a
    /// secret, one secret only, a readable secret, an http(s) URL, and
    /// bounds that are not zero.
    pub(super) fn check(&self, report: &mut Report) {
        let has_secret = !(self.secret.is_empty() && self.secret_file.is_empty());
        if self.listen.is_some() != has_secret {
            let set = match self.listen.is_some() {
                true => "listen",
                false if self.secret.is_empty() => "secret_file",
                false => "secret",
            };
            report.error(
                "peers",
                set,
                "listen and a secret (secret or secret_file) are set together",
            );
        }
        if !self.enabled() {
            return;
        }
        if !self.secret.is_empty() && !self.secret_file.is_empty() {
            report.error(
                "peers",
                "secret_file",
                "secret and secret_file are exclusive",
            );
        } else if let Err((option, why)) = self.read_secret() {
            report.error("peers", option, why);
        }
        if !self.url.is_empty() && listener_url(&self.url).is_none() {
            report.error(
                "peers",
                "url",
                format!(
                    "must be http(s)://<host>[:<port>] (no user, path or query), not {:?}",
                    crate::secrets::redact_url(&self.url)
                ),
            );
        }
        for (option, value) in [
            ("query_timeout_ms", self.query_timeout_ms),
            ("url_ttl", self.url_ttl),
            ("max_uploads", self.max_uploads as u64),
        ] {
            if value == 0 {
                report.error("peers", option, "must be above 0");
            }
        }
    }
}

/// The shape of a peer listener's URL: `http(s)://<host>[:<port>]`, with
/// no user, path (but `/`), query or fragment. `[peers]url` must have it,
/// and an offer naming another URL is not used: a master is only ever
/// asked of a peer listener, at the path the signed URL names.
pub fn listener_url(text: &str) -> Option<reqwest::Url> {
    let url = reqwest::Url::parse(text).ok()?;
    let plain = matches!(url.scheme(), "http" | "https")
        && url.host_str().is_some_and(|h| !h.is_empty())
        && url.username().is_empty()
        && url.password().is_none()
        && url.path() == "/"
        && url.query().is_none()
        && url.fragment().is_none()
        && !text.contains(['?', '#', '@']);
    plain.then_some(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listener_urls_are_scheme_host_and_port() {
        for ok in [
            "http://10.0.0.1:8089",
            "https://peer.example",
            "http://[fd00::1]:8089/",
        ] {
            assert!(listener_url(ok).is_some(), "{ok}");
        }
        for bad in [
            "ftp://10.0.0.1",
            "http://10.0.0.1:8089/masters",
            "http://u:p@10.0.0.1",
            "http://10.0.0.1/?x=1",
            "http://10.0.0.1/#f",
            "not a url",
        ] {
            assert!(listener_url(bad).is_none(), "{bad}");
        }
    }
}
