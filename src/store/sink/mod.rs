//! One pass per byte: every byte that will be served is written to its file
//! and fed to the SHA-256 hasher (and the MD5 and SHA-512 ones when they are
//! wanted, see [`Served`]) (plus the source-verification digest when Ironic
//! named another algorithm) in the same pass, each on its own thread, so
//! hashing runs in parallel with the I/O and a cache hit never has to read
//! the image again.
//!
//! - `fanout`: the chunk being built and the consumers it goes to;
//! - `writer`: how bytes reach the file ([`WritePolicy`], chosen by the
//!   caller, and the converter's [`Pace`]);
//! - `buf`: aligned, pooled chunk buffers.
//!
//! Two handles share them: [`Sink`] for async producers (downloads) and
//! [`BlockingSink`] for a producer on a thread of its own (the converter
//! process), which needs no runtime.

mod buf;
mod fanout;
mod writer;

use writer::SinkFile;
pub use writer::{Pace, WritePolicy};

use crate::error::{Error, ErrorCode, Result};
use crate::store::checksum::Algo;
use bytes::Bytes;
use fanout::{Ending, Fanout};
use std::path::Path;

/// Size of the chunks handed to the writer and the hashers.
pub const CHUNK: usize = 1 << 20;
/// Chunks queued per consumer: bounds memory to a few MiB per stream.
const DEPTH: usize = 4;

/// The digests and size of everything written through a [`Sink`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Digests {
    /// Bytes written.
    pub size: u64,
    /// MD5 hex of the bytes, when it was computed (see [`Served`]).
    pub md5: Option<String>,
    /// SHA-256 hex of the bytes (absent only for a scratch file whose plan
    /// left it out; see [`Digests::served_sha256`]).
    pub sha256: Option<String>,
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

    /// The digest for `algo`, when it was computed.
    pub fn get(&self, algo: Algo) -> Option<&str> {
        match algo {
            Algo::Md5 => self.md5.as_deref(),
            Algo::Sha256 => self.sha256.as_deref(),
            Algo::Sha512 => self.sha512.as_deref(),
        }
    }

    /// The SHA-256 of bytes that become a master: every plan for bytes
    /// that are served computes it (only a scratch file's may leave it
    /// out), so its absence is a bug, answered as one rather than with a
    /// master recorded without it.
    pub fn served_sha256(&self) -> Result<String> {
        self.sha256.clone().ok_or_else(|| {
            Error::new(
                ErrorCode::Internal,
                "the SHA-256 of the served bytes was not computed",
            )
        })
    }
}

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

impl Served {
    /// The algorithms to compute: these digests, plus `also` (the
    /// algorithm a source is verified with) when it is another.
    pub fn algos(self, also: Option<Algo>) -> Vec<Algo> {
        let mut algos = vec![Algo::Sha256];
        if self.md5 || also == Some(Algo::Md5) {
            algos.push(Algo::Md5);
        }
        if self.sha512 || also == Some(Algo::Sha512) {
            algos.push(Algo::Sha512);
        }
        algos
    }
}

/// What a sink does with its bytes: the digests it computes and how its
/// file is written.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The digests computed (each once, each on its own thread).
    pub digests: Vec<Algo>,
    /// How the file is written (ignored when there is none).
    pub write: WritePolicy,
}

impl Plan {
    /// Bytes served as they are, with the `served` digests.
    pub fn served(served: Served) -> Plan {
        Plan {
            digests: served.algos(None),
            write: WritePolicy::Served,
        }
    }
}

/// What travels from a sink to its writer and hashers.
#[derive(Clone)]
enum Piece {
    /// Bytes, written (zero blocks as holes) and hashed.
    Data(Bytes),
    /// A run of zeros known without reading it (an unallocated range of a
    /// sparse image): a hole for the writer, zeros for the hashers.
    Zeros(u64),
}

/// Zeros fed to the hashers for [`Piece::Zeros`] (and shown to a plan's
/// decision when a sink starts with zeros).
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// A file being written plus its hashers, fed by an async producer; see
/// the module documentation.
pub struct Sink {
    fan: Fanout,
}

impl Sink {
    /// Creates `path` (which must not exist, mode 0644), written and
    /// hashed as `plan` says.
    pub fn create(path: &Path, plan: Plan) -> Result<Sink> {
        Self::deciding(path, move |_| plan)
    }

    /// Creates `path` like [`Sink::create`], with the plan `decide` gives
    /// for the first chunk (up to [`CHUNK`] bytes) written.
    pub fn deciding(
        path: &Path,
        decide: impl FnOnce(&[u8]) -> Plan + Send + 'static,
    ) -> Result<Sink> {
        Ok(Sink {
            fan: Fanout::new(Some(SinkFile::create(path)?), Box::new(decide)),
        })
    }

    /// Hashes without writing anywhere (for bytes already on disk).
    pub fn hash_only(served: Served) -> Sink {
        let plan = Plan::served(served);
        Sink {
            fan: Fanout::new(None, Box::new(move |_| plan)),
        }
    }

    /// Bytes accepted so far.
    pub fn size(&self) -> u64 {
        self.fan.size()
    }

    /// Appends `data`, handing full chunks to the consumers.
    pub async fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            data = &data[self.fan.fill(data)..];
            if self.fan.is_full() {
                self.flush().await?;
            }
        }
        Ok(())
    }

    /// Appends `n` zero bytes without materialising them: the file gets a
    /// hole and the hashers hash zeros.
    pub async fn write_zeros(&mut self, n: u64) -> Result<()> {
        if n > 0 {
            self.flush().await?;
            let zeros = self.fan.zeros(n);
            self.send(zeros).await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<()> {
        match self.fan.take_chunk() {
            Some(chunk) => self.send(chunk).await,
            None => Ok(()),
        }
    }

    async fn send(&mut self, piece: Piece) -> Result<()> {
        let mut stopped = false;
        for tx in self.fan.queues(&piece)? {
            if tx.send(piece.clone()).await.is_err() {
                stopped = true;
                break;
            }
        }
        match stopped {
            // A consumer stopped early: its error is the answer.
            true => Err(consumer_stopped(wait(self.fan.abandon()).await)),
            false => Ok(()),
        }
    }

    /// Stops without finishing, for bytes that will never be used: the
    /// consumers are told and waited for, so the file is closed (its space
    /// given back once it is removed) when this returns, and it is neither
    /// extended nor synced.
    pub async fn abandon(mut self) {
        wait(self.fan.abandon()).await;
    }

    /// Flushes, waits for the file to be durable (as its plan says) and
    /// returns the digests.
    pub async fn finish(mut self) -> Result<Digests> {
        self.flush().await?;
        let endings = self.fan.close()?;
        fanout::settle(self.fan.size(), wait(endings).await)
    }
}

/// [`Sink`] for a producer on a thread of its own, outside any async
/// runtime (the converter process): every call may block.
pub struct BlockingSink {
    fan: Fanout,
}

impl BlockingSink {
    /// Creates `path` (which must not exist, mode 0644) for bytes served
    /// as they are, with the `served` digests.
    pub fn create(path: &Path, served: Served) -> Result<BlockingSink> {
        let plan = Plan::served(served);
        Ok(BlockingSink {
            fan: Fanout::new(Some(SinkFile::create(path)?), Box::new(move |_| plan)),
        })
    }

    /// Appends `data`, handing full chunks to the consumers.
    pub fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            data = &data[self.fan.fill(data)..];
            if self.fan.is_full() {
                self.flush()?;
            }
        }
        Ok(())
    }

    /// Appends up to `len` bytes read from `file` at `offset` straight into
    /// the chunk being built (no intermediate buffer); returns the bytes
    /// read, 0 at the end of the file.
    pub fn read_at(&mut self, file: &std::fs::File, offset: u64, len: usize) -> Result<usize> {
        let n = self.fan.fill_from(file, offset, len)?;
        if self.fan.is_full() {
            self.flush()?;
        }
        Ok(n)
    }

    /// Appends `n` zero bytes without materialising them (see
    /// [`Sink::write_zeros`]).
    pub fn write_zeros(&mut self, n: u64) -> Result<()> {
        if n > 0 {
            self.flush()?;
            let zeros = self.fan.zeros(n);
            self.send(zeros)?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        match self.fan.take_chunk() {
            Some(chunk) => self.send(chunk),
            None => Ok(()),
        }
    }

    fn send(&mut self, piece: Piece) -> Result<()> {
        let stopped = self
            .fan
            .queues(&piece)?
            .iter()
            .any(|tx| tx.blocking_send(piece.clone()).is_err());
        match stopped {
            true => Err(consumer_stopped(wait_blocking(self.fan.abandon()))),
            false => Ok(()),
        }
    }

    /// Flushes, waits for the file to be synced and returns the digests.
    pub fn finish(mut self) -> Result<Digests> {
        self.flush()?;
        let endings = self.fan.close()?;
        fanout::settle(self.fan.size(), wait_blocking(endings))
    }
}

type Ended = std::result::Result<Result<fanout::Output>, tokio::sync::oneshot::error::RecvError>;

async fn wait(endings: Vec<Ending>) -> Vec<Ended> {
    let mut ended = Vec::with_capacity(endings.len());
    for ending in endings {
        ended.push(ending.await);
    }
    ended
}

fn wait_blocking(endings: Vec<Ending>) -> Vec<Ended> {
    endings.into_iter().map(|e| e.blocking_recv()).collect()
}

/// The error of a sink whose consumer stopped early: that consumer's own.
fn consumer_stopped(ended: Vec<Ended>) -> Error {
    match fanout::settle(0, ended) {
        Err(e) => e,
        Ok(_) => Error::new(ErrorCode::Internal, "a sink consumer stopped"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::checksum::Hasher;

    fn hex(algo: Algo, bytes: &[u8]) -> String {
        let mut h = Hasher::new(algo);
        h.update(bytes);
        h.finalize_hex()
    }

    /// Data, zero runs and an unaligned tail.
    fn sample() -> Vec<u8> {
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
        bytes
    }

    /// Whatever the write policy, the file holds exactly the bytes and the
    /// digests are theirs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_and_digests_match_the_bytes_under_every_policy() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let bytes = sample();
        let policies = [
            ("served", WritePolicy::Served),
            ("read-back", WritePolicy::ReadBack),
            ("scratch", WritePolicy::Scratch(None)),
        ];
        for (name, write) in policies {
            let path = dir.path().join(name);
            let plan = Plan {
                digests: vec![Algo::Sha256, Algo::Md5, Algo::Sha512],
                write,
            };
            let mut sink = Sink::create(&path, plan).unwrap();
            for piece in bytes.chunks(300_007) {
                sink.write(piece).await.unwrap();
            }
            let d = sink.finish().await.unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "{name}");
            assert_eq!(d.size, bytes.len() as u64);
            assert_eq!(d.md5.unwrap(), hex(Algo::Md5, &bytes), "{name}");
            assert_eq!(d.sha256.unwrap(), hex(Algo::Sha256, &bytes), "{name}");
            assert_eq!(d.sha512.unwrap(), hex(Algo::Sha512, &bytes), "{name}");
        }
    }

    /// The plan of a deciding sink is the one its decision gives for the
    /// first chunk (whole, even when written in small pieces).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deciding_sink_follows_the_plan_of_its_first_chunk() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        for (name, lead, scratch) in [("q", &b"QFI\xfb"[..], true), ("r", &b"data"[..], false)] {
            let decide = |first: &[u8]| {
                assert!(first.len() > 4, "the decision sees the whole first chunk");
                match first.starts_with(b"QFI\xfb") {
                    true => Plan {
                        digests: vec![Algo::Sha512],
                        write: WritePolicy::Scratch(None),
                    },
                    false => Plan::served(Served::default()),
                }
            };
            let mut sink = Sink::deciding(&dir.path().join(name), decide).unwrap();
            sink.write(lead).await.unwrap();
            sink.write(&[7u8; 5000]).await.unwrap();
            let d = sink.finish().await.unwrap();
            assert_eq!(d.get(Algo::Sha512).is_some(), scratch, "{name}");
            assert_eq!(d.get(Algo::Md5).is_some(), !scratch, "{name}");
            assert_eq!(d.get(Algo::Sha256).is_some(), !scratch, "{name}");
        }
    }

    /// A sink given nothing still starts its consumers: an empty file with
    /// the digests of no bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_empty_sink_has_the_digests_of_no_bytes() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("empty");
        let sink = Sink::create(&path, Plan::served(Served::default())).unwrap();
        let d = sink.finish().await.unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        assert_eq!((d.size, d.sha256), (0, Some(hex(Algo::Sha256, b""))));
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
        let mut sink = Sink::create(&path, Plan::served(Served::default())).unwrap();
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
        let mut sink = Sink::create(&path, Plan::served(Served::default())).unwrap();
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

    /// The blocking handle, on a thread outside any runtime, writes and
    /// hashes as the async one (reads from a file, bytes, zeros).
    #[test]
    fn the_blocking_sink_needs_no_runtime() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let bytes = sample();
        let source = dir.path().join("source");
        std::fs::write(&source, &bytes).unwrap();
        let file = std::fs::File::open(&source).unwrap();
        let path = dir.path().join("out");
        let mut sink = BlockingSink::create(&path, Served::default()).unwrap();
        let mut at = 0u64;
        while at < 5_000_000 {
            at += sink.read_at(&file, at, 333_333).unwrap() as u64;
        }
        sink.write(&bytes[at as usize..]).unwrap();
        sink.write_zeros(1 << 20).unwrap();
        let d = sink.finish().unwrap();
        let mut expected = bytes.clone();
        expected.extend(std::iter::repeat_n(0u8, 1 << 20));
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        assert_eq!(d.md5.unwrap(), hex(Algo::Md5, &expected));
        assert_eq!(d.sha256.unwrap(), hex(Algo::Sha256, &expected));
    }

    /// MD5 is left out when the served digests leave it out, unless it is
    /// the algorithm a source is verified with; SHA-256 is always there.
    #[test]
    fn md5_is_computed_when_served_or_verified() {
        let no_md5 = Served {
            md5: false,
            sha512: false,
        };
        assert_eq!(no_md5.algos(Some(Algo::Sha256)), [Algo::Sha256]);
        assert_eq!(no_md5.algos(Some(Algo::Md5)), [Algo::Sha256, Algo::Md5]);
        assert_eq!(
            Served::default().algos(Some(Algo::Sha512)),
            [Algo::Sha256, Algo::Md5, Algo::Sha512]
        );
    }
}
