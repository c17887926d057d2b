//! Guards `Claim::commit_async` and `ClaimBatch::commit_async` (feature `tokio`): durable
//! commits grouped by the committer thread without blocking the runtime (batches and single
//! claims joined into one atomic write), per-claim errors, whole-group failures, and commits
//! that stand when their future is dropped.
#![cfg(feature = "tokio")]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idemdb::{
    Durability, Engine, Error, Fault, FaultInjector, Fingerprint, IoPoint, Outcome,
    RESULT_BYTES_MAX,
};
use parking_lot::{Condvar, Mutex};

use crate::util::{TestStore, counter};

/// Holds the first WAL write after it is armed until the test opens the gate, so every other
/// commit queues behind it; or fails writes, when told to.
#[derive(Debug, Default)]
struct Gate {
    armed: AtomicBool,
    fail_writes: AtomicBool,
    /// (a write is waiting at the gate, the gate is open)
    state: Mutex<(bool, bool)>,
    changed: Condvar,
    writes: AtomicUsize,
}

impl Gate {
    /// Waits (bounded, so a broken build fails instead of hanging) until a write is held.
    fn wait_for_held_write(&self) -> bool {
        let mut state = self.state.lock();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !state.0 {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return false;
            }
        }
        true
    }

    fn open(&self) {
        self.state.lock().1 = true;
        self.changed.notify_all();
    }
}

/// The engine's handle on a [`Gate`] the test keeps too.
#[derive(Debug)]
struct Gated(Arc<Gate>);

impl FaultInjector for Gated {
    fn fault(&self, point: IoPoint) -> Fault {
        self.0.fault(point)
    }
}

impl Gate {
    fn fault(&self, point: IoPoint) -> Fault {
        if point != IoPoint::Write {
            return Fault::None;
        }
        self.writes.fetch_add(1, Ordering::SeqCst);
        if self.fail_writes.load(Ordering::SeqCst) {
            return Fault::FailBefore;
        }
        if self.armed.swap(false, Ordering::SeqCst) {
            let mut state = self.state.lock();
            state.0 = true;
            self.changed.notify_all();
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while !state.1 {
                if self.changed.wait_until(&mut state, deadline).timed_out() {
                    break;
                }
            }
        }
        Fault::None
    }
}

fn open_sync(store: &TestStore, gate: &Arc<Gate>) -> Engine {
    store
        .builder()
        .durability(Durability::Sync)
        .fault_injector(Gated(gate.clone()))
        .open()
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    // One thread: if a commit blocked it, no other task could run while the write is held.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn waiting_commits_share_one_write_and_never_block_the_runtime() {
    const CLAIMS: usize = 200;
    let store = TestStore::new();
    let gate = Arc::new(Gate::default());
    let engine = open_sync(&store, &gate);
    let billing = engine.consumer("billing").unwrap();
    let counters = engine.business_table("counters").unwrap();
    gate.armed.store(true, Ordering::SeqCst);
    let writes_before = gate.writes.load(Ordering::SeqCst);

    runtime().block_on(async {
        let mut tasks = Vec::new();
        for i in 0..CLAIMS {
            let billing = billing.clone();
            let counters = counters.clone();
            tasks.push(tokio::spawn(async move {
                let key = format!("order-{i}");
                let Outcome::Fresh(mut claim) = billing.begin(&key, Fingerprint::of(&key))? else {
                    panic!("a new key is fresh");
                };
                claim.merge(&counters, "orders", 1u64.to_be_bytes())?;
                claim.commit_async(key.as_bytes()).await
            }));
        }
        // All tasks run on this one thread. They can only all have claimed their key while the
        // first write is held if none of them blocked the thread in its commit.
        let mut spins = 0;
        while engine.open_claims() < CLAIMS {
            spins += 1;
            assert!(
                spins < 1_000_000,
                "claims stalled at {}",
                engine.open_claims()
            );
            tokio::task::yield_now().await;
        }
        assert!(
            gate.wait_for_held_write(),
            "the first group never reached the WAL"
        );
        gate.open();
        for task in tasks {
            let committed = task.await.unwrap().unwrap();
            assert_eq!(committed.epoch, 1);
        }
    });

    // The first group (held at the gate), then at most one more with everything that queued
    // behind it; how many the first took depends on when the committer woke. Blocking commits
    // would have made one write each.
    let writes = gate.writes.load(Ordering::SeqCst) - writes_before;
    assert!(
        (1..=2).contains(&writes),
        "{writes} writes for {CLAIMS} commits"
    );
    assert_eq!(counter(&engine, "orders"), CLAIMS as u64);
    assert_eq!(engine.open_claims(), 0);
    for i in [0, CLAIMS / 2, CLAIMS - 1] {
        let key = format!("order-{i}");
        match billing.begin(&key, Fingerprint::of(&key)).unwrap() {
            Outcome::Duplicate { result, .. } => assert_eq!(result, key.as_bytes()),
            other => panic!("expected a duplicate, got {other:?}"),
        }
    }
}

#[test]
fn a_claim_failing_its_checks_fails_alone() {
    let store = TestStore::new();
    let gate = Arc::new(Gate::default());
    let engine = open_sync(&store, &gate);
    let billing = engine.consumer("billing").unwrap();
    runtime().block_on(async {
        let Outcome::Fresh(big) = billing.begin(b"big", Fingerprint::of(b"big")).unwrap() else {
            panic!("fresh");
        };
        let Outcome::Fresh(small) = billing.begin(b"small", Fingerprint::of(b"small")).unwrap()
        else {
            panic!("fresh");
        };
        let too_big = vec![0u8; RESULT_BYTES_MAX + 1];
        let (big, small) = tokio::join!(big.commit_async(too_big), small.commit_async(b"ok"));
        assert!(matches!(big, Err(Error::LimitExceeded { .. })), "{big:?}");
        assert_eq!(small.unwrap().epoch, 1);
    });
    // The refused claim wrote nothing and freed its key.
    assert!(matches!(
        billing.begin(b"big", Fingerprint::of(b"big")).unwrap(),
        Outcome::Fresh(_)
    ));
}

#[test]
fn a_failed_group_write_fails_every_claim_in_it_and_poisons() {
    let store = TestStore::new();
    let gate = Arc::new(Gate::default());
    let engine = open_sync(&store, &gate);
    let billing = engine.consumer("billing").unwrap();
    gate.fail_writes.store(true, Ordering::SeqCst);
    runtime().block_on(async {
        // Claim every key before the first commit: the committer may fail the first group and
        // poison the engine before a later `begin` runs, which then (rightly) refuses.
        let claims: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(
                |key| match billing.begin(key, Fingerprint::of(key)).unwrap() {
                    Outcome::Fresh(claim) => claim,
                    other => panic!("expected fresh, got {other:?}"),
                },
            )
            .collect();
        let futures: Vec<_> = claims
            .into_iter()
            .map(|claim| claim.commit_async(b"r"))
            .collect();
        for future in futures {
            assert!(future.await.is_err());
        }
    });
    assert!(matches!(engine.flush_wal(), Err(Error::Poisoned)));
    drop(billing);
    drop(engine);
    // Nothing of the failed groups is on disk.
    let engine = store.open();
    let billing = engine.consumer("billing").unwrap();
    for key in ["a", "b", "c"] {
        assert!(billing.get(key).unwrap().is_none());
    }
}

#[test]
fn a_dropped_future_does_not_cancel_the_commit() {
    let store = TestStore::new();
    let gate = Arc::new(Gate::default());
    let engine = open_sync(&store, &gate);
    let billing = engine.consumer("billing").unwrap();
    let Outcome::Fresh(claim) = billing.begin(b"k", Fingerprint::of(b"k")).unwrap() else {
        panic!("fresh");
    };
    drop(claim.commit_async(b"done"));
    // The committer finishes on its own thread; poll the key until its latch is released.
    let mut tries = 0;
    loop {
        match billing.begin(b"k", Fingerprint::of(b"k")).unwrap() {
            Outcome::InProgress { .. } => {
                tries += 1;
                assert!(tries < 30_000, "the commit never finished");
                std::thread::sleep(Duration::from_millis(1));
            }
            Outcome::Duplicate { result, .. } => {
                assert_eq!(result, "done");
                break;
            }
            other => panic!("expected the commit to stand, got {other:?}"),
        }
    }
}

#[test]
fn buffered_commits_are_ready_at_once_and_reopen_after_drop() {
    let store = TestStore::new();
    let engine = store.open(); // Durability::Buffered
    let billing = engine.consumer("billing").unwrap();
    let Outcome::Fresh(claim) = billing.begin(b"k", Fingerprint::of(b"k")).unwrap() else {
        panic!("fresh");
    };
    let mut future = std::pin::pin!(claim.commit_async(b"r"));
    let waker = std::task::Waker::noop();
    let polled = future
        .as_mut()
        .poll(&mut std::task::Context::from_waker(waker));
    assert!(matches!(polled, std::task::Poll::Ready(Ok(_))));
    drop(billing);
    drop(engine);

    // With Sync, awaiting every commit then dropping the engine leaves the store free to reopen:
    // the committer holds nothing of its own.
    let gate = Arc::new(Gate::default());
    let engine = open_sync(&store, &gate);
    let billing = engine.consumer("billing").unwrap();
    runtime().block_on(async {
        let Outcome::Fresh(claim) = billing.begin(b"j", Fingerprint::of(b"j")).unwrap() else {
            panic!("fresh");
        };
        claim.commit_async(b"r").await.unwrap();
    });
    drop(billing);
    drop(engine);
    let engine = store.open();
    assert!(
        engine
            .consumer("billing")
            .unwrap()
            .get(b"j")
            .unwrap()
            .is_some()
    );
}

#[test]
fn batches_and_single_claims_commit_together_and_each_stays_whole() {
    let store = TestStore::new();
    let gate = Arc::new(Gate::default());
    let engine = open_sync(&store, &gate);
    let billing = engine.consumer("billing").unwrap();
    let counters = engine.business_table("counters").unwrap();
    gate.armed.store(true, Ordering::SeqCst);
    let writes_before = gate.writes.load(Ordering::SeqCst);

    runtime().block_on(async {
        let mut batches = Vec::new();
        for b in 0..3 {
            let keys: Vec<String> = (0..8).map(|i| format!("b{b}-{i}")).collect();
            // A repeat inside the batch, and one winner released by its handler.
            let mut with_repeat = keys.clone();
            with_repeat.push(keys[0].clone());
            let messages: Vec<idemdb::Message> = with_repeat
                .iter()
                .map(|key| idemdb::Message::new(key, Fingerprint::of(key)))
                .collect();
            let mut batch = billing.begin_batch(&messages).unwrap();
            for index in 0..keys.len() {
                batch
                    .claim_mut(index)
                    .unwrap()
                    .merge(&counters, "orders", 1u64.to_be_bytes())
                    .unwrap();
            }
            batch.release(7);
            batches.push(batch.commit_async(|index| format!("r{index}")));
        }
        let Outcome::Fresh(single) = billing
            .begin(b"single", Fingerprint::of(b"single"))
            .unwrap()
        else {
            panic!("fresh");
        };
        let single = single.commit_async(b"s");
        assert!(
            gate.wait_for_held_write(),
            "the first group never reached the WAL"
        );
        gate.open();
        for future in batches {
            let committed = future.await.unwrap();
            assert_eq!(committed.len(), 9);
            assert!(committed[..7].iter().all(Option::is_some));
            assert!(committed[7].is_none(), "released");
            assert!(committed[8].is_none(), "repeat inside the batch");
        }
        assert_eq!(single.await.unwrap().epoch, 1);
    });

    let writes = gate.writes.load(Ordering::SeqCst) - writes_before;
    assert!((1..=2).contains(&writes), "{writes} writes for 4 commits");
    assert_eq!(counter(&engine, "orders"), 3 * 7);
    assert_eq!(engine.open_claims(), 0);
    for b in 0..3 {
        match billing
            .begin(format!("b{b}-3"), Fingerprint::of(format!("b{b}-3")))
            .unwrap()
        {
            Outcome::Duplicate { result, .. } => assert_eq!(result, "r3"),
            other => panic!("expected a duplicate, got {other:?}"),
        }
        let released = format!("b{b}-7");
        assert!(matches!(
            billing
                .begin(&released, Fingerprint::of(&released))
                .unwrap(),
            Outcome::Fresh(_)
        ));
    }
    // Reopened from the WAL: the joined group was one valid batch.
    drop((billing, counters));
    drop(engine);
    let engine = store.open();
    assert_eq!(counter(&engine, "orders"), 3 * 7);
    assert!(
        engine
            .consumer("billing")
            .unwrap()
            .get("single")
            .unwrap()
            .is_some()
    );
}
