//! Claim paths: claim + commit of unique keys, and the duplicate lookup.
//!
//! Run with `cargo bench --bench claim`. Durability is `Buffered` (WAL written, not fsynced) so
//! the figures show the engine's own cost; an fsync per commit would dominate and measure the
//! disk instead.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use idemdb::{Durability, Engine, Fingerprint, Outcome, TableOptions};

fn open(dir: &std::path::Path) -> Engine {
    Engine::builder(dir)
        .durability(Durability::Buffered)
        .business_table(TableOptions::new("orders"))
        .open()
        .expect("open bench store")
}

fn claim_commit_unique(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path());
    let consumer = engine.consumer("bench").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let value = [7u8; 64];
    let mut next = 0u64;
    let mut group = c.benchmark_group("claim");
    group.throughput(Throughput::Elements(1));
    group.bench_function("claim_commit_unique_with_one_put", |b| {
        b.iter(|| {
            next += 1;
            let key = next.to_be_bytes();
            let Outcome::Fresh(mut claim) = consumer.begin(key, Fingerprint::of(key)).unwrap()
            else {
                panic!("unique keys are fresh");
            };
            claim.put(&orders, key, value).unwrap();
            black_box(claim.commit(b"ok").unwrap());
        });
    });
    group.finish();
}

fn duplicate_lookup(c: &mut Criterion) {
    const KEYS: u64 = 100_000;
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path());
    let consumer = engine.consumer("bench").unwrap();
    for key in 0..KEYS {
        let key = key.to_be_bytes();
        let Outcome::Fresh(claim) = consumer.begin(key, Fingerprint::of(key)).unwrap() else {
            panic!("unique keys are fresh");
        };
        claim.commit(b"stored result").unwrap();
    }
    let mut group = c.benchmark_group("claim");
    group.throughput(Throughput::Elements(1));
    let mut next = 0u64;
    group.bench_function("duplicate_lookup", |b| {
        b.iter_batched(
            || {
                next = (next + 7919) % KEYS;
                next.to_be_bytes()
            },
            |key| {
                let outcome = consumer.begin(key, Fingerprint::of(key)).unwrap();
                assert!(matches!(outcome, Outcome::Duplicate { .. }));
                black_box(outcome)
            },
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

fn key_codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("codec");
    group.bench_function("encode_key_16B", |b| {
        b.iter(|| idemdb::format::encode_key(black_box(b"billing"), black_box(b"order-0000000001")))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5));
    targets = claim_commit_unique, duplicate_lookup, key_codec
}
criterion_main!(benches);
