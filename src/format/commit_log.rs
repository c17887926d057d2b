//! The commit log's on-disk format: segment headers and records. Durable commits are written
//! here before RocksDB (segments filled once, then rewritten in place as a ring); the log
//! itself is `storage/log/commit_log/`.
//!
//! A segment is a file of a fixed size, filled with zeros when it is made (written, not only
//! allocated, so that a later write never changes the file's size or its allocation and an
//! `fdatasync` writes data only). It starts with a header naming the log sequence number (LSN)
//! of its first record; records follow back to back:
//!
//! ```text
//! segment header (32 bytes): "IDEMLOG1" | segment number u64 LE | first LSN u64 LE | checksum u64 LE
//! record (24-byte header, then the payload):
//!     marker u32 LE | LSN u64 LE | payload length u32 LE | checksum u64 LE | payload
//! ```
//!
//! Both checksums are seeded xxh3-64 over every other field and the payload. A reader knows the
//! LSN it expects next, so the log ends at the first place that is not a whole record carrying
//! exactly that LSN: zeros (never written), a torn write (a checksum that does not match), or a
//! record left from an earlier lap of the ring (its LSN is an older one). The last case is why a
//! ring is safe here where RocksDB's recycled WAL was not: a stale record is never taken for a
//! new one, because its LSN is in its checksummed header and LSNs never repeat.

/// The fewest slots of a ring: one being written, one to switch to.
#[cfg(feature = "engine")]
pub(crate) const LOG_SLOTS_MIN: usize = 2;
/// The smallest segment: a header and a few records.
#[cfg(feature = "engine")]
pub(crate) const LOG_SEGMENT_BYTES_MIN: u64 = 64 << 10;

/// The bytes of a segment header.
pub const LOG_SEGMENT_HEADER_BYTES: usize = 32;
/// The bytes of a record's header.
pub const LOG_RECORD_HEADER_BYTES: usize = 24;
/// The most bytes one record's payload holds (a `u32` length, and less than 4 GiB).
pub const LOG_RECORD_PAYLOAD_MAX: usize = (u32::MAX - 1) as usize;

const SEGMENT_MAGIC: &[u8; 8] = b"IDEMLOG1";
/// Marks a record's start: never zero, so a zeroed (never written) place never reads as one.
const RECORD_MARKER: u32 = 0x1de3_c01e;
const SEGMENT_SEED: u64 = 0x05e9_3e47_1de3;
const RECORD_SEED: u64 = 0x004e_c0bd_1de3;

/// A segment's header: which segment of the log it is and the LSN of its first record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogSegmentHeader {
    /// Counts the segments the log has started, over every lap: never repeats.
    pub segment: u64,
    /// The LSN of the segment's first record.
    pub first_lsn: u64,
}

impl LogSegmentHeader {
    /// The header's bytes.
    #[must_use]
    pub fn encode(&self) -> [u8; LOG_SEGMENT_HEADER_BYTES] {
        let mut bytes = [0u8; LOG_SEGMENT_HEADER_BYTES];
        bytes[..8].copy_from_slice(SEGMENT_MAGIC);
        bytes[8..16].copy_from_slice(&self.segment.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.first_lsn.to_le_bytes());
        let checksum = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[..24], SEGMENT_SEED);
        bytes[24..32].copy_from_slice(&checksum.to_le_bytes());
        bytes
    }

    /// The header at the start of `bytes`, or `None` if there is none there (zeros, a torn
    /// write, anything else).
    #[must_use]
    pub fn decode(bytes: &[u8]) -> Option<LogSegmentHeader> {
        let bytes = bytes.get(..LOG_SEGMENT_HEADER_BYTES)?;
        if &bytes[..8] != SEGMENT_MAGIC {
            return None;
        }
        let checksum = u64::from_le_bytes(bytes[24..32].try_into().ok()?);
        if checksum != xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[..24], SEGMENT_SEED) {
            return None;
        }
        Some(LogSegmentHeader {
            segment: u64::from_le_bytes(bytes[8..16].try_into().ok()?),
            first_lsn: u64::from_le_bytes(bytes[16..24].try_into().ok()?),
        })
    }
}

/// The checksum of a record: its LSN, its length and its payload.
fn record_checksum(lsn: u64, payload: &[u8]) -> u64 {
    let mut head = [0u8; 12];
    head[..8].copy_from_slice(&lsn.to_le_bytes());
    head[8..].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    let seed = xxhash_rust::xxh3::xxh3_64_with_seed(&head, RECORD_SEED);
    xxhash_rust::xxh3::xxh3_64_with_seed(payload, seed)
}

/// Appends the record of `payload` at `lsn` to `out`.
///
/// # Panics
/// Never for a payload of at most [`LOG_RECORD_PAYLOAD_MAX`] bytes, which the caller checks
/// (the log refuses a larger batch before anything is written).
pub fn encode_log_record(lsn: u64, payload: &[u8], out: &mut Vec<u8>) {
    let length = u32::try_from(payload.len())
        .ok()
        .filter(|&length| length as usize <= LOG_RECORD_PAYLOAD_MAX)
        .expect("payload length checked by the caller");
    out.reserve(LOG_RECORD_HEADER_BYTES + payload.len());
    out.extend_from_slice(&RECORD_MARKER.to_le_bytes());
    out.extend_from_slice(&lsn.to_le_bytes());
    out.extend_from_slice(&length.to_le_bytes());
    out.extend_from_slice(&record_checksum(lsn, payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// What is at a place of the log where a record with a given LSN is expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogRead<'a> {
    /// The record expected: its payload, and the bytes it takes (header and payload).
    Record {
        /// The record's payload.
        payload: &'a [u8],
        /// The bytes the record takes: the next one starts this far on.
        length: usize,
    },
    /// The log ends here.
    End(LogEnd),
}

/// Why the log ends where it does. Every one is a normal end after a crash or a power cut; a
/// reader treats them alike, and tests and tools tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogEnd {
    /// Too few bytes left for a record header, or zeros: never written.
    Unwritten,
    /// A record header whose LSN is not the one expected: left from an earlier lap of the ring
    /// (or, with an LSN ahead, from a later write that the expected one never preceded).
    OtherLsn {
        /// The LSN found.
        found: u64,
    },
    /// A record whose bytes do not match its checksum, or whose length runs past the end:
    /// a write cut short by the crash.
    Torn,
    /// Bytes that are not a record header at all.
    Garbage,
}

/// Reads the record at the start of `bytes`, expecting `expected_lsn`. Never panics, whatever
/// the bytes.
#[must_use]
pub fn read_log_record(bytes: &[u8], expected_lsn: u64) -> LogRead<'_> {
    let Some(header) = bytes.get(..LOG_RECORD_HEADER_BYTES) else {
        return LogRead::End(LogEnd::Unwritten);
    };
    let field = |range: std::ops::Range<usize>| &header[range];
    let marker = u32::from_le_bytes(field(0..4).try_into().expect("4 bytes"));
    if marker != RECORD_MARKER {
        return LogRead::End(if header.iter().all(|&byte| byte == 0) {
            LogEnd::Unwritten
        } else {
            LogEnd::Garbage
        });
    }
    let lsn = u64::from_le_bytes(field(4..12).try_into().expect("8 bytes"));
    let length = u32::from_le_bytes(field(12..16).try_into().expect("4 bytes")) as usize;
    let checksum = u64::from_le_bytes(field(16..24).try_into().expect("8 bytes"));
    let Some(payload) = bytes
        .get(LOG_RECORD_HEADER_BYTES..)
        .and_then(|rest| rest.get(..length))
    else {
        return LogRead::End(LogEnd::Torn);
    };
    if checksum != record_checksum(lsn, payload) {
        return LogRead::End(LogEnd::Torn);
    }
    if lsn != expected_lsn {
        return LogRead::End(LogEnd::OtherLsn { found: lsn });
    }
    LogRead::Record {
        payload,
        length: LOG_RECORD_HEADER_BYTES + length,
    }
}

/// Every record of a segment's body (`bytes`, after its header) from `first_lsn` on, in order,
/// up to where the log ends, and why it ends there.
#[must_use]
pub fn read_log_records(bytes: &[u8], first_lsn: u64) -> (Vec<(u64, &[u8])>, LogEnd) {
    let mut records = Vec::new();
    let mut at = 0;
    let mut lsn = first_lsn;
    loop {
        match read_log_record(&bytes[at..], lsn) {
            LogRead::Record { payload, length } => {
                records.push((lsn, payload));
                at += length;
                // LSNs never reach the end of u64; a reader of arbitrary bytes may.
                let Some(next) = lsn.checked_add(1) else {
                    return (records, LogEnd::Unwritten);
                };
                lsn = next;
            }
            LogRead::End(end) => return (records, end),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(first_lsn: u64, payloads: &[&[u8]]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for (index, payload) in payloads.iter().enumerate() {
            encode_log_record(first_lsn + index as u64, payload, &mut bytes);
        }
        bytes
    }

    #[test]
    fn records_round_trip_and_end_at_zeros() {
        let mut bytes = log_of(7, &[b"one", b"", b"three"]);
        bytes.resize(bytes.len() + 100, 0);
        let (records, end) = read_log_records(&bytes, 7);
        assert_eq!(
            records,
            vec![(7, &b"one"[..]), (8, &b""[..]), (9, &b"three"[..])]
        );
        assert_eq!(end, LogEnd::Unwritten);
    }

    #[test]
    fn a_torn_record_ends_the_log_wherever_it_is_cut() {
        let whole = log_of(1, &[b"first", b"second record"]);
        let first_len = LOG_RECORD_HEADER_BYTES + 5;
        for cut in first_len + 1..whole.len() {
            let mut torn = whole[..cut].to_vec();
            // The rest of the place: zeros (never written) after the cut.
            torn.resize(whole.len() + 8, 0);
            let (records, end) = read_log_records(&torn, 1);
            assert_eq!(records.len(), 1, "cut at {cut}");
            assert!(
                matches!(end, LogEnd::Torn | LogEnd::Unwritten | LogEnd::Garbage),
                "{end:?}"
            );
        }
    }

    #[test]
    fn a_flipped_byte_is_never_read_as_the_record() {
        let whole = log_of(3, &[b"payload bytes"]);
        for index in 0..whole.len() {
            let mut damaged = whole.clone();
            damaged[index] ^= 0x01;
            assert!(
                !matches!(read_log_record(&damaged, 3), LogRead::Record { .. }),
                "byte {index}"
            );
        }
    }

    #[test]
    fn a_record_from_an_earlier_lap_is_not_the_one_expected() {
        // The ring wrote LSNs 10..=12 here on its last lap; this lap wrote 40 over the first.
        let mut place = log_of(10, &[b"old-a", b"old-b", b"old-c"]);
        let mut new = Vec::new();
        encode_log_record(40, b"new-a", &mut new);
        place[..new.len()].copy_from_slice(&new);
        // "new-a" is as long as "old-a": the next header is the stale LSN 11.
        let (records, end) = read_log_records(&place, 40);
        assert_eq!(records, vec![(40, &b"new-a"[..])]);
        assert_eq!(end, LogEnd::OtherLsn { found: 11 });
    }

    #[test]
    fn the_fuzz_seeds_hold_what_their_names_say() {
        // Written by hand (fuzz/corpus/log_record_decoder): a fuzzer does not find a checksum.
        let two = include_bytes!("../../fuzz/corpus/log_record_decoder/two-records");
        let (records, end) = read_log_records(&two[8..], 7);
        assert_eq!(
            records,
            vec![(7, &b"first payload"[..]), (8, &b"second"[..])]
        );
        assert_eq!(end, LogEnd::Unwritten);
        let stale = include_bytes!("../../fuzz/corpus/log_record_decoder/stale-next");
        let (records, end) = read_log_records(&stale[8..], 40);
        assert_eq!(records.len(), 1);
        assert_eq!(end, LogEnd::OtherLsn { found: 11 });
        let header = include_bytes!("../../fuzz/corpus/log_record_decoder/segment-header");
        assert_eq!(
            LogSegmentHeader::decode(header),
            Some(LogSegmentHeader {
                segment: 3,
                first_lsn: 100
            })
        );
    }

    #[test]
    fn segment_headers_round_trip_and_reject_damage() {
        let header = LogSegmentHeader {
            segment: 12,
            first_lsn: 1 << 40,
        };
        let bytes = header.encode();
        assert_eq!(LogSegmentHeader::decode(&bytes), Some(header));
        for index in 0..bytes.len() {
            let mut damaged = bytes;
            damaged[index] ^= 0x80;
            assert_eq!(LogSegmentHeader::decode(&damaged), None, "byte {index}");
        }
        assert_eq!(
            LogSegmentHeader::decode(&[0; LOG_SEGMENT_HEADER_BYTES]),
            None
        );
        assert_eq!(LogSegmentHeader::decode(&bytes[..31]), None);
    }
}
