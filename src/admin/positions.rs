//! Log consumers' read positions as an operator sees them: listed from any open, set or
//! removed (a reset, to replay from an offset) or imported (from another store's export) only
//! under an exclusive open, so never while a consumer has the store open.

use std::collections::HashSet;

use rocksdb::WriteBatch;

use crate::format::error::{Error, Result};
use crate::format::key::consumer_prefix;
use crate::format::position::{
    POSITIONS_TABLE, Position, encode_position_key, encode_position_value,
};
use crate::format::printable::printable;
use crate::operations::position::scan_positions;
use crate::storage::store::Storage;

use super::open::Store;

/// One stored read position with the consumer it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PositionEntry {
    /// The consumer id.
    pub consumer: Vec<u8>,
    /// Its position in one partition of one source.
    pub position: Position,
}

/// A read position to write with [`Store::import_positions`], checked when built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportPosition {
    consumer: Vec<u8>,
    stored_key: Vec<u8>,
    position: Position,
}

impl ImportPosition {
    /// `consumer`'s `position`, to be written with its offset and time as they are.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a consumer id or source outside its limits;
    /// [`Error::InvalidArgument`] for a source containing NUL.
    pub fn new(consumer: &[u8], position: Position) -> Result<ImportPosition> {
        let stored_key = encode_position_key(
            &consumer_prefix(consumer)?,
            &position.source,
            position.partition,
        )?;
        Ok(ImportPosition {
            consumer: consumer.to_vec(),
            stored_key,
            position,
        })
    }
}

/// What [`Store::import_positions`] did, one count per position given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PositionImportCounts {
    /// Positions written where the store held none.
    pub imported: u64,
    /// Positions written over a stored one behind them (without `overwrite`).
    pub advanced: u64,
    /// Positions written over a stored one whatever its offset (only with `overwrite`).
    pub overwritten: u64,
    /// Positions not written because the stored one is at or ahead of them (without
    /// `overwrite`).
    pub skipped: u64,
}

impl Store {
    /// Every stored read position, ordered by consumer id, source (byte order) and partition;
    /// only `consumer`'s when given. A store written before positions existed has none.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a bad consumer id; [`Error::Corrupt`] for a stored key or
    /// value that does not decode; [`Error::Storage`] if the read fails.
    pub fn positions(&self, consumer: Option<&[u8]>) -> Result<Vec<PositionEntry>> {
        let prefix = consumer
            .map(consumer_prefix)
            .transpose()?
            .unwrap_or_default();
        let Some(cf) = self.db().cf_handle(POSITIONS_TABLE) else {
            return Ok(Vec::new());
        };
        Ok(scan_positions(self.db(), cf, &prefix)?
            .into_iter()
            .map(|(consumer, position)| PositionEntry { consumer, position })
            .collect())
    }

    /// Sets `consumer`'s position in `partition` of `source` to `offset`, forwards or
    /// backwards: the consumer resumes at `offset + 1` when it next starts (to replay from
    /// offset `n`, set `n - 1`; to replay from the start, [`Store::remove_position`]). Returns
    /// the position it replaced. Fsynced before it returns.
    ///
    /// # Errors
    /// [`Error::ReadOnly`] on a read-only open: a consumer may have the store open, and a
    /// position it holds in memory would undo the reset; [`Error::LimitExceeded`] for a bad
    /// consumer id or source; [`Error::InvalidArgument`] for a source containing NUL, or for a
    /// store with no positions table (written before positions existed: open it once with the
    /// application);
    /// [`Error::Storage`] if the write fails.
    pub fn set_position(
        &self,
        consumer: &[u8],
        source: &str,
        partition: u32,
        offset: u64,
    ) -> Result<Option<Position>> {
        self.write_position(consumer, source, partition, Some(offset))
    }

    /// Removes `consumer`'s position in `partition` of `source`: it next starts at the
    /// beginning of the partition (or wherever it starts without a position). Returns the
    /// position removed.
    ///
    /// # Errors
    /// As for [`Store::set_position`].
    pub fn remove_position(
        &self,
        consumer: &[u8],
        source: &str,
        partition: u32,
    ) -> Result<Option<Position>> {
        self.write_position(consumer, source, partition, None)
    }

    fn write_position(
        &self,
        consumer: &[u8],
        source: &str,
        partition: u32,
        offset: Option<u64>,
    ) -> Result<Option<Position>> {
        let engine = self.engine()?;
        let key = encode_position_key(&consumer_prefix(consumer)?, source, partition)?;
        let storage = engine.storage();
        let cf = positions_table(storage)?;
        let previous = storage
            .read_position(&key)?
            .map(|(offset, updated_at_ms)| Position::new(source, partition, offset, updated_at_ms));
        let mut batch = WriteBatch::default();
        match offset {
            // A value, not a merge operand: it replaces whatever the position held.
            Some(offset) => batch.put_cf(cf, &key, encode_position_value(offset, self.now_ms())),
            None => batch.delete_cf(cf, &key),
        }
        storage.write(batch)?;
        Ok(previous)
    }

    /// What [`Store::import_positions`] checks before it writes anything: run it before
    /// [`Store::import`] writes the records, so that a refused position leaves the store as it
    /// was.
    ///
    /// # Errors
    /// As the refusals of [`Store::import_positions`] made before anything is written:
    /// [`Error::ReadOnly`]; [`Error::InvalidArgument`] for a position given twice, or for
    /// positions given to a store with no positions table.
    pub fn check_import_positions(&self, positions: &[ImportPosition]) -> Result<()> {
        let engine = self.engine()?;
        if positions.is_empty() {
            return Ok(());
        }
        positions_table(engine.storage())?;
        let mut seen = HashSet::with_capacity(positions.len());
        for given in positions {
            if !seen.insert(given.stored_key.as_slice()) {
                return Err(Error::invalid_argument(format!(
                    "the position of consumer {} in partition {} of {:?} is given twice",
                    printable(&given.consumer),
                    given.position.partition,
                    given.position.source
                )));
            }
        }
        Ok(())
    }

    /// Writes `positions` (an export's, typically) into the store, each with its offset and
    /// time as given. As the positions API moves a position, an import moves it forward only:
    /// where the store holds none, or one behind, the imported one is written; where it holds
    /// one at or ahead of it, that one stays (counted as skipped), since this store's consumer
    /// has read further. With `overwrite`, every position is written whatever the stored one
    /// (an operator's reset, as [`Store::set_position`]). Import the records first
    /// ([`Store::import`], after [`Store::check_import_positions`]): a consumer resuming from
    /// an imported position then finds the records of every message before it. Written in one batch, fsynced before it returns.
    ///
    /// ```
    /// use idemdb::admin::{ImportPosition, Store};
    /// use idemdb::{Engine, Position};
    ///
    /// let dir = tempfile::tempdir()?;
    /// let engine = Engine::builder(dir.path()).open()?;
    /// engine.consumer("billing")?.positions().advance("orders", 0, 41)?;
    /// drop(engine);
    ///
    /// // Another store's export, read back: partition 0 behind this store's, 1 new here.
    /// let exported = [
    ///     ImportPosition::new(b"billing", Position::new("orders", 0, 40, 1_000))?,
    ///     ImportPosition::new(b"billing", Position::new("orders", 1, 7, 1_000))?,
    /// ];
    /// let store = Store::builder(dir.path()).open_exclusive()?;
    /// let counts = store.import_positions(&exported, false)?;
    /// assert_eq!((counts.imported, counts.skipped), (1, 1));
    /// let offsets: Vec<u64> = store
    ///     .positions(Some(b"billing"))?
    ///     .iter()
    ///     .map(|entry| entry.position.offset)
    ///     .collect();
    /// assert_eq!(offsets, [41, 7], "partition 0 stays ahead; partition 1 imported");
    /// // With overwrite, backwards too.
    /// assert_eq!(store.import_positions(&exported, true)?.overwritten, 2);
    /// assert_eq!(store.positions(Some(b"billing"))?[0].position.offset, 40);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// Checked before anything is written ([`Store::check_import_positions`]):
    /// [`Error::InvalidArgument`] for a position given twice (consumer, source and
    /// partition), or for positions given to a store with no positions table (written before
    /// positions existed: open it once with the application); [`Error::ReadOnly`] on a
    /// read-only open. [`Error::Corrupt`] for a stored position that
    /// does not decode (without `overwrite`; with it, it is replaced); [`Error::Storage`] if a
    /// read or the write fails.
    pub fn import_positions(
        &self,
        positions: &[ImportPosition],
        overwrite: bool,
    ) -> Result<PositionImportCounts> {
        self.check_import_positions(positions)?;
        let mut counts = PositionImportCounts::default();
        if positions.is_empty() {
            return Ok(counts);
        }
        let engine = self.engine()?;
        let storage = engine.storage();
        let cf = positions_table(storage)?;
        let mut batch = WriteBatch::default();
        for given in positions {
            let stored = match storage.read_position(&given.stored_key) {
                Ok(stored) => stored.map(|(offset, _)| Some(offset)),
                // A value that does not decode: only an overwrite replaces it.
                Err(Error::Corrupt { .. }) if overwrite => Some(None),
                Err(error) => return Err(error),
            };
            let counter = match stored {
                None => &mut counts.imported,
                Some(_) if overwrite => &mut counts.overwritten,
                Some(Some(offset)) if offset < given.position.offset => &mut counts.advanced,
                Some(_) => {
                    counts.skipped += 1;
                    continue;
                }
            };
            *counter += 1;
            // A value, not a merge operand: it carries the exported time, and under the
            // exclusive open nothing else writes the position meanwhile.
            batch.put_cf(
                cf,
                &given.stored_key,
                encode_position_value(given.position.offset, given.position.updated_at_ms),
            );
        }
        if !batch.is_empty() {
            storage.write(batch)?;
        }
        Ok(counts)
    }
}

/// The positions table, which a store written before positions existed lacks.
fn positions_table(storage: &Storage) -> Result<&rocksdb::ColumnFamily> {
    storage.positions_cf().ok_or_else(|| {
        Error::invalid_argument(
            "the store has no positions table (written before positions existed); open it once \
             with the application first",
        )
    })
}
