//! Compaction-filter decision on arbitrary records and clocks: it never removes a record that a
//! read would still return (unexpired completed, or in progress whatever its lease), and it
//! never removes a value that does not decode.
#![no_main]

use idemdb::format::{FilterDecision, Record, RecordState, compaction_decision};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first 8 bytes are the filter's clock; the rest is the stored value.
    let Some((clock, value)) = data.split_first_chunk::<8>() else {
        return;
    };
    let now_ms = u64::from_be_bytes(*clock);
    if compaction_decision(value, now_ms) == FilterDecision::Keep {
        return;
    }
    let record = Record::decode(value).expect("the filter removed a value that does not decode");
    assert!(record.is_absent_at(now_ms), "removed a record reads still see: {record:?}");
    match record.state {
        RecordState::Completed { expires_at_ms, .. } => assert!(expires_at_ms <= now_ms),
        RecordState::Released { removable_at_ms, .. } => assert!(removable_at_ms <= now_ms),
        RecordState::InProgress { .. } => panic!("removed an in-progress record"),
        _ => {}
    }
});
