//! One broker connection's lifetime and the reconnect loop around it.
//!
//! Each attempt takes the next broker of `[amqp]url`; connecting and
//! declaring the topology must finish within `[amqp]connect_timeout`. A
//! failed broker is followed at once by the next one; only when every broker
//! of the list failed in a row does the loop wait, with jittered exponential
//! backoff capped at [`MAX_DELAY`].

use super::connect::Brokers;
use super::dispatch::Dispatcher;
use super::publisher::Publisher;
use super::topology::Topology;
use crate::dispatch::Dispatch;
use crate::metrics::Metrics;
use backon::BackoffBuilder;
use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::{FieldTable, ShortString};
use lapin::{Connection, ConnectionProperties};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// The longest wait between two rounds of connection attempts.
pub const MAX_DELAY: Duration = Duration::from_secs(30);

/// How often the dead-letter queue's depth is read.
const DEAD_LETTER_CENSUS: Duration = Duration::from_secs(15);

/// How a session ended.
enum Ended {
    /// Stopped on request; in-flight work drained.
    Stopped,
    /// Stopped on request while connecting.
    StoppedConnecting,
    /// The connection was lost after working.
    Lost,
}

/// Runs the consumer until `stop` turns true, reconnecting as needed.
/// `connected` mirrors the connection state for `/readyz`.
pub async fn run(
    work: Arc<Dispatch>,
    settings: super::Settings,
    brokers: Brokers,
    connected: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    let metrics = work.metrics().clone();
    let dispatcher = Arc::new(Dispatcher::new(work, &settings));
    let mut backoff = reconnect_backoff();
    let mut next = 0usize;
    let mut failed_in_row = 0usize;
    let mut drained = false;
    // Once the topology exists, a reconnect only consumes: declaring needs
    // every cluster node that the broker still believes alive, so with a
    // node hung it would stall until the cluster gives that node up.
    let mut declared = false;
    while !*stop.borrow() {
        let index = next % brokers.len();
        next = next.wrapping_add(1);
        let shared = Shared {
            brokers: &brokers,
            dispatcher: &dispatcher,
            metrics: &metrics,
            connected: &connected,
            settings: &settings,
        };
        let outcome = session(&shared, index, !declared, &mut stop).await;
        connected.store(false, Ordering::Relaxed);
        metrics.amqp.connected.set(0);
        match &outcome {
            Ok(_) => declared = true,
            // The queue is gone (deleted, broker reset): declare it again.
            Err(e) if e.reply_code == Some(NOT_FOUND) => declared = false,
            Err(_) => {}
        }
        let delay = match outcome {
            Ok(Ended::Stopped) => {
                drained = true;
                break;
            }
            Ok(Ended::StoppedConnecting) => break,
            Ok(Ended::Lost) => {
                backoff = reconnect_backoff();
                failed_in_row = 0;
                Duration::ZERO
            }
            Err(e) => {
                failed_in_row += 1;
                e.log(brokers.name(index));
                if failed_in_row.is_multiple_of(brokers.len()) {
                    backoff.next().unwrap_or(MAX_DELAY).min(MAX_DELAY)
                } else {
                    Duration::ZERO
                }
            }
        };
        tracing::info!(?delay, broker = %brokers.name(next % brokers.len()), "reconnecting to the broker");
        metrics.amqp.reconnects.inc();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    if drained {
        return;
    }
    // Stopped while disconnected: jobs still running get the grace period
    // (their answers need a connection; what stays unacknowledged is
    // redelivered after the restart).
    drain(&dispatcher, &settings).await;
}

/// Lets in-flight work finish within `[amqp]shutdown_grace`, taking no new
/// work; what is still unacknowledged after it is redelivered, what was
/// acknowledged early is lost (said in the log, with how many).
async fn drain(dispatcher: &Dispatcher, settings: &super::Settings) {
    dispatcher.tracker().close();
    let grace = Duration::from_secs(settings.amqp.shutdown_grace);
    if tokio::time::timeout(grace, dispatcher.tracker().wait())
        .await
        .is_err()
    {
        let lost = dispatcher.accepted_unanswered();
        tracing::warn!(
            ?grace,
            acknowledged_early = lost,
            "in-flight work did not finish in the grace period: unacknowledged work will be \
             redelivered, work acknowledged early is dropped unanswered (its callers time out)"
        );
    }
}

/// AMQP's reply code for a missing queue or exchange.
const NOT_FOUND: u16 = 404;

/// Why a session could not get going.
struct Failed {
    text: String,
    /// The broker's reply code, when it refused something.
    reply_code: Option<u16>,
}

impl Failed {
    fn of(e: &lapin::Error) -> Failed {
        Failed {
            text: crate::error::error_chain(e),
            reply_code: super::reply_code(e),
        }
    }

    /// Logs the failure with broker `name` and what to check.
    fn log(&self, name: &str) {
        tracing::warn!(
            broker = %name,
            error = %self.text,
            hint = self.hint(),
            "broker unavailable"
        );
    }

    /// What the operator should check, for the refusals that have one
    /// cause in practice.
    fn hint(&self) -> &'static str {
        if self.reply_code == Some(ACCESS_REFUSED) || self.text.contains("ACCESS_REFUSED") {
            "check the user and password of [amqp]url and the user's permissions on its \
             virtual host"
        } else if self.reply_code == Some(NOT_FOUND) {
            "the queue or exchange does not exist: give the user the configure permission, \
             or import the definitions (operations guide, least-privilege broker user)"
        } else {
            ""
        }
    }
}

/// Jittered exponential backoff; [`MAX_DELAY`] caps each value after jitter.
fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    crate::retry::jittered(Duration::from_millis(200), MAX_DELAY / 2, None)
        .build()
        .map(|d| d.min(MAX_DELAY))
}

/// The channels of a working connection.
struct Opened {
    conn: Connection,
    /// For passive declarations (reading the dead-letter queue's depth).
    probe_channel: lapin::Channel,
    consume_channel: lapin::Channel,
    consumer: lapin::Consumer,
    publisher: Publisher,
}

/// AMQP's reply code for an operation the user's permissions refuse.
const ACCESS_REFUSED: u16 = 403;

/// The steps of [`open`], named in a timeout's message.
const STEPS: [&str; 4] = [
    "connect",
    "open channels",
    "declare the topology",
    "consume",
];

/// Connects to broker `index`, declares the topology (when `declare`) and
/// starts consuming; `step` follows the progress (an index into [`STEPS`]).
async fn open(
    brokers: &Brokers,
    index: usize,
    declare: bool,
    settings: &super::Settings,
    step: &std::sync::atomic::AtomicUsize,
) -> lapin::Result<Opened> {
    step.store(0, Ordering::Relaxed);
    let props = ConnectionProperties::default()
        .with_connection_name(format!("ironic-image-worker@{}", settings.host).into());
    let conn = brokers.connect(index, props).await?;
    step.store(1, Ordering::Relaxed);
    let mut consume_channel = conn.create_channel().await?;
    let publish_channel = conn.create_channel().await?;
    let probe_channel = conn.create_channel().await?;
    let topology = Topology::new(&settings.host, &settings.amqp);
    step.store(2, Ordering::Relaxed);
    if declare
        && let Err(e) = topology
            .declare(&conn, &consume_channel, &settings.amqp)
            .await
    {
        if super::reply_code(&e) != Some(ACCESS_REFUSED) {
            return Err(e);
        }
        // A user without the configure permission (a least-privilege
        // set-up): the topology is the broker's, imported from
        // ops/rabbitmq/definitions.json; consuming tells whether it is there.
        tracing::info!(
            queue = %topology.queue,
            "the broker user may not declare: using the exchanges and queues defined on the broker"
        );
        consume_channel = conn.create_channel().await?;
    }
    consume_channel
        .basic_qos(settings.amqp.prefetch, BasicQosOptions::default())
        .await?;
    let publisher = Publisher::new(
        publish_channel,
        &topology.events_exchange,
        settings.seal.clone(),
    )
    .await?;
    step.store(3, Ordering::Relaxed);
    let consumer = consume_channel
        .basic_consume(
            topology.queue.as_str().into(),
            ShortString::from(
                format!("ironic-image-worker-{}", uuid::Uuid::new_v4().simple()).as_str(),
            ),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(Opened {
        conn,
        probe_channel,
        consume_channel,
        consumer,
        publisher,
    })
}

/// What every session of one [`run`] shares.
struct Shared<'a> {
    brokers: &'a Brokers,
    dispatcher: &'a Arc<Dispatcher>,
    metrics: &'a Metrics,
    /// Mirrors the connection state for `/readyz`.
    connected: &'a AtomicBool,
    settings: &'a super::Settings,
}

/// One connection's lifetime, to broker `index` (declaring the topology
/// when `declare`). Err: could not get going.
async fn session(
    shared: &Shared<'_>,
    index: usize,
    declare: bool,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ended, Failed> {
    let Shared {
        brokers,
        dispatcher,
        metrics,
        connected,
        settings,
    } = *shared;
    let limit = Duration::from_secs(settings.amqp.connect_timeout.max(1));
    let step = std::sync::atomic::AtomicUsize::new(0);
    let opened = tokio::select! {
        opened = tokio::time::timeout(limit, open(brokers, index, declare, settings, &step)) => match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => return Err(Failed::of(&e)),
            Err(_) => {
                let at = STEPS[step.load(Ordering::Relaxed).min(STEPS.len() - 1)];
                let text = format!("no connection within {limit:?} ([amqp]connect_timeout), stuck at: {at}");
                return Err(Failed { text, reply_code: None });
            }
        },
        _ = stop.wait_for(|s| *s) => return Ok(Ended::StoppedConnecting),
    };
    let link = dispatcher.connected(opened.publisher.clone());
    let resumer = dispatcher.clone();
    dispatcher
        .tracker()
        .spawn(async move { resumer.resume_parked().await });
    connected.store(true, Ordering::Relaxed);
    metrics.amqp.connected.set(1);
    tracing::info!(
        broker = %brokers.name(index),
        heartbeat = opened.conn.configuration().heartbeat(),
        queue = %Topology::new(&settings.host, &settings.amqp).queue,
        "consuming"
    );
    let mut opened = opened;
    let ended = consume(shared, index, &mut opened, &link, stop).await;
    connected.store(false, Ordering::Relaxed);
    metrics.amqp.connected.set(0);
    if let Ended::Stopped = ended {
        // Stop taking work, let in-flight work finish within the grace
        // period while this connection still carries its answers.
        let _ = opened
            .consume_channel
            .basic_cancel(opened.consumer.tag(), BasicCancelOptions::default())
            .await;
        drain(dispatcher, settings).await;
    }
    // Work goes on; answers wait for the next connection.
    dispatcher.disconnected(link.session);
    let close = opened.conn.close(200, "bye".into());
    let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
    Ok(ended)
}

/// Hands deliveries to the dispatcher and reads the dead-letter queue's
/// depth until the connection is lost or `stop` turns true. A channel the
/// broker closed over its consumer timeout teaches the dispatcher the
/// value the broker enforces.
async fn consume(
    shared: &Shared<'_>,
    index: usize,
    opened: &mut Opened,
    link: &super::dispatch::Link,
    stop: &mut watch::Receiver<bool>,
) -> Ended {
    let dead_letter_queue =
        Topology::new(&shared.settings.host, &shared.settings.amqp).dead_letter_queue;
    let mut census = tokio::time::interval(DEAD_LETTER_CENSUS);
    loop {
        // Deliveries (and the consumer's error) first: a consumer timeout
        // also fails acknowledgements, which signal `broken`, and its
        // value is only in the consumer's error.
        let (census_due, delivery) = tokio::select! {
            biased;
            next = opened.consumer.next() => match next {
                Some(Ok(delivery)) => (false, Some(delivery)),
                Some(Err(e)) => {
                    if let Some(enforced) = super::consumer_timeout_of(&e) {
                        shared.dispatcher.broker_consumer_timeout(enforced);
                    }
                    let error = crate::error::error_chain(&e);
                    tracing::warn!(broker = %shared.brokers.name(index), %error, "connection lost");
                    return Ended::Lost;
                }
                None => return Ended::Lost,
            },
            _ = link.broken.notified() => return Ended::Lost,
            _ = stop.wait_for(|s| *s) => return Ended::Stopped,
            _ = census.tick() => (true, None),
        };
        if let Some(delivery) = delivery {
            shared.dispatcher.dispatch(link.session, delivery).await;
        }
        if census_due {
            dead_letter_census(shared.metrics, &opened.probe_channel, &dead_letter_queue).await;
        }
    }
}

/// Reads the dead-letter queue's depth into `amqp_dead_letter_messages`.
async fn dead_letter_census(metrics: &Metrics, probe: &lapin::Channel, queue: &str) {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = tokio::time::timeout(
        DEAD_LETTER_CENSUS,
        probe.queue_declare(queue.into(), passive, FieldTable::default()),
    )
    .await;
    if let Ok(Ok(q)) = declared {
        metrics.amqp.dead_letters.set(i64::from(q.message_count()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jitter adds up to the delay itself on top of it: the cap must hold
    /// after jitter (it once let 45 s through a documented 30 s cap).
    #[test]
    fn backoff_stays_within_its_cap() {
        let delays: Vec<Duration> = reconnect_backoff().take(200).collect();
        assert!(delays.iter().all(|d| *d <= MAX_DELAY), "{delays:?}");
        assert!(delays.iter().any(|d| *d > MAX_DELAY / 4), "it does grow");
    }
}
