//! The Debian package and the container image, built by the very recipes
//! operators run (`packaging/deb/build`, `packaging/oci/build`), with the
//! binary under test: the package is installed, run, upgraded and purged on
//! this machine; the image is pushed to a registry, pulled back with skopeo,
//! unpacked and the worker run from it, serving a prepare.

use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const PACKAGE: &str = "ironic-image-worker";
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds the package of the binary under test as `version` into `out`.
fn build_deb(out: &Path, version: &str) -> PathBuf {
    let printed = sh(Command::new(format!("{ROOT}/packaging/deb/build"))
        .args(["--binary", BIN, "--version", version, "--out"])
        .arg(out));
    PathBuf::from(printed.trim())
}

/// Held by a test that installs the package: one at a time on this
/// machine's dpkg.
static DPKG: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Purges the package and what the test itself left (its cache file, the
/// service user), whatever happened.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["--purge", PACKAGE]).output();
        let _ = std::fs::remove_dir_all("/var/lib/ironic-image-worker");
        let _ = Command::new("userdel").arg(PACKAGE).output();
        let _ = Command::new("groupdel").arg(PACKAGE).output();
    }
}

/// The files the package installs (everything but directories).
fn package_files() -> Vec<PathBuf> {
    sh(Command::new("dpkg").args(["-L", PACKAGE]))
        .lines()
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .collect()
}

/// Runs the installed worker as the service user with `args`.
fn as_service(args: &[&str]) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", PACKAGE, "--regid", PACKAGE, "--init-groups"])
        .arg(format!("/usr/bin/{PACKAGE}"))
        .args(args)
        .stdin(Stdio::null());
    cmd
}

/// A prepare through the broker to the worker of `host`, then the served
/// bytes fetched from its `image_url` and compared with the source.
async fn prepare_and_fetch(host: &str, source: &Path) {
    let server = SourceServer::start(source.parent().unwrap()).await;
    let name = source.file_name().unwrap().to_str().unwrap();
    let broker = Broker::connect().await;
    let done = broker
        .call(host, prepare_cmd(&node(), &server.url(name)))
        .await;
    assert_eq!(done["status"], "success", "{done}");
    let (status, body) = get(done["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(body, std::fs::read(source).unwrap());
}

/// Waits for `/readyz` on `port` (serving, and consuming its queue).
async fn wait_ready(port: u16) {
    let url = format!("http://127.0.0.1:{port}/readyz");
    for _ in 0..400 {
        if reqwest::get(&url)
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the worker did not start");
}

/// A worker started by the test, stopped (SIGTERM) when dropped, also when
/// the test fails.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.0.id().to_string()).output();
        let _ = self.0.wait();
    }
}

/// The settings that make an installed worker this test's own: its host
/// name, loopback ports and the URL nodes get.
fn own(env: &Env) -> Vec<String> {
    let (h, m) = (env.http_port, env.metrics_port);
    [
        format!("DEFAULT.host={}", env.host),
        format!("http.listen=127.0.0.1:{h}"),
        format!("deploy.http_url=http://127.0.0.1:{h}"),
        format!("metrics.listen=127.0.0.1:{m}"),
    ]
    .into_iter()
    .flat_map(|s| ["--set".to_string(), s])
    .collect()
}

/// Installed: the binary, the unit, the commented configuration, the docs,
/// the service user and its directories; the worker runs from the installed
/// files with `config check` passing. Upgraded: the operator's
/// configuration and the caches stay, no stray file appears. Purged: not a
/// file of the package is left, and the caches are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_package_installs_upgrades_and_purges() {
    let _turn = DPKG.lock().await;
    let env = Env::new("");
    let _installed = Installed;
    let out = env.root().join("deb");
    let first = build_deb(&out, "0.1.0~test1");
    let control = sh(Command::new("dpkg-deb").arg("--field").arg(&first));
    assert!(
        control.contains("Depends: qemu-utils, adduser, libc6 (>= 2.34)")
            && !control.contains("Homepage:")
            && control.contains("JSON-RPC"),
        "{control}"
    );
    sh(Command::new("dpkg").arg("-i").arg(&first));
    for file in [
        "/usr/bin/ironic-image-worker",
        "/lib/systemd/system/ironic-image-worker.service",
        "/usr/share/doc/ironic-image-worker/operations.md",
        "/usr/share/ironic-image-worker/rabbitmq/definitions.json",
    ] {
        assert!(Path::new(file).is_file(), "{file}");
    }
    assert_eq!(
        std::fs::read_to_string("/etc/ironic-image-worker/worker.toml").unwrap(),
        std::fs::read_to_string(format!("{ROOT}/ops/worker.example.toml")).unwrap()
    );
    sh(Command::new("getent").args(["passwd", PACKAGE]));
    for dir in ["master_images", "images", "httpboot"] {
        let meta = std::fs::metadata(format!("/var/lib/ironic-image-worker/{dir}")).unwrap();
        assert_ne!(std::os::unix::fs::MetadataExt::uid(&meta), 0, "{dir}");
    }
    let version = sh(Command::new("/usr/bin/ironic-image-worker").arg("--version"));
    assert!(version.contains("0.1.0"), "{version}");
    let check = sh(&mut as_service(&["--ironic-config", "", "config", "check"]));
    assert!(
        check.contains("/etc/ironic-image-worker/worker.toml"),
        "{check}"
    );

    let mut args = own(&env);
    args.extend([
        "--ironic-config".to_string(),
        String::new(),
        "serve".to_string(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker = Running(as_service(&args).stderr(Stdio::null()).spawn().unwrap());
    wait_ready(env.metrics_port).await;
    let src = env.root().join("src/disk.img");
    random_file(&src, 1 << 20, 91);
    prepare_and_fetch(&env.host, &src).await;
    drop(worker);
    let masters = std::fs::read_dir("/var/lib/ironic-image-worker/master_images")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .count();
    assert!(
        masters >= 1,
        "the prepare's master is in the packaged cache"
    );

    // Upgrade, with the operator's own change to the configuration.
    let changed = "[source]\nretries = 5\n";
    std::fs::write("/etc/ironic-image-worker/worker.toml", changed).unwrap();
    let second = build_deb(&out, "0.1.0~test2");
    sh(Command::new("dpkg").arg("-i").arg(&second));
    assert_eq!(
        std::fs::read_to_string("/etc/ironic-image-worker/worker.toml").unwrap(),
        changed
    );
    let stray = sh(Command::new("find").args([
        "/etc/ironic-image-worker",
        "/usr/share/ironic-image-worker",
        "-name",
        "*.dpkg-*",
    ]));
    assert!(stray.trim().is_empty(), "{stray}");
    let status = sh(Command::new("dpkg-query").args(["-W", "-f=${Version}", PACKAGE]));
    assert_eq!(status, "0.1.0~test2");
    let after_upgrade = std::fs::read_dir("/var/lib/ironic-image-worker/master_images")
        .unwrap()
        .count();

    // Enabled by an operator where systemd is not the init system (here):
    // systemctl makes its link all the same, and the purge must take it.
    let wants =
        Path::new("/etc/systemd/system/multi-user.target.wants/ironic-image-worker.service");
    sh(Command::new("systemctl").args(["enable", PACKAGE]));
    assert!(wants.is_symlink(), "systemctl enable made no link");
    let files = package_files();
    sh(Command::new("dpkg").args(["--purge", PACKAGE]));
    assert!(!wants.is_symlink(), "the purge left {}", wants.display());
    let left: Vec<&PathBuf> = files.iter().filter(|f| f.exists()).collect();
    assert!(left.is_empty(), "left by the purge: {left:?}");
    assert!(!Path::new("/etc/ironic-image-worker").exists());
    assert_eq!(
        std::fs::read_dir("/var/lib/ironic-image-worker/master_images")
            .unwrap()
            .count(),
        after_upgrade,
        "the purge touched the cache"
    );
}

/// The admin deleted the configuration file (a conffile): dpkg keeps it
/// deleted through an upgrade, and the package's scripts go on without it
/// (the package ends configured, the file still absent).
#[test]
fn an_upgrade_after_the_configuration_was_deleted() {
    let _turn = DPKG.blocking_lock();
    let dir = tempfile::tempdir().unwrap();
    let _installed = Installed;
    let conf = Path::new("/etc/ironic-image-worker/worker.toml");
    sh(Command::new("dpkg")
        .arg("-i")
        .arg(build_deb(dir.path(), "0.1.0~test1")));
    std::fs::remove_file(conf).unwrap();
    let second = build_deb(dir.path(), "0.1.0~test2");
    let out = Command::new("dpkg")
        .arg("-i")
        .arg(&second)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the upgrade failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let status = sh(Command::new("dpkg-query").args(["-W", "-f=${Status} ${Version}", PACKAGE]));
    assert_eq!(status, "install ok installed 0.1.0~test2");
    assert!(!conf.exists(), "dpkg keeps the admin's deletion");
}

/// A registry of the test's own (Debian's docker-registry, plain HTTP).
struct Registry {
    child: std::process::Child,
    port: u16,
}

impl Registry {
    async fn start(dir: &Path) -> Registry {
        let port = free_port();
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
                dir.join("storage").display()
            ),
        )
        .unwrap();
        let child = Command::new("/usr/bin/docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("/usr/bin/docker-registry");
        let registry = Registry { child, port };
        for _ in 0..100 {
            if reqwest::get(format!("http://127.0.0.1:{port}/v2/"))
                .await
                .is_ok()
            {
                return registry;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the registry did not start");
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The container image (tests/it/common/oci_image.rs): built without a
/// daemon, pushed to a registry, pulled back with skopeo (its ports
/// declared) and unpacked; the worker in it runs as its non-root user:
/// `--version`, `config check`, and a prepare served from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_image_is_pushed_pulled_and_serves() {
    let env = Env::new("");
    let dir = env.root().join("oci");
    std::fs::create_dir_all(&dir).unwrap();
    let layout = tokio::task::spawn_blocking(oci_image::worker_image_layout)
        .await
        .unwrap();
    let registry = Registry::start(&dir).await;
    let remote = format!(
        "docker://127.0.0.1:{}/ironic-image-worker:test",
        registry.port
    );
    sh(Command::new("skopeo")
        .args(["copy", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:{}", layout.display(), oci_image::TAG))
        .arg(&remote));
    sh(Command::new("skopeo")
        .args(["copy", "--src-tls-verify=false", &remote])
        .arg(format!("oci:{}:test", dir.join("pulled").display())));
    // Its ports, as pulled: images, metrics and probes, JSON-RPC.
    let image: Value = serde_json::from_str(&sh(Command::new("skopeo")
        .args(["inspect", "--config"])
        .arg(format!("oci:{}:test", dir.join("pulled").display()))))
    .unwrap();
    let ports = &image["config"]["ExposedPorts"];
    for port in ["8080/tcp", "9102/tcp", "8099/tcp"] {
        assert!(ports.get(port).is_some(), "{port} in {ports}");
    }
    let bundle = dir.join("bundle");
    sh(Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:test", dir.join("pulled").display()))
        .arg(&bundle));
    let config: Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
    let user = &config["process"]["user"];
    assert_ne!(user["uid"], 0, "{user}");
    let userspec = format!("{}:{}", user["uid"], user["gid"]);
    let rootfs = bundle.join("rootfs");
    let in_image = |args: &[&str]| {
        let mut cmd = Command::new("chroot");
        cmd.arg(format!("--userspec={userspec}"))
            .arg(&rootfs)
            .arg("/usr/bin/ironic-image-worker")
            .args(args)
            .stdin(Stdio::null());
        cmd
    };
    let version = sh(&mut in_image(&["--version"]));
    assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    let check = sh(&mut in_image(&["config", "check"]));
    assert!(
        check.contains("/etc/ironic-image-worker/worker.toml"),
        "{check}"
    );

    let mut args = own(&env);
    args.push("serve".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker = Running(in_image(&args).stderr(Stdio::null()).spawn().unwrap());
    wait_ready(env.metrics_port).await;
    let src = env.root().join("src/disk.img");
    random_file(&src, 1 << 20, 92);
    prepare_and_fetch(&env.host, &src).await;
    drop(worker);
    drop(registry);
}

/// The deploy interface builds as a wheel that carries its entry points
/// (the deploy interface Ironic loads by name, its hardware types, and its
/// options).
#[test]
fn plugin_builds_as_a_wheel() {
    let dir = tempfile::tempdir().unwrap();
    let python = ironic_python();
    let wheel = sh(Command::new(format!("{ROOT}/packaging/wheel/build"))
        .arg("--python")
        .arg(&python)
        .arg("--out")
        .arg(dir.path()));
    let wheel = PathBuf::from(wheel.trim());
    assert!(wheel.is_file(), "{}", wheel.display());
    let site = dir.path().join("site");
    sh(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        .arg(&site)
        .arg(&wheel));
    let entry_points = std::fs::read_dir(&site)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().ends_with(".dist-info"))
        .map(|e| std::fs::read_to_string(e.path().join("entry_points.txt")).unwrap())
        .unwrap();
    assert!(
        entry_points
            .contains("direct-worker = ironic_image_worker_deploy.deploy:DirectWorkerDeploy"),
        "{entry_points}"
    );
    // Its hardware types, which list direct-worker (Ironic's own are left
    // as they are).
    assert!(
        entry_points.contains("[ironic.hardware.types]")
            && entry_points.contains(
                "redfish-worker = ironic_image_worker_deploy.hardware:RedfishWorkerHardware"
            ),
        "{entry_points}"
    );
    assert!(site.join("ironic_image_worker_deploy/deploy.py").is_file());
}

/// The binary under test (the one CI packages) needs at most glibc 2.34,
/// the floor the packages declare and the guide promises (Debian 12, Ubuntu
/// 22.04 and 24.04, Rocky/RHEL 9): read from its symbol versions by
/// `packaging/check-glibc`, which the package builds run too. The check
/// refuses a program that needs glibc 2.36 (`arc4random`).
#[test]
fn the_binary_needs_at_most_glibc_2_34() {
    let check = format!("{ROOT}/packaging/check-glibc");
    let needed = sh(Command::new(&check).arg(BIN));
    let version: Vec<u32> = needed
        .trim()
        .split('.')
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(version <= vec![2, 34], "needs glibc {needed}");

    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("newer.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\nint main(void) { return (int)(arc4random() & 1); }\n",
    )
    .unwrap();
    let newer = dir.path().join("newer");
    sh(Command::new("cc").arg("-o").arg(&newer).arg(&src));
    let out = Command::new(&check).arg(&newer).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a glibc 2.36 program passed: {err}");
    assert!(
        err.contains("needs glibc 2.36, above the floor 2.34") && err.contains("arc4random"),
        "{err}"
    );
}

/// `rpm -qp` with `args` on `package`.
fn rpm_query(package: &Path, args: &[&str]) -> String {
    sh(Command::new("rpm").arg("-qp").args(args).arg(package))
}

/// The RPM for Rocky/CentOS Stream 9, built from the binary under test by
/// `packaging/rpm/build` (Debian's rpmbuild), read back with rpm's own
/// queries: its files and their owners, the configuration file kept on
/// upgrade, the scriptlets (the service user, the directories, a restart
/// on upgrade only, a stop on erase only) and its dependencies (qemu-img,
/// and no glibc above 2.34).
#[test]
fn rpm_package_files_scriptlets_and_dependencies() {
    let dir = tempfile::tempdir().unwrap();
    let printed = sh(Command::new(format!("{ROOT}/packaging/rpm/build"))
        .args(["--binary", BIN, "--version", "0.1.0", "--out"])
        .arg(dir.path()));
    let rpm = PathBuf::from(printed.trim());
    assert!(rpm.is_file(), "{}", rpm.display());

    let files = rpm_query(
        &rpm,
        &[
            "--queryformat",
            "[%{FILENAMES} %{FILEUSERNAME}:%{FILEGROUPNAME} %{FILEMODES:perms}\n]",
        ],
    );
    for want in [
        "/usr/bin/ironic-image-worker root:root -rwxr-xr-x",
        "/usr/lib/systemd/system/ironic-image-worker.service root:root -rw-r--r--",
        "/etc/ironic-image-worker/worker.toml root:ironic-image-worker -rw-r-----",
        "/usr/share/doc/ironic-image-worker/operations.md root:root -rw-r--r--",
        "/usr/share/ironic-image-worker/rabbitmq/definitions.json root:root -rw-r--r--",
        "/usr/share/ironic-image-worker/prometheus/alerts.yml root:root -rw-r--r--",
    ] {
        assert!(files.lines().any(|l| l == want), "{want} in:\n{files}");
    }
    let listed = rpm_query(&rpm, &["-l"]);
    assert!(
        listed
            .lines()
            .all(|f| f.starts_with("/usr/") || f.starts_with("/etc/ironic-image-worker")),
        "a file outside /usr and the configuration:\n{listed}"
    );
    assert_eq!(
        rpm_query(&rpm, &["-c"]).trim(),
        "/etc/ironic-image-worker/worker.toml"
    );

    let scripts = rpm_query(&rpm, &["--scripts"]);
    for want in [
        "preinstall scriptlet",
        "useradd --system --gid ironic-image-worker",
        "install -d -m 0755 -o ironic-image-worker -g ironic-image-worker",
        "if [ \"$1\" -ge 2 ] && systemctl is-active --quiet ironic-image-worker; then",
        "if [ \"$1\" -eq 0 ] && [ -d /run/systemd/system ]; then",
        "systemctl stop ironic-image-worker",
    ] {
        assert!(scripts.contains(want), "{want:?} in:\n{scripts}");
    }

    let requires = rpm_query(&rpm, &["-R"]);
    let names: Vec<&str> = requires.lines().map(str::trim).collect();
    for want in ["qemu-img", "shadow-utils", "libc.so.6()(64bit)"] {
        assert!(names.contains(&want), "{want} in:\n{requires}");
    }
    let glibc: Vec<Vec<u32>> = names
        .iter()
        .filter_map(|r| r.strip_prefix("libc.so.6(GLIBC_"))
        .filter_map(|r| r.strip_suffix(")(64bit)"))
        .map(|v| v.split('.').map(|n| n.parse().unwrap()).collect())
        .collect();
    assert!(!glibc.is_empty(), "no glibc version required:\n{requires}");
    assert!(
        glibc.iter().all(|v| v <= &vec![2, 34]),
        "a glibc above 2.34:\n{requires}"
    );
}
