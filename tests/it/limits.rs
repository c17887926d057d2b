//! Guards every documented limit: each violation is its typed error naming the limit, never a
//! panic, and nothing is written.

use std::time::Duration;

use crate::util::TestStore;
use idemdb::{
    CONSUMER_ID_BYTES_MAX, Engine, Error, Expiry, Fingerprint, Limit, MESSAGE_KEY_BYTES_MAX,
    Outcome, RESULT_BYTES_MAX, STAGED_BYTES_MAX, STAGED_WRITES_MAX, TABLE_KEY_BYTES_MAX,
    TABLE_NAME_BYTES_MAX, TABLE_VALUE_BYTES_MAX, TABLES_MAX, TableOptions,
};

#[track_caller]
fn assert_limit<T: std::fmt::Debug>(result: Result<T, Error>, expected: Limit) {
    match result {
        Err(Error::LimitExceeded { limit, .. }) => assert_eq!(limit, expected),
        other => panic!("expected {expected:?} to be exceeded, got {other:?}"),
    }
}

#[test]
fn key_limits() {
    let store = TestStore::new();
    let engine = store.open();
    assert_limit(engine.consumer(""), Limit::ConsumerIdBytes);
    assert_limit(
        engine.consumer(&"c".repeat(CONSUMER_ID_BYTES_MAX + 1)),
        Limit::ConsumerIdBytes,
    );
    engine.consumer(&"c".repeat(CONSUMER_ID_BYTES_MAX)).unwrap();
    let consumer = engine.consumer("c").unwrap();
    let fp = Fingerprint::of(b"");
    assert_limit(consumer.begin(b"", fp), Limit::MessageKeyBytes);
    assert_limit(
        consumer.begin(vec![1u8; MESSAGE_KEY_BYTES_MAX + 1], fp),
        Limit::MessageKeyBytes,
    );
    assert_limit(
        consumer.get(vec![1u8; MESSAGE_KEY_BYTES_MAX + 1]),
        Limit::MessageKeyBytes,
    );
    let customers = engine.entity_table("customers").unwrap();
    assert_limit(customers.begin(b"", fp), Limit::MessageKeyBytes);
    let Outcome::Fresh(_) = consumer
        .begin(vec![1u8; MESSAGE_KEY_BYTES_MAX], fp)
        .unwrap()
    else {
        panic!("the longest key is allowed");
    };
}

#[test]
fn claim_limits() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let fp = Fingerprint::of(b"");
    let Outcome::Fresh(mut claim) = consumer.begin(b"k", fp).unwrap() else {
        panic!("fresh expected");
    };
    assert_limit(claim.put(&orders, b"", b"v"), Limit::TableKeyBytes);
    assert_limit(
        claim.put(&orders, vec![0u8; TABLE_KEY_BYTES_MAX + 1], b"v"),
        Limit::TableKeyBytes,
    );
    assert_limit(
        claim.put(&orders, b"k", vec![0u8; TABLE_VALUE_BYTES_MAX + 1]),
        Limit::TableValueBytes,
    );
    assert_limit(
        claim.set_expiry(Expiry::After(Duration::ZERO)),
        Limit::RetentionMs,
    );
    assert_limit(
        claim.set_expiry(Expiry::After(Duration::from_secs(20 * 365 * 24 * 3600))),
        Limit::RetentionMs,
    );
    assert_eq!(claim.staged_writes(), 0);

    // Staged bytes: four maximal values fill the budget; the next byte is refused.
    let big = vec![0u8; TABLE_VALUE_BYTES_MAX - 8];
    for i in 0..(STAGED_BYTES_MAX / TABLE_VALUE_BYTES_MAX) {
        claim.put(&orders, format!("big{i}"), &big).unwrap();
    }
    assert_limit(
        claim.put(&orders, b"one-more", vec![0u8; 64]),
        Limit::StagedBytes,
    );
    drop(claim);

    let Outcome::Fresh(mut claim) = consumer.begin(b"k", fp).unwrap() else {
        panic!("fresh expected");
    };
    for i in 0..STAGED_WRITES_MAX {
        claim.put(&orders, (i as u32).to_be_bytes(), b"").unwrap();
    }
    assert_limit(claim.put(&orders, b"x", b""), Limit::StagedWrites);
    drop(claim);

    let Outcome::Fresh(mut claim) = consumer.begin(b"k", fp).unwrap() else {
        panic!("fresh expected");
    };
    // Staged into the batch the commit would have written.
    claim.put(&orders, b"staged", b"v").unwrap();
    assert_limit(
        claim.commit(vec![0u8; RESULT_BYTES_MAX + 1]),
        Limit::ResultBytes,
    );
    // The failed commit wrote nothing and released the key.
    assert!(consumer.get(b"k").unwrap().is_none());
    assert_eq!(orders.get(b"staged").unwrap(), None);
    assert!(matches!(
        consumer.begin(b"k", fp).unwrap(),
        Outcome::Fresh(_)
    ));
}

#[test]
fn option_limits() {
    let store = TestStore::new();
    assert_limit(
        store.builder().retention(Duration::ZERO).open(),
        Limit::RetentionMs,
    );
    assert_limit(
        store
            .builder()
            .retention(Duration::from_secs(20 * 365 * 24 * 3600))
            .open(),
        Limit::RetentionMs,
    );
    assert_limit(
        store
            .builder()
            .periodic_compaction(Duration::from_secs(60))
            .open(),
        Limit::PeriodicCompactionS,
    );
    assert_limit(
        store.builder().block_cache_bytes(1).open(),
        Limit::BlockCacheBytes,
    );
    assert_limit(
        store.builder().write_buffer_bytes(1).open(),
        Limit::WriteBufferBytes,
    );
    assert_limit(
        store.builder().business_table(TableOptions::new("")).open(),
        Limit::TableNameBytes,
    );
    assert_limit(
        store
            .builder()
            .business_table(TableOptions::new("t".repeat(TABLE_NAME_BYTES_MAX + 1)))
            .open(),
        Limit::TableNameBytes,
    );
    let mut many = Engine::builder(store.dir.path());
    for i in 0..=TABLES_MAX {
        many = many.business_table(TableOptions::new(format!("t{i}")));
    }
    assert_limit(many.open(), Limit::Tables);

    for bad in ["idemdb.records", "default", "has space", "nul\0", "orders"] {
        let result = store
            .builder()
            .business_table(TableOptions::new(bad))
            .open();
        assert!(
            matches!(result, Err(Error::InvalidOption { .. })),
            "{bad:?}: {result:?}"
        );
    }
    // Nothing above created a store.
    assert!(!store.dir.path().join("CURRENT").exists());
}
