//! Read positions of log consumers: written in the same write batch as the claims (or not at
//! all), the highest offset per partition for a batch, never moving backwards (a stale writer
//! refused with nothing written, racing threads leaving the highest), kept across reopens,
//! checkpoints, operator resets and imports (forward only unless overwritten, checked before
//! anything is written), and absent from stores written before they existed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idemdb::admin::Store;
use idemdb::{Error, Fingerprint, Limit, Message, Outcome};

use crate::util::TestStore;

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(body.as_bytes())
}

fn offset_of(engine: &idemdb::Engine, consumer: &str, source: &str, partition: u32) -> Option<u64> {
    engine
        .consumer(consumer)
        .unwrap()
        .positions()
        .get(source, partition)
        .unwrap()
        .map(|position| position.offset)
}

#[test]
fn a_claims_position_is_written_with_its_marker_and_kept_across_reopen() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let Outcome::Fresh(mut claim) = c.begin(b"m-7", fp("7")).unwrap() else {
        panic!("fresh")
    };
    claim.put(&orders, b"o-7", b"paid").unwrap();
    claim.stage_position("orders", 2, 7).unwrap();
    // Not stored until the commit.
    assert_eq!(offset_of(&engine, "c", "orders", 2), None);
    claim.commit(b"ok").unwrap();
    let position = c.positions().get("orders", 2).unwrap().unwrap();
    assert_eq!((position.offset, position.next_offset()), (7, 8));
    assert_eq!(position.updated_at_ms, store.clock_now());
    // Other partitions, sources and consumers have none.
    assert_eq!(offset_of(&engine, "c", "orders", 3), None);
    assert_eq!(offset_of(&engine, "c", "order", 2), None);
    assert_eq!(offset_of(&engine, "d", "orders", 2), None);
    drop((c, orders, engine));

    let engine = store.open();
    assert_eq!(offset_of(&engine, "c", "orders", 2), Some(7));
    assert_eq!(
        engine
            .consumer("c")
            .unwrap()
            .positions()
            .list()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn an_aborted_claim_leaves_the_position_where_it_was() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    c.positions().advance("s", 0, 3).unwrap();
    let Outcome::Fresh(mut claim) = c.begin(b"m-4", fp("4")).unwrap() else {
        panic!("fresh")
    };
    claim.stage_position("s", 0, 4).unwrap();
    drop(claim);
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(3));
}

#[test]
fn a_commit_behind_the_position_is_refused_and_writes_nothing() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    c.positions().advance("s", 1, 10).unwrap();

    let Outcome::Fresh(mut claim) = c.begin(b"m-9", fp("9")).unwrap() else {
        panic!("fresh")
    };
    claim.put(&orders, b"o-9", b"paid").unwrap();
    claim.stage_position("s", 1, 9).unwrap();
    match claim.commit(b"ok") {
        Err(Error::PositionBehind {
            source_name,
            partition,
            stored,
            staged,
        }) => {
            assert_eq!(
                (source_name.as_str(), partition, stored, staged),
                ("s", 1, 10, 9)
            );
        }
        other => panic!("expected PositionBehind, got {other:?}"),
    }
    // Nothing of the commit landed: no marker, no business row, the position unchanged.
    assert!(c.get(b"m-9").unwrap().is_none());
    assert!(orders.get(b"o-9").unwrap().is_none());
    assert_eq!(offset_of(&engine, "c", "s", 1), Some(10));
    // The key is free again, and an offset at the position is accepted.
    let Outcome::Fresh(mut claim) = c.begin(b"m-9", fp("9")).unwrap() else {
        panic!("fresh again")
    };
    claim.stage_position("s", 1, 10).unwrap();
    claim.commit(b"ok").unwrap();
    assert_eq!(offset_of(&engine, "c", "s", 1), Some(10));
    // Advancing alone is refused the same way.
    assert!(matches!(
        c.positions().advance("s", 1, 2),
        Err(Error::PositionBehind {
            stored: 10,
            staged: 2,
            ..
        })
    ));
}

#[test]
fn the_stored_position_is_checked_after_a_reopen() {
    let store = TestStore::new();
    {
        let engine = store.open();
        engine
            .consumer("c")
            .unwrap()
            .positions()
            .advance("s", 0, 50)
            .unwrap();
    }
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    let Outcome::Fresh(mut claim) = c.begin(b"m", fp("m")).unwrap() else {
        panic!("fresh")
    };
    claim.stage_position("s", 0, 49).unwrap();
    assert!(matches!(
        claim.commit(b""),
        Err(Error::PositionBehind { stored: 50, .. })
    ));
}

#[test]
fn a_batch_stores_the_highest_offset_per_partition() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    let messages: Vec<Message<'_>> = ["a", "b", "c", "d"]
        .iter()
        .map(|key| Message::new(key.as_bytes(), fp(key)))
        .collect();
    let mut batch = c.begin_batch(&messages).unwrap();
    // Claims stage their own offsets, out of order; the batch stages one more.
    batch
        .claim_mut(0)
        .unwrap()
        .stage_position("s", 0, 100)
        .unwrap();
    batch
        .claim_mut(1)
        .unwrap()
        .stage_position("s", 0, 103)
        .unwrap();
    batch
        .claim_mut(2)
        .unwrap()
        .stage_position("s", 1, 7)
        .unwrap();
    batch
        .claim_mut(3)
        .unwrap()
        .stage_position("s", 0, 101)
        .unwrap();
    batch.stage_position("s", 1, 9).unwrap();
    // A released claim's position is not written.
    batch.claim_mut(3).unwrap();
    batch.release(1);
    batch.commit(|_| b"ok").unwrap();
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(101));
    assert_eq!(offset_of(&engine, "c", "s", 1), Some(9));
    assert!(c.get(b"b").unwrap().is_none());
}

#[test]
fn a_batch_of_duplicates_still_moves_the_position() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    let messages = [Message::new(b"a", fp("a")), Message::new(b"b", fp("b"))];
    let mut batch = c.begin_batch(&messages).unwrap();
    batch.stage_position("s", 0, 1).unwrap();
    batch.commit(|_| b"ok").unwrap();
    // Replayed (a producer's resend): every message a duplicate, nothing to claim.
    let mut batch = c.begin_batch(&messages).unwrap();
    assert!(batch.claim_mut(0).is_none() && batch.claim_mut(1).is_none());
    batch.stage_position("s", 0, 3).unwrap();
    // A write of the batch's own lands with the position, though no claim is left.
    let orders = engine.business_table("orders").unwrap();
    batch.put(&orders, b"read-3", b"duplicates").unwrap();
    let committed = batch.commit(|_| b"ok").unwrap();
    assert!(committed.iter().all(Option::is_none));
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(3));
    assert_eq!(
        orders.get(b"read-3").unwrap().as_deref(),
        Some(&b"duplicates"[..])
    );
}

#[test]
fn a_batch_behind_the_position_writes_none_of_its_claims() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    c.positions().advance("s", 0, 20).unwrap();
    c.positions().advance("s", 1, 20).unwrap();
    let messages = [Message::new(b"a", fp("a")), Message::new(b"b", fp("b"))];
    let orders = engine.business_table("orders").unwrap();
    let mut batch = c.begin_batch(&messages).unwrap();
    batch.stage_position("s", 0, 21).unwrap();
    // One partition ahead, one behind: the whole batch is refused.
    batch.stage_position("s", 1, 19).unwrap();
    batch.put(&orders, b"batch-row", b"x").unwrap();
    batch
        .claim_mut(0)
        .unwrap()
        .put(&orders, b"claim-row", b"x")
        .unwrap();
    assert!(matches!(
        batch.commit(|_| b"ok"),
        Err(Error::PositionBehind { partition: 1, .. })
    ));
    assert!(c.get(b"a").unwrap().is_none());
    assert!(orders.get(b"batch-row").unwrap().is_none());
    assert!(orders.get(b"claim-row").unwrap().is_none());
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(20));
    // The refusal reserved nothing: partition 0 may still move to 21.
    c.positions().advance("s", 0, 21).unwrap();
}

#[test]
fn racing_writers_leave_the_highest_offset_and_never_move_it_back() {
    let store = TestStore::new();
    let engine = Arc::new(store.open());
    let accepted_max = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..4u64)
        .map(|thread| {
            let engine = engine.clone();
            let accepted_max = accepted_max.clone();
            std::thread::spawn(move || {
                let c = engine.consumer("c").unwrap();
                let mut refused = 0;
                for round in 0..300u64 {
                    // Interleaved, partly decreasing offsets from four writers.
                    let offset = (round * 7 + thread * 13) % 1000;
                    let key = format!("t{thread}-{round}");
                    let Outcome::Fresh(mut claim) = c.begin(&key, fp(&key)).unwrap() else {
                        panic!("fresh")
                    };
                    claim.stage_position("s", 0, offset).unwrap();
                    match claim.commit(b"") {
                        Ok(_) => {
                            accepted_max.fetch_max(offset, Ordering::SeqCst);
                            // What any reader sees afterwards is at least this commit's offset.
                            let seen = c.positions().get("s", 0).unwrap().unwrap().offset;
                            assert!(seen >= offset, "read {seen} after committing {offset}");
                        }
                        Err(Error::PositionBehind { stored, staged, .. }) => {
                            assert!(staged < stored);
                            // The refused claim wrote nothing.
                            assert!(c.get(&key).unwrap().is_none());
                            refused += 1;
                        }
                        Err(other) => panic!("{other:?}"),
                    }
                }
                refused
            })
        })
        .collect();
    let refused: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(
        refused > 0,
        "the offsets go backwards, so some commits must be refused"
    );
    let stored = offset_of(&engine, "c", "s", 0).unwrap();
    assert_eq!(stored, accepted_max.load(Ordering::SeqCst));
    drop(engine);
    let engine = store.open();
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(stored));
}

#[test]
fn bad_sources_and_entity_claims_are_refused() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    for source in [
        String::new(),
        "s".repeat(idemdb::POSITION_SOURCE_BYTES_MAX + 1),
    ] {
        assert!(matches!(
            c.positions().advance(&source, 0, 1),
            Err(Error::LimitExceeded {
                limit: Limit::PositionSourceBytes,
                ..
            })
        ));
        assert!(matches!(
            c.positions().get(&source, 0),
            Err(Error::LimitExceeded { .. })
        ));
    }
    // NUL: refused up front on every path, as on PostgreSQL, which cannot store it.
    let nul = "orders\0eu";
    assert!(matches!(
        c.positions().advance(nul, 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        c.positions().get(nul, 0),
        Err(Error::InvalidArgument { .. })
    ));
    let Outcome::Fresh(mut claim) = c.begin(b"m-nul", fp("nul")).unwrap() else {
        panic!("fresh")
    };
    assert!(matches!(
        claim.stage_position(nul, 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
    drop(claim);
    let mut batch = c.begin_batch(&[Message::new(b"m-nul", fp("nul"))]).unwrap();
    assert!(matches!(
        batch.stage_position(nul, 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
    drop(batch);
    assert!(c.positions().list().unwrap().is_empty());
    let longest = "s".repeat(idemdb::POSITION_SOURCE_BYTES_MAX);
    c.positions().advance(&longest, u32::MAX, u64::MAX).unwrap();
    let position = c.positions().get(&longest, u32::MAX).unwrap().unwrap();
    assert_eq!(position.offset, u64::MAX);
    assert_eq!(
        position.next_offset(),
        u64::MAX,
        "saturates, never wraps to 0"
    );

    let customers = engine.entity_table("customers").unwrap();
    let Outcome::Fresh(mut claim) = customers.begin(b"cust-1", fp("x")).unwrap() else {
        panic!("fresh")
    };
    assert!(matches!(
        claim.stage_position("s", 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn consumers_with_prefix_ids_keep_separate_positions() {
    let store = TestStore::new();
    let engine = store.open();
    // "a" + source "bs" and "ab" + source "s" would collide without the length bytes.
    engine
        .consumer("a")
        .unwrap()
        .positions()
        .advance("bs", 0, 1)
        .unwrap();
    engine
        .consumer("ab")
        .unwrap()
        .positions()
        .advance("s", 0, 2)
        .unwrap();
    assert_eq!(offset_of(&engine, "a", "bs", 0), Some(1));
    assert_eq!(offset_of(&engine, "ab", "s", 0), Some(2));
    assert_eq!(offset_of(&engine, "a", "b", 0), None);
    let listed = engine.consumer("a").unwrap().positions().list().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].source, "bs");
}

#[test]
fn a_checkpoint_holds_the_positions() {
    let store = TestStore::new();
    let engine = store.open();
    engine
        .consumer("c")
        .unwrap()
        .positions()
        .advance("s", 0, 5)
        .unwrap();
    let copy = store.dir.path().join("copy");
    engine.checkpoint(&copy).unwrap();
    drop(engine);
    let engine = store.builder_at(&copy).open().unwrap();
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(5));
}

#[test]
fn operators_list_beside_the_consumer_and_reset_only_when_it_is_stopped() {
    let store = TestStore::new();
    let engine = store.open();
    let c = engine.consumer("c").unwrap();
    c.positions().advance("s", 0, 40).unwrap();
    c.positions().advance("s", 3, 41).unwrap();
    engine
        .consumer("d")
        .unwrap()
        .positions()
        .advance("t", 0, 1)
        .unwrap();

    let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
    let all = reader.positions(None).unwrap();
    assert_eq!(all.len(), 3);
    let only_c = reader.positions(Some(b"c")).unwrap();
    assert_eq!(
        only_c
            .iter()
            .map(|entry| (entry.position.partition, entry.position.offset))
            .collect::<Vec<_>>(),
        vec![(0, 40), (3, 41)]
    );
    assert!(matches!(
        reader.set_position(b"c", "s", 0, 9),
        Err(Error::ReadOnly)
    ));
    assert!(matches!(
        Store::builder(store.dir.path()).open_exclusive(),
        Err(Error::AlreadyOpen { .. })
    ));
    drop((c, engine, reader));

    let admin = Store::builder(store.dir.path()).open_exclusive().unwrap();
    // Backwards: replay from offset 10.
    let previous = admin.set_position(b"c", "s", 0, 9).unwrap().unwrap();
    assert_eq!(previous.offset, 40);
    assert_eq!(
        admin.remove_position(b"c", "s", 3).unwrap().unwrap().offset,
        41
    );
    drop(admin);

    let engine = store.open();
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(9));
    assert_eq!(offset_of(&engine, "c", "s", 3), None);
    // The reset position is what commits are checked against now.
    engine
        .consumer("c")
        .unwrap()
        .positions()
        .advance("s", 0, 10)
        .unwrap();
}

#[test]
fn a_store_without_a_positions_table_reads_none_and_gains_one_on_open() {
    let store = TestStore::new();
    drop(store.open());
    // As written by a version before positions: drop the table with plain RocksDB.
    {
        let mut db = rocksdb::DB::open_cf(
            &rocksdb::Options::default(),
            store.dir.path(),
            crate::util::TABLES,
        )
        .unwrap();
        db.drop_cf("idemdb.positions").unwrap();
    }
    let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
    assert!(reader.positions(None).unwrap().is_empty());
    drop(reader);
    let admin = Store::builder(store.dir.path()).open_exclusive().unwrap();
    assert!(admin.positions(None).unwrap().is_empty());
    assert!(matches!(
        admin.set_position(b"c", "s", 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
    drop(admin);
    let engine = store.open();
    engine
        .consumer("c")
        .unwrap()
        .positions()
        .advance("s", 0, 1)
        .unwrap();
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(1));
}

#[cfg(feature = "tokio")]
#[tokio::test]
async fn async_commits_keep_positions_in_order_and_refuse_a_stale_one() {
    let store = TestStore::new();
    let engine = store
        .builder()
        .durability(idemdb::Durability::Sync)
        .open()
        .unwrap();
    let c = engine.consumer("c").unwrap();
    let mut futures = Vec::new();
    for offset in 0..20u64 {
        let key = format!("m-{offset}");
        let Outcome::Fresh(mut claim) = c.begin(&key, fp(&key)).unwrap() else {
            panic!("fresh")
        };
        claim.stage_position("s", 0, offset).unwrap();
        // Pipelined: the next claim stages its position before this one is written.
        futures.push(claim.commit_async(b"ok"));
    }
    for future in futures {
        future.await.unwrap();
    }
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(19));
    let Outcome::Fresh(mut claim) = c.begin(b"late", fp("late")).unwrap() else {
        panic!("fresh")
    };
    claim.stage_position("s", 0, 18).unwrap();
    assert!(matches!(
        claim.commit_async(b"ok").await,
        Err(Error::PositionBehind { stored: 19, .. })
    ));
    assert!(c.get(b"late").unwrap().is_none());

    let messages = [Message::new(b"x", fp("x"))];
    let mut batch = c.begin_batch(&messages).unwrap();
    batch.stage_position("s", 0, 25).unwrap();
    batch.commit_async(|_| b"ok").await.unwrap();
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(25));
}

/// Holds the first write after it is armed until released: a commit whose position was
/// accepted is then overtaken by a later one.
#[derive(Debug, Default)]
struct HoldFirstWrite {
    armed: std::sync::atomic::AtomicBool,
    held: std::sync::Mutex<bool>,
    released: std::sync::Condvar,
}

#[derive(Debug)]
struct Hold(Arc<HoldFirstWrite>);

impl idemdb::FaultInjector for Hold {
    fn fault(&self, point: idemdb::IoPoint) -> idemdb::Fault {
        if point == idemdb::IoPoint::Write && self.0.armed.swap(false, Ordering::SeqCst) {
            let mut released = self.0.held.lock().unwrap();
            while !*released {
                let (guard, timeout) = self
                    .0
                    .released
                    .wait_timeout(released, std::time::Duration::from_secs(30))
                    .unwrap();
                released = guard;
                if timeout.timed_out() {
                    break;
                }
            }
        }
        idemdb::Fault::None
    }
}

/// On RocksDB's WAL, where writes of one engine can overtake each other. (On the commit log
/// they cannot: a write waits for the one appended before it, whose place in the log it
/// follows.)
#[test]
fn a_write_overtaken_by_a_later_offset_does_not_move_the_position_back() {
    let store = TestStore::new();
    let hold = Arc::new(HoldFirstWrite::default());
    let engine = store
        .builder()
        .without_commit_log()
        .fault_injector(Hold(hold.clone()))
        .open()
        .unwrap();
    let c = engine.consumer("c").unwrap();
    hold.armed.store(true, Ordering::SeqCst);
    let first = {
        let c = c.clone();
        std::thread::spawn(move || {
            let Outcome::Fresh(mut claim) = c.begin(b"m-5", fp("5")).unwrap() else {
                panic!("fresh")
            };
            claim.stage_position("s", 0, 5).unwrap();
            // Accepted, then held at the write.
            claim.commit(b"ok").unwrap();
        })
    };
    while hold.armed.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    // Offset 6 is written while offset 5's write waits.
    c.positions().advance("s", 0, 6).unwrap();
    *hold.held.lock().unwrap() = true;
    hold.released.notify_all();
    first.join().unwrap();
    // Offset 5 landed last; the stored position is still 6.
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(6));
    assert!(c.get(b"m-5").unwrap().is_some());
}

#[test]
fn listings_are_in_name_order_whatever_the_lengths() {
    let store = TestStore::new();
    let engine = store.open();
    // Stored keys put shorter ids and sources first (their length bytes).
    for (consumer, source) in [("b", "b"), ("b", "aa"), ("aa", "z")] {
        engine
            .consumer(consumer)
            .unwrap()
            .positions()
            .advance(source, 0, 1)
            .unwrap();
    }
    let sources: Vec<String> = engine
        .consumer("b")
        .unwrap()
        .positions()
        .list()
        .unwrap()
        .into_iter()
        .map(|position| position.source)
        .collect();
    assert_eq!(sources, ["aa", "b"]);
    drop(engine);
    let admin = Store::builder(store.dir.path()).open_read_only().unwrap();
    let listed: Vec<(Vec<u8>, String)> = admin
        .positions(None)
        .unwrap()
        .into_iter()
        .map(|entry| (entry.consumer, entry.position.source))
        .collect();
    assert_eq!(
        listed,
        [
            (b"aa".to_vec(), "z".to_owned()),
            (b"b".to_vec(), "aa".to_owned()),
            (b"b".to_vec(), "b".to_owned())
        ]
    );
}

#[test]
fn an_import_moves_positions_forward_only_unless_overwritten_and_checks_first() {
    use idemdb::Position;
    use idemdb::admin::ImportPosition;
    let store = TestStore::new();
    let engine = store.open();
    engine
        .consumer("c")
        .unwrap()
        .positions()
        .advance("s", 0, 10)
        .unwrap();
    drop(engine);
    let given = |consumer: &[u8], partition: u32, offset: u64| {
        ImportPosition::new(consumer, Position::new("s", partition, offset, 77)).unwrap()
    };
    let counts = |counts: idemdb::admin::PositionImportCounts| {
        (
            counts.imported,
            counts.advanced,
            counts.overwritten,
            counts.skipped,
        )
    };

    // Refused on a read-only open, and checked before anything is written.
    let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
    assert!(matches!(
        reader.import_positions(&[given(b"c", 0, 11)], false),
        Err(Error::ReadOnly)
    ));
    drop(reader);
    let admin = Store::builder(store.dir.path()).open_exclusive().unwrap();
    let twice = [given(b"c", 1, 1), given(b"c", 0, 11), given(b"c", 0, 12)];
    assert!(matches!(
        admin.check_import_positions(&twice),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        admin.import_positions(&twice, true),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        ImportPosition::new(b"c", Position::new("", 0, 1, 1)),
        Err(Error::LimitExceeded {
            limit: Limit::PositionSourceBytes,
            ..
        })
    ));
    assert!(matches!(
        ImportPosition::new(b"", Position::new("s", 0, 1, 1)),
        Err(Error::LimitExceeded { .. })
    ));
    let offsets = |admin: &Store| -> Vec<(Vec<u8>, u32, u64, u64)> {
        admin
            .positions(None)
            .unwrap()
            .into_iter()
            .map(|entry| {
                let p = entry.position;
                (entry.consumer, p.partition, p.offset, p.updated_at_ms)
            })
            .collect()
    };
    let before = offsets(&admin);
    assert_eq!(before.len(), 1, "nothing written by a refused import");

    // Forward only: behind and equal kept, ahead advanced, new ones imported with their time.
    let imported = admin
        .import_positions(
            &[
                given(b"c", 0, 9),
                given(b"c", 1, 3),
                given(b"d", 0, u64::MAX),
            ],
            false,
        )
        .unwrap();
    assert_eq!(counts(imported), (2, 0, 0, 1));
    assert_eq!(
        counts(
            admin
                .import_positions(&[given(b"c", 0, 10)], false)
                .unwrap()
        ),
        (0, 0, 0, 1)
    );
    assert_eq!(
        counts(
            admin
                .import_positions(&[given(b"c", 0, 20)], false)
                .unwrap()
        ),
        (0, 1, 0, 0)
    );
    // Overwrite: backwards too.
    assert_eq!(
        counts(admin.import_positions(&[given(b"c", 1, 0)], true).unwrap()),
        (0, 0, 1, 0)
    );
    assert_eq!(
        offsets(&admin),
        [
            (b"c".to_vec(), 0, 20, 77),
            (b"c".to_vec(), 1, 0, 77),
            (b"d".to_vec(), 0, u64::MAX, 77),
        ]
    );
    drop(admin);

    // The consumer resumes from the imported positions and is held to them.
    let engine = store.open();
    assert_eq!(offset_of(&engine, "c", "s", 0), Some(20));
    let c = engine.consumer("c").unwrap();
    assert!(matches!(
        c.positions().advance("s", 0, 15),
        Err(Error::PositionBehind { stored: 20, .. })
    ));
}
