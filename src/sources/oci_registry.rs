//! The HTTP side of OCI registry sources: the registry's transport (HTTPS,
//! or plain HTTP when `[oci]permit_fallback_to_http_transport` allows it),
//! its authentication (the `WWW-Authenticate` challenge: a Bearer token from
//! the token service named by `realm`, `service` and the repository's pull
//! `scope`, or Basic), manifests and indexes read bounded and checked
//! against their digest, the choice of the artifact (see `oci`), and the
//! blob request with redirects followed here: bounded, only to http(s), and
//! with the registry's `Authorization` header kept only for the registry
//! itself and `[oci]secure_cdn_registries`.
//!
//! Every request goes through the message client's address rules
//! (`http_client`): a reference cannot point the worker at its own
//! listeners, nor (by default) at local addresses through a redirect.

mod auth;

use auth::{may_carry_operator_credential, parse_challenge, token_from_answer, token_url};

use super::oci::{self, Credential, Descriptor, Digest, Document, OciRef, Reference};
use super::{Failure, check_status, request_failure};
use crate::config::{Config, OciSection};
use crate::error::{Error, ErrorCode, Result};
use crate::sources::Source;
use crate::sources::http_client::{self, BodyError, Purpose};
use reqwest::header::{ACCEPT, AUTHORIZATION, LOCATION, WWW_AUTHENTICATE};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Largest manifest or index read (the distribution registry's own limit).
pub(crate) const MAX_MANIFEST: usize = 4 << 20;

/// Largest token service answer read.
pub(crate) const MAX_TOKEN_BODY: usize = 1 << 20;

/// Most index entries whose manifests are fetched to find the artifact: an
/// index naming thousands of unusable manifests costs that many requests.
pub(crate) const MAX_CANDIDATES: usize = 16;

/// The registry client, shared by all requests.
pub struct Registry {
    client: reqwest::Client,
    oci: OciSection,
    /// Whole-request limit of everything but blob bodies.
    small_timeout: Duration,
    max_redirects: u32,
    allow_local: bool,
}

/// One repository of one registry as a request talks to it: where it
/// answered (https, or http after a fallback), the credential and the
/// `Authorization` value in use. Shared by the resolution and the blob
/// download, so a token is fetched once and renewed when refused.
pub struct Session {
    base: reqwest::Url,
    reference: OciRef,
    credential: Option<Credential>,
    authorization: Mutex<Option<String>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("base", &self.base.as_str())
            .field("repo", &self.reference.repo)
            .finish_non_exhaustive()
    }
}

/// The blob chosen for a reference: what is downloaded.
#[derive(Debug, Clone)]
pub struct OciBlob {
    /// The registry session that found it.
    pub session: Arc<Session>,
    /// The blob's URL at the registry.
    pub url: reqwest::Url,
    /// Its digest: what its bytes must hash to.
    pub digest: Digest,
    /// Its size, as the manifest states it.
    pub size: u64,
}

impl OciBlob {
    /// `oci://<registry>/<repo>@<blob digest>`.
    pub fn display(&self) -> String {
        self.session.reference.at(&self.digest)
    }
}

/// What a reference resolves to.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The blob to download.
    pub blob: OciBlob,
    /// The manifest that names it, as Ironic records it.
    pub manifest_url: String,
    /// The format the index's `disktype` declares, when chosen from one.
    pub disk_format: Option<&'static str>,
}

fn oci_error(code: ErrorCode, r: &OciRef, why: impl std::fmt::Display) -> Error {
    Error::new(code, format!("{}: {why}", r.display()))
}

impl Registry {
    /// The client for `[oci]`: the message client's limits and address
    /// rules, redirects followed by this module, TLS verified as
    /// `[oci]verify_ca` says.
    pub fn new(config: &Config) -> Result<Registry> {
        let oci = config.oci.clone();
        let verify = oci.verify_ca.trim();
        let insecure = match verify.to_ascii_lowercase().as_str() {
            "" => !config.source.verify_tls,
            "false" | "0" | "no" | "off" => true,
            _ => false,
        };
        let bundle = match verify.to_ascii_lowercase().as_str() {
            "" | "true" | "1" | "yes" | "on" | "false" | "0" | "no" | "off" => None,
            // As in Ironic, a path that does not exist means the system CAs.
            _ => std::fs::read(verify).ok(),
        };
        let roots = match bundle {
            None => Vec::new(),
            Some(pem) => reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                Error::new(
                    ErrorCode::Internal,
                    format!("[oci]verify_ca {verify}: not a PEM CA bundle: {e}"),
                )
            })?,
        };
        let client = http_client::build_with(config, Purpose::Message, insecure, |b| {
            let b = b.redirect(reqwest::redirect::Policy::none());
            if roots.is_empty() {
                b
            } else {
                b.tls_certs_only(roots)
            }
        })?;
        Ok(Registry {
            client,
            oci,
            small_timeout: Duration::from_secs(
                config
                    .source
                    .connect_timeout
                    .saturating_add(config.source.read_timeout),
            ),
            max_redirects: config.source.max_redirects,
            allow_local: config.source.allow_local_redirects,
        })
    }

    /// Resolves `r` to one blob as Ironic's `identify_specific_image` does:
    /// a digest is taken as it is (a manifest, or an index chosen from); a
    /// tag names an index whose entries are ranked by `disktype` (`local`:
    /// qcow2 first) and filtered by `cpu_arch`, the first single-layer
    /// manifest winning (a tag naming a single-layer manifest is taken too).
    pub(super) async fn resolve(
        &self,
        r: &OciRef,
        credential: Option<Credential>,
        local: bool,
        cpu_arch: Option<&str>,
    ) -> std::result::Result<Resolved, Failure> {
        let session = Arc::new(self.open(r, credential).await?);
        let (asked, expect) = match &r.reference {
            Reference::Tag(t) => (t.clone(), None),
            Reference::Digest(d) => (d.to_string(), Some(d)),
        };
        let (doc, ctype, digest) = self.manifest(&session, &asked, expect).await?;
        if !doc.is_index(&ctype) {
            return self.single_layer(&session, &doc, &digest, None);
        }
        let entries = doc.manifests.unwrap_or_default();
        let chosen = oci::candidates(&entries, local, cpu_arch);
        if chosen.is_empty() {
            return Err(Failure::Fatal(oci_error(
                ErrorCode::SourceNotFound,
                r,
                format!(
                    "none of the index's {} entries is a disk image (a disktype annotation \
                     of qcow2, qemu, raw or applehv) for cpu_arch {}",
                    entries.len(),
                    cpu_arch.unwrap_or("(any)")
                ),
            )));
        }
        for entry in chosen.into_iter().take(MAX_CANDIDATES) {
            let Some(d) = Digest::parse(&entry.digest) else {
                continue;
            };
            let (m, ctype, _) = self.manifest(&session, &d.to_string(), Some(&d)).await?;
            if m.is_index(&ctype) || m.layers.as_ref().is_none_or(|l| l.len() != 1) {
                tracing::info!(manifest = %d, "skipping an index entry that is not a single-layer artifact");
                continue;
            }
            let disktype = entry.annotations.get("disktype").map(String::as_str);
            return self.single_layer(&session, &m, &d, disktype.map(oci::disk_format_of));
        }
        Err(Failure::Fatal(oci_error(
            ErrorCode::SourceNotFound,
            r,
            "no disk-image entry of the index is a single-layer artifact",
        )))
    }

    /// The blob of a single-layer manifest `digest`.
    fn single_layer(
        &self,
        session: &Arc<Session>,
        manifest: &Document,
        digest: &Digest,
        disk_format: Option<&'static str>,
    ) -> std::result::Result<Resolved, Failure> {
        let r = &session.reference;
        let layers: &[Descriptor] = manifest.layers.as_deref().unwrap_or_default();
        let [layer] = layers else {
            return Err(Failure::Fatal(oci_error(
                ErrorCode::SourceNotFound,
                r,
                format!(
                    "manifest {digest} has {} layers: not a disk-image artifact (one layer)",
                    layers.len()
                ),
            )));
        };
        let blob_digest = Digest::parse(&layer.digest).ok_or_else(|| {
            Failure::Fatal(oci_error(
                ErrorCode::SourceUnreachable,
                r,
                format!("manifest {digest} names a layer without a usable digest"),
            ))
        })?;
        let url = session
            .base
            .join(&format!("{}/blobs/{blob_digest}", r.repo))
            .map_err(|e| Failure::Fatal(oci_error(ErrorCode::InvalidMessage, r, e)))?;
        Ok(Resolved {
            manifest_url: r.at(digest),
            disk_format,
            blob: OciBlob {
                session: session.clone(),
                url,
                digest: blob_digest,
                size: layer.size,
            },
        })
    }

    /// Finds the registry's transport (`GET /v2/` over HTTPS, then HTTP if
    /// permitted) and answers its challenge, if it makes one.
    async fn open(
        &self,
        r: &OciRef,
        credential: Option<Credential>,
    ) -> std::result::Result<Session, Failure> {
        let url = |scheme: &str| {
            reqwest::Url::parse(&format!("{scheme}://{}/v2/", r.registry))
                .map_err(|e| Failure::Fatal(oci_error(ErrorCode::InvalidMessage, r, e)))
        };
        let source = Source::Http(url("https")?);
        let mut base = url("https")?;
        let ping = match self.send(&base, None, "", &source, true).await {
            Err(Failure::Retry(e)) if self.oci.permit_fallback_to_http_transport => {
                tracing::info!(registry = r.registry, error = %e, "no HTTPS, trying plain HTTP ([oci]permit_fallback_to_http_transport)");
                base = url("http")?;
                self.send(&base, None, "", &Source::Http(base.clone()), true)
                    .await?
            }
            other => other?,
        };
        let session = Session {
            base,
            reference: r.clone(),
            credential,
            authorization: Mutex::new(None),
        };
        if ping.status() == reqwest::StatusCode::UNAUTHORIZED {
            self.authenticate(&session, &ping).await?;
        }
        Ok(session)
    }

    /// One GET of `url`, redirects followed here: at most `[source]
    /// max_redirects`, only to http(s), not to a URL naming a local address
    /// (unless `[source]allow_local_redirects`); `authorization` goes to
    /// the first host and, after a redirect, only to the same host or a
    /// secure CDN registry. `bounded` requests (all but blobs, whose bodies
    /// are bounded by the download's rate and deadline) end within
    /// `[source]connect_timeout + read_timeout`.
    async fn send(
        &self,
        url: &reqwest::Url,
        authorization: Option<&str>,
        accept: &str,
        source: &Source,
        bounded: bool,
    ) -> std::result::Result<reqwest::Response, Failure> {
        let origin = url.origin();
        let mut url = url.clone();
        let mut hops = 0;
        loop {
            let mut req = self.client.get(url.clone());
            let same = url.origin() == origin;
            let cdn = url.scheme() == "https" && self.secure_cdn(&url);
            if let Some(a) = authorization.filter(|_| same || cdn) {
                req = req.header(AUTHORIZATION, a);
            }
            if !accept.is_empty() {
                req = req.header(ACCEPT, accept);
            }
            if bounded {
                req = req.timeout(self.small_timeout);
            }
            let resp = req.send().await.map_err(|e| request_failure(source, e))?;
            if !resp.status().is_redirection() {
                return Ok(resp);
            }
            hops += 1;
            let next = resp
                .headers()
                .get(LOCATION)
                .and_then(|l| l.to_str().ok())
                .and_then(|l| url.join(l).ok());
            let refuse = |why: String| {
                Failure::Fatal(Error::new(
                    ErrorCode::SourceNotAllowed,
                    format!("{}: {why}", source.display()),
                ))
            };
            let Some(next) = next else {
                return Err(refuse(format!(
                    "{} redirects to no usable Location",
                    resp.status()
                )));
            };
            if hops > self.max_redirects {
                return Err(refuse(format!(
                    "more than {} redirects ([source]max_redirects)",
                    self.max_redirects
                )));
            }
            http_client::check_followed(&next, self.allow_local, "redirect")
                .map_err(|why| refuse(why.to_string()))?;
            url = next;
        }
    }

    /// Whether `url`'s host is, or is under, one of `[oci]secure_cdn_registries`.
    fn secure_cdn(&self, url: &reqwest::Url) -> bool {
        let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
        self.oci.secure_cdn_registries.iter().any(|h| {
            let h = h.trim().to_ascii_lowercase();
            !h.is_empty() && (host == h || host.ends_with(&format!(".{h}")))
        })
    }

    /// A GET within the session: with its `Authorization`, and after a 401
    /// once more with a new one from the challenge.
    async fn get_authed(
        &self,
        session: &Session,
        url: &reqwest::Url,
        accept: &str,
    ) -> std::result::Result<reqwest::Response, Failure> {
        let source = Source::Http(url.clone());
        for attempt in 0..2 {
            let auth = session.authorization();
            let resp = self
                .send(url, auth.as_deref(), accept, &source, !accept.is_empty())
                .await?;
            if resp.status() != reqwest::StatusCode::UNAUTHORIZED || attempt == 1 {
                return Ok(resp);
            }
            self.authenticate(session, &resp).await?;
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// Answers a 401's challenge: a Bearer token from the token service
    /// (with the credential as Basic, if there is one), or the credential
    /// itself for Basic. No credential for Basic, or a refused one, is
    /// `source_not_allowed`.
    async fn authenticate(
        &self,
        session: &Session,
        resp: &reqwest::Response,
    ) -> std::result::Result<(), Failure> {
        let r = &session.reference;
        let challenge = resp
            .headers()
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let (scheme, params) = parse_challenge(challenge);
        // The request's own secret, else the operator's for the registry
        // as the reference names it, port included (as docker matches
        // `auths` keys), never by what the registry says.
        let (credential, operators) = match session.credential.clone() {
            Some(c) => (Some(c), false),
            None => (
                oci::credential_from_config(&self.oci.authentication_config, &r.registry),
                true,
            ),
        };
        let value = match scheme.as_str() {
            "bearer" => {
                let credential = credential.clone().filter(|_| {
                    !operators || may_carry_operator_credential(&params, &session.base)
                });
                let token = self.token(session, &params, credential.as_ref()).await?;
                format!("Bearer {token}")
            }
            "basic" => match credential {
                Some(c) => c.basic_header(),
                None => return Err(Failure::Fatal(needs_credentials(r))),
            },
            _ => {
                return Err(Failure::Fatal(oci_error(
                    ErrorCode::SourceNotAllowed,
                    r,
                    format!("the registry asks for an unsupported authentication ({scheme:?})"),
                )));
            }
        };
        *session
            .authorization
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(value);
        Ok(())
    }

    /// A pull token for the session's repository from the token service
    /// the registry names (`realm`), held to the address rules of any URL
    /// a message did not name itself.
    async fn token(
        &self,
        session: &Session,
        params: &std::collections::BTreeMap<String, String>,
        credential: Option<&Credential>,
    ) -> std::result::Result<String, Failure> {
        let r = &session.reference;
        let (realm, url) = token_url(r, params, self.allow_local).map_err(Failure::Fatal)?;
        let source = Source::Http(realm);
        let auth = credential.map(Credential::basic_header);
        let resp = self
            .send(&url, auth.as_deref(), "application/json", &source, true)
            .await?;
        if matches!(resp.status().as_u16(), 401 | 403) {
            return Err(Failure::Fatal(match credential {
                Some(_) => oci_error(
                    ErrorCode::SourceNotAllowed,
                    r,
                    format!(
                        "the token service refused the credentials ({})",
                        resp.status()
                    ),
                ),
                None => needs_credentials(r),
            }));
        }
        check_status(&source, resp.status())?;
        let body = read_bounded(resp, MAX_TOKEN_BODY, &source, "token answer").await?;
        token_from_answer(r, &body).map_err(Failure::Fatal)
    }

    /// A manifest or index by tag or digest: read bounded, checked against
    /// `expect` when given; returns it with its content type and digest.
    async fn manifest(
        &self,
        session: &Session,
        reference: &str,
        expect: Option<&Digest>,
    ) -> std::result::Result<(Document, String, Digest), Failure> {
        let r = &session.reference;
        let url = session
            .base
            .join(&format!("{}/manifests/{reference}", r.repo))
            .map_err(|e| Failure::Fatal(oci_error(ErrorCode::InvalidMessage, r, e)))?;
        let accept = oci::INDEX_TYPES
            .iter()
            .chain(oci::MANIFEST_TYPES.iter())
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        let resp = self.get_authed(session, &url, &accept).await?;
        let source = Source::Http(url.clone());
        status_of(session, &source, resp.status(), "manifest")?;
        let ctype = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let body = read_bounded(resp, MAX_MANIFEST, &source, "manifest").await?;
        let got = Digest::of(expect.map_or("sha256", |d| d.algo), &body);
        if let Some(want) = expect.filter(|w| **w != got) {
            return Err(Failure::Fatal(oci_error(
                ErrorCode::ChecksumMismatch,
                r,
                format!("the registry's manifest {want} has the digest {got}"),
            )));
        }
        let doc: Document = serde_json::from_slice(&body).map_err(|e| {
            Failure::Fatal(oci_error(
                ErrorCode::SourceUnreachable,
                r,
                format!("unreadable manifest {reference}: {e}"),
            ))
        })?;
        Ok((doc, ctype, got))
    }

    /// The blob's response, ready to stream (status checked).
    pub(super) async fn blob_response(
        &self,
        blob: &OciBlob,
        source: &Source,
    ) -> std::result::Result<reqwest::Response, Failure> {
        let resp = self.get_authed(&blob.session, &blob.url, "").await?;
        status_of(&blob.session, source, resp.status(), "blob")?;
        Ok(resp)
    }
}

impl Session {
    fn authorization(&self) -> Option<String> {
        self.authorization
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn needs_credentials(r: &OciRef) -> Error {
    oci_error(
        ErrorCode::SourceNotAllowed,
        r,
        "the registry requires credentials: instance_info.image_pull_secret, \
         driver_info.image_pull_secret or [oci]authentication_config",
    )
}

/// The status of a registry answer: 401 after authenticating is refused
/// credentials, anything else as for any source.
fn status_of(
    session: &Session,
    source: &Source,
    status: reqwest::StatusCode,
    what: &str,
) -> std::result::Result<(), Failure> {
    let r = &session.reference;
    if matches!(status.as_u16(), 401 | 403) {
        return Err(Failure::Fatal(if session.authorization().is_some() {
            oci_error(
                ErrorCode::SourceNotAllowed,
                r,
                format!("the registry refused the credentials for the {what} ({status})"),
            )
        } else {
            needs_credentials(r)
        }));
    }
    check_status(source, status)
}

async fn read_bounded(
    resp: reqwest::Response,
    limit: usize,
    source: &Source,
    what: &str,
) -> std::result::Result<Vec<u8>, Failure> {
    match http_client::read_limited(resp, limit).await {
        Ok(b) => Ok(b),
        Err(BodyError::TooLarge) => Err(Failure::Fatal(Error::new(
            ErrorCode::SourceUnreachable,
            format!(
                "{}: the {what} is larger than {} KiB",
                source.display(),
                limit >> 10
            ),
        ))),
        Err(BodyError::Transport(e)) => Err(request_failure(source, e)),
    }
}
