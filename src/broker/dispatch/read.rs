//! How a delivery reads under this host's settings: a notification when it
//! came by Ironic's exchange, else a command; whether its seal lets it be
//! worked (`[amqp]seal`), and a copy put back sealed again.
//!
//! Knows nothing of jobs, acknowledgements, the ledger or answers.

use super::super::Settings;
use super::super::sealed::Gate;
use crate::messages::inbound::{self, Inbound};
use crate::seal::{Refusal, Sealed};
use lapin::BasicProperties;
use lapin::message::Delivery;

/// What reading a delivery needs, and nothing else: the host's name, Ironic's
/// exchange, the nodes notifications act on, the body limit and the seal.
pub(super) struct Reader {
    host: String,
    /// Ironic's notification exchange (deliveries from it are notifications).
    notification_exchange: String,
    /// `[notifications]deploy_interfaces`: the nodes notifications act on.
    deploy_interfaces: Vec<String>,
    /// `[amqp]max_message_bytes`: the longest body read.
    max_message_bytes: usize,
    /// The seal commands must carry (`[amqp]seal`); `None`: off.
    gate: Option<Gate>,
}

impl Reader {
    /// The reader of the deliveries of this host's queue `queue`.
    pub(super) fn new(settings: &Settings, queue: &str) -> Reader {
        let amqp = &settings.amqp;
        Reader {
            host: settings.host.clone(),
            notification_exchange: amqp.notification_exchange.clone(),
            deploy_interfaces: settings.notifications.deploy_interfaces.clone(),
            max_message_bytes: amqp.max_message_bytes,
            gate: settings
                .seal
                .clone()
                .map(|s| Gate::new(s, &settings.host, queue)),
        }
    }

    /// Whether `delivery` may be worked under the seal policy: notifications
    /// (from Ironic's exchange: nobody seals them) and every message when
    /// the seal is off pass as unsealed.
    pub(super) fn admit(&self, delivery: &Delivery) -> Result<Option<Sealed>, Refusal> {
        match &self.gate {
            Some(gate) if delivery.exchange.as_str() != self.notification_exchange => {
                gate.admit(delivery)
            }
            _ => Ok(None),
        }
    }

    /// A body published to `exchange`, parsed as a notification when the
    /// exchange is Ironic's, else as a command; with the log's name for
    /// which it was. The same for a delivery and for one parked earlier.
    /// With sealed commands, a notification warms at most.
    pub(super) fn read(&self, body: &[u8], exchange: &str) -> (Inbound, &'static str) {
        let from_ironic = exchange == self.notification_exchange;
        let mut inbound = inbound::parse(
            body,
            from_ironic,
            &self.host,
            &self.deploy_interfaces,
            self.max_message_bytes,
        );
        if self.gate.is_some() {
            inbound = inbound::unsealed_notification(inbound);
        }
        let source = if from_ironic {
            "notification"
        } else {
            "command"
        };
        (inbound, source)
    }

    /// The properties of a copy of `body` put back on the queue: sealed
    /// again (with the key and until the time of `seal`, the original's)
    /// when commands must be sealed.
    pub(super) fn reseal(
        &self,
        copy: BasicProperties,
        body: &[u8],
        seal: (usize, Option<u64>),
    ) -> BasicProperties {
        match &self.gate {
            Some(gate) => gate.reseal(copy, body, seal),
            None => copy,
        }
    }
}

/// A reader of host `h`'s queue `q` with no seal, reading bodies up to
/// `max_message_bytes` (the other files' tests read deliveries with it).
#[cfg(test)]
pub(super) fn reader(max_message_bytes: usize) -> Reader {
    use crate::config::{AmqpSection, NotificationsSection, PeersSection};
    let settings = Settings {
        host: "h".into(),
        amqp: AmqpSection {
            max_message_bytes,
            ..AmqpSection::default()
        },
        notifications: NotificationsSection::default(),
        peers: PeersSection::default(),
        slow_downloads: 1,
        seal: None,
    };
    Reader::new(&settings, "q")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::Action;

    const PREPARE: &str = r#"{"action": "prepare", "node_uuid": "1be26c0b-03f2-4d2e-ae87-c02d7f33c123",
        "instance_info": {"image_source": "http://x/y"}}"#;

    #[test]
    fn a_body_is_a_command_unless_it_came_by_ironics_exchange() {
        let r = reader(1 << 20);
        let (command, source) = r.read(PREPARE.as_bytes(), "ironic-image-worker");
        assert!(matches!(command, Inbound::Work(req) if req.action == Action::Prepare));
        assert_eq!(source, "command");
        // Ironic publishes no such body: as a notification it is not work.
        let (notification, source) = r.read(PREPARE.as_bytes(), "ironic");
        assert!(
            !matches!(notification, Inbound::Work(_)),
            "{notification:?}"
        );
        assert_eq!(source, "notification");
    }

    #[test]
    fn a_body_past_the_limit_is_invalid_unread() {
        let (inbound, _) =
            reader(PREPARE.len() - 1).read(PREPARE.as_bytes(), "ironic-image-worker");
        assert!(matches!(inbound, Inbound::Invalid(_)), "{inbound:?}");
    }

    #[test]
    fn without_a_seal_a_copy_put_back_keeps_its_properties() {
        let props = BasicProperties::default().with_correlation_id("c".into());
        let copy = reader(1 << 20).reseal(props.clone(), b"body", (0, None));
        assert_eq!(copy, props);
    }
}
