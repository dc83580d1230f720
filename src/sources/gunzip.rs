//! A peer's master sent in its compressed form (`Content-Encoding: gzip`,
//! the holder's `[http] gzip = static` file): decoded here as it arrives,
//! so that what follows (the size, the digests, the file) sees the
//! master's own bytes, exactly as from an identity answer.
//!
//! Bounded: decoded bytes are handed on in chunks of about [`CHUNK`] bytes
//! (the decoder is fed only while fewer wait), whatever the compression
//! ratio; a header field (file name, comment, extra field) longer than
//! 64 KiB is refused (the decoder's own bound); the trailer's CRC-32 and length are checked
//! at the end, and bytes after it are refused. How many bytes the holder
//! may send at all is the caller's bound.

use std::io::{self, Write};

/// Decoded bytes handed on at a time (one more write of the decoder, at
/// most its 32 KiB buffer, may come on top).
pub(super) const CHUNK: usize = 1 << 20;

/// A gzip stream being decoded (see the module).
pub(super) struct Gunzip {
    decoder: flate2::write::GzDecoder<Vec<u8>>,
}

impl Gunzip {
    /// The decoder of a new stream.
    pub(super) fn new() -> Gunzip {
        Gunzip {
            decoder: flate2::write::GzDecoder::new(Vec::with_capacity(CHUNK + (64 << 10))),
        }
    }

    /// Decodes from `input` until it is used up or a chunk of decoded
    /// bytes waits ([`Gunzip::take`]); returns how many bytes of `input`
    /// it used. An error: not gzip, corrupt, a header field over its bound, or
    /// bytes after the end of the stream.
    pub(super) fn feed(&mut self, input: &[u8]) -> io::Result<usize> {
        let mut used = 0;
        while used < input.len() && self.decoder.get_ref().len() < CHUNK {
            let n = self.decoder.write(&input[used..])?;
            if n == 0 {
                return Err(invalid("bytes after the end of the gzip stream"));
            }
            used += n;
        }
        Ok(used)
    }

    /// The decoded bytes waiting, once a chunk of them does.
    pub(super) fn take(&mut self) -> Option<Vec<u8>> {
        (self.decoder.get_ref().len() >= CHUNK).then(|| self.take_all())
    }

    /// Every decoded byte waiting (after a cut: they are the master's
    /// bytes all the same, the decoder being exact up to its input).
    pub(super) fn take_all(&mut self) -> Vec<u8> {
        std::mem::replace(self.decoder.get_mut(), Vec::with_capacity(CHUNK))
    }

    /// The stream ended: the last decoded bytes, once its trailer checked
    /// out (CRC-32 and length of the decoded bytes).
    pub(super) fn finish(&mut self) -> io::Result<Vec<u8>> {
        self.decoder.try_finish()?;
        Ok(self.take_all())
    }
}

fn invalid(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    /// Decodes `gz` fed in pieces of `piece` bytes; the largest chunk taken.
    fn decode(gz: &[u8], piece: usize) -> io::Result<(Vec<u8>, usize)> {
        let (mut out, mut largest) = (Vec::new(), 0);
        let mut gunzip = Gunzip::new();
        for mut input in gz.chunks(piece) {
            while !input.is_empty() {
                let used = gunzip.feed(input)?;
                input = &input[used..];
                if let Some(chunk) = gunzip.take() {
                    largest = largest.max(chunk.len());
                    out.extend(chunk);
                }
            }
        }
        out.extend(gunzip.finish()?);
        Ok((out, largest))
    }

    #[test]
    fn decodes_in_bounded_chunks_whatever_the_ratio() {
        let mut data = vec![0u8; 40 << 20];
        for (i, b) in data[(8 << 20)..(9 << 20)].iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let gz = gzip(&data);
        assert!(gz.len() < 1 << 20, "{}", gz.len());
        for piece in [1, 7, 4096, 1 << 20, gz.len()] {
            let (out, largest) = decode(&gz, piece).unwrap();
            assert!(out == data, "piece {piece}");
            assert!(largest <= CHUNK + (32 << 10), "piece {piece}: {largest}");
        }
    }

    #[test]
    fn refuses_corrupt_truncated_trailing_and_oversized_headers() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 97) as u8).collect();
        let gz = gzip(&data);
        // A wrong CRC-32 in the trailer.
        let mut bad = gz.clone();
        let crc = bad.len() - 8;
        bad[crc] ^= 1;
        assert!(decode(&bad, 4096).is_err());
        // Cut short.
        assert!(decode(&gz[..gz.len() - 3], 4096).is_err());
        // Bytes after the end.
        let mut trailing = gz.clone();
        trailing.extend_from_slice(b"more");
        assert!(decode(&trailing, 4096).is_err());
        // Not gzip at all.
        assert!(decode(&data, 4096).is_err());
        // A file name that never ends: refused while it is fed.
        let mut header = vec![0x1f, 0x8b, 8, 0x08, 0, 0, 0, 0, 0, 3];
        header.extend(std::iter::repeat_n(b'a', 100 << 10));
        let mut gunzip = Gunzip::new();
        let fed: io::Result<Vec<usize>> = header.chunks(4096).map(|c| gunzip.feed(c)).collect();
        assert!(fed.is_err(), "a header field past 64 KiB");
    }
}
