//! Per-node files: the node's hard link to its master
//! (`<images_path>/<node>/disk`) and the published symlink
//! (`<http_root>/<http_image_subdir>/<node>`). Every change is made on a
//! temporary name and renamed into place, so readers never see a half state.

use crate::error::{Error, Result};
use crate::fsutil::{self, DirMode, TempOwner};
use crate::node::NodeUuid;
use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where node files live. Cheap to clone, so blocking work on it can move
/// to a blocking thread.
#[derive(Clone)]
pub struct NodeLinks {
    images_path: PathBuf,
    link_dir: PathBuf,
    owner: Arc<TempOwner>,
    dirs: DirMode,
}

impl NodeLinks {
    /// Creates the directories (with `dirs`, the group and mode of the
    /// directories shared with Ironic) if needed; with a shared group, an
    /// existing one of them that the worker owns is given it too (made by
    /// an earlier version, 0755). Temporaries are named after `owner`.
    pub fn open(
        images_path: &Path,
        http_root: &Path,
        subdir: &str,
        owner: Arc<TempOwner>,
        dirs: DirMode,
    ) -> Result<NodeLinks> {
        let link_dir = http_root.join(subdir);
        for dir in [images_path, &link_dir] {
            fsutil::ensure_dir_with(dir, dirs)?;
            if dirs.gid.is_some()
                && let Ok(m) = std::fs::metadata(dir)
                && m.uid() == rustix::process::geteuid().as_raw()
                && !dirs.is_on(&m)
            {
                dirs.apply(dir)?;
            }
        }
        Ok(NodeLinks {
            images_path: images_path.to_path_buf(),
            link_dir,
            owner,
            dirs,
        })
    }

    /// Directory of the nodes' cached images (`[pxe]images_path`).
    pub fn images_path(&self) -> &Path {
        &self.images_path
    }

    /// Directory of the published symlinks.
    pub fn link_dir(&self) -> &Path {
        &self.link_dir
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

    /// True when the node's `disk` is the very file `master` (same inode),
    /// or, on another file system, a complete copy of this very master
    /// (whose SHA-256 is `sha256`): see [`copy_identity`]. A copy of a
    /// master that was since replaced is not.
    pub fn disk_is(&self, node: &NodeUuid, master: &Path, sha256: &str) -> bool {
        let path = self.disk_path(node);
        let Ok(disk) = std::fs::metadata(&path) else {
            return false;
        };
        let Ok(m) = std::fs::metadata(master) else {
            return false;
        };
        if m.dev() == disk.dev() {
            return m.ino() == disk.ino();
        }
        disk.len() == m.len()
            && recorded_copy_of(&path).is_some_and(|r| r == copy_identity(&m, sha256))
    }

    /// Makes the node's `disk` a hard link to `master` (a copy where the file
    /// systems differ, recording which master it copies; `sha256` is the
    /// master's), replacing any previous image atomically.
    /// (Blocking: a copy may take long; call it on a blocking thread.)
    pub fn link_disk(&self, node: &NodeUuid, master: &Path, sha256: &str) -> Result<()> {
        self.replace_disk(node, master, Some(sha256)).map(|_| ())
    }

    /// Makes the node's `disk` a hard link to `master`, replacing any
    /// previous image atomically; false (and nothing changed) where the
    /// file systems differ and only a copy would do. Only metadata
    /// operations: a cache hit links without a trip to a blocking thread.
    pub fn hard_link_disk(&self, node: &NodeUuid, master: &Path) -> Result<bool> {
        self.replace_disk(node, master, None)
    }

    /// See [`NodeLinks::link_disk`]: `copy` is the master's SHA-256 where a
    /// copy may be made, `None` where only a hard link will do.
    fn replace_disk(&self, node: &NodeUuid, master: &Path, copy: Option<&str>) -> Result<bool> {
        fsutil::create_dir_fresh(&self.node_dir(node), self.dirs)?;
        let disk = self.disk_path(node);
        // A node's first image is linked straight under its name (atomic
        // too); anything else (an existing `disk`, another file system, an
        // error to report) takes the path through a temporary below.
        if std::fs::hard_link(master, &disk).is_ok() {
            return Ok(true);
        }
        let temp = self.owner.temp_next_to(&disk)?;
        let mut linked = true;
        fsutil::replace_via_temp(&disk, &temp, |temp| {
            match std::fs::hard_link(master, temp) {
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::XDEV.raw_os_error()) => {
                    if let Some(sha256) = copy {
                        copy_file(master, temp, sha256)
                    } else {
                        linked = false;
                        // Not renamed into place: replace_via_temp removes
                        // the temporary, which was never made.
                        Err(e)
                    }
                }
                other => other,
            }
        })
        .or_else(|e| if linked { Err(e) } else { Ok(()) })?;
        Ok(linked)
    }

    /// Points the node's symlink at its `disk`, replacing it atomically
    /// (the symlink directory is recreated if it was deleted); true when the
    /// node had no symlink before.
    pub fn publish(&self, node: &NodeUuid) -> Result<bool> {
        let link = self.symlink_path(node);
        let target = std::path::absolute(self.disk_path(node))
            .map_err(|e| Error::io("resolve images_path", e))?;
        // A node's first symlink is made straight under its name; anything
        // in the way (or a deleted directory) takes the path below.
        if std::os::unix::fs::symlink(&target, &link).is_ok() {
            return Ok(true);
        }
        let current = std::fs::read_link(&link).ok();
        if current.as_deref() == Some(target.as_path()) {
            return Ok(false);
        }
        fsutil::ensure_dir_with(&self.link_dir, self.dirs)?;
        let temp = self.owner.temp_next_to(&link)?;
        fsutil::replace_via_temp(&link, &temp, |temp| {
            std::os::unix::fs::symlink(&target, temp)
        })?;
        Ok(current.is_none())
    }

    /// Records that a command asked for the node's files now (the mtime of
    /// its directory, one `utimensat`; the symlink's where the directory is
    /// not the worker's to touch): what [`crate::store::expiry`] reads.
    pub fn touch(&self, node: &NodeUuid) {
        use rustix::fs::{AtFlags, CWD, Timespec, Timestamps, UTIME_NOW};
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: UTIME_NOW,
        };
        let times = Timestamps {
            last_access: now,
            last_modification: now,
        };
        if rustix::fs::utimensat(CWD, self.node_dir(node), &times, AtFlags::empty()).is_err() {
            let link = self.symlink_path(node);
            let _ = rustix::fs::utimensat(CWD, link, &times, AtFlags::SYMLINK_NOFOLLOW);
        }
    }

    /// True when the node's symlink is one the worker makes: the worker's
    /// (its owner), to the node's `disk` in `images_path`.
    pub fn symlink_is_ours(&self, node: &NodeUuid) -> bool {
        let link = self.symlink_path(node);
        let mine = std::fs::symlink_metadata(&link)
            .is_ok_and(|m| m.uid() == rustix::process::geteuid().as_raw());
        let Some(target) = std::fs::read_link(&link).ok().filter(|_| mine) else {
            return false;
        };
        std::path::absolute(self.disk_path(node)).is_ok_and(|ours| ours == target)
            || fsutil::same_path(&target, &self.disk_path(node))
    }

    /// True when the node's `disk` is one the worker makes: a hard link of
    /// one of its masters (`masters`: their device and inode, or the mark
    /// every master gets, see [`crate::store::cache::MASTER_MARK`]), or a
    /// copy of one (its [`COPY_OF`] record).
    pub fn disk_is_ours(&self, node: &NodeUuid, masters: &HashSet<(u64, u64)>) -> bool {
        let path = self.disk_path(node);
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            return false;
        };
        let mut buf = [0u8; 256];
        m.is_file()
            && (masters.contains(&(m.dev(), m.ino()))
                || rustix::fs::getxattr(&path, crate::store::cache::MASTER_MARK, &mut buf[..])
                    .is_ok()
                || recorded_copy_of(&path).is_some())
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

    /// Removes temporaries left in the symlink directory and the node
    /// directories by processes that are gone (see [`TempOwner`]).
    pub fn remove_stale_temps(&self) -> Result<usize> {
        let mut removed = self.owner.remove_orphans_in(&self.link_dir)?;
        if let Ok(nodes) = std::fs::read_dir(&self.images_path) {
            for node in nodes.flatten() {
                if node.path().is_dir() {
                    removed += self.owner.remove_orphans_in(&node.path())?;
                }
            }
        }
        Ok(removed)
    }
}

/// The extended attribute that names, on a node's copy of a master, the
/// master it copies (see [`copy_identity`]).
const COPY_OF: &str = "user.ironic-image-worker.copy-of";

/// What a copy records of its master: the master's device, inode, size and
/// modification time (nanoseconds), which change when the master is
/// replaced (masters are written once, under a temporary name), and its
/// SHA-256, which tells apart a new master that happens to reuse the inode
/// number. Written on the copy itself (an extended attribute) before it is
/// renamed into place, so it is as durable as the copy and goes with it:
/// another process, or this one after a restart, recognises the copy too.
fn copy_identity(master: &std::fs::Metadata, sha256: &str) -> String {
    format!(
        "v1 dev={} ino={} size={} mtime={}.{:09} sha256={sha256}",
        master.dev(),
        master.ino(),
        master.size(),
        master.mtime(),
        master.mtime_nsec()
    )
}

/// The identity recorded on the copy at `disk`, if any.
fn recorded_copy_of(disk: &Path) -> Option<String> {
    let mut buf = [0u8; 256];
    let n = rustix::fs::getxattr(disk, COPY_OF, &mut buf[..]).ok()?;
    String::from_utf8(buf.get(..n)?.to_vec()).ok()
}

/// A copy where a hard link is impossible (another file system): sparse
/// (holes where the master has them), synced, and carrying the master's
/// identity. A file system without user extended attributes gets the copy
/// without the record (each prepare of the node copies again).
fn copy_file(from: &Path, to: &Path, sha256: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let src = std::fs::File::open(from)?;
    let meta = src.metadata()?;
    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(to)?;
    dst.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    fsutil::copy_sparse(&src, &dst, meta.len())?;
    let identity = copy_identity(&meta, sha256);
    if let Err(e) = rustix::fs::fsetxattr(
        &dst,
        COPY_OF,
        identity.as_bytes(),
        rustix::fs::XattrFlags::empty(),
    ) {
        tracing::debug!(error = %e, "cannot record which master a node's copy is of");
    }
    dst.sync_all()
}
