//! Masking secrets before they leave the process: URLs with credentials or
//! signatures in them, and the values of options that are secrets. Every
//! layer may use it (events, logs, errors, sidecars, `config show`), and
//! none needs anything else of the worker to do so.

/// Masks the secrets of a URL, for events, logs, errors and the files the
/// worker writes: the user-info (`http://user:password@host/` and
/// `http://TOKEN@host/` both become `http://***@host/`) and the value of
/// every query (and fragment) parameter but those known to be harmless
/// ([`is_harmless_param`]: expiry times, algorithms, file names), whatever
/// a source calls its tokens (`sig`, `jwt`, `pwd`, `X-Amz-Signature`...).
/// Works on the text, so URLs that do not parse are masked too; anything
/// without `scheme://` is returned as it is (Glance ids).
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
    out.push_str(&redact_tail(&rest[authority_len..]));
    out
}

/// The path of a URL's tail kept, its query and fragment parameters masked
/// ([`redact_params`]).
fn redact_tail(tail: &str) -> String {
    let (before_fragment, fragment) = tail.split_at(tail.find('#').unwrap_or(tail.len()));
    let mut out = String::with_capacity(tail.len());
    match before_fragment.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            out.push_str(&redact_params(query));
        }
        None => out.push_str(before_fragment),
    }
    if let Some(fragment) = fragment.strip_prefix('#') {
        out.push('#');
        out.push_str(&redact_params(fragment));
    }
    out
}

/// `a=1&b=2` with every value masked (`a=***`) but empty ones and those of
/// harmless parameters; a bare item (`?TOKEN`) is masked whole.
fn redact_params(params: &str) -> String {
    params
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) if value.is_empty() || is_harmless_param(key) => pair.to_string(),
            Some((key, _)) => format!("{key}=***"),
            None if pair.is_empty() => String::new(),
            None => "***".to_string(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Query parameters whose values are never credentials: expiry times,
/// signing algorithms and dates, signed header names, object versions and
/// the names and types a download is saved under. Anything else may be a
/// token, whatever its name.
fn is_harmless_param(key: &str) -> bool {
    const HARMLESS: &[&str] = &[
        "x-amz-algorithm",
        "x-amz-date",
        "x-amz-expires",
        "x-amz-signedheaders",
        "temp_url_expires",
        "temp_url_prefix",
        "expires",
        "filename",
        "format",
        "inline",
        "multipart-manifest",
        "version",
        "versionid",
        "response-content-type",
        "response-content-disposition",
        "heartbeat",
        "ssl",
        "connection_timeout",
        "channel_max",
        "frame_max",
    ];
    HARMLESS.contains(&key.to_ascii_lowercase().as_str())
}

/// Masks every `user:password@` in a comma-separated list of URLs or hosts,
/// keeping the user name (`amqp://guest:***@host`): broker URLs, whose user
/// tells an operator which account is used. A user-info without a password
/// may be a token and is masked whole; query values are masked as
/// [`redact_url`] masks them. A `,` inside a password (not percent-encoded)
/// does not split it: a piece that cannot be a host of its own
/// (`host[:port]`), or whose next piece's user-info has no `:`, belongs to
/// the next piece's user-info.
pub fn redact_url_list(value: &str) -> String {
    let pieces: Vec<&str> = value.split(',').collect();
    let mut out = Vec::with_capacity(pieces.len());
    let mut i = 0;
    while i < pieces.len() {
        let mut piece = pieces[i].to_string();
        while user_info_end(&piece).is_none()
            && pieces
                .get(i + 1)
                .is_some_and(|next| continues(&piece, next))
        {
            piece.push(',');
            piece.push_str(pieces[i + 1]);
            i += 1;
        }
        out.push(redact_piece(&piece));
        i += 1;
    }
    out.join(",")
}

/// Where the user-info of a list's piece ends (its last `@` before any
/// query).
fn user_info_end(piece: &str) -> Option<usize> {
    piece[..piece.find('?').unwrap_or(piece.len())].rfind('@')
}

/// Whether `piece`, which has no user-info, is the start of the user-info
/// that `next` ends (a `,` inside a password).
fn continues(piece: &str, next: &str) -> bool {
    let Some(at) = user_info_end(next) else {
        return false;
    };
    let bare = piece.split_once("://").map_or(piece, |(_, rest)| rest);
    let host = &bare[..bare.find(['/', '?']).unwrap_or(bare.len())];
    !is_host_port(host) || !next[..at].contains(':')
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn is_host_port(text: &str) -> bool {
    let (host, port) = match text.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') && !text.starts_with('[') || h.ends_with(']') => {
            (h, Some(p))
        }
        _ => (text, None),
    };
    let host_ok = !host.is_empty()
        && (host.starts_with('[') && host.ends_with(']')
            || host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_'));
    host_ok && port.is_none_or(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
}

/// One piece of a list: its password masked, its query values masked.
fn redact_piece(piece: &str) -> String {
    let (prefix, body) = match piece.find("://") {
        Some(i) => piece.split_at(i + 3),
        None => ("", piece),
    };
    let (cred, rest) = match user_info_end(body) {
        Some(at) => {
            let shown = match body[..at].split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_string(),
            };
            (shown, &body[at..])
        }
        None => (String::new(), body),
    };
    let host_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    format!(
        "{prefix}{cred}{}{}",
        &rest[..host_len],
        redact_tail(&rest[host_len..])
    )
}

/// A URL that does not parse, for an error naming it: its whole authority
/// masked (`amqp://***/vh`), since where a user-info ends in it cannot be
/// told (a password's raw `,`, `/` or `:` makes it look like a host).
pub fn redact_unreadable_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "***".to_string();
    };
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    format!("{scheme}://***{}", redact_tail(&rest[authority_len..]))
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
    use super::{
        is_secret_option, redact_unreadable_url, redact_url, redact_url_list, shown_value,
    };

    #[test]
    fn user_info_and_signed_query_parameters_are_masked() {
        assert_eq!(
            redact_url("http://user:pw@host:80/a?x=1#f"),
            "http://***@host:80/a?x=***#***"
        );
        assert_eq!(
            redact_url("https://s3/b/k?X-Amz-Credential=AK&X-Amz-Signature=abc&X-Amz-Expires=60"),
            "https://s3/b/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"
        );
        assert_eq!(
            redact_url("http://swift/v1/o?temp_url_sig=s&temp_url_expires=1&flag"),
            "http://swift/v1/o?temp_url_sig=***&temp_url_expires=1&***"
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

    #[test]
    fn every_query_value_is_masked_but_harmless_ones() {
        assert_eq!(
            redact_url("http://h/i.img?jwt=abc&pwd=x&token=t&X-Amz-Expires=60&filename=a.img"),
            "http://h/i.img?jwt=***&pwd=***&token=***&X-Amz-Expires=60&filename=a.img"
        );
        assert_eq!(
            redact_url("http://h/i?S3CRET#access_token=t"),
            "http://h/i?***#access_token=***"
        );
        assert_eq!(
            shown_value("endpoint_override", "https://h/v2?apikey=s3cret"),
            "https://h/v2?apikey=***"
        );
        assert_eq!(
            shown_value("endpoint_override", "https://h/v2?jwt=s3cret"),
            "https://h/v2?jwt=***"
        );
    }

    #[test]
    fn a_comma_in_a_broker_password_shows_none_of_it() {
        assert_eq!(
            redact_url_list("amqp://u:pa,ss@h1:5672/vh"),
            "amqp://u:***@h1:5672/vh"
        );
        assert_eq!(
            redact_url_list("amqp://u:12,34@h1,v:q@h2/vh"),
            "amqp://u:***@h1,v:***@h2/vh"
        );
        assert_eq!(
            redact_url_list("amqp://h0:5672,u:p@h1/vh"),
            "amqp://h0:5672,u:***@h1/vh"
        );
        assert_eq!(
            redact_unreadable_url("amqp://u:pa/vh?x=1"),
            "amqp://***/vh?x=***"
        );
        assert_eq!(
            redact_url_list("amqp://u:p@[fd00::1]:5672,v:q@h2"),
            "amqp://u:***@[fd00::1]:5672,v:***@h2"
        );
    }
}
