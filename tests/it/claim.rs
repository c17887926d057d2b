//! Guards the claim -> stage -> commit flow and every outcome of `begin`.

use crate::util::{TestStore, counter};
use idemdb::{Fingerprint, Outcome};

#[test]
fn fresh_then_duplicate_returns_the_stored_result() {
    let store = TestStore::new();
    let engine = store.open();
    let billing = engine.consumer("billing").unwrap();
    let fp = Fingerprint::of(b"order-1 body");
    let Outcome::Fresh(claim) = billing.begin(b"order-1", fp).unwrap() else {
        panic!("first delivery must be fresh");
    };
    let committed = claim.commit(b"receipt-1").unwrap();
    assert_eq!(committed.epoch, 1);
    match billing.begin(b"order-1", fp).unwrap() {
        Outcome::Duplicate {
            result,
            first_committed_at_ms,
            ..
        } => {
            assert_eq!(result, "receipt-1");
            assert_eq!(first_committed_at_ms, committed.committed_at_ms);
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
}

#[test]
fn in_progress_while_held_and_free_after_drop() {
    let store = TestStore::new();
    let engine = store.open();
    let billing = engine.consumer("billing").unwrap();
    let fp = Fingerprint::of(b"x");
    let Outcome::Fresh(claim) = billing.begin(b"k", fp).unwrap() else {
        panic!("fresh expected");
    };
    assert!(matches!(
        billing.begin(b"k", fp).unwrap(),
        Outcome::InProgress { since_ms, .. } if since_ms == claim.claimed_at_ms()
    ));
    assert_eq!(engine.open_claims(), 1);
    drop(claim);
    assert_eq!(engine.open_claims(), 0);
    assert!(matches!(
        billing.begin(b"k", fp).unwrap(),
        Outcome::Fresh(_)
    ));
}

#[test]
fn conflict_reports_both_fingerprints() {
    let store = TestStore::new();
    let engine = store.open();
    let billing = engine.consumer("billing").unwrap();
    let (first, second) = (Fingerprint::of(b"3 apples"), Fingerprint::of(b"4 apples"));
    let Outcome::Fresh(claim) = billing.begin(b"order-9", first).unwrap() else {
        panic!("fresh expected");
    };
    claim.commit(b"").unwrap();
    match billing.begin(b"order-9", second).unwrap() {
        Outcome::Conflict {
            stored_fingerprint,
            new_fingerprint,
            ..
        } => {
            assert_eq!(stored_fingerprint, first);
            assert_eq!(new_fingerprint, second);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
}

#[test]
fn staged_writes_land_with_the_marker_and_only_on_commit() {
    let store = TestStore::new();
    let engine = store.open();
    let billing = engine.consumer("billing").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();
    let fp = Fingerprint::of(b"o");

    // A claim that stages writes and is aborted leaves no trace.
    let Outcome::Fresh(mut claim) = billing.begin(b"o-1", fp).unwrap() else {
        panic!("fresh expected");
    };
    claim.put(&orders, b"o-1", b"aborted").unwrap();
    claim.merge(&counters, b"n", 1u64.to_be_bytes()).unwrap();
    claim.abort();
    assert_eq!(orders.get(b"o-1").unwrap(), None);
    assert_eq!(counter(&engine, "n"), 0);
    assert!(billing.get(b"o-1").unwrap().is_none());

    // The redelivery commits: the marker and all staged writes are there together.
    let Outcome::Fresh(mut claim) = billing.begin(b"o-1", fp).unwrap() else {
        panic!("fresh expected after abort");
    };
    claim.put(&orders, b"o-1", b"v1").unwrap();
    claim.put(&orders, b"o-0", b"gone").unwrap();
    claim.delete(&orders, b"o-0").unwrap();
    claim.merge(&counters, b"n", 1u64.to_be_bytes()).unwrap();
    assert_eq!(claim.staged_writes(), 4);
    claim.commit(b"done").unwrap();
    assert_eq!(orders.get(b"o-1").unwrap().as_deref(), Some(&b"v1"[..]));
    assert_eq!(orders.get(b"o-0").unwrap(), None);
    assert_eq!(counter(&engine, "n"), 1);
    assert_eq!(
        billing
            .get(b"o-1")
            .unwrap()
            .unwrap()
            .result()
            .unwrap()
            .clone(),
        "done"
    );
}

#[test]
fn consumers_sharing_a_store_do_not_suppress_each_other() {
    let store = TestStore::new();
    let engine = store.open();
    let fp = Fingerprint::of(b"m");
    for consumer in ["billing", "shipping", "billin", "gbilling"] {
        let handle = engine.consumer(consumer).unwrap();
        let Outcome::Fresh(claim) = handle.begin(b"msg-1", fp).unwrap() else {
            panic!("{consumer} must see msg-1 as new");
        };
        claim.commit(consumer).unwrap();
    }
    let billing = engine.consumer("billing").unwrap();
    assert_eq!(
        billing
            .get(b"msg-1")
            .unwrap()
            .unwrap()
            .result()
            .unwrap()
            .clone(),
        "billing"
    );
}

#[test]
fn one_mebibyte_result_is_returned_whole() {
    let store = TestStore::new();
    let engine = store.open();
    let billing = engine.consumer("billing").unwrap();
    let result: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
    let fp = Fingerprint::of(b"big");
    let Outcome::Fresh(claim) = billing.begin(b"big", fp).unwrap() else {
        panic!("fresh expected");
    };
    claim.commit(&result).unwrap();
    let Outcome::Duplicate { result: stored, .. } = billing.begin(b"big", fp).unwrap() else {
        panic!("duplicate expected");
    };
    assert_eq!(stored.len(), result.len());
    assert!(stored == result);
}

#[test]
fn tables_are_checked_against_the_engine() {
    let store = TestStore::new();
    let engine = store.open();
    let other_store = TestStore::new();
    let other = other_store.open();
    assert!(matches!(
        engine.business_table("nope"),
        Err(idemdb::Error::UnknownTable { .. })
    ));
    assert!(matches!(
        engine.entity_table("orders"),
        Err(idemdb::Error::UnknownTable { .. })
    ));
    let foreign = other.business_table("orders").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let Outcome::Fresh(mut claim) = engine
        .consumer("c")
        .unwrap()
        .begin(b"k", Fingerprint::of(b""))
        .unwrap()
    else {
        panic!("fresh expected");
    };
    assert!(matches!(
        claim.put(&foreign, b"k", b"v"),
        Err(idemdb::Error::ForeignTable { .. })
    ));
    assert!(matches!(
        claim.merge(&orders, b"k", b"v"),
        Err(idemdb::Error::NoMergeOperator { .. })
    ));
    assert_eq!(claim.staged_writes(), 0);
}
