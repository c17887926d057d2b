//! Claim -> stage -> commit: the outcome of `begin`, and the claim that owns a key until it
//! commits its marker and staged business writes in one RocksDB write batch.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rocksdb::WriteBatch;

use crate::decision::{Found, PreviousAttempt, admit, inspect_record};
use crate::format::error::{Limit, Result, check_limit_u64};
use crate::format::fingerprint::Fingerprint;
use crate::format::key::StoredKey;
use crate::format::record::{Committed, EXPIRES_NEVER_MS, EncodedBytes, Record};
use crate::operations::position::{StagedPositions, consumer_prefix_of};
use crate::operations::staging::{BATCH_ENTRY_OVERHEAD_BYTES, Staged, batch_for, staging_methods};
use crate::storage::business_table::BusinessTable;
use crate::storage::observe::ConsumerMetrics;
use crate::storage::options::{RETENTION_MS_MAX, RETENTION_MS_MIN};
use crate::storage::store::{RECORDS_MARKER, Storage};

/// What `begin` found, with the engine's [`Claim`] when fresh. The outcome type itself is
/// shared by every backend and generic over the claim ([`crate::decision::Outcome`]).
pub type Outcome<C = Claim> = crate::decision::Outcome<C>;

/// Reads `stored_key` (the caller holds its latch) and decides what a claimant gets.
pub(crate) fn inspect(
    inner: &Storage,
    marker: usize,
    stored_key: &[u8],
    fingerprint: Fingerprint,
    now_ms: u64,
) -> Result<Found> {
    let record = inner.read_record_raw(marker, stored_key)?;
    Ok(inspect_record(record, fingerprint, now_ms))
}

/// How long a committed record is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// Expire this long after the commit; bounds
    /// [`RETENTION_MS_MIN`]..=[`RETENTION_MS_MAX`] milliseconds.
    After(Duration),
    /// Never expire (the default for entity tables).
    Never,
}

/// Exclusive ownership of one key, from a `Fresh` outcome until [`Claim::commit`],
/// [`Claim::abort`] or drop. Business writes staged on it land in the same RocksDB write batch
/// as the marker, or not at all.
///
/// A claim is `Send` and `Sync`: it may move to another thread (a worker pool, an async
/// runtime), and a future holding a `&Claim` across an await stays `Send`.
pub struct Claim {
    inner: Arc<Storage>,
    marker: usize,
    stored_key: StoredKey,
    /// Epoch of the claimable record found at `begin` (expired, released, or in progress with an
    /// expired lease), or 0 if the key was absent: the new record's epoch is one more.
    replaces_epoch: u64,
    fingerprint: Fingerprint,
    claimed_at_ms: u64,
    expiry: Expiry,
    /// Boxed: only a takeover has one, and every claim is moved several times on its way out.
    previous: Option<Box<PreviousAttempt>>,
    /// The ordering guard's (versions-table key, version), whose latch this claim also holds.
    version: Option<(Vec<u8>, u64)>,
    staged: Staged,
    /// Read positions to write with the marker (log consumers).
    pub(crate) positions: StagedPositions,
    /// The consumer's numbers and the message's correlation id, for metrics and logs.
    observer: Option<Observer>,
}

/// What a claim reports its commit to.
pub(crate) struct Observer {
    pub(crate) metrics: Arc<ConsumerMetrics>,
    pub(crate) correlation_id: Option<Box<str>>,
}

impl Observer {
    pub(crate) fn new(metrics: Arc<ConsumerMetrics>, correlation_id: Option<&str>) -> Observer {
        Observer {
            metrics,
            correlation_id: correlation_id.map(Into::into),
        }
    }

    /// Counts a written commit (or complete) and logs it.
    pub(crate) fn committed(
        &self,
        step: &'static str,
        stored_key: &[u8],
        epoch: u64,
        started: Instant,
    ) {
        self.metrics.commit(started.elapsed());
        self.log_step(step, stored_key, epoch, None);
    }

    /// Logs a step of the claim on `stored_key` at `epoch`; `current_epoch` when the step was
    /// refused because another holder has the key at that epoch.
    pub(crate) fn log_step(
        &self,
        step: &'static str,
        stored_key: &[u8],
        epoch: u64,
        current_epoch: Option<u64>,
    ) {
        tracing::debug!(
            target: "idemdb",
            consumer = %self.metrics.consumer,
            key = %crate::format::printable::printable(stored_key),
            epoch,
            current_epoch,
            correlation_id = self.correlation_id.as_deref(),
            "{step}{}",
            if current_epoch.is_some() { ": lease lost" } else { "" }
        );
    }
}

/// What `begin` needs to know about one delivery, beyond the marker table.
pub(crate) struct Request {
    pub(crate) stored_key: StoredKey,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) produced_at_ms: Option<u64>,
    /// The ordering guard: (versions-table key, version).
    pub(crate) version: Option<(Vec<u8>, u64)>,
    pub(crate) expiry: Expiry,
}

/// Reads the request's record, then takes its key's latch unless the record settles the
/// request: a completed record stays as it is until it expires (only a claimable or in-progress
/// record is ever replaced, under its key's latch), so a duplicate or a conflict is answered
/// without the latch. The read is kept for the decision if no record of the latch's shard was
/// written between the read and the latch ([`crate::storage::latch::Latches::try_acquire_after`]),
/// and made again under the latch if one was.
pub(crate) fn begin(inner: &Arc<Storage>, marker: usize, request: Request) -> Result<Outcome> {
    begin_at(inner, marker, request, inner.clock.now_ms())
}

/// [`begin`] at `now_ms`, the engine's clock read by the caller.
pub(crate) fn begin_at(
    inner: &Arc<Storage>,
    marker: usize,
    request: Request,
    now_ms: u64,
) -> Result<Outcome> {
    // A poisoned engine cannot commit: say so now rather than hand out a claim that must fail.
    inner.check_not_poisoned()?;
    let latches = &inner.markers[marker].latches;
    let look = latches.look(&request.stored_key);
    let found = inspect(
        inner,
        marker,
        &request.stored_key,
        request.fingerprint,
        now_ms,
    )?;
    if let Found::Settled(settled @ (Outcome::Duplicate { .. } | Outcome::Conflict { .. })) = found
    {
        return Ok(Outcome::settled(settled));
    }
    let unchanged = match latches.try_acquire_after(&request.stored_key, now_ms, look) {
        Ok(unchanged) => unchanged,
        Err(since_ms) => return Ok(Outcome::held_by_claim(since_ms)),
    };
    // The claim owns the latch from here: its drop releases it on every path below.
    let (mut claim, pending) = request.into_latched_claim(inner, marker, now_ms);
    // Committed alone: its writes go straight into its commit's batch.
    claim.staged = Staged::direct(claim.commit_bytes(0));
    let found = if unchanged {
        found
    } else {
        inspect(inner, marker, &claim.stored_key, claim.fingerprint, now_ms)?
    };
    decide(claim, found, pending, now_ms)
}

/// What deciding a latched claim needs besides the claim: production time and version.
pub(crate) struct Pending {
    produced_at_ms: Option<u64>,
    version: Option<(Vec<u8>, u64)>,
}

impl Request {
    /// Turns the request into the claim on its key, whose latch the caller has just taken.
    pub(crate) fn into_latched_claim(
        self,
        inner: &Arc<Storage>,
        marker: usize,
        now_ms: u64,
    ) -> (Claim, Pending) {
        let claim = Claim::latched(
            inner,
            marker,
            self.stored_key,
            self.fingerprint,
            self.expiry,
            now_ms,
        );
        let pending = Pending {
            produced_at_ms: self.produced_at_ms,
            version: self.version,
        };
        (claim, pending)
    }
}

/// Turns what the latch holder found into the outcome: the claim itself if the key is
/// claimable, admitted by the floor and the ordering guard; otherwise the claim is dropped
/// (releasing the latch) and the outcome says why.
pub(crate) fn decide(
    mut claim: Claim,
    found: Found,
    pending: Pending,
    now_ms: u64,
) -> Result<Outcome> {
    Ok(match decide_in_place(&mut claim, found, pending, now_ms)? {
        None => Outcome::Fresh(claim),
        Some(settled) => Outcome::settled(settled),
    })
}

/// [`decide`] on a claim that stays where it is (a batch's): `None` when it is fresh, or the
/// outcome to report instead, and then the caller drops the claim.
pub(crate) fn decide_in_place(
    claim: &mut Claim,
    found: Found,
    pending: Pending,
    now_ms: u64,
) -> Result<Option<Outcome<Infallible>>> {
    let Pending {
        produced_at_ms,
        version,
    } = pending;
    let floor = claim.inner.admission_floor_ms();
    match admit(found, produced_at_ms, now_ms, floor) {
        Found::Claimable {
            replaces_epoch,
            previous,
        } => {
            if let Some((version_key, version)) = version {
                if let Some(settled) = guard_order(&claim.inner, &version_key, version, now_ms)? {
                    return Ok(Some(settled));
                }
                claim.version = Some((version_key, version));
            }
            claim.replaces_epoch = replaces_epoch;
            claim.previous = previous.map(Box::new);
            Ok(None)
        }
        Found::Settled(outcome) => Ok(Some(outcome)),
    }
}

/// The ordering guard: takes the latch of the entity's version and compares (the decision
/// core's `guard_order`). Returns the
/// outcome to report instead of a claim (stale, or the entity busy), or `None` with the version
/// latch held by the caller's claim.
fn guard_order(
    inner: &Storage,
    version_key: &[u8],
    version: u64,
    now_ms: u64,
) -> Result<Option<Outcome<Infallible>>> {
    if let Err(since_ms) = inner.version_latches.try_acquire(version_key, now_ms) {
        // Another message of the same entity is being applied right now.
        return Ok(Some(Outcome::held_by_claim(since_ms)));
    }
    let current = match inner.read_version(version_key) {
        Ok(current) => current,
        Err(error) => {
            inner.version_latches.release(version_key);
            return Err(error);
        }
    };
    match crate::decision::guard_order(current, version) {
        Some(stale) => {
            inner.version_latches.release(version_key);
            Ok(Some(stale))
        }
        None => Ok(None),
    }
}

/// When a record committed at `now_ms` with `expiry` expires. Durations are bounded by
/// [`RETENTION_MS_MAX`]; the sum saturates below "never" for absurd clocks.
pub(crate) fn expires_at_ms(expiry: Expiry, now_ms: u64) -> u64 {
    match expiry {
        Expiry::After(duration) => now_ms
            .saturating_add(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
            .min(EXPIRES_NEVER_MS - 1),
        Expiry::Never => EXPIRES_NEVER_MS,
    }
}

/// Checks an expiry against [`RETENTION_MS_MIN`]..=[`RETENTION_MS_MAX`].
pub(crate) fn check_expiry(expiry: Expiry) -> Result<()> {
    if let Expiry::After(duration) = expiry {
        let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        check_limit_u64(Limit::RetentionMs, ms, RETENTION_MS_MIN, RETENTION_MS_MAX)?;
    }
    Ok(())
}

impl Claim {
    /// A claim on `stored_key`, whose latch the caller has just taken.
    pub(crate) fn latched(
        inner: &Arc<Storage>,
        marker: usize,
        stored_key: StoredKey,
        fingerprint: Fingerprint,
        expiry: Expiry,
        now_ms: u64,
    ) -> Claim {
        Claim {
            inner: inner.clone(),
            marker,
            stored_key,
            replaces_epoch: 0,
            fingerprint,
            claimed_at_ms: now_ms,
            expiry,
            previous: None,
            version: None,
            staged: Staged::default(),
            positions: StagedPositions::default(),
            observer: None,
        }
    }

    /// The engine this claim belongs to.
    pub(crate) fn inner(&self) -> &Arc<Storage> {
        &self.inner
    }

    /// Reports this claim's commit to a consumer's metrics and logs.
    pub(crate) fn observe(&mut self, metrics: Arc<ConsumerMetrics>, correlation_id: Option<&str>) {
        self.observer = Some(Observer::new(metrics, correlation_id));
    }

    /// Counts and logs a commit that was written.
    pub(crate) fn report_commit(&self, committed: &Committed, started: Instant) {
        if let Some(observer) = &self.observer {
            observer.committed("commit", &self.stored_key, committed.epoch, started);
        }
    }

    staging_methods!("if the claim commits");

    /// Stages the read position of a log consumer: `offset` of `partition` of `source` (a
    /// topic, a stream) is written in the same write batch as this claim's marker and staged
    /// writes, so that a restart resumes after this message exactly when its effects are
    /// stored. Staged more than once for a partition, the highest offset is written.
    ///
    /// Read positions belong to consumers: [`crate::Consumer::positions`] reads them back.
    ///
    /// # Errors
    /// [`crate::Error::LimitExceeded`] for a source outside
    /// [`crate::POSITION_SOURCE_BYTES_MIN`]..=[`crate::POSITION_SOURCE_BYTES_MAX`] bytes;
    /// [`crate::Error::InvalidArgument`] for one containing NUL, and on an entity table's
    /// claim. The commit fails with
    /// [`crate::Error::PositionBehind`], writing nothing, if `offset` is then behind the
    /// partition's position.
    pub fn stage_position(&mut self, source: &str, partition: u32, offset: u64) -> Result<()> {
        if self.marker != RECORDS_MARKER {
            return Err(crate::format::error::Error::invalid_argument(
                "read positions belong to consumers; an entity table's claim has none",
            ));
        }
        let prefix = consumer_prefix_of(&self.stored_key)?;
        let key = crate::format::position::encode_position_key(prefix, source, partition)?;
        self.positions.stage(key, offset);
        Ok(())
    }

    /// Commits: writes the marker record (with `result`, returned to later duplicates) and every
    /// staged write in one atomic RocksDB write batch, with the engine's durability. The key is
    /// released when this returns, whatever the outcome.
    ///
    /// # Errors
    /// Refusals, each writing nothing, releasing the claim and leaving the engine as it was:
    /// [`crate::Error::LimitExceeded`] if `result` is larger than [`crate::RESULT_BYTES_MAX`];
    /// [`crate::Error::PositionBehind`] if a staged read position is behind its partition's;
    /// [`crate::Error::InvalidArgument`] for a commit larger than the whole commit log
    /// ([`crate::EngineBuilder::commit_log`]); [`crate::Error::ClockOutOfRange`] for a clock
    /// past the records' range. [`crate::Error::Poisoned`] or [`crate::Error::Storage`] if the
    /// write fails: a retryable error wrote nothing; any other leaves the batch's durability
    /// unknown (a failed fsync, say: the batch may be visible in this process and still be lost
    /// by a crash), so the engine refuses further writes until it is reopened, and the reopened
    /// store holds the whole batch or none of it.
    pub fn commit(mut self, result: impl AsRef<[u8]>) -> Result<Committed> {
        let started = Instant::now();
        let mut batch = self.commit_batch(result.as_ref().len());
        let now_ms = self.inner.write_clock_ms()?;
        let committed = self.append_commit(&mut batch, result.as_ref(), now_ms)?;
        let positions = std::mem::take(&mut self.positions).append_to(
            &self.inner,
            &mut batch,
            committed.committed_at_ms,
        )?;
        // The latch is still held: no other claim can read this key until the batch is visible.
        self.inner.write(batch)?;
        if let Some(positions) = positions {
            positions.written();
        }
        self.report_commit(&committed, started);
        Ok(committed)
    }

    /// The write batch this claim's commit writes: the one its writes were staged into
    /// ([`Staged::direct`]), or a new one with room for the commit's entries.
    fn commit_batch(&mut self, result_len: usize) -> WriteBatch {
        match self.staged.take_batch() {
            Some(batch) => batch,
            None => batch_for(self.commit_bytes(result_len)),
        }
    }

    /// At most the bytes [`Claim::append_commit`] adds to a write batch, with a result of
    /// `result_len` bytes.
    pub(crate) fn commit_bytes(&self, result_len: usize) -> usize {
        let version = self
            .version
            .as_ref()
            .map_or(0, |(key, _)| BATCH_ENTRY_OVERHEAD_BYTES + key.len() + 8);
        let marker = BATCH_ENTRY_OVERHEAD_BYTES
            + self.stored_key.len()
            + crate::format::record::RECORD_HEADER_BYTES_MAX
            + result_len;
        self.staged.writes() * BATCH_ENTRY_OVERHEAD_BYTES
            + self.staged.bytes
            + version
            + marker
            + self.positions.batch_bytes()
    }

    /// Appends this claim's staged writes, its ordering-guard version and its marker to `batch`,
    /// committed at `committed_at_ms` (the engine's write clock, read once for a whole batch).
    /// Nothing is appended on error.
    pub(crate) fn append_commit(
        &mut self,
        batch: &mut WriteBatch,
        result: &[u8],
        committed_at_ms: u64,
    ) -> Result<Committed> {
        self.staged.check_result(result)?;
        let expires_at_ms = expires_at_ms(self.expiry, committed_at_ms);
        let epoch = self.replaces_epoch + 1;
        let record = Record::new(
            epoch,
            committed_at_ms,
            expires_at_ms,
            self.fingerprint,
            Bytes::copy_from_slice(result),
        );
        self.staged.drain_into(&self.inner, batch);
        if let Some((version_key, version)) = &self.version {
            batch.put_cf(self.inner.versions_cf(), version_key, version.to_be_bytes());
        }
        // The record itself, not an install operand: the latch makes this claim the key's only
        // writer from its read to this write (section 7 of docs/design.md), so the operand's
        // insert-if-absent would decide nothing, and a record stored as a value is read without
        // a merge fold: the duplicate path measured 19% fewer instructions.
        let mut value = EncodedBytes::new();
        record.encode_into(&mut value);
        batch.put_cf(self.inner.marker_cf(self.marker), &self.stored_key, value);
        Ok(Committed {
            epoch,
            committed_at_ms,
            expires_at_ms,
        })
    }

    /// Releases the key without writing anything (same as dropping the claim). The broker's
    /// redelivery will find the key free.
    pub fn abort(self) {}

    /// The idempotency key to give a downstream call made for this message at `step`:
    /// the same message and step give the same key, across redeliveries, takeovers, restarts
    /// and idemdb versions ([`crate::format::derive_key`]).
    #[must_use]
    pub fn derive_key(&self, step: &str) -> String {
        crate::format::key::derive_key(&self.stored_key, step)
    }

    /// The fingerprint this claim will store.
    #[must_use]
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The stored key this claim holds (for a consumer: the composite key).
    #[must_use]
    pub fn stored_key(&self) -> &[u8] {
        &self.stored_key
    }

    /// The epoch the record will have when committed.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.replaces_epoch + 1
    }

    /// When the claim was taken (engine clock).
    #[must_use]
    pub fn claimed_at_ms(&self) -> u64 {
        self.claimed_at_ms
    }

    /// The external attempt this claim took over after its lease expired, if any: its side
    /// effect may have been partly applied.
    #[must_use]
    pub fn previous_attempt(&self) -> Option<&PreviousAttempt> {
        self.previous.as_deref()
    }

    /// How many business writes are staged.
    #[must_use]
    pub fn staged_writes(&self) -> usize {
        self.staged.writes()
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Whether committed, aborted, failed or unwound by a panic: the key becomes free again.
        // After a commit the record is already visible, so the next claimant sees a duplicate.
        self.inner.markers[self.marker]
            .latches
            .release(&self.stored_key);
        if let Some((version_key, _)) = &self.version {
            self.inner.version_latches.release(version_key);
        }
    }
}

// Claims move between threads (a worker pool, an async runtime): keep them `Send`; and `Sync`,
// so that a future holding a `&Claim` across an await stays `Send`.
const _: () = {
    const fn assert_send<T: Send>() {}
    const fn assert_sync<T: Sync>() {}
    assert_send::<Claim>();
    assert_send::<Outcome>();
    assert_sync::<Claim>();
    assert_sync::<Outcome>();
};

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field(
                "stored_key",
                &crate::format::printable::printable(&self.stored_key),
            )
            .field("epoch", &self.epoch())
            .field("staged_writes", &self.staged.writes())
            .finish_non_exhaustive()
    }
}
#[cfg(feature = "tokio")]
impl Claim {
    /// Commits like [`Claim::commit`], without blocking the calling thread on the WAL's fsync.
    ///
    /// With [`crate::Durability::Sync`] the claim goes to the engine's committer thread, which
    /// writes every claim waiting for it as one batch (one WAL write, one fsync) and completes
    /// their futures; a runtime's worker thread is never blocked. With
    /// [`crate::Durability::Buffered`] nothing waits for a disk, so the commit is made here and
    /// the future is ready at once.
    ///
    /// The key stays claimed until the commit is visible, as with [`Claim::commit`]. Dropping
    /// the future does not cancel the commit; its read positions are settled by the write
    /// either way (given back at once if it fails).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use idemdb::{Engine, Fingerprint, Outcome};
    /// let dir = tempfile::tempdir()?;
    /// let engine = Engine::builder(dir.path()).open()?; // Durability::Sync
    /// let billing = engine.consumer("billing")?;
    /// if let Outcome::Fresh(claim) = billing.begin(b"order-42", Fingerprint::of(b"payload"))? {
    ///     let committed = claim.commit_async(b"charged").await?; // durable here
    ///     assert_eq!(committed.epoch, 1);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// The future resolves to the errors of [`Claim::commit`]. In a group whose write fails,
    /// every claim gets the same error.
    pub fn commit_async(
        self,
        result: impl AsRef<[u8]>,
    ) -> crate::storage::log::commit_future::CommitFuture {
        let (reply, receiver) = tokio::sync::oneshot::channel();
        self.submit(result.as_ref(), move |answer| {
            // The caller may have dropped the future; the commit stands either way.
            let _ = reply.send(answer);
        });
        crate::storage::log::commit_future::CommitFuture::waiting(receiver)
    }
}

impl Claim {
    /// Commits like [`Claim::commit`] and tells `reply` the outcome: from the engine's committer
    /// thread with [`crate::Durability::Sync`] (the calling thread goes on at once), before
    /// returning with `Buffered` (nothing waits for a disk) or when the commit fails its checks.
    /// The key stays claimed until the commit is visible; `reply` hears of it after the key is
    /// released. What [`Claim::commit_async`] and [`crate::Pipeline`] share.
    pub(crate) fn submit(
        mut self,
        result: &[u8],
        reply: impl FnOnce(Result<Committed>) + Send + 'static,
    ) {
        use crate::storage::log::committer::Job;
        let storage = self.inner().clone();
        if !storage.syncs_each_write() {
            return reply(self.commit(result));
        }
        let started = Instant::now();
        let committer = match storage.committer() {
            Ok(committer) => committer,
            Err(error) => return reply(Err(error)),
        };
        let mut batch = self.commit_batch(result.len());
        // Nothing is appended on error, and the claim is released as `commit` would.
        let prepared = storage
            .write_clock_ms()
            .and_then(|now_ms| self.append_commit(&mut batch, result, now_ms))
            .and_then(|committed| {
                let now_ms = committed.committed_at_ms;
                let positions = std::mem::take(&mut self.positions);
                Ok((
                    committed,
                    positions.append_to(&storage, &mut batch, now_ms)?,
                ))
            });
        let (committed, positions) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => return reply(Err(error)),
        };
        committer.submit(Job {
            batch,
            claims: 1,
            writer: storage.clone(),
            finish: Box::new(move |written| {
                if let Some(positions) = positions {
                    positions.settle(&written);
                }
                if written.is_ok() {
                    self.report_commit(&committed, started);
                }
                // The key is released before the caller hears of it.
                drop(self);
                reply(written.map(|()| committed));
            }),
        });
    }
}
