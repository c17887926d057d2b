//! Repairs under an exclusive open: resolve an in-progress key, invalidate a record, purge
//! expired records now, import an export.

use std::collections::HashSet;
use std::time::Duration;

use rocksdb::WriteBatch;

use crate::engine::Engine;
use crate::format::error::{Error, Result};
use crate::format::fingerprint::Fingerprint;
use crate::format::key::{check_message_key, consumer_prefix, encode_with_prefix};
use crate::format::operand::Operand;
use crate::format::record::{Record, RecordState, check_given_record, is_expired};
use crate::operations::claim::Expiry;
use crate::operations::lease::{LATCH_WAIT, Resolution};
use crate::storage::store_meta::RECORDS_TABLE;

use super::open::{Store, TableKind};
use super::report::StateCounts;
use super::scan::{EntryState, Target, record_state_at};

/// The most records [`Store::import`] writes in one write batch.
pub(super) const IMPORT_BATCH_RECORDS: usize = 1024;

/// The most bytes (keys and records) [`Store::import`] writes in one write batch.
pub(super) const IMPORT_BATCH_BYTES: usize = 64 << 20;

/// The result of [`Store::invalidate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalidation {
    /// The completed record (at `epoch`) is now released: the next delivery of the key is
    /// claimed afresh, at `epoch + 1`.
    Invalidated {
        /// The epoch of the record that was invalidated.
        epoch: u64,
    },
    /// Nothing was written: the key holds no live completed record.
    NotCompleted {
        /// What it holds (`None`: nothing).
        state: Option<EntryState>,
        /// Its epoch (0 when it holds nothing).
        epoch: u64,
    },
}

/// A record to write with [`Store::import`], checked when built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportRecord {
    pub(super) table: String,
    pub(super) consumer: Option<Vec<u8>>,
    pub(super) stored_key: Vec<u8>,
    pub(super) record: Record,
}

impl ImportRecord {
    /// A record for `key` in `table`: a consumer's message key when `consumer` is given (the
    /// consumers' table), an entity key otherwise.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a consumer id, key, result or holder outside its limits;
    /// [`Error::InvalidArgument`] for epoch 0 (epochs start at 1).
    pub fn new(
        table: impl Into<String>,
        consumer: Option<&[u8]>,
        key: &[u8],
        epoch: u64,
        fingerprint: Fingerprint,
        state: RecordState,
    ) -> Result<ImportRecord> {
        let stored_key = match consumer {
            Some(consumer) => encode_with_prefix(&consumer_prefix(consumer)?, key)?,
            None => {
                check_message_key(key)?;
                key.to_vec()
            }
        };
        check_given_record(epoch, &state)?;
        Ok(ImportRecord {
            table: table.into(),
            consumer: consumer.map(<[u8]>::to_vec),
            stored_key,
            record: Record {
                epoch,
                fingerprint,
                state,
            },
        })
    }
}

/// What [`Store::import`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportCounts {
    /// Records written to keys that held nothing.
    pub imported: u64,
    /// Records written over an existing value (only with `overwrite`).
    pub overwritten: u64,
    /// Records not written because the key held a value (without `overwrite`).
    pub skipped: u64,
}

/// What [`Store::purge_expired`] did: the marker tables' records before and after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Before the compaction.
    pub before: StateCounts,
    /// After it.
    pub after: StateCounts,
}

/// The index of a marker table among the engine's.
pub(super) fn marker_index(engine: &Engine, table: &str) -> Result<usize> {
    engine
        .storage()
        .markers
        .iter()
        .position(|marker| marker.name == table)
        .ok_or_else(|| Error::UnknownTable {
            name: table.to_owned(),
            expected: "marker",
        })
}

impl Store {
    /// Resolves a consumer's in-progress key, whoever holds it: completes it with a result
    /// (expiring after the builder's retention) or releases it. The same fenced step as
    /// [`crate::Consumer::resolve`]; a holder that comes back gets [`Error::LeaseLost`].
    ///
    /// # Errors
    /// [`Error::NotInProgress`] if the key is not in progress (nothing is written);
    /// [`Error::ReadOnly`] on a read-only store; [`Error::LimitExceeded`] for a bad
    /// consumer id, key or result; [`Error::Corrupt`] if the record does not decode;
    /// [`Error::Storage`] if the write fails.
    pub fn resolve(&self, consumer: &[u8], key: &[u8], resolution: Resolution) -> Result<()> {
        let engine = self.engine()?;
        let stored_key = encode_with_prefix(&consumer_prefix(consumer)?, key)?;
        let retention = Duration::from_millis(engine.storage().retention_ms);
        crate::operations::lease::resolve(
            engine.storage(),
            0,
            &stored_key,
            resolution,
            Expiry::After(retention),
        )
    }

    /// Makes a live completed record re-processable: it becomes a released record with the
    /// same epoch, so the next delivery of the key is claimed afresh (`Fresh`) at the next
    /// epoch, like after a release. The released record is kept until the completed one would
    /// have expired, so the epoch keeps increasing for as long as the record would have been
    /// remembered.
    ///
    /// No merge operand turns a completed record into a released one (a record is never
    /// changed by a write that did not expect it), so this writes a deletion of the key and an
    /// install of the released record in one batch. Only the exclusive open makes that safe.
    ///
    /// # Errors
    /// [`Error::ReadOnly`] on a read-only store; as for [`Store::get`];
    /// [`Error::Corrupt`] if the record does not decode; [`Error::Storage`] if the write fails.
    pub fn invalidate(&self, target: &Target, key: &[u8]) -> Result<Invalidation> {
        let engine = self.engine()?;
        let inner = engine.storage();
        let (table, stored_key) = self.locate(target, key)?;
        let marker = marker_index(engine, &table)?;
        let now_ms = inner.write_clock_ms()?;
        let _latch = inner.markers[marker]
            .latches
            .acquire_waiting(&stored_key, now_ms, LATCH_WAIT)
            .ok_or(Error::KeyBusy)?;
        let Some(record) = inner.read_record_raw(marker, &stored_key)? else {
            return Ok(Invalidation::NotCompleted {
                state: None,
                epoch: 0,
            });
        };
        let expires_at_ms = match record.state {
            RecordState::Completed { expires_at_ms, .. } if !is_expired(expires_at_ms, now_ms) => {
                expires_at_ms
            }
            _ => {
                return Ok(Invalidation::NotCompleted {
                    state: Some(record_state_at(&record, now_ms)),
                    epoch: record.epoch,
                });
            }
        };
        let released = Record {
            epoch: record.epoch,
            fingerprint: record.fingerprint,
            state: RecordState::Released {
                released_at_ms: now_ms,
                removable_at_ms: expires_at_ms,
            },
        };
        let cf = inner.cf(&table);
        let mut batch = WriteBatch::default();
        batch.delete_cf(cf, &stored_key);
        // Over the deletion the install applies whatever epoch it expects (merge rule 1).
        batch.merge_cf(
            cf,
            &stored_key,
            Operand::encode_install(record.epoch - 1, &released),
        );
        inner.write(batch)?;
        Ok(Invalidation::Invalidated {
            epoch: record.epoch,
        })
    }

    /// Compacts every marker table fully, so the compaction filter removes the expired records
    /// (and released records past their removal time), and counts the records before and
    /// after. `progress` is called before each table with its name, index and the number of
    /// tables. Business tables are not compacted.
    ///
    /// # Errors
    /// [`Error::ReadOnly`] on a read-only store; [`Error::Storage`] if a scan, flush or
    /// compaction fails.
    pub fn purge_expired(
        &self,
        mut progress: impl FnMut(&str, usize, usize),
    ) -> Result<PurgeReport> {
        let engine = self.engine()?;
        let before = self.marker_counts()?;
        let markers = &engine.storage().markers;
        for (index, marker) in markers.iter().enumerate() {
            progress(&marker.name, index, markers.len());
            engine.storage().compact_marker(index)?;
        }
        let after = self.marker_counts()?;
        Ok(PurgeReport { before, after })
    }

    /// Checks every record of an import before anything is written: a marker table of this
    /// store, a consumer exactly for the consumers' table, no key given twice.
    fn check_import(&self, records: &[ImportRecord]) -> Result<()> {
        let mut seen = HashSet::with_capacity(records.len());
        for record in records {
            let kind = self.kind(&record.table).filter(|kind| kind.is_marker());
            match (kind, &record.consumer) {
                (None, _) => {
                    return Err(Error::UnknownTable {
                        name: record.table.clone(),
                        expected: "marker",
                    });
                }
                (Some(TableKind::Consumers), None) => {
                    return Err(Error::invalid_argument(format!(
                        "a record for {RECORDS_TABLE:?} has no consumer"
                    )));
                }
                (Some(TableKind::Entity), Some(_)) => {
                    return Err(Error::invalid_argument(format!(
                        "a record for entity table {:?} has a consumer",
                        record.table
                    )));
                }
                _ => {}
            }
            if !seen.insert((record.table.as_str(), record.stored_key.as_slice())) {
                return Err(Error::invalid_argument(format!(
                    "key {} of table {:?} is given twice",
                    crate::format::printable::printable(&record.stored_key),
                    record.table
                )));
            }
        }
        Ok(())
    }

    /// Writes `records` (an export, typically) into the store: a key that holds nothing gets
    /// its record; a key that holds a value (any state, corrupt included) keeps it unless
    /// `overwrite`, which replaces it. Records are written exactly as given (epochs,
    /// timestamps, tokens), in batches of up to 1024; a failure leaves the batches before it
    /// written, so a rerun with the same input finishes the job.
    ///
    /// # Errors
    /// Checked before anything is written: [`Error::UnknownTable`] for a table that is not a
    /// marker table here, [`Error::InvalidArgument`] for a consumer given for an entity table or
    /// missing for the consumers' table, or a key given twice. [`Error::ReadOnly`] on a
    /// read-only store; [`Error::Storage`] if a read or write fails.
    pub fn import(&self, records: &[ImportRecord], overwrite: bool) -> Result<ImportCounts> {
        let engine = self.engine()?;
        let inner = engine.storage();
        self.check_import(records)?;
        let mut counts = ImportCounts::default();
        let mut batch = WriteBatch::default();
        let mut batch_bytes = 0;
        for record in records {
            let cf = inner.cf(&record.table);
            let exists = inner.db().get_pinned_cf(cf, &record.stored_key)?.is_some();
            if exists && !overwrite {
                counts.skipped += 1;
                continue;
            }
            if exists {
                batch.delete_cf(cf, &record.stored_key);
                counts.overwritten += 1;
            } else {
                counts.imported += 1;
            }
            // Over nothing (or the deletion) an install applies whatever epoch it expects.
            let operand = Operand::encode_install(record.record.epoch - 1, &record.record);
            batch_bytes += record.stored_key.len() + operand.len();
            batch.merge_cf(cf, &record.stored_key, operand);
            if batch.len() >= IMPORT_BATCH_RECORDS || batch_bytes >= IMPORT_BATCH_BYTES {
                inner.write(std::mem::take(&mut batch))?;
                batch_bytes = 0;
            }
        }
        if !batch.is_empty() {
            inner.write(batch)?;
        }
        Ok(counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::fingerprint::Fingerprint;
    use crate::format::record::{HOLDER_BYTES_MAX, RecordState};
    use bytes::Bytes;

    #[test]
    fn import_records_are_checked_when_built() {
        let state = RecordState::Released {
            released_at_ms: 1,
            removable_at_ms: 2,
        };
        let fingerprint = Fingerprint::of(b"");
        assert!(ImportRecord::new("t", Some(b""), b"k", 1, fingerprint, state.clone()).is_err());
        assert!(ImportRecord::new("t", None, b"", 1, fingerprint, state.clone()).is_err());
        assert!(ImportRecord::new("t", None, b"k", 0, fingerprint, state.clone()).is_err());
        let holder = Bytes::from(vec![b'h'; HOLDER_BYTES_MAX + 1]);
        let in_progress = RecordState::InProgress {
            since_ms: 1,
            lease_until_ms: 2,
            holder,
            token: 3,
        };
        assert!(ImportRecord::new("t", None, b"k", 1, fingerprint, in_progress).is_err());
        let record = ImportRecord::new("t", Some(b"c"), b"k", 1, fingerprint, state).unwrap();
        assert_eq!(record.stored_key, b"\x01ck");
    }
}
