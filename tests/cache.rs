//! Cache lifecycle with real files and hard links: eviction order, the
//! never-evict-linked rule, TTL, the size limit after a burst, the cache CLI.

mod common;

use common::*;
use serde_json::Value;
use std::time::Duration;

async fn cache_list(env: &Env) -> Vec<Value> {
    let out = env.run(&["cache", "list", "--json"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// Waits (with a deadline) until the wall clock is in a later second than
/// the last use of every master in the cache: eviction compares whole
/// seconds of mtime, atime and ctime, and ctime cannot be set by a test.
async fn wait_until_clock_passes_last_use(env: &Env) {
    use std::os::unix::fs::MetadataExt;
    let last_use = || {
        env.masters()
            .iter()
            .filter_map(|m| std::fs::metadata(env.master_dir().join(m)).ok())
            .map(|md| md.mtime().max(md.atime()).max(md.ctime()))
            .max()
            .unwrap_or(0)
    };
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while now() <= last_use() {
        assert!(
            std::time::Instant::now() < deadline,
            "clock did not advance"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `cache clean ARGS`, with `--set SET` when given.
async fn clean_with(env: &Env, set: Option<&str>, args: &[&str]) -> Value {
    let mut all = match set {
        Some(set) => vec!["--set", set, "cache", "clean"],
        None => vec!["cache", "clean"],
    };
    all.extend_from_slice(args);
    let out = env.run(&all).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oldest_unlinked_first_and_linked_never() {
    // 1 MiB random images; the limit is set per command below.
    let env = Env::new("");
    for name in ["a", "b", "c"] {
        random_file(
            &env.root().join(format!("allowed/{name}.img")),
            1 << 20,
            name.as_bytes()[0] as u64,
        );
    }
    let url = |n: &str| format!("file://{}/allowed/{n}.img", env.root().display());
    let nodes: Vec<String> = (0..3).map(|_| node()).collect();
    for (n, img) in nodes.iter().zip(["a", "b", "c"]) {
        let (ok, ev) = env.prepare(n, &url(img), &["--force-raw", "false"]).await;
        assert!(ok, "{ev}");
    }
    // a is released first, then b; c stays linked by its node.
    env.oneshot(&["cleanup", "--node", &nodes[0]]).await;
    wait_until_clock_passes_last_use(&env).await;
    env.oneshot(&["cleanup", "--node", &nodes[1]]).await;

    let listed = cache_list(&env).await;
    assert_eq!(listed.len(), 3);
    let master =
        |n: &str| uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, url(n).as_bytes()).to_string();
    let (a, b, c) = (master("a"), master("b"), master("c"));
    let entry = |name: &str| listed.iter().find(|e| e["name"] == name).unwrap().clone();
    assert_eq!(entry(&a)["linked_nodes"], 0);
    assert_eq!(entry(&b)["linked_nodes"], 0);
    assert_eq!(entry(&c)["linked_nodes"], 1);
    assert!(entry(&a)["last_used"].as_i64() < entry(&b)["last_used"].as_i64());

    // Over a 2 MiB limit with 3 MiB cached: only the oldest unlinked goes.
    let r = clean_with(&env, Some("pxe.image_cache_size=2"), &[]).await;
    assert_eq!(r["evicted"], serde_json::json!([a]));
    assert!(
        !env.master_dir().join(format!("{a}.meta.json")).exists(),
        "sidecar evicted with its master"
    );
    // Limit 0: everything unlinked goes, the linked master stays.
    let r = clean_with(&env, Some("pxe.image_cache_size=0"), &[]).await;
    assert_eq!(r["evicted"], serde_json::json!([b]));
    assert_eq!(env.masters(), vec![c.clone()]);
    // The node using c is still served.
    assert!(env.images_dir().join(&nodes[2]).join("disk").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_dry_run_and_all_unused() {
    let env = Env::new("");
    for name in ["a", "b"] {
        random_file(
            &env.root().join(format!("allowed/{name}.img")),
            1 << 20,
            40 + name.len() as u64,
        );
    }
    let url = |n: &str| format!("file://{}/allowed/{n}.img", env.root().display());
    let (n1, n2) = (node(), node());
    assert!(env.prepare(&n1, &url("a"), &[]).await.0);
    assert!(env.prepare(&n2, &url("b"), &[]).await.0);
    env.oneshot(&["deployed", "--node", &n1]).await;
    // Within the default TTL (a week) nothing expires; an orphaned sidecar
    // (its master gone) is tidied away.
    let orphan = env
        .master_dir()
        .join("0e0e0e0e-0000-5000-8000-000000000000.meta.json");
    std::fs::write(&orphan, "{}").unwrap();
    assert_eq!(
        clean_with(&env, None, &[]).await["evicted"],
        serde_json::json!([])
    );
    assert!(!orphan.exists());
    // A dry run says what would go and removes nothing.
    wait_until_clock_passes_last_use(&env).await;
    let dry = clean_with(&env, Some("pxe.image_cache_ttl=0"), &["--dry-run"]).await;
    assert_eq!(dry["evicted"].as_array().unwrap().len(), 1);
    assert_eq!(env.masters().len(), 2);
    // TTL 0: the unused master expires; the linked one does not.
    let r = clean_with(&env, Some("pxe.image_cache_ttl=0"), &[]).await;
    assert_eq!(r["evicted"].as_array().unwrap().len(), 1);
    assert_eq!(env.masters().len(), 1);
    env.oneshot(&["cleanup", "--node", &n2]).await;
    let r = clean_with(&env, None, &["--all-unused"]).await;
    assert_eq!(r["evicted"].as_array().unwrap().len(), 1);
    assert!(env.masters().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_limit_holds_after_a_burst() {
    let env = Env::new("");
    let worker = env
        .serve_with(&["--set", "pxe.image_cache_size=3"], &[])
        .await;
    let broker = Broker::connect().await;
    for i in 0..8u64 {
        let img = env.root().join(format!("allowed/{i}.img"));
        random_file(&img, 1 << 20, 100 + i);
        let node = node();
        let url = format!("file://{}", img.display());
        let ev = broker.call(&env.host, prepare_cmd(&node, &url)).await;
        assert_eq!(ev["status"], "success", "{ev}");
        let ev = broker
            .call(
                &env.host,
                serde_json::json!({"action": "deployed", "node_uuid": node}),
            )
            .await;
        assert_eq!(ev["status"], "success");
    }
    let total: u64 = cache_list(&env)
        .await
        .iter()
        .map(|e| e["size"].as_u64().unwrap())
        .sum();
    assert!(total <= 3 << 20, "cache holds {total} bytes, limit 3 MiB");
    let metrics = worker.metrics_text().await;
    assert!(
        metrics.contains("ironic_image_worker_cache_files"),
        "{metrics}"
    );
}
