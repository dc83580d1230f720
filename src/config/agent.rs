//! `[agent]`: how Ironic's agent gets its image (the options of Ironic's
//! `[agent]` that decide what the worker caches).

use super::choice::choice;
use serde::{Deserialize, Serialize};

/// `[agent]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentSection {
    /// `local`, `http` or `swift` (see docs/contract.md, "Which images are cached"); the worker defaults to `local`.
    pub image_download_source: ImageDownloadSource,
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

choice! {
    /// Ironic's three `image_download_source` modes: `[agent]`'s, and a
    /// request's own (`instance_info`), parsed with the same words.
    pub enum ImageDownloadSource refused as "unknown value {value:?} (local, http or swift)" {
        /// The image is cached (and converted) and served by the worker.
        Local = "local",
        /// An http(s) source is handed to the agent as it is; others are
        /// cached as in `local`.
        Http = "http",
        /// Swift temporary URLs: not handled by this worker.
        Swift = "swift",
    }
}

impl Default for AgentSection {
    fn default() -> Self {
        AgentSection {
            image_download_source: ImageDownloadSource::Local,
            stream_raw_images: true,
            allow_md5_checksum: true,
            served_md5: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::choice::refusal;
    use super::ImageDownloadSource;

    #[test]
    fn image_download_source_is_one_of_ironics_three_modes() {
        for (word, mode) in [
            ("local", ImageDownloadSource::Local),
            ("http", ImageDownloadSource::Http),
            ("swift", ImageDownloadSource::Swift),
        ] {
            assert_eq!(word.parse(), Ok(mode));
            assert_eq!(mode.as_str(), word);
        }
        let refused = "unknown value \"ftp\" (local, http or swift)";
        assert_eq!("ftp".parse::<ImageDownloadSource>(), Err(refused.into()));
        let error = refusal(&["agent.image_download_source=ftp"]).unwrap();
        assert!(
            error.contains(&format!(
                "[agent]image_download_source (--set agent.image_download_source): {refused}"
            )),
            "{error}"
        );
        assert_eq!(refusal(&["agent.image_download_source=http"]), None);
    }
}
