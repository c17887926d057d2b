//! `Consumer::pipeline`: commits in flight from one thread, settled in the order handed over,
//! each once it and every commit before it is durable; nothing settled as durable past a
//! failure; at most `depth` commits in flight.
//!
//! Commits of one engine are answered in order by its committer, so order is shown with two
//! engines: a `Sync` one whose log write the test holds (a fault injector that waits) and a
//! `Buffered` one, whose commits are made at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::util::TestStore;
use idemdb::{
    Durability, Durable, Engine, Error, Fault, FaultInjector, Fingerprint, IoPoint, Limit, Message,
    Outcome, Settled,
};

/// Holds every `Write` once armed, until released; then lets it through, or fails it.
#[derive(Debug, Default)]
struct HeldWrites {
    armed: AtomicBool,
    gate: Mutex<Option<Fault>>,
    opened: std::sync::Condvar,
}

impl HeldWrites {
    fn release(&self, fault: Fault) {
        *self.gate.lock().unwrap() = Some(fault);
        self.opened.notify_all();
    }
}

/// The engine's handle on the test's [`HeldWrites`].
#[derive(Debug)]
struct Held(Arc<HeldWrites>);

impl FaultInjector for Held {
    fn fault(&self, point: IoPoint) -> Fault {
        let held = &self.0;
        if point != IoPoint::Write || !held.armed.load(Ordering::SeqCst) {
            return Fault::None;
        }
        let mut gate = held.gate.lock().unwrap();
        loop {
            if let Some(fault) = *gate {
                return fault;
            }
            gate = held.opened.wait(gate).unwrap();
        }
    }
}

/// A `Sync` engine whose writes the test holds once armed, and a `Buffered` one.
fn two_engines(held: &Arc<HeldWrites>) -> (TestStore, Engine, TestStore, Engine) {
    let slow_store = TestStore::new();
    let slow = slow_store
        .builder()
        .durability(Durability::Sync)
        .fault_injector(Held(held.clone()))
        .open()
        .unwrap();
    let quick_store = TestStore::new();
    let quick = quick_store.open();
    (slow_store, slow, quick_store, quick)
}

fn fresh(engine: &Engine, key: &str) -> idemdb::Claim {
    match engine
        .consumer("c")
        .unwrap()
        .begin(key, Fingerprint::of(key.as_bytes()))
        .unwrap()
    {
        Outcome::Fresh(claim) => claim,
        other => panic!("{key}: fresh expected, got {other:?}"),
    }
}

fn tags(settled: &[Settled<u32>]) -> Vec<u32> {
    settled.iter().map(|settled| settled.tag).collect()
}

#[test]
fn an_entry_settles_only_after_every_entry_before_it_is_durable() {
    let held = Arc::new(HeldWrites::default());
    let (_slow_store, slow, _quick_store, quick) = two_engines(&held);
    let consumer = slow.consumer("c").unwrap();
    let mut pipeline = consumer.pipeline::<u32>(4).unwrap();
    held.armed.store(true, Ordering::SeqCst);
    pipeline.commit(fresh(&slow, "a"), b"1", 1);
    pipeline.commit(fresh(&quick, "b"), b"2", 2);
    pipeline.pass(3);
    // The second commit is made (its engine is buffered), the first is held in its write.
    assert!(quick.consumer("c").unwrap().get("b").unwrap().is_some());
    assert!(
        pipeline.settled().is_empty(),
        "nothing settles while the first commit is not durable"
    );
    assert_eq!(pipeline.in_flight(), 1);
    held.release(Fault::None);
    let settled = pipeline.wait();
    assert_eq!(tags(&settled), [1, 2, 3]);
    assert!(matches!(&settled[0].outcome, Ok(Durable::Claim(c)) if c.epoch == 1));
    assert!(matches!(settled[1].outcome, Ok(Durable::Claim(_))));
    assert!(matches!(settled[2].outcome, Ok(Durable::Passed)));
    assert!(slow.consumer("c").unwrap().get("a").unwrap().is_some());
    assert!(pipeline.wait().is_empty(), "each entry comes back once");
}

#[test]
fn nothing_after_a_failed_commit_settles_as_durable() {
    let held = Arc::new(HeldWrites::default());
    let (_slow_store, slow, _quick_store, quick) = two_engines(&held);
    let consumer = quick.consumer("c").unwrap();
    let mut pipeline = consumer.pipeline::<u32>(4).unwrap();
    held.armed.store(true, Ordering::SeqCst);
    pipeline.commit(fresh(&slow, "a"), b"1", 1);
    // Handed over before the failure is known: made (buffered), but not acknowledged.
    pipeline.commit(fresh(&quick, "b"), b"2", 2);
    held.release(Fault::FailBefore);
    let settled = pipeline.wait();
    assert_eq!(tags(&settled), [1, 2]);
    assert!(
        matches!(settled[0].outcome, Err(Error::Storage { .. })),
        "{:?}",
        settled[0].outcome
    );
    assert!(
        matches!(settled[1].outcome, Err(Error::PipelineBroken { .. })),
        "{:?}",
        settled[1].outcome
    );
    assert!(quick.consumer("c").unwrap().get("b").unwrap().is_some());
    // Handed over after the failure is known: not committed, its claim released.
    pipeline.commit(fresh(&quick, "c"), b"3", 3);
    let batch = quick
        .consumer("c")
        .unwrap()
        .begin_batch(&[Message::new(b"d", Fingerprint::of(b"d"))])
        .unwrap();
    pipeline.commit_batch(batch, |_| b"4", 4);
    pipeline.pass(5);
    let settled = pipeline.settled();
    assert_eq!(tags(&settled), [3, 4, 5]);
    assert!(
        settled
            .iter()
            .all(|s| matches!(s.outcome, Err(Error::PipelineBroken { .. })))
    );
    let again = quick.consumer("c").unwrap();
    for key in ["c", "d"] {
        assert!(
            matches!(
                again.begin(key, Fingerprint::of(key.as_bytes())).unwrap(),
                Outcome::Fresh(_)
            ),
            "{key} was committed after the failure"
        );
    }
}

#[test]
fn depth_bounds_the_commits_in_flight() {
    let held = Arc::new(HeldWrites::default());
    let (_slow_store, slow, _quick_store, _quick) = two_engines(&held);
    let slow = Arc::new(slow);
    held.armed.store(true, Ordering::SeqCst);
    let handed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let worker = {
        let (slow, handed) = (slow.clone(), handed.clone());
        std::thread::spawn(move || {
            let consumer = slow.consumer("c").unwrap();
            let mut pipeline = consumer.pipeline::<u32>(2).unwrap();
            for n in 0..3 {
                pipeline.commit(fresh(&slow, &format!("k-{n}")), b"ok", n);
                handed.fetch_add(1, Ordering::SeqCst);
            }
            pipeline.wait()
        })
    };
    // Two handed over; the third waits for room (the writes are held).
    while handed.load(Ordering::SeqCst) < 2 {
        std::thread::yield_now();
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(
        handed.load(Ordering::SeqCst),
        2,
        "a third commit went in flight past depth 2"
    );
    held.release(Fault::None);
    let settled = worker.join().unwrap();
    assert_eq!(tags(&settled), [0, 1, 2]);
    assert!(settled.iter().all(|s| s.outcome.is_ok()));
}

#[test]
fn batches_and_claims_of_a_sync_engine_settle_with_their_results() {
    let store = TestStore::new();
    let engine = store.builder().durability(Durability::Sync).open().unwrap();
    let consumer = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let mut pipeline = consumer.pipeline::<usize>(3).unwrap();
    let mut expected = Vec::new();
    let mut settled = Vec::new();
    for round in 0..50_usize {
        let keys: Vec<String> = (0..8).map(|n| format!("m-{round}-{n}")).collect();
        let messages: Vec<Message> = keys
            .iter()
            .map(|key| Message::new(key.as_bytes(), Fingerprint::of(key.as_bytes())))
            .collect();
        let mut batch = consumer.begin_batch(&messages).unwrap();
        for key in &keys {
            batch.put(&orders, key, b"row").unwrap();
        }
        pipeline.commit_batch(batch, |index| format!("r-{index}"), round);
        expected.push(round);
        settled.extend(pipeline.settled());
    }
    settled.extend(pipeline.wait());
    assert_eq!(settled.iter().map(|s| s.tag).collect::<Vec<_>>(), expected);
    for entry in &settled {
        let Ok(Durable::Batch(committed)) = &entry.outcome else {
            panic!("{:?}", entry.outcome);
        };
        assert!(committed.iter().all(Option::is_some));
    }
    drop((consumer, orders));
    drop(engine);
    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    let record = consumer.get("m-49-7").unwrap().expect("durable");
    assert_eq!(record.result().map(|r| &r[..]), Some(&b"r-7"[..]));
}

/// A buffered engine's commit is made in the call: nothing of it is in flight afterwards.
#[test]
fn a_buffered_commit_is_not_in_flight_once_handed_over() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    let mut pipeline = consumer.pipeline::<u32>(1).unwrap();
    pipeline.commit(fresh(&engine, "a"), b"1", 1);
    assert_eq!(pipeline.in_flight(), 0);
    assert_eq!(pipeline.len(), 1);
    assert_eq!(tags(&pipeline.settled()), [1]);
}

#[test]
fn a_depth_outside_its_bounds_is_refused() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    for depth in [0, idemdb::PIPELINE_DEPTH_MAX + 1] {
        assert!(matches!(
            consumer.pipeline::<u8>(depth),
            Err(Error::LimitExceeded {
                limit: Limit::PipelineDepth,
                ..
            })
        ));
    }
    assert!(consumer.pipeline::<u8>(idemdb::PIPELINE_DEPTH_MAX).is_ok());
}

#[cfg(feature = "tokio")]
#[test]
fn the_async_pipeline_settles_in_order_too() {
    let held = Arc::new(HeldWrites::default());
    let (_slow_store, slow, _quick_store, quick) = two_engines(&held);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let consumer = slow.consumer("c").unwrap();
        let mut pipeline = consumer.async_pipeline::<u32>(2).unwrap();
        held.armed.store(true, Ordering::SeqCst);
        pipeline.commit(fresh(&slow, "a"), b"1", 1).await;
        pipeline.commit(fresh(&quick, "b"), b"2", 2).await;
        assert!(pipeline.settled().is_empty());
        assert_eq!(pipeline.len(), 2);
        held.release(Fault::None);
        let first = pipeline.next_settled().await.expect("the first entry");
        let second = pipeline.next_settled().await.expect("the second entry");
        assert_eq!(tags(&[first.clone(), second.clone()]), [1, 2]);
        assert!(first.outcome.is_ok() && second.outcome.is_ok());
        assert!(pipeline.is_empty());
        assert!(pipeline.next_settled().await.is_none());
        assert!(pipeline.wait().await.is_empty());
    });
}
