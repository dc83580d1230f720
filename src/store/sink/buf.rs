//! The chunks a sink hands to its consumers: heap buffers aligned for
//! `O_DIRECT`, reused through a small pool once every consumer is done with
//! them.

use bytes::Bytes;
use std::fs::File;
use std::sync::{Arc, Mutex, Weak};

/// Alignment of direct (`O_DIRECT`) writes: offsets, lengths and buffers.
/// Chunks are allocated with it, so a full chunk goes to the device as it
/// is, without a copy into a bounce buffer.
pub(super) const DIRECT_ALIGN: usize = 4096;

/// Chunk buffers the consumers are done with, reused for the next chunks:
/// a fresh 1 MiB allocation costs 256 page faults and as many zeroed pages
/// (measured: ~13% of the CPU of a 2 GiB download), more than filling it.
#[derive(Default)]
pub(super) struct Pool {
    free: Arc<Mutex<Vec<AlignedBuf>>>,
}

/// Buffers kept in a [`Pool`]: as many as can be in flight (each consumer
/// queues `DEPTH` chunks, all consumers share them).
const POOLED: usize = super::DEPTH + 2;

impl Pool {
    /// A free buffer of `cap` bytes (a pooled one when there is one).
    pub(super) fn take(&self, cap: usize) -> AlignedBuf {
        let pooled = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        pooled.unwrap_or_else(|| AlignedBuf::new(cap))
    }

    /// `buf` frozen as a chunk shared by the consumers; it comes back to
    /// this pool when the last of them drops it.
    pub(super) fn freeze(&self, buf: AlignedBuf) -> Bytes {
        Bytes::from_owner(Chunk {
            buf: Some(buf),
            pool: Arc::downgrade(&self.free),
        })
    }
}

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

/// A heap buffer aligned for `O_DIRECT`.
pub(super) struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
    len: usize,
}

// SAFETY: the buffer is exclusively owned, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

// SAFETY (Sync): shared access only reads the initialised bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(cap: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(cap, DIRECT_ALIGN).expect("valid layout")
    }

    /// An empty buffer of `cap` bytes.
    pub(super) fn new(cap: usize) -> AlignedBuf {
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(Self::layout(cap)) };
        let ptr = std::ptr::NonNull::new(raw)
            .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(cap)));
        AlignedBuf { ptr, cap, len: 0 }
    }

    /// Bytes held.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Room left.
    pub(super) fn room(&self) -> usize {
        self.cap - self.len
    }

    /// Appends `data`; the caller keeps `len + data.len() <= capacity`.
    pub(super) fn extend(&mut self, data: &[u8]) {
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
    pub(super) fn fill_from(
        &mut self,
        file: &File,
        offset: u64,
        max: usize,
    ) -> std::io::Result<usize> {
        let room = max.min(self.room());
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

    /// The bytes held.
    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: the first `len` bytes were initialised by `extend` or
        // `fill_from`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}
