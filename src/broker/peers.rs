//! The peers over the broker: queries for a master and the other workers'
//! offers on the `[peers]exchange` topic exchange, and the cloud-wide claim
//! on downloading a master from its source.
//!
//! * Every `serve` process keeps one connection of its own for this, and
//!   one exclusive, auto-delete queue bound to `query.#`: it receives the
//!   queries of the others and the offers answering its own (sent to it by
//!   name, with the query's correlation id). A query expires after
//!   `[peers]query_timeout_ms`, the time the asker collects offers.
//! * The claim on master `<name>` is the exclusive queue
//!   `<exchange>.claim.<name>`, declared on a channel of its own: only one
//!   connection can hold it (the broker refuses the others with 405
//!   RESOURCE_LOCKED), the holder deletes it when its master is committed,
//!   and the broker deletes it when the holder's connection dies, so a
//!   waiting worker takes the download over.
//!
//! With the broker unreachable, a query finds no offer and a claim is
//! `Unavailable`: each worker downloads from the source alone, as without
//! peers.

use super::connect::Brokers;
use crate::peers::wire::{Offer, OfferState, QUERY_KEY, Query};
use crate::pipeline::Pipeline;
use crate::pipeline::peers::{Claim, ClaimGuard, PeerDirectory};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lapin::options::*;
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// How long the link waits before connecting again after a loss.
const RECONNECT: Duration = Duration::from_secs(1);

/// AMQP's RESOURCE_LOCKED: an exclusive queue another connection holds.
const RESOURCE_LOCKED: u16 = 405;

/// Offers kept of one query: enough holders to spread a master's copies
/// over, and a bound on what any broker participant can make us hold.
const MAX_OFFERS: usize = 64;

/// The peers' link to the broker, shared by the pipeline (as its
/// [`PeerDirectory`]) and the task answering the other workers.
pub struct PeerLink {
    pipeline: Arc<Pipeline>,
    exchange: String,
    host: String,
    process: String,
    url: String,
    timeout: Duration,
    live: Mutex<Option<Live>>,
    /// Queries of ours waiting for offers, by correlation id.
    pending: Mutex<HashMap<String, mpsc::UnboundedSender<Offer>>>,
    /// The claims this process holds (answered as `downloading`).
    held: Arc<Mutex<HashSet<String>>>,
}

/// The current connection: its channel for queries and answers, and the
/// queue that receives them.
#[derive(Clone)]
struct Live {
    conn: Arc<Connection>,
    channel: Channel,
    queue: String,
}

/// A claim held: its queue on its own channel, deleted when dropped.
struct Held {
    channel: Channel,
    queue: String,
    name: String,
    held: Arc<Mutex<HashSet<String>>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        lock(&self.held).remove(&self.name);
        let (channel, queue) = (self.channel.clone(), std::mem::take(&mut self.queue));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = channel.close(200, "claim released".into()).await;
            });
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts the peers' link (connecting, answering the others, reconnecting
/// after a loss) until `stop`; returns it for the pipeline.
pub fn start(
    pipeline: Arc<Pipeline>,
    settings: &super::Settings,
    brokers: Brokers,
    stop: watch::Receiver<bool>,
) -> Arc<PeerLink> {
    let peers = &settings.peers;
    let link = Arc::new(PeerLink {
        exchange: peers.exchange.clone(),
        host: settings.host.clone(),
        process: uuid::Uuid::new_v4().simple().to_string(),
        url: peers.advertised_url().unwrap_or_default(),
        timeout: Duration::from_millis(peers.query_timeout_ms),
        live: Mutex::new(None),
        pending: Mutex::new(HashMap::new()),
        held: Arc::new(Mutex::new(HashSet::new())),
        pipeline: pipeline.clone(),
    });
    tokio::spawn(link.clone().run(brokers, stop));
    link
}

impl PeerLink {
    /// Connects, answers, and connects again after a loss, the brokers of
    /// `[amqp]url` in turn.
    async fn run(self: Arc<Self>, brokers: Brokers, mut stop: watch::Receiver<bool>) {
        let mut next = 0usize;
        while !*stop.borrow() {
            let index = next % brokers.len();
            next = next.wrapping_add(1);
            match self.open(&brokers, index).await {
                Ok((live, consumer)) => {
                    tracing::info!(broker = %brokers.name(index), "peers: connected");
                    *lock(&self.live) = Some(live.clone());
                    tokio::select! {
                        () = self.answer(&live, consumer) => {}
                        _ = stop.wait_for(|s| *s) => {}
                    }
                    *lock(&self.live) = None;
                    let _ = live.conn.close(200, "stopping".into()).await;
                    tracing::warn!(broker = %brokers.name(index), "peers: connection lost");
                }
                Err(e) => {
                    let error = crate::error::error_chain(&e);
                    tracing::warn!(broker = %brokers.name(index), %error, "peers: broker unavailable");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(RECONNECT) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }

    /// One connection: the exchange, our queue bound to the queries, and
    /// its consumer (no acknowledgements: a lost query is a miss).
    async fn open(
        &self,
        brokers: &Brokers,
        index: usize,
    ) -> lapin::Result<(Live, lapin::Consumer)> {
        let props = ConnectionProperties::default()
            .with_connection_name(format!("ironic-image-worker-peers@{}", self.host).into());
        let conn = brokers.connect(index, props).await?;
        let channel = conn.create_channel().await?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let exchange = ShortString::from(self.exchange.as_str());
        channel
            .exchange_declare(
                exchange.clone(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await?;
        let own = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..QueueDeclareOptions::default()
        };
        let queue = channel
            .queue_declare("".into(), own, FieldTable::default())
            .await?;
        let queue = queue.name().to_string();
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange,
                format!("{QUERY_KEY}.#").as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let no_ack = BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        };
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                no_ack,
                FieldTable::default(),
            )
            .await?;
        let live = Live {
            conn: Arc::new(conn),
            channel,
            queue,
        };
        Ok((live, consumer))
    }

    /// Handles what arrives on our queue until the connection ends: the
    /// others' queries are answered, offers go to the query waiting.
    async fn answer(&self, live: &Live, mut consumer: lapin::Consumer) {
        while let Some(Ok(delivery)) = consumer.next().await {
            let props = &delivery.properties;
            let kind = props.kind().as_ref().map(|k| k.as_str().to_string());
            let correlation = props.correlation_id().as_ref().map(|c| c.to_string());
            match kind.as_deref() {
                Some("offer") => {
                    let Ok(offer) = serde_json::from_slice::<Offer>(&delivery.data) else {
                        continue;
                    };
                    if let Some(to) = correlation.and_then(|c| lock(&self.pending).get(&c).cloned())
                    {
                        let _ = to.send(offer);
                    }
                }
                Some("query") => {
                    let Ok(query) = serde_json::from_slice::<Query>(&delivery.data) else {
                        continue;
                    };
                    let reply_to = props.reply_to().as_ref().map(|r| r.to_string());
                    if let (Some(to), Some(c)) = (reply_to, correlation) {
                        self.answer_query(live, query, &to, &c).await;
                    }
                }
                _ => {}
            }
        }
    }

    /// Offers what we hold of the queried master (never to ourselves or a
    /// worker of our host, which shares our cache): `downloading` while we
    /// hold its claim (with the size of the master our listener streams as
    /// it is written, once there is one), else `verified` when its master
    /// is committed here.
    async fn answer_query(&self, live: &Live, query: Query, reply_to: &str, correlation: &str) {
        if query.process == self.process || query.host == self.host {
            return;
        }
        let mut live_size = None;
        let state = if lock(&self.held).contains(&query.name) {
            live_size = self.pipeline.live_size(&query.name);
            Some((OfferState::Downloading, None))
        } else {
            let (p, name) = (self.pipeline.clone(), query.name.clone());
            tokio::task::spawn_blocking(move || p.peer_offer(&name))
                .await
                .ok()
                .flatten()
                .map(|m| (OfferState::Verified, Some(m)))
        };
        let Some((state, master)) = state else {
            return;
        };
        let offer = Offer {
            name: query.name,
            host: self.host.clone(),
            process: self.process.clone(),
            url: self.url.clone(),
            state,
            master,
            live_size,
        };
        let Ok(body) = serde_json::to_vec(&offer) else {
            return;
        };
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_type("offer".into())
            .with_correlation_id(correlation.into())
            .with_expiration(self.timeout.as_millis().to_string().as_str().into());
        let _ = live
            .channel
            .basic_publish(
                "".into(),
                reply_to.into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await;
    }

    /// Publishes a query for `name` and collects the offers until the
    /// query timeout.
    async fn collect(&self, name: &str) -> Vec<Offer> {
        let Some(live) = lock(&self.live).clone() else {
            return Vec::new();
        };
        let correlation = uuid::Uuid::new_v4().simple().to_string();
        let (tx, mut rx) = mpsc::unbounded_channel();
        lock(&self.pending).insert(correlation.clone(), tx);
        let query = Query {
            name: name.to_string(),
            host: self.host.clone(),
            process: self.process.clone(),
        };
        let body = serde_json::to_vec(&query).unwrap_or_default();
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_type("query".into())
            .with_reply_to(live.queue.as_str().into())
            .with_correlation_id(correlation.as_str().into())
            .with_expiration(self.timeout.as_millis().to_string().as_str().into());
        let key = format!("{QUERY_KEY}.{name}");
        let sent = live
            .channel
            .basic_publish(
                self.exchange.as_str().into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await;
        let mut offers = Vec::new();
        if sent.is_ok() {
            let until = tokio::time::Instant::now() + self.timeout;
            while let Ok(Some(offer)) = tokio::time::timeout_at(until, rx.recv()).await {
                if offer.name == name && offer.process != self.process {
                    offers.push(offer);
                }
                if offers.len() >= MAX_OFFERS {
                    break;
                }
            }
        }
        lock(&self.pending).remove(&correlation);
        offers
    }

    /// Declares the claim queue of `name` exclusively on a channel of its
    /// own (a refusal closes the channel).
    async fn take(&self, name: &str) -> Claim {
        let Some(live) = lock(&self.live).clone() else {
            return Claim::Unavailable;
        };
        if lock(&self.held).contains(name) {
            return Claim::Taken;
        }
        let Ok(channel) = live.conn.create_channel().await else {
            return Claim::Unavailable;
        };
        let queue = format!("{}.claim.{name}", self.exchange);
        let exclusive = QueueDeclareOptions {
            exclusive: true,
            ..QueueDeclareOptions::default()
        };
        match channel
            .queue_declare(queue.as_str().into(), exclusive, FieldTable::default())
            .await
        {
            Ok(_) => {
                if !lock(&self.held).insert(name.to_string()) {
                    return Claim::Taken;
                }
                let held = Held {
                    channel,
                    queue,
                    name: name.to_string(),
                    held: self.held.clone(),
                };
                Claim::Held(ClaimGuard::new(Box::new(held)))
            }
            Err(e) if super::reply_code(&e) == Some(RESOURCE_LOCKED) => Claim::Taken,
            Err(e) => {
                let error = crate::error::error_chain(&e);
                tracing::warn!(%error, master = name, "peers: no claim taken; downloading alone");
                Claim::Unavailable
            }
        }
    }
}

impl PeerDirectory for PeerLink {
    fn offers<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Vec<Offer>> {
        Box::pin(self.collect(name))
    }

    fn claim<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Claim> {
        Box::pin(self.take(name))
    }
}
