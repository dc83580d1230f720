//! Our own qcow2 header parser and validator, and the map of where an
//! image's guest data lives. Every qcow2 image is checked here before any
//! converter (ours or qemu-img) reads a byte of it: qemu-img follows
//! backing and data files (CVE-2024-44082), and our converter trusts only
//! what was validated.

use crate::error::{Error, ErrorCode, Result};

/// The fields of a qcow2 header that matter for safety and conversion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Size of the virtual disk in bytes.
    pub virtual_size: u64,
    /// Entries in the L1 table.
    pub l1_size: u32,
    /// Host offset of the L1 table.
    pub l1_table_offset: u64,
    /// Host offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Clusters of the refcount table.
    pub refcount_table_clusters: u32,
    /// Incompatible feature bits (v3).
    pub incompatible_features: u64,
    /// Internal snapshots.
    pub nb_snapshots: u32,
    /// Host offset of the snapshot table.
    pub snapshots_offset: u64,
    /// log2 of the refcount width in bits.
    pub refcount_order: u32,
    /// How compressed clusters are stored (v3 header field; zlib before).
    pub compression_type: u8,
}

/// How the compressed clusters of an image are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Raw deflate (qemu's default).
    Zlib,
    /// zstd frames (`compression_type=zstd`).
    Zstd,
}

/// Incompatible feature bits.
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION_TYPE: u64 = 1 << 3;
const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;
/// Autoclear feature: the guest data lives raw in an external data file.
const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;
/// Header extension types.
const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_FULL_DISK_ENCRYPTION: u32 = 0x0537_be77;
const EXT_DATA_FILE: u32 = 0x4441_5441;
/// qemu's limit on the L1 table size.
const MAX_L1_BYTES: u64 = 32 << 20;
/// qemu's limit on the refcount table size.
const MAX_REFTABLE_BYTES: u64 = 8 << 20;

/// Limits applied while validating.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest virtual size accepted.
    pub max_virtual_size: u64,
}

impl Header {
    /// True when our converter reads this image itself (standard 64-bit L2
    /// entries, either compression type); images with extended L2 entries
    /// (subclusters) go to `qemu-img`.
    pub fn converter_reads(&self) -> bool {
        self.incompatible_features & INCOMPAT_EXTENDED_L2 == 0
    }

    /// How compressed clusters are stored.
    pub fn compression(&self) -> Compression {
        if self.compression_type == 1 {
            Compression::Zstd
        } else {
            Compression::Zlib
        }
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }
}

fn be32(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn be64(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

fn unsafe_image(msg: impl Into<String>) -> Error {
    Error::new(ErrorCode::UnsafeImage, format!("qcow2: {}", msg.into()))
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::new(ErrorCode::CorruptImage, format!("qcow2: {}", msg.into()))
}

/// Parses and validates the header at the start of `head` (at least the
/// first 64 KiB of the file, or all of it) of a file of `file_size` bytes.
/// Refuses backing files, external data files, encryption, unknown
/// incompatible features and inconsistent tables.
pub fn parse(head: &[u8], file_size: u64, limits: Limits) -> Result<Header> {
    let (mut header, autoclear_features, header_length) = read_fields(head, limits)?;
    check_features(&header, autoclear_features, header_length)?;
    check_tables(&header, file_size)?;
    header.compression_type = compression_type(head, &header, header_length)?;
    let cluster_size = 1usize << header.cluster_bits;
    check_extensions(head, header_length as usize, cluster_size)?;
    Ok(header)
}

/// The fixed header fields, with the version, backing file, cluster size,
/// virtual size and encryption checked as they are read; also the autoclear
/// features and the header length, which only the checks need.
fn read_fields(head: &[u8], limits: Limits) -> Result<(Header, u64, u32)> {
    let short = || corrupt("header is truncated");
    if head.get(0..4) != Some(b"QFI\xfb") {
        return Err(corrupt("bad magic"));
    }
    let version = be32(head, 4).ok_or_else(short)?;
    if version != 2 && version != 3 {
        return Err(unsafe_image(format!("version {version} is not 2 or 3")));
    }
    let backing_file_offset = be64(head, 8).ok_or_else(short)?;
    let backing_file_size = be32(head, 16).ok_or_else(short)?;
    if backing_file_offset != 0 || backing_file_size != 0 {
        return Err(unsafe_image("image has a backing file"));
    }
    let cluster_bits = be32(head, 20).ok_or_else(short)?;
    if !(9..=21).contains(&cluster_bits) {
        return Err(corrupt(format!(
            "cluster_bits {cluster_bits} out of range 9..=21"
        )));
    }
    let virtual_size = be64(head, 24).ok_or_else(short)?;
    if virtual_size > limits.max_virtual_size {
        return Err(unsafe_image(format!(
            "virtual size {virtual_size} exceeds the limit {}",
            limits.max_virtual_size
        )));
    }
    let crypt_method = be32(head, 32).ok_or_else(short)?;
    if crypt_method != 0 {
        return Err(unsafe_image(format!(
            "image is encrypted (crypt_method {crypt_method})"
        )));
    }
    let l1_size = be32(head, 36).ok_or_else(short)?;
    let l1_table_offset = be64(head, 40).ok_or_else(short)?;
    let refcount_table_offset = be64(head, 48).ok_or_else(short)?;
    let refcount_table_clusters = be32(head, 56).ok_or_else(short)?;
    let nb_snapshots = be32(head, 60).ok_or_else(short)?;
    let snapshots_offset = be64(head, 64).ok_or_else(short)?;

    let (incompatible_features, autoclear_features, refcount_order, header_length) = if version == 3
    {
        let incompat = be64(head, 72).ok_or_else(short)?;
        let autoclear = be64(head, 88).ok_or_else(short)?;
        let order = be32(head, 96).ok_or_else(short)?;
        let len = be32(head, 100).ok_or_else(short)?;
        (incompat, autoclear, order, len)
    } else {
        (0, 0, 4, 72)
    };
    let header = Header {
        version,
        cluster_bits,
        virtual_size,
        l1_size,
        l1_table_offset,
        refcount_table_offset,
        refcount_table_clusters,
        incompatible_features,
        nb_snapshots,
        snapshots_offset,
        refcount_order,
        compression_type: 0,
    };
    Ok((header, autoclear_features, header_length))
}

/// Refuses external data files, images marked corrupt or dirty, unknown
/// incompatible features and out-of-range header fields.
fn check_features(h: &Header, autoclear_features: u64, header_length: u32) -> Result<()> {
    let incompatible_features = h.incompatible_features;
    let (refcount_order, version) = (h.refcount_order, h.version);
    let cluster_size = 1u64 << h.cluster_bits;
    if autoclear_features & AUTOCLEAR_DATA_FILE_RAW != 0 {
        return Err(unsafe_image("image declares a raw external data file"));
    }
    if incompatible_features & INCOMPAT_DATA_FILE != 0 {
        return Err(unsafe_image("image uses an external data file"));
    }
    if incompatible_features & INCOMPAT_CORRUPT != 0 {
        return Err(corrupt("image is marked corrupt"));
    }
    if incompatible_features & INCOMPAT_DIRTY != 0 {
        return Err(corrupt(
            "image is marked dirty (not cleanly closed); repair it with qemu-img check -r all",
        ));
    }
    let known = INCOMPAT_DIRTY
        | INCOMPAT_CORRUPT
        | INCOMPAT_DATA_FILE
        | INCOMPAT_COMPRESSION_TYPE
        | INCOMPAT_EXTENDED_L2;
    if incompatible_features & !known != 0 {
        return Err(unsafe_image(format!(
            "unknown incompatible features {:#x}",
            incompatible_features & !known
        )));
    }
    if refcount_order > 6 {
        return Err(corrupt(format!("refcount_order {refcount_order} > 6")));
    }
    if version == 3 && (header_length < 104 || u64::from(header_length) > cluster_size) {
        return Err(corrupt(format!(
            "header_length {header_length} out of range"
        )));
    }

    Ok(())
}

/// The L1, refcount and snapshot tables must lie inside the file, aligned,
/// and be no larger than qemu allows.
fn check_tables(h: &Header, file_size: u64) -> Result<()> {
    let cluster_size = 1u64 << h.cluster_bits;
    let Header {
        virtual_size,
        l1_size,
        l1_table_offset,
        refcount_table_offset,
        refcount_table_clusters,
        incompatible_features,
        nb_snapshots,
        snapshots_offset,
        ..
    } = *h;
    let in_file = |off: u64, len: u64| {
        off.is_multiple_of(cluster_size) && off.checked_add(len).is_some_and(|end| end <= file_size)
    };
    // The L1 table must cover the virtual disk, fit qemu's limit and the file.
    let l2_entries = cluster_size
        / if incompatible_features & INCOMPAT_EXTENDED_L2 != 0 {
            16
        } else {
            8
        };
    let needed_l1 = virtual_size.div_ceil(cluster_size * l2_entries);
    let l1_bytes = u64::from(l1_size) * 8;
    if u64::from(l1_size) < needed_l1 {
        return Err(corrupt(format!(
            "L1 table ({l1_size} entries) too small for the virtual size"
        )));
    }
    if l1_bytes > MAX_L1_BYTES {
        return Err(corrupt(format!(
            "L1 table of {l1_bytes} bytes is too large"
        )));
    }
    if l1_size > 0 && (l1_table_offset == 0 || !in_file(l1_table_offset, l1_bytes)) {
        return Err(corrupt("L1 table lies outside the file"));
    }
    let reftable_bytes = u64::from(refcount_table_clusters) * cluster_size;
    if refcount_table_clusters == 0
        || reftable_bytes > MAX_REFTABLE_BYTES.max(cluster_size)
        || refcount_table_offset == 0
        || !in_file(refcount_table_offset, reftable_bytes)
    {
        return Err(corrupt(
            "refcount table lies outside the file or is too large",
        ));
    }
    if !l1_table_offset.is_multiple_of(cluster_size) {
        return Err(corrupt("L1 table offset is not cluster-aligned"));
    }
    // qemu validates every table offset, even of an empty table.
    if [l1_table_offset, refcount_table_offset, snapshots_offset]
        .iter()
        .any(|&o| o > i64::MAX as u64)
    {
        return Err(corrupt("a table offset is out of range"));
    }
    if !snapshots_offset.is_multiple_of(cluster_size)
        || nb_snapshots > 65536
        || (nb_snapshots > 0 && (snapshots_offset == 0 || !in_file(snapshots_offset, 1)))
    {
        return Err(corrupt("snapshot table lies outside the file"));
    }
    Ok(())
}

/// The compression type of a v3 header that declares one (zlib otherwise).
fn compression_type(head: &[u8], h: &Header, header_length: u32) -> Result<u8> {
    let short = || corrupt("header is truncated");
    let (version, incompatible_features) = (h.version, h.incompatible_features);
    let declared = incompatible_features & INCOMPAT_COMPRESSION_TYPE != 0;
    let compression_type = if version == 3 && header_length > 104 {
        *head.get(104).ok_or_else(short)?
    } else {
        0
    };
    // qemu: a compression type other than zlib needs the incompatible bit,
    // and the bit needs a type other than zlib.
    if compression_type > 1 || (compression_type == 1) != declared {
        return Err(corrupt(format!(
            "unknown or undeclared compression type {compression_type}"
        )));
    }
    Ok(compression_type)
}

/// Walks the header extensions (they end within the first cluster): a full
/// disk encryption or external data file extension is refused.
fn check_extensions(head: &[u8], header_length: usize, cluster_size: usize) -> Result<()> {
    let end = cluster_size.min(head.len());
    let mut off = header_length.div_ceil(8) * 8;
    while off + 8 <= end {
        let kind = be32(head, off).unwrap_or(EXT_END);
        let len = be32(head, off + 4).unwrap_or(0) as usize;
        match kind {
            EXT_END => return Ok(()),
            EXT_FULL_DISK_ENCRYPTION => return Err(unsafe_image("image is LUKS-encrypted")),
            EXT_DATA_FILE => return Err(unsafe_image("image names an external data file")),
            EXT_BACKING_FORMAT => return Err(unsafe_image("image names a backing format")),
            _ => {}
        }
        off = off
            .checked_add(8 + len.div_ceil(8) * 8)
            .ok_or_else(|| corrupt("header extension overflows"))?;
    }
    if off > end {
        return Err(corrupt("header extensions run past the first cluster"));
    }
    Ok(())
}

/// Checks every L1 entry (read from the file by the caller): reserved bits
/// clear, L2 tables cluster-aligned and inside the file.
pub fn check_l1_table(header: &Header, l1: &[u8], file_size: u64) -> Result<()> {
    const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
    const L1_RESERVED: u64 = 0x7f00_0000_0000_01ff;
    let cluster = header.cluster_size();
    for (i, entry) in l1.chunks_exact(8).enumerate() {
        let entry = u64::from_be_bytes(entry.try_into().unwrap_or_default());
        if entry & L1_RESERVED != 0 {
            return Err(corrupt(format!("L1 entry {i} has reserved bits set")));
        }
        let l2 = entry & L1_OFFSET_MASK;
        if l2 != 0 && (!l2.is_multiple_of(cluster) || l2.saturating_add(cluster) > file_size) {
            return Err(corrupt(format!("L1 entry {i} points outside the file")));
        }
    }
    Ok(())
}

/// Host offset of the L2 table an L1 entry points to (0: none, the whole
/// range it covers reads as zeros).
pub fn l2_offset(l1_entry: u64) -> u64 {
    l1_entry & 0x00ff_ffff_ffff_fe00
}

/// L2 entry flag of a compressed cluster.
const COMPRESSED: u64 = 1 << 62;
/// L2 entry flag of a zero cluster (v3).
const ZERO: u64 = 1;

/// Where the bytes of a [`DataRun`] are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// As they are, from this host offset on (contiguous for the whole run).
    Plain(u64),
    /// One compressed cluster: its stored stream is `len` bytes at host
    /// offset `offset` (to the end of its last 512-byte sector, as qemu
    /// reads it; bytes past the end of the file read as zeros).
    Compressed {
        /// Host offset of the stream.
        offset: u64,
        /// Bytes qemu reads for it.
        len: u64,
    },
}

/// A guest range of one L2 table that holds data, with where its bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataRun {
    /// Guest offset.
    pub guest: u64,
    /// Length in bytes (clipped to the virtual size).
    pub len: u64,
    /// Where its bytes are.
    pub stored: Stored,
}

/// The stored stream of the compressed cluster described by L2 `entry`:
/// `(host offset, bytes)`, as qemu computes them.
fn compressed_stream(header: &Header, entry: u64) -> (u64, u64) {
    let bits = 62 - (header.cluster_bits - 8);
    let offset = entry & ((1u64 << bits) - 1);
    let sectors = ((entry >> bits) & ((1u64 << (header.cluster_bits - 8)) - 1)) + 1;
    (offset, sectors * 512 - offset % 512)
}

/// The guest ranges of one L2 table that hold data, in order (standard
/// clusters merged while contiguous on the host too; one run per
/// compressed cluster). Unallocated and (v3) zero clusters read as zeros in
/// an image without a backing file, so they are left out and never read.
/// `l1_index` is the entry's place in the L1 table, `l2` the table's bytes
/// (one cluster), `file_size` the image file's size. Refused as corrupt, as
/// qemu refuses them when it reads them: a standard cluster (or an
/// allocated zero cluster) that is not cluster-aligned, a standard cluster
/// past the end of the file, a zero flag in a version 2 image. Standard
/// (not extended) L2 entries only.
pub fn data_runs(
    header: &Header,
    l1_index: u64,
    l2: &[u8],
    file_size: u64,
) -> Result<Vec<DataRun>> {
    let cluster = header.cluster_size();
    let entries = cluster / 8;
    let base = l1_index.saturating_mul(entries).saturating_mul(cluster);
    let mut runs: Vec<DataRun> = Vec::new();
    for (j, raw) in l2.chunks_exact(8).take(entries as usize).enumerate() {
        let guest = base.saturating_add(j as u64 * cluster);
        if guest >= header.virtual_size {
            break;
        }
        let entry = u64::from_be_bytes(raw.try_into().unwrap_or_default());
        let len = cluster.min(header.virtual_size - guest);
        let bad = |why: &str| corrupt(format!("L2 entry for guest offset {guest} {why}"));
        let stored = if entry & COMPRESSED != 0 {
            let (offset, len) = compressed_stream(header, entry);
            Stored::Compressed { offset, len }
        } else {
            let host = l2_offset(entry);
            if entry & ZERO != 0 && header.version < 3 {
                return Err(bad("has the zero flag in a version 2 image"));
            }
            if !host.is_multiple_of(cluster) {
                return Err(bad("is not cluster-aligned"));
            }
            if entry & ZERO != 0 || host == 0 {
                continue;
            }
            if host.saturating_add(len) > file_size {
                return Err(bad("points past the end of the file"));
            }
            Stored::Plain(host)
        };
        match (runs.last_mut(), stored) {
            (Some(last), Stored::Plain(b))
                if last.guest + last.len == guest
                    && matches!(last.stored, Stored::Plain(a) if a + last.len == b) =>
            {
                last.len += len
            }
            _ => runs.push(DataRun { guest, len, stored }),
        }
    }
    Ok(runs)
}

/// Host bytes `(offset, length)` of the compressed clusters of one L2 table
/// (see [`Stored::Compressed`]).
pub fn compressed_extents(header: &Header, l2: &[u8]) -> Vec<(u64, u64)> {
    l2.chunks_exact(8)
        .map(|raw| u64::from_be_bytes(raw.try_into().unwrap_or_default()))
        .filter(|entry| entry & COMPRESSED != 0)
        .map(|entry| compressed_stream(header, entry))
        .collect()
}

/// Checks the internal snapshot table as qemu does when it opens an image:
/// `table` holds the bytes from `snapshots_offset` (up to 64 MiB or the end
/// of the file). Snapshots are not converted, but an image qemu would refuse
/// is refused.
pub fn check_snapshot_table(header: &Header, table: &[u8], file_size: u64) -> Result<()> {
    const MAX_EXTRA: usize = 1024;
    let cluster = header.cluster_size();
    let mut off = 0usize;
    for i in 0..header.nb_snapshots {
        let bad = || corrupt(format!("snapshot table entry {i} is invalid"));
        // Each entry starts 8-aligned; the padding after the last one may
        // lie past the end of the file, as qemu leaves it.
        off = off.div_ceil(8) * 8;
        let fixed = table.get(off..off + 40).ok_or_else(bad)?;
        let l1_offset = be64(fixed, 0).ok_or_else(bad)?;
        let l1_size = be32(fixed, 8).ok_or_else(bad)? as u64;
        let id_len = u16::from_be_bytes([fixed[12], fixed[13]]) as usize;
        let name_len = u16::from_be_bytes([fixed[14], fixed[15]]) as usize;
        let extra = be32(fixed, 36).ok_or_else(bad)? as usize;
        if extra > MAX_EXTRA
            || !l1_offset.is_multiple_of(cluster)
            || l1_size * 8 > MAX_L1_BYTES
            || l1_offset.saturating_add(l1_size * 8) > file_size
        {
            return Err(bad());
        }
        off += 40 + extra + id_len + name_len;
        if off > table.len() {
            return Err(bad());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_v3() -> Vec<u8> {
        let mut h = vec![0u8; 65536];
        h[0..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
        h[36..40].copy_from_slice(&2u32.to_be_bytes());
        h[40..48].copy_from_slice(&(3u64 << 16).to_be_bytes());
        h[48..56].copy_from_slice(&(1u64 << 16).to_be_bytes());
        h[56..60].copy_from_slice(&1u32.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&112u32.to_be_bytes());
        h
    }

    const LIMITS: Limits = Limits {
        max_virtual_size: 1 << 40,
    };

    #[test]
    fn accepts_a_plain_header_and_refuses_dangerous_ones() {
        let file = 4 << 16;
        let h = header_v3();
        assert_eq!(parse(&h, file, LIMITS).unwrap().virtual_size, 1 << 30);

        // (field, value written there big-endian, the refusal)
        let refused: [(std::ops::Range<usize>, u64, ErrorCode); 10] = [
            (8..16, 512, ErrorCode::UnsafeImage),
            (32..36, 2, ErrorCode::UnsafeImage),
            (72..80, 4, ErrorCode::UnsafeImage),
            (72..80, 1 << 40, ErrorCode::UnsafeImage),
            (4..8, 4, ErrorCode::UnsafeImage),
            (20..24, 30, ErrorCode::CorruptImage),
            (24..32, 1 << 62, ErrorCode::UnsafeImage),
            (56..60, u64::from(u32::MAX), ErrorCode::CorruptImage),
            (36..40, 1, ErrorCode::CorruptImage),
            // A LUKS header extension.
            (
                112..116,
                u64::from(EXT_FULL_DISK_ENCRYPTION),
                ErrorCode::UnsafeImage,
            ),
        ];
        for (field, value, want) in refused {
            let mut h = header_v3();
            let width = field.len();
            h[field.clone()].copy_from_slice(&value.to_be_bytes()[8 - width..]);
            let got = parse(&h, file, LIMITS).unwrap_err().code;
            assert_eq!(got, want, "{field:?} = {value}");
        }
        assert_eq!(
            parse(&h[..50], file, LIMITS).unwrap_err().code,
            ErrorCode::CorruptImage
        );
    }
}

#[cfg(test)]
mod robustness {
    use super::*;

    /// A quick stand-in for the cargo-fuzz target that runs in every test
    /// run: mutated valid headers and random bytes never panic the parser.
    #[test]
    fn random_inputs_never_panic() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut base = vec![0u8; 4096];
        base[0..4].copy_from_slice(b"QFI\xfb");
        base[4..8].copy_from_slice(&3u32.to_be_bytes());
        base[20..24].copy_from_slice(&12u32.to_be_bytes());
        base[100..104].copy_from_slice(&112u32.to_be_bytes());
        for i in 0..200_000 {
            let mut data = base.clone();
            let len = if i % 7 == 0 {
                (next() % 200) as usize
            } else {
                data.len()
            };
            data.truncate(len);
            for _ in 0..1 + next() % 8 {
                if !data.is_empty() {
                    let at = (next() as usize) % data.len().min(160);
                    data[at] = next() as u8;
                }
            }
            let size = next() % (1 << 24);
            let limits = Limits {
                max_virtual_size: 1 << 40,
            };
            if let Ok(h) = parse(&data, size, limits) {
                let _ = check_l1_table(&h, &data, size);
                let _ = check_snapshot_table(&h, &data, size);
            }
        }
    }
}
