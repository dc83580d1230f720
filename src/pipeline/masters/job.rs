//! One master to obtain: where it comes from, its name in the cache and
//! what the request wants of it. Every step of making a master (download,
//! peers, conversion, inspection, commit) reads it; it names no other
//! module of the pipeline.

use crate::messages::InstanceInfo;
use crate::sources::Source;
use crate::store::checksum::Expected;

/// The digests a master's served bytes get: SHA-512 when the request's
/// algorithm is sha512, MD5 unless `[agent] served_md5` is false.
pub(super) fn served(md5: bool, expected: Option<&Expected>) -> crate::store::sink::Served {
    crate::store::sink::Served {
        md5,
        sha512: expected.is_some_and(|e| e.algo == crate::store::checksum::Algo::Sha512),
    }
}

/// What the steps of one master download share: where it comes from, the
/// master's name, and what the request wants of it.
pub(in crate::pipeline) struct MasterFetch<'a> {
    /// The image source.
    pub(super) source: &'a Source,
    /// The source as Ironic named it (recorded in the sidecar).
    pub(super) href: &'a str,
    /// The master's name in the cache.
    pub(super) name: &'a str,
    /// The checksum the source bytes must have, when one is known.
    pub(super) expected: Option<&'a Expected>,
    /// The digests of the served bytes computed (SHA-512 when the
    /// request's algorithm is sha512, MD5 unless `[agent] served_md5` is
    /// false).
    pub(in crate::pipeline) served: crate::store::sink::Served,
    /// Whether images that can be converted are converted to raw.
    pub(super) force_raw: bool,
    /// Ironic's `instance_info` (the declared disk format).
    pub(super) info: &'a InstanceInfo,
    /// Raised when the download turns out slow.
    pub(super) slow: &'a crate::messages::SlowSignal,
    /// Its turn among the download slots, taken before downloading.
    pub(super) turn: &'a crate::messages::DownloadTurn,
}

/// What a test's [`MasterFetch`] borrows: a source at `href` that the test
/// never asks (it feeds the bytes or finds them cached), an empty request
/// (its `info` and `slow` signal the test's own when it sets them).
#[cfg(test)]
pub(super) struct TestJob {
    href: &'static str,
    source: Source,
    pub(super) info: InstanceInfo,
    pub(super) slow: crate::messages::SlowSignal,
    turn: crate::messages::DownloadTurn,
}

#[cfg(test)]
impl TestJob {
    /// A request for master `m` from `href`.
    pub(super) fn new(href: &'static str) -> TestJob {
        TestJob {
            href,
            source: Source::Http(href.parse().unwrap()),
            info: InstanceInfo::default(),
            slow: Default::default(),
            turn: Default::default(),
        }
    }

    /// Its job: MD5 served, SHA-512 when `sha512`.
    pub(super) fn job<'a>(
        &'a self,
        expected: Option<&'a Expected>,
        sha512: bool,
        force_raw: bool,
    ) -> MasterFetch<'a> {
        MasterFetch {
            source: &self.source,
            href: self.href,
            name: "m",
            expected,
            served: crate::store::sink::Served { md5: true, sha512 },
            force_raw,
            info: &self.info,
            slow: &self.slow,
            turn: &self.turn,
        }
    }
}
