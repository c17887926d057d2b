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
//! commit. Two keys whose hashes collide only get a spurious `InProgress` while the other is
//! held.
//!
//! **Two round trips.** `BEGIN`, the lock and the read go out together, and so do the record's
//! write and `COMMIT`: a claim and its commit cost two round trips besides the caller's SQL.
//! The commit's time is the database's clock read by the claim's lock statement, advanced by
//! this process's monotonic clock since. A handler whose SQL does not depend on the answer
//! sends it with the claim instead: [`PgConsumer::apply`] costs one round trip for a new key.
//!
//! **Batches.** [`PgConsumer::begin_batch`] claims a broker batch in one transaction: one
//! statement takes every key's lock, one reads every key's row, sent together; each message
//! gets a [`PgBatchOutcome`] (a key repeated in the batch is a duplicate of, or a conflict with,
//! its first copy), and [`PgClaimBatch::commit`] writes every winner's record in one statement
//! with the business SQL of the whole batch. Every key the batch locked stays locked until it
//! commits or drops (PostgreSQL frees transaction-level locks only then).
//! [`PgConsumer::begin_batch_messages`] takes whole messages, with the admission floor and the
//! ordering guard, as the embedded engine's batch does.
//!
//! **Reconciliation.** [`PgConsumer::in_progress`] lists external claims in progress;
//! [`PgConsumer::resolve`] completes one with a known result or releases it, under the key's
//! lock, whoever holds it: that holder's next step is `LeaseLost`.
//!
//! **Admission floor and ordering guard**, as the embedded engine's, through
//! [`PgConsumer::begin_message`] and an [`idemdb::Message`]: with
//! [`StoreBuilder::admission_floor`] on, a message produced longer ago than the retention is
//! `TooLate`; a message carrying `version(entity, v)` is claimed only if `v` is newer than the
//! entity's highest applied version (kept in the versions table, schema version 3, written by
//! the commit in the claim's transaction), else `Stale`, and `InProgress` at once while another
//! claim of the entity is open (the entity's own advisory lock).
//!
//! **Downstream keys.** [`PgClaim::derive_key`] (and the external and batch claims') is the
//! embedded derivation: the same key for the same consumer, message key and step on both
//! backends.
//!
//! **Observability.** The embedded engine's metric names, labels and `tracing` events (see
//! idemdb's crate docs, Observability), with the label `backend="postgres"` on every series
//! (the embedded engine's carry `backend="rocksdb"`) and the field `backend = "postgres"` on
//! every event (which the embedded engine's lack): `idemdb_outcomes_total`,
//! `idemdb_commits_total`, `idemdb_lease_lost_total`, `idemdb_claim_seconds`,
//! `idemdb_commit_seconds`, `idemdb_duplicate_age_seconds`, and the gauge
//! `idemdb_in_progress`: external claims alive in this process (begun or resumed, not yet
//! completed, released, failed or dropped; clones of a claim count once). The handles are
//! registered when a consumer's handle is made ([`PgStore::consumer`]): install the recorder
//! first. Not here: the opener's extra labels.
//!
//! **Removal.** Records are range-partitioned by the day they become removable (schema
//! version 2 on; `install` migrates older versions), one day per partition unless the table was
//! installed with wider ones ([`InstallOptions::partition_days`]). Reads are exact at the expiry
//! millisecond whatever is stored; [`PgStore::maintain`], run regularly, drops each partition
//! once all of it has expired: no `DELETE`, no dead rows, the same cost at any number of
//! records. Claims create the partitions of the days ahead before their transaction begins.
//! Every read of a key looks into each partition that may hold a live record, about
//! `retention / partition_days + 2` of them: with the default 7 days' retention, weekly
//! partitions make a read look into 3 instead of 9 (and keep expired records up to a week
//! longer). Retention is at most [`RETENTION_MS_MAX`] (60 days).
//!
//! **Whose clock.** The database's (`statement_timestamp()`, in milliseconds) decides expiry
//! and commit times unless a [`idemdb::Clock`] is given (tests): the consumers' own clocks may
//! be skewed against each other without effect.
//!
//! **Which millisecond.** Every bound is "at or after": a record whose expiry is `t` answers
//! `Duplicate` through `t - 1` and is claimable again from `t` on; a lease that runs until
//! `lease_until_ms` holds the key through `lease_until_ms - 1`, and from `lease_until_ms` on
//! another claimant takes it over (the holder's next step is `LeaseLost`). The partition
//! `<table>_d<N>` of width `W` days holds the rows removable from `N * DAY_MS` through
//! `(N + W) * DAY_MS - 1`, and [`PgStore::maintain`] drops it from `(N + W) * DAY_MS` on, when
//! every row of it has expired.
//!
//! **When a call fails, the key is free.** A call that returns an error (a claim's commit
//! refused before anything was sent, a statement's failure, a record that does not decode) has
//! rolled its transaction back and waited for the server to say so: the key's lock is free
//! when the error reaches the caller, and another connection's claim of it finds it free. Only
//! a claim (or batch) dropped without `commit` or `abort` frees its keys a moment later: its
//! rollback is sent without waiting. A lost connection frees them when the server notices.
//!
//! **Connections.** Every call takes the caller's `Client`. Any call may run on any connection,
//! and a connection built where a dropped one was (a reconnect into the same variable or
//! field) serves every call as a new one: the statements the store prepared on the old
//! connection are missing on the new one, and each call that meets one prepares them anew and
//! runs again, before anything is written (see [`StoreBuilder::prepared_statements`]); that
//! holds for [`PgConsumer::apply`], which starts a claim and commits it in one call, as for
//! `begin` and the commits. A store statement deallocated on the connection (`DEALLOCATE`
//! run by the caller, inside a claim or between calls) is found missing when a commit sends
//! it, which may be the commit of a later claim: that commit fails with
//! [`Error::StatementDeallocated`], retryable, nothing written, and the statements are
//! prepared anew.
//!
//! **Upgrading an older install.** [`SCHEMA_VERSION`] is 4. A store opened on tables at
//! versions 1 to 3 (written by earlier releases) is refused with [`Error::SchemaTooOld`] and
//! nothing is touched; [`install`] migrates them in one transaction, under the installers'
//! lock: version 3 gains the recorded partition width (1 day, the width it was made with),
//! version 2 also the ordering guard's versions table, and version 1 (one plain table) is
//! copied into day partitions: every record whose removal time has not passed is kept, and
//! those whose has (they read as absent already) are left out, as removal would drop them. Stop the consumers of the old release first
//! (a version 1 table is replaced under them), run `install` once with the new release, then
//! start the new consumers; the old release refuses the migrated tables with `SchemaTooNew`.
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

mod apply;
mod batch;
mod error;
mod external;
mod observe;
mod pipeline;
mod prepared;
mod schema;
mod ticket;
mod transfer;
mod txn;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemdb::decision::{Found, admit, guard_order, inspect_record};
use idemdb::format::{Record, derive_key, encode_key};
use idemdb::{
    Clock, EXPIRES_NEVER_MS, Fingerprint, Message, Outcome, PreviousAttempt, RESULT_BYTES_MAX,
};
use observe::ConsumerMetrics;
use schema::NEVER_MS;
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};
/// A statement of the caller's with its parameters and their types, sent unnamed (it needs no
/// round trip to be prepared): see [`PgClaim::commit_with`].
pub use txn::Statement as TypedStatement;
use txn::{ClaimTransaction, CommitFailed, LOST_ROW};

pub use apply::{Applied, CLOCK_TOLERANCE_MS};
pub use batch::{BATCH_MESSAGES_MAX, PgBatchOutcome, PgClaimBatch};
pub use error::{Error, Result};
pub use external::{
    LEASE_STEP_LOCK_WAIT, PgCompletion, PgExternalClaim, PgInProgress, PgResolution,
};
pub use schema::{
    DAY_MS, InstallOptions, Names, PARTITION_DAYS_MAX, SCHEMA_VERSION, install, install_with,
};
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
    admission_floor: bool,
    prepared_statements: bool,
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

    /// The admission floor, as the embedded engine's: when on, a message whose production time
    /// ([`Message::produced_at_ms`]) is at or before now minus the retention, and whose key
    /// is claimable (no live record), is [`Outcome::TooLate`] instead of new: its record may
    /// have expired already. "Now" is the store's clock (the database's). A key with a live
    /// record is reported as usual. Default off (such a message is treated as new).
    ///
    /// ```no_run
    /// # async fn example(client: &tokio_postgres::Client) -> Result<(), idemdb_postgres::Error> {
    /// let store = idemdb_postgres::PgStore::builder()
    ///     .retention(std::time::Duration::from_secs(3 * 24 * 3600))
    ///     .admission_floor(true) // messages produced over 3 days ago are TooLate
    ///     .open(client)
    ///     .await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn admission_floor(mut self, on: bool) -> StoreBuilder {
        self.admission_floor = on;
        self
    }

    /// Whether the store's statements for single messages and leases are prepared once per
    /// connection (default on): parsed once, their plans kept, where an unnamed statement is
    /// parsed and planned over every day partition at every run. In the comparison harness
    /// that made a claim with its commit about a fifth faster at 1 client and a tenth at 32.
    /// The kept plans always look keys up in the index, however small the table was when
    /// they were made. Batches are planned at every run either way. Turn it off behind a pooler that hands each transaction to any server
    /// connection and does not track prepared statements (PgBouncer in transaction mode
    /// before 1.21, or without `max_prepared_statements`): there a statement prepared on one
    /// server connection is missing on the next.
    ///
    /// The statements are kept per connection, by the address of the `Client` passed in
    /// (tokio-postgres gives a connection no other name): a client that moves in memory
    /// prepares them again, and one built where a dropped client was finds the old ones
    /// missing on the server, forgets them and prepares them anew: every call that starts a
    /// transaction (`begin`, `apply`, a batch, an external claim and its steps) meets the
    /// missing statements there, before anything of it is written, and runs once more on its
    /// own. A statement deallocated on the connection (`DEALLOCATE`) that a claim's start did
    /// not send fails the commit that sends it with [`Error::StatementDeallocated`]
    /// (retryable, nothing written).
    #[must_use]
    pub fn prepared_statements(mut self, on: bool) -> StoreBuilder {
        self.prepared_statements = on;
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
        let partition_days = schema::check(client, &self.names).await?;
        let records = self.names.records();
        let entity = self.names.entity_versions();
        Ok(PgStore {
            inner: Arc::new(Inner {
                read: format!(
                    "SELECT record FROM {records} WHERE consumer = $1 AND message_key = $2"
                ),
                insert: format!(
                    "INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                     VALUES ($1, $2, $3, $4)"
                ),
                // An update of a row that is gone writes nothing and says nothing; this one
                // divides by the rows it wrote, so that it fails instead (`LOST_ROW`): the
                // COMMIT sent behind it then rolls back.
                update: format!(
                    "WITH updated AS ( \
                         UPDATE {records} SET record = $3, expires_at_ms = $4 \
                         WHERE consumer = $1 AND message_key = $2 RETURNING 1 \
                     ) SELECT 1 / count(*)::int4 FROM updated"
                ),
                read_many: format!(
                    "SELECT message_key, record FROM {records} \
                     WHERE consumer = $1 AND message_key = ANY($2::bytea[])"
                ),
                insert_if_new: apply::insert_if_new_sql(&records),
                insert_many: format!(
                    "INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                     SELECT $1, n.message_key, n.record, n.expires_at_ms \
                     FROM unnest($2::bytea[], $3::bytea[], $4::int8[]) \
                         AS n(message_key, record, expires_at_ms)"
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
                read_version: format!(
                    "SELECT version FROM {entity} WHERE consumer = $1 AND entity_key = $2"
                ),
                // Under the entity's lock the version is always newer; the condition backs the
                // lock up, and a row it leaves unwritten fails the statement (`LOST_ROW`), as
                // the update of a record does.
                write_version: format!(
                    "WITH written AS ( \
                         INSERT INTO {entity} AS e (consumer, entity_key, version) \
                         VALUES ($1, $2, $3) \
                         ON CONFLICT (consumer, entity_key) DO UPDATE SET version = excluded.version \
                         WHERE e.version < excluded.version RETURNING 1 \
                     ) SELECT 1 / count(*)::int4 FROM written"
                ),
                // The versions of a batch's fresh messages, one per entity (the batch gives an
                // entity to one message at most); every row must be written, as above.
                write_versions_many: format!(
                    "WITH written AS ( \
                         INSERT INTO {entity} AS e (consumer, entity_key, version) \
                         SELECT $1, v.entity_key, v.version \
                         FROM unnest($2::bytea[], $3::bytea[]) AS v(entity_key, version) \
                         ON CONFLICT (consumer, entity_key) DO UPDATE SET version = excluded.version \
                         WHERE e.version < excluded.version RETURNING 1 \
                     ) SELECT 1 / (count(*) = cardinality($2::bytea[]))::int4 FROM written"
                ),
                read_versions_many: format!(
                    "SELECT entity_key, version FROM {entity} \
                     WHERE consumer = $1 AND entity_key = ANY($2::bytea[])"
                ),
                lock_namespace: records,
                entity_lock_namespace: entity,
                names: self.names,
                partitions_through_day: AtomicI64::new(i64::MIN),
                retention_ms: self.retention_ms,
                admission_floor: self.admission_floor,
                statements: Arc::new(prepared::StatementCache::new(self.prepared_statements)),
                batch_statements: Arc::new(prepared::StatementCache::new(false)),
                clock: self.clock,
                clock_offset: apply::ClockOffset::unknown(),
                partition_days,
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
    /// Inserts a new key's completed record unless the key has a row ([`PgConsumer::apply`]).
    pub(crate) insert_if_new: String,
    /// Inserts many rows of one consumer (a batch's commit where every key was new).
    pub(crate) insert_many: String,
    /// Inserts and updates many rows of one consumer (a batch's commit).
    pub(crate) write_many: String,
    /// A consumer's rows without expiry: in-progress records (and completed ones that never
    /// expire).
    pub(crate) never_expiring: String,
    /// The ordering guard's read of an entity's highest applied version.
    pub(crate) read_version: String,
    /// The ordering guard's write of an entity's new version (at a claim's commit).
    pub(crate) write_version: String,
    /// The versions of many entities of one consumer (a batch's ordering guard).
    pub(crate) read_versions_many: String,
    /// The new versions of many entities (a batch's commit).
    pub(crate) write_versions_many: String,
    /// The records table's name, hashed into every key's lock so that two stores in one
    /// database do not share locks.
    pub(crate) lock_namespace: String,
    /// The versions table's name, hashed into every entity's lock (see [`entity_lock_id`]).
    pub(crate) entity_lock_namespace: String,
    names: Names,
    /// The last day whose partition this process knows to exist (`i64::MIN`: none yet).
    partitions_through_day: AtomicI64,
    retention_ms: u64,
    /// The admission floor is on: [`StoreBuilder::admission_floor`].
    admission_floor: bool,
    /// The statements above, prepared on each connection the store ran on.
    pub(crate) statements: Arc<prepared::StatementCache>,
    /// Batches' statements are sent unnamed, planned at every run: a batch's read is then
    /// planned for its own keys, and planning is little beside the batch's rows. (Kept plans
    /// made the harness's 64-message batches slower: 10k against 17k messages/s.)
    pub(crate) batch_statements: Arc<prepared::StatementCache>,
    clock: Option<Arc<dyn Clock>>,
    /// The database's clock against this process's, as the last claim saw them.
    clock_offset: apply::ClockOffset,
    /// The width of the records' partitions, in days, as installed.
    partition_days: u32,
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
            admission_floor: false,
            prepared_statements: true,
            clock: None,
        }
    }

    /// The handle of one consumer's records. Its metric handles are registered now, with the
    /// `metrics` recorder installed at this moment (install it first), as the embedded engine
    /// does.
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
            metrics: Arc::new(ConsumerMetrics::new(id)),
        })
    }
}

/// One consumer's records: claims, and reads of what was recorded.
#[derive(Clone, Debug)]
pub struct PgConsumer {
    pub(crate) store: PgStore,
    pub(crate) id: Bytes,
    pub(crate) metrics: Arc<ConsumerMetrics>,
}

impl PgConsumer {
    /// Claims `key` for a message with `fingerprint`, in a new transaction on `client`. Never
    /// waits for another holder. `Fresh` hands out the transaction in its claim; every other
    /// outcome has rolled it back. The same as [`PgConsumer::begin_message`] with a message of
    /// only a key and a fingerprint.
    ///
    /// `client` must not be in a transaction of the caller's: PostgreSQL answers the claim's
    /// `START TRANSACTION` there with a warning only, so the claim would run inside it, and
    /// its commit or rollback would end the caller's earlier statements with it. The same
    /// holds for every call that takes a `&mut Client`. The caller's statements given to
    /// [`PgClaim::commit_with`] or [`PgConsumer::apply`] must not end the transaction either
    /// (`COMMIT`, `ROLLBACK`): the record is written after them.
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
        self.begin_message(client, &Message::new(key.as_ref(), fingerprint))
            .await
    }

    /// Like [`PgConsumer::begin`], for an [`idemdb::Message`] that may carry its production
    /// time (the admission floor: [`StoreBuilder::admission_floor`]), an entity version (the
    /// ordering guard) and a correlation id (carried into the log events).
    ///
    /// **Ordering guard.** A message with `version(entity, v)` is claimed only if `v` is newer
    /// than the entity's highest applied version, which the claim's commit records in the same
    /// transaction; otherwise it is [`Outcome::Stale`] with that version. The claim holds the
    /// entity's own advisory lock until it ends, so another message of the same entity meanwhile
    /// gets `InProgress` at once (never a wait), whatever its key. The entity key follows the
    /// message-key limits. The entity is looked at only when the key is claimable: a duplicate
    /// stays a duplicate whatever its version.
    ///
    /// ```no_run
    /// # async fn example(client: &mut tokio_postgres::Client, customers: idemdb_postgres::PgConsumer)
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// use idemdb::{Fingerprint, Message, Outcome};
    /// let message = Message::new("event-981", Fingerprint::of(b"address changed"))
    ///     .version("customer-7", 12) // the 12th change of customer 7
    ///     .correlation_id("req-9f2c");
    /// match customers.begin_message(client, &message).await? {
    ///     Outcome::Fresh(claim) => claim.commit(b"applied").await?, // records version 12 too
    ///     Outcome::Stale { .. } => { /* 12 or newer applied already: acknowledge */ }
    ///     _ => { /* as for begin */ }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As for [`PgConsumer::begin`]; [`Error::Idemdb`] with `LimitExceeded` for an entity key
    /// outside the message-key limits; [`Error::Corrupt`] for a stored version that is not 8
    /// bytes.
    pub async fn begin_message<'c>(
        &self,
        client: &'c mut Client,
        message: &Message<'_>,
    ) -> Result<Outcome<PgClaim<'c>>> {
        let started = Instant::now();
        let (now_ms, outcome) = self.claim_message(client, message).await?;
        self.metrics.begun(
            &outcome,
            now_ms,
            started.elapsed(),
            message.key(),
            message.correlation(),
        );
        Ok(outcome)
    }

    /// `begin_message` without its metrics and log: the locks, the reads and the decision, and
    /// the time it was decided at (the store's clock).
    async fn claim_message<'c>(
        &self,
        client: &'c mut Client,
        message: &Message<'_>,
    ) -> Result<(u64, Outcome<PgClaim<'c>>)> {
        let key = message.key();
        let stored_key = encode_key(&self.id, key)?;
        let inner = &self.store.inner;
        let lock_number = lock_id(&inner.lock_namespace, &stored_key);
        // The ordering guard's entity, checked before anything is sent.
        let entity = match message.entity_version() {
            Some((entity_key, version)) => {
                let stored_entity = encode_key(&self.id, entity_key)?;
                let (high, low) = entity_lock_id(&inner.entity_lock_namespace, &stored_entity);
                Some((entity_key, version, high, low))
            }
            None => None,
        };
        self.store.ensure_partitions(client, false).await?;
        // BEGIN, the locks and the reads go out together (one round trip), as separate
        // statements: the server runs them in order, and each read's snapshot is taken when it
        // starts, after the locks were granted, so it sees the commit of whoever held the lock
        // before. (One statement would read with a snapshot taken before the lock.) Without
        // its lock, a read's answer is not looked at.
        let (high, low) = entity.map_or((0, 0), |(_, _, high, low)| (high, low));
        let lock_params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&lock_number, Type::INT8),
            (&high, Type::INT4),
            (&low, Type::INT4),
        ];
        let id: &[u8] = &self.id;
        let entity_key: &[u8] = entity.map_or(&[], |(entity_key, ..)| entity_key);
        let read_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&id, Type::BYTEA), (&key, Type::BYTEA)];
        let version_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&id, Type::BYTEA), (&entity_key, Type::BYTEA)];
        let mut statements: Vec<TypedStatement<'_>> = vec![
            if entity.is_some() {
                (LOCK_KEY_AND_ENTITY, &lock_params[..])
            } else {
                (LOCK_KEY, &lock_params[..1])
            },
            (&inner.read, &read_params),
        ];
        if entity.is_some() {
            statements.push((&inner.read_version, &version_params));
        }
        let (mut tx, answers) =
            ClaimTransaction::begin_with(client, &inner.statements, &statements).await?;
        let decided_at = Instant::now();
        let entity = entity.map(|(entity_key, version, ..)| (entity_key, version));
        // An error here (a record that does not decode, say) leaves the key's lock held until
        // the rollback: waited for, so that the key is free when the error returns.
        let decided = decide_claim(self, answers, message, entity);
        let Decided {
            db_now_ms,
            now_ms,
            verdict,
        } = tx.release_on_error(decided).await?;
        let Claimable {
            replaces_epoch,
            previous,
            version,
        } = match verdict {
            Ok(claimable) => claimable,
            Err(outcome) => {
                tx.rollback().await?;
                return Ok((now_ms, outcome.map_fresh(|never| match never {})));
            }
        };
        let claim = PgClaim {
            tx,
            decided_at: (db_now_ms, decided_at),
            consumer: self.clone(),
            key: key.to_vec(),
            stored_key,
            fingerprint: message.fingerprint(),
            replaces_epoch,
            previous,
            version,
            correlation_id: message.correlation().map(Into::into),
        };
        Ok((now_ms, Outcome::Fresh(claim)))
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

/// What a claim's first round trip decided, before anything is written.
struct Decided {
    /// The database's clock in the lock statement.
    db_now_ms: i64,
    /// Now on the store's clock.
    now_ms: u64,
    /// The key claimable, or the outcome that settles the message without a claim.
    verdict: std::result::Result<Claimable, Outcome<std::convert::Infallible>>,
}

/// A claimable key: what the claim replaces and records.
struct Claimable {
    replaces_epoch: u64,
    previous: Option<PreviousAttempt>,
    /// The ordering guard's (entity key, version) to record.
    version: Option<(Vec<u8>, u64)>,
}

/// Decides a claim from the answers of its lock statement, its read and (with an entity
/// version) the entity's read: no I/O.
fn decide_claim(
    consumer: &PgConsumer,
    answers: txn::Answers,
    message: &Message<'_>,
    entity: Option<(&[u8], u64)>,
) -> Result<Decided> {
    let inner = &consumer.store.inner;
    let key = message.key();
    let mut answers = answers.into_iter();
    let mut next_rows = || answers.next().unwrap_or_else(|| Ok(Vec::new()));
    let lock = txn::single_row(next_rows()?)?;
    let record = next_rows();
    let current_version = next_rows();
    let db_now_ms: i64 = lock.get(1);
    inner.clock_offset.learn(db_now_ms);
    let now_ms = consumer.store.now_ms(db_now_ms);
    let decided = |verdict| {
        Ok(Decided {
            db_now_ms,
            now_ms,
            verdict,
        })
    };
    if !lock.get::<_, bool>(0) {
        return decided(Err(Outcome::held_by_claim(now_ms)));
    }
    let record = record?
        .first()
        .map(|row| decode_record(key, row.get(0)))
        .transpose()?;
    let found = inspect_record(record, message.fingerprint(), now_ms);
    let floor_ms = inner.admission_floor.then_some(inner.retention_ms);
    let (replaces_epoch, previous) =
        match admit(found, message.production_time_ms(), now_ms, floor_ms) {
            Found::Claimable {
                replaces_epoch,
                previous,
            } => (replaces_epoch, previous),
            Found::Settled(outcome) => return decided(Err(outcome)),
        };
    let mut version = None;
    if let Some((entity_key, new_version)) = entity {
        if !lock.get::<_, bool>(2) {
            // Another claim of the same entity is in flight.
            return decided(Err(Outcome::held_by_claim(now_ms)));
        }
        let current_version = current_version?
            .first()
            .map(|row| decode_version(entity_key, row.get(0)))
            .transpose()?;
        if let Some(stale) = guard_order(current_version, new_version) {
            return decided(Err(stale));
        }
        version = Some((entity_key.to_vec(), new_version));
    }
    decided(Ok(Claimable {
        replaces_epoch,
        previous,
        version,
    }))
}

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

/// A won claim: a live transaction that holds the key. Run the business SQL in
/// [`PgClaim::transaction`], then [`PgClaim::commit`]. Dropped instead, it rolls back: nothing
/// of it lands, and the key is free again.
pub struct PgClaim<'c> {
    tx: ClaimTransaction<'c>,
    /// When the claim was decided: the database's clock in its lock statement, and this
    /// process's monotonic clock when the answer came. The commit's time is the first advanced
    /// by the second's elapsed time: no extra round trip to read the database's clock again.
    decided_at: (i64, Instant),
    consumer: PgConsumer,
    key: Vec<u8>,
    /// The key as the embedded engine stores it (consumer and message key): what downstream
    /// keys are derived from.
    stored_key: Vec<u8>,
    fingerprint: Fingerprint,
    replaces_epoch: u64,
    previous: Option<PreviousAttempt>,
    /// The ordering guard's (entity key, version), whose entity lock this claim holds; the
    /// commit records the version.
    version: Option<(Vec<u8>, u64)>,
    /// The message's correlation id, for the commit's log event.
    correlation_id: Option<Box<str>>,
}

impl std::fmt::Debug for PgClaim<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgClaim")
            .field("consumer", &self.consumer.id)
            .field("key", &idemdb::format::printable(&self.key))
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl<'c> PgClaim<'c> {
    /// The connection of the claim's open transaction, for the business SQL. Do not commit or
    /// roll it back yourself: [`PgClaim::commit`] does, and dropping the claim rolls back.
    #[must_use]
    pub fn transaction(&self) -> &Client {
        self.tx.client()
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

    /// The idempotency key to give a downstream call made for this message at `step`: the
    /// same message and step give the same key across redeliveries, takeovers and restarts,
    /// and the same as the embedded engine's `Claim::derive_key` for the same consumer and
    /// message key ([`idemdb::format::derive_key`]), so a handler moved from one backend to the
    /// other keeps its downstream keys.
    ///
    /// ```no_run
    /// # async fn example(claim: idemdb_postgres::PgClaim<'_>) {
    /// let payment_key = claim.derive_key("charge-card"); // the payment API's Idempotency-Key
    /// # let _ = payment_key;
    /// # }
    /// ```
    #[must_use]
    pub fn derive_key(&self, step: &str) -> String {
        derive_key(&self.stored_key, step)
    }

    /// The ordering guard's (entity key, version) this claim records at its commit, if its
    /// message carried one.
    #[must_use]
    pub fn entity_version(&self) -> Option<(&[u8], u64)> {
        self.version
            .as_ref()
            .map(|(entity, version)| (entity.as_slice(), *version))
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
    /// [`Error::StatementDeallocated`] when the store's statement was deallocated since the
    /// claim began (retryable). Whatever the error, with the connection up the transaction has
    /// rolled back and the key is free when it returns.
    pub async fn commit(self, result: impl AsRef<[u8]>) -> Result<()> {
        self.commit_with(result, &[]).await
    }

    /// [`commit`](PgClaim::commit) with the business SQL: runs `statements` in order in the
    /// claim's transaction, writes the completed record and commits, all in one round trip
    /// (statements run on [`transaction`](PgClaim::transaction) first cost one each). The
    /// statements are sent unnamed with their parameters' types given, so none needs a round
    /// trip to be prepared. Any failure rolls everything back.
    ///
    /// ```no_run
    /// # async fn example(claim: idemdb_postgres::PgClaim<'_>, order: &[u8], total: i64)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use tokio_postgres::types::Type;
    /// claim
    ///     .commit_with(
    ///         b"accepted",
    ///         &[(
    ///             "INSERT INTO orders (id, total) VALUES ($1, $2)",
    ///             &[(&order, Type::BYTEA), (&total, Type::INT8)],
    ///         )],
    ///     )
    ///     .await
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`commit`](PgClaim::commit); a statement's own failure is [`Error::Postgres`] with
    /// its error (the record is not written); a statement that cannot be sent (a parameter
    /// that does not encode as its type) is [`Error::BadStatement`], found before anything
    /// is sent.
    pub async fn commit_with(
        self,
        result: impl AsRef<[u8]>,
        statements: &[TypedStatement<'_>],
    ) -> Result<()> {
        let started = Instant::now();
        let result = result.as_ref();
        // Refused before anything is sent; the rollback is waited for, so that the key is
        // free when the error returns.
        if let Err(error) = check_result(result).and_then(|()| txn::check_sendable(statements)) {
            return self.tx.fail(error).await;
        }
        let consumer = &self.consumer;
        let store = &consumer.store;
        let (db_ms, decided) = self.decided_at;
        let now_ms = store.now_ms(
            db_ms.saturating_add(i64::try_from(decided.elapsed().as_millis()).unwrap_or(i64::MAX)),
        );
        let epoch = self.epoch();
        let (record, expires_at_ms) =
            completed_record(store, epoch, self.fingerprint, now_ms, result, true);
        let row = RecordRow::new(
            consumer,
            &self.key,
            &record,
            expires_at_ms,
            self.replaces_epoch != 0,
        );
        let row_params = row.params();
        let id: &[u8] = &consumer.id;
        let (entity_key, version_bytes) = match &self.version {
            Some((entity_key, version)) => (entity_key.as_slice(), version.to_be_bytes()),
            None => (&[][..], [0; 8]),
        };
        let version_value: &[u8] = &version_bytes;
        let version_params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&id, Type::BYTEA),
            (&entity_key, Type::BYTEA),
            (&version_value, Type::BYTEA),
        ];
        let mut writes: Vec<TypedStatement<'_>> = vec![(row.sql, &row_params)];
        if self.version.is_some() {
            writes.push((&store.inner.write_version, &version_params));
        }
        // The record (and the entity's version) and COMMIT in one round trip.
        match self
            .tx
            .commit_with(statements, &writes, self.replaces_epoch != 0)
            .await
        {
            Ok(_) => {}
            Err(CommitFailed::Staged(error)) => return Err(Error::Postgres(error)),
            Err(CommitFailed::Store(error)) => return Err(store.write_failed(error, &self.key)),
        }
        let metrics = &consumer.metrics;
        metrics.commit(started.elapsed());
        metrics.log_step(
            "commit",
            &self.stored_key,
            epoch,
            None,
            self.correlation_id.as_deref(),
        );
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

/// A partition of the records table, as [`PgStore::partitions`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partition {
    /// Qualified: `schema.table_dN`, N its first day.
    pub name: String,
    /// Its first day (since 1970-01-01, UTC): it holds the rows that become removable on this
    /// day and the `days - 1` days after it.
    pub first_day: i64,
    /// The days it covers: the store's partition width (`InstallOptions::partition_days`).
    pub days: u32,
    /// Every row of it is removable now, on the store's clock: [`PgStore::maintain`] drops it.
    pub removable: bool,
}

impl PgStore {
    /// The partitions of the records table, oldest first, with what [`maintain`](Self::maintain)
    /// would do to each now. For operators and monitoring: a removable partition that stays
    /// means `maintain` is not running.
    ///
    /// # Errors
    /// [`Error::Postgres`] when a statement fails.
    pub async fn partitions(&self, client: &Client) -> Result<Vec<Partition>> {
        Ok(self
            .day_partitions(client)
            .await?
            .into_iter()
            .map(|(partition, removable)| Partition {
                name: partition.name,
                first_day: partition.day,
                days: self.inner.partition_days,
                removable,
            })
            .collect())
    }

    /// The records table's partitions, oldest first, each with whether every row of it is
    /// removable now (on the store's clock).
    async fn day_partitions(&self, client: &Client) -> Result<Vec<(schema::DayPartition, bool)>> {
        let removable = self.removable_rule(client).await?;
        Ok(schema::day_partitions(client, &self.inner.names)
            .await?
            .into_iter()
            .map(|partition| {
                let removable = removable(&partition);
                (partition, removable)
            })
            .collect())
    }

    /// Whether every row of a partition is removable now, on the store's clock: once the day
    /// after its last has begun.
    async fn removable_rule(
        &self,
        client: &Client,
    ) -> Result<impl Fn(&schema::DayPartition) -> bool + use<>> {
        let now_ms = i64::try_from(now_on_store_clock(client, self).await?).unwrap_or(i64::MAX);
        let days = i64::from(self.inner.partition_days);
        Ok(move |partition: &schema::DayPartition| {
            partition.day.saturating_add(days).saturating_mul(DAY_MS) <= now_ms
        })
    }

    /// Creates the partitions of the days ahead and drops those whose rows have all expired.
    /// Run it regularly (hourly, say, from one process or several): removal is one dropped
    /// partition per day, never a `DELETE` of rows, so it costs the same at any number of
    /// records and leaves no dead rows behind.
    ///
    /// Calls that overlap, from one process or several, take turns: each waits for the
    /// removals that began before it (a session-level advisory lock on the connection) and
    /// then drops what is still removable, so every call succeeds, and when one returns
    /// every partition removable when it took its turn is gone. A call given up half way (its
    /// future dropped) gives its turn back once the server has run what it sent; a partition
    /// it detached but did not drop is dropped by the next call (and listed in its
    /// [`Maintenance::dropped`]). A dropped partition is first detached
    /// concurrently (a lock that claims do not wait for), so claims go on meanwhile; the
    /// detach itself waits for the transactions that began before it (claims open then, and
    /// any other), so `maintain` takes as long as the longest of them.
    ///
    /// Claims create the partitions they need on their own (before their transaction, once a
    /// day per process); only removal needs this call. Without it, expired records stay
    /// (reads treat them as absent, exactly at their expiry millisecond) and take space.
    ///
    /// A drop gives a day's files back to the file system at once, and on the file system of
    /// the server's WAL that holds up the commits syncing it meanwhile (tens of milliseconds
    /// for a gigabyte on ext4, measured in BENCHMARKS.md). Partitions follow the records
    /// table's tablespace (`ALTER TABLE <schema>.<table> SET TABLESPACE <name>`, which moves
    /// nothing and places every partition made later), so a tablespace on another file system
    /// keeps the drops off the WAL's. That eased the stall in the harness without removing it:
    /// the detaches make every session plan its statements again.
    ///
    /// # Errors
    /// [`Error::Postgres`] when a statement fails. A detach interrupted by a lost connection is
    /// finished by the next call.
    pub async fn maintain(&self, client: &mut Client) -> Result<Maintenance> {
        let through_day = self.ensure_partitions(client, true).await?;
        let client: &Client = client;
        // Partitions are listed once the turn is taken, so that a call that waited finds
        // what the one before it dropped gone.
        let turn = schema::RemovalTurn::take(client, &self.inner.names).await?;
        let mut dropped = Vec::new();
        let removed = async {
            for (partition, removable) in self.day_partitions(client).await? {
                if removable {
                    schema::drop_partition(client, &self.inner.names, &partition).await?;
                    dropped.push(partition.name);
                }
            }
            // What an earlier call detached and was given up before it could drop.
            let removable = self.removable_rule(client).await?;
            for table in schema::detached_day_tables(client, &self.inner.names).await? {
                if removable(&table) {
                    schema::drop_detached(client, &table).await?;
                    dropped.push(table.name);
                }
            }
            Ok::<(), Error>(())
        }
        .await;
        // Given up on an error too, and waited for: the next call's turn comes at once.
        let ended = turn.end().await;
        removed?;
        ended?;
        Ok(Maintenance {
            partitions_through_day: through_day,
            dropped,
        })
    }

    /// Makes sure the partitions from today through the day after the last a record written
    /// now can expire on exist; skipped when this process already made sure, unless `always`.
    /// Today is by this process's clock and, when no clock is injected, by the database's too
    /// (read here: records take its time, and the two may be days apart); the extra day
    /// covers the database's day turning before this process's does.
    ///
    /// # Errors
    /// [`idemdb::Error::ClockOutOfRange`] for an injected clock beyond
    /// [`idemdb::CLOCK_MS_MAX`], as the embedded engine; [`Error::Postgres`] when a statement
    /// fails.
    async fn ensure_partitions(&self, client: &mut Client, always: bool) -> Result<i64> {
        let injected = match &self.inner.clock {
            Some(clock) => {
                let now_ms = clock.now_ms();
                if now_ms > idemdb::CLOCK_MS_MAX {
                    return Err(idemdb::Error::ClockOutOfRange { now_ms }.into());
                }
                Some(now_ms)
            }
            None => None,
        };
        let local_ms = injected.unwrap_or_else(local_now_ms);
        let retention_ms = self.inner.retention_ms;
        let known = &self.inner.partitions_through_day;
        if !always
            && known.load(Ordering::Acquire) >= partition_span(local_ms, local_ms, retention_ms).1
        {
            return Ok(known.load(Ordering::Acquire));
        }
        let db_ms = match injected {
            Some(now_ms) => now_ms,
            None => database_now_ms(client).await?,
        };
        let (first_day, last_day) =
            partition_span(local_ms.min(db_ms), local_ms.max(db_ms), retention_ms);
        schema::ensure_partitions(
            client,
            &self.inner.names,
            first_day,
            last_day,
            self.inner.partition_days,
        )
        .await?;
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

/// The days whose partitions records written between `from_ms` and `to_ms` need: from the
/// first's day through the day after the last expiry, `retention_ms` after `to_ms`, and never
/// past the last day that has a partition of its own (later rows go to the open partition).
fn partition_span(from_ms: u64, to_ms: u64, retention_ms: u64) -> (i64, i64) {
    let day_of = |ms: u64| i64::try_from(ms).unwrap_or(i64::MAX) / DAY_MS;
    let last_day = (day_of(to_ms.saturating_add(retention_ms)) + 1).min(schema::DAY_PARTITION_LAST);
    (day_of(from_ms).min(last_day), last_day)
}

/// The database's clock, in milliseconds since the Unix epoch.
pub(crate) async fn database_now_ms(client: &impl tokio_postgres::GenericClient) -> Result<u64> {
    let now_ms: i64 = client
        .query_one(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8",
            &[],
        )
        .await?
        .get(0);
    Ok(u64::try_from(now_ms).unwrap_or(0))
}

/// This process's clock, in milliseconds since the Unix epoch.
pub(crate) fn local_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// Writes the completed record of `key` at `epoch` in `tx`: an update of the row there is
/// (`replaces`), else an insert. `succeeded` false records a failure as the result. Errors
/// come before any COMMIT is sent: PostgreSQL answers a COMMIT of a transaction a failed
/// statement aborted with a rollback and no error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write_completed(
    tx: &Client,
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
/// never (and for a time past what int8 holds), which puts the row in the open partition.
pub(crate) fn expires_column(removable_at_ms: u64) -> i64 {
    if removable_at_ms == EXPIRES_NEVER_MS {
        return NEVER_MS;
    }
    match i64::try_from(removable_at_ms) {
        // Past the last day with a partition of its own: the open partition keeps it.
        Ok(column) if column / DAY_MS <= schema::DAY_PARTITION_LAST => column,
        _ => NEVER_MS,
    }
}

/// The row of a record, for the statement that writes it: an update of the key's row when the
/// record replaces one, else an insert.
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
                &inner.update
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
    /// found no row to update is [`Error::LostKey`]. A row with no partition to go to means the
    /// day partitions this process made sure of are gone (the tables were dropped and
    /// installed again under it): the next claim makes sure again.
    pub(crate) fn write_failed(&self, error: tokio_postgres::Error, key: &[u8]) -> Error {
        if error.code() == Some(LOST_ROW) {
            return Error::LostKey { key: key.to_vec() };
        }
        if prepared::is_stale(&error) {
            // Only the store's own writes come here, and they are prepared: the caller's SQL
            // is sent unnamed.
            return Error::StatementDeallocated;
        }
        if error.code() == Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION) {
            self.inner
                .partitions_through_day
                .store(i64::MIN, Ordering::Release);
        }
        Error::Postgres(error)
    }
}

/// Writes `record` as the row of `key` (an update when `replaces`, else an insert), removable
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

/// A claim's lock statement: the key's lock, and the statement's time (the claim's "now" on
/// the database's clock).
const LOCK_KEY: &str = "SELECT pg_try_advisory_xact_lock($1), \
     floor(extract(epoch FROM statement_timestamp()) * 1000)::int8";

/// A claim's lock statement with the ordering guard: the key's lock, the time, and the
/// entity's lock (two `int4`s: see [`entity_lock_id`]).
const LOCK_KEY_AND_ENTITY: &str = "SELECT pg_try_advisory_xact_lock($1), \
     floor(extract(epoch FROM statement_timestamp()) * 1000)::int8, \
     pg_try_advisory_xact_lock($2, $3)";

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
fn lock_id(namespace: &str, stored_key: &[u8]) -> i64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(namespace.as_bytes());
    hasher.update(&[0]);
    hasher.update(stored_key);
    i64::from_ne_bytes(hasher.digest().to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = DAY_MS as u64;

    #[test]
    fn partitions_cover_both_clocks_days_and_stop_at_the_last_day_partition() {
        // The database three days ahead of this process: its records' days are covered.
        let local = 100 * DAY + DAY / 2;
        let db = local + 3 * DAY;
        assert_eq!(partition_span(local, db, 7 * DAY), (100, 111));
        // Behind it: from the database's day on.
        assert_eq!(partition_span(local - 2 * DAY, local, 7 * DAY), (98, 108));
        // Clocks at the far end: no overflow, and no day partition past the last.
        let last = schema::DAY_PARTITION_LAST;
        assert_eq!(
            partition_span(u64::MAX / 2, u64::MAX, 7 * DAY),
            (last, last)
        );
        assert_eq!(partition_span(0, idemdb::CLOCK_MS_MAX, 0), (0, last));
    }

    #[test]
    fn expiries_past_the_last_day_partition_go_to_the_open_partition() {
        let last = schema::DAY_PARTITION_LAST;
        let at_last_day = u64::try_from(last * DAY_MS).unwrap_or(0);
        assert_eq!(expires_column(at_last_day), last * DAY_MS);
        assert_eq!(expires_column(at_last_day + DAY), NEVER_MS);
        assert_eq!(expires_column(u64::MAX - 1), NEVER_MS);
        assert_eq!(expires_column(EXPIRES_NEVER_MS), NEVER_MS);
    }
}
