//! The qcow2 file the converter child reads, possibly still being
//! downloaded: every read waits until the download has written the bytes
//! it needs, so a qcow2 can be converted close behind its download (see
//! `convert::qcow2_to_raw_streaming`).

use crate::error::{Error, ErrorCode, Result};
use crate::image::reports::{ChildReport, report};
use std::time::Duration;

/// A qcow2 file still being written by the download: reads wait until the
/// file covers them (or reaches `total`), and fail if the file was unlinked
/// (the download failed or restarted on a new file).
pub(crate) struct GrowingFile {
    /// The open file.
    pub(crate) file: std::fs::File,
    /// Its size once complete.
    pub(crate) total: u64,
    /// Still being downloaded: where it is read and waited on is reported
    /// (see `store::sink::Pace`).
    grows: bool,
    /// The furthest offset read so far.
    read_to: std::sync::atomic::AtomicU64,
}

impl GrowingFile {
    /// `file`, `total` bytes once complete, still being downloaded when
    /// `grows`.
    pub(crate) fn new(file: std::fs::File, total: u64, grows: bool) -> GrowingFile {
        GrowingFile {
            file,
            total,
            grows,
            read_to: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Notes that the file was read up to `end`, reporting every 4 MiB of
    /// progress while it is being downloaded.
    pub(crate) fn note_read(&self, end: u64) {
        use std::sync::atomic::Ordering;
        let before = self.read_to.fetch_max(end, Ordering::Relaxed);
        if self.grows && end > before && end >> 22 != before >> 22 {
            report(&ChildReport::Source { source: end });
        }
    }

    /// Reads at `offset` once the file covers the range (or reached
    /// `total`); fails if the file was unlinked meanwhile. Returns the bytes
    /// read (short only at the end of the file).
    pub(crate) fn wait_read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        self.wait_covered(offset.saturating_add(buf.len() as u64))?;
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64)? {
                0 => break,
                n => done += n,
            }
        }
        self.note_read(offset + done as u64);
        Ok(done)
    }

    /// Waits until the file covers `[0, end)` (or reached `total`); fails if
    /// it was unlinked meanwhile. Tells once that it waits.
    pub(crate) fn wait_covered(&self, end: u64) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let want = end.min(self.total);
        let mut told = !self.grows;
        loop {
            let meta = self.file.metadata()?;
            if meta.len() >= want {
                return Ok(());
            }
            if meta.nlink() == 0 {
                return Err(std::io::Error::other(
                    "the image being downloaded was removed",
                ));
            }
            if !std::mem::replace(&mut told, true) {
                report(&ChildReport::Waiting { waiting: want });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// [`GrowingFile::wait_read`] of exactly `buf.len()` bytes.
    pub(crate) fn read_waiting(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        match self.wait_read(offset, buf) {
            Ok(n) if n == buf.len() => Ok(()),
            Ok(_) => Err(Error::new(
                ErrorCode::CorruptImage,
                "qcow2: a table lies past the end of the file",
            )),
            Err(e) => Err(Error::io("read qcow2 table", e)),
        }
    }
}
