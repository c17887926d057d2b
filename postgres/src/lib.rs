//! idemdb's claims on PostgreSQL: the dedup memory of a fleet of competing consumers, in the
//! database they already run.
//!
//! The outcomes, fingerprints, limits and record format are the embedded engine's (this crate
//! uses `idemdb` without RocksDB): a handler written against one reads the same against the
//! other. A claim is a PostgreSQL transaction. `begin` opens it and claims the key; the caller
//! runs its business SQL in [`PgClaim::transaction`]; [`PgClaim::commit`] writes the completed
//! record and commits, so the marker and the business rows land together or not at all.
//! Dropping the claim rolls everything back and frees the key.
//!
//! **Exactly one winner, never a wait.** Every writer of a key holds the key's
//! transaction-level advisory lock (`pg_try_advisory_xact_lock` on a 64-bit hash of the table
//! and the stored key) while it reads and writes the key's row. A claimant that does not get the
//! lock gets `InProgress` at once. One that gets it reads the row in a second statement: under
//! READ COMMITTED each statement takes a fresh snapshot, and PostgreSQL makes a transaction's
//! commit visible before it releases its locks, so that read sees every earlier holder's
//! commit. The primary key on (consumer, message key) backs the lock up: a second insert of a
//! key fails instead of making a second record. Two keys whose hashes collide only get a
//! spurious `InProgress` while the other is held.
//!
//! **Batches.** [`PgConsumer::begin_batch`] claims a broker batch in one transaction: one
//! statement takes every key's lock, one reads every key's row, sent together; each message
//! gets a [`PgBatchOutcome`] (a key repeated in the batch is a duplicate of, or a conflict with,
//! its first copy), and [`PgClaimBatch::commit`] writes every winner's record in one statement
//! with the business SQL of the whole batch. Every key the batch locked stays locked until it
//! commits or drops (PostgreSQL frees transaction-level locks only then).
//!
//! **Reconciliation.** [`PgConsumer::in_progress`] lists external claims in progress;
//! [`PgConsumer::resolve`] completes one with a known result or releases it, under the key's
//! lock, whoever holds it: that holder's next step is `LeaseLost`.
//!
//! **Removal.** Records are range-partitioned by the day they become removable (schema
//! version 2; `install` migrates version 1). Reads are exact at the expiry millisecond
//! whatever is stored; [`PgStore::maintain`], run regularly, drops each day's partition once
//! all of it has expired: no `DELETE`, no dead rows, the same cost at any number of records.
//! Claims create the partitions of the days ahead before their transaction begins. Retention
//! is at most [`RETENTION_MS_MAX`] (60 days: every read looks into each day's partition).
//!
//! **Whose clock.** The database's (`statement_timestamp()`, in milliseconds) decides expiry
//! and commit times unless a [`idemdb::Clock`] is given (tests): the consumers' own clocks may
//! be skewed against each other without effect.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use idemdb::{Fingerprint, Outcome};
//! use idemdb_postgres::{Names, PgStore, install};
//!
//! let (mut client, connection) =
//!     tokio_postgres::connect("host=127.0.0.1 user=app dbname=shop", tokio_postgres::NoTls).await?;
//! tokio::spawn(connection);
//! install(&mut client, &Names::default()).await?; // once, at deployment
//! let store = PgStore::builder().open(&client).await?;
//! let billing = store.consumer("billing")?;
//! match billing.begin(&mut client, "order-1", Fingerprint::of(b"body")).await? {
//!     Outcome::Fresh(claim) => {
//!         claim
//!             .transaction()
//!             .execute("INSERT INTO orders (id) VALUES ('order-1')", &[])
//!             .await?;
//!         claim.commit(b"accepted").await?; // marker and order row: one transaction
//!     }
//!     Outcome::Duplicate { .. } => { /* processed before: acknowledge */ }
//!     Outcome::InProgress { .. } => { /* held elsewhere right now: nack */ }
//!     _ => { /* Conflict and the rest: dead-letter */ }
//! }
//! # Ok(())
//! # }
//! ```

// The lints of the embedded crate that apply here (CI runs clippy with `-D warnings`).
#![deny(unsafe_code)] // nothing here needs it
#![warn(missing_docs)] // every public item says what it does and what it refuses
#![warn(clippy::unwrap_used)] // bad input is an error value, never a panic (tests may unwrap)

mod batch;
mod error;
mod external;
mod schema;
mod ticket;
mod transfer;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idemdb::decision::{Found, inspect_record};
use idemdb::format::{Record, encode_key};
use idemdb::{Clock, EXPIRES_NEVER_MS, Fingerprint, Outcome, PreviousAttempt, RESULT_BYTES_MAX};
use schema::NEVER_MS;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Transaction};

pub use batch::{BATCH_MESSAGES_MAX, PgBatchOutcome, PgClaimBatch};
pub use error::{Error, Result};
pub use external::{
    LEASE_STEP_LOCK_WAIT, PgCompletion, PgExternalClaim, PgInProgress, PgResolution,
};
pub use schema::{DAY_MS, Names, SCHEMA_VERSION, install};
pub use ticket::PgLeaseTicket;
pub use transfer::{CorruptRow, ExportReport, IMPORT_TRANSACTION_RECORDS, ImportCounts};

/// How long a completed record is kept when the builder is not told: 7 days, as in the
/// embedded engine.
pub const RETENTION_MS_DEFAULT: u64 = 7 * 24 * 3600 * 1000;

/// The longest retention: 60 days. Records are partitioned by the day they become removable,
/// and every read looks into each partition, so the number of partitions (the retention in
/// days, plus two) is kept small.
pub const RETENTION_MS_MAX: u64 = 60 * DAY_MS as u64;

/// Builds a [`PgStore`].
#[derive(Debug)]
pub struct StoreBuilder {
    names: Names,
    retention_ms: u64,
    clock: Option<Arc<dyn Clock>>,
}

impl StoreBuilder {
    /// The tables to use (default `idemdb.records`).
    #[must_use]
    pub fn names(mut self, names: Names) -> StoreBuilder {
        self.names = names;
        self
    }

    /// How long a completed record answers `Duplicate` (default [`RETENTION_MS_DEFAULT`]).
    /// Longer than any redelivery can be.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> StoreBuilder {
        self.retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// Decides time with this clock instead of the database's (tests: `idemdb::MockClock`).
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> StoreBuilder {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Checks the tables and returns the store.
    ///
    /// # Errors
    /// [`Error::SchemaMissing`], [`Error::SchemaTooNew`] or [`Error::SchemaTooOld`] when the
    /// tables are not at [`SCHEMA_VERSION`]; [`Error::Idemdb`] for a retention of 0 or over
    /// [`RETENTION_MS_MAX`].
    pub async fn open(self, client: &Client) -> Result<PgStore> {
        if !(1..=RETENTION_MS_MAX).contains(&self.retention_ms) {
            return Err(Error::Idemdb(idemdb::Error::LimitExceeded {
                limit: idemdb::Limit::RetentionMs,
                actual: self.retention_ms,
                min: 1,
                max: RETENTION_MS_MAX,
            }));
        }
        schema::check(client, &self.names).await?;
        let records = self.names.records();
        Ok(PgStore {
            inner: Arc::new(Inner {
                read: format!(
                    "SELECT record FROM {records} WHERE consumer = $1 AND message_key = $2"
                ),
                insert: format!(
                    "INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                     VALUES ($1, $2, $3, $4)"
                ),
                update: format!(
                    "UPDATE {records} SET record = $3, expires_at_ms = $4 \
                     WHERE consumer = $1 AND message_key = $2"
                ),
                read_many: format!(
                    "SELECT message_key, record FROM {records} \
                     WHERE consumer = $1 AND message_key = ANY($2::bytea[])"
                ),
                // New rows are inserted (the primary key refuses a second record of a key);
                // replaced rows (expired, released, or an external claim whose lease ran out)
                // are updated. Both in one statement: every key appears in one of the two
                // lists only, and each returns the keys it wrote, so a key that was not
                // written is named.
                write_many: format!(
                    "WITH inserted AS ( \
                         INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                         SELECT $1, n.message_key, n.record, n.expires_at_ms \
                         FROM unnest($2::bytea[], $3::bytea[], $4::int8[]) \
                             AS n(message_key, record, expires_at_ms) \
                         RETURNING message_key \
                     ), updated AS ( \
                         UPDATE {records} AS r SET record = u.record, expires_at_ms = u.expires_at_ms \
                         FROM unnest($5::bytea[], $6::bytea[], $7::int8[]) \
                             AS u(message_key, record, expires_at_ms) \
                         WHERE r.consumer = $1 AND r.message_key = u.message_key \
                         RETURNING r.message_key \
                     ) \
                     SELECT message_key FROM inserted UNION ALL SELECT message_key FROM updated"
                ),
                never_expiring: format!(
                    "SELECT message_key, record FROM {records} \
                     WHERE consumer = $1 AND expires_at_ms = {NEVER_MS} ORDER BY message_key"
                ),
                lock_namespace: records,
                names: self.names,
                partitions_through_day: AtomicI64::new(i64::MIN),
                retention_ms: self.retention_ms,
                clock: self.clock,
            }),
        })
    }
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) read: String,
    pub(crate) insert: String,
    pub(crate) update: String,
    /// The rows of many keys of one consumer (a batch's read).
    pub(crate) read_many: String,
    /// Inserts and updates many rows of one consumer (a batch's commit).
    pub(crate) write_many: String,
    /// A consumer's rows without expiry: in-progress records (and completed ones that never
    /// expire).
    pub(crate) never_expiring: String,
    /// The records table's name, hashed into every key's lock so that two stores in one
    /// database do not share locks.
    pub(crate) lock_namespace: String,
    names: Names,
    /// The last day whose partition this process knows to exist (`i64::MIN`: none yet).
    partitions_through_day: AtomicI64,
    retention_ms: u64,
    clock: Option<Arc<dyn Clock>>,
}

/// The records tables of one database, opened. Cheap to clone; holds no connection: every call
/// takes the client (or pooled connection) to run on.
#[derive(Clone, Debug)]
pub struct PgStore {
    pub(crate) inner: Arc<Inner>,
}

impl PgStore {
    /// A builder with the defaults: tables `idemdb.records`, 7 days' retention, the database's
    /// clock.
    #[must_use]
    pub fn builder() -> StoreBuilder {
        StoreBuilder {
            names: Names::default(),
            retention_ms: RETENTION_MS_DEFAULT,
            clock: None,
        }
    }

    /// The handle of one consumer's records.
    ///
    /// # Errors
    /// [`Error::Idemdb`] with `LimitExceeded` for an id outside
    /// `CONSUMER_ID_BYTES_MIN..=CONSUMER_ID_BYTES_MAX`.
    pub fn consumer(&self, id: impl AsRef<[u8]>) -> Result<PgConsumer> {
        let id = id.as_ref();
        encode_key(id, b"-")?;
        Ok(PgConsumer {
            store: self.clone(),
            id: Bytes::copy_from_slice(id),
        })
    }
}

/// One consumer's records: claims, and reads of what was recorded.
#[derive(Clone, Debug)]
pub struct PgConsumer {
    pub(crate) store: PgStore,
    pub(crate) id: Bytes,
}

impl PgConsumer {
    /// Claims `key` for a message with `fingerprint`, in a new transaction on `client`. Never
    /// waits for another holder. `Fresh` hands out the transaction in its claim; every other
    /// outcome has rolled it back.
    ///
    /// # Errors
    /// [`Error::Idemdb`] for a key outside the limits; [`Error::Corrupt`] for a stored record
    /// that does not decode; [`Error::Postgres`] when the database fails (nothing is written).
    pub async fn begin<'c>(
        &self,
        client: &'c mut Client,
        key: impl AsRef<[u8]>,
        fingerprint: Fingerprint,
    ) -> Result<Outcome<PgClaim<'c>>> {
        let key = key.as_ref();
        let stored_key = encode_key(&self.id, key)?;
        let lock_number = lock_id(&self.store.inner.lock_namespace, &stored_key);
        let tx = crate::claim_transaction(client, &self.store).await?;
        // The lock and the read go out together (one round trip), as two statements: the
        // server runs them in order, and the read's snapshot is taken when it starts, after
        // the lock was granted, so it sees the commit of whoever held the lock before. (One
        // statement would read with a snapshot taken before the lock.) Without the lock, the
        // read's answer is not looked at.
        // Typed statements go out whole (no prepare step first), so both are on the wire
        // before either is answered.
        let lock_params: [(&(dyn ToSql + Sync), Type); 1] = [(&lock_number, Type::INT8)];
        let lock_statement = tx.query_typed_one(
            "SELECT pg_try_advisory_xact_lock($1), \
             floor(extract(epoch FROM statement_timestamp()) * 1000)::int8",
            &lock_params,
        );
        let read_statement = self.read(&tx, key);
        let (lock, record) = futures_util::future::join(lock_statement, read_statement).await;
        let lock = lock?;
        let locked: bool = lock.get(0);
        let now_ms = self.store.now_ms(lock.get(1));
        if !locked {
            tx.rollback().await?;
            return Ok(Outcome::held_by_claim(now_ms));
        }
        let record = record?;
        match inspect_record(record, fingerprint, now_ms) {
            Found::Claimable {
                replaces_epoch,
                previous,
            } => Ok(Outcome::Fresh(PgClaim {
                tx,
                store: self.store.clone(),
                consumer: self.id.clone(),
                key: key.to_vec(),
                fingerprint,
                replaces_epoch,
                previous,
            })),
            Found::Settled(outcome) => {
                tx.rollback().await?;
                Ok(outcome.map_fresh(|never| match never {}))
            }
        }
    }

    /// The record stored under `key`, as it is (it may be expired; see
    /// [`Record::is_absent_at`]).
    ///
    /// # Errors
    /// [`Error::Idemdb`] for a key outside the limits; [`Error::Corrupt`]; [`Error::Postgres`].
    pub async fn get(&self, client: &Client, key: impl AsRef<[u8]>) -> Result<Option<Record>> {
        let key = key.as_ref();
        encode_key(&self.id, key)?;
        self.read(client, key).await
    }
}

/// Decodes a stored record of `key`; one that does not decode is reported, never overwritten.
pub(crate) fn decode_record(key: &[u8], bytes: &[u8]) -> Result<Record> {
    Record::decode(bytes).map_err(|error| Error::Corrupt {
        key: key.to_vec(),
        detail: error.to_string(),
    })
}

/// A won claim: a live transaction that holds the key. Run the business SQL in
/// [`PgClaim::transaction`], then [`PgClaim::commit`]. Dropped instead, it rolls back: nothing
/// of it lands, and the key is free again.
pub struct PgClaim<'c> {
    tx: Transaction<'c>,
    store: PgStore,
    consumer: Bytes,
    key: Vec<u8>,
    fingerprint: Fingerprint,
    replaces_epoch: u64,
    previous: Option<PreviousAttempt>,
}

impl std::fmt::Debug for PgClaim<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgClaim")
            .field("consumer", &self.consumer)
            .field("key", &idemdb::format::printable(&self.key))
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl<'c> PgClaim<'c> {
    /// The claim's transaction, for the business SQL. Do not commit or roll it back yourself:
    /// [`PgClaim::commit`] does, and dropping the claim rolls back.
    #[must_use]
    pub fn transaction(&self) -> &Transaction<'c> {
        &self.tx
    }

    /// The epoch the committed record will have.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.replaces_epoch.saturating_add(1)
    }

    /// The external attempt this claim took over after its lease ran out, if any.
    #[must_use]
    pub fn previous_attempt(&self) -> Option<&PreviousAttempt> {
        self.previous.as_ref()
    }

    /// Rolls the claim back, business SQL included, and returns once the server has: the key
    /// is free for the next claimant then. (Dropping the claim rolls back too, but without
    /// waiting: the key is free a moment later.)
    ///
    /// # Errors
    /// [`Error::Postgres`] when the connection failed; the server then rolls back on its own
    /// when it notices.
    pub async fn abort(self) -> Result<()> {
        self.tx.rollback().await?;
        Ok(())
    }

    /// Writes the completed record with `result` (returned to duplicates) and commits the
    /// transaction: the record and the business SQL land together or not at all.
    ///
    /// # Errors
    /// [`Error::Idemdb`] for a result over `RESULT_BYTES_MAX` (nothing is written; the
    /// transaction rolls back). [`Error::Postgres`] when a statement or the commit fails; if the
    /// connection dropped during the commit its outcome is unknown: do not acknowledge the
    /// message, and its redelivery finds `Duplicate` or `Fresh`, never half of it.
    pub async fn commit(self, result: impl AsRef<[u8]>) -> Result<()> {
        let consumer = PgConsumer {
            store: self.store.clone(),
            id: self.consumer.clone(),
        };
        write_completed(
            &self.tx,
            &consumer,
            &self.key,
            self.fingerprint,
            self.epoch(),
            self.replaces_epoch != 0,
            result.as_ref(),
            true,
        )
        .await?;
        self.tx.commit().await?;
        Ok(())
    }
}

/// What [`PgStore::maintain`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Maintenance {
    /// The last day (since 1970-01-01, UTC) whose partition now exists.
    pub partitions_through_day: i64,
    /// The day partitions dropped, every row of them expired.
    pub dropped: Vec<String>,
}

impl PgStore {
    /// Creates the partitions of the days ahead and drops those whose rows have all expired.
    /// Run it regularly (hourly, say, from one process or several): removal is one dropped
    /// partition per day, never a `DELETE` of rows, so it costs the same at any number of
    /// records and leaves no dead rows behind. A dropped partition is first detached
    /// concurrently (a lock that claims do not wait for), so claims go on meanwhile.
    ///
    /// Claims create the partitions they need on their own (before their transaction, once a
    /// day per process); only removal needs this call. Without it, expired records stay
    /// (reads treat them as absent, exactly at their expiry millisecond) and take space.
    ///
    /// # Errors
    /// [`Error::Postgres`] when a statement fails. A detach interrupted by a lost connection is
    /// finished by the next call.
    pub async fn maintain(&self, client: &mut Client) -> Result<Maintenance> {
        let through_day = self.ensure_partitions(client, true).await?;
        let now_ms = i64::try_from(now_on_store_clock(&*client, self).await?).unwrap_or(i64::MAX);
        let mut dropped = Vec::new();
        for partition in schema::day_partitions(client, &self.inner.names).await? {
            // Every row of day d is removable from (d + 1) days on.
            if (partition.day + 1).saturating_mul(DAY_MS) <= now_ms {
                schema::drop_partition(client, &self.inner.names, &partition).await?;
                dropped.push(partition.name);
            }
        }
        Ok(Maintenance {
            partitions_through_day: through_day,
            dropped,
        })
    }

    /// Makes sure the partitions from today through the day after the last a record written
    /// now can expire on exist; skipped when this process already made sure, unless `always`.
    /// Reads the local clock (or the injected one): the extra day covers a database clock
    /// ahead of it.
    async fn ensure_partitions(&self, client: &mut Client, always: bool) -> Result<i64> {
        let now_ms = match &self.inner.clock {
            Some(clock) => clock.now_ms(),
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| {
                    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
                }),
        };
        let day_of = |ms: u64| i64::try_from(ms).unwrap_or(i64::MAX) / DAY_MS;
        let first_day = day_of(now_ms);
        let last_day = day_of(now_ms.saturating_add(self.inner.retention_ms)) + 1;
        let known = &self.inner.partitions_through_day;
        if !always && known.load(Ordering::Acquire) >= last_day {
            return Ok(known.load(Ordering::Acquire));
        }
        schema::ensure_partitions(client, &self.inner.names, first_day, last_day).await?;
        known.fetch_max(last_day, Ordering::AcqRel);
        Ok(last_day)
    }

    /// Now, on the store's clock: the injected one, or the database's reading `db_now_ms`.
    pub(crate) fn now_ms(&self, db_now_ms: i64) -> u64 {
        match &self.inner.clock {
            Some(clock) => clock.now_ms(),
            None => u64::try_from(db_now_ms).unwrap_or(0),
        }
    }
}

/// Writes the completed record of `key` at `epoch` in `tx`: an update of the row there is
/// (`replaces`), else an insert. `succeeded` false records a failure as the result. Errors
/// come before any COMMIT is sent: PostgreSQL answers a COMMIT of a transaction a failed
/// statement aborted with a rollback and no error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write_completed(
    tx: &Transaction<'_>,
    consumer: &PgConsumer,
    key: &[u8],
    fingerprint: Fingerprint,
    epoch: u64,
    replaces: bool,
    result: &[u8],
    succeeded: bool,
) -> Result<()> {
    check_result(result)?;
    let now_ms = now_on_store_clock(tx, &consumer.store).await?;
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

/// Now on the store's clock: the injected one, or the database's wall clock at this statement
/// (`clock_timestamp()`, not the transaction's start: a claim may be held a while before it
/// commits, and its record's retention runs from the commit). Commits and removal read it.
pub(crate) async fn now_on_store_clock(
    client: &impl tokio_postgres::GenericClient,
    store: &PgStore,
) -> Result<u64> {
    Ok(match &store.inner.clock {
        Some(clock) => clock.now_ms(),
        None => {
            let row = client
                .query_one(
                    "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8",
                    &[],
                )
                .await?;
            u64::try_from(row.get::<_, i64>(0)).unwrap_or(0)
        }
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
/// never (and for a time past what int8 holds), which puts the row in the open partition.
pub(crate) fn expires_column(removable_at_ms: u64) -> i64 {
    if removable_at_ms == EXPIRES_NEVER_MS {
        return NEVER_MS;
    }
    i64::try_from(removable_at_ms).unwrap_or(NEVER_MS)
}

/// Writes `record` as the row of `key` (an update when `replaces`, else an insert), removable
/// from `removable_at_ms` on.
pub(crate) async fn write_record(
    tx: &Transaction<'_>,
    consumer: &PgConsumer,
    key: &[u8],
    record: &Record,
    removable_at_ms: u64,
    replaces: bool,
) -> Result<()> {
    let inner = &consumer.store.inner;
    let expires_column = expires_column(removable_at_ms);
    let params: [&(dyn ToSql + Sync); 4] = [
        &consumer.id.as_ref(),
        &key,
        &record.encode(),
        &expires_column,
    ];
    let statement = if replaces {
        &inner.update
    } else {
        &inner.insert
    };
    let written = tx.execute(statement, &params).await?;
    if written != 1 {
        return Err(Error::LostKey { key: key.to_vec() });
    }
    Ok(())
}

/// Opens the transaction of a claim or a lease step: READ COMMITTED whatever the database's
/// default, as the claim's read must take its snapshot after the key's lock was granted,
/// which only READ COMMITTED does per statement (under REPEATABLE READ the first statement's
/// snapshot would hide the previous holder's commit). Before it, makes sure the partitions the
/// transaction may write into exist (see [`PgStore::maintain`]): DDL never runs inside a
/// claim.
pub(crate) async fn claim_transaction<'c>(
    client: &'c mut Client,
    store: &PgStore,
) -> Result<Transaction<'c>> {
    store.ensure_partitions(client, false).await?;
    Ok(client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
        .start()
        .await?)
}

/// The advisory lock of a stored key in a table: a 64-bit hash of both.
fn lock_id(namespace: &str, stored_key: &[u8]) -> i64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(namespace.as_bytes());
    hasher.update(&[0]);
    hasher.update(stored_key);
    i64::from_ne_bytes(hasher.digest().to_ne_bytes())
}
