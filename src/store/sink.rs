//! One pass per byte: every byte that will be served is written to its file
//! and fed to the SHA-256 hasher (and the MD5 and SHA-512 ones when they are
//! wanted, see [`Served`]) (plus the source-verification
//! digest when Ironic named another algorithm) in the same pass, each on its
//! own blocking thread, so hashing runs in parallel with the I/O and a cache
//! hit never has to read the image again.

use crate::error::{Error, ErrorCode, Result};
use crate::store::checksum::{Algo, Hasher};
use bytes::Bytes;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Size of the chunks handed to the writer and the hashers.
pub const CHUNK: usize = 1 << 20;
/// Chunks queued per consumer: bounds memory to a few MiB per stream.
const DEPTH: usize = 4;
/// Start write-back every this many bytes so the final fsync is short
/// (buffered writes).
const WRITEBACK_WINDOW: u64 = 32 << 20;
/// Granularity of the holes of a served file: qemu-img's (`convert -O raw`
/// leaves every zero 4 KiB block of its output a hole), so a served disk
/// allocates what qemu-img's output of the same image does, not every
/// 1 MiB chunk that holds a byte of data.
const HOLE_BLOCK: u64 = 4096;
/// Alignment of direct (`O_DIRECT`) writes: offsets, lengths and buffers.
/// Chunks are allocated with it, so a full chunk goes to the device as it
/// is, without a copy into a bounce buffer.
const DIRECT_ALIGN: usize = 4096;

/// The digests and size of everything written through a [`Sink`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Digests {
    /// Bytes written.
    pub size: u64,
    /// MD5 hex of the bytes; empty when it was not computed (see
    /// [`Served`]).
    pub md5: String,
    /// SHA-256 hex of the bytes.
    pub sha256: String,
    /// SHA-512 hex, only when it was asked for.
    pub sha512: Option<String>,
    /// Microseconds the slowest hasher spent hashing (beside the I/O).
    #[serde(default)]
    pub hash_micros: u64,
}

impl Digests {
    /// The time the hashers spent (the slowest of them).
    pub fn hashing(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.hash_micros)
    }
}

impl Digests {
    /// The digest for `algo`, when it was computed.
    pub fn get(&self, algo: Algo) -> Option<&str> {
        match algo {
            Algo::Md5 => Some(&self.md5),
            Algo::Sha256 => Some(&self.sha256),
            Algo::Sha512 => self.sha512.as_deref(),
        }
    }
}

/// What travels from a [`Sink`] to its writer and hashers.
#[derive(Clone)]
enum Piece {
    /// Bytes, written (zero chunks as holes) and hashed.
    Data(Bytes),
    /// A run of zeros known without reading it (an unallocated range of a
    /// sparse image): a hole for the writer, zeros for the hashers.
    Zeros(u64),
}

/// Zeros fed to the hashers for [`Piece::Zeros`].
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// The pipeline's test of a download's first chunk: true when the bytes
/// will be converted rather than served as they are.
pub type Converted = fn(&[u8]) -> bool;

/// Which digests of the served bytes are computed besides SHA-256 (always
/// computed: Ironic writes it into `image_os_hash_value`). MD5 is the
/// dearest digest (about 0.8 GB/s a core against 1.8 GB/s for SHA-256), so
/// it is computed only when the completion will carry it (`[agent]
/// served_md5`); SHA-512 only when the request's algorithm is sha512.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Compute the MD5 (`image_checksum`).
    pub md5: bool,
    /// Compute the SHA-512.
    pub sha512: bool,
}

impl Default for Served {
    /// MD5 and SHA-256: what a completion carries by default.
    fn default() -> Served {
        Served {
            md5: true,
            sha512: false,
        }
    }
}

/// Which digests a [`Sink`] computes.
#[derive(Debug, Clone, Default)]
pub struct Hashes {
    /// The digests of the served bytes (MD5 is computed anyway when it is
    /// `keep`).
    pub served: Served,
    /// For a download that will be converted when it turns out to be a
    /// convertible format (`converted`): skip every digest but
    /// `keep`, since the served bytes are hashed by the conversion and the
    /// source is only verified with the algorithm Ironic named. Skipped
    /// digests are empty strings. Such a file is scratch, read once by the
    /// converter and removed: it is neither written back early nor synced.
    pub lazy_if_converted: bool,
    /// How the first chunk tells bytes that will be converted (read back at
    /// once) from bytes served as they are: the pipeline's test, from
    /// `image/`. `None`: everything is served as it is.
    pub converted: Option<Converted>,
    /// The digest always computed (the expected checksum's algorithm).
    pub keep: Option<Algo>,
    /// The converter reading a scratch file while it is written: the writer
    /// keeps within [`PACE_LEAD`] of it.
    pub pace: Option<Arc<Pace>>,
}

/// How far a scratch file's writer may run ahead of its converter. The
/// converter gives back what it has read (see `image::reclaim`), so the
/// file's pages are reused within this window instead of filling the page
/// cache with new pages (on a virtual machine each new page costs a first
/// touch: measured ~0.9 s of system time per 512 MiB written ahead, against
/// ~0.1 s within the window).
pub const PACE_LEAD: u64 = 64 << 20;

/// Where the converter of a scratch file is, shared by the writer (which
/// waits on it) and whoever hears from the converter. Until the converter
/// reports its first position, after it is over, and while it waits for
/// bytes not yet written, the writer never waits.
#[derive(Debug, Default)]
pub struct Pace {
    state: Mutex<PaceState>,
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

enum Output {
    Written,
    Digest(Algo, String, std::time::Duration),
}

/// A file being written plus its hashers; see the module documentation.
pub struct Sink {
    senders: Vec<mpsc::Sender<Piece>>,
    tasks: Vec<JoinHandle<Result<Output>>>,
    buf: AlignedBuf,
    pool: Pool,
    size: u64,
    /// Set by [`Sink::abandon`]: the writer neither extends nor syncs.
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

/// Chunk buffers the consumers are done with, reused for the next chunks:
/// a fresh 1 MiB allocation costs 256 page faults and as many zeroed pages
/// (measured: ~13% of the CPU of a 2 GiB download), more than filling it.
type Pool = Arc<Mutex<Vec<AlignedBuf>>>;

/// Buffers kept in a [`Pool`]: as many as can be in flight (each consumer
/// queues [`DEPTH`] chunks, all consumers share them).
const POOLED: usize = DEPTH + 2;

/// A frozen chunk: its buffer goes back to the sink's pool when the last
/// consumer drops it.
struct Chunk {
    buf: Option<AlignedBuf>,
    pool: Weak<Mutex<Vec<AlignedBuf>>>,
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], AlignedBuf::as_slice)
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let (Some(mut buf), Some(pool)) = (self.buf.take(), self.pool.upgrade()) {
            let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < POOLED {
                buf.len = 0;
                pool.push(buf);
            }
        }
    }
}

impl Sink {
    /// Creates `path` (which must not exist, mode 0644) and starts the writer
    /// and the hashers of the `served` digests.
    pub fn create(path: &Path, served: Served) -> Result<Sink> {
        Self::create_hashing(
            path,
            Hashes {
                served,
                ..Hashes::default()
            },
        )
    }

    /// [`Sink::create`] with the digests chosen by `hashes`.
    pub fn create_hashing(path: &Path, hashes: Hashes) -> Result<Sink> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(path)
            .map_err(|e| Error::io(format!("create {}", path.display()), e))?;
        crate::fsutil::set_mode(&file, 0o644)?;
        // A second descriptor bypassing the page cache, where the file
        // system supports it (not tmpfs): see `write_file`.
        let direct = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(path)
            .ok();
        Ok(Sink::new(Some((file, direct)), hashes))
    }

    /// Hashes without writing anywhere (for bytes already on disk).
    pub fn hash_only(served: Served) -> Sink {
        Sink::new(
            None,
            Hashes {
                served,
                ..Hashes::default()
            },
        )
    }

    fn new(file: Option<(File, Option<File>)>, hashes: Hashes) -> Sink {
        let mut sink = Sink {
            senders: Vec::new(),
            tasks: Vec::new(),
            buf: AlignedBuf::new(CHUNK),
            pool: Pool::default(),
            size: 0,
            abandoned: Arc::default(),
        };
        if let Some((file, direct)) = file {
            let (scratch, pace) = (hashes.lazy_if_converted, hashes.pace.clone());
            let converted = hashes.converted;
            let abandoned = sink.abandoned.clone();
            sink.spawn(move |rx| {
                write_file(file, direct, (scratch, converted), pace, rx, &abandoned)
            });
        }
        let mut algos = vec![Algo::Sha256];
        if hashes.served.md5 || hashes.keep == Some(Algo::Md5) {
            algos.push(Algo::Md5);
        }
        if hashes.served.sha512 || hashes.keep == Some(Algo::Sha512) {
            algos.push(Algo::Sha512);
        }
        for algo in algos {
            let lazy = hashes.lazy_if_converted && hashes.keep != Some(algo);
            let converted = hashes.converted;
            sink.spawn(move |mut rx| {
                let mut hasher = Hasher::new(algo);
                let mut busy = std::time::Duration::ZERO;
                let mut skip = None;
                while let Some(piece) = rx.blocking_recv() {
                    let first: &[u8] = match &piece {
                        Piece::Data(chunk) => chunk,
                        Piece::Zeros(_) => &ZEROS,
                    };
                    if *skip.get_or_insert_with(|| lazy && converted.is_some_and(|c| c(first))) {
                        continue;
                    }
                    let t = std::time::Instant::now();
                    match piece {
                        Piece::Data(chunk) => hasher.update(&chunk),
                        Piece::Zeros(mut n) => {
                            while n > 0 {
                                let take = n.min(ZEROS.len() as u64) as usize;
                                hasher.update(&ZEROS[..take]);
                                n -= take as u64;
                            }
                        }
                    }
                    busy += t.elapsed();
                }
                let hex = if skip == Some(true) {
                    String::new()
                } else {
                    hasher.finalize_hex()
                };
                Ok(Output::Digest(algo, hex, busy))
            });
        }
        sink
    }

    fn spawn(&mut self, f: impl FnOnce(mpsc::Receiver<Piece>) -> Result<Output> + Send + 'static) {
        let (tx, rx) = mpsc::channel(DEPTH);
        self.senders.push(tx);
        self.tasks.push(tokio::task::spawn_blocking(move || f(rx)));
    }

    /// Bytes accepted so far.
    pub fn size(&self) -> u64 {
        self.size + self.buf.len() as u64
    }

    /// Appends `data`, handing full chunks to the consumers.
    pub async fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let take = (CHUNK - self.buf.len()).min(data.len());
            self.buf.extend(&data[..take]);
            data = &data[take..];
            if self.buf.len() == CHUNK {
                self.flush().await?;
            }
        }
        Ok(())
    }

    /// Appends up to `len` bytes read from `file` at `offset` straight into
    /// the chunk being built (no intermediate buffer); returns the bytes
    /// read, 0 at the end of the file. The read blocks the calling thread:
    /// for producers on a thread of their own (the converter process).
    pub async fn read_at(&mut self, file: &File, offset: u64, len: usize) -> Result<usize> {
        let take = (CHUNK - self.buf.len()).min(len);
        let n = self
            .buf
            .fill_from(file, offset, take)
            .map_err(|e| Error::io("read image", e))?;
        if self.buf.len() == CHUNK {
            self.flush().await?;
        }
        Ok(n)
    }

    /// Appends `n` zero bytes without materialising them: the file gets a
    /// hole and the hashers hash zeros (for ranges known to be empty, such
    /// as unallocated clusters of a sparse image).
    pub async fn write_zeros(&mut self, n: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.flush().await?;
        self.size += n;
        self.send(Piece::Zeros(n)).await
    }

    async fn flush(&mut self) -> Result<()> {
        if self.buf.len() == 0 {
            return Ok(());
        }
        let next = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let full = std::mem::replace(
            &mut self.buf,
            next.unwrap_or_else(|| AlignedBuf::new(CHUNK)),
        );
        let chunk = Bytes::from_owner(Chunk {
            buf: Some(full),
            pool: Arc::downgrade(&self.pool),
        });
        self.size += chunk.len() as u64;
        self.send(Piece::Data(chunk)).await
    }

    async fn send(&mut self, piece: Piece) -> Result<()> {
        for tx in &self.senders {
            if tx.send(piece.clone()).await.is_err() {
                // A consumer stopped early: its error is reported by finish().
                return self.fail().await;
            }
        }
        Ok(())
    }

    async fn fail(&mut self) -> Result<()> {
        self.senders.clear();
        for task in self.tasks.drain(..) {
            join(task).await?;
        }
        Err(Error::new(ErrorCode::Internal, "a sink consumer stopped"))
    }

    /// Stops without finishing, for bytes that will never be used: the
    /// consumers are told and waited for, so the file is closed (its space
    /// given back once it is removed) when this returns, and it is neither
    /// extended nor synced.
    pub async fn abandon(mut self) {
        self.abandoned
            .store(true, std::sync::atomic::Ordering::Release);
        self.senders.clear();
        for task in self.tasks.drain(..) {
            let _ = join(task).await;
        }
    }

    /// Flushes, waits for the file to be durable and returns the digests.
    pub async fn finish(mut self) -> Result<Digests> {
        self.flush().await?;
        self.senders.clear();
        let mut digests = Digests {
            size: self.size,
            md5: String::new(),
            sha256: String::new(),
            sha512: None,
            hash_micros: 0,
        };
        for task in self.tasks.drain(..) {
            if let Output::Digest(algo, hex, busy) = join(task).await? {
                digests.hash_micros = digests.hash_micros.max(busy.as_micros() as u64);
                match algo {
                    Algo::Md5 => digests.md5 = hex,
                    Algo::Sha256 => digests.sha256 = hex,
                    Algo::Sha512 => digests.sha512 = Some(hex),
                }
            }
        }
        Ok(digests)
    }
}

async fn join(task: JoinHandle<Result<Output>>) -> Result<Output> {
    task.await
        .map_err(|e| Error::new(ErrorCode::Internal, format!("sink thread: {e}")))?
}

/// The writer thread: zero chunks become holes, and the file is synced
/// before the caller may rename it into the cache (unless it is scratch).
///
/// Images that are served as they are (raw, GPT, ISO: detected from the first
/// chunk) are written with `O_DIRECT` when `direct` is open, straight from
/// the aligned chunks: no page-cache copy, no write-back to wait for at the
/// end (on this kind of virtual disk, 0.9 GB/s direct in 1 MiB writes vs
/// about 0.3-0.5 GB/s buffered with the final sync, and less CPU). Images
/// that will be read back at once (a qcow2 about to be converted) stay in
/// the page cache; when `scratch` is set and they will be converted, they
/// are neither written back nor synced (the converter reads them from memory
/// and they are removed after) and the writer keeps pace with the converter
/// when there is one; otherwise write-back starts early so the final fsync
/// is short.
fn write_file(
    file: File,
    direct: Option<File>,
    (scratch, converted): (bool, Option<Converted>),
    mut pace: Option<Arc<Pace>>,
    mut rx: mpsc::Receiver<Piece>,
    abandoned: &std::sync::atomic::AtomicBool,
) -> Result<Output> {
    let io = |what: &str, e| Error::io(format!("write image: {what}"), e);
    let mut offset = 0u64;
    let mut synced = 0u64;
    let mut direct = direct;
    let mut durable = true;
    let mut held = None;
    let mut first = true;
    while let Some(piece) = rx.blocking_recv() {
        let chunk = match piece {
            Piece::Data(chunk) => chunk,
            Piece::Zeros(n) => {
                first = false;
                offset += n;
                continue;
            }
        };
        if std::mem::take(&mut first) && converted.is_some_and(|c| c(&chunk)) {
            direct = None;
            durable = !scratch;
            held = if scratch { pace.take() } else { None };
        }
        if let Some(pace) = &held {
            pace.hold(offset);
        }
        // Served bytes keep every zero block as a hole; a scratch file
        // (read by the converter as it grows, removed after) is written
        // whole unless the chunk is all zeros, so its length follows the
        // download closely.
        let written = if durable {
            write_sparse(&file, direct.as_ref(), &chunk, offset)
        } else if !crate::fsutil::is_zero(&chunk) {
            write_at(&file, direct.as_ref(), &chunk, offset)
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
    if abandoned.load(std::sync::atomic::Ordering::Acquire) {
        return Ok(Output::Written);
    }
    file.set_len(offset).map_err(|e| io("set length", e))?;
    if durable {
        file.sync_data().map_err(|e| io("sync", e))?;
    }
    Ok(Output::Written)
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

/// A heap buffer aligned for `O_DIRECT`.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
    len: usize,
}

// SAFETY: the buffer is exclusively owned, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn layout(cap: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(cap, DIRECT_ALIGN).expect("valid layout")
    }

    fn new(cap: usize) -> AlignedBuf {
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(Self::layout(cap)) };
        let ptr = std::ptr::NonNull::new(raw)
            .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(cap)));
        AlignedBuf { ptr, cap, len: 0 }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Appends `data`; the caller keeps `len + data.len() <= capacity`.
    fn extend(&mut self, data: &[u8]) {
        assert!(self.len + data.len() <= self.cap, "aligned buffer overflow");
        // SAFETY: in bounds (checked above); the regions cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().add(self.len),
                data.len(),
            );
        }
        self.len += data.len();
    }

    /// Appends up to `max` bytes read from `file` at `offset` (at most the
    /// room left); returns how many.
    fn fill_from(&mut self, file: &File, offset: u64, max: usize) -> std::io::Result<usize> {
        let room = max.min(self.cap - self.len);
        // SAFETY: in bounds; the spare part is only written to (as
        // uninitialised bytes) by the read below.
        let spare = unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr
                    .as_ptr()
                    .add(self.len)
                    .cast::<std::mem::MaybeUninit<u8>>(),
                room,
            )
        };
        let n = loop {
            match rustix::io::pread(file, &mut *spare, offset) {
                Ok((read, _)) => break read.len(),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        self.len += n;
        Ok(n)
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: the first `len` bytes were initialised by `extend` or
        // `fill_from`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

// SAFETY (Sync): shared access only reads the initialised bytes.
unsafe impl Sync for AlignedBuf {}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

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

    /// Data, holes and an unaligned tail, through direct and buffered
    /// writes: the file holds exactly the bytes, the digests are theirs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_and_digests_match_the_bytes() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        for (name, lead) in [("raw", &b"\x01raw"[..]), ("qcow2", &b"QFI\xfb"[..])] {
            let mut bytes = Vec::new();
            for i in 0..23u32 {
                let len = if i == 11 { 4096 * 3 + 7 } else { 700_001 };
                let fill = if i % 5 == 2 {
                    0
                } else {
                    (i * 37 % 251) as u8 + 1
                };
                bytes.extend(std::iter::repeat_n(fill, len));
            }
            bytes.extend(std::iter::repeat_n(0u8, 3 << 20));
            bytes.extend_from_slice(b"tail");
            bytes[..lead.len()].copy_from_slice(lead);
            let path = dir.path().join(name);
            let mut sink = Sink::create(
                &path,
                Served {
                    md5: true,
                    sha512: true,
                },
            )
            .unwrap();
            for piece in bytes.chunks(300_007) {
                sink.write(piece).await.unwrap();
            }
            let d = sink.finish().await.unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "{name}");
            assert_eq!(d.size, bytes.len() as u64);
            let mut md5 = Hasher::new(Algo::Md5);
            md5.update(&bytes);
            assert_eq!(d.md5, md5.finalize_hex());
            let mut sha = Hasher::new(Algo::Sha512);
            sha.update(&bytes);
            assert_eq!(d.sha512.unwrap(), sha.finalize_hex());
        }
    }

    /// A download that will be converted hashes only the expected algorithm;
    /// one served as it is hashes everything.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lazy_hashes_skip_what_conversion_recomputes() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let hashes = Hashes {
            served: Served::default(),
            lazy_if_converted: true,
            converted: Some(|first: &[u8]| first.starts_with(b"QFI\xfb")),
            keep: Some(Algo::Sha256),
            pace: None,
        };
        for (name, lead, served) in [("q", &b"QFI\xfb"[..], false), ("r", &b"data"[..], true)] {
            let mut sink = Sink::create_hashing(&dir.path().join(name), hashes.clone()).unwrap();
            sink.write(lead).await.unwrap();
            sink.write(&[7u8; 5000]).await.unwrap();
            let d = sink.finish().await.unwrap();
            assert_eq!(d.sha256.len(), 64, "{name}");
            assert_eq!(d.md5.is_empty(), !served, "{name}");
        }
    }

    /// Zero 4 KiB blocks inside a chunk with data become holes (the file
    /// holds the bytes, and allocates only the blocks with data).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zero_blocks_inside_a_chunk_are_holes() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("scattered");
        let mut bytes = vec![0u8; 4 << 20];
        for at in (0..bytes.len()).step_by(64 << 10) {
            bytes[at..at + 4096].fill(0x5a);
        }
        bytes[(3 << 20) + 40_000] = 1;
        let mut sink = Sink::create(&path, Served::default()).unwrap();
        sink.write(&bytes).await.unwrap();
        sink.finish().await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
        // 64 blocks of data plus one: what the file system may round up
        // (its blocks are at most 64 KiB here) stays far below 4 MiB.
        assert!(allocated <= 65 * 4096 * 2, "{allocated} bytes allocated");
    }

    /// An abandoned sink has closed its file when `abandon` returns, and
    /// has not extended it to the bytes it was given.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoned_sink_has_let_go_of_its_file() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("gone");
        let mut sink = Sink::create(&path, Served::default()).unwrap();
        sink.write(&[9u8; 3 << 20]).await.unwrap();
        sink.write_zeros(1 << 30).await.unwrap();
        sink.abandon().await;
        let open = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == path))
            .count();
        assert_eq!(open, 0, "no descriptor left on the file");
        assert!(std::fs::metadata(&path).unwrap().len() < 1 << 30);
    }

    /// MD5 is left out when asked, unless it is the expected algorithm.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn md5_is_skipped_unless_it_is_the_one_kept() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        for (name, keep, computed) in [
            ("a", Some(Algo::Sha256), false),
            ("b", Some(Algo::Md5), true),
        ] {
            let hashes = Hashes {
                keep,
                served: Served {
                    md5: false,
                    sha512: false,
                },
                ..Hashes::default()
            };
            let mut sink = Sink::create_hashing(&dir.path().join(name), hashes).unwrap();
            sink.write(&[5u8; 70_000]).await.unwrap();
            let d = sink.finish().await.unwrap();
            assert_eq!(d.sha256.len(), 64, "{name}");
            assert_eq!(!d.md5.is_empty(), computed, "{name}");
        }
    }
}
