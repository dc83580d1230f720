//! Which part of a file the image server answers with: the `Range` and
//! `If-Range` rules of RFC 9110 (sections 13.1.5 and 14), decided before the
//! file is served, so that a resuming download never receives bytes of
//! another image and odd `Range` headers get the answers nginx gives.
//!
//! * `If-Range` with a validator that does not match the file (an ETag other
//!   than the current strong one, any weak ETag, a date other than the
//!   file's `Last-Modified`, or an unparsable value): the whole file (200).
//! * A range unit other than `bytes`, or a syntactically invalid byte range
//!   (`bytes=abc`, `bytes=5-2`): ignored, the whole file (200).
//! * Several ranges in one request: the whole file (200), as RFC 9110
//!   allows (no `multipart/byteranges`); 416 only when none is satisfiable.
//! * One range: 206 with that part, or 416 when it starts beyond the end
//!   (or is an empty suffix `bytes=-0`).
//!
//! The other conditional headers are evaluated first, in the order of RFC
//! 9110 section 13.2.2: `If-Match` / `If-Unmodified-Since` (412 when they
//! fail), then `If-None-Match` / `If-Modified-Since` (304).

use std::time::SystemTime;

/// What to answer for a GET/HEAD of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The whole file (200).
    Full,
    /// Bytes `first..=last` of the file (206).
    Partial(u64, u64),
    /// No requested range is satisfiable (416).
    Unsatisfiable,
}

/// The current validators of the file being served.
pub(crate) struct Validators<'a> {
    /// The strong ETag sent with the file, quotes included.
    pub(crate) etag: &'a str,
    /// The file's modification time (sent as `Last-Modified`, in seconds).
    pub(crate) modified: SystemTime,
    /// Whether `Last-Modified` tells this representation from every other
    /// answer to the same URL: not when a compressed form is served beside
    /// the identity one (they are made within the same second, so a date an
    /// `If-Range` holds from one would match the other).
    pub(crate) date_is_strong: bool,
}

/// Decides the answer to `range` / `if_range` (header values, if present)
/// for a file of `len` bytes with validators `current`.
pub(crate) fn decide(
    range: Option<&str>,
    if_range: Option<&str>,
    len: u64,
    current: &Validators<'_>,
) -> Decision {
    let Some(range) = range else {
        return Decision::Full;
    };
    if let Some(validator) = if_range
        && !if_range_matches(validator.trim(), current)
    {
        return Decision::Full;
    }
    let Some(specs) = parse_byte_ranges(range) else {
        return Decision::Full;
    };
    let satisfiable: Vec<(u64, u64)> = specs.iter().filter_map(|s| s.resolve(len)).collect();
    match (specs.len(), satisfiable.first()) {
        (_, None) => Decision::Unsatisfiable,
        (1, Some(&(first, last))) => Decision::Partial(first, last),
        _ => Decision::Full,
    }
}

/// What the preconditions of a GET/HEAD make of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Precondition {
    /// Answer the request (then [`decide`] which part).
    Proceed,
    /// 304 Not Modified.
    NotModified,
    /// 412 Precondition Failed.
    Failed,
}

/// The conditional request headers of a GET/HEAD (values, if present).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Conditions<'a> {
    /// `If-Match`.
    pub(crate) if_match: Option<&'a str>,
    /// `If-Unmodified-Since`.
    pub(crate) if_unmodified_since: Option<&'a str>,
    /// `If-None-Match`.
    pub(crate) if_none_match: Option<&'a str>,
    /// `If-Modified-Since`.
    pub(crate) if_modified_since: Option<&'a str>,
}

/// RFC 9110 13.2.2: `If-Match` (strong comparison) or, without it,
/// `If-Unmodified-Since`; then `If-None-Match` (weak comparison) or,
/// without it, `If-Modified-Since`. Unparsable dates are ignored.
pub(crate) fn preconditions(c: &Conditions<'_>, current: &Validators<'_>) -> Precondition {
    let date = |v: Option<&str>| v.and_then(|v| httpdate::parse_http_date(v.trim()).ok());
    let modified = secs(current.modified);
    if let Some(list) = c.if_match {
        if !tag_list_matches(list, current.etag, false) {
            return Precondition::Failed;
        }
    } else if let Some(since) = date(c.if_unmodified_since)
        && modified > secs(since)
    {
        return Precondition::Failed;
    }
    if let Some(list) = c.if_none_match {
        if tag_list_matches(list, current.etag, true) {
            return Precondition::NotModified;
        }
    } else if let Some(since) = date(c.if_modified_since)
        && modified <= secs(since)
    {
        return Precondition::NotModified;
    }
    Precondition::Proceed
}

/// Whether `*` or one entity tag of the comma-separated `list` matches
/// `etag` (strong comparison: weak tags never match; weak: `W/` ignored).
fn tag_list_matches(list: &str, etag: &str, weak: bool) -> bool {
    if list.trim() == "*" {
        return true;
    }
    let mut rest = list;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ',']);
        if rest.is_empty() {
            return false;
        }
        let is_weak = rest.starts_with("W/");
        let tag_start = if is_weak { &rest[2..] } else { rest };
        let Some(body) = tag_start.strip_prefix('"') else {
            return false;
        };
        let Some(end) = body.find('"') else {
            return false;
        };
        let tag = &tag_start[..end + 2];
        if (weak || !is_weak) && tag == etag.trim_start_matches("W/") {
            return true;
        }
        rest = &body[end + 1..];
    }
}

/// RFC 9110 13.1.5: an entity tag matches only by strong comparison; a date
/// only when it is exactly the file's `Last-Modified` and a strong
/// validator.
fn if_range_matches(validator: &str, current: &Validators<'_>) -> bool {
    if validator.starts_with("W/") {
        return false;
    }
    if validator.starts_with('"') {
        return validator == current.etag && !current.etag.starts_with("W/");
    }
    match httpdate::parse_http_date(validator) {
        Ok(date) => current.date_is_strong && secs(date) == secs(current.modified),
        Err(_) => false,
    }
}

fn secs(t: SystemTime) -> Option<u64> {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs())
}

/// One range-spec of a `bytes` range set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spec {
    /// `first-` or `first-last`.
    From(u64, Option<u64>),
    /// `-n`: the last n bytes.
    Suffix(u64),
}

impl Spec {
    /// The inclusive byte span this spec selects in a file of `len` bytes,
    /// or `None` when it is unsatisfiable.
    fn resolve(self, len: u64) -> Option<(u64, u64)> {
        match self {
            Spec::From(first, last) if first < len => {
                Some((first, last.map_or(len - 1, |l| l.min(len - 1))))
            }
            Spec::From(..) => None,
            Spec::Suffix(n) if n > 0 && len > 0 => Some((len - n.min(len), len - 1)),
            Spec::Suffix(_) => None,
        }
    }
}

/// Parses `bytes=<range-set>`; `None` for another unit or an invalid set
/// (both are ignored: the whole file is sent).
fn parse_byte_ranges(value: &str) -> Option<Vec<Spec>> {
    let (unit, set) = value.split_once('=')?;
    if !unit.trim().eq_ignore_ascii_case("bytes") {
        return None;
    }
    let mut specs = Vec::new();
    // The list syntax allows empty elements (`bytes=0-1,,5-6`).
    for spec in set.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (first, last) = spec.split_once('-')?;
        let (first, last) = (first.trim(), last.trim());
        specs.push(if first.is_empty() {
            Spec::Suffix(number(last)?)
        } else {
            let first = number(first)?;
            let last = if last.is_empty() {
                None
            } else {
                Some(number(last)?)
            };
            if last.is_some_and(|l| l < first) {
                return None;
            }
            Spec::From(first, last)
        });
    }
    if specs.is_empty() { None } else { Some(specs) }
}

/// Digits only; values beyond u64 saturate (they are beyond any file).
fn number(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse().unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const ETAG: &str = "\"abc-10\"";

    fn at(secs: u64, nanos: u32) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::new(secs, nanos)
    }

    fn d(range: &str, if_range: Option<&str>) -> Decision {
        let v = Validators {
            etag: ETAG,
            modified: at(1_700_000_000, 500_000_000),
            date_is_strong: true,
        };
        decide(Some(range), if_range, 100, &v)
    }

    #[test]
    fn single_ranges() {
        assert_eq!(d("bytes=0-9", None), Decision::Partial(0, 9));
        assert_eq!(d("bytes=90-", None), Decision::Partial(90, 99));
        assert_eq!(d("bytes=90-1000", None), Decision::Partial(90, 99));
        assert_eq!(d("bytes=-10", None), Decision::Partial(90, 99));
        assert_eq!(d("bytes=-1000", None), Decision::Partial(0, 99));
        assert_eq!(d("Bytes = 5 - 6", None), Decision::Partial(5, 6));
        assert_eq!(d("bytes=100-", None), Decision::Unsatisfiable);
        assert_eq!(d("bytes=-0", None), Decision::Unsatisfiable);
        assert_eq!(
            d("bytes=99999999999999999999999-", None),
            Decision::Unsatisfiable
        );
    }

    #[test]
    fn odd_ranges_are_ignored() {
        for r in [
            "items=0-5",
            "bytes=abc",
            "bytes=5-2",
            "bytes=",
            "bytes=-",
            "bytes=1-2-3",
            "bytes 0-5",
            "bytes=0x1-2",
            "bytes=+1-2",
        ] {
            assert_eq!(d(r, None), Decision::Full, "{r}");
        }
    }

    #[test]
    fn several_ranges_get_the_whole_file() {
        assert_eq!(d("bytes=0-1,5-6", None), Decision::Full);
        assert_eq!(d("bytes=0-1,,", None), Decision::Partial(0, 1));
        assert_eq!(d("bytes=200-300,400-", None), Decision::Unsatisfiable);
        assert_eq!(d("bytes=200-300,-5", None), Decision::Full);
    }

    #[test]
    fn if_range() {
        assert_eq!(d("bytes=0-9", Some(ETAG)), Decision::Partial(0, 9));
        assert_eq!(d("bytes=0-9", Some("\"other\"")), Decision::Full);
        assert_eq!(d("bytes=0-9", Some("W/\"abc-10\"")), Decision::Full);
        let date = httpdate::fmt_http_date(at(1_700_000_000, 0));
        assert_eq!(d("bytes=0-9", Some(&date)), Decision::Partial(0, 9));
        let other = httpdate::fmt_http_date(at(1_700_000_001, 0));
        assert_eq!(d("bytes=0-9", Some(&other)), Decision::Full);
        assert_eq!(d("bytes=0-9", Some("yesterday")), Decision::Full);
        // Beside another representation, a date tells neither apart.
        let both = Validators {
            etag: ETAG,
            modified: at(1_700_000_000, 500_000_000),
            date_is_strong: false,
        };
        assert_eq!(
            decide(Some("bytes=0-9"), Some(&date), 100, &both),
            Decision::Full
        );
        assert_eq!(
            decide(Some("bytes=0-9"), Some(ETAG), 100, &both),
            Decision::Partial(0, 9)
        );
        // Without a Range, If-Range changes nothing.
        let v = Validators {
            etag: ETAG,
            modified: at(1, 0),
            date_is_strong: true,
        };
        assert_eq!(decide(None, Some("\"x\""), 100, &v), Decision::Full);
    }

    #[test]
    fn conditional_headers() {
        let v = Validators {
            etag: ETAG,
            modified: at(1_700_000_000, 500_000_000),
            date_is_strong: true,
        };
        let same = httpdate::fmt_http_date(at(1_700_000_000, 0));
        let before = httpdate::fmt_http_date(at(1_699_999_999, 0));
        let p = |c: Conditions<'_>| preconditions(&c, &v);
        use Precondition::*;
        assert_eq!(p(Conditions::default()), Proceed);
        let m = |v| Conditions {
            if_match: Some(v),
            ..Default::default()
        };
        assert_eq!(p(m(ETAG)), Proceed);
        assert_eq!(p(m("\"x\", \"abc-10\"")), Proceed);
        assert_eq!(p(m("*")), Proceed);
        assert_eq!(p(m("W/\"abc-10\"")), Failed);
        assert_eq!(p(m("\"x\"")), Failed);
        let n = |v| Conditions {
            if_none_match: Some(v),
            if_modified_since: Some(&before),
            ..Default::default()
        };
        assert_eq!(p(n("W/\"abc-10\"")), NotModified);
        assert_eq!(p(n("\"a,b\", \"abc-10\"")), NotModified);
        assert_eq!(p(n("\"x\"")), Proceed, "If-Modified-Since ignored");
        let ims = |d| Conditions {
            if_modified_since: Some(d),
            ..Default::default()
        };
        assert_eq!(p(ims(&same)), NotModified);
        assert_eq!(p(ims(&before)), Proceed);
        assert_eq!(p(ims("garbage")), Proceed);
        let ius = |d| Conditions {
            if_unmodified_since: Some(d),
            ..Default::default()
        };
        assert_eq!(p(ius(&same)), Proceed);
        assert_eq!(p(ius(&before)), Failed);
    }

    #[test]
    fn empty_file() {
        let v = Validators {
            etag: ETAG,
            modified: at(1, 0),
            date_is_strong: true,
        };
        assert_eq!(
            decide(Some("bytes=0-"), None, 0, &v),
            Decision::Unsatisfiable
        );
        assert_eq!(
            decide(Some("bytes=-5"), None, 0, &v),
            Decision::Unsatisfiable
        );
    }
}
