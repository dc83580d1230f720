//! The converter child's report lines: what `convert-child` tells the
//! worker on stdout (progress, where it reads a download, its verdict).
//! Written by the child's modules (`convert`, `growing`, `clusters`) and
//! read by the worker side of `convert`, so both agree on one type.

use crate::error::ErrorCode;
use crate::store::sink::Digests;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// What the child reports on stdout, one JSON object per line: progress
/// now and then (and, converting a download, where it reads), then the
/// result.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum ChildReport {
    /// Guest bytes written so far.
    Progress {
        /// Guest offset reached.
        progress: u64,
    },
    /// Bytes of the source read so far (a download being converted).
    Source {
        /// Offset read up to.
        source: u64,
    },
    /// Waiting for source bytes not yet downloaded.
    Waiting {
        /// Offset waited for.
        waiting: u64,
    },
    /// The conversion failed.
    Failed {
        /// The error's code.
        code: ErrorCode,
        /// The error's message.
        message: String,
        /// The source was partly given back (see `reclaim`): converting
        /// it again cannot work.
        #[serde(default)]
        conclusive: bool,
    },
    /// The conversion finished.
    Done(Digests),
}

/// One report line of the child on stdout.
pub(crate) fn report(r: &ChildReport) {
    println!("{}", serde_json::to_string(r).unwrap_or_default());
}

/// Reports the guest offset reached when a second has passed since `last`.
pub(crate) fn report_every_second(last: &mut Instant, off: u64) {
    if last.elapsed() >= Duration::from_secs(1) {
        *last = Instant::now();
        report(&ChildReport::Progress { progress: off });
    }
}
