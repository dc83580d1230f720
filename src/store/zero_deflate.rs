//! Runs of zeros as raw deflate that every decoder copies fast, for the
//! compressed form of masters (`compress.rs`).
//!
//! A mostly empty disk is mostly zeros on the wire too, once compressed,
//! and compressors write zeros either long or slow to decode: zlib-rs at
//! level 1 writes a MiB of zeros in 10,143 bytes (fixed Huffman codes), at
//! levels 2-9 in 1,033 bytes as matches at distance 1, whose every byte a
//! decoder copies from the one it has just written: Python 3.11 with zlib
//! 1.2.13, the agent's, inflated that MiB in 2.9 ms against 0.1 ms for the
//! level-1 one. The block written here costs 3,083 bytes a MiB and inflates
//! in 0.1 ms: one dynamic-Huffman block of 64 literal zeros, then matches
//! of 258 bytes at distance 64 (6 bits each), any zeros left as literals,
//! ended by an empty stored block (a full flush), so the block is byte
//! aligned, refers to nothing before it and may follow any full flush.
//!
//! Its three trees are fixed (RFC 1951 3.2.7): literal/length codes 285
//! (a 258-byte match: `0`), 0 (a literal zero: `10`) and 256 (end of
//! block: `11`); one distance code, 11 (49-64, four extra bits); the
//! code-length code sends those lengths with symbols 18 (a run of zero
//! lengths: `0`), 1 (`10`) and 2 (`11`).

/// The distance of the matches: the first bytes are literals, the rest
/// copies from this far back (far enough that a decoder's copy does not
/// wait on its own last store: 64 inflated as fast as 258 or 1,024).
const DISTANCE: usize = 64;
/// Longest deflate match.
const MATCH: usize = 258;

/// Appends `n` zeros to a raw deflate stream that is at a byte boundary
/// after a full flush (or at its start), as one block that ends the same
/// way.
pub(super) fn append_zeros(out: &mut Vec<u8>, n: usize) {
    let mut bits = Bits {
        out,
        acc: 0,
        len: 0,
    };
    // BFINAL 0, BTYPE 10 (dynamic); HLIT 286 codes, HDIST 12, HCLEN 18.
    bits.put(0, 1);
    bits.put(2, 2);
    bits.put(286 - 257, 5);
    bits.put(12 - 1, 5);
    bits.put(18 - 4, 4);
    // The code-length code's lengths, in RFC order 16, 17, 18, 0, 8, 7,
    // 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1: 18 has 1 bit, 2 and 1 have 2.
    for len in [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 2] {
        bits.put(len, 3);
    }
    // Literal/length lengths: 0 → 2, 1..=255 → none (18: 138 + 117 zero
    // lengths), 256 → 2, 257..=284 → none (18: 28), 285 → 1; then the
    // distance lengths: 0..=10 → none (18: 11), 11 → 1.
    let (one, two, run) = ((0b10, 2), (0b11, 2), (0b0, 1));
    let zeros = |bits: &mut Bits, count: u32| {
        bits.code(run);
        bits.put(count - 11, 7);
    };
    bits.code(two);
    zeros(&mut bits, 138);
    zeros(&mut bits, 117);
    bits.code(two);
    zeros(&mut bits, 28);
    bits.code(one);
    zeros(&mut bits, 11);
    bits.code(one);
    // The data: literal zeros up to the distance, 258-byte matches, the
    // remainder as literals, end of block.
    let (literal, matched, end) = ((0b10, 2), (0b0, 1), (0b11, 2));
    let literals = n.min(DISTANCE);
    let matches = (n - literals) / MATCH;
    let rest = n - literals - matches * MATCH;
    for _ in 0..literals {
        bits.code(literal);
    }
    for _ in 0..matches {
        bits.code(matched);
        // Distance code 11 (its one code, 1 bit), extra bits 64 - 49.
        bits.code((0b0, 1));
        bits.put((DISTANCE - 49) as u32, 4);
    }
    for _ in 0..rest {
        bits.code(literal);
    }
    bits.code(end);
    // An empty stored block: to the byte boundary, LEN 0, NLEN !0.
    bits.put(0, 3);
    bits.align();
    bits.out.extend_from_slice(&[0, 0, 0xff, 0xff]);
}

/// A deflate bit writer: values least significant bit first, Huffman
/// codes most significant bit first (RFC 1951 3.1.1).
struct Bits<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    len: u32,
}

impl Bits<'_> {
    fn put(&mut self, value: u32, len: u32) {
        self.acc |= u64::from(value) << self.len;
        self.len += len;
        while self.len >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.len -= 8;
        }
    }

    /// A Huffman code `(code, length)`, its first bit the most significant.
    fn code(&mut self, (code, len): (u32, u32)) {
        self.put(code.reverse_bits() >> (32 - len), len);
    }

    fn align(&mut self) {
        if self.len > 0 {
            self.put(0, 8 - self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn stream(runs: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        for &n in runs {
            append_zeros(&mut out, n);
        }
        // A final empty stored block ends the stream.
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
        out
    }

    #[test]
    fn decodes_to_zeros_in_both_decoders() {
        for n in [
            0,
            1,
            63,
            64,
            65,
            322,
            323,
            4096,
            65_537,
            1 << 20,
            (1 << 20) - 1,
        ] {
            let runs = [n, 7, n];
            let expected = vec![0u8; 2 * n + 7];
            let encoded = stream(&runs);
            let mut zlib = Vec::new();
            flate2::read::DeflateDecoder::new(&encoded[..])
                .read_to_end(&mut zlib)
                .unwrap();
            assert!(zlib == expected, "zlib-rs, {n}");
            let miniz = miniz_oxide::inflate::decompress_to_vec(&encoded).unwrap();
            assert!(miniz == expected, "miniz_oxide, {n}");
        }
    }

    #[test]
    fn a_mib_costs_about_3_kib() {
        let mut out = Vec::new();
        append_zeros(&mut out, 1 << 20);
        assert!((3000..3200).contains(&out.len()), "{}", out.len());
    }
}
