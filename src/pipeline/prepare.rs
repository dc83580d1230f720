//! Preparing a node: resolve the source and the expected checksum, reuse
//! the cached master when it is still good (computing digests it lacks) or
//! make a new one (`fetch`), link it for the node and say where it is
//! served. It knows nothing of the broker or HTTP serving: the served URL
//! is only a string built from the configuration.

use super::job::MasterFetch;
use super::obtain::{Obtained, fill_image};
use super::resolve::Mode;
use super::{Pipeline, Released, Request, blocking};
use crate::error::Result;
use crate::messages::{CacheOutcome, Completion};
use crate::node::NodeUuid;
use crate::store::cache::Master;

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
        if let Some(name) = master.path.file_name() {
            self.compress_later(&name.to_string_lossy());
        }
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
        fill_image(&master.meta, job.served, outcome, done);
        Ok(())
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
}
