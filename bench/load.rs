//! Load generator of `bench/run`, one binary for three measurements:
//!
//! * `hits HOST SOURCE MD5 COUNT WINDOW`: prepare commands for distinct nodes
//!   of one cached image through RabbitMQ, WINDOW in flight; answers per
//!   second and latency (published -> completion received).
//! * `burst HOST COUNT SOURCE...`: COUNT prepare commands published at once,
//!   node i using SOURCE i mod n; time until every completion arrived.
//! * `http URL CLIENTS`: CLIENTS concurrent clients each GET the whole URL;
//!   throughput and errors (wrong status or short body).
//!
//! Each prints one human line and one `RESULT key=value ...` line.
//!
//! With `SEAL_KEY_FILE` (a key file as `[amqp]seal_secret_file` reads it),
//! `hits` seals every command with its first key, as the deploy interface
//! does (docs/contract.md, "Sealed commands and answers"), and checks the
//! seal of every answer.

use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::collections::HashMap;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[tokio::main]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("hits") if args.len() == 6 => {
            hits(
                &args[1],
                &args[2],
                &args[3],
                args[4].parse()?,
                args[5].parse()?,
            )
            .await
        }
        Some("rpc-hits") if args.len() == 6 => {
            rpc_hits(
                &args[1],
                &args[2],
                &args[3],
                args[4].parse()?,
                args[5].parse()?,
            )
            .await
        }
        Some("burst") if args.len() >= 4 => burst(&args[1], args[2].parse()?, &args[3..]).await,
        Some("http") if args.len() == 3 => http(&args[1], args[2].parse()?).await,
        _ => {
            eprintln!(
                "usage: bench-load hits HOST SOURCE MD5 COUNT WINDOW | rpc-hits URL SOURCE MD5 COUNT WINDOW | burst HOST COUNT SOURCE... | http URL CLIENTS"
            );
            std::process::exit(2);
        }
    }
}

/// A channel to the broker with an exclusive reply queue and its consumer.
struct Client {
    conn: Connection,
    ch: Channel,
    reply_to: String,
    replies: lapin::Consumer,
    /// The key commands are sealed with (`SEAL_KEY_FILE`).
    seal_key: Option<Vec<u8>>,
}

/// The first key of the key file `SEAL_KEY_FILE`, when set.
fn seal_key() -> Res<Option<Vec<u8>>> {
    let Some(path) = std::env::var_os("SEAL_KEY_FILE") else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)?;
    let line = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .ok_or("no key")?;
    Ok(Some(hex::decode(line.trim())?))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// The `x-iiw-seal` header of `body` (docs/contract.md: HMAC-SHA256 over
/// the length-prefixed fields) sealed at `at`; `aim` is the routing key,
/// `reply_to` and `correlation_id`.
fn seal(
    key: &[u8],
    kind: &str,
    aim: [Option<&str>; 3],
    body: &[u8],
    at: u64,
    valid: u64,
) -> String {
    use hmac::{KeyInit, Mac};
    use sha2::Digest;
    let tagged = [b"ironic-image-worker seal key v1\n".as_slice(), key].concat();
    let id = hex::encode(&sha2::Sha256::digest(tagged)[..8]);
    let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key).expect("any key");
    mac.update(b"ironic-image-worker seal v1\n");
    let (at_text, valid_text) = (at.to_string(), valid.to_string());
    let [routing_key, reply_to, correlation_id] = aim;
    for field in [
        Some(kind),
        Some(id.as_str()),
        routing_key,
        reply_to,
        correlation_id,
        Some(at_text.as_str()),
        Some(valid_text.as_str()),
    ]
    .map(|f| f.map(str::as_bytes))
    .into_iter()
    .chain([Some(body)])
    {
        match field {
            None => mac.update(&[0]),
            Some(v) => {
                mac.update(&[1]);
                mac.update(&(v.len() as u64).to_be_bytes());
                mac.update(v);
            }
        }
    }
    let mac = hex::encode(mac.finalize().into_bytes());
    format!("1:{id}:{at}:{valid}:{mac}")
}

impl Client {
    async fn connect() -> Res<Client> {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        let q = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let replies = ch
            .basic_consume(
                q.name().clone(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok(Client {
            conn,
            ch,
            reply_to: q.name().to_string(),
            replies,
            seal_key: seal_key()?,
        })
    }

    async fn prepare(&self, host: &str, id: &str, info: serde_json::Value) -> Res<()> {
        let body = serde_json::json!({
            "action": "prepare", "node_uuid": uuid::Uuid::new_v4().to_string(),
            "request_id": id, "instance_info": info,
        });
        let mut props = BasicProperties::default()
            .with_reply_to(self.reply_to.as_str().into())
            .with_correlation_id(id.into())
            .with_delivery_mode(2);
        let key = format!("{host}.node.prepare");
        let body = body.to_string();
        if let Some(k) = &self.seal_key {
            let aim = [Some(key.as_str()), Some(&self.reply_to), Some(id)];
            let sealed = seal(k, "command", aim, body.as_bytes(), now_ms(), 1_800_000);
            let mut headers = FieldTable::default();
            headers.insert("x-iiw-seal".into(), AMQPValue::LongString(sealed.into()));
            props = props.with_headers(headers);
        }
        self.ch
            .basic_publish(
                "ironic-image-worker".into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?;
        Ok(())
    }

    /// The next completion: (correlation id, body).
    async fn reply(&mut self, within: Duration) -> Res<(String, serde_json::Value)> {
        let d = tokio::time::timeout(within, self.replies.next())
            .await?
            .ok_or("reply queue closed")??;
        let id = d
            .properties
            .correlation_id()
            .as_ref()
            .map(|c| c.as_str().to_string())
            .unwrap_or_default();
        if let Some(k) = &self.seal_key {
            let got =
                d.properties
                    .headers()
                    .as_ref()
                    .and_then(|h| match h.inner().get("x-iiw-seal") {
                        Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                        _ => None,
                    });
            let got = got.ok_or("an unsealed answer")?;
            // Checked as the deploy interface checks it: the same seal
            // made again at the answer's own time.
            let at = got
                .split(':')
                .nth(2)
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            let aim = [Some(self.reply_to.as_str()), None, Some(id.as_str())];
            let want = seal(k, "answer", aim, &d.data, at, 0);
            if want != got {
                return Err(format!("an answer whose seal does not hold: {got}").into());
            }
        }
        Ok((id, serde_json::from_slice(&d.data)?))
    }
}

async fn hits(host: &str, source: &str, md5: &str, count: usize, window: usize) -> Res<()> {
    let mut c = Client::connect().await?;
    let info = serde_json::json!({"image_source": source, "image_checksum": md5});
    let mut sent_at: HashMap<String, Instant> = HashMap::new();
    let mut latencies = Vec::with_capacity(count);
    let (mut errors, mut next) = (0usize, 0usize);
    let start = Instant::now();
    while latencies.len() < count {
        while next < count && sent_at.len() < window {
            let id = format!("bench-{next}");
            sent_at.insert(id.clone(), Instant::now());
            c.prepare(host, &id, info.clone()).await?;
            next += 1;
        }
        let (id, v) = c.reply(Duration::from_secs(60)).await?;
        if let Some(t) = sent_at.remove(&id) {
            latencies.push(t.elapsed());
            if v["status"] != "success" || v["cache"] != "hit" {
                errors += 1;
            }
        }
    }
    let total = start.elapsed().as_secs_f64();
    latencies.sort();
    let pct = |p: f64| {
        latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)].as_secs_f64()
            * 1e3
    };
    println!(
        "cache-hit prepares: {count} in {total:.2} s = {:.0}/s, window {window}, median {:.1} ms, p99 {:.1} ms, not-hit-or-error {errors}",
        count as f64 / total,
        pct(0.5),
        pct(0.99),
    );
    println!(
        "RESULT rate={:.0} p50_ms={:.1} p99_ms={:.1} errors={errors}",
        count as f64 / total,
        pct(0.5),
        pct(0.99)
    );
    c.conn.close(200, "bye".into()).await?;
    Ok(())
}

/// `COUNT` prepares for distinct nodes through the JSON-RPC listener at
/// `url`, as Ironic's client sends them (`context`, `rpc.version`), with
/// `WINDOW` calls in flight (one keep-alive connection each); each call
/// returns its completion.
async fn rpc_hits(url: &str, source: &str, md5: &str, count: usize, window: usize) -> Res<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let client = reqwest::Client::new();
    let next = std::sync::Arc::new(AtomicUsize::new(0));
    let info = serde_json::json!({"image_source": source, "image_checksum": md5});
    let run = std::process::id();
    let start = Instant::now();
    let tasks: Vec<_> = (0..window)
        .map(|_| {
            let (client, next, info, url) =
                (client.clone(), next.clone(), info.clone(), url.to_string());
            tokio::spawn(async move {
                let (mut latencies, mut errors) = (Vec::new(), 0usize);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return Ok::<_, reqwest::Error>((latencies, errors));
                    }
                    let body = serde_json::json!({
                        "jsonrpc": "2.0", "id": i, "method": "prepare",
                        "params": {
                            "node_uuid": uuid::Uuid::new_v4().to_string(),
                            "request_id": format!("rpc-bench-{run}-{i}"),
                            "instance_info": info,
                            "context": {"request_id": format!("req-{i}")},
                            "rpc.version": "1.0",
                        },
                    });
                    let t = Instant::now();
                    let v: serde_json::Value =
                        client.post(&url).json(&body).send().await?.json().await?;
                    latencies.push(t.elapsed());
                    if v["result"]["status"] != "success" || v["result"]["cache"] != "hit" {
                        errors += 1;
                    }
                }
            })
        })
        .collect();
    let (mut latencies, mut errors) = (Vec::with_capacity(count), 0usize);
    for t in tasks {
        let (l, e) = t.await??;
        latencies.extend(l);
        errors += e;
    }
    let total = start.elapsed().as_secs_f64();
    latencies.sort();
    let pct = |p: f64| {
        latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)].as_secs_f64()
            * 1e3
    };
    println!(
        "cache-hit prepares over JSON-RPC: {count} in {total:.2} s = {:.0}/s, window {window}, median {:.1} ms, p99 {:.1} ms, not-hit-or-error {errors}",
        count as f64 / total,
        pct(0.5),
        pct(0.99),
    );
    println!(
        "RESULT rate={:.0} p50_ms={:.1} p99_ms={:.1} errors={errors}",
        count as f64 / total,
        pct(0.5),
        pct(0.99)
    );
    Ok(())
}

async fn burst(host: &str, count: usize, sources: &[String]) -> Res<()> {
    let mut c = Client::connect().await?;
    let start = Instant::now();
    for i in 0..count {
        let info = serde_json::json!({"image_source": sources[i % sources.len()]});
        c.prepare(host, &format!("burst-{i}"), info).await?;
    }
    let published = start.elapsed().as_secs_f64();
    let (mut errors, mut misses, mut got) = (0usize, 0usize, 0usize);
    let mut last_miss = 0.0;
    while got < count {
        let (_, v) = c.reply(Duration::from_secs(600)).await?;
        got += 1;
        if v["status"] != "success" {
            errors += 1;
            eprintln!("error: {v}");
        } else if v["cache"] == "miss" {
            misses += 1;
            last_miss = start.elapsed().as_secs_f64();
        }
    }
    let total = start.elapsed().as_secs_f64();
    println!(
        "burst: {count} prepares of {} images answered in {total:.2} s (published in {published:.2} s, last miss answered at {last_miss:.2} s), {misses} misses, {errors} errors",
        sources.len()
    );
    println!("RESULT seconds={total:.3} misses={misses} errors={errors}");
    c.conn.close(200, "bye".into()).await?;
    Ok(())
}

async fn http(url: &str, clients: usize) -> Res<()> {
    let mut builder = reqwest::Client::builder().pool_max_idle_per_host(0);
    // An https:// URL is verified against the CA in BENCH_CA (a test CA).
    if let Some(ca) = std::env::var_os("BENCH_CA") {
        let pem = std::fs::read(ca)?;
        builder = builder.tls_certs_only([reqwest::Certificate::from_pem(&pem)?]);
    }
    let client = builder.build()?;
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (client, url) = (client.clone(), url.to_string());
            tokio::spawn(async move {
                let resp = match client.get(&url).send().await {
                    Ok(r) if r.status() == 200 => r,
                    _ => return (0u64, false),
                };
                let expected = resp.content_length();
                let mut body = resp.bytes_stream();
                let mut n = 0u64;
                while let Some(chunk) = body.next().await {
                    match chunk {
                        Ok(c) => n += c.len() as u64,
                        Err(_) => return (n, false),
                    }
                }
                (n, expected == Some(n))
            })
        })
        .collect();
    let (mut bytes, mut errors) = (0u64, 0usize);
    for t in tasks {
        let (n, ok) = t.await?;
        bytes += n;
        errors += usize::from(!ok);
    }
    let total = start.elapsed().as_secs_f64();
    let mbps = bytes as f64 / total / 1e6;
    println!(
        "http: {clients} clients, {bytes} bytes in {total:.2} s = {mbps:.0} MB/s, {errors} errors"
    );
    println!("RESULT mbps={mbps:.1} seconds={total:.3} errors={errors}");
    Ok(())
}
