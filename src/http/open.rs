//! Opens the file a request names, once, with no path looked up twice: the
//! request path is resolved beneath `http_root` by the kernel
//! (`openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: `..` and symlinks
//! inside the root are followed, none leads out, even one swapped in while
//! the path is walked). The one way out of `http_root` is a published node
//! symlink whose last component points, by an absolute path, into one of the
//! worker's own directories (masters, `images_path`): its target is read
//! and opened beneath the directory it names, with no symlink and no mount
//! point followed there (`RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`). The
//! descriptor opened is the one whose metadata answers the request and
//! whose bytes are sent.
//!
//! Nothing whose name starts with a dot is served (the worker's `.meta`,
//! `.locks`, `.tmp`, temporaries, any other hidden file), no directory is
//! listed, and only regular files are opened for reading (`O_NONBLOCK`, so a
//! FIFO cannot hang the open).

use axum::http::StatusCode;
use rustix::fd::OwnedFd;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// A directory the server may open files beneath, under the names a
/// symlink may give it.
#[derive(Debug, Clone)]
struct Allowed {
    /// Where it is opened (the configured path, made absolute).
    dir: PathBuf,
    /// Prefixes a symlink target may use for it: as configured and resolved.
    names: Vec<PathBuf>,
}

/// The directories the image server opens files in.
#[derive(Debug, Clone)]
pub(crate) struct Beneath {
    http_root: PathBuf,
    allowed: Vec<Allowed>,
}

const FILE_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::NONBLOCK)
    .union(OFlags::CLOEXEC)
    .union(OFlags::NOCTTY);
const DIR_FLAGS: OFlags = OFlags::PATH.union(OFlags::DIRECTORY).union(OFlags::CLOEXEC);

impl Beneath {
    /// `http_root` is served; a symlink may lead out of it only into
    /// `escapes` (and into `http_root` itself by an absolute path).
    pub(crate) fn new(http_root: &Path, escapes: &[&Path]) -> std::io::Result<Beneath> {
        let http_root = std::path::absolute(http_root)?;
        let mut allowed = Vec::new();
        for dir in std::iter::once(http_root.as_path()).chain(escapes.iter().copied()) {
            let dir = std::path::absolute(dir)?;
            let mut names = vec![dir.clone()];
            let real = std::fs::canonicalize(&dir)?;
            if real != dir {
                names.push(real);
            }
            allowed.push(Allowed { dir, names });
        }
        Ok(Beneath { http_root, allowed })
    }

    /// Opens the regular file request path `raw_path` names (blocking: a
    /// handful of system calls), or the status to answer: 404 for what does
    /// not exist or may not be named (dot-files, `..`, encoded separators,
    /// NULs, anything but a regular file or a directory), 403 for a
    /// directory or a symlink leading out of the allowed directories.
    pub(crate) fn open(&self, raw_path: &str) -> Result<std::fs::File, StatusCode> {
        let rel = request_path(raw_path)?;
        let root = rustix::fs::open(&self.http_root, DIR_FLAGS, Mode::empty())
            .map_err(|_| StatusCode::NOT_FOUND)?;
        let fd = match open_beneath(&root, &rel, FILE_FLAGS, ResolveFlags::empty()) {
            Err(Errno::XDEV | Errno::LOOP) => self.open_link_target(&root, &rel),
            other => other.map_err(status),
        }?;
        regular(fd)
    }

    /// The last component of `rel` is a symlink leading out of `http_root`:
    /// opens its target when it lies in an allowed directory.
    fn open_link_target(&self, root: &OwnedFd, rel: &Path) -> Result<OwnedFd, StatusCode> {
        let (parent, name) = match (rel.parent(), rel.file_name()) {
            (Some(p), Some(n)) => (p, n),
            _ => return Err(StatusCode::FORBIDDEN),
        };
        let dir = if parent.as_os_str().is_empty() {
            rustix::fs::openat(root, ".", DIR_FLAGS, Mode::empty())
        } else {
            open_beneath(root, parent, DIR_FLAGS, ResolveFlags::empty())
        }
        .map_err(|e| match e {
            Errno::XDEV | Errno::LOOP => StatusCode::FORBIDDEN,
            other => status(other),
        })?;
        let target =
            rustix::fs::readlinkat(&dir, name, Vec::new()).map_err(|_| StatusCode::FORBIDDEN)?;
        let target = Path::new(OsStr::from_bytes(target.as_bytes()));
        let (allowed, rest) = self
            .allowed
            .iter()
            .find_map(|a| {
                a.names
                    .iter()
                    .find_map(|n| target.strip_prefix(n).ok())
                    .map(|rest| (a, rest))
            })
            .ok_or(StatusCode::FORBIDDEN)?;
        if rest.as_os_str().is_empty() || !rest.components().all(plain) {
            return Err(StatusCode::FORBIDDEN);
        }
        let base = rustix::fs::open(&allowed.dir, DIR_FLAGS, Mode::empty())
            .map_err(|_| StatusCode::NOT_FOUND)?;
        let strict = ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV;
        open_beneath(&base, rest, FILE_FLAGS, strict).map_err(|e| match e {
            Errno::XDEV | Errno::LOOP => StatusCode::FORBIDDEN,
            other => status(other),
        })
    }
}

/// The request path as a relative path of plain, visible components.
fn request_path(raw_path: &str) -> Result<PathBuf, StatusCode> {
    let mut rel = PathBuf::new();
    for segment in raw_path
        .strip_prefix('/')
        .ok_or(StatusCode::BAD_REQUEST)?
        .split('/')
    {
        let bytes: Vec<u8> = percent_encoding::percent_decode_str(segment).collect();
        if bytes.is_empty()
            || bytes.starts_with(b".")
            || bytes.iter().any(|b| matches!(b, b'/' | b'\\' | 0))
        {
            return Err(StatusCode::NOT_FOUND);
        }
        rel.push(OsStr::from_bytes(&bytes));
    }
    Ok(rel)
}

/// A component a symlink target may have below an allowed directory.
fn plain(c: Component<'_>) -> bool {
    matches!(c, Component::Normal(n) if !n.as_bytes().starts_with(b"."))
}

fn status(e: Errno) -> StatusCode {
    match e {
        Errno::XDEV | Errno::LOOP => StatusCode::FORBIDDEN,
        _ => StatusCode::NOT_FOUND,
    }
}

/// The open descriptor as a file, if it is a regular one (403 for a
/// directory, 404 for anything else).
fn regular(fd: OwnedFd) -> Result<std::fs::File, StatusCode> {
    let st = rustix::fs::fstat(&fd).map_err(|_| StatusCode::NOT_FOUND)?;
    match rustix::fs::FileType::from_raw_mode(st.st_mode) {
        rustix::fs::FileType::RegularFile => Ok(std::fs::File::from(fd)),
        rustix::fs::FileType::Directory => Err(StatusCode::FORBIDDEN),
        _ => Err(StatusCode::NOT_FOUND),
    }
}

/// `openat2(dir, rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | extra)`;
/// on kernels without it (before 5.6), a walk one component at a time with
/// `O_NOFOLLOW` (no symlink followed at all).
fn open_beneath(
    dir: &OwnedFd,
    rel: &Path,
    flags: OFlags,
    extra: ResolveFlags,
) -> rustix::io::Result<OwnedFd> {
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS | extra;
    match rustix::fs::openat2(dir, rel, flags, Mode::empty(), resolve) {
        Err(Errno::NOSYS) => crate::fsutil::open_beneath_nofollow(dir, rel, flags),
        other => other,
    }
}

/// Opens `path` for reading, never through a symlink: `None` when it is
/// not a regular file.
pub(super) fn open_regular(path: &std::path::Path) -> rustix::io::Result<Option<std::fs::File>> {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
    let file = std::fs::File::from(rustix::fs::open(path, flags, Mode::empty())?);
    Ok(file.metadata().ok().filter(|m| m.is_file()).map(|_| file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn opens_beneath_and_into_allowed_dirs_only() {
        let t = tempfile::tempdir().unwrap();
        let (root, images, outside) = (t.path().join("r"), t.path().join("i"), t.path().join("o"));
        for d in [
            &root,
            &images,
            &outside,
            &root.join("sub"),
            &images.join("n"),
        ] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(root.join("sub/f"), b"f").unwrap();
        std::fs::write(images.join("n/disk"), b"disk").unwrap();
        std::fs::write(images.join("n/.tmp"), b"tmp").unwrap();
        std::fs::write(outside.join("secret"), b"secret").unwrap();
        symlink(images.join("n/disk"), root.join("node")).unwrap();
        symlink(images.join("n/.tmp"), root.join("hidden")).unwrap();
        symlink(outside.join("secret"), root.join("out")).unwrap();
        symlink("../o/secret", root.join("rel-out")).unwrap();
        symlink("sub/f", root.join("rel-in")).unwrap();
        symlink(&outside, root.join("outdir")).unwrap();
        let b = Beneath::new(&root, &[&images]).unwrap();
        let read = |p: &str| {
            b.open(p)
                .map(|f| std::io::read_to_string(f).unwrap())
                .map_err(|s| s.as_u16())
        };
        assert_eq!(read("/sub/f"), Ok("f".into()));
        assert_eq!(read("/node"), Ok("disk".into()));
        assert_eq!(read("/rel-in"), Ok("f".into()));
        assert_eq!(read("/out"), Err(403));
        assert_eq!(read("/rel-out"), Err(403));
        assert_eq!(read("/outdir/secret"), Err(403));
        assert_eq!(read("/hidden"), Err(403));
        assert_eq!(read("/sub"), Err(403));
        assert_eq!(read("/sub/.f"), Err(404));
        assert_eq!(read("/sub/../sub/f"), Err(404));
        assert_eq!(read("/sub%2Ff"), Err(404));
        assert_eq!(read("/missing"), Err(404));
    }
}
