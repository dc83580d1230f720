//! `file://` sources: a local regular file under
//! `[conductor]file_url_allowed_paths`, opened once beneath its allowed
//! directory (no `..`, symlink or swapped-in link leads outside it, and
//! never into a directory Ironic does not read file URLs from), then read
//! from that descriptor only.

use super::{Delivery, SourceStat, deliver, receiver_gone};
use crate::config::blocked_dir;
use crate::error::{Error, ErrorCode, Result};
use rustix::fd::OwnedFd;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use tokio::sync::mpsc;

/// An open `file://` source.
#[derive(Debug, Clone)]
pub struct FileSource {
    /// The path as requested (for messages).
    pub path: PathBuf,
    file: Arc<std::fs::File>,
}

impl PartialEq for FileSource {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path
    }
}

impl Eq for FileSource {}

/// Size of the reads from a `file://` source.
const READ_CHUNK: usize = 1 << 20;

impl FileSource {
    /// What the open file says of itself: its size and modification time.
    pub(super) fn stat(&self) -> Result<SourceStat> {
        let meta = self
            .file
            .metadata()
            .map_err(|e| Error::io(self.path.display(), e))?;
        Ok(SourceStat {
            last_modified: meta.modified().ok(),
            size: Some(meta.len()),
        })
    }

    /// Streams the open file (from offset 0, so a retry starts over) from a
    /// blocking thread.
    pub(super) async fn stream(&self, to: &mpsc::Sender<Delivery>) -> Result<SourceStat> {
        let stat = self.stat()?;
        deliver(to, Delivery::Attempt(stat.clone())).await?;
        let (file, path, to) = (self.file.clone(), self.path.clone(), to.clone());
        tokio::task::spawn_blocking(move || {
            let mut offset = 0u64;
            loop {
                let mut buf = vec![0u8; READ_CHUNK];
                let n = match file.read_at(&mut buf, offset) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Error::io(path.display(), e)),
                };
                let piece = match n {
                    0 => Delivery::Complete,
                    n => {
                        buf.truncate(n);
                        offset += n as u64;
                        Delivery::Bytes(buf.into())
                    }
                };
                let last = matches!(piece, Delivery::Complete);
                to.blocking_send(piece).map_err(|_| receiver_gone())?;
                if last {
                    return Ok(stat);
                }
            }
        })
        .await
        .map_err(|e| Error::new(ErrorCode::Internal, format!("file reader: {e}")))?
    }
}

/// Opens the `file://` source `path` for reading, race-free: the allowed
/// list is checked on the path as written before the file system is
/// touched (so a missing file outside it is `source_not_allowed`, like any
/// other, and nothing leaks whether it exists); then the file is opened
/// relative to the allowed directory with `openat2(RESOLVE_BENEATH)`, so no
/// `..` or symlink (even one swapped in meanwhile) leads outside it;
/// `O_NONBLOCK` keeps a FIFO from blocking the open, and the open
/// descriptor must be a regular file.
pub(super) fn open_allowed(path: &Path, allowed: &[PathBuf]) -> Result<FileSource> {
    let (dir, rel) = allowed_place(path, allowed)?;
    let fd = open_beneath(&dir, &rel).map_err(|e| open_error(path, e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| open_error(path, e))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(not_allowed(path, "not a regular file"));
    }
    check_not_blocked(path, &fd)?;
    Ok(FileSource {
        path: path.to_path_buf(),
        file: Arc::new(std::fs::File::from(fd)),
    })
}

/// `source_not_allowed` for `path`, saying why.
fn not_allowed(path: &Path, why: &str) -> Error {
    Error::new(
        ErrorCode::SourceNotAllowed,
        format!("{}: {why}", path.display()),
    )
}

/// The allowed directory `path` lies under and its path relative to it,
/// judged on the path as written, before the file system is read for it: an
/// absolute path without `.` or `..`, under no blocked directory, strictly
/// beneath an allowed directory as configured or resolved (it may itself be
/// a symlink, and requests may name either form).
fn allowed_place(path: &Path, allowed: &[PathBuf]) -> Result<(PathBuf, PathBuf)> {
    let outside = || not_allowed(path, "not under [conductor]file_url_allowed_paths");
    if let Some(dir) = blocked_dir(path) {
        return Err(not_allowed(
            path,
            &format!("file URLs are never read under {dir}"),
        ));
    }
    if !path.is_absolute()
        || path
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return Err(outside());
    }
    allowed
        .iter()
        .flat_map(|d| [Some(d.clone()), std::fs::canonicalize(d).ok()])
        .flatten()
        .find_map(|d| {
            let rel = path.strip_prefix(&d).ok()?.to_path_buf();
            (!rel.as_os_str().is_empty()).then_some((d, rel))
        })
        .ok_or_else(outside)
}

/// Opens `rel` beneath `dir` for reading: `openat2(RESOLVE_BENEATH)`, or
/// the O_NOFOLLOW walk where the kernel has no `openat2`.
fn open_beneath(dir: &Path, rel: &Path) -> rustix::io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let dirfd = rustix::fs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    match rustix::fs::openat2(
        &dirfd,
        rel,
        flags,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    ) {
        Err(rustix::io::Errno::NOSYS) => crate::fsutil::open_beneath_nofollow(&dirfd, rel, flags),
        other => other,
    }
}

/// The error of a failed open or `fstat` of `path`: a missing file is
/// `source_not_found`, a way out of the allowed directory or a refused
/// permission `source_not_allowed`, anything else `source_unreachable`.
fn open_error(path: &Path, e: rustix::io::Errno) -> Error {
    use rustix::io::Errno;
    let code = match e {
        Errno::NOENT | Errno::NOTDIR => ErrorCode::SourceNotFound,
        Errno::XDEV | Errno::LOOP => ErrorCode::SourceNotAllowed,
        Errno::ACCESS | Errno::PERM => ErrorCode::SourceNotAllowed,
        _ => ErrorCode::SourceUnreachable,
    };
    let why = match e {
        Errno::XDEV | Errno::LOOP => "leads outside [conductor]file_url_allowed_paths".to_string(),
        other => std::io::Error::from(other).to_string(),
    };
    Error::new(code, format!("{}: {why}", path.display()))
}

/// Refuses the open `file://` source `fd` when the file it really is (an
/// allowed directory may be `/`, and a symlink beneath it lead there) lies
/// under a directory Ironic never reads file URLs from.
fn check_not_blocked(path: &Path, fd: &impl AsRawFd) -> Result<()> {
    let opened = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| Error::io(path.display(), e))?;
    match blocked_dir(&opened) {
        Some(dir) => Err(Error::new(
            ErrorCode::SourceNotAllowed,
            format!(
                "{}: leads to {}, and file URLs are never read under {dir}",
                path.display(),
                opened.display()
            ),
        )),
        None => Ok(()),
    }
}
