//! The compressed form of a master (`[http] gzip = static`): where it lives
//! and how it says which master it decodes to. Written by the store
//! (`store/compress.rs`), opened by the image server (`http/`), so the one
//! rule both rely on lives here: a compressed file is served for an open
//! file only when the identity its gzip header records is the identity of
//! that very open file.
//!
//! A master's compressed file is `<instance_master_path>/.gzip/<inode>.gz`:
//! named by the master's inode, so the image server finds it from the node's
//! `disk` it opened (a hard link of the master: the same inode) with one
//! `fstat`, without knowing masters' names. Its gzip header carries, in an
//! extra subfield (`IW`, RFC 1952 2.3.1.1; decoders skip it), the master's
//! device, inode, size and modification time (nanoseconds), taken from the
//! descriptor the compressor read. Masters are written once under a
//! temporary name and never modified, so an equal identity means the same
//! bytes; a node prepared again with another image, a master evicted and
//! made again (even on a reused inode number: another modification time), a
//! node's copy on another file system all differ and are served identity.

use std::fs::{File, Metadata};
use std::os::unix::fs::{FileExt, MetadataExt};

/// Subdirectory of the master cache holding the compressed files (hidden:
/// never a master, never listed by a sweeper of plain files).
pub const DIR: &str = ".gzip";

/// Bytes of a gzip header read at most to find the identity.
const HEADER_MAX: usize = 512;
/// The extra subfield's identifier (RFC 1952: two letters).
const SUBFIELD: [u8; 2] = *b"IW";

/// The identity of a master's bytes: what its compressed file records and
/// the image server compares with the file it opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    /// Device of the master.
    pub dev: u64,
    /// Inode of the master.
    pub ino: u64,
    /// Size of the master, bytes.
    pub size: u64,
    /// Modification time of the master: seconds.
    pub mtime: i64,
    /// Modification time of the master: nanoseconds.
    pub mtime_nsec: i64,
}

impl Origin {
    /// The identity of the file whose metadata is `m`.
    pub fn of(m: &Metadata) -> Origin {
        Origin {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
        }
    }

    /// The name of the compressed file of this master in [`DIR`].
    pub fn file_name(&self) -> String {
        file_name(self.ino)
    }

    /// The text recorded in the gzip header (and in a "does not pay"
    /// marker).
    pub fn encode(&self) -> String {
        format!(
            "v1 dev={} ino={} size={} mtime={}.{:09}",
            self.dev, self.ino, self.size, self.mtime, self.mtime_nsec
        )
    }

    /// The gzip member header (RFC 1952) that records this identity: no
    /// file name, no time, "fastest" (XFL 4), Unix (OS 3).
    pub fn gzip_header(&self) -> Vec<u8> {
        let data = self.encode().into_bytes();
        let sub_len = data.len() as u16;
        let xlen = 4 + sub_len;
        let mut h = vec![0x1f, 0x8b, 8, 4, 0, 0, 0, 0, 4, 3];
        h.extend_from_slice(&xlen.to_le_bytes());
        h.extend_from_slice(&SUBFIELD);
        h.extend_from_slice(&sub_len.to_le_bytes());
        h.extend_from_slice(&data);
        h
    }

    /// The identity recorded in the gzip header at the start of `file`, if
    /// it has one of ours.
    pub fn recorded_in(file: &File) -> Option<String> {
        let mut buf = [0u8; HEADER_MAX];
        let mut got = 0;
        while got < buf.len() {
            match file.read_at(&mut buf[got..], got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        recorded(&buf[..got])
    }
}

/// The name of the compressed file of the master with inode `ino`.
pub fn file_name(ino: u64) -> String {
    format!("{ino}.gz")
}

/// The name of the marker saying the master with inode `ino` does not
/// compress well enough (it holds the master's [`Origin::encode`]).
pub fn marker_name(ino: u64) -> String {
    format!("{ino}.identity")
}

/// The identity in the `IW` subfield of a gzip header.
fn recorded(h: &[u8]) -> Option<String> {
    if h.get(..4)? != [0x1f, 0x8b, 8, 4] {
        return None;
    }
    let xlen = u16::from_le_bytes([*h.get(10)?, *h.get(11)?]) as usize;
    let mut extra = h.get(12..12 + xlen)?;
    while extra.len() >= 4 {
        let len = u16::from_le_bytes([extra[2], extra[3]]) as usize;
        let data = extra.get(4..4 + len)?;
        if extra[..2] == SUBFIELD {
            return String::from_utf8(data.to_vec()).ok();
        }
        extra = &extra[4 + len..];
    }
    None
}

/// The compressed file of the open master whose metadata is `meta`, in
/// the directory at `dir` (the master cache's [`DIR`]): [`open_for`] after
/// opening the directory. The image server and the peer listener both
/// serve through it. `None` means: serve identity.
pub fn open_in(dir: &std::path::Path, meta: &Metadata) -> Option<(File, Metadata)> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let dir = rustix::fs::open(dir, flags, Mode::empty()).ok()?;
    open_for(&dir, meta)
}

/// The compressed file for the open file `opened` (metadata `meta`), found
/// in the directory `dir` (the master cache's [`DIR`], opened as a
/// directory): only a regular file whose recorded identity is exactly
/// `opened`'s, with its metadata. `None` means: serve identity.
pub fn open_for(dir: &impl rustix::fd::AsFd, meta: &Metadata) -> Option<(File, Metadata)> {
    use rustix::fs::{Mode, OFlags};
    let origin = Origin::of(meta);
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(dir, origin.file_name(), flags, Mode::empty()).ok()?;
    let file = File::from(fd);
    let gz = file.metadata().ok()?;
    if !gz.is_file() || gz.dev() != origin.dev {
        return None;
    }
    (Origin::recorded_in(&file)? == origin.encode()).then_some((file, gz))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn the_header_records_the_origin_and_decodes() {
        let o = Origin {
            dev: 1,
            ino: 2,
            size: 3,
            mtime: 4,
            mtime_nsec: 5,
        };
        let mut gz = o.gzip_header();
        // A stored empty final deflate block, then the CRC and size of "".
        gz.extend_from_slice(&[3, 0]);
        gz.extend_from_slice(&[0; 8]);
        assert_eq!(recorded(&gz).as_deref(), Some(o.encode().as_str()));
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut out)
            .unwrap();
        assert!(out.is_empty());
        assert_eq!(recorded(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3]), None);
        assert_eq!(recorded(b"\x1f\x8b\x08\x04\0\0\0\0\0\x03\xff\xff"), None);
    }
}
