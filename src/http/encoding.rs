//! Which content coding a client accepts (RFC 9110 12.5.3, `Accept-Encoding`):
//! the image server sends a master's compressed form only to a client that
//! accepts `gzip`, and identity to everyone else, exactly as before.
//!
//! * `gzip` (or `x-gzip`, its alias) with a weight above 0 accepts it;
//!   `gzip;q=0` refuses it, whatever `*` says.
//! * Without `gzip`, `*` with a weight above 0 accepts it.
//! * No header, an empty one, or a weight that does not parse: identity.
//! * `identity;q=0` alone never forces gzip: without an acceptable gzip the
//!   answer is identity (a 406 would only fail the download).

use axum::http::{HeaderMap, header};

/// True when the request's `Accept-Encoding` headers (all of them, as one
/// list) accept `gzip`.
pub(crate) fn accepts_gzip(headers: &HeaderMap) -> bool {
    let mut gzip: Option<bool> = None;
    let mut star: Option<bool> = None;
    let values = headers.get_all(header::ACCEPT_ENCODING);
    for item in values
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
    {
        let mut parts = item.split(';');
        let coding = parts.next().unwrap_or("").trim();
        let accepted = weight(parts).is_some_and(|q| q > 0);
        let slot = if coding.eq_ignore_ascii_case("gzip") || coding.eq_ignore_ascii_case("x-gzip") {
            &mut gzip
        } else if coding == "*" {
            &mut star
        } else {
            continue;
        };
        // The same coding twice: a refusal wins.
        *slot = Some(slot.unwrap_or(true) && accepted);
    }
    gzip.or(star).unwrap_or(false)
}

/// The weight of one list member, in thousandths (1000 without `q`);
/// `None` when its `q` does not parse (`qvalue`: `0[.ddd]` or `1[.000]`).
fn weight<'a>(params: impl Iterator<Item = &'a str>) -> Option<u32> {
    for param in params {
        let Some((name, value)) = param.split_once('=') else {
            continue;
        };
        if !name.trim().eq_ignore_ascii_case("q") {
            continue;
        }
        let value = value.trim();
        let (int, frac) = value.split_once('.').unwrap_or((value, ""));
        if !matches!(int, "0" | "1") || frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let thousandths = format!("{frac:0<3}").parse::<u32>().ok()?;
        let q = int.parse::<u32>().ok()? * 1000 + thousandths;
        return (q <= 1000).then_some(q);
    }
    Some(1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(values: &[&str]) -> bool {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::ACCEPT_ENCODING, v.parse().unwrap());
        }
        accepts_gzip(&h)
    }

    #[test]
    fn rfc_9110_accept_encoding() {
        assert!(!accepts(&[]));
        assert!(!accepts(&[""]));
        assert!(accepts(&["gzip, deflate"]));
        assert!(accepts(&["deflate, GZIP;q=0.5"]));
        assert!(accepts(&["x-gzip"]));
        assert!(accepts(&["*"]));
        assert!(accepts(&["br;q=1, *;q=0.1"]));
        assert!(accepts(&["identity;q=0", "gzip"]));
        assert!(!accepts(&["gzip;q=0"]));
        assert!(!accepts(&["gzip;q=0.000, *"]));
        assert!(!accepts(&["*;q=0"]));
        assert!(!accepts(&["identity;q=0"]));
        assert!(!accepts(&["deflate, br"]));
        assert!(!accepts(&["gzip;q=2"]));
        assert!(!accepts(&["gzip;q=0.1234"]));
        assert!(!accepts(&["gzip;q=abc"]));
        assert!(accepts(&["gzip ; q=1.000"]));
        assert!(!accepts(&["gzip;q=1.001"]));
        assert!(!accepts(&["gzip", "gzip;q=0"]));
    }
}
