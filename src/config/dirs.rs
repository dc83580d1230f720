//! The directories the worker writes, checked against this process's
//! rights before it takes any work: a directory it cannot write fails every
//! prepare after the download, so it is refused at start (and by
//! `config check`), naming the option. A path several levels of which do
//! not exist yet is likely mistyped and worth a warning.

use super::Config;
use super::check::Report;
use std::path::{Path, PathBuf};

/// Checks the master directory, `images_path` and the published directory
/// under `http_root`: each exists and is writable, or can be created.
pub fn check_dirs(config: &Config, report: &mut Report) {
    let published = config
        .deploy
        .http_root
        .join(&config.deploy.http_image_subdir);
    for (section, option, dir) in [
        (
            "pxe",
            "instance_master_path",
            config.pxe.instance_master_path.clone(),
        ),
        ("pxe", "images_path", config.pxe.images_path.clone()),
        ("deploy", "http_root", published),
    ] {
        match check_dir(&dir) {
            Err(e) => report.error(section, option, e),
            Ok(Some(missing)) if !dir.starts_with(super::default_state_dir()) => report.warn(
                section,
                option,
                format!(
                    "{} does not exist: {missing} directories would be created under {} \
                     (mistyped?)",
                    dir.display(),
                    existing_ancestor(&dir).display()
                ),
            ),
            Ok(_) => {}
        }
    }
}

/// Ok(None): `dir` is a writable directory, or its parent is one to make
/// it in; Ok(Some(n)): `n` levels must be made; Err: why it cannot be used.
fn check_dir(dir: &Path) -> Result<Option<usize>, String> {
    match std::fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => Err(format!("{} is not a directory", dir.display())),
        Ok(_) => writable(dir).map(|()| None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let ancestor = existing_ancestor(dir);
            writable(&ancestor)
                .map_err(|e| format!("{} does not exist and cannot be made: {e}", dir.display()))?;
            let missing = dir.components().count() - ancestor.components().count();
            Ok((missing > 1).then_some(missing))
        }
        Err(e) => Err(format!("{}: {e}", dir.display())),
    }
}

/// The nearest ancestor of `dir` that exists.
fn existing_ancestor(dir: &Path) -> PathBuf {
    dir.ancestors()
        .skip(1)
        .find(|a| a.as_os_str().is_empty() || a.exists())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("/"))
}

/// Whether this process may make and remove files in `dir`.
fn writable(dir: &Path) -> Result<(), String> {
    use rustix::fs::{Access, access};
    access(dir, Access::WRITE_OK | Access::EXEC_OK).map_err(|e| {
        format!(
            "{} is not writable by this user (uid {}): {}",
            dir.display(),
            rustix::process::geteuid().as_raw(),
            std::io::Error::from(e)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::check_dir;

    #[test]
    fn missing_levels_are_counted_and_files_refused() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(check_dir(tmp.path()), Ok(None));
        assert_eq!(check_dir(&tmp.path().join("a")), Ok(None));
        assert_eq!(check_dir(&tmp.path().join("a/b/c")), Ok(Some(3)));
        let file = tmp.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(check_dir(&file).unwrap_err().contains("not a directory"));
        assert!(check_dir(&file.join("x")).is_err());
    }
}
