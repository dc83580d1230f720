//! `[source]`: how image sources are downloaded: timeouts, retries, the
//! slowest acceptable rate, the slow lane, redirects.

use super::check::Report;
use serde::{Deserialize, Serialize};

/// `[source]`: download behaviour.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceSection {
    /// Seconds to establish a connection.
    pub connect_timeout: u64,
    /// Seconds without receiving a byte before a download is abandoned.
    pub read_timeout: u64,
    /// Retries after a failed attempt (connection errors, 5xx, broken or too
    /// slow streams): `retries = 2` makes at most 3 attempts.
    pub retries: u32,
    /// Whether TLS certificates of https sources are verified.
    pub verify_tls: bool,
    /// Slowest acceptable download, bytes per second, averaged over
    /// `min_rate_window`; a slower attempt fails as "too slow" (0 = no limit).
    pub min_rate: u64,
    /// Seconds over which `min_rate` is measured.
    pub min_rate_window: u64,
    /// Seconds one download may take in all, every attempt included
    /// (0 = no limit).
    pub download_deadline: u64,
    /// A download averaging fewer bytes per second than this after
    /// `slow_after` seconds gives back its download slot (the slow lane), so
    /// slow sources never starve the others (0 = never).
    pub slow_rate: u64,
    /// Seconds a download runs before its rate is judged for the slow lane.
    pub slow_after: u64,
    /// Downloads in the slow lane at once (each still holds its
    /// connection, a few MiB of buffers and its node's files); when it is
    /// full, a slow download keeps its download slot.
    pub slow_downloads: u32,
    /// Redirects followed per request.
    pub max_redirects: u32,
    /// Whether a redirect, or a host name resolving there, may lead a source
    /// to a loopback, link-local or unspecified address (this host's own
    /// services, a metadata service); a URL naming one literally may always.
    /// The worker's own listeners are refused either way.
    pub allow_local_redirects: bool,
}

impl Default for SourceSection {
    fn default() -> Self {
        SourceSection {
            connect_timeout: 10,
            read_timeout: 60,
            retries: 2,
            verify_tls: true,
            min_rate: 1024,
            min_rate_window: 60,
            download_deadline: 6 * 3600,
            slow_rate: 1 << 20,
            slow_after: 60,
            slow_downloads: 16,
            max_redirects: 10,
            allow_local_redirects: false,
        }
    }
}

impl SourceSection {
    /// A minimum rate needs a window to be measured over.
    pub(super) fn check(&self, report: &mut Report) {
        if self.min_rate > 0 && self.min_rate_window == 0 {
            report.error("source", "min_rate_window", "must be at least 1 second");
        }
    }
}
