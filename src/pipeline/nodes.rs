//! A node's files on this host, owned by one component: its copy of a
//! master (`images_path/<node>/disk`, a hard link), its published symlink
//! (`http_root/<subdir>/<node>`), its lock, and the URL the agent downloads
//! from. A prepare links and publishes here, `deployed` and `cleanup` take
//! back here, the periodic clean-up expires here. It knows masters only as
//! files (a path and a SHA-256), never how they are made.

use super::blocking;
use crate::config::Config;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::node::NodeUuid;
use crate::store::cache::{Cache, Master};
use crate::store::link::NodeLinks;
use crate::store::lock::{LockGuard, Locks};
use std::sync::Arc;

/// The nodes' files, locks and URLs (see the module).
pub(super) struct Nodes {
    links: NodeLinks,
    locks: Locks,
    /// `<[deploy]http_url>/<[deploy]http_image_subdir>`: a node's image URL
    /// without the node.
    url_base: String,
    metrics: Arc<Metrics>,
}

impl Nodes {
    /// Opens `images_path` and the link directory under `http_root`; node
    /// files are made as `cache` makes its files (owner and mode).
    pub(super) fn open(config: &Config, cache: &Cache, metrics: Arc<Metrics>) -> Result<Nodes> {
        let links = NodeLinks::open(
            &config.pxe.images_path,
            &config.deploy.http_root,
            &config.deploy.http_image_subdir,
            cache.owner(),
            config.cache.shared_dirs()?,
        )?;
        Ok(Nodes {
            links,
            locks: Locks::new(config.pxe.images_path.join(".locks"))?,
            url_base: format!("{}/{}", config.http_url(), config.deploy.http_image_subdir),
            metrics,
        })
    }

    /// Takes `node`'s lock (every process of the host honours it).
    pub(super) async fn lock(&self, node: &NodeUuid) -> Result<LockGuard> {
        self.locks.acquire(node.as_str()).await
    }

    /// True when the node has a published link or a cached image here.
    pub(super) fn has_files(&self, node: &NodeUuid) -> bool {
        self.links.symlink_path(node).symlink_metadata().is_ok()
            || self.links.node_dir(node).exists()
    }

    /// Whether `node`'s disk is `master` already.
    pub(super) fn links_to(&self, node: &NodeUuid, master: &Master) -> bool {
        self.links.disk_is(node, &master.path, &master.meta.sha256)
    }

    /// Links `master` for `node` when `linked_here` (a hard link made here;
    /// a copy across file systems on a blocking thread) and publishes the
    /// node's symlink; a link made for this prepare is taken back when the
    /// symlink cannot be published, as it would keep its master from ever
    /// being evicted. Then the node counts as asked for now (not expired
    /// for another `[cache]node_files_ttl`). Returns the node's image URL.
    pub(super) async fn link_and_publish(
        &self,
        node: &NodeUuid,
        master: &Master,
        linked_here: bool,
    ) -> Result<String> {
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
        self.links.touch(node);
        Ok(format!("{}/{node}", self.url_base))
    }

    /// Withdraws `node`'s symlink and its disk (with `whole_dir`, its whole
    /// directory). Doing it twice changes nothing.
    pub(super) async fn take_back(&self, node: &NodeUuid, whole_dir: bool) -> Result<()> {
        if self.links.unpublish(node)? {
            self.metrics.cache.active_links.dec();
        }
        // Removing a node's directory touches the disk: off the async threads.
        let (links, owned) = (self.links.clone(), node.clone());
        blocking(move || {
            if whole_dir {
                links.remove_node_dir(&owned)?;
            } else {
                links.remove_disk(&owned)?;
            }
            Ok(())
        })
        .await
    }

    /// Removes temporaries of node copies whose writer is gone; how many.
    pub(super) fn remove_stale_temps(&self) -> Result<usize> {
        self.links.remove_stale_temps()
    }

    /// Sets the published-links gauge from the link directory (blocking).
    pub(super) fn refresh_gauge(&self) {
        self.metrics
            .cache
            .active_links
            .set(self.links.count_published() as i64);
    }

    /// Removes the files of nodes no command asked for within `ttl` (files
    /// a conductor takeover left here; see `store::expiry`), skipping
    /// nodes whose lock is held; how many nodes (blocking).
    pub(super) fn expire(&self, ttl: std::time::Duration, cache: &Cache) -> Result<usize> {
        let expired = crate::store::expiry::NodeFiles {
            links: &self.links,
            cache,
            locks: &self.locks,
        }
        .expire(ttl)?;
        self.metrics
            .cache
            .node_files_expired
            .inc_by(expired.len() as u64);
        Ok(expired.len())
    }
}
