//! The experimental commit log (`EngineBuilder::commit_log`): commits made durable in idemdb's
//! own log and replayed into the tables at the next open, each exactly once (merge counters
//! stay exact across reopens with and without flushes, ring wraps that need flushes, many
//! threads in one group commit, async commits), checkpoints, and stores that switch it on
//! and off.

use std::sync::Arc;

use idemdb::{Durability, Engine, Fingerprint, Outcome, merge_ops};

use crate::util::TestStore;

const SEGMENT: u64 = 64 << 10;

fn logged(store: &TestStore, durability: Durability) -> Engine {
    logged_ring(store, durability, 3)
}

/// A store on a log of `segments` segments of [`SEGMENT`] bytes.
fn logged_ring(store: &TestStore, durability: Durability, segments: usize) -> Engine {
    store
        .builder()
        .durability(durability)
        .commit_log(segments, SEGMENT)
        .open()
        .unwrap()
}

/// Commits `keys` on consumer `c`, each adding 1 to the `n` counter and writing its order.
pub(crate) fn commit_all(engine: &Engine, keys: std::ops::Range<u32>) {
    let c = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();
    for key in keys {
        let key = format!("m-{key}");
        let Outcome::Fresh(mut claim) = c.begin(&key, Fingerprint::of(&key)).unwrap() else {
            panic!("{key}: not fresh")
        };
        claim.put(&orders, &key, [7u8; 300]).unwrap();
        claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
        claim.commit(b"ok").unwrap();
    }
}

/// The bytes of RocksDB's WAL files in the store.
fn rocksdb_wal_bytes(store: &TestStore) -> u64 {
    std::fs::read_dir(store.dir.path())
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.file_name().to_string_lossy().ends_with(".log"))
        .map(|entry| entry.metadata().unwrap().len())
        .sum()
}

pub(crate) fn counter(engine: &Engine) -> u64 {
    let counters = engine.business_table("counters").unwrap();
    counters
        .get("n")
        .unwrap()
        .and_then(|value| merge_ops::read_u64(&value))
        .unwrap_or(0)
}

fn assert_all_duplicates(engine: &Engine, keys: std::ops::Range<u32>) {
    assert_all_duplicates_of(engine, keys.map(|key| format!("m-{key}")));
}

fn assert_all_duplicates_of(engine: &Engine, keys: impl Iterator<Item = String>) {
    let c = engine.consumer("c").unwrap();
    for key in keys {
        assert!(
            matches!(
                c.begin(&key, Fingerprint::of(&key)).unwrap(),
                Outcome::Duplicate { .. }
            ),
            "{key}"
        );
    }
}

#[test]
fn commits_are_replayed_exactly_once_across_reopens_and_flushes() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability);
        let wal_before = rocksdb_wal_bytes(&store);
        commit_all(&engine, 0..150);
        // The commits went to the commit log, not to RocksDB's WAL.
        assert_eq!(rocksdb_wal_bytes(&store), wal_before, "{durability:?}");
        assert!(
            store
                .dir
                .path()
                .join("idemdb-log")
                .join("segment-0")
                .exists()
        );
        drop(engine); // the tables are not flushed at close: the log holds everything
        let engine = logged(&store, durability);
        assert_eq!(counter(&engine), 150, "{durability:?}: replayed once");
        commit_all(&engine, 150..300);
        engine.flush().unwrap();
        commit_all(&engine, 300..400);
        drop(engine);
        let engine = logged(&store, durability);
        assert_eq!(counter(&engine), 400, "{durability:?}: after a flush");
        drop(engine);
        let engine = logged(&store, durability);
        assert_eq!(counter(&engine), 400, "{durability:?}: reopened again");
        assert_all_duplicates(&engine, 0..400);
    }
}

/// A reopen that declares a new table writes the store's metadata, into the table that also
/// holds the commit log's LSN, and flushes it at once. Flushed alone, that table's files said
/// the tables held every record the open had just replayed, while the other tables held them
/// only in memory: a crash then, and the next open replayed nothing and lost the commits. The
/// open flushes every table together instead.
#[test]
fn a_reopen_declaring_a_new_table_keeps_the_replayed_commits_across_a_crash() {
    let store = TestStore::new();
    let engine = logged(&store, Durability::Sync);
    commit_all(&engine, 0..50);
    drop(engine); // the tables are not flushed at close: the log holds the commits
    let with_new_table = || {
        store
            .builder()
            .durability(Durability::Sync)
            .commit_log(3, SEGMENT)
            .business_table(idemdb::TableOptions::new("invoices"))
            .open()
            .unwrap()
    };
    let engine = with_new_table();
    drop(engine); // a crash before any other flush
    let engine = with_new_table();
    assert_eq!(counter(&engine), 50);
    assert_all_duplicates(&engine, 0..50);
}

/// A reader beside the owner (an operator tool's read-only open) sees every acknowledged
/// commit while the owner runs, before any flush: it reads the commit log's records after the
/// LSN the table files hold.
#[test]
fn a_read_only_open_beside_the_owner_sees_every_acknowledged_commit() {
    use idemdb::admin::{Store, Target};
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability);
        commit_all(&engine, 0..40);
        engine.flush().unwrap();
        commit_all(&engine, 40..90);
        let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
        let c = Target::Consumer(b"c".to_vec());
        for key in 0..90 {
            let key = format!("m-{key}");
            let entry = reader.get(&c, key.as_bytes()).unwrap();
            assert!(
                entry.is_some(),
                "{durability:?}: {key} not seen by the reader"
            );
        }
        drop(reader);
        // The owner goes on; a new reader sees the newer commits too.
        commit_all(&engine, 90..95);
        let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
        assert!(reader.get(&c, b"m-94").unwrap().is_some(), "{durability:?}");
        drop(reader);
        drop(engine);
        // The readers changed nothing: the owner's next open counts each commit once.
        let engine = logged(&store, durability);
        assert_eq!(counter(&engine), 95, "{durability:?}");
    }
}

/// Readers open again and again while the owner commits, flushes and reuses its small ring's
/// segments: each reader sees every commit acknowledged before it began.
#[test]
fn read_only_opens_racing_flushes_and_reused_segments_miss_nothing() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    use idemdb::admin::{Store, Target};
    let store = TestStore::new();
    let engine = Arc::new(logged(&store, Durability::Buffered));
    let acknowledged = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (engine, acknowledged, stop) = (engine.clone(), acknowledged.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut next = 0;
            while !stop.load(Ordering::Relaxed) {
                commit_all(&engine, next..next + 1);
                next += 1;
                acknowledged.store(next, Ordering::Release);
                if next % 97 == 0 {
                    engine.flush().unwrap();
                }
                // A few thousand commits a second: a flush every few dozen milliseconds, and
                // the ring round every few hundred (a reader that finds a flush during its
                // read starts again, so the pace must leave it a chance).
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        })
    };
    let c = Target::Consumer(b"c".to_vec());
    let mut opens = 0;
    // At least 60 opens, and on until the ring went round more than once (on a busy machine
    // the writer makes fewer commits per open).
    while opens < 60 || acknowledged.load(Ordering::Acquire) <= 1_000 {
        let before = acknowledged.load(Ordering::Acquire);
        if before == 0 {
            std::thread::yield_now();
            continue;
        }
        let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
        for key in [0, before / 2, before - 1] {
            let key = format!("m-{key}");
            assert!(
                reader.get(&c, key.as_bytes()).unwrap().is_some(),
                "open {opens}: {key} (of {before} acknowledged) not seen"
            );
        }
        opens += 1;
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let written = acknowledged.load(Ordering::Acquire);
    // The ring (3 segments of 64 KiB, about 480 commits) went round more than once.
    assert!(written > 1_000, "only {written} commits");
    drop(engine);
    assert_eq!(
        counter(&logged(&store, Durability::Buffered)),
        u64::from(written)
    );
}

/// A store switched to the log still holds, in RocksDB's own WAL, what it wrote before and
/// has not flushed: a reader sees those commits and the log's.
#[test]
fn a_read_only_open_sees_commits_from_before_the_log_and_in_it() {
    use idemdb::admin::{Store, Target};
    let store = TestStore::new();
    let engine = store.builder().durability(Durability::Sync).open().unwrap();
    commit_all(&engine, 0..30);
    drop(engine);
    let engine = logged(&store, Durability::Sync);
    commit_all(&engine, 30..60);
    let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
    let c = Target::Consumer(b"c".to_vec());
    for key in 0..60 {
        let key = format!("m-{key}");
        assert!(reader.get(&c, key.as_bytes()).unwrap().is_some(), "{key}");
    }
    drop(reader);
    drop(engine);
    assert_eq!(counter(&logged(&store, Durability::Sync)), 60);
}

#[test]
fn a_full_ring_flushes_the_tables_and_goes_round() {
    let store = TestStore::new();
    let engine = logged(&store, Durability::Sync);
    // About 400 bytes a commit: 3 segments of 64 KiB hold about 480; 2,000 go round several
    // times.
    commit_all(&engine, 0..2_000);
    drop(engine);
    let engine = logged(&store, Durability::Sync);
    assert_eq!(counter(&engine), 2_000);
    assert_all_duplicates(&engine, 0..2_000);
}

#[test]
fn many_threads_commit_through_one_group_commit() {
    let store = TestStore::new();
    let engine = Arc::new(logged(&store, Durability::Sync));
    let threads: Vec<_> = (0..8u32)
        .map(|thread| {
            let engine = engine.clone();
            std::thread::spawn(move || commit_all(&engine, thread * 1_000..thread * 1_000 + 150))
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(counter(&engine), 1_200);
    let batches = engine.stats().write_batches;
    assert_eq!(
        batches, 1_200,
        "one write batch per commit, whatever the grouping"
    );
    drop(engine);
    let engine = logged(&store, Durability::Sync);
    assert_eq!(counter(&engine), 1_200);
}

#[test]
fn a_store_turns_the_log_off_and_on_again() {
    let store = TestStore::new();
    let engine = logged(&store, Durability::Sync);
    commit_all(&engine, 0..100);
    drop(engine);
    // Without the log: its records go into RocksDB's WAL, and the log goes.
    let engine = store.builder().without_commit_log().open().unwrap();
    assert_eq!(counter(&engine), 100);
    assert!(!store.dir.path().join("idemdb-log").exists());
    commit_all(&engine, 100..150);
    drop(engine);
    let engine = logged(&store, Durability::Sync);
    assert_eq!(counter(&engine), 150);
    commit_all(&engine, 150..200);
    drop(engine);
    // An operator tool's exclusive open replays the log too.
    let admin = idemdb::admin::Store::builder(store.dir.path())
        .open_exclusive()
        .unwrap();
    drop(admin);
    assert!(!store.dir.path().join("idemdb-log").exists());
    let engine = store.builder().without_commit_log().open().unwrap();
    assert_eq!(counter(&engine), 200);
    assert_all_duplicates(&engine, 0..200);
}

#[test]
fn a_checkpoint_holds_every_commit_made_before_it() {
    let store = TestStore::new();
    let engine = logged(&store, Durability::Sync);
    commit_all(&engine, 0..120);
    let copy = store.dir.path().join("copy");
    engine.checkpoint(&copy).unwrap();
    commit_all(&engine, 120..130);
    drop(engine);
    let engine = store
        .builder_at(&copy)
        .commit_log(3, SEGMENT)
        .open()
        .unwrap();
    assert_eq!(counter(&engine), 120);
}

#[test]
fn bad_log_shapes_are_refused_at_open() {
    use idemdb::{Error, Limit};
    let store = TestStore::new();
    for (segments, bytes, limit) in [
        (1, SEGMENT, Limit::CommitLogSegments),
        (usize::MAX, SEGMENT, Limit::CommitLogSegments),
        (
            idemdb::COMMIT_LOG_SEGMENTS_MAX + 1,
            SEGMENT,
            Limit::CommitLogSegments,
        ),
        (3, 1024, Limit::CommitLogSegmentBytes),
        (2, u64::MAX, Limit::CommitLogSegmentBytes),
        (
            2,
            idemdb::COMMIT_LOG_SEGMENT_BYTES_MAX + 1,
            Limit::CommitLogSegmentBytes,
        ),
    ] {
        let opened = store.builder().commit_log(segments, bytes).open();
        assert!(
            matches!(opened, Err(Error::LimitExceeded { limit: found, .. }) if found == limit),
            "{segments} x {bytes}: {opened:?}"
        );
    }
    // A log beyond the disk is refused before a byte is written: full_disk.rs, on a small
    // file system. Nothing above made a log.
    assert!(!store.dir.path().join("idemdb-log").exists());
    drop(store.builder().commit_log(2, SEGMENT).open().unwrap());
}

#[cfg(feature = "tokio")]
#[tokio::test]
async fn async_commits_go_through_the_log() {
    let store = TestStore::new();
    let engine = logged(&store, Durability::Sync);
    let c = engine.consumer("c").unwrap();
    let counters = engine.business_table("counters").unwrap();
    let mut futures = Vec::new();
    for key in 0..50 {
        let key = format!("a-{key}");
        let Outcome::Fresh(mut claim) = c.begin(&key, Fingerprint::of(&key)).unwrap() else {
            panic!("fresh")
        };
        claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
        futures.push(claim.commit_async(b"ok"));
    }
    for future in futures {
        future.await.unwrap();
    }
    drop((c, counters, engine));
    let engine = logged(&store, Durability::Sync);
    assert_eq!(counter(&engine), 50);
}

/// Async commits (the committer making groups durable while the applier applies the ones
/// before) and synchronous writers (leading groups of their own, waking one another) at once,
/// through a ring small enough to need flushes: every commit answered, each applied once.
#[cfg(feature = "tokio")]
#[test]
fn async_and_synchronous_writers_share_the_pipeline() {
    let store = TestStore::new();
    let engine = Arc::new(logged(&store, Durability::Sync));
    let synchronous: Vec<_> = (0..12u32)
        .map(|thread| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                commit_all(
                    &engine,
                    10_000 + thread * 1_000..10_000 + thread * 1_000 + 60,
                );
            })
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let c = engine.consumer("c").unwrap();
        let counters = engine.business_table("counters").unwrap();
        let mut in_flight = std::collections::VecDeque::new();
        for key in 0..600 {
            let key = format!("a-{key}");
            let Outcome::Fresh(mut claim) = c.begin(&key, Fingerprint::of(&key)).unwrap() else {
                panic!("fresh")
            };
            claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
            in_flight.push_back(claim.commit_async(b"ok"));
            if in_flight.len() > 8 {
                in_flight.pop_front().unwrap().await.unwrap();
            }
        }
        for future in in_flight {
            future.await.unwrap();
        }
    });
    for thread in synchronous {
        thread.join().unwrap();
    }
    assert_eq!(counter(&engine), 600 + 12 * 60);
    drop(engine);
    assert_eq!(counter(&logged(&store, Durability::Sync)), 600 + 12 * 60);
}

/// Found by tests written from the docs alone: async commits waiting together were joined into
/// one record, and a group of small commits larger than a segment was refused as "a batch
/// larger than a segment". Each commit is now its own record, and what does not fit in the
/// ring waits for the next group.
#[cfg(feature = "tokio")]
#[test]
fn many_small_async_commits_in_flight_fit_a_small_ring() {
    let store = TestStore::new();
    let engine = logged_ring(&store, Durability::Sync, 2);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let c = engine.consumer("c").unwrap();
        let counters = engine.business_table("counters").unwrap();
        let orders = engine.business_table("orders").unwrap();
        // About 500 KB waiting at once: several times a segment, and the whole ring.
        let futures: Vec<_> = (0..1_500)
            .map(|key| {
                let key = format!("a-{key}");
                let Outcome::Fresh(mut claim) = c.begin(&key, Fingerprint::of(&key)).unwrap()
                else {
                    panic!("fresh")
                };
                claim.put(&orders, &key, [7u8; 200]).unwrap();
                claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
                claim.commit_async(b"ok")
            })
            .collect();
        for future in futures {
            future.await.unwrap();
        }
    });
    assert_eq!(counter(&engine), 1_500);
    drop(engine);
    let engine = logged_ring(&store, Durability::Sync, 2);
    assert_eq!(counter(&engine), 1_500);
}

/// Found by tests written from the docs alone: writers queued behind a leader whose group
/// filled the ring with its own records were refused ("the commit log is full") instead of
/// waiting for the next group, which flushes the tables first.
#[test]
fn queued_writers_wait_for_room_instead_of_failing() {
    let store = TestStore::new();
    let engine = logged_ring(&store, Durability::Sync, 2);
    std::thread::scope(|scope| {
        for thread in 0..8 {
            let engine = &engine;
            scope.spawn(move || {
                let c = engine.consumer("c").unwrap();
                let orders = engine.business_table("orders").unwrap();
                for round in 0..20 {
                    // About 30 KiB a batch: two fit in a segment, four in the ring.
                    let keys: Vec<String> =
                        (0..10).map(|i| format!("q{thread}-{round}-{i}")).collect();
                    let messages: Vec<idemdb::Message<'_>> = keys
                        .iter()
                        .map(|key| idemdb::Message::new(key, Fingerprint::of(key)))
                        .collect();
                    let mut batch = c.begin_batch(&messages).unwrap();
                    for (index, key) in keys.iter().enumerate() {
                        batch
                            .claim_mut(index)
                            .unwrap()
                            .put(&orders, key, vec![5u8; 3 << 10])
                            .unwrap();
                    }
                    batch.commit(|_| b"ok").unwrap();
                }
            });
        }
    });
    drop(engine);
    let engine = logged_ring(&store, Durability::Sync, 2);
    assert_all_duplicates_of(
        &engine,
        (0..8)
            .flat_map(|t| (0..20).flat_map(move |r| (0..10).map(move |i| format!("q{t}-{r}-{i}")))),
    );
}

/// How a test commits: each path that stages read positions.
#[derive(Clone, Copy, Debug)]
enum CommitPath {
    Claim,
    Batch,
    #[cfg(feature = "tokio")]
    ClaimAsync,
    #[cfg(feature = "tokio")]
    BatchAsync,
}

impl CommitPath {
    const ALL: &[CommitPath] = &[
        CommitPath::Claim,
        CommitPath::Batch,
        #[cfg(feature = "tokio")]
        CommitPath::ClaimAsync,
        #[cfg(feature = "tokio")]
        CommitPath::BatchAsync,
    ];

    /// Claims `key` on consumer `c`, puts a value of `value_bytes` into `orders` and stages
    /// offset `offset` of partition 0 of `s`, then commits along this path.
    fn commit(
        self,
        engine: &Engine,
        key: &str,
        value_bytes: usize,
        offset: u64,
    ) -> idemdb::Result<()> {
        let c = engine.consumer("c").unwrap();
        let orders = engine.business_table("orders").unwrap();
        let value = vec![7u8; value_bytes];
        let single = |c: &idemdb::Consumer| {
            let Outcome::Fresh(mut claim) = c.begin(key, Fingerprint::of(key)).unwrap() else {
                panic!("{key}: not fresh")
            };
            claim.put(&orders, key, &value).unwrap();
            claim.stage_position("s", 0, offset).unwrap();
            claim
        };
        let batch = |c: &idemdb::Consumer| {
            let message = idemdb::Message::new(key.as_bytes(), Fingerprint::of(key));
            let mut batch = c.begin_batch(&[message]).unwrap();
            batch.put(&orders, key, &value).unwrap();
            batch.stage_position("s", 0, offset).unwrap();
            batch
        };
        match self {
            CommitPath::Claim => single(&c).commit(b"ok").map(drop),
            CommitPath::Batch => batch(&c).commit(|_| b"ok").map(drop),
            #[cfg(feature = "tokio")]
            CommitPath::ClaimAsync => block_on(single(&c).commit_async(b"ok")).map(drop),
            #[cfg(feature = "tokio")]
            CommitPath::BatchAsync => block_on(batch(&c).commit_async(|_| b"ok")).map(drop),
        }
    }
}

#[cfg(feature = "tokio")]
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(future)
}

#[test]
fn a_commit_too_large_for_the_log_gives_its_read_position_back() {
    use idemdb::Error;
    for &path in CommitPath::ALL {
        for durability in [Durability::Sync, Durability::Buffered] {
            let store = TestStore::new();
            let engine = logged_ring(&store, durability, 2);
            let c = engine.consumer("c").unwrap();
            let at = |c: &idemdb::Consumer| {
                c.positions()
                    .get("s", 0)
                    .unwrap()
                    .map(|position| position.offset)
            };
            path.commit(&engine, "m-10", 10, 10).unwrap();
            // A value larger than the whole log (2 segments of 64 KiB): refused, nothing
            // written.
            let refused = path.commit(&engine, "m-20", 200_000, 20);
            match &refused {
                Err(Error::InvalidArgument { reason }) => {
                    assert!(reason.contains("split the commit"), "{reason}")
                }
                other => panic!("{path:?} {durability:?}: {other:?}"),
            }
            assert_eq!(at(&c), Some(10), "{path:?} {durability:?}");
            assert!(c.get(b"m-20").unwrap().is_none());
            // The same work split smaller commits below the refused offset, at once.
            path.commit(&engine, "m-15", 10, 15)
                .unwrap_or_else(|error| panic!("{path:?} {durability:?}: {error:?}"));
            c.positions().advance("s", 0, 16).unwrap();
            path.commit(&engine, "m-20", 10, 20).unwrap();
            assert_eq!(at(&c), Some(20), "{path:?} {durability:?}");
            // Still refused behind what was written.
            assert!(matches!(
                path.commit(&engine, "m-19", 10, 19),
                Err(Error::PositionBehind {
                    stored: 20,
                    staged: 19,
                    ..
                })
            ));
        }
    }
}

/// On a 32 MiB file system (a tmpfs the test mounts, as root; skipped where that is refused).
#[test]
fn an_open_refused_for_the_logs_size_changes_nothing() {
    use idemdb::{Error, StorageErrorKind};
    let Some(disk) = crate::tmpfs::Tmpfs::mount(32) else {
        eprintln!(
            "skipped an_open_refused_for_the_logs_size_changes_nothing: mounting a tmpfs was \
             refused (the test needs root or CAP_SYS_ADMIN)"
        );
        return;
    };
    // Its first two segments, 64 MiB each, do not fit.
    let huge = |store: &TestStore, path: &std::path::Path| {
        store
            .builder_at(path)
            .commit_log(idemdb::COMMIT_LOG_SEGMENTS_MAX, 64 << 20)
            .open()
    };
    let listing = crate::files::lengths;
    let no_space = |opened: idemdb::Result<Engine>| {
        assert!(
            matches!(
                &opened,
                Err(Error::Storage {
                    kind: StorageErrorKind::NoSpace,
                    ..
                })
            ),
            "{opened:?}"
        );
    };
    // A store with a commit still in RocksDB's WAL (buffered: no flush at close).
    let store = TestStore::new();
    let path = disk.path().join("store");
    commit_all(
        &store.builder_at(&path).without_commit_log().open().unwrap(),
        0..1,
    );
    let before = listing(&path);
    assert!(
        before
            .iter()
            .any(|(name, bytes)| name.ends_with(".log") && *bytes > 0)
    );
    no_space(huge(&store, &path));
    assert_eq!(listing(&path), before, "the store was changed");
    // An empty directory stays empty.
    let empty = disk.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    no_space(huge(&store, &empty));
    assert_eq!(listing(&empty), Vec::new());
    // A missing path, two levels deep, is not created.
    let missing = disk.path().join("a").join("store");
    no_space(huge(&store, &missing));
    assert!(!disk.path().join("a").exists());
    // Both open with a log that fits, the commit kept.
    let engine = store
        .builder_at(&path)
        .commit_log(2, SEGMENT)
        .open()
        .unwrap();
    assert_eq!(counter(&engine), 1);
    drop(
        store
            .builder_at(&empty)
            .commit_log(2, SEGMENT)
            .open()
            .unwrap(),
    );
}

/// The segment files of the store's log.
fn log_segments(store: &TestStore) -> usize {
    std::fs::read_dir(store.dir.path().join("idemdb-log"))
        .unwrap()
        .filter(|entry| {
            let name = entry.as_ref().unwrap().file_name();
            let name = name.to_string_lossy();
            name.starts_with("segment-") && !name.ends_with(".new")
        })
        .count()
}

/// A new log is made with two segments, whatever its most, and grows a segment at a time as
/// commits need room; it keeps what it grew to, and every commit replays exactly.
#[test]
fn a_new_log_is_made_with_two_segments_and_grows_as_commits_need() {
    let store = TestStore::new();
    let engine = logged_ring(&store, Durability::Sync, 6);
    assert_eq!(log_segments(&store), 2, "made with two segments");
    // About 400 bytes a commit: some 160 commits a segment, none flushed meanwhile.
    commit_all(&engine, 0..400);
    let grown = log_segments(&store);
    assert!((3..=6).contains(&grown), "{grown} segments");
    drop(engine);
    let engine = logged_ring(&store, Durability::Sync, 6);
    assert_eq!(counter(&engine), 400);
    commit_all(&engine, 400..1400);
    assert_eq!(log_segments(&store), 6, "grown to its most, then reused");
    drop(engine);
    // A later open with a smaller most keeps the segments the log has.
    let engine = logged_ring(&store, Durability::Sync, 2);
    assert_eq!(counter(&engine), 1400);
    assert_eq!(log_segments(&store), 6);
}

/// A commit larger than a segment (but not than the whole log) gets a free segment enlarged to
/// its size; it replays after a reopen, and the segment is cut back once a flush holds it.
#[test]
fn a_commit_larger_than_a_segment_gets_a_segment_of_its_own() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged_ring(&store, durability, 4);
        let c = engine.consumer("c").unwrap();
        let orders = engine.business_table("orders").unwrap();
        let Outcome::Fresh(mut claim) = c.begin("large", Fingerprint::of(b"large")).unwrap() else {
            panic!("fresh expected");
        };
        claim.put(&orders, "large", vec![9u8; 150_000]).unwrap();
        claim.commit(b"ok").unwrap();
        let large = |store: &TestStore| {
            std::fs::read_dir(store.dir.path().join("idemdb-log"))
                .unwrap()
                .filter(|entry| entry.as_ref().unwrap().metadata().unwrap().len() > SEGMENT)
                .count()
        };
        assert_eq!(log_segments(&store), 2, "{durability:?}: enlarged in place");
        assert_eq!(large(&store), 1, "{durability:?}");
        commit_all(&engine, 0..10);
        drop((c, orders, engine));
        let engine = logged_ring(&store, durability, 4);
        let orders = engine.business_table("orders").unwrap();
        assert_eq!(orders.get("large").unwrap().map(|v| v.len()), Some(150_000));
        assert_eq!(counter(&engine), 10, "{durability:?}");
        engine.flush().unwrap();
        assert_eq!(large(&store), 0, "{durability:?}: cut back by the flush");
    }
}
