//! `[oci]`: how `oci://` sources reach their registry, with the names and
//! meanings of ironic.conf's `[oci]` options.

use serde::{Deserialize, Serialize};

/// `[oci]`: how `oci://` image sources reach their registry, with the names
/// and meanings of ironic.conf's `[oci]` options.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct OciSection {
    /// A docker `config.json` (`{"auths": {"<registry>": {"auth": ...}}}`)
    /// with pre-shared credentials per registry, re-read on every use; empty
    /// for none.
    pub authentication_config: String,
    /// `true`, `false` (no TLS verification) or a CA bundle (PEM) that
    /// alone is trusted for registries; empty: `[source]verify_tls`.
    pub verify_ca: String,
    /// Whether a registry that does not speak HTTPS is tried over plain
    /// HTTP (test set-ups only).
    pub permit_fallback_to_http_transport: bool,
    /// Registries whose redirects (to their CDN) keep the registry's
    /// `Authorization` header: a redirect host equal to one of these, or
    /// under one of them; any other host gets the request without it.
    #[serde(deserialize_with = "super::value::list_opt")]
    pub secure_cdn_registries: Vec<String>,
}

impl Default for OciSection {
    fn default() -> Self {
        OciSection {
            authentication_config: String::new(),
            verify_ca: String::new(),
            permit_fallback_to_http_transport: false,
            secure_cdn_registries: [
                "registry.redhat.io",
                "registry.access.redhat.com",
                "docker.io",
                "registry-1.docker.io",
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}
