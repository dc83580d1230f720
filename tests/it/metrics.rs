//! Every metric an operator relies on appears on /metrics and moves after a
//! scripted sequence of good and bad commands (scraped over HTTP, parsed).

use crate::common;

use common::*;
use serde_json::json;
use std::collections::HashMap;

/// Parses the Prometheus text format into `name{labels}` -> value.
fn scrape(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            Some((key.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Sum of the samples of `name` whose labels contain every `want` pair.
fn value(m: &HashMap<String, f64>, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for (key, v) in m {
        let (n, labels) = key.split_once('{').unwrap_or((key, ""));
        if n == name
            && want
                .iter()
                .all(|(k, val)| labels.contains(&format!("{k}=\"{val}\"")))
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_appear_and_move() {
    // Notifications on an exchange of the test's own: one every running
    // worker reads would reach other tests' queues as they are deleted.
    let env = Env::notified_alone("");
    let notifications = env.notification_exchange().to_string();
    let raw = env.root().join("d.raw");
    random_file(&raw, 3 << 20, 51);
    qcow2_from(&raw, &env.root().join("src/d.qcow2"), &[]);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let node = node();

    let first = broker
        .call(&env.host, prepare_cmd(&node, &server.url("d.qcow2")))
        .await;
    assert_eq!(first["status"], "success", "{first}");
    let again = broker
        .call(&env.host, prepare_cmd(&node, &server.url("d.qcow2")))
        .await;
    assert_eq!(again["cache"], "hit");
    let missing = broker
        .call(
            &env.host,
            prepare_cmd(&common::node(), &server.url("nope.img")),
        )
        .await;
    assert_eq!(missing["error"]["code"], "source_not_found");
    broker
        .publish_raw(&env.host, "prepare", b"garbage", "g", None, true)
        .await;
    broker.next_reply(std::time::Duration::from_secs(30)).await;
    let (status, body) = get(first["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    // A notification from another conductor: acknowledged and counted only.
    let other = json!({"publisher_id": "ironic-conductor.somebody-else", "event_type": "baremetal.node.provision_set.start",
                       "message_id": "x", "payload": {}});
    broker
        .publish_notification_on(&notifications, other.to_string().as_bytes())
        .await;
    // Wait until the notification was counted (a deadline, not a sleep).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let text = loop {
        let text = worker.metrics_text().await;
        let counted = value(
            &scrape(&text),
            "ironic_image_worker_ignored_messages_total",
            &[("reason", "other_publisher")],
        );
        if counted.is_some_and(|n| n >= 1.0) {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "notification never counted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let m = scrape(&text);
    let v = |name: &str, labels: &[(&str, &str)]| {
        value(&m, &format!("ironic_image_worker_{name}"), labels)
    };
    // Every series is checked before the wrong ones are reported together.
    let wrong = std::cell::RefCell::new(Vec::new());
    let at_least = |name: &str, labels: &[(&str, &str)], min: f64| match v(name, labels) {
        Some(got) if got >= min => {}
        got => wrong
            .borrow_mut()
            .push(format!("{name} {labels:?} = {got:?}, expected >= {min}")),
    };
    at_least(
        "messages_consumed_total",
        &[
            ("source", "command"),
            ("action", "prepare"),
            ("outcome", "success"),
        ],
        2.0,
    );
    at_least(
        "messages_consumed_total",
        &[("source", "command"), ("outcome", "invalid")],
        1.0,
    );
    at_least(
        "ignored_messages_total",
        &[("reason", "other_publisher")],
        1.0,
    );
    at_least(
        "completions_total",
        &[("status", "error"), ("code", "source_not_found")],
        1.0,
    );
    at_least(
        "completions_total",
        &[("status", "error"), ("code", "invalid_message")],
        1.0,
    );
    at_least(
        "completions_total",
        &[("action", "prepare"), ("status", "success")],
        2.0,
    );
    at_least("prepare_duration_seconds_count", &[("cache", "hit")], 1.0);
    at_least("prepare_duration_seconds_count", &[("cache", "miss")], 1.0);
    at_least(
        "download_bytes_total",
        &[],
        std::fs::metadata(env.root().join("src/d.qcow2"))
            .unwrap()
            .len() as f64,
    );
    at_least("download_duration_seconds_count", &[], 1.0);
    at_least("conversion_bytes_total", &[], (3 << 20) as f64);
    at_least("conversion_duration_seconds_count", &[], 1.0);
    at_least("hashing_duration_seconds_count", &[], 2.0);
    at_least("cache_size_bytes", &[], (3 << 20) as f64 * 0.5);
    at_least("cache_files", &[], 1.0);
    at_least("cache_linked_files", &[], 1.0);
    at_least("cache_limit_bytes", &[], (20480u64 << 20) as f64);
    // Nothing was evicted, nothing is in flight, the broker never dropped.
    let exactly = |name: &str, labels: &[(&str, &str)], want: f64| {
        if v(name, labels) != Some(want) {
            let got = v(name, labels);
            wrong
                .borrow_mut()
                .push(format!("{name} {labels:?} = {got:?}, expected {want}"));
        }
    };
    exactly("cache_evictions_total", &[], 0.0);
    at_least("active_links", &[], 1.0);
    exactly("operations_in_flight", &[], 0.0);
    exactly("in_flight_done_bytes", &[("stage", "download")], 0.0);
    exactly("in_flight_expected_bytes", &[("stage", "convert")], 0.0);
    exactly("amqp_enabled", &[], 1.0);
    exactly("amqp_connected", &[], 1.0);
    exactly("amqp_reconnects_total", &[], 0.0);
    if v("http_connections_open", &[]).is_none() {
        wrong
            .borrow_mut()
            .push("http_connections_open missing".into());
    }
    at_least("http_requests_total", &[("status", "200")], 1.0);
    at_least(
        "http_response_bytes_total",
        &[("status", "200")],
        body.len() as f64,
    );
    if !m
        .keys()
        .any(|k| k.starts_with("process_resident_memory_bytes"))
    {
        wrong.borrow_mut().push("no process metrics".into());
    }
    for line in text
        .lines()
        .filter(|l| l.starts_with("# TYPE ironic_image_worker_"))
    {
        let mut parts = line.split_whitespace().skip(2);
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        if name.ends_with("_total") != (kind == "counter") {
            wrong
                .borrow_mut()
                .push(format!("Prometheus naming: {line}"));
        }
    }
    let wrong = wrong.into_inner();
    assert!(wrong.is_empty(), "{}\n\nmetrics:\n{text}", wrong.join("\n"));
}

/// Every series the operations guide lists exists from a fresh worker's
/// first scrape (an alert or a rate over a series that appears only once
/// used misreads), with the build version and the readiness as series of
/// their own; names carry their unit last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_series_exists_from_the_start() {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let start = guide.find("`/metrics` (all names prefixed").unwrap();
    let end = start + guide[start..].find("`process_*`").unwrap();
    // Series of an open set of labels (an HTTP status, an error code or
    // reason, an outcome) appear when first counted; the others at once.
    let open = ["status", "reason", "code", "outcome"];
    let documented: Vec<&str> = guide[start..end]
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| {
            !open
                .iter()
                .any(|l| t.contains(&format!("{{{l}")) || t.contains(&format!(",{l}")))
        })
        .map(|t| t.split('{').next().unwrap_or(t))
        // Metric names: words joined by `_` (label values such as `ok`
        // and the prefix itself are not), the process metrics aside.
        .filter(|t| t.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .filter(|t| t.contains('_') && !t.ends_with('_') && !t.starts_with("process_"))
        .collect();
    assert!(documented.len() > 25, "{documented:?}");
    let env = Env::new("");
    let worker = env.serve().await;
    let (_, body) = get(&worker.metrics_url("/metrics")).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    let m = scrape(&text);
    let present = |name: &str| {
        m.keys().any(|k| {
            let n = k.split_once('{').map_or(k.as_str(), |(n, _)| n);
            n == format!("ironic_image_worker_{name}")
                || n == format!("ironic_image_worker_{name}_count")
        })
    };
    let missing: Vec<&&str> = documented.iter().filter(|n| !present(n)).collect();
    assert!(
        missing.is_empty(),
        "documented but absent: {missing:?}\n{text}"
    );
    assert!(
        text.contains(&format!(
            "ironic_image_worker_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    assert_eq!(
        value(&m, "ironic_image_worker_ready", &[]),
        Some(1.0),
        "{text}"
    );
    for name in m.keys().filter(|k| k.contains("bytes")) {
        let n = name.split_once('{').map_or(name.as_str(), |(n, _)| n);
        assert!(
            n.ends_with("_bytes")
                || n.ends_with("_bytes_total")
                || n.contains("_bytes_bucket")
                || n.ends_with("_bytes_sum")
                || n.ends_with("_bytes_count"),
            "{n}: the unit comes last"
        );
    }
    worker.terminate().await;
}
