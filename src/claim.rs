//! Claim -> stage -> commit: the outcome of `begin`, and the claim that owns a key until it
//! commits its marker and staged business writes in one RocksDB write batch.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rocksdb::WriteBatch;

use crate::engine::{BusinessTable, Inner};
use crate::error::{Error, Limit, Result, check_limit};
use crate::fingerprint::Fingerprint;
use crate::options::{RETENTION_MS_MAX, RETENTION_MS_MIN};
use crate::record::{EXPIRES_NEVER_MS, Operand, RESULT_BYTES_MAX, Record};

/// The shortest key of a staged business write, in bytes.
pub const TABLE_KEY_BYTES_MIN: usize = 1;
/// The longest key of a staged business write, in bytes (64 KiB).
pub const TABLE_KEY_BYTES_MAX: usize = 64 << 10;
/// The largest value (or merge operand) of a staged business write, in bytes (64 MiB).
pub const TABLE_VALUE_BYTES_MAX: usize = 64 << 20;
/// The most business writes one claim stages.
pub const STAGED_WRITES_MAX: usize = 65_536;
/// The most bytes (keys, values and the result together) one claim commits (256 MiB).
pub const STAGED_BYTES_MAX: usize = 256 << 20;

/// What `begin` found. Match every variant: each asks the caller for a different action.
#[derive(Debug)]
#[must_use = "an outcome tells the caller whether to process, skip or dead-letter the message"]
pub enum Outcome {
    /// The key was free and this caller now owns it: process the message, stage the business
    /// writes on the claim and [`Claim::commit`]. Dropping the claim releases the key and writes
    /// nothing (a transient failure: let the broker redeliver).
    Fresh(Claim),
    /// The message was processed before: acknowledge it without effect and, if useful, return
    /// the stored result.
    #[non_exhaustive]
    Duplicate {
        /// The result stored by the first commit.
        result: Bytes,
        /// When the first commit happened (engine clock, ms since the Unix epoch).
        first_committed_at_ms: u64,
        /// When the record expires ([`crate::EXPIRES_NEVER_MS`] for never).
        expires_at_ms: u64,
        /// The record's epoch.
        epoch: u64,
    },
    /// Another claim in this process holds the key right now: do not acknowledge; let the
    /// broker redeliver later (or retry after a delay).
    #[non_exhaustive]
    InProgress {
        /// When the holding claim was taken (engine clock, ms since the Unix epoch).
        since_ms: u64,
    },
    /// The key was completed with different content (R15): the producer reused an id or the
    /// message changed. Route the message to a dead-letter path and alert; do not process it.
    #[non_exhaustive]
    Conflict {
        /// The fingerprint stored by the first commit.
        stored_fingerprint: Fingerprint,
        /// The fingerprint given to this `begin`.
        new_fingerprint: Fingerprint,
        /// When the first commit happened.
        first_committed_at_ms: u64,
    },
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

/// What a successful commit wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Committed {
    /// The new record's epoch.
    pub epoch: u64,
    /// The commit's timestamp (engine clock).
    pub committed_at_ms: u64,
    /// When the record expires ([`EXPIRES_NEVER_MS`] for never).
    pub expires_at_ms: u64,
}

/// Exclusive ownership of one key, from a `Fresh` outcome until [`Claim::commit`],
/// [`Claim::abort`] or drop. Business writes staged on it land in the same RocksDB write batch
/// as the marker, or not at all.
pub struct Claim {
    inner: Arc<Inner>,
    marker: usize,
    stored_key: Vec<u8>,
    /// Epoch of the expired record found at `begin`, or 0 if the key was absent: the merge
    /// operand installs the new record only over that one (or over nothing).
    replaces_epoch: u64,
    fingerprint: Fingerprint,
    claimed_at_ms: u64,
    expiry: Expiry,
    batch: WriteBatch,
    staged_writes: usize,
    staged_bytes: usize,
}

/// Takes the latch on `stored_key`, then reads its record while holding it.
pub(crate) fn begin(
    inner: &Arc<Inner>,
    marker: usize,
    stored_key: Vec<u8>,
    fingerprint: Fingerprint,
    expiry: Expiry,
) -> Result<Outcome> {
    // A poisoned engine cannot commit: say so now rather than hand out a claim that must fail.
    inner.check_not_poisoned()?;
    let now_ms = inner.clock.now_ms();
    let latches = &inner.markers[marker].latches;
    if let Err(since_ms) = latches.try_acquire(&stored_key, now_ms) {
        return Ok(Outcome::InProgress { since_ms });
    }
    // From here the latch is ours: the claim releases it on drop, and so does every early return
    // below (the claim is built first so that its drop covers them).
    let mut claim = Claim {
        inner: inner.clone(),
        marker,
        stored_key,
        replaces_epoch: 0,
        fingerprint,
        claimed_at_ms: now_ms,
        expiry,
        batch: WriteBatch::default(),
        staged_writes: 0,
        staged_bytes: 0,
    };
    let existing = inner.read_record_raw(marker, &claim.stored_key)?;
    match existing {
        None => Ok(Outcome::Fresh(claim)),
        Some(record) if record.is_expired(now_ms) => {
            claim.replaces_epoch = record.epoch;
            Ok(Outcome::Fresh(claim))
        }
        Some(record) if record.fingerprint == fingerprint => Ok(Outcome::Duplicate {
            result: record.result,
            first_committed_at_ms: record.committed_at_ms,
            expires_at_ms: record.expires_at_ms,
            epoch: record.epoch,
        }),
        Some(record) => Ok(Outcome::Conflict {
            stored_fingerprint: record.fingerprint,
            new_fingerprint: fingerprint,
            first_committed_at_ms: record.committed_at_ms,
        }),
    }
}

impl Claim {
    /// Stages `value` under `key` in `table`; applied only if the claim commits.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a key or value outside its limits or a claim past
    /// [`STAGED_WRITES_MAX`] / [`STAGED_BYTES_MAX`]; [`Error::ForeignTable`] for another
    /// engine's table. Nothing is staged on error.
    pub fn put(
        &mut self,
        table: &BusinessTable,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
    ) -> Result<()> {
        let (key, value) = (key.as_ref(), value.as_ref());
        self.check_write(table, key, value.len())?;
        self.batch.put_cf(self.inner.cf(&table.name), key, value);
        Ok(())
    }

    /// Stages a deletion of `key` in `table`; applied only if the claim commits.
    ///
    /// # Errors
    /// As for [`Claim::put`].
    pub fn delete(&mut self, table: &BusinessTable, key: impl AsRef<[u8]>) -> Result<()> {
        let key = key.as_ref();
        self.check_write(table, key, 0)?;
        self.batch.delete_cf(self.inner.cf(&table.name), key);
        Ok(())
    }

    /// Stages a merge of `operand` into `key` of `table` (which needs a merge operator);
    /// applied only if the claim commits.
    ///
    /// # Errors
    /// As for [`Claim::put`], and [`Error::NoMergeOperator`] if the table has none.
    pub fn merge(
        &mut self,
        table: &BusinessTable,
        key: impl AsRef<[u8]>,
        operand: impl AsRef<[u8]>,
    ) -> Result<()> {
        let (key, operand) = (key.as_ref(), operand.as_ref());
        if !table.has_merge_operator {
            return Err(Error::NoMergeOperator {
                name: table.name.clone(),
            });
        }
        self.check_write(table, key, operand.len())?;
        self.batch
            .merge_cf(self.inner.cf(&table.name), key, operand);
        Ok(())
    }

    /// Sets how long the committed record is kept, instead of the table's default (the engine's
    /// retention for consumers, [`Expiry::Never`] for entity tables).
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a duration outside
    /// [`RETENTION_MS_MIN`]..=[`RETENTION_MS_MAX`] ms.
    pub fn set_expiry(&mut self, expiry: Expiry) -> Result<()> {
        if let Expiry::After(duration) = expiry {
            let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
            if !(RETENTION_MS_MIN..=RETENTION_MS_MAX).contains(&ms) {
                return Err(Error::LimitExceeded {
                    limit: Limit::RetentionMs,
                    actual: ms,
                    min: RETENTION_MS_MIN,
                    max: RETENTION_MS_MAX,
                });
            }
        }
        self.expiry = expiry;
        Ok(())
    }

    /// Commits: writes the marker record (with `result`, returned to later duplicates) and every
    /// staged write in one atomic RocksDB write batch, with the engine's durability. The key is
    /// released when this returns, whatever the outcome.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] if `result` is larger than [`crate::RESULT_BYTES_MAX`] (nothing is
    /// written; the claim is released). [`Error::Poisoned`] or [`Error::Storage`] if the write
    /// fails; the batch then did not become visible, and unless the error is retryable the
    /// engine refuses further writes until reopened.
    pub fn commit(mut self, result: impl AsRef<[u8]>) -> Result<Committed> {
        let result = result.as_ref();
        check_limit(Limit::ResultBytes, result.len(), 0, RESULT_BYTES_MAX)?;
        let total_bytes = self.staged_bytes + result.len();
        check_limit(Limit::StagedBytes, total_bytes, 0, STAGED_BYTES_MAX)?;

        let committed_at_ms = self.inner.clock.now_ms();
        let expires_at_ms = match self.expiry {
            // Duration bounded by RETENTION_MS_MAX; saturate below "never" for absurd clocks.
            Expiry::After(duration) => committed_at_ms
                .saturating_add(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
                .min(EXPIRES_NEVER_MS - 1),
            Expiry::Never => EXPIRES_NEVER_MS,
        };
        let epoch = self.replaces_epoch + 1;
        let record = Record::new(
            epoch,
            committed_at_ms,
            expires_at_ms,
            self.fingerprint,
            Bytes::copy_from_slice(result),
        );
        let operand = Operand::encode_commit(self.replaces_epoch, &record);
        let mut batch = std::mem::take(&mut self.batch);
        batch.merge_cf(
            self.inner.cf(&self.inner.markers[self.marker].name),
            &self.stored_key,
            operand,
        );
        // The latch is still held: no other claim can read this key until the batch is visible.
        self.inner.write(batch)?;
        Ok(Committed {
            epoch,
            committed_at_ms,
            expires_at_ms,
        })
    }

    /// Releases the key without writing anything (same as dropping the claim). The broker's
    /// redelivery will find the key free.
    pub fn abort(self) {}

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

    /// How many business writes are staged.
    #[must_use]
    pub fn staged_writes(&self) -> usize {
        self.staged_writes
    }

    fn check_write(&mut self, table: &BusinessTable, key: &[u8], value_len: usize) -> Result<()> {
        if !Arc::ptr_eq(&table.inner, &self.inner) {
            return Err(Error::ForeignTable {
                name: table.name.clone(),
            });
        }
        check_limit(
            Limit::TableKeyBytes,
            key.len(),
            TABLE_KEY_BYTES_MIN,
            TABLE_KEY_BYTES_MAX,
        )?;
        check_limit(Limit::TableValueBytes, value_len, 0, TABLE_VALUE_BYTES_MAX)?;
        check_limit(
            Limit::StagedWrites,
            self.staged_writes + 1,
            0,
            STAGED_WRITES_MAX,
        )?;
        let staged_bytes = self.staged_bytes + key.len() + value_len;
        check_limit(Limit::StagedBytes, staged_bytes, 0, STAGED_BYTES_MAX)?;
        self.staged_writes += 1;
        self.staged_bytes = staged_bytes;
        Ok(())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Whether committed, aborted, failed or unwound by a panic: the key becomes free again.
        // After a commit the record is already visible, so the next claimant sees a duplicate.
        self.inner.markers[self.marker]
            .latches
            .release(&self.stored_key);
    }
}

// Claims move between threads (a worker pool, an async runtime): keep them `Send`.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Claim>();
    assert_send::<Outcome>();
};

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("stored_key", &crate::format::printable(&self.stored_key))
            .field("epoch", &self.epoch())
            .field("staged_writes", &self.staged_writes)
            .finish_non_exhaustive()
    }
}
