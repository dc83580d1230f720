//! `[deploy]`: where the published symlinks live, the URL nodes reach
//! them under, and the image server's authentication (Ironic's own names).

use super::check::Report;
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
    // Image server authentication (Ironic's names; Ironic hands the same
    // credentials to the agent in its image_info).
    /// `noauth` or `http_basic` (every image request must carry
    /// `image_server_user` / `image_server_password`).
    pub image_server_auth_strategy: String,
    /// User name of `http_basic`.
    pub image_server_user: String,
    /// Password of `http_basic` (never logged).
    pub image_server_password: String,
}

impl Default for DeploySection {
    fn default() -> Self {
        DeploySection {
            http_root: super::default_state_dir().join("httpboot"),
            http_url: String::new(),
            http_image_subdir: "agent_images".into(),
            image_server_auth_strategy: "noauth".into(),
            image_server_user: String::new(),
            image_server_password: String::new(),
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
        let option = "image_server_auth_strategy";
        match self.image_server_auth_strategy.as_str() {
            "noauth" => {}
            "http_basic"
                if self.image_server_user.is_empty() || self.image_server_password.is_empty() =>
            {
                report.error(
                    "deploy",
                    option,
                    "http_basic needs image_server_user and image_server_password",
                )
            }
            "http_basic" if self.image_server_user.contains(':') => report.error(
                "deploy",
                "image_server_user",
                "must not contain ':' (HTTP Basic)",
            ),
            "http_basic" => {}
            other => report.error(
                "deploy",
                option,
                format!("unknown value {other:?} (noauth or http_basic)"),
            ),
        }
    }
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
