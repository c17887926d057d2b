//! Work outside the batch: external claims held under a durable lease with a fencing epoch.
//!
//! A side effect that cannot join the write batch (a payment API, another store) is performed
//! between `begin_external`, which durably records the key as in progress, and `complete`,
//! which records the result. Every step after the first is *fenced*: under the key's latch the
//! holder checks that the stored record is still its own in-progress record (same epoch, same
//! token) and writes a merge operand that applies only to that record. A holder whose lease
//! expired and was taken over gets [`Error::LeaseLost`] and writes nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rocksdb::WriteBatch;

use crate::decision::{Found, PreviousAttempt, admit};
use crate::format::error::{Error, Limit, Result, check_limit, check_limit_u64};
use crate::format::fingerprint::Fingerprint;
use crate::format::key::StoredKey;
use crate::format::operand::Operand;
use crate::format::record::{HOLDER_BYTES_MAX, Record, RecordState};
use crate::operations::claim::{Expiry, Observer, Outcome, check_expiry, expires_at_ms, inspect};
use crate::operations::staging::{Staged, staging_methods};
use crate::storage::business_table::BusinessTable;
use crate::storage::observe::ConsumerMetrics;
use crate::storage::store::Storage;

use crate::format::record::{LEASE_MS_MAX, LEASE_MS_MIN};

/// How long a lease step waits for the key's latch, in real time, before [`Error::KeyBusy`]
/// (the operator tools' writes wait as long).
pub(crate) const LATCH_WAIT: Duration = Duration::from_millis(100);

/// What to record when the handler of an external claim fails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Release the key without a result: the broker's redelivery processes it again (the
    /// default choice for transient failures).
    Release,
    /// Record the failure as the key's result: redeliveries get [`Outcome::Duplicate`] with
    /// `succeeded: false` and replay it instead of retrying (for permanent failures).
    RecordFailure(Bytes),
}

/// An operator's resolution of a stuck in-progress key (see [`crate::Consumer::resolve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// Mark it completed with this result (the side effect is known to have happened).
    Complete(Bytes),
    /// Release it, so the next delivery processes it again.
    Release,
}

/// An in-progress record found by [`crate::Consumer::in_progress`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InProgressEntry {
    /// The message key.
    pub message_key: Bytes,
    /// The holder's epoch.
    pub epoch: u64,
    /// The holder's identity.
    pub holder: Bytes,
    /// When the holder took the key.
    pub since_ms: u64,
    /// Until when its lease runs (it may already have run out).
    pub lease_until_ms: u64,
}

/// What an external holder needs to find its claim again after a restart: pass it to
/// [`crate::Consumer::resume`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseTicket {
    pub(crate) stored_key: Vec<u8>,
    pub(crate) epoch: u64,
    pub(crate) token: u64,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) holder: Bytes,
    pub(crate) since_ms: u64,
    pub(crate) lease_until_ms: u64,
}

impl LeaseTicket {
    /// The epoch the ticket's holder was given.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

/// A key held under a durable lease while a side effect outside the batch is performed.
///
/// Unlike a [`crate::Claim`] it does not hold the key in memory: the in-progress record in the
/// store does, until the lease runs out. Dropping it abandons the attempt; the key is taken over
/// after the lease. Business writes staged on it land only with [`ExternalClaim::complete`].
pub struct ExternalClaim {
    inner: Arc<Storage>,
    marker: usize,
    ticket: LeaseTicket,
    previous: Option<PreviousAttempt>,
    expiry: Expiry,
    staged: Staged,
    observer: Option<Observer>,
}

/// Checks a lease length and returns it in milliseconds.
fn lease_ms(lease: Duration) -> Result<u64> {
    let ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
    check_limit_u64(Limit::LeaseMs, ms, LEASE_MS_MIN, LEASE_MS_MAX)?;
    Ok(ms)
}

/// Takes the key under a lease: writes the in-progress record (honouring the durability mode)
/// before returning.
#[allow(clippy::too_many_arguments)]
pub(crate) fn begin_external(
    inner: &Arc<Storage>,
    marker: usize,
    stored_key: StoredKey,
    fingerprint: Fingerprint,
    lease: Duration,
    holder: &[u8],
    expiry: Expiry,
    produced_at_ms: Option<u64>,
) -> Result<Outcome<ExternalClaim>> {
    let lease_ms = lease_ms(lease)?;
    check_limit(Limit::HolderBytes, holder.len(), 0, HOLDER_BYTES_MAX)?;
    inner.check_not_poisoned()?;
    let now_ms = inner.write_clock_ms()?;
    let latches = &inner.markers[marker].latches;
    let _latch = match latches.try_guard(&stored_key, now_ms) {
        Ok(guard) => guard,
        Err(since_ms) => return Ok(Outcome::held_by_claim(since_ms)),
    };
    let found = inspect(inner, marker, &stored_key, fingerprint, now_ms)?;
    let floor = inner.admission_floor_ms();
    let (replaces_epoch, previous) = match admit(found, produced_at_ms, now_ms, floor) {
        Found::Claimable {
            replaces_epoch,
            previous,
        } => (replaces_epoch, previous),
        Found::Settled(outcome) => return Ok(Outcome::settled(outcome)),
    };
    let ticket = LeaseTicket {
        stored_key: stored_key.to_vec(),
        epoch: replaces_epoch + 1,
        token: inner.next_token(),
        fingerprint,
        holder: Bytes::copy_from_slice(holder),
        since_ms: now_ms,
        lease_until_ms: now_ms.saturating_add(lease_ms),
    };
    let mut batch = WriteBatch::default();
    batch.merge_cf(
        inner.marker_cf(marker),
        &stored_key,
        Operand::encode_install(
            replaces_epoch,
            &ticket.in_progress_record(ticket.lease_until_ms),
        ),
    );
    inner.write(batch)?;
    Ok(Outcome::Fresh(ExternalClaim {
        inner: inner.clone(),
        marker,
        ticket,
        previous,
        expiry,
        staged: Staged::default(),
        observer: None,
    }))
}

impl LeaseTicket {
    fn in_progress_record(&self, lease_until_ms: u64) -> Record {
        Record {
            epoch: self.epoch,
            fingerprint: self.fingerprint,
            state: RecordState::InProgress {
                since_ms: self.since_ms,
                lease_until_ms,
                holder: self.holder.clone(),
                token: self.token,
            },
        }
    }
}

/// Writes `record` in place of the in-progress record (`epoch`, `token`) of `stored_key`, with
/// `batch` (staged writes) in the same write batch, after checking under the key's latch that
/// the record is still that one.
fn fenced_replace(
    inner: &Storage,
    marker: usize,
    stored_key: &[u8],
    holder: Option<(u64, u64)>,
    make_record: impl FnOnce(u64, &Record) -> Record,
    batch: WriteBatch,
    not_held: impl FnOnce(u64) -> Error,
) -> Result<()> {
    inner.check_not_poisoned()?;
    let now_ms = inner.write_clock_ms()?;
    let _latch = inner.markers[marker]
        .latches
        .acquire_waiting(stored_key, now_ms, LATCH_WAIT)
        .ok_or(Error::KeyBusy)?;
    let current = inner.read_record_raw(marker, stored_key)?;
    let Some(current) = current else {
        return Err(not_held(0));
    };
    let RecordState::InProgress { token, .. } = current.state else {
        return Err(not_held(current.epoch));
    };
    if holder.is_some_and(|expected| expected != (current.epoch, token)) {
        return Err(not_held(current.epoch));
    }
    let record = make_record(now_ms, &current);
    let mut batch = batch;
    batch.merge_cf(
        inner.marker_cf(marker),
        stored_key,
        Operand::encode_replace(current.epoch, token, &record),
    );
    inner.write(batch)
}

/// The record a release leaves: absent to reads, kept for the engine's retention so that the
/// key's epoch keeps increasing.
fn released(inner: &Storage, now_ms: u64, current: &Record) -> Record {
    Record {
        epoch: current.epoch,
        fingerprint: current.fingerprint,
        state: RecordState::Released {
            released_at_ms: now_ms,
            removable_at_ms: expires_at_ms(
                Expiry::After(Duration::from_millis(inner.retention_ms)),
                now_ms,
            ),
        },
    }
}

fn completed(
    now_ms: u64,
    expiry: Expiry,
    current: &Record,
    result: Bytes,
    succeeded: bool,
) -> Record {
    Record {
        epoch: current.epoch,
        fingerprint: current.fingerprint,
        state: RecordState::Completed {
            committed_at_ms: now_ms,
            expires_at_ms: expires_at_ms(expiry, now_ms),
            result,
            succeeded,
        },
    }
}

/// An operator's resolution of an in-progress key, whoever holds it.
pub(crate) fn resolve(
    inner: &Storage,
    marker: usize,
    stored_key: &[u8],
    resolution: Resolution,
    expiry: Expiry,
) -> Result<()> {
    if let Resolution::Complete(result) = &resolution {
        crate::format::record::check_result(result)?;
    }
    fenced_replace(
        inner,
        marker,
        stored_key,
        None,
        |now_ms, current| match resolution {
            Resolution::Complete(result) => completed(now_ms, expiry, current, result, true),
            Resolution::Release => released(inner, now_ms, current),
        },
        WriteBatch::default(),
        |current_epoch| Error::NotInProgress { current_epoch },
    )
}

impl ExternalClaim {
    pub(crate) fn resumed(
        inner: Arc<Storage>,
        marker: usize,
        ticket: LeaseTicket,
        expiry: Expiry,
    ) -> Self {
        ExternalClaim {
            inner,
            marker,
            ticket,
            previous: None,
            expiry,
            staged: Staged::default(),
            observer: None,
        }
    }

    /// Reports this claim's steps to a consumer's metrics and logs; the consumer's in-progress
    /// gauge counts it while it is alive.
    pub(crate) fn observe(&mut self, metrics: Arc<ConsumerMetrics>, correlation_id: Option<&str>) {
        metrics.in_progress(1);
        self.observer = Some(Observer::new(metrics, correlation_id));
    }

    /// Counts a refused step, logs a written one.
    fn observed(&self, step: &'static str, result: &Result<()>, started: Instant) {
        let Some(observer) = &self.observer else {
            return;
        };
        match result {
            Ok(()) if step == "complete" => {
                observer.committed(step, &self.ticket.stored_key, self.ticket.epoch, started);
            }
            Ok(()) => observer.log_step(step, &self.ticket.stored_key, self.ticket.epoch, None),
            Err(Error::LeaseLost { current_epoch }) => {
                observer.metrics.lease_lost();
                let key = &self.ticket.stored_key;
                observer.log_step(step, key, self.ticket.epoch, Some(*current_epoch));
            }
            Err(_) => {}
        }
    }

    fn fenced(
        &mut self,
        step: &'static str,
        make_record: impl FnOnce(u64, &Record) -> Record,
        batch: WriteBatch,
    ) -> Result<()> {
        let started = Instant::now();
        let result = fenced_replace(
            &self.inner,
            self.marker,
            &self.ticket.stored_key,
            Some((self.ticket.epoch, self.ticket.token)),
            make_record,
            batch,
            |current_epoch| Error::LeaseLost { current_epoch },
        );
        self.observed(step, &result, started);
        result
    }

    /// Extends the lease to `lease` from now (a heartbeat). Returns the new deadline.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if another holder took the key over; [`Error::LimitExceeded`] for a
    /// lease outside [`LEASE_MS_MIN`]..=[`LEASE_MS_MAX`].
    pub fn renew(&mut self, lease: Duration) -> Result<u64> {
        let lease_ms = lease_ms(lease)?;
        let ticket = self.ticket.clone();
        let mut lease_until_ms = 0;
        self.fenced(
            "renew",
            |now_ms, _| {
                lease_until_ms = now_ms.saturating_add(lease_ms);
                ticket.in_progress_record(lease_until_ms)
            },
            WriteBatch::default(),
        )?;
        self.ticket.lease_until_ms = lease_until_ms;
        Ok(lease_until_ms)
    }

    staging_methods!("by [`ExternalClaim::complete`]");

    /// Completes: replaces the in-progress record by the completed one (with `result`) and
    /// applies the staged writes, in one write batch, if this holder still holds the key.
    /// Returns the completed record's epoch: this holder's fencing epoch
    /// ([`ExternalClaim::epoch`]), which the record keeps.
    ///
    /// # Retrying
    /// `complete` consumes the claim, staged writes included. A retryable error
    /// ([`Error::is_retryable`]: [`Error::KeyBusy`] when another caller in this process held the
    /// key's latch for longer than the lease steps wait, or a transient storage error) wrote
    /// nothing and left the lease as it was: resume the claim from its ticket, stage again and
    /// complete again. Any other error is final for this holder.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idemdb::{Engine, Fingerprint, Outcome, TableOptions};
    ///
    /// let dir = tempfile::tempdir()?;
    /// let engine = Engine::builder(dir.path()).business_table(TableOptions::new("sent")).open()?;
    /// let mailer = engine.consumer("mailer")?;
    /// let sent = engine.business_table("sent")?;
    /// let lease = Duration::from_secs(30);
    /// let Outcome::Fresh(mut claim) = mailer.begin_external("order-7", Fingerprint::of(b"m"), lease, "host-a")?
    /// else {
    ///     unreachable!("a new store has seen nothing")
    /// };
    /// let ticket = claim.ticket().clone();
    /// // ... send the e-mail, with claim.derive_key("mail") as its idempotency key ...
    /// let epoch = loop {
    ///     claim.put(&sent, "order-7", b"yes")?;
    ///     match claim.complete(b"sent") {
    ///         Ok(epoch) => break epoch,
    ///         Err(error) if error.is_retryable() => claim = mailer.resume(&ticket)?,
    ///         Err(error) => return Err(error.into()),
    ///     }
    /// };
    /// assert_eq!(epoch, ticket.epoch());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::LeaseLost`] (nothing written, staged writes included) if the key was taken over;
    /// otherwise as for [`crate::Claim::commit`].
    pub fn complete(mut self, result: impl AsRef<[u8]>) -> Result<u64> {
        let result = result.as_ref();
        self.staged.check_result(result)?;
        let result = Bytes::copy_from_slice(result);
        let expiry = self.expiry;
        let mut batch = WriteBatch::default();
        self.staged.drain_into(&self.inner, &mut batch);
        self.fenced(
            "complete",
            |now_ms, current| completed(now_ms, expiry, current, result, true),
            batch,
        )?;
        Ok(self.ticket.epoch)
    }

    /// Records the handler's failure by `policy`. Staged writes are discarded.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the key was taken over; storage errors as for
    /// [`crate::Claim::commit`].
    pub fn fail(mut self, policy: FailurePolicy) -> Result<()> {
        let expiry = self.expiry;
        let inner = self.inner.clone();
        if let FailurePolicy::RecordFailure(result) = &policy {
            crate::format::record::check_result(result)?;
        }
        let step = match policy {
            FailurePolicy::Release => "release",
            FailurePolicy::RecordFailure(_) => "fail",
        };
        self.fenced(
            step,
            |now_ms, current| match policy {
                FailurePolicy::Release => released(&inner, now_ms, current),
                FailurePolicy::RecordFailure(result) => {
                    completed(now_ms, expiry, current, result, false)
                }
            },
            WriteBatch::default(),
        )
    }

    /// Releases the key without a result (same as `fail(FailurePolicy::Release)`).
    ///
    /// # Errors
    /// As for [`ExternalClaim::fail`].
    pub fn release(self) -> Result<()> {
        self.fail(FailurePolicy::Release)
    }

    /// What is needed to resume this claim after a restart ([`crate::Consumer::resume`]).
    #[must_use]
    pub fn ticket(&self) -> &LeaseTicket {
        &self.ticket
    }

    /// The idempotency key to give the downstream call at `step`: the same for every
    /// attempt at this message, so a takeover's retry is deduplicated downstream
    /// ([`crate::format::derive_key`]).
    #[must_use]
    pub fn derive_key(&self, step: &str) -> String {
        crate::format::key::derive_key(&self.ticket.stored_key, step)
    }

    /// This holder's fencing epoch.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.ticket.epoch
    }

    /// Until when the lease runs, as last written by this holder.
    #[must_use]
    pub fn lease_until_ms(&self) -> u64 {
        self.ticket.lease_until_ms
    }

    /// The attempt this claim took over, if any: its side effect may have been partly applied.
    #[must_use]
    pub fn previous_attempt(&self) -> Option<&PreviousAttempt> {
        self.previous.as_ref()
    }
}

impl Drop for ExternalClaim {
    fn drop(&mut self) {
        if let Some(observer) = &self.observer {
            observer.metrics.in_progress(-1);
        }
    }
}

impl std::fmt::Debug for ExternalClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalClaim")
            .field(
                "stored_key",
                &crate::format::printable::printable(&self.ticket.stored_key),
            )
            .field("epoch", &self.ticket.epoch)
            .field("lease_until_ms", &self.ticket.lease_until_ms)
            .finish_non_exhaustive()
    }
}
