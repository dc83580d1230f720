//! `[http]`: the embedded image server: where it listens, its timeouts
//! and connection cap, HTTPS, and compressed serving.

use super::check::Report;
use super::choice::{AuthStrategy, TlsMinVersion};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// `[http]`: the embedded image server.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSection {
    /// Listen address of the image server.
    pub listen: SocketAddr,
    /// Seconds a client has to send a complete request header (also the
    /// longest a keep-alive connection waits for its next request).
    pub header_timeout: u64,
    /// Seconds without a byte received or sent (a client that stopped
    /// reading a download) before a connection is closed.
    pub idle_timeout: u64,
    /// Connections the image server keeps open at once; 0 derives it from
    /// the process file-descriptor limit, keeping descriptors for the
    /// pipeline, the broker and the metrics listener.
    pub max_connections: usize,
    // HTTPS (the operations listener stays plain).
    /// Certificate chain (PEM) of the image server; with `tls_key_file`
    /// the server speaks only HTTPS. Reloaded when the file changes.
    pub tls_cert_file: String,
    /// Private key (PEM) of `tls_cert_file`; never logged.
    pub tls_key_file: String,
    /// Lowest TLS version accepted: `1.3` (the default, as Ironic's own
    /// servers) or `1.2`.
    pub tls_min_version: TlsMinVersion,
    /// The image port's own authentication: `noauth` or `http_basic`
    /// (every request carries `auth_user` / `auth_password`; Ironic hands
    /// the agent its `[deploy]image_server_user` / `_password`, so set the
    /// same there, with this host permitted).
    pub auth_strategy: AuthStrategy,
    /// User name of `http_basic`.
    pub auth_user: String,
    /// Password of `http_basic` (never logged).
    pub auth_password: String,
    /// Compressed serving: `off`, or `static` (each master compressed once,
    /// in the background, and served with `Content-Encoding: gzip` to the
    /// clients that accept it).
    pub gzip: GzipMode,
    /// A master is served compressed only when its compressed file is at
    /// least this many times smaller than it (at least 1.0); below that the
    /// compressed file is discarded and the master served as it is.
    pub gzip_min_ratio: f64,
}

/// `[http] gzip`: whether masters get a compressed form to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GzipMode {
    /// Never compressed: every answer is the file as it is.
    Off,
    /// Compressed once per master, after it is ready; served where it pays.
    Static,
}

impl Default for HttpSection {
    fn default() -> Self {
        HttpSection {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            header_timeout: 60,
            idle_timeout: 60,
            max_connections: 0,
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tls_min_version: TlsMinVersion::Tls13,
            auth_strategy: AuthStrategy::NoAuth,
            auth_user: String::new(),
            auth_password: String::new(),
            gzip: GzipMode::Off,
            gzip_min_ratio: 2.0,
        }
    }
}

impl HttpSection {
    /// Whether the image server speaks HTTPS.
    pub fn tls_enabled(&self) -> bool {
        !self.tls_cert_file.is_empty()
    }

    /// TLS files both given and readable, the credentials `http_basic`
    /// needs.
    pub(super) fn check(&self, report: &mut Report) {
        report.basic_auth(
            "http",
            ["auth_strategy", "auth_user", "auth_password"],
            self.auth_strategy,
            [&self.auth_user, &self.auth_password],
        );
        report.tls("http", &self.tls_cert_file, &self.tls_key_file);
        // NaN fails the comparison too.
        if !(self.gzip_min_ratio >= 1.0 && self.gzip_min_ratio.is_finite()) {
            report.error(
                "http",
                "gzip_min_ratio",
                format!(
                    "{} is not a ratio of at least 1.0 (a compressed file this many times \
                     smaller than its master is served)",
                    self.gzip_min_ratio
                ),
            );
        }
    }
}
