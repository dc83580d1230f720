//! Test support: a real HTTP source server that counts requests, a worker
//! environment in a temporary directory, images made with `qemu-img`, and
//! validation of every completion event against the JSON schema.
#![allow(dead_code)]

pub mod agent;
pub mod ca;
pub mod netns;
pub mod oci_image;
pub mod plugin;
pub mod rabbit;
pub mod served;

#[allow(unused_imports)] // tests/broker_restart.rs includes this module too
pub use served::{Served, assert_served, fetch_served, served};

use axum::Router;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::ServiceExt;

/// The worker binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_ironic-image-worker");

/// A local HTTP server serving a directory, counting requests per
/// `(method, path)`.
pub struct SourceServer {
    pub addr: SocketAddr,
    pub dir: PathBuf,
    counts: Arc<Mutex<HashMap<(String, String), usize>>>,
}

impl SourceServer {
    pub async fn start(dir: &Path) -> SourceServer {
        let counts: Arc<Mutex<HashMap<(String, String), usize>>> = Arc::default();
        let state = (dir.to_path_buf(), counts.clone());
        let app = Router::new().fallback(serve_counted).with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        SourceServer {
            addr,
            dir: dir.to_path_buf(),
            counts,
        }
    }

    pub fn url(&self, name: &str) -> String {
        format!("http://{}/{name}", self.addr)
    }

    /// Requests seen for `path` with `method`.
    pub fn count(&self, method: &str, name: &str) -> usize {
        let key = (method.to_string(), format!("/{name}"));
        *self.counts.lock().unwrap().get(&key).unwrap_or(&0)
    }
}

type CountState = (PathBuf, Arc<Mutex<HashMap<(String, String), usize>>>);

async fn serve_counted(State((dir, counts)): State<CountState>, req: Request) -> Response {
    let key = (req.method().to_string(), req.uri().path().to_string());
    *counts.lock().unwrap().entry(key).or_default() += 1;
    match tower_http::services::ServeDir::new(dir).oneshot(req).await {
        Ok(r) => r.into_response(),
        Err(never) => match never {},
    }
}

/// A worker configuration rooted in a temporary directory.
pub struct Env {
    pub tmp: tempfile::TempDir,
    pub config: PathBuf,
    pub http_port: u16,
    pub metrics_port: u16,
    pub host: String,
}

/// A TCP port on loopback reserved for this test process until it exits.
///
/// The worker under test binds its own listeners, so the port cannot simply
/// be passed as an open socket. Instead it is taken below the kernel's
/// ephemeral range (so no `bind(0)` or outgoing connection is ever given it)
/// and reserved with a lock file that every test process honours; the lock
/// is released by the kernel when the process ends.
pub fn free_port() -> u16 {
    static HELD: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());
    let ephemeral_low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_low.max(10_100));
    let dir = std::env::temp_dir().join("ironic-image-worker-test-ports");
    std::fs::create_dir_all(&dir).unwrap();
    let span = u32::from(high - low);
    let start = uuid::Uuid::new_v4().as_u128() as u32 % span;
    for i in 0..span {
        let port = low + ((start + i) % span) as u16;
        let Ok(lock) = std::fs::File::create(dir.join(port.to_string())) else {
            continue;
        };
        // flock conflicts between open files even within one process, so
        // this also skips the ports this process holds already.
        if lock.try_lock().is_err() {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            HELD.lock().unwrap().push(lock);
            return port;
        }
    }
    panic!("no free port below {high}");
}

impl Env {
    /// Turns on compressed serving (`[http] gzip = static`, with `extra`
    /// lines in `[http]`), before the worker starts.
    pub fn gzip_static(&self, extra: &str) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        let text = text.replace("[http]\n", &format!("[http]\ngzip = \"static\"\n{extra}\n"));
        std::fs::write(&self.config, text).unwrap();
    }

    /// A new environment; `extra` is appended to the TOML file.
    pub fn new(extra: &str) -> Env {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for d in ["src", "allowed"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let http_port = free_port();
        let metrics_port = free_port();
        let host = format!("test-{}", uuid::Uuid::new_v4().simple());
        let config = root.join("worker.toml");
        let text = format!(
            r#"
[DEFAULT]
host = "{host}"

[deploy]
http_root = "{root}/httpboot"
http_url = "http://127.0.0.1:{http_port}"

[pxe]
instance_master_path = "{root}/master_images"
images_path = "{root}/images"

[conductor]
file_url_allowed_paths = "{root}/allowed"

[http]
listen = "127.0.0.1:{http_port}"

[metrics]
listen = "127.0.0.1:{metrics_port}"

[source]
retries = 2
connect_timeout = 2
read_timeout = 5
{extra}
"#,
            root = root.display()
        );
        std::fs::write(&config, text).unwrap();
        Env {
            tmp,
            config,
            http_port,
            metrics_port,
            host,
        }
    }

    pub fn root(&self) -> &Path {
        self.tmp.path()
    }

    pub fn master_dir(&self) -> PathBuf {
        self.root().join("master_images")
    }

    pub fn images_dir(&self) -> PathBuf {
        self.root().join("images")
    }

    pub fn link_dir(&self) -> PathBuf {
        self.root().join("httpboot/agent_images")
    }

    /// Runs the binary with this configuration and `args`.
    pub async fn run(&self, args: &[&str]) -> Output {
        self.run_with_umask(None, args).await
    }

    /// Runs the binary under `umask` (via sh) with `args`.
    pub async fn run_with_umask(&self, umask: Option<&str>, args: &[&str]) -> Output {
        let mut cmd = match umask {
            None => tokio::process::Command::new(BIN),
            Some(mask) => {
                let mut c = tokio::process::Command::new("sh");
                c.arg("-c")
                    .arg(format!("umask {mask}; exec \"$0\" \"$@\""))
                    .arg(BIN);
                c
            }
        };
        cmd.arg("--config").arg(&self.config).args(args);
        cmd.env_remove("IRONIC_IMAGE_WORKER_CONFIG");
        tokio::time::timeout(Duration::from_secs(120), cmd.output())
            .await
            .expect("worker command timed out")
            .unwrap()
    }

    /// Runs a one-shot command and returns its completion event (validated).
    pub async fn oneshot(&self, args: &[&str]) -> (bool, Value) {
        let out = self.run(args).await;
        completion_of(&out)
    }

    /// `prepare --node NODE --image-source SRC` plus `extra`.
    pub async fn prepare(&self, node: &str, source: &str, extra: &[&str]) -> (bool, Value) {
        let mut args = vec!["prepare", "--node", node, "--image-source", source];
        args.extend_from_slice(extra);
        self.oneshot(&args).await
    }

    /// Files in the master cache that are not sidecars, locks or hidden.
    pub fn masters(&self) -> Vec<String> {
        list_visible(&self.master_dir())
            .into_iter()
            .filter(|n| !n.ends_with(".meta.json"))
            .collect()
    }

    /// Every temporary in the master cache (`.tmp/`, and the earlier
    /// layout's `.tmp-*` next to the masters) and the symlink directory.
    pub fn temporaries(&self) -> Vec<String> {
        let mut found = Vec::new();
        for dir in [
            self.master_dir(),
            self.master_dir().join(".tmp"),
            self.link_dir(),
        ] {
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    let n = e.file_name().to_string_lossy().into_owned();
                    if n.starts_with(".tmp-") {
                        found.push(n);
                    }
                }
            }
        }
        found
    }

    /// Starts `serve` and waits until `/healthz` answers.
    pub async fn serve(&self) -> Worker {
        self.serve_with(&[], &[]).await
    }

    /// Starts `serve` with extra arguments and environment variables.
    pub async fn serve_with(&self, args: &[&str], envs: &[(&str, &str)]) -> Worker {
        let command = || {
            let mut cmd = self.command(args);
            for (k, v) in envs {
                cmd.env(k, v);
            }
            cmd
        };
        Worker::start(command, self.http_port, self.metrics_port).await
    }

    /// `serve` with this environment's configuration and `args` before it,
    /// its log on the test's stderr; not started.
    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.arg("--config")
            .arg(&self.config)
            .args(args)
            .arg("serve")
            .env_remove("IRONIC_IMAGE_WORKER_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .env("RUST_LOG", "warn,lapin=error")
            .kill_on_drop(true);
        cmd
    }
}

impl Drop for Env {
    /// Deletes this environment's queues (they are bound to Ironic's
    /// exchange and would collect notifications forever).
    fn drop(&mut self) {
        let host = self.host.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                use lapin::options::QueueDeleteOptions;
                let Ok(conn) = lapin::Connection::connect(AMQP_URL, Default::default()).await
                else {
                    return;
                };
                if let Ok(ch) = conn.create_channel().await {
                    for q in [
                        format!("ironic-image-worker.{host}"),
                        format!("ironic-image-worker.{host}.dead"),
                    ] {
                        let _ = ch
                            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                }
                let _ = conn.close(200, "bye".into()).await;
            });
        })
        .join();
    }
}

/// A running `serve` process.
pub struct Worker {
    pub child: tokio::process::Child,
    pub http_port: u16,
    pub metrics_port: u16,
}

impl Drop for Worker {
    /// Kills the worker and waits until it is gone, so that the next worker
    /// of the test (same ports, same directories) never finds them still
    /// held: `kill_on_drop` alone only sends the signal, and under load the
    /// process outlived the drop and the next `serve` failed to listen.
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Worker {
    /// Spawns `command` (a `serve` listening on `http_port` and
    /// `metrics_port`) and waits until it is ready.
    ///
    /// The ports are reserved among test processes only (see [`free_port`]):
    /// a process outside the tests (an Erlang CLI tool picking its
    /// distribution port, say) may hold one for a moment when the worker
    /// binds it. A worker that exits while another process listens on one of
    /// its ports is started again once the port is free, and the holder is
    /// printed; any other early exit fails the test.
    pub async fn start(
        command: impl Fn() -> tokio::process::Command,
        http_port: u16,
        metrics_port: u16,
    ) -> Worker {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let mut worker = Worker {
                child: command().spawn().unwrap(),
                http_port,
                metrics_port,
            };
            let Err(status) = worker.ready_or_exit().await else {
                return worker;
            };
            let held: Vec<u16> = [http_port, metrics_port]
                .into_iter()
                .filter(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_err())
                .collect();
            assert!(
                !held.is_empty() && tokio::time::Instant::now() < deadline,
                "worker exited before it was ready: {status}"
            );
            let holders = std::process::Command::new("ss")
                .args(["-Htlnp", "sport", "=", &format!(":{}", held[0])])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            eprintln!(
                "port {held:?} held by another process ({holders}); starting the worker again"
            );
            while tokio::time::Instant::now() < deadline
                && held
                    .iter()
                    .any(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_err())
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// Waits until `/readyz` answers 200, or the process exits (its status).
    async fn ready_or_exit(&mut self) -> Result<(), std::process::ExitStatus> {
        let url = format!("http://127.0.0.1:{}/readyz", self.metrics_port);
        for _ in 0..200 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(status);
            }
            if let Ok(r) = reqwest::get(&url).await
                && r.status().is_success()
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("worker did not become ready");
    }

    /// Waits until the worker is ready; fails the test if it exits first.
    pub async fn wait_healthy(&mut self) {
        if let Err(status) = self.ready_or_exit().await {
            panic!("worker exited before it was ready: {status}");
        }
    }

    pub fn image_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http_port)
    }

    pub fn metrics_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.metrics_port)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        if let Some(pid) = self.child.id()
            && let Some(pid) = rustix::process::Pid::from_raw(pid as i32)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("worker did not stop")
            .unwrap()
    }
}

pub fn list_visible(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Parses and schema-validates the completion printed by a one-shot command;
/// returns (exit success, event).
pub fn completion_of(out: &Output) -> (bool, Value) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| {
        panic!(
            "no completion on stdout; stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let event: Value = serde_json::from_str(line).expect("completion is JSON");
    assert_valid_completion(&event);
    let ok = out.status.success();
    assert_eq!(
        ok,
        event["status"] == "success",
        "exit status agrees with event: {event}"
    );
    (ok, event)
}

/// Validates `event` against `schemas/completion.v1.json`.
pub fn assert_valid_completion(event: &Value) {
    static SCHEMA: std::sync::OnceLock<jsonschema::Validator> = std::sync::OnceLock::new();
    let validator = SCHEMA.get_or_init(|| {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/completion.v1.json"),
        )
        .unwrap();
        jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap()
    });
    let errors: Vec<String> = validator
        .iter_errors(event)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "event {event} violates the schema: {errors:?}"
    );
}

/// Runs a reference tool and returns its stdout, panicking on failure.
pub fn tool(cmd: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The MD5 of a file (hex), by OpenSSL, a reference independent of the
/// worker's own hashing.
pub fn md5sum(path: &Path) -> String {
    openssl_digest("md5", path)
}

/// The SHA-256 of a file (hex), by OpenSSL.
pub fn sha256sum(path: &Path) -> String {
    openssl_digest("sha256", path)
}

/// The SHA-512 of a file (hex), by OpenSSL.
pub fn sha512sum(path: &Path) -> String {
    openssl_digest("sha512", path)
}

/// The `algo` digest of a file (hex), by `openssl dgst`: coreutils'
/// `sha256sum` takes six times its CPU here (no SHA instructions), and the
/// tests hash gigabytes of reference images. A file with holes is fed
/// through a pipe with its holes as zeros from memory: the first read of a
/// hole makes the kernel zero page cache for it, 20 s of system time for
/// the 8 GiB of a sparse test's reference.
pub fn openssl_digest(algo: &str, path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom, Write};
    let len = std::fs::metadata(path).unwrap().len();
    let ranges = data_ranges(path);
    let dash_algo = format!("-{algo}");
    let out = if ranges.iter().map(|(a, b)| b - a).sum::<u64>() == len {
        tool(
            "openssl",
            &["dgst", &dash_algo, "-r", path.to_str().unwrap()],
        )
    } else {
        let mut child = std::process::Command::new("openssl")
            .args(["dgst", &dash_algo, "-r"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut pipe = child.stdin.take().unwrap();
        let mut file = std::fs::File::open(path).unwrap();
        let zeros = vec![0u8; 1 << 20];
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        for (start, end) in ranges.into_iter().chain([(len, len)]) {
            while at < start {
                let n = (start - at).min(zeros.len() as u64) as usize;
                pipe.write_all(&zeros[..n]).unwrap();
                at += n as u64;
            }
            file.seek(SeekFrom::Start(at)).unwrap();
            while at < end {
                let n = (end - at).min(buf.len() as u64) as usize;
                file.read_exact(&mut buf[..n]).unwrap();
                pipe.write_all(&buf[..n]).unwrap();
                at += n as u64;
            }
        }
        drop(pipe);
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "openssl dgst {dash_algo} failed");
        String::from_utf8(out.stdout).unwrap()
    };
    out.split_whitespace().next().unwrap().to_string()
}

/// The `(start, end)` ranges of `path` that are not holes (SEEK_DATA /
/// SEEK_HOLE), in order.
pub fn data_ranges(path: &Path) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as i64;
    let mut ranges = Vec::new();
    let mut at = 0i64;
    while at < len {
        // SAFETY: lseek on a descriptor this function owns; no memory is passed.
        let data = unsafe { libc::lseek(file.as_raw_fd(), at, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole from here to the end.
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
        assert!(hole > data, "SEEK_HOLE of {path:?} at {data}");
        ranges.push((data as u64, hole as u64));
        at = hole;
    }
    ranges
}

/// A worker configuration without the served MD5, for tests where
/// gigabytes of zeros hashed by the worker and again by the check would be
/// most of their CPU and say nothing of what they test.
pub const NO_MD5: &str = "[agent]\nserved_md5 = false\n";

/// Writes `len` pseudo-random bytes (seeded, so failures reproduce).
pub fn random_file(path: &Path, len: usize, seed: u64) {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut data = Vec::with_capacity(len + 8);
    while data.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        data.extend_from_slice(&state.to_le_bytes());
    }
    data.truncate(len);
    std::fs::write(path, data).unwrap();
}

/// Writes a sparse raw disk of `size` bytes with random data at a few
/// places (start, a third, the middle, the end) and zeros elsewhere.
pub fn patchy_raw(path: &Path, size: u64, seed: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let chunk_path = dir.path().join("chunk");
    random_file(&chunk_path, 64 * 1024 + 17, seed);
    let chunk = std::fs::read(chunk_path).unwrap();
    for (i, at) in [0, size / 3, size / 2 + 4096, size.saturating_sub(70_000)]
        .iter()
        .enumerate()
    {
        let at = (*at).min(size.saturating_sub(chunk.len() as u64));
        f.write_all_at(&chunk[..chunk.len() - i], at).unwrap();
    }
}

/// `qemu-img convert -O raw` of the qcow2 `img` into `out`: the reference.
pub fn reference_raw(img: &Path, out: &Path) {
    tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "qcow2",
            "-O",
            "raw",
            img.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
}

/// Makes a qcow2 from a raw file with `qemu-img convert` (options in `opts`).
pub fn qcow2_from(raw: &Path, out: &Path, opts: &[&str]) {
    let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
    args.extend_from_slice(opts);
    args.push(raw.to_str().unwrap());
    args.push(out.to_str().unwrap());
    tool("qemu-img", &args);
}

/// A qcow2 at `out` backed by the raw file `base` (named by the path given,
/// its size taken): created with `-u`, so qemu-img opens nothing.
pub fn qcow2_backed_by(base: &Path, out: &Path) {
    let size = std::fs::metadata(base).unwrap().len().to_string();
    let (base, out) = (base.to_str().unwrap(), out.to_str().unwrap());
    tool(
        "qemu-img",
        &[
            "create", "-f", "qcow2", "-u", "-b", base, "-F", "raw", out, &size,
        ],
    );
}

/// A random canonical node UUID.
pub fn node() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// GETs `url` and returns (status, body bytes).
pub async fn get(url: &str) -> (u16, Vec<u8>) {
    let r = reqwest::get(url).await.unwrap();
    let status = r.status().as_u16();
    (status, r.bytes().await.unwrap().to_vec())
}

/// A test client of the real broker: publishes commands and collects the
/// completion events that come back on its temporary reply queue.
pub struct Broker {
    pub conn: lapin::Connection,
    pub channel: lapin::Channel,
    pub reply_queue: String,
    replies: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<(Option<String>, Value)>>,
}

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

impl Broker {
    /// A client of the default broker on 127.0.0.1:5672.
    pub async fn connect() -> Broker {
        Broker::connect_to(AMQP_URL).await
    }

    /// A client of the broker at `url` (a test's own RabbitMQ node).
    pub async fn connect_to(url: &str) -> Broker {
        use lapin::options::*;
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {url}: {e}"));
        let channel = conn.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        let reply_queue = q.name().as_str().to_string();
        Broker::replying(conn, channel, reply_queue).await
    }

    /// A client of the broker at `url` whose answers come to `reply_queue`,
    /// a queue declared elsewhere (a durable quorum queue, as a deploy
    /// interface's).
    pub async fn connect_replying_to(url: &str, reply_queue: &str) -> Broker {
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {url}: {e}"));
        let channel = conn.create_channel().await.unwrap();
        Broker::replying(conn, channel, reply_queue.to_string()).await
    }

    /// The client of `conn` consuming `reply_queue`, publishing on `channel`
    /// (put in confirm mode).
    async fn replying(
        conn: lapin::Connection,
        channel: lapin::Channel,
        reply_queue: String,
    ) -> Broker {
        use futures_util::StreamExt;
        use lapin::options::*;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let consume = conn.create_channel().await.unwrap();
        let mut consumer = consume
            .basic_consume(
                reply_queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let _keep = consume;
            loop {
                let d = match consumer.next().await {
                    Some(Ok(d)) => d,
                    // Said, so that a test missing its answers tells why.
                    end => return eprintln!("the reply consumer stopped: {end:?}"),
                };
                let corr = d
                    .properties
                    .correlation_id()
                    .as_ref()
                    .map(|c| c.as_str().to_string());
                let v: Value = serde_json::from_slice(&d.data).expect("completion is JSON");
                assert_valid_completion(&v);
                if tx.send((corr, v)).is_err() {
                    break;
                }
            }
        });
        Broker {
            conn,
            channel,
            reply_queue,
            replies: tokio::sync::Mutex::new(rx),
        }
    }

    /// Publishes raw `body` for `host` with routing key `<host>.node.<action>`.
    pub async fn publish_raw(
        &self,
        host: &str,
        action: &str,
        body: &[u8],
        correlation_id: &str,
        headers: Option<lapin::types::FieldTable>,
        reply: bool,
    ) {
        let reply_to = reply.then_some(self.reply_queue.as_str());
        let props = Broker::properties(correlation_id, headers, reply_to);
        self.publish_props(host, action, body, props).await;
    }

    /// A persistent JSON command's properties.
    pub fn properties(
        correlation_id: &str,
        headers: Option<lapin::types::FieldTable>,
        reply_to: Option<&str>,
    ) -> lapin::BasicProperties {
        let mut props = lapin::BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_correlation_id(correlation_id.into());
        if let Some(queue) = reply_to {
            props = props.with_reply_to(queue.into());
        }
        if let Some(h) = headers {
            props = props.with_headers(h);
        }
        props
    }

    /// Publishes `body` with `props` to `<host>.node.<action>`, mandatory and
    /// confirmed: the command must reach a queue.
    pub async fn publish_props(
        &self,
        host: &str,
        action: &str,
        body: &[u8],
        props: lapin::BasicProperties,
    ) {
        use lapin::options::*;
        let confirm = self
            .channel
            .basic_publish(
                "ironic-image-worker".into(),
                format!("{host}.node.{action}").as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(
            confirm,
            lapin::Confirmation::Ack(None),
            "command was routed"
        );
    }

    /// Publishes raw bytes as a notification on Ironic's exchange
    /// (`ironic_versioned_notifications.info`), confirmed by the broker.
    pub async fn publish_notification(&self, body: &[u8]) {
        self.channel
            .basic_publish(
                "ironic".into(),
                "ironic_versioned_notifications.info".into(),
                lapin::options::BasicPublishOptions::default(),
                body,
                Default::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Publishes `body` on exchange `exchange` with routing `key`, answered
    /// to this client's reply queue when `reply`; returns its correlation id.
    pub async fn publish_to(&self, exchange: &str, key: &str, body: &Value, reply: bool) -> String {
        use lapin::options::*;
        let corr = uuid::Uuid::new_v4().to_string();
        let mut props = lapin::BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_correlation_id(corr.as_str().into());
        if reply {
            props = props.with_reply_to(self.reply_queue.as_str().into());
        }
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.to_string().as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(confirm, lapin::Confirmation::Ack(None), "{key} was routed");
        corr
    }

    /// Publishes a command JSON and returns its correlation id.
    pub async fn command(&self, host: &str, body: Value) -> String {
        self.send(host, &body, None).await
    }

    /// Sends command `body` to `host` with a reply queue and, when given, an
    /// AMQP `expiration` in ms; returns its correlation id.
    pub async fn send(&self, host: &str, body: &Value, expiration: Option<u64>) -> String {
        let corr = uuid::Uuid::new_v4().to_string();
        let action = body["action"].as_str().unwrap_or("prepare").to_string();
        let mut props = Broker::properties(&corr, None, Some(&self.reply_queue));
        if let Some(ms) = expiration {
            props = props.with_expiration(ms.to_string().as_str().into());
        }
        self.publish_props(host, &action, body.to_string().as_bytes(), props)
            .await;
        corr
    }

    /// The answers to `sent`, waiting up to `within` for all of them and
    /// then `quiet` longer for duplicates: answers per correlation id.
    pub async fn answers(
        &self,
        sent: &[String],
        within: Duration,
        quiet: Duration,
    ) -> HashMap<String, Vec<Value>> {
        let mut seen: HashMap<String, Vec<Value>> = HashMap::new();
        let deadline = tokio::time::Instant::now() + within;
        let mut rx = self.replies.lock().await;
        loop {
            let all = sent.iter().all(|c| seen.contains_key(c));
            let until = if all {
                tokio::time::Instant::now() + quiet
            } else {
                deadline
            };
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some((corr, v))) => seen.entry(corr.unwrap_or_default()).or_default().push(v),
                _ => return seen,
            }
        }
    }

    /// The next completion event (with its correlation id).
    pub async fn next_reply(&self, within: Duration) -> (Option<String>, Value) {
        let mut rx = self.replies.lock().await;
        tokio::time::timeout(within, rx.recv())
            .await
            .expect("a completion event in time")
            .expect("reply consumer alive")
    }

    /// Waits for `n` replies, keyed by correlation id.
    pub async fn replies(&self, n: usize, within: Duration) -> HashMap<String, Value> {
        let deadline = tokio::time::Instant::now() + within;
        let mut out = HashMap::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let (corr, v) = self.next_reply(left).await;
            out.insert(corr.unwrap_or_default(), v);
        }
        out
    }

    /// Sends one command and waits for its answer.
    pub async fn call(&self, host: &str, body: Value) -> Value {
        let corr = self.command(host, body).await;
        let (got, v) = self.next_reply(Duration::from_secs(60)).await;
        assert_eq!(
            got.as_deref(),
            Some(corr.as_str()),
            "correlation_id honoured"
        );
        v
    }

    /// Takes every message from `queue` (acknowledging them).
    pub async fn drain(&self, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
        use lapin::options::*;
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            out.push(m);
        }
        out
    }
}

/// A prepare command body.
pub fn prepare_cmd(node: &str, source: &str) -> Value {
    serde_json::json!({
        "action": "prepare",
        "node_uuid": node,
        "request_id": uuid::Uuid::new_v4().to_string(),
        "instance_info": {"image_source": source},
    })
}

/// Python with Ironic installed (a virtualenv at `$IIW_IRONIC_VENV`, default
/// `target/ironic-venv`, made on first use from PyPI by
/// `tests/helpers/ironic_venv.py`, which `.ci/run` also starts ahead of the
/// build), to run Ironic's own code.
pub fn ironic_python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let venv = std::env::var_os("IIW_IRONIC_VENV")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ironic-venv")
                });
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/ironic_venv.py");
            let python = tool(
                "python3",
                &[script.to_str().unwrap(), venv.to_str().unwrap()],
            );
            PathBuf::from(python.trim())
        })
        .clone()
}

/// Emits provision_set notifications through Ironic's notifier as conductor
/// `host`; each spec is one transition (see tests/helpers/emit_notification.py).
pub fn emit_notifications(host: &str, specs: &[Value]) {
    use std::io::Write;
    let mut child = std::process::Command::new(ironic_python())
        .arg(notifier_script())
        .arg(host)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines: String = specs.iter().map(|s| format!("{s}\n")).collect();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "emit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Ironic's notifier, a transition a line on stdin.
fn notifier_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/emit_notification.py")
}

/// A long-lived helper process that answers each line written to its stdin
/// with one line on its stdout (the Ironic helpers in tests/helpers): one import
/// of Ironic (seconds of CPU) for a test's many operations.
pub struct LineHelper {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    /// Its stderr (a pipe nobody reads could fill and stop it).
    stderr: tempfile::NamedTempFile,
}

impl LineHelper {
    /// Starts `cmd` with its stdin and stdout piped to this helper.
    pub fn start(mut cmd: tokio::process::Command) -> LineHelper {
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr.reopen().unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
        let lines = tokio::io::AsyncBufReadExt::lines(stdout);
        LineHelper {
            child,
            stdin,
            lines,
            stderr,
        }
    }

    /// Writes `line` and returns the answer; panics, with the helper's
    /// stderr, when none comes within two minutes.
    pub async fn ask(&mut self, line: &str) -> String {
        use tokio::io::AsyncWriteExt;
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        match tokio::time::timeout(Duration::from_secs(120), self.lines.next_line()).await {
            Ok(Ok(Some(answer))) => answer,
            other => panic!(
                "the helper answered {other:?} (exit {:?}); stderr {}",
                self.child.try_wait(),
                std::fs::read_to_string(self.stderr.path()).unwrap_or_default()
            ),
        }
    }
}

/// Ironic's notifier as one long-lived conductor process (see
/// tests/helpers/emit_notification.py), for tests that emit in turns.
pub struct Notifier(LineHelper);

impl Notifier {
    /// The notifier of conductor `host`.
    pub fn start(host: &str) -> Notifier {
        let mut cmd = tokio::process::Command::new(ironic_python());
        cmd.arg(notifier_script()).arg(host);
        Notifier(LineHelper::start(cmd))
    }

    /// Emits the transitions `specs` in turn, each once Ironic has sent the
    /// one before.
    pub async fn emit(&mut self, specs: &[Value]) {
        for spec in specs {
            assert_eq!(self.0.ask(&spec.to_string()).await, "sent", "{spec}");
        }
    }
}

/// A queue receiving the completion events published without reply_to.
pub struct EventTap {
    channel: lapin::Channel,
    queue: String,
}

impl EventTap {
    pub async fn new(broker: &Broker) -> EventTap {
        use lapin::options::*;
        let channel = broker.conn.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        // Node events, and the warms' (which name an image).
        for key in ["node.#", "image.#"] {
            channel
                .queue_bind(
                    q.name().clone(),
                    "ironic-image-worker.events".into(),
                    key.into(),
                    Default::default(),
                    Default::default(),
                )
                .await
                .unwrap();
        }
        EventTap {
            channel,
            queue: q.name().as_str().to_string(),
        }
    }

    /// The next event of conductor `host` within `wait`, with its routing key
    /// and delivery mode. Answers to messages that could not be parsed at all
    /// (`action` "unknown") are skipped: every worker answers a malformed
    /// notification on Ironic's shared exchange, so such an event belongs to
    /// the test that published it, which reads it with [`EventTap::collect_any`].
    pub async fn next(&self, host: &str, wait: Duration) -> Option<(String, Option<u8>, Value)> {
        self.next_where(host, wait, |v| v["action"] != "unknown")
            .await
    }

    /// The next event of conductor `host` within `wait` that `keep` accepts.
    async fn next_where(
        &self,
        host: &str,
        wait: Duration,
        keep: impl Fn(&Value) -> bool,
    ) -> Option<(String, Option<u8>, Value)> {
        use lapin::options::*;
        let deadline = tokio::time::Instant::now() + wait;
        while tokio::time::Instant::now() < deadline {
            let got = self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap();
            match got {
                Some(m) => {
                    let v: Value = serde_json::from_slice(&m.delivery.data).unwrap();
                    assert_valid_completion(&v);
                    if v["conductor_host"] == host && keep(&v) {
                        let mode = *m.delivery.properties.delivery_mode();
                        return Some((m.delivery.routing_key.as_str().to_string(), mode, v));
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        None
    }

    /// Events of conductor `host` seen within `wait` (stops early at `n`),
    /// without answers to unparsable messages (see [`EventTap::next`]).
    pub async fn collect(&self, host: &str, n: usize, wait: Duration) -> Vec<Value> {
        self.collect_where(host, n, wait, |v| v["action"] != "unknown")
            .await
    }

    /// Every event of conductor `host` seen within `wait` (stops early at `n`).
    pub async fn collect_any(&self, host: &str, n: usize, wait: Duration) -> Vec<Value> {
        self.collect_where(host, n, wait, |_| true).await
    }

    async fn collect_where(
        &self,
        host: &str,
        n: usize,
        wait: Duration,
        keep: impl Fn(&Value) -> bool,
    ) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut out = Vec::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_where(host, left, &keep).await {
                Some((_, _, v)) => out.push(v),
                None => break,
            }
        }
        out
    }
}

/// How long [`Worker::wait_metrics`] waits for a metric.
pub const METRIC_WAIT: Duration = Duration::from_secs(90);

/// The value of the sample `line_prefix` (metric name with labels) in a
/// Prometheus text exposition, if present.
pub fn metric(text: &str, line_prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.strip_prefix(' ')?.parse().ok())
}

/// A raw HTTP server for fault injection, serving files of `dir` by name:
/// `/slow/NAME` at `rate` bytes/s, `/stall/NAME` stops after half the body
/// and holds the connection, `/short/NAME` closes after half the body
/// (Content-Length says more), `/reset/NAME` resets the connection after
/// half the body, `/nolength/NAME` sends it without a Content-Length,
/// `/trickle/NAME` sends a byte every 100 ms, `/endless/ANY` streams without
/// a length for ever, `/redirect/TARGET` answers 302 to TARGET,
/// `/switch/NAME` sends other bytes on the first attempt (see there).
/// Counts requests per path.
pub struct FaultServer {
    pub addr: SocketAddr,
    counts: Arc<Mutex<HashMap<String, usize>>>,
}

impl FaultServer {
    pub async fn start(dir: &Path, rate: usize) -> FaultServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let (dir, c) = (dir.to_path_buf(), counts.clone());
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (dir, c) = (dir.clone(), c.clone());
                tokio::spawn(async move {
                    let _ = serve_fault(sock, &dir, rate, &c).await;
                });
            }
        });
        FaultServer { addr, counts }
    }

    pub fn url(&self, mode: &str, name: &str) -> String {
        format!("http://{}/{mode}/{name}", self.addr)
    }

    pub fn count(&self, mode: &str, name: &str) -> usize {
        *self
            .counts
            .lock()
            .unwrap()
            .get(&format!("/{mode}/{name}"))
            .unwrap_or(&0)
    }
}

async fn serve_fault(
    mut sock: tokio::net::TcpStream,
    dir: &Path,
    rate: usize,
    counts: &Mutex<HashMap<String, usize>>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        req.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&req).to_string();
    let mut words = text.split_whitespace();
    let (method, path) = (
        words.next().unwrap_or(""),
        words.next().unwrap_or("").to_string(),
    );
    *counts.lock().unwrap().entry(path.clone()).or_default() += 1;
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (mode, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    // `/redirect/TARGET` answers 302 to TARGET (taken verbatim).
    if mode == "redirect" {
        let head = format!(
            "HTTP/1.1 302 Found\r\nLocation: {name}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        sock.write_all(head.as_bytes()).await?;
        return Ok(());
    }
    // `/endless/NAME` streams text without a Content-Length, for ever.
    if mode == "endless" {
        sock.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            .await?;
        if method == "HEAD" {
            return Ok(());
        }
        let line = [b'0'; 64 * 1024];
        loop {
            sock.write_all(&line).await?;
        }
    }
    // `/switch/NAME`: the first request gets `NAME.first` (announced with
    // the length of `NAME`, then reset), every later one `NAME` itself: a
    // source whose first, failed attempt sent other bytes than its retry.
    let first_of_switch = mode == "switch" && counts.lock().unwrap()[&path] == 1;
    let file = if first_of_switch {
        format!("{name}.first")
    } else {
        name.to_string()
    };
    let Ok(data) = std::fs::read(dir.join(&file)) else {
        sock.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await?;
        return Ok(());
    };
    // Last-Modified from the file itself, as a real server would answer.
    let modified = std::fs::metadata(dir.join(name))
        .and_then(|m| m.modified())
        .map(httpdate::fmt_http_date)?;
    let announced = match first_of_switch {
        true => std::fs::metadata(dir.join(name))?.len() as usize,
        false => data.len(),
    };
    let length = if mode == "nolength" {
        String::new()
    } else {
        format!("Content-Length: {announced}\r\n")
    };
    let head = format!(
        "HTTP/1.1 200 OK\r\n{length}Last-Modified: {modified}\r\nConnection: close\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).await?;
    if method == "HEAD" {
        return Ok(());
    }
    let half = data.len() / 2;
    match mode {
        "slow" => {
            for chunk in data.chunks(rate.max(1) / 10 + 1) {
                sock.write_all(chunk).await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        "stall" => {
            sock.write_all(&data[..half]).await?;
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        // One byte every 100 ms (Content-Length announced).
        "trickle" => {
            for byte in &data {
                sock.write_all(std::slice::from_ref(byte)).await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        "short" => sock.write_all(&data[..half]).await?,
        // All of `NAME.first` (shorter than the announced length), padded
        // to one byte short of it, then a reset.
        "switch" if first_of_switch => {
            sock.write_all(&data).await?;
            let pad = vec![0x5au8; announced.saturating_sub(data.len() + 1)];
            sock.write_all(&pad).await?;
            sock.set_zero_linger()?;
        }
        "reset" => {
            sock.write_all(&data[..half]).await?;
            sock.set_zero_linger()?;
        }
        _ => sock.write_all(&data).await?,
    }
    Ok(())
}

impl Env {
    /// Starts a second `serve` sharing this environment's queue and
    /// directories, on its own HTTP and metrics ports.
    pub async fn serve_another(&self, extra: &[&str]) -> Worker {
        let (http, metrics) = (free_port(), free_port());
        let h = format!("http.listen=127.0.0.1:{http}");
        let m = format!("metrics.listen=127.0.0.1:{metrics}");
        let mut args = vec!["--set", &h, "--set", &m];
        args.extend_from_slice(extra);
        Worker::start(|| self.command(&args), http, metrics).await
    }

    /// Waits until a temporary file appears in the master cache.
    pub async fn wait_for_temporary(&self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        while self.temporaries().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "no work started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Worker {
    /// Waits until `check` holds for the `/metrics` page (polled every
    /// 50 ms, at most [`METRIC_WAIT`]): the page it held for. Panics naming
    /// `what`, with the last page.
    pub async fn wait_metrics(&self, what: &str, check: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + METRIC_WAIT;
        loop {
            let text = self.metrics_text().await;
            if check(&text) {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not reached in {METRIC_WAIT:?}; metrics:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the series `sample` (a line's start, labels included)
    /// reads at least `at_least`: the page it did on.
    pub async fn wait_metric(&self, sample: &str, at_least: f64) -> String {
        let what = format!("{sample} >= {at_least}");
        self.wait_metrics(&what, |t| metric(t, sample).is_some_and(|v| v >= at_least))
            .await
    }

    /// The `/metrics` page.
    pub async fn metrics_text(&self) -> String {
        reqwest::get(self.metrics_url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// SIGKILL, as a crash would.
    pub async fn kill9(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A tmpfs of `size` mounted over a test directory (needs root, as CI has),
/// unmounted when dropped: a real file system that fills up or turns
/// read-only.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tmpfs",
                dir.to_str().unwrap(),
            ])
            .output();
        match out {
            Ok(out) if out.status.success() => Tmpfs(dir.to_path_buf()),
            Ok(out) => panic!(
                "cannot mount a tmpfs (this test needs root, as CI has): {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => panic!("cannot mount a tmpfs (this test needs root, as CI has): {e}"),
        }
    }

    /// `mount -o remount,<mode>`, e.g. `ro` or `rw`.
    pub fn remount(&self, mode: &str) {
        tool(
            "mount",
            &["-o", &format!("remount,{mode}"), self.0.to_str().unwrap()],
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}
