//! A record's row: the completed record built for a commit, its encoding and removal time,
//! its write (insert or update) and what a failed write means, and the advisory-lock numbers of
//! keys and entities.

use bytes::Bytes;
use idemdb::format::Record;
use idemdb::{EXPIRES_NEVER_MS, Fingerprint, RESULT_BYTES_MAX};
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::sql::clock::database_now_ms;
use crate::sql::txn::LOST_ROW;
use crate::storage::store::ClockReading;
use crate::storage::store::PgConsumer;
use crate::storage::store::PgStore;
use crate::tables::names::NEVER_MS;

/// Decodes a stored version of `entity_key` (8 bytes, big-endian).
pub(crate) fn decode_version(entity_key: &[u8], bytes: &[u8]) -> Result<u64> {
    match <[u8; 8]>::try_from(bytes) {
        Ok(be) => Ok(u64::from_be_bytes(be)),
        Err(_) => Err(Error::Corrupt {
            key: entity_key.to_vec(),
            detail: format!("an entity version of {} bytes, not 8", bytes.len()),
        }),
    }
}

/// Decodes a stored record of `key`; one that does not decode is reported, never overwritten.
pub(crate) fn decode_record(key: &[u8], bytes: &[u8]) -> Result<Record> {
    Record::decode(bytes).map_err(|error| Error::Corrupt {
        key: key.to_vec(),
        detail: error.to_string(),
    })
}

/// Writes the completed record of `key` at `epoch` in `tx`: replacing the row there is
/// (`replaces`), else an insert, committed at `clock`'s time (the call's one reading of an
/// injected clock, or the database's now). `succeeded` false records a failure as the result.
/// Errors come before any COMMIT is sent: PostgreSQL answers a COMMIT of a transaction a
/// failed statement aborted with a rollback and no error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write_completed(
    tx: &Client,
    consumer: &PgConsumer,
    clock: ClockReading,
    key: &[u8],
    fingerprint: Fingerprint,
    epoch: u64,
    replaces: bool,
    result: &[u8],
    succeeded: bool,
) -> Result<()> {
    check_result(result)?;
    let now_ms = now_on_store_clock(tx, clock).await?;
    let (record, expires_at_ms) = completed_record(
        &consumer.store,
        epoch,
        fingerprint,
        now_ms,
        result,
        succeeded,
    );
    write_record(tx, consumer, key, &record, expires_at_ms, replaces).await
}

/// Refuses a result over `RESULT_BYTES_MAX`, as the embedded engine does, before anything is
/// written.
pub(crate) fn check_result(result: &[u8]) -> Result<()> {
    if result.len() > RESULT_BYTES_MAX {
        return Err(Error::Idemdb(idemdb::Error::LimitExceeded {
            limit: idemdb::Limit::ResultBytes,
            actual: result.len() as u64,
            min: 0,
            max: RESULT_BYTES_MAX as u64,
        }));
    }
    Ok(())
}

/// Now on the store's clock as the call read it: the injected clock's reading, or the
/// database's wall clock at this statement (`clock_timestamp()`, not the transaction's start:
/// a claim may be held a while before it commits, and its record's retention runs from the
/// commit). Commits and removal read it.
pub(crate) async fn now_on_store_clock(
    client: &impl tokio_postgres::GenericClient,
    clock: ClockReading,
) -> Result<u64> {
    Ok(match clock.injected() {
        Some(now_ms) => now_ms,
        None => database_now_ms(client).await?,
    })
}

/// The completed record committed at `now_ms`, and when it expires (after the store's
/// retention).
pub(crate) fn completed_record(
    store: &PgStore,
    epoch: u64,
    fingerprint: Fingerprint,
    now_ms: u64,
    result: &[u8],
    succeeded: bool,
) -> (Record, u64) {
    let expires_at_ms = now_ms.saturating_add(store.inner.retention_ms);
    let mut record = Record::new(
        epoch,
        now_ms,
        expires_at_ms,
        fingerprint,
        Bytes::copy_from_slice(result),
    );
    if !succeeded {
        record.state = idemdb::format::RecordState::Completed {
            committed_at_ms: now_ms,
            expires_at_ms,
            result: Bytes::copy_from_slice(result),
            succeeded: false,
        };
    }
    (record, expires_at_ms)
}

/// The `expires_at_ms` column of a row removable from `removable_at_ms` on: [`NEVER_MS`] for
/// never (and for a time past what int8 holds).
pub(crate) fn expires_column(removable_at_ms: u64) -> i64 {
    if removable_at_ms == EXPIRES_NEVER_MS {
        return NEVER_MS;
    }
    i64::try_from(removable_at_ms).unwrap_or(NEVER_MS)
}

/// The row of a record, for the statement that writes it: an upsert when the record replaces
/// the key's row (which removal may have deleted meanwhile), else an insert.
pub(crate) struct RecordRow<'a> {
    pub(crate) sql: &'a str,
    id: &'a [u8],
    key: &'a [u8],
    record: Vec<u8>,
    expires_column: i64,
}

impl<'a> RecordRow<'a> {
    /// `record` of `key`, removable from `removable_at_ms` on.
    pub(crate) fn new(
        consumer: &'a PgConsumer,
        key: &'a [u8],
        record: &Record,
        removable_at_ms: u64,
        replaces: bool,
    ) -> RecordRow<'a> {
        let inner = &consumer.store.inner;
        RecordRow {
            sql: if replaces {
                &inner.upsert
            } else {
                &inner.insert
            },
            id: &consumer.id,
            key,
            record: record.encode(),
            expires_column: expires_column(removable_at_ms),
        }
    }

    pub(crate) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 4] {
        [
            (&self.id, Type::BYTEA),
            (&self.key, Type::BYTEA),
            (&self.record, Type::BYTEA),
            (&self.expires_column, Type::INT8),
        ]
    }
}

impl PgStore {
    /// The error of a failed write of `key`'s record (or of its entity's version). A write that
    /// found no row to update is [`Error::LostKey`].
    pub(crate) fn write_failed(&self, error: tokio_postgres::Error, key: &[u8]) -> Error {
        if error.code() == Some(LOST_ROW) {
            return Error::LostKey { key: key.to_vec() };
        }
        if crate::sql::prepared::is_stale(&error) {
            // Only the store's own writes come here, and they are prepared: the caller's SQL
            // is sent unnamed.
            return Error::StatementDeallocated;
        }
        Error::Postgres(error)
    }
}

/// Writes `record` as the row of `key` (replacing the row there when `replaces`, else an
/// insert), removable
/// from `removable_at_ms` on.
pub(crate) async fn write_record(
    tx: &Client,
    consumer: &PgConsumer,
    key: &[u8],
    record: &Record,
    removable_at_ms: u64,
    replaces: bool,
) -> Result<()> {
    let row = RecordRow::new(consumer, key, record, removable_at_ms, replaces);
    match tx.query_typed(row.sql, &row.params()).await {
        Ok(_) => Ok(()),
        Err(error) => Err(consumer.store.write_failed(error, key)),
    }
}

/// The advisory lock of an entity's version (the ordering guard): a 64-bit hash of the
/// versions table's name and the stored entity key, as the two `int4` keys of PostgreSQL's
/// two-key form. Advisory locks on one `int8` key and on two `int4` keys are separate key
/// spaces in PostgreSQL's lock table, so an entity's lock is never a key's lock (those take
/// the `int8` form), whatever the hashes; two entities whose hashes collide only cost a
/// spurious `InProgress` while the other is held.
pub(crate) fn entity_lock_id(namespace: &str, stored_entity: &[u8]) -> (i32, i32) {
    let hash = lock_id(namespace, stored_entity).to_be_bytes();
    let [a, b, c, d, e, f, g, h] = hash;
    (
        i32::from_be_bytes([a, b, c, d]),
        i32::from_be_bytes([e, f, g, h]),
    )
}

/// The advisory lock of a stored key in a table: a 64-bit hash of both.
pub(crate) fn lock_id(namespace: &str, stored_key: &[u8]) -> i64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(namespace.as_bytes());
    hasher.update(&[0]);
    hasher.update(stored_key);
    i64::from_ne_bytes(hasher.digest().to_ne_bytes())
}

/// How a batch of removal treats a row another transaction has locked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Locked {
    /// Delete without locking first, waiting at most [`REMOVAL_LOCK_TIMEOUT_MS`] for a row
    /// another transaction holds (the batch then fails with `55P03`, and is sent again as
    /// [`Locked::Skip`]). One WAL record per row, the delete's.
    Wait,
    /// Lock the rows first, skipping those another transaction holds, then delete them: never
    /// waits, but each row writes two WAL records, the lock's and the delete's.
    Skip,
}

/// How long a batch of removal waits for a row another transaction holds before it is sent
/// again skipping such rows. Far below the server's `deadlock_timeout` (1 s by default), so a
/// claim that waits for the batch while the batch waits for it is never the one aborted.
pub(crate) const REMOVAL_LOCK_TIMEOUT_MS: u32 = 20;

/// The start of every batch of removal: READ COMMITTED, and a failure with SQLSTATE 25001
/// (`active_sql_transaction`) before anything else when the batch would run inside a
/// transaction of the caller's instead of its own implicit one. Neither its `SET LOCAL`s
/// (`synchronous_commit` off, the lock timeout) nor its delete may land there: the caller's
/// `COMMIT` would commit them with the caller's writes, without waiting for the WAL, and a
/// rollback would undo removals already reported.
///
/// Setting the isolation level alone refuses too few: PostgreSQL refuses it after the
/// transaction's first snapshot only when it changes the level, so a READ COMMITTED
/// transaction that has run a statement would pass. Two checks (each seen on PostgreSQL 15):
/// - `NOT DEFERRABLE` is refused after the first snapshot and in any subtransaction, whatever
///   the value and the level: every caller's transaction that has run a statement, and every
///   savepoint, fails at the first statement, on the server's own rule.
/// - A transaction begun by an earlier message that has run nothing since (a bare `BEGIN`)
///   has no snapshot, so no setting is refused there. `transaction_timestamp()` equals
///   `statement_timestamp()` during the first message of a transaction (PostgreSQL's
///   documentation of the two), and the batch's own transaction begins with its message; one
///   begun by an earlier message began earlier, and the `DO` block fails it. It comes after
///   the isolation level, which must be set before any snapshot, and before the settings; the
///   failure aborts the caller's transaction, the level set in it with it.
///
/// Neither adds a round trip. The `DO` block, compiled at every batch, costs about 25 µs of
/// the server's (PostgreSQL 15 over loopback: a batch that finds nothing went from 0.08 to
/// 0.11 ms; a batch that deletes takes milliseconds).
const OWN_TRANSACTION_ONLY: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED, NOT DEFERRABLE; \
     DO $idemdb$ BEGIN \
         IF transaction_timestamp() <> statement_timestamp() THEN \
             RAISE EXCEPTION USING ERRCODE = 'active_sql_transaction', \
                 MESSAGE = 'idemdb''s removal runs in transactions of its own: call maintain \
                            outside any transaction (this one is aborted: roll it back)'; \
         END IF; \
     END $idemdb$; ";

/// One batch of removal, as one simple query (one implicit transaction, at READ COMMITTED
/// whatever the session's default; inside a transaction of the caller's it fails with 25001
/// before its settings and its delete, see [`OWN_TRANSACTION_ONLY`]): the oldest rows expired
/// at `now_ms`, up to `limit`, deleted; its one row answers how many rows were chosen and how
/// many deleted. A row replaced since the statement began (a claim took the key
/// again) is looked at in its new version, which no longer qualifies, by the delete's own
/// condition (and by the lock's, with [`Locked::Skip`]).
///
/// The transaction commits without waiting for its WAL to reach the disk (`synchronous_commit`
/// off for it alone): a removal lost in a crash is only done again, and a claim that follows it
/// waits for its own WAL, which comes after the removal's. So removal adds no sync of its own
/// beside the claims'. The numbers are the library's own, written into the text as literals,
/// so each batch is planned for its bounds.
pub(crate) fn remove_expired_sql(records: &str, now_ms: i64, limit: i64, locked: Locked) -> String {
    let (wait, lock) = match locked {
        Locked::Wait => (
            format!("SET LOCAL lock_timeout = {REMOVAL_LOCK_TIMEOUT_MS}; "),
            "",
        ),
        Locked::Skip => (String::new(), " FOR UPDATE SKIP LOCKED"),
    };
    format!(
        "{OWN_TRANSACTION_ONLY}\
         SET LOCAL synchronous_commit TO off; {wait}\
         WITH doomed AS ( \
             SELECT ctid FROM {records} WHERE expires_at_ms <= {now_ms} \
             ORDER BY expires_at_ms LIMIT {limit}{lock} \
         ), removed AS ( \
             DELETE FROM {records} AS r USING doomed \
             WHERE r.ctid = doomed.ctid AND r.expires_at_ms <= {now_ms} RETURNING 1 \
         ) SELECT (SELECT count(*) FROM doomed), (SELECT count(*) FROM removed)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_times_past_int8_and_never_are_the_never_column() {
        assert_eq!(expires_column(1_000), 1_000);
        assert_eq!(expires_column(u64::MAX - 1), NEVER_MS);
        assert_eq!(expires_column(EXPIRES_NEVER_MS), NEVER_MS);
    }
}
