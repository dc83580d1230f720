//! Running out of disk space on a real (tmpfs) file system: clear errors,
//! eviction before giving up, no partial file, other images intact, and the
//! worker keeps serving. Needs root to mount the file system (CI runs as root).

use crate::common;

use common::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_fails_cleanly_evicts_first_and_keeps_serving() {
    let env = Env::new("");
    let small = env.root().join("small");
    let _mount = Tmpfs::mount(&small, "20m");
    let src = env.root().join("src");
    random_file(&src.join("a.img"), 8 << 20, 71);
    random_file(&src.join("b.img"), 14 << 20, 72);
    random_file(&src.join("c.img"), 16 << 20, 73);
    let server = SourceServer::start(&src).await;
    let faults = FaultServer::start(&src, 1 << 30).await;
    let sets: Vec<String> = [
        format!("pxe.instance_master_path={}/master", small.display()),
        format!("pxe.images_path={}/images", small.display()),
        format!("deploy.http_root={}/httpboot", small.display()),
    ]
    .to_vec();
    let mut args: Vec<&str> = Vec::new();
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let worker = env.serve_with(&args, &[]).await;
    let broker = Broker::connect().await;
    let master_dir = small.join("master");
    let temps = || {
        std::fs::read_dir(master_dir.join(".tmp"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .count()
    };

    let (na, nb) = (node(), node());
    let a = broker
        .call(&env.host, prepare_cmd(&na, &server.url("a.img")))
        .await;
    assert_eq!(a["status"], "success", "{a}");

    // B does not fit next to A (linked, so not evictable): refused up front
    // from Content-Length, nothing written.
    let b = broker
        .call(&env.host, prepare_cmd(&nb, &server.url("b.img")))
        .await;
    assert_eq!(b["error"]["code"], "insufficient_disk_space", "{b}");
    assert_eq!(temps(), 0);

    // Without a Content-Length the download runs into ENOSPC: same answer,
    // no partial file, A intact.
    let c = broker
        .call(
            &env.host,
            prepare_cmd(&node(), &faults.url("nolength", "c.img")),
        )
        .await;
    assert_eq!(c["error"]["code"], "insufficient_disk_space", "{c}");
    assert_eq!(temps(), 0);
    let (status, body) = get(a["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        std::fs::read(src.join("a.img")).unwrap(),
        "other images intact"
    );

    // Once A's node is torn down, A is evicted to make room for B.
    let done = broker
        .call(
            &env.host,
            serde_json::json!({"action": "cleanup", "node_uuid": na}),
        )
        .await;
    assert_eq!(done["status"], "success");
    let b = broker
        .call(&env.host, prepare_cmd(&nb, &server.url("b.img")))
        .await;
    assert_eq!(b["status"], "success", "{b}");
    assert_eq!(b["image_checksum"], md5sum(&src.join("b.img")));
    let metrics = worker.metrics_text().await;
    assert!(
        metric(&metrics, "ironic_image_worker_cache_evictions_total") >= Some(1.0),
        "an eviction was counted"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(worker);
}
