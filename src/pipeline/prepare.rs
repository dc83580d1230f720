//! Preparing a node: resolve the source and the expected checksum, reuse
//! the cached master when it is still good (computing digests it lacks) or
//! make a new one (`fetch`), link it for the node and say where it is
//! served. It knows nothing of the broker or HTTP serving: the served URL
//! is only a string built from the configuration.

use super::fetch::MasterFetch;
use super::verdict::{self, Fit, Formats, Verdict, Wanted, source_digest};
use super::{Pipeline, Released, Request, blocking};
use crate::error::{Error, ErrorCode, Result};
use crate::messages::{CacheOutcome, Completion, InstanceInfo};
use crate::node::NodeUuid;
use crate::sources::Source;
use crate::store::cache::{self, Master, MasterMeta};
use crate::store::checksum::{Algo, ChecksumSpec, Expected, parse_checksum_file};

impl Pipeline {
    /// Makes the image ready for `node` and fills `done` with where and
    /// how it is served.
    ///
    /// The steps that talk to a source (Glance, a checksum URL, a download)
    /// or hash a master are boxed: inline, their state would make the
    /// future of every request, a cache hit's too, kilobytes larger (12.5
    /// KiB instead of 3.7 KiB), and a request's future is moved several
    /// times on its way into a task.
    pub(super) async fn prepare(
        &self,
        node: &NodeUuid,
        req: &Request,
        done: &mut Completion,
    ) -> Result<Released> {
        // Before any work; again under the node lock before linking.
        self.check_not_stale(node, req)?;
        let image = Box::pin(self.resolve_image(req, done)).await?;
        match image.mode {
            Mode::Cache => {}
            Mode::PassThrough => {
                let answer = self.pass_through(&image.source, &image.href, image.spec, done);
                return Box::pin(answer).await.map(|()| Released::Done);
            }
            Mode::Validate => {
                let validated = self.validate_image(image, req, done);
                return Box::pin(validated).await.map(|_| Released::Done);
            }
        }
        let expected = Box::pin(self.expected_of(image.spec.clone(), &image.source)).await?;
        let (name, force_raw) = self.master_of(&image, req);
        let job = image.job(&name, expected.as_ref(), force_raw, req);
        let locked = self.prepare_locked(node, req, &job, done);
        self.locked(Some(node), &name, locked).await?;
        Ok(Released::Done)
    }

    /// What a prepare and a warm of `req`'s image decide before taking any
    /// lock: the source (an `oci://` one resolved to its blob), the name
    /// its master is recorded under, `instance_info` completed from Glance,
    /// the checksum asked for, and how `image_download_source` has it
    /// served.
    pub(super) async fn resolve_image(
        &self,
        req: &Request,
        done: &mut Completion,
    ) -> Result<ImagePlan> {
        let mode = self.download_source(&req.instance_info).to_string();
        let mut info = req.instance_info.clone();
        let (source, href) = Box::pin(self.source_of(req, &mode, &mut info, done)).await?;
        Box::pin(self.complete_from_glance(&source, &mut info)).await?;
        let spec = ChecksumSpec::from_fields(
            info.image_checksum.as_deref(),
            info.image_os_hash_algo.as_deref(),
            info.image_os_hash_value.as_deref(),
        )?;
        let mode = self.download_mode(&mode, &source)?;
        Ok(ImagePlan {
            source,
            href,
            info,
            spec,
            mode,
        })
    }

    /// `http` mode with validation: the image downloaded, verified and
    /// inspected (or found so in the cache) and the source's own URL
    /// answered; whether it was found in the cache.
    pub(super) async fn validate_image(
        &self,
        image: ImagePlan,
        req: &Request,
        done: &mut Completion,
    ) -> Result<CacheOutcome> {
        let expected = Box::pin(self.expected_of(image.spec.clone(), &image.source)).await?;
        let validated = self.validated_pass_through(
            &image.source,
            &image.href,
            expected,
            req,
            &image.info,
            done,
        );
        Box::pin(validated).await
    }

    /// The expected digest of the source bytes, when a checksum is given.
    pub(super) async fn expected_of(
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
    pub(super) fn master_of(&self, image: &ImagePlan, req: &Request) -> (String, bool) {
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
    /// in Ironic), else `[agent]`'s.
    fn download_source<'a>(&'a self, info: &'a InstanceInfo) -> &'a str {
        info.image_download_source
            .as_deref()
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .unwrap_or(&self.config.agent.image_download_source)
    }

    /// What `image_download_source` (the request's, else `[agent]`'s; an
    /// empty value is unset, as in Ironic's get_image_download_source) asks
    /// for this source.
    fn download_mode(&self, mode: &str, source: &Source) -> Result<Mode> {
        match (mode, source) {
            ("swift", _) => Err(Error::new(
                ErrorCode::SourceNotAllowed,
                "image_download_source=swift is not handled by this worker",
            )),
            ("http", Source::Http(_)) if self.validates_http_sources() => Ok(Mode::Validate),
            ("http", Source::Http(_)) => Ok(Mode::PassThrough),
            ("local" | "http", _) => Ok(Mode::Cache),
            (other, _) => Err(Error::new(
                ErrorCode::InvalidMessage,
                format!("unknown image_download_source {other:?}"),
            )),
        }
    }

    /// The part of a prepare made under the node's and the master's locks:
    /// reuse or make the master, link it for the node, fill `done`.
    async fn prepare_locked(
        &self,
        node: &NodeUuid,
        req: &Request,
        job: &MasterFetch<'_>,
        done: &mut Completion,
    ) -> Result<()> {
        // `_hold` keeps a new master linked (st_nlink > 1) until the node
        // links it, so no sweeper of unlinked files removes it in between.
        let Obtained {
            master,
            outcome,
            linked,
            hold: _hold,
        } = self
            .obtain_master(job, false, &|m| {
                self.links.disk_is(node, &m.path, &m.meta.sha256)
            })
            .await?;
        // The node may have moved on while the image was made (a cleanup
        // waits for this lock; a notification does not).
        self.check_not_stale(node, req)?;
        let linked_here = match outcome {
            CacheOutcome::Miss => !self.links.disk_is(node, &master.path, &master.meta.sha256),
            _ => !linked,
        };
        self.link_and_publish(node, &master, linked_here).await?;
        // Asked for now: not expired for another [cache]node_files_ttl.
        self.links.touch(node);
        if outcome == CacheOutcome::Miss {
            self.after_growth().await;
            self.refresh_cache_gauges().await;
        }
        tracing::info!(cache = ?outcome, master = %master.path.display(), "prepared");
        done.image_url = Some(format!(
            "{}/{}/{}",
            self.http_url, self.config.deploy.http_image_subdir, node
        ));
        fill_image(&master.meta, job.sha512, outcome, done);
        Ok(())
    }

    /// The master of `job`, under its master lock: the cached one when its
    /// record fits the request ([`verdict::judge`]; its missing digests
    /// computed first, its freshness asked of the source when no checksum
    /// was given), else a new one (`fetch_master`). What a prepare, a warm
    /// and a validated pass-through share; `as_fetched` when only the
    /// source's own bytes will do. A master `linked` says its node links
    /// already needs no freshness check (a repeated event).
    pub(super) async fn obtain_master(
        &self,
        job: &MasterFetch<'_>,
        as_fetched: bool,
        linked: &(dyn Fn(&Master) -> bool + Sync),
    ) -> Result<Obtained> {
        let want = self.wanted(job, as_fetched);
        let cached = match self.cache.load(job.name) {
            Some(m) if !matches!(verdict::judge(&m.meta, &want), Verdict::Unfit(_)) => {
                let completed = self.complete_digests(job.name, m, job.expected, job.sha512);
                Some(Box::pin(completed).await?)
            }
            _ => None,
        };
        if let Some(m) = cached {
            let linked = linked(&m);
            if let Some(fits) = Box::pin(self.still_fits(job, &want, &m, linked)).await? {
                fits?;
                return Ok(Obtained {
                    master: m,
                    outcome: CacheOutcome::Hit,
                    linked,
                    hold: None,
                });
            }
        }
        let (master, hold) = Box::pin(self.fetch_master(job)).await?;
        Ok(Obtained {
            master,
            outcome: CacheOutcome::Miss,
            linked: false,
            hold: Some(hold),
        })
    }

    /// Whether the cached master `m` (its digests completed) is the
    /// request's: `None` when it is not (a miss), else `Ok` or the error
    /// the request fails with. Freshness is asked of the source only when
    /// the verdict needs it and the node does not link `m` already.
    async fn still_fits(
        &self,
        job: &MasterFetch<'_>,
        want: &Wanted<'_>,
        m: &Master,
        linked: bool,
    ) -> Result<Option<Result<()>>> {
        let (fit, refusal) = match verdict::judge(&m.meta, want) {
            Verdict::Fits(fit) => (fit, None),
            Verdict::Refused(fit, e) => (fit, Some(e)),
            Verdict::Unfit(why) => {
                tracing::debug!(
                    master = job.name,
                    ?why,
                    "the cached master is not this request's"
                );
                return Ok(None);
            }
        };
        let fits = match fit {
            Fit::Verified => true,
            // Its digests were completed: a digest still unknown is not there.
            Fit::OnceHashed(_) => false,
            Fit::IfFresh => linked || self.is_fresh(job.source, &m.meta).await?,
        };
        if want.formats.is_none() && fits {
            warn_formats_unchecked(&m.meta.source_format);
        }
        Ok(fits.then(|| refusal.map_or(Ok(()), Err)))
    }

    /// What `job` wants of its master, as [`verdict::judge`] weighs it.
    pub(super) fn wanted<'a>(&'a self, job: &MasterFetch<'a>, as_fetched: bool) -> Wanted<'a> {
        Wanted {
            source: crate::secrets::redact_url(job.href),
            expected: job.expected,
            force_raw: job.force_raw,
            as_fetched,
            formats: self.formats(job.info),
        }
    }

    /// The formats a request takes (`None` with
    /// `[conductor]disable_deep_image_inspection`: not checked).
    pub(super) fn formats<'a>(&'a self, info: &'a InstanceInfo) -> Option<Formats<'a>> {
        let c = &self.config.conductor;
        (!c.disable_deep_image_inspection).then_some(Formats {
            declared: info.image_disk_format.as_deref(),
            permitted: &c.permitted_image_formats,
        })
    }

    /// Runs `work` (a prepare's, a warm's or a validation's) under master
    /// `name`'s lock, and first `node`'s when given. Lock files stay only
    /// while what they guard exists: a failure that leaves no master, or
    /// no files of the node, removes them.
    pub(super) async fn locked<T>(
        &self,
        node: Option<&NodeUuid>,
        name: &str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let mut node_lock = match node {
            Some(node) => Some(self.node_locks.acquire(node.as_str()).await?),
            None => None,
        };
        let mut master_lock = self.cache.lock(name).await?;
        let result = work.await;
        if result.is_err() {
            self.cache.release_failed(name, &mut master_lock);
            if let (Some(node), Some(lock)) = (node, node_lock.as_mut())
                && !self.has_node_files(node)
            {
                lock.remove_file();
            }
        }
        result
    }

    /// Links `master` for `node` when `linked_here` (a hard link made here;
    /// a copy across file systems on a blocking thread) and publishes the
    /// node's symlink; a link made for this prepare is taken back when the
    /// symlink cannot be published, as it would keep its master from ever
    /// being evicted.
    async fn link_and_publish(
        &self,
        node: &NodeUuid,
        master: &Master,
        linked_here: bool,
    ) -> Result<()> {
        if linked_here && !self.links.hard_link_disk(node, &master.path)? {
            let (links, node, path) = (self.links.clone(), node.clone(), master.path.clone());
            let sha256 = master.meta.sha256.clone();
            blocking(move || links.link_disk(&node, &path, &sha256)).await?;
        }
        match self.links.publish(node) {
            Ok(true) => self.metrics.cache.active_links.inc(),
            Ok(false) => {}
            Err(e) => {
                if linked_here {
                    let _ = self.links.remove_disk(node);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Computes from the master the digests its sidecar lacks and this
    /// request needs (the expected algorithm over the source bytes when the
    /// master is those very bytes; SHA-512 of the served bytes), instead of
    /// downloading again, and records them.
    async fn complete_digests(
        &self,
        name: &str,
        mut master: Master,
        expected: Option<&Expected>,
        want_sha512: bool,
    ) -> Result<Master> {
        let meta = &master.meta;
        let source_missing = expected
            .map(|e| e.algo)
            .filter(|&algo| source_digest(meta, algo).is_none() && meta.served_as_fetched());
        let served_missing = (want_sha512 && meta.sha512.is_none()).then_some(Algo::Sha512);
        let mut learnt = false;
        let mut missing: Vec<Algo> = [source_missing, served_missing]
            .into_iter()
            .flatten()
            .collect();
        missing.dedup();
        for algo in missing {
            let path = master.path.clone();
            let hex = blocking(move || cache::hash_file(&path, algo)).await?;
            tracing::info!(%algo, "computed a missing digest from the cached master");
            let meta = &mut master.meta;
            if meta.served_as_fetched() {
                set_source_digest(meta, algo, hex.clone());
            }
            if algo == Algo::Sha512 && (served_missing.is_some() || meta.served_as_fetched()) {
                meta.sha512 = Some(hex);
            }
            learnt = true;
        }
        if learnt {
            let (cache, name, meta) = (self.cache.clone(), name.to_string(), master.meta.clone());
            blocking(move || cache.write_meta(&name, &meta)).await?;
        }
        Ok(master)
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

    /// The request's source and the name its master is recorded under:
    /// `<id>` and `glance://<id>` are one image, recorded by its id; an
    /// `oci://` reference is resolved to its blob, recorded by its digest.
    async fn source_of(
        &self,
        req: &Request,
        mode: &str,
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
        mode: &str,
        info: &mut InstanceInfo,
        done: &mut Completion,
    ) -> Result<Source> {
        if mode == "swift" {
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
            .resolve_oci(r, credential, mode == "local", arch)
            .await?;
        let digest = &resolved.blob.digest;
        tracing::info!(source = %r.display(), manifest = %resolved.manifest_url, blob = %digest, "OCI reference resolved");
        info.image_checksum = None;
        info.image_os_hash_algo = Some(digest.algo.into());
        info.image_os_hash_value = Some(digest.hex.clone());
        if info.image_disk_format.is_none() {
            info.image_disk_format = resolved.disk_format.map(Into::into);
        }
        done.oci_image_manifest_url = Some(resolved.manifest_url);
        Ok(Source::OciBlob(resolved.blob))
    }

    /// `image_download_source = http` with an http(s) source: the agent
    /// downloads from the source itself, after a HEAD check, as Ironic does.
    pub(super) async fn pass_through(
        &self,
        source: &Source,
        href: &str,
        spec: Option<ChecksumSpec>,
        done: &mut Completion,
    ) -> Result<()> {
        let stat = self.fetcher.stat(source).await?;
        let expected = match spec {
            None => None,
            Some(spec) => Some(self.resolve_checksum(spec, source).await?),
        };
        done.image_url = Some(href.to_string());
        if let Some(e) = expected {
            if e.algo == Algo::Md5 {
                done.image_checksum = Some(e.hex);
            } else {
                done.image_os_hash_algo = Some(e.algo.name().into());
                done.image_os_hash_value = Some(e.hex);
            }
        }
        done.image_size = stat.size;
        done.converted = Some(false);
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

    /// Ironic's staleness rule for a master without an expected checksum: the
    /// source must say when it changed, and not after the master was fetched.
    pub(super) async fn is_fresh(&self, source: &Source, meta: &MasterMeta) -> Result<bool> {
        let stat = self.fetcher.stat(source).await?;
        Ok(stat
            .last_modified
            .is_some_and(|t| cache::unix_secs(t) <= meta.fetched_at))
    }
}

/// What a prepare or a warm resolved of its image before any lock (see
/// [`Pipeline::resolve_image`]).
pub(super) struct ImagePlan {
    /// Where the bytes come from (an `oci://` reference resolved to a blob).
    pub(super) source: Source,
    /// The name the master is recorded under (a Glance id, the blob, the URL).
    pub(super) href: String,
    /// `instance_info`, completed from Glance or the OCI registry.
    pub(super) info: InstanceInfo,
    /// The checksum asked for, not resolved yet.
    pub(super) spec: Option<ChecksumSpec>,
    /// How `image_download_source` has the image served.
    pub(super) mode: Mode,
}

impl ImagePlan {
    /// The download of this image into the master `name`.
    pub(super) fn job<'a>(
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
            sha512: expected.is_some_and(|e| e.algo == Algo::Sha512),
            force_raw,
            info: &self.info,
            slow: &req.slow,
        }
    }
}

/// A master obtained for a request (see [`Pipeline::obtain_master`]).
pub(super) struct Obtained {
    /// The verified master.
    pub(super) master: Master,
    /// Found in the cache or made now.
    pub(super) outcome: CacheOutcome,
    /// The prepare's node links this very master already.
    pub(super) linked: bool,
    /// A new master's hold: a hard link keeping it (`st_nlink > 1`, so no
    /// eviction takes it) until dropped.
    pub(super) hold: Option<crate::fsutil::TempGuard>,
}

/// What a request served from the master described by `meta` answers of
/// it: the checksums of exactly the served bytes, their format and size,
/// whether converted, hit or miss (everything but a prepare's URL).
pub(super) fn fill_image(
    meta: &MasterMeta,
    sha512: bool,
    outcome: CacheOutcome,
    done: &mut Completion,
) {
    done.image_checksum = Some(meta.md5.clone());
    let (algo, value) = match (&meta.sha512, sha512) {
        (Some(v), true) => ("sha512", v.clone()),
        _ => ("sha256", meta.sha256.clone()),
    };
    done.image_os_hash_algo = Some(algo.into());
    done.image_os_hash_value = Some(value);
    done.image_disk_format = Some(meta.disk_format.clone());
    done.image_size = Some(meta.size);
    done.converted = Some(meta.converted);
    done.cache = Some(outcome);
}

/// How a prepare answers, from `image_download_source` and the source.
pub(super) enum Mode {
    /// Cache (and convert) the image and serve it.
    Cache,
    /// `http` mode: answer the http(s) source's own URL after a HEAD check.
    PassThrough,
    /// `http` mode with `conductor_always_validates_images`: download and
    /// inspect first, then answer the source's own URL.
    Validate,
}

/// Says, once per request served from a master, that its format was not
/// checked against the declared and permitted ones.
pub(super) fn warn_formats_unchecked(format: &str) {
    tracing::warn!(
        format,
        "[conductor]disable_deep_image_inspection: the declared and permitted formats \
         are not checked"
    );
}

fn set_source_digest(meta: &mut MasterMeta, algo: Algo, hex: String) {
    match algo {
        Algo::Md5 => meta.source_md5 = Some(hex),
        Algo::Sha256 => meta.source_sha256 = Some(hex),
        Algo::Sha512 => meta.source_sha512 = Some(hex),
    }
}
