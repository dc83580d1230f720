//! A download job's turn among the worker's download slots: asked for by
//! the pipeline right before it downloads (through the request's
//! `DownloadTurn`), so that only downloads wait for a slot, and watched
//! by the job's runner (`work`), which sets aside the delivery of a job
//! that waits and gives back, when the worker stops, one that never got
//! its turn.

use crate::error::{Error, ErrorCode, Result};
use crate::messages::Turns;
use futures_util::future::BoxFuture;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// Where a download job stands with its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stand {
    /// Not asked for (yet): resolving, a cache hit, waiting for the lock
    /// of a master another job is making.
    NotAsked,
    /// Waiting for a download slot: nothing downloaded yet.
    Waiting,
    /// Downloading, holding a slot.
    Downloading,
    /// Downloading in the slow lane: its slot given back.
    SlowLane,
}

/// One job's turn (see the module).
pub(super) struct Turn {
    slots: Arc<Semaphore>,
    /// When the sender stops waiting (ms since the epoch), if it does.
    deadline: Option<u64>,
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    stand: watch::Sender<Stand>,
}

impl Turn {
    /// A turn among `slots` for a job whose sender waits until `deadline`.
    pub(super) fn new(slots: Arc<Semaphore>, deadline: Option<u64>) -> Arc<Turn> {
        Arc::new(Turn {
            slots,
            deadline,
            permit: Mutex::new(None),
            stand: watch::Sender::new(Stand::NotAsked),
        })
    }

    /// Where the job stands, and each change of it.
    pub(super) fn watch(&self) -> watch::Receiver<Stand> {
        self.stand.subscribe()
    }

    /// The download is slow and moves to the slow lane: its slot goes back.
    pub(super) fn to_slow_lane(&self) {
        self.permit.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.stand.send_replace(Stand::SlowLane);
    }

    /// A slot, waited for until the deadline; `None` when it passed first.
    async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        let acquire = self.slots.clone().acquire_owned();
        match self.deadline {
            None => acquire.await.ok(),
            Some(at) => {
                let wait = Duration::from_millis(at.saturating_sub(crate::clock::now_ms()));
                tokio::time::timeout(wait, acquire).await.ok()?.ok()
            }
        }
    }
}

impl Turns for Turn {
    fn take(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            if *self.stand.borrow() != Stand::NotAsked {
                return Ok(());
            }
            let permit = match self.slots.clone().try_acquire_owned() {
                Ok(permit) => permit,
                Err(_) => {
                    self.stand.send_replace(Stand::Waiting);
                    self.slot().await.ok_or_else(|| {
                        Error::new(
                            ErrorCode::Expired,
                            "the command's deadline (its expiration, counted from its first \
                             delivery) passed while its download waited for a download slot",
                        )
                    })?
                }
            };
            *self.permit.lock().unwrap_or_else(|p| p.into_inner()) = Some(permit);
            self.stand.send_replace(Stand::Downloading);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A turn is taken at once while a slot is free; otherwise the job
    /// stands `Waiting` until a slot frees (the slow lane gives one back),
    /// or is refused `expired` once its deadline passes.
    #[tokio::test]
    async fn a_turn_waits_for_a_slot_until_its_deadline() {
        let slots = Arc::new(Semaphore::new(1));
        let first = Turn::new(slots.clone(), None);
        first.take().await.unwrap();
        assert_eq!(*first.watch().borrow(), Stand::Downloading);

        let soon = crate::clock::now_ms() + 50;
        let late = Turn::new(slots.clone(), Some(soon));
        let err = late.take().await.unwrap_err();
        assert_eq!(err.code, ErrorCode::Expired);
        assert_eq!(*late.watch().borrow(), Stand::Waiting);

        let second = Turn::new(slots, None);
        let mut stand = second.watch();
        let waiting = tokio::spawn({
            let second = second.clone();
            async move { second.take().await }
        });
        stand.wait_for(|s| *s == Stand::Waiting).await.unwrap();
        first.to_slow_lane();
        waiting.await.unwrap().unwrap();
        assert_eq!(*second.watch().borrow(), Stand::Downloading);
    }
}
