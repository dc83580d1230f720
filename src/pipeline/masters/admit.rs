//! What lets bytes stand as a request's master: what the request wants of
//! it, for [`super::verdict::judge`] (`wanted`, the formats it takes),
//! whether its source changed since it was fetched, and, for new bytes
//! (a download's or a peer's), the inspection against the request and the
//! commit into the cache. Shared below the steps that make a master, so
//! neither a download nor a peer's transfer needs the other.

use super::blocking;
use super::job::MasterFetch;
use super::verdict::{Formats, Wanted};
use crate::config::{ConductorSection, ConvertSection};
use crate::error::{Error, Result};
use crate::fsutil::TempGuard;
use crate::image::{inspect, qcow2};
use crate::image_format::Format;
use crate::messages::InstanceInfo;
use crate::sources::{Fetcher, Source};
use crate::store::cache::{self, Cache, Master, MasterMeta};
use std::path::Path;

/// Judges and commits masters (see the module): it holds the cache it
/// commits into, the client that asks a source whether it changed, and
/// the formats and qcow2 limits of its sections, nothing else.
pub(super) struct Admission {
    cache: Cache,
    fetcher: Fetcher,
    /// `[conductor]permitted_image_formats`; `None` with
    /// `disable_deep_image_inspection` (formats are not checked).
    permitted: Option<Vec<Format>>,
    /// `[convert]`'s bounds on a qcow2 header.
    qcow2_limits: qcow2::Limits,
}

impl Admission {
    /// The admission of masters into `cache` under these sections.
    pub(super) fn new(
        cache: Cache,
        fetcher: Fetcher,
        conductor: &ConductorSection,
        convert: &ConvertSection,
    ) -> Admission {
        Admission {
            cache,
            fetcher,
            permitted: (!conductor.disable_deep_image_inspection)
                .then(|| conductor.permitted_image_formats.clone()),
            qcow2_limits: convert.qcow2_limits(),
        }
    }

    /// Inspects the downloaded image: its format must be the declared one
    /// and permitted, and a qcow2 must pass the safety checks.
    pub(super) async fn inspect_download(
        &self,
        job: &MasterFetch<'_>,
        temp: &Path,
    ) -> Result<(inspect::Inspection, Option<crate::image::qcow2::Header>)> {
        let found = inspect::inspect_file(temp)?;
        self.check_declared_format(found.format, job.info)?;
        let qcow2 = inspect::spawn_safety_check(temp, &found, self.qcow2_limits).await?;
        Ok((found, qcow2))
    }

    /// The detected format must be the declared one and permitted, unless
    /// `[conductor]disable_deep_image_inspection` is set: then, as in
    /// Ironic, the detected format is only what decides the conversion
    /// (the structural checks of `inspect::spawn_safety_check` stay).
    pub(super) fn check_declared_format(&self, format: Format, info: &InstanceInfo) -> Result<()> {
        match self.formats(info) {
            Some(formats) => formats.check(format),
            None => {
                warn_formats_unchecked(format);
                Ok(())
            }
        }
    }

    /// Commits `temp` as the master `name` with its sidecar, holding it by a
    /// hard link first (see [`super::fetch::Maker::make`]).
    pub(super) async fn commit_master(
        &self,
        name: &str,
        temp: TempGuard,
        meta: MasterMeta,
    ) -> Result<(Master, TempGuard)> {
        let hold = TempGuard::new(self.cache.temp_path(name)?);
        let (cache, path, owned_name) = (
            self.cache.clone(),
            temp.path().to_path_buf(),
            name.to_string(),
        );
        let hold_path = hold.path().to_path_buf();
        // All on a blocking thread: the sync may write back gigabytes
        // (qemu-img writes its output through the page cache, unsynced).
        let master = blocking(move || {
            // Durable before it becomes a master; the writers sync what
            // they write (then this is cheap), except a download they were
            // told is scratch (one that is converted), never committed
            // itself, and qemu-img.
            std::fs::File::open(&path)
                .and_then(|f| f.sync_data())
                .map_err(|e| Error::io("sync the new master", e))?;
            std::fs::hard_link(&path, &hold_path)
                .map_err(|e| Error::io("hold the new master", e))?;
            cache.commit(&path, &owned_name, meta)
        })
        .await?;
        temp.keep();
        Ok((master, hold))
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
        self.permitted.as_deref().map(|permitted| Formats {
            declared: info.image_disk_format.as_deref(),
            permitted,
        })
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

/// Says, once per request served from a master, that its format was not
/// checked against the declared and permitted ones.
pub(super) fn warn_formats_unchecked(format: Format) {
    tracing::warn!(
        format = format.name(),
        "[conductor]disable_deep_image_inspection: the declared and permitted formats \
         are not checked"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    fn admission(deep_inspection: bool) -> (tempfile::TempDir, Admission) {
        let dir = tempfile::tempdir().unwrap();
        let config = crate::config::Config::default();
        let conductor = ConductorSection {
            disable_deep_image_inspection: !deep_inspection,
            ..config.conductor.clone()
        };
        let admission = Admission::new(
            Cache::open(dir.path()).unwrap(),
            Fetcher::new(&config).unwrap(),
            &conductor,
            &config.convert,
        );
        (dir, admission)
    }

    fn declared(format: &str) -> InstanceInfo {
        InstanceInfo {
            image_disk_format: Some(format.into()),
            ..InstanceInfo::default()
        }
    }

    #[test]
    fn a_format_other_than_the_declared_or_not_permitted_is_refused() {
        let (_dir, a) = admission(true);
        a.check_declared_format(Format::Qcow2, &declared("qcow2"))
            .unwrap();
        let other = a.check_declared_format(Format::Qcow2, &declared("raw"));
        assert_eq!(other.unwrap_err().code, ErrorCode::FormatMismatch);
        // Ironic's default list has no vmdk, declared or not.
        let vmdk = a.check_declared_format(Format::Vmdk, &declared("vmdk"));
        assert_eq!(vmdk.unwrap_err().code, ErrorCode::FormatNotPermitted);
    }

    #[test]
    fn without_deep_inspection_no_format_is_checked() {
        let (_dir, a) = admission(false);
        assert!(a.formats(&declared("raw")).is_none());
        a.check_declared_format(Format::Qcow2, &declared("raw"))
            .unwrap();
        a.check_declared_format(Format::Vmdk, &InstanceInfo::default())
            .unwrap();
    }
}
