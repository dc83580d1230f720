//! A command's deadline, kept across deferral.
//!
//! A sender that waits for the answer a limited time (the deploy interface)
//! sets the AMQP `expiration` of its command: the broker drops the command
//! if it waits in the queue longer. Once delivered, the worker counts the
//! same time from the first delivery. A deferred prepare goes back to the
//! queue as a new message, whose `expiration` would start again: the copy
//! carries the absolute deadline in [`HEADER`] instead (and no
//! `expiration`, so that it is answered `expired` rather than dropped by
//! the broker unanswered).

use lapin::BasicProperties;
use lapin::types::{AMQPValue, ShortString};

/// The header carrying a deferred command's deadline, in milliseconds
/// since the Unix epoch.
pub(super) const HEADER: &str = "x-iiw-deadline";

/// The deadline of a delivery received at `received_ms`: the one a
/// deferral carried, else `expiration` counted from now; `None` when the
/// sender set neither (nobody gives up on it).
pub(super) fn of(props: &BasicProperties, received_ms: u64) -> Option<u64> {
    let carried = super::stamp::header_ms(props, HEADER);
    carried.or_else(|| {
        let ttl: u64 = props.expiration().as_ref()?.as_str().trim().parse().ok()?;
        Some(received_ms.saturating_add(ttl))
    })
}

/// The properties of a deferred copy: the original ones with `deadline`
/// in [`HEADER`] and without `expiration`.
pub(super) fn carried(props: &BasicProperties, deadline: Option<u64>) -> BasicProperties {
    let mut out = BasicProperties::default();
    macro_rules! keep {
        ($($get:ident => $with:ident),* $(,)?) => {
            $(if let Some(v) = props.$get().clone() {
                out = out.$with(v);
            })*
        };
    }
    keep!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        delivery_mode => with_delivery_mode,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        user_id => with_user_id,
        app_id => with_app_id,
        cluster_id => with_cluster_id,
    );
    let mut headers = props.headers().clone().unwrap_or_default();
    if let Some(at) = deadline {
        let at = i64::try_from(at).unwrap_or(i64::MAX);
        headers.insert(ShortString::from(HEADER), AMQPValue::LongLongInt(at));
    }
    if deadline.is_some() || props.headers().is_some() {
        out = out.with_headers(headers);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldTable;

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    #[test]
    fn expiration_counts_from_the_first_delivery() {
        let p = BasicProperties::default().with_expiration("6000".into());
        assert_eq!(of(&p, 1_000), Some(7_000));
        assert_eq!(of(&BasicProperties::default(), 1_000), None);
        let junk = BasicProperties::default().with_expiration("soon".into());
        assert_eq!(of(&junk, 1_000), None);
    }

    /// A deferred copy keeps the first deadline: its own `expiration` is
    /// gone and the header wins over whatever time it is received at.
    #[test]
    fn a_deferred_copy_keeps_its_deadline() {
        let p = BasicProperties::default()
            .with_expiration("6000".into())
            .with_correlation_id("c1".into())
            .with_reply_to("r1".into())
            .with_headers(table(&[("other", AMQPValue::Boolean(true))]));
        let first = of(&p, 1_000);
        let copy = carried(&p, first);
        assert!(copy.expiration().is_none());
        assert_eq!(copy.correlation_id().as_ref().unwrap().as_str(), "c1");
        assert_eq!(copy.reply_to().as_ref().unwrap().as_str(), "r1");
        assert!(
            copy.headers()
                .as_ref()
                .unwrap()
                .inner()
                .contains_key("other")
        );
        assert_eq!(of(&copy, 50_000), Some(7_000));
        let again = carried(&copy, of(&copy, 90_000));
        assert_eq!(of(&again, 90_000), Some(7_000));
    }
}
