//! Guards exclusivity under real concurrency: of any number of simultaneous deliveries of one
//! key exactly one commits, and staged writes of claims that did not commit never land.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crate::util::{TestStore, counter};
use idemdb::{Fingerprint, Outcome};

const THREADS: usize = 8;
const KEYS: usize = 10_000;
const COPIES: usize = 4;
/// Every tenth key's first winner fails after staging writes and drops its claim (a transient
/// failure); the redelivery must then win and commit.
const FAIL_FIRST_EVERY: usize = 10;

#[test]
fn eight_threads_deliver_each_key_four_times() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("race").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();

    // Copies of one key sit next to each other, so different threads take them at nearly the
    // same moment.
    let deliveries: Arc<Vec<u32>> = Arc::new(
        (0..KEYS as u32)
            .flat_map(|key| std::iter::repeat_n(key, COPIES))
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let fresh: Arc<Vec<AtomicU32>> = Arc::new((0..KEYS).map(|_| AtomicU32::new(0)).collect());
    let committed: Arc<Vec<AtomicU32>> = Arc::new((0..KEYS).map(|_| AtomicU32::new(0)).collect());
    let duplicates = Arc::new(AtomicUsize::new(0));
    let in_progress = Arc::new(AtomicUsize::new(0));

    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            let (consumer, orders, counters) = (consumer.clone(), orders.clone(), counters.clone());
            let (deliveries, next, fresh, committed) = (
                deliveries.clone(),
                next.clone(),
                fresh.clone(),
                committed.clone(),
            );
            let (duplicates, in_progress) = (duplicates.clone(), in_progress.clone());
            std::thread::spawn(move || {
                loop {
                    let index = next.fetch_add(1, Ordering::SeqCst);
                    let Some(&key) = deliveries.get(index) else {
                        return;
                    };
                    let message_key = format!("msg-{key}");
                    let fp = Fingerprint::of(message_key.as_bytes());
                    // Redeliver until the delivery ends as a commit or a duplicate.
                    loop {
                        match consumer.begin(&message_key, fp).unwrap() {
                            Outcome::Fresh(mut claim) => {
                                let attempt = fresh[key as usize].fetch_add(1, Ordering::SeqCst);
                                if attempt == 0 && (key as usize).is_multiple_of(FAIL_FIRST_EVERY) {
                                    claim.put(&orders, format!("lost/{key}"), b"x").unwrap();
                                    claim.merge(&counters, "total", 1u64.to_be_bytes()).unwrap();
                                    drop(claim);
                                    continue;
                                }
                                claim.put(&orders, format!("applied/{key}"), b"1").unwrap();
                                claim.merge(&counters, "total", 1u64.to_be_bytes()).unwrap();
                                claim.commit(key.to_be_bytes()).unwrap();
                                committed[key as usize].fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            Outcome::Duplicate { result, .. } => {
                                assert_eq!(&result[..], &key.to_be_bytes()[..]);
                                duplicates.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            Outcome::InProgress { .. } => {
                                in_progress.fetch_add(1, Ordering::SeqCst);
                                std::thread::yield_now();
                            }
                            other => panic!("unexpected outcome {other:?}"),
                        }
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker panicked");
    }

    for key in 0..KEYS {
        assert_eq!(
            committed[key].load(Ordering::SeqCst),
            1,
            "key {key} committed"
        );
        let expected_fresh = if key.is_multiple_of(FAIL_FIRST_EVERY) {
            2
        } else {
            1
        };
        assert_eq!(
            fresh[key].load(Ordering::SeqCst),
            expected_fresh,
            "key {key} fresh"
        );
        assert!(orders.get(format!("applied/{key}")).unwrap().is_some());
        assert!(
            orders.get(format!("lost/{key}")).unwrap().is_none(),
            "a dropped claim's write landed for key {key}"
        );
    }
    assert_eq!(counter(&engine, "total"), KEYS as u64);
    assert_eq!(duplicates.load(Ordering::SeqCst), KEYS * (COPIES - 1));
    assert_eq!(engine.open_claims(), 0);
    // The test is only meaningful if deliveries really collided.
    assert!(
        in_progress.load(Ordering::SeqCst) > 0,
        "no delivery ever met a held claim"
    );
    eprintln!(
        "race: {KEYS} keys x {COPIES} copies on {THREADS} threads, {} in-progress encounters",
        in_progress.load(Ordering::SeqCst)
    );
}
