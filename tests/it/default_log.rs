//! The default durable path's footprint: a new store's first open makes two 4 MiB segments of
//! the commit log and nothing more of it, and a process that owns 64 partition stores, each
//! taking commits through a pipeline, holds at most 16 MiB of disk per store.

use std::path::Path;

use idemdb::{Durability, Engine, Fingerprint, Outcome};

/// The bytes the files under `dir` take on disk (allocated blocks, not lengths).
fn allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let metadata = entry.metadata().unwrap();
            if metadata.is_dir() {
                allocated_bytes(&entry.path())
            } else {
                metadata.blocks() * 512
            }
        })
        .sum()
}

fn segments(store: &Path) -> Vec<(String, u64)> {
    crate::files::lengths(&store.join("idemdb-log"))
}

#[test]
fn a_new_store_starts_with_two_segments_of_the_default_size() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let segment = idemdb::COMMIT_LOG_SEGMENT_BYTES_DEFAULT;
    assert_eq!(
        segments(dir.path()),
        [
            ("segment-0".to_owned(), segment),
            ("segment-1".to_owned(), segment)
        ]
    );
    drop(engine);
    assert!(allocated_bytes(dir.path()) <= 16 << 20);
}

/// 64 stores in one process, as a consumer that owns 64 partitions holds them: each opened with
/// the default, each taking 200 commits through a pipeline of depth 4, all open at once.
#[test]
fn sixty_four_partition_stores_take_at_most_16_mib_of_disk_each() {
    let dir = tempfile::tempdir().unwrap();
    let engines: Vec<Engine> = (0..64)
        .map(|partition| {
            Engine::builder(dir.path().join(format!("partition-{partition}")))
                .durability(Durability::Sync)
                .metrics_label("partition", &partition.to_string())
                .open()
                .unwrap()
        })
        .collect();
    for engine in &engines {
        let consumer = engine.consumer("orders").unwrap();
        let mut pipeline = consumer.pipeline::<u32>(4).unwrap();
        for n in 0..200 {
            let key = format!("order-{n}");
            let Outcome::Fresh(claim) = consumer.begin(&key, Fingerprint::of(&key)).unwrap() else {
                panic!("fresh expected");
            };
            pipeline.commit(claim, [0x5a; 512], n);
        }
        let settled = pipeline.wait();
        assert_eq!(settled.len(), 200);
        assert!(settled.iter().all(|settled| settled.outcome.is_ok()));
    }
    let total = allocated_bytes(dir.path());
    eprintln!(
        "64 stores: {} MiB on disk ({} KiB each)",
        total >> 20,
        (total >> 10) / 64
    );
    assert!(total <= 64 * (16 << 20), "{total} bytes");
    drop(engines);
    // Every commit is there after a reopen.
    for partition in [0, 63] {
        let engine = Engine::builder(dir.path().join(format!("partition-{partition}")))
            .open()
            .unwrap();
        let consumer = engine.consumer("orders").unwrap();
        assert!(consumer.get("order-199").unwrap().is_some());
    }
}

/// RocksDB flushes the tables on its own once a memtable fills; the segments whose records its
/// files then hold are reused, so the ring stays near the memtables' size instead of growing to
/// its most (the default's most here: 80 segments, 320 MiB) before a flush of its own.
#[test]
fn the_ring_reuses_the_segments_the_tables_flushed_on_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path())
        .durability(Durability::Buffered)
        .write_buffer_bytes(1 << 20)
        .open()
        .unwrap();
    let consumer = engine.consumer("orders").unwrap();
    let result = [0x5a_u8; 1024];
    // 40 MiB of results: 10 segments' worth, 40 memtables'.
    for n in 0..40_000 {
        let key = format!("order-{n}");
        let Outcome::Fresh(claim) = consumer.begin(&key, Fingerprint::of(&key)).unwrap() else {
            panic!("fresh expected");
        };
        claim.commit(result).unwrap();
    }
    let slots = segments(dir.path()).len();
    eprintln!("40 MiB committed: {slots} segments");
    assert!(slots <= 4, "the ring grew to {slots} segments");
    drop(consumer);
    drop(engine);
    let engine = Engine::builder(dir.path()).open().unwrap();
    let consumer = engine.consumer("orders").unwrap();
    for key in ["order-0", "order-39999"] {
        assert!(consumer.get(key).unwrap().is_some(), "{key}");
    }
}

/// Commits `count` claims of 1 KiB results to `consumer`, keys `prefix-<n>`.
fn commit_many(consumer: &idemdb::Consumer, prefix: &str, count: usize) {
    let result = [0xa5_u8; 1024];
    for n in 0..count {
        let key = format!("{prefix}-{n}");
        let Outcome::Fresh(claim) = consumer.begin(&key, Fingerprint::of(&key)).unwrap() else {
            panic!("fresh expected");
        };
        claim.commit(result).unwrap();
    }
}

/// Waits (up to 20 s) until the store's log has at most `slots` segments: how many it has then.
fn wait_for_segments(store: &Path, slots: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let now = segments(store).len();
        if now <= slots || std::time::Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A burst that grows the ring (large memtables, so the tables do not flush on their own),
/// then quiet: the log goes back to the two segments of a new store, and every commit is
/// still there, before and after a reopen. A commit after the shrink grows it again, and the
/// next quiet period gives the segments back again.
#[test]
fn a_quiet_store_gives_back_the_segments_a_burst_added() {
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        Engine::builder(dir.path())
            .durability(Durability::Sync)
            .commit_log_shrink_after(std::time::Duration::from_millis(200))
            .open()
            .unwrap()
    };
    let engine = open();
    let consumer = engine.consumer("orders").unwrap();
    for round in 0..2 {
        // 16 MiB of results: four segments' worth, a quarter of one memtable.
        commit_many(&consumer, &format!("round{round}"), 16_000);
        let grown = segments(dir.path()).len();
        assert!(
            grown >= 4,
            "round {round}: the burst grew the ring to {grown} only"
        );
        let after = wait_for_segments(dir.path(), 2);
        eprintln!("round {round}: {grown} segments after the burst, {after} once quiet");
        assert_eq!(
            after, 2,
            "round {round}: the quiet store kept {after} segments"
        );
        for key in [format!("round{round}-0"), format!("round{round}-15999")] {
            assert!(consumer.get(&key).unwrap().is_some(), "{key}");
        }
    }
    drop(consumer);
    drop(engine);
    let engine = open();
    let consumer = engine.consumer("orders").unwrap();
    for round in 0..2 {
        for n in [0, 7_777, 15_999] {
            let key = format!("round{round}-{n}");
            assert!(
                matches!(
                    consumer.begin(&key, Fingerprint::of(&key)).unwrap(),
                    Outcome::Duplicate { .. }
                ),
                "{key}"
            );
        }
    }
}

/// Commits that keep coming put the shrink off: the ring keeps what it needs while the store
/// writes, however long that lasts beyond one quiet period.
#[test]
fn a_store_that_keeps_writing_keeps_its_segments() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path())
        .durability(Durability::Buffered)
        .commit_log_shrink_after(std::time::Duration::from_millis(300))
        .open()
        .unwrap();
    let consumer = engine.consumer("orders").unwrap();
    commit_many(&consumer, "burst", 16_000);
    let grown = segments(dir.path()).len();
    assert!(grown >= 4, "the burst grew the ring to {grown} only");
    // A commit every 50 ms for 1.5 s: five quiet periods long, none of them quiet.
    for n in 0..30 {
        commit_many(&consumer, &format!("trickle{n}"), 1);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let now = segments(dir.path()).len();
        assert!(
            now >= grown,
            "shrunk to {now} segments while the store wrote"
        );
    }
    assert_eq!(wait_for_segments(dir.path(), 2), 2);
}

/// Dropping the last handle while the shrinker waits for a quiet period closes the store at
/// once: a reopen right after it succeeds (the shrinker holds the database, not the store, and
/// the store stops it before closing).
#[test]
fn dropping_a_store_whose_shrinker_waits_closes_it_at_once() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..3 {
        let engine = Engine::builder(dir.path())
            .durability(Durability::Buffered)
            .commit_log_shrink_after(std::time::Duration::from_secs(3600))
            .open()
            .unwrap();
        let consumer = engine.consumer("orders").unwrap();
        commit_many(&consumer, &format!("round{round}"), 16_000);
        assert!(segments(dir.path()).len() > 2);
        drop(consumer);
        let started = std::time::Instant::now();
        drop(engine);
        eprintln!("round {round}: dropped in {:?}", started.elapsed());
    }
    let engine = Engine::builder(dir.path()).open().unwrap();
    let consumer = engine.consumer("orders").unwrap();
    assert!(consumer.get("round2-15999").unwrap().is_some());
}

/// `Duration::MAX` keeps the grown segments; zero is refused at open.
#[test]
fn the_shrink_can_be_turned_off_and_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let refused = Engine::builder(dir.path())
        .commit_log_shrink_after(std::time::Duration::ZERO)
        .open();
    assert!(
        matches!(refused, Err(idemdb::Error::InvalidOption { .. })),
        "{refused:?}"
    );
    let engine = Engine::builder(dir.path())
        .durability(Durability::Buffered)
        .commit_log_shrink_after(std::time::Duration::MAX)
        .open()
        .unwrap();
    let consumer = engine.consumer("orders").unwrap();
    commit_many(&consumer, "burst", 16_000);
    let grown = segments(dir.path()).len();
    assert!(grown > 2, "{grown} segments");
    std::thread::sleep(std::time::Duration::from_millis(500));
    // At least as many: a slot the ring was making ahead of need may land meanwhile (its file
    // is made by a thread of its own), and a shrink would have left two.
    let kept = segments(dir.path()).len();
    assert!(kept >= grown, "{grown} segments, then {kept}");
}

/// A ring grown before a restart (here: by an open that kept its segments) is given back once
/// the next open is quiet, without a write of its own.
#[test]
fn a_ring_grown_before_a_reopen_is_given_back_once_quiet() {
    let dir = tempfile::tempdir().unwrap();
    let open = |quiet: std::time::Duration| {
        Engine::builder(dir.path())
            .durability(Durability::Buffered)
            .commit_log_shrink_after(quiet)
            .open()
            .unwrap()
    };
    let engine = open(std::time::Duration::MAX);
    let consumer = engine.consumer("orders").unwrap();
    commit_many(&consumer, "burst", 16_000);
    drop(consumer);
    drop(engine);
    let grown = segments(dir.path()).len();
    assert!(grown >= 4, "the burst grew the ring to {grown} only");
    let engine = open(std::time::Duration::from_millis(200));
    assert_eq!(wait_for_segments(dir.path(), 2), 2);
    let consumer = engine.consumer("orders").unwrap();
    assert!(consumer.get("burst-15999").unwrap().is_some());
}
