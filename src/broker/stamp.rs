//! When a command was issued, as its AMQP message says it: the header
//! `timestamp_in_ms` (ms since the epoch, as RabbitMQ's message-timestamp
//! interceptor and this worker's senders set it), else the `timestamp`
//! property (seconds), else when this worker first received it. The
//! pipeline orders a node's commands by that time (`pipeline/order.rs`), so
//! a deferred prepare's copy carries its first receipt time along.

use lapin::BasicProperties;
use lapin::types::AMQPValue;

/// The header carrying a command's issue time, in ms since the epoch.
pub const HEADER: &str = "timestamp_in_ms";

/// A header of `properties` holding milliseconds since the epoch (an AMQP
/// integer of any width, or a timestamp), if it is there.
pub(super) fn header_ms(properties: &BasicProperties, name: &str) -> Option<u64> {
    properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(name))
        .and_then(|v| match v {
            AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
            AMQPValue::Timestamp(v) => Some(*v),
            AMQPValue::LongUInt(v) => Some(u64::from(*v)),
            AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
            _ => None,
        })
}

/// The issue time `properties` carry, if any.
fn stamped_ms(properties: &BasicProperties) -> Option<u64> {
    header_ms(properties, HEADER).or_else(|| properties.timestamp().map(|s| s.saturating_mul(1000)))
}

/// When the command of `properties`, received at `received_ms`, was issued.
pub fn issued_ms(properties: &BasicProperties, received_ms: u64) -> u64 {
    stamped_ms(properties).unwrap_or(received_ms)
}

/// `properties` carrying an issue time: theirs, or `received_ms` (for the
/// copy of a deferred prepare, so that it keeps its place in the node's
/// order).
pub fn with_issue_time(properties: BasicProperties, received_ms: u64) -> BasicProperties {
    if stamped_ms(&properties).is_some() {
        return properties;
    }
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(HEADER.into(), AMQPValue::LongLongInt(received_ms as i64));
    properties.with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_then_property_then_receipt() {
        let bare = BasicProperties::default();
        assert_eq!(issued_ms(&bare, 7), 7);
        let seconds = BasicProperties::default().with_timestamp(5);
        assert_eq!(issued_ms(&seconds, 7_000), 5_000);
        let stamped = with_issue_time(seconds.clone(), 9);
        assert_eq!(
            issued_ms(&stamped, 7_000),
            5_000,
            "an existing time is kept"
        );
        let copy = with_issue_time(bare, 1234);
        assert_eq!(issued_ms(&copy, 99_999), 1234);
    }
}
