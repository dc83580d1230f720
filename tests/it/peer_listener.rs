//! The peer listener serves masters to the other workers and nothing to
//! anybody else: a URL signed with the shared secret (signatures made here
//! with openssl, an implementation of HMAC-SHA256 that is not ours) opens
//! one master until it expires; unsigned, expired, forged and re-aimed URLs
//! get an empty 401; nothing but a regular file named like a master in the
//! master directory is served, never through a symlink; the image port
//! serves no master; uploads beyond `max_uploads` are told to come back.

use crate::common;

use common::*;
use std::time::Duration;

const SECRET: &str = "peer-listener-test-secret-0123456789";

/// HMAC-SHA256 of `GET\n<expires>\n/masters/<name>` by openssl.
fn signature(name: &str, expires: u64) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("openssl")
        .args(["dgst", "-sha256", "-hmac", SECRET, "-hex"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("GET\n{expires}\n/masters/{name}").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    text.rsplit(' ').next().unwrap().trim().to_string()
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

struct Peer {
    env: Env,
    port: u16,
    master: String,
    image: Vec<u8>,
}

impl Peer {
    fn url(&self, path_and_query: &str) -> String {
        format!("http://127.0.0.1:{}{path_and_query}", self.port)
    }

    fn signed(&self, name: &str, expires: u64) -> String {
        let sig = signature(name, expires);
        self.url(&format!(
            "/masters/{name}?temp_url_sig={sig}&temp_url_expires={expires}"
        ))
    }
}

/// A worker with the peer listener on and one master in its cache.
async fn peer_with_a_master(max_uploads: usize) -> Peer {
    let port = free_port();
    let env = Env::new(&format!(
        "[peers]\nlisten = \"127.0.0.1:{port}\"\nsecret = \"{SECRET}\"\nmax_uploads = {max_uploads}\n"
    ));
    let img = env.root().join("allowed/disk.raw");
    random_file(&img, 32 << 20, 7);
    let (ok, event) = env
        .prepare(&node(), &format!("file://{}", img.display()), &[])
        .await;
    assert!(ok, "{event}");
    let masters = env.masters();
    assert_eq!(masters.len(), 1, "{masters:?}");
    Peer {
        master: masters[0].clone(),
        image: std::fs::read(&img).unwrap(),
        env,
        port,
    }
}

async fn fetch(url: &str, headers: &[(&str, &str)]) -> (u16, Vec<u8>) {
    let mut req = reqwest::Client::new().get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.bytes().await.unwrap().to_vec())
}

#[tokio::test]
async fn a_signed_url_opens_its_master_and_nothing_else_does() {
    let peer = peer_with_a_master(4).await;
    let worker = peer.env.serve().await;
    let name = &peer.master;
    let (status, body) = fetch(&peer.signed(name, now() + 60), &[]).await;
    assert_eq!(status, 200);
    assert!(body == peer.image, "the master's bytes, whole");
    let (status, body) = fetch(&peer.signed(name, now() + 60), &[("Range", "bytes=1000-")]).await;
    assert_eq!(
        (status, &body[..]),
        (206, &peer.image[1000..]),
        "resumed with Range"
    );

    let sig = signature(name, now() + 60);
    let refused = [
        peer.url(&format!("/masters/{name}")),
        peer.url(&format!("/masters/{name}?temp_url_sig={sig}")),
        peer.signed(name, now() - 1),
        // The signature of one expiry with another.
        peer.url(&format!(
            "/masters/{name}?temp_url_sig={sig}&temp_url_expires={}",
            now() + 3600
        )),
        // Signed for another name.
        peer.url(&format!(
            "/masters/x{name}?temp_url_sig={sig}&temp_url_expires={}",
            now() + 60
        )),
        peer.signed(".meta", now() + 60),
        peer.url(&format!("/masters/../{name}")),
        peer.url("/"),
    ];
    for url in &refused {
        let (status, body) = fetch(url, &[]).await;
        assert_eq!((status, body.len()), (401, 0), "{url}");
    }

    // Signed, but no master: a missing name, and a symlink named like a
    // master (never followed).
    let evil = "0c6e8f2a-1f7e-5a43-9d4b-2a1b3c4d5e6f";
    std::os::unix::fs::symlink("/etc/passwd", peer.env.master_dir().join(evil)).unwrap();
    for missing in ["no-such-master", evil] {
        let (status, body) = fetch(&peer.signed(missing, now() + 60), &[]).await;
        assert_eq!((status, body.len()), (404, 0), "{missing}");
    }
    // The image port serves no master, signed or not.
    let on_image_port = peer.signed(name, now() + 60).replace(
        &format!(":{}/", peer.port),
        &format!(":{}/", worker.http_port),
    );
    assert_eq!(fetch(&on_image_port, &[]).await.0, 404);

    let (_, metrics) = get(&worker.metrics_url("/metrics")).await;
    let metrics = String::from_utf8(metrics).unwrap();
    let served = metric(
        &metrics,
        "ironic_image_worker_peer_served_requests_total{status=\"401\"}",
    );
    assert_eq!(served, Some(refused.len() as f64), "{metrics}");
    worker.terminate().await;
}

#[tokio::test]
async fn uploads_beyond_the_bound_are_told_to_come_back() {
    let peer = peer_with_a_master(1).await;
    let worker = peer.env.serve().await;
    let url = peer.signed(&peer.master, now() + 60);
    // The first upload holds the only slot while its body is unread.
    let first = reqwest::get(&url).await.unwrap();
    assert_eq!(first.status().as_u16(), 200);
    let second = reqwest::get(&url).await.unwrap();
    assert_eq!(second.status().as_u16(), 503);
    assert_eq!(second.headers()["retry-after"], "1");
    // The slot comes back when the first body is done.
    assert!(first.bytes().await.unwrap() == peer.image);
    let mut status = 0;
    for _ in 0..50 {
        status = fetch(&url, &[]).await.0;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, 200);
    worker.terminate().await;
}
