//! The on-disk format, for tools, fuzzers and tests: key and record codecs and the compaction
//! filter's decision. Specified byte by byte in docs/design.md.
//!
//! The format layer, the lowest: keys, records and merge operands with their encodings, the
//! record state machine and the compaction filter's decision, messages, fingerprints, the
//! clock and the errors. It reads no disk and builds without RocksDB. (`merge_ops` and
//! `transfer` live here too, declared by the crate root to keep their public paths.)

pub(crate) mod clock;
pub(crate) mod commit_log;
pub(crate) mod error;
pub(crate) mod fingerprint;
pub(crate) mod key;
pub(crate) mod merge;
// The engine reads a message's fields; a backend without RocksDB reads them through its getters.
pub(crate) mod message;
pub(crate) mod operand;
pub(crate) mod position;
pub(crate) mod printable;
pub(crate) mod record;
pub(crate) mod ttl;
pub(crate) mod varint;

pub use commit_log::{
    LOG_RECORD_HEADER_BYTES, LOG_RECORD_PAYLOAD_MAX, LOG_SEGMENT_HEADER_BYTES, LogEnd, LogRead,
    LogSegmentHeader, encode_log_record, read_log_record, read_log_records,
};
pub use error::DecodeError;
pub use key::{decode_key, derive_key, encode_key};
pub use merge::apply_operands;
pub use operand::{encode_commit_operand, encode_replace_operand};
pub use position::{
    check_position_source, decode_position_key, decode_position_value, encode_position_value,
    fold_positions,
};
pub use printable::printable;
pub use record::{Record, RecordState};
pub use ttl::{FilterDecision, compaction_decision};
