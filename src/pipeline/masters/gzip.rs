//! Compressing masters in the background (`[http] gzip = static`): a
//! prepare (or warm) whose master is ready asks for it and goes on; one
//! thread of this process, at a low priority (nice 10), compresses the
//! masters asked for one at a time (`store/compress.rs`: once per master
//! across processes), then applies the cache policy, since the compressed
//! file counts in the cache's size. At most [`QUEUED`] masters wait; one
//! asked for beyond that is asked for again by its next prepare.

use super::keeper::Keeper;
use crate::store::compress::Outcome;
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Masters waiting for the compressing thread, at most.
const QUEUED: usize = 64;
/// The compressing thread's nice value (prepares come first).
const NICENESS: i32 = 10;

/// The masters waiting to be compressed, and the thread's wake-up.
#[derive(Default)]
struct Compressions {
    queue: Mutex<(VecDeque<String>, HashSet<String>)>,
    wake: Condvar,
}

/// The background compression of masters: what `[http] gzip` and
/// `gzip_min_ratio` say, the cache housekeeping it runs after each
/// compression, and the queue once `serve` turned it on.
pub(super) struct Compressor {
    /// `[http] gzip = static`: masters get a compressed form.
    on: bool,
    /// `[http] gzip_min_ratio`.
    min_ratio: f64,
    keeper: Keeper,
    /// The masters waiting, once the thread runs.
    queue: OnceLock<Arc<Compressions>>,
}

impl Compressor {
    /// The compression `http` configures, cleaning the cache with `keeper`.
    pub(super) fn new(http: &crate::config::HttpSection, keeper: Keeper) -> Compressor {
        Compressor {
            on: http.gzip == crate::config::GzipMode::Static,
            min_ratio: http.gzip_min_ratio,
            keeper,
            queue: OnceLock::new(),
        }
    }

    /// Starts the compressing thread when compression is on (`serve` does
    /// this; one-shot commands never compress: they would stop halfway).
    pub(super) fn start(&self) {
        if !self.on {
            return;
        }
        let compressions = Arc::new(Compressions::default());
        if self.queue.set(compressions.clone()).is_err() {
            return;
        }
        let (keeper, ratio) = (self.keeper.clone(), self.min_ratio);
        let spawned = std::thread::Builder::new()
            .name("gzip".into())
            .spawn(move || compress_forever(&compressions, &keeper, ratio));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the compressing thread: masters are served identity");
        }
    }

    /// Where the image server finds the compressed forms of masters, when
    /// compression is on.
    pub(super) fn dir(&self) -> Option<std::path::PathBuf> {
        self.on.then(|| self.keeper.cache.gzip_dir())
    }

    /// Asks for master `name` to be compressed (nothing when the thread
    /// does not run, the master already waits, or too many do).
    pub(super) fn later(&self, name: &str) {
        let Some(c) = self.queue.get() else {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Files};
    use crate::store::cache::Cache;

    fn compressor(dir: &std::path::Path, gzip: &str) -> Compressor {
        let flags = [
            format!("http.gzip={gzip}"),
            format!("pxe.instance_master_path={}", dir.display()),
        ];
        let config = Config::load_from(&Files::default(), &[], &flags).unwrap();
        let cache = Cache::open(&config.pxe.instance_master_path).unwrap();
        let metrics = Arc::new(crate::metrics::Metrics::new());
        Compressor::new(
            &config.http,
            Keeper::new(cache, &config.pxe, &config.convert, metrics),
        )
    }

    #[test]
    fn off_it_names_no_directory_and_queues_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let c = compressor(dir.path(), "off");
        assert_eq!(c.dir(), None);
        c.start();
        c.later("m");
        assert!(c.queue.get().is_none(), "no thread, no queue");
    }

    /// A master asked for twice waits once; past [`QUEUED`] masters, one
    /// more is not queued (its next prepare asks again).
    #[test]
    fn the_queue_is_bounded_and_holds_a_master_once() {
        let dir = tempfile::tempdir().unwrap();
        let c = compressor(dir.path(), "static");
        assert!(c.dir().is_some());
        // The queue without its thread, so that nothing is taken off it.
        c.queue.set(Arc::default()).ok().unwrap();
        c.later("m");
        c.later("m");
        for i in 0..QUEUED + 5 {
            c.later(&format!("m{i}"));
        }
        let queue = c.queue.get().unwrap().queue.lock().unwrap();
        assert_eq!(queue.0.len(), QUEUED);
        assert_eq!(queue.0.iter().filter(|n| *n == "m").count(), 1);
    }
}
