//! Guards `Engine::checkpoint`: a copy taken while threads commit holds every commit
//! acknowledged before it, each claim whole (its marker and its staged writes in two business
//! tables, or none of them), each thread's commits as a prefix, and opens as a store of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::util::TestStore;
use idemdb::{Durability, Engine, Error, Fingerprint, Outcome, TableOptions};

const THREADS: u32 = 4;

fn key(thread: u32, index: u32) -> String {
    format!("t{thread}-{index:06}")
}

fn builder(path: &std::path::Path) -> idemdb::EngineBuilder {
    Engine::builder(path)
        .durability(Durability::Buffered)
        .write_buffer_bytes(1 << 20)
        .business_table(TableOptions::new("orders"))
        .business_table(TableOptions::new("audit"))
}

#[test]
fn a_checkpoint_under_load_holds_whole_claims_and_every_earlier_commit() {
    let store = TestStore::new();
    let engine = builder(&store.dir.path().join("live")).open().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // Per thread: how many of its commits have been acknowledged so far.
    let acknowledged: Arc<Vec<AtomicU32>> =
        Arc::new((0..THREADS).map(|_| AtomicU32::new(0)).collect());
    let workers: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (engine, stop, acknowledged) = (engine.clone(), stop.clone(), acknowledged.clone());
            std::thread::spawn(move || {
                let consumer = engine.consumer("c").unwrap();
                let orders = engine.business_table("orders").unwrap();
                let audit = engine.business_table("audit").unwrap();
                let mut index = 0;
                while !stop.load(Ordering::Acquire) {
                    let key = key(thread, index);
                    let Outcome::Fresh(mut claim) =
                        consumer.begin(&key, Fingerprint::of(&key)).unwrap()
                    else {
                        panic!("{key} is new");
                    };
                    claim.put(&orders, &key, b"order").unwrap();
                    claim.put(&audit, &key, b"audit").unwrap();
                    claim.commit(b"").unwrap();
                    index += 1;
                    acknowledged[thread as usize].store(index, Ordering::Release);
                }
            })
        })
        .collect();

    // Checkpoints at several moments of the run, each with what was acknowledged before it.
    let mut checkpoints = Vec::new();
    for round in 0..3 {
        std::thread::sleep(std::time::Duration::from_millis(150));
        let before: Vec<u32> = acknowledged
            .iter()
            .map(|count| count.load(Ordering::Acquire))
            .collect();
        let dir = store.dir.path().join(format!("checkpoint-{round}"));
        engine.checkpoint(&dir).unwrap();
        checkpoints.push((dir, before));
    }
    stop.store(true, Ordering::Release);
    for worker in workers {
        worker.join().unwrap();
    }
    let total: u32 = acknowledged
        .iter()
        .map(|count| count.load(Ordering::Acquire))
        .sum();
    assert!(total > 0, "the workers committed nothing");

    for (dir, before) in checkpoints {
        let copy = builder(&dir).open().unwrap();
        let consumer = copy.consumer("c").unwrap();
        let orders = copy.business_table("orders").unwrap();
        let audit = copy.business_table("audit").unwrap();
        for thread in 0..THREADS {
            // A thread commits in order, so the copy holds a prefix of its commits.
            let mut present = 0;
            let attempted = acknowledged[thread as usize].load(Ordering::Acquire);
            for index in 0..attempted {
                let key = key(thread, index);
                let record = consumer.get(&key).unwrap().is_some();
                let order = orders.get(&key).unwrap().is_some();
                let audited = audit.get(&key).unwrap().is_some();
                assert_eq!(
                    order, record,
                    "{dir:?} {key}: marker and orders row disagree"
                );
                assert_eq!(
                    audited, record,
                    "{dir:?} {key}: marker and audit row disagree"
                );
                if record {
                    assert_eq!(present, index, "{dir:?} {key}: not a prefix");
                    present += 1;
                }
            }
            assert!(
                present >= before[thread as usize],
                "{dir:?}: thread {thread} had {} acknowledged before the checkpoint, the copy has {present}",
                before[thread as usize]
            );
        }
    }
}

#[test]
fn a_checkpoint_into_an_existing_directory_is_refused() {
    let store = TestStore::new();
    let engine = store.open();
    let existing = tempfile::tempdir().unwrap();
    assert!(matches!(
        engine.checkpoint(existing.path()),
        Err(Error::InvalidArgument { .. })
    ));
    // The engine is not poisoned by it.
    let consumer = engine.consumer("c").unwrap();
    let Outcome::Fresh(claim) = consumer.begin("k", Fingerprint::of("k")).unwrap() else {
        panic!("fresh");
    };
    claim.commit(b"").unwrap();
}
