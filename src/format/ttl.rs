//! Retention: the compaction filter that physically removes expired records.
//!
//! Expiry itself is exact and happens at read time (`Record::is_absent_at`); this filter only
//! reclaims space. It therefore keeps anything it is not sure about.

use crate::format::record::RecordHeader;

/// The name RocksDB persists in the OPTIONS file for the marker tables' compaction filter.
#[cfg(feature = "engine")]
pub(crate) const COMPACTION_FILTER_NAME: &std::ffi::CStr = c"idemdb.ttl.v1";

/// What the compaction filter does with one stored value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterDecision {
    /// Keep the value.
    Keep,
    /// Remove the value: it is a record that has expired by `now_ms`.
    Remove,
}

/// Decides the fate of one stored value at `now_ms`.
///
/// Removes exactly the values that decode as a completed record expired at `now_ms` or a
/// released record past its removal time: records every read already treats as absent. Keeps
/// everything else: in-progress records whatever their lease (they are reconciled, never
/// silently dropped), and values that do not decode (evidence of corruption).
///
/// ```
/// use idemdb::format::{compaction_decision, FilterDecision};
/// assert_eq!(compaction_decision(b"not a record", 0), FilterDecision::Keep);
/// ```
#[must_use]
pub fn compaction_decision(value: &[u8], now_ms: u64) -> FilterDecision {
    match RecordHeader::decode(value) {
        Ok(header) if header.is_removable_at(now_ms) => FilterDecision::Remove,
        _ => FilterDecision::Keep,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::fingerprint::Fingerprint;
    use crate::format::record::{EXPIRES_NEVER_MS, Record};
    use bytes::Bytes;

    fn encoded(expires_at_ms: u64) -> Vec<u8> {
        Record::new(1, 0, expires_at_ms, Fingerprint::of(b""), Bytes::new()).encode()
    }

    #[test]
    fn removes_from_the_expiry_instant_on() {
        assert_eq!(compaction_decision(&encoded(100), 99), FilterDecision::Keep);
        assert_eq!(
            compaction_decision(&encoded(100), 100),
            FilterDecision::Remove
        );
        assert_eq!(
            compaction_decision(&encoded(100), 101),
            FilterDecision::Remove
        );
    }

    #[test]
    fn keeps_never_expiring_and_undecodable_values() {
        let never = encoded(EXPIRES_NEVER_MS);
        assert_eq!(compaction_decision(&never, u64::MAX), FilterDecision::Keep);
        assert_eq!(compaction_decision(b"", u64::MAX), FilterDecision::Keep);
        // An expired header with a wrong length is corrupt, not expired: kept as evidence.
        let mut trailing = encoded(100);
        trailing.push(0);
        assert_eq!(compaction_decision(&trailing, 200), FilterDecision::Keep);
        let truncated = encoded(100);
        let truncated = &truncated[..truncated.len() - 1];
        assert_eq!(compaction_decision(truncated, 200), FilterDecision::Keep);
    }
}
