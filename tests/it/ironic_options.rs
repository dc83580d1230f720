//! The ironic.conf options that change Ironic's image path, each honoured
//! as Ironic 39 honours it, whether set in the worker's TOML (`--set`), in
//! an ironic.conf or as oslo.config's `OS_<GROUP>__<OPTION>` variables
//! (docs/contract.md, "Ironic's image options"). One-shot prepares against
//! real servers and images made by qemu-img; each test fails when its
//! option is ignored.

use crate::common;

use common::*;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// A one-shot `prepare` with extra global flags (`--set`, `--ironic-config`)
/// and environment variables.
async fn prepare_with(
    env: &Env,
    flags: &[&str],
    vars: &[(&str, &str)],
    source: &str,
    extra: &[&str],
) -> (bool, Value) {
    let node = node();
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--config").arg(&env.config).args(flags);
    cmd.args(["prepare", "--node", &node, "--image-source", source])
        .args(extra)
        .env_remove("IRONIC_IMAGE_WORKER_CONFIG");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("worker command timed out")
        .unwrap();
    completion_of(&out)
}

/// Environment variables of one run.
type Vars<'a> = &'a [(&'a str, &'a str)];

fn code(ev: &Value) -> &str {
    ev["error"]["code"].as_str().unwrap_or("")
}

/// A plain HTTP server for what `SourceServer` does not do: `/gzip/NAME`
/// answers `NAME.gz` with `Content-Encoding: gzip`; `/pause/NAME` sends its
/// header, then nothing for 3 s, then `NAME`.
async fn odd_server(dir: &Path) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dir = dir.to_path_buf();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let dir = dir.clone();
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&req).to_string();
                let mut words = text.split_whitespace();
                let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
                let (mode, name) = path.trim_start_matches('/').split_once('/').unwrap();
                let (file, encoding) = match mode {
                    "gzip" => (format!("{name}.gz"), "Content-Encoding: gzip\r\n"),
                    _ => (name.to_string(), ""),
                };
                let data = std::fs::read(dir.join(file)).unwrap();
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n{encoding}Connection: close\r\n\r\n",
                    data.len()
                );
                let _ = sock.write_all(head.as_bytes()).await;
                if method == "HEAD" {
                    return;
                }
                if mode == "pause" {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
                let _ = sock.write_all(&data).await;
            });
        }
    });
    format!("http://{addr}")
}

/// `[agent]allow_md5_checksum = false`: an MD5-only checksum (inline or
/// from a checksum file) is refused, whichever way the option is set;
/// SHA-256 still works. The source of these tests: `disk.img` beside an
/// `MD5SUMS` naming it; returns its MD5, its sha256, the file's URL and
/// the server (kept running).
async fn md5_source(env: &Env) -> (String, String, String, SourceServer) {
    let src = env.root().join("src");
    random_file(&src.join("disk.img"), 1 << 20, 261);
    let md5 = md5sum(&src.join("disk.img"));
    let sha256 = sha256sum(&src.join("disk.img"));
    std::fs::write(src.join("MD5SUMS"), format!("{md5}  disk.img\n")).unwrap();
    let server = SourceServer::start(&src).await;
    let url = server.url("disk.img");
    (md5, sha256, url, server)
}

/// With MD5 not allowed by `flags` and `vars`, each MD5-only form (inline,
/// `md5:` prefixed, a checksum file) is refused.
async fn md5_refused(env: &Env, flags: &[&str], vars: Vars<'_>) {
    let (md5, _, url, server) = md5_source(env).await;
    for checksum in [md5.clone(), format!("md5:{md5}"), server.url("MD5SUMS")] {
        let (ok, ev) = prepare_with(env, flags, vars, &url, &["--checksum", &checksum]).await;
        assert!(!ok, "{flags:?} {vars:?} {checksum}: {ev}");
        assert_eq!(code(&ev), "checksum_not_permitted", "{ev}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md5_checksums_are_allowed_by_default() {
    let env = Env::new("");
    let (md5, _, url, _server) = md5_source(&env).await;
    let (ok, ev) = prepare_with(&env, &[], &[], &url, &["--checksum", &md5]).await;
    assert!(ok, "MD5 is allowed by default: {ev}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md5_only_checksums_are_refused_when_set_does_not_allow_md5() {
    let env = Env::new("");
    md5_refused(&env, &["--set", "agent.allow_md5_checksum=false"], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md5_only_checksums_are_refused_when_the_environment_does_not_allow_md5() {
    let env = Env::new("");
    md5_refused(&env, &[], &[("OS_AGENT__ALLOW_MD5_CHECKSUM", "false")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md5_only_checksums_are_refused_when_ironic_conf_does_not_allow_md5() {
    let env = Env::new("");
    let ironic_conf = env.root().join("ironic.conf");
    std::fs::write(&ironic_conf, "[agent]\nallow_md5_checksum = False\n").unwrap();
    let conf = ironic_conf.to_str().unwrap();
    md5_refused(&env, &["--ironic-config", conf], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sha256_still_works_when_md5_is_not_allowed() {
    let env = Env::new("");
    let (_, sha256, url, _server) = md5_source(&env).await;
    let (ok, ev) = prepare_with(
        &env,
        &[],
        &[("OS_AGENT__ALLOW_MD5_CHECKSUM", "false")],
        &url,
        &["--os-hash-algo", "sha256", "--os-hash-value", &sha256],
    )
    .await;
    assert!(ok, "{ev}");
}

/// `[conductor]disable_support_for_checksum_files = true`: a checksum file
/// URL is refused before it is fetched; the digest itself still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksum_file_urls_are_refused_when_disabled() {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("disk.img"), 1 << 20, 262);
    let sha256 = sha256sum(&src.join("disk.img"));
    std::fs::write(src.join("SHA256SUMS"), format!("{sha256}  disk.img\n")).unwrap();
    let server = SourceServer::start(&src).await;
    let url = server.url("disk.img");
    let sums = server.url("SHA256SUMS");

    let (ok, ev) = prepare_with(&env, &[], &[], &url, &["--checksum", &sums]).await;
    assert!(ok, "{ev}");
    assert_eq!(server.count("GET", "SHA256SUMS"), 1);
    let off = [("OS_CONDUCTOR__DISABLE_SUPPORT_FOR_CHECKSUM_FILES", "true")];
    let (ok, ev) = prepare_with(&env, &[], &off, &url, &["--checksum", &sums]).await;
    assert!(!ok, "{ev}");
    assert_eq!(code(&ev), "checksum_not_permitted", "{ev}");
    assert_eq!(server.count("GET", "SHA256SUMS"), 1, "not fetched");
    let (ok, ev) = prepare_with(&env, &[], &off, &url, &["--checksum", &sha256]).await;
    assert!(ok, "{ev}");
}

/// `[conductor]disable_deep_image_inspection = true`: the declared and
/// permitted formats are not checked (the detected format still decides
/// the conversion); the structural checks stay. The images of these tests,
/// in the allowed directory: `disk.vmdk` and `disk.qcow2` of the returned
/// raw disk, and `backed.qcow2` backed by it.
fn inspected_images(env: &Env) -> std::path::PathBuf {
    let allowed = env.root().join("allowed");
    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 8 << 20, 263);
    tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "vmdk",
            raw.to_str().unwrap(),
            allowed.join("disk.vmdk").to_str().unwrap(),
        ],
    );
    qcow2_from(&raw, &allowed.join("disk.qcow2"), &[]);
    qcow2_backed_by(&raw, &allowed.join("backed.qcow2"));
    raw
}

/// A file:// URL of `name` in the allowed directory.
fn allowed_file(env: &Env, name: &str) -> String {
    format!("file://{}", env.root().join("allowed").join(name).display())
}

const NO_DEEP_INSPECTION: [&str; 2] = ["--set", "conductor.disable_deep_image_inspection=true"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_inspection_checks_the_permitted_and_declared_formats() {
    let env = Env::new("");
    inspected_images(&env);
    let (_, ev) = prepare_with(&env, &[], &[], &allowed_file(&env, "disk.vmdk"), &[]).await;
    assert_eq!(code(&ev), "format_not_permitted", "{ev}");
    let qcow2 = allowed_file(&env, "disk.qcow2");
    let (_, ev) = prepare_with(&env, &[], &[], &qcow2, &["--disk-format", "raw"]).await;
    assert_eq!(code(&ev), "format_mismatch", "{ev}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_deep_inspection_a_vmdk_is_converted() {
    let env = Env::new("");
    let raw = inspected_images(&env);
    let vmdk = allowed_file(&env, "disk.vmdk");
    let (ok, ev) = prepare_with(&env, &NO_DEEP_INSPECTION, &[], &vmdk, &[]).await;
    assert!(ok, "{ev}");
    assert_eq!(ev["converted"], true);
    assert_served(&ev, &raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_deep_inspection_a_qcow2_declared_raw_is_converted() {
    let env = Env::new("");
    let raw = inspected_images(&env);
    let qcow2 = allowed_file(&env, "disk.qcow2");
    let declared = ["--disk-format", "raw"];
    let (ok, ev) = prepare_with(&env, &NO_DEEP_INSPECTION, &[], &qcow2, &declared).await;
    assert!(ok, "{ev}");
    assert_eq!(ev["converted"], true);
    assert_served(&ev, &raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_deep_inspection_a_backing_file_is_still_unsafe() {
    let env = Env::new("");
    inspected_images(&env);
    let backed = allowed_file(&env, "backed.qcow2");
    let (_, ev) = prepare_with(&env, &NO_DEEP_INSPECTION, &[], &backed, &[]).await;
    assert_eq!(code(&ev), "unsafe_image", "{ev}");
}

/// `[conductor]conductor_always_validates_images = true` in `http` mode:
/// an http(s) source is downloaded and inspected before its own URL is
/// answered (unless deep inspection is disabled). An empty
/// `instance_info.image_download_source` is unset, as in Ironic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_mode_inspects_sources_when_the_conductor_always_validates() {
    let env = Env::new("");
    let src = env.root().join("src");
    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 8 << 20, 264);
    qcow2_from(&raw, &src.join("disk.qcow2"), &[]);
    qcow2_backed_by(&raw, &src.join("backed.qcow2"));
    let server = SourceServer::start(&src).await;
    let http = ["--set", "agent.image_download_source=http"];
    let validating = [
        "--set",
        "agent.image_download_source=http",
        "--set",
        "conductor.conductor_always_validates_images=true",
    ];
    // `""` falls back to `[agent]`, here `http`: passed through unread.
    let mode = ["--image-download-source", ""];

    let (ok, ev) = prepare_with(&env, &http, &[], &server.url("backed.qcow2"), &mode).await;
    assert!(ok, "{ev}");
    assert_eq!(ev["image_url"], server.url("backed.qcow2"));
    assert_eq!(server.count("GET", "backed.qcow2"), 0);

    let (ok, ev) = prepare_with(&env, &validating, &[], &server.url("backed.qcow2"), &[]).await;
    assert!(!ok, "{ev}");
    assert_eq!(code(&ev), "unsafe_image", "{ev}");
    assert_eq!(server.count("GET", "backed.qcow2"), 1);

    let good = server.url("disk.qcow2");
    let (ok, ev) = prepare_with(&env, &validating, &[], &good, &["--disk-format", "qcow2"]).await;
    assert!(ok, "{ev}");
    assert_eq!(ev["image_url"], good, "the agent downloads from the source");
    assert_eq!(ev["image_disk_format"], "qcow2");
    assert_eq!(ev["converted"], false);
    // Inspected, not served: no MD5 computed, the sha256 of the source.
    served(&src.join("disk.qcow2")).without_md5().check(&ev);
    assert_eq!(server.count("GET", "disk.qcow2"), 1);
    // Verified once: a repeat with the checksum is not downloaded again.
    let sha = sha256sum(&src.join("disk.qcow2"));
    let again = ["--os-hash-algo", "sha256", "--os-hash-value", &sha];
    let (ok, ev) = prepare_with(&env, &validating, &[], &good, &again).await;
    assert!(ok, "{ev}");
    assert_eq!(server.count("GET", "disk.qcow2"), 1);
    let (_, ev) = prepare_with(&env, &validating, &[], &good, &["--disk-format", "raw"]).await;
    assert_eq!(code(&ev), "format_mismatch", "{ev}");

    // Without deep inspection nothing is inspected, as in Ironic.
    let mut unchecked = validating.to_vec();
    unchecked.extend(["--set", "conductor.disable_deep_image_inspection=true"]);
    let (ok, ev) = prepare_with(&env, &unchecked, &[], &server.url("backed.qcow2"), &[]).await;
    assert!(ok, "{ev}");
    assert_eq!(server.count("GET", "backed.qcow2"), 1);
}

/// `[DEFAULT]raw_image_growth_factor`: the raw size estimated for the
/// space check before a conversion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_image_growth_factor_sizes_the_conversion_space_check() {
    let env = Env::new("");
    let small = env.root().join("small");
    let mount = Tmpfs::mount(&small, "20m");
    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 64 << 20, 265);
    let image = env.root().join("allowed/disk.qcow2");
    qcow2_from(&raw, &image, &[]);
    let dirs = mount.worker_flags();
    let flags: Vec<&str> = dirs.iter().map(String::as_str).collect();
    let source = format!("file://{}", image.display());
    // 64 MiB of virtual disk in 20 MiB: only a small estimate fits.
    let huge = [("OS_DEFAULT__RAW_IMAGE_GROWTH_FACTOR", "1000")];
    let (ok, ev) = prepare_with(&env, &flags, &huge, &source, &[]).await;
    assert!(!ok, "{ev}");
    assert_eq!(code(&ev), "insufficient_disk_space", "{ev}");
    let (ok, ev) = prepare_with(&env, &flags, &[], &source, &[]).await;
    assert!(ok, "{ev}");
    assert_served(&ev, &raw);
}

/// Makes a CA and a certificate for 127.0.0.1 signed by it, and
/// serves `dir` over HTTPS with `openssl s_server -WWW`.
fn https_server(dir: &Path, certs: &Path) -> (Killed, String) {
    let ca = common::ca::TestCa::new(certs, "ca");
    let (cert, key) = ca.issue("srv", "127.0.0.1", "subjectAltName=IP:127.0.0.1\n");
    let port = free_port();
    let child = std::process::Command::new("openssl")
        .args(["s_server", "-quiet", "-WWW", "-accept"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("-cert")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (Killed(child), format!("https://127.0.0.1:{port}"))
}

/// A server process killed when dropped (a failed assertion included).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `[DEFAULT]webserver_verify_ca`: a CA bundle path, or False, for https
/// sources (the system store knows nothing of the test's CA). The source
/// of these tests: `disk.img` over HTTPS; returns the server, the file,
/// its URL, the test CA and a `--checksum` of the file.
fn https_source(
    env: &Env,
) -> (
    Killed,
    std::path::PathBuf,
    String,
    std::path::PathBuf,
    String,
) {
    let src = env.root().join("src");
    random_file(&src.join("disk.img"), 1 << 20, 266);
    let sha256 = sha256sum(&src.join("disk.img"));
    let (server, base) = https_server(&src, &env.root().join("certs"));
    let url = format!("{base}/disk.img");
    let ca = env.root().join("certs/ca.pem");
    (server, src.join("disk.img"), url, ca, sha256)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_source_signed_by_an_unknown_ca_is_unreachable() {
    let env = Env::new("");
    let (_server, _, url, _, sha256) = https_source(&env);
    let (ok, ev) = prepare_with(&env, &[], &[], &url, &["--checksum", &sha256]).await;
    assert!(!ok, "an unknown CA: {ev}");
    assert_eq!(code(&ev), "source_unreachable", "{ev}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webserver_verify_ca_as_a_bundle_verifies_https_sources() {
    let env = Env::new("");
    let (_server, file, url, ca, sha256) = https_source(&env);
    let bundle = format!("DEFAULT.webserver_verify_ca={}", ca.display());
    let sum = ["--checksum", sha256.as_str()];
    let (ok, ev) = prepare_with(&env, &["--set", &bundle], &[], &url, &sum).await;
    assert!(ok, "{ev}");
    assert_served(&ev, &file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webserver_verify_ca_false_does_not_verify_https_sources() {
    let env = Env::new("");
    let (_server, _, url, _, sha256) = https_source(&env);
    let no = [("OS_DEFAULT__WEBSERVER_VERIFY_CA", "False")];
    let (ok, ev) = prepare_with(&env, &[], &no, &url, &["--checksum", &sha256]).await;
    assert!(ok, "{ev}");
}

/// `[DEFAULT]webserver_connection_timeout`: the longest wait for a byte of
/// an http(s) source, over `[source]read_timeout` (5 s in these tests) in
/// both directions; the source pauses 3 s before its body. A prepare of
/// `disk.img` from such a source with `flags` and `vars`, tried once.
async fn paused_prepare(flags: &[&str], vars: Vars<'_>) -> (bool, Value) {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("disk.img"), 1 << 20, 267);
    let sha256 = sha256sum(&src.join("disk.img"));
    let base = odd_server(&src).await;
    let url = format!("{base}/pause/disk.img");
    let once = [&["--set", "source.retries=0"][..], flags].concat();
    prepare_with(&env, &once, vars, &url, &["--checksum", &sha256]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_pausing_within_read_timeout_is_read() {
    let (ok, ev) = paused_prepare(&[], &[]).await;
    assert!(ok, "3 s within read_timeout: {ev}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_webserver_connection_timeout_gives_up_on_a_pause() {
    let short = [("OS_DEFAULT__WEBSERVER_CONNECTION_TIMEOUT", "1")];
    let (ok, ev) = paused_prepare(&[], &short).await;
    assert!(!ok, "{ev}");
    assert_eq!(code(&ev), "source_unreachable", "{ev}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_longer_webserver_connection_timeout_outlasts_read_timeout() {
    let long = [
        "--set",
        "source.read_timeout=1",
        "--set",
        "DEFAULT.webserver_connection_timeout=10",
    ];
    let (ok, ev) = paused_prepare(&long, &[]).await;
    assert!(ok, "{ev}");
    assert_eq!(ev["cache"], "miss");
}

/// `file://` sources under `/dev`, `/sys`, `/proc`, `/boot`, `/run` or
/// `/etc` are refused whatever `file_url_allowed_paths` allows, whether
/// named so or reached through a symlink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_urls_are_never_read_under_system_directories() {
    let env = Env::new("");
    let everywhere = ["--set", "conductor.file_url_allowed_paths=/"];
    // A relative link (`openat2` refuses absolute ones on its own).
    let link = env.root().join("allowed/passwd");
    let up = "../".repeat(link.parent().unwrap().components().count() - 1);
    std::os::unix::fs::symlink(format!("{up}etc/passwd"), &link).unwrap();
    assert!(std::fs::read(&link).is_ok());
    for source in [
        "file:///etc/passwd".to_string(),
        "file:///proc/self/status".to_string(),
        format!("file://{}", link.display()),
    ] {
        let (ok, ev) = prepare_with(&env, &everywhere, &[], &source, &[]).await;
        assert!(!ok, "{source}: {ev}");
        assert_eq!(code(&ev), "source_not_allowed", "{ev}");
        assert!(
            ev["error"]["message"]
                .as_str()
                .unwrap()
                .contains("never read under"),
            "{ev}"
        );
    }
}

/// With `file_url_allowed_paths = /`, other files are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_urls_elsewhere_are_read_when_all_is_allowed() {
    let env = Env::new("");
    let everywhere = ["--set", "conductor.file_url_allowed_paths=/"];
    let image = env.root().join("src/disk.img");
    random_file(&image, 1 << 20, 268);
    let source = format!("file://{}", image.display());
    let (ok, ev) = prepare_with(&env, &everywhere, &[], &source, &[]).await;
    assert!(ok, "{ev}");
}

/// A source answering `Content-Encoding: gzip` is decoded as Ironic's
/// download decodes it: the checksum is over the decoded bytes, and those
/// are what is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_encoded_sources_are_decoded() {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("disk.img"), 1 << 20, 269);
    let gz = std::process::Command::new("gzip")
        .args(["-c", src.join("disk.img").to_str().unwrap()])
        .output()
        .unwrap();
    std::fs::write(src.join("disk.img.gz"), &gz.stdout).unwrap();
    let sha256 = sha256sum(&src.join("disk.img"));
    let base = odd_server(&src).await;
    let source = format!("{base}/gzip/disk.img");
    let sum = [
        "--os-hash-algo",
        "sha256",
        "--os-hash-value",
        sha256.as_str(),
    ];
    let (ok, ev) = prepare_with(&env, &[], &[], &source, &sum).await;
    assert!(ok, "{ev}");
    assert_served(&ev, &src.join("disk.img"));
    let node = ev["node_uuid"].as_str().unwrap();
    served(&env.link_dir().join(node))
        .context("the decoded bytes are served")
        .check(&ev);
}
