//! The composite-key codec: encoding (consumer id, message key) into the stored key, decoding it
//! back, and the derived keys for side effects.
//!
//! Run with `cargo bench --bench key_codec`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use idemdb::format::{decode_key, derive_key, encode_key};

fn key_codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("key_codec");
    group.bench_function("encode_16B", |b| {
        b.iter(|| encode_key(black_box(b"billing"), black_box(b"order-0000000001")))
    });
    let stored = encode_key(b"billing", b"order-0000000001").unwrap();
    group.bench_function("decode_16B", |b| b.iter(|| decode_key(black_box(&stored))));
    group.bench_function("derive_key", |b| {
        b.iter(|| derive_key(black_box(&stored), black_box("charge")))
    });
    group.bench_function("cloudevents_key", |b| {
        b.iter(|| {
            idemdb::cloudevents_key(
                black_box("https://shop.example/orders"),
                black_box("A234-1234-1234"),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, key_codec);
criterion_main!(benches);
