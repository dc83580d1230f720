//! Expiry of node files no command asked for. When Ironic's hash ring moves
//! a node to another conductor, the old host's worker never hears of it
//! again: its symlink and hard link would stay for ever, and the hard link
//! keeps the master from being evicted. Every prepare records that the
//! node's files were asked for ([`NodeLinks::touch`]: the mtime of
//! `images_path/<node>/`); files older than `[cache]node_files_ttl` are
//! removed by the periodic clean-up.
//!
//! Only what the worker itself made goes: the node's symlink when it points
//! at the node's `disk`, and that `disk` when it is a hard link (or a copy)
//! of one of the worker's masters; then the node's directory if that left
//! it empty. Anything else of Ironic's in those places stays. A node whose
//! lock is held (a command for it is running) is skipped until the next
//! clean-up.

use crate::error::Result;
use crate::node::NodeUuid;
use crate::store::cache::Cache;
use crate::store::link::NodeLinks;
use crate::store::lock::Locks;
use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

/// The places expiry looks at: the node files, the masters they may link,
/// the node locks.
pub struct NodeFiles<'a> {
    /// The nodes' links and directories.
    pub links: &'a NodeLinks,
    /// The master cache (whose masters a node's `disk` links).
    pub cache: &'a Cache,
    /// The node locks (`images_path/.locks`).
    pub locks: &'a Locks,
}

impl NodeFiles<'_> {
    /// Removes the worker's files of every node not asked for within `ttl`
    /// (see the module documentation); returns the nodes whose files went.
    pub fn expire(&self, ttl: Duration) -> Result<Vec<NodeUuid>> {
        let now = SystemTime::now();
        let mut masters: Option<HashSet<(u64, u64)>> = None;
        let mut expired = Vec::new();
        for node in self.nodes() {
            if !self.is_stale(&node, now, ttl) {
                continue;
            }
            let masters = masters.get_or_insert_with(|| self.cache.master_inodes());
            // Nothing of the worker's: not even a lock file is made.
            if self.ours(&node, masters) == (false, false) {
                continue;
            }
            // A command for the node is running: it is asked for.
            let Some(mut lock) = self.locks.try_acquire(node.as_str()) else {
                continue;
            };
            // Asked for between the look and the lock.
            if !self.is_stale(&node, now, ttl) {
                continue;
            }
            if self.remove_ours(&node, masters)? {
                tracing::info!(
                    node = %node,
                    "removed the node's files: no command asked for them within [cache]node_files_ttl"
                );
                expired.push(node.clone());
            }
            let links = self.links;
            if links.symlink_path(&node).symlink_metadata().is_err()
                && !links.node_dir(&node).exists()
            {
                lock.remove_file();
            }
        }
        Ok(expired)
    }

    /// Removes the node's symlink and `disk` where the worker made them,
    /// then its directory if that left it empty; true if anything went.
    fn remove_ours(&self, node: &NodeUuid, masters: &HashSet<(u64, u64)>) -> Result<bool> {
        let links = self.links;
        let (symlink, disk) = self.ours(node, masters);
        let mut removed = false;
        if symlink {
            removed |= links.unpublish(node)?;
        }
        if disk {
            removed |= links.remove_disk(node)?;
            // Only an empty directory goes: Ironic's files keep it.
            let _ = std::fs::remove_dir(links.node_dir(node));
        }
        Ok(removed)
    }

    /// Whether the node's symlink and its `disk` are the worker's: the
    /// `disk` a hard link or copy of one of its masters, the symlink the
    /// worker's own pointing at that `disk` (or at none left).
    fn ours(&self, node: &NodeUuid, masters: &HashSet<(u64, u64)>) -> (bool, bool) {
        let links = self.links;
        let disk = links.disk_is_ours(node, masters);
        let symlink = links.symlink_is_ours(node)
            && (disk || links.disk_path(node).symlink_metadata().is_err());
        (symlink, disk)
    }

    /// The nodes with a directory in `images_path` or a symlink in the
    /// symlink directory (names that are node UUIDs only).
    fn nodes(&self) -> BTreeSet<NodeUuid> {
        let mut nodes = BTreeSet::new();
        for dir in [self.links.images_path(), self.links.link_dir()] {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if let Some(node) = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| NodeUuid::parse(n).ok())
                {
                    nodes.insert(node);
                }
            }
        }
        nodes
    }

    /// True when the node has files and the last time they were asked for
    /// (the later mtime of its directory and of its symlink) is more than
    /// `ttl` before `now`.
    fn is_stale(&self, node: &NodeUuid, now: SystemTime, ttl: Duration) -> bool {
        let mtime = |p: std::path::PathBuf| p.symlink_metadata().and_then(|m| m.modified()).ok();
        let last = [
            mtime(self.links.node_dir(node)),
            mtime(self.links.symlink_path(node)),
        ]
        .into_iter()
        .flatten()
        .max();
        last.is_some_and(|t| now.duration_since(t).is_ok_and(|age| age > ttl))
    }
}
