//! The broker side of the worker: everything that speaks AMQP.
//!
//! * [`topology`]: the exchanges, queues and bindings the worker declares;
//! * `publisher`: completion events out, with publisher confirms;
//! * `connect`: the broker list, heartbeat and TLS;
//! * `session`: one connection's lifetime and the reconnect loop around it
//!   (next broker at once, then capped backoff);
//! * `dispatch`: deliveries in, routed to per-node work, answered, then
//!   acknowledged (or dead-lettered when unusable); work outlives a
//!   connection and a redelivered copy is adopted, not run twice.
//!
//! One connection with two channels (consume/ack, and publish with
//! confirms). A delivery is acknowledged only after its completion event is
//! confirmed by the broker (except work running longer than the broker's
//! consumer timeout allows). Deliveries for one node run in order, different
//! nodes concurrently, bounded by the prefetch.
//!
//! This layer turns messages into pipeline requests and completions into
//! messages; it must not know how images are fetched, converted or stored
//! (that is the pipeline's business), nor anything of HTTP serving.

mod ack;
mod connect;
mod dispatch;
mod publisher;
mod session;
pub mod topology;

pub use connect::Brokers;
pub use session::run;
pub use topology::Topology;

/// An error with its causes, `outer: inner: innermost`, so that a broker
/// failure's reason (refused, TLS, timeout) is never lost in logs.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}
