//! The two-phase path for side effects outside the batch: `begin_external` (writes an
//! in-progress record with a lease) then `complete` (replaces it, fenced by epoch and token).
//! Two write batches per message, against one for a transactional claim.
//!
//! Run with `cargo bench --bench external`.

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use idemdb::{Fingerprint, Outcome};

fn begin_complete(c: &mut Criterion) {
    let store = common::open();
    let consumer = store.engine.consumer("bench").unwrap();
    let mut next = 0u64;
    let mut group = c.benchmark_group("external");
    group.throughput(Throughput::Elements(1));
    group.bench_function("begin_external_complete", |b| {
        b.iter(|| {
            next += 1;
            let key = common::key(next);
            let outcome = consumer
                .begin_external(key, Fingerprint::of(key), Duration::from_secs(30), b"bench")
                .unwrap();
            let Outcome::Fresh(claim) = outcome else {
                panic!("unique keys are fresh");
            };
            black_box(claim.complete(b"ok").unwrap());
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5));
    targets = begin_complete
}
criterion_main!(benches);
