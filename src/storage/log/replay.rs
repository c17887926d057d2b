//! The commit log's place in the store: its directory, the LSN the tables hold (put with each
//! group's write), a record as a batch to replay into the tables, the check that a new log fits
//! the disk, and the retirement of a log when the store opens without one.

use std::path::Path;

use rocksdb::{DB, WriteBatch, WriteOptions};

use crate::format::error::{Error, Result};
use crate::storage::log::commit_log::{CommitLog, building_path};

/// The meta key (`default` table) holding the LSN of the last batch written to the tables.
pub(crate) const LOG_LSN_KEY: &[u8] = b"idemdb.log-lsn";
/// The commit log's directory inside the store.
pub(crate) const LOG_DIR: &str = "idemdb-log";

/// Writes to RocksDB after the log, without RocksDB's WAL: the log made the batch durable.
/// (Written through RocksDB's WAL as well, unsynced, so that other processes' read-only opens
/// would replay it, the batch path lost 12-15% of its throughput; the read-only open reads the
/// log itself instead: `admin::StoreBuilder::open_read_only`.)
pub(crate) fn no_wal() -> WriteOptions {
    let mut options = WriteOptions::default();
    options.disable_wal(true);
    options
}

pub(crate) fn default_table(db: &DB) -> &rocksdb::ColumnFamily {
    db.cf_handle(rocksdb::DEFAULT_COLUMN_FAMILY_NAME)
        .expect("the default table exists")
}

/// The log record `payload` of LSN `lsn` as a batch to replay into the tables: with the put
/// of its LSN, so that the tables say which records they hold.
pub(crate) fn numbered(db: &DB, payload: &[u8], lsn: u64) -> WriteBatch {
    let mut batch = WriteBatch::from_data(payload);
    batch.put_cf(default_table(db), LOG_LSN_KEY, lsn.to_be_bytes());
    batch
}

/// The LSN of the last batch the tables hold (memtables included), 0 for none.
pub(crate) fn tables_lsn(db: &DB) -> Result<u64> {
    lsn_at(db, &rocksdb::ReadOptions::default())
}

/// The LSN the tables' files hold: [`tables_lsn`] read without the memtables (the tables
/// write no WAL of their own, so RocksDB's persisted tier skips them). Every table flushes
/// together (atomic flush), so every batch up to it is in table files.
pub(crate) fn persisted_lsn(db: &DB) -> Result<u64> {
    let mut options = rocksdb::ReadOptions::default();
    options.set_read_tier(rocksdb::ReadTier::Persisted);
    lsn_at(db, &options)
}

/// The LSN key read with `options`, 0 when absent.
fn lsn_at(db: &DB, options: &rocksdb::ReadOptions) -> Result<u64> {
    Ok(
        match db.get_pinned_cf_opt(default_table(db), LOG_LSN_KEY, options)? {
            Some(value) => {
                u64::from_be_bytes(value.as_ref().try_into().map_err(|_| Error::Corrupt {
                    key: LOG_LSN_KEY.to_vec(),
                    reason: crate::format::error::DecodeError::Invalid {
                        reason: "the commit log's LSN is not 8 bytes",
                    },
                })?)
            }
            None => 0,
        },
    )
}

/// Refuses an open that would make a commit log of up to `segments` x `segment_bytes` in
/// `store` (it has none yet) on a file system without room for the segments it is made with
/// (`LOG_SLOTS_FIRST`; it grows only where there is room): run before the store is opened for
/// writing, so that the refusal changes nothing. A log the store has already is opened as it
/// is and needs no space.
pub(crate) fn check_new_log_fits(store: &Path, segments: usize, segment_bytes: u64) -> Result<()> {
    let dir = store.join(LOG_DIR);
    if dir.exists() {
        return Ok(());
    }
    // A log left half made by a crash is removed before the new one is made: its space counts
    // as free.
    let building = building_path(&dir);
    let left_over = if building.exists() {
        crate::storage::directory::directory_size(&building)?.0
    } else {
        0
    };
    let first = crate::storage::log::commit_log::LOG_SLOTS_FIRST.min(segments);
    crate::storage::log::commit_log::check_space(&dir, first, segment_bytes, left_over)
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
    let (log, _) = CommitLog::open(&dir, from, |lsn, payload| {
        Ok(db.write_opt(numbered(db, payload, lsn), &synced)?)
    })?;
    drop(log);
    std::fs::remove_dir_all(&dir).map_err(|error| Error::io("removing the commit log", &error))?;
    crate::storage::directory::sync_directory(store)
        .map_err(|error| Error::io("syncing the store directory", &error))
}
