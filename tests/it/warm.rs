//! `warm`: caching an image on one conductor's worker or on all of them
//! before any deploy, so the first prepare of it is a cache hit. Real
//! broker, real workers, qcow2 images made by `qemu-img`, a source server
//! that counts its requests.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

/// A warm command body for `instance_info`.
fn warm_cmd(instance_info: Value) -> Value {
    json!({
        "action": "warm",
        "request_id": uuid::Uuid::new_v4().to_string(),
        "instance_info": instance_info,
        "options": {},
    })
}

/// Sends a warm to the worker of `host` (`<host>.image.warm`) and returns
/// its answer (schema-validated by the broker client).
async fn warm(broker: &Broker, host: &str, instance_info: Value) -> Value {
    let key = format!("{host}.image.warm");
    let corr = broker
        .publish_to("ironic-image-worker", &key, &warm_cmd(instance_info), true)
        .await;
    let (got, ev) = broker.next_reply(WAIT).await;
    assert_eq!(
        got.as_deref(),
        Some(corr.as_str()),
        "correlation_id honoured"
    );
    ev
}

/// A qcow2 (8 MiB virtual, a few patches of data) under `dir/name`, and the
/// raw a conversion of it must give.
fn qcow2_image(dir: &Path, name: &str, seed: u64) -> (std::path::PathBuf, std::path::PathBuf) {
    let raw = dir.join(format!("{name}.raw"));
    patchy_raw(&raw, 8 << 20, seed);
    let img = dir.join(name);
    qcow2_from(&raw, &img, &[]);
    let reference = dir.join(format!("{name}.reference"));
    reference_raw(&img, &reference);
    std::fs::remove_file(&raw).unwrap();
    (img, reference)
}

/// Nothing of any node: no node directory, no published link, no ledger
/// record.
fn assert_no_node_files(env: &Env) {
    assert_eq!(list_visible(&env.images_dir()), Vec::<String>::new());
    assert_eq!(list_visible(&env.link_dir()), Vec::<String>::new());
    assert_eq!(
        list_visible(&env.images_dir().join(".ledger")),
        Vec::<String>::new()
    );
}

/// A warm answers as a prepare would (the converted master's checksums,
/// format, size) without node or URL, caches exactly the master a prepare
/// uses, and touches no node's files: the next prepare is a hit with no
/// further download.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_then_prepare_is_a_hit() {
    let env = Env::new("");
    let (img, reference) = qcow2_image(&env.root().join("src"), "disk.qcow2", 91);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let url = server.url("disk.qcow2");
    let info = json!({"image_source": url, "image_os_hash_algo": "sha256",
        "image_os_hash_value": sha256sum(&img)});

    let ev = warm(&broker, &env.host, info.clone()).await;
    assert_eq!(ev["status"], "success", "{ev}");
    assert_eq!(ev["action"], "warm");
    assert_eq!(ev["conductor_host"], env.host.as_str());
    assert_eq!(ev["cache"], "miss");
    assert_eq!(ev["converted"], true);
    assert_eq!(ev["image_disk_format"], "raw");
    assert_eq!(ev["image_source"], url.as_str());
    assert_served(&ev, &reference);
    assert!(ev.get("node_uuid").is_none(), "{ev}");
    assert!(ev.get("image_url").is_none(), "{ev}");
    assert_eq!(server.count("GET", "disk.qcow2"), 1);
    assert_eq!(env.masters().len(), 1, "{:?}", env.masters());
    assert!(env.masters()[0].ends_with(".converted"));
    assert_no_node_files(&env);

    let node = node();
    let mut cmd = prepare_cmd(&node, &url);
    cmd["instance_info"] = info;
    let prepared = broker.call(&env.host, cmd).await;
    assert_eq!(prepared["status"], "success", "{prepared}");
    assert_eq!(prepared["cache"], "hit", "{prepared}");
    assert_eq!(prepared["image_checksum"], ev["image_checksum"]);
    assert_eq!(server.count("GET", "disk.qcow2"), 1, "no second download");
    let (status, body) = get(&worker.image_url(&format!("/agent_images/{node}"))).await;
    assert_eq!(status, 200);
    assert_eq!(body, std::fs::read(&reference).unwrap());

    let metrics = worker.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ironic_image_worker_completions_total")
                && l.contains(r#"action="warm""#)
                && l.contains(r#"status="success""#)
                && !l.ends_with(" 0")),
        "{metrics}"
    );
}

/// `send warm --all-conductors` reaches every worker (each with its own
/// host and directories), prints each answer and waits for `--expect` of
/// them; the next prepare on each is a hit. An image that is not there is
/// an error on every conductor, and the exit code says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_warm_all_conductors() {
    // A command exchange of this test's own, so `all.image.warm` reaches
    // only this test's workers.
    let exchange = format!("iiw-warm-{}", uuid::Uuid::new_v4().simple());
    let extra = format!("[amqp]\ncommand_exchange = \"{exchange}\"\n");
    let envs: Vec<Env> = (0..3).map(|_| Env::new(&extra)).collect();
    let src = envs[0].root().join("src/disk.img");
    random_file(&src, 3 << 20, 92);
    let server = SourceServer::start(&envs[0].root().join("src")).await;
    let mut workers = Vec::new();
    for env in &envs {
        workers.push(env.serve().await);
    }
    let url = server.url("disk.img");

    let out = envs[0]
        .run(&[
            "send",
            "warm",
            "--all-conductors",
            "--image-source",
            &url,
            "--expect",
            "3",
            "--timeout",
            "90",
        ])
        .await;
    let answers = answers_of(&out);
    assert!(out.status.success(), "{answers:?}");
    let hosts: BTreeSet<String> = envs.iter().map(|e| e.host.clone()).collect();
    let answered: BTreeSet<String> = answers
        .iter()
        .map(|a| a["conductor_host"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(answered, hosts);
    for a in &answers {
        assert_eq!(a["status"], "success", "{a}");
        assert_eq!(a["cache"], "miss", "{a}");
        served(&src).context(&a["conductor_host"]).check(a);
    }
    assert_eq!(
        server.count("GET", "disk.img"),
        3,
        "one download per conductor"
    );
    for env in &envs {
        assert_no_node_files(env);
        let (ok, ev) = env.prepare(&node(), &url, &[]).await;
        assert!(ok, "{ev}");
        assert_eq!(ev["cache"], "hit", "{ev}");
    }
    assert_eq!(
        server.count("GET", "disk.img"),
        3,
        "every prepare was a hit"
    );

    // An image that is not there: every conductor answers an error.
    let missing = server.url("missing.img");
    let out = envs[0]
        .run(&[
            "send",
            "warm",
            "--all-conductors",
            "--image-checksum",
            "sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "--image-source",
            &missing,
            "--expect",
            "3",
            "--timeout",
            "90",
        ])
        .await;
    let answers = answers_of(&out);
    assert!(!out.status.success(), "{answers:?}");
    assert_eq!(answers.len(), 3, "{answers:?}");
    for a in &answers {
        assert_eq!(a["error"]["code"], "source_not_found", "{a}");
    }

    drop(workers);
    let broker = Broker::connect().await;
    let _ = broker
        .channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
}

/// Sets the access time of `path` to `secs`, keeping its modification time.
fn set_atime(path: &Path, secs: i64) {
    use rustix::fs::{AtFlags, CWD, Timespec, Timestamps, UTIME_OMIT};
    let times = Timestamps {
        last_access: Timespec {
            tv_sec: secs,
            tv_nsec: 0,
        },
        last_modification: Timespec {
            tv_sec: 0,
            tv_nsec: UTIME_OMIT,
        },
    };
    rustix::fs::utimensat(CWD, path, &times, AtFlags::empty()).unwrap();
}

/// Every JSON line `send` printed, schema-validated.
fn answers_of(out: &std::process::Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("an answer is JSON");
            assert_valid_completion(&v);
            v
        })
        .collect()
}

/// A warm with a wrong checksum is `checksum_mismatch` and an unsafe image
/// (a qcow2 with a backing file) `unsafe_image`, each with nothing cached;
/// a warm naming a node, or no image, is `invalid_message`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_refusals_cache_nothing() {
    let env = Env::new("");
    let src = env.root().join("src");
    random_file(&src.join("disk.img"), 1 << 20, 93);
    random_file(&src.join("base.raw"), 4 << 20, 94);
    let backing = src.join("backing.qcow2");
    qcow2_backed_by(&src.join("base.raw"), &backing);
    let server = SourceServer::start(&src).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;

    let wrong = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    let ev = warm(
        &broker,
        &env.host,
        json!({"image_source": server.url("disk.img"), "image_checksum": wrong}),
    )
    .await;
    assert_eq!(ev["status"], "error", "{ev}");
    assert_eq!(ev["error"]["code"], "checksum_mismatch", "{ev}");
    assert!(ev.get("image_checksum").is_none(), "{ev}");

    let ev = warm(
        &broker,
        &env.host,
        json!({"image_source": server.url("backing.qcow2")}),
    )
    .await;
    assert_eq!(ev["error"]["code"], "unsafe_image", "{ev}");
    assert!(ev.get("node_uuid").is_none(), "{ev}");
    assert_eq!(env.masters(), Vec::<String>::new());
    assert_eq!(env.temporaries(), Vec::<String>::new());
    assert_no_node_files(&env);

    let mut with_node = warm_cmd(json!({"image_source": server.url("disk.img")}));
    with_node["node_uuid"] = node().into();
    let key = format!("{}.image.warm", env.host);
    broker
        .publish_to("ironic-image-worker", &key, &with_node, true)
        .await;
    let (_, ev) = broker.next_reply(WAIT).await;
    assert_eq!(ev["error"]["code"], "invalid_message", "{ev}");
    let no_image = warm_cmd(json!({}));
    broker
        .publish_to("ironic-image-worker", &key, &no_image, true)
        .await;
    let (_, ev) = broker.next_reply(WAIT).await;
    assert_eq!(ev["error"]["code"], "invalid_message", "{ev}");
    assert_eq!(env.masters(), Vec::<String>::new());
}

/// Two warms of one image sent at once download it once (the second
/// waits behind the first and is a hit); a third through `send warm
/// --host` is a hit too, and counts as a use of the master for eviction.
/// A warm without `reply_to` is answered on the
/// events exchange as `image.warm.<status>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_warm_twice_downloads_once() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 16 << 20, 95);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let url = server.url("disk.img");
    let key = format!("{}.image.warm", env.host);
    let body = warm_cmd(json!({"image_source": url}));
    let mut other = body.clone();
    other["request_id"] = "second".into();
    broker
        .publish_to("ironic-image-worker", &key, &body, true)
        .await;
    broker
        .publish_to("ironic-image-worker", &key, &other, true)
        .await;
    let answers = broker.replies(2, WAIT).await;
    let outcomes: BTreeSet<String> = answers
        .values()
        .map(|a| {
            assert_eq!(a["status"], "success", "{a}");
            a["cache"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(outcomes, ["hit", "miss"].map(String::from).into());
    assert_eq!(server.count("GET", "disk.img"), 1);

    // A hit counts as a use of the master for eviction: its access time
    // (set back to 1970 here, its modification time kept) becomes now.
    let master = env.master_dir().join(&env.masters()[0]);
    let mtime_before = std::fs::metadata(&master).unwrap().mtime();
    set_atime(&master, 0);
    assert_eq!(std::fs::metadata(&master).unwrap().atime(), 0);
    let out = env
        .run(&[
            "send",
            "warm",
            "--host",
            &env.host,
            "--image-source",
            &url,
            "--wait",
            "--timeout",
            "60",
        ])
        .await;
    let (ok, ev) = completion_of(&out);
    assert!(ok, "{ev}");
    assert_eq!(ev["cache"], "hit", "{ev}");
    assert_eq!(server.count("GET", "disk.img"), 1);
    let after = std::fs::metadata(&master).unwrap();
    assert!(after.atime() > 1_000_000_000, "atime {}", after.atime());
    assert_eq!(after.mtime(), mtime_before);

    let tap = EventTap::new(&broker).await;
    broker
        .publish_to("ironic-image-worker", &key, &body, false)
        .await;
    let (routing_key, _, ev) = tap.next(&env.host, WAIT).await.expect("an event");
    assert_eq!(routing_key, "image.warm.success", "{ev}");
    assert_eq!(ev["cache"], "hit", "{ev}");
}

/// With `image_download_source = http` an http(s) source is what deploys
/// download from: a warm checks the source as a prepare would and says
/// `pass_through`, caching nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_in_http_mode_caches_nothing() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1 << 20, 96);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    let broker = Broker::connect().await;
    let ev = warm(
        &broker,
        &env.host,
        json!({"image_source": server.url("disk.img"), "image_download_source": "http",
            "image_checksum": format!("sha256:{}", sha256sum(&src))}),
    )
    .await;
    assert_eq!(ev["status"], "success", "{ev}");
    assert_eq!(ev["cache"], "pass_through", "{ev}");
    assert_eq!(ev["image_size"], 1 << 20);
    assert!(ev.get("image_url").is_none(), "{ev}");
    assert_eq!(server.count("GET", "disk.img"), 0);
    assert_eq!(env.masters(), Vec::<String>::new());
}

/// The command schema takes a warm without a node and refuses one with a
/// node or without an image, and still requires a node of every other
/// action.
#[test]
fn command_schema_of_warm() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schemas/command.v1.json"
    ))
    .unwrap();
    let schema = jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap();
    let warm = warm_cmd(json!({"image_source": "http://images.example/disk.qcow2"}));
    assert!(schema.is_valid(&warm));
    let mut with_node = warm.clone();
    with_node["node_uuid"] = node().into();
    assert!(!schema.is_valid(&with_node));
    assert!(!schema.is_valid(&warm_cmd(json!({}))));
    assert!(!schema.is_valid(&json!({"action": "warm"})));
    assert!(!schema.is_valid(&json!({"action": "cleanup"})));
    assert!(schema.is_valid(&json!({"action": "cleanup", "node_uuid": node()})));
    let prepare = prepare_cmd(&node(), "http://images.example/disk.qcow2");
    assert!(schema.is_valid(&prepare));
}
