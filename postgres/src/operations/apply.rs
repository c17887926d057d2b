//! A message's business SQL run exactly once, in one round trip when the key is new.
//!
//! [`PgConsumer::begin`] and [`PgClaim::commit_with`](crate::operations::claim::PgClaim::commit_with) cost two
//! round trips: the claim's answer must come back before the caller knows what to run. A
//! handler whose SQL does not depend on the answer (insert the order, add to the balance) can
//! send everything at once: `BEGIN`, one call of the store's function `<table>_apply`, which
//! takes the key's lock and inserts the completed record when the key has no row (and fails
//! otherwise, with the key's row in its error), the caller's SQL and `COMMIT`: four
//! statements, as a hand-written dedup insert in front of the same SQL would send. When the key
//! is new (most deliveries), that one round trip is the whole of it. When it is not, the
//! statement fails, the transaction rolls back with the caller's SQL, and the key's row, from
//! the error, decides: a duplicate, a conflict or a live external claim is answered from it,
//! in the same round trip; a record that can be taken over (expired, released, a lease run
//! out), or a key held by a claim in flight, is decided and committed as
//! [`PgConsumer::begin_message`] and `commit_with` do.
//!
//! Why the shortcut cannot give a second winner: the insert is decided by the records' unique
//! key, whose check sees rows committed after the statement began and rows still being
//! written; and the key's lock, taken in the same statement, keeps it from a claim that holds
//! the key but writes its row only at its commit.
//!
//! The record's times are written before the database's clock is read, so they come from this
//! process's clock, corrected by the offset to the database's clock seen at the last claim of
//! the store (see [`ClockOffset`](crate::sql::clock::ClockOffset)). The insert checks the estimate against the database's clock
//! and refuses to write if they differ by more than [`CLOCK_TOLERANCE_MS`]; the slow path then
//! writes the database's time and learns the offset again.

use std::time::Instant;

use idemdb::decision::{Found, admit, inspect_record};
use idemdb::format::encode_key;
use idemdb::{Message, Outcome};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::operations::positions::ReadPosition;
use crate::sql::txn::{ClaimTransaction, Connection, LOST_ROW, Statement, Whole, single_row};
use crate::storage::observe::OutcomeKind;
use crate::storage::positions::{StagedPositions, advance_statement, position_behind};
use crate::storage::records::check_result;
use crate::storage::records::completed_record;
use crate::storage::records::decode_record;
use crate::storage::records::expires_column;
use crate::storage::records::lock_id;
use crate::storage::store::CLOCK_TOLERANCE_MS;
use crate::storage::store::ClockReading;
use crate::storage::store::PgConsumer;

/// One call of `apply` or `apply_at`: the message, what it commits, and the one reading of the
/// store's clock it is decided at.
#[derive(Clone, Copy)]
struct Call<'a> {
    message: &'a Message<'a>,
    stored_key: &'a [u8],
    result: &'a [u8],
    statements: &'a [Statement<'a>],
    /// The read positions written with the record (none for `apply`).
    positions: &'a StagedPositions,
    started: Instant,
    clock: ClockReading,
}

/// What the one round trip did.
enum OneTrip {
    /// Committed the record at epoch 1 with the caller's statements.
    Applied,
    /// Wrote nothing: the message's outcome, decided in the same round trip.
    Settled(Outcome<std::convert::Infallible>),
    /// Wrote nothing; decide the message the two-round-trip way.
    LongWay,
}

/// What [`PgConsumer::apply`] committed: the message's statements and its completed record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Applied {
    /// The committed record's epoch: 1 for a key without a row (never claimed, or its
    /// expired record already removed by [`PgStore::maintain`](crate::PgStore::maintain)),
    /// the next epoch for a key whose expired, released or taken-over record was still stored.
    pub epoch: u64,
    /// True when the message was decided and committed by the one-round-trip path (the key
    /// was new and the clocks agreed); false when it took the two-round-trip path of
    /// `begin_message` and `commit_with`. On a connection the store has not used before, the
    /// statements are prepared first, in round trips of their own, whichever path it takes.
    pub one_round_trip: bool,
}

impl PgConsumer {
    /// Runs `statements` for `message` exactly once: commits them with the message's completed
    /// record (`result` for its duplicates) if the message is fresh, and otherwise runs nothing
    /// and returns what [`begin_message`](PgConsumer::begin_message) would have (`Duplicate`,
    /// `InProgress`, `Conflict`, `TooLate`, `Stale`). For handlers whose SQL does not depend on
    /// the claim's answer; the others [`begin_message`](PgConsumer::begin_message), run their
    /// SQL, and [`commit_with`](crate::operations::claim::PgClaim::commit_with).
    ///
    /// A new key (no row at all, its lock free, no entity version) costs one round trip: the
    /// lock, the record, the statements and `COMMIT` go out together. Any other message is
    /// first tried that way too (the record's insert then fails and the transaction rolls back,
    /// statements included), and is then decided and committed in two more round trips. The
    /// first call on a store takes the longer way, to learn the database's clock. A key that is
    /// not new fails the first statement, which carries the key's row back in its error (a
    /// duplicate is answered in the one round trip): an error on the server's side like any
    /// other, so with PostgreSQL's default logging each one writes a line to the server's log,
    /// with the statement and the stored record (in hex) in its detail.
    ///
    /// ```no_run
    /// # async fn example(client: &mut tokio_postgres::Client, orders: idemdb_postgres::PgConsumer)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use idemdb::{Fingerprint, Message, Outcome};
    /// use tokio_postgres::types::Type;
    /// let (id, total): (&[u8], i64) = (b"order-7", 4200);
    /// let message = Message::new(id, Fingerprint::of(b"order-7 4200"));
    /// match orders
    ///     .apply(client, &message, b"accepted", &[(
    ///         "INSERT INTO orders (id, total) VALUES ($1, $2)",
    ///         &[(&id, Type::BYTEA), (&total, Type::INT8)],
    ///     )])
    ///     .await?
    /// {
    ///     Outcome::Fresh(_) | Outcome::Duplicate { .. } => { /* acknowledge */ }
    ///     _ => { /* do not acknowledge: redeliver later, or dead-letter */ }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`begin_message`](PgConsumer::begin_message) and
    /// [`commit_with`](crate::operations::claim::PgClaim::commit_with): a key or result outside the limits before
    /// anything is sent, and so is a statement that cannot be sent ([`Error::BadStatement`]: a
    /// parameter that does not encode as its type); a statement's own failure as
    /// [`Error::Postgres`] with nothing written;
    /// a connection lost during the call leaves the outcome unknown (do not acknowledge; the
    /// redelivery finds `Duplicate` or `Fresh`, never half of it).
    pub async fn apply(
        &self,
        client: &mut Client,
        message: &Message<'_>,
        result: impl AsRef<[u8]>,
        statements: &[Statement<'_>],
    ) -> Result<Outcome<Applied>> {
        self.apply_staged(
            client,
            message,
            StagedPositions::default(),
            result.as_ref(),
            statements,
        )
        .await
    }

    /// [`apply`](PgConsumer::apply) for a log consumer: `at`, the message's place in the log,
    /// becomes the consumer's read position in the same transaction as the message's record
    /// and statements, as [`PgClaim::stage_position`](crate::PgClaim::stage_position) makes it
    /// for a claim, and a new key still costs one round trip (the position's write goes out
    /// with the rest, after the caller's statements). The position moves only with a commit:
    /// any outcome but `Fresh` writes nothing, the position included, as a claim that is not
    /// won stages nothing; move it for messages settled that way with
    /// [`PgPositions::advance`](crate::PgPositions::advance). An offset behind the partition's
    /// stored position fails the call with [`idemdb::Error::PositionBehind`] (in
    /// [`Error::Idemdb`]), with nothing written (record, statements, position): a stale reader,
    /// as at a claim's commit.
    ///
    /// ```no_run
    /// # async fn example(client: &mut tokio_postgres::Client, orders: idemdb_postgres::PgConsumer)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use idemdb::{Fingerprint, Message, Outcome};
    /// use idemdb_postgres::ReadPosition;
    /// use tokio_postgres::types::Type;
    /// // The message at offset 41 of partition 3 of the "orders" topic.
    /// let (id, total): (&[u8], i64) = (b"order-7", 4200);
    /// let message = Message::new(id, Fingerprint::of(b"order-7 4200"));
    /// let at = ReadPosition::new("orders", 3, 41);
    /// let insert = "INSERT INTO orders (id, total) VALUES ($1, $2)";
    /// match orders
    ///     .apply_at(client, &message, at, b"accepted", &[(
    ///         insert,
    ///         &[(&id, Type::BYTEA), (&total, Type::INT8)],
    ///     )])
    ///     .await?
    /// {
    ///     // Committed with its order row and the position: a restart resumes at 42.
    ///     Outcome::Fresh(_) => {}
    ///     // Nothing written: move the position past it on its own.
    ///     Outcome::Duplicate { .. } => orders.positions().advance(client, "orders", 3, 41).await?,
    ///     _ => { /* do not acknowledge: redeliver later, or dead-letter */ }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`apply`](PgConsumer::apply); as
    /// [`PgClaim::stage_position`](crate::PgClaim::stage_position) for a source or offset
    /// outside the limits, before anything is sent; [`idemdb::Error::PositionBehind`] (in
    /// [`Error::Idemdb`]) for an offset behind the stored one, nothing written.
    pub async fn apply_at(
        &self,
        client: &mut Client,
        message: &Message<'_>,
        at: ReadPosition<'_>,
        result: impl AsRef<[u8]>,
        statements: &[Statement<'_>],
    ) -> Result<Outcome<Applied>> {
        let mut positions = StagedPositions::default();
        positions.stage(at.source, at.partition, at.offset)?;
        self.apply_staged(client, message, positions, result.as_ref(), statements)
            .await
    }

    /// `apply` with the read `positions` to write with the record (none for `apply`).
    async fn apply_staged(
        &self,
        client: &mut Client,
        message: &Message<'_>,
        positions: StagedPositions,
        result: &[u8],
        statements: &[Statement<'_>],
    ) -> Result<Outcome<Applied>> {
        let started = Instant::now();
        check_result(result)?;
        crate::sql::txn::check_sendable(statements)?;
        let stored_key = encode_key(&self.id, message.key())?;
        // The store's clock, read once for the whole call (an injected one checked before
        // anything is sent): the one round trip, the decision after it and the long way's
        // claim and commit all take their time from this reading.
        let clock = self.store.read_clock()?;
        let call = Call {
            message,
            stored_key: &stored_key,
            result,
            statements,
            positions: &positions,
            started,
            clock,
        };
        // A message with an entity's version takes the long way (which checks the entity key).
        if message.entity_version().is_none() {
            match self.apply_if_new(client, &call).await? {
                OneTrip::Applied => {
                    return Ok(Outcome::Fresh(Applied {
                        epoch: 1,
                        one_round_trip: true,
                    }));
                }
                OneTrip::Settled(outcome) => return Ok(outcome.map_fresh(|never| match never {})),
                OneTrip::LongWay => {}
            }
        }
        let mut claim = None;
        let outcome = self
            .begin_on(Connection::from(client), message, Some(clock))
            .await?
            .map_fresh(|fresh| {
                let epoch = fresh.epoch();
                claim = Some(fresh);
                Applied {
                    epoch,
                    one_round_trip: false,
                }
            });
        if let Some(mut claim) = claim {
            claim.replace_positions(positions);
            claim.commit_at(result, statements, true).await?;
        }
        Ok(outcome)
    }

    /// The one round trip: committed, settled, or to be decided the long way (nothing of it
    /// written).
    async fn apply_if_new(&self, client: &mut Client, call: &Call<'_>) -> Result<OneTrip> {
        let Call {
            message,
            stored_key,
            result,
            statements,
            positions,
            started,
            clock,
        } = *call;
        let store = &self.store;
        let inner = &store.inner;
        let Some((now_ms, db_check_ms)) = store.estimated_now_ms(clock, message) else {
            return Ok(OneTrip::LongWay);
        };
        // A message produced near the admission floor's horizon is left to the database's own
        // clock: within the tolerance, the estimate could admit what the database refuses.
        if inner.admission_floor
            && let Some(produced_at_ms) = message.production_time_ms()
            && produced_at_ms
                <= now_ms
                    .saturating_sub(inner.retention_ms)
                    .saturating_add(CLOCK_TOLERANCE_MS)
        {
            return Ok(OneTrip::LongWay);
        }
        const EPOCH: u64 = 1;
        let (record, removable_at_ms) =
            completed_record(store, EPOCH, message.fingerprint(), now_ms, result, true);
        let key = message.key();
        let id: &[u8] = &self.id;
        let encoded = record.encode();
        let expires = expires_column(removable_at_ms);
        let lock_number = lock_id(&inner.lock_namespace, stored_key);
        let insert_params: [(&(dyn ToSql + Sync), Type); 6] = [
            (&id, Type::BYTEA),
            (&key, Type::BYTEA),
            (&encoded, Type::BYTEA),
            (&expires, Type::INT8),
            (&db_check_ms, Type::INT8),
            (&lock_number, Type::INT8),
        ];
        let store_statements: [Statement<'_>; 1] = [(&inner.insert_if_new, &insert_params)];
        // A read position is written after the caller's statements, as a claim's commit
        // writes it: its row is locked in the same order either way.
        let position_params = positions.params(id, now_ms);
        let position_typed = position_params.typed();
        let after: Vec<Statement<'_>> = if positions.is_empty() {
            Vec::new()
        } else {
            vec![advance_statement(store, &position_typed)]
        };
        let Whole {
            store: answers,
            staged,
            after,
            committed,
        } = ClaimTransaction::run_whole(
            client,
            &inner.statements,
            &store_statements,
            statements,
            &after,
        )
        .await?;
        let claimed = answers.into_iter().next().unwrap_or_else(|| Ok(Vec::new()));
        let metrics = &self.metrics;
        let correlation = message.correlation();
        // The database's time, learned when it was checked against this process's estimate
        // (not with an injected clock).
        let learn = |db_now_ms: i64| {
            if db_check_ms.is_some() {
                inner.clock_offset.learn(db_now_ms);
            }
        };
        match claimed {
            Ok(rows) => learn(single_row(rows)?.get(0)),
            // Nothing inserted, nothing of the transaction written: the key's row, in the
            // error's detail, decides.
            Err(error)
                if error.code().map(SqlState::code)
                    == Some(crate::tables::install::NOT_NEW_SQLSTATE) =>
            {
                let (db_now_ms, stored) = not_new_detail(&error)?;
                learn(db_now_ms);
                return self.settle(call, db_now_ms, stored.as_deref());
            }
            // The insert met a row its read did not see (the unique key backs the read up):
            // the key's row, read in one more round trip, decides.
            Err(error)
                if error.code() == Some(LOST_ROW)
                    || error.code() == Some(&SqlState::UNIQUE_VIOLATION) =>
            {
                // The rollback's answer came with the COMMIT's; the read runs after it, unnamed:
                // planned for the table as it is now (a kept plan could be one made when the
                // table was small, which scans it whole), and outside any transaction, where
                // the seqscan setting of the claims' reads cannot be set and restored around it.
                let read_params: [(&(dyn ToSql + Sync), Type); 2] =
                    [(&id, Type::BYTEA), (&key, Type::BYTEA)];
                let row = single_row(client.query_typed(&inner.read_at, &read_params).await?)?;
                let db_now_ms: i64 = row.get(1);
                learn(db_now_ms);
                return self.settle(call, db_now_ms, row.get::<_, Option<&[u8]>>(0));
            }
            Err(error) => return Err(store.write_failed(error, key)),
        }
        if let Some(Err(error)) = staged.into_iter().find(std::result::Result::is_err) {
            return Err(Error::Postgres(error));
        }
        // The read position behind the stored one (a stale reader): nothing was committed.
        if let Some(Err(error)) = after.into_iter().find(std::result::Result::is_err) {
            return Err(position_behind(&error).unwrap_or_else(|| store.write_failed(error, key)));
        }
        // A COMMIT's own failure is the connection's or a deferred check of the caller's, never
        // the record's write (whose answer was read above).
        committed.map_err(Error::Postgres)?;
        metrics.outcome(OutcomeKind::Fresh, started.elapsed(), None);
        metrics.log_begin(key, OutcomeKind::Fresh, correlation);
        metrics.commit(started.elapsed());
        metrics.log_step("commit", stored_key, EPOCH, None, correlation);
        Ok(OneTrip::Applied)
    }

    /// What a one-round-trip claim that inserted nothing settles to, from the key's row
    /// `stored` (none: the lock was held or the clocks were apart) at the database's time.
    fn settle(&self, call: &Call<'_>, db_now_ms: i64, stored: Option<&[u8]>) -> Result<OneTrip> {
        let Call {
            message,
            started,
            clock,
            ..
        } = *call;
        let inner = &self.store.inner;
        let key = message.key();
        let Some(bytes) = stored else {
            return Ok(OneTrip::LongWay);
        };
        let db_now = clock.now_ms(db_now_ms);
        let found = inspect_record(
            Some(decode_record(key, bytes)?),
            message.fingerprint(),
            db_now,
        );
        let floor_ms = inner.admission_floor.then_some(inner.retention_ms);
        match admit(found, message.production_time_ms(), db_now, floor_ms) {
            Found::Settled(outcome) => {
                self.metrics.begun(
                    &outcome,
                    db_now,
                    started.elapsed(),
                    key,
                    message.correlation(),
                );
                Ok(OneTrip::Settled(outcome))
            }
            // Expired, released, or a lease run out: taken over at the next epoch.
            Found::Claimable { .. } => Ok(OneTrip::LongWay),
        }
    }
}

/// The database's time and the key's row (none when it has none) from the detail of
/// `<table>_apply`'s refusal: `<time> <row in hex>`.
///
/// # Errors
/// [`Error::UnexpectedAnswer`] for a detail of another shape.
fn not_new_detail(error: &tokio_postgres::Error) -> Result<(i64, Option<Vec<u8>>)> {
    let malformed = || Error::UnexpectedAnswer {
        detail: "the one-round-trip insert's refusal carries no time and row",
    };
    let detail = error
        .as_db_error()
        .and_then(|db| db.detail())
        .ok_or_else(malformed)?;
    let (time, row) = detail.split_once(' ').ok_or_else(malformed)?;
    let db_now_ms: i64 = time.parse().map_err(|_| malformed())?;
    if row.is_empty() {
        return Ok((db_now_ms, None));
    }
    let hex = row.as_bytes();
    if hex.len() % 2 != 0 {
        return Err(malformed());
    }
    let digit = |byte: u8| match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        _ => None,
    };
    let mut bytes = Vec::with_capacity(hex.len() / 2);
    for pair in hex.chunks_exact(2) {
        match (digit(pair[0]), digit(pair[1])) {
            (Some(high), Some(low)) => bytes.push(high << 4 | low),
            _ => return Err(malformed()),
        }
    }
    Ok((db_now_ms, Some(bytes)))
}
