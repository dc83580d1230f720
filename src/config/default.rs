//! `[DEFAULT]`: the options of Ironic's `[DEFAULT]` the worker shares with
//! the conductor (its host name, the raw-conversion switch, the options of
//! Ironic's web-server sources).

use super::check::Report;
use serde::{Deserialize, Serialize};

/// `[DEFAULT]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DefaultSection {
    /// Conductor host name: only events for this host are acted on.
    pub host: String,
    /// Ironic's `force_raw_images` (default true, as in Ironic).
    pub force_raw_images: bool,
    /// Ironic's `raw_image_growth_factor` (default 2.0, at least 1.0): when
    /// the virtual size of an image to convert does not fit, the raw size
    /// is estimated as the image size times this (capped by the virtual
    /// size) for the space check.
    pub raw_image_growth_factor: f64,
    /// Ironic's `webserver_verify_ca` for http(s) sources and checksum
    /// files: a boolean (`True`/`False`, as oslo spells them) or the path
    /// of a CA bundle (a path that does not exist means `True`, as in
    /// Ironic). Unset: `[source]verify_tls` decides.
    #[serde(deserialize_with = "super::value::bool_or_string")]
    pub webserver_verify_ca: Option<String>,
    /// Ironic's `webserver_connection_timeout`, seconds: requests' single
    /// `timeout`, so both the connect timeout and the longest wait for a
    /// byte of an http(s) source. Unset: `[source]connect_timeout` and
    /// `read_timeout` decide.
    pub webserver_connection_timeout: Option<u64>,
}

impl Default for DefaultSection {
    fn default() -> Self {
        DefaultSection {
            host: system_hostname(),
            force_raw_images: true,
            raw_image_growth_factor: 2.0,
            webserver_verify_ca: None,
            webserver_connection_timeout: None,
        }
    }
}

/// The machine's host name, Ironic's default for `[DEFAULT]host`.
pub fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

impl DefaultSection {
    /// The host name becomes part of queue names and routing keys: it is
    /// not empty and holds none of AMQP's topic wildcards or whitespace.
    pub(super) fn check(&self, report: &mut Report) {
        let bad = |c: char| c.is_whitespace() || c == '*' || c == '#' || c.is_control();
        if self.host.is_empty() {
            report.error(
                "DEFAULT",
                "host",
                "must not be empty (the queue is named after it)",
            );
        } else if self.host.contains(bad) {
            report.error(
                "DEFAULT",
                "host",
                format!(
                    "{:?} holds whitespace or an AMQP wildcard (* or #); routing keys are made \
                     of it",
                    self.host
                ),
            );
        }
    }
}
