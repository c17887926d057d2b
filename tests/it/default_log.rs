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
