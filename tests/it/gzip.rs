//! Compressed serving (`[http] gzip = static`): a master compressed once in
//! the background and served with `Content-Encoding: gzip` to the clients
//! that accept it (ironic-python-agent 13's own download and verify code
//! among them, over plain HTTP and over HTTPS), identity to the others,
//! ranges over the gzip bytes, a dense image served identity, a node
//! prepared again never served the old compressed file, the compressed file
//! evicted with its master, and nothing compressed with the default `gzip =
//! off`. Images are made with qemu-img; the worker is the real `serve`,
//! driven through the real broker.

use crate::common;

use common::agent::ipa_download;
use common::*;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An environment with `[http] gzip = static` (and `extra` in `[http]`).
fn gzip_env(extra: &str) -> Env {
    let env = Env::new("");
    env.gzip_static(extra);
    env
}

/// A raw disk of `virtual_mib` MiB made by qemu-img (sparse), with
/// `data_mib` MiB of random data (seed `seed`) in four places, and the
/// qcow2 qemu-img makes of it: (raw, qcow2), both under `allowed/`.
fn zero_heavy(
    env: &Env,
    name: &str,
    virtual_mib: u64,
    data_mib: usize,
    seed: u64,
) -> (PathBuf, PathBuf) {
    let raw = env.root().join(format!("allowed/{name}.raw"));
    tool(
        "qemu-img",
        &[
            "create",
            "-f",
            "raw",
            raw.to_str().unwrap(),
            &format!("{virtual_mib}M"),
        ],
    );
    let chunk = env.root().join(format!("{name}.chunk"));
    random_file(&chunk, data_mib << 18, seed);
    let data = std::fs::read(&chunk).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&raw).unwrap();
    for i in 0..4u64 {
        f.write_all_at(&data, i * (virtual_mib << 20) / 4 + 12345)
            .unwrap();
    }
    let qcow2 = env.root().join(format!("allowed/{name}.qcow2"));
    qcow2_from(&raw, &qcow2, &[]);
    (raw, qcow2)
}

/// Prepares `node` from `source` through the running worker; the completion.
async fn prepare(env: &Env, broker: &Broker, node: &str, source: &Path) -> serde_json::Value {
    let done = broker
        .call(
            &env.host,
            prepare_cmd(node, &format!("file://{}", source.display())),
        )
        .await;
    assert_eq!(done["status"], "success", "{done}");
    done
}

/// The files of `.gzip/` with `suffix`, waited for up to a minute.
pub(crate) async fn wait_for(env: &Env, suffix: &str) -> PathBuf {
    for _ in 0..600 {
        if let Some(found) = gzip_files(env)
            .into_iter()
            .find(|p| p.to_string_lossy().ends_with(suffix))
        {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no {suffix} file in .gzip: {:?}", gzip_files(env));
}

/// The compressed files and markers in the cache.
fn gzip_files(env: &Env) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(env.master_dir().join(".gzip")) else {
        return Vec::new();
    };
    rd.flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect()
}

/// One HTTP/1.1 request with `headers` on a fresh connection: the status
/// line and header block (lower-cased names), and the body.
async fn raw_request(port: u16, method: &str, path: &str, headers: &[&str]) -> (String, Vec<u8>) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let end = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..end]).to_lowercase();
    (head, out[end + 4..].to_vec())
}

/// The value of header `name` (lower case) in `head`.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(str::trim)
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// The path of the node's published URL.
fn node_path(node: &str) -> String {
    format!("/agent_images/{node}")
}

#[tokio::test]
async fn the_agent_downloads_and_verifies_the_compressed_image() {
    let env = gzip_env("");
    let (raw, qcow2) = zero_heavy(&env, "a", 64, 4, 71);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    let done = prepare(&env, &broker, &node, &qcow2).await;
    let gz = wait_for(&env, ".gz").await;
    served(&raw)
        .context("the completion describes the decoded bytes")
        .check(&done);
    let sha256 = done["image_os_hash_value"].as_str().unwrap();
    let url = done["image_url"].as_str().unwrap();
    // The agent loads its CA file whatever the URL's scheme.
    let ca = common::ca::TestCa::new(&env.root().join("agent-ca"), "ca");
    let (ok, out) = ipa_download(env.root(), url, sha256, &ca.pem, None).await;
    assert!(ok, "the agent downloads and verifies: {out}");
    assert_sent_gzip_only(&worker, &gz, &raw).await;
}

/// The agent's download crossed the wire as the compressed file: the
/// image server sent `gz`'s bytes with `Content-Encoding: gzip`, nothing
/// identity, and less than an eighth of the decoded image `raw`.
async fn assert_sent_gzip_only(worker: &Worker, gz: &Path, raw: &Path) {
    let metrics = worker.metrics_text().await;
    let sent = |encoding: &str| {
        let name = format!(
            "ironic_image_worker_http_response_encoding_bytes_total{{encoding=\"{encoding}\"}}"
        );
        metric(&metrics, &name).unwrap_or(0.0) as u64
    };
    let image = std::fs::metadata(raw).unwrap().len();
    let gzip_bytes = sent("gzip");
    assert_eq!(
        gzip_bytes,
        std::fs::metadata(gz).unwrap().len(),
        "{metrics}"
    );
    assert_eq!(sent("identity"), 0, "{metrics}");
    assert!(
        gzip_bytes * 8 < image,
        "{gzip_bytes} bytes on the wire for {image}"
    );
}

#[tokio::test]
async fn over_https_the_agent_gets_and_verifies_the_compressed_image() {
    let env = gzip_env("");
    let certs = env.root().join("certs");
    crate::tls::make_ca_and_server(&certs, "ca1");
    crate::tls::enable_tls(
        &env,
        &certs.join("ca1-server.pem"),
        &certs.join("ca1-server.key"),
        "",
        "",
    );
    let (raw, qcow2) = zero_heavy(&env, "a", 64, 4, 73);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let done = prepare(&env, &broker, &node(), &qcow2).await;
    let gz = wait_for(&env, ".gz").await;
    let url = done["image_url"].as_str().unwrap();
    assert!(url.starts_with("https://"), "{url}");
    assert_served(&done, &raw);
    let sha256 = done["image_os_hash_value"].as_str().unwrap();
    let (ok, out) = ipa_download(env.root(), url, sha256, &certs.join("ca1.pem"), None).await;
    assert!(ok, "the agent downloads over TLS and verifies: {out}");
    assert_sent_gzip_only(&worker, &gz, &raw).await;
}

#[tokio::test]
async fn clients_that_do_not_ask_for_gzip_get_the_image_as_before() {
    let env = gzip_env("");
    let (raw, qcow2) = zero_heavy(&env, "a", 16, 1, 72);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    prepare(&env, &broker, &node, &qcow2).await;
    wait_for(&env, ".gz").await;
    let expected = std::fs::read(&raw).unwrap();
    for asked in [
        &[][..],
        &["Accept-Encoding: gzip;q=0, deflate"],
        &["Accept-Encoding: identity"],
    ] {
        let (head, body) = raw_request(worker.http_port, "GET", &node_path(&node), asked).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert_eq!(header(&head, "content-encoding"), None, "{asked:?}: {head}");
        assert_eq!(header(&head, "vary"), Some("accept-encoding"), "{head}");
        assert_eq!(
            header(&head, "content-length"),
            Some(expected.len().to_string().as_str())
        );
        assert!(body == expected, "{asked:?}: the image's bytes");
    }
    // curl without --compressed sends no Accept-Encoding.
    let out = env.root().join("curl.out");
    tool(
        "curl",
        &[
            "-sf",
            "-o",
            out.to_str().unwrap(),
            &worker.image_url(&node_path(&node)),
        ],
    );
    assert_eq!(sha256sum(&out), sha256sum(&raw));
}

#[tokio::test]
async fn a_range_of_the_gzip_representation_is_a_slice_of_the_gz() {
    let env = gzip_env("");
    let (raw, qcow2) = zero_heavy(&env, "a", 16, 1, 73);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    prepare(&env, &broker, &node, &qcow2).await;
    let gz_path = wait_for(&env, ".gz").await;
    let gz = std::fs::read(&gz_path).unwrap();
    assert!(gunzip(&gz) == std::fs::read(&raw).unwrap());
    let path = node_path(&node);
    let (head, body) =
        raw_request(worker.http_port, "GET", &path, &["Accept-Encoding: gzip"]).await;
    assert_eq!(header(&head, "content-encoding"), Some("gzip"), "{head}");
    assert!(body == gz);
    let etag = header(&head, "etag").unwrap().to_string();
    let (identity_head, _) = raw_request(worker.http_port, "HEAD", &path, &[]).await;
    let identity_etag = header(&identity_head, "etag").unwrap();
    assert_ne!(etag, identity_etag, "each representation its own ETag");
    let (head, body) = ranged(worker.http_port, &path, None).await;
    assert!(head.starts_with("http/1.1 206"), "{head}");
    assert_eq!(
        header(&head, "content-range"),
        Some(format!("bytes 10-1000/{}", gz.len()).as_str())
    );
    assert_eq!(header(&head, "content-encoding"), Some("gzip"));
    assert!(body == gz[10..=1000]);
    let (head, body) = ranged(worker.http_port, &path, Some(&etag)).await;
    assert!(
        head.starts_with("http/1.1 206") && body == gz[10..=1000],
        "{head}"
    );
    // The identity validator does not resume the gzip bytes: all of them.
    let (head, body) = ranged(worker.http_port, &path, Some(identity_etag)).await;
    assert!(head.starts_with("http/1.1 200") && body == gz, "{head}");
    // Nor does a date, even the gzip form's own: both forms are made within
    // the same second, so a date cannot tell which one a client holds.
    let modified = std::fs::metadata(&gz_path).unwrap().modified().unwrap();
    let date = httpdate::fmt_http_date(modified);
    let (head, body) = ranged(worker.http_port, &path, Some(&date)).await;
    assert!(head.starts_with("http/1.1 200") && body == gz, "{head}");
}

/// `GET path` of bytes 10-1000 of the gzip representation, with `If-Range`.
async fn ranged(port: u16, path: &str, if_range: Option<&str>) -> (String, Vec<u8>) {
    let if_range = if_range.map(|v| format!("If-Range: {v}"));
    let mut headers = vec!["Accept-Encoding: gzip", "Range: bytes=10-1000"];
    headers.extend(if_range.as_deref());
    raw_request(port, "GET", path, &headers).await
}

#[tokio::test]
async fn a_dense_image_is_served_identity() {
    let env = gzip_env("gzip_min_ratio = 2.0");
    let image = env.root().join("allowed/dense.raw");
    random_file(&image, 8 << 20, 74);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    prepare(&env, &broker, &node, &image).await;
    wait_for(&env, ".identity").await;
    let (head, body) = raw_request(
        worker.http_port,
        "GET",
        &node_path(&node),
        &["Accept-Encoding: gzip"],
    )
    .await;
    assert_eq!(header(&head, "content-encoding"), None, "{head}");
    assert_eq!(header(&head, "vary"), None, "no compressed form: {head}");
    assert!(body == std::fs::read(&image).unwrap());
    assert!(
        !gzip_files(&env)
            .iter()
            .any(|p| p.extension().is_some_and(|e| e == "gz"))
    );
}

#[tokio::test]
async fn a_node_prepared_again_is_never_served_the_old_compressed_file() {
    let env = gzip_env("");
    let (_, first) = zero_heavy(&env, "a", 16, 1, 75);
    let (second_raw, second) = zero_heavy(&env, "b", 16, 1, 76);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    prepare(&env, &broker, &node, &first).await;
    let old = wait_for(&env, ".gz").await;
    prepare(&env, &broker, &node, &second).await;
    let expected = std::fs::read(&second_raw).unwrap();
    // At once (the second master's compressed file may not exist yet), and
    // once it does: the second image's bytes, never the first's.
    for _ in 0..2 {
        let (head, body) = raw_request(
            worker.http_port,
            "GET",
            &node_path(&node),
            &["Accept-Encoding: gzip"],
        )
        .await;
        let decoded = match header(&head, "content-encoding") {
            Some("gzip") => gunzip(&body),
            _ => body,
        };
        assert!(decoded == expected, "{head}");
        for _ in 0..600 {
            if gzip_files(&env).iter().filter(|p| *p != &old).count() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let (head, _) = raw_request(
        worker.http_port,
        "HEAD",
        &node_path(&node),
        &["Accept-Encoding: gzip"],
    )
    .await;
    assert_eq!(
        header(&head, "content-encoding"),
        Some("gzip"),
        "the new master's: {head}"
    );
}

#[tokio::test]
async fn eviction_removes_the_compressed_file_with_its_master() {
    let env = gzip_env("");
    let (_, qcow2) = zero_heavy(&env, "a", 16, 1, 77);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    prepare(&env, &broker, &node, &qcow2).await;
    let gz = wait_for(&env, ".gz").await;
    let listed = env.run(&["cache", "list", "--json"]).await;
    let entries: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let master = env.master_dir().join(entries[0]["name"].as_str().unwrap());
    let allocated =
        |p: &Path| std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(p).unwrap()) * 512;
    assert_eq!(
        entries[0]["size"].as_u64().unwrap(),
        allocated(&master) + allocated(&gz),
        "the compressed file counts in the cache's size"
    );
    let cleanup = serde_json::json!({"action": "cleanup", "node_uuid": node, "request_id": uuid::Uuid::new_v4().to_string()});
    let done = broker.call(&env.host, cleanup).await;
    assert_eq!(done["status"], "success", "{done}");
    let out = env.run(&["cache", "clean", "--all-unused"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!master.exists());
    assert_eq!(
        gzip_files(&env),
        Vec::<PathBuf>::new(),
        "removed with its master"
    );
    worker.terminate().await;
}

#[tokio::test]
async fn nothing_is_compressed_with_gzip_off() {
    let env = Env::new("");
    let (_, qcow2) = zero_heavy(&env, "a", 16, 1, 78);
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();
    prepare(&env, &broker, &node, &qcow2).await;
    // No wait for a compression that could come later: with gzip off no
    // master is ever queued for it (the compressor's own unit test).
    let (head, _) = raw_request(
        worker.http_port,
        "HEAD",
        &node_path(&node),
        &["Accept-Encoding: gzip"],
    )
    .await;
    assert_eq!(header(&head, "content-encoding"), None, "{head}");
    assert_eq!(header(&head, "vary"), None, "{head}");
    assert!(!env.master_dir().join(".gzip").exists());
}

#[tokio::test]
async fn config_check_refuses_a_ratio_below_one_and_show_shows_both() {
    let env = gzip_env("gzip_min_ratio = 0.5");
    let out = env.run(&["config", "check"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("[http]gzip_min_ratio (")),
        "{text}"
    );
    let env = gzip_env("gzip_min_ratio = 3.5");
    let out = env.run(&["config", "show"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("gzip = \"static\""), "{text}");
    assert!(text.contains("gzip_min_ratio = 3.5"), "{text}");
    let env = gzip_env("");
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("\"static\"", "\"dynamic\"");
    std::fs::write(&env.config, text).unwrap();
    let out = env.run(&["config", "check"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.code() == Some(1) && text.contains("[http]gzip ("),
        "{text}"
    );
}
