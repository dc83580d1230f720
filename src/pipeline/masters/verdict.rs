//! Whether a master may stand for a request, decided in one place from
//! plain values: what the master's record says of it (a sidecar here, the
//! record a peer offers) against what the request wants. A cache hit, a
//! validated pass-through and a peer's offer are all judged by [`judge`],
//! so they can never disagree; what each does with an unfit master differs
//! (a hit becomes a miss, an offer is not used), the rule does not.
//!
//! It does no I/O: what needs some is said in the verdict and done by the
//! caller (hashing a digest the record lacks, asking the source whether it
//! changed since the master was fetched).

use crate::error::Error;
use crate::image::inspect;
use crate::image_format::Format;
use crate::store::cache::MasterMeta;
use crate::store::checksum::{Algo, Expected};

/// What a request wants of its master.
pub(super) struct Wanted<'a> {
    /// The request's image source, its secrets masked as a record keeps it
    /// ([`crate::secrets::redact_url`]).
    pub(super) source: String,
    /// The digest the source bytes must have, when a checksum was given.
    pub(super) expected: Option<&'a Expected>,
    /// Whether images that can be converted are served converted to raw.
    pub(super) force_raw: bool,
    /// Only the source's own bytes will do (neither converted nor
    /// decompressed): the agent downloads the source itself.
    pub(super) as_fetched: bool,
    /// The formats the request takes; `None` when they are not checked
    /// (`[conductor]disable_deep_image_inspection`).
    pub(super) formats: Option<Formats<'a>>,
}

/// The formats a request takes: the declared one and those permitted.
#[derive(Clone, Copy)]
pub(super) struct Formats<'a> {
    /// `image_disk_format`, when declared.
    pub(super) declared: Option<&'a str>,
    /// `[conductor]permitted_image_formats`.
    pub(super) permitted: &'a [Format],
}

impl Formats<'_> {
    /// Whether `format` is the declared one and permitted (the error says
    /// which rule it breaks).
    pub(super) fn check(&self, format: Format) -> crate::error::Result<()> {
        inspect::check_format(format, self.declared, self.permitted)
    }
}

/// What the master's record says it is for the request.
#[derive(Debug)]
pub(super) enum Verdict {
    /// It stands for the request, with what is left to make sure of.
    Fits(Fit),
    /// It is not the request's master (another is made, the offer is not
    /// used), and why.
    Unfit(Unfit),
    /// It holds what the request asks for (as far as the fit says), but
    /// the request cannot be served it (a format not declared or not
    /// permitted): once the fit is made sure of, the request fails with
    /// this error, as a new download of the same bytes would.
    Refused(Fit, Error),
}

/// How a fitting master is known to fit.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Fit {
    /// Its recorded source digest is the expected checksum.
    Verified,
    /// The expected checksum is not among its recorded digests, but its
    /// bytes are the source's: it fits once they are hashed and match.
    OnceHashed(Algo),
    /// No checksum was given: it fits when its source has not changed
    /// since the master was fetched (Ironic's staleness rule).
    IfFresh,
}

/// Why a master is not the request's.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unfit {
    /// Made from another image source.
    OtherSource,
    /// Converted, for a request that serves images as they are.
    Converted,
    /// Not the source's own bytes (converted or decompressed), for a
    /// request whose agent downloads the source itself.
    NotAsFetched,
    /// Its recorded source digest is not the expected checksum.
    ChecksumDiffers,
    /// The expected checksum is not recorded and cannot be computed from
    /// its bytes (they are not the source's).
    ChecksumUnknown,
    /// Its record contradicts itself: the served format is not what its
    /// source format and conversion make it.
    Inconsistent,
}

/// Judges the master recorded as `meta` against what the request wants.
/// The rules, in order: the same source; no conversion unless asked for;
/// the source's own bytes when those are wanted; the expected checksum
/// among the recorded source digests (or computable from the bytes);
/// a consistent record; the declared and permitted format.
pub(super) fn judge(meta: &MasterMeta, want: &Wanted<'_>) -> Verdict {
    if meta.source != want.source {
        return Verdict::Unfit(Unfit::OtherSource);
    }
    if meta.converted && !want.force_raw {
        return Verdict::Unfit(Unfit::Converted);
    }
    if want.as_fetched && !meta.served_as_fetched() {
        return Verdict::Unfit(Unfit::NotAsFetched);
    }
    let fit = match want.expected {
        None => Fit::IfFresh,
        Some(e) => match source_digest(meta, e.algo) {
            Some(hex) if hex == e.hex => Fit::Verified,
            Some(_) => return Verdict::Unfit(Unfit::ChecksumDiffers),
            None if meta.served_as_fetched() => Fit::OnceHashed(e.algo),
            None => return Verdict::Unfit(Unfit::ChecksumUnknown),
        },
    };
    let served = match meta.converted {
        true => Format::Raw.served(),
        false => meta.source_format.served(),
    };
    if meta.disk_format != served {
        return Verdict::Unfit(Unfit::Inconsistent);
    }
    match want.formats.map(|f| f.check(meta.source_format)) {
        Some(Err(e)) => Verdict::Refused(fit, e),
        _ => Verdict::Fits(fit),
    }
}

/// The recorded digest of the source bytes for `algo`, when computed.
pub(super) fn source_digest(meta: &MasterMeta, algo: Algo) -> Option<&str> {
    match algo {
        Algo::Md5 => meta.source_md5.as_deref(),
        Algo::Sha256 => meta.source_sha256.as_deref(),
        Algo::Sha512 => meta.source_sha512.as_deref(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    const SOURCE: &str = "https://images.example/disk.qcow2";
    const SHA256: &str = "aa11";
    const RAW_SHA256: &str = "bb22";

    /// A qcow2 served as fetched, every source digest recorded.
    fn qcow2() -> MasterMeta {
        MasterMeta {
            source: SOURCE.into(),
            fetched_at: 100,
            source_last_modified: Some(50),
            source_size: 10,
            source_md5: Some("md5".into()),
            source_sha256: Some(SHA256.into()),
            source_sha512: None,
            source_format: Format::Qcow2,
            converted: false,
            disk_format: Format::Qcow2.served(),
            size: 10,
            md5: Some("md5".into()),
            sha256: SHA256.into(),
            sha512: None,
            inode: 1,
        }
    }

    /// The same image converted to raw.
    fn converted() -> MasterMeta {
        MasterMeta {
            converted: true,
            disk_format: Format::Raw.served(),
            size: 64,
            md5: Some("rawmd5".into()),
            sha256: RAW_SHA256.into(),
            ..qcow2()
        }
    }

    fn sha256(hex: &str) -> Expected {
        Expected {
            algo: Algo::Sha256,
            hex: hex.into(),
        }
    }

    fn want(expected: Option<&Expected>) -> Wanted<'_> {
        Wanted {
            source: SOURCE.into(),
            expected,
            force_raw: false,
            as_fetched: false,
            formats: None,
        }
    }

    fn fit(v: Verdict) -> Fit {
        match v {
            Verdict::Fits(f) => f,
            other => panic!("expected a fit, got {other:?}"),
        }
    }

    fn unfit(v: Verdict) -> Unfit {
        match v {
            Verdict::Unfit(u) => u,
            other => panic!("expected unfit, got {other:?}"),
        }
    }

    fn refused(v: Verdict) -> ErrorCode {
        match v {
            Verdict::Refused(_, e) => e.code,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn the_expected_checksum_recorded_fits() {
        let e = sha256(SHA256);
        assert_eq!(fit(judge(&qcow2(), &want(Some(&e)))), Fit::Verified);
    }

    #[test]
    fn without_a_checksum_it_fits_only_if_fresh() {
        assert_eq!(fit(judge(&qcow2(), &want(None))), Fit::IfFresh);
    }

    #[test]
    fn another_source_is_unfit_whatever_its_checksum() {
        let e = sha256(SHA256);
        let meta = MasterMeta {
            source: "https://images.example/other.qcow2".into(),
            ..qcow2()
        };
        assert_eq!(unfit(judge(&meta, &want(Some(&e)))), Unfit::OtherSource);
    }

    #[test]
    fn a_different_recorded_checksum_is_unfit() {
        let e = sha256("ffff");
        assert_eq!(
            unfit(judge(&qcow2(), &want(Some(&e)))),
            Unfit::ChecksumDiffers
        );
    }

    #[test]
    fn an_unrecorded_checksum_of_the_source_bytes_fits_once_hashed() {
        let e = Expected {
            algo: Algo::Sha512,
            hex: "cc33".into(),
        };
        assert_eq!(
            fit(judge(&qcow2(), &want(Some(&e)))),
            Fit::OnceHashed(Algo::Sha512)
        );
    }

    #[test]
    fn an_unrecorded_checksum_of_converted_bytes_is_unknown() {
        let e = Expected {
            algo: Algo::Sha512,
            hex: "cc33".into(),
        };
        let w = Wanted {
            force_raw: true,
            ..want(Some(&e))
        };
        assert_eq!(unfit(judge(&converted(), &w)), Unfit::ChecksumUnknown);
    }

    #[test]
    fn a_conversion_is_judged_by_its_source_digest() {
        let e = sha256(SHA256);
        let w = Wanted {
            force_raw: true,
            ..want(Some(&e))
        };
        assert_eq!(fit(judge(&converted(), &w)), Fit::Verified);
    }

    #[test]
    fn a_conversion_does_not_stand_for_the_image_as_it_is() {
        let e = sha256(SHA256);
        assert_eq!(
            unfit(judge(&converted(), &want(Some(&e)))),
            Unfit::Converted
        );
    }

    #[test]
    fn a_pass_through_takes_only_the_source_bytes() {
        let decompressed = MasterMeta {
            source_size: 4,
            ..qcow2()
        };
        let w = Wanted {
            as_fetched: true,
            ..want(None)
        };
        assert_eq!(fit(judge(&qcow2(), &w)), Fit::IfFresh);
        assert_eq!(unfit(judge(&decompressed, &w)), Unfit::NotAsFetched);
        let w = Wanted {
            force_raw: true,
            ..w
        };
        assert_eq!(unfit(judge(&converted(), &w)), Unfit::NotAsFetched);
    }

    #[test]
    fn a_record_that_contradicts_itself_is_unfit() {
        let meta = MasterMeta {
            disk_format: Format::Raw.served(),
            ..qcow2()
        };
        assert_eq!(unfit(judge(&meta, &want(None))), Unfit::Inconsistent);
    }

    #[test]
    fn the_declared_and_permitted_formats_are_checked_on_every_verdict() {
        let permitted = [Format::Raw, Format::Qcow2];
        let only_raw = [Format::Raw];
        let with = |declared, permitted| Wanted {
            formats: Some(Formats {
                declared,
                permitted,
            }),
            ..want(None)
        };
        let meta = qcow2();
        assert_eq!(
            fit(judge(&meta, &with(Some("qcow2"), &permitted))),
            Fit::IfFresh
        );
        assert_eq!(
            refused(judge(&meta, &with(Some("raw"), &permitted))),
            ErrorCode::FormatMismatch
        );
        assert_eq!(
            refused(judge(&meta, &with(None, &only_raw))),
            ErrorCode::FormatNotPermitted
        );
        // Unchecked (deep inspection disabled): the format stands.
        assert_eq!(fit(judge(&meta, &want(None))), Fit::IfFresh);
    }

    #[test]
    fn a_checksum_mismatch_is_unfit_before_any_format_refusal() {
        let e = sha256("ffff");
        let w = Wanted {
            formats: Some(Formats {
                declared: Some("raw"),
                permitted: &[],
            }),
            ..want(Some(&e))
        };
        assert_eq!(unfit(judge(&qcow2(), &w)), Unfit::ChecksumDiffers);
    }
}
