//! A single claim: `begin` opens its transaction and decides it (the key's lock and its
//! read in one round trip, the decision core's answer), and [`PgClaim`] commits the record with
//! the caller's SQL in one more.

use std::time::Instant;

use idemdb::decision::{Found, admit, guard_order, inspect_record};
use idemdb::format::{Record, derive_key, encode_key};
use idemdb::{Fingerprint, Message, Outcome, PreviousAttempt};
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::sql::prepared::PlainClaim;
use crate::sql::txn::CommitFailed;
use crate::sql::txn::Statement as TypedStatement;
use crate::sql::txn::{ClaimTransaction, Connection};
use crate::storage::positions::{StagedPositions, advance_statement, position_behind};
use crate::storage::records::RecordRow;
use crate::storage::records::check_result;
use crate::storage::records::completed_record;
use crate::storage::records::decode_record;
use crate::storage::records::decode_version;
use crate::storage::records::entity_lock_id;
use crate::storage::records::expires_column;
use crate::storage::records::lock_id;
use crate::storage::store::CLOCK_TOLERANCE_MS;
use crate::storage::store::ClockReading;
use crate::storage::store::PgConsumer;

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
    /// (`COMMIT`, `ROLLBACK`): the record's write and the `COMMIT` behind them count on it
    /// being open (a new key's record, inserted by the claim, would be rolled back with it).
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
    /// time (the admission floor: [`StoreBuilder::admission_floor`](crate::StoreBuilder::admission_floor)), an entity version (the
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
        self.begin_on(Connection::from(client), message, None).await
    }

    /// Like [`PgConsumer::begin_message`], on a connection the claim takes and owns (a pooled
    /// connection: anything that dereferences to a [`Client`]), so that the claim is not tied
    /// to a borrow of the caller's: it can be kept in a request while its handler runs, or
    /// moved to another task. The connection is dropped (given back to its pool) when the claim
    /// ends, and at once with any outcome other than `Fresh`. As for `begin`, it must not be in
    /// a transaction of the caller's.
    ///
    /// ```no_run
    /// # async fn example(consumer: idemdb_postgres::PgConsumer, client: tokio_postgres::Client)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use idemdb::{Fingerprint, Message, Outcome};
    /// let message = Message::new("order-7", Fingerprint::of(b"payload"));
    /// if let Outcome::Fresh(claim) = consumer.begin_owned(Box::new(client), &message).await? {
    ///     // `claim` borrows nothing: it may be sent to another task before it commits.
    ///     tokio::spawn(async move { claim.commit(b"done").await });
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As for [`PgConsumer::begin_message`].
    pub async fn begin_owned(
        &self,
        client: impl std::ops::DerefMut<Target = Client> + Send + 'static,
        message: &Message<'_>,
    ) -> Result<Outcome<PgClaim<'static>>> {
        self.begin_on(Connection::Owned(Box::new(client)), message, None)
            .await
    }

    /// `begin_message` on a borrowed or owned connection, at `clock` when the caller read the
    /// store's clock already (`apply`'s long way), else at a reading of its own.
    pub(crate) async fn begin_on<'c>(
        &self,
        client: Connection<'c>,
        message: &Message<'_>,
        clock: Option<ClockReading>,
    ) -> Result<Outcome<PgClaim<'c>>> {
        let started = Instant::now();
        let (now_ms, outcome) = self.claim_message(client, message, clock).await?;
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
        client: Connection<'c>,
        message: &Message<'_>,
        clock: Option<ClockReading>,
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
        // The store's clock, read once (an injected one checked here, before anything is
        // sent): the decision and the claim's commit time come from this reading.
        let clock = match clock {
            Some(clock) => clock,
            None => self.store.read_clock()?,
        };
        // BEGIN, the locks and the reads go out together (one round trip). Each read's
        // snapshot is taken after its lock was granted, so it sees the commit of whoever held
        // the lock before; without its lock, a read's answer is not looked at.
        let (high, low) = entity.map_or((0, 0), |(_, _, high, low)| (high, low));
        let entity_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&high, Type::INT4), (&low, Type::INT4)];
        let id: &[u8] = &self.id;
        let entity_key: &[u8] = entity.map_or(&[], |(entity_key, ..)| entity_key);
        let version_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&id, Type::BYTEA), (&entity_key, Type::BYTEA)];
        // A new key's completed record (an empty result), which the claim's function inserts
        // when the key has no row: the commit then sends no write of its own if its record is
        // the same (see `PgClaim::commit_at`). Not with an entity version, whose statements
        // run after the function.
        let early = match entity {
            None => EarlyRecord::new(self, message, clock),
            Some(_) => None,
        };
        let early_bytes: Option<&[u8]> = early.as_ref().map(|early| &early.encoded[..]);
        let early_expires: Option<i64> = early.as_ref().map(|early| early.expires_column);
        let early_check: Option<i64> = early.as_ref().and_then(|early| early.check_ms);
        let claim_params: [(&(dyn ToSql + Sync), Type); 6] = [
            (&lock_number, Type::INT8),
            (&id, Type::BYTEA),
            (&key, Type::BYTEA),
            (&early_bytes, Type::BYTEA),
            (&early_expires, Type::INT8),
            (&early_check, Type::INT8),
        ];
        // The key's lock, the time and the key's row in one call of the store's function,
        // which reads after the lock was granted (see `create_claim_functions`), or in one
        // plain statement once the table is large (see `plain_claim_sql`); with an entity
        // version, the entity's lock and then its read behind it, each read's snapshot taken
        // after its lock.
        let plain = if early.is_some() && entity.is_none() {
            // Bound apart so that the future holds a `&Client` across the wait, not the
            // connection (whose owned form is `Send` but not `Sync`).
            let shared: &Client = client.get();
            self.plain_claim(shared).await?
        } else {
            false
        };
        let (mut tx, answers) = if entity.is_none() {
            let claim = if plain {
                &inner.claim_plain
            } else {
                &inner.claim
            };
            let statements: [TypedStatement<'_>; 1] = [(claim, &claim_params)];
            ClaimTransaction::begin_with_functions(client, &inner.statements, &statements).await?
        } else {
            let statements: [TypedStatement<'_>; 3] = [
                (&inner.claim, &claim_params),
                (LOCK_ENTITY, &entity_params),
                (&inner.read_version, &version_params),
            ];
            ClaimTransaction::begin_with(client, &inner.statements, &statements).await?
        };
        let decided_at = Instant::now();
        let entity = entity.map(|(entity_key, version, ..)| (entity_key, version));
        // An error here (a record that does not decode, say) leaves the key's lock held until
        // the rollback: waited for, so that the key is free when the error returns.
        let missed = plain && missed_a_row(&answers);
        let mut decided = decide_claim(self, answers, message, entity, clock);
        // The plain statement read the key's row before its lock, so a holder that committed
        // and released the lock in between may have written a row it did not see: the
        // decision is made again on a read after the lock when the read found no row and
        // nothing was inserted (`missed_a_row`), or when it found a row the claim would
        // replace (expired, released, a lease run out). A live completed row is never
        // replaced, so a duplicate stands as the statement answered it.
        if missed || plain && decided.as_ref().is_ok_and(|decided| decided.replaces_a_row) {
            let shared: &Client = tx.client();
            decided = match self.read_again(shared, lock_number, key).await {
                Ok(answers) => decide_claim(self, answers, message, entity, clock),
                Err(error) => Err(error),
            };
        }
        let Decided {
            db_now_ms,
            now_ms,
            verdict,
            ..
        } = tx.release_on_error(decided).await?;
        let Claimable {
            replaces_epoch,
            previous,
            version,
            inserted,
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
            clock,
            consumer: self.clone(),
            key: key.to_vec(),
            stored_key,
            fingerprint: message.fingerprint(),
            replaces_epoch,
            previous,
            version,
            positions: StagedPositions::default(),
            correlation_id: message.correlation().map(Into::into),
            early: early.filter(|_| inserted).map(|early| early.now_ms),
        };
        Ok((now_ms, Outcome::Fresh(claim)))
    }

    /// Whether this claim may run as the plain claim statement on `client`: the table's size
    /// looked at when the connection has not looked lately (see
    /// [`StatementCache::plain_claim`](crate::sql::prepared::StatementCache::plain_claim)).
    async fn plain_claim(&self, client: &Client) -> Result<bool> {
        let inner = &self.store.inner;
        Ok(match inner.statements.plain_claim(client) {
            PlainClaim::Use => true,
            PlainClaim::Skip => false,
            PlainClaim::Check => {
                let large: bool = crate::sql::txn::single_row(
                    client.query_typed(&inner.records_large, &[]).await?,
                )?
                .get(0);
                inner.statements.plain_claim_checked(client, large);
                large
            }
        })
    }

    /// The claim's answer again, from a call of the claim's function without a record: the
    /// lock is this transaction's already, and the function's read takes a snapshot of its
    /// own, after it. Unnamed: a rare path, and the function plans its read itself.
    async fn read_again(
        &self,
        client: &Client,
        lock_number: i64,
        key: &[u8],
    ) -> Result<crate::sql::txn::Answers> {
        let id: &[u8] = &self.id;
        let none: Option<&[u8]> = None;
        let no_time: Option<i64> = None;
        let again = client
            .query_typed(
                &self.store.inner.claim,
                &[
                    (&lock_number, Type::INT8),
                    (&id, Type::BYTEA),
                    (&key, Type::BYTEA),
                    (&none, Type::BYTEA),
                    (&no_time, Type::INT8),
                    (&no_time, Type::INT8),
                ],
            )
            .await?;
        Ok(vec![Ok(again)])
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

/// Whether the plain claim statement's answer says that its read found no row (with the
/// lock granted) and nothing was inserted: the key's row may have been committed after the
/// statement's snapshot by a holder that released the lock just before this claim took it
/// (the insert then found it), or the record's time was too far from the database's clock
/// to insert, and the read may have missed such a row all the same.
fn missed_a_row(answers: &crate::sql::txn::Answers) -> bool {
    match answers.first() {
        Some(Ok(rows)) => rows
            .first()
            .is_some_and(|row| row.get::<_, bool>(4) && !row.get::<_, bool>(3)),
        _ => false,
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
    /// The key's row was found and is claimable (expired, released, a lease run out): the
    /// claim would replace it, or the admission floor refused the message on it.
    replaces_a_row: bool,
}

/// A claimable key: what the claim replaces and records.
struct Claimable {
    replaces_epoch: u64,
    previous: Option<PreviousAttempt>,
    /// The ordering guard's (entity key, version) to record.
    version: Option<(Vec<u8>, u64)>,
    /// The claim's function inserted the new key's record ([`EarlyRecord`]).
    inserted: bool,
}

/// A new key's completed record with an empty result, sent with the claim for its function
/// to insert when the key has no row, its lock was granted and the record's time is within
/// [`CLOCK_TOLERANCE_MS`](crate::tables::names::CLOCK_TOLERANCE_MS) of the database's clock
/// (an injected clock is not checked). Its time is the store's estimate of the database's
/// clock, as `apply`'s record's; its epoch is 1. Inserted, it is the key's row for the rest of
/// the claim's transaction, and rolls back with it.
struct EarlyRecord {
    now_ms: u64,
    encoded: Vec<u8>,
    expires_column: i64,
    /// What the database checks `now_ms` against (`None` for an injected clock).
    check_ms: Option<i64>,
}

impl EarlyRecord {
    /// The record for `message` at the store's estimate of the database's clock; `None` where
    /// there is none ([`PgStore::estimated_now_ms`](crate::storage::store::PgStore::estimated_now_ms)).
    fn new(consumer: &PgConsumer, message: &Message<'_>, clock: ClockReading) -> Option<Self> {
        let (now_ms, check_ms) = consumer.store.estimated_now_ms(clock, message)?;
        let (record, removable_at_ms) =
            completed_record(&consumer.store, 1, message.fingerprint(), now_ms, b"", true);
        Some(EarlyRecord {
            now_ms,
            encoded: record.encode(),
            expires_column: expires_column(removable_at_ms),
            check_ms,
        })
    }
}

/// Decides a claim from the answers of the claim's function (the key's lock, the time and
/// the key's row in one row) and, with an entity version, of the entity's lock and read, at
/// `clock`'s time: no I/O.
fn decide_claim(
    consumer: &PgConsumer,
    answers: crate::sql::txn::Answers,
    message: &Message<'_>,
    entity: Option<(&[u8], u64)>,
    clock: ClockReading,
) -> Result<Decided> {
    let inner = &consumer.store.inner;
    let key = message.key();
    let mut answers = answers.into_iter();
    let mut next_rows = || answers.next().unwrap_or_else(|| Ok(Vec::new()));
    let lock = crate::sql::txn::single_row(next_rows()?)?;
    let entity_lock = next_rows();
    let current_version = next_rows();
    let db_now_ms: i64 = lock.get(1);
    inner.clock_offset.learn(db_now_ms);
    let now_ms = clock.now_ms(db_now_ms);
    if !lock.get::<_, bool>(0) {
        return Ok(Decided {
            db_now_ms,
            now_ms,
            verdict: Err(Outcome::held_by_claim(now_ms)),
            replaces_a_row: false,
        });
    }
    let record = lock
        .get::<_, Option<&[u8]>>(2)
        .map(|bytes| decode_record(key, bytes))
        .transpose()?;
    let found = inspect_record(record, message.fingerprint(), now_ms);
    // Epochs start at 1: a claimable key with a row replaces a nonzero epoch.
    let replaces_a_row =
        matches!(found, Found::Claimable { replaces_epoch, .. } if replaces_epoch != 0);
    let decided = |verdict| {
        Ok(Decided {
            db_now_ms,
            now_ms,
            verdict,
            replaces_a_row,
        })
    };
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
        if !crate::sql::txn::single_row(entity_lock?)?.get::<_, bool>(0) {
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
    let inserted = lock.get::<_, bool>(3);
    decided(Ok(Claimable {
        replaces_epoch,
        previous,
        version,
        inserted,
    }))
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
    /// The store's clock as the claim's `begin` read it; its commit reads its own, unless the
    /// claim was begun by `apply`, whose one reading serves the whole call.
    clock: ClockReading,
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
    /// Read positions the commit writes (log consumers).
    positions: StagedPositions,
    /// The message's correlation id, for the commit's log event.
    correlation_id: Option<Box<str>>,
    /// The time of the record the claim's function inserted for the new key, if it did.
    early: Option<u64>,
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

    /// Stages the read position of a log consumer: `offset` of `partition` of `source` (a
    /// topic, a stream) is written in this claim's transaction, with its record and business
    /// SQL, so that a restart resumes after this message exactly when its effects are
    /// committed. Staged more than once for a partition, the highest offset is written.
    /// [`PgConsumer::positions`] reads them back.
    ///
    /// # Errors
    /// [`Error::Idemdb`] with `LimitExceeded` for a source outside
    /// [`idemdb::POSITION_SOURCE_BYTES_MIN`]..=[`idemdb::POSITION_SOURCE_BYTES_MAX`] bytes,
    /// with `InvalidArgument` for one containing NUL or an offset past
    /// [`crate::POSITION_OFFSET_MAX`]. The commit
    /// fails with [`idemdb::Error::PositionBehind`] (in [`Error::Idemdb`]), writing nothing,
    /// if `offset` is then behind the partition's stored position.
    pub fn stage_position(&mut self, source: &str, partition: u32, offset: u64) -> Result<()> {
        self.positions.stage(source, partition, offset)
    }

    /// Replaces the read positions staged so far with `positions` (checked when staged):
    /// `apply_at`'s position, on the claim of its long way.
    pub(crate) fn replace_positions(&mut self, positions: StagedPositions) {
        self.positions = positions;
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
    /// A new key's record went out with the claim, and is already in the claim's transaction:
    /// with an empty result, business SQL given to [`commit_with`](PgClaim::commit_with) (or a
    /// staged read position) and a commit within a second of the claim (the clock tolerance
    /// `apply`'s records are written within), that record stands, with the claim's time (its
    /// retention starts then), and nothing more is written for it; otherwise (a result, no SQL
    /// of the caller's, a later commit, a key that had a row, an entity version) the commit
    /// writes the record at its own time.
    ///
    /// # Errors
    /// [`Error::Idemdb`] for a result over `RESULT_BYTES_MAX`, or an injected clock
    /// ([`StoreBuilder::clock`](crate::StoreBuilder::clock)) reading past
    /// [`idemdb::CLOCK_MS_MAX`] (`ClockOutOfRange`): nothing is written, the transaction rolls
    /// back. [`Error::Postgres`] when a statement or the commit fails; if the
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
    /// statements carry their parameters' types; each is prepared on the connection the first
    /// time it is sent there (one round trip then) and only bound and run after that, unless
    /// the store's prepared statements are off ([`StoreBuilder::prepared_statements`](crate::StoreBuilder::prepared_statements)). Any
    /// failure rolls everything back.
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
        self.commit_at(result.as_ref(), statements, false).await
    }

    /// [`commit_with`](PgClaim::commit_with) at a reading of the store's clock of its own, or
    /// at the one its `begin` took (`apply`, one call: `same_call`).
    pub(crate) async fn commit_at(
        self,
        result: &[u8],
        statements: &[TypedStatement<'_>],
        same_call: bool,
    ) -> Result<()> {
        let started = Instant::now();
        // Refused before anything is sent; the rollback is waited for, so that the key is
        // free when the error returns. The clock is read once, here (an injected one checked).
        let checked = check_result(result)
            .and_then(|()| crate::sql::txn::check_sendable(statements))
            .and_then(|()| {
                if same_call {
                    Ok(self.clock)
                } else {
                    self.consumer.store.read_clock()
                }
            });
        let clock = match checked {
            Ok(clock) => clock,
            Err(error) => return self.tx.fail(error).await,
        };
        let consumer = &self.consumer;
        let store = &consumer.store;
        let (db_ms, decided) = self.decided_at;
        let now_ms = clock.now_ms(
            db_ms.saturating_add(i64::try_from(decided.elapsed().as_millis()).unwrap_or(i64::MAX)),
        );
        // The record the claim's function inserted stands for this commit's when the result is
        // empty (the state, epoch and fingerprint are the same by construction) and its time is
        // within the clock tolerance of the commit's: nothing is sent for it then. Its time is
        // the claim's, up to the tolerance from the commit's, as a record `apply` writes is up to
        // it from the database's clock. A commit later than that writes its own record. So does
        // a commit that would send `COMMIT` alone: PostgreSQL answers the `COMMIT` of a
        // transaction that a statement on `transaction()` aborted with a rollback and no
        // error, so some statement's answer must say the transaction still stands (the
        // caller's, or a read position's, checked before the `COMMIT`'s).
        // And a retention shorter than the wait would leave a record already expired at its
        // commit: it stands only while it is live.
        let answered_before_commit = !statements.is_empty() || !self.positions.is_empty();
        let retention_ms = store.inner.retention_ms;
        let early_stands = result.is_empty()
            && answered_before_commit
            && matches!(self.early, Some(early_ms)
                if early_ms.abs_diff(now_ms) <= CLOCK_TOLERANCE_MS
                    && early_ms.saturating_add(retention_ms) > now_ms);
        let epoch = self.epoch();
        // The commit's own record, made only when it is written.
        let row = (!early_stands).then(|| {
            let (record, expires_at_ms) =
                completed_record(store, epoch, self.fingerprint, now_ms, result, true);
            RecordRow::new(
                consumer,
                &self.key,
                &record,
                expires_at_ms,
                self.replaces_epoch != 0 || self.early.is_some(),
            )
        });
        let row_params = row.as_ref().map(RecordRow::params);
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
        let mut writes: Vec<TypedStatement<'_>> = Vec::new();
        if let (Some(row), Some(params)) = (&row, &row_params) {
            writes.push((row.sql, params));
        }
        if self.version.is_some() {
            writes.push((&store.inner.write_version, &version_params));
        }
        let position_params = self.positions.params(id, now_ms);
        let position_typed = position_params.typed();
        if !self.positions.is_empty() {
            writes.push(advance_statement(store, &position_typed));
        }
        // The record (and the entity's version) and COMMIT in one round trip.
        match self.tx.commit_with(statements, &writes).await {
            Ok(_) => {}
            Err(CommitFailed::Staged(error)) => return Err(Error::Postgres(error)),
            Err(CommitFailed::Store(error)) => {
                return Err(
                    position_behind(&error).unwrap_or_else(|| store.write_failed(error, &self.key))
                );
            }
            Err(CommitFailed::Commit(error)) => return Err(Error::Postgres(error)),
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

/// The ordering guard's lock of a claim's entity (two `int4`s: see [`entity_lock_id`]), taken
/// after the key's.
const LOCK_ENTITY: &str = "SELECT pg_try_advisory_xact_lock($1, $2)";
