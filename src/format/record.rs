//! The stored record (the value under a marker key); the merge operands that change it are in
//! `operand.rs`.
//!
//! The encoding is specified byte by byte in docs/design.md. Integers are fixed-width
//! big-endian. Decoding is total: every byte string either decodes or yields a [`DecodeError`].

use bytes::Bytes;

use crate::format::error::DecodeError;
use crate::format::fingerprint::Fingerprint;

/// The largest result stored with a completed record, in bytes (64 MiB).
pub const RESULT_BYTES_MAX: usize = 64 << 20;

/// `expires_at_ms` of a record that never expires (entity tables by default).
pub const EXPIRES_NEVER_MS: u64 = u64::MAX;

/// The shortest lease of an external claim, in milliseconds.
pub const LEASE_MS_MIN: u64 = 1;
/// The longest lease of an external claim, in milliseconds (7 days). Renew a longer side
/// effect.
pub const LEASE_MS_MAX: u64 = 7 * 24 * 3600 * 1000;

/// The one expiry rule, shared by reads and the compaction filter: a record expires at the
/// instant `expires_at_ms` is reached, except that [`EXPIRES_NEVER_MS`] never does.
pub(crate) fn is_expired(expires_at_ms: u64, now_ms: u64) -> bool {
    expires_at_ms != EXPIRES_NEVER_MS && expires_at_ms <= now_ms
}

/// The longest holder identity of an in-progress record, in bytes.
pub const HOLDER_BYTES_MAX: usize = 255;

/// The record format this build writes and reads.
pub(crate) const RECORD_FORMAT_VERSION: u8 = 1;

const STATE_COMPLETED: u8 = 1;
const STATE_IN_PROGRESS: u8 = 2;
const STATE_RELEASED: u8 = 3;
const STATE_FAILED: u8 = 4;

/// version(1) state(1) epoch(8) at_ms(8) until_ms(8) fingerprint(16) payload_len(4)
pub(crate) const RECORD_HEADER_BYTES: usize = 1 + 1 + 8 + 8 + 8 + 16 + 4;
/// Encoded records and merge operands: the ones a claim writes (a record with a short result)
/// stay inline, so encoding them does not allocate; the write batch copies them anyway.
pub(crate) type EncodedBytes = smallvec::SmallVec<[u8; 128]>;

/// The largest payload any state carries.
const PAYLOAD_BYTES_MAX: usize = RESULT_BYTES_MAX;

/// Checks the size of a result to store with a record (at most [`RESULT_BYTES_MAX`]).
///
/// # Errors
/// [`crate::Error::LimitExceeded`] for a larger one.
#[cfg(any(feature = "engine", feature = "transfer"))]
pub(crate) fn check_result(result: &[u8]) -> crate::format::error::Result<()> {
    crate::format::error::check_limit(
        crate::format::error::Limit::ResultBytes,
        result.len(),
        0,
        RESULT_BYTES_MAX,
    )
}

/// Checks a record given from outside (an import) before it is encoded: an epoch from 1 (epochs
/// start at 1), a result and a holder within their limits (`Record::encode` asserts those).
///
/// # Errors
/// [`crate::Error::InvalidArgument`] for epoch 0; [`crate::Error::LimitExceeded`] for a result
/// or holder over its limit.
#[cfg(any(feature = "engine", feature = "transfer"))]
pub(crate) fn check_given_record(
    epoch: u64,
    state: &RecordState,
) -> crate::format::error::Result<()> {
    if epoch == 0 {
        return Err(crate::format::error::Error::invalid_argument(
            "a record's epoch is 0; epochs start at 1",
        ));
    }
    match state {
        RecordState::Completed { result, .. } => check_result(result),
        RecordState::InProgress { holder, .. } => crate::format::error::check_limit(
            crate::format::error::Limit::HolderBytes,
            holder.len(),
            0,
            HOLDER_BYTES_MAX,
        ),
        RecordState::Released { .. } => Ok(()),
    }
}

/// Decodes an entry of the versions table (the ordering guard's highest applied version of an
/// entity): a big-endian `u64`.
///
/// # Errors
/// [`DecodeError::Invalid`] unless the value is exactly 8 bytes.
#[cfg(feature = "engine")]
pub(crate) fn decode_entity_version(value: &[u8]) -> Result<u64, DecodeError> {
    let bytes = <[u8; 8]>::try_from(value).map_err(|_| DecodeError::Invalid {
        reason: "an entity version is not 8 bytes",
    })?;
    Ok(u64::from_be_bytes(bytes))
}

/// What a stored record means to a read at some instant ([`Record::standing_at`]).
#[cfg(feature = "engine")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Completed and not expired: a redelivery is a duplicate (or a conflict).
    Live,
    /// Completed and expired: reads treat it as absent until compaction removes it.
    Expired,
    /// Held by an external claim, whether its lease is live or not.
    InProgress,
    /// Released: reads treat it as absent; kept so the key's epoch keeps increasing.
    Released,
}

/// What a successful commit wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Committed {
    /// The new record's epoch.
    pub epoch: u64,
    /// The commit's timestamp (engine clock).
    pub committed_at_ms: u64,
    /// When the record expires ([`EXPIRES_NEVER_MS`] for never).
    pub expires_at_ms: u64,
}

/// What idemdb remembers about one key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// Increases by one each time the key changes hands (a claim commits, an external claim is
    /// taken or taken over); with the holder's token it fences stale holders. Starts at 1.
    pub epoch: u64,
    /// The fingerprint of the message that created the record.
    pub fingerprint: Fingerprint,
    /// The record's state.
    pub state: RecordState,
}

/// The states a stored record can be in (docs/design.md, section 6).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// Processed. Duplicates get `result`; `succeeded` is false when the handler's failure was
    /// recorded as the result (so redeliveries replay the failure instead of retrying).
    Completed {
        /// When the claim committed (engine clock, ms since the Unix epoch).
        committed_at_ms: u64,
        /// From this instant on the record reads as absent; [`EXPIRES_NEVER_MS`] means never.
        expires_at_ms: u64,
        /// The stored result (for an entity table: the entity).
        result: Bytes,
        /// False for a recorded failure.
        succeeded: bool,
    },
    /// A side effect outside the batch is being performed under a lease.
    InProgress {
        /// When the current holder took the key.
        since_ms: u64,
        /// Until when the holder's lease runs; afterwards the key may be taken over.
        lease_until_ms: u64,
        /// The holder's identity, as it gave it.
        holder: Bytes,
        /// The holder's random token; with the epoch it fences stale holders.
        token: u64,
    },
    /// Released by its holder without a result: reads treat it as absent. It is kept until
    /// `removable_at_ms` so the key's epoch keeps increasing across the release.
    Released {
        /// When it was released.
        released_at_ms: u64,
        /// When the compaction filter may remove it.
        removable_at_ms: u64,
    },
}

impl Record {
    /// A completed record; used by the engine and by tools that write the format.
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
            fingerprint,
            state: RecordState::Completed {
                committed_at_ms,
                expires_at_ms,
                result,
                succeeded: true,
            },
        }
    }

    /// The in-progress record of an external claim; used by backends and tools that write the
    /// format.
    #[must_use]
    pub fn in_progress(
        epoch: u64,
        fingerprint: Fingerprint,
        since_ms: u64,
        lease_until_ms: u64,
        holder: Bytes,
        token: u64,
    ) -> Record {
        Record {
            epoch,
            fingerprint,
            state: RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                token,
            },
        }
    }

    /// True when reads treat this record as absent at `now_ms`: a completed record from the
    /// instant it expires (whether or not compaction has removed it yet), a released record
    /// always. An in-progress record is never absent.
    #[must_use]
    pub fn is_absent_at(&self, now_ms: u64) -> bool {
        match &self.state {
            RecordState::Completed { expires_at_ms, .. } => is_expired(*expires_at_ms, now_ms),
            RecordState::InProgress { .. } => false,
            RecordState::Released { .. } => true,
        }
    }

    /// What the record means to a read at `now_ms` (the engine's counts and the operator
    /// tools' states classify records by it).
    #[cfg(feature = "engine")]
    pub(crate) fn standing_at(&self, now_ms: u64) -> Standing {
        match &self.state {
            RecordState::Completed { expires_at_ms, .. } if is_expired(*expires_at_ms, now_ms) => {
                Standing::Expired
            }
            RecordState::Completed { .. } => Standing::Live,
            RecordState::InProgress { .. } => Standing::InProgress,
            RecordState::Released { .. } => Standing::Released,
        }
    }

    /// The stored result of a completed record.
    #[must_use]
    pub fn result(&self) -> Option<&Bytes> {
        match &self.state {
            RecordState::Completed { result, .. } => Some(result),
            _ => None,
        }
    }

    /// Encodes the record (format version 1).
    ///
    /// # Panics
    /// Never for records built by the engine: it bounds results by [`RESULT_BYTES_MAX`] and
    /// holders by [`HOLDER_BYTES_MAX`] first. A record built by hand beyond them asserts.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = EncodedBytes::with_capacity(RECORD_HEADER_BYTES + self.payload_len());
        self.encode_into(&mut out);
        out.into_vec()
    }

    pub(crate) fn payload_len(&self) -> usize {
        match &self.state {
            RecordState::Completed { result, .. } => result.len(),
            RecordState::InProgress { holder, .. } => 8 + holder.len(),
            RecordState::Released { .. } => 0,
        }
    }

    pub(crate) fn encode_into(&self, out: &mut EncodedBytes) {
        assert!(self.epoch >= 1, "epochs start at 1");
        let (state, at_ms, until_ms) = match &self.state {
            RecordState::Completed {
                committed_at_ms,
                expires_at_ms,
                result,
                succeeded,
            } => {
                assert!(
                    result.len() <= RESULT_BYTES_MAX,
                    "result above RESULT_BYTES_MAX"
                );
                let state = if *succeeded {
                    STATE_COMPLETED
                } else {
                    STATE_FAILED
                };
                (state, *committed_at_ms, *expires_at_ms)
            }
            RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                ..
            } => {
                assert!(
                    holder.len() <= HOLDER_BYTES_MAX,
                    "holder above HOLDER_BYTES_MAX"
                );
                (STATE_IN_PROGRESS, *since_ms, *lease_until_ms)
            }
            RecordState::Released {
                released_at_ms,
                removable_at_ms,
            } => (STATE_RELEASED, *released_at_ms, *removable_at_ms),
        };
        let payload_len = u32::try_from(self.payload_len()).expect("payload bounded above");
        // The header is assembled in place and appended in one copy: appended field by field,
        // the inline buffer checked its capacity seven times.
        let mut header = [0u8; RECORD_HEADER_BYTES];
        header[0] = RECORD_FORMAT_VERSION;
        header[1] = state;
        header[2..10].copy_from_slice(&self.epoch.to_be_bytes());
        header[10..18].copy_from_slice(&at_ms.to_be_bytes());
        header[18..26].copy_from_slice(&until_ms.to_be_bytes());
        header[26..42].copy_from_slice(&self.fingerprint.as_u128().to_be_bytes());
        header[42..].copy_from_slice(&payload_len.to_be_bytes());
        out.extend_from_slice(&header);
        match &self.state {
            RecordState::Completed { result, .. } => out.extend_from_slice(result),
            RecordState::InProgress { token, holder, .. } => {
                out.extend_from_slice(&token.to_be_bytes());
                out.extend_from_slice(holder);
            }
            RecordState::Released { .. } => {}
        }
    }

    /// Decodes a stored value.
    ///
    /// # Errors
    /// [`DecodeError`] for anything that is not exactly one version-1 record.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let header = RecordHeader::decode(bytes)?;
        let payload = &bytes[RECORD_HEADER_BYTES..];
        let state = match header.state {
            STATE_COMPLETED | STATE_FAILED => RecordState::Completed {
                committed_at_ms: header.at_ms,
                expires_at_ms: header.until_ms,
                result: Bytes::copy_from_slice(payload),
                succeeded: header.state == STATE_COMPLETED,
            },
            STATE_IN_PROGRESS => RecordState::InProgress {
                since_ms: header.at_ms,
                lease_until_ms: header.until_ms,
                token: header.token.expect("checked by RecordHeader::decode"),
                holder: Bytes::copy_from_slice(&payload[8..]),
            },
            _ => RecordState::Released {
                released_at_ms: header.at_ms,
                removable_at_ms: header.until_ms,
            },
        };
        Ok(Record {
            epoch: header.epoch,
            fingerprint: header.fingerprint,
            state,
        })
    }
}

/// Checks the format version, that the fixed-size header is all there, and the state tag;
/// returns the state.
fn decode_state(bytes: &[u8]) -> Result<u8, DecodeError> {
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
    if !matches!(
        state,
        STATE_COMPLETED | STATE_IN_PROGRESS | STATE_RELEASED | STATE_FAILED
    ) {
        return Err(DecodeError::UnknownTag {
            what: "state",
            tag: state,
        });
    }
    Ok(state)
}

/// Checks that the payload the header announces is bounded and is exactly the rest of `bytes`.
fn check_payload_len(bytes: &[u8], payload_len: usize) -> Result<(), DecodeError> {
    if payload_len > PAYLOAD_BYTES_MAX {
        return Err(DecodeError::Invalid {
            reason: "payload length above RESULT_BYTES_MAX",
        });
    }
    let expected = RECORD_HEADER_BYTES + payload_len;
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
    Ok(())
}

/// The fixed-size part of a record, decoded without copying the payload. The merge operator and
/// the compaction filter need only this, but they validate the whole value like
/// [`Record::decode`] does: a value is a record for all of them, or for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub(crate) state: u8,
    pub(crate) epoch: u64,
    pub(crate) at_ms: u64,
    pub(crate) until_ms: u64,
    pub(crate) fingerprint: Fingerprint,
    /// The holder's token, for an in-progress record.
    pub(crate) token: Option<u64>,
}

impl RecordHeader {
    pub(crate) fn decode(bytes: &[u8]) -> Result<RecordHeader, DecodeError> {
        let state = decode_state(bytes)?;
        let mut fields = Reader { bytes, at: 2 };
        let epoch = fields.u64();
        let at_ms = fields.u64();
        let until_ms = fields.u64();
        let fingerprint = Fingerprint::from_u128(fields.u128());
        let payload_len = fields.u32() as usize;
        if epoch == 0 {
            return Err(DecodeError::Invalid {
                reason: "epoch 0 (epochs start at 1)",
            });
        }
        check_payload_len(bytes, payload_len)?;
        let token = match state {
            STATE_IN_PROGRESS => {
                if !(8..=8 + HOLDER_BYTES_MAX).contains(&payload_len) {
                    return Err(DecodeError::Invalid {
                        reason: "in-progress payload is not a token and a holder",
                    });
                }
                Some(fields.u64())
            }
            STATE_RELEASED if payload_len != 0 => {
                return Err(DecodeError::Invalid {
                    reason: "released record with a payload",
                });
            }
            _ => None,
        };
        Ok(RecordHeader {
            state,
            epoch,
            at_ms,
            until_ms,
            fingerprint,
            token,
        })
    }

    /// Whether the compaction filter may remove this record at `now_ms`: a completed (or failed)
    /// record that has expired, or a released record past its removal time. Never an
    /// in-progress record, whatever its lease.
    pub(crate) fn is_removable_at(&self, now_ms: u64) -> bool {
        self.state != STATE_IN_PROGRESS && is_expired(self.until_ms, now_ms)
    }
}

/// Reads fixed-width big-endian fields; the caller has checked the length first.
pub(crate) struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let field: [u8; N] = self.bytes[self.at..self.at + N]
            .try_into()
            .expect("slice of length N");
        self.at += N;
        field
    }
    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take())
    }
    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take())
    }
    pub(crate) fn u128(&mut self) -> u128 {
        u128::from_be_bytes(self.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::operand::Operand;
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
        assert_eq!(encoded[1], STATE_COMPLETED);
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
        assert_eq!(
            Record::decode(&encoded).unwrap().result().unwrap().len(),
            1 << 20
        );
    }

    #[test]
    fn operand_round_trips_and_checks_epoch() {
        let encoded = Operand::encode_install(2, &record(b"r"));
        let Operand::Install {
            replaces_epoch,
            record_bytes,
        } = Operand::decode(&encoded).unwrap()
        else {
            panic!("install expected");
        };
        assert_eq!(replaces_epoch, 2);
        assert_eq!(Record::decode(record_bytes).unwrap(), record(b"r"));
        let wrong_epoch = Operand::encode_install(5, &record(b"r"));
        assert!(Operand::decode(&wrong_epoch).is_err());

        let encoded = Operand::encode_replace(3, 99, &record(b"r"));
        let Operand::Replace { epoch, token, .. } = Operand::decode(&encoded).unwrap() else {
            panic!("replace expected");
        };
        assert_eq!((epoch, token), (3, 99));
        assert!(Operand::decode(&Operand::encode_replace(4, 99, &record(b"r"))).is_err());
    }

    #[test]
    fn every_state_round_trips() {
        let in_progress = Record {
            epoch: 7,
            fingerprint: Fingerprint::of(b"m"),
            state: RecordState::InProgress {
                since_ms: 5,
                lease_until_ms: 9,
                holder: Bytes::from_static(b"worker-1"),
                token: 0xfeed,
            },
        };
        let released = Record {
            epoch: 8,
            fingerprint: Fingerprint::of(b"m"),
            state: RecordState::Released {
                released_at_ms: 10,
                removable_at_ms: 20,
            },
        };
        let failed = Record {
            epoch: 9,
            fingerprint: Fingerprint::of(b"m"),
            state: RecordState::Completed {
                committed_at_ms: 1,
                expires_at_ms: 2,
                result: Bytes::from_static(b"card declined"),
                succeeded: false,
            },
        };
        for record in [in_progress, released, failed] {
            assert_eq!(Record::decode(&record.encode()).unwrap(), record);
        }
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
