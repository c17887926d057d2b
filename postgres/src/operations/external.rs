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
use idemdb::format::{Record, RecordState, encode_key};
use idemdb::{
    EXPIRES_NEVER_MS, Fingerprint, HOLDER_BYTES_MAX, LEASE_MS_MAX, LEASE_MS_MIN, Outcome,
    PreviousAttempt,
};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient};

use crate::error::{Error, Result};
use crate::sql::txn::ClaimTransaction;
use crate::storage::records::decode_record;
use crate::storage::records::lock_id;
use crate::storage::store::ClockReading;
use crate::storage::store::PgConsumer;
use crate::storage::store::PgStore;
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
    pub(crate) alive: Arc<crate::storage::observe::Alive>,
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
        // The store's clock, read once (an injected one checked before anything is sent).
        let clock = self.store.read_clock()?;
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
            let lock = crate::sql::txn::single_row(next_rows()?)?;
            let read = next_rows();
            let now_ms = clock.now_ms(lock.get(1));
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
                let written = crate::storage::records::write_record(
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
        let now_ms = self.store.read_clock_for_reading().now_ms(row.get(0));
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
            crate::storage::records::check_result(result)?;
        }
        // The store's clock, read once (an injected one checked before anything is sent).
        let clock = self.store.read_clock()?;
        let (mut tx, now_ms, record) = locked_record(self, client, key, &stored_key, clock).await?;
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
                crate::storage::records::write_completed(
                    tx.client(),
                    self,
                    clock,
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
                crate::storage::records::write_record(
                    tx.client(),
                    self,
                    key,
                    &record,
                    removable_at_ms,
                    true,
                )
                .await
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

/// A transaction holding the lock of `key` (`stored_key` encoded), taken waiting at most
/// [`LEASE_STEP_LOCK_WAIT`]; the store's time (`clock`, the call's reading); and the key's
/// record, read after the lock was granted. The lease steps and a resolution check the record
/// before they write.
pub(crate) async fn locked_record<'c>(
    consumer: &PgConsumer,
    client: &'c mut Client,
    key: &[u8],
    stored_key: &[u8],
    clock: ClockReading,
) -> Result<(ClaimTransaction<'c>, u64, Option<Record>)> {
    let store: &PgStore = &consumer.store;
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
        let now_ms = clock.now_ms(row.get(1));
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

pub(crate) fn lease_ms(lease: Duration) -> Result<u64> {
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
