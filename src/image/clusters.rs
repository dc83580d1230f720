//! The converter child's output: the raw disk written in guest order while
//! compressed clusters are decoded on every core.
//!
//! Why this exists: on a compressed qcow2 (most cloud images) decoding is
//! the converter's slowest step. One core inflates zlib clusters more
//! slowly than the hashers hash what comes out, and every cluster is a
//! stream of its own (qcow2 compresses cluster by cluster), so clusters
//! can be decoded side by side. The converter's thread reads the tables
//! and the stored streams in guest order and hands each stream to a pool
//! of decoder threads, one per core (`std::thread::available_parallelism`,
//! at most [`MAX_THREADS`]);
//! the output still goes out in guest order through the one [`Sink`] (one
//! hashing pass, holes for zero ranges, as when clusters were decoded one
//! after another): every piece of the disk (a zero range, a range stored as
//! it is, a compressed cluster's part) is queued in order and written once
//! all the pieces before it are; a piece that needs no decoding goes out at
//! once when nothing waits before it.
//!
//! Errors stay those of decoding one cluster after another: the first
//! failing piece in guest order is the error (not a broken cluster after
//! it, nor a broken table found while reading ahead; see
//! [`Output::first_error`]), and nothing after it is written (the caller
//! removes the partial output). A decoder thread that panics aborts the
//! process: the converter is a child process, so the worker sees a crashed
//! converter (`corrupt_image`), as before.
//!
//! Memory is bounded: at most [`window`] compressed clusters are in flight
//! (stream read, being decoded, or decoded and waiting for their turn):
//! [`PER_THREAD`] per decoder thread, and no more than [`WINDOW_BYTES`]
//! hold (a decoded cluster plus its stored stream of up to two clusters
//! each); at most [`MAX_QUEUED`] pieces wait to be written.

use crate::error::{Error, ErrorCode, Result};
use crate::image::growing::GrowingFile;
use crate::image::inflate::Inflater;
use crate::image::qcow2::Header;
use crate::image::reclaim::Reclaimer;
use crate::image::reports::report_every_second;
use crate::store::sink::{BlockingSink, CHUNK, Digests};
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Memory the compressed clusters in flight may hold, decoded clusters and
/// stored streams together.
pub(crate) const WINDOW_BYTES: u64 = 32 << 20;
/// Pieces (zero ranges, stored ranges, clusters) waiting to be written, at
/// most: a few words each.
pub(crate) const MAX_QUEUED: usize = 4096;
/// Zeros handed to the hashers at once: the sink queues a few pieces per
/// hasher, so the writer waits for them within a few of these and the
/// progress it reports stays close to the bytes hashed.
const ZERO_PIECE: u64 = 64 << 20;

/// Compressed clusters each decoder thread may have in flight: enough to
/// keep the threads busy while the writer waits on the hashers.
pub(crate) const PER_THREAD: usize = 32;

/// Compressed clusters in flight at most, for clusters of `cluster` bytes
/// and `threads` decoders: [`PER_THREAD`] per thread, and no more than
/// [`WINDOW_BYTES`] hold at three clusters each (the decoded cluster and a
/// stored stream of up to two); at least 2. With qemu's default 64 KiB
/// clusters on 2 cores: 64 (4 MiB decoded); with 2 MiB clusters: 5.
pub(crate) fn window(cluster: u64, threads: usize) -> usize {
    let by_memory = WINDOW_BYTES / cluster.saturating_mul(3).max(1);
    (by_memory.min((threads.max(1) * PER_THREAD) as u64) as usize).max(2)
}

/// Decoder threads at most, whatever the core count: each reserves a stack
/// in the converter's address space (`[convert] memory_limit_mib`).
pub(crate) const MAX_THREADS: usize = 64;

/// Decoder threads a conversion uses: one per core (as many as this
/// process may run on), at most [`MAX_THREADS`].
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(MAX_THREADS)
}

/// A compressed cluster's buffers: its stored stream and its decoded bytes.
struct Buffers {
    stream: Vec<u8>,
    cluster: Vec<u8>,
}

/// A decoded cluster (or why it could not be), with its buffers back.
type Decoded = (Buffers, Result<()>);

/// One cluster for a decoder thread.
struct Job {
    bufs: Buffers,
    guest: u64,
    reply: SyncSender<Decoded>,
}

/// Decoder threads and the clusters handed to them, oldest first.
pub(crate) struct Decoders {
    /// Closed when dropped: the threads then end after their current job.
    jobs: SyncSender<Job>,
    pending: VecDeque<Receiver<Decoded>>,
    spare: Vec<Buffers>,
    cluster: usize,
    window: usize,
}

impl Decoders {
    /// Starts `threads` decoders (at least one) for the compressed
    /// clusters of the image of `header`.
    pub(crate) fn new(header: &Header, threads: usize) -> Result<Decoders> {
        let window = window(header.cluster_size(), threads);
        let (jobs, rx) = sync_channel::<Job>(window);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let mut inflater = Inflater::new(header)?;
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("decode-{i}"))
                .spawn(move || decode(&rx, &mut inflater))
                .map_err(|e| Error::io("start a decoder thread", e))?;
        }
        Ok(Decoders {
            jobs,
            pending: VecDeque::new(),
            spare: Vec::new(),
            cluster: header.cluster_size() as usize,
            window,
        })
    }

    /// True when [`window`] clusters are in flight: the oldest must be
    /// taken back before another is handed out.
    pub(crate) fn full(&self) -> bool {
        self.pending.len() >= self.window
    }

    /// True while more than half the window is in flight.
    pub(crate) fn over_half(&self) -> bool {
        self.pending.len() > self.window / 2
    }

    /// Buffers for the next cluster, its stream `len` bytes of zeros.
    fn buffers(&mut self, len: usize) -> Buffers {
        let mut bufs = self.spare.pop().unwrap_or_else(|| Buffers {
            stream: Vec::new(),
            cluster: vec![0u8; self.cluster],
        });
        bufs.stream.clear();
        bufs.stream.resize(len, 0);
        bufs
    }

    /// Hands the cluster at guest offset `guest` (its stored stream read
    /// into `bufs`) to the decoders; there must be room (see `full`).
    fn submit(&mut self, bufs: Buffers, guest: u64) {
        let (reply, rx) = sync_channel(1);
        if self.jobs.send(Job { bufs, guest, reply }).is_err() {
            died();
        }
        self.pending.push_back(rx);
    }

    /// The oldest cluster handed out, decoded; `None` when none is in
    /// flight, or (unless `wait`) when it is not decoded yet.
    fn next(&mut self, wait: bool) -> Option<Decoded> {
        let rx = self.pending.front()?;
        let decoded = if wait {
            rx.recv().ok()
        } else {
            match rx.try_recv() {
                Ok(d) => Some(d),
                Err(TryRecvError::Empty) => return None,
                Err(TryRecvError::Disconnected) => None,
            }
        };
        let Some(decoded) = decoded else { died() };
        self.pending.pop_front();
        Some(decoded)
    }

    /// Keeps a cluster's buffers for the next one.
    fn recycle(&mut self, bufs: Buffers) {
        if self.spare.len() < self.window {
            self.spare.push(bufs);
        }
    }
}

/// A decoder thread: decodes clusters until the channel closes.
fn decode(jobs: &Mutex<Receiver<Job>>, inflater: &mut Inflater) {
    loop {
        let job = match jobs.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(Job {
            mut bufs,
            guest,
            reply,
        }) = job
        else {
            return;
        };
        let done = inflater.inflate(&bufs.stream, &mut bufs.cluster, guest);
        let _ = reply.send((bufs, done));
    }
}

/// A decoder thread ended without an answer: it panicked (its message is
/// on stderr). The converter stops as a crashed one, as when decoding ran
/// on its own thread.
fn died() -> ! {
    eprintln!("qcow2: a cluster decoder thread died");
    std::process::abort()
}

/// A piece of the raw disk waiting for its turn.
#[derive(Clone, Copy)]
enum Piece {
    /// Zeros up to this guest offset.
    Zeros(u64),
    /// Bytes stored as they are from host offset `from` on, up to guest
    /// offset `end`.
    Plain { from: u64, end: u64 },
    /// The oldest cluster handed to the decoders, at guest offset `guest`,
    /// written up to guest offset `end`.
    Cluster { guest: u64, end: u64 },
}

/// The raw disk being written, in guest order; see the module
/// documentation.
pub(crate) struct Output<'a> {
    sink: BlockingSink,
    source: &'a GrowingFile,
    reclaim: &'a mut Reclaimer,
    header: &'a Header,
    /// Guest offset up to which pieces are queued.
    queued_to: u64,
    /// Guest offset up to which they are written.
    written: u64,
    queue: VecDeque<Piece>,
    /// Started at the first compressed cluster.
    decoders: Option<Decoders>,
    reported: Instant,
}

impl<'a> Output<'a> {
    /// Writes the disk of the image of `header` (read from `source`, given
    /// back by `reclaim`) into `sink`.
    pub(crate) fn new(
        sink: BlockingSink,
        source: &'a GrowingFile,
        reclaim: &'a mut Reclaimer,
        header: &'a Header,
    ) -> Output<'a> {
        Output {
            sink,
            source,
            reclaim,
            header,
            queued_to: 0,
            written: 0,
            queue: VecDeque::new(),
            decoders: None,
            reported: Instant::now(),
        }
    }

    /// Guest offset up to which the disk is queued.
    pub(crate) fn queued_to(&self) -> u64 {
        self.queued_to
    }

    /// Reports the guest offset written when a second has passed since
    /// the last report.
    pub(crate) fn report_progress(&mut self) {
        report_every_second(&mut self.reported, self.written);
    }

    /// Fails when host bytes of the compressed clusters `extents`
    /// (`(offset, length)`) were already claimed by a stored range.
    pub(crate) fn check_unclaimed(&self, extents: &[(u64, u64)]) -> Result<()> {
        extents
            .iter()
            .try_for_each(|&(at, len)| self.reclaim.check(at, len))
    }

    /// Continues with zeros (holes, hashed as zeros) up to guest offset
    /// `to`.
    pub(crate) fn zeros_to(&mut self, to: u64) -> Result<()> {
        if self.queued_to >= to {
            return Ok(());
        }
        self.queued_to = to;
        self.push(Piece::Zeros(to))
    }

    /// Continues with the bytes stored as they are from host offset `from`
    /// on, up to guest offset `end`; refused when another cluster claimed
    /// them already.
    pub(crate) fn plain(&mut self, from: u64, end: u64) -> Result<()> {
        self.reclaim.claim(from, end - self.queued_to)?;
        self.queued_to = end;
        self.push(Piece::Plain { from, end })
    }

    /// Continues with the compressed cluster at guest offset `guest` (its
    /// stored stream: `(host offset, length)`, at most two clusters by the
    /// width of the length field) up to guest offset `end`. Bytes of the
    /// stream past the end of the file read as zeros, as qemu reads them.
    pub(crate) fn compressed(&mut self, guest: u64, (at, len): (u64, u64), end: u64) -> Result<()> {
        if self.decoders.as_ref().is_some_and(Decoders::full) {
            // Half the window is taken back before more is handed out: the
            // converter's thread and the decoders then wake each other once
            // per half window, not once per cluster (on a busy machine each
            // wake-up waits for a time slice).
            while self.decoders.as_ref().is_some_and(Decoders::over_half) {
                if !self.write_next(true)? {
                    break;
                }
            }
        }
        let decoders = match &mut self.decoders {
            Some(d) => d,
            None => self.decoders.insert(Decoders::new(self.header, cores())?),
        };
        let mut bufs = decoders.buffers(len as usize);
        self.source
            .wait_read(at, &mut bufs.stream)
            .map_err(|e| Error::io("read a compressed cluster", e))?;
        decoders.submit(bufs, guest);
        self.queued_to = end;
        self.push(Piece::Cluster { guest, end })
    }

    /// Writes everything queued and finishes the sink.
    pub(crate) fn finish(mut self) -> Result<Digests> {
        while self.write_next(true)? {}
        self.sink.finish()
    }

    /// The error of the conversion when queuing failed with `e` (a table,
    /// a stream read ahead): the pieces queued before it are written first,
    /// and the first of them that fails is the error instead, as when each
    /// piece was written before the next was read.
    pub(crate) fn first_error(mut self, e: Error) -> Error {
        loop {
            match self.write_next(true) {
                Ok(true) => {}
                Ok(false) => return e,
                Err(earlier) => return earlier,
            }
        }
    }

    fn push(&mut self, piece: Piece) -> Result<()> {
        self.queue.push_back(piece);
        while self.queue.len() > MAX_QUEUED {
            self.write_next(true)?;
        }
        while self.write_next(false)? {}
        Ok(())
    }

    /// Writes the oldest queued piece, waiting for its cluster to be
    /// decoded when `wait` (else writing nothing while it is not). False
    /// when nothing was written. After a failure nothing more is written.
    fn write_next(&mut self, wait: bool) -> Result<bool> {
        let Some(&piece) = self.queue.front() else {
            return Ok(false);
        };
        let done = match piece {
            Piece::Zeros(to) => self.write_zeros(to),
            Piece::Plain { from, end } => self.copy_plain(from, end),
            Piece::Cluster { guest, end } => {
                let Some(decoded) = self.decoders.as_mut().and_then(|d| d.next(wait)) else {
                    return Ok(false);
                };
                self.write_cluster(decoded, guest, end)
            }
        };
        self.queue.pop_front();
        if done.is_err() {
            self.queue.clear();
            self.decoders = None;
        }
        done.map(|()| true)
    }

    fn write_zeros(&mut self, to: u64) -> Result<()> {
        while self.written < to {
            let n = (to - self.written).min(ZERO_PIECE);
            self.sink.write_zeros(n)?;
            self.written += n;
            self.report_progress();
        }
        Ok(())
    }

    /// Copies the guest range up to `end` stored as it is from host offset
    /// `from` on, one chunk at a time, each read as soon as it has been
    /// downloaded and then given back.
    fn copy_plain(&mut self, from: u64, end: u64) -> Result<()> {
        let start = self.written;
        while self.written < end {
            let at = from + (self.written - start);
            let want = (end - self.written).min(CHUNK as u64);
            self.source
                .wait_covered(at + want)
                .map_err(|e| Error::io("wait for the download", e))?;
            let n = self.sink.read_at(&self.source.file, at, want as usize)?;
            if n == 0 {
                return Err(Error::new(
                    ErrorCode::CorruptImage,
                    "qcow2: a data cluster lies past the end of the file",
                ));
            }
            self.reclaim.give_back(at, n as u64);
            self.written += n as u64;
            self.source.note_read(at + n as u64);
        }
        Ok(())
    }

    /// Writes the part up to guest offset `end` of the decoded cluster at
    /// guest offset `guest`, or its decoding error.
    fn write_cluster(&mut self, (bufs, decoded): Decoded, guest: u64, end: u64) -> Result<()> {
        decoded?;
        let from = (self.written - guest) as usize;
        let to = (end - guest) as usize;
        self.sink.write(&bufs.cluster[from..to])?;
        self.written = end;
        if let Some(d) = &mut self.decoders {
            d.recycle(bufs);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(cluster_bits: u32, compression_type: u8) -> Header {
        Header {
            version: 3,
            cluster_bits,
            virtual_size: 1 << 30,
            l1_size: 1,
            l1_table_offset: 0,
            refcount_table_offset: 0,
            refcount_table_clusters: 1,
            incompatible_features: 0,
            nb_snapshots: 0,
            snapshots_offset: 0,
            refcount_order: 4,
            compression_type,
        }
    }

    /// A cluster's worth of compressible bytes, different for each `i`.
    fn cluster_data(i: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|j| b"abcdefghij"[(j / (i % 7 + 1) + i) % 10])
            .collect()
    }

    #[test]
    fn decoded_in_the_order_handed_out_whatever_the_threads() {
        let h = header(12, 0);
        let mut dec = Decoders::new(&h, 4).unwrap();
        let want: Vec<Vec<u8>> = (0..300).map(|i| cluster_data(i, 4096)).collect();
        let mut got = Vec::new();
        for (i, data) in want.iter().enumerate() {
            while dec.full() {
                got.push(dec.next(true).unwrap());
            }
            let stored = miniz_oxide::deflate::compress_to_vec(data, 1 + i as u8 % 9);
            let mut bufs = dec.buffers(stored.len());
            bufs.stream.copy_from_slice(&stored);
            dec.submit(bufs, i as u64 * 4096);
        }
        while let Some(d) = dec.next(true) {
            got.push(d);
        }
        assert_eq!(got.len(), want.len());
        for (i, ((bufs, done), data)) in got.into_iter().zip(&want).enumerate() {
            done.unwrap();
            assert_eq!(&bufs.cluster, data, "cluster {i}");
        }
    }

    #[test]
    fn a_broken_cluster_is_reported_in_its_place() {
        let h = header(16, 1);
        let mut dec = Decoders::new(&h, 3).unwrap();
        for i in 0..6u64 {
            let data = cluster_data(i as usize, 65536);
            let mut stored = zstd::encode_all(&data[..], 3).unwrap();
            if i == 2 || i == 4 {
                stored.truncate(stored.len() / 2);
            }
            let mut bufs = dec.buffers(stored.len());
            bufs.stream.copy_from_slice(&stored);
            dec.submit(bufs, i * 65536);
        }
        let verdicts: Vec<_> = std::iter::from_fn(|| dec.next(true))
            .map(|(_, done)| done.err().map(|e| (e.code, e.message)))
            .collect();
        assert_eq!(verdicts.len(), 6);
        for (i, v) in verdicts.iter().enumerate() {
            match v {
                Some((code, message)) => {
                    assert!(i == 2 || i == 4, "cluster {i}: {message}");
                    assert_eq!(*code, ErrorCode::CorruptImage);
                    assert!(
                        message.contains(&format!("offset {}", i * 65536)),
                        "{message}"
                    );
                }
                None => assert!(i != 2 && i != 4, "cluster {i} accepted"),
            }
        }
    }

    #[test]
    fn the_window_is_bounded_by_memory() {
        assert_eq!(window(65536, 2), 64);
        assert_eq!(window(65536, 64), 170);
        assert_eq!(window(2 << 20, 2), 5);
        assert_eq!(window(512, 1), 32);
        assert_eq!(window(u64::MAX, 8), 2);
    }
}
