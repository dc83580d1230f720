//! The live connection as jobs see it: its id and publisher, replaced when
//! the connection is renewed and absent while there is none, so that work
//! outliving a connection answers, defers and settles through the next one.
//!
//! Knows nothing of deliveries, jobs, the ledger or answers.

use super::super::publisher::Publisher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{Notify, watch};

/// The current connection, as jobs see it: its id and its publisher.
#[derive(Clone)]
pub(in crate::broker) struct Link {
    /// The connection's id: a copy names the connection it came through.
    pub(in crate::broker) session: u64,
    /// Its way out: answers and deferred copies.
    pub(in crate::broker) publisher: Publisher,
    /// Signalled when a broker operation on this connection failed.
    pub(in crate::broker) broken: Arc<Notify>,
}

/// The connection in force, shared by the parts that publish or settle
/// through it (answers, deferred copies), for the life of the worker.
pub(super) struct Links {
    /// The live connection, `None` while disconnected.
    live: watch::Sender<Option<Link>>,
    /// The id of the next connection.
    next_session: AtomicU64,
}

impl Links {
    /// No connection yet; the first one is session 1.
    pub(super) fn new() -> Links {
        Links {
            live: watch::Sender::new(None),
            next_session: AtomicU64::new(1),
        }
    }

    /// Makes `publisher` the way out for every job; returns the new link.
    pub(super) fn connected(&self, publisher: Publisher) -> Link {
        let link = Link {
            session: self.next_session.fetch_add(1, Ordering::Relaxed),
            publisher,
            broken: Arc::new(Notify::new()),
        };
        self.live.send_replace(Some(link.clone()));
        link
    }

    /// The connection of `session` is gone (a later one is left alone).
    pub(super) fn disconnected(&self, session: u64) {
        self.live.send_if_modified(|l| {
            if l.as_ref().is_some_and(|l| l.session == session) {
                *l = None;
                true
            } else {
                false
            }
        });
    }

    /// The live connection, if there is one.
    pub(super) fn current(&self) -> Option<Link> {
        self.live.borrow().clone()
    }

    /// The connection as it changes, to wait for one.
    pub(super) fn watch(&self) -> watch::Receiver<Option<Link>> {
        self.live.subscribe()
    }

    /// Whether a copy held through connection `held` came through one now
    /// gone ([`gone`]).
    pub(super) fn gone(&self, held: Option<u64>) -> bool {
        gone(self.live.borrow().as_ref().map(|l| l.session), held)
    }
}

/// Whether a copy held through connection `held` came through another than
/// the `live` one: the broker gives that message again by itself, to
/// another consumer (possibly another process of the host), so it is not
/// put back and counts as delivered twice. A job that holds no copy
/// (`None`: acknowledged early) has nothing gone.
pub(super) fn gone(live: Option<u64>, held: Option<u64>) -> bool {
    held.is_some_and(|s| Some(s) != live)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_copy_of_another_connection_is_gone() {
        assert!(!gone(Some(2), Some(2)), "the live connection's copy");
        assert!(gone(Some(2), Some(1)));
        // Acknowledged early: nothing held (a job given back is put back
        // from its record; a deferred one waits where it is).
        assert!(!gone(Some(2), None));
    }

    #[test]
    fn a_copy_held_while_disconnected_came_through_a_connection_gone() {
        let links = Links::new();
        assert!(links.current().is_none());
        assert!(links.gone(Some(1)));
        assert!(!links.gone(None), "no copy held: nothing gone");
        // Losing a connection that is not the live one changes nothing.
        links.disconnected(1);
        assert!(links.current().is_none());
    }
}
