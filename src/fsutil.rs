//! Small file-system helpers shared by the cache and the node links: explicit
//! permissions whatever the umask, atomic replacement, free space.

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

/// Creates `dir` and its missing parents with mode 0755 whatever the umask.
pub fn ensure_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        ensure_dir(parent)?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => std::fs::set_permissions(dir, Permissions::from_mode(0o755))
            .map_err(|e| Error::io(format!("chmod {}", dir.display()), e)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(Error::io(format!("create directory {}", dir.display()), e)),
    }
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

/// Removes the worker's temporaries (see [`TEMP_PREFIX`]) directly in `dir`,
/// left behind by a crashed run; a missing `dir` has none.
pub fn remove_temps_in(dir: &Path) -> Result<usize> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(0);
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX)
            && remove_file_if_exists(&entry.path())?
        {
            removed += 1;
        }
    }
    Ok(removed)
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
