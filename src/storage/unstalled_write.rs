//! Writes to RocksDB that never wait inside it: the one way every write path of ours reaches
//! the tables (RocksDB's WAL path, and the commit log's writes to the tables behind it).
//!
//! Why: RocksDB holds writes back while its flushes or compactions are behind (a write stall),
//! and stops them while a background error stands, such as a flush that found the disk full. A
//! write held back waits inside RocksDB's write queue. Two ways that hung a commit for good,
//! both found by `tests/it/full_disk.rs`:
//! - behind the commit log, a commit is already durable and needs no new space, so nothing
//!   else failed it: it waited for as long as the disk stayed full;
//! - on RocksDB's WAL, once space came back, RocksDB's recovery flush waited to enter the write
//!   queue behind the held-back writer, which waited for the recovery (seen once, in a loaded
//!   CI run: the test hung in `DBImpl::DelayWrite` beside `ErrorHandler::RecoverFromBGError`).
//!
//! So every write is made with `no_slowdown`: held back, it returns at once, and is tried again
//! a millisecond later outside the queue, unless a background error stands; then a flush either
//! reports it (the write fails, which poisons the engine) or makes room.

use rocksdb::{DB, WriteBatch, WriteOptions};

use crate::format::error::Result;

/// Writes `batch` with `options`, which must have `no_slowdown` set, trying again while RocksDB
/// holds writes back (see the module's docs). `flush` flushes the tables while a background
/// error stands: every table together behind the commit log (a table flushed alone would put
/// the log's LSN in files that other tables' files lag behind), the `default` table on
/// RocksDB's WAL.
///
/// # Errors
/// RocksDB's error for the write, or the standing background error.
pub(crate) fn write_unstalled(
    db: &DB,
    batch: WriteBatch,
    options: &WriteOptions,
    flush: &dyn Fn() -> Result<()>,
) -> Result<()> {
    let mut attempt = batch;
    loop {
        // A write held back is not applied, and takes its batch with it: the bytes are kept
        // for another attempt (a plain copy of them: a second RocksDB batch made and dropped
        // for every write cost 600 instructions a commit).
        let again = attempt.data().to_vec();
        match db.write_opt(attempt, options) {
            Ok(()) => return Ok(()),
            Err(error) if error.kind() == rocksdb::ErrorKind::Incomplete => {
                let background_errors = db
                    .property_int_value(rocksdb::properties::BACKGROUND_ERRORS)?
                    .unwrap_or(0);
                if background_errors > 0 {
                    // Fails with the standing error, or makes room for the write.
                    flush()?;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
                attempt = WriteBatch::from_data(&again);
            }
            Err(error) => return Err(error.into()),
        }
    }
}
