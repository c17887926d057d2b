//! A reader beside the log's owner: the log's records after the table files' LSN, written as a
//! RocksDB WAL file for RocksDB's own read-only recovery.

use std::path::Path;

use rocksdb::WriteBatch;

use crate::format::error::{Error, Result};
use crate::storage::log::commit_log::CommitLog;
use crate::storage::log::replay::{LOG_DIR, LOG_LSN_KEY};

/// The sequence numbers a reader gives the log's records start this far past the store's
/// last one: past every write in RocksDB's own WAL files too, which a store switched to the
/// log may still hold unflushed from before (their sequence numbers are not in the table
/// files' count).
const READER_SEQUENCE_MARGIN: u64 = 1 << 40;

/// The log's records a reader beside the owner needs, written as RocksDB WAL files in a
/// temporary directory (see `storage/log/wal_file.rs`), removed when this is dropped.
pub(crate) struct ReaderWal {
    dir: tempfile::TempDir,
}

impl ReaderWal {
    /// The WAL directory to give RocksDB's read-only open.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// `payload` (a log record's batch) without a put of its LSN at its end. Records carry none
/// now (a group's write to the tables puts its LSN once); logs written before carry one in
/// every record. A reader's replay leaves [`LOG_LSN_KEY`] as the table files have it, so that
/// the reader can check that the files it opened are the ones whose LSN it read the log after.
///
/// # Errors
/// [`Error::Corrupt`] for a payload shorter than a write batch's header.
pub(super) fn without_lsn_put(lsn: u64, payload: &[u8]) -> Result<Vec<u8>> {
    use crate::storage::log::wal_file::{BATCH_HEADER_BYTES, batch_count};
    let mut alone = WriteBatch::default();
    alone.put(LOG_LSN_KEY, lsn.to_be_bytes());
    let put = &alone.data()[BATCH_HEADER_BYTES..];
    match batch_count(payload) {
        Some(count)
            if count > 0
                && payload.len() >= BATCH_HEADER_BYTES + put.len()
                && payload.ends_with(put) =>
        {
            let mut batch = payload[..payload.len() - put.len()].to_vec();
            batch[8..BATCH_HEADER_BYTES].copy_from_slice(&(count - 1).to_le_bytes());
            Ok(batch)
        }
        Some(_) => Ok(payload.to_vec()),
        None => Err(Error::Corrupt {
            key: LOG_LSN_KEY.to_vec(),
            reason: crate::format::error::DecodeError::Invalid {
                reason: "a commit-log record is shorter than a write batch's header",
            },
        }),
    }
}

/// For a read-only open of `store` beside its owner: the commit log's records after
/// `tables_lsn` (the LSN the table files the reader opened hold), as a WAL file whose first
/// batch gets a sequence number past `last_sequence` (the reader's), beside links to the
/// store's own WAL files. `None` when the store has no log, or the log holds nothing after
/// `tables_lsn`.
///
/// # Errors
/// [`Error::Storage`] if a file cannot be read or written; [`Error::InvalidArgument`] if the
/// log no longer holds `tables_lsn + 1` (the owner flushed and reused its segment meanwhile:
/// open again); [`Error::Storage`] of kind `Retryable` if a segment read was reused during the
/// read (records may be missing: open again).
pub(crate) fn log_as_wal(
    store: &Path,
    tables_lsn: u64,
    last_sequence: u64,
) -> Result<Option<ReaderWal>> {
    use crate::storage::log::wal_file::{WalFileWriter, wal_file_path};
    let log_dir = store.join(LOG_DIR);
    if !log_dir.is_dir() {
        return Ok(None);
    }
    let dir = tempfile::Builder::new()
        .prefix("idemdb-reader-wal-")
        .tempdir()
        .map_err(|error| Error::io("making a temporary WAL directory", &error))?;
    let first_sequence = last_sequence
        .checked_add(1 + READER_SEQUENCE_MARGIN)
        .ok_or_else(|| Error::invalid_argument("the store's sequence numbers are exhausted"))?;
    // Numbered past every WAL file of the store, whose links go beside it.
    let path = wal_file_path(dir.path(), u64::MAX >> 8);
    let mut writer = WalFileWriter::create(&path, first_sequence)?;
    let mut records = 0u64;
    let headers = CommitLog::read_beside_writer(&log_dir, tables_lsn + 1, |lsn, payload| {
        records += 1;
        writer.append_batch(&without_lsn_put(lsn, payload)?)
    })?;
    writer.finish()?;
    // A segment the owner reused during the read may have cut the records short, or ended them
    // at once when it was reused between the read of its header and of its records (a read
    // that found nothing had been taken for the end, missing every commit after the tables'
    // LSN): such a read is not used, whatever it found.
    if !CommitLog::unchanged_since(&log_dir, &headers)? {
        return Err(Error::Storage {
            kind: crate::format::error::StorageErrorKind::Retryable,
            detail: "the commit log's segments were reused during the read".to_owned(),
        });
    }
    if records == 0 {
        return Ok(None);
    }
    let absolute = std::path::absolute(store)
        .map_err(|error| Error::io("finding the store's absolute path", &error))?;
    let entries = std::fs::read_dir(&absolute)
        .map_err(|error| Error::io("listing the store's files", &error))?;
    for entry in entries {
        let entry = entry.map_err(|error| Error::io("listing the store's files", &error))?;
        let name = entry.file_name();
        if name.to_string_lossy().ends_with(".log") {
            std::os::unix::fs::symlink(absolute.join(&name), dir.path().join(&name))
                .map_err(|error| Error::io("linking the store's WAL files", &error))?;
        }
    }
    Ok(Some(ReaderWal { dir }))
}
