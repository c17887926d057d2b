//! Merge operands of the marker tables: the state transitions a claim or a lease step asks
//! for (install a record, replace an in-progress one), encoded as docs/design.md section 5
//! describes. The merge operator (`merge.rs`) applies them.

use crate::format::error::DecodeError;
use crate::format::record::{EncodedBytes, RECORD_HEADER_BYTES_MAX, Reader, Record, RecordHeader};

/// The merge-operand format this build writes and reads.
const OPERAND_FORMAT_VERSION: u8 = 1;
const OPERAND_INSTALL: u8 = 1;
const OPERAND_REPLACE: u8 = 2;
/// version(1) kind(1) epoch(8), then for a replace token(8), then a whole record.
const OPERAND_HEADER_BYTES: usize = 1 + 1 + 8;

/// A merge operand: one requested state transition of a marker record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Operand<'a> {
    /// Install `record` if the key is absent or still holds the record with epoch
    /// `replaces_epoch` (the one the claimant saw: expired, released, or in progress with an
    /// expired lease). Otherwise the existing record stands.
    Install {
        replaces_epoch: u64,
        record_bytes: &'a [u8],
    },
    /// Replace the in-progress record with this `epoch` and `token` by `record`; anything else
    /// (another holder, a completed record, nothing) stands. The fenced transition of leases.
    Replace {
        epoch: u64,
        token: u64,
        record_bytes: &'a [u8],
    },
}

/// Encodes the merge operand a claim writes to install a record: `record` replaces the key's
/// record only if the key is absent or holds the record with epoch `replaces_epoch` (0 when the
/// claimant found the key absent). `record.epoch` must be `replaces_epoch + 1`. For fuzzers and
/// format tools.
#[must_use]
pub fn encode_commit_operand(replaces_epoch: u64, record: &Record) -> Vec<u8> {
    Operand::encode_install(replaces_epoch, record).into_vec()
}

/// Encodes the fenced merge operand of a lease step: `record` replaces the key's record only if
/// that is the in-progress record with this `epoch` and `token`. `record.epoch` must equal
/// `epoch`. For fuzzers and format tools.
#[must_use]
pub fn encode_replace_operand(epoch: u64, token: u64, record: &Record) -> Vec<u8> {
    Operand::encode_replace(epoch, token, record).into_vec()
}

impl Operand<'_> {
    pub(crate) fn encode_install(replaces_epoch: u64, record: &Record) -> EncodedBytes {
        let mut out = EncodedBytes::with_capacity(
            OPERAND_HEADER_BYTES + RECORD_HEADER_BYTES_MAX + record.payload_len(),
        );
        out.push(OPERAND_FORMAT_VERSION);
        out.push(OPERAND_INSTALL);
        out.extend_from_slice(&replaces_epoch.to_be_bytes());
        record.encode_into(&mut out);
        out
    }

    pub(crate) fn encode_replace(epoch: u64, token: u64, record: &Record) -> EncodedBytes {
        let mut out = EncodedBytes::with_capacity(
            OPERAND_HEADER_BYTES + 8 + RECORD_HEADER_BYTES_MAX + record.payload_len(),
        );
        out.push(OPERAND_FORMAT_VERSION);
        out.push(OPERAND_REPLACE);
        out.extend_from_slice(&epoch.to_be_bytes());
        out.extend_from_slice(&token.to_be_bytes());
        record.encode_into(&mut out);
        out
    }

    /// Decodes an operand and validates the record inside it.
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
        let mut fields = Reader { bytes, at: 2 };
        let epoch = fields.u64();
        match bytes[1] {
            OPERAND_INSTALL => {
                let record_bytes = &bytes[OPERAND_HEADER_BYTES..];
                let header = RecordHeader::decode(record_bytes)?;
                if header.epoch != epoch.wrapping_add(1) {
                    return Err(DecodeError::Invalid {
                        reason: "install operand epoch is not replaces_epoch + 1",
                    });
                }
                Ok(Operand::Install {
                    replaces_epoch: epoch,
                    record_bytes,
                })
            }
            OPERAND_REPLACE => {
                if bytes.len() < OPERAND_HEADER_BYTES + 8 {
                    return Err(DecodeError::Truncated {
                        needed: OPERAND_HEADER_BYTES + 8,
                        available: bytes.len(),
                    });
                }
                let token = fields.u64();
                let record_bytes = &bytes[OPERAND_HEADER_BYTES + 8..];
                let header = RecordHeader::decode(record_bytes)?;
                if header.epoch != epoch {
                    return Err(DecodeError::Invalid {
                        reason: "replace operand changes the epoch",
                    });
                }
                Ok(Operand::Replace {
                    epoch,
                    token,
                    record_bytes,
                })
            }
            tag => Err(DecodeError::UnknownTag {
                what: "operand kind",
                tag,
            }),
        }
    }
}
