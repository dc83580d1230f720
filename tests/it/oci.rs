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
        let auth = user.map(|(u, p)| {
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
fn assert_serves(env: &Env, done: &Value, want: &Path) {
    let served = env.link_dir().join(done["node_uuid"].as_str().unwrap());
    assert_eq!(md5sum(&served), md5sum(want), "served bytes");
    assert_eq!(done["image_checksum"], md5sum(want));
    assert_eq!(done["image_os_hash_algo"], "sha256");
    assert_eq!(done["image_os_hash_value"], sha256sum(want));
    assert_eq!(done["image_size"], std::fs::metadata(want).unwrap().len());
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
