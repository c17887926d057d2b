//! The steps of an external claim under its fenced lease: renew, complete (with the business
//! SQL), release, fail; each under the key's lock, refused with `LeaseLost` once another holder
//! took the key.

use std::time::{Duration, Instant};

use idemdb::format::{Record, RecordState, derive_key};
use idemdb::{EXPIRES_NEVER_MS, PreviousAttempt};
use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::operations::external::PgExternalClaim;
use crate::operations::external::lease_ms;
use crate::operations::external::locked_record;
use crate::sql::txn::ClaimTransaction;
use crate::storage::store::ClockReading;

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
    /// written), `KeyBusy` when the key's lock was not free within [`LEASE_STEP_LOCK_WAIT`](crate::LEASE_STEP_LOCK_WAIT),
    /// `LimitExceeded` for a lease outside the limits; [`Error::Postgres`].
    pub async fn renew(&mut self, client: &mut Client, lease: Duration) -> Result<u64> {
        let started = Instant::now();
        let renewed = self.renew_unobserved(client, lease).await;
        self.observed("renew", renewed.as_ref().map(|_| ()), started);
        renewed
    }

    async fn renew_unobserved(&mut self, client: &mut Client, lease: Duration) -> Result<u64> {
        let lease_ms = lease_ms(lease)?;
        let clock = self.consumer.store.read_clock()?;
        let (mut tx, now_ms) = self.fenced(client, clock).await?;
        let until = now_ms.saturating_add(lease_ms);
        let record = self.record(until);
        let written = crate::storage::records::write_record(
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
        let fenced = match self.consumer.store.read_clock() {
            Ok(clock) => self.fenced(client, clock).await,
            Err(error) => Err(error),
        };
        let (tx, _) = match fenced {
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
        let clock = self.consumer.store.read_clock()?;
        let (mut tx, now_ms) = self.fenced(client, clock).await?;
        let removable_at_ms = now_ms.saturating_add(self.consumer.store.inner.retention_ms);
        let mut record = self.record(self.lease_until_ms);
        // Kept, reading as absent, until the retention has passed, so that the key's epoch
        // keeps increasing across the release.
        record.state = RecordState::Released {
            released_at_ms: now_ms,
            removable_at_ms,
        };
        let written = crate::storage::records::write_record(
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
        // Read once: the fence and the record's time both come from this reading.
        let clock = self.consumer.store.read_clock()?;
        let (mut tx, _) = self.fenced(client, clock).await?;
        let written = crate::storage::records::write_completed(
            tx.client(),
            &self.consumer,
            clock,
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
    pub(crate) fn record(&self, lease_until_ms: u64) -> Record {
        Record::in_progress(
            self.epoch,
            self.fingerprint,
            self.since_ms,
            lease_until_ms,
            self.holder.clone(),
            self.token,
        )
    }

    /// A transaction holding the key's lock, in which the record is still this holder's, and
    /// the step's time (`clock`: the step's one reading of the store's clock).
    async fn fenced<'c>(
        &self,
        client: &'c mut Client,
        clock: ClockReading,
    ) -> Result<(ClaimTransaction<'c>, u64)> {
        let (tx, now_ms, record) =
            locked_record(&self.consumer, client, &self.key, &self.stored_key, clock).await?;
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
    /// As [`crate::operations::claim::PgClaim::commit`].
    pub async fn commit(self, result: impl AsRef<[u8]>) -> Result<()> {
        let started = Instant::now();
        let PgCompletion { mut tx, claim } = self;
        // The store's clock, read once (an injected one checked before anything is sent).
        let clock = match claim.consumer.store.read_clock() {
            Ok(clock) => clock,
            Err(error) => return tx.fail(error).await,
        };
        let written = crate::storage::records::write_completed(
            tx.client(),
            &claim.consumer,
            clock,
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
