//! Log consumers' read positions as an operator sees them: listed from any open, set or
//! removed (a reset, to replay from an offset) only under an exclusive open, so never while a
//! consumer has the store open.

use rocksdb::WriteBatch;

use crate::format::error::{Error, Result};
use crate::format::key::consumer_prefix;
use crate::format::position::{
    POSITIONS_TABLE, Position, encode_position_key, encode_position_value,
};
use crate::operations::position::scan_positions;

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
        let cf = storage.positions_cf().ok_or_else(|| {
            Error::invalid_argument(
                "the store has no positions table (written before positions existed); open it \
                 once with the application first",
            )
        })?;
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
}
