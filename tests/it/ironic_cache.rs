//! The worker beside Ironic's own image-cache code (Ironic 39 from PyPI,
//! `tests/helpers/ironic_image_cache.py`): Ironic's clean-up never hurts the
//! worker's files, Ironic's own fetch of the same image never fails because
//! of the worker, and nodes Ironic prepares itself are never touched.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

/// `spec` with Ironic's directories filled in.
fn in_env(env: &Env, mut spec: Value) -> Value {
    spec["images"] = json!(env.images_dir());
    spec["allowed"] = json!(env.root().join("allowed"));
    if spec.get("master").is_none() {
        spec["master"] = json!(ironic_master(env));
    }
    spec
}

/// Ironic's image cache in one long-lived conductor process, an operation
/// at a time.
struct Conductor(LineHelper);

impl Conductor {
    fn start() -> Conductor {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/ironic_image_cache.py");
        let mut cmd = tokio::process::Command::new(ironic_python());
        cmd.arg(script);
        Conductor(LineHelper::start(cmd))
    }

    /// Runs `spec` (Ironic's directories filled in); the helper's answer.
    async fn run(&mut self, env: &Env, spec: Value) -> Value {
        let answer = self.0.ask(&in_env(env, spec).to_string()).await;
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"))
    }
}

/// Ironic's own master directory: never the worker's.
fn ironic_master(env: &Env) -> std::path::PathBuf {
    env.root().join("ironic_master")
}

/// Every file under `dir` (recursively) with its inode.
fn tree(dir: &Path) -> Vec<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                stack.push(e.path());
            } else {
                let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
                out.push((rel, meta.ino()));
            }
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ironic_clean_up_never_touches_the_worker_files() {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 1 << 20, 61);
    random_file(&src.join("b.img"), 4 << 20, 62);
    let server = SourceServer::start(&src).await;
    let faults = FaultServer::start(&src, 1 << 20).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    // A master linked by a node, with its sidecar.
    let linked = node();
    let ev = broker
        .call(&env.host, prepare_cmd(&linked, &server.url("a.img")))
        .await;
    assert_eq!(ev["status"], "success", "{ev}");
    let before = tree(&env.master_dir());
    assert!(
        before.iter().any(|(n, _)| n.starts_with(".meta/")),
        "{before:?}"
    );

    // Ironic's clean-up with size and TTL 0 (everything unlinked goes),
    // over and over while the worker downloads another image: on Ironic's
    // own directory, and even swept over the worker's directory.
    let n = node();
    let corr = broker
        .command(&env.host, prepare_cmd(&n, &faults.url("slow", "b.img")))
        .await;
    env.wait_for_temporary(WAIT).await;
    let stop = env.root().join("stop");
    let (mut on_own, mut on_workers) = (Conductor::start(), Conductor::start());
    let (a, b, (got, ev)) = tokio::join!(
        on_own.run(&env, json!({"op": "clean", "until": stop})),
        on_workers.run(
            &env,
            json!({"op": "clean", "until": stop, "master": env.master_dir()})
        ),
        async {
            let reply = broker.next_reply(WAIT).await;
            std::fs::write(&stop, b"").unwrap();
            reply
        }
    );
    let results = [a, b];
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_served(&ev, &src.join("b.img"));
    for r in &results {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["errors"], json!([]), "{r}");
        assert!(r["runs"].as_u64().unwrap() >= 1);
    }
    // The linked master and every sidecar survived; both masters are hits.
    let after = tree(&env.master_dir());
    for entry in before.iter().filter(|(n, _)| !n.starts_with(".owners")) {
        assert!(after.contains(entry), "{entry:?} gone: {after:?}");
    }
    let again = broker
        .call(&env.host, prepare_cmd(&node(), &server.url("a.img")))
        .await;
    assert_eq!(again["cache"], "hit", "{again}");
    let (status, body) = get(ev["image_url"].as_str().unwrap()).await;
    assert_eq!(
        (status, body),
        (200, std::fs::read(src.join("b.img")).unwrap())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ironic_fetch_beside_the_worker_prepare_of_the_same_image_never_fails() {
    let env = Env::new("");
    let src = env.root().join("src");
    let server = SourceServer::start(&src).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let mut ironic = Conductor::start();
    for run in 0..10u64 {
        // A new image each run, so both sides download it at the same time.
        let raw = env.root().join(format!("r{run}.raw"));
        patchy_raw(&raw, 32 << 20, 600 + run);
        let name = format!("img{run}.qcow2");
        qcow2_from(&raw, &src.join(&name), &[]);
        let url = server.url(&name);
        let (worker_node, ironic_node) = (node(), node());
        let corr = broker
            .command(&env.host, prepare_cmd(&worker_node, &url))
            .await;
        let spec = json!({"op": "fetch", "node": ironic_node, "href": url, "force_raw": true,
                          "checksum": md5sum(&src.join(&name)), "checksum_algo": "md5"});
        let (theirs, (got, ours)) = tokio::join!(ironic.run(&env, spec), broker.next_reply(WAIT));
        assert_eq!(theirs["ok"], true, "run {run}: Ironic failed: {theirs}");
        assert_eq!(got.as_deref(), Some(corr.as_str()));
        assert_eq!(ours["status"], "success", "run {run}: {ours}");
        // Each node has its own image, both the raw conversion.
        let reference = env.root().join(format!("r{run}.ref"));
        reference_raw(&src.join(&name), &reference);
        for n in [&worker_node, &ironic_node] {
            assert_eq!(
                md5sum(&env.images_dir().join(n).join("disk")),
                md5sum(&reference),
                "run {run}"
            );
        }
        std::fs::remove_file(&raw).unwrap();
        std::fs::remove_file(&reference).unwrap();
    }
    // Neither side ever wrote into the other's master directory.
    assert!(
        tree(&ironic_master(&env))
            .iter()
            .all(|(n, _)| n.ends_with(".converted")),
        "{:?}",
        tree(&ironic_master(&env))
    );
    assert_eq!(env.masters().len(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_direct_node_prepared_by_ironic_beside_its_notifications() {
    let env = Env::new("");
    let src = env.root().join("src");
    let server = SourceServer::start(&src).await;
    let worker = env.serve().await;
    let node = node();
    let (mut ironic, mut notifier) = (Conductor::start(), Notifier::start(&env.host));
    for run in 0..10u64 {
        let raw = env.root().join(format!("r{run}.raw"));
        patchy_raw(&raw, 16 << 20, 700 + run);
        let name = format!("img{run}.qcow2");
        qcow2_from(&raw, &src.join(&name), &[]);
        let url = server.url(&name);
        // Ironic prepares the node itself while its notifications for the
        // same node (deploy interface `direct`) reach the worker.
        let info = json!({"image_source": url});
        let transition = [
            json!({"node": node, "status": "start", "prev_state": "active",
                   "state": "deploying", "target": "active", "event": "rebuild",
                   "instance_info": info, "deploy_interface": "direct"}),
        ];
        let spec = json!({"op": "fetch", "node": node, "href": url, "force_raw": true});
        let (theirs, ()) = tokio::join!(ironic.run(&env, spec), notifier.emit(&transition));
        assert_eq!(theirs["ok"], true, "run {run}: Ironic failed: {theirs}");
        let reference = env.root().join(format!("r{run}.ref"));
        reference_raw(&src.join(&name), &reference);
        assert_eq!(
            md5sum(&env.images_dir().join(&node).join("disk")),
            md5sum(&reference)
        );
        std::fs::remove_file(&raw).unwrap();
        std::fs::remove_file(&reference).unwrap();
    }
    // Every notification was seen and ignored; the worker wrote nothing.
    let sample = "ironic_image_worker_ignored_messages_total{reason=\"other_deploy_interface\"}";
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let text = worker.metrics_text().await;
        if metric(&text, sample) >= Some(10.0) {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            // What the worker did count, since it did not see them all.
            let counted: Vec<&str> = text
                .lines()
                .filter(|l| {
                    l.strip_prefix("ironic_image_worker_").is_some_and(|name| {
                        [
                            "ignored_messages_total{",
                            "messages_consumed_total{",
                            "amqp_",
                        ]
                        .iter()
                        .any(|p| name.starts_with(p))
                    })
                })
                .collect();
            panic!("not all notifications seen: {counted:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(env.masters().is_empty());
    assert!(env.link_dir().join(&node).symlink_metadata().is_err());
    assert_eq!(
        tree(&env.images_dir().join(&node)).len(),
        1,
        "only Ironic's disk in the node's directory"
    );
}
