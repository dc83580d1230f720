//! The shipped systemd unit (`ops/systemd/`) passes `systemd-analyze verify`,
//! and the worker speaks the `Type=notify` protocol it declares.

use crate::common;

use common::*;
use std::time::Duration;

#[test]
fn unit_file_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/systemd/ironic-image-worker.service"
    ))
    .unwrap();
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
