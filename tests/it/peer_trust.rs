//! Trust between conductors: only the holders of the deployment's
//! `[peers]` secret can ask or answer on the peers' exchange, and even
//! they only within rules. An impostor on the real broker (a client
//! without the secret) publishes forged offers, seals and claims; a holder
//! of the secret names URLs it must not; holders are busy, slow, or hold
//! a decompressed master; bodies are oversized; a worker waits for
//! another's download. Every image is made by qemu-img and every answer
//! checked against sha256sum.

use crate::common;
use crate::peers::{
    Conductor, MINUTE, SECRET, conductors, cutting_proxy, exchange, image, image_with, metric_of,
    peers_section, prepare,
};

use common::*;
use futures_util::StreamExt;
use hmac::{KeyInit, Mac};
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::{Value, json};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The seal headers of a peers' message as docs/contract.md describes
/// them, made with `secret`.
fn seal(secret: &[u8], kind: &str, correlation: &str, reply_to: &str, body: &[u8]) -> FieldTable {
    let time = now_ms();
    let mut mac = HmacSha256::new_from_slice(secret).unwrap();
    let time_text = time.to_string();
    for field in [
        b"iiw-peers-v1".as_slice(),
        kind.as_bytes(),
        correlation.as_bytes(),
        reply_to.as_bytes(),
        time_text.as_bytes(),
        body,
    ] {
        mac.update(&(field.len() as u64).to_be_bytes());
        mac.update(field);
    }
    let mut headers = FieldTable::default();
    headers.insert(
        "x-iiw-peer-time".into(),
        AMQPValue::LongLongInt(time as i64),
    );
    headers.insert(
        "x-iiw-peer-mac".into(),
        AMQPValue::LongString(hex::encode(mac.finalize().into_bytes()).into()),
    );
    headers
}

/// The claim queue of master `name` as the workers name it, from the
/// secret (what an impostor could only learn from a leak).
fn sealed_claim(exchange: &str, name: &str) -> String {
    let mut mac = HmacSha256::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(b"iiw-peers-claim-v1\n");
    mac.update(name.as_bytes());
    format!(
        "{exchange}.claim.{}",
        hex::encode(&mac.finalize().into_bytes()[..16])
    )
}

/// `/masters/<name>?temp_url_sig=..&temp_url_expires=..`, signed with the
/// secret.
fn signed_path(name: &str) -> String {
    let expires = now_ms() / 1000 + 300;
    let mut mac = HmacSha256::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(format!("GET\n{expires}\n/masters/{name}").as_bytes());
    let sig = hex::encode(mac.finalize().into_bytes());
    format!("/masters/{name}?temp_url_sig={sig}&temp_url_expires={expires}")
}

/// What an impostor answers to one query (`name`, its correlation id and
/// `reply_to`): bodies to send back, each with the headers it carries.
type Answers = Box<dyn Fn(&str, &str, &str) -> Vec<(Value, FieldTable)> + Send + Sync>;

/// A client of the real broker that hears every query on a peers'
/// exchange (as anyone on the broker can) and answers it as it likes;
/// it may also take claim queues. Counts the queries it heard.
struct Impostor {
    conn: lapin::Connection,
    heard: Arc<Mutex<Vec<String>>>,
    /// Claim queues it holds (kept declared on this channel).
    claims: lapin::Channel,
}

impl Impostor {
    async fn start(exchange: &str, answers: Answers) -> Impostor {
        let conn = lapin::Connection::connect(AMQP_URL, Default::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        channel
            .exchange_declare(
                exchange.into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let own = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        };
        let q = channel
            .queue_declare("".into(), own, FieldTable::default())
            .await
            .unwrap();
        let q = q.name().to_string();
        channel
            .queue_bind(
                q.as_str().into(),
                exchange.into(),
                "query.#".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut consumer = channel
            .basic_consume(
                q.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let heard: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = heard.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let p = &d.properties;
                let (Some(reply_to), Some(corr)) = (p.reply_to(), p.correlation_id()) else {
                    continue;
                };
                let Ok(query) = serde_json::from_slice::<Value>(&d.data) else {
                    continue;
                };
                let name = query["name"].as_str().unwrap_or_default().to_string();
                seen.lock().unwrap().push(name.clone());
                for (body, headers) in answers(&name, corr.as_str(), reply_to.as_str()) {
                    let props = lapin::BasicProperties::default()
                        .with_content_type("application/json".into())
                        .with_type("offer".into())
                        .with_correlation_id(corr.clone())
                        .with_headers(headers);
                    let _ = channel
                        .basic_publish(
                            "".into(),
                            reply_to.as_str().into(),
                            Default::default(),
                            body.to_string().as_bytes(),
                            props,
                        )
                        .await;
                }
            }
        });
        let claims = conn.create_channel().await.unwrap();
        Impostor {
            conn,
            heard,
            claims,
        }
    }

    /// Takes the exclusive queue `queue` (a claim) and keeps it.
    async fn squat(&self, queue: &str) {
        self.claims
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
    }

    fn heard(&self) -> Vec<String> {
        self.heard.lock().unwrap().clone()
    }
}

/// A raw file of `mib` MiB of random bytes under `dir`: its path, size,
/// md5 and sha256.
fn evil_bytes(dir: &Path, name: &str, mib: usize) -> (std::path::PathBuf, u64, String, String) {
    let path = dir.join(name);
    random_file(&path, mib << 20, 666);
    let size = std::fs::metadata(&path).unwrap().len();
    (path.clone(), size, md5sum(&path), sha256sum(&path))
}

/// An offer of a `verified` master from `url`, describing the bytes
/// (`size`, `md5`, `sha256`) as the conversion of the source `href` with
/// checksum `sha`, fetched just now (the newest there is).
fn verified_offer(name: &str, url: &str, href: &str, sha: &str, facts: (u64, &str, &str)) -> Value {
    let (size, md5, sha256) = facts;
    json!({"name": name, "host": "impostor", "process": "p", "url": url,
        "state": "verified",
        "master": {"size": size, "md5": md5, "sha256": sha256, "converted": true,
            "disk_format": "raw", "source_format": "qcow2", "source": href,
            "fetched_at": now_ms() / 1000 + 60, "source_size": size,
            "source_sha256": sha}})
}

/// A worker's master name for an http(s) image source, as Ironic names
/// it (the one a query asks for): learnt from the first query heard.
async fn first_name(imp: &Impostor) -> String {
    let deadline = tokio::time::Instant::now() + MINUTE;
    loop {
        if let Some(n) = imp.heard().first() {
            return n.clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "no query heard");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A participant of the broker without the secret answers every query
/// with forged offers: a `verified` one naming its own listener and bytes
/// (claiming the request's own source and checksum, and the newest
/// fetch), the same with a made-up seal, and a `downloading` one; it also
/// takes the claim queue under the name workers used before claims were
/// sealed. The worker reads none of them: it takes the claim, downloads
/// from the source once and serves qemu-img's bytes; the impostor's
/// listener is never asked; the refusals are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_offers_from_a_participant_without_the_secret_are_ignored() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 16);
    let source = SourceServer::start(src.path()).await;
    let evil_dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(evil_dir.path().join("masters")).unwrap();
    let evil = SourceServer::start(evil_dir.path()).await;
    let (evil_file, size, md5, sha256) = evil_bytes(src.path(), "evil.raw", 4);
    let ex = exchange();
    let href = source.url("disk.qcow2");
    let (url, h, s) = (format!("http://{}", evil.addr), href.clone(), sha.clone());
    let masters = evil_dir.path().join("masters");
    let imp = Impostor::start(
        &ex,
        Box::new(move |name, _, _| {
            let _ = std::fs::copy(&evil_file, masters.join(name));
            let offer = verified_offer(name, &url, &h, &s, (size, &md5, &sha256));
            let mut made_up = FieldTable::default();
            made_up.insert(
                "x-iiw-peer-time".into(),
                AMQPValue::LongLongInt(now_ms() as i64),
            );
            made_up.insert(
                "x-iiw-peer-mac".into(),
                AMQPValue::LongString("ab".repeat(32).into()),
            );
            let downloading = json!({"name": name, "host": "impostor", "process": "p",
                "url": url, "state": "downloading", "live_size": size});
            vec![
                (offer.clone(), FieldTable::default()),
                (offer, made_up),
                (downloading, FieldTable::default()),
            ]
        }),
    )
    .await;
    let b = conductors(1, Some(&ex)).await.remove(0);
    let broker = Broker::connect().await;
    let corr = broker
        .command(&b.env.host, prepare(&node(), &href, &sha))
        .await;
    let name = first_name(&imp).await;
    imp.squat(&format!("{ex}.claim.{name}")).await;
    let (got, ev) = broker.next_reply(2 * MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()), "{ev}");
    assert_served(&ev, &served);
    assert_eq!(source.count("GET", "disk.qcow2"), 1, "from the source");
    assert_eq!(
        evil.count("GET", &format!("masters/{name}")),
        0,
        "the impostor's listener was never asked"
    );
    let masters = b.env.masters();
    assert_eq!(
        sha256sum(&b.env.master_dir().join(&masters[0])),
        sha256sum(&served)
    );
    for reason in ["unsigned", "bad_signature"] {
        let line = format!(
            "ironic_image_worker_peer_refused_messages_total{{kind=\"offer\",reason=\"{reason}\"}}"
        );
        assert!(metric_of(&b, &line).await >= 1.0, "{line}");
    }
    drop(imp.conn);
}

/// Queries are sealed too: an impostor's unsigned query for a master a
/// worker holds, or a worker's sealed query replayed by whoever heard it,
/// makes no worker answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsigned_or_replayed_queries_are_not_answered() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 8);
    let source = SourceServer::start(src.path()).await;
    let ex = exchange();
    let a = conductors(1, Some(&ex)).await.remove(0);
    let broker = Broker::connect().await;
    let cmd = prepare(&node(), &source.url("disk.qcow2"), &sha);
    assert_served(&broker.call(&a.env.host, cmd).await, &served);
    let name = a.env.masters()[0].clone();
    // The impostor's own queue hears what comes back.
    let imp = Impostor::start(&ex, Box::new(|_, _, _| Vec::new())).await;
    let ch = imp.conn.create_channel().await.unwrap();
    let own = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..Default::default()
    };
    let inbox = ch
        .queue_declare("".into(), own, FieldTable::default())
        .await
        .unwrap();
    let inbox = inbox.name().to_string();
    let body = json!({"name": name, "host": "impostor", "process": "p"}).to_string();
    let sealed = seal(
        SECRET.as_bytes(),
        "query",
        "replayed-1",
        &inbox,
        body.as_bytes(),
    );
    for (corr, headers) in [
        ("unsigned-1", FieldTable::default()),
        ("replayed-1", sealed.clone()),
        ("replayed-1", sealed),
    ] {
        let props = lapin::BasicProperties::default()
            .with_type("query".into())
            .with_correlation_id(corr.into())
            .with_reply_to(inbox.as_str().into())
            .with_headers(headers);
        ch.basic_publish(
            ex.as_str().into(),
            format!("query.{name}").as_str().into(),
            Default::default(),
            body.as_bytes(),
            props,
        )
        .await
        .unwrap();
    }
    // Offers expire after the query timeout: take them as they come.
    let mut answers = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < until {
        let got = ch
            .basic_get(inbox.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        match got {
            Some(m) => answers.push(m.delivery.properties.correlation_id().clone()),
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    // The sealed query (as a worker would send it) is answered once, the
    // unsigned one and the replay never.
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].as_ref().unwrap().as_str(), "replayed-1");
    for reason in ["unsigned", "replayed"] {
        let line = format!(
            "ironic_image_worker_peer_refused_messages_total{{kind=\"query\",reason=\"{reason}\"}}"
        );
        assert_eq!(metric_of(&a, &line).await, 1.0, "{line}");
    }
}

/// A claim taken by something that never answers `downloading` (the
/// claim's name leaked to an impostor, which takes it under the sealed
/// name and the old one) holds nobody for long: the worker downloads
/// from the source itself and counts the silent claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_claim_holder_stalls_nobody() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 8);
    let source = SourceServer::start(src.path()).await;
    let ex = exchange();
    let imp = Impostor::start(&ex, Box::new(|_, _, _| Vec::new())).await;
    let env = Env::new(&format!("download_deadline = 600\n{}", peers_section(&ex)));
    let b = Conductor {
        worker: env.serve().await,
        env,
    };
    // Learn the master's name from a first prepare of another conductor's
    // image name: the name depends on the source URL only.
    let broker = Broker::connect().await;
    let href = source.url("disk.qcow2");
    let probe = Env::new("");
    let (ok, ev) = probe
        .prepare(&node(), &href, &["--checksum", &format!("sha256:{sha}")])
        .await;
    assert!(ok, "{ev}");
    let name = probe.masters()[0].clone();
    assert_eq!(source.count("GET", "disk.qcow2"), 1);
    imp.squat(&sealed_claim(&ex, &name)).await;
    imp.squat(&format!("{ex}.claim.{name}")).await;
    let corr = broker
        .command(&b.env.host, prepare(&node(), &href, &sha))
        .await;
    let (got, ev) = broker.next_reply(MINUTE).await;
    assert_eq!(
        got.as_deref(),
        Some(corr.as_str()),
        "answered well before the deadline: {ev}"
    );
    assert_served(&ev, &served);
    assert_eq!(source.count("GET", "disk.qcow2"), 2);
    assert_eq!(
        metric_of(&b, "ironic_image_worker_peer_silent_claims_total").await,
        1.0
    );
}

/// Even a holder of the secret cannot send a worker anywhere: an offer
/// whose URL is not a peer listener's (`http(s)://host[:port]`), or names
/// a local address (loopback, or link-local: a listener in a network
/// namespace of the test's own) while this worker's own listener is not on
/// one, is not used; the worker downloads from the source, and the trap is
/// never reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offers_name_only_peer_listeners_at_allowed_addresses() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 8);
    let source = SourceServer::start(src.path()).await;
    let evil_dir = tempfile::tempdir().unwrap();
    let evil = SourceServer::start(evil_dir.path()).await;
    let trap = netns::Trap::link_local(&evil_dir.path().join("trap"));
    let (status, _) = get(&format!("{}/probe", trap.url)).await;
    assert_eq!(status, 401, "the trap is reachable from here");
    let (evil_file, size, md5, sha256) = evil_bytes(src.path(), "evil.raw", 4);
    let ex = exchange();
    let href = source.url("disk.qcow2");
    let urls = [
        trap.url.clone(),
        format!("http://{}/elsewhere", evil.addr),
        format!("http://{}", evil.addr),
    ];
    let (h, s, dir) = (href.clone(), sha.clone(), evil_dir.path().to_path_buf());
    let imp = Impostor::start(
        &ex,
        Box::new(move |name, corr, _| {
            for sub in ["masters", "elsewhere/masters"] {
                std::fs::create_dir_all(dir.join(sub)).unwrap();
                let _ = std::fs::copy(&evil_file, dir.join(sub).join(name));
            }
            urls.iter()
                .map(|u| {
                    let offer = verified_offer(name, u, &h, &s, (size, &md5, &sha256));
                    let headers = seal(
                        SECRET.as_bytes(),
                        "offer",
                        corr,
                        "",
                        offer.to_string().as_bytes(),
                    );
                    (offer, headers)
                })
                .collect()
        }),
    )
    .await;
    // This worker's own listener URL names no local address (its peers
    // would be on other hosts).
    let port = free_port();
    let env = Env::new(&format!(
        "[peers]\nlisten = \"127.0.0.1:{port}\"\nurl = \"http://peer-b.invalid:{port}\"\n\
         secret = \"{SECRET}\"\nexchange = \"{ex}\"\n"
    ));
    let b = Conductor {
        worker: env.serve().await,
        env,
    };
    let broker = Broker::connect().await;
    let ev = broker
        .call(&b.env.host, prepare(&node(), &href, &sha))
        .await;
    assert_served(&ev, &served);
    assert!(!imp.heard().is_empty(), "the offers were made");
    assert_eq!(trap.hits().len(), 1, "only the probe: {:?}", trap.hits());
    let name = b.env.masters()[0].clone();
    for path in [
        format!("masters/{name}"),
        format!("elsewhere/masters/{name}"),
    ] {
        assert_eq!(evil.count("GET", &path), 0, "{path}");
    }
    assert_eq!(source.count("GET", "disk.qcow2"), 1);
    assert!(
        metric_of(
            &b,
            "ironic_image_worker_peer_refused_offers_total{reason=\"url\"}"
        )
        .await
            >= 3.0
    );
}

/// A master decompressed from a zstd source (raw, so not converted)
/// crosses between conductors like any other: its bytes are checked
/// against what the holder recorded, not against the compressed source's
/// checksum, and nobody is found bad.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zstd_decompressed_master_crosses_between_conductors() {
    let src = tempfile::tempdir().unwrap();
    let raw = src.path().join("disk.raw");
    patchy_raw(&raw, 16 << 20, 17);
    let data = std::fs::read(&raw).unwrap();
    let packed = src.path().join("disk.raw.zst");
    std::fs::write(&packed, zstd::encode_all(&data[..], 3).unwrap()).unwrap();
    let (sha, served) = (sha256sum(&packed), raw.clone());
    let source = SourceServer::start(src.path()).await;
    let cloud = conductors(2, Some(&exchange())).await;
    let broker = Broker::connect().await;
    let cmd = || {
        let mut c = prepare(&node(), &source.url("disk.raw.zst"), &sha);
        c["instance_info"]["image_disk_format"] = json!("raw");
        c
    };
    assert_served(&broker.call(&cloud[0].env.host, cmd()).await, &served);
    let ev = broker.call(&cloud[1].env.host, cmd()).await;
    assert_served(&ev, &served);
    assert_eq!(source.count("GET", "disk.raw.zst"), 1, "B took A's master");
    let b = &cloud[1];
    assert_eq!(
        metric_of(
            b,
            "ironic_image_worker_peer_fetch_failures_total{reason=\"digest_mismatch\"}"
        )
        .await,
        0.0
    );
    let masters = b.env.masters();
    assert_eq!(
        sha256sum(&b.env.master_dir().join(&masters[0])),
        sha256sum(&served)
    );
}

/// A holder serving as many peers as `max_uploads` answers 503 with
/// `Retry-After`: the asker comes back as told instead of giving the
/// holder up, and takes the master from it once it has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_holder_is_asked_again_after_retry_after() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image_with(src.path(), "disk.qcow2", 48, true);
    let source = SourceServer::start(src.path()).await;
    let ex = exchange();
    let listen = free_port();
    let a_env = Env::new(&format!(
        "[peers]\nlisten = \"127.0.0.1:{listen}\"\nsecret = \"{SECRET}\"\nexchange = \"{ex}\"\n\
         max_uploads = 1\n"
    ));
    let a = Conductor {
        worker: a_env.serve().await,
        env: a_env,
    };
    let broker = Broker::connect().await;
    let href = source.url("disk.qcow2");
    assert_served(
        &broker
            .call(&a.env.host, prepare(&node(), &href, &sha))
            .await,
        &served,
    );
    let name = a.env.masters()[0].clone();
    // The test takes A's only upload and keeps it unread.
    let held = reqwest::get(format!("http://127.0.0.1:{listen}{}", signed_path(&name)))
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let b = conductors(1, Some(&ex)).await.remove(0);
    let corr = broker
        .command(&b.env.host, prepare(&node(), &href, &sha))
        .await;
    let busy = "ironic_image_worker_peer_served_requests_total{status=\"503\"}";
    let deadline = tokio::time::Instant::now() + MINUTE;
    while metric_of(&a, busy).await < 4.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "B did not come back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(held);
    let (got, ev) = broker.next_reply(2 * MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_served(&ev, &served);
    assert_eq!(source.count("GET", "disk.qcow2"), 1, "B waited for A");
    assert!(
        metric_of(
            &b,
            "ironic_image_worker_peer_fetch_failures_total{reason=\"busy\"}"
        )
        .await
            >= 4.0
    );
}

/// A holder trickling its master (behind a proxy passing 16 KiB/s) is
/// held to `[source]min_rate` as a source is: the asker gives it up and
/// downloads from the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_holder_is_held_to_min_rate() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 24);
    let source = SourceServer::start(src.path()).await;
    let ex = exchange();
    let listen = free_port();
    let (proxy, _) = cutting_proxy(listen, usize::MAX, 16 << 10).await;
    let a_env = Env::new(&format!(
        "[peers]\nlisten = \"127.0.0.1:{listen}\"\nurl = \"http://127.0.0.1:{proxy}\"\n\
         secret = \"{SECRET}\"\nexchange = \"{ex}\"\n"
    ));
    let a = Conductor {
        worker: a_env.serve().await,
        env: a_env,
    };
    let broker = Broker::connect().await;
    let href = source.url("disk.qcow2");
    assert_served(
        &broker
            .call(&a.env.host, prepare(&node(), &href, &sha))
            .await,
        &served,
    );
    let b_env = Env::new(&format!(
        "min_rate = 262144\nmin_rate_window = 2\n{}",
        peers_section(&ex)
    ));
    let b = Conductor {
        worker: b_env.serve().await,
        env: b_env,
    };
    let corr = broker
        .command(&b.env.host, prepare(&node(), &href, &sha))
        .await;
    let (got, ev) = broker.next_reply(2 * MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()), "{ev}");
    assert_served(&ev, &served);
    assert_eq!(source.count("GET", "disk.qcow2"), 2, "B went to the source");
    assert!(
        metric_of(
            &b,
            "ironic_image_worker_peer_fetch_failures_total{reason=\"too_slow\"}"
        )
        .await
            >= 1.0
    );
}

/// A body over the peers' bound is never read: one over the queue's
/// byte bound is refused by the broker itself, one under it but over the
/// message bound is dropped unread (counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_peer_messages_are_not_read() {
    let ex = exchange();
    let a = conductors(1, Some(&ex)).await.remove(0);
    let broker = Broker::connect().await;
    // The worker's queue is bound once its link is up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Too large for the message bound, over the queue's, then a sentinel
    // like the first: in order on one channel, so once the sentinel is
    // counted the 8 MiB one was either counted before it or never came.
    for len in [100 << 10, 8 << 20, 100 << 10] {
        let body = vec![b'{'; len];
        let props = lapin::BasicProperties::default()
            .with_type("query".into())
            .with_correlation_id("big".into())
            .with_reply_to("nowhere".into());
        broker
            .channel
            .basic_publish(
                ex.as_str().into(),
                "query.big".into(),
                Default::default(),
                &body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let line =
        "ironic_image_worker_peer_refused_messages_total{kind=\"query\",reason=\"too_large\"}";
    let deadline = tokio::time::Instant::now() + MINUTE;
    while metric_of(&a, line).await < 2.0 {
        assert!(tokio::time::Instant::now() < deadline, "never refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric_of(&a, line).await, 2.0, "the 8 MiB one never came");
}

/// A prepare waiting for another conductor's download gives back its
/// prepare slot (as a slow download does), so the same worker's other
/// prepares run meanwhile: with one prepare slot, a second image is
/// answered while the first still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_another_conductor_does_not_hold_the_prepare_slot() {
    let src = tempfile::tempdir().unwrap();
    random_file(&src.path().join("big.raw"), 24 << 20, 31);
    random_file(&src.path().join("small.raw"), 1 << 20, 32);
    let (big, small) = (
        sha256sum(&src.path().join("big.raw")),
        sha256sum(&src.path().join("small.raw")),
    );
    // About 1 MiB/s: A's download of the big one lasts ~24 s.
    let slow = FaultServer::start(src.path(), 1 << 20).await;
    let fast = SourceServer::start(src.path()).await;
    let ex = exchange();
    let a = conductors(1, Some(&ex)).await.remove(0);
    // One prepare slot (a prefetch of 2 keeps one delivery for other
    // actions); waiting is "slow" after a second.
    let b_env = Env::new(&format!(
        "slow_after = 1\n{}[amqp]\nprefetch = 2\n",
        peers_section(&ex)
    ));
    let b = Conductor {
        worker: b_env.serve().await,
        env: b_env,
    };
    let broker = Broker::connect().await;
    let raw = |url: &str, sha: &str| {
        let mut c = prepare(&node(), url, sha);
        c["instance_info"]["image_disk_format"] = json!("raw");
        c
    };
    let url = slow.url("slow", "big.raw");
    let first = broker.command(&a.env.host, raw(&url, &big)).await;
    a.env.wait_for_temporary(MINUTE).await;
    let waiting = broker.command(&b.env.host, raw(&url, &big)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let other = broker
        .command(&b.env.host, raw(&fast.url("small.raw"), &small))
        .await;
    let mut order = Vec::new();
    for _ in 0..3 {
        let (got, ev) = broker.next_reply(2 * MINUTE).await;
        assert_eq!(ev["status"], "success", "{ev}");
        order.push(got.unwrap());
    }
    let at = |c: &str| order.iter().position(|o| o == c).unwrap();
    assert!(at(&other) < at(&waiting), "{order:?}");
    assert!(
        at(&other) < at(&first),
        "A was still downloading: {order:?}"
    );
    assert_eq!(slow.count("slow", "big.raw"), 1, "B waited for A");
}
