//! The one write path: RocksDB's WAL or the commit log, the fault seam in front of every
//! write and sync, and the poisoning of the engine by a write whose durability is unknown.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rocksdb::{WriteBatch, WriteOptions};

use super::Storage;
use crate::format::error::{Error, Result};
use crate::storage::fault::{Fault, IoPoint};
use crate::storage::log::committer::StagedWrite;
use crate::storage::log::logged_writes::LogWriter;
use crate::storage::log::quiet_shrink::Shrinker;
use crate::storage::unstalled_write::write_unstalled;

impl Storage {
    pub(crate) fn check_not_poisoned(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(Error::Poisoned);
        }
        Ok(())
    }

    /// The one write path: writes `batch` atomically with the engine's durability.
    pub(crate) fn write(&self, batch: WriteBatch) -> Result<()> {
        self.check_not_poisoned()?;
        if let Some(log) = &self.log {
            log.write(
                self.db(),
                batch,
                |call| self.io_result(IoPoint::Write, call),
                || self.flush_every_table(),
            )
            .inspect_err(|error| self.poison_after_log(error))?;
            self.write_batches.fetch_add(1, Ordering::Relaxed);
            self.watch_log_growth(log);
            return Ok(());
        }
        self.write_without_log(batch)
    }

    /// [`Storage::write`] in two halves, for the async committer: this one makes `batches`
    /// (each a commit's, numbered by the caller) durable. With the commit log each is a record
    /// of one group, and those the ring had no room for are returned, for the next call (the
    /// committer can start it while [`Storage::complete_write`] applies this group to the
    /// tables); without the log they are joined into one write batch and written whole.
    pub(crate) fn write_durable(
        &self,
        batches: Vec<(usize, WriteBatch)>,
    ) -> (StagedWrite, Vec<(usize, WriteBatch)>) {
        let numbers: Vec<usize> = batches.iter().map(|(number, _)| *number).collect();
        if let Err(error) = self.check_not_poisoned() {
            return (StagedWrite::Done(numbers, Err(error)), Vec::new());
        }
        match &self.log {
            Some(log) => {
                let (group, left) = log.write_durable(
                    self.db(),
                    batches,
                    |call| self.io_result(IoPoint::Write, call),
                    || self.flush_every_table(),
                );
                (StagedWrite::Logged(group), left)
            }
            None => {
                let joined =
                    crate::storage::log::wal_file::join(batches.into_iter().map(|(_, b)| b));
                (
                    StagedWrite::Done(numbers, self.write_without_log(joined)),
                    Vec::new(),
                )
            }
        }
    }

    /// The second half of [`Storage::write_durable`]: each batch's outcome, by its number.
    pub(crate) fn complete_write(&self, staged: StagedWrite) -> Vec<(usize, Result<()>)> {
        match staged {
            StagedWrite::Done(numbers, outcome) => numbers
                .into_iter()
                .map(|number| (number, outcome.clone()))
                .collect(),
            StagedWrite::Logged(group) => {
                let log = self.log.as_ref().expect("a logged write has the log");
                let outcomes = log
                    .apply(self.db(), group, &|| self.flush_every_table())
                    .into_vec();
                for (_, outcome) in &outcomes {
                    if let Err(error) = outcome {
                        self.poison_after_log(error);
                    }
                }
                let written = outcomes
                    .iter()
                    .filter(|(_, outcome)| outcome.is_ok())
                    .count();
                self.write_batches
                    .fetch_add(written as u64, Ordering::Relaxed);
                self.watch_log_growth(log);
                outcomes
            }
        }
    }

    /// Starts the shrinker (`storage/log/quiet_shrink.rs`) when the commit log grew past its
    /// first segments (by a write, or before this open) and none runs: it gives them back once
    /// the store is quiet. A shrinker that cannot start is reported; the ring keeps its
    /// segments.
    pub(super) fn watch_log_growth(&self, log: &Arc<LogWriter>) {
        if !log.take_growth() || self.shrink_after == Duration::MAX {
            return;
        }
        // The one before, if any, has ended or is ending (the log asks for a shrinker only
        // once the last one decided to end): it is joined as it is replaced.
        let mut shrinker = self.shrinker.lock();
        let tables: Vec<String> = self.table_names().into_iter().map(str::to_owned).collect();
        let db = self.open.borrow_owner().clone();
        let flush = move || {
            let names: Vec<&str> = tables.iter().map(String::as_str).collect();
            Ok(super::flush_all(&db, &names)?)
        };
        match Shrinker::start(log.clone(), Box::new(flush), self.shrink_after) {
            Ok(started) => *shrinker = Some(started),
            Err(error) => {
                tracing::warn!(target: "idemdb", %error, "no thread to shrink the commit log");
                log.shrinker_ended();
            }
        }
    }

    /// A write through RocksDB's WAL (no commit log).
    fn write_without_log(&self, batch: WriteBatch) -> Result<()> {
        let flush = || self.flush_default_table();
        self.io_result(IoPoint::Write, |synced| {
            if synced {
                write_unstalled(self.db(), batch, &self.write_options, &flush)
            } else {
                let mut unsynced = WriteOptions::default();
                unsynced.set_sync(false);
                unsynced.set_no_slowdown(true);
                write_unstalled(self.db(), batch, &unsynced, &flush)
            }
        })?;
        self.write_batches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Flushes the `default` table, waiting for it: on RocksDB's WAL, what a write held back by
    /// a background error asks for (`storage/unstalled_write.rs`).
    fn flush_default_table(&self) -> Result<()> {
        let mut flush = rocksdb::FlushOptions::default();
        flush.set_wait(true);
        Ok(self.db().flush_opt(&flush)?)
    }

    /// Poisons the engine after a failed write through the commit log, as a failed write to
    /// RocksDB's WAL does: a storage failure of the log or of the tables behind it (a flush
    /// that found the disk full, say) leaves the commit's fate to the next open's replay. A
    /// refusal that wrote nothing (a commit too large for the log, one to retry) does not.
    fn poison_after_log(&self, error: &Error) {
        if matches!(error, Error::Storage { .. }) && !error.is_retryable() {
            self.poisoned.store(true, Ordering::Release);
        }
    }

    /// Runs one RocksDB call at `point` through [`Storage::io_result`].
    pub(super) fn io(
        &self,
        point: IoPoint,
        call: impl FnOnce(bool) -> std::result::Result<(), rocksdb::Error>,
    ) -> Result<()> {
        self.io_result(point, |synced| call(synced).map_err(Error::from))
    }

    /// Runs one I/O call at `point` (RocksDB's, or the commit log's), applying an injected
    /// fault if one is installed, and poisons the engine on any failure that is not known to
    /// have written nothing. The call is told whether to sync as its durability asks (`false`
    /// only under [`Fault::Unsynced`]).
    fn io_result(&self, point: IoPoint, call: impl FnOnce(bool) -> Result<()>) -> Result<()> {
        let fault = self
            .fault_injector
            .as_ref()
            .map_or(Fault::None, |injector| injector.fault(point));
        let poison = |outcome: Result<()>| {
            outcome.inspect_err(|error| {
                if !error.is_retryable() {
                    self.poisoned.store(true, Ordering::Release);
                }
            })
        };
        match fault {
            Fault::None => poison(call(true)),
            Fault::Unsynced if point == IoPoint::SyncWal => Ok(()),
            Fault::Unsynced => poison(call(false)),
            Fault::FailBefore | Fault::FailAfter => {
                if fault == Fault::FailAfter {
                    // Its own outcome is hidden from the caller, as a failed fsync would be.
                    let _ = call(true);
                }
                self.poisoned.store(true, Ordering::Release);
                Err(crate::storage::fault::injected(point))
            }
        }
    }

    /// Fsyncs the WAL (or the commit log): every write so far becomes durable.
    pub(crate) fn sync_wal(&self) -> Result<()> {
        self.check_not_poisoned()?;
        if let Some(log) = &self.log {
            return self.io_result(IoPoint::SyncWal, |_| log.sync());
        }
        self.io(IoPoint::SyncWal, |_| self.db().flush_wal(true))
    }
}

impl crate::storage::log::committer::BatchWriter for Storage {
    fn write_durable(
        &self,
        batches: Vec<(usize, WriteBatch)>,
    ) -> (StagedWrite, Vec<(usize, WriteBatch)>) {
        Storage::write_durable(self, batches)
    }

    fn complete_write(&self, staged: StagedWrite) -> Vec<(usize, Result<()>)> {
        Storage::complete_write(self, staged)
    }
}
