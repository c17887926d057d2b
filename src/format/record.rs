//! The stored record (the value under a marker key); the merge operands that change it are in
//! `operand.rs`.
//!
//! The encoding is specified byte by byte in docs/design.md, section 4: format 2 (varints) is
//! written, format 1 (fixed-width big-endian integers, earlier releases') is read too. Decoding
//! is total: every byte string either decodes or yields a [`DecodeError`].

use bytes::Bytes;

use crate::format::error::DecodeError;
use crate::format::fingerprint::Fingerprint;
use crate::format::varint;

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

/// The record format this build writes: version 2, with its integers as varints. It reads
/// [`RECORD_FORMAT_V1`] too, the fixed-width format earlier releases wrote.
pub(crate) const RECORD_FORMAT_VERSION: u8 = 2;
/// The first record format: every integer fixed-width and big-endian.
pub(crate) const RECORD_FORMAT_V1: u8 = 1;

const STATE_COMPLETED: u8 = 1;
const STATE_IN_PROGRESS: u8 = 2;
const STATE_RELEASED: u8 = 3;
const STATE_FAILED: u8 = 4;

/// Version 1's header: version(1) state(1) epoch(8) at_ms(8) until_ms(8) fingerprint(16)
/// payload_len(4).
const V1_HEADER_BYTES: usize = 1 + 1 + 8 + 8 + 8 + 16 + 4;
/// Version 2's header at its longest: version(1) state(1), the varints epoch, at_ms and
/// until_ms's difference (10 each), fingerprint(16), and the payload's length (a varint; 4
/// bytes carry [`RESULT_BYTES_MAX`], 10 are room for any value).
pub(crate) const RECORD_HEADER_BYTES_MAX: usize = 1 + 1 + 3 * varint::U64_BYTES_MAX + 16 + 10;
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

    /// Encodes the record (format version 2, docs/design.md section 4).
    ///
    /// # Panics
    /// Never for records built by the engine: it bounds results by [`RESULT_BYTES_MAX`] and
    /// holders by [`HOLDER_BYTES_MAX`] first. A record built by hand beyond them asserts.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = EncodedBytes::with_capacity(RECORD_HEADER_BYTES_MAX + self.payload_len());
        self.encode_into(&mut out);
        out.into_vec()
    }

    /// Encodes the record in format version 1, the fixed-width format earlier releases wrote:
    /// for tests and tools that build the stores those releases left. This build reads both.
    ///
    /// # Panics
    /// As [`Record::encode`].
    #[doc(hidden)]
    #[must_use]
    pub fn encode_v1(&self) -> Vec<u8> {
        let (state, at_ms, until_ms) = self.fields();
        let mut out = Vec::with_capacity(V1_HEADER_BYTES + self.payload_len());
        out.push(RECORD_FORMAT_V1);
        out.push(state);
        out.extend_from_slice(&self.epoch.to_be_bytes());
        out.extend_from_slice(&at_ms.to_be_bytes());
        out.extend_from_slice(&until_ms.to_be_bytes());
        out.extend_from_slice(&self.fingerprint.as_u128().to_be_bytes());
        let payload_len = u32::try_from(self.payload_len()).expect("payload bounded above");
        out.extend_from_slice(&payload_len.to_be_bytes());
        self.payload_into(|bytes| out.extend_from_slice(bytes));
        out
    }

    pub(crate) fn payload_len(&self) -> usize {
        match &self.state {
            RecordState::Completed { result, .. } => result.len(),
            RecordState::InProgress { holder, .. } => 8 + holder.len(),
            RecordState::Released { .. } => 0,
        }
    }

    pub(crate) fn encode_into(&self, out: &mut EncodedBytes) {
        let (state, at_ms, until_ms) = self.fields();
        // The header is assembled in place and appended in one copy: appended field by field,
        // the inline buffer checked its capacity at each.
        let mut header = [0u8; RECORD_HEADER_BYTES_MAX];
        header[0] = RECORD_FORMAT_VERSION;
        header[1] = state;
        let mut at = 2;
        varint::put(&mut header, &mut at, self.epoch);
        varint::put(&mut header, &mut at, at_ms);
        // The second time as a difference from the first: a retention or a lease, the same
        // few bytes for every record of a consumer, where the instant took six.
        varint::put(
            &mut header,
            &mut at,
            varint::zigzag(until_ms.wrapping_sub(at_ms)),
        );
        header[at..at + 16].copy_from_slice(&self.fingerprint.as_u128().to_be_bytes());
        at += 16;
        varint::put(&mut header, &mut at, self.payload_len() as u64);
        out.extend_from_slice(&header[..at]);
        self.payload_into(|bytes| out.extend_from_slice(bytes));
    }

    /// The state's tag and its two times, with the limits `encode` asserts checked.
    fn fields(&self) -> (u8, u64, u64) {
        assert!(self.epoch >= 1, "epochs start at 1");
        match &self.state {
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
        }
    }

    /// Hands the payload to `append`, in pieces: the same in both formats.
    fn payload_into(&self, mut append: impl FnMut(&[u8])) {
        match &self.state {
            RecordState::Completed { result, .. } => append(result),
            RecordState::InProgress { token, holder, .. } => {
                append(&token.to_be_bytes());
                append(holder);
            }
            RecordState::Released { .. } => {}
        }
    }

    /// Decodes a stored value, in either format.
    ///
    /// # Errors
    /// [`DecodeError`] for anything that is not exactly one record of format 1 or 2.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let header = RecordHeader::decode(bytes)?;
        let payload = &bytes[header.payload_at..];
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

/// Checks the format version and the state tag; returns both.
fn decode_version_and_state(bytes: &[u8]) -> Result<(u8, u8), DecodeError> {
    let version = *bytes.first().ok_or(DecodeError::Truncated {
        needed: 2,
        available: 0,
    })?;
    if !matches!(version, RECORD_FORMAT_V1 | RECORD_FORMAT_VERSION) {
        return Err(DecodeError::UnknownVersion { version });
    }
    let state = *bytes.get(1).ok_or(DecodeError::Truncated {
        needed: 2,
        available: 1,
    })?;
    if !matches!(
        state,
        STATE_COMPLETED | STATE_IN_PROGRESS | STATE_RELEASED | STATE_FAILED
    ) {
        return Err(DecodeError::UnknownTag {
            what: "state",
            tag: state,
        });
    }
    Ok((version, state))
}

/// The integers of a record's header, whichever its format, and where its payload starts.
struct HeaderFields {
    epoch: u64,
    at_ms: u64,
    until_ms: u64,
    fingerprint: Fingerprint,
    payload_len: u64,
    payload_at: usize,
}

impl HeaderFields {
    fn decode_v1(bytes: &[u8]) -> Result<HeaderFields, DecodeError> {
        if bytes.len() < V1_HEADER_BYTES {
            return Err(DecodeError::Truncated {
                needed: V1_HEADER_BYTES,
                available: bytes.len(),
            });
        }
        let mut fields = Reader { bytes, at: 2 };
        Ok(HeaderFields {
            epoch: fields.u64(),
            at_ms: fields.u64(),
            until_ms: fields.u64(),
            fingerprint: Fingerprint::from_u128(fields.u128()),
            payload_len: u64::from(fields.u32()),
            payload_at: V1_HEADER_BYTES,
        })
    }

    fn decode_v2(bytes: &[u8]) -> Result<HeaderFields, DecodeError> {
        let mut at = 2;
        let epoch = varint::read(bytes, &mut at)?;
        let at_ms = varint::read(bytes, &mut at)?;
        let until_ms = at_ms.wrapping_add(varint::unzigzag(varint::read(bytes, &mut at)?));
        let fingerprint = bytes
            .get(at..at + 16)
            .ok_or(DecodeError::Truncated {
                needed: at + 16,
                available: bytes.len(),
            })?
            .try_into()
            .map(u128::from_be_bytes)
            .expect("16 bytes");
        at += 16;
        let payload_len = varint::read(bytes, &mut at)?;
        Ok(HeaderFields {
            epoch,
            at_ms,
            until_ms,
            fingerprint: Fingerprint::from_u128(fingerprint),
            payload_len,
            payload_at: at,
        })
    }
}

/// Checks that the payload the header announces is bounded and is exactly the rest of `bytes`;
/// returns its length.
fn check_payload_len(bytes: &[u8], fields: &HeaderFields) -> Result<usize, DecodeError> {
    let payload_len = usize::try_from(fields.payload_len)
        .ok()
        .filter(|len| *len <= PAYLOAD_BYTES_MAX)
        .ok_or(DecodeError::Invalid {
            reason: "payload length above RESULT_BYTES_MAX",
        })?;
    let expected = fields.payload_at + payload_len;
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
    Ok(payload_len)
}

/// The fixed fields of a record, decoded without copying the payload. The merge operator and
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
    /// Where the payload starts (the header's length: fixed in format 1, not in format 2).
    pub(crate) payload_at: usize,
}

impl RecordHeader {
    pub(crate) fn decode(bytes: &[u8]) -> Result<RecordHeader, DecodeError> {
        let (version, state) = decode_version_and_state(bytes)?;
        let fields = if version == RECORD_FORMAT_V1 {
            HeaderFields::decode_v1(bytes)?
        } else {
            HeaderFields::decode_v2(bytes)?
        };
        if fields.epoch == 0 {
            return Err(DecodeError::Invalid {
                reason: "epoch 0 (epochs start at 1)",
            });
        }
        let payload_len = check_payload_len(bytes, &fields)?;
        let token = match state {
            STATE_IN_PROGRESS => {
                if !(8..=8 + HOLDER_BYTES_MAX).contains(&payload_len) {
                    return Err(DecodeError::Invalid {
                        reason: "in-progress payload is not a token and a holder",
                    });
                }
                Some(
                    Reader {
                        bytes,
                        at: fields.payload_at,
                    }
                    .u64(),
                )
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
            epoch: fields.epoch,
            at_ms: fields.at_ms,
            until_ms: fields.until_ms,
            fingerprint: fields.fingerprint,
            token,
            payload_at: fields.payload_at,
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
    fn a_claims_record_takes_31_bytes_and_round_trips() {
        // What a claim with an empty result writes: epoch 1, a commit in 2026, kept the default
        // retention (7 days).
        let committed_at_ms = 1_780_000_000_000;
        let record = Record::new(
            1,
            committed_at_ms,
            committed_at_ms + 7 * 86_400_000,
            Fingerprint::of(b"m"),
            Bytes::new(),
        );
        let encoded = record.encode();
        // version, state, epoch (1), the instant (6), 7 days as a difference (5), the
        // fingerprint (16), the payload's length (1): against 46 bytes in format 1.
        assert_eq!(encoded.len(), 2 + 1 + 6 + 5 + 16 + 1);
        assert_eq!(encoded[..2], [RECORD_FORMAT_VERSION, STATE_COMPLETED]);
        assert_eq!(Record::decode(&encoded).unwrap(), record);
        assert_eq!(record.encode_v1().len(), 46);
    }

    #[test]
    fn format_1_still_decodes_byte_for_byte() {
        // A completed record as earlier releases wrote it, spelled out: epoch 3, committed at
        // 1,000, expiring at 2,000, fingerprint 0x0102..10, result "ok".
        let mut v1 = vec![1, STATE_COMPLETED];
        v1.extend_from_slice(&3u64.to_be_bytes());
        v1.extend_from_slice(&1_000u64.to_be_bytes());
        v1.extend_from_slice(&2_000u64.to_be_bytes());
        v1.extend((1u8..=16).collect::<Vec<_>>());
        v1.extend_from_slice(&2u32.to_be_bytes());
        v1.extend_from_slice(b"ok");
        let expected = Record::new(
            3,
            1_000,
            2_000,
            Fingerprint::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
            Bytes::from_static(b"ok"),
        );
        assert_eq!(Record::decode(&v1).unwrap(), expected);
        assert_eq!(expected.encode_v1(), v1);
        let header = RecordHeader::decode(&v1).unwrap();
        assert_eq!(
            (header.at_ms, header.until_ms, header.payload_at),
            (1_000, 2_000, 46)
        );
    }

    #[test]
    fn the_second_time_may_come_first_or_never() {
        // A lease or expiry before its start (an imported record may say so) and "never" both
        // round-trip through the difference.
        for (at, until) in [
            (5_000, 1),
            (1_780_000_000_000, EXPIRES_NEVER_MS),
            (u64::MAX, 0),
        ] {
            let record = Record::new(1, at, until, Fingerprint::of(b"m"), Bytes::new());
            assert_eq!(Record::decode(&record.encode()).unwrap(), record);
        }
    }

    #[test]
    fn refuses_a_varint_longer_than_it_needs() {
        // Epoch 1 written in two bytes: it would decode to a record that encodes differently.
        let encoded = record(b"").encode();
        let mut longer = vec![encoded[0], encoded[1], 0x81, 0x00];
        longer.extend_from_slice(&encoded[3..]);
        assert!(matches!(
            Record::decode(&longer),
            Err(DecodeError::Invalid { .. })
        ));
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
        for version in [0, 3] {
            encoded[0] = version;
            assert_eq!(
                Record::decode(&encoded),
                Err(DecodeError::UnknownVersion { version })
            );
        }
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
            assert_eq!(Record::decode(&record.encode_v1()).unwrap(), record);
        }
    }

    proptest! {
        #[test]
        fn round_trip(epoch in 1u64.., at in any::<u64>(), exp in any::<u64>(),
                      fp in any::<u128>(), result in prop::collection::vec(any::<u8>(), 0..256)) {
            let r = Record::new(epoch, at, exp, Fingerprint::from_u128(fp), Bytes::from(result));
            prop_assert_eq!(Record::decode(&r.encode()).unwrap(), r.clone());
            prop_assert_eq!(Record::decode(&r.encode_v1()).unwrap(), r);
        }

        #[test]
        fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
            let _ = Record::decode(&bytes);
            let _ = Operand::decode(&bytes);
        }

        #[test]
        fn what_decodes_in_format_2_encodes_back_the_same(
            tail in prop::collection::vec(any::<u8>(), 0..64), state in 1u8..=4,
        ) {
            let mut bytes = vec![RECORD_FORMAT_VERSION, state];
            bytes.extend(tail);
            if let Ok(record) = Record::decode(&bytes) {
                prop_assert_eq!(record.encode(), bytes);
            }
        }
    }
}
