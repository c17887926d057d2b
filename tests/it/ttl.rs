//! Guards retention: exact read-time expiry on the mock clock, and physical removal by the
//! compaction filter (and only of expired records).

use std::time::Duration;

use crate::util::TestStore;
use idemdb::{Expiry, Fingerprint, Outcome, RecordCounts};

const HOUR: Duration = Duration::from_secs(3600);

fn commit(consumer: &idemdb::Consumer, key: &str, expiry: Option<Expiry>) -> u64 {
    let Outcome::Fresh(mut claim) = consumer.begin(key, Fingerprint::of(key)).unwrap() else {
        panic!("fresh expected for {key}");
    };
    if let Some(expiry) = expiry {
        claim.set_expiry(expiry).unwrap();
    }
    claim.commit(b"r").unwrap().expires_at_ms
}

fn counts(live: u64, expired: u64) -> RecordCounts {
    let mut counts = RecordCounts::default();
    counts.live = live;
    counts.expired = expired;
    counts
}

#[test]
fn expired_reads_as_absent_before_compaction_and_is_removed_by_it() {
    let store = TestStore::new();
    let engine = store.builder().retention(HOUR).open().unwrap();
    let consumer = engine.consumer("ttl").unwrap();
    let expires_at_ms = commit(&consumer, "a", None);
    assert_eq!(expires_at_ms, engine.now_ms() + 3_600_000);

    store.clock.set(expires_at_ms - 1);
    assert!(consumer.get("a").unwrap().is_some());
    assert!(matches!(
        consumer.begin("a", Fingerprint::of("a")).unwrap(),
        Outcome::Duplicate { .. }
    ));

    // From the expiry instant on, reads and begin treat it as absent, while it is still stored.
    store.clock.set(expires_at_ms);
    assert!(consumer.get("a").unwrap().is_none());
    assert_eq!(engine.record_counts().unwrap(), counts(0, 1));
    let Outcome::Fresh(claim) = consumer.begin("a", Fingerprint::of("a")).unwrap() else {
        panic!("an expired record must not suppress a delivery");
    };
    drop(claim);

    engine.compact().unwrap();
    assert_eq!(engine.record_counts().unwrap(), counts(0, 0));
}

#[test]
fn compaction_keeps_unexpired_records() {
    let store = TestStore::new();
    let engine = store.builder().retention(HOUR).open().unwrap();
    let consumer = engine.consumer("ttl").unwrap();
    commit(&consumer, "short", None);
    commit(&consumer, "long", Some(Expiry::After(3 * HOUR)));
    commit(&consumer, "forever", Some(Expiry::Never));
    store.clock.advance(2 * HOUR);
    engine.compact().unwrap();
    assert_eq!(engine.record_counts().unwrap(), counts(2, 0));
    assert!(consumer.get("short").unwrap().is_none());
    assert!(consumer.get("long").unwrap().is_some());
    store.clock.advance(100 * 365 * 24 * HOUR);
    engine.compact().unwrap();
    assert_eq!(engine.record_counts().unwrap(), counts(1, 0));
    assert!(consumer.get("forever").unwrap().is_some());
}

#[test]
fn a_recommit_after_expiry_replaces_the_old_record() {
    let store = TestStore::new();
    let engine = store.builder().retention(HOUR).open().unwrap();
    let consumer = engine.consumer("ttl").unwrap();
    commit(&consumer, "k", None);
    store.clock.advance(HOUR);
    // Same key, new content: after expiry it is a new message, not a conflict.
    let Outcome::Fresh(claim) = consumer.begin("k", Fingerprint::of("other")).unwrap() else {
        panic!("fresh expected after expiry");
    };
    assert_eq!(claim.epoch(), 2);
    claim.commit(b"second").unwrap();
    let record = consumer.get("k").unwrap().unwrap();
    assert_eq!(record.result().unwrap().clone(), "second");
    assert_eq!(record.epoch, 2);
    assert_eq!(record.fingerprint, Fingerprint::of("other"));
    // The compaction filter must not remove the new record, nor resurrect the old one.
    engine.compact().unwrap();
    assert_eq!(
        consumer
            .get("k")
            .unwrap()
            .unwrap()
            .result()
            .unwrap()
            .clone(),
        "second"
    );
}

/// One `compact` removes every record expired by then, also records written as merge operands
/// across several table files (a compaction writes the value it folds from operands without
/// offering it to the filter, so one pass alone left some of them stored).
#[test]
fn one_compact_removes_every_expired_record_of_several_files() {
    let store = TestStore::new();
    let engine = store.builder().retention(HOUR).open().unwrap();
    let consumer = engine.consumer("ttl").unwrap();
    let mut expires_at_ms = 0;
    for file in 0..5 {
        for key in 0..10 {
            expires_at_ms = commit(&consumer, &format!("k{file}-{key}"), None);
        }
        engine.flush().unwrap();
    }
    store.clock.set(expires_at_ms);
    assert_eq!(engine.record_counts().unwrap(), counts(0, 50));
    engine.compact().unwrap();
    assert_eq!(engine.record_counts().unwrap(), counts(0, 0));
}
