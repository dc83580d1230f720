//! Checksums: which digest Ironic expects for a source (from `instance_info`),
//! the digest algorithms themselves, and Ironic's checksum-file format.

use crate::error::{Error, ErrorCode, Result};
use std::fmt;

/// A digest algorithm Ironic may name for an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algo {
    /// MD5, Ironic's legacy `image_checksum` and the checksum published with every served image.
    Md5,
    /// SHA-256, Glance's default `os_hash_algo` after a format change.
    Sha256,
    /// SHA-512, Glance's default `os_hash_algo`.
    Sha512,
}

impl Algo {
    /// Parses an algorithm name as Glance/Ironic spell it.
    pub fn parse(name: &str) -> Option<Algo> {
        match name.trim().to_ascii_lowercase().as_str() {
            "md5" => Some(Algo::Md5),
            "sha256" => Some(Algo::Sha256),
            "sha512" => Some(Algo::Sha512),
            _ => None,
        }
    }

    /// Guesses the algorithm from a hex digest's length, as Ironic does.
    pub fn from_hex_len(len: usize) -> Option<Algo> {
        match len {
            32 => Some(Algo::Md5),
            64 => Some(Algo::Sha256),
            128 => Some(Algo::Sha512),
            _ => None,
        }
    }

    /// The lowercase name (`md5`, `sha256`, `sha512`).
    pub fn name(self) -> &'static str {
        match self {
            Algo::Md5 => "md5",
            Algo::Sha256 => "sha256",
            Algo::Sha512 => "sha512",
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A concrete expected digest of the source bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// Its algorithm.
    pub algo: Algo,
    /// Lowercase hex value.
    pub hex: String,
}

impl Expected {
    /// Builds an expected digest, checking that `hex` fits `algo`.
    pub fn new(algo: Algo, hex: &str) -> Result<Expected> {
        let hex = hex.trim().to_ascii_lowercase();
        let len_ok = Algo::from_hex_len(hex.len()) == Some(algo);
        if !len_ok || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::new(
                ErrorCode::InvalidMessage,
                format!("{hex:?} is not a {algo} hex digest"),
            ));
        }
        Ok(Expected { algo, hex })
    }

    /// Parses `value` or `algo:value`, guessing the algorithm from the length.
    pub fn parse_guess(value: &str) -> Result<Expected> {
        let value = value.trim();
        if let Some((name, hex)) = value.split_once(':') {
            let algo = Algo::parse(name).ok_or_else(|| {
                Error::new(
                    ErrorCode::InvalidMessage,
                    format!("unknown checksum algorithm {name:?}"),
                )
            })?;
            return Expected::new(algo, hex);
        }
        let algo = Algo::from_hex_len(value.len()).ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidMessage,
                format!("cannot tell the algorithm of checksum {value:?} from its length"),
            )
        })?;
        Expected::new(algo, value)
    }
}

/// What Ironic asked the source bytes to hash to: a value, or the URL of a
/// checksum file still to be fetched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChecksumSpec {
    /// A digest given inline.
    Value(Expected),
    /// A checksum file at an http(s) URL, with the algorithm when it was named.
    Url {
        /// The checksum file's URL.
        url: String,
        /// The algorithm named by `image_os_hash_algo`, if any.
        algo: Option<Algo>,
    },
}

impl ChecksumSpec {
    /// Applies Ironic's precedence: `image_os_hash_algo` + `image_os_hash_value`
    /// win over `image_checksum`; either may be an http(s) URL.
    pub fn from_fields(
        checksum: Option<&str>,
        os_hash_algo: Option<&str>,
        os_hash_value: Option<&str>,
    ) -> Result<Option<ChecksumSpec>> {
        if let (Some(algo), Some(value)) = (nonempty(os_hash_algo), nonempty(os_hash_value)) {
            let algo = Algo::parse(algo).ok_or_else(|| {
                Error::new(
                    ErrorCode::InvalidMessage,
                    format!("unsupported image_os_hash_algo {algo:?}"),
                )
            })?;
            if is_url(value) {
                return Ok(Some(ChecksumSpec::Url {
                    url: value.to_string(),
                    algo: Some(algo),
                }));
            }
            return Ok(Some(ChecksumSpec::Value(Expected::new(algo, value)?)));
        }
        match nonempty(checksum) {
            None => Ok(None),
            Some(value) if is_url(value) => Ok(Some(ChecksumSpec::Url {
                url: value.to_string(),
                algo: None,
            })),
            Some(value) => Ok(Some(ChecksumSpec::Value(Expected::parse_guess(value)?))),
        }
    }
}

fn nonempty(s: Option<&str>) -> Option<&str> {
    s.map(str::trim).filter(|s| !s.is_empty())
}

fn is_url(value: &str) -> bool {
    let lower = value.to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// Finds the digest for `file_name` in a checksum file: lines `<hex>  <name>`
/// (`*name` for binary mode, as sha256sum writes), BSD lines `ALGO (name) =
/// <hex>`, or a file holding a single digest.
pub fn parse_checksum_file(text: &str, file_name: &str, algo: Option<Algo>) -> Result<Expected> {
    let mut entries: Vec<(Option<String>, String)> = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some((head, hex)) = line.rsplit_once(" = ")
            && let (Some(open), Some(close)) = (head.find('('), head.rfind(')'))
            && open < close
        {
            entries.push((Some(head[open + 1..close].to_string()), hex.trim().into()));
            continue;
        }
        let mut parts = line.splitn(2, char::is_whitespace);
        let hex = parts.next().unwrap_or_default().to_string();
        let name = parts
            .next()
            .map(|n| n.trim().trim_start_matches('*').to_string());
        entries.push((name, hex));
    }
    let base = |n: &str| n.rsplit('/').next().unwrap_or(n).to_string();
    let found = entries
        .iter()
        .find(|(name, _)| name.as_deref().map(base).as_deref() == Some(file_name))
        .or(match entries.as_slice() {
            [only] => Some(only),
            _ => None,
        });
    let (_, hex) = found.ok_or_else(|| {
        Error::new(
            ErrorCode::ChecksumMismatch,
            format!("checksum file has no entry for {file_name:?}"),
        )
    })?;
    match algo {
        Some(algo) => Expected::new(algo, hex),
        None => Expected::parse_guess(hex),
    }
    .map_err(|e| {
        Error::new(
            ErrorCode::ChecksumMismatch,
            format!("checksum file: {}", e.message),
        )
    })
}

/// A running digest of one of the supported algorithms.
#[derive(Clone)]
pub enum Hasher {
    /// MD5 state.
    Md5(crate::store::md5::Md5),
    /// SHA-256 state.
    Sha256(sha2::Sha256),
    /// SHA-512 state.
    Sha512(sha2::Sha512),
}

impl Hasher {
    /// A fresh hasher for `algo`.
    pub fn new(algo: Algo) -> Hasher {
        match algo {
            Algo::Md5 => Hasher::Md5(crate::store::md5::Md5::new()),
            Algo::Sha256 => Hasher::Sha256(sha2::Digest::new()),
            Algo::Sha512 => Hasher::Sha512(sha2::Digest::new()),
        }
    }

    /// Feeds bytes.
    pub fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Md5(h) => h.update(data),
            Hasher::Sha256(h) => sha2::Digest::update(h, data),
            Hasher::Sha512(h) => sha2::Digest::update(h, data),
        }
    }

    /// The lowercase hex digest.
    pub fn finalize_hex(self) -> String {
        match self {
            Hasher::Md5(h) => hex::encode(h.finalize()),
            Hasher::Sha256(h) => hex::encode(sha2::Digest::finalize(h)),
            Hasher::Sha512(h) => hex::encode(sha2::Digest::finalize(h)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MD5: &str = "d41d8cd98f00b204e9800998ecf8427e";
    const SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn os_hash_wins_over_checksum() {
        let spec = ChecksumSpec::from_fields(Some(MD5), Some("sha256"), Some(SHA256)).unwrap();
        assert_eq!(
            spec,
            Some(ChecksumSpec::Value(
                Expected::new(Algo::Sha256, SHA256).unwrap()
            ))
        );
    }

    #[test]
    fn guesses_and_prefixed_forms() {
        assert_eq!(Expected::parse_guess(MD5).unwrap().algo, Algo::Md5);
        assert_eq!(
            Expected::parse_guess(&format!("sha256:{SHA256}"))
                .unwrap()
                .algo,
            Algo::Sha256
        );
        assert!(Expected::parse_guess("abc").is_err());
        assert!(Expected::parse_guess(&format!("sha1:{MD5}")).is_err());
        assert!(Expected::parse_guess(&"zz".repeat(16)).is_err());
    }

    #[test]
    fn checksum_url_is_kept_for_fetching() {
        let spec = ChecksumSpec::from_fields(Some("http://h/SHA256SUMS"), None, None).unwrap();
        assert!(matches!(spec, Some(ChecksumSpec::Url { algo: None, .. })));
    }

    #[test]
    fn checksum_file_formats() {
        let text = format!("{MD5}  other.img\n{SHA256} *disk.img\n");
        assert_eq!(
            parse_checksum_file(&text, "disk.img", None).unwrap().hex,
            SHA256
        );
        let bsd = format!("SHA256 (disk.img) = {SHA256}\n");
        assert_eq!(
            parse_checksum_file(&bsd, "disk.img", None).unwrap().hex,
            SHA256
        );
        assert_eq!(parse_checksum_file(MD5, "x", None).unwrap().hex, MD5);
        assert!(parse_checksum_file(&text, "missing.img", None).is_err());
    }

    #[test]
    fn hashers_match_known_vectors() {
        assert_eq!(Hasher::new(Algo::Md5).finalize_hex(), MD5);
        assert_eq!(Hasher::new(Algo::Sha256).finalize_hex(), SHA256);
    }
}
