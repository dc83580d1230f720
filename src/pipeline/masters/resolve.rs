//! What a prepare and a warm decide of their image before any lock: the
//! source (an `oci://` reference resolved to its blob), the name its
//! master is recorded under, `instance_info` completed from Glance or the
//! registry, the checksum asked for and resolved under Ironic's checksum
//! policy, and how `image_download_source` has the image served.

use super::job::MasterFetch;
use super::{Masters, Request};
use crate::config::ImageDownloadSource;
use crate::error::{Error, ErrorCode, Result};
use crate::messages::{Completion, InstanceInfo};
use crate::sources::Source;
use crate::store::cache;
use crate::store::checksum::{Algo, ChecksumSpec, Expected, parse_checksum_file};

impl Masters {
    /// What a prepare and a warm of `req`'s image decide before taking any
    /// lock: the source (an `oci://` one resolved to its blob), the name
    /// its master is recorded under, `instance_info` completed from Glance,
    /// the checksum asked for, and how `image_download_source` has it
    /// served.
    pub(in crate::pipeline) async fn resolve_image(
        &self,
        req: &Request,
        done: &mut Completion,
    ) -> Result<ImagePlan> {
        let mode = self.download_source(&req.instance_info);
        let mut info = req.instance_info.clone();
        let (source, href) = Box::pin(self.source_of(req, mode, &mut info, done)).await?;
        Box::pin(self.complete_from_glance(&source, &mut info)).await?;
        let spec = ChecksumSpec::from_fields(
            info.image_checksum.as_deref(),
            info.image_os_hash_algo.as_deref(),
            info.image_os_hash_value.as_deref(),
        )?;
        let mode = self.download_mode(mode, &source)?;
        Ok(ImagePlan {
            source,
            href,
            info,
            spec,
            mode,
            served_md5: self.config.agent.served_md5,
        })
    }

    /// The expected digest of the source bytes, when a checksum is given.
    pub(in crate::pipeline) async fn expected_of(
        &self,
        spec: Option<ChecksumSpec>,
        source: &Source,
    ) -> Result<Option<Expected>> {
        match spec {
            None => Ok(None),
            Some(spec) => Ok(Some(Box::pin(self.resolve_checksum(spec, source)).await?)),
        }
    }

    /// The master's name and whether it is converted to raw: Ironic's
    /// rule (`force_raw_images` and `stream_raw_images`, the request's
    /// overrides first, for a whole-disk image).
    pub(in crate::pipeline) fn master_of(
        &self,
        image: &ImagePlan,
        req: &Request,
    ) -> (String, bool) {
        let force_raw = req
            .options
            .force_raw
            .unwrap_or(self.config.default.force_raw_images)
            && req
                .options
                .stream_raw
                .unwrap_or(self.config.agent.stream_raw_images)
            && image.info.is_whole_disk();
        let glance = match &image.source {
            Source::Glance(id) => Some(id.as_str()),
            _ => None,
        };
        (
            cache::master_name(&image.href, glance, force_raw),
            force_raw,
        )
    }

    /// The node's `image_download_source` (an empty one counts as unset, as
    /// in Ironic), else `[agent]`'s; `Err` holds a request's unknown word,
    /// refused by [`Masters::download_mode`] once the source is known.
    fn download_source<'a>(&self, info: &'a InstanceInfo) -> DownloadSource<'a> {
        match info.image_download_source.as_deref().map(str::trim) {
            Some(word) if !word.is_empty() => word.parse().map_err(|_| word),
            _ => Ok(self.config.agent.image_download_source),
        }
    }

    /// What `image_download_source` (the request's, else `[agent]`'s; an
    /// empty value is unset, as in Ironic's get_image_download_source) asks
    /// for this source.
    fn download_mode(&self, mode: DownloadSource, source: &Source) -> Result<Mode> {
        use ImageDownloadSource::{Http, Local, Swift};
        match (mode, source) {
            (Ok(Swift), _) => Err(Error::new(
                ErrorCode::SourceNotAllowed,
                "image_download_source=swift is not handled by this worker",
            )),
            (Ok(Http), Source::Http(_)) if self.validates_http_sources() => Ok(Mode::Validate),
            (Ok(Http), Source::Http(_)) => Ok(Mode::PassThrough),
            (Ok(Local | Http), _) => Ok(Mode::Cache),
            (Err(other), _) => Err(Error::new(
                ErrorCode::InvalidMessage,
                format!("unknown image_download_source {other:?}"),
            )),
        }
    }

    /// The request's source and the name its master is recorded under:
    /// `<id>` and `glance://<id>` are one image, recorded by its id; an
    /// `oci://` reference is resolved to its blob, recorded by its digest.
    async fn source_of(
        &self,
        req: &Request,
        mode: DownloadSource<'_>,
        info: &mut InstanceInfo,
        done: &mut Completion,
    ) -> Result<(Source, String)> {
        let href = req
            .instance_info
            .image_source
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::InvalidMessage,
                    "instance_info.image_source is required",
                )
            })?;
        let source = match Source::parse(href, &self.config)? {
            Source::Oci(r) => self.resolve_oci(&r, req, mode, info, done).await?,
            other => other,
        };
        let href = match &source {
            Source::Glance(id) => id.clone(),
            Source::OciBlob(b) => b.display(),
            _ => href.to_string(),
        };
        Ok((source, href))
    }

    /// For an `oci://` source: the blob it resolves to (with the request's
    /// pull secret, else the node's), and what Ironic takes from the
    /// registry instead of `instance_info`: the blob's digest is the
    /// checksum (`image_checksum` is ignored, as Ironic ignores it), the
    /// index's `disktype` the declared format when none is, and the
    /// manifest URL goes into the completion.
    async fn resolve_oci(
        &self,
        r: &crate::sources::oci::OciRef,
        req: &Request,
        mode: DownloadSource<'_>,
        info: &mut InstanceInfo,
        done: &mut Completion,
    ) -> Result<Source> {
        if mode == Ok(ImageDownloadSource::Swift) {
            return Err(Error::new(
                ErrorCode::SourceNotAllowed,
                "image_download_source=swift cannot fetch from an OCI registry",
            ));
        }
        let credential = [&info.image_pull_secret, &req.node_info.image_pull_secret]
            .into_iter()
            .flatten()
            .find(|s| !s.0.trim().is_empty())
            .map(|s| crate::sources::oci::Credential::from_secret(&s.0));
        let arch = req.node_info.cpu_arch.as_deref();
        let resolved = self
            .fetcher
            .resolve_oci(r, credential, mode == Ok(ImageDownloadSource::Local), arch)
            .await?;
        let digest = &resolved.blob.digest;
        tracing::info!(source = %r.display(), manifest = %crate::secrets::redact_url(&resolved.manifest_url), blob = %digest, "OCI reference resolved");
        info.image_checksum = None;
        info.image_os_hash_algo = Some(digest.algo.into());
        info.image_os_hash_value = Some(digest.hex.clone());
        if info.image_disk_format.is_none() {
            info.image_disk_format = resolved.disk_format.map(Into::into);
        }
        done.oci_image_manifest_url = Some(resolved.manifest_url);
        Ok(Source::OciBlob(resolved.blob))
    }

    /// For a Glance image, what Glance says completes `instance_info`: its
    /// checksums when Ironic passed none, its disk format when none was
    /// declared (Ironic copies both from Glance when it deploys).
    async fn complete_from_glance(&self, source: &Source, info: &mut InstanceInfo) -> Result<()> {
        let Source::Glance(id) = source else {
            return Ok(());
        };
        let meta = self.fetcher.glance().image(id).await?;
        let no_checksum = info.image_checksum.is_none()
            && info.image_os_hash_algo.is_none()
            && info.image_os_hash_value.is_none();
        if no_checksum {
            if meta.os_hash_algo.is_some() && meta.os_hash_value.is_some() {
                info.image_os_hash_algo = meta.os_hash_algo;
                info.image_os_hash_value = meta.os_hash_value;
            } else {
                info.image_checksum = meta.checksum;
            }
        }
        if info.image_disk_format.is_none() {
            info.image_disk_format = meta.disk_format;
        }
        Ok(())
    }

    /// The digest the source bytes must have, fetched from its checksum
    /// file when it is one, under Ironic's checksum policy: no checksum
    /// file with `[conductor]disable_support_for_checksum_files`, no MD5
    /// without `[agent]allow_md5_checksum` (whether given inline or found
    /// in a checksum file).
    pub(super) async fn resolve_checksum(
        &self,
        spec: ChecksumSpec,
        source: &Source,
    ) -> Result<Expected> {
        let expected = match spec {
            ChecksumSpec::Value(e) => e,
            ChecksumSpec::Url { url, algo } => {
                if self.config.conductor.disable_support_for_checksum_files {
                    return Err(Error::new(
                        ErrorCode::ChecksumNotPermitted,
                        format!(
                            "the checksum is a checksum file URL ({}) and \
                             [conductor]disable_support_for_checksum_files is true",
                            crate::secrets::redact_url(&url)
                        ),
                    ));
                }
                let text = self.fetcher.fetch_text(&url).await?;
                parse_checksum_file(&text, &source.file_name(), algo)?
            }
        };
        if expected.algo == Algo::Md5 && !self.config.agent.allow_md5_checksum {
            return Err(Error::new(
                ErrorCode::ChecksumNotPermitted,
                "the only checksum given is MD5 and [agent]allow_md5_checksum is false; \
                 give a SHA-256 or SHA-512 one (image_os_hash_algo/image_os_hash_value, \
                 or sha256:<hex>)",
            ));
        }
        Ok(expected)
    }

    /// Whether an http(s) source in `http` mode is inspected before its URL
    /// is answered: `conductor_always_validates_images`, unless deep image
    /// inspection is disabled (Ironic then inspects nothing).
    pub(super) fn validates_http_sources(&self) -> bool {
        let c = &self.config.conductor;
        c.conductor_always_validates_images && !c.disable_deep_image_inspection
    }
}

/// What a prepare or a warm resolved of its image before any lock (see
/// [`Masters::resolve_image`]).
pub(in crate::pipeline) struct ImagePlan {
    /// Where the bytes come from (an `oci://` reference resolved to a blob).
    pub(in crate::pipeline) source: Source,
    /// The name the master is recorded under (a Glance id, the blob, the URL).
    pub(in crate::pipeline) href: String,
    /// `instance_info`, completed from Glance or the OCI registry.
    pub(in crate::pipeline) info: InstanceInfo,
    /// The checksum asked for, not resolved yet.
    pub(in crate::pipeline) spec: Option<ChecksumSpec>,
    /// How `image_download_source` has the image served.
    pub(in crate::pipeline) mode: Mode,
    /// `[agent] served_md5`.
    served_md5: bool,
}

impl ImagePlan {
    /// The download of this image into the master `name`.
    pub(in crate::pipeline) fn job<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a Expected>,
        force_raw: bool,
        req: &'a Request,
    ) -> MasterFetch<'a> {
        MasterFetch {
            source: &self.source,
            href: &self.href,
            name,
            expected,
            served: super::job::served(self.served_md5, expected),
            force_raw,
            info: &self.info,
            slow: &req.slow,
            turn: &req.turn,
        }
    }
}

/// A request's `image_download_source`, or the unknown word it gave.
type DownloadSource<'a> = std::result::Result<ImageDownloadSource, &'a str>;

/// How a prepare answers, from `image_download_source` and the source.
pub(in crate::pipeline) enum Mode {
    /// Cache (and convert) the image and serve it.
    Cache,
    /// `http` mode: answer the http(s) source's own URL after a HEAD check.
    PassThrough,
    /// `http` mode with `conductor_always_validates_images`: download and
    /// inspect first, then answer the source's own URL.
    Validate,
}
