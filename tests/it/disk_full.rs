//! Running out of disk space on a real (tmpfs) file system: clear errors,
//! eviction before giving up, no partial file, other images intact, and the
//! worker keeps serving. Needs root to mount the file system (CI runs as root).

use crate::common;

use common::*;
use std::time::Duration;

/// A worker of `env` whose directories are all on the file system `small`.
async fn serve_on(env: &Env, small: &Tmpfs) -> Worker {
    let flags = small.worker_flags();
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    env.serve_with(&args, &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_fails_cleanly_evicts_first_and_keeps_serving() {
    let env = Env::new("");
    let small = env.root().join("small");
    let mount = Tmpfs::mount(&small, "20m");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 8 << 20, 71);
    random_file(&src.join("b.img"), 14 << 20, 72);
    random_file(&src.join("c.img"), 16 << 20, 73);
    let server = SourceServer::start(&src).await;
    let faults = FaultServer::start(&src, 1 << 30).await;
    let worker = serve_on(&env, &mount).await;
    let broker = Broker::connect().await;
    let master_dir = small.join("master");
    let temps = || {
        std::fs::read_dir(master_dir.join(".tmp"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .count()
    };

    let (na, nb) = (node(), node());
    let a = broker
        .call(&env.host, prepare_cmd(&na, &server.url("a.img")))
        .await;
    assert_eq!(a["status"], "success", "{a}");

    // B does not fit next to A (linked, so not evictable): refused up front
    // from Content-Length, nothing written.
    let b = broker
        .call(&env.host, prepare_cmd(&nb, &server.url("b.img")))
        .await;
    assert_eq!(b["error"]["code"], "insufficient_disk_space", "{b}");
    assert_eq!(temps(), 0);

    // Without a Content-Length the download runs into ENOSPC: same answer,
    // no partial file, A intact.
    let c = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &faults.url("nolength", "c.img")),
        )
        .await;
    assert_eq!(c["error"]["code"], "insufficient_disk_space", "{c}");
    assert_eq!(temps(), 0);
    let (status, body) = get(a["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        std::fs::read(src.join("a.img")).unwrap(),
        "other images intact"
    );

    // Once A's node is torn down, A is evicted to make room for B.
    let done = broker
        .call(
            &env.host,
            serde_json::json!({"action": "cleanup", "node_uuid": na}),
        )
        .await;
    assert_eq!(done["status"], "success");
    let b = broker
        .call(&env.host, prepare_cmd(&nb, &server.url("b.img")))
        .await;
    assert_served(&b, &src.join("b.img"));
    let metrics = worker.metrics_text().await;
    assert!(
        metric(&metrics, "ironic_image_worker_cache_evictions_total") >= Some(1.0),
        "an eviction was counted"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(worker);
}

/// nginx with `gzip_static always` on `dir`: every `NAME` is answered with
/// `NAME.gz`, `Content-Encoding: gzip` and the compressed length. One
/// process (`master_process off`), so killing it leaves no worker behind.
/// Returns the server (killed when dropped) and its base URL.
fn nginx_gzip_static(dir: &std::path::Path, conf_dir: &std::path::Path) -> (KillOnDrop, String) {
    let port = free_port();
    let d = conf_dir.display();
    let conf = conf_dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\nevents {{}}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fastcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
             server {{\n    listen 127.0.0.1:{port};\n    root {};\n    gzip_static always;\n  }}\n}}\n",
            dir.display()
        ),
    )
    .unwrap();
    let child = KillOnDrop(
        std::process::Command::new("/usr/sbin/nginx")
            .args(["-c", conf.to_str().unwrap()])
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nginx (apt-get install nginx)"),
    );
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return (child, format!("http://127.0.0.1:{port}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "nginx did not start: {:?}",
        std::fs::read_to_string(conf_dir.join("error.log"))
    );
}

/// A child process killed when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A gzip bomb from a real web server: 1 GiB of one byte, about 1 MiB
/// compressed, answered `Content-Encoding: gzip` with the compressed
/// Content-Length. The decoded length is unknown, so the download is held,
/// like any body without a length, to the room made ahead of it: on a
/// 400 MiB file system it stops with `insufficient_disk_space` before the
/// file system is full, leaves nothing behind, and the worker goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_bomb_stops_at_the_room_made_and_leaves_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new("");
    let small = env.root().join("small");
    let mount = Tmpfs::mount(&small, "400m");
    let web = tempfile::tempdir().unwrap();
    std::fs::set_permissions(web.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bomb = web.path().join("bomb.img.gz");
    tool(
        "sh",
        &[
            "-c",
            &format!(
                "head -c 1G /dev/zero | tr '\\0' A | gzip -1 > {} && chmod 644 {0}",
                bomb.display()
            ),
        ],
    );
    let packed = std::fs::metadata(&bomb).unwrap().len();
    assert!(packed < 16 << 20, "{packed}");
    let (_nginx, base) = nginx_gzip_static(web.path(), env.root());
    // nginx answers it gzip-encoded, with the compressed length.
    let head = reqwest::Client::builder()
        .no_gzip()
        .build()
        .unwrap()
        .get(format!("{base}/bomb.img"))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    assert_eq!(head.headers()["content-encoding"], "gzip");
    assert_eq!(head.content_length(), Some(packed));
    drop(head);

    let worker = serve_on(&env, &mount).await;
    let broker = Broker::connect().await;
    let n = node();
    let done = broker
        .call(&env.host, prepare_cmd(&n, &format!("{base}/bomb.img")))
        .await;
    assert_valid_completion(&done);
    assert_eq!(done["error"]["code"], "insufficient_disk_space", "{done}");
    // Nothing left: no master, no temporary, no link; the file system is
    // empty again.
    let mut left = Vec::new();
    let mut stack = vec![small.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            } else {
                // The worker's own bookkeeping: the node's ledger, the
                // file marking which process owns the temporaries.
                let name = p.to_string_lossy();
                if !name.contains("/.ledger/") && !name.contains("/.owners/") {
                    left.push(p);
                }
            }
        }
    }
    assert!(left.is_empty(), "{left:?}");
    // ... and the space is back by the time the error is answered (the
    // failed attempt's file is closed, not only removed).
    let st = rustix::fs::statvfs(&small).unwrap();
    let free = st.f_bavail * st.f_frsize;
    assert!(free > 380 << 20, "{} MiB free", free >> 20);
    println!("bomb: {}", done["error"]["message"]);
    assert!(!small.join("httpboot/agent_images").join(&n).exists());

    // The worker goes on: a small image from the same server is served.
    random_file(&web.path().join("ok.img"), 1 << 20, 81);
    std::fs::set_permissions(
        web.path().join("ok.img"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    tool(
        "sh",
        &[
            "-c",
            &format!(
                "gzip -k {}/ok.img && chmod 644 {0}/ok.img.gz",
                web.path().display()
            ),
        ],
    );
    let ok = broker
        .call(&env.host, prepare_cmd(&node(), &format!("{base}/ok.img")))
        .await;
    assert_served(&ok, &web.path().join("ok.img"));
    drop(worker);
}

/// A zstd bomb: 1 GiB of one byte, about 33 KiB compressed, served as a
/// plain file (an http source of zstd bytes, which are decompressed as
/// Ironic does). The decompressed length is nobody's announcement, so it
/// is held to the same room rule as a download without one: on a 400 MiB
/// file system it stops with `insufficient_disk_space` while space is
/// left (never by running into ENOSPC), and leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_bomb_stops_at_the_room_made_like_gzip() {
    let env = Env::new("");
    let small = env.root().join("small");
    let mount = Tmpfs::mount(&small, "400m");
    let web = tempfile::tempdir().unwrap();
    let bomb = web.path().join("bomb.img.zst");
    tool(
        "sh",
        &[
            "-c",
            &format!(
                "head -c 1G /dev/zero | tr '\\0' A | zstd -q -3 -o {}",
                bomb.display()
            ),
        ],
    );
    let packed = std::fs::metadata(&bomb).unwrap().len();
    assert!(packed < 1 << 20, "{packed}");
    let server = SourceServer::start(web.path()).await;
    let worker = serve_on(&env, &mount).await;
    let broker = Broker::connect().await;
    // The lowest free space seen while the prepare runs.
    let watched = small.clone();
    let lowest = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    let (low, stop) = (
        lowest.clone(),
        std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
    );
    let stopped = stop.clone();
    let sampler = std::thread::spawn(move || {
        while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(st) = rustix::fs::statvfs(&watched) {
                low.fetch_min(
                    st.f_bavail * st.f_frsize,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    let done = broker
        .call(&env.host, prepare_cmd(&node(), &server.url("bomb.img.zst")))
        .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    assert_valid_completion(&done);
    assert_eq!(done["error"]["code"], "insufficient_disk_space", "{done}");
    let message = done["error"]["message"].as_str().unwrap();
    assert!(
        !message.contains("No space left"),
        "stopped by the room rule, not by a full file system: {message}"
    );
    let lowest = lowest.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        lowest >= 1 << 20,
        "the file system went down to {lowest} bytes free"
    );
    let st = rustix::fs::statvfs(&small).unwrap();
    assert!(st.f_bavail * st.f_frsize > 380 << 20, "the space is back");
    drop(worker);
}

/// A source of unknown length (no `Content-Length`) that never ends may
/// make room, by eviction, for no more than the largest image the
/// configuration admits (`[convert]max_virtual_size_gib`, here 1 GiB): on a
/// file system holding 2 GiB of unused masters it is refused with
/// `insufficient_disk_space` with most of them still cached, and what it
/// evicted is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_of_unknown_length_evicts_no_more_than_the_largest_image() {
    let env = Env::new("[convert]\nmax_virtual_size_gib = 1\n");
    let small = env.root().join("small");
    let mount = Tmpfs::mount(&small, "2600m");
    let faults = FaultServer::start(&env.root().join("src"), 1 << 30).await;
    let worker = serve_on(&env, &mount).await;
    // Eight unused masters of 256 MiB (allocated, as written ones are).
    let master_dir = small.join("master");
    let old: Vec<String> = (0..8).map(|i| format!("old{i}")).collect();
    for name in &old {
        tool(
            "fallocate",
            &["-l", "256MiB", master_dir.join(name).to_str().unwrap()],
        );
    }
    let broker = Broker::connect().await;
    let done = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &faults.url("endless", "image")),
        )
        .await;
    assert_eq!(done["error"]["code"], "insufficient_disk_space", "{done}");
    let kept = old.iter().filter(|n| master_dir.join(n).exists()).count();
    let metrics = worker.metrics_text().await;
    let evicted = metric(
        &metrics,
        "ironic_image_worker_cache_unannounced_evicted_bytes_total",
    );
    eprintln!("kept {kept} of 8 masters; evicted for it: {evicted:?}");
    // At most 1 GiB and one step of room (256 MiB) more: at least 3 kept.
    assert!(kept >= 3, "the cache was emptied: {kept} of 8 masters kept");
    let evicted = evicted.expect("the bytes evicted for it are counted");
    assert_eq!(evicted as u64, (8 - kept as u64) * (256 << 20), "{metrics}");
    let temporaries = std::fs::read_dir(master_dir.join(".tmp"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .count();
    assert_eq!(temporaries, 0, "no partial file");
    drop(worker);
}
