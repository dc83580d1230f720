//! The image server faces every node on the provisioning network: clients
//! that hold connections open with half a header, resume downloads with old
//! validators, send odd `Range` headers or abort downloads; and the process
//! itself outlives an in-place upgrade of its binary.

use crate::common;

use common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Starts `serve` from `program` with `args` (`--set ...`), run through
/// `sh -c "<shell>; exec ..."`, with stderr as given; waits until ready.
async fn serve_from(
    env: &Env,
    program: &Path,
    shell: &str,
    args: &[&str],
    stderr: Stdio,
) -> Worker {
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(format!("{shell}; exec \"$0\" \"$@\""))
        .arg(program)
        .arg("--config")
        .arg(&env.config)
        .args(args)
        .arg("serve")
        .env_remove("IRONIC_IMAGE_WORKER_CONFIG")
        .env_remove("NO_COLOR")
        .env("RUST_LOG", "info,lapin=error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .kill_on_drop(true);
    let mut worker = Worker {
        child: cmd.spawn().unwrap(),
        http_port: env.http_port,
        metrics_port: env.metrics_port,
    };
    worker.wait_healthy().await;
    worker
}

/// A sample of `/metrics` (0 when the series does not exist yet).
async fn sample(worker: &Worker, line_prefix: &str) -> f64 {
    metric(&worker.metrics_text().await, line_prefix).unwrap_or(0.0)
}

/// Prepares `node` from the file `name` of the allowed directory over the
/// broker; returns the image URL.
async fn prepare_file(env: &Env, broker: &Broker, node: &str, name: &str) -> String {
    let source = format!("file://{}", env.root().join("allowed").join(name).display());
    let done = broker.call(&env.host, prepare_cmd(node, &source)).await;
    assert_eq!(done["status"], "success", "{done}");
    done["image_url"].as_str().unwrap().to_string()
}

/// A connection that sent the start of a request header and nothing more.
async fn partial_header(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(b"GET /agent_images/x HTTP/1.1\r\nHost: slow\r\n")
        .await
        .unwrap();
    s
}

/// Whether the server closed `s` (EOF or reset) within `within`.
async fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 256];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// More half-sent headers than the process has file descriptors: the
/// server keeps a bounded number (closing the oldest waiting ones), image
/// downloads, `/readyz` and prepares keep working, the metrics listener is
/// bounded the same way, and the stale connections are closed after the
/// header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_headers_starve_nothing() {
    // `prefetch` sizes the descriptors kept for the pipeline: with 512
    // descriptors, 256 + 16*4 + 64 + 64 are kept and the cap is 64.
    let env = Env::new("[amqp]\nprefetch = 4\n");
    random_file(&env.root().join("allowed/a.img"), 1 << 20, 141);
    random_file(&env.root().join("allowed/b.img"), (1 << 20) + 3, 142);
    let timeouts = [
        "--set",
        "http.header_timeout=10",
        "--set",
        "http.idle_timeout=10",
    ];
    let worker = serve_from(
        &env,
        Path::new(BIN),
        "ulimit -n 512",
        &timeouts,
        Stdio::inherit(),
    )
    .await;
    let broker = Broker::connect().await;
    let url_a = prepare_file(&env, &broker, &node(), "a.img").await;

    let mut slow = Vec::new();
    for _ in 0..700 {
        slow.push(partial_header(env.http_port).await);
    }
    let mut slow_ops = Vec::new();
    for _ in 0..200 {
        slow_ops.push(partial_header(env.metrics_port).await);
    }

    // Before the slow connections time out: nothing waits behind them.
    let (status, body) = not_starved(get(&url_a)).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        std::fs::read(env.root().join("allowed/a.img")).unwrap()
    );
    assert_eq!(
        not_starved(get(&worker.metrics_url("/readyz"))).await.0,
        200
    );
    assert_eq!(
        not_starved(get(&worker.metrics_url("/healthz"))).await.0,
        200
    );
    let url_b = not_starved(prepare_file(&env, &broker, &node(), "b.img")).await;
    let (status, body) = not_starved(get(&url_b)).await;
    assert_eq!(status, 200);
    assert_eq!(body.len(), (1 << 20) + 3);

    let text = worker.metrics_text().await;
    let open = metric(&text, "ironic_image_worker_http_connections_open").unwrap();
    assert!(open <= 64.0, "{open} connections kept open");
    let evicted = metric(
        &text,
        "ironic_image_worker_http_connections_dropped_total{reason=\"evicted\"}",
    )
    .unwrap_or(0.0);
    let timed_out = metric(
        &text,
        "ironic_image_worker_http_connections_dropped_total{reason=\"header_timeout\"}",
    )
    .unwrap_or(0.0);
    assert!(
        evicted > 0.0 && evicted + timed_out >= 700.0 - 64.0,
        "{evicted} evicted, {timed_out} timed out"
    );

    // Those still open are closed by the header timeout; every one of
    // them is closed by the server, none stays.
    for s in slow.iter_mut().chain(slow_ops.iter_mut()) {
        assert!(
            closed_by_server(s, Duration::from_secs(40)).await,
            "a partial header stayed open"
        );
    }
    let text = worker
        .wait_metrics("connections closed", |t| {
            metric(t, "ironic_image_worker_http_connections_open") == Some(0.0)
        })
        .await;
    let timed_out = metric(
        &text,
        "ironic_image_worker_http_connections_dropped_total{reason=\"header_timeout\"}",
    )
    .unwrap_or(0.0);
    assert!(timed_out >= 1.0, "header timeouts counted:\n{text}");
    assert_eq!(get(&url_a).await.0, 200);
}

/// `fut`, which must not wait for the slow clients' timeouts.
async fn not_starved<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(8), fut)
        .await
        .expect("answered before the slow clients time out")
}

/// Sends a GET with `headers` and returns (status, headers, body).
async fn fetch(url: &str, headers: &[(&str, &str)]) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
    let mut req = reqwest::Client::new().get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let h = resp.headers().clone();
    (status, h, resp.bytes().await.unwrap().to_vec())
}

/// A download resumed with `If-Range` after the node was prepared again
/// with another image gets the whole new image, never a part of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_range_with_an_old_validator_gets_the_whole_new_image() {
    let env = Env::new("");
    random_file(&env.root().join("allowed/a.img"), 1 << 20, 61);
    let a = std::fs::read(env.root().join("allowed/a.img")).unwrap();
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    let url = prepare_file(&env, &broker, &node, "a.img").await;
    let (status, h, body) = fetch(&url, &[]).await;
    assert_eq!((status, body.len()), (200, a.len()));
    let etag = h["etag"].to_str().unwrap().to_string();
    let modified = h["last-modified"].to_str().unwrap().to_string();
    assert!(etag.starts_with('"'), "a strong ETag: {etag}");
    let (status, _, part) = fetch(&url, &[("Range", "bytes=100-199"), ("If-Range", &etag)]).await;
    assert_eq!((status, &part[..]), (206, &a[100..200]));

    // Image B is written in a later second than A's Last-Modified.
    let a_time = httpdate::parse_http_date(&modified).unwrap();
    while std::time::SystemTime::now() < a_time + Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    random_file(&env.root().join("allowed/b.img"), (1 << 20) + 5, 62);
    let b = std::fs::read(env.root().join("allowed/b.img")).unwrap();
    assert_eq!(prepare_file(&env, &broker, &node, "b.img").await, url);

    for old in [etag.as_str(), modified.as_str()] {
        let (status, _, body) = fetch(&url, &[("Range", "bytes=100-199"), ("If-Range", old)]).await;
        assert_eq!(status, 200, "If-Range {old}");
        assert!(body == b, "If-Range {old}: the whole new image");
    }
    let (_, h, _) = fetch(&url, &[]).await;
    let etag_b = h["etag"].to_str().unwrap().to_string();
    let modified_b = h["last-modified"].to_str().unwrap().to_string();
    assert_ne!(etag_b, etag);
    for current in [etag_b.as_str(), modified_b.as_str()] {
        let (status, _, part) =
            fetch(&url, &[("Range", "bytes=100-199"), ("If-Range", current)]).await;
        assert_eq!(
            (status, &part[..]),
            (206, &b[100..200]),
            "If-Range {current}"
        );
    }
    let weak = format!("W/{etag_b}");
    let (status, _, body) = fetch(&url, &[("Range", "bytes=100-199"), ("If-Range", &weak)]).await;
    assert_eq!(
        (status, body.len()),
        (200, b.len()),
        "a weak ETag never matches"
    );
    drop(worker);
}

/// `Range` headers nginx would ignore get the whole file; several ranges
/// get the whole file; 416 only for byte ranges beyond the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_ranges_get_what_nginx_gives() {
    let env = Env::new("");
    random_file(&env.root().join("allowed/a.img"), 100_000, 71);
    let a = std::fs::read(env.root().join("allowed/a.img")).unwrap();
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let url = prepare_file(&env, &broker, &node(), "a.img").await;
    for whole in [
        "items=0-5",
        "bytes=0-1,5-6",
        "bytes=0-10, 200000-",
        "bytes=5-2",
        "bytes=abc",
        "bytes=",
    ] {
        let (status, h, body) = fetch(&url, &[("Range", whole)]).await;
        assert_eq!(status, 200, "Range: {whole}");
        assert!(body == a, "Range: {whole}: the whole file");
        assert!(h.get("content-range").is_none());
    }
    for (range, from, to) in [
        ("bytes=10-19", 10, 20),
        ("bytes=99990-", 99990, 100_000),
        ("bytes=-5", 99995, 100_000),
        ("bytes=99999-200000", 99999, 100_000),
    ] {
        let (status, h, body) = fetch(&url, &[("Range", range)]).await;
        assert_eq!((status, &body[..]), (206, &a[from..to]), "Range: {range}");
        assert_eq!(
            h["content-range"].to_str().unwrap(),
            format!("bytes {from}-{}/100000", to - 1)
        );
    }
    for beyond in [
        "bytes=100000-",
        "bytes=200000-300000",
        "bytes=-0",
        "bytes=100000-100001,200000-",
    ] {
        let (status, h, _) = fetch(&url, &[("Range", beyond)]).await;
        assert_eq!(status, 416, "Range: {beyond}");
        assert_eq!(h["content-range"].to_str().unwrap(), "bytes */100000");
    }
}

/// `http_response_bytes_total` counts the bytes sent: nothing for HEAD,
/// the part sent of an aborted download, the whole of a full one; a client
/// that stops reading is closed after the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_bytes_count_what_was_sent() {
    let env = Env::new("");
    let size: usize = 64 << 20;
    random_file(&env.root().join("allowed/big.img"), size, 81);
    let timeouts = [
        "--set",
        "http.header_timeout=3",
        "--set",
        "http.idle_timeout=3",
    ];
    let worker = env.serve_with(&timeouts, &[]).await;
    let broker = Broker::connect().await;
    let url = prepare_file(&env, &broker, &node(), "big.img").await;
    let bytes_200 = "ironic_image_worker_http_response_bytes_total{status=\"200\"}";

    let head = reqwest::Client::new().head(&url).send().await.unwrap();
    assert_eq!(head.status(), 200);
    assert_eq!(head.headers()["content-length"], size.to_string().as_str());
    assert_eq!(sample(&worker, bytes_200).await, 0.0, "HEAD sends no body");

    // An aborted download: 1 MiB read, then a reset.
    let path = url.split_once(&format!(":{}", env.http_port)).unwrap().1;
    let mut s = TcpStream::connect(("127.0.0.1", env.http_port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut got = vec![0u8; 1 << 20];
    s.read_exact(&mut got).await.unwrap();
    s.set_zero_linger().unwrap();
    drop(s);
    worker
        .wait_metrics("aborted download finished", |t| {
            metric(t, "ironic_image_worker_http_connections_open") == Some(0.0)
        })
        .await;
    let aborted = sample(&worker, bytes_200).await;
    assert!(
        aborted >= (1 << 19) as f64 && aborted < (size / 2) as f64,
        "an aborted download of 1 MiB counted {aborted} bytes"
    );

    // A full download counts exactly the file.
    let (status, body) = get(&url).await;
    assert_eq!((status, body.len()), (200, size));
    let full = sample(&worker, bytes_200).await;
    assert_eq!(full - aborted, size as f64);

    // A client that stops reading: closed after the idle timeout.
    let mut s = TcpStream::connect(("127.0.0.1", env.http_port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
        .await
        .unwrap();
    worker
        .wait_metrics("idle timeout", |t| {
            metric(
                t,
                "ironic_image_worker_http_connections_dropped_total{reason=\"idle_timeout\"}",
            ) == Some(1.0)
        })
        .await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut rest)).await;
    assert!(rest.len() < size, "the stalled download was cut");
}

/// Replacing the binary in place (a new file renamed over it, or
/// `install`) does not break conversions of the running worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversions_survive_replacing_the_binary() {
    let env = Env::new("");
    let bin_dir = env.root().join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let program = bin_dir.join("ironic-image-worker");
    std::fs::copy(BIN, &program).unwrap();
    let worker = serve_from(&env, &program, "true", &[], Stdio::inherit()).await;
    let broker = Broker::connect().await;

    let replacements: [&dyn Fn(); 2] = [
        &|| {
            let new = bin_dir.join("ironic-image-worker.new");
            std::fs::copy(BIN, &new).unwrap();
            std::fs::rename(&new, &program).unwrap();
        },
        &|| {
            tool("install", &["-m", "0755", BIN, program.to_str().unwrap()]);
        },
    ];
    for (i, replace) in replacements.iter().enumerate() {
        replace();
        let raw = env.root().join(format!("d{i}.raw"));
        patchy_raw(&raw, 8 << 20, 90 + i as u64);
        let img = env.root().join(format!("allowed/d{i}.qcow2"));
        qcow2_from(&raw, &img, &[]);
        let reference = env.root().join(format!("ref{i}.raw"));
        reference_raw(&img, &reference);
        let node = node();
        let source = format!("file://{}", img.display());
        let done = broker.call(&env.host, prepare_cmd(&node, &source)).await;
        assert_eq!(done["status"], "success", "after replacement {i}: {done}");
        assert_eq!(done["image_disk_format"], "raw");
        served(&reference)
            .context(format_args!("after replacement {i}"))
            .check(&done);
    }
    drop(worker);
}

/// Logs to a pipe (a file, the journal) carry no ANSI colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_off_a_terminal_have_no_colours() {
    let env = Env::new("");
    let mut worker = serve_from(&env, Path::new(BIN), "true", &[], Stdio::piped()).await;
    let mut stderr = worker.child.stderr.take().unwrap();
    if let Some(pid) = worker.child.id() {
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    let mut out = Vec::new();
    let read_all = tokio::io::AsyncReadExt::read_to_end(&mut stderr, &mut out);
    let (read, exit) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(read_all, worker.child.wait())
    })
    .await
    .expect("worker stopped");
    read.unwrap();
    exit.unwrap();
    let log = String::from_utf8_lossy(&out);
    assert!(log.contains("ironic-image-worker serving"), "{log}");
    assert!(!out.contains(&0x1b), "ANSI escapes in:\n{log}");
}

/// Runs a swap (`renameat2(RENAME_EXCHANGE)`) in a loop on a thread until
/// [`Swapper::stop`] (or the end of the test).
struct Swapper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Swapper {
    fn start(swap: impl Fn() + Send + 'static) -> Swapper {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut n = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                swap();
                n += 1;
            }
            n
        });
        Swapper {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the thread; returns how many swaps it made.
    fn stop(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Exchanges `a` and `b` atomically (errors ignored: the test's directory
/// may be going away).
fn exchange(a: &Path, b: &Path) {
    let _ = rustix::fs::renameat_with(
        rustix::fs::CWD,
        a,
        rustix::fs::CWD,
        b,
        rustix::fs::RenameFlags::EXCHANGE,
    );
}

/// Whoever can write in `http_root` (it is shared with Ironic) swaps a
/// directory with a symlink to a directory outside every served one while
/// a client GETs a file through it: the file outside is never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_symlink_never_leads_outside_http_root() {
    let env = Env::new("");
    let _worker = env.serve().await;
    let root = env.root().join("httpboot");
    let outside = env.root().join("outside");
    std::fs::create_dir_all(root.join("d")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(root.join("d/f"), b"public file").unwrap();
    std::fs::write(outside.join("f"), b"SECRET outside http_root").unwrap();
    std::os::unix::fs::symlink(&outside, root.join("s")).unwrap();
    let url = format!("http://127.0.0.1:{}/d/f", env.http_port);
    assert_eq!(get(&url).await, (200, b"public file".to_vec()));
    let direct = format!("http://127.0.0.1:{}/s/f", env.http_port);
    assert_eq!(get(&direct).await.0, 403);

    let (d, s) = (root.join("d"), root.join("s"));
    let swapper = Swapper::start(move || exchange(&d, &s));
    let client = reqwest::Client::new();
    let mut statuses = std::collections::BTreeMap::new();
    for _ in 0..2000 {
        let r = client.get(&url).send().await.unwrap();
        let status = r.status().as_u16();
        let body = r.bytes().await.unwrap();
        assert!(
            !body.starts_with(b"SECRET"),
            "served a file outside http_root after {statuses:?}"
        );
        *statuses.entry(status).or_insert(0) += 1;
    }
    let swaps = swapper.stop();
    assert!(swaps > 100, "only {swaps} swaps");
    assert!(statuses.contains_key(&200), "{statuses:?}");
}

/// A download resumed with `If-Range` and the old ETag while the node's
/// `disk` is replaced again and again (as a new prepare renames a new hard
/// link into place): a 206 is only ever a part of the old image, and every
/// answer's body is the image its ETag names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_range_never_mixes_images_while_the_disk_is_replaced() {
    let env = Env::new("");
    random_file(&env.root().join("allowed/a.img"), 256 << 10, 63);
    let a = std::fs::read(env.root().join("allowed/a.img")).unwrap();
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    let url = prepare_file(&env, &broker, &node, "a.img").await;
    let (status, h, _) = fetch(&url, &[]).await;
    assert_eq!(status, 200);
    let etag_a = h["etag"].to_str().unwrap().to_string();

    // B: another image, another size and time, in the node's directory.
    let disk = env.images_dir().join(&node).join("disk");
    let b_path = env.images_dir().join(&node).join("b");
    random_file(&b_path, (256 << 10) + 7, 64);
    let b = std::fs::read(&b_path).unwrap();
    let f = std::fs::File::options().write(true).open(&b_path).unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(3600))
        .unwrap();
    drop(f);
    let (_, _, whole) = fetch(&url, &[]).await;
    assert!(whole == a);
    let swapper = Swapper::start(move || exchange(&disk, &b_path));

    let client = reqwest::Client::new();
    let (mut partial, mut full) = (0, 0);
    for _ in 0..2000 {
        let r = client
            .get(&url)
            .header("Range", "bytes=100-199")
            .header("If-Range", &etag_a)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let etag = r.headers()["etag"].to_str().unwrap().to_string();
        let body = r.bytes().await.unwrap();
        match status {
            206 => {
                assert!(body[..] == a[100..200], "206 with bytes of another image");
                assert_eq!(etag, etag_a);
                partial += 1;
            }
            200 => {
                assert!(body == b, "200: the whole new image");
                assert_ne!(etag, etag_a);
                full += 1;
            }
            other => panic!("status {other}"),
        }
    }
    swapper.stop();
    assert!(partial > 0 && full > 0, "{partial} partial, {full} full");
}

/// Hidden names (the worker's `.meta`, `.locks`, `.tmp`, temporaries, any
/// dot-file) and directories are never served, even where a symlink leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_files_and_directories_are_never_served() {
    let env = Env::new("");
    let _worker = env.serve().await;
    let root = env.root().join("httpboot");
    std::fs::create_dir_all(root.join(".hidden")).unwrap();
    std::fs::write(root.join(".hidden/f"), b"hidden").unwrap();
    std::fs::write(root.join(".f"), b"hidden").unwrap();
    std::fs::write(root.join("visible"), b"visible").unwrap();
    let node_dir = env.images_dir().join("n");
    std::fs::create_dir_all(node_dir.join(".tmp")).unwrap();
    std::fs::write(node_dir.join(".tmp/x"), b"temporary").unwrap();
    std::os::unix::fs::symlink(node_dir.join(".tmp/x"), root.join("to-temp")).unwrap();
    std::os::unix::fs::symlink(env.master_dir().join(".meta"), root.join("to-meta")).unwrap();
    let at = |p: &str| format!("http://127.0.0.1:{}{p}", env.http_port);
    assert_eq!(get(&at("/visible")).await, (200, b"visible".to_vec()));
    for hidden in ["/.hidden/f", "/.f", "/%2Ef", "/agent_images/.tmp"] {
        assert_eq!(get(&at(hidden)).await.0, 404, "{hidden}");
    }
    for refused in ["/to-temp", "/to-meta", "/agent_images", "/agent_images/"] {
        let (status, body) = get(&at(refused)).await;
        assert!(matches!(status, 403 | 404), "{refused}: {status}");
        assert!(
            body.is_empty() || !body.starts_with(b"temporary"),
            "{refused}"
        );
    }
    assert_eq!(get(&at("/agent_images")).await.0, 403);
}

/// A master directory or `images_path` inside `http_root` would publish
/// masters, sidecars and temporaries: refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_directories_inside_http_root_are_refused() {
    let env = Env::new("");
    let root = env.root().join("httpboot");
    for (option, dir) in [
        ("pxe.instance_master_path", root.join("masters")),
        ("pxe.images_path", root.join("images")),
        ("pxe.images_path", root.clone()),
    ] {
        let set = format!("{option}={}", dir.display());
        let child = tokio::process::Command::new(BIN)
            .arg("--config")
            .arg(&env.config)
            .args(["--set", &set, "serve"])
            .env_remove("IRONIC_IMAGE_WORKER_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("{set}: the worker started"))
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set}: started");
        assert!(err.contains("inside [deploy]http_root"), "{set}: {err}");
    }
}

/// GETs `path` on a fresh connection and returns the status line, or what
/// went wrong (a reset, or a close before any answer).
async fn status_line(port: u16, path: &str) -> Result<String, String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    // A write refused by a reset still leaves the answer to read, if any.
    let _ = s
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut got)).await;
    let line = String::from_utf8_lossy(&got)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    match read {
        _ if line.starts_with("HTTP/1.1 ") => Ok(line),
        Err(_) => Err("no answer within 60 s".into()),
        Ok(Err(e)) => Err(format!("{e} after {} bytes", got.len())),
        Ok(Ok(n)) => Err(format!("closed after {n} bytes without a status line")),
    }
}

/// A flood of bare connections (connected, nothing sent) beside GETs, with
/// a small cap: the bare ones make room, a GET is never closed unanswered;
/// every GET gets a status line (200, or 503 when it could not be kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bare_connections_never_cut_a_request() {
    let env = Env::new("");
    let worker = env
        .serve_with(&["--set", "http.max_connections=8"], &[])
        .await;
    random_file(&env.root().join("httpboot/small"), 20_000, 65);
    let port = env.http_port;
    let mut bare = Vec::new();
    let mut gets = tokio::task::JoinSet::new();
    for i in 0..400 {
        bare.push(TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        if i % 2 == 0 {
            gets.spawn(status_line(port, "/small"));
        }
    }
    let mut lines = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    while let Some(r) = gets.join_next().await {
        match r.unwrap() {
            Ok(line) => *lines.entry(line).or_insert(0) += 1,
            Err(e) => failures.push(e),
        }
    }
    assert!(
        failures.is_empty(),
        "{} GETs without a status line ({failures:?}); answered: {lines:?}",
        failures.len()
    );
    assert!(lines.contains_key("HTTP/1.1 200 OK"), "{lines:?}");
    let evicted = sample(
        &worker,
        "ironic_image_worker_http_connections_dropped_total{reason=\"evicted\"}",
    )
    .await;
    assert!(evicted > 0.0, "the bare connections made room");
    drop(bare);
}
