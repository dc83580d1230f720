//! One pass per byte: every byte that will be served is written to its file
//! and fed to the MD5 and SHA-256 hashers (plus the source-verification
//! digest when Ironic named another algorithm) in the same pass, each on its
//! own blocking thread, so hashing runs in parallel with the I/O and a cache
//! hit never has to read the image again.

use crate::checksum::{Algo, Hasher};
use crate::error::{Error, ErrorCode, Result};
use bytes::{Bytes, BytesMut};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Size of the chunks handed to the writer and the hashers.
pub const CHUNK: usize = 1 << 20;
/// Chunks queued per consumer: bounds memory to a few MiB per stream.
const DEPTH: usize = 8;
/// Start write-back every this many bytes so the final fsync is short.
const WRITEBACK_WINDOW: u64 = 32 << 20;

/// The digests and size of everything written through a [`Sink`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Digests {
    /// Bytes written.
    pub size: u64,
    /// MD5 hex of the bytes.
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
    /// The digest for `algo`, when it was computed.
    pub fn get(&self, algo: Algo) -> Option<&str> {
        match algo {
            Algo::Md5 => Some(&self.md5),
            Algo::Sha256 => Some(&self.sha256),
            Algo::Sha512 => self.sha512.as_deref(),
        }
    }
}

enum Output {
    Written,
    Digest(Algo, String, std::time::Duration),
}

/// A file being written plus its hashers; see the module documentation.
pub struct Sink {
    senders: Vec<mpsc::Sender<Bytes>>,
    tasks: Vec<JoinHandle<Result<Output>>>,
    buf: BytesMut,
    size: u64,
}

impl Sink {
    /// Creates `path` (which must not exist, mode 0644) and starts the writer
    /// and the hashers. SHA-512 is computed too when `sha512` is set.
    pub fn create(path: &Path, sha512: bool) -> Result<Sink> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(path)
            .map_err(|e| Error::io(format!("create {}", path.display()), e))?;
        crate::fsutil::set_mode(&file, 0o644)?;
        Ok(Sink::new(Some(file), sha512))
    }

    /// Hashes without writing anywhere (for bytes already on disk).
    pub fn hash_only(sha512: bool) -> Sink {
        Sink::new(None, sha512)
    }

    fn new(file: Option<File>, sha512: bool) -> Sink {
        let mut sink = Sink {
            senders: Vec::new(),
            tasks: Vec::new(),
            buf: BytesMut::with_capacity(CHUNK),
            size: 0,
        };
        if let Some(file) = file {
            sink.spawn(move |rx| write_file(file, rx));
        }
        let mut algos = vec![Algo::Md5, Algo::Sha256];
        if sha512 {
            algos.push(Algo::Sha512);
        }
        for algo in algos {
            sink.spawn(move |mut rx| {
                let mut hasher = Hasher::new(algo);
                let mut busy = std::time::Duration::ZERO;
                while let Some(chunk) = rx.blocking_recv() {
                    let t = std::time::Instant::now();
                    hasher.update(&chunk);
                    busy += t.elapsed();
                }
                Ok(Output::Digest(algo, hasher.finalize_hex(), busy))
            });
        }
        sink
    }

    fn spawn(&mut self, f: impl FnOnce(mpsc::Receiver<Bytes>) -> Result<Output> + Send + 'static) {
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
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == CHUNK {
                self.flush().await?;
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, BytesMut::with_capacity(CHUNK)).freeze();
        self.size += chunk.len() as u64;
        for tx in &self.senders {
            if tx.send(chunk.clone()).await.is_err() {
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

/// The writer thread: zero chunks become holes, write-back starts early, and
/// the file is synced before the caller may rename it into the cache.
fn write_file(file: File, mut rx: mpsc::Receiver<Bytes>) -> Result<Output> {
    let io = |what: &str, e| Error::io(format!("write image: {what}"), e);
    let mut offset = 0u64;
    let mut synced = 0u64;
    while let Some(chunk) = rx.blocking_recv() {
        if !is_zero(&chunk) {
            file.write_all_at(&chunk, offset)
                .map_err(|e| io("write", e))?;
        }
        offset += chunk.len() as u64;
        if offset - synced >= WRITEBACK_WINDOW {
            start_writeback(&file, synced, offset - synced);
            synced = offset;
        }
    }
    file.set_len(offset).map_err(|e| io("set length", e))?;
    file.sync_data().map_err(|e| io("sync", e))?;
    Ok(Output::Written)
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

/// True when every byte of `data` is zero (checked a word at a time).
pub fn is_zero(data: &[u8]) -> bool {
    // SAFETY: u128 has no invalid bit patterns; align_to handles the edges.
    let (head, body, tail) = unsafe { data.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}
