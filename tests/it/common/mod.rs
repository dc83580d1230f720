//! Test support: a real HTTP source server that counts requests, a worker
//! environment in a temporary directory, the worker's metrics, and
//! validation of every completion event against the JSON schema; the rest
//! by subject in the modules below.
#![allow(dead_code)]

pub mod agent;
pub mod broker;
pub mod ca;
pub mod faults;
pub mod images;
pub mod ironic;
pub mod netns;
pub mod oci_image;
pub mod plugin;
pub mod rabbit;
pub mod served;

// tests/broker_restart.rs includes this module too, and uses a few of them.
#[allow(unused_imports)]
pub use broker::{AMQP_URL, Broker, EventTap, prepare_cmd};
#[allow(unused_imports)]
pub use faults::{FaultServer, Tmpfs};
#[allow(unused_imports)]
pub use images::{
    data_ranges, md5sum, openssl_digest, patchy_raw, qcow2_backed_by, qcow2_from, random_file,
    reference_raw, sha256sum, sha512sum, tool,
};
#[allow(unused_imports)]
pub use ironic::{LineHelper, Notifier, emit_notifications, emit_notifications_on, ironic_python};
#[allow(unused_imports)]
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
    /// The exchange this worker reads Ironic's notifications on when it
    /// is the test's own ([`Env::notified_alone`]), deleted with the
    /// environment.
    pub notifications: Option<String>,
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
            notifications: None,
        }
    }

    /// A new environment whose worker reads Ironic's notifications on an
    /// exchange of the test's own (its name in `notifications`), with
    /// `amqp` more lines in `[amqp]`: what other tests send on Ironic's
    /// reaches every running worker, and would be counted or dead-lettered
    /// in this test's queues (or routed to a queue as it is deleted).
    pub fn notified_alone(amqp: &str) -> Env {
        let exchange = format!("ironic-{}", uuid::Uuid::new_v4().simple());
        let mut env = Env::new(&format!(
            "[amqp]\nnotification_exchange = \"{exchange}\"\n{amqp}\n"
        ));
        env.notifications = Some(exchange);
        env
    }

    /// The exchange of [`Env::notified_alone`].
    pub fn notification_exchange(&self) -> &str {
        self.notifications
            .as_deref()
            .expect("an environment made by Env::notified_alone")
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
    /// exchange and would collect notifications forever) and its own
    /// notification exchange.
    fn drop(&mut self) {
        let host = self.host.clone();
        let exchange = self.notifications.take();
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
                    if let Some(x) = exchange {
                        let _ = ch
                            .exchange_delete(x.as_str().into(), Default::default())
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

/// A worker configuration without the served MD5, for tests where
/// gigabytes of zeros hashed by the worker and again by the check would be
/// most of their CPU and say nothing of what they test.
pub const NO_MD5: &str = "[agent]\nserved_md5 = false\n";

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

/// How long [`Worker::wait_metrics`] waits for a metric.
pub const METRIC_WAIT: Duration = Duration::from_secs(90);

/// The value of the sample `line_prefix` (metric name with labels) in a
/// Prometheus text exposition, if present.
pub fn metric(text: &str, line_prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.strip_prefix(' ')?.parse().ok())
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
