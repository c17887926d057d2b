//! The compaction filter's decision, which RocksDB calls once per record in every compaction:
//! an expired completed record (removed), a live one and an in-progress one (kept), and a value
//! that does not decode (kept as evidence).
//!
//! Run with `cargo bench --bench ttl`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use idemdb::Fingerprint;
use idemdb::format::{FilterDecision, Record, RecordState, compaction_decision};

const NOW_MS: u64 = 1_780_000_000_000;

fn ttl_decision(c: &mut Criterion) {
    let completed = |expires_at_ms| {
        Record::new(
            1,
            NOW_MS - 1000,
            expires_at_ms,
            Fingerprint::of(b"content"),
            Bytes::from_static(b"result"),
        )
        .encode()
    };
    // `Record` is non-exhaustive: build a completed one, then make it in progress.
    let mut in_progress = Record::new(
        1,
        NOW_MS - 60_000,
        NOW_MS + 1000,
        Fingerprint::of(b"content"),
        Bytes::new(),
    );
    in_progress.state = RecordState::InProgress {
        since_ms: NOW_MS - 60_000,
        lease_until_ms: NOW_MS - 30_000,
        holder: Bytes::from_static(b"worker-1"),
        token: 7,
    };
    let in_progress = in_progress.encode();
    let cases = [
        ("expired", completed(NOW_MS - 1), FilterDecision::Remove),
        ("live", completed(NOW_MS + 1000), FilterDecision::Keep),
        ("in_progress", in_progress, FilterDecision::Keep),
        ("corrupt", b"not a record".to_vec(), FilterDecision::Keep),
    ];
    let mut group = c.benchmark_group("ttl");
    for (name, value, expected) in cases {
        assert_eq!(compaction_decision(&value, NOW_MS), expected, "{name}");
        group.bench_with_input(BenchmarkId::new("decision", name), &value, |b, value| {
            b.iter(|| compaction_decision(black_box(value), black_box(NOW_MS)))
        });
    }
    group.finish();
}

criterion_group!(benches, ttl_decision);
criterion_main!(benches);
