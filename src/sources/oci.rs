//! OCI registry sources: an `image_source` of the form
//! `oci://<registry>[:port]/<repo>[:<tag>]` or `...@sha256:<digest>`.
//! This module holds what needs no network: the reference, the credentials
//! a request or `[oci]authentication_config` gives, and the choice of one
//! disk-image artifact from an index, made as Ironic's `OciImageService`
//! makes it (the `disktype` annotation, then the CPU architecture). The
//! HTTP side (authentication, manifests, blobs, redirects) is
//! `oci_registry`.

use crate::error::{Error, ErrorCode, Result};
use base64::Engine;
use serde::Deserialize;
use std::collections::BTreeMap;

/// Media types of OCI and Docker indexes (lists of manifests).
pub(crate) const INDEX_TYPES: [&str; 2] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// Media types of OCI and Docker image manifests.
pub(crate) const MANIFEST_TYPES: [&str; 2] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// A parsed `oci://` reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OciRef {
    /// `host[:port]` of the registry.
    pub registry: String,
    /// The repository path (`org/image`).
    pub repo: String,
    /// The tag or digest asked for.
    pub reference: Reference,
}

/// What an [`OciRef`] points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reference {
    /// A tag (`latest` when the reference names none), resolved through the
    /// registry to an index or a manifest.
    Tag(String),
    /// A manifest or index digest, taken as it is.
    Digest(Digest),
}

/// A content digest (`sha256:<hex>` or `sha512:<hex>`), lowercase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    /// `sha256` or `sha512`.
    pub algo: &'static str,
    /// Lowercase hex of the right length for `algo`.
    pub hex: String,
}

impl Digest {
    /// Parses `algo:hex`, checking the algorithm and the length as Ironic
    /// does (sha256: 64 hex digits, sha512: 128).
    pub fn parse(s: &str) -> Option<Digest> {
        let (algo, hex) = s.split_once(':')?;
        let (algo, len) = match algo.to_ascii_lowercase().as_str() {
            "sha256" => ("sha256", 64),
            "sha512" => ("sha512", 128),
            _ => return None,
        };
        let hex = hex.to_ascii_lowercase();
        (hex.len() == len && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then_some(Digest { algo, hex })
    }

    /// The digest of `bytes` in `algo` (`sha512`, else `sha256`).
    pub fn of(algo: &str, bytes: &[u8]) -> Digest {
        use sha2::Digest as _;
        match algo {
            "sha512" => Digest {
                algo: "sha512",
                hex: hex::encode(sha2::Sha512::digest(bytes)),
            },
            _ => Digest {
                algo: "sha256",
                hex: hex::encode(sha2::Sha256::digest(bytes)),
            },
        }
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.algo, self.hex)
    }
}

fn bad_ref(href: &str, why: &str) -> Error {
    Error::new(
        ErrorCode::InvalidMessage,
        format!("image_source {href:?} is not an OCI reference: {why}"),
    )
}

impl OciRef {
    /// Parses `oci://<registry>[:port]/<repo>[:<tag>|@<digest>]`; only the
    /// characters the distribution spec allows are accepted, so every part
    /// goes into a registry URL as it is.
    pub fn parse(href: &str) -> Result<OciRef> {
        let rest = href
            .strip_prefix("oci://")
            .ok_or_else(|| bad_ref(href, "it does not start with oci://"))?;
        let (registry, path) = rest
            .split_once('/')
            .ok_or_else(|| bad_ref(href, "no repository after the registry"))?;
        let registry_ok = !registry.is_empty()
            && registry
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b));
        if !registry_ok {
            return Err(bad_ref(href, "the registry is not host[:port]"));
        }
        let (repo, reference) = match path.split_once('@') {
            Some((repo, digest)) => (
                repo,
                Reference::Digest(
                    Digest::parse(digest)
                        .ok_or_else(|| bad_ref(href, "the digest is not sha256:<64 hex digits>"))?,
                ),
            ),
            None => match path.rsplit_once(':') {
                Some((repo, tag)) => (repo, Reference::Tag(tag.to_string())),
                None => (path, Reference::Tag("latest".into())),
            },
        };
        if let Reference::Tag(tag) = &reference {
            let tag_ok = (1..=128).contains(&tag.len())
                && tag
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
                && !tag.starts_with(['.', '-']);
            if !tag_ok {
                return Err(bad_ref(href, "the tag is not [A-Za-z0-9_][A-Za-z0-9_.-]*"));
            }
        }
        let repo_ok = !repo.is_empty()
            && repo.split('/').all(|c| {
                !c.is_empty()
                    && c.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)
                    })
                    && c.as_bytes()[0].is_ascii_alphanumeric()
            });
        if !repo_ok {
            return Err(bad_ref(
                href,
                "the repository is not lowercase path components",
            ));
        }
        Ok(OciRef {
            registry: registry.to_string(),
            repo: repo.to_string(),
            reference,
        })
    }

    /// `oci://<registry>/<repo>@<digest>`: the manifest URL Ironic records,
    /// and (with a blob digest) the name a blob's master is made from.
    pub fn at(&self, digest: &Digest) -> String {
        format!("oci://{}/{}@{digest}", self.registry, self.repo)
    }

    /// The reference as asked for, for messages.
    pub fn display(&self) -> String {
        match &self.reference {
            Reference::Tag(t) => format!("oci://{}/{}:{t}", self.registry, self.repo),
            Reference::Digest(d) => self.at(d),
        }
    }
}

/// Registry credentials, ready for an `Authorization: Basic` header (to the
/// registry itself or to its token service). `Debug` never shows them.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential(String);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credential(***)")
    }
}

impl Credential {
    /// From a pull secret or a `config.json` `auth` value: the base64 of
    /// `user:pass` (docker's and Metal3's form) is taken as it is, a plain
    /// `user:pass` is encoded, and anything else is a pre-shared token sent
    /// as the password of an empty user name, as Ironic sends it.
    pub fn from_secret(secret: &str) -> Credential {
        let b64 = base64::engine::general_purpose::STANDARD;
        let secret = secret.trim();
        let decodes_to_pair = b64
            .decode(secret)
            .ok()
            .and_then(|d| String::from_utf8(d).ok())
            .is_some_and(|d| d.contains(':'));
        if decodes_to_pair {
            Credential(secret.to_string())
        } else if secret.contains(':') {
            Credential(b64.encode(secret))
        } else {
            Credential(b64.encode(format!(":{secret}")))
        }
    }

    /// The `Authorization` header value.
    pub fn basic_header(&self) -> String {
        format!("Basic {}", self.0)
    }
}

/// The credential `[oci]authentication_config` holds for `registry`
/// (`host[:port]` as the reference names it): the `auths` entry whose key
/// is that registry, port included, as docker matches them (a key may be
/// written as a URL, `https://host[:port]/...`), with `auth`, or `username`
/// and `password`. A registry on another port is another registry.
/// The file is read on every use, so it can be replaced while the worker
/// runs; an unreadable or malformed file is logged (never its contents) and
/// counts as no credential, as in Ironic.
pub fn credential_from_config(path: &str, registry: &str) -> Option<Credential> {
    if path.is_empty() {
        return None;
    }
    #[derive(Deserialize)]
    struct File {
        #[serde(default)]
        auths: BTreeMap<String, Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        #[serde(default)]
        auth: Option<String>,
        #[serde(default)]
        username: Option<String>,
        #[serde(default)]
        password: Option<String>,
    }
    let text = match std::fs::read(path) {
        Ok(t) if t.len() <= 1 << 20 => t,
        Ok(_) => {
            tracing::error!(
                path,
                "[oci]authentication_config is larger than 1 MiB, ignored"
            );
            return None;
        }
        Err(e) => {
            tracing::error!(path, error = %e, "cannot read [oci]authentication_config");
            return None;
        }
    };
    let file: File = match serde_json::from_slice(&text) {
        Ok(f) => f,
        Err(e) => {
            // serde_json's message names a position, never the contents.
            tracing::error!(path, error = %e, "[oci]authentication_config is not a config.json");
            return None;
        }
    };
    let wanted = registry.to_ascii_lowercase();
    file.auths.iter().find_map(|(key, e)| {
        if auths_key_registry(key) != wanted {
            return None;
        }
        match (&e.auth, &e.username, &e.password) {
            (Some(a), _, _) if !a.is_empty() => Some(Credential::from_secret(a)),
            (_, Some(u), Some(p)) => Some(Credential::from_secret(&format!("{u}:{p}"))),
            _ => None,
        }
    })
}

/// The registry (`host[:port]`, lowercase) an `auths` key names: the key
/// itself, or the authority of a key written as a URL.
fn auths_key_registry(key: &str) -> String {
    let bare = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    bare.split('/')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase()
}

/// A descriptor in an index or a manifest (the fields the choice reads).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Descriptor {
    /// Digest of what it points at.
    #[serde(default)]
    pub digest: String,
    /// Size in bytes of what it points at.
    #[serde(default)]
    pub size: u64,
    /// Annotations (`disktype`, `org.opencontainers.image.title`).
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// The platform of an index entry.
    #[serde(default)]
    pub platform: Option<Platform>,
}

/// The platform of an index entry.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Platform {
    /// `amd64`, `arm64`, ... (or `x86_64`, `aarch64`, as some registries have it).
    #[serde(default)]
    pub architecture: Option<String>,
}

/// An index or a manifest, as one type: an index has `manifests`, an
/// image manifest `layers`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Document {
    /// The document's own media type, when it states it.
    #[serde(default, rename = "mediaType")]
    pub media_type: Option<String>,
    /// An index's entries.
    #[serde(default)]
    pub manifests: Option<Vec<Descriptor>>,
    /// A manifest's layers.
    #[serde(default)]
    pub layers: Option<Vec<Descriptor>>,
}

impl Document {
    /// Whether this is an index (by the answer's content type, the
    /// document's own media type, or its shape).
    pub fn is_index(&self, content_type: &str) -> bool {
        INDEX_TYPES.iter().any(|t| content_type.starts_with(t))
            || self
                .media_type
                .as_deref()
                .is_some_and(|m| INDEX_TYPES.contains(&m))
            || (self.manifests.is_some() && self.layers.is_none())
    }
}

/// How Ironic ranks an index entry by its `disktype` annotation: with
/// `image_download_source = local` qcow2 first, otherwise raw first; other
/// or missing annotations are not disk images and never chosen.
pub fn disk_priority(disktype: &str, local: bool) -> Option<u8> {
    let order: [&str; 4] = if local {
        ["qcow2", "qemu", "raw", "applehv"]
    } else {
        ["raw", "applehv", "qcow2", "qemu"]
    };
    order.iter().position(|d| *d == disktype).map(|p| p as u8)
}

/// The format Ironic declares for a `disktype`.
pub fn disk_format_of(disktype: &str) -> &'static str {
    match disktype {
        "raw" | "applehv" => "raw",
        _ => "qcow2",
    }
}

/// Whether an entry of `architecture` fits the node's `cpu_arch`
/// (`x86_64` = `amd64`, `aarch64` = `arm64`); an entry that states no
/// architecture, or a node without one, always fits.
pub fn arch_fits(cpu_arch: Option<&str>, architecture: Option<&str>) -> bool {
    let (Some(want), Some(have)) = (cpu_arch, architecture) else {
        return true;
    };
    fn family(a: &str) -> &str {
        match a {
            "x86_64" | "amd64" => "amd64",
            "aarch64" | "arm64" => "arm64",
            other => other,
        }
    }
    family(want) == family(have)
}

/// The entries of an index that may be the disk image, best first: a known
/// `disktype` (ranked by [`disk_priority`], the index order kept among
/// equals) and a fitting architecture.
pub fn candidates<'a>(
    entries: &'a [Descriptor],
    local: bool,
    cpu_arch: Option<&str>,
) -> Vec<&'a Descriptor> {
    let mut ranked: Vec<(u8, &Descriptor)> = entries
        .iter()
        .filter(|e| {
            arch_fits(
                cpu_arch,
                e.platform.as_ref().and_then(|p| p.architecture.as_deref()),
            )
        })
        .filter_map(|e| {
            let d = e.annotations.get("disktype")?;
            Some((disk_priority(d, local)?, e))
        })
        .collect();
    ranked.sort_by_key(|(p, _)| *p);
    ranked.into_iter().map(|(_, e)| e).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn references() {
        let r = OciRef::parse("oci://reg.example:5000/org/img:v1").unwrap();
        assert_eq!(r.registry, "reg.example:5000");
        assert_eq!(r.repo, "org/img");
        assert_eq!(r.reference, Reference::Tag("v1".into()));
        let r = OciRef::parse("oci://reg/img").unwrap();
        assert_eq!(r.reference, Reference::Tag("latest".into()));
        let r = OciRef::parse(&format!("oci://reg/img@{D}")).unwrap();
        assert_eq!(
            r.at(&Digest::parse(D).unwrap()),
            format!("oci://reg/img@{D}")
        );
        for bad in [
            "oci://reg",
            "oci:///img:v1",
            "oci://reg/Img:v1",
            "oci://reg/img:v1?x=1",
            "oci://reg/img@sha256:abc",
            "oci://reg/img@md5:0123456789abcdef0123456789abcdef",
            "oci://reg/../img:v1",
            "oci://us er@reg/img:v1",
        ] {
            let e = OciRef::parse(bad).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidMessage, "{bad}");
        }
    }

    #[test]
    fn secrets_become_basic_credentials() {
        let b64 = base64::engine::general_purpose::STANDARD;
        let pair = b64.encode("user:pass");
        assert_eq!(Credential::from_secret(&pair).0, pair);
        assert_eq!(Credential::from_secret("user:pass").0, pair);
        assert_eq!(Credential::from_secret("tok").0, b64.encode(":tok"));
        assert_eq!(
            format!("{:?}", Credential::from_secret("user:pass")),
            "Credential(***)"
        );
    }

    #[test]
    fn config_credentials_are_chosen_by_host_and_port() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let json = r#"{"auths": {"reg.example": {"auth": "dXNlcjpwYXNz"},
            "https://other.example:5000/v1/": {"username": "u", "password": "p"}}}"#;
        std::fs::write(&path, json).unwrap();
        let path = path.to_str().unwrap();
        assert!(credential_from_config(path, "reg.example").is_some());
        assert!(credential_from_config(path, "REG.example").is_some());
        assert!(credential_from_config(path, "reg.example:8443").is_none());
        assert!(credential_from_config(path, "other.example:5000").is_some());
        assert!(credential_from_config(path, "other.example").is_none());
    }

    fn entry(disktype: Option<&str>, arch: Option<&str>, digest: &str) -> Descriptor {
        Descriptor {
            digest: digest.into(),
            annotations: disktype
                .map(|d| [("disktype".to_string(), d.to_string())].into())
                .unwrap_or_default(),
            platform: Some(Platform {
                architecture: arch.map(String::from),
            }),
            ..Descriptor::default()
        }
    }

    #[test]
    fn choice_follows_disktype_and_arch() {
        let index = [
            entry(None, Some("amd64"), "none"),
            entry(Some("raw"), Some("amd64"), "raw-amd64"),
            entry(Some("qcow2"), Some("amd64"), "qcow2-amd64"),
            entry(Some("qcow2"), Some("arm64"), "qcow2-arm64"),
            entry(Some("iso"), Some("amd64"), "iso"),
        ];
        let first = |local, arch| candidates(&index, local, arch)[0].digest.clone();
        assert_eq!(first(true, Some("x86_64")), "qcow2-amd64");
        assert_eq!(first(false, Some("x86_64")), "raw-amd64");
        assert_eq!(first(true, Some("aarch64")), "qcow2-arm64");
        assert_eq!(candidates(&index, false, Some("aarch64")).len(), 1);
        assert!(candidates(&index, true, Some("s390x")).is_empty());
        assert_eq!(candidates(&index, true, None).len(), 3);
    }
}
