//! The JSON-RPC listener with no broker at all (`[amqp]enabled = false`),
//! called with Ironic 39's own JSON-RPC client (`ironic.common.json_rpc`,
//! from the Ironic virtualenv, see tests/helpers/json_rpc_call.py) and,
//! for what that client never sends, with plain HTTP.

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a step of a test may take on a loaded machine.
const WAIT: Duration = Duration::from_secs(90);

/// A worker environment with no broker and JSON-RPC on a port of its own;
/// `extra` goes into `[json_rpc]`.
fn env_without_broker(extra: &str) -> (Env, u16) {
    let port = free_port();
    let env = Env::new(&format!(
        "[amqp]\nenabled = false\n[json_rpc]\nlisten = \"127.0.0.1:{port}\"\n{extra}\n"
    ));
    (env, port)
}

/// Runs `calls` through Ironic's JSON-RPC client; one answer a call.
async fn ironic_client(port: u16, args: &[&str], calls: &[Value]) -> Vec<Value> {
    let python = tokio::task::spawn_blocking(ironic_python).await.unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/json_rpc_call.py");
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(script)
        .arg(port.to_string())
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let input: String = calls.iter().map(|c| c.to_string() + "\n").collect();
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).await.unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("the client finished")
        .unwrap();
    let answers: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(answers.len(), calls.len(), "one answer a call: {answers:?}");
    answers
}

fn call(method: &str, params: Value) -> Value {
    json!({"method": method, "params": params})
}

/// A JSON-RPC request over plain HTTP; (status, body).
async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A qcow2 image in `dir` and its `qemu-img convert` reference.
fn image(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let raw = dir.join(format!("{name}.raw"));
    patchy_raw(&raw, 8 << 20, 7);
    let img = dir.join(format!("{name}.qcow2"));
    qcow2_from(&raw, &img, &[]);
    let reference = dir.join(format!("{name}.ref"));
    reference_raw(&img, &reference);
    (img, reference)
}

/// prepare, the same prepare again, status, a cast, a checksum mismatch,
/// deployed and cleanup through Ironic's client, against a worker with no
/// broker: the answers are the completions (errors carry the worker's
/// code), one download for everything, the served bytes are qemu-img's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_through_ironics_client_without_a_broker() {
    let (env, port) = env_without_broker("");
    let (img, reference) = image(&env.root().join("src"), "disk");
    let source = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let (n1, n2, n3) = (node(), node(), node());
    let info = json!({"image_source": source.url("disk.qcow2"),
                      "image_os_hash_algo": "sha256", "image_os_hash_value": sha256sum(&img)});
    let prepare = |n: &str, id: &str| {
        call(
            "prepare",
            json!({"node_uuid": n, "request_id": id, "instance_info": info,
                               "options": {"force_raw": true, "stream_raw": true}}),
        )
    };
    let bad = json!({"image_source": source.url("disk.qcow2"), "image_os_hash_algo": "sha256",
                     "image_os_hash_value": "0".repeat(64)});
    let answers = ironic_client(
        port,
        &[],
        &[
            prepare(&n1, "r1"),
            prepare(&n1, "r1"),
            call("status", json!({"node_uuid": n1})),
            call(
                "prepare",
                json!({"node_uuid": n3, "request_id": "r3", "instance_info": bad}),
            ),
            call("prepare", json!({"node_uuid": "not-a-uuid"})),
            call("no_such_method", json!({})),
        ],
    )
    .await;
    let done = &answers[0]["result"];
    assert_valid_completion(done);
    assert_served(done, &reference);
    let (status, served) = get(done["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(served, std::fs::read(&reference).unwrap());
    assert_eq!(
        answers[1]["result"], *done,
        "the same request, the same answer"
    );
    assert_eq!(answers[2]["result"], *done);
    // Published again for the same node: not an error, the same URL.
    let again = ironic_client(port, &[], &[prepare(&n1, "r1-again")]).await;
    assert_eq!(again[0]["result"]["status"], "success", "{again:?}");
    assert_eq!(again[0]["result"]["image_url"], done["image_url"]);
    let mismatch = &answers[3]["error"];
    assert_eq!(mismatch["class"], "ironic.common.exception.IronicException");
    assert!(
        mismatch["message"]
            .as_str()
            .unwrap()
            .starts_with("checksum_mismatch: ")
    );
    assert_eq!(
        answers[4]["error"]["class"],
        "ironic.common.exception.InvalidParameterValue"
    );
    assert!(
        answers[4]["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("invalid_node_uuid: ")
    );
    // An unknown method: a JSON-RPC error without a class, which Ironic's
    // client turns into its generic error, as it does for its own server's
    // "method not found" (the code and message: the raw call below).
    assert_eq!(
        answers[5]["error"],
        json!({"class": "ironic.common.exception.IronicException",
               "message": "Unexpected error raised by RPC", "status": 500})
    );

    // A cast is queued; status tells its end.
    let cast = json!({"method": "prepare", "cast": true,
                      "params": {"node_uuid": n2, "request_id": "r2", "instance_info": info,
                                 "options": {"force_raw": true, "stream_raw": true}}});
    assert_eq!(
        ironic_client(port, &[], &[cast]).await[0]["result"],
        Value::Null
    );
    let url = format!("http://127.0.0.1:{port}/");
    let status = json!({"jsonrpc": "2.0", "id": 1, "method": "status",
                        "params": {"node_uuid": n2.to_uppercase(), "request_id": "r2"}});
    let mut known = Value::Null;
    for _ in 0..200 {
        known = post(&url, &status).await.1["result"].clone();
        if known["status"] != "in_progress" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(known["status"], "success", "{known}");
    assert_eq!(known["cache"], "hit");
    assert_eq!(
        source.count("GET", "disk.qcow2"),
        2,
        "one download, one for the mismatch"
    );

    let answers = ironic_client(
        port,
        &[],
        &[
            call("deployed", json!({"node_uuid": n1, "request_id": "d1"})),
            call("cleanup", json!({"node_uuid": n2, "request_id": "c2"})),
        ],
    )
    .await;
    assert_eq!(answers[0]["result"]["status"], "success", "{answers:?}");
    assert_eq!(answers[1]["result"]["status"], "success");
    assert!(list_visible(&env.link_dir()).is_empty());
    drop(worker);
}

/// What Ironic's client never sends, over plain HTTP: a GET, a body over
/// the limit, a batch, an unknown method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_refuses_what_is_not_a_bounded_json_rpc_call() {
    let (env, port) = env_without_broker("max_body_bytes = 4096");
    let _worker = env.serve().await;
    let url = format!("http://127.0.0.1:{port}/");
    let r = reqwest::get(&url).await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let big = json!({"jsonrpc": "2.0", "id": 1, "method": "warm",
                     "params": {"instance_info": {"image_source": "x".repeat(10_000)}}});
    assert_eq!(post(&url, &big).await.0, 413);
    let (status, batch) = post(&url, &json!([{"jsonrpc": "2.0", "id": 1, "method": "x"}])).await;
    assert_eq!(
        (status, batch["error"]["code"].as_i64()),
        (200, Some(-32600))
    );
    let unknown = json!({"jsonrpc": "2.0", "id": 7, "method": "reboot", "params": {}});
    let (_, answer) = post(&url, &unknown).await;
    assert_eq!(answer["error"]["code"], -32601);
    assert_eq!(answer["error"]["message"], "Method reboot was not found");
    assert_eq!(answer["id"], 7);
    let numbered = json!({"jsonrpc": "2.0", "id": 8, "method": "status",
                          "params": {"node_uuid": node(), "request_id": 5}});
    let (_, answer) = post(&url, &numbered).await;
    assert_eq!(answer["error"]["code"], -32602, "{answer}");
    let (status, body) = post(&url, &json!({"jsonrpc": "2.0", "method": "reboot"})).await;
    assert_eq!(
        (status, body),
        (204, Value::Null),
        "a notification is answered with nothing"
    );
}

/// `http_basic` against an htpasswd file of bcrypt entries, over TLS with
/// a CA: Ironic's client with the right password gets in, with a wrong
/// one gets a 401; a request without credentials is refused; a new
/// password written to the file counts at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_basic_from_htpasswd_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca::TestCa::new(dir.path(), "rpc-ca");
    let (cert, key) = ca.issue(
        "rpc-server",
        "localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    let htpasswd = dir.path().join("htpasswd");
    tool(
        "htpasswd",
        &["-Bbc", htpasswd.to_str().unwrap(), "ironic", "s3cret"],
    );
    let (env, port) = env_without_broker(&format!(
        "auth_strategy = \"http_basic\"\nhttp_basic_auth_user_file = \"{}\"\n\
         tls_cert_file = \"{}\"\ntls_key_file = \"{}\"",
        htpasswd.display(),
        cert.display(),
        key.display()
    ));
    let _worker = env.serve().await;
    let n = node();
    let status = || call("status", json!({"node_uuid": n}));
    let cafile = ca.pem.to_str().unwrap();
    let with = |user: &'static str, password: &'static str| {
        ["--user", user, "--password", password, "--cafile", cafile]
    };
    let right = ironic_client(port, &with("ironic", "s3cret"), &[status()]).await;
    assert_eq!(right[0]["result"]["status"], "unknown", "{right:?}");
    let wrong = ironic_client(port, &with("ironic", "guess"), &[status(), status()]).await;
    for answer in &wrong {
        assert_eq!(answer["error"]["status"], 401, "{answer}");
    }
    let client = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(&std::fs::read(&ca.pem).unwrap()).unwrap(),
        )
        .build()
        .unwrap();
    let bare = client
        .post(format!("https://127.0.0.1:{port}/"))
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "status", "params": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status().as_u16(), 401);
    assert!(bare.headers().contains_key("www-authenticate"));
    tool(
        "htpasswd",
        &["-Bb", htpasswd.to_str().unwrap(), "ironic", "n3w"],
    );
    let after = ironic_client(port, &with("ironic", "s3cret"), &[status()]).await;
    assert_eq!(
        after[0]["error"]["status"], 401,
        "the old password no longer lets in"
    );
    let after = ironic_client(port, &with("ironic", "n3w"), &[status()]).await;
    assert_eq!(after[0]["result"]["status"], "unknown");
}

/// Forty wrong passwords from one address (127.0.0.2), then the genuine
/// client's first call from another (127.0.0.1): the excess of the first
/// address is answered `429` at once, and no more of its passwords are
/// checked before the genuine call is answered than its bound (two).
/// Counted, not timed: the attackers' `401`s that arrived before the
/// genuine answer (every check takes ~0.1-1 s at cost 12, so a check
/// that ran ahead of the genuine one answers before it). The only wait is
/// for the attackers' requests to reach the worker first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_passwords_of_one_address_do_not_delay_another() {
    let dir = tempfile::tempdir().unwrap();
    let htpasswd = dir.path().join("htpasswd");
    tool(
        "htpasswd",
        &[
            "-Bbc",
            "-C",
            "12",
            htpasswd.to_str().unwrap(),
            "ironic",
            "s3cret",
        ],
    );
    let (env, port) = env_without_broker(&format!(
        "auth_strategy = \"http_basic\"\nhttp_basic_auth_user_file = \"{}\"",
        htpasswd.display()
    ));
    let _worker = env.serve().await;
    let url = format!("http://127.0.0.1:{port}/");
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "status",
                      "params": {"node_uuid": node()}});
    let checked_before = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let attacker = reqwest::Client::builder()
        .local_address(Some("127.0.0.2".parse().unwrap()))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let guesses: Vec<_> = (0..40)
        .map(|i| {
            let (client, url, body) = (attacker.clone(), url.clone(), body.clone());
            let checked_before = checked_before.clone();
            tokio::spawn(async move {
                let r = client
                    .post(&url)
                    .basic_auth("ironic", Some(format!("guess{i}")))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                if r.status() == 401 {
                    checked_before.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                let retry = r.headers().get("retry-after").cloned();
                (r.status().as_u16(), retry)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let genuine = reqwest::Client::new()
        .post(&url)
        .basic_auth("ironic", Some("s3cret"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let ahead = checked_before.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(genuine.status(), 200);
    assert!(
        ahead <= 2,
        "{ahead} wrong passwords were checked before the genuine one"
    );
    let mut busy = 0;
    for guess in guesses {
        match guess.await.unwrap() {
            (429, Some(retry)) => {
                assert_eq!(retry, "1");
                busy += 1;
            }
            (401, _) => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(busy >= 30, "only {busy} of 40 refused at once");
}

/// A cast (Ironic's `send` of a prepare) accepted by a worker that is then
/// killed mid-download is run again by the worker that next listens on
/// that port: `status` there gives its answer, and its record goes once
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cast_outlives_its_worker_killed_mid_download() {
    let (env, port) = env_without_broker("");
    let src = env.root().join("src");
    random_file(&src.join("slow.img"), 2 << 20, 68);
    // 256 KiB/s: some 8 s of download.
    let faults = FaultServer::start(&src, 256 << 10).await;
    let first = env.serve().await;
    let x = node();
    let url = format!("http://127.0.0.1:{port}/");
    let cast = json!({"jsonrpc": "2.0", "method": "prepare",
                      "params": {"node_uuid": x, "request_id": "r1",
                                 "instance_info": {"image_source": faults.url("slow", "slow.img")}}});
    let r = reqwest::Client::new()
        .post(&url)
        .json(&cast)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let started = std::time::Instant::now();
    while faults.count("slow", "slow.img") == 0 {
        assert!(started.elapsed() < WAIT, "the prepare starts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill9().await;
    let _worker = env.serve().await;
    let status = json!({"jsonrpc": "2.0", "id": 1, "method": "status",
                        "params": {"node_uuid": x, "request_id": "r1"}});
    let started = std::time::Instant::now();
    let known = loop {
        let known = post(&url, &status).await.1["result"].clone();
        if known["status"] != "in_progress" {
            break known;
        }
        assert!(started.elapsed() < WAIT * 2, "answered after the restart");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(known["status"], "success", "{known}");
    assert!(
        env.link_dir().join(&x).symlink_metadata().is_ok(),
        "the node's image is published"
    );
    let shelf = env
        .images_dir()
        .join(format!(".ledger/accepted-json-rpc-{port}"));
    let started = std::time::Instant::now();
    while !list_visible(&shelf).is_empty() {
        assert!(started.elapsed() < WAIT, "answered: its record goes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `head` on a new connection to `port`, then `body` a byte every
/// `gap`; what the listener answered within `within` (empty if nothing).
async fn trickle(port: u16, head: &str, body: &[u8], gap: Duration, within: Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (mut rd, mut wr) = s.into_split();
    let writer = {
        let (head, body) = (head.to_string(), body.to_vec());
        tokio::spawn(async move {
            let _ = wr.write_all(head.as_bytes()).await;
            for b in body {
                tokio::time::sleep(gap).await;
                if wr.write_all(&[b]).await.is_err() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_secs(3600)).await;
        })
    };
    let mut got = Vec::new();
    let _ = tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = rd.read(&mut buf).await {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    writer.abort();
    String::from_utf8_lossy(&got).into_owned()
}

/// An http source that accepts connections and never answers (a prepare
/// of it goes on until its read timeout); abort the task to close them.
async fn hanging_source() -> (String, tokio::task::JoinHandle<()>) {
    let hang = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let source = format!("http://{}/disk.img", hang.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((s, _)) = hang.accept().await {
            open.push(s);
        }
    });
    (source, held)
}

/// The listener's time bounds hold for the body and spare a waiting call:
/// a body sent a byte at a time is cut at `[http]header_timeout` (`408`;
/// before, it held its connection for ever), a `Content-Length` over
/// `max_body_bytes` is refused before any body (`413`; before, the
/// listener waited for a mebibyte), and a call whose work outlasts
/// `[http]idle_timeout` still gets `in_progress` at `request_timeout`
/// (before, the idle timeout closed it with no answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_are_bounded_in_time_and_waiting_calls_are_not_idle() {
    let (env, port) = env_without_broker("request_timeout = 4");
    let text = std::fs::read_to_string(&env.config).unwrap();
    let text = text.replace("[http]\n", "[http]\nheader_timeout = 2\nidle_timeout = 2\n");
    std::fs::write(&env.config, text).unwrap();
    let _worker = env.serve().await;

    let head = "POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 100\r\n\r\n";
    let slow = trickle(
        port,
        head,
        &[b' '; 100],
        Duration::from_millis(300),
        Duration::from_secs(10),
    )
    .await;
    assert!(slow.starts_with("HTTP/1.1 408"), "{slow:?}");

    let huge = "POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 1000000000000\r\n\r\n";
    let refused = trickle(port, huge, b"", Duration::ZERO, Duration::from_secs(2)).await;
    assert!(refused.starts_with("HTTP/1.1 413"), "{refused:?}");

    // A source that accepts and never answers: the prepare goes on.
    let (source, held) = hanging_source().await;
    let prepare = json!({"jsonrpc": "2.0", "id": 1, "method": "prepare",
        "params": {"node_uuid": node(), "request_id": "waiting",
                   "instance_info": {"image_source": source}}});
    let (status, answer) = post(&format!("http://127.0.0.1:{port}/"), &prepare).await;
    assert_eq!(
        (status, &answer["result"]),
        (200, &json!({"status": "in_progress"})),
        "{answer}"
    );
    held.abort();
}

/// A cast the worker has no room for (1,024 requests queued or running) is
/// answered `503` with the `-32000` error, so that Ironic's client raises;
/// before, it got the `204` of a queued cast and was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cast_with_no_room_is_refused_not_lost() {
    let (env, port) = env_without_broker("");
    let _worker = env.serve().await;
    let (source, held) = hanging_source().await;
    let url = format!("http://127.0.0.1:{port}/");
    let node = node();
    let client = reqwest::Client::new();
    let mut statuses = std::collections::BTreeMap::new();
    let mut last = Value::Null;
    for batch in 0..65 {
        let sends = (0..16).map(|i| {
            let cast = json!({"jsonrpc": "2.0", "method": "prepare",
                "params": {"node_uuid": node, "request_id": format!("flood-{batch}-{i}"),
                           "instance_info": {"image_source": source}}});
            let (client, url) = (client.clone(), url.clone());
            async move {
                let r = client.post(&url).json(&cast).send().await.unwrap();
                let status = r.status().as_u16();
                (status, r.json::<Value>().await.unwrap_or(Value::Null))
            }
        });
        for (status, body) in futures_util::future::join_all(sends).await {
            *statuses.entry(status).or_insert(0) += 1;
            if status != 204 {
                last = body;
            }
        }
    }
    assert_eq!(
        statuses,
        [(204, 1024), (503, 16)].into_iter().collect(),
        "{last}"
    );
    assert_eq!(last["error"]["code"], -32000, "{last}");
    held.abort();
}

/// Runs `ironic-image-worker send ARGS` against `env`'s configuration (no
/// ironic.conf), with the listener's password in `password` (the
/// environment variable `send` reads it from); (exit code, stdout, stderr).
async fn send(env: &Env, password: Option<&str>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--config")
        .arg(&env.config)
        .args(["--ironic-config", "", "send"])
        .args(args)
        .env_remove("IRONIC_IMAGE_WORKER_RPC_PASSWORD")
        .env_remove("IRONIC_IMAGE_WORKER_RPC_USER");
    if let Some(p) = password {
        cmd.env("IRONIC_IMAGE_WORKER_RPC_PASSWORD", p);
    }
    let out = tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("send finished")
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `send` on a worker configured without a broker takes its JSON-RPC
/// listener, with the listener's HTTP Basic credentials and CA: a prepare
/// with `--wait` prints the completion (served bytes are qemu-img's); a
/// cleanup without `--wait` is a cast that the worker then runs; missing
/// credentials are refused before anything is sent, a wrong password gets
/// the listener's 401, and the broker's routing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_speaks_json_rpc_to_a_worker_without_a_broker() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca::TestCa::new(dir.path(), "rpc-ca");
    let (cert, key) = ca.issue(
        "rpc-server",
        "localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    let htpasswd = dir.path().join("htpasswd");
    tool(
        "htpasswd",
        &["-Bbc", htpasswd.to_str().unwrap(), "ironic", "s3cret"],
    );
    let (env, _port) = env_without_broker(&format!(
        "auth_strategy = \"http_basic\"\nhttp_basic_auth_user_file = \"{}\"\n\
         tls_cert_file = \"{}\"\ntls_key_file = \"{}\"",
        htpasswd.display(),
        cert.display(),
        key.display()
    ));
    let (img, reference) = image(&env.root().join("src"), "disk");
    let source = SourceServer::start(&env.root().join("src")).await;
    let _worker = env.serve().await;
    // No broker configured: the broker alerts' gauge says so.
    let (_, metrics) = get(&format!("http://127.0.0.1:{}/metrics", env.metrics_port)).await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics
            .lines()
            .any(|l| l == "ironic_image_worker_amqp_enabled 0"),
        "{metrics}"
    );
    let n = node();
    let url = source.url("disk.qcow2");
    let sha = sha256sum(&img);
    let cafile = ca.pem.to_str().unwrap();
    let auth = ["--user", "ironic", "--cafile", cafile];
    let prepare = [
        "prepare",
        "--node",
        &n,
        "--image-source",
        &url,
        "--os-hash-algo",
        "sha256",
        "--os-hash-value",
        &sha,
        "--wait",
    ];
    let (code, out, err) = send(&env, Some("s3cret"), &[&prepare[..], &auth[..]].concat()).await;
    assert_eq!(code, 0, "{out}{err}");
    let done: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(done["status"], "success", "{done}");
    let image_url = done["image_url"].as_str().unwrap().to_string();
    let (status, body) = get(&image_url).await;
    assert_eq!(status, 200);
    assert_eq!(body, std::fs::read(&reference).unwrap());

    let (code, _, err) = send(&env, None, &[&prepare[..], &["--cafile", cafile]].concat()).await;
    assert!(
        code != 0 && err.contains("auth_strategy is http_basic"),
        "{err}"
    );
    let (code, _, err) = send(&env, None, &[&prepare[..], &auth[..]].concat()).await;
    assert!(code != 0 && err.contains("needs a password"), "{err}");
    let (code, _, err) = send(&env, Some("guess"), &[&prepare[..], &auth[..]].concat()).await;
    assert!(code != 0 && err.contains("401"), "{err}");
    let routed = [&prepare[..], &auth[..], &["--conductor", "other"]].concat();
    let (code, _, err) = send(&env, Some("s3cret"), &routed).await;
    assert!(
        code != 0 && err.contains("route through the broker"),
        "{err}"
    );

    let password_file = dir.path().join("password");
    std::fs::write(&password_file, "s3cret\n").unwrap();
    let cast = [
        "cleanup",
        "--node",
        &n,
        "--password-file",
        password_file.to_str().unwrap(),
    ];
    let (code, out, err) = send(&env, None, &[&cast[..], &auth[..]].concat()).await;
    assert_eq!(code, 0, "{out}{err}");
    let sent: Value = serde_json::from_str(out.trim()).unwrap();
    assert!(sent["request_id"].is_string(), "{sent}");
    let deadline = std::time::Instant::now() + WAIT;
    while get(&image_url).await.0 != 404 {
        assert!(std::time::Instant::now() < deadline, "the cast was not run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
