//! `EngineBuilder::commit_log_shrink_after`, tested from its documentation alone: a quiet
//! store's commit log gives back the segments a burst grew (back to the two of a new log),
//! every commit still answered as a duplicate after the shrink and after a reopen, with Sync and
//! Buffered; commits arriving around the quiet moment; many stores shrinking in one process;
//! drops while a shrink may run, then reopens at once; other settings (and no log) at reopen;
//! checkpoints and read-only opens beside a shrinking ring; `Duration::MAX` and zero; claim
//! batches, pipelines and commits larger than a segment through a shrink; a frozen test clock;
//! a burst of a single segment switch.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use idemdb::admin::{Store, Target};
use idemdb::{
    COMMIT_LOG_SHRINK_AFTER_DEFAULT, Durability, Engine, EngineBuilder, Error, Fingerprint,
    Message, MockClock, Outcome, TableOptions,
};

const SEG: u64 = 64 << 10;
const VALUE: usize = 8 << 10;
const SHRINK_WAIT: Duration = Duration::from_secs(20);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A store on a ring of at most 32 segments of 64 KiB that gives them back after `quiet`.
fn builder(path: &Path, durability: Durability, quiet: Duration) -> EngineBuilder {
    Engine::builder(path)
        .durability(durability)
        .write_buffer_bytes(4 << 20)
        .business_table(TableOptions::new("orders"))
        .commit_log(32, SEG)
        .commit_log_shrink_after(quiet)
}

/// The log's segment files (`<store>/idemdb-log/segment-N`) with their sizes, by N.
fn segments(store: &Path) -> Vec<(u64, u64)> {
    let Ok(dir) = std::fs::read_dir(store.join("idemdb-log")) else {
        return Vec::new();
    };
    let mut found: Vec<(u64, u64)> = dir
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            let n = name.strip_prefix("segment-")?.parse().ok()?;
            Some((n, entry.metadata().ok()?.len()))
        })
        .collect();
    found.sort_unstable();
    found
}

fn wait_until(what: &str, store: &Path, within: Duration, done: impl Fn(usize) -> bool) -> usize {
    let start = Instant::now();
    loop {
        let n = segments(store).len();
        if done(n) {
            return n;
        }
        assert!(
            start.elapsed() < within,
            "{what}: still {:?} after {within:?}",
            segments(store)
        );
        thread::sleep(ms(5));
    }
}

/// Waits for the ring to be back to two segments, each of a new log's size.
fn wait_for_two(store: &Path) {
    wait_until(
        "back to a new log's two segments",
        store,
        SHRINK_WAIT,
        |n| n == 2 && segments(store).iter().all(|&(_, len)| len == SEG),
    );
}

fn wait_grown(store: &Path) -> usize {
    wait_until("growth past two", store, Duration::from_secs(5), |n| n > 2)
}

/// Commits `key` with an order of `bytes` bytes.
fn commit(engine: &Engine, key: &str, bytes: usize) -> idemdb::Result<()> {
    let c = engine.consumer("c")?;
    let orders = engine.business_table("orders")?;
    let Outcome::Fresh(mut claim) = c.begin(key, Fingerprint::of(key))? else {
        panic!("{key}: not fresh")
    };
    claim.put(&orders, key, vec![7u8; bytes])?;
    claim.commit(b"ok").map(drop)
}

fn burst(engine: &Engine, prefix: &str, n: usize, bytes: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let key = format!("{prefix}-{i}");
            commit(engine, &key, bytes).unwrap_or_else(|e| panic!("{key}: {e:?}"));
            key
        })
        .collect()
}

/// Every key answered as a duplicate, its order in the table.
fn assert_dups<'a>(engine: &Engine, keys: impl IntoIterator<Item = &'a String>) {
    let c = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    for key in keys {
        let outcome = c.begin(key, Fingerprint::of(key.as_str())).unwrap();
        assert!(
            matches!(outcome, Outcome::Duplicate { .. }),
            "{key} not a duplicate"
        );
        assert!(orders.get(key).unwrap().is_some(), "{key}: order lost");
    }
}

#[test]
fn a_quiet_store_gives_back_grown_segments_sync_and_buffered() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path();
        let engine = builder(path, durability, ms(200)).open().unwrap();
        assert_eq!(segments(path).len(), 2, "a new log has two segments");
        let mut keys = burst(&engine, "a", 48, VALUE);
        wait_grown(path);
        // Reads (duplicates, and fresh claims dropped unwritten) are no writes: the store stays quiet.
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (engine, keys, stop) = (engine.clone(), keys.clone(), stop.clone());
            thread::spawn(move || {
                let c = engine.consumer("c").unwrap();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = &keys[i % keys.len()];
                    let dup = c.begin(key, Fingerprint::of(key.as_str())).unwrap();
                    assert!(matches!(dup, Outcome::Duplicate { .. }), "{key}");
                    drop(
                        c.begin(format!("unwritten-{i}"), Fingerprint::of(b"x"))
                            .unwrap(),
                    );
                    i += 1;
                    thread::sleep(ms(1));
                }
            })
        };
        wait_for_two(path);
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap();
        assert_dups(&engine, &keys);
        // It grows again for the next burst, and gives back again.
        keys.extend(burst(&engine, "b", 48, VALUE));
        wait_grown(path);
        wait_for_two(path);
        assert_dups(&engine, &keys);
        drop(engine);
        let engine = builder(path, durability, ms(200)).open().unwrap();
        assert_dups(&engine, &keys);
        assert_eq!(segments(path).len(), 2, "{durability:?}");
    }
}

#[test]
fn duration_max_and_huge_durations_keep_the_segments() {
    for quiet in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path();
        let engine = builder(path, Durability::Buffered, quiet).open().unwrap();
        let keys = burst(&engine, "k", 48, VALUE);
        let grown = wait_grown(path);
        thread::sleep(ms(1500));
        assert!(
            segments(path).len() >= grown,
            "{quiet:?}: {:?}",
            segments(path)
        );
        assert_dups(&engine, &keys);
        drop(engine);
        let engine = builder(path, Durability::Buffered, quiet).open().unwrap();
        assert!(
            segments(path).len() >= grown,
            "{quiet:?} after reopen: {:?}",
            segments(path)
        );
        assert_dups(&engine, &keys);
    }
}

#[test]
fn zero_is_refused_with_a_typed_error_and_changes_nothing() {
    assert_eq!(COMMIT_LOG_SHRINK_AFTER_DEFAULT, Duration::from_secs(10));
    let dir = tempfile::tempdir().unwrap();
    let fresh = dir.path().join("new");
    let refused = builder(&fresh, Durability::Sync, Duration::ZERO).open();
    assert!(
        matches!(refused, Err(Error::InvalidOption { .. })),
        "{refused:?}"
    );
    assert!(!fresh.join("idemdb-log").exists());

    let path = dir.path().join("store");
    let engine = builder(&path, Durability::Sync, ms(100)).open().unwrap();
    let keys = burst(&engine, "z", 4, 100);
    drop(engine);
    let before = segments(&path);
    for open in [
        builder(&path, Durability::Sync, Duration::ZERO),
        builder(&path, Durability::Sync, Duration::ZERO).without_commit_log(),
    ] {
        let refused = open.open();
        assert!(
            matches!(refused, Err(Error::InvalidOption { .. })),
            "{refused:?}"
        );
        assert_eq!(segments(&path), before, "a refused open changed the log");
    }
    // The smallest duration that is not zero is taken.
    let engine = builder(&path, Durability::Sync, Duration::from_nanos(1))
        .open()
        .unwrap();
    assert_dups(&engine, &keys);
    burst(&engine, "n", 4, 100);
}

/// Writers that commit on and off, with pauses of about `quiet`, so that commits come while
/// the shrinker wakes, flushes and moves the log's end.
fn racing_writers(path: &Path, durability: Durability, quiet: Duration, pauses: &[u64]) {
    let engine = builder(path, durability, quiet).open().unwrap();
    let handles: Vec<_> = (0..3)
        .map(|t| {
            let (engine, pauses) = (engine.clone(), pauses.to_vec());
            thread::spawn(move || {
                let mut keys = Vec::new();
                for (round, pause) in pauses.iter().enumerate() {
                    keys.extend(burst(&engine, &format!("t{t}-r{round}"), 8, VALUE));
                    thread::sleep(ms(*pause + t as u64));
                }
                keys
            })
        })
        .collect();
    let keys: Vec<String> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("a writer failed"))
        .collect();
    assert_dups(&engine, &keys);
    wait_for_two(path);
    assert_dups(&engine, &keys);
    drop(engine);
    let engine = builder(path, durability, quiet).open().unwrap();
    assert_dups(&engine, &keys);
}

#[test]
fn commits_around_the_quiet_moment_and_a_one_millisecond_quiet() {
    let around = [0, 10, 25, 28, 30, 32, 35, 45, 60, 90, 5, 31, 29, 62, 0, 33];
    let busy = [0, 1, 2, 0, 3, 1, 0, 2, 5, 1, 0, 1, 2, 4, 0, 1, 1, 3, 0, 2];
    for (quiet, pauses) in [(ms(30), &around[..]), (ms(1), &busy[..])] {
        for durability in [Durability::Sync, Durability::Buffered] {
            let dir = tempfile::tempdir().unwrap();
            racing_writers(dir.path(), durability, quiet, pauses);
        }
    }
}

/// Store `i` of many: Sync or Buffered; every third on a frozen test clock, which is for
/// timestamps, expiry and compaction (`EngineBuilder::clock`), not for the store's quiet.
fn one_of_many(path: &Path, i: usize) -> Engine {
    let store = builder(
        path,
        [Durability::Sync, Durability::Buffered][i % 2],
        ms(150),
    );
    let store = if i.is_multiple_of(3) {
        store.clock(MockClock::new(1_767_225_600_000))
    } else {
        store
    };
    store.open().unwrap()
}

#[test]
fn many_stores_in_one_process_each_shrink() {
    let dirs: Vec<_> = (0..12).map(|_| tempfile::tempdir().unwrap()).collect();
    let opened: Vec<(Engine, Vec<String>)> = thread::scope(|s| {
        let handles: Vec<_> = dirs
            .iter()
            .enumerate()
            .map(|(i, dir)| {
                s.spawn(move || {
                    let engine = one_of_many(dir.path(), i);
                    let keys = burst(&engine, &format!("s{i}"), 40, VALUE);
                    (engine, keys)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for dir in &dirs {
        wait_for_two(dir.path());
    }
    for (i, ((engine, keys), dir)) in opened.into_iter().zip(&dirs).enumerate() {
        assert_dups(&engine, &keys);
        drop(engine);
        assert_dups(&one_of_many(dir.path(), i), &keys);
    }
}

#[test]
fn dropping_while_a_shrink_may_run_then_reopening_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let mut keys = Vec::new();
    for i in 0..14u64 {
        let quiet = ms(1 + (i % 4) * 5);
        let durability = [Durability::Sync, Durability::Buffered][(i % 2) as usize];
        let engine = builder(path, durability, quiet)
            .open()
            .unwrap_or_else(|e| panic!("reopen {i} at once: {e:?}"));
        assert_dups(&engine, &keys);
        keys.extend(burst(&engine, &format!("d{i}"), 24, VALUE));
        thread::sleep(ms((i * 3) % 25));
        drop(engine);
    }
    // A long quiet: dropping does not wait for the shrinker's period.
    let engine = builder(path, Durability::Buffered, Duration::from_secs(60))
        .open()
        .unwrap();
    assert_dups(&engine, &keys);
    keys.extend(burst(&engine, "long", 40, VALUE));
    let started = Instant::now();
    drop(engine);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "drop took {:?}",
        started.elapsed()
    );
    let engine = builder(path, Durability::Buffered, ms(50)).open().unwrap();
    assert_dups(&engine, &keys);
    wait_for_two(path);
}

#[test]
fn reopening_with_other_settings_or_without_the_log_after_a_shrink() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let sync = Durability::Sync;
    let engine = builder(path, sync, ms(100)).open().unwrap();
    let mut keys = burst(&engine, "a", 40, VALUE);
    wait_for_two(path);
    drop(engine);
    // Duration::MAX after a shrink: the ring grows and keeps its segments.
    let engine = builder(path, sync, Duration::MAX).open().unwrap();
    assert_eq!(segments(path).len(), 2);
    assert_dups(&engine, &keys);
    keys.extend(burst(&engine, "b", 48, VALUE));
    let grown = wait_grown(path);
    drop(engine);
    assert!(segments(path).len() >= grown);
    // A short quiet again, on a smaller ring shape: the ring the open finds grown is given back.
    let engine = builder(path, sync, ms(100))
        .commit_log(4, SEG)
        .open()
        .unwrap();
    assert_dups(&engine, &keys);
    wait_for_two(path);
    drop(engine);
    // Without the log (opt-out), with the smallest quiet: RocksDB's WAL, no log files.
    let engine = builder(path, sync, ms(1))
        .without_commit_log()
        .open()
        .unwrap();
    assert!(!path.join("idemdb-log").exists());
    assert_dups(&engine, &keys);
    keys.extend(burst(&engine, "c", 48, VALUE));
    thread::sleep(ms(50));
    assert!(!path.join("idemdb-log").exists());
    drop(engine);
    // Back on the log: a new one of two segments, which grows and is given back.
    let engine = builder(path, sync, ms(100)).open().unwrap();
    assert_eq!(segments(path).len(), 2);
    assert_dups(&engine, &keys);
    keys.extend(burst(&engine, "d", 48, VALUE));
    wait_for_two(path);
    drop(engine);
    let engine = Engine::builder(path)
        .business_table(TableOptions::new("orders"))
        .commit_log(32, SEG)
        .open()
        .unwrap();
    assert_dups(&engine, &keys);
}

#[test]
fn checkpoints_and_read_only_opens_while_the_ring_shrinks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let engine = builder(&path, Durability::Sync, ms(20)).open().unwrap();
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (engine, acked, stop) = (engine.clone(), acked.clone(), stop.clone());
        thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for key in burst(&engine, &format!("w{round}"), 12, VALUE) {
                    acked.lock().unwrap().push(key);
                }
                thread::sleep(ms((round % 5) * 12));
                round += 1;
            }
        })
    };
    let mut copies = Vec::new();
    for i in 0..6 {
        thread::sleep(ms(40));
        let before = acked.lock().unwrap().clone();
        let copy = dir.path().join(format!("copy-{i}"));
        engine.checkpoint(&copy).unwrap();
        copies.push((copy, before.clone()));
        let store = Store::builder(&path).open_read_only();
        let store = store.unwrap_or_else(|e| panic!("read-only open #{i} beside the ring: {e:?}"));
        for key in &before {
            let entry = store.get(&Target::Consumer(b"c".to_vec()), key.as_bytes());
            assert!(entry.unwrap().is_some(), "read-only open #{i} lacks {key}");
        }
        if i % 2 == 1 {
            engine.flush().unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let all = acked.lock().unwrap().clone();
    wait_for_two(&path);
    let store = Store::builder(&path).open_read_only().unwrap();
    for key in &all {
        let entry = store
            .get(&Target::Consumer(b"c".to_vec()), key.as_bytes())
            .unwrap();
        assert!(
            entry.is_some(),
            "read-only open after the shrink lacks {key}"
        );
    }
    drop(store);
    for (copy, keys) in &copies {
        let engine = builder(copy, Durability::Sync, ms(20)).open().unwrap();
        assert_dups(&engine, keys);
    }
    drop(engine);
    let engine = builder(&path, Durability::Sync, ms(20)).open().unwrap();
    assert_dups(&engine, &all);
}

#[test]
fn claim_batches_and_a_pipeline_through_shrinks() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path();
        let engine = builder(path, durability, ms(100)).open().unwrap();
        let c = engine.consumer("c").unwrap();
        let orders = engine.business_table("orders").unwrap();
        let mut pipeline = c.pipeline::<usize>(8).unwrap();
        let mut keys = Vec::new();
        let mut last_offset = 0;
        for round in 0..3u64 {
            let batch_keys: Vec<String> = (0..32).map(|i| format!("b{round}-{i}")).collect();
            let messages: Vec<Message<'_>> = batch_keys
                .iter()
                .map(|k| Message::new(k, Fingerprint::of(k.as_str())))
                .collect();
            let mut batch = c.begin_batch(&messages).unwrap();
            for (i, key) in batch_keys.iter().enumerate() {
                let claim = batch.claim_mut(i).expect("fresh");
                claim.put(&orders, key, vec![1u8; 4 << 10]).unwrap();
            }
            last_offset = round * 100 + 31;
            batch.stage_position("src", 0, last_offset).unwrap();
            batch.commit(|_| b"ok").unwrap();
            keys.extend(batch_keys);
            for i in 0..32 {
                let key = format!("p{round}-{i}");
                let Outcome::Fresh(mut claim) =
                    c.begin(&key, Fingerprint::of(key.as_str())).unwrap()
                else {
                    panic!("{key}")
                };
                claim.put(&orders, &key, vec![2u8; 4 << 10]).unwrap();
                pipeline.commit(claim, b"ok", i);
                for settled in pipeline.settled() {
                    settled.outcome.unwrap();
                }
                keys.push(key);
            }
            for settled in pipeline.wait() {
                settled.outcome.unwrap();
            }
            assert_dups(&engine, &keys);
            wait_for_two(path);
            assert_dups(&engine, &keys);
            let stored = c.positions().get("src", 0).unwrap().expect("position");
            assert_eq!(stored.next_offset(), last_offset + 1);
        }
        drop((pipeline, c, orders));
        drop(engine);
        let engine = builder(path, durability, ms(100)).open().unwrap();
        assert_dups(&engine, &keys);
        let c = engine.consumer("c").unwrap();
        let stored = c.positions().get("src", 0).unwrap().expect("position");
        assert_eq!(stored.next_offset(), last_offset + 1);
    }
}

#[test]
fn commits_larger_than_a_segment_before_a_quiet_period_and_after_a_shrink() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let open = || {
        builder(path, Durability::Sync, ms(150))
            .commit_log(8, SEG)
            .open()
            .unwrap()
    };
    let engine = open();
    let sizes = [200usize << 10, 130 << 10, 400 << 10, 70 << 10];
    let keys: Vec<String> = (0..sizes.len()).map(|i| format!("big-{i}")).collect();
    for (key, &size) in keys.iter().zip(&sizes) {
        commit(&engine, key, size).unwrap();
    }
    let total: u64 = segments(path).iter().map(|&(_, len)| len).sum();
    assert!(total > 2 * SEG, "nothing grew: {:?}", segments(path));
    wait_for_two(path);
    let check = |engine: &Engine| {
        assert_dups(engine, &keys);
        let orders = engine.business_table("orders").unwrap();
        for (key, &size) in keys.iter().zip(&sizes) {
            let len = orders.get(key).unwrap().map(|v| v.len());
            assert_eq!(len, Some(size), "{key}");
        }
    };
    check(&engine);
    drop(engine);
    let engine = open();
    check(&engine);
    // Then, on the ring back to two, one more commit larger than a segment (a free segment is
    // enlarged to its size, "cut back once the tables hold it") and quiet: the store should
    // not keep that disk space while idle.
    commit(&engine, "after", 300 << 10).unwrap();
    wait_for_two(path);
    drop(engine);
    let engine = open();
    check(&engine);
    assert_dups(&engine, &["after".to_owned()]);
}

#[test]
fn a_burst_of_one_segment_switch_is_given_back_too() {
    // A new store's first segment switch: the ring may make its next segment ahead of need
    // (commit_log docs); a store quiet after it should be back to two segments all the same.
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut opened = Vec::new();
    for (dir, n) in dirs.iter().zip([8, 9, 10, 12]) {
        let engine = builder(dir.path(), Durability::Sync, ms(100))
            .open()
            .unwrap();
        let keys = burst(&engine, "k", n, VALUE);
        opened.push((engine, keys));
    }
    for (dir, (engine, keys)) in dirs.iter().zip(&opened) {
        wait_for_two(dir.path());
        assert_dups(engine, keys);
    }
}
