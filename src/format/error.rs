//! The crate's error type: one variant per failure a caller can act on, each carrying evidence.

use std::path::PathBuf;

/// A specialised `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which limit an input violated. Every limit is a named constant of the crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Limit {
    /// [`crate::CONSUMER_ID_BYTES_MIN`] ..= [`crate::CONSUMER_ID_BYTES_MAX`].
    ConsumerIdBytes,
    /// [`crate::MESSAGE_KEY_BYTES_MIN`] ..= [`crate::MESSAGE_KEY_BYTES_MAX`].
    MessageKeyBytes,
    /// [`crate::RESULT_BYTES_MAX`].
    ResultBytes,
    /// [`crate::TABLE_NAME_BYTES_MIN`] ..= [`crate::TABLE_NAME_BYTES_MAX`].
    TableNameBytes,
    /// [`crate::TABLE_KEY_BYTES_MIN`] ..= [`crate::TABLE_KEY_BYTES_MAX`].
    TableKeyBytes,
    /// [`crate::TABLE_VALUE_BYTES_MAX`].
    TableValueBytes,
    /// [`crate::STAGED_WRITES_MAX`].
    StagedWrites,
    /// [`crate::STAGED_BYTES_MAX`].
    StagedBytes,
    /// [`crate::RETENTION_MS_MIN`] ..= [`crate::RETENTION_MS_MAX`].
    RetentionMs,
    /// [`crate::PERIODIC_COMPACTION_S_MIN`] ..= [`crate::PERIODIC_COMPACTION_S_MAX`].
    PeriodicCompactionS,
    /// [`crate::BLOCK_CACHE_BYTES_MIN`] ..= [`crate::BLOCK_CACHE_BYTES_MAX`].
    BlockCacheBytes,
    /// [`crate::WRITE_BUFFER_BYTES_MIN`] ..= [`crate::WRITE_BUFFER_BYTES_MAX`].
    WriteBufferBytes,
    /// [`crate::TABLES_MAX`].
    Tables,
    /// [`crate::LEASE_MS_MIN`] ..= [`crate::LEASE_MS_MAX`].
    LeaseMs,
    /// [`crate::HOLDER_BYTES_MAX`].
    HolderBytes,
    /// [`crate::BATCH_MESSAGES_MAX`].
    BatchMessages,
    /// [`crate::POSITION_SOURCE_BYTES_MIN`] ..= [`crate::POSITION_SOURCE_BYTES_MAX`].
    PositionSourceBytes,
    /// [`crate::COMMIT_LOG_SEGMENTS_MIN`] ..= [`crate::COMMIT_LOG_SEGMENTS_MAX`].
    CommitLogSegments,
    /// [`crate::COMMIT_LOG_SEGMENT_BYTES_MIN`] ..= [`crate::COMMIT_LOG_SEGMENT_BYTES_MAX`].
    CommitLogSegmentBytes,
    /// 1 ..= [`crate::PIPELINE_DEPTH_MAX`].
    PipelineDepth,
}

/// What RocksDB reported, reduced to what a caller can act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StorageErrorKind {
    /// The operation did not take effect and may simply be retried (RocksDB `Busy`, `TryAgain`,
    /// `TimedOut`, `Incomplete`).
    Retryable,
    /// An I/O failure. On the write path this poisons the engine (see [`Error::Poisoned`]).
    Io,
    /// The file system is full (`ENOSPC`). On the write path this poisons the engine like any
    /// I/O failure: RocksDB stops accepting writes once a WAL or flush write has failed. Reads
    /// keep working; free space, then open the store again (every acknowledged commit is
    /// there).
    NoSpace,
    /// RocksDB detected corruption of its own files (checksums, manifest, WAL).
    Corruption,
    /// The store is shutting down.
    ShuttingDown,
    /// Anything else RocksDB reports (invalid argument, not supported, ...). A bug in idemdb or an
    /// incompatible store rather than a transient condition.
    Other,
}

/// Every failure idemdb reports. Duplicates, conflicts and in-progress keys are *not* errors:
/// they are [`crate::Outcome`]s.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An input was outside a documented limit.
    #[error("{limit:?} is {actual}, outside the allowed {min}..={max}; see the limit's constant")]
    LimitExceeded {
        /// Which limit.
        limit: Limit,
        /// The value supplied (a length in bytes, a count, or a duration in the limit's unit).
        actual: u64,
        /// The smallest allowed value.
        min: u64,
        /// The largest allowed value.
        max: u64,
    },

    /// The store at `path` is held open by another process or by another `Engine` in this one.
    #[error(
        "store {path:?} is already open (by another process or another Engine in this process); \
         close it there first"
    )]
    AlreadyOpen {
        /// The store's directory.
        path: PathBuf,
    },

    /// An option given to the builder is inconsistent (a duplicate table name, a reserved name ...).
    #[error("invalid option: {reason}")]
    InvalidOption {
        /// What is wrong, in words.
        reason: String,
    },

    /// An argument of a call does not fit the call or the store (a cursor that does not parse,
    /// an import record for a table it cannot belong to, a message version given to
    /// `begin_external` ...). Nothing was read or written; fix the call.
    #[error("invalid argument: {reason}")]
    InvalidArgument {
        /// What is wrong, in words.
        reason: String,
    },

    /// A write was asked of an operator tool's read-only store.
    #[error(
        "the store was opened read-only; writes need admin::StoreBuilder::open_exclusive (with \
         the application stopped)"
    )]
    ReadOnly,

    /// The directory holds a RocksDB database that is not an idemdb store, or one written by an
    /// incompatible version of idemdb, or one whose tables differ from the declared ones.
    #[error("incompatible store at {path:?}: {reason}")]
    IncompatibleStore {
        /// The store's directory.
        path: PathBuf,
        /// What does not match, in words.
        reason: String,
    },

    /// A table handle was requested by a name that was not declared when the engine was opened,
    /// or with the wrong kind.
    #[error("table {name:?} was not declared as a {expected} table when the engine was opened")]
    UnknownTable {
        /// The name asked for.
        name: String,
        /// The kind of table asked for ("business" or "entity").
        expected: &'static str,
    },

    /// A handle belongs to a different `Engine` than the claim it was used with.
    #[error("table {name:?} belongs to another Engine; take the handle from the claim's engine")]
    ForeignTable {
        /// The table's name.
        name: String,
    },

    /// A merge was staged into a business table declared without a merge operator.
    #[error("table {name:?} has no merge operator; declare one with TableOptions::merge_operator")]
    NoMergeOperator {
        /// The table's name.
        name: String,
    },

    /// A stored record (or merge operand) failed to decode. The key is the stored key, printable
    /// with [`crate::format::printable`].
    #[error(
        "corrupt record at key {}: {reason}",
        crate::format::printable::printable(key)
    )]
    Corrupt {
        /// The stored key whose value did not decode.
        key: Vec<u8>,
        /// Why it did not decode.
        reason: DecodeError,
    },

    /// The engine clock reads beyond [`crate::CLOCK_MS_MAX`]: a write's timestamps would
    /// overflow. Fix the clock; nothing was written.
    #[error("the clock reads {now_ms} ms, beyond CLOCK_MS_MAX; nothing was written")]
    ClockOutOfRange {
        /// The clock's reading.
        now_ms: u64,
    },

    /// An external claim's holder lost the key: its lease expired and another holder took it
    /// over (or it was resolved by an operator). Nothing of this call was written, staged writes
    /// included. Stop, and do not acknowledge the message as processed by this attempt.
    #[error("lease lost: the key is now at epoch {current_epoch}; stop and drop this attempt")]
    LeaseLost {
        /// The key's epoch now (0 when the key holds no record).
        current_epoch: u64,
    },

    /// A lease step could not take the key's latch in time: another claim holds the key (in
    /// this process for the embedded engine; in any session for the PostgreSQL backend, whose
    /// latch is the key's lock). After the lease ran out, a takeover may be under way. Nothing
    /// was written; retry, or treat the lease as lost.
    #[error("the key is held by another claim; retry")]
    KeyBusy,

    /// An operator resolution targeted a key that is not in progress.
    #[error("the key is not in progress (epoch {current_epoch}); nothing to resolve")]
    NotInProgress {
        /// The key's epoch now (0 when the key holds no record).
        current_epoch: u64,
    },

    /// A lease ticket was resumed on a consumer or table it was not issued by.
    #[error("the lease ticket was issued for another consumer or table")]
    ForeignTicket,

    /// A read position was staged behind the one stored (or accepted from a commit still being
    /// written): another reader of the partition has moved on, so this one is stale. Nothing of
    /// the commit was written, the claim's marker and staged writes included. Stop reading the
    /// partition here and resume from [`crate::Positions::get`].
    ///
    /// `stored` may be the offset of a commit still being written that then fails: a failed
    /// commit gives its offset back, so the position read afterwards is the one to trust.
    #[error(
        "position of {source_name:?} partition {partition} is at offset {stored}; offset {staged} is \
         behind it: this reader is stale, nothing was written"
    )]
    PositionBehind {
        /// The source (topic, stream). (Not `source`: that name means the error's cause.)
        source_name: String,
        /// The partition.
        partition: u32,
        /// The offset already stored, or accepted for a commit still being written.
        stored: u64,
        /// The offset this commit staged.
        staged: u64,
    },

    /// A commit of a pipeline ([`crate::Pipeline`]) that came after one that failed: a
    /// pipeline acknowledges nothing past a failure, so that no acknowledgement (a broker's
    /// cumulative one above all) covers the failed message. This one was not committed if it
    /// was handed over after the failure was known, and may have been otherwise (its
    /// redelivery is then a duplicate): leave its message unacknowledged and take the next
    /// messages through a new pipeline.
    #[error(
        "a commit before this one in its pipeline failed ({earlier}); this one is not acknowledged"
    )]
    PipelineBroken {
        /// The error of the commit that failed first, in words.
        earlier: String,
    },

    /// An earlier write failed in a way that leaves its durability unknown (a failed WAL write or
    /// fsync). The engine refuses writes until it is dropped and reopened, which recovers a
    /// consistent state from the WAL.
    #[error("the engine is poisoned by an earlier failed write; drop it and reopen the store")]
    Poisoned,

    /// RocksDB reported an error. `kind` is the part to act on; `detail` is for logs only and its
    /// wording is not part of the API.
    #[error("storage error ({kind:?}): {detail}")]
    Storage {
        /// What kind of failure.
        kind: StorageErrorKind,
        /// RocksDB's own message, for logs.
        detail: String,
    },
}

impl Error {
    /// True when the same call may succeed if simply retried (nothing was written).
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::KeyBusy
                | Error::Storage {
                    kind: StorageErrorKind::Retryable,
                    ..
                }
        )
    }

    pub(crate) fn limit(limit: Limit, actual: usize, min: usize, max: usize) -> Error {
        // `usize` fits in `u64` on every platform Rust supports.
        Error::LimitExceeded {
            limit,
            actual: actual as u64,
            min: min as u64,
            max: max as u64,
        }
    }

    /// A file-system failure outside RocksDB (the store directory, its lock), as a storage
    /// error of kind [`StorageErrorKind::Io`].
    #[cfg(feature = "engine")]
    pub(crate) fn io(doing: &str, error: &std::io::Error) -> Error {
        let kind = if error.kind() == std::io::ErrorKind::StorageFull {
            StorageErrorKind::NoSpace
        } else {
            StorageErrorKind::Io
        };
        Error::Storage {
            kind,
            detail: format!("{doing}: {error}"),
        }
    }

    #[cfg(any(feature = "engine", feature = "transfer"))]
    pub(crate) fn invalid_argument(reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            reason: reason.into(),
        }
    }

    #[cfg(feature = "engine")]
    pub(crate) fn invalid_option(reason: impl Into<String>) -> Error {
        Error::InvalidOption {
            reason: reason.into(),
        }
    }
}

/// Checks `min <= actual <= max` for a limit counted in `u64` (milliseconds, seconds), else
/// returns [`Error::LimitExceeded`] naming `limit`.
#[cfg(feature = "engine")]
pub(crate) fn check_limit_u64(limit: Limit, actual: u64, min: u64, max: u64) -> Result<()> {
    if actual < min || actual > max {
        return Err(Error::LimitExceeded {
            limit,
            actual,
            min,
            max,
        });
    }
    Ok(())
}

/// Checks `min <= actual <= max`, else returns [`Error::LimitExceeded`] naming `limit`.
pub(crate) fn check_limit(limit: Limit, actual: usize, min: usize, max: usize) -> Result<()> {
    if actual < min || actual > max {
        return Err(Error::limit(limit, actual, min, max));
    }
    Ok(())
}

#[cfg(feature = "engine")]
impl From<rocksdb::Error> for Error {
    fn from(error: rocksdb::Error) -> Error {
        use rocksdb::ErrorKind as K;
        let kind = match error.kind() {
            K::Busy | K::TryAgain | K::TimedOut | K::Incomplete => StorageErrorKind::Retryable,
            // RocksDB has a NoSpace subcode, but the bindings report only the message.
            K::IOError if error.as_ref().contains("No space left on device") => {
                StorageErrorKind::NoSpace
            }
            K::IOError => StorageErrorKind::Io,
            K::Corruption => StorageErrorKind::Corruption,
            K::ShutdownInProgress => StorageErrorKind::ShuttingDown,
            _ => StorageErrorKind::Other,
        };
        Error::Storage {
            kind,
            detail: error.into_string(),
        }
    }
}

/// Why stored bytes did not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the layout requires.
    #[error("truncated: needed {needed} bytes, found {available}")]
    Truncated {
        /// Bytes the layout requires.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// More bytes than the layout accounts for.
    #[error("{extra} trailing bytes after the record")]
    TrailingBytes {
        /// Bytes past the end of the record.
        extra: usize,
    },
    /// A format version this build does not know (written by a newer idemdb, or garbage).
    #[error("unknown format version {version}")]
    UnknownVersion {
        /// The version byte found.
        version: u8,
    },
    /// A record state or operand kind this build does not know.
    #[error("unknown {what} tag {tag}")]
    UnknownTag {
        /// "state" or "operand kind".
        what: &'static str,
        /// The tag byte found.
        tag: u8,
    },
    /// A field holds a value no writer produces.
    #[error("invalid field: {reason}")]
    Invalid {
        /// Which field and why.
        reason: &'static str,
    },
    /// A stored key that is not a valid composite key.
    #[error("bad key: {reason}")]
    BadKey {
        /// Why.
        reason: &'static str,
    },
}
