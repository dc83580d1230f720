//! The fan-out behind both sink handles: the chunk being built, and the
//! writer and hashers it is handed to, each on a thread of its own with a
//! bounded queue. The consumers start with the first piece, on the plan
//! the caller's decision gives for it.

use super::buf::{AlignedBuf, Pool};
use super::writer::{SinkFile, write_file};
use super::{CHUNK, DEPTH, Digests, Piece, Plan, ZEROS};
use crate::error::{Error, ErrorCode, Result};
use crate::store::checksum::{Algo, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The caller's choice of a [`Plan`], made on the first bytes (or zeros)
/// the sink is given.
pub(super) type Decide = Box<dyn FnOnce(&[u8]) -> Plan + Send>;

/// What a consumer thread ends with.
pub(super) enum Output {
    Written,
    Digest(Algo, String, Duration),
}

/// A consumer's end: its output, or the thread died without one.
pub(super) type Ending = oneshot::Receiver<Result<Output>>;

/// See the module documentation.
pub(super) struct Fanout {
    senders: Vec<mpsc::Sender<Piece>>,
    endings: Vec<Ending>,
    buf: AlignedBuf,
    pool: Pool,
    /// Bytes handed to the consumers (the chunk being built not counted).
    size: u64,
    /// Set by [`Fanout::abandon`]: the writer neither extends nor syncs.
    abandoned: Arc<AtomicBool>,
    /// Until the first piece: the file (none when only hashing) and the
    /// decision that starts the consumers.
    unstarted: Option<(Option<SinkFile>, Decide)>,
}

impl Fanout {
    /// A fan-out to `file`'s writer (none: hashers only) and the hashers
    /// `decide` picks.
    pub(super) fn new(file: Option<SinkFile>, decide: Decide) -> Fanout {
        let pool = Pool::default();
        Fanout {
            senders: Vec::new(),
            endings: Vec::new(),
            buf: pool.take(CHUNK),
            pool,
            size: 0,
            abandoned: Arc::default(),
            unstarted: Some((file, decide)),
        }
    }

    /// Bytes accepted so far.
    pub(super) fn size(&self) -> u64 {
        self.size + self.buf.len() as u64
    }

    /// Appends what fits of `data` to the chunk being built; returns how
    /// many bytes it took.
    pub(super) fn fill(&mut self, data: &[u8]) -> usize {
        let take = self.buf.room().min(data.len());
        self.buf.extend(&data[..take]);
        take
    }

    /// Appends up to `len` bytes read from `file` at `offset` to the chunk
    /// being built; returns how many (0 at the end of the file).
    pub(super) fn fill_from(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> Result<usize> {
        self.buf
            .fill_from(file, offset, len)
            .map_err(|e| Error::io("read image", e))
    }

    /// True when the chunk being built is full.
    pub(super) fn is_full(&self) -> bool {
        self.buf.room() == 0
    }

    /// The chunk being built, as a piece for the consumers (none when it
    /// is empty); the next one starts in a pooled buffer.
    pub(super) fn take_chunk(&mut self) -> Option<Piece> {
        if self.buf.len() == 0 {
            return None;
        }
        let full = std::mem::replace(&mut self.buf, self.pool.take(CHUNK));
        self.size += full.len() as u64;
        Some(Piece::Data(self.pool.freeze(full)))
    }

    /// `n` zeros as a piece for the consumers.
    pub(super) fn zeros(&mut self, n: u64) -> Piece {
        self.size += n;
        Piece::Zeros(n)
    }

    /// The consumers' queues, started on `first` (the first piece) when
    /// they are not yet.
    pub(super) fn queues(&mut self, first: &Piece) -> Result<&[mpsc::Sender<Piece>]> {
        if let Some((file, decide)) = self.unstarted.take() {
            let plan = decide(match first {
                Piece::Data(chunk) => chunk,
                Piece::Zeros(_) => &ZEROS,
            });
            self.start(file, plan)?;
        }
        Ok(&self.senders)
    }

    fn start(&mut self, file: Option<SinkFile>, plan: Plan) -> Result<()> {
        if let Some(file) = file {
            let abandoned = self.abandoned.clone();
            self.spawn("sink-writer", move |rx| {
                write_file(file, plan.write, rx, &abandoned).map(|()| Output::Written)
            })?;
        }
        for algo in plan.digests {
            self.spawn("sink-hasher", move |rx| Ok(hash(algo, rx)))?;
        }
        Ok(())
    }

    fn spawn(
        &mut self,
        name: &str,
        consume: impl FnOnce(mpsc::Receiver<Piece>) -> Result<Output> + Send + 'static,
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel(DEPTH);
        let (done, ending) = oneshot::channel();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let _ = done.send(consume(rx));
            })
            .map_err(|e| Error::io("start a sink thread", e))?;
        self.senders.push(tx);
        self.endings.push(ending);
        Ok(())
    }

    /// No more pieces: the consumers (started now on no bytes when nothing
    /// came) are told; returns their endings, to be waited for.
    pub(super) fn close(&mut self) -> Result<Vec<Ending>> {
        if self.unstarted.is_some() {
            self.queues(&Piece::Data(bytes::Bytes::new()))?;
        }
        self.senders.clear();
        Ok(std::mem::take(&mut self.endings))
    }

    /// Gives up: the file (if the consumers never started) is closed, the
    /// writer neither extends nor syncs it; returns the endings to wait for.
    pub(super) fn abandon(&mut self) -> Vec<Ending> {
        self.abandoned.store(true, Ordering::Release);
        self.unstarted = None;
        self.senders.clear();
        std::mem::take(&mut self.endings)
    }
}

/// A hasher thread: the digest of every piece, and the time it took.
fn hash(algo: Algo, mut rx: mpsc::Receiver<Piece>) -> Output {
    let mut hasher = Hasher::new(algo);
    let mut busy = Duration::ZERO;
    while let Some(piece) = rx.blocking_recv() {
        let t = Instant::now();
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
    Output::Digest(algo, hasher.finalize_hex(), busy)
}

/// What the consumers ended with: the digests of `size` bytes, or the
/// first consumer's error.
pub(super) fn settle(
    size: u64,
    endings: Vec<std::result::Result<Result<Output>, oneshot::error::RecvError>>,
) -> Result<Digests> {
    let mut digests = Digests {
        size,
        md5: None,
        sha256: None,
        sha512: None,
        hash_micros: 0,
    };
    for ending in endings {
        let output =
            ending.map_err(|_| Error::new(ErrorCode::Internal, "a sink thread died"))??;
        if let Output::Digest(algo, hex, busy) = output {
            digests.hash_micros = digests.hash_micros.max(busy.as_micros() as u64);
            match algo {
                Algo::Md5 => digests.md5 = Some(hex),
                Algo::Sha256 => digests.sha256 = Some(hex),
                Algo::Sha512 => digests.sha512 = Some(hex),
            }
        }
    }
    Ok(digests)
}
