//! Giving back the memory of a qcow2 download as the converter consumes it.
//!
//! A qcow2 converted while it downloads is scratch: the raw result is what
//! gets cached, and the download is removed once it is converted. Left
//! alone, its pages fill the page cache and are written back to disk for
//! nothing; on a virtual machine every new page also costs a first touch by
//! the host (measured here: 0.55-0.96 s of system time per 512 MiB, against
//! 0.12-0.18 s when each range is punched out right after it was read).
//! So the converter punches out the data clusters it has read (the file
//! keeps its size: the download goes on writing past them), and the pages
//! are reused for the next bytes that arrive (the download is written in
//! pieces of a cluster, `store::sink::writer`'s `SCRATCH_PIECE`, so what
//! is punched out frees whole page-cache folios). Compressed clusters are
//! not given back: their stored streams are not aligned, and one may share
//! a sector with the next.
//!
//! The header, the L1, L2 and refcount tables stay: the complete file is
//! still inspected after the download. Since read bytes may be gone, host
//! bytes used by two clusters (a refcount error `qemu-img check` reports)
//! fail every conversion, streamed or not, instead of reading zeros; and a
//! failed conversion cannot be retried on a file that was given back (see
//! `convert::StreamFailure`).

use crate::error::{Error, ErrorCode, Result};
use crate::image::qcow2::{self, Header};
use std::collections::BTreeMap;
use std::fs::File;

/// The data ranges of one qcow2 file already read (and given back), and
/// the metadata ranges never to be given back.
pub(crate) struct Reclaimer {
    /// A writable descriptor of the download; `None`: nothing is punched.
    file: Option<File>,
    /// Metadata ranges `(start, end)`, sorted by start.
    protected: Vec<(u64, u64)>,
    /// Data ranges claimed (read or about to be): start -> end, disjoint.
    consumed: BTreeMap<u64, u64>,
    /// Whether any range was punched.
    punched: bool,
}

impl Reclaimer {
    /// A reclaimer for the open qcow2 `source` with `header` and L1 table
    /// `l1`; punches only when `enabled` and the file can be opened again
    /// for writing (the same file, even if a retried download has replaced
    /// it under its name meanwhile).
    pub(crate) fn new(source: &File, header: &Header, l1: &[u8], enabled: bool) -> Self {
        use std::os::fd::AsRawFd;
        let same_file = format!("/proc/self/fd/{}", source.as_raw_fd());
        let file = enabled
            .then(|| std::fs::OpenOptions::new().write(true).open(same_file).ok())
            .flatten();
        let cluster = header.cluster_size();
        let mut protected = vec![
            (0, (crate::image::inspect::HEADER_LEN as u64).max(cluster)),
            (
                header.l1_table_offset,
                header.l1_table_offset + header.l1_size as u64 * 8,
            ),
            (
                header.refcount_table_offset,
                header.refcount_table_offset + header.refcount_table_clusters as u64 * cluster,
            ),
        ];
        for entry in l1.chunks_exact(8) {
            let l2 = qcow2::l2_offset(u64::from_be_bytes(entry.try_into().unwrap_or_default()));
            if l2 != 0 {
                protected.push((l2, l2 + cluster));
            }
        }
        protected.sort_unstable();
        Reclaimer {
            file,
            protected,
            consumed: BTreeMap::new(),
            punched: false,
        }
    }

    /// True when some range was given back and the file is still the
    /// download's (not replaced by a retry): it no longer holds the whole
    /// image, so it cannot be converted again.
    pub(crate) fn spoiled(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        self.punched
            && self
                .file
                .as_ref()
                .and_then(|f| f.metadata().ok())
                .is_none_or(|m| m.nlink() > 0)
    }

    /// Fails when any of `[start, start + len)` was already read.
    pub(crate) fn check(&self, start: u64, len: u64) -> Result<()> {
        let end = start.saturating_add(len);
        match self.consumed.range(..end).next_back() {
            Some((_, &punched_end)) if punched_end > start => Err(Error::new(
                ErrorCode::CorruptImage,
                format!(
                    "qcow2: host bytes at {start} are used by two clusters (a refcount error qemu-img check reports)"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Fails when any of `[start, start + len)` was already claimed, else
    /// records it as read: a data range is claimed when the converter takes
    /// it on (in guest order, before the bytes of earlier clusters are
    /// written), so two clusters sharing host bytes are found whatever
    /// still waits to be written.
    pub(crate) fn claim(&mut self, start: u64, len: u64) -> Result<()> {
        self.check(start, len)?;
        let end = start.saturating_add(len);
        match self.consumed.range_mut(..=start).next_back() {
            Some((_, last_end)) if *last_end == start => *last_end = end,
            _ => {
                self.consumed.insert(start, end);
            }
        }
        Ok(())
    }

    /// Gives back `[start, start + len)` (claimed, now read) unless it
    /// overlaps metadata.
    pub(crate) fn give_back(&mut self, start: u64, len: u64) {
        let end = start.saturating_add(len);
        let Some(file) = &self.file else { return };
        let first_after = self.protected.partition_point(|&(s, _)| s < end);
        if self.protected[..first_after]
            .iter()
            .any(|&(_, e)| e > start)
        {
            return;
        }
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(file, flags, start, len) {
            Ok(()) => self.punched = true,
            // A file system without hole punching: keep the pages.
            Err(_) => self.file = None,
        }
    }
}
