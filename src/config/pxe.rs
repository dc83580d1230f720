//! `[pxe]`: the worker's master cache, the per-node image directories
//! and the cache limits (Ironic's names; the master directory is the
//! worker's own, never Ironic's).

use super::check::Report;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where the worker keeps its masters when it reads a configuration file
/// that does not say otherwise: a directory of its own, never Ironic's, on
/// the same file system as Ironic's default `images_path`. (With no
/// configuration at all the default is a writable directory under the
/// state directory, so the worker starts without root.)
pub const SYSTEM_MASTER_PATH: &str = "/var/lib/ironic-image-worker/master_images";

/// `images_path` of a worker configured by its own file without an
/// ironic.conf (with one, Ironic's own `images_path` is shared).
pub const SYSTEM_IMAGES_PATH: &str = "/var/lib/ironic-image-worker/images";

/// `[pxe]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PxeSection {
    /// The worker's own master image cache directory (never Ironic's).
    pub instance_master_path: PathBuf,
    /// Per-node image directories (`<images_path>/<node>/disk`).
    pub images_path: PathBuf,
    /// Cache size limit in MiB.
    pub image_cache_size: u64,
    /// Cache TTL in minutes.
    pub image_cache_ttl: u64,
}

impl Default for PxeSection {
    fn default() -> Self {
        let base = super::default_state_dir();
        PxeSection {
            instance_master_path: base.join("master_images"),
            images_path: base.join("images"),
            image_cache_size: 20480,
            image_cache_ttl: 10080,
        }
    }
}

impl PxeSection {
    /// The cache policy from `image_cache_size` (MiB) and `image_cache_ttl` (minutes).
    pub fn eviction_policy(&self) -> crate::store::eviction::Policy {
        crate::store::eviction::Policy {
            size_limit: self.image_cache_size.saturating_mul(1 << 20),
            ttl: i64::try_from(self.image_cache_ttl.saturating_mul(60)).unwrap_or(i64::MAX),
        }
    }

    /// The limits convert to bytes and seconds without overflowing.
    pub(super) fn check(&self, report: &mut Report) {
        report.fits("pxe", "image_cache_size", self.image_cache_size, 1 << 20);
        // Minutes to seconds, kept as a signed number of seconds.
        report.fits("pxe", "image_cache_ttl", self.image_cache_ttl, 60 * 2);
    }
}
