//! A master's compressed form (`[http] gzip = static`): made once per
//! master, kept beside the master in the cache (`.gzip/<inode>.gz`, see
//! [`crate::gzip`] for the identity its header records), counted in the
//! cache's size and removed with the master (`eviction`).
//!
//! One compressor a master across threads and processes: the compressor
//! takes the master's gzip lock without waiting (another holder is already
//! compressing it) and looks again for a finished result under it. The file
//! is written in `.tmp/` (named after this process, so a crash leaves a
//! temporary that start-up recovery removes), synced, then renamed into
//! place: the name never holds a partial file.
//!
//! Raw disks are mostly zeros: holes (`SEEK_DATA`/`SEEK_HOLE`) are never
//! read, and zeros, a hole or a MiB read, are written as deflate blocks
//! made for them from [`ZERO_BLOCK_MIN`] on (`zero_deflate`; the compressor
//! is fully flushed first, so a block is appended as it is; a whole MiB is
//! one block made once) with their CRC-32 combined, not computed. The rest
//! is raw deflate at [`LEVEL`], a MiB that does not compress
//! ([`STORE_ABOVE`]) stored as it is, which the agent copies instead of
//! decoding. A master that cannot pay (its compressed
//! output passes `size / gzip_min_ratio`) is abandoned there and a marker
//! (`.gzip/<inode>.identity`) remembers it, so it is not tried again.

use crate::error::{Error, Result};
use crate::fsutil;
use crate::gzip::{self, Origin};
use crate::store::cache::Cache;
use crate::store::zero_deflate;
use flate2::{Compress, Compression, FlushCompress, Status};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Bytes read, and zeros appended as one chunk, at a time.
const BLOCK: usize = 1 << 20;
/// The deflate level of data: the fastest.
const LEVEL: u32 = 1;
/// Data read in pieces from this size on is deflated as a unit of its own
/// (fully flushed before and after) and stored instead when it does not
/// pay; smaller pieces (a page between holes) are deflated with what is
/// around them.
const UNIT_MIN: usize = 64 << 10;
/// A unit whose deflate output passes this share of its size is stored
/// (RFC 1951 3.2.4) instead. zlib-rs at level 1 writes fixed Huffman
/// codes, so incompressible data (compressed files, encrypted data) grows
/// by 5.5% instead of staying as it is, and the agent's zlib (1.2.13, under
/// Python 3.11) inflates such a MiB in 8.1 ms against 0.6 ms stored: eight
/// times the 1 ms that 1/8 of a MiB takes on a 1 Gbit/s link.
const STORE_ABOVE: f64 = 7.0 / 8.0;
/// Longest stored block (its LEN field is 16 bits).
const STORED_MAX: usize = 0xffff;
/// Zeros from this many on are written as blocks of their own: shorter
/// runs (a small hole between data) would pay a full flush, a block's
/// trees and the data's lost history for little (4 KiB of zeros: 87 bytes
/// as a block, 44 deflated at level 1; 64 KiB: 274 and 641).
const ZERO_BLOCK_MIN: u64 = 64 << 10;
/// A MiB of zeros, read where zeros are deflated or hashed (no allocation).
static ZEROS: [u8; BLOCK] = [0; BLOCK];
/// Compressed bytes buffered before a write.
const OUT_BUFFER: usize = 1 << 20;

/// What one compression of a master did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    /// Size of the master, bytes.
    pub input: u64,
    /// Compressed bytes written (up to where it was abandoned).
    pub output: u64,
    /// CPU time of the compressing thread.
    pub cpu: Duration,
    /// Wall time.
    pub wall: Duration,
}

/// What became of a request to compress a master.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// Its compressed file is in place.
    Compressed(Figures),
    /// It does not compress well enough: served identity, remembered.
    NotWorth(Figures),
    /// Done before (a compressed file or the marker for this very master).
    AlreadyDone,
    /// Another thread or process is compressing it right now.
    Busy,
    /// No such master (evicted, or replaced meanwhile).
    Gone,
}

/// Bytes allocated to the compressed form (or marker) of the master with
/// inode `ino` of the cache directory `dir`: read only, for a listing that
/// opens no cache.
pub fn encoded_size_in(dir: &std::path::Path, ino: u64) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir.join(gzip::DIR).join(gzip::file_name(ino)))
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

impl Cache {
    /// The directory of the compressed files.
    pub fn gzip_dir(&self) -> PathBuf {
        self.dir().join(gzip::DIR)
    }

    /// Removes the compressed form and marker of the master with inode
    /// `ino` (the master is gone or going).
    pub fn remove_encoded(&self, ino: u64) -> Result<()> {
        let dir = self.gzip_dir();
        fsutil::remove_file_if_exists(&dir.join(gzip::file_name(ino)))?;
        fsutil::remove_file_if_exists(&dir.join(gzip::marker_name(ino)))?;
        Ok(())
    }

    /// Removes the compressed files and markers whose master is no longer
    /// in the cache (evicted by a process that died in between, replaced).
    /// The directory is listed before the masters, so a file made for a
    /// master committed meanwhile is never taken for an orphan.
    pub fn remove_orphan_encodings(&self) -> Result<usize> {
        use std::os::unix::fs::MetadataExt;
        let Ok(entries) = std::fs::read_dir(self.gzip_dir()) else {
            return Ok(0);
        };
        let names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let dev = std::fs::metadata(self.dir()).map(|m| m.dev()).ok();
        let masters = self.master_inodes();
        let mut removed = 0;
        for name in names {
            let ino = name
                .strip_suffix(".gz")
                .or_else(|| name.strip_suffix(".identity"))
                .and_then(|i| i.parse::<u64>().ok());
            if let (Some(ino), Some(dev)) = (ino, dev)
                && !masters.contains(&(dev, ino))
                && fsutil::remove_file_if_exists(&self.gzip_dir().join(&name))?
            {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Compresses master `name` unless that was done or is being done (see
    /// the module documentation); blocking, CPU-bound: run it on a thread
    /// of its own.
    pub fn compress(&self, name: &str, min_ratio: f64) -> Result<Outcome> {
        let Some(master) = self.load(name) else {
            return Ok(Outcome::Gone);
        };
        let file = File::open(&master.path).map_err(|e| Error::io("open master", e))?;
        let origin = Origin::of(&file.metadata().map_err(|e| Error::io("stat master", e))?);
        if self.encoded(&origin) {
            return Ok(Outcome::AlreadyDone);
        }
        let Some(mut lock) = self.gzip_locks()?.try_acquire(&origin.ino.to_string()) else {
            return Ok(Outcome::Busy);
        };
        // Finished by another holder between the look and the lock.
        if self.encoded(&origin) {
            return Ok(Outcome::AlreadyDone);
        }
        fsutil::ensure_dir(&self.gzip_dir())?;
        let temp = self.temp_path(&origin.file_name())?;
        let guard = fsutil::TempGuard::new(temp.clone());
        let budget = (origin.size as f64 / min_ratio) as u64;
        let written = write_gzip(&file, &origin, &temp, budget)?;
        let still = std::fs::metadata(&master.path).is_ok_and(|m| Origin::of(&m) == origin);
        let outcome = match written {
            _ if !still => Outcome::Gone,
            Written::Whole(figures) => {
                let target = self.gzip_dir().join(origin.file_name());
                std::fs::rename(&temp, &target)
                    .map_err(|e| Error::io(format!("rename into {}", target.display()), e))?;
                guard.keep();
                Outcome::Compressed(figures)
            }
            Written::OverBudget(figures) => {
                let marker = self.gzip_dir().join(gzip::marker_name(origin.ino));
                let marker_temp = self.owner().temp_next_to(&marker)?;
                let body = origin.encode();
                fsutil::write_file_atomically(&marker, &marker_temp, body.as_bytes(), 0o644)?;
                fsutil::remove_file_if_exists(&self.gzip_dir().join(origin.file_name()))?;
                Outcome::NotWorth(figures)
            }
        };
        lock.remove_file();
        Ok(outcome)
    }

    /// True when the master `origin` has its compressed file or its "does
    /// not pay" marker.
    fn encoded(&self, origin: &Origin) -> bool {
        let dir = self.gzip_dir();
        let marked = std::fs::read(dir.join(gzip::marker_name(origin.ino)))
            .is_ok_and(|m| m == origin.encode().as_bytes());
        marked
            || File::open(dir.join(origin.file_name()))
                .ok()
                .and_then(|f| Origin::recorded_in(&f))
                .is_some_and(|r| r == origin.encode())
    }

    /// The locks of compressions (`.gzip/.locks/<inode>.lock`), made on
    /// first use so that `gzip = off` never makes the directory.
    fn gzip_locks(&self) -> Result<&crate::store::lock::Locks> {
        if let Some(locks) = self.gzip_locks.get() {
            return Ok(locks);
        }
        let locks = crate::store::lock::Locks::new(self.gzip_dir().join(".locks"))?;
        Ok(self.gzip_locks.get_or_init(|| locks))
    }
}

/// How far a compression went.
enum Written {
    /// The whole member, synced.
    Whole(Figures),
    /// Abandoned: the output passed the budget.
    OverBudget(Figures),
}

/// Writes `master` (identity `origin`) as one gzip member into the new
/// file `temp`, or stops once more than `budget` bytes are written.
fn write_gzip(
    master: &File,
    origin: &Origin,
    temp: &std::path::Path,
    budget: u64,
) -> Result<Written> {
    let (started, cpu) = (Instant::now(), thread_cpu());
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(temp)
        .map_err(|e| Error::io("create compressed file", e))?;
    fsutil::set_mode(&out, 0o644)?;
    let mut member = Member::new(out, budget);
    member.raw(&origin.gzip_header())?;
    let whole = read_extents(master, origin.size, &mut member)?;
    let figures = |m: &Member| Figures {
        input: origin.size,
        output: m.written + m.buf.len() as u64,
        cpu: thread_cpu().saturating_sub(cpu),
        wall: started.elapsed(),
    };
    if !whole {
        return Ok(Written::OverBudget(figures(&member)));
    }
    member.finish(origin.size)?;
    let done = figures(&member);
    if done.output > budget {
        return Ok(Written::OverBudget(done));
    }
    member
        .out
        .sync_all()
        .map_err(|e| Error::io("sync compressed file", e))?;
    Ok(Written::Whole(done))
}

/// Feeds the `len` bytes of `master` to `member`, holes and whole MiB of
/// zeros as zeros; false when the member passed its budget.
fn read_extents(master: &File, len: u64, member: &mut Member) -> Result<bool> {
    use rustix::fs::{SeekFrom, seek};
    let mut buf = vec![0u8; BLOCK];
    let mut pos = 0u64;
    while pos < len {
        // Where the next data starts (the end when only a hole is left; a
        // file system without SEEK_DATA reports all data).
        let data = match seek(master, SeekFrom::Data(pos)) {
            Ok(at) => at.min(len),
            Err(rustix::io::Errno::NXIO) => len,
            Err(_) => pos,
        };
        member.zeros(data - pos)?;
        pos = data;
        let hole = match seek(master, SeekFrom::Hole(pos)) {
            Ok(at) => at.clamp(pos, len),
            Err(_) => len,
        };
        while pos < hole {
            let want = (hole - pos).min(BLOCK as u64) as usize;
            let n = match master.read_at(&mut buf[..want], pos) {
                Ok(0) => {
                    return Err(Error::io(
                        "read master",
                        std::io::ErrorKind::UnexpectedEof.into(),
                    ));
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io("read master", e)),
            };
            if fsutil::is_zero(&buf[..n]) {
                member.zeros(n as u64)?;
            } else {
                member.data(&buf[..n])?;
            }
            pos += n as u64;
            if member.over_budget() {
                return Ok(false);
            }
        }
    }
    Ok(!member.over_budget())
}

/// One gzip member being written: raw deflate, its CRC-32, the output.
struct Member {
    deflate: Compress,
    crc: crc32fast::Hasher,
    out: File,
    buf: Vec<u8>,
    /// Bytes written to `out` so far.
    written: u64,
    budget: u64,
    /// True right after a full flush: a zero chunk may be appended.
    flushed: bool,
    /// A unit's deflate output, before it is kept or stored instead.
    unit: Vec<u8>,
}

impl Member {
    fn new(out: File, budget: u64) -> Member {
        Member {
            deflate: Compress::new(Compression::new(LEVEL), false),
            crc: crc32fast::Hasher::new(),
            out,
            buf: Vec::with_capacity(OUT_BUFFER + BLOCK),
            written: 0,
            budget,
            flushed: true,
            unit: Vec::new(),
        }
    }

    fn over_budget(&self) -> bool {
        self.written + self.buf.len() as u64 > self.budget
    }

    /// Bytes written as they are (header, chunks, trailer).
    fn raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.buf.extend_from_slice(bytes);
        self.spill(false)
    }

    /// Data: a piece of [`UNIT_MIN`] or more as a unit that ends on a full
    /// flush, deflated or stored, whichever [`STORE_ABOVE`] says; a smaller
    /// one deflated with what is around it.
    fn data(&mut self, input: &[u8]) -> Result<()> {
        self.crc.update(input);
        if input.len() < UNIT_MIN {
            self.flushed = false;
            return self.deflate_all(input, FlushCompress::None);
        }
        if !self.flushed {
            self.deflate_all(&[], FlushCompress::Full)?;
        }
        let mut unit = std::mem::take(&mut self.unit);
        unit.clear();
        deflate_into(&mut self.deflate, input, FlushCompress::Full, &mut unit)?;
        // After a full flush the compressor refers to nothing before it,
        // so the unit's own deflate output may be replaced.
        if unit.len() as f64 > input.len() as f64 * STORE_ABOVE {
            append_stored(&mut self.buf, input);
        } else {
            self.buf.extend_from_slice(&unit);
        }
        self.unit = unit;
        self.flushed = true;
        self.spill(false)
    }

    /// `n` zero bytes: from [`ZERO_BLOCK_MIN`] on, after a full flush,
    /// whole MiB as the block made once and the rest as a block of its own
    /// (see `zero_deflate`); a shorter run deflated with the data around it.
    fn zeros(&mut self, n: u64) -> Result<()> {
        if n < ZERO_BLOCK_MIN {
            return self.data(&ZEROS[..n as usize]);
        }
        if !self.flushed {
            self.deflate_all(&[], FlushCompress::Full)?;
            self.flushed = true;
        }
        let (chunk, crc) = zero_chunk();
        for _ in 0..n / BLOCK as u64 {
            self.crc.combine(crc);
            self.raw(chunk)?;
            if self.over_budget() {
                return Ok(());
            }
        }
        let rest = (n % BLOCK as u64) as usize;
        if rest > 0 {
            let mut crc = crc32fast::Hasher::new();
            crc.update(&ZEROS[..rest]);
            self.crc.combine(&crc);
            zero_deflate::append_zeros(&mut self.buf, rest);
            self.spill(false)?;
        }
        Ok(())
    }

    /// Deflates all of `input` with `flush` into the buffer.
    fn deflate_all(&mut self, input: &[u8], flush: FlushCompress) -> Result<()> {
        deflate_into(&mut self.deflate, input, flush, &mut self.buf)?;
        self.spill(false)
    }

    /// Writes the buffer out once it is large (or `all` of it).
    fn spill(&mut self, all: bool) -> Result<()> {
        if self.buf.len() >= OUT_BUFFER || (all && !self.buf.is_empty()) {
            self.out
                .write_all(&self.buf)
                .map_err(|e| Error::io("write compressed file", e))?;
            self.written += self.buf.len() as u64;
            self.buf.clear();
        }
        Ok(())
    }

    /// Ends the deflate stream and writes the trailer (CRC-32, size mod 2^32).
    fn finish(&mut self, len: u64) -> Result<()> {
        self.deflate_all(&[], FlushCompress::Finish)?;
        let crc = self.crc.clone().finalize();
        let mut trailer = crc.to_le_bytes().to_vec();
        trailer.extend_from_slice(&(len as u32).to_le_bytes());
        self.raw(&trailer)?;
        self.spill(true)
    }
}

/// Deflates all of `input` with `flush` at the end of `out`: at most
/// `input` and a flush's worth more in memory (input comes in pieces of a
/// MiB at most).
fn deflate_into(
    deflate: &mut Compress,
    mut input: &[u8],
    flush: FlushCompress,
    out: &mut Vec<u8>,
) -> Result<()> {
    loop {
        out.reserve(input.len() / 8 + input.len() + 4096);
        let before = deflate.total_in();
        let status = deflate
            .compress_vec(input, out, flush)
            .map_err(|e| Error::io("deflate", std::io::Error::other(e)))?;
        input = &input[(deflate.total_in() - before) as usize..];
        let room_left = out.len() < out.capacity();
        if status == Status::StreamEnd || (input.is_empty() && room_left) {
            return Ok(());
        }
    }
}

/// Appends `bytes` as stored blocks (RFC 1951 3.2.4) to a raw deflate
/// stream that is at a block boundary on a byte boundary (after a flush),
/// which it leaves the same way: each block is a header byte (not final,
/// type 00, the rest padding), LEN and its complement, and the bytes.
fn append_stored(out: &mut Vec<u8>, bytes: &[u8]) {
    for piece in bytes.chunks(STORED_MAX) {
        let len = piece.len() as u16;
        out.push(0);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(piece);
    }
}

/// A MiB of zeros as raw deflate (`zero_deflate`) and its CRC-32; made
/// once.
fn zero_chunk() -> &'static (Vec<u8>, crc32fast::Hasher) {
    static CHUNK: OnceLock<(Vec<u8>, crc32fast::Hasher)> = OnceLock::new();
    CHUNK.get_or_init(|| {
        let mut out = Vec::new();
        zero_deflate::append_zeros(&mut out, BLOCK);
        let mut crc = crc32fast::Hasher::new();
        crc.update(&ZEROS);
        (out, crc)
    })
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn decode(path: &std::path::Path) -> Vec<u8> {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(File::open(path).unwrap())
            .read_to_end(&mut out)
            .unwrap();
        out
    }

    /// Bytes no deflate compresses (xorshift64).
    fn pseudo_random(len: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn zeros_data_and_holes_decode_to_the_master() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        // A hole, data, written zeros, data not MiB-aligned, a hole at the end.
        let mut data = vec![0u8; 3 * BLOCK + 777];
        for (i, b) in data.iter_mut().enumerate().take(BLOCK + 5) {
            *b = (i * 7 % 251) as u8;
        }
        data[3 * BLOCK + 100] = 9;
        f.write_all_at(&data, 5 * BLOCK as u64).unwrap();
        // Data around a small hole (deflated with it) and a large one.
        let page = vec![3u8; 4096];
        for at in [10 * BLOCK, 10 * BLOCK + 12288, 10 * BLOCK + (300 << 10)] {
            f.write_all_at(&page, at as u64).unwrap();
        }
        f.set_len(12 * BLOCK as u64 + 3).unwrap();
        let origin = Origin::of(&f.metadata().unwrap());
        let temp = dir.path().join("m.gz");
        let Written::Whole(figures) = write_gzip(&f, &origin, &temp, u64::MAX).unwrap() else {
            panic!("over budget");
        };
        let mut expected = vec![0u8; 12 * BLOCK + 3];
        expected[5 * BLOCK..5 * BLOCK + data.len()].copy_from_slice(&data);
        for at in [10 * BLOCK, 10 * BLOCK + 12288, 10 * BLOCK + (300 << 10)] {
            expected[at..at + 4096].copy_from_slice(&page);
        }
        assert!(decode(&temp) == expected);
        assert_eq!(figures.output, std::fs::metadata(&temp).unwrap().len());
        assert_eq!(
            Origin::recorded_in(&File::open(&temp).unwrap()),
            Some(origin.encode())
        );
        // Incompressible MiB are stored: they cost their size and a few
        // bytes, not the 5.5% more of level 1's fixed codes.
        let noise = pseudo_random(2 * BLOCK + 12_345);
        f.write_all_at(&noise, 5 * BLOCK as u64).unwrap();
        expected[5 * BLOCK..5 * BLOCK + noise.len()].copy_from_slice(&noise);
        let origin = Origin::of(&f.metadata().unwrap());
        std::fs::remove_file(&temp).unwrap();
        let Written::Whole(noisy) = write_gzip(&f, &origin, &temp, u64::MAX).unwrap() else {
            panic!("over budget");
        };
        assert!(decode(&temp) == expected);
        let grown = noisy.output as i64 - figures.output as i64;
        assert!(
            grown < noise.len() as i64 + 1024,
            "{} noisy bytes grew the file by {grown}",
            noise.len()
        );
        // A budget it cannot meet: abandoned.
        std::fs::remove_file(&temp).unwrap();
        let written = write_gzip(&f, &origin, &temp, 100).unwrap();
        assert!(matches!(written, Written::OverBudget(_)));
    }
}
