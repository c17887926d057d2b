//! The shrinker: a thread that gives back the commit log's segments a burst added once the
//! store has been quiet for a while (`EngineBuilder::commit_log_shrink_after`), so that a
//! store's log returns to the size of a new one (its first segments) instead of
//! keeping its largest size for good.
//!
//! It runs only while the ring has grown (more slots, one being made ahead of need, or one
//! enlarged for a large record): the store starts it when a write grew the ring or an open
//! found it grown (`Storage::watch_log_growth`), and it ends once the ring is back to its
//! first segments; the log decides both under its lock, so a growth just after a shrinker
//! decided to end asks for a new one. The period is wall-clock time, whatever the engine's
//! clock.
//! A partitioned process with many idle stores runs none. It holds the database (for a flush)
//! and the log, not the store: the store stops and joins it before its database closes, so
//! dropping the last handle still closes the store at once.
//!
//! Quiet means no record appended for one whole period: the thread wakes once per period and
//! compares the log's next LSN with the one it saw before. Then it flushes every table (their
//! files take every record, which frees every segment) and asks the log to shrink, under the
//! log's lock and only if still nothing was appended ([`LogWriter::shrink_if_quiet`]). A write
//! meanwhile puts it off to the next quiet period.

use std::sync::Arc;
use std::time::Duration;

use crate::format::error::{Error, Result};
use crate::storage::log::logged_writes::LogWriter;

/// Flushes every table of the store at once.
pub(crate) type FlushTables = Box<dyn Fn() -> Result<()> + Send>;

/// The running shrinker; dropping it stops the thread and waits for it.
pub(crate) struct Shrinker {
    stop: Arc<Stop>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Tells the thread to end, and wakes it.
#[derive(Default)]
struct Stop {
    stopped: parking_lot::Mutex<bool>,
    wake: parking_lot::Condvar,
}

impl Stop {
    /// Waits `period` (less if stopped meanwhile): whether the shrinker was stopped.
    fn wait(&self, period: Duration) -> bool {
        let mut stopped = self.stopped.lock();
        if !*stopped {
            let _ = self.wake.wait_for(&mut stopped, period);
        }
        *stopped
    }
}

impl Shrinker {
    /// Starts the thread over `log`, flushing with `flush`, quiet after `period`.
    ///
    /// # Errors
    /// [`Error::Storage`] if the thread cannot start.
    pub(crate) fn start(
        log: Arc<LogWriter>,
        flush: FlushTables,
        period: Duration,
    ) -> Result<Shrinker> {
        let stop = Arc::new(Stop::default());
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("idemdb-log-shrink".into())
            .spawn(move || run(&log, &flush, period, &stopped))
            .map_err(|error| Error::Storage {
                kind: crate::format::error::StorageErrorKind::Io,
                detail: format!("cannot start the commit log's shrinker: {error}"),
            })?;
        Ok(Shrinker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Shrinker {
    fn drop(&mut self) {
        *self.stop.stopped.lock() = true;
        self.stop.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            drop(thread.join());
        }
    }
}

/// The thread: one look per period, until the ring is back to its first segments.
fn run(log: &LogWriter, flush: &FlushTables, period: Duration, stop: &Stop) {
    let mut seen = log.next_lsn();
    loop {
        if stop.wait(period) {
            return;
        }
        let now = log.next_lsn();
        if now != seen {
            seen = now;
            continue;
        }
        // Quiet for a whole period: the tables' files take every record written so far, and
        // every segment is free.
        let written = log.written_lsn();
        if let Err(error) = flush() {
            tracing::warn!(target: "idemdb", %error, "the commit log keeps its segments: the flush failed");
            log.shrinker_ended();
            return;
        }
        log.flushed(written);
        match log.shrink_if_quiet(seen) {
            Ok(true) => {
                tracing::debug!(target: "idemdb", "commit log shrunk");
                return;
            }
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(target: "idemdb", %error, "the commit log keeps its segments");
                log.shrinker_ended();
                return;
            }
        }
    }
}
