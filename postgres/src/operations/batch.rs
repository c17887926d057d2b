//! Batch claims: a broker batch of messages claimed in one transaction, and its winners'
//! records committed in one statement with the business SQL of the whole batch.
//!
//! The claim is one call of the store's function `<table>_claim_many`, sent with `BEGIN` (one
//! round trip): it tries the advisory lock of every key with `pg_try_advisory_xact_lock`, then
//! reads the row of every key in a statement of its own. The function is volatile, so under
//! READ COMMITTED its read takes its snapshot after every lock was granted or refused, and sees
//! the commit of every earlier holder of each key it locked (PostgreSQL makes a commit visible
//! before it frees the committer's locks); one plain statement would read with a snapshot taken
//! before its own locks. The read's answer for a key whose lock was refused is not looked at:
//! that key is `InProgress`. The answer is one row of arrays (the locks refused, the keys found
//! and their rows), not a row per key.
//!
//! Every key the batch locked stays locked until the batch commits or drops, the keys settled
//! as duplicates or conflicts too: PostgreSQL frees a transaction-level advisory lock only at
//! the transaction's end. A claimant of such a key meanwhile gets `InProgress`, and its
//! redelivery after the batch the settled answer. (The embedded engine frees a settled key's
//! latch at once.)

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::time::Instant;

use idemdb::decision::{Found, admit, guard_order, inspect_record};
use idemdb::format::encode_key;
use idemdb::{Fingerprint, Message, Outcome, PreviousAttempt};
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::sql::pipeline::in_order;
use crate::sql::txn::{ClaimTransaction, Statement};
use crate::storage::observe::OutcomeKind;
use crate::storage::records::decode_record;
use crate::storage::records::decode_version;
use crate::storage::records::entity_lock_id;
use crate::storage::records::lock_id;
use crate::storage::store::ClockReading;
use crate::storage::store::PgConsumer;
/// The most messages one batch claims: the embedded engine's `idemdb::BATCH_MESSAGES_MAX`,
/// repeated here because idemdb exports it only with its RocksDB engine, which this crate does
/// not compile.
///
/// Each distinct key of a batch holds one advisory lock until the batch ends, and advisory
/// locks live in the server's shared lock table with every other lock, sized by
/// `max_locks_per_transaction` × `max_connections` (64 × 100 by default, plus some slack: on
/// a default PostgreSQL 15, three sessions holding 4 096 advisory locks each fit, and a fourth
/// got "out of shared memory"). When the table is full no session of the server gets any new
/// lock, table locks of ordinary queries included, until locks are freed: with large batches
/// from many connections, raise `max_locks_per_transaction` or keep batches smaller. A claim
/// that finds the table full fails with [`Error::Postgres`] and writes nothing.
pub const BATCH_MESSAGES_MAX: usize = 4096;

/// Takes the lock of every entity of a batch's fresh messages that carry a version (the
/// ordering guard), in ascending order, each once: the two-`int4` locks of
/// [`crate::storage::records::entity_lock_id`].
const LOCK_ENTITIES: &str = "SELECT e.high, e.low, pg_try_advisory_xact_lock(e.high, e.low) \
     FROM unnest($1::int4[], $2::int4[]) AS e(high, low) ORDER BY e.high, e.low";

/// What one message of a batch got.
///
/// The embedded engine's `idemdb::BatchOutcome`, variant for variant, so that a handler
/// matches the same cases with either backend. It is a type of its own because idemdb exports
/// `BatchOutcome` only with its RocksDB engine (it lives beside the engine's `ClaimBatch`),
/// which this crate does not compile.
#[derive(Debug)]
pub enum PgBatchOutcome {
    /// Claimed: run its business SQL in [`PgClaimBatch::transaction`];
    /// [`PgClaimBatch::commit`] writes its record unless it was
    /// [released](PgClaimBatch::release).
    Fresh,
    /// The same key, with the same fingerprint, appears earlier in this batch at index
    /// `first`: this copy is a duplicate of that message. Acknowledge it with the batch.
    DuplicateInBatch {
        /// The index of the first copy.
        first: usize,
    },
    /// The same key appears earlier in this batch, at index `first`, with another fingerprint,
    /// and that first copy is [`PgBatchOutcome::Fresh`]: it will be committed with the batch,
    /// so this copy's content conflicts with it. Route it like an [`Outcome::Conflict`]:
    /// dead-letter and alert (or, if the first copy is [released](PgClaimBatch::release), let
    /// the broker redeliver it). A repeat with another fingerprint whose first copy is not
    /// fresh is decided on its own, after the first copy, as [`PgConsumer::begin`] would
    /// decide it against the same lock answer and the same read: a duplicate of the stored
    /// record or a conflict with it, or `InProgress` while the key is held.
    ConflictInBatch {
        /// The index of the first copy.
        first: usize,
        /// The first copy's fingerprint.
        first_fingerprint: Fingerprint,
        /// This copy's fingerprint.
        new_fingerprint: Fingerprint,
    },
    /// Anything but fresh, exactly as [`PgConsumer::begin`] would report it.
    Settled(Outcome<Infallible>),
}

/// The claim of one fresh message of a batch.
#[derive(Debug)]
pub(crate) struct BatchClaim {
    pub(crate) key: Vec<u8>,
    /// The key as the embedded engine stores it: what downstream keys are derived from.
    pub(crate) stored_key: Vec<u8>,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) replaces_epoch: u64,
    pub(crate) previous: Option<PreviousAttempt>,
    /// The entity and version the commit records (the ordering guard), if the message has one.
    pub(crate) version: Option<(Vec<u8>, u64)>,
}

impl BatchClaim {
    pub(crate) fn epoch(&self) -> u64 {
        self.replaces_epoch.saturating_add(1)
    }
}

/// The claims of one batch of messages, in the order given: a live READ COMMITTED transaction
/// that holds every key it locked. Run the business SQL of the fresh messages in
/// [`PgClaimBatch::transaction`], then [`PgClaimBatch::commit`]: every winner's record and the
/// business rows land together or not at all. Dropped instead, it rolls back: nothing of it
/// lands, and every key is free again.
///
/// The transaction is the whole batch's: a failed statement aborts it, and the commit then
/// fails and writes nothing. Run the SQL of a message that may fail on its own inside a
/// savepoint (`SAVEPOINT m` ... `ROLLBACK TO SAVEPOINT m` through
/// `batch_execute` on [`PgClaimBatch::transaction`]) and [release](PgClaimBatch::release) it.
///
/// Not the embedded engine's `idemdb::ClaimBatch`: that one holds RocksDB latches and stages
/// writes for a RocksDB write batch; this one holds a PostgreSQL transaction.
pub struct PgClaimBatch<'c> {
    pub(crate) tx: ClaimTransaction<'c>,
    /// When the batch was decided: the database's clock in its call, and this
    /// process's monotonic clock then (see `PgClaim`'s field of the same name).
    pub(crate) decided_at: (i64, Instant),
    pub(crate) consumer: PgConsumer,
    pub(crate) outcomes: Vec<PgBatchOutcome>,
    /// By message index: the claim of each fresh message not released.
    pub(crate) claims: Vec<Option<BatchClaim>>,
    /// Read positions the commit writes (log consumers).
    pub(crate) positions: crate::storage::positions::StagedPositions,
}

impl PgConsumer {
    /// Claims a whole broker batch, `(message key, fingerprint)` by message, in a new
    /// transaction on `client`: one call of the store's function takes every key's lock and
    /// then reads every key's record, sent with `BEGIN` (one round trip); each message gets a
    /// [`PgBatchOutcome`], in the order given. A key
    /// repeated in the batch is decided once, by its first copy: a later copy is a
    /// [`PgBatchOutcome::DuplicateInBatch`] of it, or with another fingerprint a
    /// [`PgBatchOutcome::ConflictInBatch`]. Never waits for another holder. An empty batch is
    /// an empty transaction.
    ///
    /// For messages with a production time or an entity's version (the admission floor and
    /// the ordering guard), [`PgConsumer::begin_batch_messages`].
    ///
    /// # Errors
    /// [`Error::Idemdb`] with `LimitExceeded` for more than [`BATCH_MESSAGES_MAX`] messages or
    /// a key outside the limits (every key is checked before any is taken);
    /// [`Error::Corrupt`] for a stored record of a locked key that does not decode;
    /// [`Error::Postgres`] when the database fails. On every error nothing is written and no
    /// key stays locked.
    pub async fn begin_batch<'c, K: AsRef<[u8]>>(
        &self,
        client: &'c mut Client,
        messages: &[(K, Fingerprint)],
    ) -> Result<PgClaimBatch<'c>> {
        let messages: Vec<Message<'_>> = messages
            .iter()
            .map(|(key, fingerprint)| Message::new(key.as_ref(), *fingerprint))
            .collect();
        self.begin_batch_messages(client, &messages).await
    }

    /// [`PgConsumer::begin_batch`] with whole messages, as the embedded engine's `begin_batch`
    /// takes them: each is decided as [`PgConsumer::begin_message`] decides it, the admission
    /// floor and the ordering guard included. The guard takes the lock of each entity whose
    /// message is claimable, in one more round trip (only when one carries a version), and
    /// reads the entities' versions with it: a message of an entity whose lock another
    /// session holds, or that an earlier message of the batch claimed, is `InProgress`; one
    /// not newer than the entity's version is `Stale`. The commit writes each fresh
    /// message's version with its record.
    ///
    /// ```no_run
    /// # async fn example(client: &mut tokio_postgres::Client, accounts: idemdb_postgres::PgConsumer)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use idemdb::{Fingerprint, Message};
    /// let messages = [
    ///     Message::new("evt-41", Fingerprint::of(b"credit 5")).version("account-7", 41),
    ///     Message::new("evt-42", Fingerprint::of(b"debit 3")).version("account-9", 42),
    /// ];
    /// let batch = accounts.begin_batch_messages(client, &messages).await?;
    /// // ... the business SQL of each fresh message on batch.transaction() ...
    /// batch.commit(|_| b"applied").await
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`PgConsumer::begin_batch`]; an entity key outside the limits too.
    pub async fn begin_batch_messages<'c>(
        &self,
        client: &'c mut Client,
        messages: &[Message<'_>],
    ) -> Result<PgClaimBatch<'c>> {
        let started = Instant::now();
        if messages.len() > BATCH_MESSAGES_MAX {
            return Err(Error::Idemdb(idemdb::Error::LimitExceeded {
                limit: idemdb::Limit::BatchMessages,
                actual: messages.len() as u64,
                min: 0,
                max: BATCH_MESSAGES_MAX as u64,
            }));
        }
        let namespace = &self.store.inner.lock_namespace;
        // Each key as stored, made once: its lock number is hashed from it, and a fresh
        // message's claim keeps it.
        let stored_keys = messages
            .iter()
            .map(|message| Ok(encode_key(&self.id, message.key())?))
            .collect::<Result<Vec<Vec<u8>>>>()?;
        let lock_numbers: Vec<i64> = stored_keys
            .iter()
            .map(|stored| lock_id(namespace, stored))
            .collect();
        // Every entity key is checked before anything is sent.
        for message in messages {
            if let Some((entity_key, _)) = message.entity_version() {
                encode_key(&self.id, entity_key)?;
            }
        }
        let first_of = first_occurrences(messages);
        let mut distinct_locks = lock_numbers.clone();
        distinct_locks.sort_unstable();
        distinct_locks.dedup();
        let distinct_keys: Vec<&[u8]> = messages
            .iter()
            .enumerate()
            .filter(|(index, _)| first_of[*index] == *index)
            .map(|(_, message)| message.key())
            .collect();
        // The store's clock, read once (an injected one checked before anything is sent):
        // every message of the batch is decided at this reading.
        let clock = self.store.read_clock()?;
        // BEGIN and the call go out together (one round trip). The function takes the locks
        // (in ascending order, each once) before it reads, so its read sees the commit of every
        // earlier holder of a key it locked. From here every error drops `tx`, which rolls back
        // and frees every lock taken.
        let consumer: &[u8] = &self.id;
        let params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&distinct_locks, Type::INT8_ARRAY),
            (&consumer, Type::BYTEA),
            (&distinct_keys, Type::BYTEA_ARRAY),
        ];
        let call: [Statement<'_>; 1] = [(&self.store.inner.claim_many, &params)];
        let statements: &[Statement<'_>] = if messages.is_empty() { &[] } else { &call };
        let (mut tx, answers) = ClaimTransaction::begin_with_functions(
            client,
            &self.store.inner.statements,
            statements,
        )
        .await?;
        let taken = if messages.is_empty() {
            Ok(Taken::default())
        } else {
            self.taken(answers, clock)
        };
        // From here an error (a record that does not decode, say) rolls back, waited for, so
        // that every key of the batch is free when the error returns.
        let taken = tx.release_on_error(taken).await?;
        let mut batch = PgClaimBatch {
            tx,
            decided_at: (taken.db_now_ms, Instant::now()),
            consumer: self.clone(),
            outcomes: Vec::with_capacity(messages.len()),
            claims: Vec::with_capacity(messages.len()),
            positions: crate::storage::positions::StagedPositions::default(),
        };
        let decided = self
            .decide_batch(
                &mut batch,
                messages,
                stored_keys,
                &taken,
                &lock_numbers,
                &first_of,
            )
            .await;
        batch.tx.release_on_error(decided).await?;
        self.observe_batch(&batch, messages, taken.now_ms, started);
        Ok(batch)
    }

    /// Decides every message of `batch` from what its first round trip `taken` found, and
    /// applies the ordering guard to the fresh ones (one more round trip when any carries a
    /// version).
    async fn decide_batch(
        &self,
        batch: &mut PgClaimBatch<'_>,
        messages: &[Message<'_>],
        stored_keys: Vec<Vec<u8>>,
        taken: &Taken,
        lock_numbers: &[i64],
        first_of: &[usize],
    ) -> Result<()> {
        let floor_ms = admission_floor_ms(self);
        // Each message's stored key, taken by the claim that decides it.
        let mut stored_keys: Vec<Option<Vec<u8>>> = stored_keys.into_iter().map(Some).collect();
        let mut other_content = Vec::new();
        for (index, message) in messages.iter().enumerate() {
            let first = first_of[index];
            let (outcome, claim) = if first == index {
                let stored_key = stored_keys[index].take().unwrap_or_default();
                let locked = taken.locked(lock_numbers[index]);
                decide(message, stored_key, locked, taken, floor_ms)?
            } else {
                if message.fingerprint() != messages[first].fingerprint() {
                    other_content.push(index);
                }
                (PgBatchOutcome::DuplicateInBatch { first }, None)
            };
            batch.outcomes.push(outcome);
            batch.claims.push(claim);
        }
        // A repeat with other content, after every first copy was decided (as the embedded
        // engine decides it): a conflict with a fresh first copy, or else decided on its own.
        let mut claimed_by_repeat: HashSet<&[u8]> = HashSet::new();
        for index in other_content {
            let first = first_of[index];
            let key = messages[index].key();
            let (outcome, claim) = if matches!(batch.outcomes[first], PgBatchOutcome::Fresh) {
                let conflict = PgBatchOutcome::ConflictInBatch {
                    first,
                    first_fingerprint: messages[first].fingerprint(),
                    new_fingerprint: messages[index].fingerprint(),
                };
                (conflict, None)
            } else if claimed_by_repeat.contains(key) {
                // An earlier repeat of the key holds it in this batch: held by a claim, as the
                // embedded engine's latch answers a second claimant.
                let held = Outcome::held_by_claim(taken.now_ms);
                (PgBatchOutcome::Settled(held), None)
            } else {
                let locked = taken.locked(lock_numbers[index]);
                let stored_key = stored_keys[index].take().unwrap_or_default();
                decide(&messages[index], stored_key, locked, taken, floor_ms)?
            };
            if claim.is_some() {
                claimed_by_repeat.insert(key);
            }
            batch.outcomes[index] = outcome;
            batch.claims[index] = claim;
        }
        self.guard_versions(batch, messages, taken.now_ms).await
    }

    /// The ordering guard of the batch's fresh messages that carry a version, in message
    /// order, as the embedded engine's batch applies it: the entity's lock (taken now, for
    /// every such entity at once, with a read of their versions: one round trip), then the
    /// version. A fresh message that does not pass is `InProgress` or `Stale` instead.
    async fn guard_versions(
        &self,
        batch: &mut PgClaimBatch<'_>,
        messages: &[Message<'_>],
        now_ms: u64,
    ) -> Result<()> {
        let inner = &self.store.inner;
        let versioned: Vec<(usize, &[u8], u64)> = messages
            .iter()
            .enumerate()
            .filter(|(index, _)| batch.claims[*index].is_some())
            .filter_map(|(index, message)| {
                let (entity_key, version) = message.entity_version()?;
                Some((index, entity_key, version))
            })
            .collect();
        if versioned.is_empty() {
            return Ok(());
        }
        let mut entities: Vec<&[u8]> = versioned.iter().map(|(_, entity, _)| *entity).collect();
        entities.sort_unstable();
        entities.dedup();
        let lock_of = |entity_key: &[u8]| {
            encode_key(&self.id, entity_key)
                .map(|stored| entity_lock_id(&inner.entity_lock_namespace, &stored))
        };
        let mut locks = entities
            .iter()
            .map(|entity| lock_of(entity))
            .collect::<std::result::Result<Vec<(i32, i32)>, _>>()?;
        locks.sort_unstable();
        locks.dedup();
        let (highs, lows): (Vec<i32>, Vec<i32>) = locks.into_iter().unzip();
        let lock_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&highs, Type::INT4_ARRAY), (&lows, Type::INT4_ARRAY)];
        let consumer: &[u8] = &self.id;
        let read_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&consumer, Type::BYTEA), (&entities, Type::BYTEA_ARRAY)];
        let client = batch.tx.client();
        let mut answers = in_order([
            client.query_typed(LOCK_ENTITIES, &lock_params),
            client.query_typed(&inner.read_versions_many, &read_params),
        ])
        .await
        .into_iter();
        let lock_rows = answers.next().unwrap_or_else(|| Ok(Vec::new()))?;
        let version_rows = answers.next().unwrap_or_else(|| Ok(Vec::new()))?;
        let granted: HashMap<(i32, i32), bool> = lock_rows
            .iter()
            .map(|row| ((row.get(0), row.get(1)), row.get(2)))
            .collect();
        let mut current: HashMap<Vec<u8>, u64> = HashMap::new();
        for row in &version_rows {
            let entity_key: &[u8] = row.get(0);
            current.insert(entity_key.to_vec(), decode_version(entity_key, row.get(1))?);
        }
        let mut claimed: HashSet<&[u8]> = HashSet::new();
        for (index, entity_key, version) in versioned {
            let held = !granted.get(&lock_of(entity_key)?).copied().unwrap_or(false)
                || claimed.contains(entity_key);
            let settled = if held {
                Some(Outcome::held_by_claim(now_ms))
            } else {
                guard_order(current.get(entity_key).copied(), version)
            };
            match settled {
                Some(outcome) => {
                    batch.claims[index] = None;
                    batch.outcomes[index] = PgBatchOutcome::Settled(outcome);
                }
                None => {
                    claimed.insert(entity_key);
                    if let Some(claim) = batch.claims[index].as_mut() {
                        claim.version = Some((entity_key.to_vec(), version));
                    }
                }
            }
        }
        Ok(())
    }

    /// Counts and logs every message's outcome as the embedded engine does: a settled one with
    /// an equal share of the batch's time (and its duplicate age), the others counted only; a
    /// conflict within the batch is a conflict.
    fn observe_batch(
        &self,
        batch: &PgClaimBatch<'_>,
        messages: &[Message<'_>],
        now_ms: u64,
        started: Instant,
    ) {
        let share = started.elapsed() / u32::try_from(messages.len().max(1)).unwrap_or(u32::MAX);
        for (outcome, message) in batch.outcomes.iter().zip(messages) {
            let (key, correlation) = (message.key(), message.correlation());
            let kind = match outcome {
                PgBatchOutcome::Fresh => OutcomeKind::Fresh,
                PgBatchOutcome::DuplicateInBatch { .. } => OutcomeKind::DuplicateInBatch,
                PgBatchOutcome::ConflictInBatch { .. } => OutcomeKind::Conflict,
                PgBatchOutcome::Settled(outcome) => {
                    self.metrics.begun(outcome, now_ms, share, key, correlation);
                    continue;
                }
            };
            self.metrics.count(kind);
            self.metrics.log_begin(key, kind, correlation);
        }
    }

    /// What the batch's call answered: the locks refused, the database's time (and the
    /// batch's on the store's clock, `clock`'s reading), and the stored (undecoded) row of
    /// every key that has one.
    fn taken(&self, answers: crate::sql::txn::Answers, clock: ClockReading) -> Result<Taken> {
        let rows = answers
            .into_iter()
            .next()
            .unwrap_or_else(|| Ok(Vec::new()))?;
        let row = crate::sql::txn::single_row(rows)?;
        let db_now_ms: i64 = row.get(0);
        let refused: Vec<i64> = row.get(1);
        let keys: Vec<Vec<u8>> = row.get(2);
        let records: Vec<Vec<u8>> = row.get(3);
        Ok(Taken {
            db_now_ms,
            refused: refused.into_iter().collect(),
            now_ms: clock.now_ms(db_now_ms),
            rows: keys.into_iter().zip(records).collect(),
        })
    }
}

/// What a batch's call found.
#[derive(Default)]
struct Taken {
    /// The lock numbers another session holds (every other lock of the batch is this
    /// transaction's).
    refused: HashSet<i64>,
    /// The claim's time on the store's clock.
    now_ms: u64,
    /// The claim's time on the database's clock.
    db_now_ms: i64,
    /// By message key: the stored record, not decoded yet (only locked keys' are).
    rows: HashMap<Vec<u8>, Vec<u8>>,
}

impl Taken {
    fn locked(&self, lock_number: i64) -> bool {
        !self.refused.contains(&lock_number)
    }
}

/// Decides one message of a batch as [`PgConsumer::begin`] decides a claim: `InProgress`
/// without the key's lock, else from the key's record read after the lock.
fn decide(
    message: &Message<'_>,
    stored_key: Vec<u8>,
    locked: bool,
    taken: &Taken,
    floor_ms: Option<u64>,
) -> Result<(PgBatchOutcome, Option<BatchClaim>)> {
    let (key, fingerprint) = (message.key(), message.fingerprint());
    if !locked {
        let held = Outcome::held_by_claim(taken.now_ms);
        return Ok((PgBatchOutcome::Settled(held), None));
    }
    let record = taken
        .rows
        .get(key)
        .map(|bytes| decode_record(key, bytes))
        .transpose()?;
    let found = inspect_record(record, fingerprint, taken.now_ms);
    Ok(
        match admit(found, message.production_time_ms(), taken.now_ms, floor_ms) {
            Found::Claimable {
                replaces_epoch,
                previous,
            } => {
                let claim = BatchClaim {
                    key: key.to_vec(),
                    stored_key,
                    fingerprint,
                    replaces_epoch,
                    previous,
                    version: None,
                };
                (PgBatchOutcome::Fresh, Some(claim))
            }
            Found::Settled(outcome) => (PgBatchOutcome::Settled(outcome), None),
        },
    )
}

/// For each message, the index of the first message with the same key (itself if none
/// before).
fn first_occurrences<'m>(messages: &[Message<'m>]) -> Vec<usize> {
    let mut first_index: HashMap<&'m [u8], usize> = HashMap::with_capacity(messages.len());
    messages
        .iter()
        .enumerate()
        .map(|(index, message)| *first_index.entry(message.key()).or_insert(index))
        .collect()
}

/// The admission floor's horizon (the retention) when the store has it on.
fn admission_floor_ms(consumer: &PgConsumer) -> Option<u64> {
    let inner = &consumer.store.inner;
    inner.admission_floor.then_some(inner.retention_ms)
}

impl std::fmt::Debug for PgClaimBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgClaimBatch")
            .field("consumer", &self.consumer.id)
            .field("outcomes", &self.outcomes)
            .finish_non_exhaustive()
    }
}
