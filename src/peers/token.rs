//! Signed master URLs, in the manner of Swift's temp URLs (which Ironic
//! operators know): `/masters/<name>?temp_url_sig=<hex>&temp_url_expires=<unix>`,
//! where the signature is HMAC-SHA256 with the shared secret over
//! `GET\n<expires>\n/masters/<name>`. The listener checks it in constant
//! time and refuses a missing, wrong or expired one alike.

use hmac::{KeyInit, Mac};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The path prefix masters are served under on the peer listener.
pub(crate) const PREFIX: &str = "/masters/";

/// Why a request was refused; every refusal gets the same 401.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The path names no master (or an invalid name).
    BadName,
    /// No signature or expiry, or one that cannot be read.
    Missing,
    /// The expiry has passed.
    Expired,
    /// The signature does not match.
    BadSignature,
}

/// Whether `name` is a master name a peer may ask for: the cache's own
/// names (a Glance id or a UUID, maybe `.converted`) are letters, digits,
/// `-`, `_` and `.`, and never start with a dot (temporaries, sidecars and
/// lock directories do).
pub(crate) fn is_master_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn mac(secret: &[u8], name: &str, expires: u64) -> HmacSha256 {
    // An HMAC takes a key of any length.
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(format!("GET\n{expires}\n{PREFIX}{name}").as_bytes());
    mac
}

/// Unix seconds now: the clock expiries are read against.
pub(crate) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The path and query that fetch master `name` until `expires` (unix
/// seconds), to be appended to a peer's URL.
pub(crate) fn signed_path(secret: &[u8], name: &str, expires: u64) -> String {
    let sig = hex::encode(mac(secret, name, expires).finalize().into_bytes());
    format!("{PREFIX}{name}?temp_url_sig={sig}&temp_url_expires={expires}")
}

/// Checks a request's path and query (`query` without the `?`) at `now`
/// (unix seconds) and returns the master name it may fetch.
pub(crate) fn verify<'a>(
    secret: &[u8],
    path: &'a str,
    query: Option<&str>,
    now: u64,
) -> Result<&'a str, Refusal> {
    let name = path
        .strip_prefix(PREFIX)
        .filter(|n| is_master_name(n))
        .ok_or(Refusal::BadName)?;
    let (mut sig, mut expires) = (None, None);
    for pair in query.unwrap_or_default().split('&') {
        match pair.split_once('=') {
            Some(("temp_url_sig", v)) => sig = Some(v),
            Some(("temp_url_expires", v)) => expires = Some(v),
            _ => {}
        }
    }
    let expires: u64 = expires
        .and_then(|e| e.parse().ok())
        .ok_or(Refusal::Missing)?;
    let sig = sig
        .and_then(|s| hex::decode(s).ok())
        .ok_or(Refusal::Missing)?;
    if expires < now {
        return Err(Refusal::Expired);
    }
    mac(secret, name, expires)
        .verify_slice(&sig)
        .map_err(|_| Refusal::BadSignature)?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"a secret of the whole deployment";
    const NAME: &str = "0c6e8f2a-1f7e-5a43-9d4b-2a1b3c4d5e6f.converted";

    fn split(signed: &str) -> (&str, Option<&str>) {
        let (p, q) = signed.split_once('?').unwrap();
        (p, Some(q))
    }

    #[test]
    fn a_signed_path_opens_its_master_until_it_expires() {
        let signed = signed_path(SECRET, NAME, 1000);
        let (path, query) = split(&signed);
        assert_eq!(verify(SECRET, path, query, 1000), Ok(NAME));
        assert_eq!(verify(SECRET, path, query, 1001), Err(Refusal::Expired));
    }

    #[test]
    fn anything_else_is_refused() {
        let signed = signed_path(SECRET, NAME, 1000);
        let (path, query) = split(&signed);
        assert_eq!(
            verify(b"another secret, not ours", path, query, 0),
            Err(Refusal::BadSignature)
        );
        assert_eq!(verify(SECRET, path, None, 0), Err(Refusal::Missing));
        // The signature of one master opens no other.
        let other = format!("{PREFIX}1{}", &NAME[1..]);
        assert_eq!(verify(SECRET, &other, query, 0), Err(Refusal::BadSignature));
        // A later expiry under the same signature.
        let later = query.unwrap().replace("=1000", "=2000");
        assert_eq!(
            verify(SECRET, path, Some(&later), 0),
            Err(Refusal::BadSignature)
        );
        for bad in [
            "/masters/",
            "/masters/.meta",
            "/masters/../x",
            "/masters/a/b",
            "/x/abc",
        ] {
            assert_eq!(
                verify(SECRET, bad, query, 0),
                Err(Refusal::BadName),
                "{bad}"
            );
        }
    }
}
