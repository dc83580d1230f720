//! The claims on deliveries being worked on: byte-range locks of one file,
//! `.ledger/.claims`, a byte per delivery key.
//!
//! Why locks and not files: a claim counts only while its process lives,
//! which is exactly the life of an open file description lock (`fcntl`
//! `F_OFD_SETLK`): the kernel drops it when the process ends, however it
//! ends, so no liveness check of the claiming process is needed and a claim
//! makes no inode (a file made and removed per cache hit cost the file
//! system a new inode each time). The file itself is empty and never
//! removed; a lock may lie past its end.
//!
//! A key's byte is at an offset taken from a hash of the key (FNV-1a, the
//! same in every build), in a range of 2^62 bytes. Locks of one open file
//! description never conflict with each other, so this process remembers
//! which of its keys holds which offset: a second key of this process on
//! an offset it holds, like a key of another process on it, waits for the
//! first to end (two keys sharing an offset cost a short wait, never a
//! second answer).

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Mutex;

/// The claims file's name in the ledger directory.
pub(super) const CLAIMS_FILE: &str = ".claims";

/// Offsets are below this (2^62: far from the largest file offset).
const OFFSETS: u64 = 1 << 62;

/// What a claim attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Got {
    /// The key is claimed by this process now.
    Taken,
    /// The key was claimed by this process already.
    Mine,
    /// Another process, or another key of this one, holds the key's byte.
    Held,
}

/// This process's claims (one per [`super::Ledger`] opened, shared by its
/// clones).
pub(super) struct Claims {
    path: PathBuf,
    /// How many offsets keys are spread over (a few in tests, to make keys
    /// share them).
    offsets: u64,
    /// The claims file, opened at the first claim, and the key each offset
    /// this process locks is held for.
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    file: Option<File>,
    held: HashMap<u64, String>,
}

impl Claims {
    /// The claims kept in `path`.
    pub(super) fn new(path: PathBuf) -> Claims {
        Claims::spread(path, OFFSETS)
    }

    /// Claims whose keys share `offsets` offsets.
    pub(super) fn spread(path: PathBuf, offsets: u64) -> Claims {
        Claims {
            path,
            offsets: offsets.clamp(1, OFFSETS),
            state: Mutex::new(State::default()),
        }
    }

    /// Claims `key` for this process unless another process or another of
    /// its keys holds its byte. One non-blocking `fcntl`: fit for an async
    /// thread.
    pub(super) fn take(&self, key: &str) -> Result<Got> {
        let offset = self.offset(key);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(holder) = state.held.get(&offset) {
            return Ok(if holder == key { Got::Mine } else { Got::Held });
        }
        if state.file.is_none() {
            state.file = Some(self.open()?);
        }
        let Some(file) = state.file.as_ref() else {
            return Ok(Got::Held);
        };
        match set_lock(file, offset, libc::F_WRLCK) {
            Ok(()) => {
                state.held.insert(offset, key.to_string());
                Ok(Got::Taken)
            }
            Err(e) if is_held(&e) => Ok(Got::Held),
            Err(e) => Err(Error::io("lock a ledger claim", e)),
        }
    }

    /// Ends this process's claim on `key`, if it holds one.
    pub(super) fn drop_claim(&self, key: &str) {
        let offset = self.offset(key);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.held.get(&offset).is_none_or(|holder| holder != key) {
            return;
        }
        state.held.remove(&offset);
        if let Some(file) = state.file.as_ref()
            && let Err(e) = set_lock(file, offset, libc::F_UNLCK)
        {
            // Left held, the claim would make other processes wait for
            // this one's end: say so.
            tracing::warn!(error = %e, "could not release a ledger claim");
        }
    }

    /// How many claims this process holds.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.held.len()
    }

    /// The byte of `key`.
    fn offset(&self, key: &str) -> u64 {
        let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        hash % self.offsets
    }

    /// Opens (or makes) the claims file, read-write (a write lock needs it).
    fn open(&self) -> Result<File> {
        let dir = self.path.parent().unwrap_or(std::path::Path::new("."));
        super::making_dir(dir, "open the ledger claims", || {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&self.path)
        })
    }
}

/// Whether `e` says another open file description holds the lock.
fn is_held(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES))
}

/// Sets the open file description lock `kind` (`F_WRLCK`, `F_UNLCK`) on the
/// byte at `offset` of `file`, without waiting.
fn set_lock(file: &File, offset: u64, kind: libc::c_int) -> std::io::Result<()> {
    let start = libc::off_t::try_from(offset)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "offset"))?;
    // SAFETY: an all-zero `flock` is a valid value of the plain C struct;
    // the fields that matter are set below (l_pid must be 0 for OFD locks).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = start;
    lock.l_len = 1;
    // SAFETY: `fcntl(F_OFD_SETLK)` reads the `flock` passed, which lives
    // through the call, on a descriptor `file` keeps open.
    let done = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
    if done == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
