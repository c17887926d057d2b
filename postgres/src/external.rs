//! External claims: work outside the database (an HTTP call, an e-mail) under a fenced lease.
//!
//! `begin_external` commits an in-progress record at once (epoch, random token, holder, lease),
//! so that a crashed holder's key is taken over once its lease ran out, and the new holder is
//! told of the earlier attempt. Every later step (renew, complete) runs in a transaction that
//! first takes the key's advisory lock (waiting at most [`LEASE_STEP_LOCK_WAIT`]) and checks that
//! the record still carries this holder's epoch and token; otherwise it is `LeaseLost` and its
//! transaction, the caller's SQL included, writes nothing.
//!
//! A reconciler resolves a key found in progress ([`PgConsumer::resolve`]) under the same lock,
//! fenced on the record being in progress, whoever holds it.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemdb::decision::{Found, inspect_record};
use idemdb::format::{Record, RecordState, derive_key, encode_key};
use idemdb::{
    EXPIRES_NEVER_MS, Fingerprint, HOLDER_BYTES_MAX, LEASE_MS_MAX, LEASE_MS_MIN, Outcome,
    PreviousAttempt,
};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient};

use crate::error::{Error, Result};
use crate::txn::ClaimTransaction;
use crate::{PgConsumer, PgStore, decode_record, lock_id};

/// How long a lease step waits for the key's lock (another step of the same key, or a
/// claimant's read of it, holds it only for a round trip or two).
pub const LEASE_STEP_LOCK_WAIT: Duration = Duration::from_millis(100);

/// An operator's resolution of a key stuck in progress ([`PgConsumer::resolve`]).
///
/// The embedded engine's `idemdb::Resolution`, variant for variant; a type of its own because
/// idemdb exports `Resolution` only with its RocksDB engine, which this crate does not compile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PgResolution {
    /// Mark it completed with this result (the side effect is known to have happened):
    /// redeliveries get `Duplicate` with it.
    Complete(Bytes),
    /// Release it, so that the next delivery processes the message again (at a higher epoch).
    Release,
}

/// A holder's durable claim on a key, for a side effect outside the database. Keep it while
/// the side effect runs, and its [ticket](PgExternalClaim::ticket) where a restart finds it;
/// renew the lease before it runs out.
#[derive(Clone, Debug)]
pub struct PgExternalClaim {
    pub(crate) consumer: PgConsumer,
    pub(crate) key: Vec<u8>,
    pub(crate) stored_key: Vec<u8>,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) epoch: u64,
    pub(crate) token: u64,
    pub(crate) since_ms: u64,
    pub(crate) lease_until_ms: u64,
    pub(crate) holder: Bytes,
    pub(crate) previous: Option<PreviousAttempt>,
    /// Counts the claim in the `idemdb_in_progress` gauge while any clone of it exists.
    pub(crate) alive: Arc<crate::observe::Alive>,
}

impl PgConsumer {
    /// Claims `key` for an external side effect, under a lease of `lease` held by `holder`
    /// (an identity for operators). The in-progress record is committed before this returns.
    /// A key whose holder's lease ran out is taken over: the claim's
    /// [`PgExternalClaim::previous_attempt`] says so.
    ///
    /// # Errors
    /// [`Error::Idemdb`] for a key, lease or holder outside the limits; [`Error::Corrupt`];
    /// [`Error::Postgres`] (nothing is written unless the commit's outcome is unknown).
    pub async fn begin_external(
        &self,
        client: &mut Client,
        key: impl AsRef<[u8]>,
        fingerprint: Fingerprint,
        lease: Duration,
        holder: impl AsRef<[u8]>,
    ) -> Result<Outcome<PgExternalClaim>> {
        let started = Instant::now();
        let key = key.as_ref();
        let (now_ms, outcome) = self
            .claim_external(client, key, fingerprint, lease, holder.as_ref())
            .await?;
        self.metrics
            .begun(&outcome, now_ms, started.elapsed(), key, None);
        Ok(outcome)
    }

    /// `begin_external` without its metrics and log, with the time it decided at.
    async fn claim_external(
        &self,
        client: &mut Client,
        key: &[u8],
        fingerprint: Fingerprint,
        lease: Duration,
        holder: &[u8],
    ) -> Result<(u64, Outcome<PgExternalClaim>)> {
        let lease_ms = lease_ms(lease)?;
        check(
            idemdb::Limit::HolderBytes,
            holder.len() as u64,
            1,
            HOLDER_BYTES_MAX as u64,
        )?;
        let stored_key = idemdb::format::encode_key(&self.id, key)?;
        let inner = &self.store.inner;
        self.store.ensure_partitions(client, false).await?;
        // BEGIN, the lock and the read in one round trip, as a claim's (see `begin_message`).
        let lock_number = lock_id(&inner.lock_namespace, &stored_key);
        let id: &[u8] = &self.id;
        let lock_params: [(&(dyn ToSql + Sync), Type); 1] = [(&lock_number, Type::INT8)];
        let read_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&id, Type::BYTEA), (&key, Type::BYTEA)];
        let (mut tx, answers) = ClaimTransaction::begin_with(
            client,
            &inner.statements,
            &[
                (
                    "SELECT pg_try_advisory_xact_lock($1), \
                     floor(extract(epoch FROM statement_timestamp()) * 1000)::int8",
                    &lock_params,
                ),
                (&inner.read, &read_params),
            ],
        )
        .await?;
        let mut answers = answers.into_iter();
        let mut next_rows = || answers.next().unwrap_or_else(|| Ok(Vec::new()));
        // Any error from here rolls back, waited for: the key is free when it returns.
        let read = (|| -> Result<(u64, Option<Option<Record>>)> {
            let lock = crate::txn::single_row(next_rows()?)?;
            let read = next_rows();
            let now_ms = self.store.now_ms(lock.get(1));
            if !lock.get::<_, bool>(0) {
                return Ok((now_ms, None));
            }
            let record = read?
                .first()
                .map(|row| decode_record(key, row.get(0)))
                .transpose()?;
            Ok((now_ms, Some(record)))
        })();
        let (now_ms, record) = tx.release_on_error(read).await?;
        let Some(record) = record else {
            tx.rollback().await?;
            return Ok((now_ms, Outcome::held_by_claim(now_ms)));
        };
        match inspect_record(record, fingerprint, now_ms) {
            Found::Claimable {
                replaces_epoch,
                previous,
            } => {
                let claim = PgExternalClaim {
                    consumer: self.clone(),
                    key: key.to_vec(),
                    stored_key,
                    fingerprint,
                    epoch: replaces_epoch.saturating_add(1),
                    token: random_token(),
                    since_ms: now_ms,
                    lease_until_ms: now_ms.saturating_add(lease_ms),
                    holder: Bytes::copy_from_slice(holder),
                    previous,
                    alive: self.metrics.alive(),
                };
                let record = claim.record(claim.lease_until_ms);
                // In progress: never removable by itself, whatever the lease.
                let written = crate::write_record(
                    tx.client(),
                    self,
                    key,
                    &record,
                    EXPIRES_NEVER_MS,
                    replaces_epoch != 0,
                )
                .await;
                tx.release_on_error(written).await?;
                tx.commit().await?;
                Ok((now_ms, Outcome::Fresh(claim)))
            }
            Found::Settled(outcome) => {
                tx.rollback().await?;
                Ok((now_ms, outcome.map_fresh(|never| match never {})))
            }
        }
    }

    /// The external claims of this consumer in progress since at least `older_than` (on the
    /// store's clock), at most `limit` of them, in key order: what a reconciler looks at, with
    /// the holder and whether its lease ran out.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a stored record that does not decode; [`Error::Postgres`].
    pub async fn in_progress(
        &self,
        client: &Client,
        older_than: Duration,
        limit: usize,
    ) -> Result<Vec<PgInProgress>> {
        let row = client
            .query_one(
                "SELECT floor(extract(epoch FROM statement_timestamp()) * 1000)::int8",
                &[],
            )
            .await?;
        let now_ms = self.store.now_ms(row.get(0));
        let horizon_ms =
            now_ms.saturating_sub(u64::try_from(older_than.as_millis()).unwrap_or(u64::MAX));
        // In-progress records are the ones with no expiry (with completed records that never
        // expire, which the decode below skips).
        let rows = client
            .query(&self.store.inner.never_expiring, &[&self.id.as_ref()])
            .await?;
        let mut found = Vec::new();
        for row in rows {
            if found.len() >= limit {
                break;
            }
            let key: &[u8] = row.get(0);
            let record = decode_record(key, row.get(1))?;
            if let RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                ..
            } = record.state
                && since_ms <= horizon_ms
            {
                found.push(PgInProgress {
                    message_key: Bytes::copy_from_slice(key),
                    epoch: record.epoch,
                    holder,
                    since_ms,
                    lease_until_ms,
                });
            }
        }
        Ok(found)
    }

    /// Resolves `key`, in progress under an external claim, by hand (a reconciler's answer to
    /// [`PgConsumer::in_progress`]): completes it with a result, or releases it, whoever holds
    /// it and whether its lease ran out or not. The record keeps its epoch, so that the
    /// holder's next step finds its record gone and gets `LeaseLost`, its SQL unwritten.
    /// Waits at most [`LEASE_STEP_LOCK_WAIT`] for the key's lock, like a lease step.
    ///
    /// # Errors
    /// [`Error::Idemdb`] with `NotInProgress` (the key's epoch, 0 for none) when the key has
    /// no in-progress record: absent, completed (expired or not) or released, as the embedded
    /// engine answers; with `KeyBusy` when the key's lock was not free in time (a claim holds
    /// it: retry); with `LimitExceeded` for a key or result outside the limits. Nothing is
    /// written then. [`Error::Postgres`] when the database fails.
    pub async fn resolve(
        &self,
        client: &mut Client,
        key: impl AsRef<[u8]>,
        resolution: PgResolution,
    ) -> Result<()> {
        let key = key.as_ref();
        let stored_key = encode_key(&self.id, key)?;
        if let PgResolution::Complete(result) = &resolution {
            crate::check_result(result)?;
        }
        let (mut tx, now_ms, record) = locked_record(self, client, key, &stored_key).await?;
        let current = match record {
            Some(record) if matches!(record.state, RecordState::InProgress { .. }) => record,
            other => {
                let current_epoch = other.map_or(0, |record| record.epoch);
                tx.rollback().await?;
                return Err(Error::Idemdb(idemdb::Error::NotInProgress {
                    current_epoch,
                }));
            }
        };
        let written = match resolution {
            PgResolution::Complete(result) => {
                crate::write_completed(
                    tx.client(),
                    self,
                    key,
                    current.fingerprint,
                    current.epoch,
                    true,
                    &result,
                    true,
                )
                .await
            }
            PgResolution::Release => {
                let removable_at_ms = now_ms.saturating_add(self.store.inner.retention_ms);
                let mut record = current;
                // Kept, reading as absent, until the retention has passed, so that the key's
                // epoch keeps increasing across the release (as `PgExternalClaim::release`).
                record.state = RecordState::Released {
                    released_at_ms: now_ms,
                    removable_at_ms,
                };
                crate::write_record(tx.client(), self, key, &record, removable_at_ms, true).await
            }
        };
        tx.release_on_error(written).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Reads and decodes the key's record, inside a claim's transaction or on a client.
    pub(crate) async fn read(
        &self,
        client: &impl GenericClient,
        key: &[u8],
    ) -> Result<Option<Record>> {
        let id: &[u8] = &self.id;
        let row = client
            .query_typed_opt(
                &self.store.inner.read,
                &[(&id, Type::BYTEA), (&key, Type::BYTEA)],
            )
            .await?;
        row.map(|row| decode_record(key, row.get(0))).transpose()
    }
}

impl PgExternalClaim {
    /// This holder's fencing epoch.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Until when the lease runs, as last written by this holder (the store's clock).
    #[must_use]
    pub fn lease_until_ms(&self) -> u64 {
        self.lease_until_ms
    }

    /// The attempt this claim took over, if any: its side effect may have been partly applied.
    #[must_use]
    pub fn previous_attempt(&self) -> Option<&PreviousAttempt> {
        self.previous.as_ref()
    }

    /// The idempotency key to give the downstream call at `step`: the same for every attempt
    /// at this message, with either backend.
    #[must_use]
    pub fn derive_key(&self, step: &str) -> String {
        derive_key(&self.stored_key, step)
    }

    /// Extends the lease to `lease` from now. Returns the new deadline.
    ///
    /// # Errors
    /// [`Error::Idemdb`] with `LeaseLost` when another holder took the key over (nothing is
    /// written), `KeyBusy` when the key's lock was not free within [`LEASE_STEP_LOCK_WAIT`],
    /// `LimitExceeded` for a lease outside the limits; [`Error::Postgres`].
    pub async fn renew(&mut self, client: &mut Client, lease: Duration) -> Result<u64> {
        let started = Instant::now();
        let renewed = self.renew_unobserved(client, lease).await;
        self.observed("renew", renewed.as_ref().map(|_| ()), started);
        renewed
    }

    async fn renew_unobserved(&mut self, client: &mut Client, lease: Duration) -> Result<u64> {
        let lease_ms = lease_ms(lease)?;
        let (mut tx, now_ms) = self.fenced(client).await?;
        let until = now_ms.saturating_add(lease_ms);
        let record = self.record(until);
        let written = crate::write_record(
            tx.client(),
            &self.consumer,
            &self.key,
            &record,
            EXPIRES_NEVER_MS,
            true,
        )
        .await;
        tx.release_on_error(written).await?;
        tx.commit().await?;
        self.lease_until_ms = until;
        Ok(until)
    }

    /// Opens the transaction that completes this claim, once it is known to still hold the
    /// key: run the business SQL in [`PgCompletion::transaction`], then
    /// [`PgCompletion::commit`] with the result.
    ///
    /// # Errors
    /// As [`PgExternalClaim::renew`].
    pub async fn completion<'c>(&self, client: &'c mut Client) -> Result<PgCompletion<'c>> {
        let (tx, _) = match self.fenced(client).await {
            Ok(fenced) => fenced,
            Err(error) => {
                // The completion's step is refused here; a written one is counted at its commit.
                self.observed("complete", Err(&error), Instant::now());
                return Err(error);
            }
        };
        Ok(PgCompletion {
            tx,
            claim: self.clone(),
        })
    }

    /// Gives the key up without a result, after a transient failure: the next delivery
    /// processes the message again, at a higher epoch.
    ///
    /// # Errors
    /// As [`PgExternalClaim::renew`].
    pub async fn release(self, client: &mut Client) -> Result<()> {
        let started = Instant::now();
        let released = self.release_unobserved(client).await;
        self.observed("release", released.as_ref().copied(), started);
        released
    }

    async fn release_unobserved(&self, client: &mut Client) -> Result<()> {
        let (mut tx, now_ms) = self.fenced(client).await?;
        let removable_at_ms = now_ms.saturating_add(self.consumer.store.inner.retention_ms);
        let mut record = self.record(self.lease_until_ms);
        // Kept, reading as absent, until the retention has passed, so that the key's epoch
        // keeps increasing across the release.
        record.state = RecordState::Released {
            released_at_ms: now_ms,
            removable_at_ms,
        };
        let written = crate::write_record(
            tx.client(),
            &self.consumer,
            &self.key,
            &record,
            removable_at_ms,
            true,
        )
        .await;
        tx.release_on_error(written).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records a permanent failure as the key's result: redeliveries get `Duplicate` with
    /// `succeeded: false` and `result`, and replay it instead of retrying.
    ///
    /// # Errors
    /// As [`PgExternalClaim::renew`], and a result over `RESULT_BYTES_MAX`.
    pub async fn fail_permanently(
        self,
        client: &mut Client,
        result: impl AsRef<[u8]>,
    ) -> Result<()> {
        let started = Instant::now();
        let failed = self.fail_unobserved(client, result.as_ref()).await;
        self.observed("fail", failed.as_ref().copied(), started);
        failed
    }

    async fn fail_unobserved(&self, client: &mut Client, result: &[u8]) -> Result<()> {
        let (mut tx, _) = self.fenced(client).await?;
        let written = crate::write_completed(
            tx.client(),
            &self.consumer,
            &self.key,
            self.fingerprint,
            self.epoch,
            true,
            result,
            false,
        )
        .await;
        tx.release_on_error(written).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Counts and logs a lease step as the embedded engine does: `complete` (a commit) is
    /// counted with the commits, a step refused with `LeaseLost` with the lost leases, and
    /// every written or refused step is logged.
    fn observed(
        &self,
        step: &'static str,
        result: std::result::Result<(), &Error>,
        started: Instant,
    ) {
        let metrics = &self.consumer.metrics;
        match result {
            Ok(()) => {
                if step == "complete" {
                    metrics.commit(started.elapsed());
                }
                if matches!(step, "complete" | "release" | "fail") {
                    self.alive.finish();
                }
                metrics.log_step(step, &self.stored_key, self.epoch, None, None);
            }
            Err(Error::Idemdb(idemdb::Error::LeaseLost { current_epoch })) => {
                metrics.lease_lost();
                metrics.log_step(
                    step,
                    &self.stored_key,
                    self.epoch,
                    Some(*current_epoch),
                    None,
                );
            }
            Err(_) => {}
        }
    }

    /// The in-progress record of this holder with a lease until `lease_until_ms`.
    fn record(&self, lease_until_ms: u64) -> Record {
        Record::in_progress(
            self.epoch,
            self.fingerprint,
            self.since_ms,
            lease_until_ms,
            self.holder.clone(),
            self.token,
        )
    }

    /// A transaction holding the key's lock, in which the record is still this holder's.
    async fn fenced<'c>(&self, client: &'c mut Client) -> Result<(ClaimTransaction<'c>, u64)> {
        let (tx, now_ms, record) =
            locked_record(&self.consumer, client, &self.key, &self.stored_key).await?;
        let still_ours = record.as_ref().is_some_and(|record| {
            record.epoch == self.epoch
                && matches!(record.state, RecordState::InProgress { token, .. } if token == self.token)
        });
        if !still_ours {
            let current_epoch = record.map_or(0, |record| record.epoch);
            tx.rollback().await?;
            return Err(Error::Idemdb(idemdb::Error::LeaseLost { current_epoch }));
        }
        Ok((tx, now_ms))
    }
}

/// A transaction holding the lock of `key` (`stored_key` encoded), taken waiting at most
/// [`LEASE_STEP_LOCK_WAIT`]; the store's time; and the key's record, read after the lock was
/// granted. The lease steps and a resolution check the record before they write.
async fn locked_record<'c>(
    consumer: &PgConsumer,
    client: &'c mut Client,
    key: &[u8],
    stored_key: &[u8],
) -> Result<(ClaimTransaction<'c>, u64, Option<Record>)> {
    let store: &PgStore = &consumer.store;
    store.ensure_partitions(client, false).await?;
    // BEGIN, the lock wait's bound, the lock and the read in one round trip: the server runs
    // them in order, so the read's snapshot is taken once the lock is granted.
    let timeout = format!("{}ms", LEASE_STEP_LOCK_WAIT.as_millis());
    let lock_number = lock_id(&store.inner.lock_namespace, stored_key);
    let id: &[u8] = &consumer.id;
    let timeout_params: [(&(dyn ToSql + Sync), Type); 1] = [(&timeout, Type::TEXT)];
    let lock_params: [(&(dyn ToSql + Sync), Type); 1] = [(&lock_number, Type::INT8)];
    let read_params: [(&(dyn ToSql + Sync), Type); 2] = [(&id, Type::BYTEA), (&key, Type::BYTEA)];
    let (mut tx, answers) = ClaimTransaction::begin_with(
        client,
        &store.inner.statements,
        &[
            (
                "SELECT set_config('lock_timeout', $1, true)",
                &timeout_params,
            ),
            (
                "SELECT pg_advisory_xact_lock($1)::text, \
                 floor(extract(epoch FROM statement_timestamp()) * 1000)::int8",
                &lock_params,
            ),
            (&store.inner.read, &read_params),
        ],
    )
    .await?;
    let mut answers = answers.into_iter();
    let mut next_rows = || answers.next().unwrap_or_else(|| Ok(Vec::new()));
    // Any error from here rolls back, waited for: the key is free when it returns.
    let read = (|| -> Result<(u64, Option<Record>)> {
        next_rows()?;
        let locked = next_rows().map(|rows| rows.into_iter().next());
        let read = next_rows();
        let row = match locked {
            Ok(Some(row)) => row,
            Ok(None) => {
                return Err(Error::UnexpectedAnswer {
                    detail: "the lock statement returned no row",
                });
            }
            Err(error)
                if error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                return Err(Error::Idemdb(idemdb::Error::KeyBusy));
            }
            Err(error) => return Err(error.into()),
        };
        let now_ms = store.now_ms(row.get(1));
        let record = read?
            .first()
            .map(|row| decode_record(key, row.get(0)))
            .transpose()?;
        Ok((now_ms, record))
    })();
    let (now_ms, record) = tx.release_on_error(read).await?;
    Ok((tx, now_ms, record))
}

/// An external claim in progress, as [`PgConsumer::in_progress`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PgInProgress {
    /// The message key.
    pub message_key: Bytes,
    /// The holder's epoch.
    pub epoch: u64,
    /// The holder's identity.
    pub holder: Bytes,
    /// When the holder took the key (the store's clock).
    pub since_ms: u64,
    /// Until when its lease runs (it may already have run out).
    pub lease_until_ms: u64,
}

/// The transaction that completes an external claim: the record and the caller's SQL commit
/// together. Dropped, it rolls back and the claim still holds the key.
pub struct PgCompletion<'c> {
    tx: ClaimTransaction<'c>,
    claim: PgExternalClaim,
}

impl std::fmt::Debug for PgCompletion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgCompletion")
            .field("claim", &self.claim)
            .finish_non_exhaustive()
    }
}

impl<'c> PgCompletion<'c> {
    /// The connection of the open transaction, for the business SQL. Do not commit or roll it
    /// back yourself.
    #[must_use]
    pub fn transaction(&self) -> &Client {
        self.tx.client()
    }

    /// Writes the completed record with `result` and commits, with the business SQL.
    ///
    /// # Errors
    /// As [`crate::PgClaim::commit`].
    pub async fn commit(self, result: impl AsRef<[u8]>) -> Result<()> {
        let started = Instant::now();
        let PgCompletion { mut tx, claim } = self;
        let written = crate::write_completed(
            tx.client(),
            &claim.consumer,
            &claim.key,
            claim.fingerprint,
            claim.epoch,
            true,
            result.as_ref(),
            true,
        )
        .await;
        tx.release_on_error(written).await?;
        tx.commit().await?;
        claim.observed("complete", Ok(()), started);
        Ok(())
    }
}

fn lease_ms(lease: Duration) -> Result<u64> {
    let ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
    check(idemdb::Limit::LeaseMs, ms, LEASE_MS_MIN, LEASE_MS_MAX)?;
    Ok(ms)
}

fn check(limit: idemdb::Limit, actual: u64, min: u64, max: u64) -> Result<()> {
    if (min..=max).contains(&actual) {
        return Ok(());
    }
    Err(Error::Idemdb(idemdb::Error::LimitExceeded {
        limit,
        actual,
        min,
        max,
    }))
}

/// A token no other holder of the key will have: the standard library's per-process random
/// hash keys over the time and a counter.
fn random_token() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos()),
    );
    hasher.finish()
}
