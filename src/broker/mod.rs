//! The broker side of the worker: everything that speaks AMQP.
//!
//! * [`topology`]: the exchanges, queues and bindings the worker declares;
//! * `publisher`: completion events out, with publisher confirms;
//! * `connect`: the broker list, heartbeat and TLS;
//! * `ack`: one job's acknowledgement state (which copy settles it);
//! * `deadline`: a command's deadline, kept when a prepare is deferred;
//! * `session`: one connection's lifetime and the reconnect loop around it
//!   (next broker at once, then capped backoff);
//! * `dispatch`: deliveries in, routed to per-node work, answered, then
//!   acknowledged (or dead-lettered when unusable); work outlives a
//!   connection and a redelivered copy is adopted, not run twice. A folder:
//!   routing (`mod.rs`), and around it one part a file, each a type that
//!   holds what its methods use: how a delivery reads (`read`), the live
//!   connection (`link`), the backlog of a new connection (`intake`), the
//!   jobs awaiting acknowledgement (`pending`), adoption (`adopt`), early
//!   acknowledgement (`early_ack`), the slow lane's parked deliveries
//!   (`slow_lane`), refused commands (`refuse`), deferred prepares
//!   (`defer`), the answer and the copy settled or dead-lettered
//!   (`settle`);
//! * `identity`: what identifies a delivery across redeliveries, as the
//!   stable key the node's ledger records it under;
//! * `parked`: a delivery acknowledged before its answer (slow lane), kept
//!   whole in the node ledger so that it is run again after a crash;
//! * `stamp`: when a command was issued, from its AMQP message;
//! * `sealed`: the seal (`crate::seal`) on commands and answers: a
//!   delivered command checked and aimed at this worker, an answer sealed,
//!   a deferred copy sealed again;
//! * `peers`: queries and offers between the workers of several
//!   conductors, and the cloud-wide claim on a master's download.
//!
//! One connection with two channels (consume/ack, and publish with
//! confirms). A delivery is acknowledged only after its completion event is
//! confirmed by the broker (except a delivery kept longer than the broker's
//! consumer timeout allows, queued or running: it is acknowledged early). Deliveries for one node run in order, different
//! nodes concurrently, bounded by the prefetch.
//!
//! This layer turns messages into pipeline requests and completions into
//! messages; it must not know how images are fetched, converted or stored
//! (that is the pipeline's business), nor anything of HTTP serving.

mod ack;
mod connect;
mod deadline;
mod dispatch;
mod identity;
mod parked;
pub mod peers;
mod publisher;
mod sealed;
mod session;
mod stamp;
pub mod topology;

pub use connect::Brokers;
pub(crate) use sealed::{admit_answer, seal_command};
pub use session::run;
pub use topology::{Topology, WARM_ALL_KEY};

use crate::config::{AmqpSection, Config, NotificationsSection, PeersSection};
use crate::seal::Sealer;
use std::sync::Arc;

/// What the broker layer is configured with: its own sections, handed to it
/// by the service (or the CLI's `send`), never read through the pipeline.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `[DEFAULT]host`: the queue and the routing keys are named after it,
    /// and only notifications for this conductor are acted on.
    pub host: String,
    /// `[amqp]`: the brokers, the topology names and the limits.
    pub amqp: AmqpSection,
    /// `[notifications]`: which nodes Ironic's notifications may act on.
    pub notifications: NotificationsSection,
    /// `[peers]`: the peers' exchange, query timeout and advertised URL.
    pub peers: PeersSection,
    /// `[source]slow_downloads`: the width of the slow lane that slow
    /// prepares move to, freeing their download slot.
    pub slow_downloads: usize,
    /// `[amqp]seal` with its keys read: what commands must carry and what
    /// seals every answer; `None` when off.
    pub seal: Option<Arc<Sealer>>,
}

impl Settings {
    /// The broker layer's sections of `config`, the seal's key file read
    /// (an unreadable or unsafe one fails here, before anything starts).
    pub fn of(config: &Config) -> crate::error::Result<Settings> {
        Ok(Settings {
            host: config.default.host.clone(),
            amqp: config.amqp.clone(),
            notifications: config.notifications.clone(),
            peers: config.peers.clone(),
            slow_downloads: config.source.slow_downloads as usize,
            seal: config.amqp.sealer()?.map(Arc::new),
        })
    }
}

/// The AMQP reply code of a broker's refusal (404 NOT_FOUND, 406
/// PRECONDITION_FAILED, ...), read from the error itself rather than its
/// text.
fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(err) => Some(err.get_id()),
        _ => None,
    }
}

/// The consumer timeout the broker enforces, from the channel close it
/// sends when a delivery stayed unacknowledged longer (RabbitMQ: 406,
/// "... timed out. Timeout value used: 10000 ms ..."), the only place the
/// broker tells its value.
fn consumer_timeout_of(e: &lapin::Error) -> Option<std::time::Duration> {
    const VALUE: &str = "Timeout value used: ";
    let lapin::ErrorKind::ProtocolError(err) = e.kind() else {
        return None;
    };
    if err.get_id() != 406 {
        return None;
    }
    let text = err.get_message().as_str();
    let rest = &text[text.find(VALUE)? + VALUE.len()..];
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let ms: u64 = rest[..digits].parse().ok()?;
    let unit = rest[digits..].trim_start();
    (unit.starts_with("ms") && ms > 0).then(|| std::time::Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    fn refusal(kind: AMQPSoftError, text: &str) -> lapin::Error {
        let err = AMQPError::new(AMQPErrorKind::Soft(kind), text.into());
        lapin::ErrorKind::ProtocolError(err).into()
    }

    #[test]
    fn the_broker_tells_its_consumer_timeout() {
        let closed = refusal(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. \
             Timeout value used: 10000 ms. This timeout value can be configured, \
             see consumers doc guide to learn more",
        );
        assert_eq!(
            consumer_timeout_of(&closed),
            Some(std::time::Duration::from_secs(10))
        );
        assert_eq!(reply_code(&closed), Some(406));
        let other = refusal(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - inequivalent arg",
        );
        assert_eq!(consumer_timeout_of(&other), None);
        let gone = refusal(
            AMQPSoftError::NOTFOUND,
            "NOT_FOUND - no queue 'q' in vhost '/'",
        );
        assert_eq!(reply_code(&gone), Some(404));
        assert_eq!(consumer_timeout_of(&gone), None);
    }
}
