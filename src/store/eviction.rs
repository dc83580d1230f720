//! Ironic's cache clean-up policy, applied to the master cache: masters
//! still linked by a node (`st_nlink > 1`) are never evicted; unused ones
//! expire after `[pxe]image_cache_ttl`, and the oldest-used go first while
//! the cache is over `[pxe]image_cache_size` or space is needed.

use crate::error::Result;
use crate::store::cache::{Cache, OLD_META_SUFFIX};
use serde::Serialize;
use std::os::unix::fs::MetadataExt;

/// One master as the policy sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// File name in the cache directory.
    pub name: String,
    /// Bytes allocated on disk (converted masters are sparse), its
    /// compressed form's included.
    pub size: u64,
    /// Unix seconds of the last use: the latest of mtime, atime and ctime
    /// (linking a master changes its ctime), as Ironic reckons it.
    pub last_used: i64,
    /// Nodes linking it (`st_nlink - 1`).
    pub linked_nodes: u64,
    /// Whether the name carries `.converted`.
    pub converted: bool,
}

/// The limits in force.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Cache size limit, bytes.
    pub size_limit: u64,
    /// Unused masters older than this many seconds expire.
    pub ttl: i64,
}

/// Lists the masters: the plain files at the top of the cache directory
/// (sidecars, locks and temporaries live in hidden subdirectories).
pub fn list(cache: &Cache) -> Result<Vec<Entry>> {
    list_dir(cache.dir())
}

/// [`list`] of the cache directory `cache_dir`, reading only (no cache
/// opened, nothing created): what `cache list` shows, whoever runs it.
pub fn list_dir(cache_dir: &std::path::Path) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    let dir = std::fs::read_dir(cache_dir).map_err(|e| crate::error::Error::io("list cache", e))?;
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name.ends_with(OLD_META_SUFFIX) {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        out.push(Entry {
            converted: name.ends_with(crate::store::cache::CONVERTED_SUFFIX),
            name,
            size: meta.blocks() * 512
                + crate::store::compress::encoded_size_in(cache_dir, meta.ino()),
            last_used: meta.mtime().max(meta.atime()).max(meta.ctime()),
            linked_nodes: meta.nlink().saturating_sub(1),
        });
    }
    out.sort_by(|a, b| a.last_used.cmp(&b.last_used).then(a.name.cmp(&b.name)));
    Ok(out)
}

/// Chooses what to evict at time `now`: expired unlinked masters, then the
/// oldest-used unlinked ones while the total is over the limit or fewer than
/// `amount` bytes were reclaimed. `all_unused` evicts every unlinked master.
pub fn plan(
    entries: &[Entry],
    now: i64,
    policy: Policy,
    amount: u64,
    all_unused: bool,
) -> Vec<String> {
    let mut total: u64 = entries.iter().map(|e| e.size).sum();
    let mut reclaimed = 0u64;
    let mut victims = Vec::new();
    let mut candidates: Vec<&Entry> = entries.iter().filter(|e| e.linked_nodes == 0).collect();
    candidates.sort_by_key(|e| e.last_used);
    for e in candidates {
        let expired = e.last_used < now - policy.ttl;
        if all_unused || expired || total > policy.size_limit || reclaimed < amount {
            victims.push(e.name.clone());
            total -= e.size;
            reclaimed += e.size;
        }
    }
    victims
}

/// What a clean-up did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Masters removed (with their sidecars).
    pub evicted: Vec<String>,
    /// Bytes freed.
    pub freed: u64,
}

/// Applies [`plan`]: each victim is removed under its master lock, taken
/// without waiting (a master in use is skipped), and rechecked for links.
pub fn clean(
    cache: &Cache,
    policy: Policy,
    amount: u64,
    all_unused: bool,
    dry_run: bool,
) -> Result<Report> {
    let entries = list(cache)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let mut report = Report::default();
    if !dry_run {
        remove_orphans(cache)?;
    }
    for name in plan(&entries, now, policy, amount, all_unused) {
        let size = entries
            .iter()
            .find(|e| e.name == name)
            .map(|e| e.size)
            .unwrap_or(0);
        if dry_run {
            report.freed += size;
            report.evicted.push(name);
            continue;
        }
        let Some(mut guard) = cache.try_lock(&name) else {
            continue;
        };
        let path = cache.master_path(&name);
        let ino = match std::fs::metadata(&path) {
            Ok(m) if m.nlink() == 1 => m.ino(),
            _ => continue,
        };
        cache.remove_meta(&name)?;
        let removed = crate::fsutil::remove_file_if_exists(&path)?;
        cache.remove_encoded(ino)?;
        guard.remove_file();
        if removed {
            tracing::info!(master = %name, bytes = size, "evicted from the image cache");
            report.freed += size;
            report.evicted.push(name);
        }
    }
    Ok(report)
}

/// Removes the sidecars, lock files and compressed forms of masters that
/// are gone (a crash between two removals, a download that failed in a
/// process that then died). A master being made holds its lock and is
/// skipped.
fn remove_orphans(cache: &Cache) -> Result<()> {
    cache.remove_orphan_encodings()?;
    let mut names = cache.sidecar_names();
    names.extend(cache.lock_names());
    names.sort_unstable();
    names.dedup();
    for master in names {
        if !cache.master_path(&master).exists()
            && let Some(mut guard) = cache.try_lock(&master)
            && !cache.master_path(&master).exists()
        {
            cache.remove_meta(&master)?;
            guard.remove_file();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(name: &str, size: u64, last_used: i64, linked: u64) -> Entry {
        Entry {
            name: name.into(),
            size,
            last_used,
            linked_nodes: linked,
            converted: false,
        }
    }

    const POLICY: Policy = Policy {
        size_limit: 100,
        ttl: 1000,
    };

    #[test]
    fn ttl_size_and_amount_never_linked() {
        let now = 10_000;
        let entries = vec![
            e("old-linked", 50, 1, 1),
            e("old", 10, 2, 0),
            e("mid", 30, 9_500, 0),
            e("new", 30, 9_900, 0),
        ];
        // Under the limit (120 > 100 though): TTL removes "old", size removes "mid".
        assert_eq!(plan(&entries, now, POLICY, 0, false), ["old", "mid"]);
        // Nothing over limits: only the expired one.
        let roomy = Policy {
            size_limit: 1000,
            ..POLICY
        };
        assert_eq!(plan(&entries, now, roomy, 0, false), ["old"]);
        // Space needed: oldest unlinked first until reclaimed.
        assert_eq!(plan(&entries, now, roomy, 35, false), ["old", "mid"]);
        // Everything unused, never the linked one.
        assert_eq!(plan(&entries, now, roomy, 0, true), ["old", "mid", "new"]);
        assert_eq!(
            plan(&entries, now, roomy, u64::MAX, false),
            ["old", "mid", "new"]
        );
    }
}
