//! What a prepare and a warm decide of their image before any lock: the
//! source (an `oci://` reference resolved to its blob), the name its
//! master is recorded under, `instance_info` completed from Glance or the
//! registry, the checksum asked for and resolved under Ironic's checksum
//! policy, and how `image_download_source` has the image served.

use super::Request;
use super::job::MasterFetch;
use crate::config::{AgentSection, ConductorSection, ImageDownloadSource};
use crate::error::{Error, ErrorCode, Result};
use crate::messages::{Completion, InstanceInfo};
use crate::sources::{Fetcher, Source};
use crate::store::cache;
use crate::store::checksum::{Algo, ChecksumSpec, Expected, parse_checksum_file};

/// Resolves requests' images before any lock (see the module). It holds
/// the clients of Glance and the registries and the options its decisions
/// read, nothing of the cache: a new kind of source or a checksum rule is
/// decided here alone.
pub(in crate::pipeline) struct Resolver {
    fetcher: Fetcher,
    /// `[agent]`: the default `image_download_source`, `stream_raw_images`,
    /// `allow_md5_checksum`, `served_md5`.
    agent: AgentSection,
    /// `[conductor]`: checksum files, validation of http sources, the
    /// directories `file://` sources may name.
    conductor: ConductorSection,
    /// `[DEFAULT] force_raw_images`.
    force_raw_images: bool,
}

impl Resolver {
    /// A resolver fetching metadata (Glance, registries, checksum files)
    /// with `fetcher` under the options of these sections.
    pub(super) fn new(
        fetcher: Fetcher,
        agent: &AgentSection,
        conductor: &ConductorSection,
        force_raw_images: bool,
    ) -> Resolver {
        Resolver {
            fetcher,
            agent: agent.clone(),
            conductor: conductor.clone(),
            force_raw_images,
        }
    }

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
            served_md5: self.agent.served_md5,
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
        let force_raw = req.options.force_raw.unwrap_or(self.force_raw_images)
            && req
                .options
                .stream_raw
                .unwrap_or(self.agent.stream_raw_images)
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
    /// refused by [`Resolver::download_mode`] once the source is known.
    fn download_source<'a>(&self, info: &'a InstanceInfo) -> DownloadSource<'a> {
        match info.image_download_source.as_deref().map(str::trim) {
            Some(word) if !word.is_empty() => word.parse().map_err(|_| word),
            _ => Ok(self.agent.image_download_source),
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
        let source = match Source::parse(href, &self.conductor.file_url_allowed_paths)? {
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
                if self.conductor.disable_support_for_checksum_files {
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
        if expected.algo == Algo::Md5 && !self.agent.allow_md5_checksum {
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
    fn validates_http_sources(&self) -> bool {
        let c = &self.conductor;
        c.conductor_always_validates_images && !c.disable_deep_image_inspection
    }
}

/// What a prepare or a warm resolved of its image before any lock (see
/// [`Resolver::resolve_image`]).
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
#[derive(Debug, PartialEq, Eq)]
pub(in crate::pipeline) enum Mode {
    /// Cache (and convert) the image and serve it.
    Cache,
    /// `http` mode: answer the http(s) source's own URL after a HEAD check.
    PassThrough,
    /// `http` mode with `conductor_always_validates_images`: download and
    /// inspect first, then answer the source's own URL.
    Validate,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::messages::inbound::{Inbound, parse_command};
    use serde_json::json;

    fn resolver(edit: impl FnOnce(&mut Config)) -> Resolver {
        let mut config = Config::default();
        edit(&mut config);
        let fetcher = Fetcher::new(&config).unwrap();
        Resolver::new(
            fetcher,
            &config.agent,
            &config.conductor,
            config.default.force_raw_images,
        )
    }

    /// A prepare of `instance_info` with `options`, as a command brings it.
    fn request(info: serde_json::Value, options: serde_json::Value) -> Request {
        let body = json!({
            "action": "prepare", "node_uuid": "1be26c0b-03f2-4d2e-ae87-c02d7f33c123",
            "instance_info": info, "options": options,
        });
        match parse_command(body.to_string().as_bytes(), "h") {
            Inbound::Work(r) => *r,
            other => panic!("{other:?}"),
        }
    }

    const URL: &str = "http://images.example/disk.qcow2";

    fn done() -> Completion {
        Completion::new(crate::messages::Action::Prepare, None, None, "h")
    }

    /// Resolves an http(s) source (nothing is fetched for one) and names
    /// its master.
    async fn master(r: &Resolver, req: &Request) -> (String, bool) {
        let image = r.resolve_image(req, &mut done()).await.unwrap();
        r.master_of(&image, req)
    }

    #[tokio::test]
    async fn a_whole_disk_image_is_converted_when_both_options_say_so() {
        let r = resolver(|_| {});
        let req = request(json!({"image_source": URL}), json!({}));
        let (name, converted) = master(&r, &req).await;
        assert_eq!(
            (&name, converted),
            (&cache::master_name(URL, None, true), true)
        );
        assert!(name.ends_with(".converted"));
    }

    #[tokio::test]
    async fn either_option_off_or_a_partition_image_keeps_the_image_as_it_is() {
        let plain = (cache::master_name(URL, None, false), false);
        let r = resolver(|_| {});
        for options in [json!({"force_raw": false}), json!({"stream_raw": false})] {
            let req = request(json!({"image_source": URL}), options);
            assert_eq!(master(&r, &req).await, plain);
        }
        let partition = json!({"image_source": URL, "kernel": "k", "ramdisk": "r"});
        assert_eq!(master(&r, &request(partition, json!({}))).await, plain);
        let r = resolver(|c| c.agent.stream_raw_images = false);
        let req = request(json!({"image_source": URL}), json!({}));
        assert_eq!(master(&r, &req).await, plain);
        // The request's option wins over the worker's.
        let req = request(json!({"image_source": URL}), json!({"stream_raw": true}));
        assert!(master(&r, &req).await.1);
    }

    #[test]
    fn a_glance_image_is_named_by_its_id_whatever_its_href() {
        let r = resolver(|_| {});
        let id = "8c2a6f2e-5d7b-4f7e-9d8e-0c1b2a3d4e5f";
        let req = request(json!({"image_source": format!("glance://{id}")}), json!({}));
        let image = ImagePlan {
            source: Source::Glance(id.into()),
            href: id.into(),
            info: req.instance_info.clone(),
            spec: None,
            mode: Mode::Cache,
            served_md5: true,
        };
        assert_eq!(r.master_of(&image, &req), (format!("{id}.converted"), true));
    }

    async fn mode(r: &Resolver, download_source: &str) -> Result<Mode> {
        let info = json!({"image_source": URL, "image_download_source": download_source});
        let req = request(info, json!({}));
        let image = r.resolve_image(&req, &mut done()).await?;
        Ok(image.mode)
    }

    #[tokio::test]
    async fn image_download_source_decides_how_an_http_source_is_answered() {
        let r = resolver(|_| {});
        assert_eq!(mode(&r, "local").await.unwrap(), Mode::Cache);
        // Empty is unset, as in Ironic: the worker's own (local).
        assert_eq!(mode(&r, " ").await.unwrap(), Mode::Cache);
        assert_eq!(mode(&r, "http").await.unwrap(), Mode::PassThrough);
        let swift = mode(&r, "swift").await.unwrap_err();
        assert_eq!(swift.code, ErrorCode::SourceNotAllowed);
        let unknown = mode(&r, "ftp").await.unwrap_err();
        assert_eq!(unknown.code, ErrorCode::InvalidMessage);
        let r = resolver(|c| c.conductor.conductor_always_validates_images = true);
        assert_eq!(mode(&r, "http").await.unwrap(), Mode::Validate);
        // Ironic inspects nothing without deep inspection.
        let r = resolver(|c| {
            c.conductor.conductor_always_validates_images = true;
            c.conductor.disable_deep_image_inspection = true;
        });
        assert_eq!(mode(&r, "http").await.unwrap(), Mode::PassThrough);
        let r = resolver(|c| c.agent.image_download_source = ImageDownloadSource::Http);
        assert_eq!(mode(&r, "").await.unwrap(), Mode::PassThrough);
    }

    #[tokio::test]
    async fn the_checksum_policy_refuses_md5_and_checksum_files_when_told() {
        let source = Source::parse(URL, &[]).unwrap();
        let md5 = || {
            ChecksumSpec::Value(Expected {
                algo: Algo::Md5,
                hex: "0".repeat(32),
            })
        };
        let r = resolver(|_| {});
        assert_eq!(
            r.resolve_checksum(md5(), &source).await.unwrap().algo,
            Algo::Md5
        );
        let r = resolver(|c| c.agent.allow_md5_checksum = false);
        let refused = r.resolve_checksum(md5(), &source).await.unwrap_err();
        assert_eq!(refused.code, ErrorCode::ChecksumNotPermitted);
        // Refused before any fetch: nothing listens on the URL's port.
        let r = resolver(|c| c.conductor.disable_support_for_checksum_files = true);
        let file = ChecksumSpec::Url {
            url: "http://127.0.0.1:9/SHA256SUMS".into(),
            algo: None,
        };
        let refused = r.resolve_checksum(file, &source).await.unwrap_err();
        assert_eq!(refused.code, ErrorCode::ChecksumNotPermitted);
    }
}
