//! The peers over the broker: queries for a master and the other workers'
//! offers on the `[peers]exchange` topic exchange, and the cloud-wide claim
//! on downloading a master from its source.
//!
//! * Every `serve` process keeps one connection of its own for this, and
//!   one exclusive, auto-delete queue bound to `query.#`: it receives the
//!   queries of the others and the offers answering its own (sent to it by
//!   name, with the query's correlation id). A query expires after
//!   `[peers]query_timeout_ms`, the time the asker collects offers.
//! * Every query and offer is sealed with the `[peers]` secret
//!   (`peers::seal`) and the seal is checked before the body is read: a
//!   participant of the broker without the secret can neither ask the
//!   workers nor answer them. Bodies over `seal::MAX_MESSAGE_BYTES` are not
//!   read; the queue itself refuses a message over [`MAX_QUEUE_BYTES`], so
//!   it never reaches the worker.
//! * The claim on master `<name>` is the exclusive queue
//!   `<exchange>.claim.<HMAC of name>` (a name only holders of the secret
//!   can compute), declared on a channel of its own: only one
//!   connection can hold it (the broker refuses the others with 405
//!   RESOURCE_LOCKED), the holder deletes it when its master is committed,
//!   and the broker deletes it when the holder's connection dies, so a
//!   waiting worker takes the download over.
//!
//! With the broker unreachable, a query finds no offer and a claim is
//! `Unavailable`: each worker downloads from the source alone, as without
//! peers.

use super::connect::Brokers;
use crate::metrics::Metrics;
use crate::peers::seal::{self, Envelope, Kind, Refusal, Replays};
use crate::peers::wire::{Offer, OfferState, QUERY_KEY, Query};
use crate::pipeline::Pipeline;
use crate::pipeline::peers::{Claim, ClaimGuard, PeerDirectory};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
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

/// Bytes of ready messages our queue holds at most: the broker refuses a
/// message beyond it (`x-overflow = reject-publish`), so an oversized one
/// never reaches a worker, and keeps the others.
const MAX_QUEUE_BYTES: i64 = 1 << 20;

/// The peers' link to the broker, shared by the pipeline (as its
/// [`PeerDirectory`]) and the task answering the other workers.
pub struct PeerLink {
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    secret: Vec<u8>,
    exchange: String,
    host: String,
    process: String,
    url: String,
    timeout: Duration,
    live: Mutex<Option<Live>>,
    /// Queries of ours waiting for offers, by correlation id.
    pending: Mutex<HashMap<String, Pending>>,
    /// The seals of the queries seen lately (a query counts once).
    replays: Mutex<Replays>,
    /// The claims this process holds (answered as `downloading`).
    held: Arc<Mutex<HashSet<String>>>,
}

/// A query of ours collecting offers: where they go, and the seals of
/// those taken (an offer counts once).
struct Pending {
    to: mpsc::UnboundedSender<Offer>,
    seen: HashSet<[u8; 32]>,
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
    metrics: Arc<Metrics>,
    stop: watch::Receiver<bool>,
) -> crate::error::Result<Arc<PeerLink>> {
    let peers = &settings.peers;
    let link = Arc::new(PeerLink {
        metrics,
        secret: peers.load_secret()?,
        replays: Mutex::new(Replays::default()),
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
    Ok(link)
}

/// The headers carrying the seal of `body` in `env`.
fn sealed(secret: &[u8], env: &Envelope<'_>, body: &[u8]) -> FieldTable {
    let mut headers = FieldTable::default();
    headers.insert(
        seal::TIME_HEADER.into(),
        AMQPValue::LongLongInt(env.time_ms as i64),
    );
    headers.insert(
        seal::MAC_HEADER.into(),
        AMQPValue::LongString(seal::seal(secret, env, body).into()),
    );
    headers
}

/// The seal a delivery's headers carry (hex), if any.
fn mac_of(props: &BasicProperties) -> Option<String> {
    let headers = props.headers().as_ref()?;
    match headers.inner().get(seal::MAC_HEADER)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        _ => None,
    }
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
        let mut bounded = FieldTable::default();
        bounded.insert(
            "x-max-length-bytes".into(),
            AMQPValue::LongLongInt(MAX_QUEUE_BYTES),
        );
        bounded.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        let queue = channel.queue_declare("".into(), own, bounded).await?;
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
    /// others' queries are answered, offers go to the query waiting; none
    /// is read unless its seal holds.
    async fn answer(&self, live: &Live, mut consumer: lapin::Consumer) {
        while let Some(Ok(delivery)) = consumer.next().await {
            if let Err((kind, refusal)) = self.handle(live, &delivery).await {
                self.refused(kind, refusal);
            }
        }
    }

    /// One delivery: its seal checked first (size, signature, time), then
    /// read as what it says it is.
    async fn handle(
        &self,
        live: &Live,
        delivery: &lapin::message::Delivery,
    ) -> std::result::Result<(), (Kind, Refusal)> {
        let props = &delivery.properties;
        let kind = props.kind().as_ref().map(|k| k.as_str().to_string());
        let correlation = props.correlation_id().as_ref().map(|c| c.to_string());
        let reply_to = props.reply_to().as_ref().map(|r| r.to_string());
        let (kind, correlation) = match (kind.as_deref(), correlation) {
            (Some("offer"), Some(c)) => (Kind::Offer, c),
            (Some("query"), Some(c)) => (Kind::Query, c),
            _ => return Ok(()),
        };
        let env = Envelope {
            kind,
            correlation: &correlation,
            reply_to: reply_to.as_deref().unwrap_or_default(),
            time_ms: super::stamp::header_ms(props, seal::TIME_HEADER).unwrap_or(0),
        };
        let mac = mac_of(props);
        let now = crate::clock::now_ms();
        let refused = |r| (kind, r);
        let mac = seal::check(&self.secret, &env, &delivery.data, mac.as_deref(), now)
            .map_err(refused)?;
        if kind == Kind::Offer {
            return self
                .take_offer(&correlation, mac, &delivery.data)
                .map_err(refused);
        }
        if !lock(&self.replays).first_time(mac, env.time_ms, now) {
            return Err(refused(Refusal::Replayed));
        }
        let to = reply_to.filter(|t| !t.is_empty());
        if let (Ok(query), Some(to)) = (serde_json::from_slice::<Query>(&delivery.data), to) {
            self.answer_query(live, query, &to, &correlation).await;
        }
        Ok(())
    }

    /// Counts and logs (at debug: anyone on the broker may cause it) a
    /// message dropped unread.
    fn refused(&self, kind: Kind, refusal: Refusal) {
        let kind = match kind {
            Kind::Query => "query",
            Kind::Offer => "offer",
        };
        tracing::debug!(kind, reason = refusal.reason(), "peers: message refused");
        self.metrics
            .peers
            .refused_messages
            .with_label_values(&[kind, refusal.reason()])
            .inc();
    }

    /// A sealed offer for query `correlation`: to the query, once, when it
    /// is still collecting (a late one is dropped quietly).
    fn take_offer(
        &self,
        correlation: &str,
        mac: [u8; 32],
        body: &[u8],
    ) -> std::result::Result<(), Refusal> {
        let mut pending = lock(&self.pending);
        let Some(query) = pending.get_mut(correlation) else {
            return Ok(());
        };
        if !query.seen.insert(mac) {
            return Err(Refusal::Replayed);
        }
        if let Ok(offer) = serde_json::from_slice::<Offer>(body) {
            let _ = query.to.send(offer);
        }
        Ok(())
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
            live_size = self.pipeline.masters().live_size(&query.name);
            Some((OfferState::Downloading, None))
        } else {
            let (p, name) = (self.pipeline.clone(), query.name.clone());
            tokio::task::spawn_blocking(move || p.masters().peer_offer(&name))
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
        let env = Envelope {
            kind: Kind::Offer,
            correlation,
            reply_to: "",
            time_ms: crate::clock::now_ms(),
        };
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_type("offer".into())
            .with_headers(sealed(&self.secret, &env, &body))
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
        let pending = Pending {
            to: tx,
            seen: HashSet::new(),
        };
        lock(&self.pending).insert(correlation.clone(), pending);
        let query = Query {
            name: name.to_string(),
            host: self.host.clone(),
            process: self.process.clone(),
        };
        let body = serde_json::to_vec(&query).unwrap_or_default();
        let env = Envelope {
            kind: Kind::Query,
            correlation: &correlation,
            reply_to: &live.queue,
            time_ms: crate::clock::now_ms(),
        };
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_type("query".into())
            .with_headers(sealed(&self.secret, &env, &body))
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
        let queue = seal::claim_queue(&self.secret, &self.exchange, name);
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
