//! The Metal3 sidecar example (`ops/kubernetes/metal3-sidecar.yaml`) run in
//! a pod by a real pod runtime: Debian's podman (`podman kube play`), with
//! the project's image (tests/it/common/oci_image.rs). The worker's
//! container is the example's own: its volumes, variables, probes and
//! security context, only the example's provisioning address placeholder
//! given this machine's loopback. Ironic's and httpd's containers keep
//! their names, volumes and security context; a busybox image of the test
//! stands in for Metal3's image (not pulled here): Ironic's container acts
//! as Metal3's non-root Ironic writing its own files under /shared, and
//! httpd's serves the example's `http_root` at its `http_url`.
//!
//! What this machine needs apart from what a cluster needs (each said where
//! it is done; docs/operations.md, "Running the example with podman"):
//! runc (Debian 12's crun refuses its hybrid cgroup hierarchy), limits the
//! process may set (it lacks CAP_SYS_RESOURCE, so podman's default
//! `nofile` of 1048576 cannot be set), and the Secrets as podman 4.3 reads
//! a Secret volume (below, [`podman_secret`]).

use crate::common::oci_image;
use crate::common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Metal3's ironic user and group (the ironic RPMs' uid and gid in
/// Metal3's image), as its own Ironic pod runs every container.
const METAL3_IRONIC: (u64, u64) = (997, 994);

/// The name the stand-in image of Ironic's and httpd's containers gets.
const STAND_IN: &str = "localhost/iiw-metal3-stand-in:test";

/// The example's documents (Secret, Pod), read by Ironic's own Python
/// environment's YAML parser (the tests carry none).
fn manifest() -> Vec<Value> {
    let out = Command::new(ironic_python())
        .args([
            "-c",
            "import json, sys, yaml; json.dump(list(yaml.safe_load_all(sys.stdin)), sys.stdout)",
        ])
        .stdin(std::fs::File::open(format!("{ROOT}/ops/kubernetes/metal3-sidecar.yaml")).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// podman with a configuration of the test's own (`CONTAINERS_CONF`):
/// the machine's own is left alone.
struct Podman {
    conf: PathBuf,
}

impl Podman {
    /// runc as the runtime: crun 1.8 (Debian 12's default) refuses a host
    /// whose cgroups are v1 with a v2 `unified` hierarchy beside ("cgroups
    /// in hybrid mode not supported"), as here. Limits this process may
    /// set: without CAP_SYS_RESOURCE podman's default `nofile` (1048576)
    /// fails, so the containers get this process's hard `nofile` and 4096
    /// processes (higher `nproc` values were refused here too).
    fn new(dir: &Path) -> Podman {
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .maximum
            .unwrap_or(1 << 20)
            .min(1 << 20);
        let conf = dir.join("containers.conf");
        std::fs::write(
            &conf,
            format!(
                "[containers]\ndefault_ulimits = [\"nofile={nofile}:{nofile}\", \"nproc=4096:4096\"]\n\
                 [engine]\nruntime = \"runc\"\n"
            ),
        )
        .unwrap();
        Podman { conf }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf).args(args);
        cmd
    }

    /// Runs podman with `args`; its stdout, or the test fails with its
    /// output.
    fn run(&self, args: &[&str]) -> String {
        let out = self
            .cmd(args)
            .output()
            .expect("podman (.ci/run installs it)");
        assert!(
            out.status.success(),
            "podman {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs podman with `args`, whatever comes of it.
    fn quietly(&self, args: &[&str]) {
        let _ = self.cmd(args).output();
    }
}

/// What the test gives podman (the pod, its volumes, the Secrets, the
/// images), removed when dropped, also when the test fails (then the
/// containers' logs are printed first), and before the test begins (what
/// a killed run left).
struct Played<'a> {
    podman: &'a Podman,
    pod: String,
    containers: Vec<String>,
    volumes: Vec<String>,
    secrets: Vec<String>,
    images: Vec<String>,
}

impl Played<'_> {
    fn remove(&self) {
        self.podman
            .quietly(&["pod", "rm", "--force", "--time", "0", &self.pod]);
        for volume in &self.volumes {
            self.podman.quietly(&["volume", "rm", "--force", volume]);
        }
        for secret in &self.secrets {
            self.podman.quietly(&["secret", "rm", secret]);
        }
        for image in &self.images {
            self.podman.quietly(&["rmi", "--force", image]);
        }
    }
}

impl Drop for Played<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for c in &self.containers {
                if let Ok(out) = self.podman.cmd(&["logs", c]).output() {
                    eprintln!(
                        "--- {c}:\n{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
        }
        self.remove();
    }
}

/// The podman secret behind the Secret volume `name` of the example, in
/// the form podman 4.3 reads for a Secret volume: a Secret whose `data`
/// holds each file's content as it is (not base64, as Kubernetes would
/// have it). A `kind: Secret` document played with the pod gives its
/// volume no files, and a `secretKeyRef` wants a flat object of base64
/// values instead, so one Secret cannot feed both: only the worker's
/// container reads Secrets here.
fn podman_secret(name: &str, files: &[(&str, String)]) -> Value {
    let data: serde_json::Map<String, Value> = files
        .iter()
        .map(|(file, text)| (file.to_string(), json!(text)))
        .collect();
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": data})
}

/// `env`'s literal value of `name` (a container's `env` list).
fn env_value<'a>(env: &'a Value, name: &str) -> &'a str {
    env.as_array()
        .and_then(|vars| vars.iter().find(|v| v["name"] == name))
        .and_then(|v| v["value"].as_str())
        .unwrap_or_else(|| panic!("no {name} in {env}"))
}

/// Waits until `url` answers 200 (the kubelet's `httpGet` probe), or the
/// test fails with what podman says of the pod's containers.
async fn wait_200(url: &str, podman: &Podman, pod: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if reqwest::get(url)
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return;
        }
        if Instant::now() > deadline {
            let ps = podman.run(&["ps", "--all", "--filter", &format!("pod={pod}")]);
            panic!("{url} never answered 200:\n{ps}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the test takes from the example's worker container: where it
/// listens, publishes and keeps its node files, and its probes' URLs.
struct WorkerSide {
    http_url: String,
    http_root: String,
    rpc_listen: String,
    images_path: String,
    probes: Vec<String>,
}

impl WorkerSide {
    fn of(pod: &Value) -> WorkerSide {
        let worker = pod["spec"]["containers"]
            .as_array()
            .and_then(|cs| {
                cs.iter()
                    .find(|c| c["image"] == "ironic-image-worker:latest")
            })
            .expect("the worker's container");
        let env = |name: &str| env_value(&worker["env"], name).to_string();
        let probes = ["readinessProbe", "livenessProbe"]
            .iter()
            .map(|probe| {
                let get = &worker[probe]["httpGet"];
                format!(
                    "http://{}:{}{}",
                    get["host"].as_str().unwrap(),
                    get["port"],
                    get["path"].as_str().unwrap()
                )
            })
            .collect();
        let side = WorkerSide {
            http_url: env("OS_DEPLOY__HTTP_URL").replace("PROVISIONING-IP", "127.0.0.1"),
            http_root: env("OS_DEPLOY__HTTP_ROOT"),
            rpc_listen: env("IRONIC_IMAGE_WORKER__JSON_RPC__LISTEN"),
            images_path: env("IRONIC_IMAGE_WORKER__PXE__IMAGES_PATH"),
            probes,
        };
        // The pod binds the example's fixed loopback ports on this host.
        for addr in [
            side.rpc_listen.as_str(),
            side.httpd_listen(),
            env_value(&worker["env"], "IRONIC_IMAGE_WORKER__HTTP__LISTEN"),
            env_value(&worker["env"], "IRONIC_IMAGE_WORKER__METRICS__LISTEN"),
        ] {
            assert!(
                std::net::TcpListener::bind(addr).is_ok(),
                "{addr} is taken: the pod binds it on the host's network"
            );
        }
        side
    }

    /// httpd's address, from `http_url`.
    fn httpd_listen(&self) -> &str {
        self.http_url.trim_start_matches("http://")
    }
}

/// Every container of `pod` runs as Metal3's ironic user, non-root, with
/// Metal3's group on the pod's volumes.
fn assert_metal3_users(pod: &Value) {
    let security = &pod["spec"]["securityContext"];
    assert_eq!(security["runAsNonRoot"], true, "{security}");
    assert_eq!(security["fsGroup"], METAL3_IRONIC.1, "{security}");
    for c in pod["spec"]["containers"].as_array().unwrap() {
        let user = &c["securityContext"];
        assert_eq!(
            (&user["runAsUser"], &user["runAsGroup"]),
            (&json!(METAL3_IRONIC.0), &json!(METAL3_IRONIC.1)),
            "{}",
            c["name"]
        );
    }
}

/// What playing `pod` gives podman, for [`Played`] to remove.
fn played<'a>(podman: &'a Podman, pod: &Value) -> Played<'a> {
    let name = pod["metadata"]["name"].as_str().unwrap().to_string();
    let volumes = pod["spec"]["volumes"].as_array().unwrap();
    let secret = |v: &Value| v["secret"]["secretName"].as_str().map(str::to_string);
    Played {
        podman,
        containers: pod["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| format!("{name}-{}", c["name"].as_str().unwrap()))
            .collect(),
        // podman 4.3 names an emptyDir volume after it and a Secret's after
        // the Secret, and keeps both after the pod.
        volumes: volumes
            .iter()
            .map(|v| secret(v).unwrap_or_else(|| v["name"].as_str().unwrap().to_string()))
            .collect(),
        secrets: volumes.iter().filter_map(secret).collect(),
        images: vec![
            "localhost/ironic-image-worker:latest".into(),
            STAND_IN.into(),
        ],
        pod: name,
    }
}

/// The worker's image where podman finds the example's image name, and
/// the stand-in of Metal3's (busybox: a shell, httpd).
async fn load_images(podman: &Podman, dir: &Path) {
    let layout = tokio::task::spawn_blocking(oci_image::worker_image_layout)
        .await
        .unwrap();
    tool(
        "skopeo",
        &[
            "copy",
            &format!("oci:{}:{}", layout.display(), oci_image::TAG),
            "containers-storage:localhost/ironic-image-worker:latest",
        ],
    );
    let rootfs = dir.join("stand-in.tar");
    tool(
        "mmdebstrap",
        &[
            "--quiet",
            "--variant=extract",
            "--include=busybox",
            "bookworm",
            rootfs.to_str().unwrap(),
            "http://deb.debian.org/debian",
        ],
    );
    podman.run(&["import", "--quiet", rootfs.to_str().unwrap(), STAND_IN]);
}

/// The Secrets of `played` with this test's credentials (user `ironic`,
/// `password`) and a certificate for the listener's address; returns the
/// CA that signed it.
fn create_secrets(
    podman: &Podman,
    played: &Played,
    auth: &Value,
    dir: &Path,
    rpc_listen: &str,
    password: &str,
) -> PathBuf {
    let ca = ca::TestCa::new(&dir.join("ca"), "rpc-ca");
    let rpc_ip = rpc_listen.split(':').next().unwrap();
    let (cert, key) = ca.issue(
        "rpc-server",
        rpc_ip,
        &format!("subjectAltName=IP:{rpc_ip}\nextendedKeyUsage=serverAuth\n"),
    );
    let htpasswd = tool("htpasswd", &["-nbB", "ironic", password]);
    let read = |p: &Path| std::fs::read_to_string(p).unwrap();
    for secret in &played.secrets {
        let content = match secret.as_str() {
            "image-worker-rpc-auth" => {
                assert_eq!(auth["metadata"]["name"], "image-worker-rpc-auth");
                assert!(auth["stringData"].get("htpasswd").is_some(), "{auth}");
                podman_secret(secret, &[("htpasswd", format!("{}\n", htpasswd.trim()))])
            }
            "image-worker-rpc-tls" => podman_secret(
                secret,
                &[
                    ("tls.crt", read(&cert)),
                    ("tls.key", read(&key)),
                    ("ca.crt", read(&ca.pem)),
                ],
            ),
            other => panic!("a Secret the test does not know: {other}"),
        };
        let file = dir.join(format!("{secret}.json"));
        std::fs::write(&file, content.to_string()).unwrap();
        podman.run(&["secret", "create", secret, file.to_str().unwrap()]);
    }
    ca.pem
}

/// The pod as played here: Ironic's and httpd's containers on the
/// stand-in image, the worker's as the example has it; the provisioning
/// address placeholder is this host's loopback.
fn stand_ins(pod: &mut Value, side: &WorkerSide) {
    for c in pod["spec"]["containers"].as_array_mut().unwrap() {
        match c["name"].as_str().unwrap() {
            "ironic" => {
                c["image"] = json!(STAND_IN);
                c["command"] = json!(["/bin/busybox", "sleep", "3600"]);
                // Its settings are for Metal3's Ironic.
                c.as_object_mut().unwrap().remove("env");
            }
            "httpd" => {
                // As Metal3's httpd, it makes http_root before serving
                // it (the worker may not have started yet).
                c["image"] = json!(STAND_IN);
                let serve = format!(
                    "/bin/busybox mkdir -p {root} && \
                     exec /bin/busybox httpd -f -p {listen} -h {root}",
                    root = side.http_root,
                    listen = side.httpd_listen()
                );
                c["command"] = json!(["/bin/busybox", "sh", "-c", serve]);
            }
            _ => {}
        }
        if let Some(env) = c["env"].as_array_mut() {
            for var in env {
                if let Some(v) = var["value"].as_str() {
                    var["value"] = json!(v.replace("PROVISIONING-IP", "127.0.0.1"));
                }
            }
        }
    }
}

/// A prepare of `node` from `source`, sent to the listener as Ironic's
/// client sends it (`send --transport json-rpc`); its completion.
fn prepare(
    dir: &Path,
    side: &WorkerSide,
    cafile: &Path,
    password: &str,
    node: &str,
    source: &str,
) -> Value {
    let config = dir.join("send.toml");
    std::fs::write(
        &config,
        format!(
            "[amqp]\nenabled = false\n[json_rpc]\nlisten = \"{}\"\n",
            side.rpc_listen
        ),
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .args(["--ironic-config", "", "send", "prepare", "--node", node])
        .args(["--image-source", source, "--wait"])
        .args(["--transport", "json-rpc", "--url"])
        .arg(format!("https://{}", side.rpc_listen))
        .args(["--user", "ironic", "--cafile"])
        .arg(cafile)
        .env("IRONIC_IMAGE_WORKER_RPC_PASSWORD", password)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(printed.trim()).unwrap()
}

/// The example's pod, played by podman as root (podman's kube play needs
/// root here; the test is skipped otherwise): the worker's readiness and
/// liveness probes pass; a JSON-RPC prepare sent as Ironic's client sends
/// it is answered with a URL under the example's `http_url`, where httpd
/// serves bytes whose MD5 and SHA-256 are the announced ones; every
/// container runs as Metal3's ironic user, and Ironic's container, non-root,
/// writes its own files beside the worker's under /shared, adds its own
/// link where the worker publishes and removes the worker's node files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_runs_in_a_pod() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: podman kube play needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let docs = manifest();
    let mut pod = docs
        .iter()
        .find(|d| d["kind"] == "Pod")
        .cloned()
        .expect("a Pod");
    let auth = docs
        .iter()
        .find(|d| d["kind"] == "Secret")
        .expect("the auth Secret");
    let side = WorkerSide::of(&pod);
    let podman = Podman::new(dir.path());
    let played = played(&podman, &pod);
    played.remove();
    load_images(&podman, dir.path()).await;
    let password = "pod-s3cret";
    let cafile = create_secrets(
        &podman,
        &played,
        auth,
        dir.path(),
        &side.rpc_listen,
        password,
    );
    stand_ins(&mut pod, &side);
    let pod_file = dir.path().join("pod.json");
    std::fs::write(&pod_file, pod.to_string()).unwrap();
    podman.run(&["kube", "play", pod_file.to_str().unwrap()]);
    for probe in &side.probes {
        wait_200(probe, &podman, &played.pod).await;
    }

    // A prepare through JSON-RPC, served by httpd.
    let src = dir.path().join("src/disk.img");
    std::fs::create_dir_all(dir.path().join("src")).unwrap();
    random_file(&src, 1 << 20, 57);
    let source = SourceServer::start(src.parent().unwrap()).await;
    let n = node();
    let done = prepare(
        dir.path(),
        &side,
        &cafile,
        password,
        &n,
        &source.url("disk.img"),
    );
    assert_eq!(done["status"], "success", "{done}");
    let image_url = done["image_url"].as_str().unwrap();
    let link = image_url
        .strip_prefix(&format!("{}/", side.http_url))
        .unwrap_or_else(|| panic!("not under http_url: {done}"));
    let (status, body) = get(image_url).await;
    assert_eq!(status, 200, "{image_url}");
    assert_eq!(body, std::fs::read(&src).unwrap());
    let served = dir.path().join("served");
    std::fs::write(&served, &body).unwrap();
    assert_eq!(done["image_checksum"], md5sum(&served), "{done}");
    assert_eq!(done["image_os_hash_algo"], "sha256", "{done}");
    assert_eq!(done["image_os_hash_value"], sha256sum(&served), "{done}");

    // Ironic, non-root, beside the worker that made /shared/html and its
    // node files first: its own directories and files, its own link where
    // the worker publishes, and the worker's node files removed (a
    // cleanup after a takeover).
    let script = format!(
        "set -e; b=/bin/busybox; cd {root}; \
         $b mkdir -p images pxelinux.cfg /shared/log; echo ironic > pxelinux.cfg/default; \
         echo ironic > images/ironic.iso; $b ln -s ../images/ironic.iso {link}.ironic; \
         $b rm {link}; $b rm -r {images}/{n}; \
         $b id -u; $b id -g; $b stat -c '%u:%g' {root} {root}/{link}.ironic",
        root = side.http_root,
        images = side.images_path,
    );
    let ironic = format!("{}-ironic", played.pod);
    let said = podman.run(&["exec", &ironic, "/bin/busybox", "sh", "-c", &script]);
    let (uid, gid) = METAL3_IRONIC;
    assert_eq!(
        said,
        format!("{uid}\n{gid}\n{uid}:{gid}\n{uid}:{gid}\n"),
        "Ironic's uid and gid, then the owners of http_root and of its link"
    );
    let (status, body) = get(&format!("{}/images/ironic.iso", side.http_url)).await;
    assert_eq!((status, body), (200, b"ironic\n".to_vec()));
    assert_eq!(get(image_url).await.0, 404, "the worker's link is gone");
    assert_metal3_users(&pod);
    drop(played);
}
