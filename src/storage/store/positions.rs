//! Read positions in the store: their reads, and the check that none moves backwards, with
//! the acceptance a commit holds until its write is settled.

use std::sync::Arc;

use smallvec::SmallVec;

use super::Storage;
use crate::format::error::{Error, Result};
use crate::format::position::{decode_position_key, decode_position_value};

impl Storage {
    /// Reads a stored read position: (offset, updated_at_ms).
    pub(crate) fn read_position(&self, key: &[u8]) -> Result<Option<(u64, u64)>> {
        let Some(cf) = self.positions_cf() else {
            return Ok(None);
        };
        let Some(value) = self.db().get_pinned_cf(cf, key)? else {
            return Ok(None);
        };
        decode_position_value(&value)
            .map(Some)
            .map_err(|reason| Error::Corrupt {
                key: key.to_vec(),
                reason,
            })
    }

    /// Checks a commit's staged positions (position key, offset; one entry per key) against
    /// the highest offset stored, written by this open, or accepted for a commit still in
    /// flight, and accepts them all, or none: [`Error::PositionBehind`] for the first one
    /// behind. Checked and accepted under one lock, so of two commits racing for a partition
    /// the later offset wins and the other is refused whatever order they write in; the
    /// positions table's merge keeps the highest offset too, so the stored position never
    /// moves backwards even for writes this check did not see.
    ///
    /// The acceptance lasts until the commit is settled: [`AcceptedPositions::written`] makes
    /// its offsets the written ones; a commit that fails, or is dropped before its write, gives
    /// its offsets back, so a later commit behind them (the same work split smaller, say) is
    /// checked against what was written. After a failure that poisons the engine nothing more
    /// is written anyway.
    pub(crate) fn accept_positions(
        self: &Arc<Self>,
        staged: SmallVec<[(Vec<u8>, u64); 1]>,
    ) -> Result<AcceptedPositions> {
        let mut accepted = self.accepted_positions.lock();
        for (key, offset) in &staged {
            if !accepted.contains_key(key) {
                let written = self.read_position(key)?.map(|(offset, _)| offset);
                accepted.insert(
                    key.clone(),
                    AcceptedOffsets {
                        written,
                        in_flight: SmallVec::new(),
                    },
                );
            }
            let highest = accepted[key].highest();
            if let Some(highest) = highest.filter(|&highest| *offset < highest) {
                let (_, source, partition) =
                    decode_position_key(key).map_err(|reason| Error::Corrupt {
                        key: key.clone(),
                        reason,
                    })?;
                return Err(Error::PositionBehind {
                    source_name: source.to_owned(),
                    partition,
                    stored: highest,
                    staged: *offset,
                });
            }
        }
        for (key, offset) in &staged {
            if let Some(offsets) = accepted.get_mut(key) {
                offsets.in_flight.push(*offset);
            }
        }
        Ok(AcceptedPositions {
            storage: self.clone(),
            staged,
        })
    }

    /// Ends the acceptance of `staged`: each offset leaves the commits in flight and, if the
    /// commit was `written`, raises the written offset.
    fn settle_positions(&self, staged: &[(Vec<u8>, u64)], written: bool) {
        let mut accepted = self.accepted_positions.lock();
        for (key, offset) in staged {
            let Some(offsets) = accepted.get_mut(key) else {
                continue;
            };
            if let Some(at) = offsets.in_flight.iter().position(|o| o == offset) {
                offsets.in_flight.swap_remove(at);
            }
            if written {
                offsets.written = offsets.written.max(Some(*offset));
            }
        }
    }
}

/// What this open knows of one position key: the highest offset written (by this open, or
/// stored before it), and the offsets of the commits accepted and not yet settled.
pub(super) struct AcceptedOffsets {
    written: Option<u64>,
    in_flight: SmallVec<[u64; 2]>,
}

impl AcceptedOffsets {
    /// The highest offset a new commit of the key must not be behind.
    fn highest(&self) -> Option<u64> {
        self.written.max(self.in_flight.iter().copied().max())
    }
}

/// The read positions of one commit, accepted by [`Storage::accept_positions`] and held until
/// the commit's write is settled: [`AcceptedPositions::written`] once it is written; dropped
/// without it (the write failed, or an error came before it), the offsets are given back.
#[must_use = "dropping the acceptance gives the offsets back"]
pub(crate) struct AcceptedPositions {
    storage: Arc<Storage>,
    staged: SmallVec<[(Vec<u8>, u64); 1]>,
}

impl AcceptedPositions {
    /// The accepted (position key, offset) pairs.
    pub(crate) fn offsets(&self) -> &[(Vec<u8>, u64)] {
        &self.staged
    }

    /// The commit was written: its offsets are the written ones.
    pub(crate) fn written(mut self) {
        let staged = std::mem::take(&mut self.staged);
        self.storage.settle_positions(&staged, true);
    }

    /// Settles by the write's outcome: [`AcceptedPositions::written`] if it succeeded, given
    /// back if it failed (the async commits, which hear of it in the committer's thread).
    pub(crate) fn settle(self, outcome: &Result<()>) {
        if outcome.is_ok() {
            self.written();
        }
    }
}

impl Drop for AcceptedPositions {
    fn drop(&mut self) {
        if !self.staged.is_empty() {
            self.storage.settle_positions(&self.staged, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::format::position::encode_position_key;
    use crate::storage::options::EngineBuilder;
    use crate::storage::store_lock::StoreLock;
    use crate::storage::store_meta::StoredMeta;

    fn open(dir: &Path) -> Arc<Storage> {
        let builder = EngineBuilder::new(dir);
        let lock = StoreLock::acquire(dir).unwrap();
        let stored = StoredMeta::read(dir).unwrap();
        Arc::new(Storage::open(&builder, lock, stored).unwrap())
    }

    fn staged(key: &[u8], offset: u64) -> SmallVec<[(Vec<u8>, u64); 1]> {
        smallvec::smallvec![(key.to_vec(), offset)]
    }

    fn behind(storage: &Arc<Storage>, key: &[u8], offset: u64) -> Option<u64> {
        match storage.accept_positions(staged(key, offset)) {
            Err(Error::PositionBehind { stored, .. }) => Some(stored),
            Ok(_) => None,
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_acceptance_given_back_leaves_the_highest_written_or_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let storage = open(dir.path());
        let key = encode_position_key(b"\x01c", "s", 0).unwrap();
        storage
            .accept_positions(staged(&key, 10))
            .unwrap()
            .written();
        // Two commits in flight, 20 then 30.
        let twenty = storage.accept_positions(staged(&key, 20)).unwrap();
        let thirty = storage.accept_positions(staged(&key, 30)).unwrap();
        assert_eq!(behind(&storage, &key, 25), Some(30));
        // The higher one fails: the lower one, still in flight, is the bar.
        drop(thirty);
        assert_eq!(behind(&storage, &key, 15), Some(20));
        // It fails too: back to what was written.
        twenty.settle(&Err(Error::Poisoned));
        assert_eq!(behind(&storage, &key, 9), Some(10));
        // Accepted at 15 (not behind 10), and it is written.
        storage
            .accept_positions(staged(&key, 15))
            .unwrap()
            .written();
        assert_eq!(behind(&storage, &key, 14), Some(15));
        // A lower commit written after a higher one does not lower the bar.
        let forty = storage.accept_positions(staged(&key, 40)).unwrap();
        let refused = storage.accept_positions(staged(&key, 39));
        assert!(refused.is_err());
        forty.settle(&Ok(()));
        assert_eq!(behind(&storage, &key, 39), Some(40));
        // Two commits at the same offset: settling one leaves the other in flight.
        let first = storage.accept_positions(staged(&key, 50)).unwrap();
        let second = storage.accept_positions(staged(&key, 50)).unwrap();
        drop(first);
        assert_eq!(behind(&storage, &key, 45), Some(50));
        drop(second);
        assert_eq!(behind(&storage, &key, 45), None);
    }
}
