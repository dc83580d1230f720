//! qcow2 -> raw conversion and hostile images: results compared with
//! `qemu-img convert -O raw`, checksums with `openssl dgst`.

use crate::common;

use common::*;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The disk served to `node`.
pub(crate) fn disk_of(env: &Env, node: &str) -> PathBuf {
    env.images_dir().join(node).join("disk")
}

/// A file:// URL of `p`.
pub(crate) fn file_url(p: &Path) -> String {
    format!("file://{}", p.display())
}

/// Prepares the qcow2 `img` (a file:// source) for a new node, which must
/// succeed and be described by `expect`, made with [`served`] for the file
/// where this makes `qemu-img convert -O raw` of `img` first (with the
/// case's name as its context). Returns the node and the completion.
pub(crate) async fn prepare_like_qemu_img(
    env: &Env,
    img: &Path,
    expect: Served,
) -> (String, serde_json::Value) {
    reference_raw(img, expect.bytes());
    let node = node();
    let (ok, ev) = env.prepare(&node, &file_url(img), &[]).await;
    assert!(ok, "{ev}");
    expect.check(&ev);
    (node, ev)
}

/// The node's served disk holds exactly `reference`'s bytes in fewer than
/// `max_allocated` allocated bytes; `holes` says which ranges must have
/// become holes.
fn assert_sparse_copy(env: &Env, node: &str, reference: &Path, max_allocated: u64, holes: &str) {
    let disk = std::fs::metadata(disk_of(env, node)).unwrap();
    assert!(
        disk.blocks() * 512 < max_allocated,
        "{holes}: {} bytes allocated",
        disk.blocks() * 512
    );
    assert_same_bytes(&disk_of(env, node), reference);
}

/// `a` and `b` hold the same bytes. Only the ranges where either file has
/// data are read and compared: a hole in both reads as zeros in both, and
/// these disks are gigabytes of holes (`cmp` read every byte of both).
pub(crate) fn assert_same_bytes(a: &Path, b: &Path) {
    use std::io::{Read, Seek, SeekFrom};
    let len = std::fs::metadata(a).unwrap().len();
    assert_eq!(
        len,
        std::fs::metadata(b).unwrap().len(),
        "{a:?} and {b:?}: sizes"
    );
    let mut ranges = [data_ranges(a), data_ranges(b)].concat();
    ranges.sort_unstable();
    let (mut fa, mut fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut done = 0;
    for (start, end) in ranges {
        let mut at = start.max(done);
        while at < end {
            let n = (end - at).min(ba.len() as u64) as usize;
            for (f, buf) in [(&mut fa, &mut ba), (&mut fb, &mut bb)] {
                f.seek(SeekFrom::Start(at)).unwrap();
                f.read_exact(&mut buf[..n]).unwrap();
            }
            if ba[..n] != bb[..n] {
                let i = (0..n).find(|&i| ba[i] != bb[i]).unwrap_or_default();
                panic!("{a:?} and {b:?} differ at byte {}", at + i as u64);
            }
            at += n as u64;
        }
        done = done.max(end);
    }
}

/// A qcow2 made by qemu-img with `opts` from a patchy raw disk of `size`
/// bytes (seed `seed`) converts to exactly qemu-img's raw, as a master
/// named `<id>.converted`, leaving no temporary.
async fn converts_like_qemu_img(name: &str, size: u64, seed: u64, opts: &[&str]) {
    let env = Env::new("");
    let dir = env.root().join("allowed");
    let raw = env.root().join(format!("{name}.raw"));
    patchy_raw(&raw, size, seed);
    let img = dir.join(format!("{name}.qcow2"));
    qcow2_from(&raw, &img, opts);
    let reference = env.root().join(format!("{name}.ref"));
    let (node, ev) = prepare_like_qemu_img(&env, &img, served(&reference).context(name)).await;
    assert_eq!(ev["converted"], true, "{name}");
    assert_eq!(ev["image_disk_format"], "raw");
    assert_eq!(
        std::fs::read(disk_of(&env, &node)).unwrap(),
        std::fs::read(&reference).unwrap(),
        "{name}"
    );
    let master = env.master_dir().join(format!(
        "{}.converted",
        ev["image_source"]
            .as_str()
            .map(|s| uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, s.as_bytes()))
            .unwrap()
    ));
    assert!(
        master.exists(),
        "{name}: converted master named <id>.converted"
    );
    assert!(env.temporaries().is_empty());
}

/// One test per qcow2 variant: `test: name, size, seed, [qemu-img options];`.
macro_rules! qcow2_variants {
    ($($test:ident: $name:literal, $size:expr, $seed:literal, $opts:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            converts_like_qemu_img($name, $size, $seed, &$opts).await;
        }
    )*};
}

qcow2_variants! {
    qcow2_v2_converts_exactly_like_qemu_img: "v2", 24 << 20, 0, ["-o", "compat=0.10"];
    qcow2_v3_converts_exactly_like_qemu_img: "v3", 24 << 20, 1, ["-o", "compat=1.1"];
    qcow2_zlib_converts_exactly_like_qemu_img: "zlib", 24 << 20, 2, ["-c"];
    qcow2_4k_clusters_convert_exactly_like_qemu_img:
        "4k-clusters", 12 << 20, 3, ["-o", "cluster_size=4096"];
    qcow2_2m_clusters_convert_exactly_like_qemu_img:
        "2m-clusters", 40 << 20, 4, ["-o", "cluster_size=2097152"];
    qcow2_of_an_odd_size_converts_exactly_like_qemu_img: "odd-size", (13 << 20) + 3 * 512, 5, [];
    qcow2_with_1bit_refcounts_converts_exactly_like_qemu_img:
        "refcount-1bit", 8 << 20, 6, ["-o", "refcount_bits=1"];
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mostly_empty_8g_image_writes_holes() {
    let env = Env::new(NO_MD5);
    let raw = env.root().join("big.raw");
    patchy_raw(&raw, 8 << 30, 99);
    let img = env.root().join("allowed/big.qcow2");
    qcow2_from(&raw, &img, &[]);
    std::fs::remove_file(&raw).unwrap();
    let reference = env.root().join("big.ref");
    let expect = served(&reference).without_md5().context("big");
    let (node, ev) = prepare_like_qemu_img(&env, &img, expect).await;
    assert_eq!(ev["image_size"], 8u64 << 30);
    assert_sparse_copy(
        &env,
        &node,
        &reference,
        64 << 20,
        "zero clusters became holes",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconverted_variants_coexist_with_converted_ones() {
    let env = Env::new("");
    let raw = env.root().join("d.raw");
    patchy_raw(&raw, 4 << 20, 5);
    let img = env.root().join("allowed/d.qcow2");
    qcow2_from(&raw, &img, &[]);
    let url = file_url(&img);
    let (ok, conv) = env.prepare(&node(), &url, &[]).await;
    assert!(ok && conv["converted"] == true, "{conv}");
    let (ok, part) = env
        .prepare(&node(), &url, &["--image-type", "partition"])
        .await;
    assert!(ok && part["converted"] == false, "{part}");
    assert_eq!(part["image_disk_format"], "qcow2");
    assert_served(&part, &img);
    let (ok, again) = env.prepare(&node(), &url, &[]).await;
    assert!(ok);
    assert_eq!(again["cache"], "hit");
    assert_eq!(again["image_checksum"], conv["image_checksum"]);
    let masters = env.masters();
    assert_eq!(masters.len(), 2, "{masters:?}");
    assert!(masters.iter().any(|m| m.ends_with(".converted")));
    assert!(masters.iter().any(|m| !m.contains('.')));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_compressed_sources_are_decompressed() {
    let env = Env::new("");
    let raw = env.root().join("z.raw");
    patchy_raw(&raw, 6 << 20, 6);
    let img = env.root().join("z.qcow2");
    qcow2_from(&raw, &img, &[]);
    let compressed = env.root().join("allowed/z.qcow2.zst");
    let data = std::fs::read(&img).unwrap();
    std::fs::write(&compressed, zstd::encode_all(&data[..], 3).unwrap()).unwrap();
    let reference = env.root().join("z.ref");
    reference_raw(&img, &reference);
    let (ok, ev) = env
        .prepare(
            &node(),
            &file_url(&compressed),
            &["--checksum", &md5sum(&compressed)],
        )
        .await;
    assert!(ok, "{ev}");
    assert_eq!(ev["converted"], true);
    assert_served(&ev, &reference);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_images_are_refused_with_clear_errors() {
    let env = Env::new("");
    let dir = env.root().join("allowed");
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let raw = env.root().join("base.raw");
    patchy_raw(&raw, 4 << 20, 7);
    std::fs::copy(&raw, dir.join("base.raw")).unwrap();
    // Backing file (created with -u: qemu-img must not open anything).
    qcow2_backed_by(&dir.join("base.raw"), &dir.join("backing.qcow2"));
    // External data file, inside the test directory.
    tool(
        "qemu-img",
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            &format!("data_file={}", p("data.bin")),
            &p("datafile.qcow2"),
            "4M",
        ],
    );
    std::fs::write(dir.join("data.bin"), b"data file contents").unwrap();
    // LUKS-encrypted qcow2.
    tool(
        "qemu-img",
        &[
            "create",
            "-f",
            "qcow2",
            "--object",
            "secret,id=sec0,data=hunter2",
            "-o",
            "encrypt.format=luks,encrypt.key-secret=sec0",
            &p("luks.qcow2"),
            "4M",
        ],
    );
    // Truncated: cut in the middle of its tables.
    qcow2_from(&raw, &dir.join("full.qcow2"), &[]);
    let full = std::fs::read(dir.join("full.qcow2")).unwrap();
    std::fs::write(dir.join("truncated.qcow2"), &full[..70_000]).unwrap();
    // Other formats.
    tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "vmdk",
            raw.to_str().unwrap(),
            &p("disk.vmdk"),
        ],
    );
    tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "qed",
            raw.to_str().unwrap(),
            &p("disk.qed"),
        ],
    );

    let cases: Vec<(&str, Vec<&str>, &[&str])> = vec![
        ("backing.qcow2", vec![], &["unsafe_image"]),
        ("datafile.qcow2", vec![], &["unsafe_image"]),
        ("luks.qcow2", vec![], &["unsafe_image"]),
        ("truncated.qcow2", vec![], &["corrupt_image"]),
        (
            "full.qcow2",
            vec!["--disk-format", "raw"],
            &["format_mismatch"],
        ),
        ("disk.vmdk", vec![], &["format_not_permitted"]),
        ("disk.qed", vec![], &["format_not_permitted"]),
    ];
    for (file, extra, codes) in cases {
        let (ok, ev) = env
            .prepare(&node(), &file_url(&dir.join(file)), &extra)
            .await;
        assert!(!ok, "{file}: {ev}");
        let code = ev["error"]["code"].as_str().unwrap();
        assert!(codes.contains(&code), "{file}: {ev}");
    }
    // Even where vmdk/qed are permitted, the deep checks apply.
    let set = "conductor.permitted_image_formats=raw,qcow2,vmdk,qed";
    let (_, ev) = env
        .prepare(&node(), &file_url(&dir.join("disk.qed")), &["--set", set])
        .await;
    assert_eq!(ev["error"]["code"], "unsafe_image");
    let (ok, ev) = env
        .prepare(&node(), &file_url(&dir.join("disk.vmdk")), &["--set", set])
        .await;
    assert!(ok, "monolithicSparse vmdk is converted with qemu-img: {ev}");
    assert_served(&ev, &raw);

    assert!(env.masters().iter().all(|m| !m.starts_with('.')));
    assert_eq!(
        env.masters().len(),
        1,
        "only the permitted vmdk was cached: {:?}",
        env.masters()
    );
    assert!(env.temporaries().is_empty());
    assert_eq!(
        std::fs::read(dir.join("data.bin")).unwrap(),
        b"data file contents",
        "data file untouched"
    );

    // `inspect` gives the verdict as JSON.
    let out = env.run(&["inspect", &p("backing.qcow2")]).await;
    assert!(!out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["format"], "qcow2");
    assert_eq!(v["safe"], false);
    assert_eq!(v["error"]["code"], "unsafe_image");
    let out = env.run(&["inspect", &p("full.qcow2")]).await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["safe"], true);
    assert_eq!(v["virtual_size"], 4 << 20);
}

/// Flips random bytes of a valid qcow2's header and tables; every result is
/// either a clear error or exactly qemu-img's conversion, and the worker
/// serving them through the broker never goes down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_headers_never_crash_the_worker() {
    // More cases and other seeds locally: IIW_CORRUPT_CASES, IIW_CORRUPT_SEED.
    let count: usize = std::env::var("IIW_CORRUPT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(220);
    let seed_value: u64 = std::env::var("IIW_CORRUPT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x2545_f491_4f6c_dd1d);
    let env = Env::new("");
    let dir = env.root().join("allowed");
    let raw = env.root().join("seed.raw");
    patchy_raw(&raw, 2 << 20, 8);
    let seed_img = env.root().join("seed.qcow2");
    qcow2_from(&raw, &seed_img, &["-o", "cluster_size=4096"]);
    let seed = std::fs::read(&seed_img).unwrap();
    let mut rng = seed_value;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut files = Vec::new();
    let mut mutations = Vec::new();
    for i in 0..count {
        let mut img = seed.clone();
        let span = if i % 3 == 0 { 3 * 4096 } else { 112 };
        let mut changed = Vec::new();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % span;
            img[at] = next() as u8;
            changed.push((at, img[at]));
        }
        mutations.push(changed);
        let path = dir.join(format!("c{i}.qcow2"));
        std::fs::write(&path, img).unwrap();
        files.push(path);
    }
    let worker = env
        .serve_with(&["--set", "convert.min_timeout=20"], &[])
        .await;
    let broker = Broker::connect().await;
    let mut sent = std::collections::HashMap::new();
    for (i, f) in files.iter().enumerate() {
        let node = node();
        let corr = broker
            .command(&env.host, prepare_cmd(&node, &file_url(f)))
            .await;
        sent.insert(corr, (i, node));
    }
    let replies = broker.replies(count, Duration::from_secs(600)).await;
    let (mut errors, mut converted, mut crashed) = (0, 0, 0);
    for (corr, (i, node)) in &sent {
        let ev = &replies[corr];
        if ev["status"] == "error" {
            errors += 1;
            let code = ev["error"]["code"].as_str().unwrap();
            if ev["error"]["message"]
                .as_str()
                .unwrap_or("")
                .starts_with("qcow2 reader")
            {
                crashed += 1;
            }
            assert!(
                [
                    "corrupt_image",
                    "unsafe_image",
                    "format_mismatch",
                    "format_not_permitted"
                ]
                .contains(&code),
                "case {i}: {ev}"
            );
            continue;
        }
        converted += 1;
        // Accepted: the bytes must be exactly what qemu-img makes of it.
        let reference = env.root().join(format!("c{i}.ref"));
        let qemu = std::process::Command::new("qemu-img")
            .args([
                "convert",
                "-f",
                ev["image_disk_format"].as_str().map(|_| "qcow2").unwrap(),
                "-O",
                "raw",
            ])
            .arg(&files[*i])
            .arg(&reference)
            .output()
            .unwrap();
        if ev["converted"] == true {
            assert!(
                qemu.status.success(),
                "case {i} (bytes {:?}): we converted what qemu-img refuses ({}): {ev}",
                mutations[*i],
                String::from_utf8_lossy(&qemu.stderr)
            );
            served(&reference)
                .context(format_args!("case {i} (bytes {:?})", mutations[*i]))
                .check(ev);
            assert_eq!(
                std::fs::read(disk_of(&env, node)).unwrap(),
                std::fs::read(&reference).unwrap(),
                "case {i}"
            );
        }
    }
    eprintln!(
        "{count} corrupted images: {errors} refused ({crashed} by a crash of the isolated reader), {converted} accepted"
    );
    assert!(errors > count / 2, "most corruptions are caught");
    assert!(env.temporaries().is_empty());
    // Still serving.
    assert_eq!(
        reqwest::get(worker.metrics_url("/healthz"))
            .await
            .unwrap()
            .status(),
        200
    );
    let ok = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &file_url(&seed_img_copy(&env, &seed))),
        )
        .await;
    assert_eq!(ok["status"], "success", "{ok}");
}

fn seed_img_copy(env: &Env, seed: &[u8]) -> PathBuf {
    let p = env.root().join("allowed/fine.qcow2");
    std::fs::write(&p, seed).unwrap();
    p
}

/// The converter runs in its own process: when it dies (here: starved by a
/// tiny address-space limit) or overruns its time, the request gets
/// `corrupt_image` and the worker keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converter_crash_or_timeout_is_contained() {
    let env = Env::new("");
    let raw = env.root().join("c.raw");
    patchy_raw(&raw, 8 << 20, 9);
    let img = env.root().join("allowed/c.qcow2");
    qcow2_from(&raw, &img, &[]);
    let worker = env
        .serve_with(&["--set", "convert.memory_limit_mib=8"], &[])
        .await;
    let broker = Broker::connect().await;
    let ev = broker
        .call(&env.host, prepare_cmd(&node(), &file_url(&img)))
        .await;
    assert_eq!(ev["error"]["code"], "corrupt_image", "{ev}");
    assert!(
        ev["error"]["message"]
            .as_str()
            .unwrap()
            .contains("qcow2 reader"),
        "{ev}"
    );
    assert!(env.temporaries().is_empty());
    // Still serving: a raw image needs no converter.
    std::fs::copy(&raw, env.root().join("allowed/c.raw")).unwrap();
    let ok = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &file_url(&env.root().join("allowed/c.raw"))),
        )
        .await;
    assert_eq!(ok["status"], "success", "{ok}");
    worker.terminate().await;

    let (_, ev) = env
        .prepare(
            &node(),
            &file_url(&img),
            &[
                "--set",
                "convert.min_timeout=0",
                "--set",
                "convert.min_rate_mib=100000000",
            ],
        )
        .await;
    assert_eq!(ev["error"]["code"], "corrupt_image");
    assert!(
        ev["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not finish"),
        "{ev}"
    );
    assert!(env.temporaries().is_empty());
}

/// A qcow2 from an http source is converted while it downloads (throttled
/// here, so the converter must wait for bytes): the result equals qemu-img's,
/// a wrong checksum still refuses it, a broken download leaves nothing and
/// no converter behind, and file:// sources convert after the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qcow2_converted_while_it_downloads() {
    let env = Env::new("");
    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 24 << 20, 31);
    let img = env.root().join("src/disk.qcow2");
    qcow2_from(&raw, &img, &["-c"]);
    let reference = env.root().join("ref.raw");
    reference_raw(&img, &reference);
    let faults = FaultServer::start(&env.root().join("src"), 2 << 20).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;

    let done = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &faults.url("slow", "disk.qcow2")),
        )
        .await;
    assert_eq!(done["status"], "success", "{done}");
    assert_eq!(done["converted"], true);
    assert_served(&done, &reference);
    let text = worker.metrics_text().await;
    let mode = |text: &str, m: &str| {
        metric(
            text,
            &format!("ironic_image_worker_conversions_total{{mode=\"{m}\"}}"),
        )
    };
    assert_eq!(mode(&text, "while_downloading"), Some(1.0), "{text}");
    assert_eq!(mode(&text, "after_download"), Some(0.0), "{text}");

    // Plain clusters are read by the converter itself, and the download
    // given back as it is read: the result is still qemu-img's.
    let plain = env.root().join("src/plain.qcow2");
    qcow2_from(&raw, &plain, &[]);
    let done = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &faults.url("slow", "plain.qcow2")),
        )
        .await;
    assert_served(&done, &reference);
    let text = worker.metrics_text().await;
    assert_eq!(mode(&text, "while_downloading"), Some(2.0), "{text}");
    assert_eq!(mode(&text, "after_download"), Some(0.0), "{text}");

    // Converted while downloading, but the download does not match.
    let mut cmd = prepare_cmd(&node(), &faults.url("fast", "disk.qcow2"));
    cmd["instance_info"]["image_checksum"] = serde_json::json!("0".repeat(32));
    let bad = broker.call(&env.host, cmd).await;
    assert_eq!(bad["error"]["code"], "checksum_mismatch", "{bad}");

    // The download breaks off half-way on every attempt.
    let short = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &faults.url("short", "disk.qcow2")),
        )
        .await;
    assert_eq!(short["error"]["code"], "source_unreachable", "{short}");
    assert_eq!(env.masters().len(), 2, "{:?}", env.masters());
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
    let pid = worker.child.id().unwrap().to_string();
    let children = tool("sh", &["-c", &format!("pgrep -P {pid} || true")]);
    assert_eq!(children.trim(), "", "no converter left waiting");

    // A file:// source is converted after it is copied.
    let allowed = env.root().join("allowed/disk.qcow2");
    std::fs::copy(&img, &allowed).unwrap();
    let local = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &format!("file://{}", allowed.display())),
        )
        .await;
    assert_served(&local, &reference);
    let text = worker.metrics_text().await;
    assert_eq!(mode(&text, "after_download"), Some(1.0), "{text}");
}

/// A qcow2 whose L2 table points two guest clusters at the same host
/// cluster (a refcount error `qemu-img check` reports) is refused as
/// corrupt, whether converted while it downloads (the first read of the
/// cluster gave it back) or after a copy: never zeros served for data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_sharing_host_bytes_are_refused() {
    let env = Env::new("");
    let raw = env.root().join("disk.raw");
    random_file(&raw, 1 << 20, 7);
    let img = env.root().join("src/shared.qcow2");
    qcow2_from(&raw, &img, &[]);
    // Guest cluster 9 now reads host cluster of guest cluster 2.
    let mut bytes = std::fs::read(&img).unwrap();
    let be64 = |b: &[u8], at: usize| u64::from_be_bytes(b[at..at + 8].try_into().unwrap());
    let l1 = be64(&bytes, 40) as usize;
    let l2 = (be64(&bytes, l1) & 0x00ff_ffff_ffff_fe00) as usize;
    let (a, b) = (be64(&bytes, l2 + 2 * 8), be64(&bytes, l2 + 9 * 8));
    assert!(a != 0 && b != 0, "both clusters hold data");
    bytes[l2 + 9 * 8..l2 + 10 * 8].copy_from_slice(&a.to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    std::fs::copy(&img, env.root().join("allowed/shared.qcow2")).unwrap();
    let faults = FaultServer::start(&env.root().join("src"), 2 << 20).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    for source in [
        faults.url("slow", "shared.qcow2"),
        file_url(&env.root().join("allowed/shared.qcow2")),
    ] {
        let done = broker.call(&env.host, prepare_cmd(&node(), &source)).await;
        assert_eq!(done["error"]["code"], "corrupt_image", "{source}: {done}");
        let message = done["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("two clusters"), "{message}");
    }
    assert!(env.masters().is_empty(), "{:?}", env.masters());
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
}

/// Writes `commands` into the qcow2 `img` with qemu-io.
fn qemu_io(img: &Path, commands: &[&str]) {
    let mut args = vec!["-f", "qcow2"];
    for c in commands {
        args.push("-c");
        args.push(c);
    }
    args.push(img.to_str().unwrap());
    tool("qemu-io", &args);
}

/// A sparse qcow2 (unallocated L1 ranges, unallocated and zero clusters,
/// zero clusters over allocated ones, a compressed cluster, data at the
/// very end) converts exactly like qemu-img, as a sparse file: the
/// converter reads only the allocated clusters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_qcow2_converts_by_its_allocated_clusters() {
    let env = Env::new(NO_MD5);
    let img = env.root().join("allowed/sparse.qcow2");
    tool(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "6G"],
    );
    qemu_io(
        &img,
        &[
            "write -P 0x5a 0 1M",
            "write -P 0xa5 1G 3M",
            "write -P 0x77 2G 1M",
            "write -z 2G 512k",
            "write -z 3G 2M",
            "write -c -P 0x33 4G 64k",
            "write -P 0x11 6143M 1M",
        ],
    );
    let reference = env.root().join("sparse.ref");
    let expect = served(&reference).without_md5().context("sparse");
    let (node, ev) = prepare_like_qemu_img(&env, &img, expect).await;
    assert_eq!(ev["image_size"], 6u64 << 30);
    assert_sparse_copy(
        &env,
        &node,
        &reference,
        32 << 20,
        "unallocated ranges are holes",
    );
}

/// A converter stopped by its limits while the image downloads is not
/// started a second time on the complete file: the request fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converter_stopped_by_its_limits_is_not_run_again() {
    let env = Env::new("");
    let img = env.root().join("src/huge.qcow2");
    tool(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "1T"],
    );
    qemu_io(&img, &["write -P 0x5a 0 1M", "write -P 0xa5 512G 1M"]);
    let server = SourceServer::start(&env.root().join("src")).await;
    let out = env
        .run(&[
            "--set",
            "convert.min_timeout=1",
            "--set",
            "convert.min_rate_mib=100000000",
            "prepare",
            "--node",
            &node(),
            "--image-source",
            &server.url("huge.qcow2"),
        ])
        .await;
    let (ok, ev) = completion_of(&out);
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "corrupt_image", "{ev}");
    assert!(
        ev["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not finish"),
        "{ev}"
    );
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        log.matches("converting to raw").count(),
        1,
        "one conversion attempt: {log}"
    );
    assert!(env.temporaries().is_empty());
}

/// A qcow2 whose data is scattered 4 KiB writes (one every 64 KiB, so
/// every 1 MiB of the disk holds some data and mostly zeros) is served
/// with the holes `qemu-img convert -O raw` keeps: at most 1.1 times the
/// blocks qemu-img's output allocates (a 4 KiB zero block is a hole, not
/// only a whole zero chunk), and the very same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_small_writes_allocate_what_qemu_img_allocates() {
    let env = Env::new("");
    let img = env.root().join("allowed/scattered.qcow2");
    tool(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "48M"],
    );
    let writes: Vec<String> = (0..(48u64 << 20) / (64 << 10))
        .map(|i| format!("write -P 0x5a {} 4k", i * (64 << 10) + (i % 3) * 4096))
        .collect();
    let writes: Vec<&str> = writes.iter().map(String::as_str).collect();
    qemu_io(&img, &writes);
    let reference = env.root().join("scattered.ref");
    let (node, _) =
        prepare_like_qemu_img(&env, &img, served(&reference).context("scattered")).await;
    let theirs = std::fs::metadata(&reference).unwrap().blocks();
    let ours = std::fs::metadata(disk_of(&env, &node)).unwrap().blocks();
    assert!(
        ours * 10 <= theirs * 11,
        "served file allocates {} KiB, qemu-img's {} KiB",
        ours / 2,
        theirs / 2
    );
    assert_sparse_copy(&env, &node, &reference, (ours + 1) * 512, "4 KiB holes");
}
