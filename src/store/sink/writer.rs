//! The writer of a sink: how the bytes reach the file, as the caller's
//! [`WritePolicy`] says (served bytes: zero blocks as holes, `O_DIRECT`,
//! synced; bytes read back at once: through the page cache; scratch: not
//! synced, kept within reach of the converter reading it).

use super::Piece;
use super::buf::DIRECT_ALIGN;
use crate::error::{Error, Result};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::mpsc;

/// Start write-back every this many bytes so the final fsync is short
/// (buffered writes).
const WRITEBACK_WINDOW: u64 = 32 << 20;
/// Granularity of the holes of a served file: qemu-img's (`convert -O raw`
/// leaves every zero 4 KiB block of its output a hole), so a served disk
/// allocates what qemu-img's output of the same image does, not every
/// 1 MiB chunk that holds a byte of data.
const HOLE_BLOCK: u64 = 4096;

/// How a sink's bytes reach its file: chosen by whoever knows what the
/// file is for (the pipeline, from the first bytes of a download).
#[derive(Debug, Clone, Default)]
pub enum WritePolicy {
    /// Bytes served as they are (raw, GPT, ISO): written with `O_DIRECT`
    /// where the file system takes it, straight from the aligned chunks
    /// (no page-cache copy, no write-back to wait for at the end: on this
    /// kind of virtual disk 0.9 GB/s in 1 MiB writes against 0.3-0.5 GB/s
    /// buffered with the final sync), zero 4 KiB blocks left as holes, synced.
    #[default]
    Served,
    /// Bytes read back at once (an image about to be converted or
    /// decompressed, kept): through the page cache, write-back started
    /// early so the final sync is short; zero blocks left as holes.
    ReadBack,
    /// A scratch file read once by the converter as it grows and removed
    /// after: through the page cache, never written back nor synced,
    /// written whole but for chunks that are all zeros (its length follows
    /// the download closely) in [`SCRATCH_PIECE`] writes, and kept within
    /// [`PACE_LEAD`] of the converter when there is one.
    Scratch(Option<Arc<Pace>>),
}

/// How far a scratch file's writer may run ahead of its converter. The
/// converter gives back what it has read (see `image::reclaim`), so the
/// file's pages are reused within this window instead of filling the page
/// cache with new pages (on a virtual machine each new page costs a first
/// touch: measured ~0.9 s of system time per 512 MiB written ahead, against
/// ~0.1 s within the window).
pub const PACE_LEAD: u64 = 64 << 20;

/// The size of each write to a scratch file: qemu-img's default cluster
/// size, the unit the converter punches out. The page cache makes a folio
/// of about the size of a write; a 1 MiB folio of which a 64 KiB cluster
/// is punched out is split or zeroed, not freed, so its pages are not the
/// ones the next writes get, and a new 1 MiB folio comes from memory the
/// host may have taken back (each first touch faults on the host). A
/// prepare of a 1 GiB qcow2 holding 512 MiB of data, run nine times in a
/// row, took 1.7-2.7 s of system time in eight of them with 1 MiB writes,
/// 0.6-0.7 s in all nine with 64 KiB writes (see docs/benchmarks.md,
/// section `ironic39`).
const SCRATCH_PIECE: usize = 64 << 10;

/// Where the converter of a scratch file is, shared by the writer (which
/// waits on it) and whoever hears from the converter. Until the converter
/// reports its first position, after it is over, and while it waits for
/// bytes not yet written, the writer never waits.
#[derive(Debug, Default)]
pub struct Pace {
    state: std::sync::Mutex<PaceState>,
    moved: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct PaceState {
    /// Bytes of the file the converter has read up to; `None` before it
    /// started.
    reader_at: Option<u64>,
    /// The converter waits for bytes beyond what is written.
    waiting: bool,
    /// The converter is over: the writer goes on freely.
    over: bool,
}

impl Pace {
    /// The converter has read the file up to `at` (the furthest told wins).
    pub fn reader_at(&self, at: u64) {
        self.update(|s| {
            s.reader_at = Some(s.reader_at.map_or(at, |r| r.max(at)));
            s.waiting = false;
        });
    }

    /// The converter waits for bytes not yet in the file.
    pub fn reader_waiting(&self) {
        self.update(|s| s.waiting = true);
    }

    /// The converter is over (done or failed).
    pub fn finish(&self) {
        self.update(|s| s.over = true);
    }

    fn update(&self, f: impl FnOnce(&mut PaceState)) {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()));
        self.moved.notify_all();
    }

    /// Blocks the writer while writing at `offset` would run more than
    /// [`PACE_LEAD`] ahead of the converter (each wait bounded, so a lost
    /// report only slows the writer down).
    fn hold(&self, offset: u64) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let started = std::time::Instant::now();
        while let Some(at) = s.reader_at {
            if s.over || s.waiting || offset <= at + PACE_LEAD {
                return;
            }
            let left = std::time::Duration::from_millis(100).saturating_sub(started.elapsed());
            if left.is_zero() {
                return;
            }
            s = self
                .moved
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A new file for a sink: its buffered descriptor and, where the file
/// system supports it (not tmpfs), a second one bypassing the page cache.
pub(super) struct SinkFile {
    file: File,
    direct: Option<File>,
}

impl SinkFile {
    /// Creates `path` (which must not exist), mode 0644.
    pub(super) fn create(path: &Path) -> Result<SinkFile> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(path)
            .map_err(|e| Error::io(format!("create {}", path.display()), e))?;
        crate::fsutil::set_mode(&file, 0o644)?;
        let direct = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(path)
            .ok();
        Ok(SinkFile { file, direct })
    }
}

/// The writer thread: writes each piece as `policy` says, then gives the
/// file its length and (unless it is scratch) syncs it before the caller
/// may rename it into the cache. An `abandoned` file is neither extended
/// nor synced.
pub(super) fn write_file(
    SinkFile { file, direct }: SinkFile,
    policy: WritePolicy,
    mut rx: mpsc::Receiver<Piece>,
    abandoned: &AtomicBool,
) -> Result<()> {
    let io = |what: &str, e| Error::io(format!("write image: {what}"), e);
    let (direct, durable, pace) = match policy {
        WritePolicy::Served => (direct, true, None),
        WritePolicy::ReadBack => (None, true, None),
        WritePolicy::Scratch(pace) => (None, false, pace),
    };
    let mut offset = 0u64;
    let mut synced = 0u64;
    while let Some(piece) = rx.blocking_recv() {
        let chunk = match piece {
            Piece::Data(chunk) => chunk,
            Piece::Zeros(n) => {
                offset += n;
                continue;
            }
        };
        if let Some(pace) = &pace {
            pace.hold(offset);
        }
        let written = if durable {
            write_sparse(&file, direct.as_ref(), &chunk, offset)
        } else if !crate::fsutil::is_zero(&chunk) {
            write_in_pieces(&file, &chunk, offset)
        } else {
            Ok(())
        };
        written.map_err(|e| io("write", e))?;
        offset += chunk.len() as u64;
        if direct.is_none() && durable && offset - synced >= WRITEBACK_WINDOW {
            start_writeback(&file, synced, offset - synced);
            synced = offset;
        }
    }
    if abandoned.load(Ordering::Acquire) {
        return Ok(());
    }
    file.set_len(offset).map_err(|e| io("set length", e))?;
    if durable {
        file.sync_data().map_err(|e| io("sync", e))?;
    }
    Ok(())
}

/// Writes a scratch chunk in writes that end on [`SCRATCH_PIECE`]
/// boundaries of the file (or at the chunk's end).
fn write_in_pieces(file: &File, data: &[u8], at: u64) -> std::io::Result<()> {
    let piece = SCRATCH_PIECE as u64;
    let mut done = 0usize;
    while done < data.len() {
        let here = at + done as u64;
        let len = ((here / piece + 1) * piece - here).min((data.len() - done) as u64) as usize;
        file.write_all_at(&data[done..done + len], here)?;
        done += len;
    }
    Ok(())
}

/// Writes `data` at `at` leaving its zero blocks (of [`HOLE_BLOCK`], aligned
/// on the file's offsets) as holes: each run of blocks holding data is one
/// write, so dense data still goes out in whole chunks.
fn write_sparse(file: &File, direct: Option<&File>, data: &[u8], at: u64) -> std::io::Result<()> {
    let mut run: Option<usize> = None;
    let mut i = 0usize;
    while i < data.len() {
        let block_end = ((at + i as u64) / HOLE_BLOCK + 1) * HOLE_BLOCK - at;
        let end = (block_end as usize).min(data.len());
        let zero = crate::fsutil::is_zero(&data[i..end]);
        match (zero, run) {
            (false, None) => run = Some(i),
            (true, Some(start)) => {
                write_at(file, direct, &data[start..i], at + start as u64)?;
                run = None;
            }
            _ => {}
        }
        i = end;
    }
    if let Some(start) = run {
        write_at(file, direct, &data[start..], at + start as u64)?;
    }
    Ok(())
}

/// Writes `data` at `at`: the aligned part through `direct` when it is open
/// and the buffer, offset and length allow it; the rest (an unaligned tail,
/// the end of the image) through the buffered `file`.
fn write_at(file: &File, direct: Option<&File>, data: &[u8], at: u64) -> std::io::Result<()> {
    let aligned = match direct {
        Some(_)
            if at.is_multiple_of(DIRECT_ALIGN as u64)
                && (data.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN) =>
        {
            data.len() / DIRECT_ALIGN * DIRECT_ALIGN
        }
        _ => 0,
    };
    if let (Some(direct), true) = (direct, aligned > 0) {
        match direct.write_all_at(&data[..aligned], at) {
            // A file system that accepted O_DIRECT at open but not this write.
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                file.write_all_at(&data[..aligned], at)?
            }
            other => other?,
        }
    }
    if aligned < data.len() {
        file.write_all_at(&data[aligned..], at + aligned as u64)?;
    }
    Ok(())
}

/// Starts write-back of a range of `file` (`sync_file_range`, which rustix
/// does not wrap), so the final sync is short.
fn start_writeback(file: &File, offset: u64, len: u64) {
    // SAFETY: sync_file_range only reads its integer arguments; the fd is open.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_written_in_pieces_lands_whole_at_any_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("scratch");
        let file = File::create(&path).unwrap();
        let data: Vec<u8> = (0..3 * SCRATCH_PIECE + 777)
            .map(|i| (i % 251) as u8)
            .collect();
        for at in [
            0,
            12_345,
            SCRATCH_PIECE as u64 - 1,
            5 * SCRATCH_PIECE as u64,
        ] {
            write_in_pieces(&file, &data, at).unwrap();
            let back = std::fs::read(&path).unwrap();
            assert_eq!(
                &back[at as usize..at as usize + data.len()],
                &data[..],
                "at {at}"
            );
        }
    }
}
