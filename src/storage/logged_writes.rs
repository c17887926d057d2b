//! The experimental durable path through the commit log (`EngineBuilder::commit_log`): each
//! write batch gets the next log sequence number (LSN), written into the batch itself
//! ([`LOG_LSN_KEY`]), is appended to the log, made durable there, and only then written to
//! RocksDB, whose tables run without their WAL and flush atomically (all together), so that
//! the table files always hold exactly the batches up to the LSN they record.
//!
//! Group commit: writers queue their batches; one of them at a time leads, takes the queue,
//! appends it to the log under the lock, then writes and syncs the log and writes the batches
//! to RocksDB in LSN order without the lock, while the next group queues. Every writer of a
//! group gets the group's outcome.
//!
//! Recovery (at open): the table files' LSN says where the log's replay starts; the records
//! after it are written to RocksDB in order, each exactly once (merge operands are not
//! idempotent).

use std::collections::HashMap;
use std::path::Path;

use rocksdb::{DB, WriteBatch, WriteOptions};

use crate::format::error::{Error, Result};
use crate::storage::commit_log::{CommitLog, building_path, perform_writes};

/// The meta key (`default` table) holding the LSN of the last batch written to the tables.
pub(crate) const LOG_LSN_KEY: &[u8] = b"idemdb.log-lsn";
/// The commit log's directory inside the store.
pub(crate) const LOG_DIR: &str = "idemdb-log";

/// Writes without RocksDB's WAL.
fn no_wal() -> WriteOptions {
    let mut options = WriteOptions::default();
    options.disable_wal(true);
    options
}

/// The LSN of the last batch the tables hold (memtables included), 0 for none.
pub(crate) fn tables_lsn(db: &DB) -> Result<u64> {
    let default = db
        .cf_handle(rocksdb::DEFAULT_COLUMN_FAMILY_NAME)
        .expect("the default table exists");
    Ok(match db.get_pinned_cf(default, LOG_LSN_KEY)? {
        Some(value) => {
            u64::from_be_bytes(value.as_ref().try_into().map_err(|_| Error::Corrupt {
                key: LOG_LSN_KEY.to_vec(),
                reason: crate::format::error::DecodeError::Invalid {
                    reason: "the commit log's LSN is not 8 bytes",
                },
            })?)
        }
        None => 0,
    })
}

/// Replays a log left in `store` into RocksDB's WAL (each record a synced write) and removes
/// it: an open without the commit log (the application's, or an operator tool's) keeps every
/// commit the log holds.
pub(crate) fn retire_log(store: &Path, db: &DB) -> Result<()> {
    let dir = store.join(LOG_DIR);
    let building = building_path(&dir);
    if building.exists() {
        std::fs::remove_dir_all(&building)
            .map_err(|error| Error::io("removing an unfinished commit log", &error))?;
    }
    if !dir.exists() {
        return Ok(());
    }
    let mut synced = WriteOptions::default();
    synced.set_sync(true);
    let from = tables_lsn(db)? + 1;
    let (log, _) = CommitLog::open(&dir, from, |_, payload| {
        Ok(db.write_opt(WriteBatch::from_data(payload), &synced)?)
    })?;
    drop(log);
    std::fs::remove_dir_all(&dir).map_err(|error| Error::io("removing the commit log", &error))?;
    crate::storage::store_meta::sync_directory(store)
        .map_err(|error| Error::io("syncing the store directory", &error))
}

/// The commit log and its group commit.
pub(crate) struct LogWriter {
    state: parking_lot::Mutex<State>,
    done: parking_lot::Condvar,
    /// Every write fsyncs the log ([`crate::Durability::Sync`]).
    sync_each: bool,
}

struct State {
    log: CommitLog,
    queue: Vec<(u64, WriteBatch)>,
    outcomes: HashMap<u64, Result<()>>,
    next_ticket: u64,
    leading: bool,
    /// The LSN of the last batch written to RocksDB.
    written_lsn: u64,
}

impl LogWriter {
    /// Opens the store's log (making it if there is none) and replays into `db` every record
    /// after the LSN the tables hold.
    pub(crate) fn open(
        store: &Path,
        db: &DB,
        segments: usize,
        segment_bytes: u64,
        sync_each: bool,
    ) -> Result<LogWriter> {
        let dir = store.join(LOG_DIR);
        let tables = tables_lsn(db)?;
        let (log, written_lsn) = if dir.exists() {
            let mut last = tables;
            let (log, recovered) = CommitLog::open(&dir, tables + 1, |lsn, payload| {
                db.write_opt(WriteBatch::from_data(payload), &no_wal())?;
                last = lsn;
                Ok(())
            })?;
            tracing::info!(
                target: "idemdb",
                tables_lsn = tables,
                replayed = recovered.recovered,
                end = ?recovered.end,
                "commit log replayed"
            );
            (log, last)
        } else {
            (
                CommitLog::create(&dir, segments, segment_bytes, tables + 1)?,
                tables,
            )
        };
        Ok(LogWriter {
            state: parking_lot::Mutex::new(State {
                log,
                queue: Vec::new(),
                outcomes: HashMap::new(),
                next_ticket: 0,
                leading: false,
                written_lsn,
            }),
            done: parking_lot::Condvar::new(),
            sync_each,
        })
    }

    /// Writes `batch` durably (with `Durability::Sync`) through the log, then to `db`.
    /// `io` runs the log's writes and sync (the fault seam; its argument says whether to sync);
    /// `flush` flushes every table (when the log needs room).
    pub(crate) fn write(
        &self,
        db: &DB,
        batch: WriteBatch,
        io: impl Fn(&dyn Fn(bool) -> Result<()>) -> Result<()>,
        flush: impl Fn() -> Result<()>,
    ) -> Result<()> {
        let default = db
            .cf_handle(rocksdb::DEFAULT_COLUMN_FAMILY_NAME)
            .expect("the default table exists");
        let mut state = self.state.lock();
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        state.queue.push((ticket, batch));
        loop {
            if let Some(outcome) = state.outcomes.remove(&ticket) {
                return outcome;
            }
            if state.leading {
                self.done.wait(&mut state);
                continue;
            }
            // Lead the next group.
            state.leading = true;
            let group = std::mem::take(&mut state.queue);
            let mut batches = Vec::with_capacity(group.len());
            let mut refused = Vec::new();
            for (member, mut batch) in group {
                let lsn = state.log.next_lsn();
                batch.put_cf(default, LOG_LSN_KEY, lsn.to_be_bytes());
                let appended = match state.log.append(batch.data()) {
                    Err(full) if full.is_retryable() => {
                        // The ring is full: every batch written so far goes to table files,
                        // and their segments are free again.
                        flush().and_then(|()| {
                            let written = state.written_lsn;
                            state.log.release_through(written + 1);
                            state.log.append(batch.data())
                        })
                    }
                    other => other,
                };
                match appended {
                    Ok(_) => batches.push((member, batch)),
                    Err(error) => refused.push((member, error)),
                }
            }
            let writes = state.log.take_writes();
            let last_lsn = state.log.next_lsn() - 1;
            drop(state);
            // The log first (durable with Sync), then the tables, in LSN order.
            let sync_each = self.sync_each;
            let members: Vec<u64> = batches.iter().map(|(member, _)| *member).collect();
            let outcome =
                io(&|synced| perform_writes(&writes, synced && sync_each)).and_then(|()| {
                    for (_, batch) in batches {
                        db.write_opt(batch, &no_wal())?;
                    }
                    Ok(())
                });
            state = self.state.lock();
            if outcome.is_ok() && !members.is_empty() {
                state.written_lsn = last_lsn;
            }
            for member in members {
                state.outcomes.insert(member, outcome.clone());
            }
            for (member, error) in refused {
                state.outcomes.insert(member, Err(error));
            }
            state.leading = false;
            self.done.notify_all();
        }
    }

    /// Syncs the log's files: every commit so far becomes durable (`Engine::flush_wal`).
    pub(crate) fn sync(&self) -> Result<()> {
        self.state.lock().log.sync_files()
    }

    /// After every table was flushed (all of them together): the records up to the last
    /// written LSN are in table files; their segments may be reused.
    pub(crate) fn flushed(&self, written_before_flush: u64) {
        self.state
            .lock()
            .log
            .release_through(written_before_flush + 1);
    }

    /// The LSN of the last batch written to the tables.
    pub(crate) fn written_lsn(&self) -> u64 {
        self.state.lock().written_lsn
    }
}
