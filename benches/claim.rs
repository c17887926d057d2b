//! The single-message claim paths: claim + commit of a unique key, a duplicate hit and a
//! conflict (a reused key with other content).
//!
//! Run with `cargo bench --bench claim`.

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use idemdb::{Fingerprint, Outcome};

/// Keys stored before the duplicate and conflict benches: enough that lookups leave the memtable
/// hot set, few enough to fill in a second.
const STORED: u64 = 100_000;

fn claim_commit_unique(c: &mut Criterion) {
    let store = common::open();
    let consumer = store.engine.consumer("bench").unwrap();
    let orders = store.engine.business_table("orders").unwrap();
    let value = [7u8; 64];
    let mut next = 0u64;
    let mut group = c.benchmark_group("claim");
    group.throughput(Throughput::Elements(1));
    group.bench_function("claim_commit_unique_with_one_put", |b| {
        b.iter(|| {
            next += 1;
            let key = common::key(next);
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

/// Looks up stored keys in a scattered order, with the stored fingerprint (`same_content`) or
/// another one, and checks every outcome is the expected kind.
fn lookup(c: &mut Criterion, name: &str, same_content: bool) {
    let store = common::open();
    common::fill(&store, "bench", STORED);
    let consumer = store.engine.consumer("bench").unwrap();
    let mut group = c.benchmark_group("claim");
    group.throughput(Throughput::Elements(1));
    let mut next = 0u64;
    group.bench_function(name, |b| {
        b.iter_batched(
            || {
                next = (next + 7919) % STORED;
                common::key(next)
            },
            |key| {
                let fingerprint = if same_content {
                    Fingerprint::of(key)
                } else {
                    Fingerprint::of(b"other content")
                };
                let outcome = consumer.begin(key, fingerprint).unwrap();
                match (&outcome, same_content) {
                    (Outcome::Duplicate { .. }, true) | (Outcome::Conflict { .. }, false) => {}
                    _ => panic!("unexpected outcome {outcome:?}"),
                }
                black_box(outcome)
            },
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

fn duplicate_hit(c: &mut Criterion) {
    lookup(c, "duplicate_hit", true);
}

fn conflict(c: &mut Criterion) {
    lookup(c, "conflict", false);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5));
    targets = claim_commit_unique, duplicate_hit, conflict
}
criterion_main!(benches);
