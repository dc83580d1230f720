//! The master of a request, under the locks that guard it: the cached one
//! when its record fits the request ([`super::verdict::judge`], its
//! missing digests computed from its bytes first), else a new one
//! (`fetch`); and what a request answers of the master it was served.
//! What a prepare, a warm and a validated pass-through share, the
//! [`Obtainer`]'s work.

use super::admit::Admission;
use super::blocking;
use super::fetch::Maker;
use super::job::MasterFetch;
use super::verdict::{self, Fit, Verdict, Wanted, source_digest};
use crate::error::Result;
use crate::messages::{CacheOutcome, Completion};
use crate::store::cache::{self, Cache, Master, MasterMeta};
use crate::store::checksum::{Algo, Expected};
use std::sync::Arc;

/// Obtains requests' masters (see the module): it holds the cache the
/// masters are found in and locked by, the admission that says what a
/// request wants, and the maker of new masters, nothing else.
pub(super) struct Obtainer {
    cache: Cache,
    admission: Arc<Admission>,
    maker: Maker,
}

impl Obtainer {
    /// Obtains masters from `cache`, or made by `maker`, as `admission`
    /// judges them.
    pub(super) fn new(cache: Cache, admission: Arc<Admission>, maker: Maker) -> Obtainer {
        Obtainer {
            cache,
            admission,
            maker,
        }
    }

    /// The master of `job`, under its master lock: the cached one when its
    /// record fits the request ([`verdict::judge`]; its missing digests
    /// computed first, its freshness asked of the source when no checksum
    /// was given), else a new one ([`Maker::make`]). What a prepare, a warm
    /// and a validated pass-through share; `as_fetched` when only the
    /// source's own bytes will do. A master `linked` says its node links
    /// already needs no freshness check (a repeated event).
    pub(super) async fn obtain(
        &self,
        job: &MasterFetch<'_>,
        as_fetched: bool,
        linked: &(dyn Fn(&Master) -> bool + Sync),
    ) -> Result<Obtained> {
        let want = self.admission.wanted(job, as_fetched);
        let cached = match self.cache.load(job.name) {
            Some(m) if !matches!(verdict::judge(&m.meta, &want), Verdict::Unfit(_)) => {
                let completed = self.complete_digests(job.name, m, job.expected, job.served);
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
        let (master, hold) = Box::pin(self.maker.make(job)).await?;
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
            Fit::IfFresh => linked || self.admission.is_fresh(job.source, &m.meta).await?,
        };
        if want.formats.is_none() && fits {
            super::admit::warn_formats_unchecked(m.meta.source_format);
        }
        Ok(fits.then(|| refusal.map_or(Ok(()), Err)))
    }

    /// Runs `work` (a prepare's, a warm's or a validation's) under master
    /// `name`'s lock. The lock file stays only while its master exists: a
    /// failure that leaves no master removes it.
    pub(super) async fn locked<T>(
        &self,
        name: &str,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let mut master_lock = self.cache.lock(name).await?;
        let result = work.await;
        if result.is_err() {
            self.cache.release_failed(name, &mut master_lock);
        }
        result
    }

    /// Computes from the master the digests its sidecar lacks and this
    /// request needs (the expected algorithm over the source bytes when the
    /// master is those very bytes; SHA-512 and MD5 of the served bytes when
    /// `served` wants them: a master made with `[agent] served_md5 = false`
    /// has no MD5), instead of downloading again, and records them.
    async fn complete_digests(
        &self,
        name: &str,
        mut master: Master,
        expected: Option<&Expected>,
        served: crate::store::sink::Served,
    ) -> Result<Master> {
        let meta = &master.meta;
        let source_missing = expected
            .map(|e| e.algo)
            .filter(|&algo| source_digest(meta, algo).is_none() && meta.served_as_fetched());
        let sha512_missing = (served.sha512 && meta.sha512.is_none()).then_some(Algo::Sha512);
        let md5_missing = (served.md5 && meta.md5.is_none()).then_some(Algo::Md5);
        let mut learnt = false;
        let mut missing: Vec<Algo> = [source_missing, sha512_missing, md5_missing]
            .into_iter()
            .flatten()
            .collect();
        missing.sort_by_key(|a| a.name());
        missing.dedup();
        for algo in missing {
            let path = master.path.clone();
            let hex = blocking(move || cache::hash_file(&path, algo)).await?;
            tracing::info!(%algo, "computed a missing digest from the cached master");
            let meta = &mut master.meta;
            if meta.served_as_fetched() {
                set_source_digest(meta, algo, hex.clone());
            }
            match algo {
                Algo::Sha512 if sha512_missing.is_some() || meta.served_as_fetched() => {
                    meta.sha512 = Some(hex)
                }
                Algo::Md5 if meta.md5.is_none() => meta.md5 = Some(hex),
                _ => {}
            }
            learnt = true;
        }
        if learnt {
            let (cache, name, meta) = (self.cache.clone(), name.to_string(), master.meta.clone());
            blocking(move || cache.write_meta(&name, &meta)).await?;
        }
        Ok(master)
    }
}

/// A master obtained for a request (see [`Obtainer::obtain`]).
pub(in crate::pipeline) struct Obtained {
    /// The verified master.
    pub(in crate::pipeline) master: Master,
    /// Found in the cache or made now.
    pub(in crate::pipeline) outcome: CacheOutcome,
    /// The prepare's node links this very master already.
    pub(in crate::pipeline) linked: bool,
    /// A new master's hold: a hard link keeping it (`st_nlink > 1`, so no
    /// eviction takes it) until dropped.
    pub(in crate::pipeline) hold: Option<crate::fsutil::TempGuard>,
}

/// What a request served from the master described by `meta` answers of
/// it: the checksums of exactly the served bytes, their format and size,
/// whether converted, hit or miss (everything but a prepare's URL). The
/// MD5 (`image_checksum`) only when `served` has it: without it, Ironic
/// verifies with `image_os_hash_*` alone, as after its own conversions.
pub(in crate::pipeline) fn fill_image(
    meta: &MasterMeta,
    served: crate::store::sink::Served,
    outcome: CacheOutcome,
    done: &mut Completion,
) {
    done.image_checksum = meta.md5.clone().filter(|_| served.md5);
    let (algo, value) = match (&meta.sha512, served.sha512) {
        (Some(v), true) => ("sha512", v.clone()),
        _ => ("sha256", meta.sha256.clone()),
    };
    done.image_os_hash_algo = Some(algo.into());
    done.image_os_hash_value = Some(value);
    done.image_disk_format = Some(meta.disk_format.name().into());
    done.image_size = Some(meta.size);
    done.converted = Some(meta.converted);
    done.cache = Some(outcome);
}

fn set_source_digest(meta: &mut MasterMeta, algo: Algo, hex: String) {
    match algo {
        Algo::Md5 => meta.source_md5 = Some(hex),
        Algo::Sha256 => meta.source_sha256 = Some(hex),
        Algo::Sha512 => meta.source_sha512 = Some(hex),
    }
}

#[cfg(test)]
mod tests {
    use super::super::job::TestJob;
    use super::*;
    use crate::image_format::Format;

    /// A source nothing answers at: a miss would fail, so a test that
    /// passes obtained its master from the cache.
    const HREF: &str = "http://127.0.0.1:9/disk.img";
    const BYTES: &[u8] = b"the master's bytes";

    /// The masters of a worker whose cache is `dir`.
    fn masters(dir: &std::path::Path) -> super::super::Masters {
        super::super::Masters::for_test(dir, "me")
    }

    fn sha256(b: &[u8]) -> String {
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b))
    }

    /// Commits `BYTES` as a raw master `name` of `HREF`, served as
    /// fetched, with their SHA-256 and MD5 recorded and no SHA-512.
    fn commit(masters: &super::super::Masters, name: &str) {
        let cache = masters.cache();
        let temp = cache.temp_path(name).unwrap();
        std::fs::write(&temp, BYTES).unwrap();
        let meta = MasterMeta {
            source: HREF.into(),
            fetched_at: 1,
            source_last_modified: None,
            source_size: BYTES.len() as u64,
            source_md5: Some("md5".into()),
            source_sha256: Some(sha256(BYTES)),
            source_sha512: None,
            source_format: Format::Raw,
            converted: false,
            disk_format: Format::Raw.served(),
            size: BYTES.len() as u64,
            md5: Some("md5".into()),
            sha256: sha256(BYTES),
            sha512: None,
            inode: 0,
        };
        cache.commit(&temp, name, meta).unwrap();
    }

    /// A cached master whose record has the expected checksum is the
    /// request's: a hit, with no hold and no download.
    #[tokio::test]
    async fn a_cached_master_with_the_expected_checksum_is_a_hit() {
        let dir = tempfile::tempdir().unwrap();
        let masters = masters(dir.path());
        commit(&masters, "m");
        let fixture = TestJob::new(HREF);
        let expected = Expected {
            algo: Algo::Sha256,
            hex: sha256(BYTES),
        };
        let job = fixture.job(Some(&expected), false, false);
        let got = masters
            .obtain_master(&job, false, &|_| false)
            .await
            .unwrap();
        assert_eq!(got.outcome, CacheOutcome::Hit);
        assert!(got.hold.is_none());
        assert!(!got.linked);
        assert_eq!(got.master.meta.sha256, sha256(BYTES));
    }

    /// A digest the request needs and the record lacks is computed from
    /// the cached master's bytes and recorded, instead of downloading.
    #[tokio::test]
    async fn a_missing_digest_is_computed_from_the_cached_master() {
        let dir = tempfile::tempdir().unwrap();
        let masters = masters(dir.path());
        commit(&masters, "m");
        let fixture = TestJob::new(HREF);
        let expected = Expected {
            algo: Algo::Sha512,
            hex: hex::encode(<sha2::Sha512 as sha2::Digest>::digest(BYTES)),
        };
        let job = fixture.job(Some(&expected), true, false);
        let got = masters
            .obtain_master(&job, false, &|_| false)
            .await
            .unwrap();
        assert_eq!(got.outcome, CacheOutcome::Hit);
        assert_eq!(
            got.master.meta.sha512.as_deref(),
            Some(expected.hex.as_str())
        );
        let recorded = masters.cache().load("m").unwrap().meta;
        assert_eq!(recorded.sha512.as_deref(), Some(expected.hex.as_str()));
        assert_eq!(
            recorded.source_sha512.as_deref(),
            Some(expected.hex.as_str())
        );
    }

    /// Without a checksum, a master the node links already is used without
    /// asking its source whether it changed (nothing answers at it).
    #[tokio::test]
    async fn a_master_the_node_links_needs_no_freshness_check() {
        let dir = tempfile::tempdir().unwrap();
        let masters = masters(dir.path());
        commit(&masters, "m");
        let fixture = TestJob::new(HREF);
        let job = fixture.job(None, false, false);
        let got = masters.obtain_master(&job, false, &|_| true).await.unwrap();
        assert_eq!(got.outcome, CacheOutcome::Hit);
        assert!(got.linked);
    }
}
