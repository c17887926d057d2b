//! Staging: the business writes a claim collects (puts, deletes, merges into business
//! tables) until its commit puts them into the write batch with the marker, their limits, and
//! the staging methods both claim types share. A claim committed alone writes them straight
//! into the write batch its commit will write ([`Staged::direct`]); the others keep them as
//! data until the commit that takes many claims' writes into one batch.

use std::sync::Arc;

use rocksdb::WriteBatch;
use sync_wrapper::SyncWrapper;

use crate::format::error::{Error, Limit, Result, check_limit};
use crate::storage::business_table::BusinessTable;
use crate::storage::store::Storage;

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

/// The business-write methods of everything that stages writes (`Claim`, `ExternalClaim`,
/// `ClaimBatch` for the batch as a whole): put, delete and merge into business tables, kept
/// until the commit. Each type holds the same `inner` and `staged` fields; `$applied` says
/// when staged writes land.
macro_rules! business_write_methods {
    ($applied:literal) => {
        #[doc = concat!("Stages `value` under `key` in `table`; applied only ", $applied, ".")]
        ///
        /// # Errors
        /// [`crate::Error::LimitExceeded`] for a key or value outside its limits or a claim past
        /// [`crate::STAGED_WRITES_MAX`] / [`crate::STAGED_BYTES_MAX`]; [`crate::Error::ForeignTable`]
        /// for another engine's table. Nothing is staged on error.
        pub fn put(
            &mut self,
            table: &BusinessTable,
            key: impl AsRef<[u8]>,
            value: impl AsRef<[u8]>,
        ) -> Result<()> {
            self.staged
                .put(&self.inner, table, key.as_ref(), value.as_ref())
        }

        #[doc = concat!("Stages a deletion of `key` in `table`; applied only ", $applied, ".")]
        ///
        /// # Errors
        /// As for `put`.
        pub fn delete(&mut self, table: &BusinessTable, key: impl AsRef<[u8]>) -> Result<()> {
            self.staged.delete(&self.inner, table, key.as_ref())
        }

        #[doc = concat!(
            "Stages a merge of `operand` into `key` of `table` (which needs a merge operator); ",
            "applied only ", $applied, "."
        )]
        ///
        /// # Errors
        /// As for `put`, and [`crate::Error::NoMergeOperator`] if the table has none.
        pub fn merge(
            &mut self,
            table: &BusinessTable,
            key: impl AsRef<[u8]>,
            operand: impl AsRef<[u8]>,
        ) -> Result<()> {
            self.staged
                .merge(&self.inner, table, key.as_ref(), operand.as_ref())
        }

    };
}
pub(crate) use business_write_methods;

/// The staging methods of every claim type (`Claim`, `ExternalClaim`): the business writes
/// and the record's expiry. Both types hold the same `inner`, `staged` and `expiry` fields.
macro_rules! staging_methods {
    ($applied:literal) => {
        crate::operations::staging::business_write_methods!($applied);

        /// Sets how long the committed record is kept, instead of the table's default (the
        /// engine's retention for consumers, [`crate::Expiry::Never`] for entity tables).
        ///
        /// # Errors
        /// [`crate::Error::LimitExceeded`] for a duration outside
        /// [`crate::RETENTION_MS_MIN`]..=[`crate::RETENTION_MS_MAX`] ms.
        pub fn set_expiry(&mut self, expiry: Expiry) -> Result<()> {
            check_expiry(expiry)?;
            self.expiry = expiry;
            Ok(())
        }
    };
}
pub(crate) use staging_methods;

/// One staged business write, kept as data until a commit builds the write batch (so that a
/// batch commit can put many claims' writes into one `WriteBatch`). The key and the value (or
/// merge operand) share one allocation: staging is on every message's path.
struct StagedOp {
    kind: StagedKind,
    table: usize,
    key_len: usize,
    /// The key, then the value or operand (nothing for a delete).
    bytes: Box<[u8]>,
}

#[derive(Clone, Copy)]
enum StagedKind {
    Put,
    Delete,
    Merge,
}

impl StagedKind {
    /// Appends a write of this kind to `batch` (a delete ignores `value`).
    fn append(self, batch: &mut WriteBatch, cf: &rocksdb::ColumnFamily, key: &[u8], value: &[u8]) {
        match self {
            StagedKind::Put => batch.put_cf(cf, key, value),
            StagedKind::Delete => batch.delete_cf(cf, key),
            StagedKind::Merge => batch.merge_cf(cf, key, value),
        }
    }
}

impl StagedOp {
    fn new(kind: StagedKind, table: usize, key: &[u8], value: &[u8]) -> StagedOp {
        let mut bytes = Vec::with_capacity(key.len() + value.len());
        bytes.extend_from_slice(key);
        bytes.extend_from_slice(value);
        StagedOp {
            kind,
            table,
            key_len: key.len(),
            bytes: bytes.into_boxed_slice(),
        }
    }
}

/// What a write batch adds to each entry besides its key and value, at most: the entry's tag,
/// its column family's id and the two lengths, each a varint of up to 5 bytes.
pub(crate) const BATCH_ENTRY_OVERHEAD_BYTES: usize = 16;

/// An empty write batch with room for `bytes` of entries. Reserved up front, its buffer is
/// allocated once: grown by doubling from empty, a claim's commit reallocated it three or four
/// times.
pub(crate) fn batch_for(bytes: usize) -> WriteBatch {
    WriteBatch::with_capacity_bytes(crate::storage::log::wal_file::BATCH_HEADER_BYTES + bytes)
}

/// Business writes staged on a claim, and their size against the limits.
#[derive(Default)]
pub(crate) struct Staged {
    /// The common claim stages one write: kept inline, the list costs no allocation.
    ops: smallvec::SmallVec<[StagedOp; 1]>,
    /// With [`Staged::direct`], the writes go here instead, the batch made at the first one.
    /// (A write batch is reached only through `&mut`: the wrapper keeps the claim `Sync`,
    /// which RocksDB's batch alone is not.)
    batch: Option<SyncWrapper<WriteBatch>>,
    /// Whether writes go straight into `batch`, and the room for the commit's own entries
    /// its first write reserves beside its own.
    direct: Option<usize>,
    writes: usize,
    pub(crate) bytes: usize,
}

impl Staged {
    /// Writes staged straight into the write batch the claim's commit will take
    /// ([`Staged::take_batch`]), reserved at the first with `commit_bytes` more for the
    /// commit's own entries: a claim committed alone then copies each write once (kept as data
    /// and copied into the batch at the commit, each cost an allocation and 360 instructions
    /// more).
    pub(crate) fn direct(commit_bytes: usize) -> Staged {
        Staged {
            direct: Some(commit_bytes),
            ..Staged::default()
        }
    }

    pub(crate) fn writes(&self) -> usize {
        self.writes
    }

    /// The write batch holding the writes staged directly, if any was made: the commit appends
    /// its entries to it and writes it.
    pub(crate) fn take_batch(&mut self) -> Option<WriteBatch> {
        self.batch.take().map(SyncWrapper::into_inner)
    }

    /// Stages one write: into the batch when direct (made at the first write), else as data.
    fn stage(&mut self, inner: &Storage, kind: StagedKind, table: usize, key: &[u8], value: &[u8]) {
        self.writes += 1;
        let Some(room) = self.direct else {
            self.ops.push(StagedOp::new(kind, table, key, value));
            return;
        };
        let batch = self
            .batch
            .get_or_insert_with(|| {
                SyncWrapper::new(batch_for(
                    room + BATCH_ENTRY_OVERHEAD_BYTES + key.len() + value.len(),
                ))
            })
            .get_mut();
        kind.append(batch, inner.business_cf(table), key, value);
    }

    pub(crate) fn put(
        &mut self,
        inner: &Arc<Storage>,
        table: &BusinessTable,
        key: &[u8],
        value: &[u8],
    ) -> Result<()> {
        self.check_write(inner, table, key, value.len())?;
        self.stage(inner, StagedKind::Put, table.index, key, value);
        Ok(())
    }

    pub(crate) fn delete(
        &mut self,
        inner: &Arc<Storage>,
        table: &BusinessTable,
        key: &[u8],
    ) -> Result<()> {
        self.check_write(inner, table, key, 0)?;
        self.stage(inner, StagedKind::Delete, table.index, key, &[]);
        Ok(())
    }

    pub(crate) fn merge(
        &mut self,
        inner: &Arc<Storage>,
        table: &BusinessTable,
        key: &[u8],
        operand: &[u8],
    ) -> Result<()> {
        if !table.has_merge_operator {
            return Err(Error::NoMergeOperator {
                name: table.name.clone(),
            });
        }
        self.check_write(inner, table, key, operand.len())?;
        self.stage(inner, StagedKind::Merge, table.index, key, operand);
        Ok(())
    }

    /// Appends every write staged as data to `batch`, leaving nothing staged (writes staged
    /// directly are in the batch [`Staged::take_batch`] gave already).
    pub(crate) fn drain_into(&mut self, inner: &Storage, batch: &mut WriteBatch) {
        for op in self.ops.drain(..) {
            let (key, value) = op.bytes.split_at(op.key_len);
            op.kind
                .append(batch, inner.business_cf(op.table), key, value);
        }
        self.bytes = 0;
        self.writes = 0;
    }

    /// Checks a result against its limit and the staged total; nothing is written on error.
    pub(crate) fn check_result(&self, result: &[u8]) -> Result<()> {
        crate::format::record::check_result(result)?;
        check_limit(
            Limit::StagedBytes,
            self.bytes + result.len(),
            0,
            STAGED_BYTES_MAX,
        )
    }

    fn check_write(
        &mut self,
        inner: &Arc<Storage>,
        table: &BusinessTable,
        key: &[u8],
        value_len: usize,
    ) -> Result<()> {
        if !Arc::ptr_eq(&table.inner, inner) {
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
        check_limit(Limit::StagedWrites, self.writes + 1, 0, STAGED_WRITES_MAX)?;
        let bytes = self.bytes + key.len() + value_len;
        check_limit(Limit::StagedBytes, bytes, 0, STAGED_BYTES_MAX)?;
        self.bytes = bytes;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default commit log takes any single claim's commit (a claim at its limits must not
    /// be refused for the log's size where RocksDB's WAL would take it).
    #[test]
    fn the_default_log_takes_the_largest_claim() {
        // Staged bytes count the result too; each write adds at most 32 bytes of batch encoding
        // (its tag, table and lengths); 1 MiB for the marker and the headers.
        let largest = STAGED_BYTES_MAX + STAGED_WRITES_MAX * 32 + (1 << 20);
        assert!(
            largest as u64 <= crate::storage::options::LARGEST_CLAIM_COMMIT_BYTES,
            "{largest}"
        );
    }
}
