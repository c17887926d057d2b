//! Feature `transfer`: the export line, the one format in which every backend's records leave
//! and enter it (the `idemdb` operator tool's `export` and `import`, and idemdb-postgres's).
//!
//! An export line is one JSON object on one line: where the record is (`table`, and the
//! consumer and key, each as printable text and as exact hex) and what it holds (its state and
//! that state's fields, numbers as JSON integers, bytes as hex). Reading a line takes only the
//! exact fields (`*_hex`, numbers); the printable ones are for people. A line is checked when it
//! is read (limits, epoch, the fields its state needs), so a backend writes only what it could
//! have written itself.
//!
//! A log consumer's read position travels in the same stream as a line of its own kind,
//! `"kind":"position"` first, then the consumer (printable and exact hex), the source, the
//! partition, the offset of the last message committed and the time it moved
//! ([`PositionLine`]). Record lines carry no `kind`: they are the format's first lines and stay
//! as they were. A reader of this release refuses a line of a kind it does not know
//! ([`LineError::UnknownKind`]); a reader of a release before positions travelled refuses a
//! position line as malformed (it has no `table`), naming its line number, and writes
//! nothing: a position is never dropped on the way without a word. Every backend's export
//! writes its position lines after all its record lines, and every import writes them after
//! the records, so that a consumer resuming from an imported position finds the records of
//! every message before it.
//!
//! ```
//! use idemdb::format::Record;
//! use idemdb::transfer::{CONSUMERS_TABLE, ExportLine};
//! use idemdb::Fingerprint;
//!
//! let record = Record::new(1, 1_000, 2_000, Fingerprint::of(b"body"), "accepted".into());
//! let line = ExportLine::of(CONSUMERS_TABLE, Some(b"billing"), b"order-7", &record);
//! let mut text = Vec::new();
//! line.write_to(&mut text)?;
//! let read = ExportLine::parse(std::str::from_utf8(&text)?)?;
//! assert_eq!((read.consumer(), read.key()), (Some(&b"billing"[..]), &b"order-7"[..]));
//! assert_eq!(read.record(), &record);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A stream of both kinds, read back as [`read_lines`] reads an import:
//!
//! ```
//! use idemdb::format::Record;
//! use idemdb::transfer::{CONSUMERS_TABLE, ExportLine, PositionLine, read_lines};
//! use idemdb::{Fingerprint, Position};
//!
//! let record = Record::new(1, 1_000, 2_000, Fingerprint::of(b"body"), "accepted".into());
//! let mut text = Vec::new();
//! ExportLine::of(CONSUMERS_TABLE, Some(b"billing"), b"order-7", &record).write_to(&mut text)?;
//! PositionLine::of(b"billing", &Position::new("orders", 3, 41, 1_000)).write_to(&mut text)?;
//! let lines = read_lines(&text[..])?;
//! assert_eq!(lines.records.len(), 1);
//! let (line, moved) = &lines.positions[0];
//! assert_eq!((*line, moved.consumer()), (2, &b"billing"[..]));
//! assert_eq!(moved.position().next_offset(), 42);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io::{self, BufRead, Write};

use bytes::Bytes;
use hex::FromHex;
use serde::{Deserialize, Serialize};

use crate::format::fingerprint::Fingerprint;
use crate::format::key::{RECORDS_TABLE, check_message_key, consumer_prefix};
use crate::format::position::{Position, check_position_source};
use crate::format::printable::printable;
use crate::format::record::{Record, RecordState, check_given_record};

/// The table of consumers' records, as export lines name it (`idemdb.records`). Entity tables
/// are named by their own names.
pub const CONSUMERS_TABLE: &str = RECORDS_TABLE;

/// Where an export line's record is: the table, and the consumer (consumers' table only) and
/// key, each printable and as exact hex.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineKey {
    table: String,
    consumer: Option<String>,
    consumer_hex: Option<String>,
    key: String,
    key_hex: String,
}

impl LineKey {
    /// The place of `key` in `table`, of `consumer` when it is the consumers' table.
    #[must_use]
    pub fn new(table: &str, consumer: Option<&[u8]>, key: &[u8]) -> LineKey {
        LineKey {
            table: table.to_owned(),
            consumer: consumer.map(printable),
            consumer_hex: consumer.map(hex::encode),
            key: printable(key),
            key_hex: hex::encode(key),
        }
    }
}

/// What an export line's record holds: `state` (`completed`, `in_progress` or `released`) and
/// that state's fields. Other documents (the operator tool's `get` and `list`) also use the
/// state `corrupt`, with no fields, for a value that does not decode.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineRecord {
    state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    epoch: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fingerprint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    committed_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    succeeded: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result_hex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    since_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lease_until_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    holder_hex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    token: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    released_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    removable_at_ms: Option<u64>,
}

impl LineRecord {
    /// The fields of a decoded record.
    #[must_use]
    pub fn of(record: &Record) -> LineRecord {
        let mut line = LineRecord {
            epoch: Some(record.epoch),
            fingerprint: Some(record.fingerprint.to_string()),
            ..LineRecord::default()
        };
        line.state = match &record.state {
            RecordState::Completed {
                committed_at_ms,
                expires_at_ms,
                result,
                succeeded,
            } => {
                line.committed_at_ms = Some(*committed_at_ms);
                line.expires_at_ms = Some(*expires_at_ms);
                line.succeeded = Some(*succeeded);
                line.result = Some(printable(result));
                line.result_hex = Some(hex::encode(result));
                "completed"
            }
            RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                token,
            } => {
                line.holder = Some(printable(holder));
                line.holder_hex = Some(hex::encode(holder));
                line.token = Some(*token);
                line.since_ms = Some(*since_ms);
                line.lease_until_ms = Some(*lease_until_ms);
                "in_progress"
            }
            RecordState::Released {
                released_at_ms,
                removable_at_ms,
            } => {
                line.released_at_ms = Some(*released_at_ms);
                line.removable_at_ms = Some(*removable_at_ms);
                "released"
            }
        }
        .to_owned();
        line
    }

    /// A value that does not decode: state `corrupt`, no fields (never an export line).
    #[must_use]
    pub fn corrupt() -> LineRecord {
        LineRecord {
            state: "corrupt".to_owned(),
            ..LineRecord::default()
        }
    }

    /// The record these fields describe.
    fn to_record(&self) -> Result<Record, LineError> {
        let epoch = required(self.epoch, "epoch")?;
        let fingerprint = required(self.fingerprint.as_deref(), "fingerprint")?;
        // Written in the fingerprint's Display form: 32 hex digits, most significant first.
        let fingerprint = <[u8; 16]>::from_hex(fingerprint)
            .map(|bytes| Fingerprint::from_u128(u128::from_be_bytes(bytes)))
            .map_err(|_| LineError::BadFingerprint)?;
        let state = match self.state.as_str() {
            "completed" => RecordState::Completed {
                committed_at_ms: required(self.committed_at_ms, "committed_at_ms")?,
                expires_at_ms: required(self.expires_at_ms, "expires_at_ms")?,
                result: required_bytes(self.result_hex.as_deref(), "result_hex")?,
                succeeded: required(self.succeeded, "succeeded")?,
            },
            "in_progress" => RecordState::InProgress {
                since_ms: required(self.since_ms, "since_ms")?,
                lease_until_ms: required(self.lease_until_ms, "lease_until_ms")?,
                holder: required_bytes(self.holder_hex.as_deref(), "holder_hex")?,
                token: required(self.token, "token")?,
            },
            "released" => RecordState::Released {
                released_at_ms: required(self.released_at_ms, "released_at_ms")?,
                removable_at_ms: required(self.removable_at_ms, "removable_at_ms")?,
            },
            other => {
                return Err(LineError::UnknownState {
                    state: other.to_owned(),
                });
            }
        };
        check_given_record(epoch, &state)?;
        Ok(Record {
            epoch,
            fingerprint,
            state,
        })
    }
}

/// One line of an export: a [`LineKey`] and a [`LineRecord`], their fields side by side in one
/// JSON object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportLine {
    #[serde(flatten)]
    key: LineKey,
    #[serde(flatten)]
    record: LineRecord,
}

impl ExportLine {
    /// The line of `record`, stored under `key` in `table` (of `consumer` when it is
    /// [`CONSUMERS_TABLE`]).
    #[must_use]
    pub fn of(table: &str, consumer: Option<&[u8]>, key: &[u8], record: &Record) -> ExportLine {
        ExportLine {
            key: LineKey::new(table, consumer, key),
            record: LineRecord::of(record),
        }
    }

    /// Writes the line: compact JSON and a newline.
    ///
    /// # Errors
    /// What `out` returns.
    pub fn write_to(&self, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
        serde_json::to_writer(&mut *out, self).map_err(io::Error::from)?;
        out.write_all(b"\n")
    }

    /// Reads one line (without its newline) and checks it.
    ///
    /// # Errors
    /// [`LineError`]: not a JSON object of this shape, a field its state needs missing or not
    /// hex, a state that cannot be written, or a value outside the limits.
    pub fn parse(text: &str) -> Result<TransferRecord, LineError> {
        let line: ExportLine = serde_json::from_str(text).map_err(|error| LineError::Json {
            reason: error.to_string(),
        })?;
        line.into_record()
    }

    /// The record this line describes, checked: the exact fields only (`*_hex`, numbers).
    ///
    /// # Errors
    /// As for [`ExportLine::parse`].
    pub fn into_record(self) -> Result<TransferRecord, LineError> {
        let key = unhex(&self.key.key_hex, "key_hex")?;
        let consumer = match &self.key.consumer_hex {
            Some(consumer) => Some(unhex(consumer, "consumer_hex")?),
            None => None,
        };
        let record = self.record.to_record()?;
        TransferRecord::new(self.key.table, consumer, key, record).map_err(LineError::from)
    }
}

/// A record read from an export line and checked: the consumer id and key within their
/// limits, an epoch from 1, a result and a holder within theirs. Which tables and consumers a
/// backend accepts is the backend's to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferRecord {
    table: String,
    consumer: Option<Vec<u8>>,
    key: Vec<u8>,
    record: Record,
}

impl TransferRecord {
    /// Checks and keeps a record of `key` in `table` (of `consumer` in the consumers' table).
    ///
    /// # Errors
    /// [`crate::Error::LimitExceeded`] for a consumer id, key, result or holder outside its
    /// limits; [`crate::Error::InvalidArgument`] for epoch 0.
    pub fn new(
        table: impl Into<String>,
        consumer: Option<Vec<u8>>,
        key: Vec<u8>,
        record: Record,
    ) -> crate::format::error::Result<TransferRecord> {
        if let Some(consumer) = &consumer {
            consumer_prefix(consumer)?;
        }
        check_message_key(&key)?;
        check_given_record(record.epoch, &record.state)?;
        Ok(TransferRecord {
            table: table.into(),
            consumer,
            key,
            record,
        })
    }

    /// The table the record was exported from.
    #[must_use]
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The consumer id (records of the consumers' table), if any.
    #[must_use]
    pub fn consumer(&self) -> Option<&[u8]> {
        self.consumer.as_deref()
    }

    /// The message key (an entity key in an entity table).
    #[must_use]
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The record, exactly as exported (epoch, timestamps, token).
    #[must_use]
    pub fn record(&self) -> &Record {
        &self.record
    }

    /// The line that exports this record.
    #[must_use]
    pub fn to_line(&self) -> ExportLine {
        ExportLine::of(
            &self.table,
            self.consumer.as_deref(),
            &self.key,
            &self.record,
        )
    }
}

/// The `kind` of a read position's line. Record lines have no `kind`.
pub const POSITION_KIND: &str = "position";

/// One line of an export holding a log consumer's read position: `kind` (always
/// [`POSITION_KIND`], written first), the consumer, printable and as exact hex, and the
/// position's source, partition, offset (of the last message committed) and time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PositionLine {
    kind: String,
    consumer: String,
    consumer_hex: String,
    source: String,
    partition: u32,
    offset: u64,
    updated_at_ms: u64,
}

impl PositionLine {
    /// The line of `consumer`'s `position`.
    #[must_use]
    pub fn of(consumer: &[u8], position: &Position) -> PositionLine {
        PositionLine {
            kind: POSITION_KIND.to_owned(),
            consumer: printable(consumer),
            consumer_hex: hex::encode(consumer),
            source: position.source.clone(),
            partition: position.partition,
            offset: position.offset,
            updated_at_ms: position.updated_at_ms,
        }
    }

    /// Writes the line: compact JSON and a newline.
    ///
    /// # Errors
    /// What `out` returns.
    pub fn write_to(&self, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
        serde_json::to_writer(&mut *out, self).map_err(io::Error::from)?;
        out.write_all(b"\n")
    }

    /// The position this line describes, checked: the exact consumer (`consumer_hex`) and a
    /// source within the limits every backend keeps.
    ///
    /// # Errors
    /// [`LineError::NotHex`] for `consumer_hex`; [`LineError::Invalid`] for a consumer id or a
    /// source outside its limits, or a source containing NUL.
    pub fn into_position(self) -> Result<TransferPosition, LineError> {
        let consumer = unhex(&self.consumer_hex, "consumer_hex")?;
        let position = Position::new(self.source, self.partition, self.offset, self.updated_at_ms);
        TransferPosition::new(consumer, position).map_err(LineError::from)
    }
}

/// A read position read from a position line and checked: the consumer id and the source
/// within their limits. Any offset is taken here; a backend that stores fewer (PostgreSQL's
/// `bigint`) refuses the rest when it imports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferPosition {
    consumer: Vec<u8>,
    position: Position,
}

impl TransferPosition {
    /// Checks and keeps `consumer`'s `position`.
    ///
    /// # Errors
    /// [`crate::Error::LimitExceeded`] for a consumer id or source outside its limits;
    /// [`crate::Error::InvalidArgument`] for a source containing NUL.
    pub fn new(
        consumer: Vec<u8>,
        position: Position,
    ) -> crate::format::error::Result<TransferPosition> {
        consumer_prefix(&consumer)?;
        check_position_source(&position.source)?;
        Ok(TransferPosition { consumer, position })
    }

    /// The consumer id.
    #[must_use]
    pub fn consumer(&self) -> &[u8] {
        &self.consumer
    }

    /// The position, exactly as exported (offset and time).
    #[must_use]
    pub fn position(&self) -> &Position {
        &self.position
    }

    /// The line that exports this position.
    #[must_use]
    pub fn to_line(&self) -> PositionLine {
        PositionLine::of(&self.consumer, &self.position)
    }
}

/// One line of an export read and checked: a record or a read position.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferLine {
    /// A record line (no `kind`).
    Record(TransferRecord),
    /// A read position's line (`"kind":"position"`).
    Position(TransferPosition),
}

/// Reads one line of either kind (without its newline) and checks it: a line without `kind`
/// is a record ([`ExportLine::parse`]), one of kind [`POSITION_KIND`] a read position.
///
/// # Errors
/// [`LineError::UnknownKind`] for another kind; otherwise what reading a line of its kind
/// returns.
pub fn parse_line(text: &str) -> Result<TransferLine, LineError> {
    /// Only the kind: every other field is passed over.
    #[derive(Deserialize)]
    struct Kind {
        #[serde(default)]
        kind: Option<String>,
    }
    let json = |error: serde_json::Error| LineError::Json {
        reason: error.to_string(),
    };
    let Kind { kind } = serde_json::from_str(text).map_err(json)?;
    match kind.as_deref() {
        None => ExportLine::parse(text).map(TransferLine::Record),
        Some(POSITION_KIND) => serde_json::from_str::<PositionLine>(text)
            .map_err(json)?
            .into_position()
            .map(TransferLine::Position),
        Some(other) => Err(LineError::UnknownKind {
            kind: other.to_owned(),
        }),
    }
}

/// The lines of an input read and checked ([`read_lines`]), each with its line number (from
/// 1), in the input's order within its kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferLines {
    /// The record lines.
    pub records: Vec<(u64, TransferRecord)>,
    /// The read positions' lines.
    pub positions: Vec<(u64, TransferPosition)>,
}

/// Why an export line cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LineError {
    /// Not UTF-8 text: no export line is.
    #[error("not UTF-8 text")]
    NotUtf8,
    /// Not a JSON object with an export line's fields.
    #[error("{reason}")]
    Json {
        /// What the JSON parser said.
        reason: String,
    },
    /// A field the line's state needs is missing.
    #[error("missing {field:?}")]
    MissingField {
        /// The field's name.
        field: &'static str,
    },
    /// A `*_hex` field holds something other than hex digits.
    #[error("{field:?} is not hex")]
    NotHex {
        /// The field's name.
        field: &'static str,
    },
    /// `fingerprint` is not 32 hex digits.
    #[error("\"fingerprint\" is not 32 hex digits")]
    BadFingerprint,
    /// A line of a kind this release does not know (a later release's): refused rather
    /// than passed over, so that nothing an export holds is lost on the way unseen.
    #[error("a line of kind {kind:?}, which this release cannot import")]
    UnknownKind {
        /// The kind the line names.
        kind: String,
    },
    /// A state no backend writes (`corrupt`, or one this release does not know).
    #[error("state {state:?} cannot be imported")]
    UnknownState {
        /// The state the line names.
        state: String,
    },
    /// A value outside the format's limits, or epoch 0.
    #[error(transparent)]
    Invalid(#[from] crate::format::error::Error),
}

/// Why the lines of an input cannot be read: the input failed, or a line is malformed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// Reading the input failed.
    #[error("reading the export lines: {0}")]
    Io(#[from] io::Error),
    /// A line is malformed.
    #[error("import line {line}: {error}")]
    Line {
        /// Its number, from 1 (blank lines count).
        line: u64,
        /// What is wrong with it.
        #[source]
        error: LineError,
    },
}

/// Reads every line of `input` and checks each, before the caller writes any: blank lines are
/// passed over; the first malformed one is the error, naming its line number. Records and read
/// positions are returned apart, each with its line number.
///
/// # Errors
/// [`ReadError`].
pub fn read_lines(input: impl BufRead) -> Result<TransferLines, ReadError> {
    let mut lines = TransferLines::default();
    for (index, text) in input.lines().enumerate() {
        let line = index as u64 + 1;
        let text = match text {
            Ok(text) => text,
            // Bytes that are not UTF-8 are the input's fault, not the reader's: a malformed
            // line, named, as any other.
            Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                return Err(ReadError::Line {
                    line,
                    error: LineError::NotUtf8,
                });
            }
            Err(error) => return Err(error.into()),
        };
        if text.trim().is_empty() {
            continue;
        }
        match parse_line(&text).map_err(|error| ReadError::Line { line, error })? {
            TransferLine::Record(record) => lines.records.push((line, record)),
            TransferLine::Position(position) => lines.positions.push((line, position)),
        }
    }
    Ok(lines)
}

/// A field a line must have for its state.
fn required<T>(value: Option<T>, field: &'static str) -> Result<T, LineError> {
    value.ok_or(LineError::MissingField { field })
}

/// The bytes of a `*_hex` field a line must have.
fn required_bytes(value: Option<&str>, field: &'static str) -> Result<Bytes, LineError> {
    unhex(required(value, field)?, field).map(Bytes::from)
}

/// The bytes a `*_hex` field spells.
fn unhex(digits: &str, field: &'static str) -> Result<Vec<u8>, LineError> {
    hex::decode(digits).map_err(|_| LineError::NotHex { field })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completed() -> Record {
        Record::new(
            3,
            10,
            20,
            Fingerprint::of(b"m"),
            Bytes::from_static(b"ok\n"),
        )
    }

    #[test]
    fn a_line_reads_back_as_its_record_and_its_fields_keep_their_order() {
        let line = ExportLine::of(CONSUMERS_TABLE, Some(b"c"), b"k\x00", &completed());
        let mut text = Vec::new();
        line.write_to(&mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.starts_with(
                "{\"table\":\"idemdb.records\",\"consumer\":\"c\",\"consumer_hex\":\"63\",\
                 \"key\":\"0x6b00\",\"key_hex\":\"6b00\",\"state\":\"completed\",\"epoch\":3,"
            ),
            "{text}"
        );
        assert!(text.ends_with("}\n"));
        let read = ExportLine::parse(text.trim_end()).unwrap();
        assert_eq!(read.record(), &completed());
        assert_eq!(read.to_line(), line);
    }

    #[test]
    fn every_state_keeps_every_field_through_a_line() {
        let mut failed = completed();
        failed.state = RecordState::Completed {
            committed_at_ms: 11,
            expires_at_ms: 21,
            result: Bytes::from_static(b"declined"),
            succeeded: false,
        };
        let mut in_progress = completed();
        in_progress.state = RecordState::InProgress {
            since_ms: 12,
            lease_until_ms: 22,
            holder: Bytes::from_static(b"worker-1"),
            token: 77,
        };
        let mut released = completed();
        released.state = RecordState::Released {
            released_at_ms: 13,
            removable_at_ms: 23,
        };
        let fields = |state: &[&'static str]| {
            let mut all = vec![
                "table",
                "consumer",
                "consumer_hex",
                "key",
                "key_hex",
                "state",
                "epoch",
                "fingerprint",
            ];
            all.extend_from_slice(state);
            all
        };
        for (record, state_fields) in [
            (
                failed,
                fields(&[
                    "committed_at_ms",
                    "expires_at_ms",
                    "succeeded",
                    "result",
                    "result_hex",
                ]),
            ),
            (
                in_progress,
                fields(&[
                    "since_ms",
                    "lease_until_ms",
                    "holder",
                    "holder_hex",
                    "token",
                ]),
            ),
            (released, fields(&["released_at_ms", "removable_at_ms"])),
        ] {
            let mut text = Vec::new();
            ExportLine::of(CONSUMERS_TABLE, Some(b"c"), b"k", &record)
                .write_to(&mut text)
                .unwrap();
            let text = String::from_utf8(text).unwrap();
            let object: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&text).unwrap();
            let written: Vec<&str> = object.keys().map(String::as_str).collect();
            let mut expected = state_fields.clone();
            expected.sort_unstable();
            let mut sorted = written.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, expected, "{text}");
            assert_eq!(
                ExportLine::parse(text.trim_end()).unwrap().record(),
                &record
            );
        }
    }

    #[test]
    fn malformed_lines_are_typed_errors() {
        let good = serde_json::to_value(ExportLine::of("t", None, b"k", &completed())).unwrap();
        let with = |field: &str, value: serde_json::Value| {
            let mut line = good.clone();
            line[field] = value;
            ExportLine::parse(&line.to_string())
        };
        assert!(matches!(
            ExportLine::parse("{"),
            Err(LineError::Json { .. })
        ));
        assert!(matches!(
            with("epoch", serde_json::Value::Null),
            Err(LineError::MissingField { field: "epoch" })
        ));
        assert!(matches!(
            with("key_hex", "zz".into()),
            Err(LineError::NotHex { field: "key_hex" })
        ));
        assert!(matches!(
            with("fingerprint", "12".into()),
            Err(LineError::BadFingerprint)
        ));
        assert!(matches!(
            with("state", "corrupt".into()),
            Err(LineError::UnknownState { .. })
        ));
        assert!(matches!(
            with("epoch", 0.into()),
            Err(LineError::Invalid(_))
        ));
        assert!(matches!(
            with("key_hex", "".into()),
            Err(LineError::Invalid(_))
        ));
        let lines = format!("{good}\n\n{{\"table\":\"t\"}}\n");
        match read_lines(lines.as_bytes()) {
            Err(ReadError::Line { line: 3, .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_position_line_reads_back_as_its_position_and_names_its_kind_first() {
        let position = Position::new("orders", 7, u64::MAX, 1_234);
        let mut text = Vec::new();
        PositionLine::of(b"c\x00", &position)
            .write_to(&mut text)
            .unwrap();
        let text = String::from_utf8(text).unwrap();
        assert_eq!(
            text,
            "{\"kind\":\"position\",\"consumer\":\"0x6300\",\"consumer_hex\":\"6300\",\
             \"source\":\"orders\",\"partition\":7,\"offset\":18446744073709551615,\
             \"updated_at_ms\":1234}\n"
        );
        match parse_line(text.trim_end()).unwrap() {
            TransferLine::Position(read) => {
                assert_eq!(
                    (read.consumer(), read.position()),
                    (&b"c\x00"[..], &position)
                );
                assert_eq!(read.to_line(), PositionLine::of(b"c\x00", &position));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_record_reader_refuses_a_position_line_and_unknown_kinds_are_refused() {
        let mut text = Vec::new();
        PositionLine::of(b"c", &Position::new("s", 0, 1, 2))
            .write_to(&mut text)
            .unwrap();
        let text = String::from_utf8(text).unwrap();
        // What an importer of a release before position lines runs: a typed refusal.
        assert!(matches!(
            ExportLine::parse(text.trim_end()),
            Err(LineError::Json { .. })
        ));
        let later = text.replace("\"position\"", "\"watermark\"");
        assert!(matches!(
            parse_line(later.trim_end()),
            Err(LineError::UnknownKind { kind }) if kind == "watermark"
        ));
        let position: serde_json::Value = serde_json::from_str(&text).unwrap();
        let with = |field: &str, value: serde_json::Value| {
            let mut line = position.clone();
            line[field] = value;
            parse_line(&line.to_string())
        };
        assert!(matches!(
            with("consumer_hex", "zz".into()),
            Err(LineError::NotHex {
                field: "consumer_hex"
            })
        ));
        assert!(matches!(
            with("consumer_hex", "".into()),
            Err(LineError::Invalid(_))
        ));
        assert!(matches!(
            with("source", "".into()),
            Err(LineError::Invalid(_))
        ));
        assert!(matches!(
            with("source", "s".repeat(256).into()),
            Err(LineError::Invalid(_))
        ));
        assert!(matches!(
            with("source", "a\u{0}b".into()),
            Err(LineError::Invalid(_))
        ));
        assert!(matches!(
            with("partition", (-1).into()),
            Err(LineError::Json { .. })
        ));
        assert!(matches!(
            with("partition", (u64::from(u32::MAX) + 1).into()),
            Err(LineError::Json { .. })
        ));
        assert!(matches!(
            with("offset", (-1).into()),
            Err(LineError::Json { .. })
        ));
        assert!(matches!(
            with("offset", serde_json::Value::Null),
            Err(LineError::Json { .. })
        ));
        assert!(matches!(parse_line("[]"), Err(LineError::Json { .. })));
        assert!(matches!(
            parse_line("{\"kind\":3}"),
            Err(LineError::Json { .. })
        ));
        let record = serde_json::to_value(ExportLine::of("t", None, b"k", &completed())).unwrap();
        let text = text.trim_end();
        let lines = format!("{text}\n{record}\n{text}");
        let read = read_lines(lines.as_bytes()).unwrap();
        assert_eq!(
            read.records
                .iter()
                .map(|(line, _)| *line)
                .collect::<Vec<_>>(),
            [2]
        );
        assert_eq!(
            read.positions
                .iter()
                .map(|(line, _)| *line)
                .collect::<Vec<_>>(),
            [1, 3]
        );
    }
}
