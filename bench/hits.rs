//! Cache-hit throughput through RabbitMQ: publishes N prepare commands for
//! distinct nodes of one cached image to a running worker, keeping a window
//! of commands in flight, and prints answers per second with median and p99
//! latency (published -> completion received).
//!
//! Usage: bench-hits <conductor-host> <image-source> <md5> <count> [window]

use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: bench-hits HOST IMAGE_SOURCE MD5 COUNT [WINDOW]");
        std::process::exit(2);
    }
    let (host, source, md5) = (&args[1], &args[2], &args[3]);
    let count: usize = args[4].parse()?;
    let window: usize = args.get(5).map(|w| w.parse()).transpose()?.unwrap_or(32);
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    let reply = ch
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
    let mut replies = ch
        .basic_consume(
            reply.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let key = format!("{host}.node.prepare");
    let mut sent_at: HashMap<String, Instant> = HashMap::new();
    let mut latencies = Vec::with_capacity(count);
    let mut errors = 0usize;
    let mut next = 0usize;
    let start = Instant::now();
    while latencies.len() < count {
        while next < count && sent_at.len() < window {
            let id = format!("bench-{next}");
            let node = uuid::Uuid::new_v4().to_string();
            let body = serde_json::json!({
                "action": "prepare", "node_uuid": node, "request_id": id,
                "instance_info": {"image_source": source, "image_checksum": md5},
            });
            let props = BasicProperties::default()
                .with_reply_to(reply.name().clone())
                .with_correlation_id(id.as_str().into())
                .with_delivery_mode(2);
            sent_at.insert(id, Instant::now());
            ch.basic_publish(
                "ironic-image-worker".into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                body.to_string().as_bytes(),
                props,
            )
            .await?;
            next += 1;
        }
        let d = tokio::time::timeout(Duration::from_secs(60), replies.next())
            .await?
            .ok_or("reply queue closed")??;
        let id = d
            .properties
            .correlation_id()
            .as_ref()
            .map(|c| c.as_str().to_string())
            .unwrap_or_default();
        if let Some(t) = sent_at.remove(&id) {
            latencies.push(t.elapsed());
            let v: serde_json::Value = serde_json::from_slice(&d.data)?;
            if v["status"] != "success" || v["cache"] != "hit" {
                errors += 1;
            }
        }
    }
    let total = start.elapsed();
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
    println!(
        "cache-hit prepares: {count} in {:.2} s = {:.0}/s, window {window}, median {:.1} ms, p99 {:.1} ms, not-hit-or-error {errors}",
        total.as_secs_f64(),
        count as f64 / total.as_secs_f64(),
        pct(0.5).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
    );
    conn.close(200, "bye".into()).await?;
    Ok(())
}
