//! OCI registry sources against a real registry: Debian's `docker-registry`
//! (the CNCF distribution registry) started by each test on its own port
//! with its storage in the test's temporary directory, plain HTTP or TLS
//! (a test CA made with openssl), with or without htpasswd authentication.
//! Artifacts are pushed with the registry's own upload API (blobs, then
//! manifests and indexes as ORAS and podman lay them out: one layer per
//! disk image, a `disktype` annotation and a platform per index entry).

use crate::common;

use base64::Engine;
use common::*;
use serde_json::{Value, json};
use sha2::Digest as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// How a registry authenticates its clients.
enum Auth<'a> {
    /// htpasswd with this user and password (Basic).
    Htpasswd((&'a str, &'a str)),
    /// Bearer tokens from the token service at this realm, signed by the key
    /// of this certificate.
    Token(&'a str, &'a Path),
}

/// The `service` and `issuer` of the test's token server (the registry
/// checks both in every token).
const TOKEN_SERVICE: &str = "iiw-registry";
const TOKEN_ISSUER: &str = "iiw-token-issuer";

/// A running registry, stopped when dropped.
struct Registry {
    child: std::process::Child,
    port: u16,
    scheme: &'static str,
    storage: PathBuf,
    /// `Authorization` for pushing, when the registry wants one.
    auth: Option<String>,
    client: reqwest::Client,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A test CA and a certificate for `localhost` and 127.0.0.1 signed by it.
fn make_certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ca = common::ca::TestCa::new(dir, "ca");
    let (cert, key) = ca.issue(
        "server",
        "localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    );
    (ca.pem, cert, key)
}

impl Registry {
    /// Starts a registry under `dir`: with `user` (htpasswd, Basic) and
    /// with `tls`, when asked.
    async fn start(dir: &Path, user: Option<(&str, &str)>, tls: bool) -> Registry {
        Registry::start_with(dir, user.map(Auth::Htpasswd), tls).await
    }

    /// Starts a registry under `dir` that takes Bearer tokens only: from
    /// the token service at `realm` (`service` and `issuer` as the test's
    /// token server signs them), signed by the key of `cert`.
    async fn start_token(dir: &Path, realm: &str, cert: &Path) -> Registry {
        Registry::start_with(dir, Some(Auth::Token(realm, cert)), false).await
    }

    async fn start_with(dir: &Path, auth: Option<Auth<'_>>, tls: bool) -> Registry {
        std::fs::create_dir_all(dir).unwrap();
        let port = free_port();
        let storage = dir.join("storage");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            storage.display()
        );
        let mut client = reqwest::Client::builder();
        if tls {
            let (ca, cert, key) = make_certs(dir);
            config += &format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                cert.display(),
                key.display()
            );
            let pem = std::fs::read(&ca).unwrap();
            client = client.tls_certs_only(reqwest::Certificate::from_pem_bundle(&pem).unwrap());
        }
        if let Some(Auth::Token(realm, cert)) = auth {
            config += &format!(
                "auth:\n  token:\n    realm: {realm}\n    service: {TOKEN_SERVICE}\n    issuer: {TOKEN_ISSUER}\n    rootcertbundle: {}\n",
                cert.display()
            );
        }
        let auth = auth.and_then(|a| match a {
            Auth::Htpasswd(user) => Some(user),
            Auth::Token(..) => None,
        });
        let auth = auth.map(|(u, p)| {
            let line = tool("htpasswd", &["-Bbn", u, p]);
            std::fs::write(dir.join("htpasswd"), line.trim()).unwrap();
            config += &format!(
                "auth:\n  htpasswd:\n    realm: iiw-test\n    path: {}\n",
                dir.join("htpasswd").display()
            );
            let b64 = base64::engine::general_purpose::STANDARD;
            format!("Basic {}", b64.encode(format!("{u}:{p}")))
        });
        std::fs::write(dir.join("config.yml"), config).unwrap();
        let child = std::process::Command::new("/usr/bin/docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("registry.log")).unwrap())
            .spawn()
            .expect("/usr/bin/docker-registry (apt-get install docker-registry)");
        let reg = Registry {
            child,
            port,
            scheme: if tls { "https" } else { "http" },
            storage,
            auth,
            client: client.build().unwrap(),
        };
        for _ in 0..100 {
            if reg.client.get(reg.url("")).send().await.is_ok() {
                return reg;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "the registry did not start: {:?}",
            std::fs::read_to_string(dir.join("registry.log"))
        );
    }

    fn url(&self, path: &str) -> String {
        format!("{}://127.0.0.1:{}/v2/{path}", self.scheme, self.port)
    }

    /// `oci://127.0.0.1:<port>/<rest>`.
    fn oci(&self, rest: &str) -> String {
        format!("oci://127.0.0.1:{}/{rest}", self.port)
    }

    fn req(&self, method: reqwest::Method, url: &str) -> reqwest::RequestBuilder {
        let r = self.client.request(method, url);
        match &self.auth {
            Some(a) => r.header("Authorization", a),
            None => r,
        }
    }

    /// Uploads a blob and returns its digest.
    async fn blob(&self, repo: &str, data: &[u8]) -> String {
        let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)));
        let r = self
            .req(
                reqwest::Method::POST,
                &self.url(&format!("{repo}/blobs/uploads/")),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202, "upload start");
        let loc = r.headers()["location"].to_str().unwrap().to_string();
        let loc = reqwest::Url::parse(&self.url(""))
            .unwrap()
            .join(&loc)
            .unwrap();
        let sep = if loc.query().is_some() { '&' } else { '?' };
        let r = self
            .req(reqwest::Method::PUT, &format!("{loc}{sep}digest={digest}"))
            .header("Content-Type", "application/octet-stream")
            .body(data.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "blob upload");
        digest
    }

    /// Puts a manifest or index under `reference` (a tag, or its digest
    /// when `None`) and returns its digest.
    async fn manifest(
        &self,
        repo: &str,
        reference: Option<&str>,
        doc: &Value,
        media: &str,
    ) -> String {
        let body = serde_json::to_vec(doc).unwrap();
        let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&body)));
        let r = self
            .req(
                reqwest::Method::PUT,
                &self.url(&format!(
                    "{repo}/manifests/{}",
                    reference.unwrap_or(&digest)
                )),
            )
            .header("Content-Type", media)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "manifest put: {}", r.text().await.unwrap());
        digest
    }

    /// Pushes `file` as a single-layer artifact (as ORAS does) and returns
    /// (manifest digest, manifest size, blob digest).
    async fn artifact(&self, repo: &str, file: &Path, layer_type: &str) -> (String, usize, String) {
        let data = std::fs::read(file).unwrap();
        let blob = self.blob(repo, &data).await;
        let config = self.blob(repo, b"{}").await;
        let doc = json!({
            "schemaVersion": 2, "mediaType": MANIFEST,
            "artifactType": "application/vnd.unknown.artifact.v1",
            "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": config, "size": 2},
            "layers": [{"mediaType": layer_type, "digest": blob, "size": data.len(),
                "annotations": {"org.opencontainers.image.title":
                    file.file_name().unwrap().to_str().unwrap()}}],
        });
        let size = serde_json::to_vec(&doc).unwrap().len();
        (self.manifest(repo, None, &doc, MANIFEST).await, size, blob)
    }

    /// Tags an index of `entries` (manifest digest, size, disktype, arch).
    async fn index(&self, repo: &str, tag: &str, entries: &[(&str, usize, &str, &str)]) -> String {
        let manifests: Vec<Value> = entries
            .iter()
            .map(|(d, size, disktype, arch)| {
                json!({"mediaType": MANIFEST, "digest": d, "size": size,
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {"disktype": disktype}})
            })
            .collect();
        let doc = json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests});
        self.manifest(repo, Some(tag), &doc, INDEX).await
    }

    /// The file the registry stores blob `digest` in.
    fn stored_blob(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.storage.join(format!(
            "docker/registry/v2/blobs/sha256/{}/{hex}/data",
            &hex[..2]
        ))
    }
}

/// A raw disk with content from `seed` and its qcow2.
fn disk(dir: &Path, name: &str, seed: u64) -> (PathBuf, PathBuf) {
    let raw = dir.join(format!("{name}.raw"));
    patchy_raw(&raw, 4 << 20, seed);
    let qcow2 = dir.join(format!("{name}.qcow2"));
    qcow2_from(&raw, &qcow2, &[]);
    (raw, qcow2)
}

/// The served bytes of a successful prepare match its completion's
/// checksums and the `want` reference file.
#[track_caller]
fn assert_serves(env: &Env, done: &Value, want: &Path) {
    assert_served(done, want);
    served(&env.served_file(done))
        .context("served bytes")
        .check(done);
}

/// Also fetches what a running worker serves at `image_url`.
async fn assert_http_serves(done: &Value, want: &Path) {
    let (status, body) = get(done["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(body, std::fs::read(want).unwrap(), "bytes served over HTTP");
}

fn plain_env() -> Env {
    Env::new("[oci]\npermit_fallback_to_http_transport = true\n")
}

#[tokio::test]
async fn tag_and_digests_resolve_to_one_cached_master() {
    let env = plain_env();
    let reg = Registry::start(&env.root().join("registry"), None, false).await;
    let (raw, qcow2) = disk(env.root(), "disk", 1);
    let (manifest, size, _) = reg
        .artifact("img/disk", &qcow2, "application/octet-stream")
        .await;
    let index = reg
        .index("img/disk", "v1", &[(&manifest, size, "qcow2", "amd64")])
        .await;

    let (ok, done) = env.prepare(&node(), &reg.oci("img/disk:v1"), &[]).await;
    assert!(ok, "{done}");
    assert_eq!(done["cache"], "miss");
    assert_eq!(done["converted"], true);
    assert_eq!(
        done["oci_image_manifest_url"],
        reg.oci(&format!("img/disk@{manifest}"))
    );
    assert_serves(&env, &done, &raw);

    // The manifest's digest and the index's name the same blob: one master.
    for digest in [&manifest, &index] {
        let (ok, again) = env
            .prepare(&node(), &reg.oci(&format!("img/disk@{digest}")), &[])
            .await;
        assert!(ok, "{again}");
        assert_eq!(again["cache"], "hit", "{digest}");
        assert_eq!(
            again["oci_image_manifest_url"],
            done["oci_image_manifest_url"]
        );
        assert_serves(&env, &again, &raw);
    }
    assert_eq!(env.masters().len(), 1, "{:?}", env.masters());

    let (ok, gone) = env.prepare(&node(), &reg.oci("img/disk:v2"), &[]).await;
    assert!(!ok);
    assert_eq!(gone["error"]["code"], "source_not_found", "{gone}");
}

#[tokio::test]
async fn index_choice_follows_disktype_and_cpu_arch() {
    let env = plain_env();
    let reg = Registry::start(&env.root().join("registry"), None, false).await;
    let (raw_amd64, _) = disk(env.root(), "raw-amd64", 11);
    let (q_amd64_raw, q_amd64) = disk(env.root(), "q-amd64", 12);
    let (q_arm64_raw, q_arm64) = disk(env.root(), "q-arm64", 13);
    let (ra, ras, _) = reg
        .artifact("os", &raw_amd64, "application/octet-stream")
        .await;
    let (qa, qas, _) = reg
        .artifact("os", &q_amd64, "application/octet-stream")
        .await;
    let (qr, qrs, _) = reg
        .artifact("os", &q_arm64, "application/octet-stream")
        .await;
    reg.index(
        "os",
        "multi",
        &[
            (&ra, ras, "raw", "amd64"),
            (&qa, qas, "qcow2", "amd64"),
            (&qr, qrs, "qcow2", "arm64"),
        ],
    )
    .await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let cases = [
        ("x86_64", "local", &q_amd64_raw, &qa),
        ("x86_64", "http", &raw_amd64, &ra),
        ("aarch64", "local", &q_arm64_raw, &qr),
        ("arm64", "http", &q_arm64_raw, &qr),
    ];
    for (arch, mode, want, manifest) in cases {
        let mut cmd = prepare_cmd(&node(), &reg.oci("os:multi"));
        cmd["instance_info"]["image_download_source"] = json!(mode);
        cmd["properties"] = json!({"cpu_arch": arch});
        let done = broker.call(&env.host, cmd).await;
        assert_valid_completion(&done);
        assert_eq!(done["status"], "success", "{arch} {mode}: {done}");
        assert_eq!(
            done["oci_image_manifest_url"],
            reg.oci(&format!("os@{manifest}")),
            "{arch} {mode}"
        );
        assert_serves(&env, &done, want);
        assert_http_serves(&done, want).await;
    }
    let mut cmd = prepare_cmd(&node(), &reg.oci("os:multi"));
    cmd["properties"] = json!({"cpu_arch": "s390x"});
    let done = broker.call(&env.host, cmd).await;
    assert_eq!(done["error"]["code"], "source_not_found", "{done}");
    worker.terminate().await;
}

#[tokio::test]
async fn zstd_layers_are_decompressed_and_served_converted() {
    let env = plain_env();
    let reg = Registry::start(&env.root().join("registry"), None, false).await;
    let (raw, qcow2) = disk(env.root(), "z", 21);
    let zst = env.root().join("z.qcow2.zst");
    let packed = zstd::encode_all(std::fs::File::open(&qcow2).unwrap(), 3).unwrap();
    std::fs::write(&zst, packed).unwrap();
    let (m, s, _) = reg.artifact("z", &zst, "application/zstd").await;
    reg.index("z", "latest", &[(&m, s, "qcow2", "amd64")]).await;
    // No tag: `latest`, as Ironic takes it.
    let (ok, done) = env.prepare(&node(), &reg.oci("z"), &[]).await;
    assert!(ok, "{done}");
    assert_eq!(done["converted"], true);
    assert_serves(&env, &done, &raw);
}

#[tokio::test]
async fn blobs_not_matching_their_digest_are_refused() {
    let env = plain_env();
    let reg = Registry::start(&env.root().join("registry"), None, false).await;
    let (_, qcow2) = disk(env.root(), "bad", 31);
    let (m, s, blob) = reg
        .artifact("bad", &qcow2, "application/octet-stream")
        .await;
    reg.index("bad", "v1", &[(&m, s, "qcow2", "amd64")]).await;
    // The registry's storage goes bad: same length, one byte changed.
    let stored = reg.stored_blob(&blob);
    let mut bytes = std::fs::read(&stored).unwrap();
    bytes[100_000] ^= 0xff;
    std::fs::write(&stored, bytes).unwrap();
    let (ok, done) = env.prepare(&node(), &reg.oci("bad:v1"), &[]).await;
    assert!(!ok);
    assert_eq!(done["error"]["code"], "checksum_mismatch", "{done}");
    assert!(
        env.masters().is_empty(),
        "nothing cached: {:?}",
        env.masters()
    );
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
    // (A manifest gone bad is not served at all by this registry: it checks
    // manifests itself and answers 500.)
}

#[tokio::test]
async fn credentials_over_tls_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Registry::start(
        &dir.path().join("registry"),
        Some(("puller", "s3cret-pw")),
        true,
    )
    .await;
    let auth_file = dir.path().join("config.json");
    let env = Env::new(&format!(
        "[oci]\nverify_ca = \"{}\"\nauthentication_config = \"{}\"\n",
        dir.path().join("registry/ca.pem").display(),
        auth_file.display()
    ));
    let (raw, qcow2) = disk(env.root(), "priv", 41);
    let (m, s, _) = reg
        .artifact("priv/os", &qcow2, "application/octet-stream")
        .await;
    reg.index("priv/os", "v1", &[(&m, s, "qcow2", "amd64")])
        .await;
    let src = reg.oci("priv/os:v1");

    // No credentials anywhere: a clear refusal.
    let (ok, done) = env.prepare(&node(), &src, &[]).await;
    assert!(!ok);
    assert_eq!(done["error"]["code"], "source_not_allowed", "{done}");
    assert!(
        done["error"]["message"]
            .as_str()
            .unwrap()
            .contains("requires credentials"),
        "{done}"
    );

    // The config file, read on use (written after the worker started).
    let b64 = base64::engine::general_purpose::STANDARD;
    let registry = format!("127.0.0.1:{}", reg.port);
    let write_auth = |pw: &str| {
        let auth =
            json!({"auths": {registry.clone(): {"auth": b64.encode(format!("puller:{pw}"))}}});
        std::fs::write(&auth_file, auth.to_string()).unwrap();
    };
    write_auth("wrong");
    let (ok, done) = env.prepare(&node(), &src, &[]).await;
    assert!(!ok);
    assert_eq!(done["error"]["code"], "source_not_allowed", "{done}");
    assert!(
        done["error"]["message"]
            .as_str()
            .unwrap()
            .contains("refused"),
        "{done}"
    );
    write_auth("s3cret-pw");
    let (ok, done) = env.prepare(&node(), &src, &[]).await;
    assert!(ok, "{done}");
    assert_serves(&env, &done, &raw);
    std::fs::remove_file(&auth_file).unwrap();

    // Pull secrets in the command: instance_info's (base64, as Metal3
    // passes it) wins over driver_info's; driver_info's alone is used too.
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let good = b64.encode("puller:s3cret-pw");
    let secrets = [
        (Some(good.as_str()), Some("puller:wrong"), "success"),
        (Some("puller:wrong"), Some(good.as_str()), "error"),
        (None, Some("puller:s3cret-pw"), "success"),
    ];
    for (ii, di, want) in secrets {
        let mut cmd = prepare_cmd(&node(), &src);
        if let Some(s) = ii {
            cmd["instance_info"]["image_pull_secret"] = json!(s);
        }
        if let Some(s) = di {
            cmd["driver_info"] = json!({"image_pull_secret": s});
        }
        let done = broker.call(&env.host, cmd).await;
        assert_valid_completion(&done);
        assert_eq!(done["status"], want, "{ii:?} {di:?}: {done}");
        let text = done.to_string();
        assert!(
            !text.contains("s3cret") && !text.contains(&good),
            "secret echoed: {text}"
        );
    }
    worker.terminate().await;

    // No secret in the sidecars or the worker's own files.
    for entry in walk(env.root()) {
        let name = entry.to_string_lossy();
        if name.ends_with(".json") || name.ends_with(".log") {
            let text = std::fs::read_to_string(&entry).unwrap_or_default();
            assert!(
                !text.contains("s3cret") && !text.contains(&good),
                "secret in {name}"
            );
        }
    }
}

#[tokio::test]
async fn tls_registry_with_an_unknown_ca_is_refused() {
    let env = Env::new("");
    let reg = Registry::start(&env.root().join("registry"), None, true).await;
    let (_, qcow2) = disk(env.root(), "t", 51);
    let (m, s, _) = reg.artifact("t", &qcow2, "application/octet-stream").await;
    reg.index("t", "v1", &[(&m, s, "qcow2", "amd64")]).await;
    let (ok, done) = env.prepare(&node(), &reg.oci("t:v1"), &[]).await;
    assert!(!ok, "{done}");
    assert_eq!(done["error"]["code"], "source_unreachable", "{done}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// A prepare started by Ironic's own notification (its notifier, the real
/// broker) for an OCI node: the payload carries `properties` (so the node's
/// `cpu_arch` chooses the artifact) but not `driver_info`, and Ironic masks
/// `instance_info.image_pull_secret` (`******`): the worker then uses
/// `[oci]authentication_config`, never the mask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notified_prepare_follows_cpu_arch_and_the_authentication_config() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Registry::start(
        &dir.path().join("registry"),
        Some(("puller", "n0tified-pw")),
        false,
    )
    .await;
    let auth_file = dir.path().join("config.json");
    let b64 = base64::engine::general_purpose::STANDARD;
    let auth = json!({"auths": {format!("127.0.0.1:{}", reg.port):
        {"auth": b64.encode("puller:n0tified-pw")}}});
    std::fs::write(&auth_file, auth.to_string()).unwrap();
    let env = Env::new(&format!(
        "[oci]\npermit_fallback_to_http_transport = true\nauthentication_config = \"{}\"\n",
        auth_file.display()
    ));
    let (amd64_raw, amd64) = disk(env.root(), "n-amd64", 61);
    let (arm64_raw, arm64) = disk(env.root(), "n-arm64", 62);
    let (ma, sa, _) = reg
        .artifact("n/os", &amd64, "application/octet-stream")
        .await;
    let (mr, sr, _) = reg
        .artifact("n/os", &arm64, "application/octet-stream")
        .await;
    reg.index(
        "n/os",
        "v1",
        &[(&ma, sa, "qcow2", "amd64"), (&mr, sr, "qcow2", "arm64")],
    )
    .await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    let node = node();
    let spec = json!({"node": node, "status": "start", "prev_state": "available",
        "state": "deploying", "target": "active", "event": "deploy",
        "instance_info": {"image_source": reg.oci("n/os:v1"),
            "image_pull_secret": "puller:wrong-in-instance-info"},
        "driver_info": {"image_pull_secret": "puller:wrong-in-driver-info"},
        "properties": {"cpu_arch": "aarch64", "memory_mb": 4096}});
    emit_notifications(&env.host, &[spec]);
    let ev = tap.collect(&env.host, 1, Duration::from_secs(60)).await;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0]["action"], "prepare");
    assert_eq!(ev[0]["status"], "success", "{}", ev[0]);
    assert_eq!(
        ev[0]["oci_image_manifest_url"],
        reg.oci(&format!("n/os@{mr}")),
        "the aarch64 node gets the arm64 artifact"
    );
    assert_serves(&env, &ev[0], &arm64_raw);
    assert_http_serves(&ev[0], &arm64_raw).await;
    assert_ne!(md5sum(&arm64_raw), md5sum(&amd64_raw));
}

/// The test's token server (tests/helpers/token_server.py), killed when
/// dropped, and the file it logs its requests to.
struct TokenServer {
    child: std::process::Child,
    realm: String,
    log: PathBuf,
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl TokenServer {
    /// Starts it with a new key and its self-signed certificate (made with
    /// openssl under `dir`, `token.key` and `token.pem`) for `users`.
    async fn start(dir: &Path, users: &[&str]) -> TokenServer {
        std::fs::create_dir_all(dir).unwrap();
        let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
        tool(
            "openssl",
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN={TOKEN_ISSUER}"),
                "-keyout",
                &p("token.key"),
                "-out",
                &p("token.pem"),
            ],
        );
        let port = free_port();
        let log = dir.join("token-requests.jsonl");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/token_server.py");
        let child = std::process::Command::new("python3")
            .arg(script)
            .args([
                port.to_string(),
                p("token.key"),
                p("token.pem"),
                TOKEN_ISSUER.to_string(),
                log.to_str().unwrap().to_string(),
            ])
            .args(users)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("token-server.log")).unwrap())
            .spawn()
            .unwrap();
        let server = TokenServer {
            child,
            realm: format!("http://127.0.0.1:{port}/token"),
            log,
        };
        for _ in 0..100 {
            if reqwest::get(&server.realm).await.is_ok() {
                std::fs::write(&server.log, "").unwrap();
                return server;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "the token server did not start: {:?}",
            std::fs::read_to_string(dir.join("token-server.log"))
        );
    }

    /// A token for `user` (Basic `user:password`) with `scope`.
    async fn token(&self, user: &str, password: &str, scope: &str) -> String {
        let mut url = reqwest::Url::parse(&self.realm).unwrap();
        url.query_pairs_mut()
            .append_pair("service", TOKEN_SERVICE)
            .append_pair("scope", scope);
        let r = reqwest::Client::new()
            .get(url)
            .basic_auth(user, Some(password))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        v["token"].as_str().unwrap().to_string()
    }

    /// The requests logged since the last call.
    fn requests(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.log).unwrap();
        std::fs::write(&self.log, "").unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// A registry that takes only Bearer tokens from a real token service
/// (`auth: token:`, tokens checked against the service's certificate): a
/// prepare with `image_pull_secret` pulls through the token flow, asking
/// for the repository's pull and nothing more; a wrong password or no
/// secret is `source_not_allowed` with a clear message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_tokens_from_a_real_token_service() {
    // The token service is on this host's loopback, named by the registry
    // (not by the message): allowed only as a local redirect would be.
    let env =
        Env::new("allow_local_redirects = true\n[oci]\npermit_fallback_to_http_transport = true\n");
    let tokens = TokenServer::start(
        &env.root().join("token"),
        &["puller:t0ken-pw", "pusher:push-pw"],
    )
    .await;
    let mut reg = Registry::start_token(
        &env.root().join("registry"),
        &tokens.realm,
        &env.root().join("token/token.pem"),
    )
    .await;
    // Anonymous: the registry's Bearer challenge.
    let r = reg.client.get(reg.url("")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let challenge = r.headers()["www-authenticate"].to_str().unwrap();
    assert!(challenge.starts_with("Bearer realm="), "{challenge}");
    let push = tokens
        .token("pusher", "push-pw", "repository:tok/os:pull,push")
        .await;
    reg.auth = Some(format!("Bearer {push}"));
    let (raw, qcow2) = disk(env.root(), "tok", 71);
    let (m, s, _) = reg
        .artifact("tok/os", &qcow2, "application/octet-stream")
        .await;
    reg.index("tok/os", "v1", &[(&m, s, "qcow2", "amd64")])
        .await;
    tokens.requests();

    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let src = reg.oci("tok/os:v1");
    let prepare = |secret: Option<&str>| {
        let mut cmd = prepare_cmd(&node(), &src);
        if let Some(s) = secret {
            cmd["instance_info"]["image_pull_secret"] = json!(s);
        }
        broker.call(&env.host, cmd)
    };
    let done = prepare(Some("puller:t0ken-pw")).await;
    assert_valid_completion(&done);
    assert_eq!(done["status"], "success", "{done}");
    assert_serves(&env, &done, &raw);
    assert_http_serves(&done, &raw).await;
    let asked = tokens.requests();
    assert!(!asked.is_empty());
    for a in &asked {
        assert_eq!(a["user"], "puller", "{a}");
        assert_eq!(a["service"], TOKEN_SERVICE, "{a}");
        assert_eq!(a["scope"], json!(["repository:tok/os:pull"]), "{a}");
    }

    for (secret, says) in [
        (
            Some("puller:wrong"),
            "the token service refused the credentials",
        ),
        (None, "requires credentials"),
    ] {
        let done = prepare(secret).await;
        assert_valid_completion(&done);
        assert_eq!(done["error"]["code"], "source_not_allowed", "{done}");
        let message = done["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{secret:?}: {message}");
        assert!(!done.to_string().contains("wrong"), "secret echoed: {done}");
        let asked = tokens.requests();
        assert!(!asked.is_empty() && asked.iter().all(|a| a["granted"] == false));
    }
    worker.terminate().await;
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
}

/// Pushed by the tools operators use: the `oras` package pushes a qcow2 as
/// a single-layer artifact under a tag (no index), and Debian's `skopeo`
/// copies it, whole, to another repository and through an OCI layout
/// directory; the worker serves the same raw image from each.
#[tokio::test]
async fn images_pushed_with_oras_and_copied_with_skopeo() {
    let env = plain_env();
    let reg = Registry::start(&env.root().join("registry"), None, false).await;
    let (raw, qcow2) = disk(env.root(), "disk", 11);
    let host = format!("127.0.0.1:{}", reg.port);
    let push = format!(
        "import oras.client\n\
         c = oras.client.OrasClient(hostname={host:?}, insecure=True)\n\
         r = c.push(target={target:?}, files=[{file:?}], disable_path_validation=True)\n\
         assert r.status_code == 201, r.status_code\n",
        target = format!("{host}/img/oras:v1"),
        file = qcow2.to_str().unwrap(),
    );
    tool(ironic_python().to_str().unwrap(), &["-c", &push]);
    let skopeo = |from: String, to: String| {
        tool(
            "skopeo",
            &[
                "copy",
                "--all",
                "--src-tls-verify=false",
                "--dest-tls-verify=false",
                &from,
                &to,
            ],
        )
    };
    skopeo(
        format!("docker://{host}/img/oras:v1"),
        format!("docker://{host}/img/copied:v2"),
    );
    let layout = env.root().join("layout");
    skopeo(
        format!("docker://{host}/img/oras:v1"),
        format!("oci:{}:v3", layout.display()),
    );
    skopeo(
        format!("oci:{}:v3", layout.display()),
        format!("docker://{host}/img/layout:v3"),
    );
    for reference in ["img/oras:v1", "img/copied:v2", "img/layout:v3"] {
        let (ok, done) = env.prepare(&node(), &reg.oci(reference), &[]).await;
        assert!(ok, "{reference}: {done}");
        assert_eq!(done["converted"], true, "{reference}");
        assert_serves(&env, &done, &raw);
    }
}

/// A registry (`auth: token:`) whose Bearer challenge names `realm`: the
/// realm is the first thing the worker reaches, so nothing is pushed.
async fn registry_with_realm(dir: &Path, realm: &str) -> Registry {
    tool(
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=unused",
            "-keyout",
            dir.join("realm.key").to_str().unwrap(),
            "-out",
            dir.join("realm.pem").to_str().unwrap(),
        ],
    );
    Registry::start_token(&dir.join("registry"), realm, &dir.join("realm.pem")).await
}

/// A hostile registry's `Bearer realm` naming a link-local address (a
/// listener in a network namespace of the test's own, routed from here:
/// the metadata service's kind of address) or a loopback one is never
/// reached: the realm is held to the address rules of a redirect, IP
/// literals included, and the prepare is `source_not_allowed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_realm_on_a_local_address_is_never_reached() {
    let env = plain_env();
    let traps = [
        netns::Trap::link_local(&env.root().join("trap-ll")),
        netns::Trap::loopback(&env.root().join("trap-lo")),
    ];
    for (i, trap) in traps.iter().enumerate() {
        // Reachable from here: only the worker's rules keep it out.
        let (status, _) = get(&format!("{}/probe", trap.url)).await;
        assert_eq!(status, 401);
        let dir = env.root().join(format!("reg{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let realm = format!("{}/latest/meta-data/iam/token", trap.url);
        let reg = registry_with_realm(&dir, &realm).await;
        let (ok, ev) = env.prepare(&node(), &reg.oci("any/os:v1"), &[]).await;
        assert!(!ok, "{ev}");
        assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");
        let hits = trap.hits();
        assert_eq!(hits.len(), 1, "only the test's probe: {hits:?}");
    }
}

/// `[oci]authentication_config` credentials are chosen by the registry as
/// the reference names it, port included: an entry for the host alone is
/// another registry's (port 443) and is not sent; and the registry's own
/// credential never goes in clear to a realm on another port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_credentials_follow_host_and_port_and_never_go_in_clear_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let trap = netns::Trap::loopback(&dir.path().join("trap"));
    let realm = format!("{}/token", trap.url);
    let reg = registry_with_realm(dir.path(), &realm).await;
    let b64 = base64::engine::general_purpose::STANDARD;
    let cred = json!({"auth": b64.encode("puller:s3cret-pw")});
    let registry = format!("127.0.0.1:{}", reg.port);
    for key in ["127.0.0.1", registry.as_str()] {
        let auth_file = dir.path().join("config.json");
        std::fs::write(&auth_file, json!({"auths": {key: cred}}).to_string()).unwrap();
        let env = Env::new(&format!(
            "allow_local_redirects = true\n[oci]\npermit_fallback_to_http_transport = true\n\
             authentication_config = \"{}\"\n",
            auth_file.display()
        ));
        let (ok, ev) = env.prepare(&node(), &reg.oci("any/os:v1"), &[]).await;
        assert!(!ok, "{ev}");
        assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");
        let hits = trap.hits();
        assert!(!hits.is_empty(), "{key}: the realm was asked");
        for h in &hits {
            assert_eq!(h["authorization"], Value::Null, "{key}: {h}");
        }
        trap.clear();
    }
}
