//! The store and its builder ([`PgStore`], [`StoreBuilder`]): the tables' names, the
//! statements made for them once, the clock and the options every claim reads; and the
//! consumer handle ([`PgConsumer`]) the claims are made through.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemdb::Clock;
use idemdb::Message;
use idemdb::format::encode_key;
use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::storage::observe::ConsumerMetrics;
use crate::tables::names::DAY_MS;
use crate::tables::names::NEVER_MS;
use crate::tables::names::Names;

/// How long a completed record is kept when the builder is not told: 7 days, as in the
/// embedded engine.
pub const RETENTION_MS_DEFAULT: u64 = 7 * 24 * 3600 * 1000;

/// The longest retention: 60 days, as in the embedded engine's default limits. (A record's
/// removal time must fit the clock's range; 60 days is far beyond any redelivery.)
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
    /// ([`Message::produced_at_ms`](idemdb::Message::produced_at_ms)) is at or before now minus the retention, and whose key
    /// is claimable (no live record), is [`Outcome::TooLate`](idemdb::Outcome::TooLate) instead of new: its record may
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

    /// Whether statements are prepared once per connection (default on): the store's, and the
    /// caller's statements given to `commit_with`, `apply` and batch commits (up to
    /// [`CALLER_STATEMENTS_MAX`](crate::CALLER_STATEMENTS_MAX) distinct ones per connection;
    /// past that they are sent unnamed). Prepared, a statement is parsed once and its plan
    /// kept, where an unnamed one is parsed and planned at every run; the store's reads are
    /// planned with sequential scans off, so a plan kept from when the table was small looks
    /// keys up in the index at any size. As with any prepared statement, a caller's statement
    /// whose result columns change under it (`SELECT *` of a table altered since) fails with
    /// "cached plan must not change result type" until the connection is replaced. Turn it off behind a pooler that hands each
    /// transaction to any server connection and does not track prepared statements (PgBouncer
    /// in transaction mode before 1.21, or without `max_prepared_statements`): there a
    /// statement prepared on one server connection is missing on the next.
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
    /// Each call reads it once and takes every time it decides or writes from that reading;
    /// a reading past [`idemdb::CLOCK_MS_MAX`] fails the call with `ClockOutOfRange` before
    /// anything is sent (calls that only read, such as [`PgConsumer::in_progress`], take any
    /// reading).
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> StoreBuilder {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Checks the tables and returns the store.
    ///
    /// # Errors
    /// [`Error::SchemaMissing`], [`Error::SchemaTooNew`] or [`Error::SchemaTooOld`] when the
    /// tables are not at [`SCHEMA_VERSION`](crate::SCHEMA_VERSION); [`Error::Idemdb`] for a retention of 0 or over
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
        crate::tables::install::check(client, &self.names).await?;
        let records = self.names.records();
        let entity = self.names.entity_versions();
        let positions = self.names.positions();
        Ok(PgStore {
            inner: Arc::new(Inner {
                read: format!(
                    "SELECT record FROM {records} WHERE consumer = $1 AND message_key = $2"
                ),
                claim: format!(
                    "SELECT o_locked, o_now_ms, o_record, o_inserted FROM {}($1, $2, $3, $4, $5, $6)",
                    self.names.claim_function()
                ),
                claim_plain: plain_claim_sql(&records),
                records_large: format!(
                    "SELECT pg_relation_size('{records}'::regclass) >= {PLAIN_CLAIM_TABLE_BYTES}"
                ),
                insert: format!(
                    "INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                     VALUES ($1, $2, $3, $4)"
                ),
                // The key's row replaced, or inserted if removal deleted it meanwhile (it had
                // expired: removal takes no key's lock). The writer holds the key's lock, so
                // no other claim's row can be there.
                upsert: format!(
                    "INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, message_key) DO UPDATE \
                     SET record = excluded.record, expires_at_ms = excluded.expires_at_ms"
                ),
                claim_many: format!(
                    "SELECT o_now_ms, o_refused, o_keys, o_records FROM {}($1, $2, $3)",
                    self.names.claim_many_function()
                ),
                insert_if_new: format!(
                    "SELECT {}($1, $2, $3, $4, $5, $6)",
                    self.names.apply_function()
                ),
                read_at: read_at_sql(&records),
                insert_many: format!(
                    "INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                     SELECT $1, n.message_key, n.record, n.expires_at_ms \
                     FROM unnest($2::bytea[], $3::bytea[], $4::int8[]) \
                         AS n(message_key, record, expires_at_ms)"
                ),
                // New rows are inserted (the primary key refuses a second record of a key);
                // replaced rows (expired, released, or an external claim whose lease ran out)
                // are upserted, as a single claim's are (removal may have deleted them). Both in
                // one statement: every key appears in one of the two lists only, and each row
                // is written or the statement fails.
                write_many: format!(
                    "WITH inserted AS ( \
                         INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                         SELECT $1, n.message_key, n.record, n.expires_at_ms \
                         FROM unnest($2::bytea[], $3::bytea[], $4::int8[]) \
                             AS n(message_key, record, expires_at_ms) \
                     ), replaced AS ( \
                         INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
                         SELECT $1, u.message_key, u.record, u.expires_at_ms \
                         FROM unnest($5::bytea[], $6::bytea[], $7::int8[]) \
                             AS u(message_key, record, expires_at_ms) \
                         ON CONFLICT (consumer, message_key) DO UPDATE \
                         SET record = excluded.record, expires_at_ms = excluded.expires_at_ms \
                     ) SELECT 1"
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
                advance_positions: format!(
                    "SELECT {}($1, $2, $3, $4, $5)",
                    self.names.advance_positions()
                ),
                read_position: format!(
                    "SELECT read_offset, updated_at_ms FROM {positions} \
                     WHERE consumer = $1 AND source = $2 AND partition = $3"
                ),
                list_positions: format!(
                    "SELECT source, partition, read_offset, updated_at_ms FROM {positions} \
                     WHERE consumer = $1 ORDER BY source COLLATE \"C\", partition"
                ),
                // The row as it was (locked first, so a writer in flight is waited for and
                // its commit is what is answered), replaced whatever its offset; the time is
                // the injected clock's `$5`, or the database's.
                set_position: format!(
                    "WITH before AS ( \
                         SELECT read_offset, updated_at_ms FROM {positions} \
                         WHERE consumer = $1 AND source = $2 AND partition = $3 FOR UPDATE \
                     ), written AS ( \
                         INSERT INTO {positions} AS p \
                             (consumer, source, partition, read_offset, updated_at_ms) \
                         VALUES ($1, $2, $3, $4, coalesce($5::int8, \
                             floor(extract(epoch FROM statement_timestamp()) * 1000)::int8)) \
                         ON CONFLICT (consumer, source, partition) DO UPDATE \
                         SET read_offset = excluded.read_offset, \
                             updated_at_ms = excluded.updated_at_ms \
                     ) SELECT read_offset, updated_at_ms FROM before"
                ),
                remove_position: format!(
                    "DELETE FROM {positions} \
                     WHERE consumer = $1 AND source = $2 AND partition = $3 \
                     RETURNING read_offset, updated_at_ms"
                ),
                lock_namespace: records,
                entity_lock_namespace: entity,
                names: self.names,
                retention_ms: self.retention_ms,
                admission_floor: self.admission_floor,
                statements: Arc::new(crate::sql::prepared::StatementCache::new(
                    self.prepared_statements,
                )),
                clock: self.clock,
                clock_offset: crate::sql::clock::ClockOffset::unknown(),
            }),
        })
    }
}

/// A reading of the store's clock, refused beyond [`idemdb::CLOCK_MS_MAX`].
///
/// # Errors
/// [`idemdb::Error::ClockOutOfRange`].
pub(crate) fn clock_in_range(now_ms: u64) -> Result<u64> {
    if now_ms > idemdb::CLOCK_MS_MAX {
        return Err(idemdb::Error::ClockOutOfRange { now_ms }.into());
    }
    Ok(now_ms)
}

/// The store's clock as one call read it ([`PgStore::read_clock`]): the injected clock's one
/// reading, or the database's, which the call's statements read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClockReading {
    injected: Option<u64>,
}

impl ClockReading {
    /// Now for the call: the injected clock's reading, or the database's `db_now_ms` (read by
    /// one of the call's statements).
    pub(crate) fn now_ms(self, db_now_ms: i64) -> u64 {
        self.injected
            .unwrap_or_else(|| u64::try_from(db_now_ms).unwrap_or(0))
    }

    /// The injected clock's reading; `None` when the database's clock decides.
    pub(crate) fn injected(self) -> Option<u64> {
        self.injected
    }
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) read: String,
    /// A claim's key lock, the database's time and the key's row, in one statement
    /// (`<table>_claim`).
    pub(crate) claim: String,
    /// The same claim as one plain statement, cheaper on the server than the function's call;
    /// for a table large enough that its kept plan reads by the index (see
    /// [`plain_claim_sql`]).
    pub(crate) claim_plain: String,
    /// Whether the records table has reached [`PLAIN_CLAIM_TABLE_BYTES`].
    pub(crate) records_large: String,
    pub(crate) insert: String,
    /// Writes a record that replaces the key's row (expired, released, a lease run out).
    pub(crate) upsert: String,
    /// A batch claim's key locks, the database's time and the keys' rows, in one statement
    /// (`<table>_claim_many`).
    pub(crate) claim_many: String,
    /// Inserts a new key's completed record unless the key has a row ([`PgConsumer::apply`]).
    pub(crate) insert_if_new: String,
    /// The key's row and the database's time, read after a one-round-trip claim inserted
    /// nothing.
    pub(crate) read_at: String,
    /// Inserts many rows of one consumer (a batch's commit where every key was new).
    pub(crate) insert_many: String,
    /// Inserts and upserts many rows of one consumer (a batch's commit where some key replaces
    /// a row).
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
    /// Moves read positions forward or fails (`<table>_advance_positions`).
    pub(crate) advance_positions: String,
    /// One read position.
    pub(crate) read_position: String,
    /// A consumer's read positions.
    pub(crate) list_positions: String,
    /// Sets one read position, forwards or backwards, answering the one it replaced.
    pub(crate) set_position: String,
    /// Removes one read position, answering it.
    pub(crate) remove_position: String,
    /// The records table's name, hashed into every key's lock so that two stores in one
    /// database do not share locks.
    pub(crate) lock_namespace: String,
    /// The versions table's name, hashed into every entity's lock (see [`entity_lock_id`]).
    pub(crate) entity_lock_namespace: String,
    pub(crate) names: Names,
    pub(crate) retention_ms: u64,
    /// The admission floor is on: [`StoreBuilder::admission_floor`].
    pub(crate) admission_floor: bool,
    /// The statements above, prepared on each connection the store ran on.
    pub(crate) statements: Arc<crate::sql::prepared::StatementCache>,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    /// The database's clock against this process's, as the last claim saw them.
    pub(crate) clock_offset: crate::sql::clock::ClockOffset,
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

    /// Reads the store's clock for one call that writes: the injected clock once, refused
    /// beyond [`idemdb::CLOCK_MS_MAX`] (as the embedded engine refuses) before the call sends
    /// anything. The call takes every time it needs from this one reading, so what was
    /// checked is what decides: a clock read again later could have moved (past the limit,
    /// or past a record's expiry the first reading was before). With the database's clock
    /// nothing is read here; the call's own statements read it.
    ///
    /// # Errors
    /// [`idemdb::Error::ClockOutOfRange`].
    pub(crate) fn read_clock(&self) -> Result<ClockReading> {
        let injected = match &self.inner.clock {
            Some(clock) => Some(clock_in_range(clock.now_ms())?),
            None => None,
        };
        Ok(ClockReading { injected })
    }

    /// The time a record of `message` written in the call's first round trip carries
    /// (`apply`'s, and a new key's record that `begin` inserts): now on the store's clock before
    /// asking the database (the call's reading `clock` of an injected one), and the time the
    /// database must agree with (`None`: the injected clock decides, nothing to check).
    ///
    /// `None` until a claim has seen the database's clock, and, under the admission floor, for
    /// a message produced after that time: a redelivery is refused as too late only from the
    /// production time on, so the record must not be older than the message (an estimate that
    /// trails the database's clock could make it so; the commit's own time is never before the
    /// claim's).
    pub(crate) fn estimated_now_ms(
        &self,
        clock: ClockReading,
        message: &Message<'_>,
    ) -> Option<(u64, Option<i64>)> {
        let (now_ms, check_ms) = match clock.injected() {
            Some(now_ms) => (now_ms, None),
            None => {
                let now_ms = self.inner.clock_offset.estimate_ms()?;
                (now_ms, Some(i64::try_from(now_ms).unwrap_or(i64::MAX)))
            }
        };
        let produced_later = self.inner.admission_floor
            && message
                .production_time_ms()
                .is_some_and(|produced_at_ms| produced_at_ms > now_ms);
        (!produced_later).then_some((now_ms, check_ms))
    }

    /// [`PgStore::read_clock`] for a call that only reads: never refused (reads work at any
    /// reading, as in the embedded engine).
    pub(crate) fn read_clock_for_reading(&self) -> ClockReading {
        ClockReading {
            injected: self.inner.clock.as_ref().map(|clock| clock.now_ms()),
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

pub use crate::tables::names::CLOCK_TOLERANCE_MS;

/// The size of the records table from which a claim may run as one plain statement
/// ([`plain_claim_sql`]) instead of a call of `<table>_claim` (1 MiB: 128 pages of 8 KiB).
/// Below a dozen pages PostgreSQL plans a read by key as a scan of the whole table, and a
/// connection keeps the plan it made until the table's next analyze; from this size on every
/// plan it makes reads by the index (a scan's estimate is ten times the index's), so a kept
/// plan can no longer be a scan that goes on as the table grows.
pub(crate) const PLAIN_CLAIM_TABLE_BYTES: u64 = 1 << 20;

/// A claim's first round trip as one statement, with the answer of `<table>_claim`'s call
/// (`o_locked`, `o_now_ms`, `o_record`, `o_inserted`) and a fifth column, whether its read
/// found no row with the lock granted. The key's lock is tried, the database's time taken, and, with
/// the lock, the key's row read and, when there is none, the new key's record (`$4`, with its
/// removal time `$5`, checked against the database's clock when `$6` is not null) inserted.
///
/// Its server time is about two thirds of the function's call (measured with
/// `pg_stat_statements` beside pgbench: 28-33 against 45-52 us; PL/pgSQL's statements, the
/// function scan and the setting it changes for its run make the difference), but it differs
/// in two ways:
///
/// - **Its read's snapshot is the statement's**, taken before the lock: a holder that commits
///   and releases the lock in between has its row missed by the read. The insert then finds
///   the row (`ON CONFLICT` looks at committed rows whatever the snapshot) and inserts nothing;
///   the caller sees that the read found no row and nothing was inserted (also when the
///   record's time was too far from the database's clock to insert it), and reads the row
///   again in a statement of its own (`PgConsumer::claim_message`). A row the read found may
///   have been replaced in between too: a decision to replace it is made again on a read
///   after the lock (a live completed row is never replaced). A claim without a record to insert
///   (an entity version's) uses the function.
/// - **Its read's plan is the connection's**, kept and made again only after an analyze,
///   without the function's `enable_seqscan = off`: so it is used only once the table has
///   reached [`PLAIN_CLAIM_TABLE_BYTES`], and only with prepared statements (an unnamed
///   statement is planned every time, which costs more than the function saves).
fn plain_claim_sql(records: &str) -> String {
    format!(
        "WITH l AS MATERIALIZED ( \
             SELECT pg_try_advisory_xact_lock($1) AS locked, \
                    floor(extract(epoch FROM statement_timestamp()) * 1000)::int8 AS now_ms \
         ), r AS MATERIALIZED ( \
             SELECT k.record FROM {records} AS k, l \
             WHERE l.locked AND k.consumer = $2 AND k.message_key = $3 \
         ), w AS MATERIALIZED ( \
             SELECT l.locked AND $4::bytea IS NOT NULL AND NOT EXISTS (SELECT 1 FROM r) \
                    AND ($6::int8 IS NULL OR abs(l.now_ms - $6::int8) <= {CLOCK_TOLERANCE_MS}) \
                    AS wanted \
             FROM l \
         ), i AS ( \
             INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
             SELECT $2, $3, $4, $5 FROM w WHERE w.wanted \
             ON CONFLICT (consumer, message_key) DO NOTHING RETURNING true \
         ) SELECT l.locked, l.now_ms, (SELECT record FROM r), EXISTS (SELECT 1 FROM i), \
                  l.locked AND NOT EXISTS (SELECT 1 FROM r) \
         FROM l, w"
    )
}

/// The key's row as it is, if any, and the database's time: what a one-round-trip claim that
/// inserted nothing is answered from.
pub(crate) fn read_at_sql(records: &str) -> String {
    format!(
        "SELECT (SELECT record FROM {records} WHERE consumer = $1 AND message_key = $2), \
             floor(extract(epoch FROM statement_timestamp()) * 1000)::int8"
    )
}
