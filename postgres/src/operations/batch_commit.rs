//! A batch's commit: every winner's record in one statement with the business SQL of the
//! whole batch, and `COMMIT`, in one round trip.

use std::time::Instant;

use idemdb::PreviousAttempt;
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::operations::batch::BatchClaim;
use crate::operations::batch::PgBatchOutcome;
use crate::operations::batch::PgClaimBatch;
use crate::sql::txn::CommitFailed;
use crate::sql::txn::Statement;
use crate::storage::positions::{advance_statement, position_behind};
use crate::storage::store::PgConsumer;

/// The rows a batch's commit writes with one of its two lists (inserted or updated), as the
/// statement's parallel arrays.
#[derive(Default)]
struct Rows<'k> {
    keys: Vec<&'k [u8]>,
    records: Vec<Vec<u8>>,
    expires_at_ms: Vec<i64>,
}

impl<'c> PgClaimBatch<'c> {
    /// The batch's transaction, for the business SQL of its fresh messages. Do not commit or
    /// roll it back yourself: [`PgClaimBatch::commit`] does, and dropping the batch rolls back.
    #[must_use]
    pub fn transaction(&self) -> &Client {
        self.tx.client()
    }

    /// Each message's outcome, in the order the messages were given.
    #[must_use]
    pub fn outcomes(&self) -> &[PgBatchOutcome] {
        &self.outcomes
    }

    /// The outcome of message `index`; `None` past the end of the batch.
    #[must_use]
    pub fn outcome(&self, index: usize) -> Option<&PgBatchOutcome> {
        self.outcomes.get(index)
    }

    /// The number of messages in the batch.
    #[must_use]
    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    /// True for a batch of no messages.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// The epoch the committed record of message `index` will have; `None` unless it is
    /// fresh and not released.
    #[must_use]
    pub fn epoch(&self, index: usize) -> Option<u64> {
        Some(self.claims.get(index)?.as_ref()?.epoch())
    }

    /// The external attempt the claim of message `index` took over after its lease ran out,
    /// if any (its side effect may have been partly applied).
    #[must_use]
    pub fn previous_attempt(&self, index: usize) -> Option<&PreviousAttempt> {
        self.claims.get(index)?.as_ref()?.previous.as_ref()
    }

    /// The idempotency key to give a downstream call made for message `index` at `step`: the
    /// embedded engine's derivation ([`idemdb::format::derive_key`]), as
    /// [`crate::operations::claim::PgClaim::derive_key`] gives it. `None` unless the message is fresh and not
    /// released.
    #[must_use]
    pub fn derive_key(&self, index: usize, step: &str) -> Option<String> {
        let claim = self.claims.get(index)?.as_ref()?;
        Some(idemdb::format::derive_key(&claim.stored_key, step))
    }

    /// Leaves message `index` out of the commit (its handler failed): no record is written for
    /// it, so its redelivery is fresh again. Its key stays locked until the batch ends, and
    /// SQL already run for it in the batch's transaction stays in it: roll that back to a
    /// savepoint first. Does nothing for a message that holds no claim.
    pub fn release(&mut self, index: usize) {
        if let Some(slot) = self.claims.get_mut(index) {
            *slot = None;
        }
    }

    /// Stages the read position of a log consumer for the whole batch: written in the batch's
    /// transaction with every claim still held, even if none is (a batch of duplicates still
    /// moves the position). Staged more than once for a partition, the highest offset is
    /// written: stage the offset of the batch's last message, settled or fresh.
    ///
    /// # Errors
    /// As for [`PgClaim::stage_position`](crate::PgClaim::stage_position); the commit fails
    /// with [`idemdb::Error::PositionBehind`] (in [`Error::Idemdb`]), writing nothing, if an
    /// offset is then behind its partition's stored position.
    pub fn stage_position(&mut self, source: &str, partition: u32, offset: u64) -> Result<()> {
        self.positions.stage(source, partition, offset)
    }

    /// Writes the completed record of every claim still held, with the result `result_of`
    /// gives for its index (returned to duplicates), in **one** statement, and commits the
    /// transaction: the records and the business SQL of the batch land together or not at
    /// all. `result_of` is called for those indexes only, in order.
    ///
    /// # Errors
    /// [`Error::Idemdb`] for a result over `RESULT_BYTES_MAX`, or an injected clock
    /// ([`StoreBuilder::clock`](crate::StoreBuilder::clock)) reading past
    /// [`idemdb::CLOCK_MS_MAX`] (`ClockOutOfRange`); [`Error::LostKey`] if an
    /// entity's version could not be written (the entity's lock should make it impossible; a
    /// replaced record whose row removal deleted meanwhile is written anew, not an error);
    /// [`Error::Postgres`]
    /// when a statement or the commit fails, a business statement of the batch included. A
    /// failed statement makes the COMMIT sent behind it roll back, and nothing is written; if
    /// the connection dropped during the COMMIT its outcome is unknown: do not acknowledge the
    /// batch, and its redelivery finds every message `Duplicate` or every message `Fresh`,
    /// never half of the batch.
    pub async fn commit<R: AsRef<[u8]>>(self, result_of: impl FnMut(usize) -> R) -> Result<()> {
        self.commit_with(result_of, &[]).await
    }

    /// [`commit`](PgClaimBatch::commit) with the batch's business SQL: runs `statements` in
    /// order in the batch's transaction, then writes the records and commits, in one round
    /// trip (statements run on
    /// [`transaction`](PgClaimBatch::transaction) first cost one each). Statements are
    /// prepared once per connection, as [`crate::operations::claim::PgClaim::commit_with`]'s.
    ///
    /// # Errors
    /// As [`commit`](PgClaimBatch::commit); a statement's own failure is [`Error::Postgres`]
    /// with its error; a statement that cannot be sent (a parameter that does not encode as
    /// its type) is [`Error::BadStatement`], found before anything is sent.
    pub async fn commit_with<R: AsRef<[u8]>>(
        self,
        mut result_of: impl FnMut(usize) -> R,
        statements: &[crate::sql::txn::Statement<'_>],
    ) -> Result<()> {
        let started = Instant::now();
        let PgClaimBatch {
            tx,
            consumer,
            claims,
            decided_at: (db_ms, decided),
            positions,
            ..
        } = self;
        // Refused before anything is sent; the rollback is waited for, so that every key of
        // the batch is free when the error returns.
        if let Err(error) = crate::sql::txn::check_sendable(statements) {
            return tx.fail(error).await;
        }
        let mut held = Vec::new();
        for (index, claim) in claims.iter().enumerate() {
            if let Some(claim) = claim {
                let result = result_of(index);
                if let Err(error) = crate::storage::records::check_result(result.as_ref()) {
                    return tx.fail(error).await;
                }
                held.push((claim, result));
            }
        }
        // The store's clock, read once (an injected one checked before anything is sent).
        let clock = match consumer.store.read_clock() {
            Ok(clock) => clock,
            Err(error) => return tx.fail(error).await,
        };
        let now_ms = clock.now_ms(
            db_ms.saturating_add(i64::try_from(decided.elapsed().as_millis()).unwrap_or(i64::MAX)),
        );
        let rows = Records::of(&consumer, &held, now_ms);
        // The ordering guard's new versions, written with the records.
        let (entity_keys, versions): (Vec<&[u8]>, Vec<Vec<u8>>) = held
            .iter()
            .filter_map(|(claim, _)| claim.version.as_ref())
            .map(|(entity_key, version)| (entity_key.as_slice(), version.to_be_bytes().to_vec()))
            .unzip();
        let consumer_id: &[u8] = &consumer.id;
        let version_params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&consumer_id, Type::BYTEA),
            (&entity_keys, Type::BYTEA_ARRAY),
            (&versions, Type::BYTEA_ARRAY),
        ];
        let write_versions: Option<Statement<'_>> = (!entity_keys.is_empty())
            .then_some((&consumer.store.inner.write_versions_many, &version_params));
        // The caller's SQL, the records, the versions and COMMIT go out together: every
        // write writes its rows or fails (an insert on the primary key; a replaced row is
        // upserted), and a failed business statement is reported by its own answer rather
        // than by a COMMIT that PostgreSQL answers with a silent rollback.
        let Records { inserted, replaced } = &rows;
        let params: [(&(dyn ToSql + Sync), Type); 7] = [
            (&consumer_id, Type::BYTEA),
            (&inserted.keys, Type::BYTEA_ARRAY),
            (&inserted.records, Type::BYTEA_ARRAY),
            (&inserted.expires_at_ms, Type::INT8_ARRAY),
            (&replaced.keys, Type::BYTEA_ARRAY),
            (&replaced.records, Type::BYTEA_ARRAY),
            (&replaced.expires_at_ms, Type::INT8_ARRAY),
        ];
        let inner = &consumer.store.inner;
        let write: Statement<'_> = if held.is_empty() {
            ("SELECT 1", &[])
        } else if replaced.keys.is_empty() {
            (&inner.insert_many, &params[..4])
        } else {
            (&inner.write_many, &params)
        };
        let position_params = positions.params(consumer_id, now_ms);
        let position_typed = position_params.typed();
        let write_positions: Option<Statement<'_>> =
            (!positions.is_empty()).then(|| advance_statement(&consumer.store, &position_typed));
        let writes: Vec<Statement<'_>> = std::iter::once(write)
            .chain(write_versions)
            .chain(write_positions)
            .collect();
        match tx.commit_with(statements, &writes).await {
            Ok(_) => {}
            Err(CommitFailed::Staged(error)) => return Err(Error::Postgres(error)),
            Err(CommitFailed::Commit(error)) => return Err(Error::Postgres(error)),
            Err(CommitFailed::Store(error)) => {
                if let Some(behind) = position_behind(&error) {
                    return Err(behind);
                }
                let key = held.first().map_or(&[][..], |(claim, _)| &claim.key);
                return Err(consumer.store.write_failed(error, key));
            }
        }
        // Each claim's commit is counted and logged, as the embedded batch reports its claims:
        // each with the batch's commit time, read once.
        let elapsed = started.elapsed();
        for (claim, _) in &held {
            consumer.metrics.commit(elapsed);
            consumer
                .metrics
                .log_step("commit", &claim.stored_key, claim.epoch(), None, None);
        }
        Ok(())
    }
}

/// The rows of a batch's completed records: new ones to insert, and those that replace a row
/// (expired, released, or a lease run out) to upsert.
struct Records<'k> {
    inserted: Rows<'k>,
    replaced: Rows<'k>,
}

impl<'k> Records<'k> {
    /// The completed record of each claim in `held` with its result, committed at `now_ms`.
    fn of<R: AsRef<[u8]>>(
        consumer: &PgConsumer,
        held: &[(&'k BatchClaim, R)],
        now_ms: u64,
    ) -> Records<'k> {
        let mut records = Records {
            inserted: Rows::default(),
            replaced: Rows::default(),
        };
        for (claim, result) in held {
            let (record, expires_at_ms) = crate::storage::records::completed_record(
                &consumer.store,
                claim.epoch(),
                claim.fingerprint,
                now_ms,
                result.as_ref(),
                true,
            );
            let rows = if claim.replaces_epoch == 0 {
                &mut records.inserted
            } else {
                &mut records.replaced
            };
            rows.keys.push(&claim.key);
            rows.records.push(record.encode());
            rows.expires_at_ms
                .push(crate::storage::records::expires_column(expires_at_ms));
        }
        records
    }
}
