//! Per-node files: the node's hard link to its master
//! (`<images_path>/<node>/disk`) and the published symlink
//! (`<http_root>/<http_image_subdir>/<node>`). Every change is made on a
//! temporary name and renamed into place, so readers never see a half state.

use crate::error::{Error, Result};
use crate::fsutil;
use crate::node::NodeUuid;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where node files live.
#[derive(Debug, Clone)]
pub struct NodeLinks {
    images_path: PathBuf,
    link_dir: PathBuf,
}

impl NodeLinks {
    /// Creates the directories (0755) if needed.
    pub fn open(images_path: &Path, http_root: &Path, subdir: &str) -> Result<NodeLinks> {
        let link_dir = http_root.join(subdir);
        fsutil::ensure_dir(images_path)?;
        fsutil::ensure_dir(&link_dir)?;
        Ok(NodeLinks {
            images_path: images_path.to_path_buf(),
            link_dir,
        })
    }

    /// Directory of a node's cached image.
    pub fn node_dir(&self, node: &NodeUuid) -> PathBuf {
        self.images_path.join(node.as_str())
    }

    /// The node's cached image (a hard link to its master).
    pub fn disk_path(&self, node: &NodeUuid) -> PathBuf {
        self.node_dir(node).join("disk")
    }

    /// The published symlink.
    pub fn symlink_path(&self, node: &NodeUuid) -> PathBuf {
        self.link_dir.join(node.as_str())
    }

    /// True when the node's `disk` is the very file `master` (same inode).
    pub fn disk_is(&self, node: &NodeUuid, master: &Path) -> bool {
        match (
            std::fs::metadata(self.disk_path(node)),
            std::fs::metadata(master),
        ) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }

    /// Makes the node's `disk` a hard link to `master` (a copy where the file
    /// systems differ), replacing any previous image atomically.
    pub fn link_disk(&self, node: &NodeUuid, master: &Path) -> Result<()> {
        let dir = self.node_dir(node);
        fsutil::ensure_dir(&dir)?;
        let disk = self.disk_path(node);
        let temp = fsutil::temp_path(&disk);
        match std::fs::hard_link(master, &temp) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::XDEV.raw_os_error()) => {
                copy_file(master, &temp)?;
            }
            Err(e) => return Err(Error::io(format!("link {}", disk.display()), e)),
        }
        std::fs::rename(&temp, &disk).map_err(|e| {
            let _ = std::fs::remove_file(&temp);
            Error::io(format!("rename {}", disk.display()), e)
        })
    }

    /// Points the node's symlink at its `disk`, replacing it atomically;
    /// true when the node had no symlink before.
    pub fn publish(&self, node: &NodeUuid) -> Result<bool> {
        let link = self.symlink_path(node);
        let target = std::path::absolute(self.disk_path(node))
            .map_err(|e| Error::io("resolve images_path", e))?;
        let current = std::fs::read_link(&link).ok();
        if current.as_deref() == Some(target.as_path()) {
            return Ok(false);
        }
        let temp = fsutil::temp_path(&link);
        std::os::unix::fs::symlink(&target, &temp)
            .map_err(|e| Error::io(format!("symlink {}", link.display()), e))?;
        std::fs::rename(&temp, &link).map_err(|e| {
            let _ = std::fs::remove_file(&temp);
            Error::io(format!("rename {}", link.display()), e)
        })?;
        Ok(current.is_none())
    }

    /// Published node symlinks (temporaries excluded).
    pub fn count_published(&self) -> usize {
        std::fs::read_dir(&self.link_dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Removes the node's symlink; true if there was one.
    pub fn unpublish(&self, node: &NodeUuid) -> Result<bool> {
        fsutil::remove_file_if_exists(&self.symlink_path(node))
    }

    /// Removes the node's hard link; true if there was one.
    pub fn remove_disk(&self, node: &NodeUuid) -> Result<bool> {
        fsutil::remove_file_if_exists(&self.disk_path(node))
    }

    /// Removes the node's whole image directory; true if there was one.
    pub fn remove_node_dir(&self, node: &NodeUuid) -> Result<bool> {
        match std::fs::remove_dir_all(self.node_dir(node)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io("remove node directory", e)),
        }
    }

    /// Removes temporaries left by a crashed run in the symlink directory and
    /// the node directories.
    pub fn remove_stale_temps(&self) -> Result<usize> {
        let mut removed = fsutil::remove_temps_in(&self.link_dir)?;
        if let Ok(nodes) = std::fs::read_dir(&self.images_path) {
            for node in nodes.flatten() {
                removed += fsutil::remove_temps_in(&node.path())?;
            }
        }
        Ok(removed)
    }
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).map_err(|e| Error::io(format!("copy to {}", to.display()), e))?;
    let file = std::fs::File::open(to).map_err(|e| Error::io("reopen copy", e))?;
    fsutil::set_mode(&file, 0o644)?;
    file.sync_all().map_err(|e| Error::io("sync copy", e))
}
