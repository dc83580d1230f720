//! Faults injected into the real broker, the worker process and the image
//! sources: nothing is lost, nothing wrong or partial is ever served.

use crate::common;

use common::*;
use std::time::{Duration, Instant};

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_short_and_reset_sources_are_retried_then_unreachable() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 4 << 20, 61);
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    for mode in ["stall", "short", "reset"] {
        let started = Instant::now();
        let (ok, ev) = env
            .prepare(
                &node(),
                &faults.url(mode, "disk.img"),
                &[
                    "--set",
                    "source.read_timeout=1",
                    "--set",
                    "source.retries=2",
                ],
            )
            .await;
        assert!(!ok);
        assert_eq!(ev["error"]["code"], "source_unreachable", "{mode}: {ev}");
        assert_eq!(
            faults.count(mode, "disk.img"),
            3,
            "{mode}: one attempt and two retries"
        );
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "{mode}: never a hang"
        );
    }
    assert!(env.masters().is_empty());
    assert!(env.temporaries().is_empty());
}

/// kill -9 during a download: the unacknowledged command is redelivered to
/// the restarted worker and answered exactly once, with the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_during_download_is_redelivered_and_answered_once() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 6 << 20, 62);
    let faults = FaultServer::start(&env.root().join("src"), 2 << 20).await;
    let broker = Broker::connect().await;
    let worker = env.serve().await;
    let node = node();
    let corr = broker
        .command(
            &env.host,
            prepare_cmd(&node, &faults.url("slow", "disk.img")),
        )
        .await;
    env.wait_for_temporary(MINUTE).await;
    worker.kill9().await;
    assert!(
        !env.temporaries().is_empty(),
        "the crash left a partial file"
    );
    let _again = env.serve().await;
    let (got, ev) = broker.next_reply(MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_served(&ev, &src);
    assert_eq!(
        get(ev["image_url"].as_str().unwrap()).await.1,
        std::fs::read(&src).unwrap()
    );
    assert!(
        env.temporaries().is_empty(),
        "start-up recovery removed the partial file"
    );
    let extra = tokio::time::timeout(Duration::from_secs(3), broker.next_reply(MINUTE)).await;
    assert!(extra.is_err(), "answered exactly once");
    assert_eq!(faults.count("slow", "disk.img"), 2);
}

/// kill -9 during a conversion: the isolated converter dies with the worker;
/// the restarted worker converts again and answers once, as qemu-img would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_during_conversion_is_redelivered_and_answered_once() {
    let env = Env::new(NO_MD5);
    let raw = env.root().join("big.raw");
    patchy_raw(&raw, 3 << 30, 63);
    let img = env.root().join("allowed/big.qcow2");
    qcow2_from(&raw, &img, &[]);
    std::fs::remove_file(&raw).unwrap();
    let reference = env.root().join("big.ref");
    reference_raw(&img, &reference);

    let broker = Broker::connect().await;
    let worker = env.serve().await;
    let corr = broker
        .command(
            &env.host,
            prepare_cmd(&node(), &format!("file://{}", img.display())),
        )
        .await;
    // The conversion's output is the second temporary (after the download's).
    let deadline = Instant::now() + MINUTE;
    loop {
        let converting = std::fs::read_dir(env.master_dir().join(".tmp"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .count()
            >= 2;
        if converting {
            break;
        }
        assert!(Instant::now() < deadline, "conversion never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    worker.kill9().await;
    let _again = env.serve().await;
    let (got, ev) = broker.next_reply(Duration::from_secs(300)).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    served(&reference).without_md5().check(&ev);
    assert!(env.temporaries().is_empty());
    let extra = tokio::time::timeout(Duration::from_secs(3), broker.next_reply(MINUTE)).await;
    assert!(extra.is_err(), "answered exactly once");
}

/// SIGTERM during work: the worker stops within its grace period and the
/// unfinished command goes back to the queue for the next worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_requeues_unfinished_work_within_the_grace_period() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 8 << 20, 64);
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let broker = Broker::connect().await;
    let worker = env
        .serve_with(&["--set", "amqp.shutdown_grace=1"], &[])
        .await;
    let corr = broker
        .command(
            &env.host,
            prepare_cmd(&node(), &faults.url("slow", "disk.img")),
        )
        .await;
    env.wait_for_temporary(MINUTE).await;
    let started = Instant::now();
    let status = worker.terminate().await;
    assert!(status.success(), "clean exit: {status}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "stopped within the grace period"
    );
    let _next = env.serve().await;
    let (got, ev) = broker.next_reply(MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_served(&ev, &src);
}

/// A command whose handling keeps killing the worker is dead-lettered by the
/// quorum queue's delivery limit instead of looping forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_message_is_dead_lettered_after_bounded_attempts() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 8 << 20, 65);
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let broker = Broker::connect().await;
    let limit = ["--set", "amqp.delivery_limit=1"];
    let corr = {
        let w = env.serve_with(&limit, &[]).await;
        let corr = broker
            .command(
                &env.host,
                prepare_cmd(&node(), &faults.url("slow", "disk.img")),
            )
            .await;
        env.wait_for_temporary(MINUTE).await;
        w.kill9().await;
        corr
    };
    // Second delivery: crash again.
    let w = env.serve_with(&limit, &[]).await;
    env.wait_for_temporary(MINUTE).await;
    let deadline = std::time::Instant::now() + MINUTE;
    while faults.count("slow", "disk.img") < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the second delivery never fetched the source"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.kill9().await;
    // The limit is exceeded: the broker dead-letters instead of a third try.
    let worker = env.serve_with(&limit, &[]).await;
    let dead = format!("ironic-image-worker.{}.dead", env.host);
    let mut got = Vec::new();
    for _ in 0..200 {
        got.extend(broker.drain(&dead).await);
        if !got.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(got.len(), 1, "dead-lettered");
    assert_eq!(
        got[0]
            .delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|c| c.as_str()),
        Some(corr.as_str())
    );
    assert_eq!(faults.count("slow", "disk.img"), 2, "no third attempt");
    // The worker is fine and answers the next command.
    random_file(&env.root().join("src/ok.img"), 1 << 20, 66);
    let src = SourceServer::start(&env.root().join("src")).await;
    let ev = broker
        .call(&env.host, prepare_cmd(&node(), &src.url("ok.img")))
        .await;
    assert_eq!(ev["status"], "success", "{ev}");
    drop(worker);
}

/// Two workers share one queue and one cache: 50 nodes of one image make
/// one download and one conversion, and every reply has the same checksums.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_one_download_one_conversion() {
    let env = Env::new("");
    let raw = env.root().join("d.raw");
    random_file(&raw, 6 << 20, 67);
    qcow2_from(&raw, &env.root().join("src/d.qcow2"), &[]);
    let server = SourceServer::start(&env.root().join("src")).await;
    let a = env.serve().await;
    let b = env.serve_another(&[]).await;
    let broker = Broker::connect().await;
    for _ in 0..50 {
        broker
            .command(&env.host, prepare_cmd(&node(), &server.url("d.qcow2")))
            .await;
    }
    let replies = broker.replies(50, Duration::from_secs(120)).await;
    let sums: std::collections::HashSet<String> = replies
        .values()
        .map(|r| {
            assert_eq!(r["status"], "success", "{r}");
            r["image_checksum"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(sums.len(), 1, "one MD5 for all: {sums:?}");
    assert_served(replies.values().next().unwrap(), &raw);
    assert_eq!(server.count("GET", "d.qcow2"), 1, "one download");
    let mut conversions = 0.0;
    let mut served_by = Vec::new();
    for w in [&a, &b] {
        let text = w.metrics_text().await;
        for line in text.lines() {
            if let Some(v) =
                line.strip_prefix("ironic_image_worker_conversion_duration_seconds_count ")
            {
                conversions += v.parse::<f64>().unwrap();
            }
            if let Some(v) = line.strip_prefix("ironic_image_worker_messages_consumed_total{action=\"prepare\",outcome=\"success\",source=\"command\"} ") {
                served_by.push(v.parse::<f64>().unwrap());
            }
        }
    }
    assert_eq!(conversions, 1.0, "one conversion across both workers");
    assert_eq!(
        served_by.len(),
        2,
        "both workers took commands: {served_by:?}"
    );
}

/// Prepare and cleanup of one node racing on two workers (cross-process node
/// locks): whatever order wins, the node's link and image agree, and a final
/// prepare serves the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_prepare_and_cleanup_stay_consistent() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 2 << 20, 68);
    let server = SourceServer::start(&env.root().join("src")).await;
    let _a = env.serve().await;
    let _b = env.serve_another(&[]).await;
    let broker = Broker::connect().await;
    let node = node();
    for i in 0..40 {
        let cmd = if i % 2 == 0 {
            prepare_cmd(&node, &server.url("disk.img"))
        } else {
            serde_json::json!({"action": "cleanup", "node_uuid": node})
        };
        broker.command(&env.host, cmd).await;
    }
    let replies = broker.replies(40, MINUTE).await;
    // A prepare that one worker reaches after the other ran the cleanup
    // sent after it is refused (it never takes effect after a later
    // cleanup); everything else succeeds.
    assert!(
        replies.values().all(|r| r["status"] == "success"
            || (r["action"] == "prepare" && r["error"]["code"] == "stale_request")),
        "{replies:?}"
    );
    let link = env.link_dir().join(&node);
    let disk = env.images_dir().join(&node).join("disk");
    assert_eq!(
        link.symlink_metadata().is_ok(),
        disk.exists(),
        "link and image agree"
    );
    let last = broker
        .call(&env.host, prepare_cmd(&node, &server.url("disk.img")))
        .await;
    assert_eq!(
        get(last["image_url"].as_str().unwrap()).await.1,
        std::fs::read(&src).unwrap()
    );
    assert!(env.temporaries().is_empty());
}

/// A checksum file is read into memory: one streamed without a length (or
/// announcing more) stops at 1 MiB with `invalid_message`, not a growing
/// process and not `checksum_mismatch`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_checksum_files_stop_at_one_mebibyte() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 71);
    random_file(&env.root().join("src/big.sums"), 3 << 20, 72);
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let server = SourceServer::start(&env.root().join("src")).await;
    for sums in [faults.url("endless", "sums"), server.url("big.sums")] {
        let (ok, ev) = env
            .prepare(&node(), &server.url("disk.img"), &["--checksum", &sums])
            .await;
        assert!(!ok);
        assert_eq!(ev["error"]["code"], "invalid_message", "{ev}");
        let msg = ev["error"]["message"].as_str().unwrap();
        assert!(msg.contains("larger than 1 MiB"), "{msg}");
    }
    assert_eq!(server.count("GET", "disk.img"), 0, "nothing downloaded");
}

/// A source that sends a byte now and then never trips the read timeout;
/// the minimum rate fails it (each attempt), and the overall deadline
/// bounds even a steady slow source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickling_and_endless_downloads_are_bounded() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 4 << 20, 73);
    let faults = FaultServer::start(&env.root().join("src"), 64 << 10).await;
    let (ok, ev) = env
        .prepare(
            &node(),
            &faults.url("trickle", "disk.img"),
            &[
                "--set",
                "source.min_rate=100",
                "--set",
                "source.min_rate_window=2",
                "--set",
                "source.retries=1",
            ],
        )
        .await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_unreachable", "{ev}");
    assert!(
        ev["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too slow"),
        "{ev}"
    );
    assert_eq!(faults.count("trickle", "disk.img"), 2, "one retry");

    let (ok, ev) = env
        .prepare(
            &node(),
            &faults.url("slow", "disk.img"),
            &["--set", "source.download_deadline=2"],
        )
        .await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_unreachable", "{ev}");
    assert!(
        ev["error"]["message"]
            .as_str()
            .unwrap()
            .contains("deadline"),
        "{ev}"
    );
    assert!(env.masters().is_empty());
    assert!(env.temporaries().is_empty());
}

/// Redirects are bounded: never to this host's loopback (where the metrics
/// port listens) unless allowed, never to another scheme, never in a loop;
/// a URL too long for any HTTP stack is an invalid message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_and_urls_are_bounded() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 74);
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let server = SourceServer::start(&env.root().join("src")).await;
    let local = faults.url("redirect", &server.url("disk.img"));
    let (ok, ev) = env.prepare(&node(), &local, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");
    assert_eq!(
        server.count("GET", "disk.img"),
        0,
        "the target was not fetched"
    );
    let (ok, ev) = env
        .prepare(
            &node(),
            &local,
            &["--set", "source.allow_local_redirects=true"],
        )
        .await;
    assert!(ok, "{ev}");
    assert_eq!(server.count("GET", "disk.img"), 1);

    let to_file = faults.url("redirect", "file:///etc/passwd");
    let (ok, ev) = env.prepare(&node(), &to_file, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");

    // A loop: every hop redirects to the same URL.
    let looping = format!(
        "http://{}/redirect/http://{}/redirect/x",
        faults.addr, faults.addr
    );
    let (ok, ev) = env
        .prepare(
            &node(),
            &looping,
            &[
                "--set",
                "source.allow_local_redirects=true",
                "--set",
                "source.max_redirects=3",
            ],
        )
        .await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");
    let hops = faults.count("redirect", "x");
    assert!((1..=4).contains(&hops), "bounded hops: {hops}");

    let long = format!("{}?{}", server.url("disk.img"), "a".repeat(64 * 1024));
    let (ok, ev) = env.prepare(&node(), &long, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "invalid_message", "{ev}");
    assert!(ev.to_string().len() < 4096, "the URL is not echoed back");
}

/// A host name other than `localhost` that this machine's /etc/hosts maps to
/// a loopback address (on this kind of machine: the host's own name).
fn loopback_alias() -> String {
    let hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
    hosts
        .lines()
        .filter_map(|l| {
            let mut words = l.split('#').next()?.split_whitespace();
            let ip: std::net::IpAddr = words.next()?.parse().ok()?;
            ip.is_loopback().then_some(words)
        })
        .flatten()
        .find(|n| !n.to_ascii_lowercase().contains("localhost"))
        .map(str::to_string)
        .expect("/etc/hosts maps a name other than localhost to a loopback address")
}

/// The local-address rule holds for the address a name resolves to, not
/// only for the URL's literal host: a redirect to a name resolving to
/// 127.0.0.1, or a source named that way, is refused unless allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_resolving_to_loopback_are_local_addresses() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 76);
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let server = SourceServer::start(&env.root().join("src")).await;
    let alias = loopback_alias();
    let target = format!("http://{alias}:{}/disk.img", server.addr.port());
    for source in [faults.url("redirect", &target), target.clone()] {
        let (ok, ev) = env.prepare(&node(), &source, &[]).await;
        assert!(!ok, "{source}: {ev}");
        assert_eq!(ev["error"]["code"], "source_not_allowed", "{source}: {ev}");
    }
    assert_eq!(server.count("GET", "disk.img"), 0, "never fetched");
    let allow = ["--set", "source.allow_local_redirects=true"];
    let (ok, ev) = env
        .prepare(&node(), &faults.url("redirect", &target), &allow)
        .await;
    assert!(ok, "{ev}");
    assert_eq!(server.count("GET", "disk.img"), 1);
}

/// The worker's own listeners are never a source, even where local
/// addresses are allowed: named directly (as an IP literal or a host name),
/// or reached through a redirect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_own_listeners_are_never_a_source() {
    let env = Env::new("");
    let worker = env
        .serve_with(&["--set", "source.allow_local_redirects=true"], &[])
        .await;
    let broker = Broker::connect().await;
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let metrics = worker.metrics_url("/metrics");
    let by_name = format!("http://localhost:{}/metrics", worker.metrics_port);
    let images = worker.image_url("/index.html");
    for source in [
        metrics.clone(),
        by_name,
        images,
        faults.url("redirect", &metrics),
    ] {
        let done = broker.call(&env.host, prepare_cmd(&node(), &source)).await;
        assert_eq!(done["status"], "error", "{source}: {done}");
        assert_eq!(
            done["error"]["code"], "source_not_allowed",
            "{source}: {done}"
        );
    }
    // The one-shot command refuses the configured listeners as well.
    let (ok, ev) = env.prepare(&node(), &metrics, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");
}

/// Credentials in a source URL never appear in the completion event (also
/// on the events exchange) or in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_source_urls_are_redacted_everywhere() {
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 75);
    let server = SourceServer::start(&env.root().join("src")).await;
    let with_password = format!("http://user:s3cretpw@{}/disk.img", server.addr);
    let with_token = format!("http://T0KENVALUE@{}/missing.img", server.addr);
    for (src, ok_expected) in [(&with_password, true), (&with_token, false)] {
        let out = env
            .run(&["prepare", "--node", &node(), "--image-source", src])
            .await;
        let (ok, ev) = completion_of(&out);
        assert_eq!(ok, ok_expected, "{ev}");
        let all = format!("{ev} {}", String::from_utf8_lossy(&out.stderr));
        assert!(
            !all.contains("s3cretpw") && !all.contains("T0KENVALUE"),
            "{all}"
        );
        assert!(
            ev["image_source"].as_str().unwrap().contains("***@"),
            "{ev}"
        );
    }

    let broker = Broker::connect().await;
    let tap = EventTap::new(&broker).await;
    let _worker = env.serve().await;
    let mut cmd = prepare_cmd(&node(), &with_password);
    cmd["request_id"] = "redacted".into();
    broker
        .publish_raw(
            &env.host,
            "prepare",
            cmd.to_string().as_bytes(),
            "c",
            None,
            false,
        )
        .await;
    let (_, _, ev) = tap.next(&env.host, MINUTE).await.expect("an event");
    assert_eq!(ev["status"], "success", "{ev}");
    assert!(!ev.to_string().contains("s3cretpw"), "{ev}");
}

/// Every file under `dir` (recursively, symlinks not followed) whose bytes
/// contain `needle`.
fn files_containing(dir: &std::path::Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                todo.push(path);
            } else if kind.is_file() {
                let bytes = std::fs::read(&path).unwrap_or_default();
                if bytes.windows(needle.len()).any(|w| w == needle) {
                    found.push(path.display().to_string());
                }
            } else if kind.is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                if target
                    .to_string_lossy()
                    .contains(&*String::from_utf8_lossy(needle))
                {
                    found.push(path.display().to_string());
                }
            }
        }
    }
    found
}

/// No file the worker writes holds a source's credentials (user-info or a
/// signed URL's parameters); its sidecars are its own (0600 in a 0700
/// directory); and the cache still finds the master for the same URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_file_the_worker_writes_holds_a_source_credential() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new("");
    random_file(&env.root().join("src/disk.img"), 1 << 20, 77);
    let server = SourceServer::start(&env.root().join("src")).await;
    let secret = "Zq8-s3cr3t-Pw";
    let sources = [
        format!("http://user:{secret}@{}/disk.img", server.addr),
        format!(
            "http://{}/disk.img?X-Amz-Expires=60&X-Amz-Signature={secret}&temp_url_sig={secret}",
            server.addr
        ),
    ];
    for source in &sources {
        for _ in 0..2 {
            let (ok, ev) = env.prepare(&node(), source, &[]).await;
            assert!(ok, "{ev}");
            assert!(!ev.to_string().contains(secret), "{ev}");
        }
    }
    assert_eq!(
        server.count("GET", "disk.img"),
        2,
        "one download per URL: the second prepare of each was a cache hit"
    );
    for dir in [
        env.master_dir(),
        env.images_dir(),
        env.root().join("httpboot"),
    ] {
        let found = files_containing(&dir, secret.as_bytes());
        assert!(found.is_empty(), "the secret is on disk in {found:?}");
    }
    let meta = env.master_dir().join(".meta");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&meta), 0o700);
    for sidecar in std::fs::read_dir(&meta).unwrap().flatten() {
        assert_eq!(mode(&sidecar.path()), 0o600, "{}", sidecar.path().display());
    }
}

/// `file://` sources: the allowed list is checked before the file system
/// is touched (a missing file outside it answers like `/etc/passwd`), and
/// the file is opened once beneath the allowed directory: no symlink out,
/// no FIFO hang, no directory. The allowed directory of these tests holds
/// `disk.img`, `sub/inside` (a link to it), `out-abs` and `out-rel` (links
/// to /etc/passwd), a FIFO `fifo`; returns it.
fn beneath_allowed(env: &Env) -> std::path::PathBuf {
    let allowed = env.root().join("allowed");
    random_file(&allowed.join("disk.img"), 1 << 20, 76);
    std::fs::create_dir(allowed.join("sub")).unwrap();
    std::os::unix::fs::symlink("../disk.img", allowed.join("sub/inside")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", allowed.join("out-abs")).unwrap();
    std::os::unix::fs::symlink("../../../../../../../etc/passwd", allowed.join("out-rel")).unwrap();
    tool("mkfifo", &[allowed.join("fifo").to_str().unwrap()]);
    allowed
}

/// Each of `names` (paths beneath the allowed directory, or absolute) is
/// refused with `code`.
async fn file_sources_refused(names: &[&str], code: &str) {
    let env = Env::new("");
    let allowed = beneath_allowed(&env);
    for name in names {
        let src = format!("file://{}", allowed.join(name).display());
        let (ok, ev) = env.prepare(&node(), &src, &[]).await;
        assert!(!ok, "{src}: {ev}");
        assert_eq!(ev["error"]["code"], code, "{src}: {ev}");
    }
}

/// One test per refusal: `name: [paths] => code;`.
macro_rules! file_sources_refused {
    ($($test:ident: $names:expr => $code:literal;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            file_sources_refused(&$names, $code).await;
        }
    )*};
}

file_sources_refused! {
    file_sources_outside_the_allowed_paths_are_refused_unread:
        ["/nonexistent/disk.img", "/etc/passwd"] => "source_not_allowed";
    a_missing_file_beneath_the_allowed_paths_is_not_found: ["missing.img"] => "source_not_found";
    symlinks_out_of_the_allowed_paths_are_refused: ["out-abs", "out-rel"] => "source_not_allowed";
    a_fifo_file_source_is_refused_without_hanging: ["fifo"] => "source_not_allowed";
    a_directory_file_source_is_refused: ["sub"] => "source_not_allowed";
    dot_dot_out_of_the_allowed_paths_is_refused: ["../src/x"] => "source_not_allowed";
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_within_the_allowed_paths_is_followed() {
    let env = Env::new("");
    let allowed = beneath_allowed(&env);
    let src = format!("file://{}", allowed.join("sub/inside").display());
    let (ok, ev) = env.prepare(&node(), &src, &[]).await;
    assert!(ok, "a symlink within the allowed directory is fine: {ev}");
    assert_served(&ev, &allowed.join("disk.img"));
}

/// Glance (and Keystone) answers are read into memory: one streaming for
/// ever ends at the bound with `source_unreachable`, the process small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_glance_documents_are_bounded() {
    let env = Env::new("");
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let endpoint = format!("glance.endpoint_override=http://{}/endless", faults.addr);
    let (ok, ev) = env
        .prepare(
            &node(),
            &node(),
            &["--set", "glance.auth_type=none", "--set", &endpoint],
        )
        .await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_unreachable", "{ev}");
    assert!(
        ev["error"]["message"]
            .as_str()
            .unwrap()
            .contains("larger than 8 MiB"),
        "{ev}"
    );
}

/// A source whose first attempt sends another qcow2 in full and then resets:
/// only what derives from the retry, whose bytes were verified, is served,
/// published and cached (a conversion of the first attempt is thrown away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_download_serves_only_the_verified_attempt() {
    let env = Env::new("");
    let size = 8u64 << 20;
    // A: 1 MiB of data in an 8 MiB disk (a small qcow2); B: 8 MiB of data.
    let raw_a = env.root().join("a.raw");
    let f = std::fs::File::create(&raw_a).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x41u8; 1 << 20], 0).unwrap();
    f.set_len(size).unwrap();
    let raw_b = env.root().join("b.raw");
    random_file(&raw_b, size as usize, 73);
    let img = env.root().join("src/disk.qcow2");
    qcow2_from(&raw_b, &img, &[]);
    qcow2_from(&raw_a, &env.root().join("src/disk.qcow2.first"), &[]);
    let reference = env.root().join("ref.raw");
    reference_raw(&img, &reference);
    let faults = FaultServer::start(&env.root().join("src"), 1 << 20).await;
    let url = faults.url("switch", "disk.qcow2");
    let checksum = sha256sum(&img);
    for round in 0..2 {
        let node = node();
        let (ok, ev) = env.prepare(&node, &url, &["--checksum", &checksum]).await;
        assert!(ok, "round {round}: {ev}");
        assert_eq!(ev["cache"], if round == 0 { "miss" } else { "hit" });
        assert_eq!(ev["converted"], true);
        let round = format!("round {round}");
        served(&reference).context(&round).check(&ev);
        let disk = env.images_dir().join(&node).join("disk");
        served(&disk).context(&round).check(&ev);
    }
    assert_eq!(faults.count("switch", "disk.qcow2"), 2, "one retry");
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
}
