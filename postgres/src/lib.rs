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
//! **Exactly one winner, never a wait.** The records are one table whose primary key is
//! (consumer, message key): at most one row per key, whoever writes it, and a read of a key is
//! one probe of that index. Every writer of a key holds the key's transaction-level advisory
//! lock (`pg_try_advisory_xact_lock` on a 64-bit hash of the table and the stored key) while it
//! reads and writes the key's row. A claimant that does not get the lock gets `InProgress` at
//! once. One that gets it reads the row in a second statement: under READ COMMITTED each
//! statement takes a fresh snapshot, and PostgreSQL makes a transaction's commit visible
//! before it releases its locks, so that read sees every earlier holder's commit. Two keys
//! whose hashes collide only get a spurious `InProgress` while the other is held. Removal
//! takes no key's lock: it deletes only expired rows, and a claim that replaces an expired row
//! writes its record whether removal got there first or not.
//!
//! **Two round trips.** `BEGIN` and a call of the store's function `<table>_claim` (the key's
//! lock, the database's time, and then the key's row; for a new key, its record inserted; once
//! the table has reached 1 MiB, the same as one plain statement, cheaper on the server, whose
//! read is checked again after the lock where it could be stale: docs/design.md) go
//! out together, and so do the caller's SQL and `COMMIT`: a claim and its commit cost two round
//! trips and four statements, what a hand-written dedup insert sends when its business SQL waits
//! for the insert's answer. The new key's record stands for the commit's when the result is
//! empty, the commit carries SQL of the caller's (whose answer says the transaction stands) and
//! comes within a second of the claim: its time is the claim's, this process's estimate of the
//! database's clock. Otherwise the record's write goes with the commit (five statements), at
//! the commit's time: the database's clock read by the claim's function, advanced by this
//! process's monotonic clock since. The function turns sequential scans off for its own read
//! only, so the caller's SQL sees the session's own setting (see
//! [`StoreBuilder::prepared_statements`]). A handler whose SQL does not depend on the answer
//! sends it with the claim instead: [`PgConsumer::apply`] costs one round trip for a new key,
//! and four statements (`BEGIN`, one that takes the key's lock and inserts the record,
//! the caller's SQL, `COMMIT`): what a hand-written dedup insert in front of the same SQL sends.
//!
//! **Batches.** [`PgConsumer::begin_batch`] claims a broker batch in one transaction: one
//! call of the store's function `<table>_claim_many` takes every key's lock and then reads
//! every key's row, sent with `BEGIN`; each message
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
//! **Removal.** Reads are exact at the expiry millisecond whatever is stored;
//! [`PgStore::maintain`], run regularly, deletes the expired records oldest first through the
//! index on their removal time, in batches of 1,000 rows (each its own transaction, going
//! around rows another transaction holds: a claim's commit replacing one), busy 10% of the
//! time by default ([`Removal::busy_percent`]), so it costs what expired since the last run,
//! not what the table holds, never holds many locks or frees much at once, and leaves the
//! server to the claims. The table is installed with
//! autovacuum told to visit it after 1% of its rows changed, so new records reuse the space of
//! removed ones. Retention is at most [`RETENTION_MS_MAX`] (60 days).
//!
//! **Whose clock.** The database's (`statement_timestamp()`, in milliseconds) decides expiry
//! and commit times unless a [`idemdb::Clock`] is given (tests): the consumers' own clocks may
//! be skewed against each other without effect. An injected clock is read once per call (a
//! claim, `apply`, a batch, an external claim, a lease step, a resolution, a commit, a
//! position moved, removal): every time the call decides or writes comes from that one
//! reading, refused past [`idemdb::CLOCK_MS_MAX`] (`ClockOutOfRange`) before anything is
//! sent, as the embedded engine refuses it; a clock that moves during the call changes
//! nothing of it.
//!
//! **Which millisecond.** Every bound is "at or after": a record whose expiry is `t` answers
//! `Duplicate` through `t - 1` and is claimable again from `t` on; a lease that runs until
//! `lease_until_ms` holds the key through `lease_until_ms - 1`, and from `lease_until_ms` on
//! another claimant takes it over (the holder's next step is `LeaseLost`). A row removable
//! from `t` on is deleted by a [`PgStore::maintain`] whose clock read `t` or later when it began.
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
//! **Log consumers.** [`PgClaim::stage_position`] and [`PgClaimBatch::stage_position`] write a
//! consumer's read position in a log (a Kafka topic partition, a RabbitMQ stream) in the
//! claim's transaction, with its record and business SQL, and [`PgConsumer::apply_at`] does
//! the same for `apply`, still in one round trip for a new key; [`PgConsumer::positions`]
//! reads it back (where to resume) and moves it for messages settled without a claim. A
//! position behind the stored one fails the commit with `idemdb::Error::PositionBehind` (in
//! [`Error::Idemdb`]), nothing written: a stale reader. The embedded engine's calls, in the
//! same shape. An operator resets a stopped consumer's position with [`PgPositions::set`]
//! (forwards or backwards) or [`PgPositions::remove`], or with `idemdb-pg positions`.
//!
//! **Upgrading an older install.** [`SCHEMA_VERSION`] is 10. A store opened on tables at
//! versions 1 to 9 (written by earlier releases) is refused with [`Error::SchemaTooOld`] and
//! nothing is touched; [`install`] migrates them in one transaction, under the installers'
//! lock. (Below, "version N gains" is what tables at version N gain when `install` migrates
//! them.) Version 9 gains no table: the claim's function (`<table>_claim`) is replaced by one
//! that also inserts a new key's record; a process of an earlier release still running then fails
//! its `begin` claims (the function it calls is gone; its `apply` and batches call functions that
//! stay) and processes nothing twice. Version 8 gains
//! no table, only the version: the records written from then on are in
//! the shorter record format 2, which earlier releases cannot read (the records already there
//! stay in format 1 and read as before). Stop every process of an earlier release before that
//! `install`: a store checks the version when it opens, so one still running would read the new
//! records as [`Error::Corrupt`] (failing those messages, never processing them twice).
//! Version 7 gains the batch claim's function (`<table>_claim_many`: a batch's locks and
//! reads in one statement); version 6 also the claim's functions (`<table>_claim`, a claim's
//! lock and read in one statement, and `<table>_apply`); version 5 also the read positions'
//! table and function. From versions 1 to 4 the old
//! records table (plain at version 1, partitioned by removal day at 2 to 4) is
//! renamed aside, the new one made, every record whose removal time has not passed copied into
//! it (those whose has read as absent already, and removal would delete them), and the old
//! table dropped with its partitions; version 1 and 2 tables also gain the ordering guard's
//! versions table. The copy takes as long as the live records take to write, and holds the old
//! table meanwhile. Stop the consumers of the old release first (their table is replaced
//! under them), run `install` once with the new release, then start the new consumers; the
//! old release refuses the migrated tables with `SchemaTooNew`.
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

// The layers, bottom first (ARCHITECTURE.md; tests/layers.rs): each names only its own layer
// and those below it.
//
// Errors, for every layer.
mod error;
// How statements reach PostgreSQL: pipelined, prepared once per connection, in a claim's
// transaction; the clocks.
mod sql;
// The tables: names, installation and migrations, the installers' locks.
mod tables;
// Storage: the store, its builder, statements and clock, the consumer handle, records' rows, metrics.
mod storage;
// What consumers and operators do: claims, `apply`, batches, external claims and their lease
// steps, tickets, removal, export and import.
mod operations;

/// A statement of the caller's with its parameters and their types, prepared once per
/// connection: see [`PgClaim::commit_with`].
pub use sql::txn::Statement as TypedStatement;

pub use error::{Error, Result};
pub use operations::apply::Applied;
pub use operations::batch::{BATCH_MESSAGES_MAX, PgBatchOutcome, PgClaimBatch};
pub use operations::claim::PgClaim;
pub use operations::external::{LEASE_STEP_LOCK_WAIT, PgExternalClaim, PgInProgress, PgResolution};
pub use operations::lease::PgCompletion;
pub use operations::maintain::{Maintenance, Removal};
pub use operations::positions::{PgPositions, ReadPosition};
pub use operations::ticket::PgLeaseTicket;
pub use operations::transfer::{
    CorruptRow, ExportReport, IMPORT_TRANSACTION_RECORDS, ImportCounts, PositionImportCounts,
};
pub use sql::prepared::CALLER_STATEMENTS_MAX;
pub use storage::positions::POSITION_OFFSET_MAX;
pub use storage::store::CLOCK_TOLERANCE_MS;
pub use storage::store::{
    PgConsumer, PgStore, RETENTION_MS_DEFAULT, RETENTION_MS_MAX, StoreBuilder,
};
pub use tables::install::{SCHEMA_VERSION, install};
pub use tables::names::{DAY_MS, Names};
