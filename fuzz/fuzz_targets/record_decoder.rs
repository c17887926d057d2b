//! Record decoder (both formats), merge fold and compaction-filter decision on arbitrary bytes: never panic;
//! valid records round-trip; the filter removes only records that decode and that reads already
//! treat as absent, never an in-progress one.
#![no_main]

use idemdb::format::{FilterDecision, Record, RecordState, apply_operands, compaction_decision};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A record that decodes is canonical: it re-encodes, in the format it was read in (the
    // first byte), to exactly the input.
    if let Ok(record) = Record::decode(data) {
        let encoded = if data[0] == 1 {
            record.encode_v1()
        } else {
            record.encode()
        };
        assert_eq!(encoded, data);
    }

    // The filter's clock is the input's first 8 bytes.
    let now_ms = data
        .first_chunk::<8>()
        .map_or(0, |bytes| u64::from_be_bytes(*bytes));
    if compaction_decision(data, now_ms) == FilterDecision::Remove {
        let record = Record::decode(data).expect("removed values decode");
        assert!(
            record.is_absent_at(now_ms),
            "removed a record reads still see"
        );
        assert!(
            !matches!(record.state, RecordState::InProgress { .. }),
            "removed an in-progress record"
        );
    }

    // The merge fold over arbitrary existing values and operands never panics, and its result
    // is either one of its inputs' records or empty.
    let mut parts = data.split(|&byte| byte == 0xff);
    let existing = parts.next();
    let operands: Vec<&[u8]> = parts.collect();
    let merged = apply_operands(existing, operands.iter().copied());
    if !merged.is_empty() && Some(&merged[..]) != existing {
        Record::decode(&merged).expect("an installed record decodes");
    }
});
