//! HTTPS and HTTP Basic authentication on the image server: ironic-python-
//! agent's own download code (TLS verified against a test CA, credentials
//! from its image_info as Ironic sends them) against the worker; certificate
//! rotation without a restart (a bad new pair keeps the old one); and the
//! listener's bounds over TLS (handshake timeout, eviction with a `503`
//! through TLS). The CAs and certificates are made with openssl.

use crate::common;

use common::agent::ipa_download;
use common::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A CA (`<ca>.pem`) and a server certificate it signs (`<ca>-server.pem`,
/// `.key`) for `localhost`, 127.0.0.1 and ::1, made in `dir`.
pub(crate) fn make_ca_and_server(dir: &Path, ca: &str) {
    common::ca::TestCa::new(dir, ca).issue(
        &format!("{ca}-server"),
        "localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\n\
         extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
    );
}

/// Turns TLS on in `env`'s configuration with `cert`/`key`, publishing
/// `https://` URLs, plus extra lines in `[http]` and `[deploy]`.
pub(crate) fn enable_tls(env: &Env, cert: &Path, key: &Path, http_extra: &str, deploy_extra: &str) {
    let text = std::fs::read_to_string(&env.config).unwrap();
    let text = text
        .replace(
            "[http]\n",
            &format!(
                "[http]\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n{http_extra}\n",
                cert.display(),
                key.display()
            ),
        )
        .replace(
            "http_url = \"http://127.0.0.1:",
            &format!("{deploy_extra}\nhttp_url = \"https://127.0.0.1:"),
        );
    std::fs::write(&env.config, text).unwrap();
}

/// A fresh TLS connection to the image server trusting only `ca`.
async fn connect(
    port: u16,
    ca: &Path,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await
}

/// `GET path` over a fresh TLS connection trusting only `ca`: the status
/// line and the rest of the answer, or the TLS error.
async fn tls_get(port: u16, ca: &Path, path: &str) -> std::io::Result<String> {
    let mut s = connect(port, ca).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// An environment serving over TLS (CA `ca1`, files `server.pem` and
/// `server.key` in the certificate directory), with extra lines in `[http]`
/// and `[deploy]`, and a node prepared from a random image: the env, its
/// certificate directory, the image URL and the image's SHA-256.
async fn tls_env(http_extra: &str, deploy_extra: &str) -> (Env, PathBuf, String, String) {
    let env = Env::new("");
    let certs = env.root().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    make_ca_and_server(&certs, "ca1");
    let (cert, key) = (certs.join("server.pem"), certs.join("server.key"));
    std::fs::copy(certs.join("ca1-server.pem"), &cert).unwrap();
    std::fs::copy(certs.join("ca1-server.key"), &key).unwrap();
    enable_tls(&env, &cert, &key, http_extra, deploy_extra);
    let image = env.root().join("allowed/disk.img");
    random_file(&image, 3 << 20, 26);
    let source = format!("file://{}", image.display());
    let (ok, done) = env.prepare(&node(), &source, &[]).await;
    assert!(ok, "{done}");
    let url = done["image_url"].as_str().unwrap().to_string();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    (env, certs, url, sha256sum(&image))
}

/// The image port's own Basic authentication (`[http]`).
const BASIC: &str =
    "auth_strategy = \"http_basic\"\nauth_user = \"ironic\"\nauth_password = \"s3cret-pw\"";

#[tokio::test]
async fn agent_downloads_over_https_with_basic_auth() {
    let (env, certs, url, sha) = tls_env(BASIC, "").await;
    let worker = env.serve().await;
    let ca = certs.join("ca1.pem");
    let (ok, out) = ipa_download(env.root(), &url, &sha, &ca, Some(("ironic", "s3cret-pw"))).await;
    assert!(ok, "the agent downloads with Ironic's credentials: {out}");
    let (ok, out) = ipa_download(env.root(), &url, &sha, &ca, Some(("ironic", "wrong"))).await;
    assert!(
        !ok && out.contains("401"),
        "a wrong password is refused: {out}"
    );
    let (ok, out) = ipa_download(env.root(), &url, &sha, &ca, None).await;
    assert!(
        !ok && out.contains("401"),
        "no credentials are refused: {out}"
    );
    // The challenge names the scheme.
    let answer = tls_get(env.http_port, &ca, "/").await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(
        answer.contains("www-authenticate: Basic realm="),
        "{answer}"
    );
    // An agent that does not trust the CA does not download.
    let other = env.root().join("other");
    std::fs::create_dir_all(&other).unwrap();
    make_ca_and_server(&other, "ca9");
    let (ok, out) = ipa_download(
        env.root(),
        &url,
        &sha,
        &other.join("ca9.pem"),
        Some(("ironic", "s3cret-pw")),
    )
    .await;
    assert!(!ok && out.contains("CERTIFICATE_VERIFY_FAILED"), "{out}");
    // Plain HTTP on the TLS port gets nothing served; /metrics stays plain.
    let plain = reqwest::get(worker.image_url(path_of(&url))).await;
    assert!(plain.is_err(), "{plain:?}");
    let text = worker.metrics_text().await;
    assert!(
        metric(
            &text,
            "ironic_image_worker_http_requests_total{status=\"401\"}"
        )
        .unwrap()
            >= 3.0,
        "{text}"
    );
    // The untrusting agent and the plain client.
    let sample =
        "ironic_image_worker_http_connections_dropped_total{reason=\"tls_handshake_failed\"}";
    worker
        .wait_metrics(sample, |t| metric(t, sample) == Some(2.0))
        .await;
    worker.terminate().await;
}

#[tokio::test]
async fn agent_downloads_over_https_without_auth() {
    let (env, certs, url, sha) = tls_env("", "").await;
    let worker = env.serve().await;
    let (ok, out) = ipa_download(env.root(), &url, &sha, &certs.join("ca1.pem"), None).await;
    assert!(ok, "{out}");
    worker.terminate().await;
}

/// The path of an image URL.
fn path_of(url: &str) -> &str {
    &url[url.find("/agent_images/").unwrap()..]
}

/// Replaces `to` with a copy of `from` by a rename, as cert-manager (or
/// a symlink swap of a mounted secret) does.
fn replace(from: &Path, to: &Path) {
    let tmp = to.with_extension("new");
    std::fs::copy(from, &tmp).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

/// A GET on an open TLS connection (keep-alive): the whole answer.
async fn get_on<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    path: &str,
) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn rotated_certificate_reaches_new_handshakes() {
    let (env, certs, url, _) = tls_env("", "").await;
    make_ca_and_server(&certs, "ca2");
    let (ca1, ca2) = (certs.join("ca1.pem"), certs.join("ca2.pem"));
    let (cert, key) = (certs.join("server.pem"), certs.join("server.key"));
    let worker = env.serve().await;
    let (port, path) = (env.http_port, path_of(&url));
    let ok = |answer: std::io::Result<String>| answer.is_ok_and(|a| a.starts_with("HTTP/1.1 200"));
    assert!(ok(tls_get(port, &ca1, path).await));
    let mut before = connect(port, &ca1).await.unwrap();
    // The certificate first: it does not match the key yet, so the old pair
    // stays in use.
    replace(&certs.join("ca2-server.pem"), &cert);
    assert!(
        ok(tls_get(port, &ca1, path).await),
        "kept until the pair matches"
    );
    replace(&certs.join("ca2-server.key"), &key);
    assert!(
        ok(tls_get(port, &ca2, path).await),
        "the new pair is served"
    );
    let refused = tls_get(port, &ca1, path).await;
    assert!(
        refused.is_err(),
        "the old CA no longer verifies: {refused:?}"
    );
    // A connection made before the rotation goes on.
    assert!(get_on(&mut before, path).await.starts_with("HTTP/1.1 200"));
    // A broken key file keeps the current pair.
    std::fs::write(certs.join("broken.key"), "not a key\n").unwrap();
    replace(&certs.join("broken.key"), &key);
    assert!(
        ok(tls_get(port, &ca2, path).await),
        "a bad new pair keeps the old one"
    );
    let text = worker.metrics_text().await;
    assert_eq!(
        metric(
            &text,
            "ironic_image_worker_http_tls_reloads_total{result=\"ok\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "ironic_image_worker_http_tls_reloads_total{result=\"error\"}"
        ),
        Some(2.0),
        "{text}"
    );
    worker.terminate().await;
}

#[tokio::test]
async fn tls_handshake_is_bounded_by_the_header_timeout() {
    let (env, _certs, _url, _) = tls_env("header_timeout = 1", "").await;
    let worker = env.serve().await;
    let mut silent = TcpStream::connect(("127.0.0.1", env.http_port))
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(60), silent.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "closed: {read:?}");
    let sample =
        "ironic_image_worker_http_connections_dropped_total{reason=\"tls_handshake_timeout\"}";
    worker
        .wait_metrics(sample, |t| metric(t, sample) == Some(1.0))
        .await;
    worker.terminate().await;
}

#[tokio::test]
async fn tls_connection_evicted_at_the_cap_gets_503_through_tls() {
    let (env, certs, url, _) = tls_env("max_connections = 2", "").await;
    let ca = certs.join("ca1.pem");
    let worker = env.serve().await;
    let port = env.http_port;
    // Two connections that shook hands and sent nothing fill the cap.
    let mut idle = connect(port, &ca).await.unwrap();
    // The server's session tickets follow the end of its handshake.
    tokio::time::timeout(Duration::from_secs(60), idle.get_ref().0.readable())
        .await
        .expect("the server finished its handshake")
        .unwrap();
    let _other = connect(port, &ca).await.unwrap();
    let answer = tls_get(port, &ca, path_of(&url)).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let mut out = Vec::new();
    idle.read_to_end(&mut out).await.unwrap();
    let out = String::from_utf8_lossy(&out);
    assert!(
        out.starts_with("HTTP/1.1 503"),
        "the oldest made room: {out}"
    );
    let text = worker.metrics_text().await;
    assert_eq!(
        metric(
            &text,
            "ironic_image_worker_http_connections_dropped_total{reason=\"evicted\"}"
        ),
        Some(1.0),
        "{text}"
    );
    worker.terminate().await;
}

/// A certificate path whose reads block (the key replaced by a FIFO
/// nobody writes, as a hung network mount would behave) freezes nothing:
/// handshakes go on with the pair in use, `/healthz` answers, and once the
/// FIFO yields (an empty key) the bad pair is refused and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_certificate_path_freezes_nothing() {
    let (env, certs, url, _) = tls_env("", "").await;
    let key = certs.join("server.key");
    let worker = env.serve().await;
    let (port, path) = (env.http_port, path_of(&url));
    let ca = certs.join("ca1.pem");
    std::fs::remove_file(&key).unwrap();
    tool("mkfifo", &[key.to_str().unwrap()]);
    // More handshakes at once than the worker has runtime threads.
    let mut handshakes = Vec::new();
    for _ in 0..8 {
        let (ca, path) = (ca.clone(), path.to_string());
        handshakes.push(tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(20), tls_get(port, &ca, &path)).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let health = tokio::time::timeout(
        Duration::from_secs(10),
        reqwest::get(worker.metrics_url("/healthz")),
    )
    .await;
    assert!(
        health
            .as_ref()
            .is_ok_and(|r| r.as_ref().is_ok_and(|r| r.status() == 200)),
        "/healthz froze: {health:?}"
    );
    for h in handshakes {
        let answer = h.await.unwrap();
        assert!(
            matches!(&answer, Ok(Ok(a)) if a.starts_with("HTTP/1.1 200")),
            "served with the pair in use: {answer:?}"
        );
    }
    // The FIFO yields an empty key: refused, the old pair still serves.
    {
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&key);
    }
    let sample = "ironic_image_worker_http_tls_reloads_total{result=\"error\"}";
    worker
        .wait_metrics(sample, |t| metric(t, sample) == Some(1.0))
        .await;
    assert!(
        tls_get(port, &ca, path)
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200")
    );
    worker.terminate().await;
}

#[test]
fn tls_and_auth_options_are_checked() {
    use ironic_image_worker::config::{AuthStrategy, Config, Files, TlsMinVersion};
    let dir = tempfile::tempdir().unwrap();
    make_ca_and_server(dir.path(), "ca1");
    let cert = format!(
        "http.tls_cert_file={}",
        dir.path().join("ca1-server.pem").display()
    );
    let key = format!(
        "http.tls_key_file={}",
        dir.path().join("ca1-server.key").display()
    );
    let load = |items: &[&str]| {
        let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        Config::load_from(&Files::default(), &[], &items)
    };
    let refused: &[&[&str]] = &[
        &[&cert],
        &[&key],
        &[
            "http.tls_cert_file=/nonexistent/cert.pem",
            "http.tls_key_file=/nonexistent/k",
        ],
        &[&cert, &key, "http.tls_min_version=1.1"],
        &[&cert, &key, "deploy.http_url=http://127.0.0.1:8080"],
        &["http.auth_strategy=http_basic", "http.auth_user=u"],
        &["http.auth_strategy=http_basic", "http.auth_password=p"],
        &[
            "http.auth_strategy=http_basic",
            "http.auth_user=a:b",
            "http.auth_password=p",
        ],
        &["http.auth_strategy=keystone"],
        &[
            "deploy.image_server_auth_strategy=http_basic",
            "deploy.image_server_user=u",
        ],
        &[
            "deploy.image_server_auth_strategy=http_basic",
            "deploy.image_server_password=p",
        ],
        &[
            "deploy.image_server_auth_strategy=http_basic",
            "deploy.image_server_user=a:b",
            "deploy.image_server_password=p",
        ],
        &["deploy.image_server_auth_strategy=keystone"],
    ];
    for items in refused {
        assert!(load(items).is_err(), "{items:?} must be refused");
    }
    let c = load(&[&cert, &key, "http.listen=[::1]:8443"]).unwrap();
    assert_eq!(c.http_url(), "https://[::1]:8443", "derived as https://");
    assert_eq!(
        c.http.tls_min_version,
        TlsMinVersion::Tls13,
        "Ironic's default"
    );
    let c = load(&[
        "deploy.image_server_auth_strategy=http_basic",
        "deploy.image_server_user=ironic",
        "deploy.image_server_password=pw",
    ])
    .unwrap();
    assert_eq!(c.deploy.image_server_user, "ironic");
    // Ironic's own options, from its ironic.conf.
    let conf = dir.path().join("ironic.conf");
    std::fs::write(
        &conf,
        "[deploy]\nimage_server_auth_strategy = http_basic\nimage_server_user = ironic\n\
         image_server_password = from-ironic\n",
    )
    .unwrap();
    let files = Files {
        ironic_conf: Some(conf),
        ..Files::default()
    };
    let c = Config::load_from(&files, &[], &[]).unwrap();
    assert_eq!(c.deploy.image_server_auth_strategy, AuthStrategy::HttpBasic);
    assert_eq!(c.deploy.image_server_password, "from-ironic");
}
