//! Registry authentication as values, apart from the requests that carry
//! it: the `WWW-Authenticate` challenge, whether an operator's credential
//! may go to the token service it names, the token request's URL and the
//! token in the service's answer. Each is a pure function, unit tested here.

use super::oci_error;
use crate::error::{ErrorCode, Result};
use crate::sources::http_client;
use crate::sources::oci::OciRef;

/// Parses a `WWW-Authenticate` challenge: its scheme (lowercase) and its
/// `key="value"` parameters (quoted values may hold commas).
pub(super) fn parse_challenge(
    header: &str,
) -> (String, std::collections::BTreeMap<String, String>) {
    let header = header.trim();
    let (scheme, mut rest) = header.split_once(' ').unwrap_or((header, ""));
    let mut params = std::collections::BTreeMap::new();
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let key = key.trim().to_ascii_lowercase();
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => match quoted.find('"') {
                Some(end) => (&quoted[..end], &quoted[end + 1..]),
                None => (quoted, ""),
            },
            None => after.split_once(',').unwrap_or((after, "")),
        };
        params.insert(key, value.trim().to_string());
        rest = next;
    }
    (scheme.to_ascii_lowercase(), params)
}

/// Whether an operator's credential (`[oci]authentication_config`) may go
/// to the token service the challenge names: over HTTPS, or to the
/// registry's own origin; never in clear to another port or scheme.
pub(super) fn may_carry_operator_credential(
    params: &std::collections::BTreeMap<String, String>,
    registry: &reqwest::Url,
) -> bool {
    params
        .get("realm")
        .and_then(|u| reqwest::Url::parse(u).ok())
        .is_some_and(|realm| realm.scheme() == "https" || realm.origin() == registry.origin())
}

/// The token service's `realm` from a Bearer challenge (a URL allowed by
/// the address rules of a URL no message named) and the URL asking it for
/// a pull token of `r`'s repository.
pub(super) fn token_url(
    r: &OciRef,
    params: &std::collections::BTreeMap<String, String>,
    allow_local: bool,
) -> Result<(reqwest::Url, reqwest::Url)> {
    let realm = params
        .get("realm")
        .and_then(|u| reqwest::Url::parse(u).ok())
        .ok_or_else(|| {
            oci_error(
                ErrorCode::SourceUnreachable,
                r,
                "the registry's Bearer challenge names no usable realm",
            )
        })?;
    http_client::check_followed(&realm, allow_local, "token realm")
        .map_err(|why| oci_error(ErrorCode::SourceNotAllowed, r, why))?;
    let mut url = realm.clone();
    {
        let mut q = url.query_pairs_mut();
        if let Some(s) = params.get("service") {
            q.append_pair("service", s);
        }
        q.append_pair("scope", &format!("repository:{}:pull", r.repo));
    }
    Ok((realm, url))
}

/// The token of a token service's answer (`token`, else `access_token`),
/// refused when missing, empty, oversized or able to split a header.
pub(super) fn token_from_answer(r: &OciRef, body: &[u8]) -> Result<String> {
    #[derive(serde::Deserialize)]
    struct Answer {
        #[serde(default)]
        token: Option<String>,
        #[serde(default)]
        access_token: Option<String>,
    }
    let answer: Answer = serde_json::from_slice(body).map_err(|e| {
        oci_error(
            ErrorCode::SourceUnreachable,
            r,
            format!("unreadable token answer: {e}"),
        )
    })?;
    answer
        .token
        .or(answer.access_token)
        .filter(|t| !t.is_empty() && t.len() < 64 << 10 && !t.contains(['\r', '\n']))
        .ok_or_else(|| {
            oci_error(
                ErrorCode::SourceUnreachable,
                r,
                "the token service answered no usable token",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_url_asks_for_a_pull_of_the_repository() {
        let r = OciRef::parse("oci://registry.example/team/img:1").unwrap();
        let params: std::collections::BTreeMap<String, String> = [
            ("realm", "https://auth.example/token"),
            ("service", "registry.example"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let (realm, url) = token_url(&r, &params, false).unwrap();
        assert_eq!(realm.as_str(), "https://auth.example/token");
        assert_eq!(
            url.as_str(),
            "https://auth.example/token?service=registry.example&scope=repository%3Ateam%2Fimg%3Apull"
        );
        let no_realm = std::collections::BTreeMap::new();
        let e = token_url(&r, &no_realm, false).unwrap_err();
        assert_eq!(e.code, ErrorCode::SourceUnreachable);
    }

    #[test]
    fn only_a_usable_token_is_taken() {
        let r = OciRef::parse("oci://registry.example/team/img:1").unwrap();
        let t = |body: &str| token_from_answer(&r, body.as_bytes());
        assert_eq!(t(r#"{"token":"a","access_token":"b"}"#).unwrap(), "a");
        assert_eq!(t(r#"{"access_token":"b"}"#).unwrap(), "b");
        for bad in [
            r#"{}"#,
            r#"{"token":""}"#,
            r#"{"token":"a\r\nX: y"}"#,
            "nope",
        ] {
            let e = t(bad).unwrap_err();
            assert_eq!(e.code, ErrorCode::SourceUnreachable, "{bad}");
        }
    }

    #[test]
    fn challenges() {
        let (s, p) = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(s, "bearer");
        assert_eq!(p["realm"], "https://auth.example/token");
        assert_eq!(p["service"], "registry.example");
        assert_eq!(p["scope"], "repository:a/b:pull,push");
        let (s, p) = parse_challenge(r#"Basic realm="Registry Realm""#);
        assert_eq!(s, "basic");
        assert_eq!(p["realm"], "Registry Realm");
    }
}
