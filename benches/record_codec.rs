//! The record codec: encoding and decoding a completed record (empty and 64-byte results), and
//! the merge fold of a commit operand over an in-progress record, as RocksDB's merge operator runs
//! it on reads and compactions.
//!
//! Run with `cargo bench --bench record_codec`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use idemdb::Fingerprint;
use idemdb::format::{Record, RecordState, apply_operands, encode_commit_operand};

const NOW_MS: u64 = 1_780_000_000_000;

fn completed(result_bytes: usize) -> Record {
    Record::new(
        1,
        NOW_MS,
        NOW_MS + 7 * 24 * 3600 * 1000,
        Fingerprint::of(b"content"),
        Bytes::from(vec![b'r'; result_bytes]),
    )
}

/// `Record` is non-exhaustive: build a completed one, then make it in progress.
fn in_progress_record() -> Record {
    let mut record = completed(0);
    record.state = RecordState::InProgress {
        since_ms: NOW_MS,
        lease_until_ms: NOW_MS + 30_000,
        holder: Bytes::from_static(b"worker-1"),
        token: 42,
    };
    record
}

fn record_codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("record_codec");
    for result_bytes in [0usize, 64] {
        let record = completed(result_bytes);
        group.bench_with_input(
            BenchmarkId::new("encode", result_bytes),
            &record,
            |b, record| b.iter(|| black_box(record).encode()),
        );
        let encoded = record.encode();
        group.bench_with_input(
            BenchmarkId::new("decode", result_bytes),
            &encoded,
            |b, encoded| b.iter(|| Record::decode(black_box(encoded)).unwrap()),
        );
    }

    let in_progress = in_progress_record().encode();
    let operand = encode_commit_operand(1, &completed(64));
    group.bench_function("merge_commit_over_in_progress", |b| {
        b.iter(|| apply_operands(Some(black_box(&in_progress[..])), [black_box(&operand[..])]))
    });
    group.finish();
}

criterion_group!(benches, record_codec);
criterion_main!(benches);
