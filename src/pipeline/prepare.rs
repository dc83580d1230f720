//! Preparing a node: resolve the source and the expected checksum, reuse
//! the cached master when it is still good (computing digests it lacks) or
//! make a new one (`fetch`), link it for the node and say where it is
//! served. It knows nothing of the broker or HTTP serving: the served URL
//! is only a string built from the configuration.

use super::masters::{MasterFetch, Mode, Obtained, fill_image};
use super::{Pipeline, Released, Request};
use crate::error::Result;
use crate::messages::{CacheOutcome, Completion};
use crate::node::NodeUuid;

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
        self.order.check_not_stale(node, req)?;
        let masters = &self.masters;
        let resolver = masters.resolver();
        let image = Box::pin(resolver.resolve_image(req, done)).await?;
        match image.mode {
            Mode::Cache => {}
            Mode::PassThrough => {
                let answer = masters.pass_through(&image.source, &image.href, image.spec, done);
                return Box::pin(answer).await.map(|()| Released::Done);
            }
            Mode::Validate => {
                let validated = masters.validate_image(image, req, done);
                return Box::pin(validated).await.map(|_| Released::Done);
            }
        }
        let expected = Box::pin(resolver.expected_of(image.spec.clone(), &image.source)).await?;
        let (name, force_raw) = resolver.master_of(&image, req);
        let job = image.job(&name, expected.as_ref(), force_raw, req);
        let locked = self.prepare_locked(node, req, &job, done);
        self.locked(node, &name, locked).await?;
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
            .masters
            .obtain_master(job, false, &|m| self.nodes.links_to(node, m))
            .await?;
        // The node may have moved on while the image was made (a cleanup
        // waits for this lock; a notification does not).
        self.order.check_not_stale(node, req)?;
        let linked_here = match outcome {
            CacheOutcome::Miss => !self.nodes.links_to(node, &master),
            _ => !linked,
        };
        let url = self
            .nodes
            .link_and_publish(node, &master, linked_here)
            .await?;
        if let Some(name) = master.path.file_name() {
            self.masters.compress_later(&name.to_string_lossy());
        }
        if outcome == CacheOutcome::Miss {
            self.masters.after_growth().await;
        }
        // The request's one line (`request done`) says the outcome; which
        // master, for who debugs the cache.
        tracing::debug!(master = %master.path.display(), "prepared");
        done.image_url = Some(url);
        fill_image(&master.meta, job.served, outcome, done);
        Ok(())
    }
}
