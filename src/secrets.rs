//! Masking secrets before they leave the process: URLs with credentials or
//! signatures in them, and the values of options that are secrets. Every
//! layer may use it (events, logs, errors, sidecars, `config show`), and
//! none needs anything else of the worker to do so.

/// Masks the secrets of a URL, for events, logs, errors and the files the
/// worker writes: the user-info (`http://user:password@host/` and
/// `http://TOKEN@host/` both become `http://***@host/`) and the values of
/// query parameters that carry signatures or tokens (`X-Amz-Signature`,
/// `temp_url_sig`, `sig`, `token`...: see [`is_secret_param`]). Works on
/// the text, so URLs that do not parse are masked too; anything without
/// `scheme://` is returned as it is (Glance ids).
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest_at = scheme_end + 3;
    let rest = &url[rest_at..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..rest_at]);
    match rest[..authority_len].rfind('@') {
        Some(at) => {
            out.push_str("***");
            out.push_str(&rest[at..authority_len]);
        }
        None => out.push_str(&rest[..authority_len]),
    }
    let tail = &rest[authority_len..];
    let (before_fragment, fragment) = tail.split_at(tail.find('#').unwrap_or(tail.len()));
    match before_fragment.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if is_secret_param(key) => format!("{key}=***"),
                    _ => pair.to_string(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
        None => out.push_str(before_fragment),
    }
    out.push_str(fragment);
    out
}

/// Whether a query parameter's value may be a credential: its name mentions
/// a signature, a token, a key, a secret, a password, a credential or
/// authentication (S3 and Swift temporary URLs, SAS tokens, API keys).
fn is_secret_param(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "sig",
        "token",
        "key",
        "secret",
        "passw",
        "credential",
        "auth",
    ]
    .iter()
    .any(|word| key.contains(word))
}

/// Masks every `user:password@` in a comma-separated list of URLs or hosts,
/// keeping the user name (`amqp://guest:***@host`): broker URLs, whose user
/// tells an operator which account is used. A user-info without a password
/// may be a token and is masked whole.
pub fn redact_url_list(value: &str) -> String {
    value
        .split(',')
        .map(|piece| match piece.rfind('@') {
            Some(at) => {
                let (cred, host) = piece.split_at(at);
                let (prefix, cred) = match cred.find("://") {
                    Some(i) => (&cred[..i + 3], &cred[i + 3..]),
                    None => ("", cred),
                };
                match cred.split_once(':') {
                    Some((user, _)) => format!("{prefix}{user}:***{host}"),
                    None => format!("{prefix}***{host}"),
                }
            }
            None => piece.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether an option holds a secret by its name (`password`,
/// `image_server_password`, `secret`, `application_credential_secret`,
/// `token`): its value is never shown. A file naming where a secret is
/// (`secret_file`) is not one.
pub fn is_secret_option(name: &str) -> bool {
    name == "password"
        || name.ends_with("_password")
        || name == "secret"
        || name.ends_with("_secret")
        || name == "token"
}

/// What may be shown of option `name`'s value `value`: `***` for a secret
/// (nothing when it is empty), the credentials of URLs masked otherwise
/// (a user name such as `ironic@example.net` is left alone).
pub fn shown_value(name: &str, value: &str) -> String {
    match is_secret_option(name) {
        true if value.is_empty() => String::new(),
        true => "***".to_string(),
        false if value.contains("://") => redact_url_list(value),
        false => value.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::{is_secret_option, redact_url, redact_url_list, shown_value};

    #[test]
    fn user_info_and_signed_query_parameters_are_masked() {
        assert_eq!(
            redact_url("http://user:pw@host:80/a?x=1#f"),
            "http://***@host:80/a?x=1#f"
        );
        assert_eq!(
            redact_url("https://s3/b/k?X-Amz-Credential=AK&X-Amz-Signature=abc&X-Amz-Expires=60"),
            "https://s3/b/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"
        );
        assert_eq!(
            redact_url("http://swift/v1/o?temp_url_sig=s&temp_url_expires=1&flag"),
            "http://swift/v1/o?temp_url_sig=***&temp_url_expires=1&flag"
        );
        assert_eq!(
            redact_url("http://host/a?token=t"),
            "http://host/a?token=***"
        );
        assert_eq!(redact_url("http://host/plain"), "http://host/plain");
        assert_eq!(redact_url("0b1c-glance-id"), "0b1c-glance-id");
    }

    #[test]
    fn broker_lists_keep_their_user_names() {
        assert_eq!(
            redact_url_list("amqp://u:p@a:5672,v:q@b/vh"),
            "amqp://u:***@a:5672,v:***@b/vh"
        );
    }

    #[test]
    fn secret_options_are_known_by_their_names() {
        for name in ["password", "image_server_password", "secret", "token"] {
            assert!(is_secret_option(name), "{name}");
            assert_eq!(shown_value(name, "hunter2"), "***");
        }
        assert!(is_secret_option("application_credential_secret"));
        for name in ["secret_file", "username", "token_file", "url"] {
            assert!(!is_secret_option(name), "{name}");
        }
        assert_eq!(shown_value("password", ""), "");
        assert_eq!(
            shown_value("username", "ironic@example.net"),
            "ironic@example.net"
        );
        assert_eq!(shown_value("url", "amqp://g:pw@h/"), "amqp://g:***@h/");
        assert_eq!(
            shown_value("auth_url", "https://TOKEN@h/"),
            "https://***@h/"
        );
    }
}
