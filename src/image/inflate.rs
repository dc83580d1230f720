//! Decoding compressed qcow2 clusters exactly as qemu does.
//!
//! The converter reads compressed clusters itself (no qcow2 library): a
//! cluster is accepted only when qemu would accept it, so the served bytes
//! are qemu-img's or the image is refused as corrupt. qemu reads the stored
//! stream (bytes past the end of the file read as zeros) and requires it to
//! fill the whole cluster: a stream that ends early, or that is broken
//! before the cluster is full, is an I/O error in qemu-img and
//! `corrupt_image` here.

use crate::error::{Error, ErrorCode, Result};
use crate::image::qcow2::{Compression, Header};
use zlib_rs::{Inflate, InflateFlush, Status};
use zstd::stream::raw::{InBuffer, Operation, OutBuffer};

/// A decoder for the compressed clusters of one image, reused from cluster
/// to cluster.
pub struct Inflater {
    kind: Kind,
}

enum Kind {
    Zlib(Box<Inflate>),
    Zstd(Box<zstd::stream::raw::Decoder<'static>>),
}

fn corrupt(guest: u64, why: &str) -> Error {
    Error::new(
        ErrorCode::CorruptImage,
        format!("qcow2: the compressed cluster at guest offset {guest} {why}"),
    )
}

impl Inflater {
    /// A decoder for the compression type of `header`.
    pub fn new(header: &Header) -> Result<Inflater> {
        let kind = match header.compression() {
            Compression::Zlib => Kind::Zlib(Box::new(Inflate::new(false, QEMU_WINDOW_BITS))),
            Compression::Zstd => Kind::Zstd(Box::new(
                zstd::stream::raw::Decoder::new().map_err(|e| Error::io("zstd decoder", e))?,
            )),
        };
        Ok(Inflater { kind })
    }

    /// Decodes the stored stream `input` of the cluster at guest offset
    /// `guest` into `out` (one whole cluster), or refuses it as qemu does.
    pub fn inflate(&mut self, input: &[u8], out: &mut [u8], guest: u64) -> Result<()> {
        match &mut self.kind {
            Kind::Zlib(state) => zlib(state, input, out, guest),
            Kind::Zstd(dec) => zstd(dec, input, out, guest),
        }
    }
}

/// The window qemu opens its raw deflate streams with (`inflateInit2(-12)`).
const QEMU_WINDOW_BITS: u8 = 12;

/// qemu: `inflateInit2(-12)`, one `inflate(Z_FINISH)`; accepted when the
/// stream ended or ran out (`Z_STREAM_END`/`Z_BUF_ERROR`) with the output
/// full, whatever input is left. zlib-rs is zlib ported to Rust (the same
/// state machine and return codes as the zlib qemu links), and faster than
/// miniz_oxide on the literal-heavy streams of real images.
fn zlib(state: &mut Inflate, input: &[u8], out: &mut [u8], guest: u64) -> Result<()> {
    // A fresh state per cluster, opened as qemu opens it (`reset` would
    // reopen it with zlib's default window).
    *state = Inflate::new(false, QEMU_WINDOW_BITS);
    let before = state.total_out();
    match state.decompress(input, out, InflateFlush::Finish) {
        Ok(Status::StreamEnd | Status::BufError | Status::Ok) => {}
        Err(_) => return Err(corrupt(guest, "holds a broken deflate stream")),
    }
    if state.total_out() - before < out.len() as u64 {
        return Err(corrupt(guest, "inflates to less than a cluster"));
    }
    Ok(())
}

/// qemu: `ZSTD_decompressStream` until the output is full, each step making
/// progress, and the last frame completely flushed.
fn zstd(
    dec: &mut zstd::stream::raw::Decoder<'static>,
    input: &[u8],
    out: &mut [u8],
    guest: u64,
) -> Result<()> {
    dec.reinit().map_err(|e| Error::io("zstd decoder", e))?;
    let bad = |_| corrupt(guest, "holds a broken zstd stream");
    let mut input = InBuffer::around(input);
    let len = out.len();
    let mut output = OutBuffer::around(out);
    let mut left = 0;
    while output.pos() < len {
        let (was_in, was_out) = (input.pos, output.pos());
        left = dec.run(&mut input, &mut output).map_err(bad)?;
        if input.pos <= was_in && output.pos() <= was_out {
            return Err(corrupt(guest, "decompresses to less than a cluster"));
        }
    }
    if left > 0 {
        return Err(corrupt(guest, "decompresses to more than a cluster"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deflate(data: &[u8]) -> Vec<u8> {
        miniz_oxide::deflate::compress_to_vec(data, 6)
    }

    fn zlib_of(input: &[u8], len: usize) -> Result<Vec<u8>> {
        let mut state = Inflate::new(false, QEMU_WINDOW_BITS);
        let mut out = vec![0u8; len];
        zlib(&mut state, input, &mut out, 0).map(|()| out)
    }

    #[test]
    fn zlib_needs_a_full_cluster() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let stored = deflate(&data);
        // Trailing bytes (the rest of the last sector) are ignored.
        let mut padded = stored.clone();
        padded.extend_from_slice(&[0u8; 300]);
        assert_eq!(zlib_of(&padded, 4096).unwrap(), data);
        // More output than a cluster: the cluster is its first bytes.
        assert_eq!(zlib_of(&stored, 1024).unwrap(), data[..1024]);
        // A stream of 100 bytes for a cluster of 4096.
        let short = deflate(&data[..100]);
        assert_eq!(
            zlib_of(&short, 4096).unwrap_err().code,
            ErrorCode::CorruptImage
        );
        // Cut short, or garbage.
        assert!(zlib_of(&stored[..stored.len() / 2], 4096).is_err());
        assert!(zlib_of(&[0xff; 64], 4096).is_err());
    }

    #[test]
    fn zstd_needs_a_full_cluster_and_no_more() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 253) as u8).collect();
        let mut dec = zstd::stream::raw::Decoder::new().unwrap();
        let mut run = |input: &[u8], len: usize| {
            let mut out = vec![0u8; len];
            zstd(&mut dec, input, &mut out, 0).map(|()| out)
        };
        let stored = zstd::encode_all(&data[..], 3).unwrap();
        let mut padded = stored.clone();
        padded.extend_from_slice(&[0u8; 200]);
        assert_eq!(run(&padded, 4096).unwrap(), data);
        assert!(run(&stored, 1024).is_err(), "frame not fully flushed");
        let short = zstd::encode_all(&data[..100], 3).unwrap();
        assert!(run(&short, 4096).is_err());
        assert!(run(&[0u8; 64], 4096).is_err());
        // The decoder is reset between clusters.
        assert_eq!(run(&stored, 4096).unwrap(), data);
    }
}
