//! `[agent]`: how Ironic's agent gets its image (the options of Ironic's
//! `[agent]` that decide what the worker caches).

use super::check::Report;
use serde::{Deserialize, Serialize};

/// `[agent]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentSection {
    /// `local`, `http` or `swift` (see docs/contract.md, "Which images are cached"); the worker defaults to `local`.
    pub image_download_source: String,
    /// Ironic's `stream_raw_images` (default true).
    pub stream_raw_images: bool,
    /// Ironic's `allow_md5_checksum` (default true): when false, a request
    /// whose only checksum is MD5 (inline or in a checksum file) is refused
    /// with `checksum_not_permitted`.
    pub allow_md5_checksum: bool,
    /// The worker's own (default true): the completion carries the MD5 of
    /// the served bytes (`image_checksum`). False: no MD5 of them is
    /// computed at all, and `image_os_hash_*` alone verify them (sha256,
    /// sha512 when the request's algorithm is), as Ironic itself does
    /// after a conversion since Ironic 15; MD5 is the dearest digest.
    pub served_md5: bool,
}

impl Default for AgentSection {
    fn default() -> Self {
        AgentSection {
            image_download_source: "local".into(),
            stream_raw_images: true,
            allow_md5_checksum: true,
            served_md5: true,
        }
    }
}

impl AgentSection {
    /// `image_download_source` is one of Ironic's three modes.
    pub(super) fn check(&self, report: &mut Report) {
        match self.image_download_source.as_str() {
            "local" | "http" | "swift" => {}
            other => report.error(
                "agent",
                "image_download_source",
                format!("unknown value {other:?} (local, http or swift)"),
            ),
        }
    }
}
