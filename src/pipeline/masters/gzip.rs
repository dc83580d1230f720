//! Compressing masters in the background (`[http] gzip = static`): a
//! prepare (or warm) whose master is ready asks for it and goes on; one
//! thread of this process, at a low priority (nice 10), compresses the
//! masters asked for one at a time (`store/compress.rs`: once per master
//! across processes), then applies the cache policy, since the compressed
//! file counts in the cache's size. At most [`QUEUED`] masters wait; one
//! asked for beyond that is asked for again by its next prepare.

use super::Masters;
use super::keeper::Keeper;
use crate::store::compress::Outcome;
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};

/// Masters waiting for the compressing thread, at most.
const QUEUED: usize = 64;
/// The compressing thread's nice value (prepares come first).
const NICENESS: i32 = 10;

/// The masters waiting to be compressed, and the thread's wake-up.
#[derive(Default)]
pub(super) struct Compressions {
    queue: Mutex<(VecDeque<String>, HashSet<String>)>,
    wake: Condvar,
}

impl Masters {
    /// Turns compression on (`serve` does this with `[http] gzip =
    /// static`; one-shot commands never compress: they would stop halfway).
    pub fn start_compressing(&self) {
        if self.config.http.gzip != crate::config::GzipMode::Static {
            return;
        }
        let compressions = Arc::new(Compressions::default());
        if self.compressions.set(compressions.clone()).is_err() {
            return;
        }
        let keeper = self.keeper();
        let ratio = self.config.http.gzip_min_ratio;
        let spawned = std::thread::Builder::new()
            .name("gzip".into())
            .spawn(move || compress_forever(&compressions, &keeper, ratio));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the compressing thread: masters are served identity");
        }
    }

    /// Where the image server finds the compressed forms of masters, when
    /// compression is on (`[http] gzip = static`).
    pub fn gzip_dir(&self) -> Option<std::path::PathBuf> {
        (self.config.http.gzip == crate::config::GzipMode::Static).then(|| self.cache.gzip_dir())
    }

    /// Asks for master `name` to be compressed (nothing when compression
    /// is off, the master already waits, or too many do).
    pub(in crate::pipeline) fn compress_later(&self, name: &str) {
        let Some(c) = self.compressions.get() else {
            return;
        };
        let mut queue = c.queue.lock().unwrap_or_else(|p| p.into_inner());
        let (waiting, names) = &mut *queue;
        if waiting.len() < QUEUED && names.insert(name.to_string()) {
            waiting.push_back(name.to_string());
            c.wake.notify_one();
        }
    }
}

/// The compressing thread: each master asked for, in turn.
fn compress_forever(c: &Compressions, keeper: &Keeper, ratio: f64) {
    // SAFETY: plain system calls on the calling thread.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, NICENESS);
    }
    loop {
        let name = {
            let mut queue = c.queue.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(name) = queue.0.pop_front() {
                    break name;
                }
                queue = c.wake.wait(queue).unwrap_or_else(|p| p.into_inner());
            }
        };
        compress_one(keeper, &name, ratio);
        let mut queue = c.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.1.remove(&name);
    }
}

/// Compresses master `name`, logs and counts what came of it.
fn compress_one(keeper: &Keeper, name: &str, ratio: f64) {
    let count = |result: &str| {
        keeper
            .metrics
            .cache
            .compressions
            .with_label_values(&[result])
            .inc()
    };
    match keeper.cache.compress(name, ratio) {
        Ok(Outcome::Compressed(f)) => {
            count("compressed");
            tracing::info!(
                master = name,
                bytes = f.input,
                compressed = f.output,
                cpu_s = f.cpu.as_secs_f64(),
                wall_s = f.wall.as_secs_f64(),
                "compressed the master for serving with Content-Encoding: gzip"
            );
            if let Err(e) = keeper.clean(0, false, false) {
                tracing::warn!(error = %e, "cache clean-up failed");
            }
            keeper.refresh_cache_gauges();
        }
        Ok(Outcome::NotWorth(f)) => {
            count("declined");
            tracing::info!(
                master = name,
                bytes = f.input,
                compressed_at_least = f.output,
                cpu_s = f.cpu.as_secs_f64(),
                wall_s = f.wall.as_secs_f64(),
                "the master does not compress by [http] gzip_min_ratio: served identity"
            );
        }
        Ok(Outcome::AlreadyDone | Outcome::Busy | Outcome::Gone) => {}
        Err(e) => {
            count("failed");
            tracing::warn!(master = name, error = %e, "cannot compress the master: served identity");
        }
    }
}
