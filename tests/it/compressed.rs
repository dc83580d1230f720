//! Compressed qcow2 (zlib and zstd) through the converter that decodes
//! clusters on every core: the served bytes are `qemu-img convert -O raw`'s
//! (in guest order, zero ranges left as holes), and a broken cluster in
//! the middle is refused as it was when clusters were decoded one after
//! another, leaving nothing behind.

use crate::common;
use crate::convert::{assert_same_bytes, disk_of, file_url, prepare_like_qemu_img};

use common::*;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A raw disk of `size` bytes in 64 KiB blocks: compressible text (most),
/// random bytes (stored uncompressed by `qemu-img convert -c`) and zeros,
/// so compressed, standard and unallocated clusters alternate.
fn mixed_raw(path: &Path, size: u64, seed: u64) {
    const BLOCK: usize = 64 << 10;
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let letters = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut data = Vec::with_capacity(size as usize);
    for i in 0..(size as usize).div_ceil(BLOCK) {
        match i % 8 {
            0 | 5 => data.resize(data.len() + BLOCK, 0),
            3 => (0..BLOCK / 8).for_each(|_| data.extend_from_slice(&next().to_le_bytes())),
            _ => (0..BLOCK).for_each(|_| data.push(letters[(next() % 64) as usize])),
        }
    }
    data.truncate(size as usize);
    std::fs::write(path, data).unwrap();
}

/// Host offset of the stored stream of the compressed cluster `n` of the
/// qcow2 `bytes` (panics when that cluster is not compressed).
fn compressed_stream_at(bytes: &[u8], n: u64) -> usize {
    let be64 = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap());
    let cluster_bits = u32::from_be_bytes(bytes[20..24].try_into().unwrap()) as u64;
    let per_l2 = 1u64 << (cluster_bits - 3);
    let l1 = be64(40) as usize;
    let l2 = be64(l1 + (n / per_l2) as usize * 8) & 0x00ff_ffff_ffff_fe00;
    let entry = be64(l2 as usize + (n % per_l2) as usize * 8);
    assert!(entry & (1 << 62) != 0, "cluster {n} is compressed");
    (entry & ((1u64 << (62 - (cluster_bits - 8))) - 1)) as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_clusters_decode_in_parallel_exactly_like_qemu_img() {
    let env = Env::new("");
    let size = 40u64 << 20;
    let raw = env.root().join("mixed.raw");
    mixed_raw(&raw, size, 11);
    let mut cases = vec![
        ("zlib", vec!["-c"]),
        ("zlib-4k", vec!["-c", "-o", "cluster_size=4096"]),
        ("zlib-2m", vec!["-c", "-o", "cluster_size=2097152"]),
    ];
    let zstd = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o", "compression_type=zstd"])
        .arg(env.root().join("probe.qcow2"))
        .arg("1M")
        .status()
        .unwrap()
        .success();
    if zstd {
        cases.push(("zstd", vec!["-c", "-o", "compression_type=zstd"]));
    }
    for (name, opts) in cases {
        let img = env.root().join(format!("allowed/{name}.qcow2"));
        qcow2_from(&raw, &img, &opts);
        let plain = env.root().join(format!("{name}-plain.qcow2"));
        qcow2_from(&raw, &plain, &opts[1..]);
        let len = |p: &Path| std::fs::metadata(p).unwrap().len();
        assert!(
            len(&img) < len(&plain) * 9 / 10,
            "{name}: the image holds compressed clusters"
        );
        let reference = env.root().join(format!("{name}.ref"));
        let (node, ev) = prepare_like_qemu_img(&env, &img, served(&reference).context(name)).await;
        assert_eq!(ev["image_size"], size, "{name}");
        assert_same_bytes(&disk_of(&env, &node), &reference);
        // A quarter of the blocks are zeros: holes, as qemu-img leaves them.
        let allocated = std::fs::metadata(disk_of(&env, &node)).unwrap().blocks() * 512;
        assert!(
            allocated <= size * 4 / 5,
            "{name}: {allocated} bytes allocated"
        );
    }
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
}

/// Broken clusters in the middle (the first good ones already written, the
/// later ones decoded ahead) and a broken L2 entry further on: the first
/// broken cluster in guest order is the error, with its code, whether the
/// image is converted after its copy or while it downloads, and no output
/// is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_compressed_cluster_midway_is_refused_and_nothing_kept() {
    let env = Env::new("");
    let raw = env.root().join("text.raw");
    mixed_raw(&raw, 8 << 20, 5);
    let img = env.root().join("src/broken.qcow2");
    qcow2_from(&raw, &img, &["-c", "-o", "cluster_size=4096"]);
    let mut bytes = std::fs::read(&img).unwrap();
    // Clusters 1023 (the last of the second L2 table) and 1560 (in 64 KiB
    // blocks 63 and 97: text) start with an invalid deflate block type.
    for n in [1023u64, 1560] {
        let at = compressed_stream_at(&bytes, n);
        bytes[at..at + 8].copy_from_slice(&[0xff; 8]);
    }
    // The L2 entry of cluster 1100 (in the third L2 table) points at an
    // unaligned host offset: a table error found while cluster 1023 is
    // still being decoded.
    let be64 = |b: &[u8], at: usize| u64::from_be_bytes(b[at..at + 8].try_into().unwrap());
    let l1 = be64(&bytes, 40) as usize;
    let l2 = (be64(&bytes, l1 + 2 * 8) & 0x00ff_ffff_ffff_fe00) as usize;
    let bad = (1u64 << 63) | (4096 * 3 + 512);
    bytes[l2 + (1100 - 2 * 512) * 8..][..8].copy_from_slice(&bad.to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    let refused = std::process::Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&img)
        .arg(env.root().join("qemu.raw"))
        .status()
        .unwrap();
    assert!(!refused.success(), "qemu-img refuses it too");
    std::fs::copy(&img, env.root().join("allowed/broken.qcow2")).unwrap();

    let faults = FaultServer::start(&env.root().join("src"), 2 << 20).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    for source in [
        file_url(&env.root().join("allowed/broken.qcow2")),
        faults.url("slow", "broken.qcow2"),
    ] {
        let node = node();
        let done = broker.call(&env.host, prepare_cmd(&node, &source)).await;
        assert_eq!(done["error"]["code"], "corrupt_image", "{source}: {done}");
        let message = done["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!(
                "compressed cluster at guest offset {}",
                1023 * 4096
            )),
            "{source}: {message}"
        );
        assert!(!disk_of(&env, &node).exists(), "{source}: nothing served");
    }
    assert!(env.masters().is_empty(), "{:?}", env.masters());
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
}
