//! The slow lane's side of the broker: a prepare whose download is slow,
//! or a download job that waits (for a download slot, for a master another
//! job makes), is recorded whole in the ledger (`parked`), then
//! acknowledged early so its delivery slot serves other work and the
//! broker does not take it back; after a crash, the parked deliveries of
//! this host are read back to be run again.
//!
//! Knows nothing of routing, adoption or the consumer timeout.

use super::super::parked::Parked;
use super::Delivered;
use super::pending::Pending;
use super::read::Reader;
use super::settle::settle;
use crate::dispatch::{Dispatch, Shelf};
use crate::messages::Request;
use crate::messages::inbound::Inbound;
use lapin::Acker;
use std::sync::Arc;

/// The most jobs acknowledged before their answer at once: past it, a
/// download job that waits keeps its delivery (and is deferred, as before
/// there was a ledger to keep it in), so one process never takes in a
/// whole backlog that other processes of the host could share.
const SET_ASIDE_AT_MOST: usize = 1024;

/// What becomes of the delivery of a job that waits ([`waiting`]).
#[derive(Debug, PartialEq)]
enum Waiting {
    /// It holds no delivery (acknowledged early already): nothing to do.
    NothingHeld,
    /// Too many are set aside already: it keeps its delivery.
    Keep,
    /// Recorded, then acknowledged early.
    SetAside,
}

/// What becomes of the delivery of a job that waits, whether it `holds`
/// one, while `set_aside` jobs are acknowledged and not answered.
fn waiting(holds: bool, set_aside: usize) -> Waiting {
    if !holds {
        Waiting::NothingHeld
    } else if set_aside >= SET_ASIDE_AT_MOST {
        Waiting::Keep
    } else {
        Waiting::SetAside
    }
}

/// A parked delivery read back ([`read_back`]).
enum ReadBack {
    /// Not a record: it is dropped, logged.
    Unreadable,
    /// Not work (a notification, or no longer valid): it is dropped.
    NotWork,
    /// Work, to be run again.
    Work(Box<Resumed>),
}

/// A parked delivery to run again: its record, body, request (with the
/// issue time recorded) and the log's name for what it was.
pub(super) struct Resumed {
    /// Its key in the ledger (`identity::key`).
    pub(super) key: String,
    /// Its record (the body's hex aside).
    pub(super) parked: Parked,
    /// Its bytes.
    pub(super) body: Vec<u8>,
    /// What it asks.
    pub(super) request: Box<Request>,
    /// A command or a notification (see `read`).
    pub(super) source: &'static str,
}

/// The parked delivery `key`'s record `bytes`, read back as `reader`
/// reads deliveries.
fn read_back(reader: &Reader, key: String, bytes: &[u8]) -> ReadBack {
    let Some((parked, body)) = Parked::from_bytes(bytes) else {
        return ReadBack::Unreadable;
    };
    let (inbound, source) = reader.read(&body, &parked.exchange);
    let Inbound::Work(mut request) = inbound else {
        return ReadBack::NotWork;
    };
    request.issued_ms.get_or_insert(parked.issued_ms);
    ReadBack::Work(Box::new(Resumed {
        key,
        parked,
        body,
        request,
        source,
    }))
}

/// Parks deliveries in the ledger and acknowledges them early, and reads
/// them back after a crash. Holds the jobs awaiting acknowledgement (to
/// count those set aside) and the shared dispatch (the ledger).
pub(super) struct SlowLane {
    pending: Arc<Pending<Acker>>,
    work: Arc<Dispatch>,
}

impl SlowLane {
    /// Set aside jobs counted among `pending`, parked in `work`'s ledger.
    pub(super) fn new(pending: Arc<Pending<Acker>>, work: Arc<Dispatch>) -> SlowLane {
        SlowLane { pending, work }
    }

    /// `job`'s download is slow: its delivery is recorded, then
    /// acknowledged early (kept unacknowledged when it could not be
    /// recorded, or when it holds no copy).
    pub(super) async fn slowed(&self, job: &Delivered) {
        if self.set_aside(job).await {
            tracing::info!("slow download moved to the slow lane: recorded, acknowledged early");
        }
    }

    /// `job` waits (for a download slot, for a master another job makes):
    /// its delivery is recorded, then acknowledged early, so that waiting
    /// jobs never fill the prefetch. True when it holds no delivery now;
    /// false when it could not be recorded or [`SET_ASIDE_AT_MOST`] jobs
    /// are set aside already.
    pub(super) async fn hold(&self, job: &Delivered) -> bool {
        let holds = job.tracked.session().is_some();
        match waiting(holds, self.pending.accepted_unanswered()) {
            Waiting::NothingHeld => true,
            Waiting::Keep => false,
            Waiting::SetAside => {
                let set_aside = self.set_aside(job).await;
                if set_aside {
                    tracing::info!(
                        "waiting: recorded, acknowledged early (its delivery slot serves others)"
                    );
                }
                set_aside
            }
        }
    }

    /// Records `job`'s delivery, then acknowledges it early; true when
    /// done (false: it could not be recorded, or it holds no copy).
    async fn set_aside(&self, job: &Delivered) -> bool {
        if job.tracked.session().is_none() || !self.park(job).await {
            return false;
        }
        match job.tracked.ack_early(None) {
            Some((_, acker)) => {
                let _ = settle(acker, false).await;
                true
            }
            None => false,
        }
    }

    /// Records the whole delivery of `job` before it is acknowledged early;
    /// false when it could not be (it is then kept unacknowledged).
    async fn park(&self, job: &Delivered) -> bool {
        let parked = Parked {
            exchange: job.exchange.clone(),
            routing_key: job.routing_key.clone(),
            body: hex::encode(&job.body),
            reply_to: job.reply_to.clone(),
            correlation_id: job.correlation_id.clone(),
            deadline: job.deadline,
            issued_ms: job.issued_ms,
            received_ms: job.received_ms,
        };
        match (self.work)
            .park(&Shelf::broker(), &job.identity, parked.to_bytes())
            .await
        {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "could not record a slow prepare: kept unacknowledged");
                false
            }
        }
    }

    /// The deliveries that processes of this host (gone now) acknowledged
    /// before answering them (see `parked`), read by `reader`, to be run
    /// again; the records that are not work are dropped.
    pub(super) async fn resumable(&self, reader: &Reader) -> Vec<Resumed> {
        let mut resumable = Vec::new();
        for (key, bytes) in self.work.adopt_parked(&Shelf::broker()).await {
            match read_back(reader, key.clone(), &bytes) {
                ReadBack::Work(resumed) => resumable.push(*resumed),
                ReadBack::Unreadable => {
                    tracing::warn!(key, "an unreadable parked delivery: dropped");
                    self.work.unpark(&Shelf::broker(), &key).await;
                }
                ReadBack::NotWork => self.work.unpark(&Shelf::broker(), &key).await,
            }
        }
        resumable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AmqpSection;

    #[test]
    fn a_waiting_job_is_set_aside_until_too_many_are() {
        assert_eq!(waiting(true, 0), Waiting::SetAside);
        assert_eq!(waiting(true, SET_ASIDE_AT_MOST - 1), Waiting::SetAside);
        assert_eq!(waiting(true, SET_ASIDE_AT_MOST), Waiting::Keep);
        assert_eq!(waiting(false, SET_ASIDE_AT_MOST), Waiting::NothingHeld);
    }

    fn reader() -> Reader {
        super::super::read::reader(AmqpSection::default().max_message_bytes)
    }

    fn record(exchange: &str, body: &[u8]) -> Vec<u8> {
        Parked {
            exchange: exchange.into(),
            routing_key: "h.node.prepare".into(),
            body: hex::encode(body),
            reply_to: Some("r".into()),
            correlation_id: None,
            deadline: Some(5),
            issued_ms: 7,
            received_ms: 9,
        }
        .to_bytes()
    }

    const PREPARE: &str = r#"{"action": "prepare", "node_uuid": "1be26c0b-03f2-4d2e-ae87-c02d7f33c123",
        "instance_info": {"image_source": "http://x/y"}}"#;

    #[test]
    fn a_parked_command_is_run_again_with_its_recorded_issue_time() {
        let bytes = record("ironic-image-worker", PREPARE.as_bytes());
        let ReadBack::Work(resumed) = read_back(&reader(), "k".into(), &bytes) else {
            panic!("a parked prepare is work");
        };
        assert_eq!(resumed.key, "k");
        assert_eq!(resumed.source, "command");
        assert_eq!(resumed.request.issued_ms, Some(7));
        assert_eq!(resumed.body, PREPARE.as_bytes());
        assert_eq!(resumed.parked.reply_to.as_deref(), Some("r"));
    }

    #[test]
    fn a_parked_record_that_is_not_work_is_dropped() {
        let r = reader();
        assert!(matches!(
            read_back(&r, "k".into(), b"junk"),
            ReadBack::Unreadable
        ));
        // The same body by Ironic's exchange is a notification, not work.
        let notification = record(
            &AmqpSection::default().notification_exchange,
            PREPARE.as_bytes(),
        );
        assert!(matches!(
            read_back(&r, "k".into(), &notification),
            ReadBack::NotWork
        ));
    }
}
