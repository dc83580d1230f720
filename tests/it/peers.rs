//! Many conductors, one download: workers of several conductors (each its
//! own host name, directories and ports) on one broker with `[peers]` on
//! ask each other before they go to an image's source, and a cloud-wide
//! claim makes one of them download while the others take its master.
//! The source servers count their GETs; every image is a real qcow2 made
//! by qemu-img and every answer is checked against sha256sum.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub(crate) const SECRET: &str = "peers-test-secret-0123456789abcdef";
pub(crate) const MINUTE: Duration = Duration::from_secs(60);

/// A worker of one conductor with peers on, on the test's own exchange.
pub(crate) struct Conductor {
    pub(crate) env: Env,
    pub(crate) worker: Worker,
}

/// The `[peers]` section of a conductor on `exchange`.
pub(crate) fn peers_section(exchange: &str) -> String {
    format!(
        "[peers]\nlisten = \"127.0.0.1:{}\"\nsecret = \"{SECRET}\"\nexchange = \"{exchange}\"\n",
        free_port()
    )
}

/// `n` conductors sharing the exchange `exchange` (peers off when `None`).
pub(crate) async fn conductors(n: usize, exchange: Option<&str>) -> Vec<Conductor> {
    let mut all = Vec::new();
    for _ in 0..n {
        let env = Env::new(&exchange.map(peers_section).unwrap_or_default());
        let worker = env.serve().await;
        all.push(Conductor { env, worker });
    }
    all
}

pub(crate) fn exchange() -> String {
    format!("iiw-test-peers-{}", uuid::Uuid::new_v4().simple())
}

/// A qcow2 with data in `dir` (sparse but for a few patches, or `dense`):
/// the sha256 of its bytes (the checksum Ironic passes), and its raw
/// conversion by qemu-img (what is served), kept in `dir` as `<name>.ref`.
pub(crate) fn image_with(dir: &Path, name: &str, mib: u64, dense: bool) -> (String, PathBuf) {
    let raw = dir.join(format!("{name}.raw"));
    match dense {
        true => random_file(&raw, (mib << 20) as usize, 11),
        false => patchy_raw(&raw, mib << 20, 11),
    }
    let img = dir.join(name);
    qcow2_from(&raw, &img, &[]);
    let converted = dir.join(format!("{name}.ref"));
    reference_raw(&img, &converted);
    std::fs::remove_file(&raw).unwrap();
    (sha256sum(&img), converted)
}

pub(crate) fn image(dir: &Path, name: &str, mib: u64) -> (String, PathBuf) {
    image_with(dir, name, mib, false)
}

pub(crate) fn prepare(node: &str, url: &str, sha256: &str) -> Value {
    let mut cmd = prepare_cmd(node, url);
    cmd["instance_info"]["image_os_hash_algo"] = json!("sha256");
    cmd["instance_info"]["image_os_hash_value"] = json!(sha256);
    cmd["instance_info"]["image_disk_format"] = json!("qcow2");
    cmd
}

pub(crate) async fn metric_of(c: &Conductor, name: &str) -> f64 {
    metric(&c.worker.metrics_text().await, name).unwrap_or(0.0)
}

/// A source serving one qcow2 (its sha256 and what is served) and
/// conductors with peers on one exchange of their own, with a broker
/// client.
struct Cloud {
    src: tempfile::TempDir,
    sha: String,
    served: PathBuf,
    source: SourceServer,
    cloud: Vec<Conductor>,
    broker: Broker,
}

impl Cloud {
    /// `n` conductors and a qcow2 of `mib` MiB.
    async fn start(n: usize, mib: u64) -> Cloud {
        let src = tempfile::tempdir().unwrap();
        let (sha, served) = image(src.path(), "disk.qcow2", mib);
        let source = SourceServer::start(src.path()).await;
        let cloud = conductors(n, Some(&exchange())).await;
        Cloud {
            src,
            sha,
            served,
            source,
            cloud,
            broker: Broker::connect().await,
        }
    }
}

#[tokio::test]
async fn four_conductors_at_once_download_once() {
    let Cloud {
        src: _src,
        sha,
        served,
        source,
        cloud,
        broker,
    } = Cloud::start(4, 96).await;
    for c in &cloud {
        let cmd = prepare(&node(), &source.url("disk.qcow2"), &sha);
        broker.command(&c.env.host, cmd).await;
    }
    let replies = broker.replies(4, 2 * MINUTE).await;
    for ev in replies.values() {
        assert_served(ev, &served);
    }
    assert_eq!(
        source.count("GET", "disk.qcow2"),
        1,
        "one GET from the source for four conductors"
    );
    let mut from_peers = 0.0;
    for c in &cloud {
        from_peers += metric_of(c, "ironic_image_worker_peer_received_bytes_total").await;
        let masters = c.env.masters();
        assert_eq!(masters.len(), 1, "{masters:?}");
        assert_eq!(
            sha256sum(&c.env.master_dir().join(&masters[0])),
            sha256sum(&served)
        );
    }
    let size = std::fs::metadata(cloud[0].env.master_dir().join(&cloud[0].env.masters()[0]))
        .unwrap()
        .len() as f64;
    assert_eq!(from_peers, 3.0 * size, "three masters came from peers");
}

#[tokio::test]
async fn a_node_moved_to_another_conductor_takes_the_image_from_the_first() {
    let Cloud {
        src,
        sha,
        served,
        source,
        cloud,
        broker,
    } = Cloud::start(2, 48).await;
    let node = node();
    let cmd = prepare(&node, &source.url("disk.qcow2"), &sha);
    assert_served(&broker.call(&cloud[0].env.host, cmd.clone()).await, &served);
    assert_eq!(source.count("GET", "disk.qcow2"), 1);
    // The hash ring moved the node: conductor B prepares it.
    let ev = broker.call(&cloud[1].env.host, cmd).await;
    assert_served(&ev, &served);
    assert_eq!(ev["cache"], "miss", "{ev}");
    assert_eq!(
        source.count("GET", "disk.qcow2"),
        1,
        "no source GET the second time"
    );
    let b = &cloud[1];
    assert!(metric_of(b, "ironic_image_worker_peer_received_bytes_total").await > 0.0);
    assert_eq!(
        metric_of(
            b,
            "ironic_image_worker_peer_queries_total{result=\"answered\"}"
        )
        .await,
        1.0
    );
    let (status, body) = get(&b.worker.image_url(&format!("/agent_images/{node}"))).await;
    assert_eq!(status, 200);
    let served_here = src.path().join("served");
    std::fs::write(&served_here, body).unwrap();
    assert_eq!(sha256sum(&served_here), sha256sum(&served));
}

#[tokio::test]
async fn a_peer_master_corrupted_on_disk_is_detected_and_never_served() {
    let Cloud {
        src: _src,
        sha,
        served,
        source,
        cloud,
        broker,
    } = Cloud::start(2, 48).await;
    let cmd = prepare(&node(), &source.url("disk.qcow2"), &sha);
    assert_served(&broker.call(&cloud[0].env.host, cmd).await, &served);
    // Conductor A's master rots after it was verified (same size, its
    // sidecar unchanged).
    let a = &cloud[0];
    let master = a.env.master_dir().join(&a.env.masters()[0]);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&master)
            .unwrap();
        f.write_all_at(b"rotten bytes", 4 << 20).unwrap();
    }
    let cmd = prepare(&node(), &source.url("disk.qcow2"), &sha);
    let ev = broker.call(&cloud[1].env.host, cmd).await;
    assert_served(&ev, &served);
    assert_eq!(
        source.count("GET", "disk.qcow2"),
        2,
        "the bad peer was skipped for the source"
    );
    let b = &cloud[1];
    assert_eq!(
        metric_of(
            b,
            "ironic_image_worker_peer_fetch_failures_total{reason=\"digest_mismatch\"}"
        )
        .await,
        1.0
    );
    let masters = b.env.masters();
    assert_eq!(masters.len(), 1, "{masters:?}");
    assert_eq!(
        sha256sum(&b.env.master_dir().join(&masters[0])),
        sha256sum(&served)
    );
    assert!(
        b.env.temporaries().is_empty(),
        "nothing of the bad bytes left"
    );
}

#[tokio::test]
async fn when_the_downloading_worker_dies_another_takes_the_download_over() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image_with(src.path(), "disk.qcow2", 24, true);
    // About 2 MiB/s: a download that lasts long enough to be interrupted.
    let source = FaultServer::start(src.path(), 2 << 20).await;
    let exchange = exchange();
    let mut cloud = conductors(2, Some(&exchange)).await;
    let broker = Broker::connect().await;
    let url = source.url("slow", "disk.qcow2");
    broker
        .command(&cloud[0].env.host, prepare(&node(), &url, &sha))
        .await;
    cloud[0].env.wait_for_temporary(MINUTE).await;
    let corr = broker
        .command(&cloud[1].env.host, prepare(&node(), &url, &sha))
        .await;
    // B waits for A's download (A holds the claim): it follows A's master
    // as it is written (A sends it bytes) or asks the peers again and
    // again (each query finding no master yet), never the source...
    let missed = "ironic_image_worker_peer_queries_total{result=\"missed\"}";
    let sent = "ironic_image_worker_peer_served_bytes_total";
    let deadline = tokio::time::Instant::now() + MINUTE;
    while metric_of(&cloud[0], sent).await == 0.0 && metric_of(&cloud[1], missed).await < 3.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "B neither follows nor waits for A"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(source.count("slow", "disk.qcow2"), 1, "B waits for A");
    // ... until A dies: the broker drops A's claim and B takes it.
    let a = cloud.remove(0);
    a.worker.kill9().await;
    let (got, ev) = broker.next_reply(2 * MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_served(&ev, &served);
    assert_eq!(source.count("slow", "disk.qcow2"), 2);
}

#[tokio::test]
async fn with_peers_off_every_conductor_downloads_for_itself() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 16);
    let source = SourceServer::start(src.path()).await;
    let cloud = conductors(2, None).await;
    let broker = Broker::connect().await;
    for c in &cloud {
        let cmd = prepare(&node(), &source.url("disk.qcow2"), &sha);
        assert_served(&broker.call(&c.env.host, cmd).await, &served);
    }
    assert_eq!(source.count("GET", "disk.qcow2"), 2);
    for c in &cloud {
        let text = c.worker.metrics_text().await;
        let missed = metric(
            &text,
            "ironic_image_worker_peer_queries_total{result=\"missed\"}",
        );
        assert_eq!(missed.unwrap_or(0.0), 0.0, "no peer query");
    }
}

/// A TCP proxy in front of `upstream`: its first connection is reset after
/// `cut` bytes of the answer (a peer dying mid-transfer), the later ones
/// pass whole; answers pass at about `rate` bytes a second. Returns its port
/// and the requests' heads it saw.
pub(crate) async fn cutting_proxy(upstream: u16, cut: usize, rate: usize) -> (u16, Heads) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads: Heads = Default::default();
    let seen = heads.clone();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut client, _)) = listener.accept().await {
            let limit = if first { cut } else { usize::MAX };
            first = false;
            let seen = seen.clone();
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                else {
                    return;
                };
                let mut head = vec![0u8; 8192];
                let n = client.read(&mut head).await.unwrap_or(0);
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&head[..n]).to_string());
                server.write_all(&head[..n]).await.unwrap();
                let mut buf = vec![0u8; 64 * 1024];
                let mut passed = 0usize;
                loop {
                    let n = server.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    let n = n.min(limit - passed);
                    if client.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    passed += n;
                    let pause = n as f64 / rate as f64;
                    tokio::time::sleep(Duration::from_secs_f64(pause)).await;
                    if passed >= limit {
                        let _ = client.set_zero_linger();
                        break;
                    }
                }
            });
        }
    });
    (port, heads)
}

/// The requests' heads a proxy saw.
pub(crate) type Heads = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// Conductor A, reached by its peers through `cutting_proxy(.., cut,
/// rate)`, holding the image at `url` (prepared there), and conductor B on
/// the same exchange, with a broker client and the proxy's request heads.
async fn holder_behind_a_proxy(
    url: &str,
    sha: &str,
    served: &Path,
    cut: usize,
    rate: usize,
) -> (Conductor, Conductor, Broker, Heads) {
    holder_behind_a_proxy_with(url, sha, served, (cut, rate), false).await
}

/// [`holder_behind_a_proxy`], A with `[http] gzip = static` when `gzip`
/// (its master's compressed form made before this returns).
async fn holder_behind_a_proxy_with(
    url: &str,
    sha: &str,
    served: &Path,
    (cut, rate): (usize, usize),
    gzip: bool,
) -> (Conductor, Conductor, Broker, Heads) {
    let exchange = exchange();
    let listen = free_port();
    let (proxy, heads) = cutting_proxy(listen, cut, rate).await;
    let a_env = Env::new(&format!(
        "[peers]\nlisten = \"127.0.0.1:{listen}\"\nurl = \"http://127.0.0.1:{proxy}\"\n\
         secret = \"{SECRET}\"\nexchange = \"{exchange}\"\n"
    ));
    if gzip {
        a_env.gzip_static("");
    }
    let a = Conductor {
        worker: a_env.serve().await,
        env: a_env,
    };
    let b = conductors(1, Some(&exchange)).await.remove(0);
    let broker = Broker::connect().await;
    assert_served(
        &broker.call(&a.env.host, prepare(&node(), url, sha)).await,
        served,
    );
    if gzip {
        crate::gzip::wait_for(&a.env, ".gz").await;
    }
    (a, b, broker, heads)
}

/// A 48 MiB qcow2 prepared on A (reached through `cutting_proxy(.., cut,
/// unthrottled)`, compressing it when `gzip`), then on B, which must take
/// A's master: served right, one source GET in all, B's master the served
/// bytes. Returns A, B and the proxy's request heads (lower case).
async fn b_takes_the_master_from_a(cut: usize, gzip: bool) -> (Conductor, Conductor, Vec<String>) {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 48);
    let source = SourceServer::start(src.path()).await;
    let url = source.url("disk.qcow2");
    let (a, b, broker, heads) =
        holder_behind_a_proxy_with(&url, &sha, &served, (cut, usize::MAX), gzip).await;
    let done = broker.call(&b.env.host, prepare(&node(), &url, &sha)).await;
    assert_served(&done, &served);
    assert_eq!(source.count("GET", "disk.qcow2"), 1, "B took it from A");
    let masters = b.env.masters();
    assert_eq!(masters.len(), 1, "{masters:?}");
    assert_eq!(
        sha256sum(&b.env.master_dir().join(&masters[0])),
        sha256sum(&served)
    );
    let heads = heads
        .lock()
        .unwrap()
        .iter()
        .map(|h| h.to_ascii_lowercase())
        .collect();
    (a, b, heads)
}

/// Where the request `head` resumed a transfer (its `Range`).
fn resumed_from(head: &str) -> u64 {
    head.split("range: bytes=")
        .nth(1)
        .and_then(|r| r.split('-').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("resumed with a Range: {head}"))
}

/// The size of B's master.
fn master_size(b: &Conductor) -> f64 {
    let masters = b.env.masters();
    std::fs::metadata(b.env.master_dir().join(&masters[0]))
        .unwrap()
        .len() as f64
}

#[tokio::test]
async fn a_transfer_cut_mid_way_resumes_with_range_and_no_source_get() {
    // A's listener is reached through a proxy that cuts the first transfer
    // after 5 MiB.
    let (_a, b, heads) = b_takes_the_master_from_a(5 << 20, false).await;
    assert_eq!(heads.len(), 2, "{heads:?}");
    // The cut came 5 MiB into the answer, its head included; what the
    // reset caught unread in the receiver's socket is fetched again.
    let from = resumed_from(&heads[1]);
    assert!(
        (1..5 << 20).contains(&from),
        "resumed where it was cut: {from}"
    );
    assert_eq!(
        metric_of(
            &b,
            "ironic_image_worker_peer_fetch_failures_total{reason=\"unreachable\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_compressed_master_crosses_to_a_peer_compressed_and_is_checked_decoded() {
    // Only A compresses: B asks for gzip all the same, and decodes it.
    let (a, b, heads) = b_takes_the_master_from_a(usize::MAX, true).await;
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(heads[0].contains("accept-encoding: gzip"), "{heads:?}");
    let size = master_size(&b);
    let sent = metric_of(&a, "ironic_image_worker_peer_served_bytes_total").await;
    assert!(
        sent > 0.0 && sent * 8.0 < size,
        "{sent} bytes crossed for {size}"
    );
    assert_eq!(
        metric_of(&b, "ironic_image_worker_peer_received_bytes_total").await,
        size,
        "counted decoded"
    );
}

#[tokio::test]
async fn a_compressed_transfer_cut_mid_way_resumes_identity_where_decoding_stopped() {
    // Cut 100 KB into the compressed answer (about half of it).
    let (_a, _b, heads) = b_takes_the_master_from_a(100_000, true).await;
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(heads[0].contains("accept-encoding: gzip"), "{heads:?}");
    assert!(!heads[1].contains("accept-encoding"), "{heads:?}");
    let from = resumed_from(&heads[1]);
    assert!(
        from >= 1 << 20,
        "decoded bytes before the cut count: {from}"
    );
}

#[tokio::test]
async fn the_only_holder_killed_mid_transfer_leaves_the_rest_to_the_source() {
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image_with(src.path(), "disk.qcow2", 32, true);
    let source = SourceServer::start(src.path()).await;
    // Conductor A's peers reach it through a proxy at about 4 MiB/s, so its
    // transfer to B lasts long enough for A to be killed in the middle.
    let (a, b, broker, _) = holder_behind_a_proxy(
        &source.url("disk.qcow2"),
        &sha,
        &served,
        usize::MAX,
        4 << 20,
    )
    .await;
    let corr = broker
        .command(
            &b.env.host,
            prepare(&node(), &source.url("disk.qcow2"), &sha),
        )
        .await;
    b.env.wait_for_temporary(MINUTE).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    a.worker.kill9().await;
    let (got, ev) = broker.next_reply(2 * MINUTE).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_served(&ev, &served);
    assert_eq!(
        source.count("GET", "disk.qcow2"),
        2,
        "the source finished what the dead peer began"
    );
    assert!(
        metric_of(
            &b,
            "ironic_image_worker_peer_fetch_failures_total{reason=\"unreachable\"}"
        )
        .await
            >= 1.0,
        "the transfer from the peer began and broke off"
    );
    let masters = b.env.masters();
    assert_eq!(masters.len(), 1, "{masters:?}");
    assert_eq!(
        sha256sum(&b.env.master_dir().join(&masters[0])),
        sha256sum(&served)
    );
    assert!(b.env.temporaries().is_empty(), "nothing partial left");
}

#[tokio::test]
async fn warming_every_conductor_crosses_from_the_source_once() {
    // A command exchange of this test's own, so `all.image.warm` reaches
    // only this test's workers.
    let commands = format!("iiw-test-warm-{}", uuid::Uuid::new_v4().simple());
    let exchange = exchange();
    let src = tempfile::tempdir().unwrap();
    let (sha, served) = image(src.path(), "disk.qcow2", 48);
    let source = SourceServer::start(src.path()).await;
    let mut cloud = Vec::new();
    for _ in 0..3 {
        let env = Env::new(&format!(
            "[amqp]\ncommand_exchange = \"{commands}\"\n{}",
            peers_section(&exchange)
        ));
        let worker = env.serve().await;
        cloud.push(Conductor { env, worker });
    }
    let out = cloud[0]
        .env
        .run(&[
            "send",
            "warm",
            "--all-conductors",
            "--image-source",
            &source.url("disk.qcow2"),
            "--image-checksum",
            &format!("sha256:{sha}"),
            "--expect",
            "3",
            "--timeout",
            "120",
        ])
        .await;
    let answers: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(out.status.success(), "{answers:?}");
    assert_eq!(answers.len(), 3, "{answers:?}");
    for ev in &answers {
        assert_served(ev, &served);
    }
    assert_eq!(source.count("GET", "disk.qcow2"), 1, "one source download");
    for c in &cloud {
        let (ok, ev) = c
            .env
            .prepare(
                &node(),
                &source.url("disk.qcow2"),
                &["--checksum", &format!("sha256:{sha}")],
            )
            .await;
        assert!(ok, "{ev}");
        assert_eq!(ev["cache"], "hit", "{ev}");
    }
    assert_eq!(source.count("GET", "disk.qcow2"), 1, "every deploy a hit");
}

/// Conductors A and B on one exchange, a qcow2 with data served at about
/// 4 MiB/s, and A's download of it under way (converted while it
/// downloads) when B is asked for the same image; `corr` are the two
/// prepares' correlation ids (A's, B's).
struct Following {
    _src: tempfile::TempDir,
    served: PathBuf,
    source: FaultServer,
    a: Conductor,
    b: Conductor,
    broker: Broker,
    corr: (String, String),
}

impl Following {
    /// A qcow2 of `mib` MiB, both prepares asking for checksum `sha` (the
    /// image's own when `None`).
    async fn start(mib: u64, sha: Option<&str>) -> Following {
        let src = tempfile::tempdir().unwrap();
        let (own, served) = image_with(src.path(), "disk.qcow2", mib, true);
        let sha = sha.unwrap_or(&own).to_string();
        let source = FaultServer::start(src.path(), 4 << 20).await;
        let mut cloud = conductors(2, Some(&exchange())).await;
        let (b, a) = (cloud.pop().unwrap(), cloud.pop().unwrap());
        let broker = Broker::connect().await;
        let url = source.url("slow", "disk.qcow2");
        let first = broker
            .command(&a.env.host, prepare(&node(), &url, &sha))
            .await;
        a.env.wait_for_temporary(MINUTE).await;
        let second = broker
            .command(&b.env.host, prepare(&node(), &url, &sha))
            .await;
        Following {
            _src: src,
            served,
            source,
            a,
            b,
            broker,
            corr: (first, second),
        }
    }

    /// Waits until A's listener has answered B (a 200 for the master A is
    /// still writing).
    async fn wait_until_b_follows(&self) {
        let served = "ironic_image_worker_peer_served_requests_total{status=\"200\"}";
        let deadline = tokio::time::Instant::now() + MINUTE;
        while metric_of(&self.a, served).await < 1.0 {
            assert!(tokio::time::Instant::now() < deadline, "B never asked A");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn a_second_conductor_follows_the_first_ones_download_as_it_lands() {
    let f = Following::start(24, None).await;
    f.wait_until_b_follows().await;
    // A's listener answered B before A had a master: B takes the bytes
    // as A's conversion writes them, not after A's commit.
    assert!(f.a.env.masters().is_empty(), "A is still downloading");
    let replies = f.broker.replies(2, 2 * MINUTE).await;
    assert_served(&replies[&f.corr.0], &f.served);
    assert_served(&replies[&f.corr.1], &f.served);
    assert_eq!(f.source.count("slow", "disk.qcow2"), 1, "one source GET");
    let b = &f.b;
    let masters = b.env.masters();
    assert_eq!(masters.len(), 1, "{masters:?}");
    let master = b.env.master_dir().join(&masters[0]);
    assert_eq!(sha256sum(&master), sha256sum(&f.served));
    assert_eq!(
        metric_of(b, "ironic_image_worker_peer_received_bytes_total").await,
        std::fs::metadata(&master).unwrap().len() as f64
    );
    assert_eq!(
        metric_of(b, "ironic_image_worker_download_bytes_total").await,
        0.0,
        "nothing from the source on B"
    );
    assert!(b.env.temporaries().is_empty());
}

#[tokio::test]
async fn a_followed_download_that_fails_verification_becomes_no_master_anywhere() {
    // Both are asked for a checksum the source's bytes do not have: A
    // converts them while they download and B follows A's output, which A
    // then refuses. B must not keep what it followed.
    let wrong = "0".repeat(64);
    let f = Following::start(16, Some(&wrong)).await;
    f.wait_until_b_follows().await;
    let replies = f.broker.replies(2, 2 * MINUTE).await;
    for corr in [&f.corr.0, &f.corr.1] {
        let ev = &replies[corr];
        assert_eq!(ev["status"], "error", "{ev}");
        assert_eq!(ev["error"]["code"], "checksum_mismatch", "{ev}");
    }
    for c in [&f.a, &f.b] {
        assert!(c.env.masters().is_empty(), "{:?}", c.env.masters());
        assert!(c.env.temporaries().is_empty(), "{:?}", c.env.temporaries());
    }
    // What B followed was cut off; B then verified the source itself.
    assert_eq!(f.source.count("slow", "disk.qcow2"), 2);
}
