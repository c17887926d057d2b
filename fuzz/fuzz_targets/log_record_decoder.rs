//! The commit log's record and segment-header decoders on arbitrary bytes: never panic; a
//! record read is exactly one that encodes to the bytes it took, at the LSN expected; a segment
//! header read re-encodes to its bytes.
#![no_main]

use idemdb::format::{
    LogRead, LogSegmentHeader, encode_log_record, read_log_record, read_log_records,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The LSN expected is the input's first 8 bytes.
    let expected = data
        .first_chunk::<8>()
        .map_or(0, |bytes| u64::from_le_bytes(*bytes));
    let body = data.get(8..).unwrap_or_default();
    if let LogRead::Record { payload, length } = read_log_record(body, expected) {
        let mut again = Vec::new();
        encode_log_record(expected, payload, &mut again);
        assert_eq!(&again[..], &body[..length], "a record read re-encodes to its bytes");
    }
    let (records, _) = read_log_records(body, expected);
    for (index, (lsn, _)) in records.iter().enumerate() {
        assert_eq!(*lsn, expected + index as u64, "records come in LSN order, none skipped");
    }
    if let Some(header) = LogSegmentHeader::decode(data) {
        assert_eq!(&header.encode()[..], &data[..32]);
    }
});
