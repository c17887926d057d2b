//! The marker tables' merge operator: the record state machine, applied by RocksDB.
//!
//! A lease step is written as a merge operand ("install this record if the key is absent or
//! still holds the record I found expired", "replace the in-progress record I hold"); a
//! transactional claim's commit writes its record as a value, which the latch makes safe
//! (docs/design.md, section 5). RocksDB orders all operands
//! of a key by sequence number and folds them over the base value with [`apply_operands`], so the
//! outcome of concurrent transitions is decided by one deterministic function over one total
//! order, whenever and wherever (read, flush, compaction) the fold runs. docs/design.md gives the
//! rules and the argument for why they compose with the claim latch and the compaction filter.

use crate::format::operand::Operand;
use crate::format::record::RecordHeader;

/// The name RocksDB persists in the OPTIONS file; changing it makes old stores refuse to open.
#[cfg(feature = "engine")]
pub(crate) const MERGE_OPERATOR_NAME: &str = "idemdb.record.v1";

/// Folds `operands` (oldest first) over `existing`, returning the new stored value.
///
/// Rules, for each operand in order:
/// - `Install { replaces_epoch, record }` installs `record` when the current value is absent or
///   is a record whose epoch equals `replaces_epoch`; otherwise the current value stands
///   (insert-if-absent: a record is never overwritten by an install that did not expect it).
/// - `Replace { epoch, token, record }` installs `record` only when the current value is an
///   in-progress record with that epoch and token (the fenced step of a lease: renew,
///   complete, fail, release); otherwise the current value stands.
/// - An operand that does not decode is skipped; a current value that does not decode is kept
///   as it is, so that reads of this one key report it as corrupt.
///
/// Never fails: a failed merge makes RocksDB stop compaction for the whole store, which is a
/// worse outcome than one key reading as corrupt. When there is nothing valid to store at all
/// (no existing value and no operand that decodes) the result is the empty value, which reads
/// as [`crate::Error::Corrupt`] for that key alone and which the compaction filter keeps.
pub fn apply_operands<'a>(
    existing: Option<&'a [u8]>,
    operands: impl IntoIterator<Item = &'a [u8]>,
) -> Vec<u8> {
    let mut current: Option<&[u8]> = existing;
    for operand in operands {
        let current_header = current.map(RecordHeader::decode);
        let installed = match Operand::decode(operand) {
            Ok(Operand::Install {
                replaces_epoch,
                record_bytes,
            }) => match current_header {
                None => Some(record_bytes),
                Some(Ok(header)) if header.epoch == replaces_epoch => Some(record_bytes),
                Some(_) => None,
            },
            Ok(Operand::Replace {
                epoch,
                token,
                record_bytes,
            }) => match current_header {
                Some(Ok(header)) if header.epoch == epoch && header.token == Some(token) => {
                    Some(record_bytes)
                }
                _ => None,
            },
            Err(_) => None,
        };
        if let Some(record_bytes) = installed {
            current = Some(record_bytes);
        }
    }
    current.map(<[u8]>::to_vec).unwrap_or_default()
}

/// The merge operator as RocksDB calls it.
#[cfg(feature = "engine")]
pub(crate) fn rocksdb_full_merge(
    _key: &[u8],
    existing: Option<&[u8]>,
    operands: &rocksdb::MergeOperands,
) -> Option<Vec<u8>> {
    Some(apply_operands(existing, operands))
}

/// Partial merges (operands without a base) are declined: a commit's effect depends on the base
/// value, so two operands cannot be combined without it. RocksDB then keeps the operands and
/// folds them when the base is known.
#[cfg(feature = "engine")]
pub(crate) fn rocksdb_partial_merge(
    _key: &[u8],
    _existing: Option<&[u8]>,
    _operands: &rocksdb::MergeOperands,
) -> Option<Vec<u8>> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::fingerprint::Fingerprint;
    use crate::format::record::{Record, RecordState};
    use bytes::Bytes;

    fn record(epoch: u64, result: &str) -> Record {
        Record::new(
            epoch,
            10,
            20,
            Fingerprint::of(result),
            Bytes::copy_from_slice(result.as_bytes()),
        )
    }

    fn commit(replaces: u64, result: &str) -> Vec<u8> {
        Operand::encode_install(replaces, &record(replaces + 1, result)).to_vec()
    }

    fn in_progress(epoch: u64, token: u64) -> Record {
        Record {
            epoch,
            fingerprint: Fingerprint::of(b""),
            state: RecordState::InProgress {
                since_ms: 1,
                lease_until_ms: 2,
                holder: Bytes::from_static(b"h"),
                token,
            },
        }
    }

    fn fold(existing: Option<Record>, operands: &[Vec<u8>]) -> Option<Record> {
        let existing = existing.map(|r| r.encode());
        let merged = apply_operands(existing.as_deref(), operands.iter().map(Vec::as_slice));
        (!merged.is_empty()).then(|| Record::decode(&merged).unwrap())
    }

    #[test]
    fn first_commit_over_absent_wins() {
        let merged = fold(None, &[commit(0, "a"), commit(0, "b")]).unwrap();
        assert_eq!(merged.result().unwrap(), "a");
        assert_eq!(merged.epoch, 1);
    }

    #[test]
    fn commit_replaces_only_the_record_it_saw() {
        let merged = fold(Some(record(4, "old")), &[commit(4, "new")]).unwrap();
        assert_eq!(merged.result().unwrap(), "new");
        let kept = fold(Some(record(4, "old")), &[commit(3, "stale")]).unwrap();
        assert_eq!(kept.result().unwrap(), "old");
    }

    #[test]
    fn replace_applies_only_to_the_matching_holder() {
        let lease = in_progress(3, 77);
        let done = record(3, "done");
        let by_holder = Operand::encode_replace(3, 77, &done).to_vec();
        let by_stale_epoch = Operand::encode_replace(2, 77, &record(2, "stale")).to_vec();
        let by_other_token = Operand::encode_replace(3, 78, &record(3, "other")).to_vec();
        let merged = fold(
            Some(lease.clone()),
            &[by_stale_epoch, by_other_token.clone()],
        )
        .unwrap();
        assert_eq!(merged, lease);
        let merged = fold(Some(lease), &[by_holder, by_other_token]).unwrap();
        assert_eq!(merged.result().unwrap(), "done");
        // Nothing to replace: a replace never creates a record.
        assert_eq!(
            fold(
                None,
                &[Operand::encode_replace(1, 1, &record(1, "x")).to_vec()]
            ),
            None
        );
    }

    #[test]
    fn corrupt_operands_are_skipped_and_corrupt_bases_kept() {
        let merged = fold(None, &[b"junk".to_vec(), commit(0, "a")]).unwrap();
        assert_eq!(merged.result().unwrap(), "a");
        let kept = apply_operands(Some(b"junk"), [commit(0, "a").as_slice()]);
        assert_eq!(kept, b"junk");
        assert!(apply_operands(None, [&b"junk"[..]]).is_empty());
    }
}
