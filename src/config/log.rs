//! `[log]`: how the worker's log lines look and whether the image server
//! writes an access log.

use serde::{Deserialize, Serialize};

/// The shape of log lines on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (`key=value` fields; the access log in the
    /// combined log format).
    Text,
    /// One JSON object a line, its fields as keys.
    Json,
}

/// `[log]`: the log format and the image server's access log.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSection {
    /// `text` or `json` (`--log-format` overrides it).
    pub format: LogFormat,
    /// One line per image-server request (client, method, path, status,
    /// bytes, duration, range), at INFO under the target
    /// `ironic_image_worker::access`.
    pub access_log: bool,
}

impl Default for LogSection {
    fn default() -> Self {
        LogSection {
            format: LogFormat::Text,
            access_log: true,
        }
    }
}
