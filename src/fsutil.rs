//! Small file-system helpers every layer may use (they know no layout):
//! explicit permissions whatever the umask, atomic replacement, free space,
//! path comparison, sparse copies and the O_NOFOLLOW walk beneath a
//! directory that both file sources and the image server open files with.

use crate::error::{Error, ErrorCode, Result};
use std::fs::{File, Permissions};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Sets `mode` on an open file: the umask must not make cached images
/// unreadable to nginx/Apache running as another user.
pub fn set_mode(file: &File, mode: u32) -> Result<()> {
    file.set_permissions(Permissions::from_mode(mode))
        .map_err(|e| Error::io("chmod", e))
}

/// The mode (and group) of the directories the worker makes. The worker's
/// own get 0755; those shared with Ironic (`images_path/<node>/`,
/// `http_root/<subdir>/`) may get a group both users are in and a mode
/// such as 2775, so that Ironic, running as another user, can remove the
/// worker's node files and create its own symlinks there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirMode {
    /// Permission bits, the setgid bit included (never setuid or sticky).
    pub mode: u32,
    /// Group given to new directories; `None` keeps the one they got.
    pub gid: Option<u32>,
}

impl DirMode {
    /// 0755, group as created: what nobody else writes to.
    pub const PRIVATE: DirMode = DirMode {
        mode: 0o755,
        gid: None,
    };

    /// Gives the existing directory `dir` this group and mode.
    pub fn apply(&self, dir: &Path) -> Result<()> {
        if let Some(gid) = self.gid {
            rustix::fs::chown(dir, None, Some(rustix::fs::Gid::from_raw(gid))).map_err(|e| {
                Error::io(format!("chgrp {} to group {gid}", dir.display()), e.into())
            })?;
        }
        std::fs::set_permissions(dir, Permissions::from_mode(self.mode))
            .map_err(|e| Error::io(format!("chmod {:o} {}", self.mode, dir.display()), e))
    }

    /// True when the existing directory `dir` already has this group and
    /// mode.
    pub fn is_on(&self, dir: &std::fs::Metadata) -> bool {
        use std::os::unix::fs::MetadataExt;
        dir.mode() & 0o7777 == self.mode && self.gid.is_none_or(|g| dir.gid() == g)
    }
}

/// The id of the group `name` (a name from the system's group database,
/// or a number), if it exists.
pub fn group_id(name: &str) -> Option<u32> {
    if let Ok(gid) = name.parse::<u32>() {
        return Some(gid);
    }
    let cname = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 16 << 10];
    let mut group: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` outlives it and
    // only `gr_gid`, a plain integer, is read afterwards.
    let rc = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut group,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    (rc == 0 && !found.is_null()).then_some(group.gr_gid)
}

/// Creates `dir` and its missing parents with mode 0755 whatever the umask.
pub fn ensure_dir(dir: &Path) -> Result<()> {
    ensure_dir_with(dir, DirMode::PRIVATE)
}

/// Creates `dir` and its missing parents with `mode` whatever the umask.
pub fn ensure_dir_with(dir: &Path, mode: DirMode) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        ensure_dir_with(parent, mode)?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => mode.apply(dir),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(Error::io(format!("create directory {}", dir.display()), e)),
    }
}

/// Creates `dir` (with `mode` whatever the umask) where it is usually new:
/// one `mkdir` where [`ensure_dir_with`] looks first; any failure is left
/// to it.
pub fn create_dir_fresh(dir: &Path, mode: DirMode) -> Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => mode.apply(dir),
        Err(_) => ensure_dir_with(dir, mode),
    }
}

/// Creates `dir` (its parents 0755) with mode 0700, or takes an existing
/// one's group and world bits away: for what only the worker reads.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(dir)
        && meta.is_dir()
    {
        if meta.permissions().mode() & 0o077 == 0 {
            return Ok(());
        }
    } else {
        ensure_dir(dir)?;
    }
    std::fs::set_permissions(dir, Permissions::from_mode(0o700))
        .map_err(|e| Error::io(format!("chmod {}", dir.display()), e))
}

/// A unique hidden temporary name next to `target`, so a rename over
/// `target` is atomic and start-up recovery can find leftovers by prefix.
pub fn temp_path(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(
        "{TEMP_PREFIX}{name}.{}",
        uuid::Uuid::new_v4().simple()
    ))
}

/// Prefix of every temporary file the worker creates.
pub const TEMP_PREFIX: &str = ".tmp-";

/// Removes a file, treating "already gone" as success.
pub fn remove_file_if_exists(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("remove {}", path.display()), e)),
    }
}

/// Free bytes available to this process on the file system holding `path`.
pub fn free_space(path: &Path) -> Result<u64> {
    let st = rustix::fs::statvfs(path).map_err(|e| {
        Error::new(
            ErrorCode::Internal,
            format!("statvfs {}: {e}", path.display()),
        )
    })?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Fails with `insufficient_disk_space` when `needed` bytes do not fit in `dir`.
pub fn check_space(dir: &Path, needed: u64) -> Result<()> {
    let free = free_space(dir)?;
    if needed > free {
        return Err(Error::new(
            ErrorCode::InsufficientDiskSpace,
            format!(
                "{} needs {} MiB but only {} MiB are free",
                dir.display(),
                needed.div_ceil(1 << 20),
                free >> 20
            ),
        ));
    }
    Ok(())
}

/// True when `a` and `b` name the same directory, comparing canonical paths
/// (a part that does not exist yet is compared as written, below the
/// canonical form of its deepest existing ancestor).
pub fn same_path(a: &Path, b: &Path) -> bool {
    resolve(a) == resolve(b)
}

/// `path` made absolute with its longest existing prefix resolved
/// (symlinks, `..`), so that two spellings of one place compare equal.
pub fn resolve(path: &Path) -> PathBuf {
    let mut existing = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut rest = Vec::new();
    while !existing.exists() {
        match (existing.file_name(), existing.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name.to_os_string());
                existing = parent.to_path_buf();
            }
            _ => break,
        }
    }
    let mut out = existing.canonicalize().unwrap_or(existing);
    out.extend(rest.iter().rev());
    out
}

/// The device of the file system holding `path` (or, when it does not exist
/// yet, its deepest existing ancestor).
pub fn device_of(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let resolved = resolve(path);
    resolved
        .ancestors()
        .find_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.dev())
}

/// Makes `target` by building it under the temporary name `temp` with
/// `make` and renaming it into place: readers see the old object or the new
/// one, never a half-made one, and a failure leaves no temporary behind.
pub fn replace_via_temp(
    target: &Path,
    temp: &Path,
    make: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Result<()> {
    let done = make(temp).and_then(|()| std::fs::rename(temp, target));
    done.map_err(|e| {
        let _ = std::fs::remove_file(temp);
        Error::io(format!("replace {}", target.display()), e)
    })
}

/// Writes `body` to `target` (mode `mode` whatever the umask, synced)
/// through a temporary name, created with that mode.
pub fn write_file_atomically(target: &Path, temp: &Path, body: &[u8], mode: u32) -> Result<()> {
    write_via_temp(target, temp, body, mode, true)
}

/// [`write_file_atomically`] without the sync: for what a crash of the host
/// may lose (readers still see the old contents or the new, whole).
pub fn write_file_unsynced(target: &Path, temp: &Path, body: &[u8], mode: u32) -> Result<()> {
    write_via_temp(target, temp, body, mode, false)
}

fn write_via_temp(target: &Path, temp: &Path, body: &[u8], mode: u32, sync: bool) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    replace_via_temp(target, temp, |temp| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(temp)?;
        std::io::Write::write_all(&mut file, body)?;
        file.set_permissions(Permissions::from_mode(mode))?;
        if sync {
            #[cfg(test)]
            SYNCS.with(|n| n.set(n.get() + 1));
            file.sync_all()
        } else {
            Ok(())
        }
    })
}

#[cfg(test)]
thread_local! {
    /// How many files [`write_file_atomically`] synced on this thread.
    static SYNCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many files [`write_file_atomically`] synced on this thread: what a
/// test asserts to show that a path never syncs.
#[cfg(test)]
pub fn syncs_on_this_thread() -> usize {
    SYNCS.with(|n| n.get())
}

/// True when `path` names the very file `file` is open on.
fn names_inode(path: &Path, file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    file.metadata()
        .is_ok_and(|m| path_names(path, m.dev(), m.ino()))
}

/// True when `path` itself (not a symlink's target) is inode `ino` of
/// device `dev`: a lock file's path still names the file that was locked.
pub fn path_names(path: &Path, dev: u64, ino: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}

/// The owner of a process's temporaries: a token that every temporary name
/// carries, and an `flock` on `<owners>/<token>` held for the life of the
/// process. Start-up clean-up removes only temporaries whose owner's lock
/// is free, so a process never deletes the files another one is writing.
pub struct TempOwner {
    owners: PathBuf,
    token: String,
    held: std::sync::Mutex<Option<File>>,
}

impl TempOwner {
    /// An owner registering itself in `owners` when it makes its first
    /// temporary (read-only commands never write there).
    pub fn new(owners: PathBuf) -> TempOwner {
        TempOwner {
            owners,
            token: uuid::Uuid::new_v4().simple().to_string(),
            held: std::sync::Mutex::new(None),
        }
    }

    /// This owner's token (the name of its lock file).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Holds the owner lock, (re)creating the lock file if it is missing
    /// (for example after the directory was deleted).
    pub fn register(&self) -> Result<()> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let path = self.owners.join(&self.token);
        if held.as_ref().is_some_and(|f| names_inode(&path, f)) {
            return Ok(());
        }
        ensure_dir(&self.owners)?;
        let file = File::create(&path).map_err(|e| Error::io("create owner lock", e))?;
        file.try_lock()
            .map_err(|e| Error::new(ErrorCode::Internal, format!("owner lock: {e}")))?;
        *held = Some(file);
        Ok(())
    }

    /// True when the owner `token` may still be writing: it is this owner,
    /// or its lock file exists and somebody holds its lock.
    pub fn is_alive(&self, token: &str) -> bool {
        if token == self.token {
            return true;
        }
        let Ok(file) = File::open(self.owners.join(token)) else {
            return false;
        };
        match file.try_lock() {
            Ok(()) => false,
            Err(std::fs::TryLockError::WouldBlock) => true,
            Err(std::fs::TryLockError::Error(_)) => true,
        }
    }

    /// Removes the lock files of owners that are gone (each under its own
    /// lock, and only while the path still names the locked file).
    pub fn remove_dead_owners(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.owners) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == self.token {
                continue;
            }
            let Ok(file) = File::open(entry.path()) else {
                continue;
            };
            if file.try_lock().is_ok()
                && names_inode(&entry.path(), &file)
                && std::fs::remove_file(entry.path()).is_ok()
            {
                removed += 1;
            }
        }
        removed
    }

    /// A temporary name next to `target` carrying this owner's token.
    pub fn temp_next_to(&self, target: &Path) -> Result<PathBuf> {
        self.register()?;
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(target.with_file_name(format!(
            "{TEMP_PREFIX}{}.{name}.{}",
            self.token,
            uuid::Uuid::new_v4().simple()
        )))
    }

    /// Removes the temporaries (see [`TempOwner::temp_next_to`]) directly in
    /// `dir` whose owner is gone. Names without a token (older versions,
    /// short-lived probes) count as gone once unchanged for an hour.
    pub fn remove_orphans_in(&self, dir: &Path) -> Result<usize> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(0);
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(TEMP_PREFIX) else {
                continue;
            };
            if self.orphaned(rest, &entry) && remove_file_if_exists(&entry.path())? {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Whether the temporary `entry`, whose name (after any prefix) is
    /// `rest`, has no living owner.
    pub fn orphaned(&self, rest: &str, entry: &std::fs::DirEntry) -> bool {
        match rest.split_once('.') {
            Some((token, _))
                if token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()) =>
            {
                !self.is_alive(token)
            }
            _ => entry
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > std::time::Duration::from_secs(3600)),
        }
    }
}

/// Removes a temporary file when dropped unless [`TempGuard::keep`] was
/// called: a failed step never leaves a partial file behind.
pub struct TempGuard(Option<PathBuf>);

impl TempGuard {
    /// Guards `path`.
    pub fn new(path: PathBuf) -> TempGuard {
        TempGuard(Some(path))
    }

    /// The guarded path.
    pub fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }

    /// Stops guarding (the file was renamed into place).
    pub fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// What identifies one version of a file: a change of any field means new
/// contents (files replaced by a rename get a new inode and change time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    ctime: (i64, i64),
    mtime: (i64, i64),
}

impl FileStamp {
    /// The stamp of the file `m` describes.
    pub fn of(m: &std::fs::Metadata) -> FileStamp {
        use std::os::unix::fs::MetadataExt;
        FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            ctime: (m.ctime(), m.ctime_nsec()),
            mtime: (m.mtime(), m.mtime_nsec()),
        }
    }
}

/// True when every byte of `data` is zero (checked a word at a time).
pub fn is_zero(data: &[u8]) -> bool {
    // SAFETY: u128 has no invalid bit patterns; align_to handles the edges.
    let (head, body, tail) = unsafe { data.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Copies the `len` bytes of `from` into the empty file `to` keeping its
/// holes: each data extent (found with `SEEK_DATA`/`SEEK_HOLE`) is copied
/// with `copy_file_range` (read/write where the kernel cannot copy between
/// the two file systems), holes are skipped, so a sparse master of 100 GiB
/// with 3 GiB of data costs 3 GiB on the other file system, not 100.
/// Returns the bytes of data copied.
pub fn copy_sparse(from: &File, to: &File, len: u64) -> std::io::Result<u64> {
    use rustix::fs::{SeekFrom, seek};
    let mut pos = 0u64;
    let mut copied = 0u64;
    let mut kernel = true;
    while pos < len {
        // Where the next data starts (the end when only a hole is left; a
        // file system without SEEK_DATA reports all data).
        let data = match seek(from, SeekFrom::Data(pos)) {
            Ok(at) => at.min(len),
            Err(rustix::io::Errno::NXIO) => len,
            Err(_) => pos,
        };
        let hole = match seek(from, SeekFrom::Hole(data)) {
            Ok(at) => at.clamp(data, len),
            Err(_) => len,
        };
        if hole > data {
            copy_extent(from, to, data, hole - data, &mut kernel)?;
            copied += hole - data;
        }
        pos = hole.max(data);
    }
    to.set_len(len)?;
    Ok(copied)
}

/// Copies `len` bytes at `at` from `from` to the same offset of `to`:
/// `copy_file_range` while `kernel` holds, then (once the kernel refused
/// the pair of files) reads and writes, leaving all-zero blocks as holes.
fn copy_extent(
    from: &File,
    to: &File,
    at: u64,
    len: u64,
    kernel: &mut bool,
) -> std::io::Result<()> {
    use rustix::io::Errno;
    let (mut off_in, mut off_out) = (at, at);
    let end = at + len;
    while *kernel && off_in < end {
        let want = (end - off_in).min(1 << 30) as usize;
        match rustix::fs::copy_file_range(from, Some(&mut off_in), to, Some(&mut off_out), want) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {}
            Err(Errno::INTR) => {}
            Err(Errno::XDEV | Errno::NOSYS | Errno::INVAL | Errno::OPNOTSUPP | Errno::PERM) => {
                *kernel = false;
            }
            Err(e) => return Err(e.into()),
        }
    }
    copy_extent_rw(from, to, off_in, end - off_in)
}

/// The read/write half of [`copy_extent`]; all-zero blocks are not written.
fn copy_extent_rw(from: &File, to: &File, at: u64, len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    const BLOCK: usize = 1 << 20;
    let mut buf = vec![0u8; (len.min(BLOCK as u64)) as usize];
    let mut off = at;
    let end = at + len;
    while off < end {
        let want = (end - off).min(buf.len() as u64) as usize;
        let n = match from.read_at(&mut buf[..want], off) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if !is_zero(&buf[..n]) {
            to.write_all_at(&buf[..n], off)?;
        }
        off += n as u64;
    }
    Ok(())
}

/// For kernels without `openat2` (before 5.6): walks `rel` one component at
/// a time below `dir` with `O_NOFOLLOW`, so no symlink is followed at all.
pub fn open_beneath_nofollow(
    dir: &rustix::fd::OwnedFd,
    rel: &Path,
    flags: rustix::fs::OFlags,
) -> rustix::io::Result<rustix::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    use std::path::Component;
    let parts: Vec<_> = rel.components().collect();
    let mut cur: Option<rustix::fd::OwnedFd> = None;
    for (i, part) in parts.iter().enumerate() {
        let Component::Normal(name) = part else {
            return Err(rustix::io::Errno::XDEV);
        };
        let last = i + 1 == parts.len();
        let oflags = if last {
            flags | OFlags::NOFOLLOW
        } else {
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
        };
        let at = match &cur {
            Some(fd) => rustix::fs::openat(fd, *name, oflags, Mode::empty()),
            None => rustix::fs::openat(dir, *name, oflags, Mode::empty()),
        }?;
        cur = Some(at);
    }
    cur.ok_or(rustix::io::Errno::NOENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};

    /// A file of `len` bytes with data at each `(offset, len, byte)`.
    fn sparse(path: &Path, len: u64, data: &[(u64, usize, u8)]) -> File {
        let file = File::create(path).unwrap();
        for &(at, n, byte) in data {
            file.write_all_at(&vec![byte; n], at).unwrap();
        }
        file.set_len(len).unwrap();
        file.sync_all().unwrap();
        File::open(path).unwrap()
    }

    /// The copy has the bytes and the holes of the original, through
    /// `copy_file_range` and through reads and writes alike.
    #[test]
    fn sparse_copy_keeps_bytes_and_holes() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let len = 256u64 << 20;
        let data = [(0, 4096, 1u8), (100 << 20, 3 << 20, 2), (len - 10, 10, 3)];
        let from = sparse(&dir.path().join("from"), len, &data);
        for (name, kernel) in [("crf", true), ("rw", false)] {
            let path = dir.path().join(name);
            let to = File::create(&path).unwrap();
            if kernel {
                copy_sparse(&from, &to, len).unwrap();
            } else {
                let mut kernel = false;
                for &(at, n, _) in &data {
                    copy_extent(&from, &to, at, n as u64, &mut kernel).unwrap();
                }
                to.set_len(len).unwrap();
            }
            to.sync_all().unwrap();
            let (a, b) = (
                std::fs::read(dir.path().join("from")).unwrap(),
                std::fs::read(&path).unwrap(),
            );
            assert!(a == b, "{name}: bytes differ");
            let allocated = to.metadata().unwrap().blocks() * 512;
            assert!(allocated <= 8 << 20, "{name}: {allocated} bytes allocated");
        }
    }

    /// A file shorter than it was said to be is an error, not a short copy.
    #[test]
    fn sparse_copy_of_a_shrunk_file_fails() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let from = sparse(&dir.path().join("from"), 8192, &[(0, 8192, 7)]);
        let to = File::create(dir.path().join("to")).unwrap();
        let mut kernel = false;
        assert!(copy_extent(&from, &to, 0, 1 << 20, &mut kernel).is_err());
    }
}
