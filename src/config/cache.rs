//! `[cache]`: housekeeping of the master cache beyond Ironic's `[pxe]`
//! limits, and the group and mode of the directories shared with Ironic.

use super::check::{Report, config_error};
use crate::error::Result;
use serde::{Deserialize, Serialize};

/// `[cache]`: housekeeping of the master cache beyond Ironic's `[pxe]` limits.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheSection {
    /// Seconds between periodic clean-ups (TTL and size limit), 0 = never.
    pub clean_interval: u64,
    /// Seconds after which a node's files that no prepare asked for (files
    /// left by a conductor takeover) are removed by the periodic clean-up,
    /// 0 = never.
    pub node_files_ttl: u64,
    /// Group given to the directories shared with Ironic
    /// (`images_path/<node>/`, `http_root/<subdir>/`) when the worker
    /// creates them; empty = the worker's own group.
    pub shared_group: String,
    /// Octal mode of those directories (`"2775"` with a shared group).
    pub shared_dir_mode: String,
}

impl Default for CacheSection {
    fn default() -> Self {
        CacheSection {
            clean_interval: 600,
            node_files_ttl: 7 * 24 * 3600,
            shared_group: String::new(),
            shared_dir_mode: "0755".into(),
        }
    }
}

impl CacheSection {
    /// The group and mode of the directories shared with Ironic, checked:
    /// the worker keeps owner rwx, no setuid or sticky bit (a sticky
    /// directory would stop Ironic removing the worker's files), and a
    /// shared group needs group write access to be of any use.
    pub fn shared_dirs(&self) -> Result<crate::fsutil::DirMode> {
        self.dir_mode()
            .map_err(|(option, why)| config_error(format!("[cache]{option}: {why}")))
    }

    /// [`CacheSection::shared_dirs`], or the option at fault and why.
    fn dir_mode(&self) -> Result<crate::fsutil::DirMode, (&'static str, String)> {
        let bad = |why: &str| {
            (
                "shared_dir_mode",
                format!("{:?}: {why}", self.shared_dir_mode),
            )
        };
        let mode = u32::from_str_radix(self.shared_dir_mode.trim_start_matches("0o"), 8)
            .map_err(|_| bad("not an octal mode"))?;
        if mode & !0o2777 != 0 {
            return Err(bad("only permission bits and setgid (2000) are allowed"));
        }
        if mode & 0o700 != 0o700 {
            return Err(bad("the owner (the worker) needs rwx"));
        }
        let gid = match self.shared_group.as_str() {
            "" => None,
            name => Some(
                crate::fsutil::group_id(name)
                    .ok_or_else(|| ("shared_group", format!("no group {name:?}")))?,
            ),
        };
        if gid.is_some() && mode & 0o070 != 0o070 {
            return Err(bad("a shared group needs rwx (for example 2775)"));
        }
        Ok(crate::fsutil::DirMode { mode, gid })
    }

    /// The shared directories' group and mode are usable.
    pub(super) fn check(&self, report: &mut Report) {
        if let Err((option, why)) = self.dir_mode() {
            report.error("cache", option, why);
        }
    }
}
