//! Read positions of log consumers: staged on a claim or a batch and written in its write
//! batch (with the marker and the business writes, or not at all), moved on their own for
//! messages skipped without a claim, and read back to resume. The format and its merge are in
//! `format/position.rs`; the check that a position never moves backwards is
//! `Storage::accept_positions`.

use std::sync::Arc;

use rocksdb::WriteBatch;

use crate::format::error::{Error, Result};
use crate::format::key::decode_key;
use crate::format::position::{
    Position, decode_position_key, decode_position_value, encode_position_key,
    encode_position_value,
};
use crate::storage::store::{AcceptedPositions, Storage};

/// The positions a commit will write: (position key, offset), one entry per key, the highest
/// offset staged for it. Almost every commit stages one position, or none.
#[derive(Default, Debug)]
pub(crate) struct StagedPositions {
    entries: smallvec::SmallVec<[(Vec<u8>, u64); 1]>,
}

impl StagedPositions {
    /// Stages `offset` for `key`, keeping the highest offset staged for the key.
    pub(crate) fn stage(&mut self, key: Vec<u8>, offset: u64) {
        match self.entries.iter_mut().find(|(staged, _)| *staged == key) {
            Some((_, highest)) => *highest = (*highest).max(offset),
            None => self.entries.push((key, offset)),
        }
    }

    /// Moves every position of `other` into this one (the highest offset per key).
    pub(crate) fn absorb(&mut self, other: &mut StagedPositions) {
        for (key, offset) in other.entries.drain(..) {
            self.stage(key, offset);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// At most the bytes these positions add to a write batch.
    pub(crate) fn batch_bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|(key, _)| 16 + key.len() + crate::format::position::POSITION_VALUE_BYTES)
            .sum()
    }

    /// Checks every position against the stored and accepted ones and, if none is behind,
    /// appends them to `batch` as merge operands stamped `now_ms`. Nothing is appended on
    /// error ([`Error::PositionBehind`]). The acceptance returned is held until the commit's
    /// write is settled: dropped without [`AcceptedPositions::written`], it gives the offsets
    /// back.
    pub(crate) fn append_to(
        self,
        inner: &Arc<Storage>,
        batch: &mut WriteBatch,
        now_ms: u64,
    ) -> Result<Option<AcceptedPositions>> {
        if self.entries.is_empty() {
            return Ok(None);
        }
        let cf = inner
            .positions_cf()
            .ok_or_else(|| Error::invalid_argument("the store has no positions table"))?;
        let accepted = inner.accept_positions(self.entries)?;
        for (key, offset) in accepted.offsets() {
            batch.merge_cf(cf, key, encode_position_value(*offset, now_ms));
        }
        Ok(Some(accepted))
    }
}

/// The records prefix of the consumer a stored key belongs to.
pub(crate) fn consumer_prefix_of(stored_key: &[u8]) -> Result<&[u8]> {
    let (consumer, _) = decode_key(stored_key).map_err(|reason| Error::Corrupt {
        key: stored_key.to_vec(),
        reason,
    })?;
    Ok(&stored_key[..1 + consumer.len()])
}

/// One consumer's read positions: where it resumes each partition of each log it reads
/// ([`crate::Consumer::positions`]).
///
/// A position is the offset of the last message whose effects are committed. It is written
/// by [`crate::Claim::stage_position`] and [`crate::ClaimBatch::stage_position`] in the same
/// write batch as the claims, so that the effects and the position are stored together or not
/// at all, and by [`Positions::advance`] for messages that need no claim.
#[derive(Clone)]
pub struct Positions {
    inner: Arc<Storage>,
    prefix: Vec<u8>,
}

impl Positions {
    pub(crate) fn new(inner: Arc<Storage>, prefix: Vec<u8>) -> Positions {
        Positions { inner, prefix }
    }

    /// The stored position of `partition` of `source`, or `None` if nothing was committed
    /// there: resume at [`Position::next_offset`], or at the start of the log.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a source outside
    /// [`crate::POSITION_SOURCE_BYTES_MIN`]..=[`crate::POSITION_SOURCE_BYTES_MAX`] bytes;
    /// [`Error::InvalidArgument`] for one containing NUL; [`Error::Corrupt`] if the stored
    /// value does not decode; [`Error::Storage`] if the read fails.
    pub fn get(&self, source: &str, partition: u32) -> Result<Option<Position>> {
        let key = encode_position_key(&self.prefix, source, partition)?;
        Ok(self
            .inner
            .read_position(&key)?
            .map(|(offset, updated_at_ms)| Position {
                source: source.to_owned(),
                partition,
                offset,
                updated_at_ms,
            }))
    }

    /// Moves the position of `partition` of `source` to `offset` on its own, with the engine's
    /// durability: for messages that are read and settled without a commit of their own
    /// (filtered out, a duplicate, `Stale`, `TooLate`). An offset equal to the stored one is
    /// accepted and changes nothing but the time.
    ///
    /// # Errors
    /// [`Error::PositionBehind`] if `offset` is behind the stored position, or behind one a
    /// commit of this engine has accepted and is still writing (nothing is written); otherwise
    /// as for [`Positions::get`] and [`crate::Claim::commit`].
    pub fn advance(&self, source: &str, partition: u32, offset: u64) -> Result<()> {
        let mut staged = StagedPositions::default();
        staged.stage(
            encode_position_key(&self.prefix, source, partition)?,
            offset,
        );
        let mut batch = WriteBatch::default();
        let now_ms = self.inner.write_clock_ms()?;
        let accepted = staged.append_to(&self.inner, &mut batch, now_ms)?;
        self.inner.write(batch)?;
        if let Some(accepted) = accepted {
            accepted.written();
        }
        Ok(())
    }

    /// Every stored position of this consumer, ordered by source (byte order of the name)
    /// and partition.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a stored key or value that does not decode; [`Error::Storage`]
    /// if the read fails.
    pub fn list(&self) -> Result<Vec<Position>> {
        let Some(cf) = self.inner.positions_cf() else {
            return Ok(Vec::new());
        };
        Ok(scan_positions(self.inner.db(), cf, &self.prefix)?
            .into_iter()
            .map(|(_, position)| position)
            .collect())
    }
}

/// Every position whose key starts with `prefix` (a consumer's records prefix, or nothing for
/// every consumer's), with its consumer id, ordered by consumer id, source (byte order) and
/// partition: the keys sort shorter ids and sources first (their length bytes), and listings
/// are by name.
pub(crate) fn scan_positions(
    db: &rocksdb::DB,
    cf: &rocksdb::ColumnFamily,
    prefix: &[u8],
) -> Result<Vec<(Vec<u8>, Position)>> {
    let mode = rocksdb::IteratorMode::From(prefix, rocksdb::Direction::Forward);
    let mut positions = Vec::new();
    for entry in db.iterator_cf(cf, mode) {
        let (key, value) = entry?;
        if !key.starts_with(prefix) {
            break;
        }
        let corrupt = |reason| Error::Corrupt {
            key: key.to_vec(),
            reason,
        };
        let (consumer, source, partition) = decode_position_key(&key).map_err(corrupt)?;
        let (offset, updated_at_ms) = decode_position_value(&value).map_err(corrupt)?;
        positions.push((
            consumer.to_vec(),
            Position::new(source, partition, offset, updated_at_ms),
        ));
    }
    positions
        .sort_by(|(a, x), (b, y)| (a, &x.source, x.partition).cmp(&(b, &y.source, y.partition)));
    Ok(positions)
}

impl std::fmt::Debug for Positions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Positions")
            .field(
                "consumer",
                &crate::format::printable::printable(&self.prefix[1..]),
            )
            .finish_non_exhaustive()
    }
}
