//! The commit log's ring as `EngineBuilder::commit_log` documents it, tried the way a user
//! could break it without meaning to: a new log made with the fewest segments, grown a segment
//! at a time (made ahead of need) up to its most, a full ring flushing; commits larger than a
//! segment getting a segment of their size (cut back once a flush holds them), one larger than
//! the whole log refused and one exactly at its size taken; reopens with other numbers, with
//! and without the log; claim batches, async commits, checkpoints and read-only opens beside
//! a grown log; and a small disk.

use std::path::Path;
use std::time::{Duration, Instant};

use idemdb::{COMMIT_LOG_SEGMENTS_MIN, Durability, Engine, Error, Fingerprint, Outcome};

use crate::commit_log::{commit_all, counter};
use crate::util::TestStore;

const SEGMENT: u64 = 64 << 10;
/// A segment's header (docs: "`segment_bytes` less 32 bytes of header").
const SEGMENT_HEADER: u64 = 32;
/// A record's header (docs: "a commit takes 24 bytes of record header besides its write
/// batch's encoding").
const RECORD_HEADER: u64 = 24;

/// A store on a log of at most `segments` segments of `segment_bytes`.
fn logged(store: &TestStore, durability: Durability, segments: usize, bytes: u64) -> Engine {
    logged_at(store, store.dir.path(), durability, segments, bytes)
}

fn logged_at(
    store: &TestStore,
    path: &Path,
    durability: Durability,
    segments: usize,
    bytes: u64,
) -> Engine {
    store
        .builder_at(path)
        .durability(durability)
        .commit_log(segments, bytes)
        // The ring's growth, not its shrink (tests/it/default_log.rs, shrink_docs.rs): a
        // loaded machine's pause must not give segments back under these counts.
        .commit_log_shrink_after(Duration::MAX)
        .open()
        .unwrap_or_else(|error| panic!("{segments} x {bytes}: {error:?}"))
}

/// Commits `key` with an order of `value_bytes` bytes and 1 added to the `n` counter.
fn commit_large(engine: &Engine, key: &str, value_bytes: usize) -> idemdb::Result<()> {
    let c = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();
    let Outcome::Fresh(mut claim) = c.begin(key, Fingerprint::of(key)).unwrap() else {
        panic!("{key}: not fresh")
    };
    claim.put(&orders, key, vec![9u8; value_bytes]).unwrap();
    claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
    claim.commit(b"ok").map(drop)
}

fn order_len(engine: &Engine, key: &str) -> Option<usize> {
    engine
        .business_table("orders")
        .unwrap()
        .get(key)
        .unwrap()
        .map(|value| value.len())
}

fn assert_duplicates(engine: &Engine, keys: impl IntoIterator<Item = String>) {
    let c = engine.consumer("c").unwrap();
    for key in keys {
        assert!(
            matches!(
                c.begin(&key, Fingerprint::of(&key)).unwrap(),
                Outcome::Duplicate { .. }
            ),
            "{key} not a duplicate"
        );
    }
}

fn small_keys(keys: std::ops::Range<u32>) -> impl Iterator<Item = String> {
    keys.map(|key| format!("m-{key}"))
}

/// The sizes of the log's segment files (not the ones being made, `.new`), by name.
fn segment_sizes_at(path: &Path) -> Vec<(String, u64)> {
    crate::files::lengths(&path.join("idemdb-log"))
        .into_iter()
        .filter(|(name, _)| name.starts_with("segment-") && !name.ends_with(".new"))
        .collect()
}

fn segment_sizes(store: &TestStore) -> Vec<(String, u64)> {
    segment_sizes_at(store.dir.path())
}

fn segments(store: &TestStore) -> usize {
    segment_sizes(store).len()
}

/// Waits up to 10 s for the log to have `want` segments.
fn wait_for_segments(store: &TestStore, want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let have = segments(store);
        if have >= want || Instant::now() > deadline {
            return have;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn is_invalid_argument(result: &idemdb::Result<()>) -> bool {
    matches!(result, Err(Error::InvalidArgument { .. }))
}

/// The most a commit's write batch may encode to: the whole log less a record header.
fn whole_log_payload(segments: usize, segment_bytes: u64) -> u64 {
    segments as u64 * (segment_bytes - SEGMENT_HEADER) - RECORD_HEADER
}

/// A new log is made with `COMMIT_LOG_SEGMENTS_MIN` segments of `segment_bytes` whatever
/// `segments` is (its least, a few, the most allowed).
#[test]
fn a_new_log_is_made_with_the_fewest_segments_whatever_its_most() {
    for most in [
        COMMIT_LOG_SEGMENTS_MIN,
        3,
        64,
        idemdb::COMMIT_LOG_SEGMENTS_MAX,
    ] {
        let store = TestStore::new();
        let engine = logged(&store, Durability::Sync, most, SEGMENT);
        let sizes = segment_sizes(&store);
        assert_eq!(
            sizes.len(),
            COMMIT_LOG_SEGMENTS_MIN,
            "most {most}: {sizes:?}"
        );
        assert!(
            sizes.iter().all(|(_, bytes)| *bytes == SEGMENT),
            "most {most}: {sizes:?}"
        );
        drop(engine);
    }
}

/// The ring grows a segment at a time (never two between commits of 400 bytes), each of
/// `segment_bytes`, up to `segments` and no further, and every commit replays exactly once
/// (Sync and Buffered).
#[test]
fn the_ring_grows_a_segment_at_a_time_up_to_its_most() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let most = 5;
        let engine = logged(&store, durability, most, SEGMENT);
        let mut seen = vec![segments(&store)];
        for key in 0..2_500 {
            commit_all(&engine, key..key + 1);
            let now = segments(&store);
            let last = *seen.last().unwrap();
            assert!(
                now == last || now == last + 1,
                "{durability:?}: {last} then {now} segments after commit {key}"
            );
            assert!(now <= most, "{durability:?}: {now} segments, most {most}");
            if now != last {
                seen.push(now);
            }
        }
        assert_eq!(seen, (2..=most).collect::<Vec<_>>(), "{durability:?}");
        assert!(
            segment_sizes(&store).iter().all(|(_, b)| *b == SEGMENT),
            "{durability:?}: {:?}",
            segment_sizes(&store)
        );
        drop(engine);
        let engine = logged(&store, durability, most, SEGMENT);
        assert_eq!(counter(&engine), 2_500, "{durability:?}");
        assert_duplicates(&engine, small_keys(0..2_500).step_by(97));
    }
}

/// The next segment is made ahead of need: once the writer switches into the last free
/// segment, a third appears without another commit.
#[test]
fn the_next_segment_is_made_ahead_of_need() {
    let store = TestStore::new();
    let engine = logged(&store, Durability::Sync, 6, SEGMENT);
    assert_eq!(segments(&store), 2);
    // About 400 bytes a commit: 200 commits fill the first segment and go into the second.
    commit_all(&engine, 0..200);
    assert_eq!(
        wait_for_segments(&store, 3),
        3,
        "no segment made after the switch into the last free one"
    );
    drop(engine);
    let engine = logged(&store, Durability::Sync, 6, SEGMENT);
    assert_eq!(counter(&engine), 200);
}

/// Reopened with a larger most, the ring grows further; reopened with a smaller one, it
/// keeps the segments it has (and grows no more); every commit survives each reopen.
#[test]
fn reopens_with_more_and_fewer_segments() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 3, SEGMENT);
        commit_all(&engine, 0..1_000);
        assert_eq!(segments(&store), 3, "{durability:?}");
        drop(engine);
        let engine = logged(&store, durability, 6, SEGMENT);
        assert_eq!(segments(&store), 3, "{durability:?}: kept at reopen");
        assert_eq!(counter(&engine), 1_000, "{durability:?}");
        commit_all(&engine, 1_000..3_000);
        assert_eq!(segments(&store), 6, "{durability:?}: grew to the new most");
        drop(engine);
        let engine = logged(&store, durability, 2, SEGMENT);
        assert_eq!(counter(&engine), 3_000, "{durability:?}");
        assert_eq!(
            segments(&store),
            6,
            "{durability:?}: kept with a smaller most"
        );
        commit_all(&engine, 3_000..5_000);
        assert_eq!(
            segments(&store),
            6,
            "{durability:?}: neither grown nor shrunk"
        );
        drop(engine);
        let engine = logged(&store, durability, 4, SEGMENT);
        assert_eq!(counter(&engine), 5_000, "{durability:?}");
        assert_duplicates(&engine, small_keys(0..5_000).step_by(101));
    }
}

/// The segments' size is fixed when the log is made: reopened with another `segment_bytes`
/// (larger, then smaller), the store opens, the segments keep their size, and every commit
/// survives, a commit larger than the log's segment among them.
#[test]
fn a_reopen_with_another_segment_size_keeps_the_logs_size() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 4, SEGMENT);
        commit_all(&engine, 0..300);
        drop(engine);
        let engine = logged(&store, durability, 4, 4 * SEGMENT);
        assert_eq!(counter(&engine), 300, "{durability:?}");
        assert!(
            segment_sizes(&store).iter().all(|(_, b)| *b == SEGMENT),
            "{durability:?}: {:?}",
            segment_sizes(&store)
        );
        // Larger than the log's segments, smaller than the ones asked for.
        commit_large(&engine, "large-1", 100_000)
            .unwrap_or_else(|error| panic!("{durability:?}: {error:?}"));
        commit_all(&engine, 300..1_200);
        drop(engine);
        let engine = logged(
            &store,
            durability,
            4,
            COMMIT_LOG_SEGMENTS_MIN as u64 * SEGMENT,
        );
        assert_eq!(counter(&engine), 1_201, "{durability:?}");
        assert_eq!(order_len(&engine, "large-1"), Some(100_000));
        drop(engine);
        let engine = logged(&store, durability, 4, SEGMENT);
        assert_eq!(counter(&engine), 1_201, "{durability:?}");
        assert_duplicates(&engine, small_keys(0..1_200).step_by(37));
    }
}

/// A commit larger than a segment, the first thing after a new log's open and the first
/// after a reopen: a free segment is enlarged for it (at least its size; the log keeps its
/// two segments), it replays, and the segment is cut back by a flush after a reopen.
#[test]
fn a_large_commit_right_after_open_gets_its_own_segment() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 4, SEGMENT);
        commit_large(&engine, "large-1", 150_000)
            .unwrap_or_else(|error| panic!("{durability:?}: {error:?}"));
        let sizes = segment_sizes(&store);
        assert_eq!(sizes.len(), 2, "{durability:?}: {sizes:?}");
        assert!(
            sizes.iter().any(|(_, b)| *b >= 150_000),
            "{durability:?}: {sizes:?}"
        );
        drop(engine);
        // Reopened: the first commit is large again.
        let engine = logged(&store, durability, 4, SEGMENT);
        assert_eq!(
            order_len(&engine, "large-1"),
            Some(150_000),
            "{durability:?}"
        );
        commit_large(&engine, "large-2", 200_000)
            .unwrap_or_else(|error| panic!("{durability:?}: {error:?}"));
        commit_all(&engine, 0..20);
        drop(engine);
        let engine = logged(&store, durability, 4, SEGMENT);
        assert_eq!(
            order_len(&engine, "large-2"),
            Some(200_000),
            "{durability:?}"
        );
        assert_eq!(counter(&engine), 22, "{durability:?}");
        engine.flush().unwrap();
        let sizes = segment_sizes(&store);
        assert!(
            sizes.iter().all(|(_, b)| *b == SEGMENT) && sizes.len() <= 4,
            "{durability:?}: a large segment left after the flush: {sizes:?}"
        );
        drop(engine);
        let engine = logged(&store, durability, 4, SEGMENT);
        assert_eq!(counter(&engine), 22, "{durability:?}");
    }
}

/// A commit larger than a segment is "removed once the tables hold it": in a running engine,
/// `Engine::flush` makes the tables hold it, so its segment goes (with and without small
/// commits after it in that segment, and after the ring switched on past it).
#[test]
fn a_flush_in_the_running_engine_removes_a_large_commits_segment() {
    for durability in [Durability::Sync, Durability::Buffered] {
        for small_after in [0, 5, 1_000] {
            let store = TestStore::new();
            let engine = logged(&store, durability, 4, SEGMENT);
            commit_large(&engine, "large-1", 120_000).unwrap();
            commit_all(&engine, 0..small_after);
            if small_after < 1_000 {
                // (A thousand small commits fill the ring, whose own flush gives it back.)
                assert!(segment_sizes(&store).iter().any(|(_, b)| *b > SEGMENT));
            }
            engine.flush().unwrap();
            let sizes = segment_sizes(&store);
            assert!(
                sizes.iter().all(|(_, b)| *b == SEGMENT) && sizes.len() <= 4,
                "{durability:?}, {small_after} small commits after it: the large segment stayed \
                 after a flush: {sizes:?}"
            );
            drop(engine);
            let engine = logged(&store, durability, 4, SEGMENT);
            assert_eq!(counter(&engine), 1 + u64::from(small_after));
            assert_eq!(order_len(&engine, "large-1"), Some(120_000));
        }
    }
}

/// Many commits larger than a segment in a row (together many times the whole log), with
/// small ones between: each is taken and replays after a reopen.
#[test]
fn many_large_commits_in_a_row_are_all_taken() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let most = 4;
        let engine = logged(&store, durability, most, SEGMENT);
        for n in 0..40 {
            let bytes = 70_000 + (n % 5) * 40_000; // 70 KB to 230 KB: all under the whole log
            commit_large(&engine, &format!("large-{n}"), bytes)
                .unwrap_or_else(|error| panic!("{durability:?}: large-{n}: {error:?}"));
            commit_all(&engine, n as u32 * 3..n as u32 * 3 + 3);
        }
        drop(engine);
        let engine = logged(&store, durability, most, SEGMENT);
        assert_eq!(counter(&engine), 160, "{durability:?}");
        for n in 0..40 {
            assert_eq!(
                order_len(&engine, &format!("large-{n}")),
                Some(70_000 + (n % 5) * 40_000),
                "{durability:?}: large-{n}"
            );
        }
        assert_duplicates(&engine, small_keys(0..120).step_by(7));
    }
}

/// A large commit's segment is cut back once the tables hold it: after many large commits in
/// a row, a reopen and a flush leave only segments of the ring's size, at most one more than
/// its most (the one a large record may take beyond it, removed once it is not written).
#[test]
fn a_flush_after_a_reopen_removes_every_large_commits_segment() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let most = 4;
        let engine = logged(&store, durability, most, SEGMENT);
        for n in 0..40 {
            commit_large(&engine, &format!("large-{n}"), 70_000 + (n % 5) * 40_000).unwrap();
            commit_all(&engine, n as u32 * 3..n as u32 * 3 + 3);
        }
        drop(engine);
        let engine = logged(&store, durability, most, SEGMENT);
        assert_eq!(counter(&engine), 160, "{durability:?}");
        engine.flush().unwrap();
        let sizes = segment_sizes(&store);
        assert!(
            sizes.iter().all(|(_, b)| *b == SEGMENT) && sizes.len() <= most + 1,
            "{durability:?}: {} files after a reopen and a flush: {sizes:?}",
            sizes.len()
        );
    }
}

/// The log stays within twice the size `commit_log` gives it (`segments` x `segment_bytes`):
/// large commits take no more than that again, until the tables hold them. Many large commits
/// in a row (100 of 100 KB on 4 x 64 KiB, no small ones) must not leave a segment per commit,
/// and a flush must cut their segments back.
#[test]
fn many_large_commits_in_a_row_keep_the_log_bounded() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let most = 4;
        let engine = logged(&store, durability, most, SEGMENT);
        let mut most_files = 0;
        let mut most_bytes = 0;
        for n in 0..100 {
            commit_large(&engine, &format!("large-{n}"), 100_000)
                .unwrap_or_else(|error| panic!("{durability:?}: large-{n}: {error:?}"));
            let sizes = segment_sizes(&store);
            most_files = most_files.max(sizes.len());
            most_bytes = most_bytes.max(sizes.iter().map(|(_, b)| b).sum::<u64>());
        }
        engine.flush().unwrap();
        let after_flush = segment_sizes(&store);
        // Large commits take at most as much again as the ring's most (the docs' bound), and
        // one segment of the largest commit's size besides (rounded to 4 KiB).
        let bound = (2 * most as u64 + 1) * SEGMENT + (104 << 10);
        assert!(
            most_bytes <= bound && most_files <= most + 1,
            "{durability:?}: the log reached {most_files} files, {most_bytes} bytes (bound \
             {bound}); after a flush {} files",
            after_flush.len()
        );
        assert!(
            after_flush.iter().all(|(_, b)| *b == SEGMENT),
            "{durability:?}: after a flush: {after_flush:?}"
        );
        drop(engine);
        let engine = logged(&store, durability, most, SEGMENT);
        assert_eq!(counter(&engine), 100, "{durability:?}");
    }
}

/// A claim batch larger than a segment gets a segment of its own and replays whole; one
/// larger than the whole log is refused with `InvalidArgument` and none of its messages is
/// written (not before, not after a reopen).
#[test]
fn a_large_claim_batch() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 4, SEGMENT);
        commit_all(&engine, 0..10);
        let batch_commit = |prefix: &str, value_bytes: usize| {
            let c = engine.consumer("c").unwrap();
            let orders = engine.business_table("orders").unwrap();
            let keys: Vec<String> = (0..3).map(|i| format!("{prefix}-{i}")).collect();
            let messages: Vec<idemdb::Message<'_>> = keys
                .iter()
                .map(|key| idemdb::Message::new(key, Fingerprint::of(key)))
                .collect();
            let mut batch = c.begin_batch(&messages).unwrap();
            for (index, key) in keys.iter().enumerate() {
                batch
                    .claim_mut(index)
                    .unwrap()
                    .put(&orders, key, vec![5u8; value_bytes])
                    .unwrap();
            }
            batch.commit(|_| b"ok").map(drop)
        };
        // About 180 KB: larger than a segment, smaller than the log.
        batch_commit("b", 60_000).unwrap_or_else(|error| panic!("{durability:?}: {error:?}"));
        // About 300 KB: larger than the whole log (4 x 64 KiB).
        let refused = batch_commit("huge", 100_000);
        assert!(is_invalid_argument(&refused), "{durability:?}: {refused:?}");
        let c = engine.consumer("c").unwrap();
        for i in 0..3 {
            assert!(
                c.get(format!("huge-{i}")).unwrap().is_none(),
                "{durability:?}"
            );
            assert_eq!(order_len(&engine, &format!("huge-{i}")), None);
        }
        commit_all(&engine, 10..20);
        drop((c, engine));
        let engine = logged(&store, durability, 4, SEGMENT);
        for i in 0..3 {
            assert_eq!(order_len(&engine, &format!("b-{i}")), Some(60_000));
            assert_eq!(order_len(&engine, &format!("huge-{i}")), None);
        }
        assert_eq!(counter(&engine), 20, "{durability:?}");
        assert_duplicates(&engine, (0..3).map(|i| format!("b-{i}")));
        let c = engine.consumer("c").unwrap();
        assert!(matches!(
            c.begin("huge-0", Fingerprint::of("huge-0")).unwrap(),
            Outcome::Fresh(_)
        ));
    }
}

/// Async commits, large (larger than a segment) and small mixed, many in flight, with one
/// larger than the whole log among them: every other commit is answered and replays once;
/// the refused one is refused with `InvalidArgument` and nothing of it written.
#[cfg(feature = "tokio")]
#[test]
fn async_commits_large_and_small_mixed() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 4, SEGMENT);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let c = engine.consumer("c").unwrap();
            let orders = engine.business_table("orders").unwrap();
            let counters = engine.business_table("counters").unwrap();
            let mut in_flight = std::collections::VecDeque::new();
            for n in 0..600u32 {
                let key = format!("a-{n}");
                let Outcome::Fresh(mut claim) = c.begin(&key, Fingerprint::of(&key)).unwrap()
                else {
                    panic!("fresh")
                };
                let bytes = match n {
                    300 => 400_000, // larger than the whole log
                    n if n % 25 == 0 => 100_000,
                    _ => 200,
                };
                claim.put(&orders, &key, vec![3u8; bytes]).unwrap();
                claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
                in_flight.push_back((n, claim.commit_async(b"ok")));
                if in_flight.len() > 16 {
                    let (n, future) = in_flight.pop_front().unwrap();
                    let result = future.await.map(drop);
                    check_async(durability, n, result);
                }
            }
            for (n, future) in in_flight {
                check_async(durability, n, future.await.map(drop));
            }
        });
        assert_eq!(counter(&engine), 599, "{durability:?}");
        assert_eq!(order_len(&engine, "a-300"), None);
        drop(engine);
        let engine = logged(&store, durability, 4, SEGMENT);
        assert_eq!(counter(&engine), 599, "{durability:?}");
        assert_eq!(order_len(&engine, "a-300"), None);
        assert_eq!(order_len(&engine, "a-275"), Some(100_000));
        assert_duplicates(
            &engine,
            (0..600).filter(|n| *n != 300).map(|n| format!("a-{n}")),
        );
    }
}

#[cfg(feature = "tokio")]
fn check_async(durability: Durability, n: u32, result: idemdb::Result<()>) {
    if n == 300 {
        assert!(is_invalid_argument(&result), "{durability:?}: {result:?}");
    } else {
        result.unwrap_or_else(|error| panic!("{durability:?}: a-{n}: {error:?}"));
    }
}

/// A checkpoint taken after the ring grew and a large commit holds every commit before it,
/// and opens (with the log, with another most, and without it).
#[test]
fn a_checkpoint_after_growth_and_a_large_commit_opens_whole() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 5, SEGMENT);
        commit_all(&engine, 0..600);
        assert!(segments(&store) > 2, "{durability:?}: the ring grew");
        commit_large(&engine, "large-1", 150_000).unwrap();
        commit_all(&engine, 600..650);
        let copy = store.dir.path().join("copy");
        engine.checkpoint(&copy).unwrap();
        commit_all(&engine, 650..700);
        let copy_engine = logged_at(&store, &copy, durability, 5, SEGMENT);
        assert_eq!(counter(&copy_engine), 651, "{durability:?}");
        assert_eq!(order_len(&copy_engine, "large-1"), Some(150_000));
        commit_all(&copy_engine, 700..900);
        drop(copy_engine);
        let copy_engine = logged_at(&store, &copy, durability, 2, SEGMENT);
        assert_eq!(counter(&copy_engine), 851, "{durability:?}");
        drop(copy_engine);
        let copy_engine = store.builder_at(&copy).open().unwrap();
        assert_eq!(counter(&copy_engine), 851, "{durability:?}");
        assert_eq!(order_len(&copy_engine, "large-1"), Some(150_000));
        drop(copy_engine);
        drop(engine);
        let engine = logged(&store, durability, 5, SEGMENT);
        assert_eq!(counter(&engine), 701, "{durability:?}");
    }
}

/// The operator tool's read-only open beside the running engine sees every acknowledged
/// commit after the ring grew and after a large commit (in its own segment), before any
/// flush; and after a flush removed that segment.
#[test]
fn a_read_only_open_beside_a_grown_log_and_a_large_commit() {
    use idemdb::admin::{Store, Target};
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 6, SEGMENT);
        let c = Target::Consumer(b"c".to_vec());
        commit_all(&engine, 0..700);
        assert!(segments(&store) > 3, "{durability:?}: the ring grew");
        let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
        for key in small_keys(0..700).step_by(7).chain(["m-699".to_owned()]) {
            assert!(
                reader.get(&c, key.as_bytes()).unwrap().is_some(),
                "{durability:?}: after growth, {key} not seen"
            );
        }
        drop(reader);
        commit_large(&engine, "large-1", 150_000).unwrap();
        commit_all(&engine, 700..710);
        let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
        for key in ["m-0", "m-699", "large-1", "m-700", "m-709"] {
            assert!(
                reader.get(&c, key.as_bytes()).unwrap().is_some(),
                "{durability:?}: after a large commit, {key} not seen"
            );
        }
        drop(reader);
        engine.flush().unwrap();
        commit_all(&engine, 710..720);
        let reader = Store::builder(store.dir.path()).open_read_only().unwrap();
        for key in ["m-0", "large-1", "m-719"] {
            assert!(
                reader.get(&c, key.as_bytes()).unwrap().is_some(),
                "{durability:?}: after the flush, {key} not seen"
            );
        }
        drop(reader);
        drop(engine);
        let engine = logged(&store, durability, 6, SEGMENT);
        assert_eq!(counter(&engine), 721, "{durability:?}");
    }
}

/// Reopened without the log after it grew and took a large commit, the store replays it into
/// RocksDB's WAL and removes it; reopened with it again, the log is made anew with the fewest
/// segments, grows again, and every commit survives.
#[test]
fn a_grown_log_turned_off_and_on_again() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = logged(&store, durability, 6, SEGMENT);
        commit_all(&engine, 0..900);
        commit_large(&engine, "large-1", 200_000).unwrap();
        assert!(segments(&store) > 3, "{durability:?}");
        drop(engine);
        let engine = store
            .builder()
            .durability(durability)
            .without_commit_log()
            .open()
            .unwrap();
        assert!(!store.dir.path().join("idemdb-log").exists());
        assert_eq!(counter(&engine), 901, "{durability:?}");
        assert_eq!(order_len(&engine, "large-1"), Some(200_000));
        commit_all(&engine, 900..950);
        drop(engine);
        let engine = logged(&store, durability, 6, 2 * SEGMENT);
        assert_eq!(
            segment_sizes(&store),
            vec![
                ("segment-0".to_owned(), 2 * SEGMENT),
                ("segment-1".to_owned(), 2 * SEGMENT)
            ],
            "{durability:?}: made anew"
        );
        assert_eq!(counter(&engine), 951, "{durability:?}");
        commit_large(&engine, "large-2", 300_000).unwrap();
        commit_all(&engine, 950..2_000);
        assert!(segments(&store) > 2, "{durability:?}");
        drop(engine);
        let engine = logged(&store, durability, 6, 2 * SEGMENT);
        assert_eq!(counter(&engine), 2_002, "{durability:?}");
        assert_eq!(order_len(&engine, "large-2"), Some(300_000));
        assert_duplicates(&engine, small_keys(0..2_000).step_by(53));
    }
}

/// A commit whose write batch is exactly as large as the whole log allows (`segments` x
/// (`segment_bytes` - 32) less the 24-byte record header) is taken, also on a log not yet
/// grown to `segments` and on one with records in it; one byte more is refused with
/// `InvalidArgument` and nothing written; the largest taken survives a reopen.
#[test]
fn a_commit_at_the_whole_logs_size() {
    for durability in [Durability::Sync, Durability::Buffered] {
        for most in [2, 4] {
            let store = TestStore::new();
            let engine = logged(&store, durability, most, SEGMENT);
            let whole = whole_log_payload(most, SEGMENT);
            let probes = std::cell::Cell::new(0u32);
            let taken_count = std::cell::Cell::new(0u64);
            let try_value = |bytes: u64| {
                probes.set(probes.get() + 1);
                // Keys of one length, so that only the value's size changes.
                let key = format!("p-{:05}", probes.get());
                let result = commit_large(&engine, &key, bytes as usize);
                assert!(
                    result.is_ok() || is_invalid_argument(&result),
                    "{durability:?} {most}: {bytes}: {result:?}"
                );
                if result.is_ok() {
                    taken_count.set(taken_count.get() + 1);
                } else {
                    assert!(
                        engine.consumer("c").unwrap().get(&key).unwrap().is_none(),
                        "{key} written though refused"
                    );
                }
                (key, result.is_ok())
            };
            // The value alone larger than the whole log: refused. Well below it: taken.
            assert!(!try_value(whole + 1).1, "{durability:?} {most}");
            let (_, small_enough) = try_value(whole - 4096);
            assert!(
                small_enough,
                "{durability:?} {most}: a value {} bytes under the whole log refused",
                4096
            );
            // The largest value taken.
            let (mut taken, mut refused) = (whole - 4096, whole + 1);
            while refused - taken > 1 {
                let middle = (taken + refused) / 2;
                if try_value(middle).1 {
                    taken = middle;
                } else {
                    refused = middle;
                }
            }
            let overhead = whole - taken;
            eprintln!(
                "{durability:?}, {most} segments: whole log {whole} bytes, the largest value \
                 taken {taken} ({overhead} bytes for the rest of the commit)"
            );
            // The rest of a commit (its marker, key, counter, batch header) is a few hundred
            // bytes, not kilobytes: the documented room is the room there is.
            assert!(overhead < 512, "{durability:?} {most}: {overhead}");
            // The same on a log with records in it (and a reopened one).
            commit_all(&engine, 0..100);
            let (key, ok) = try_value(taken);
            assert!(
                ok,
                "{durability:?} {most}: {taken} refused after small commits"
            );
            assert!(!try_value(taken + 1).1, "{durability:?} {most}");
            let taken_count = taken_count.get();
            drop(engine);
            let engine = logged(&store, durability, most, SEGMENT);
            assert_eq!(counter(&engine), 100 + taken_count, "{durability:?} {most}");
            assert_eq!(
                order_len(&engine, &key),
                Some(taken as usize),
                "{durability:?} {most}"
            );
            // A key of the probes' length: only the value's size counts.
            commit_large(&engine, "p-99999", taken as usize)
                .unwrap_or_else(|error| panic!("{durability:?} {most}: {error:?}"));
            drop(engine);
            let engine = logged(&store, durability, most, SEGMENT);
            assert_eq!(order_len(&engine, "p-99999"), Some(taken as usize));
            assert_eq!(counter(&engine), 101 + taken_count, "{durability:?} {most}");
        }
    }
}

/// On a 32 MiB disk: a new log whose first two segments do not fit is refused with
/// `Storage { kind: NoSpace }` before anything is written, whatever its most; one whose first
/// two fit opens however large its most, grows only while the disk has room for a segment and
/// as many bytes again, and then flushes; commits larger than a segment go on meanwhile and
/// every commit survives.
#[test]
fn a_small_disk_bounds_the_new_log_and_its_growth() {
    use idemdb::StorageErrorKind;
    let Some(disk) = crate::tmpfs::Tmpfs::mount(32) else {
        eprintln!(
            "skipped a_small_disk_bounds_the_new_log_and_its_growth: mounting a tmpfs was \
             refused (the test needs root or CAP_SYS_ADMIN)"
        );
        return;
    };
    let store = TestStore::new();
    let path = disk.path().join("store");
    for most in [2, 3, 1024] {
        let refused = store
            .builder_at(&path)
            .durability(Durability::Sync)
            .commit_log(most, 17 << 20)
            .open();
        assert!(
            matches!(
                &refused,
                Err(Error::Storage {
                    kind: StorageErrorKind::NoSpace,
                    ..
                })
            ),
            "{most} x 17 MiB: {refused:?}"
        );
        assert!(!path.exists(), "{most}: something was written");
    }
    let segment = 1 << 20;
    let engine = logged_at(&store, &path, Durability::Sync, 1024, segment);
    assert_eq!(segment_sizes_at(&path).len(), 2);
    let free_at_open = disk.free_bytes();
    for n in 0..60u32 {
        commit_all(&engine, n * 100..n * 100 + 100);
        if n % 10 == 0 {
            commit_large(&engine, &format!("large-{n}"), 1_500_000)
                .unwrap_or_else(|error| panic!("large-{n}: {error:?}"));
        }
    }
    let grown = segment_sizes_at(&path)
        .iter()
        .filter(|(_, b)| *b == segment)
        .count() as u64;
    assert!(grown > 2, "the log grew: {grown}");
    assert!(
        grown * segment <= free_at_open / 2 + 2 * segment,
        "{grown} segments of 1 MiB with {free_at_open} bytes free at open"
    );
    drop(engine);
    let engine = logged_at(&store, &path, Durability::Sync, 1024, segment);
    assert_eq!(counter(&engine), 6_000 + 6);
    assert_eq!(order_len(&engine, "large-50"), Some(1_500_000));
}

/// Read-only opens beside an engine whose ring grows in bursts and shrinks in the pauses
/// between them (the shrinker moves the log's end and removes segments while a reader may be
/// reading them): each open sees every commit acknowledged before it, and the ring did shrink
/// and grow again while they read.
#[test]
fn read_only_opens_beside_a_ring_that_grows_and_shrinks() {
    use idemdb::admin::{Store, Target};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let store = TestStore::new();
    let engine = store
        .builder()
        .durability(Durability::Buffered)
        .commit_log(8, SEGMENT)
        .commit_log_shrink_after(Duration::from_millis(10))
        .open()
        .unwrap();
    let acknowledged = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (shrinks, growths) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let writer = {
        let (engine, acknowledged, stop) = (engine.clone(), acknowledged.clone(), stop.clone());
        let (shrinks, growths, dir) = (
            shrinks.clone(),
            growths.clone(),
            store.dir.path().to_owned(),
        );
        std::thread::spawn(move || {
            let count = || std::fs::read_dir(dir.join("idemdb-log")).unwrap().count();
            let mut next = 0;
            while !stop.load(Ordering::Relaxed) {
                // A burst: about four segments' worth.
                let before = count();
                commit_all(&engine, next..next + 600);
                next += 600;
                acknowledged.store(next, Ordering::Release);
                if count() > before.max(2) {
                    growths.fetch_add(1, Ordering::Relaxed);
                }
                // A pause: the ring goes back to two segments.
                let deadline = Instant::now() + Duration::from_secs(5);
                while count() > 2 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(2));
                }
                if count() == 2 {
                    shrinks.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    let c = Target::Consumer(b"c".to_vec());
    let mut opens = 0;
    while opens < 60 || shrinks.load(Ordering::Relaxed) < 5 {
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
    let (shrunk, grown) = (
        shrinks.load(Ordering::Relaxed),
        growths.load(Ordering::Relaxed),
    );
    eprintln!("{opens} read-only opens; the ring grew {grown} and shrank {shrunk} times");
    assert!(grown >= 5 && shrunk >= 5);
    let written = acknowledged.load(Ordering::Acquire);
    drop(engine);
    assert_eq!(
        counter(&logged(&store, Durability::Buffered, 8, SEGMENT)),
        u64::from(written)
    );
}
