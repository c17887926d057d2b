//! Guards failure handling with injected I/O faults: every injected failure is a typed error,
//! no claim is reported committed that is not, the engine refuses writes after a failed write
//! or sync (poisoned), and a reopen recovers a consistent state (marker exactly with its
//! writes).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::util::{TestStore, counter};
use idemdb::{
    Engine, Error, Fault, FaultInjector, Fingerprint, IoPoint, Message, Outcome, StorageErrorKind,
};

/// Fails the `nth` (0-based) I/O call at `point` with `fault`, once.
#[derive(Debug)]
struct FailNth {
    point: IoPoint,
    fault: Fault,
    nth: usize,
    seen: AtomicUsize,
}

impl FaultInjector for FailNth {
    fn fault(&self, point: IoPoint) -> Fault {
        if point != self.point {
            return Fault::None;
        }
        if self.seen.fetch_add(1, Ordering::SeqCst) == self.nth {
            self.fault
        } else {
            Fault::None
        }
    }
}

fn open_failing(store: &TestStore, point: IoPoint, fault: Fault, nth: usize) -> Engine {
    let plan = FailNth {
        point,
        fault,
        nth,
        seen: AtomicUsize::new(0),
    };
    store.builder().fault_injector(plan).open().unwrap()
}

#[track_caller]
fn assert_injected<T: std::fmt::Debug>(result: Result<T, Error>) {
    match result {
        Err(Error::Storage {
            kind: StorageErrorKind::Io,
            ..
        }) => {}
        other => panic!("expected an injected I/O error, got {other:?}"),
    }
}

/// Commits `key` with a counter increment and an order row; returns the commit's result.
fn commit(engine: &Engine, key: &str) -> idemdb::Result<idemdb::Committed> {
    let consumer = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();
    let Outcome::Fresh(mut claim) = consumer.begin(key, Fingerprint::of(key))? else {
        panic!("fresh expected for {key}");
    };
    claim.put(&orders, key, b"row").unwrap();
    claim.merge(&counters, key, 1u64.to_be_bytes()).unwrap();
    claim.commit(b"ok")
}

/// After a reopen: `key`'s marker, row and counter are all there or all absent.
fn present_consistently(engine: &Engine, key: &str) -> bool {
    let marker = engine.consumer("c").unwrap().get(key).unwrap().is_some();
    let row = engine
        .business_table("orders")
        .unwrap()
        .get(key)
        .unwrap()
        .is_some();
    let applied = counter(engine, key);
    assert_eq!(
        (marker, row, applied == 1),
        (marker, marker, marker),
        "torn record {key}"
    );
    assert!(applied <= 1);
    marker
}

#[test]
fn a_failed_write_is_typed_poisons_and_writes_nothing() {
    let store = TestStore::new();
    {
        let engine = open_failing(&store, IoPoint::Write, Fault::FailBefore, 1);
        commit(&engine, "before").unwrap();
        assert_injected(commit(&engine, "failed"));
        // Poisoned: no more claims, no more writes, until reopened.
        let consumer = engine.consumer("c").unwrap();
        assert!(matches!(
            consumer.begin("later", Fingerprint::of("later")),
            Err(Error::Poisoned)
        ));
        assert!(matches!(engine.flush_wal(), Err(Error::Poisoned)));
        // Reads still work.
        assert!(consumer.get("before").unwrap().is_some());
    }
    let engine = store.open();
    assert!(present_consistently(&engine, "before"));
    assert!(!present_consistently(&engine, "failed"));
    commit(&engine, "failed").unwrap();
    assert!(present_consistently(&engine, "failed"));
}

#[test]
fn a_write_reported_failed_after_reaching_the_wal_is_a_duplicate_after_reopen() {
    let store = TestStore::new();
    {
        let engine = open_failing(&store, IoPoint::Write, Fault::FailAfter, 0);
        assert_injected(commit(&engine, "unknown"));
        assert!(matches!(
            engine
                .consumer("c")
                .unwrap()
                .begin("x", Fingerprint::of("x")),
            Err(Error::Poisoned)
        ));
    }
    // The caller was told it failed, so it nacked; the redelivery finds it done, whole.
    let engine = store.open();
    assert!(present_consistently(&engine, "unknown"));
    assert!(matches!(
        engine
            .consumer("c")
            .unwrap()
            .begin("unknown", Fingerprint::of("unknown"))
            .unwrap(),
        Outcome::Duplicate { .. }
    ));
}

#[test]
fn batch_commits_and_lease_steps_fail_whole() {
    let store = TestStore::new();
    {
        let engine = open_failing(&store, IoPoint::Write, Fault::FailBefore, 1);
        let consumer = engine.consumer("c").unwrap();
        let counters = engine.business_table("counters").unwrap();
        // Write 0: the external claim's in-progress record.
        let Outcome::Fresh(external) = consumer
            .begin_external("ext", Fingerprint::of("ext"), Duration::from_secs(1), "w")
            .unwrap()
        else {
            panic!("fresh expected");
        };
        // Write 1 fails: a batch of three.
        let keys = ["b1", "b2", "b3"];
        let messages: Vec<Message> = keys
            .iter()
            .map(|k| Message::new(*k, Fingerprint::of(k)))
            .collect();
        let mut batch = consumer.begin_batch(&messages).unwrap();
        for (index, key) in keys.iter().enumerate() {
            let claim = batch.claim_mut(index).unwrap();
            claim.merge(&counters, key, 1u64.to_be_bytes()).unwrap();
        }
        assert_injected(batch.commit(|_| b"ok"));
        assert!(matches!(external.complete(b"done"), Err(Error::Poisoned)));
    }
    let engine = store.open();
    for key in ["b1", "b2", "b3"] {
        assert_eq!(counter(&engine, key), 0);
        assert!(engine.consumer("c").unwrap().get(key).unwrap().is_none());
    }
    // The external claim's lease survived; after it the key is taken over.
    let consumer = engine.consumer("c").unwrap();
    assert!(matches!(
        consumer.begin("ext", Fingerprint::of("ext")).unwrap(),
        Outcome::InProgress { .. }
    ));
    store.clock.advance(Duration::from_secs(1));
    let Outcome::Fresh(takeover) = consumer.begin("ext", Fingerprint::of("ext")).unwrap() else {
        panic!("takeover expected");
    };
    assert!(takeover.previous_attempt().is_some());
}

#[test]
fn failed_wal_sync_flush_and_compaction_are_typed_and_poison() {
    for point in [IoPoint::SyncWal, IoPoint::Flush, IoPoint::Compaction] {
        let store = TestStore::new();
        {
            let engine = open_failing(&store, point, Fault::FailBefore, 0);
            commit(&engine, "k").unwrap();
            let result = match point {
                IoPoint::SyncWal => engine.flush_wal(),
                _ => engine.compact(),
            };
            assert_injected(result);
            assert!(
                matches!(commit(&engine, "after"), Err(Error::Poisoned)),
                "{point:?} must poison"
            );
        }
        let engine = store.open();
        assert!(present_consistently(&engine, "k"), "{point:?}");
        assert!(!present_consistently(&engine, "after"), "{point:?}");
    }
}
