//! What an operator adopting the worker meets: `config check` and
//! `config show`, the start-up log (overrides of ironic.conf, the files
//! read), fatal errors that name the option at fault, and the command line
//! sharing the service's configuration.

use crate::common::{BIN, Env};
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs the binary with `args` and `env`, no configuration file found by
/// default (the system ones are not read unless named).
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("IRONIC_IMAGE_WORKER_CONFIG")
        .env_remove("IRONIC_IMAGE_WORKER_IRONIC_CONFIG")
        .env("IRONIC_IMAGE_WORKER_CONFIG", "")
        .env("IRONIC_IMAGE_WORKER_IRONIC_CONFIG", "")
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// An ironic.conf as a conductor has it: its broker (with a password), a
/// 10 GiB cache, its directories.
fn ironic_conf(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("ironic.conf");
    std::fs::write(
        &path,
        format!(
            "[DEFAULT]\nhost = cond-3\ntransport_url = rabbit://ironic:S3cretPw@mq.example.net:5672/ironic\n\
             [deploy]\nhttp_root = {root}/httpboot\nhttp_url = http://192.0.2.3:8080\n\
             [pxe]\nimages_path = {root}/images\nimage_cache_size = 10240\n",
            root = dir.display()
        ),
    )
    .unwrap();
    path
}

/// `config check` refuses each mistake with one line naming the option and
/// where its value came from (the worker's file, an oslo variable, the
/// worker's variable, a flag), and no other line.
#[test]
fn config_check_names_each_problem_with_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("w.toml");
    std::fs::write(
        &toml,
        "[deploy]\nhttp_url = \"ftp://192.0.2.3/\"\n[amqp]\nprefetch = 0\nno_such_option = 1\n",
    )
    .unwrap();
    let toml_arg = toml.to_str().unwrap();
    let out = run(
        &[
            "--config",
            toml_arg,
            "--set",
            "DEFAULT.host=",
            "config",
            "check",
        ],
        &[
            ("OS_AGENT__ALLOW_MD5_CHECKSUM", "maybe"),
            ("IRONIC_IMAGE_WORKER__PXE__IMAGES_PATH", "relative/images"),
        ],
    );
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    let lines: Vec<&str> = text.lines().collect();
    let expected = [
        format!("[deploy]http_url ({toml_arg}): "),
        format!("[amqp]prefetch ({toml_arg}): "),
        format!("[amqp]no_such_option ({toml_arg}): unknown option"),
        "[agent]allow_md5_checksum (environment OS_AGENT__ALLOW_MD5_CHECKSUM): ".to_string(),
        "[pxe]images_path (environment IRONIC_IMAGE_WORKER__PXE__IMAGES_PATH): ".to_string(),
        "[DEFAULT]host (--set DEFAULT.host): ".to_string(),
    ];
    for start in &expected {
        assert!(
            lines.iter().any(|l| l.starts_with(start.as_str())),
            "no line starting {start:?} in:\n{text}"
        );
    }
    assert_eq!(lines.len(), expected.len(), "one line per problem:\n{text}");
    assert!(!text.contains("internal"), "{text}");

    // The same file fixed is valid.
    std::fs::write(&toml, "[deploy]\nhttp_url = \"http://192.0.2.3:8080\"\n").unwrap();
    let root = dir.path().display().to_string();
    let ok = run(
        &[
            "--config",
            toml_arg,
            "--set",
            &format!("pxe.images_path={root}/images"),
            "--set",
            &format!("pxe.instance_master_path={root}/master"),
            "--set",
            &format!("deploy.http_root={root}/httpboot"),
            "config",
            "check",
        ],
        &[],
    );
    assert!(ok.status.success(), "{}{}", stdout(&ok), stderr(&ok));
}

/// A directory the service's user cannot write is refused by `config
/// check` (run as that user) and by `serve` before it takes any work,
/// naming the option; not found later by a failed prepare.
#[test]
fn unwritable_directories_are_refused_naming_their_option() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("httpboot/agent_images")).unwrap();
    for d in ["", "httpboot"] {
        let p = root.join(d);
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let toml = root.join("w.toml");
    std::fs::write(
        &toml,
        format!(
            "[deploy]\nhttp_root = \"{r}/httpboot\"\nhttp_url = \"http://192.0.2.3:8080\"\n\
             [pxe]\ninstance_master_path = \"/tmp\"\nimages_path = \"/tmp\"\n",
            r = root.display()
        ),
    )
    .unwrap();
    // As nobody: /tmp is writable, agent_images (root's, 0755) is not.
    for command in [&["config", "check"][..], &["serve"][..]] {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
            .args(["--config", toml.to_str().unwrap(), "--ironic-config", ""])
            .args(command)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = format!("{}{}", stdout(&out), stderr(&out));
        assert_eq!(out.status.code(), Some(1), "{command:?}: {text}");
        assert!(
            text.contains(&format!("[deploy]http_root ({})", toml.display()))
                && text.contains("agent_images is not writable by this user (uid 65534)"),
            "{command:?}: {text}"
        );
    }
}

/// `config show` prints every option with its value and source; secrets
/// never appear.
#[test]
fn config_show_says_where_each_value_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let conf = ironic_conf(dir.path());
    let toml = dir.path().join("w.toml");
    std::fs::write(
        &toml,
        "[pxe]\nimage_cache_size = 20480\n[glance]\npassword = \"GlPw0rd\"\n",
    )
    .unwrap();
    let out = run(
        &[
            "--config",
            toml.to_str().unwrap(),
            "--ironic-config",
            conf.to_str().unwrap(),
            "config",
            "show",
        ],
        &[("OS_DEFAULT__HOST", "cond-4")],
    );
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    let conf = conf.display();
    for line in [
        format!(
            "url = [\"amqp://ironic:***@mq.example.net:5672/ironic\"]  # {conf} [DEFAULT]transport_url"
        ),
        format!("image_cache_size = 20480  # {}", toml.display()),
        "host = \"cond-4\"  # environment OS_DEFAULT__HOST".to_string(),
        format!(
            "http_root = \"{}/httpboot\"  # {conf} [deploy]http_root",
            dir.path().display()
        ),
        format!(
            "instance_master_path = \"/var/lib/ironic-image-worker/master_images\"  # default with {conf}"
        ),
        "password = \"***\"".to_string(),
        "prefetch = 32  # default".to_string(),
    ] {
        assert!(text.contains(&line), "no {line:?} in:\n{text}");
    }
    assert!(
        !text.contains("S3cretPw") && !text.contains("GlPw0rd"),
        "{text}"
    );
}

/// `[conductor]permitted_image_formats` is parsed when the configuration
/// is read: a name that is no image format is refused by `config check`
/// with the option and the ironic.conf line it came from; names in any
/// case are formats, which `config show` prints by their names.
#[test]
fn permitted_image_formats_are_refused_or_shown_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let conf = ironic_conf(dir.path());
    let text = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(
        &conf,
        format!("{text}[conductor]\npermitted_image_formats = raw,\n  ploop\n"),
    )
    .unwrap();
    let conf_arg = conf.to_str().unwrap();
    let out = run(&["--ironic-config", conf_arg, "config", "check"], &[]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    let expected = format!(
        "[conductor]permitted_image_formats ({conf_arg} [conductor]permitted_image_formats): \
         unknown image format \"ploop\""
    );
    assert!(text.contains(&expected), "no {expected:?} in:\n{text}");

    let out = run(
        &[
            "--ironic-config",
            conf_arg,
            "--set",
            "conductor.permitted_image_formats=RAW, Qcow2",
            "config",
            "show",
        ],
        &[],
    );
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    let line = "permitted_image_formats = [\"raw\", \"qcow2\"]  \
                # --set conductor.permitted_image_formats";
    assert!(text.contains(line), "no {line:?} in:\n{text}");
}

/// A value of the worker's own file that overrides ironic.conf's is
/// logged at start with both values (the documented install used to
/// override the conductor's broker and cache size silently).
#[test]
fn overrides_of_ironic_conf_are_logged_at_start() {
    let env = Env::new("");
    let conf = ironic_conf(env.root());
    let toml = env.root().join("override.toml");
    std::fs::write(&toml, "[pxe]\nimage_cache_size = 20480\n").unwrap();
    let out = run(
        &[
            "--config",
            toml.to_str().unwrap(),
            "--ironic-config",
            conf.to_str().unwrap(),
            "--set",
            &format!("pxe.instance_master_path={}/master", env.root().display()),
            "cleanup",
            "--node",
            &crate::common::node(),
        ],
        &[("RUST_LOG", "warn")],
    );
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains(&format!(
            "[pxe]image_cache_size ({}): 20480 overrides 10240 from {} [pxe]image_cache_size",
            toml.display(),
            conf.display()
        )),
        "{log}"
    );
}

/// A start that fails (its port taken) says which option, without the
/// `internal:` of a bug, and leaves nothing on disk.
#[test]
fn a_failed_start_names_the_option_and_makes_nothing() {
    let env = Env::new("");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = Command::new(BIN)
        .args([
            "--config",
            env.config.to_str().unwrap(),
            "--ironic-config",
            "",
        ])
        .args(["--set", &format!("http.listen=127.0.0.1:{port}"), "serve"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "ironic-image-worker: [http]listen 127.0.0.1:{port}: cannot listen"
        )),
        "{text}"
    );
    assert!(!text.contains("internal"), "{text}");
    for made in [
        env.master_dir(),
        env.images_dir(),
        env.root().join("httpboot"),
    ] {
        assert!(!made.exists(), "{} was made", made.display());
    }
}

/// A `serve` whose log goes to a file: (child, log path).
fn serve_logging(env: &Env, args: &[&str]) -> (tokio::process::Child, std::path::PathBuf) {
    let log = env
        .root()
        .join(format!("serve-{}.log", uuid::Uuid::new_v4().simple()));
    let child = tokio::process::Command::new(BIN)
        .args([
            "--config",
            env.config.to_str().unwrap(),
            "--ironic-config",
            "",
        ])
        .args(args)
        .arg("serve")
        .env("RUST_LOG", "info,lapin=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    (child, log)
}

async fn wait_serving(env: &Env) {
    let url = format!("http://127.0.0.1:{}/healthz", env.metrics_port);
    for _ in 0..400 {
        if reqwest::get(&url)
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("worker did not start");
}

async fn stop(mut child: tokio::process::Child) {
    if let Some(pid) = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32))
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let _ = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait()).await;
}

/// Every image-server request leaves one access line (client, method,
/// path, status, bytes sent, duration, range): in the combined log format,
/// as JSON with `[log]format = "json"`, none with `access_log = false`.
#[tokio::test]
async fn every_image_request_leaves_an_access_line() {
    let env = Env::new("");
    std::fs::create_dir_all(env.root().join("httpboot")).unwrap();
    std::fs::write(env.root().join("httpboot/hello.txt"), b"hello world").unwrap();
    let client = reqwest::Client::new();
    let url = |p: &str| format!("http://127.0.0.1:{}{p}", env.http_port);
    for (args, expect) in [
        (&[][..], "text"),
        (&["--set", "log.format=json"][..], "json"),
        (&["--set", "log.access_log=false"][..], "none"),
    ] {
        let (child, log) = serve_logging(&env, args);
        wait_serving(&env).await;
        let part = client
            .get(url("/hello.txt"))
            .header("Range", "bytes=0-4")
            .header("User-Agent", "ipa-test/1")
            .send()
            .await
            .unwrap();
        assert_eq!(part.status(), 206);
        assert_eq!(part.bytes().await.unwrap().as_ref(), b"hello");
        let missing = client
            .get(url("/agent_images/nothing"))
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 404);
        stop(child).await;
        let text = std::fs::read_to_string(&log).unwrap();
        let access: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("ironic_image_worker::access"))
            .collect();
        match expect {
            "text" => {
                assert_eq!(access.len(), 2, "{text}");
                assert!(
                    access[0].contains("127.0.0.1 - - [")
                        && access[0]
                            .contains("\"GET /hello.txt HTTP/1.1\" 206 5 \"-\" \"ipa-test/1\"")
                        && access[0].contains("range=\"bytes=0-4\""),
                    "{text}"
                );
                assert!(
                    access[1].contains("\"GET /agent_images/nothing HTTP/1.1\" 404 "),
                    "{text}"
                );
            }
            "json" => {
                assert_eq!(access.len(), 2, "{text}");
                let line: serde_json::Value = serde_json::from_str(access[0]).unwrap();
                let f = &line["fields"];
                assert_eq!(f["status"], 206, "{line}");
                assert_eq!(f["bytes"], 5, "{line}");
                assert_eq!(f["path"], "/hello.txt", "{line}");
                assert_eq!(f["range"], "bytes=0-4", "{line}");
                assert_eq!(f["client"], "127.0.0.1", "{line}");
                assert!(f["duration_ms"].is_u64(), "{line}");
            }
            _ => assert!(access.is_empty(), "{text}"),
        }
    }
}

/// `deployed` and `cleanup` leave a line each, carrying the node and the
/// request id, as a prepare does.
#[tokio::test]
async fn every_action_leaves_a_line_with_its_node_and_request_id() {
    let env = Env::new("");
    let node = crate::common::node();
    let out = env
        .run(&[
            "--ironic-config",
            "",
            "cleanup",
            "--node",
            &node,
            "--request-id",
            "req-cleanup-1",
        ])
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let log = stderr(&out);
    let line = log
        .lines()
        .find(|l| l.contains("request done"))
        .unwrap_or_else(|| panic!("no line for the cleanup:\n{log}"));
    assert!(
        line.contains(&node) && line.contains("req-cleanup-1") && line.contains("cleanup"),
        "{line}"
    );
}

/// A long conversion shows its progress: the in-flight gauge of the
/// converted bytes moves while a large sparse qcow2 (all of it zeros to
/// hash) is converted, not only at its end.
#[tokio::test]
async fn a_long_conversion_reports_its_progress() {
    let env = Env::new("");
    let img = env.root().join("allowed/sparse.qcow2");
    crate::common::tool(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "4G"],
    );
    let worker = env.serve().await;
    let broker = crate::common::Broker::connect().await;
    let node = crate::common::node();
    let cmd = crate::common::prepare_cmd(&node, &format!("file://{}", img.display()));
    let metrics = worker.metrics_url("/metrics");
    let call = tokio::spawn({
        let host = env.host.clone();
        async move { broker.call(&host, cmd).await }
    });
    let mut most = 0.0f64;
    while !call.is_finished() {
        if let Ok(r) = reqwest::get(&metrics).await
            && let Ok(text) = r.text().await
        {
            let done = crate::common::metric(
                &text,
                "ironic_image_worker_in_flight_done_bytes{stage=\"convert\"}",
            );
            most = most.max(done.unwrap_or(0.0));
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let done = call.await.unwrap();
    assert_eq!(done["status"], "success", "{done}");
    assert!(
        most > 0.0,
        "the converted bytes never showed while converting 4 GiB of zeros"
    );
    // The converter child's CPU time is the worker's too.
    let text = reqwest::get(&metrics).await.unwrap().text().await.unwrap();
    let cpu = crate::common::metric(&text, "ironic_image_worker_children_cpu_seconds_total");
    assert!(cpu.is_some_and(|s| s > 0.5), "{cpu:?}");
    worker.terminate().await;
}

/// `[convert]max_virtual_size_gib` bounds every format, not only qcow2:
/// VMDK, VHD, VHDX and VDI images announcing 1500 GiB are refused by
/// `inspect` (as by a prepare, before any conversion), with their real
/// virtual size, and accepted under a higher limit.
#[test]
fn the_virtual_size_limit_holds_for_every_format() {
    let dir = tempfile::tempdir().unwrap();
    for (format, qemu_format) in [
        ("vmdk", "vmdk"),
        ("vhd", "vpc"),
        ("vhdx", "vhdx"),
        ("vdi", "vdi"),
    ] {
        let img = dir.path().join(format!("big.{format}"));
        let path = img.to_str().unwrap();
        crate::common::tool(
            "qemu-img",
            &["create", "-q", "-f", qemu_format, path, "1500G"],
        );
        let refused = run(
            &["--config", "", "--ironic-config", "", "inspect", path],
            &[],
        );
        let verdict: serde_json::Value = serde_json::from_slice(&refused.stdout).unwrap();
        assert_eq!(refused.status.code(), Some(1), "{format}: {verdict}");
        assert_eq!(verdict["format"], format, "{verdict}");
        assert_eq!(verdict["error"]["code"], "unsafe_image", "{verdict}");
        let allowed = run(
            &[
                "--config",
                "",
                "--ironic-config",
                "",
                "--set",
                "convert.max_virtual_size_gib=2048",
                "inspect",
                path,
            ],
            &[],
        );
        let verdict: serde_json::Value = serde_json::from_slice(&allowed.stdout).unwrap();
        assert!(allowed.status.success(), "{format}: {verdict}");
        assert!(
            verdict["virtual_size"]
                .as_u64()
                .is_some_and(|v| v >= 1400u64 << 30),
            "{format}: the real virtual size: {verdict}"
        );
    }
}

/// Run as root on a cache the service's user owns, a command that would
/// leave root's files there (lock files the service then cannot remove)
/// refuses, naming the owner; as the owner it works.
#[test]
fn root_leaves_no_files_the_service_cannot_remove() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
    for d in ["master", "images", "httpboot"] {
        std::fs::create_dir(root.join(d)).unwrap();
        std::os::unix::fs::chown(root.join(d), Some(65534), Some(65534)).unwrap();
    }
    let toml = root.join("w.toml");
    std::fs::write(
        &toml,
        format!(
            "[deploy]\nhttp_root = \"{r}/httpboot\"\nhttp_url = \"http://192.0.2.3:8080\"\n\
             [pxe]\ninstance_master_path = \"{r}/master\"\nimages_path = \"{r}/images\"\n",
            r = root.display()
        ),
    )
    .unwrap();
    let args = [
        "--config",
        toml.to_str().unwrap(),
        "--ironic-config",
        "",
        "cache",
        "clean",
    ];
    let out = run(&args, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("belongs to uid 65534")
            && stderr(&out).contains("(runuser -u nobody -- ironic-image-worker ...)"),
        "{}",
        stderr(&out)
    );
    let left: Vec<_> = std::fs::read_dir(root.join("master")).unwrap().collect();
    assert!(left.is_empty(), "root left {left:?}");
    // A listing only reads: root may run it, and it leaves nothing.
    std::fs::write(root.join("master/abc"), b"master").unwrap();
    let list = run(
        &[
            args[0], args[1], args[2], args[3], "cache", "list", "--json",
        ],
        &[],
    );
    assert!(list.status.success(), "{}", stderr(&list));
    let listed: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(listed[0]["name"], "abc", "{listed}");
    let left: Vec<_> = std::fs::read_dir(root.join("master"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["abc"], "the listing made files");
    let as_owner = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
        .args(args)
        .output()
        .unwrap();
    assert!(as_owner.status.success(), "{}", stderr(&as_owner));
}

/// `send --wait` to a conductor whose worker stopped (its queue is still
/// there, nobody consumes it) fails at once instead of waiting its whole
/// timeout.
#[tokio::test]
async fn send_to_a_conductor_without_a_worker_fails_fast() {
    let env = Env::new("");
    env.serve().await.terminate().await;
    let started = std::time::Instant::now();
    let out = env
        .run(&[
            "--ironic-config",
            "",
            "send",
            "cleanup",
            "--node",
            &crate::common::node(),
            "--wait",
            "--timeout",
            "300",
        ])
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no worker consumes"),
        "{}",
        stderr(&out)
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(60));
}
