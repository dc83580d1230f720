//! `[convert]`: how conversions to raw are bounded (the converter's
//! memory and time, the largest virtual size).

use super::check::Report;
use serde::{Deserialize, Serialize};

/// `[convert]`: how conversions to raw are bounded.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConvertSection {
    /// Address-space limit of the converter process, MiB.
    pub memory_limit_mib: u64,
    /// Seconds a conversion may always take.
    pub min_timeout: u64,
    /// Slowest acceptable conversion rate (MiB of virtual disk per second)
    /// beyond `min_timeout`.
    pub min_rate_mib: u64,
    /// Largest virtual size of an image, GiB.
    pub max_virtual_size_gib: u64,
    /// The earlier name of `[DEFAULT]raw_image_growth_factor`, still
    /// accepted: when set it wins (it is the worker's own setting).
    pub raw_image_growth_factor: Option<f64>,
    /// Convert a qcow2 from an http(s)/Glance source while it downloads
    /// (the result is used only once the download is verified).
    pub stream_while_downloading: bool,
}

impl Default for ConvertSection {
    fn default() -> Self {
        ConvertSection {
            memory_limit_mib: 2048,
            min_timeout: 300,
            min_rate_mib: 20,
            max_virtual_size_gib: 1024,
            raw_image_growth_factor: None,
            stream_while_downloading: true,
        }
    }
}

impl ConvertSection {
    /// The converter limits in the units the converter uses.
    pub fn limits(&self) -> crate::image::convert::Limits {
        crate::image::convert::Limits {
            memory: self.memory_limit_mib.saturating_mul(1 << 20),
            min_timeout: std::time::Duration::from_secs(self.min_timeout),
            min_rate: self.min_rate_mib.saturating_mul(1 << 20),
        }
    }

    /// The limits of the qcow2 header check.
    pub fn qcow2_limits(&self) -> crate::image::qcow2::Limits {
        crate::image::qcow2::Limits {
            max_virtual_size: self.max_virtual_size_gib.saturating_mul(1 << 30),
        }
    }

    /// The limits convert to bytes without overflowing.
    pub(super) fn check(&self, report: &mut Report) {
        report.fits(
            "convert",
            "memory_limit_mib",
            self.memory_limit_mib,
            1 << 20,
        );
        report.fits("convert", "min_rate_mib", self.min_rate_mib, 1 << 20);
        report.fits(
            "convert",
            "max_virtual_size_gib",
            self.max_virtual_size_gib,
            1 << 30,
        );
    }
}
