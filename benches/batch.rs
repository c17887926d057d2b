//! Batch claim + commit of unique keys, one staged put each, at batch sizes 1, 16, 64 and 256:
//! one multi-get and one write batch per batch. Throughput is per message.
//!
//! Run with `cargo bench --bench batch`.

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idemdb::{BatchOutcome, Fingerprint, Message};

fn batch_claim_commit(c: &mut Criterion) {
    let store = common::open();
    let consumer = store.engine.consumer("bench").unwrap();
    let orders = store.engine.business_table("orders").unwrap();
    let value = [7u8; 64];
    let mut next = 0u64;
    let mut group = c.benchmark_group("batch");
    for size in [1u64, 16, 64, 256] {
        group.throughput(Throughput::Elements(size));
        group.bench_with_input(BenchmarkId::new("claim_commit", size), &size, |b, &size| {
            b.iter(|| {
                let keys: Vec<[u8; 16]> = (0..size).map(|i| common::key(next + i)).collect();
                next += size;
                let messages: Vec<Message<'_>> = keys
                    .iter()
                    .map(|key| Message::new(key, Fingerprint::of(key)))
                    .collect();
                let mut batch = consumer.begin_batch(&messages).unwrap();
                for (index, key) in keys.iter().enumerate() {
                    assert!(matches!(batch.outcomes()[index], BatchOutcome::Fresh));
                    let claim = batch.claim_mut(index).expect("fresh claim");
                    claim.put(&orders, key, value).unwrap();
                }
                black_box(batch.commit(|_| b"ok").unwrap());
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5));
    targets = batch_claim_commit
}
criterion_main!(benches);
