//! Read positions of log consumers: where a consumer of a log (a Kafka topic partition, a
//! RabbitMQ stream) resumes, stored beside its records and written in the same batch as the
//! claims whose messages it has read.
//!
//! Key: `[consumer_len: u8][consumer id][source_len: u8][source][partition: u32 BE]`: the
//! consumer's records prefix, then the source with its own length byte, so that two different
//! (consumer, source, partition) triples never encode to the same bytes, and one consumer's
//! positions sort together by source and partition.
//!
//! Value: `[version = 1][offset: u64 BE][updated_at_ms: u64 BE]`. Writes are merge operands of
//! the same layout, folded by [`fold_positions`]: the highest offset wins, so a position never
//! moves backwards whatever order concurrent writes land in. Only an operator's reset
//! ([`crate::admin::Store::set_position`]) overwrites one, with a plain value.

use crate::format::error::{DecodeError, Limit, Result, check_limit};

/// The column family holding every consumer's read positions.
#[cfg(feature = "engine")]
pub(crate) const POSITIONS_TABLE: &str = "idemdb.positions";

/// The positions table's merge operator, as RocksDB records it in the OPTIONS file.
#[cfg(feature = "engine")]
pub(crate) const POSITION_MERGE_OPERATOR_NAME: &str = "idemdb.position-max.v1";

/// The shortest source name (a topic, a stream), in bytes.
pub const POSITION_SOURCE_BYTES_MIN: usize = 1;
/// The longest source name, in bytes: it is stored behind a one-byte length. Kafka topic names
/// are at most 249 characters, RabbitMQ stream names 255 bytes.
pub const POSITION_SOURCE_BYTES_MAX: usize = 255;

const POSITION_FORMAT_V1: u8 = 1;
/// The bytes of an encoded position value.
pub(crate) const POSITION_VALUE_BYTES: usize = 17;

/// Where a log consumer has read to in one partition of one source: the offset of the last
/// message whose effects are committed. Resume reading at `offset + 1`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Position {
    /// The log: a topic, a stream.
    pub source: String,
    /// The partition of the source (0 for a log without partitions, such as a single stream).
    pub partition: u32,
    /// The offset of the last message read and committed.
    pub offset: u64,
    /// When the position last moved, by the writer's clock (ms since the Unix epoch).
    pub updated_at_ms: u64,
}

impl Position {
    /// A position (for backends other than the embedded engine, which build it from their own
    /// storage).
    #[must_use]
    pub fn new(
        source: impl Into<String>,
        partition: u32,
        offset: u64,
        updated_at_ms: u64,
    ) -> Position {
        Position {
            source: source.into(),
            partition,
            offset,
            updated_at_ms,
        }
    }

    /// The offset to resume reading at: one past the stored offset (saturating: `u64::MAX`
    /// for a position at `u64::MAX`).
    #[must_use]
    pub fn next_offset(&self) -> u64 {
        self.offset.saturating_add(1)
    }
}

/// Checks a source name (a topic, a stream) against its limits, as every backend must before
/// it stores a position. A NUL character is refused by every backend, though the embedded
/// engine could store it: PostgreSQL's text cannot, and a consumer moved from one backend to
/// the other must find the same sources valid. No broker names a log with one. (A source with
/// NUL stored by an embedded store of an earlier version is still listed, and can be neither
/// read, moved nor reset by name.)
///
/// # Errors
/// [`crate::Error::LimitExceeded`] with [`Limit::PositionSourceBytes`] outside
/// [`POSITION_SOURCE_BYTES_MIN`]..=[`POSITION_SOURCE_BYTES_MAX`] bytes;
/// [`crate::Error::InvalidArgument`] for a source containing NUL (`\0`).
pub fn check_position_source(source: &str) -> Result<()> {
    check_limit(
        Limit::PositionSourceBytes,
        source.len(),
        POSITION_SOURCE_BYTES_MIN,
        POSITION_SOURCE_BYTES_MAX,
    )?;
    if source.contains('\0') {
        return Err(crate::format::error::Error::InvalidArgument {
            reason: "a read position's source contains NUL, which not every backend can store"
                .to_owned(),
        });
    }
    Ok(())
}

/// The stored key of (consumer, source, partition), from the consumer's records prefix
/// (`format::key::consumer_prefix`).
#[cfg(feature = "engine")]
pub(crate) fn encode_position_key(
    consumer_prefix: &[u8],
    source: &str,
    partition: u32,
) -> Result<Vec<u8>> {
    check_position_source(source)?;
    let mut key = Vec::with_capacity(consumer_prefix.len() + 1 + source.len() + 4);
    key.extend_from_slice(consumer_prefix);
    key.push(u8::try_from(source.len()).expect("source length checked"));
    key.extend_from_slice(source.as_bytes());
    key.extend_from_slice(&partition.to_be_bytes());
    Ok(key)
}

/// Splits a stored position key into (consumer id, source, partition).
///
/// # Errors
/// [`DecodeError::BadKey`] or [`DecodeError::Truncated`] when the bytes are not
/// a position key (layout: docs/design.md, section 3, "Read positions").
pub fn decode_position_key(key: &[u8]) -> Result<(&[u8], &str, u32), DecodeError> {
    let truncated = |needed| DecodeError::Truncated {
        needed,
        available: key.len(),
    };
    let (&consumer_len, rest) = key.split_first().ok_or_else(|| truncated(1))?;
    let consumer_len = usize::from(consumer_len);
    if consumer_len == 0 {
        return Err(DecodeError::BadKey {
            reason: "empty consumer id",
        });
    }
    if rest.len() < consumer_len + 1 {
        return Err(truncated(consumer_len + 2));
    }
    let (consumer, rest) = rest.split_at(consumer_len);
    let (&source_len, rest) = rest.split_first().ok_or_else(|| truncated(1))?;
    let source_len = usize::from(source_len);
    if source_len == 0 {
        return Err(DecodeError::BadKey {
            reason: "empty source",
        });
    }
    if rest.len() != source_len + 4 {
        return Err(if rest.len() < source_len + 4 {
            truncated(2 + consumer_len + source_len + 4)
        } else {
            DecodeError::TrailingBytes {
                extra: rest.len() - source_len - 4,
            }
        });
    }
    let (source, partition) = rest.split_at(source_len);
    let source = std::str::from_utf8(source).map_err(|_| DecodeError::BadKey {
        reason: "source is not UTF-8",
    })?;
    let partition = u32::from_be_bytes(partition.try_into().expect("four bytes checked"));
    Ok((consumer, source, partition))
}

/// Encodes a position value (also the merge operand that moves it).
#[must_use]
pub fn encode_position_value(offset: u64, updated_at_ms: u64) -> [u8; POSITION_VALUE_BYTES] {
    let mut value = [0u8; POSITION_VALUE_BYTES];
    value[0] = POSITION_FORMAT_V1;
    value[1..9].copy_from_slice(&offset.to_be_bytes());
    value[9..17].copy_from_slice(&updated_at_ms.to_be_bytes());
    value
}

/// Decodes a position value into (offset, updated_at_ms).
///
/// # Errors
/// [`DecodeError`] for a value of another length or version.
pub fn decode_position_value(value: &[u8]) -> Result<(u64, u64), DecodeError> {
    if value.len() < POSITION_VALUE_BYTES {
        return Err(DecodeError::Truncated {
            needed: POSITION_VALUE_BYTES,
            available: value.len(),
        });
    }
    if value[0] != POSITION_FORMAT_V1 {
        return Err(DecodeError::UnknownVersion { version: value[0] });
    }
    if value.len() > POSITION_VALUE_BYTES {
        return Err(DecodeError::TrailingBytes {
            extra: value.len() - POSITION_VALUE_BYTES,
        });
    }
    let offset = u64::from_be_bytes(value[1..9].try_into().expect("eight bytes"));
    let updated_at_ms = u64::from_be_bytes(value[9..17].try_into().expect("eight bytes"));
    Ok((offset, updated_at_ms))
}

/// Folds position operands (oldest first) over an existing value: the value with the highest
/// offset, the later one of equal offsets (so the time is the latest move's). Values that do
/// not decode are skipped; an existing value that does not decode and no valid operand leave
/// it as it is, so that reads report it. Never fails: a failed merge would stop RocksDB's
/// compactions for the whole store.
pub fn fold_positions<'a>(
    existing: Option<&'a [u8]>,
    operands: impl IntoIterator<Item = &'a [u8]>,
) -> Vec<u8> {
    let mut best: Option<(&[u8], u64)> = existing.and_then(|value| {
        decode_position_value(value)
            .ok()
            .map(|(offset, _)| (value, offset))
    });
    for operand in operands {
        if let Ok((offset, _)) = decode_position_value(operand)
            && best.is_none_or(|(_, highest)| offset >= highest)
        {
            best = Some((operand, offset));
        }
    }
    match best {
        Some((value, _)) => value.to_vec(),
        None => existing.map(<[u8]>::to_vec).unwrap_or_default(),
    }
}

/// The positions table's full merge as RocksDB calls it.
#[cfg(feature = "engine")]
pub(crate) fn rocksdb_position_full_merge(
    _key: &[u8],
    existing: Option<&[u8]>,
    operands: &rocksdb::MergeOperands,
) -> Option<Vec<u8>> {
    Some(fold_positions(existing, operands))
}

/// Partial merge: taking the highest of several operands needs no base value.
#[cfg(feature = "engine")]
pub(crate) fn rocksdb_position_partial_merge(
    _key: &[u8],
    _existing: Option<&[u8]>,
    operands: &rocksdb::MergeOperands,
) -> Option<Vec<u8>> {
    let folded = fold_positions(None, operands);
    (!folded.is_empty()).then_some(folded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trips_and_is_injective() {
        let a = encode_position_key(b"\x01a", "bc", 7).unwrap();
        let b = encode_position_key(b"\x01a", "b", 7).unwrap();
        assert_ne!(a, b);
        assert_eq!(decode_position_key(&a).unwrap(), (&b"a"[..], "bc", 7));
        assert!(decode_position_key(&a[..a.len() - 1]).is_err());
        let mut long = a.clone();
        long.push(0);
        assert!(decode_position_key(&long).is_err());
        assert!(encode_position_key(b"\x01a", "", 0).is_err());
        assert!(encode_position_key(b"\x01a", &"s".repeat(256), 0).is_err());
    }

    #[test]
    fn fold_keeps_the_highest_offset() {
        let v = |offset, at| encode_position_value(offset, at).to_vec();
        let folded = fold_positions(
            Some(&v(10, 1)),
            [&v(7, 2)[..], &v(12, 3)[..], &v(11, 4)[..]],
        );
        assert_eq!(decode_position_value(&folded).unwrap(), (12, 3));
        // Equal offsets: the later write's time.
        let folded = fold_positions(Some(&v(12, 3)), [&v(12, 9)[..]]);
        assert_eq!(decode_position_value(&folded).unwrap(), (12, 9));
        // Garbage operands are skipped.
        let folded = fold_positions(Some(&v(5, 1)), [&b"junk"[..]]);
        assert_eq!(decode_position_value(&folded).unwrap(), (5, 1));
        // A corrupt base with no valid operand stays, to be reported by reads.
        assert_eq!(fold_positions(Some(b"junk"), []), b"junk".to_vec());
        // A corrupt base is replaced by a valid operand.
        let folded = fold_positions(Some(b"junk"), [&v(3, 1)[..]]);
        assert_eq!(decode_position_value(&folded).unwrap(), (3, 1));
    }

    #[test]
    fn value_rejects_other_lengths_and_versions() {
        let mut value = encode_position_value(1, 2).to_vec();
        assert!(decode_position_value(&value[..16]).is_err());
        value[0] = 2;
        assert!(decode_position_value(&value).is_err());
    }
}
