//! The shipped systemd unit (`ops/systemd/`) passes `systemd-analyze verify`,
//! its system call filter lets through every call the worker makes, and the
//! worker speaks the `Type=notify` protocol it declares.

use crate::common;

use common::*;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::Duration;

const UNIT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/ops/systemd/ironic-image-worker.service"
);

#[test]
fn unit_file_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let shipped = std::fs::read_to_string(UNIT).unwrap();
    assert!(shipped.contains("Type=notify"));
    // The unit names the installed binary; point it at the one under test.
    let unit = dir.path().join("ironic-image-worker.service");
    std::fs::write(&unit, shipped.replace("/usr/bin/ironic-image-worker", BIN)).unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .expect("systemd-analyze (package systemd) is installed");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    let ours: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("ironic-image-worker.service"))
        .collect();
    assert!(out.status.success() && ours.is_empty(), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_notifies_ready_and_stopping() {
    let env = Env::new("");
    let socket_path = env.root().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&socket_path).unwrap();
    let worker = env
        .serve_with(&[], &[("NOTIFY_SOCKET", socket_path.to_str().unwrap())])
        .await;
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), socket.recv(&mut buf))
        .await
        .expect("READY=1 in time")
        .unwrap();
    let ready = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready}");
    // Ready means serving: the image port answers.
    assert_eq!(get(&worker.image_url("/agent_images/nothing")).await.0, 404);
    let status = worker.terminate().await;
    assert!(status.success());
    let n = tokio::time::timeout(Duration::from_secs(5), socket.recv(&mut buf))
        .await
        .expect("STOPPING=1 sent")
        .unwrap();
    assert_eq!(&buf[..n], b"STOPPING=1");
}

/// Under systemd, a system call outside the unit's `SystemCallFilter=`
/// kills the worker with SIGSYS (no `SystemCallErrorNumber=`), and
/// `Restart=on-failure` then crashes it again on every redelivery. So the
/// worker runs a day's work under strace (a prepare converted in its child
/// process, directories shared with a group, compressed and ranged serving,
/// a JSON-RPC call, a cleanup, a graceful stop) and every call it made must
/// be one the filter allows, as systemd's own `systemd-analyze
/// syscall-filter` resolves the unit's groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_units_system_call_filter_allows_every_call_the_worker_makes() {
    let rpc_port = free_port();
    let env = Env::new(&format!(
        "[cache]\nshared_group = \"daemon\"\nshared_dir_mode = \"2775\"\n\
         [json_rpc]\nlisten = \"127.0.0.1:{rpc_port}\"\n"
    ));
    env.gzip_static("");
    let calls = env.root().join("syscalls");
    let mut worker = Worker::start(
        || {
            let mut cmd = tokio::process::Command::new("strace");
            cmd.args(["-f", "-qq", "-c", "-U", "name", "-o"])
                .arg(&calls)
                .arg(BIN)
                .arg("--config")
                .arg(&env.config)
                .args(["--ironic-config", "", "serve"])
                .env_remove("IRONIC_IMAGE_WORKER_CONFIG")
                .env("RUST_LOG", "warn,lapin=error")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true);
            cmd
        },
        env.http_port,
        env.metrics_port,
    )
    .await;

    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 32 << 20, 5);
    let qcow2 = env.root().join("allowed/disk.qcow2");
    qcow2_from(&raw, &qcow2, &[]);
    let broker = Broker::connect().await;
    let node = node();
    let source = format!("file://{}", qcow2.display());
    let done = broker.call(&env.host, prepare_cmd(&node, &source)).await;
    assert_eq!(done["status"], "success", "{done}");
    crate::gzip::wait_for(&env, ".gz").await;
    let url = worker.image_url(&format!("/agent_images/{node}"));
    let client = reqwest::Client::builder().gzip(true).build().unwrap();
    let body = client
        .get(&url)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(
        body,
        std::fs::read(env.images_dir().join(&node).join("disk")).unwrap()
    );
    let ranged = reqwest::Client::new()
        .get(&url)
        .header("Range", "bytes=0-99")
        .send()
        .await
        .unwrap();
    assert_eq!(ranged.status(), 206);
    let status = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{rpc_port}/"))
        .json(
            &serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "status",
            "params": {"node_uuid": node}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(status.status(), 200);
    let cleanup = serde_json::json!({"action": "cleanup", "node_uuid": node,
        "request_id": uuid::Uuid::new_v4().to_string()});
    assert_eq!(broker.call(&env.host, cleanup).await["status"], "success");

    // SIGTERM to the worker (strace's child), then strace writes its count.
    let tracer = worker.child.id().unwrap();
    let children =
        std::fs::read_to_string(format!("/proc/{tracer}/task/{tracer}/children")).unwrap();
    let pid: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(60), worker.child.wait())
        .await
        .expect("the worker stops")
        .unwrap();
    assert!(exit.success(), "{exit}");

    let made: BTreeSet<String> = std::fs::read_to_string(&calls)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('-') && *l != "syscall" && *l != "total")
        .map(String::from)
        .collect();
    assert!(
        made.contains("execve") && made.contains("chown"),
        "{made:?}"
    );
    let allowed = unit_allowed_calls(Path::new(UNIT));
    let refused: Vec<&String> = made.iter().filter(|c| !allowed.contains(*c)).collect();
    assert!(
        refused.is_empty(),
        "the unit's SystemCallFilter would kill the worker on {refused:?}"
    );
}

/// The system calls the unit's `SystemCallFilter=` lines allow, read as
/// systemd reads them: the first (an allow list) sets the list, a later
/// `~` line takes its calls out and a later plain line adds its calls back;
/// `@groups` are resolved (recursively) by `systemd-analyze syscall-filter`.
fn unit_allowed_calls(unit: &Path) -> BTreeSet<String> {
    let out = std::process::Command::new("systemd-analyze")
        .args(["syscall-filter", "--no-pager"])
        .output()
        .expect("systemd-analyze (package systemd) is installed");
    let mut groups: HashMap<String, Vec<String>> = HashMap::new();
    let mut current = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(name) = line.strip_prefix('@') {
            current = Some(format!("@{}", name.trim()));
            groups.insert(current.clone().unwrap(), Vec::new());
        } else if line.trim().is_empty() {
            current = None;
        } else if let Some(group) = &current
            && !line.trim_start().starts_with('#')
        {
            groups.get_mut(group).unwrap().push(line.trim().to_string());
        }
    }
    fn resolve(name: &str, groups: &HashMap<String, Vec<String>>, out: &mut BTreeSet<String>) {
        match groups.get(name) {
            Some(members) => members.iter().for_each(|m| resolve(m, groups, out)),
            None => {
                assert!(!name.starts_with('@'), "unknown group {name}");
                out.insert(name.to_string());
            }
        }
    }
    let mut allowed: Option<BTreeSet<String>> = None;
    for value in std::fs::read_to_string(unit)
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("SystemCallFilter="))
    {
        let (deny, names) = match value.strip_prefix('~') {
            Some(rest) => (true, rest),
            None => (false, value),
        };
        let mut calls = BTreeSet::new();
        names
            .split_whitespace()
            .for_each(|n| resolve(n, &groups, &mut calls));
        let list = allowed.get_or_insert_with(BTreeSet::new);
        assert!(
            !(deny && list.is_empty()),
            "the first SystemCallFilter= is an allow list"
        );
        if deny {
            list.retain(|c| !calls.contains(c));
        } else {
            list.extend(calls);
        }
    }
    allowed.expect("the unit has a SystemCallFilter=")
}
