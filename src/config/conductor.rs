//! `[conductor]`: Ironic's image safety policy (permitted formats, where
//! `file://` sources may be read, the inspection and checksum switches).

use super::check::Report;
use crate::image_format::Format;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The directories Ironic never reads a `file://` source from, whatever
/// `[conductor]file_url_allowed_paths` says (Ironic's
/// `BLOCKED_FILE_URL_PATHS`, OSSA-2025-001): the path as written and the
/// file actually opened must lie outside them.
pub const BLOCKED_FILE_URL_PATHS: [&str; 6] = ["/dev", "/sys", "/proc", "/boot", "/etc", "/run"];

/// The blocked directory `path` is in (or is), if any.
pub fn blocked_dir(path: &Path) -> Option<&'static str> {
    BLOCKED_FILE_URL_PATHS
        .into_iter()
        .find(|dir| path.starts_with(dir))
}

/// `[conductor]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConductorSection {
    /// Formats a detected image may have: parsed when the configuration
    /// is read (a name that is no format the worker knows is refused
    /// there, with the option and its source).
    #[serde(deserialize_with = "super::value::format_list_opt")]
    pub permitted_image_formats: Vec<Format>,
    /// Directories under which `file://` sources are allowed (never
    /// under Ironic's always-refused system directories, see
    /// [`BLOCKED_FILE_URL_PATHS`]).
    #[serde(deserialize_with = "super::value::path_list_opt")]
    pub file_url_allowed_paths: Vec<PathBuf>,
    /// Ironic's `disable_deep_image_inspection` (default false): when true,
    /// the detected format is neither matched against `image_disk_format`
    /// nor against `permitted_image_formats`. The structural checks the
    /// converter relies on (backing and data files, encryption) stay.
    pub disable_deep_image_inspection: bool,
    /// Ironic's `disable_support_for_checksum_files` (default false): when
    /// true, a checksum given as an http(s) URL is refused with
    /// `checksum_not_permitted`.
    pub disable_support_for_checksum_files: bool,
    /// Ironic's `conductor_always_validates_images` (default false): with
    /// `image_download_source = http`, an http(s) source is downloaded,
    /// verified and inspected before its URL is answered.
    pub conductor_always_validates_images: bool,
}

impl Default for ConductorSection {
    fn default() -> Self {
        ConductorSection {
            permitted_image_formats: vec![Format::Raw, Format::Gpt, Format::Qcow2, Format::Iso],
            file_url_allowed_paths: [
                "/var/lib/ironic",
                "/shared/html",
                "/templates",
                "/opt/cache/files",
                "/vagrant",
            ]
            .map(PathBuf::from)
            .to_vec(),
            disable_deep_image_inspection: false,
            disable_support_for_checksum_files: false,
            conductor_always_validates_images: false,
        }
    }
}

impl ConductorSection {
    /// `file_url_allowed_paths` holds absolute paths without `.` or `..`
    /// (Ironic's `ExplicitAbsolutePath`); one inside a directory Ironic
    /// never reads file URLs from is only warned about (Ironic starts with
    /// it too), as no file there is ever read.
    pub(super) fn check(&self, report: &mut Report) {
        let option = "file_url_allowed_paths";
        for dir in &self.file_url_allowed_paths {
            let explicit = dir.is_absolute()
                && dir.components().all(|c| {
                    !matches!(
                        c,
                        std::path::Component::ParentDir | std::path::Component::CurDir
                    )
                });
            if !explicit {
                report.error(
                    "conductor",
                    option,
                    format!("{} is not an absolute path without . or ..", dir.display()),
                );
            }
            if let Some(blocked) = blocked_dir(dir) {
                report.warn(
                    "conductor",
                    option,
                    format!(
                        "{} is under {blocked}, from which file URLs are never read",
                        dir.display()
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::choice::refusal;
    use super::super::{Config, Files};
    use crate::image_format::Format;

    #[test]
    fn permitted_formats_are_parsed_once_in_any_case() {
        let flags = ["conductor.permitted_image_formats=RAW, Qcow2,vmdk".to_string()];
        let c = Config::load_from(&Files::default(), &[], &flags).unwrap();
        assert_eq!(
            c.conductor.permitted_image_formats,
            [Format::Raw, Format::Qcow2, Format::Vmdk]
        );
        // `config show` prints them by their names.
        let shown = serde_json::to_value(&c.conductor).unwrap();
        assert_eq!(
            shown["permitted_image_formats"],
            serde_json::json!(["raw", "qcow2", "vmdk"])
        );
    }

    #[test]
    fn an_unknown_permitted_format_is_refused_with_its_option() {
        let error = refusal(&["conductor.permitted_image_formats=raw,ploop"]).unwrap();
        assert!(
            error.contains(
                "[conductor]permitted_image_formats (--set conductor.permitted_image_formats): \
                 unknown image format \"ploop\" (raw, gpt, iso, qcow2, qed, vmdk, vhd, vhdx, vdi, luks)"
            ),
            "{error}"
        );
    }
}
