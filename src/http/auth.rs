//! HTTP Basic authentication on the image server (`[http]auth_strategy =
//! "http_basic"` with `auth_user` / `auth_password`; Ironic hands the agent
//! its own `[deploy]image_server_user` / `_password` for the worker's URL,
//! so they are set alike).
//!
//! The credentials a request carries are compared with the configured ones
//! through their SHA-256 digests, in time that depends on neither, so the
//! answer's timing tells nothing about how much of a guess was right. The
//! password is never logged nor echoed.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sha2::{Digest, Sha256};

/// The credentials the image server requires.
#[derive(Clone)]
pub struct BasicAuth {
    /// SHA-256 of `user:password`.
    expected: [u8; 32],
}

impl std::fmt::Debug for BasicAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BasicAuth(***)")
    }
}

/// The challenge of a `401`.
const CHALLENGE: &str = "Basic realm=\"ironic-image-worker\", charset=\"UTF-8\"";

impl BasicAuth {
    /// Requires `user` and `password` of every request.
    pub fn new(user: &str, password: &str) -> BasicAuth {
        BasicAuth {
            expected: digest(format!("{user}:{password}").as_bytes()),
        }
    }

    /// Whether `headers` carry the right credentials.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| credentials(v.as_bytes()))
        else {
            return false;
        };
        let given = digest(&given);
        given
            .iter()
            .zip(self.expected.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    /// The answer to a request without the right credentials.
    pub fn challenge() -> Response {
        let mut r = StatusCode::UNAUTHORIZED.into_response();
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static(CHALLENGE),
        );
        r
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The decoded `user:password` of a `Basic` authorization (scheme matched
/// without regard to case, as RFC 7617 asks).
fn credentials(value: &[u8]) -> Option<Vec<u8>> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    base64::engine::general_purpose::STANDARD
        .decode(token.trim())
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn only_the_right_pair_passes() {
        let auth = BasicAuth::new("ironic", "s3cr:et");
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        assert!(auth.allows(&headers(&format!("Basic {}", b64("ironic:s3cr:et")))));
        assert!(auth.allows(&headers(&format!("basic  {}", b64("ironic:s3cr:et")))));
        assert!(!auth.allows(&headers(&format!("Basic {}", b64("ironic:s3cr")))));
        assert!(!auth.allows(&headers(&format!("Basic {}", b64("other:s3cr:et")))));
        assert!(!auth.allows(&headers(&format!("Bearer {}", b64("ironic:s3cr:et")))));
        assert!(!auth.allows(&headers("Basic !!!")));
        assert!(!auth.allows(&HeaderMap::new()));
        assert_eq!(format!("{auth:?}"), "BasicAuth(***)");
    }
}
