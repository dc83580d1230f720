//! Cache lifecycle with real files and hard links: eviction order, the
//! never-evict-linked rule, TTL, the size limit after a burst, the cache CLI.

use crate::common;

use common::*;
use serde_json::Value;
use std::time::Duration;

async fn cache_list(env: &Env) -> Vec<Value> {
    let out = env.run(&["cache", "list", "--json"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// Waits (with a deadline) until the wall clock is in a later second than
/// the last use of every master in the cache: eviction compares whole
/// seconds of mtime, atime and ctime, and ctime cannot be set by a test.
async fn wait_until_clock_passes_last_use(env: &Env) {
    use std::os::unix::fs::MetadataExt;
    let last_use = || {
        env.masters()
            .iter()
            .filter_map(|m| std::fs::metadata(env.master_dir().join(m)).ok())
            .map(|md| md.mtime().max(md.atime()).max(md.ctime()))
            .max()
            .unwrap_or(0)
    };
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while now() <= last_use() {
        assert!(
            std::time::Instant::now() < deadline,
            "clock did not advance"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `cache clean ARGS`, with `--set SET` when given.
async fn clean_with(env: &Env, set: Option<&str>, args: &[&str]) -> Value {
    let mut all = match set {
        Some(set) => vec!["--set", set, "cache", "clean"],
        None => vec!["cache", "clean"],
    };
    all.extend_from_slice(args);
    let out = env.run(&all).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oldest_unlinked_first_and_linked_never() {
    // 1 MiB random images; the limit is set per command below.
    let env = Env::new("");
    for name in ["a", "b", "c"] {
        random_file(
            &env.root().join(format!("allowed/{name}.img")),
            1 << 20,
            name.as_bytes()[0] as u64,
        );
    }
    let url = |n: &str| format!("file://{}/allowed/{n}.img", env.root().display());
    let nodes: Vec<String> = (0..3).map(|_| node()).collect();
    for (n, img) in nodes.iter().zip(["a", "b", "c"]) {
        let (ok, ev) = env.prepare(n, &url(img), &["--force-raw", "false"]).await;
        assert!(ok, "{ev}");
    }
    // a is released first, then b; c stays linked by its node.
    env.oneshot(&["cleanup", "--node", &nodes[0]]).await;
    wait_until_clock_passes_last_use(&env).await;
    env.oneshot(&["cleanup", "--node", &nodes[1]]).await;

    let listed = cache_list(&env).await;
    assert_eq!(listed.len(), 3);
    let master =
        |n: &str| uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, url(n).as_bytes()).to_string();
    let (a, b, c) = (master("a"), master("b"), master("c"));
    let entry = |name: &str| listed.iter().find(|e| e["name"] == name).unwrap().clone();
    assert_eq!(entry(&a)["linked_nodes"], 0);
    assert_eq!(entry(&b)["linked_nodes"], 0);
    assert_eq!(entry(&c)["linked_nodes"], 1);
    assert!(entry(&a)["last_used"].as_i64() < entry(&b)["last_used"].as_i64());

    // Over a 2 MiB limit with 3 MiB cached: only the oldest unlinked goes.
    let r = clean_with(&env, Some("pxe.image_cache_size=2"), &[]).await;
    assert_eq!(r["evicted"], serde_json::json!([a]));
    assert!(
        !env.master_dir().join(format!(".meta/{a}.json")).exists(),
        "sidecar evicted with its master"
    );
    // Limit 0: everything unlinked goes, the linked master stays.
    let r = clean_with(&env, Some("pxe.image_cache_size=0"), &[]).await;
    assert_eq!(r["evicted"], serde_json::json!([b]));
    assert_eq!(env.masters(), vec![c.clone()]);
    // The node using c is still served.
    assert!(env.images_dir().join(&nodes[2]).join("disk").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_dry_run_and_all_unused() {
    let env = Env::new("");
    for name in ["a", "b"] {
        random_file(
            &env.root().join(format!("allowed/{name}.img")),
            1 << 20,
            40 + name.len() as u64,
        );
    }
    let url = |n: &str| format!("file://{}/allowed/{n}.img", env.root().display());
    let (n1, n2) = (node(), node());
    assert!(env.prepare(&n1, &url("a"), &[]).await.0);
    assert!(env.prepare(&n2, &url("b"), &[]).await.0);
    env.oneshot(&["deployed", "--node", &n1]).await;
    // Within the default TTL (a week) nothing expires; an orphaned sidecar
    // (its master gone) is tidied away.
    let orphan = env
        .master_dir()
        .join(".meta/0e0e0e0e-0000-5000-8000-000000000000.json");
    std::fs::write(&orphan, "{}").unwrap();
    // So is the lock file of a master that was never made (its download
    // failed in a process that died).
    let orphan_lock = env
        .master_dir()
        .join(".locks/0f0f0f0f-0000-5000-8000-000000000000.lock");
    std::fs::write(&orphan_lock, "").unwrap();
    assert_eq!(
        clean_with(&env, None, &[]).await["evicted"],
        serde_json::json!([])
    );
    assert!(!orphan.exists());
    assert!(!orphan_lock.exists());
    assert_eq!(
        lock_files(&env.master_dir()).len(),
        2,
        "the masters' locks stay"
    );
    // A dry run says what would go and removes nothing.
    wait_until_clock_passes_last_use(&env).await;
    let dry = clean_with(&env, Some("pxe.image_cache_ttl=0"), &["--dry-run"]).await;
    assert_eq!(dry["evicted"].as_array().unwrap().len(), 1);
    assert_eq!(env.masters().len(), 2);
    // TTL 0: the unused master expires; the linked one does not.
    let r = clean_with(&env, Some("pxe.image_cache_ttl=0"), &[]).await;
    assert_eq!(r["evicted"].as_array().unwrap().len(), 1);
    assert_eq!(env.masters().len(), 1);
    env.oneshot(&["cleanup", "--node", &n2]).await;
    let r = clean_with(&env, None, &["--all-unused"]).await;
    assert_eq!(r["evicted"].as_array().unwrap().len(), 1);
    assert!(env.masters().is_empty());
    // Lock files went with the masters and with the node cleaned up; the
    // node only `deployed` keeps its directory and its lock file.
    assert!(lock_files(&env.master_dir()).is_empty());
    assert_eq!(lock_files(&env.images_dir()), std::slice::from_ref(&n1));
    assert_lock_files_guard_something(&env);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_limit_holds_after_a_burst() {
    let env = Env::new("");
    let worker = env
        .serve_with(&["--set", "pxe.image_cache_size=3"], &[])
        .await;
    let broker = Broker::connect().await;
    for i in 0..8u64 {
        let img = env.root().join(format!("allowed/{i}.img"));
        random_file(&img, 1 << 20, 100 + i);
        let node = node();
        let url = format!("file://{}", img.display());
        let ev = broker.call(&env.host, prepare_cmd(&node, &url)).await;
        assert_eq!(ev["status"], "success", "{ev}");
        let ev = broker
            .call(
                &env.host,
                serde_json::json!({"action": "deployed", "node_uuid": node}),
            )
            .await;
        assert_eq!(ev["status"], "success");
    }
    let total: u64 = cache_list(&env)
        .await
        .iter()
        .map(|e| e["size"].as_u64().unwrap())
        .sum();
    assert!(total <= 3 << 20, "cache holds {total} bytes, limit 3 MiB");
    let metrics = worker.metrics_text().await;
    assert!(
        metrics.contains("ironic_image_worker_cache_files"),
        "{metrics}"
    );
}

fn inode(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().ino()
}

/// The names that have a lock file in `dir`.
fn lock_files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join(".locks"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
        .into_iter()
        .map(|n| n.strip_suffix(".lock").unwrap_or(&n).to_string())
        .collect()
}

/// Once nothing is in progress, a lock file stays only while what it
/// guards exists: a master in the cache, a node with files here.
fn assert_lock_files_guard_something(env: &Env) {
    for name in lock_files(&env.master_dir()) {
        assert!(
            env.master_dir().join(&name).is_file(),
            "lock file of a master that is gone: {name}"
        );
    }
    for name in lock_files(&env.images_dir()) {
        assert!(
            env.images_dir().join(&name).exists()
                || env.link_dir().join(&name).symlink_metadata().is_ok(),
            "lock file of a node without files: {name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_and_other_processes_leave_a_running_download_alone() {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 3 << 20, 91);
    let faults = FaultServer::start(&src, 1 << 20).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let n = node();
    let corr = broker
        .command(&env.host, prepare_cmd(&n, &faults.url("slow", "a.img")))
        .await;
    env.wait_for_temporary(Duration::from_secs(30)).await;
    let temps = env.temporaries();
    // A read-only command removes nothing; a command that writes, and a
    // second worker starting, remove only temporaries whose writer is gone.
    assert_eq!(cache_list(&env).await.len(), 0);
    assert_eq!(
        clean_with(&env, None, &[]).await["evicted"],
        serde_json::json!([])
    );
    let _other = env.serve_another(&[]).await;
    let now = env.temporaries();
    assert!(
        temps.iter().all(|t| now.contains(t)),
        "{temps:?} -> {now:?}"
    );
    let (got, ev) = broker.next_reply(Duration::from_secs(60)).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_served(&ev, &src.join("a.img"));
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
    assert_lock_files_guard_something(&env);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn earlier_layout_is_taken_over_on_start() {
    let env = Env::new("");
    let img = env.root().join("allowed/a.img");
    random_file(&img, 1 << 20, 92);
    let url = format!("file://{}", img.display());
    let (ok, ev) = env.prepare(&node(), &url, &["--force-raw", "false"]).await;
    assert!(ok, "{ev}");
    let name = env.masters().pop().unwrap();
    let master_inode = inode(&env.master_dir().join(&name));
    // The earlier layout: sidecar next to the master, a leftover temporary.
    let old_meta = env.master_dir().join(format!("{name}.meta.json"));
    std::fs::rename(
        env.master_dir().join(format!(".meta/{name}.json")),
        &old_meta,
    )
    .unwrap();
    let leftover = env.master_dir().join(".tmp-old.5f0c");
    std::fs::write(&leftover, b"partial").unwrap();
    // Read-only: nothing moves, the old sidecar is not a master.
    assert_eq!(cache_list(&env).await.len(), 1);
    assert!(old_meta.exists() && leftover.exists());
    // A command that writes takes it over: sidecar moved, temporary gone,
    // and the master is still a hit.
    let (ok, ev) = env.prepare(&node(), &url, &["--force-raw", "false"]).await;
    assert!(ok, "{ev}");
    assert_eq!(ev["cache"], "hit", "{ev}");
    assert!(!old_meta.exists() && !leftover.exists());
    assert!(env.master_dir().join(format!(".meta/{name}.json")).exists());
    assert_eq!(inode(&env.master_dir().join(&name)), master_inode);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_digest_is_computed_from_the_master_not_downloaded() {
    let env = Env::new("");
    let src = env.root().join("src");
    let img = src.join("a.img");
    random_file(&img, 2 << 20, 93);
    let server = SourceServer::start(&src).await;
    let url = server.url("a.img");
    let (n1, n2) = (node(), node());
    let (md5, sha512) = (md5sum(&img), sha512sum(&img));
    let (ok, ev) = env
        .prepare(&n1, &url, &["--checksum", &md5, "--force-raw", "false"])
        .await;
    assert!(ok, "{ev}");
    let name = env.masters().pop().unwrap();
    let sidecar = env.master_dir().join(format!(".meta/{name}.json"));
    let meta: Value = serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
    assert!(meta["source_sha512"].is_null(), "{meta}");
    let master_inode = inode(&env.master_dir().join(&name));
    // Another node asks for SHA-512: computed from the master, no download.
    let (ok, ev) = env
        .prepare(
            &n2,
            &url,
            &[
                "--os-hash-algo",
                "sha512",
                "--os-hash-value",
                &sha512,
                "--force-raw",
                "false",
            ],
        )
        .await;
    assert!(ok, "{ev}");
    assert_eq!(ev["cache"], "hit", "{ev}");
    served(&img).sha512().check(&ev);
    assert_eq!(server.count("GET", "a.img"), 1);
    assert_eq!(inode(&env.master_dir().join(&name)), master_inode);
    let meta: Value = serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
    assert_eq!(meta["source_sha512"], sha512.as_str());
    assert!(
        meta.as_object().unwrap().values().all(|v| v != ""),
        "no empty digests: {meta}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linked_master_keeps_its_inode_when_fetched_again() {
    let env = Env::new("");
    let src = env.root().join("src");
    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 16 << 20, 94);
    qcow2_from(&raw, &src.join("a.qcow2"), &[]);
    let server = SourceServer::start(&src).await;
    let url = server.url("a.qcow2");
    let (n1, n2) = (node(), node());
    let qcow2 = src.join("a.qcow2");
    // Converted while downloading, verified by MD5: the source's SHA-256
    // is never computed, and must be absent (not "").
    let (ok, ev) = env
        .prepare(&n1, &url, &["--checksum", &md5sum(&qcow2)])
        .await;
    assert!(ok, "{ev}");
    let name = env.masters().pop().unwrap();
    assert!(name.ends_with(".converted"));
    let sidecar = env.master_dir().join(format!(".meta/{name}.json"));
    let meta: Value = serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
    assert!(meta["source_sha256"].is_null(), "{meta}");
    let master = env.master_dir().join(&name);
    let before = inode(&master);
    // SHA-256 of the source cannot come from a converted master: fetched
    // again, but the same bytes keep the master nodes already link.
    let (ok, ev) = env
        .prepare(
            &n2,
            &url,
            &[
                "--os-hash-algo",
                "sha256",
                "--os-hash-value",
                &sha256sum(&qcow2),
            ],
        )
        .await;
    assert!(ok, "{ev}");
    assert_eq!(server.count("GET", "a.qcow2"), 2);
    assert_eq!(inode(&master), before, "linked master replaced");
    for n in [&n1, &n2] {
        assert_eq!(inode(&env.images_dir().join(n).join("disk")), before);
    }
    let meta: Value = serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
    assert_eq!(meta["source_sha256"], sha256sum(&qcow2).as_str());
    assert!(env.temporaries().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_prepare_removes_its_link_and_deleted_directories_come_back() {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 1 << 20, 95);
    let server = SourceServer::start(&src).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let n = node();
    // The symlink cannot be published (a directory is in the way).
    std::fs::create_dir_all(env.link_dir().join(&n).join("x")).unwrap();
    let ev = broker
        .call(&env.host, prepare_cmd(&n, &server.url("a.img")))
        .await;
    assert_eq!(ev["status"], "error", "{ev}");
    assert!(
        !env.images_dir().join(&n).join("disk").exists(),
        "the failed prepare left the node's link"
    );
    // Everything deleted under the running worker: recreated when needed.
    for d in ["httpboot", "master_images", "images"] {
        std::fs::remove_dir_all(env.root().join(d)).unwrap();
    }
    let m = node();
    let ev = broker
        .call(&env.host, prepare_cmd(&m, &server.url("a.img")))
        .await;
    assert_eq!(ev["status"], "success", "{ev}");
    let (status, body) = get(ev["image_url"].as_str().unwrap()).await;
    assert_eq!(
        (status, body),
        (200, std::fs::read(src.join("a.img")).unwrap())
    );
    assert_lock_files_guard_something(&env);
}

/// A sparse file of `len` bytes holding `byte` in each `(offset, len)`.
fn sparse_file(path: &std::path::Path, len: u64, data: &[(u64, usize)], byte: u8) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::create(path).unwrap();
    for &(at, n) in data {
        file.write_all_at(&vec![byte; n], at).unwrap();
    }
    file.set_len(len).unwrap();
}

/// Node directories on another file system than the masters: the node's
/// `disk` is a copy (a hard link cannot cross), made under a temporary name
/// for a first image and for a replacement alike, with the served bytes;
/// the copy of a sparse master has its holes (it allocates what the master
/// does, not the virtual size), a repeated prepare of the node recognises
/// its copy instead of copying again, and a copy of a master since replaced
/// is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_images_on_another_file_system_are_copies() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::new("");
    let _mount = Tmpfs::mount(&env.images_dir(), "160m");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 4 << 20, 95);
    random_file(&src.join("b.img"), 3 << 20, 96);
    let server = SourceServer::start(&src).await;
    let n = node();
    let disk = env.images_dir().join(&n).join("disk");
    for img in ["a.img", "b.img"] {
        let (ok, ev) = env.prepare(&n, &server.url(img), &[]).await;
        assert!(ok, "{ev}");
        served(&src.join(img)).context(img).check(&ev);
        assert_eq!(
            std::fs::read(&disk).unwrap(),
            std::fs::read(src.join(img)).unwrap()
        );
        assert_eq!(std::fs::metadata(&disk).unwrap().nlink(), 1, "a copy");
        assert_eq!(
            std::fs::read_link(env.link_dir().join(&n)).unwrap(),
            disk,
            "published"
        );
        let node_dir: Vec<String> = std::fs::read_dir(env.images_dir().join(&n))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(node_dir, ["disk"], "no temporary left beside the copy");
    }
    assert!(env.temporaries().is_empty());

    let c = src.join("c.img");
    let len = 96u64 << 20;
    let data = [(0, 1 << 20), (50 << 20, 1 << 20), (len - 4096, 4096)];
    sparse_file(&c, len, &data, 0x11);
    let (ok, ev) = env.prepare(&n, &server.url("c.img"), &[]).await;
    assert!(ok, "{ev}");
    assert!(std::fs::read(&disk).unwrap() == std::fs::read(&c).unwrap());
    let master = env
        .masters()
        .iter()
        .map(|m| std::fs::metadata(env.master_dir().join(m)).unwrap())
        .find(|m| m.len() == len)
        .expect("the sparse image's master");
    let copy = std::fs::metadata(&disk).unwrap();
    let (copy_bytes, master_bytes) = (copy.blocks() * 512, master.blocks() * 512);
    assert!(
        copy_bytes <= master_bytes + (1 << 20) && copy_bytes < 8 << 20,
        "the copy allocates {copy_bytes} bytes, its master {master_bytes}, of {len}"
    );
    let (ok, again) = env.prepare(&n, &server.url("c.img"), &[]).await;
    assert!(ok, "{again}");
    assert_eq!(again["cache"], "hit");
    assert_eq!(
        std::fs::metadata(&disk).unwrap().ino(),
        copy.ino(),
        "a repeated prepare keeps the node's copy"
    );

    // The source changes: another node's prepare makes a new master, and
    // the node's copy of the old one is not taken for it.
    sparse_file(&c, len, &data, 0x22);
    let later = std::time::SystemTime::now() + Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&c)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let (ok, fresh) = env.prepare(&node(), &server.url("c.img"), &[]).await;
    assert!(ok, "{fresh}");
    assert_eq!(fresh["cache"], "miss");
    let (ok, ev) = env.prepare(&n, &server.url("c.img"), &[]).await;
    assert!(ok, "{ev}");
    assert_served(&ev, &c);
    assert!(std::fs::read(&disk).unwrap() == std::fs::read(&c).unwrap());
    assert!(env.temporaries().is_empty());
}
