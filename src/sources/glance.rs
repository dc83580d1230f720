//! Glance image sources: an `image_source` that is a Glance image id (Ironic's
//! main case). Metadata comes from the Image API v2 (`GET /v2/images/{id}`),
//! data from `/v2/images/{id}/file`; authentication is a Keystone v3 token
//! (password or application credential, cached and renewed before it
//! expires or when refused), a static token, or none.

use crate::config::{GlanceAuthType, GlanceSection};
use crate::error::{Error, ErrorCode, Result};
use serde::Deserialize;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::Mutex;

/// What Glance says about an image, the fields Ironic uses.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ImageMeta {
    /// `active` when the image has data that can be downloaded.
    #[serde(default)]
    pub status: String,
    /// Declared disk format (`qcow2`, `raw`, ...).
    #[serde(default)]
    pub disk_format: Option<String>,
    /// Legacy MD5 of the image data.
    #[serde(default)]
    pub checksum: Option<String>,
    /// Multihash algorithm (`sha512` by default in Glance).
    #[serde(default)]
    pub os_hash_algo: Option<String>,
    /// Multihash value.
    #[serde(default)]
    pub os_hash_value: Option<String>,
    /// Size of the image data in bytes.
    #[serde(default)]
    pub size: Option<u64>,
    /// Last change, ISO 8601 (`2026-11-30T05:00:00Z`).
    #[serde(default)]
    pub updated_at: Option<String>,
}

impl ImageMeta {
    /// `updated_at` as a time, for Ironic's staleness rule.
    pub fn updated(&self) -> Option<SystemTime> {
        self.updated_at.as_deref().and_then(parse_iso8601)
    }
}

struct Token {
    value: String,
    expires: Option<SystemTime>,
    image_url: Option<String>,
}

/// An Image API client with a cached Keystone token, shared by all requests.
pub struct Glance {
    config: GlanceSection,
    client: reqwest::Client,
    /// Whole-request limit of metadata and token requests.
    timeout: Duration,
    token: Mutex<Option<Token>>,
}

/// Tokens are renewed this long before Keystone says they expire.
const RENEW_BEFORE: Duration = Duration::from_secs(120);

impl Glance {
    /// A client for `[glance]`, sending requests with `client`; metadata
    /// and token requests end within `timeout` (image data is bounded by
    /// the download's own rate and deadline).
    pub fn new(config: GlanceSection, client: reqwest::Client, timeout: Duration) -> Glance {
        Glance {
            config,
            client,
            timeout,
            token: Mutex::new(None),
        }
    }

    /// Image metadata; a refused token is renewed once.
    pub async fn image(&self, id: &str) -> Result<ImageMeta> {
        let resp = self.get(&format!("v2/images/{id}")).await?;
        let meta: ImageMeta =
            crate::sources::http_client::read_json(resp, &format!("Glance image {id}")).await?;
        if meta.status != "active" {
            return Err(Error::new(
                ErrorCode::SourceNotFound,
                format!(
                    "Glance image {id} is {:?}, not active: it has no data to download",
                    meta.status
                ),
            ));
        }
        Ok(meta)
    }

    /// The data request for image `id`, authenticated: the caller sends it.
    pub async fn data_request(&self, id: &str) -> Result<reqwest::RequestBuilder> {
        let (base, token) = self.endpoint_and_token().await?;
        let req = self.client.get(format!("{base}/v2/images/{id}/file"));
        Ok(match token {
            Some(t) => req.header("X-Auth-Token", t),
            None => req,
        })
    }

    /// Forgets the cached token (after Glance answered 401 with it).
    pub async fn forget_token(&self) {
        *self.token.lock().await = None;
    }

    async fn get(&self, path: &str) -> Result<reqwest::Response> {
        for attempt in 0..2 {
            let (base, token) = self.endpoint_and_token().await?;
            let mut req = self
                .client
                .get(format!("{base}/{path}"))
                .timeout(self.timeout);
            if let Some(t) = token {
                req = req.header("X-Auth-Token", t);
            }
            let resp = req.send().await.map_err(|e| unreachable("Glance", e))?;
            match resp.status().as_u16() {
                200..=299 => return Ok(resp),
                401 if attempt == 0 && self.uses_keystone() => self.forget_token().await,
                status => return Err(status_error("Glance", path, status)),
            }
        }
        Err(status_error("Glance", path, 401))
    }

    fn uses_keystone(&self) -> bool {
        !matches!(
            self.config.auth_type,
            GlanceAuthType::AdminToken | GlanceAuthType::NoAuth
        )
    }

    /// The Image API base URL (no trailing `/`, no `/v2`) and the token.
    async fn endpoint_and_token(&self) -> Result<(String, Option<String>)> {
        let fixed = self.config.endpoint_override.trim_end_matches('/');
        let fixed = fixed.strip_suffix("/v2").unwrap_or(fixed).to_string();
        match self.config.auth_type {
            GlanceAuthType::NoAuth => Ok((need_endpoint(fixed)?, None)),
            GlanceAuthType::AdminToken => {
                Ok((need_endpoint(fixed)?, Some(self.config.token.clone())))
            }
            _ => {
                let mut cached = self.token.lock().await;
                let fresh = cached.as_ref().is_some_and(|t| {
                    t.expires
                        .is_none_or(|e| SystemTime::now() + RENEW_BEFORE < e)
                });
                if !fresh {
                    *cached = Some(self.issue_token().await?);
                }
                let token = cached.as_ref().expect("token was just set");
                let base = if fixed.is_empty() {
                    token.image_url.clone().ok_or_else(|| {
                        Error::new(
                            ErrorCode::SourceNotAllowed,
                            "no image endpoint in the Keystone catalog for [glance]valid_interfaces \
                             and region_name; set [glance]endpoint_override",
                        )
                    })?
                } else {
                    fixed
                };
                Ok((base, Some(token.value.clone())))
            }
        }
    }

    /// `POST /v3/auth/tokens` with the configured credentials: the request
    /// is built by [`auth_request`], the answer read by [`read_token`].
    async fn issue_token(&self) -> Result<Token> {
        let c = &self.config;
        if c.auth_url.is_empty() {
            return Err(Error::new(
                ErrorCode::SourceNotAllowed,
                "[glance]auth_url is not set: cannot authenticate to Glance",
            ));
        }
        let resp = self
            .client
            .post(tokens_url(&c.auth_url))
            .timeout(self.timeout)
            .json(&serde_json::json!({ "auth": auth_request(c)? }))
            .send()
            .await
            .map_err(|e| unreachable("Keystone", e))?;
        let (value, body) = read_token(resp).await?;
        tracing::info!(expires_at = ?body.token.expires_at, "Keystone token issued for Glance");
        Ok(Token {
            value,
            expires: body.token.expires_at.as_deref().and_then(parse_iso8601),
            image_url: self.image_endpoint(&body.token.catalog),
        })
    }

    fn image_endpoint(&self, catalog: &[CatalogEntry]) -> Option<String> {
        let image = catalog.iter().find(|e| e.kind == "image")?;
        let region = &self.config.region_name;
        self.config.valid_interfaces.iter().find_map(|iface| {
            image
                .endpoints
                .iter()
                .find(|e| {
                    &e.interface == iface
                        && (region.is_empty()
                            || e.region_id.as_deref() == Some(region)
                            || e.region.as_deref() == Some(region))
                })
                .map(|e| {
                    let u = e.url.trim_end_matches('/');
                    u.strip_suffix("/v2").unwrap_or(u).to_string()
                })
        })
    }
}

/// The `auth` object of a Keystone v3 token request: the identity of
/// `[glance]auth_type` and, for a password, the project scope.
fn auth_request(c: &GlanceSection) -> Result<serde_json::Value> {
    let mut auth = serde_json::json!({ "identity": identity(c)? });
    if let Some(project) = project_scope(c) {
        auth["scope"] = serde_json::json!({ "project": project });
    }
    Ok(auth)
}

/// The `identity` of a token request for `[glance]auth_type`.
fn identity(c: &GlanceSection) -> Result<serde_json::Value> {
    match &c.auth_type {
        GlanceAuthType::Password => Ok(serde_json::json!({
            "methods": ["password"],
            "password": {"user": {
                "name": c.username,
                "password": c.password,
                "domain": domain(&c.user_domain_id, &c.user_domain_name),
            }},
        })),
        GlanceAuthType::ApplicationCredential => Ok(serde_json::json!({
            "methods": ["application_credential"],
            "application_credential": {
                "id": c.application_credential_id,
                "secret": c.application_credential_secret,
            },
        })),
        other => Err(Error::new(
            ErrorCode::SourceNotAllowed,
            format!("[glance]auth_type {:?} is not supported", other.as_str()),
        )),
    }
}

/// The project a token is scoped to, by id or by name and domain; none
/// for application credentials, which carry their own scope.
fn project_scope(c: &GlanceSection) -> Option<serde_json::Value> {
    if identity_is_app_cred(c) || (c.project_id.is_empty() && c.project_name.is_empty()) {
        None
    } else if c.project_id.is_empty() {
        Some(serde_json::json!({"name": c.project_name,
            "domain": domain(&c.project_domain_id, &c.project_domain_name)}))
    } else {
        Some(serde_json::json!({"id": c.project_id}))
    }
}

/// `<auth_url>/v3/auth/tokens`, whether or not `auth_url` ends in `/v3`.
fn tokens_url(auth_url: &str) -> String {
    let root = auth_url.trim_end_matches('/');
    if root.ends_with("/v3") {
        format!("{root}/auth/tokens")
    } else {
        format!("{root}/v3/auth/tokens")
    }
}

/// The token (`X-Subject-Token`) and body of Keystone's answer, or the
/// error its status or a missing token means.
async fn read_token(resp: reqwest::Response) -> Result<(String, TokenBody)> {
    let status = resp.status().as_u16();
    if !(200..300).contains(&status) {
        return Err(status_error("Keystone", "auth/tokens", status));
    }
    let value = resp
        .headers()
        .get("X-Subject-Token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .ok_or_else(|| {
            Error::new(
                ErrorCode::SourceUnreachable,
                "Keystone answered without X-Subject-Token",
            )
        })?;
    let body = crate::sources::http_client::read_json(resp, "Keystone token").await?;
    Ok((value, body))
}

fn identity_is_app_cred(c: &GlanceSection) -> bool {
    c.auth_type == GlanceAuthType::ApplicationCredential
}

fn domain(id: &str, name: &str) -> serde_json::Value {
    if !id.is_empty() {
        serde_json::json!({ "id": id })
    } else if !name.is_empty() {
        serde_json::json!({ "name": name })
    } else {
        serde_json::json!({ "id": "default" })
    }
}

fn need_endpoint(base: String) -> Result<String> {
    if base.is_empty() {
        Err(Error::new(
            ErrorCode::SourceNotAllowed,
            "[glance]endpoint_override is required without Keystone authentication",
        ))
    } else {
        Ok(base)
    }
}

fn unreachable(service: &str, e: reqwest::Error) -> Error {
    Error::new(
        ErrorCode::SourceUnreachable,
        format!("{service}: {}", crate::error::error_chain(&e.without_url())),
    )
}

/// Maps a failed status of Glance or Keystone to an error code.
pub fn status_error(service: &str, what: &str, status: u16) -> Error {
    let code = crate::error::http_status_code(status);
    let hint = match status {
        401 => " (credentials refused: check [glance] auth options)",
        403 => " (not allowed to read this image)",
        _ => "",
    };
    Error::new(code, format!("{service} {what}: HTTP {status}{hint}"))
}

#[derive(Deserialize)]
struct TokenBody {
    token: TokenInfo,
}

#[derive(Deserialize)]
struct TokenInfo {
    #[serde(default)]
    expires_at: Option<String>,
    #[serde(default)]
    catalog: Vec<CatalogEntry>,
}

#[derive(Deserialize)]
struct CatalogEntry {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    endpoints: Vec<Endpoint>,
}

#[derive(Deserialize)]
struct Endpoint {
    interface: String,
    url: String,
    #[serde(default)]
    region: Option<String>,
    #[serde(default)]
    region_id: Option<String>,
}

/// Parses the RFC 3339 timestamps of Keystone and Glance
/// (`2026-11-30T05:00:00Z`, `2026-11-30T05:00:00.000000Z`, `...+02:00`),
/// honouring the offset; a timestamp without one is taken as UTC, as
/// oslo's `isotime` writes it.
pub fn parse_iso8601(s: &str) -> Option<SystemTime> {
    use time::format_description::well_known::Rfc3339;
    let parsed = time::OffsetDateTime::parse(s, &Rfc3339)
        .or_else(|_| time::OffsetDateTime::parse(&format!("{s}Z"), &Rfc3339))
        .ok()?;
    let secs = u64::try_from(parsed.unix_timestamp()).ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_nanos(parsed.nanosecond().into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(auth_type: &str) -> GlanceSection {
        GlanceSection {
            auth_type: auth_type.to_string().into(),
            username: "ironic".to_string(),
            password: "pw".to_string(),
            ..GlanceSection::default()
        }
    }

    #[test]
    fn tokens_url_with_or_without_v3() {
        assert_eq!(
            tokens_url("http://ks:5000"),
            "http://ks:5000/v3/auth/tokens"
        );
        assert_eq!(
            tokens_url("http://ks:5000/v3/"),
            "http://ks:5000/v3/auth/tokens"
        );
    }

    #[test]
    fn password_is_scoped_to_its_project() {
        let mut c = section("password");
        assert!(auth_request(&c).unwrap().get("scope").is_none());
        c.project_name = "service".to_string();
        let auth = auth_request(&c).unwrap();
        assert_eq!(auth["identity"]["methods"][0], "password");
        assert_eq!(auth["scope"]["project"]["name"], "service");
        assert_eq!(auth["scope"]["project"]["domain"]["id"], "default");
        c.project_id = "p1".to_string();
        assert_eq!(
            auth_request(&c).unwrap()["scope"]["project"],
            serde_json::json!({"id": "p1"})
        );
    }

    #[test]
    fn application_credential_carries_its_own_scope() {
        let mut c = section("v3applicationcredential");
        c.application_credential_id = "ac".to_string();
        c.project_id = "p1".to_string();
        let auth = auth_request(&c).unwrap();
        assert_eq!(auth["identity"]["application_credential"]["id"], "ac");
        assert!(auth.get("scope").is_none());
    }

    #[test]
    fn unknown_auth_type_is_refused() {
        let e = auth_request(&section("kerberos")).unwrap_err();
        assert_eq!(e.code, ErrorCode::SourceNotAllowed);
        assert_eq!(e.message, "[glance]auth_type \"kerberos\" is not supported");
    }

    #[test]
    fn iso8601() {
        let t = |s| {
            parse_iso8601(s)
                .unwrap()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs()
        };
        assert_eq!(t("1970-01-01T00:00:00Z"), 0);
        assert_eq!(t("2026-11-30T05:00:00.000000Z"), 1_796_014_800);
        assert_eq!(t("2000-03-01T00:00:00+00:00"), 951_868_800);
        assert!(parse_iso8601("yesterday").is_none());
    }

    #[test]
    fn iso8601_honours_offsets() {
        let t = |s| {
            parse_iso8601(s)
                .unwrap()
                .duration_since(UNIX_EPOCH)
                .unwrap()
        };
        // The same instant written in UTC and at +02:00.
        assert_eq!(t("2026-11-30T07:00:00+02:00").as_secs(), 1_796_014_800);
        assert_eq!(t("2026-11-30T05:00:00Z").as_secs(), 1_796_014_800);
        assert_eq!(t("2026-11-30T03:00:00-02:00").as_secs(), 1_796_014_800);
        // Keystone's microseconds are kept, and a missing offset means UTC.
        assert_eq!(
            t("2026-11-30T05:00:00.250000Z").as_millis(),
            1_796_014_800_250
        );
        assert_eq!(t("2026-11-30T05:00:00").as_secs(), 1_796_014_800);
        assert!(parse_iso8601("2026-13-01T00:00:00Z").is_none());
    }
}
