//! The stored record (the value under a marker key) and the merge operands that change it.
//!
//! Both encodings are specified byte by byte in docs/design.md. Integers are fixed-width
//! big-endian. Decoding is total: every byte string either decodes or yields a [`DecodeError`].

use bytes::Bytes;

use crate::fingerprint::Fingerprint;

/// The largest result stored with a completed record, in bytes (64 MiB).
pub const RESULT_BYTES_MAX: usize = 64 << 20;

/// `expires_at_ms` of a record that never expires (entity tables by default).
pub const EXPIRES_NEVER_MS: u64 = u64::MAX;

/// The one expiry rule, shared by reads and the compaction filter: a record expires at the
/// instant `expires_at_ms` is reached, except that [`EXPIRES_NEVER_MS`] never does.
pub(crate) fn is_expired(expires_at_ms: u64, now_ms: u64) -> bool {
    expires_at_ms != EXPIRES_NEVER_MS && expires_at_ms <= now_ms
}

/// The record format this build writes and reads.
pub(crate) const RECORD_FORMAT_VERSION: u8 = 1;
/// The merge-operand format this build writes and reads.
pub(crate) const OPERAND_FORMAT_VERSION: u8 = 1;

const STATE_COMPLETED: u8 = 1;
const OPERAND_COMMIT: u8 = 1;

/// version(1) state(1) epoch(8) committed_at_ms(8) expires_at_ms(8) fingerprint(16) result_len(4)
const RECORD_HEADER_BYTES: usize = 1 + 1 + 8 + 8 + 8 + 16 + 4;
/// version(1) kind(1) replaces_epoch(8), followed by a whole record.
const OPERAND_HEADER_BYTES: usize = 1 + 1 + 8;

/// Why stored bytes did not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the layout requires.
    #[error("truncated: needed {needed} bytes, found {available}")]
    Truncated {
        /// Bytes the layout requires.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// More bytes than the layout accounts for.
    #[error("{extra} trailing bytes after the record")]
    TrailingBytes {
        /// Bytes past the end of the record.
        extra: usize,
    },
    /// A format version this build does not know (written by a newer idemdb, or garbage).
    #[error("unknown format version {version}")]
    UnknownVersion {
        /// The version byte found.
        version: u8,
    },
    /// A record state or operand kind this build does not know.
    #[error("unknown {what} tag {tag}")]
    UnknownTag {
        /// "state" or "operand kind".
        what: &'static str,
        /// The tag byte found.
        tag: u8,
    },
    /// A field holds a value no writer produces.
    #[error("invalid field: {reason}")]
    Invalid {
        /// Which field and why.
        reason: &'static str,
    },
    /// A stored key that is not a valid composite key.
    #[error("bad key: {reason}")]
    BadKey {
        /// Why.
        reason: &'static str,
    },
}

/// A completed record: what idemdb remembers about a processed message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// Increases by one each time the key changes hands; the record's identity for the merge
    /// operator's compare-and-set. Starts at 1.
    pub epoch: u64,
    /// When the claim that created this record committed (the engine clock, ms since the epoch).
    pub committed_at_ms: u64,
    /// From this instant on the record reads as absent. [`EXPIRES_NEVER_MS`] means never.
    pub expires_at_ms: u64,
    /// The fingerprint of the message that created it.
    pub fingerprint: Fingerprint,
    /// The result stored at commit, returned to duplicates (for an entity table: the entity).
    pub result: Bytes,
}

impl Record {
    /// Builds a completed record; used by the engine and by tools that write the format.
    #[must_use]
    pub fn new(
        epoch: u64,
        committed_at_ms: u64,
        expires_at_ms: u64,
        fingerprint: Fingerprint,
        result: Bytes,
    ) -> Record {
        Record {
            epoch,
            committed_at_ms,
            expires_at_ms,
            fingerprint,
            result,
        }
    }

    /// True from the instant `expires_at_ms` is reached: expiry is exact at read time,
    /// whether or not compaction has removed the record yet.
    #[must_use]
    pub fn is_expired(&self, now_ms: u64) -> bool {
        is_expired(self.expires_at_ms, now_ms)
    }

    /// Encodes the record (format version 1).
    ///
    /// # Panics
    /// Never for records built by the engine: it bounds `result` by [`RESULT_BYTES_MAX`] first.
    /// A record built by hand with a larger result is a programming error and asserts.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD_HEADER_BYTES + self.result.len());
        self.encode_into(&mut out);
        out
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        assert!(
            self.result.len() <= RESULT_BYTES_MAX,
            "result above RESULT_BYTES_MAX"
        );
        assert!(self.epoch >= 1, "epochs start at 1");
        out.push(RECORD_FORMAT_VERSION);
        out.push(STATE_COMPLETED);
        out.extend_from_slice(&self.epoch.to_be_bytes());
        out.extend_from_slice(&self.committed_at_ms.to_be_bytes());
        out.extend_from_slice(&self.expires_at_ms.to_be_bytes());
        out.extend_from_slice(&self.fingerprint.as_u128().to_be_bytes());
        let result_len = u32::try_from(self.result.len()).expect("bounded by RESULT_BYTES_MAX");
        out.extend_from_slice(&result_len.to_be_bytes());
        out.extend_from_slice(&self.result);
    }

    /// Decodes a stored value.
    ///
    /// # Errors
    /// [`DecodeError`] for anything that is not exactly one version-1 record.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let header = RecordHeader::decode(bytes)?;
        Ok(Record {
            epoch: header.epoch,
            committed_at_ms: header.committed_at_ms,
            expires_at_ms: header.expires_at_ms,
            fingerprint: header.fingerprint,
            result: Bytes::copy_from_slice(&bytes[RECORD_HEADER_BYTES..]),
        })
    }
}

/// The fixed-size part of a record, decoded without copying the result. The merge operator and
/// the compaction filter need only this, but they validate the whole value like
/// [`Record::decode`] does: a value is a record for all of them, or for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub(crate) epoch: u64,
    pub(crate) committed_at_ms: u64,
    pub(crate) expires_at_ms: u64,
    pub(crate) fingerprint: Fingerprint,
}

impl RecordHeader {
    pub(crate) fn decode(bytes: &[u8]) -> Result<RecordHeader, DecodeError> {
        let version = *bytes.first().ok_or(DecodeError::Truncated {
            needed: RECORD_HEADER_BYTES,
            available: 0,
        })?;
        if version != RECORD_FORMAT_VERSION {
            return Err(DecodeError::UnknownVersion { version });
        }
        if bytes.len() < RECORD_HEADER_BYTES {
            return Err(DecodeError::Truncated {
                needed: RECORD_HEADER_BYTES,
                available: bytes.len(),
            });
        }
        let state = bytes[1];
        if state != STATE_COMPLETED {
            return Err(DecodeError::UnknownTag {
                what: "state",
                tag: state,
            });
        }
        let mut fields = Reader { bytes, at: 2 };
        let epoch = fields.u64();
        let committed_at_ms = fields.u64();
        let expires_at_ms = fields.u64();
        let fingerprint = Fingerprint::from_u128(fields.u128());
        let result_len = fields.u32() as usize;
        if epoch == 0 {
            return Err(DecodeError::Invalid {
                reason: "epoch 0 (epochs start at 1)",
            });
        }
        if result_len > RESULT_BYTES_MAX {
            return Err(DecodeError::Invalid {
                reason: "result length above RESULT_BYTES_MAX",
            });
        }
        let expected = RECORD_HEADER_BYTES + result_len;
        if bytes.len() < expected {
            return Err(DecodeError::Truncated {
                needed: expected,
                available: bytes.len(),
            });
        }
        if bytes.len() > expected {
            return Err(DecodeError::TrailingBytes {
                extra: bytes.len() - expected,
            });
        }
        Ok(RecordHeader {
            epoch,
            committed_at_ms,
            expires_at_ms,
            fingerprint,
        })
    }
}

/// Reads fixed-width big-endian fields; the caller has checked the length first.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let field: [u8; N] = self.bytes[self.at..self.at + N]
            .try_into()
            .expect("slice of length N");
        self.at += N;
        field
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take())
    }
    fn u128(&mut self) -> u128 {
        u128::from_be_bytes(self.take())
    }
}

/// A merge operand: one requested state transition of a marker record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Operand<'a> {
    /// Install `record` if the key is absent or still holds the record with epoch
    /// `replaces_epoch` (the one the claimant saw, expired). Otherwise the existing record stands.
    Commit {
        replaces_epoch: u64,
        record_bytes: &'a [u8],
    },
}

/// Encodes the merge operand a claim writes when it commits: install `record` if the key is
/// absent or holds the record with epoch `replaces_epoch` (0 when the claimant found the key
/// absent). `record.epoch` must be `replaces_epoch + 1`. For fuzzers and format tools.
#[must_use]
pub fn encode_commit_operand(replaces_epoch: u64, record: &Record) -> Vec<u8> {
    Operand::encode_commit(replaces_epoch, record)
}

impl Operand<'_> {
    /// Encodes a commit operand; `replaces_epoch` is 0 when the claimant found the key absent.
    pub(crate) fn encode_commit(replaces_epoch: u64, record: &Record) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(OPERAND_HEADER_BYTES + RECORD_HEADER_BYTES + record.result.len());
        out.push(OPERAND_FORMAT_VERSION);
        out.push(OPERAND_COMMIT);
        out.extend_from_slice(&replaces_epoch.to_be_bytes());
        record.encode_into(&mut out);
        out
    }

    /// Decodes an operand and validates the record inside it (header and exact length).
    pub(crate) fn decode(bytes: &[u8]) -> Result<Operand<'_>, DecodeError> {
        if bytes.len() < OPERAND_HEADER_BYTES {
            return Err(DecodeError::Truncated {
                needed: OPERAND_HEADER_BYTES,
                available: bytes.len(),
            });
        }
        if bytes[0] != OPERAND_FORMAT_VERSION {
            return Err(DecodeError::UnknownVersion { version: bytes[0] });
        }
        if bytes[1] != OPERAND_COMMIT {
            return Err(DecodeError::UnknownTag {
                what: "operand kind",
                tag: bytes[1],
            });
        }
        let replaces_epoch = Reader { bytes, at: 2 }.u64();
        let record_bytes = &bytes[OPERAND_HEADER_BYTES..];
        let header = RecordHeader::decode(record_bytes)?;
        if header.epoch != replaces_epoch.wrapping_add(1) {
            return Err(DecodeError::Invalid {
                reason: "commit operand epoch is not replaces_epoch + 1",
            });
        }
        Ok(Operand::Commit {
            replaces_epoch,
            record_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(result: &[u8]) -> Record {
        Record::new(
            3,
            1_000,
            2_000,
            Fingerprint::of(b"m"),
            Bytes::copy_from_slice(result),
        )
    }

    #[test]
    fn header_is_46_bytes_and_round_trips() {
        let encoded = record(b"ok").encode();
        assert_eq!(encoded.len(), 46 + 2);
        assert_eq!(encoded[0], RECORD_FORMAT_VERSION);
        assert_eq!(Record::decode(&encoded).unwrap(), record(b"ok"));
    }

    #[test]
    fn rejects_every_truncation_and_extension() {
        let encoded = record(b"result").encode();
        for len in 0..encoded.len() {
            assert!(
                Record::decode(&encoded[..len]).is_err(),
                "prefix of {len} bytes"
            );
        }
        let mut longer = encoded.clone();
        longer.push(0);
        assert_eq!(
            Record::decode(&longer),
            Err(DecodeError::TrailingBytes { extra: 1 })
        );
    }

    #[test]
    fn rejects_unknown_version_and_state() {
        let mut encoded = record(b"").encode();
        encoded[0] = 2;
        assert_eq!(
            Record::decode(&encoded),
            Err(DecodeError::UnknownVersion { version: 2 })
        );
        encoded[0] = RECORD_FORMAT_VERSION;
        encoded[1] = 9;
        assert!(matches!(
            Record::decode(&encoded),
            Err(DecodeError::UnknownTag { tag: 9, .. })
        ));
    }

    #[test]
    fn large_result_round_trips() {
        let big = vec![7u8; 1 << 20];
        let encoded = record(&big).encode();
        assert_eq!(Record::decode(&encoded).unwrap().result.len(), 1 << 20);
    }

    #[test]
    fn operand_round_trips_and_checks_epoch() {
        let encoded = Operand::encode_commit(2, &record(b"r"));
        match Operand::decode(&encoded).unwrap() {
            Operand::Commit {
                replaces_epoch,
                record_bytes,
            } => {
                assert_eq!(replaces_epoch, 2);
                assert_eq!(Record::decode(record_bytes).unwrap(), record(b"r"));
            }
        }
        let wrong_epoch = Operand::encode_commit(5, &record(b"r"));
        assert!(Operand::decode(&wrong_epoch).is_err());
    }

    proptest! {
        #[test]
        fn round_trip(epoch in 1u64.., at in any::<u64>(), exp in any::<u64>(),
                      fp in any::<u128>(), result in prop::collection::vec(any::<u8>(), 0..256)) {
            let r = Record::new(epoch, at, exp, Fingerprint::from_u128(fp), Bytes::from(result));
            prop_assert_eq!(Record::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
            let _ = Record::decode(&bytes);
            let _ = Operand::decode(&bytes);
        }
    }
}
