//! Guards durability across close and reopen: committed markers and their business writes
//! survive together; uncommitted claims leave nothing.

use crate::util::{TestStore, counter};
use idemdb::{Durability, Fingerprint, Outcome};

#[test]
fn committed_records_and_business_writes_survive_reopen() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        {
            let engine = store.builder().durability(durability).open().unwrap();
            let consumer = engine.consumer("billing").unwrap();
            let orders = engine.business_table("orders").unwrap();
            let counters = engine.business_table("counters").unwrap();
            for i in 0..100u64 {
                let key = format!("order-{i}");
                let Outcome::Fresh(mut claim) =
                    consumer.begin(&key, Fingerprint::of(&key)).unwrap()
                else {
                    panic!("fresh expected");
                };
                claim.put(&orders, &key, i.to_be_bytes()).unwrap();
                claim
                    .merge(&counters, "orders", 1u64.to_be_bytes())
                    .unwrap();
                if i % 10 == 9 {
                    claim.abort();
                } else {
                    claim.commit(format!("ok-{i}")).unwrap();
                }
            }
            engine.flush_wal().unwrap();
        }
        let engine = store.builder().durability(durability).open().unwrap();
        let consumer = engine.consumer("billing").unwrap();
        let orders = engine.business_table("orders").unwrap();
        for i in 0..100u64 {
            let key = format!("order-{i}");
            let outcome = consumer.begin(&key, Fingerprint::of(&key)).unwrap();
            if i % 10 == 9 {
                assert!(
                    matches!(outcome, Outcome::Fresh(_)),
                    "{key} was never committed"
                );
                assert_eq!(orders.get(&key).unwrap(), None);
            } else {
                let Outcome::Duplicate { result, .. } = outcome else {
                    panic!("{key} must be a duplicate after reopen, got {outcome:?}");
                };
                assert_eq!(result, format!("ok-{i}").into_bytes());
                assert_eq!(orders.get(&key).unwrap().unwrap(), i.to_be_bytes());
            }
        }
        assert_eq!(counter(&engine, "orders"), 90, "{durability:?}");
    }
}

/// On the default path (the commit log) and on RocksDB's WAL.
#[test]
fn flush_writes_every_table_to_table_files_and_keeps_the_data() {
    for wal in [false, true] {
        flush_writes_every_table(wal);
    }
}

fn flush_writes_every_table(wal: bool) {
    let store = TestStore::new();
    let builder = || {
        let builder = store.builder();
        if wal {
            builder.without_commit_log()
        } else {
            builder
        }
    };
    let table_files = |dir: &std::path::Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|entry| {
                let name = entry.as_ref().unwrap().file_name();
                name.to_string_lossy().ends_with(".sst")
            })
            .count()
    };
    {
        let engine = builder().open().unwrap();
        let consumer = engine.consumer("billing").unwrap();
        let orders = engine.business_table("orders").unwrap();
        let Outcome::Fresh(mut claim) = consumer.begin("order-1", Fingerprint::of("a")).unwrap()
        else {
            panic!("fresh expected");
        };
        claim.put(&orders, "order-1", "paid").unwrap();
        claim.commit("ok").unwrap();
        // Only the store's metadata, flushed when it was written; the rest is in memtables.
        assert_eq!(table_files(store.dir.path()), 1, "all still in memtables");
        engine.flush().unwrap();
        // One file each for the record and the business write besides, and on the commit log
        // one for the log position the tables hold (in the default table).
        assert_eq!(table_files(store.dir.path()), if wal { 3 } else { 4 });
    }
    let engine = builder().open().unwrap();
    let orders = engine.business_table("orders").unwrap();
    assert_eq!(
        orders.get("order-1").unwrap().as_deref(),
        Some(&b"paid"[..])
    );
    let outcome = engine
        .consumer("billing")
        .unwrap()
        .begin("order-1", Fingerprint::of("a"))
        .unwrap();
    assert!(matches!(outcome, Outcome::Duplicate { .. }), "{outcome:?}");
}

/// The WAL files in a store's directory.
fn wal_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|entry| {
            entry.as_ref().unwrap().path().extension() == Some(std::ffi::OsStr::new("log"))
        })
        .count()
}

/// A new store's metadata (one small batch, in a table nothing else writes) must not keep the
/// WAL files the records table has flushed: RocksDB would keep them up to its bound on their
/// total size (8 times all the memtables), and a reopen after a crash would read them all.
#[test]
fn wal_files_go_once_the_records_table_is_flushed() {
    let store = TestStore::new();
    // 1 MiB memtables: the records table flushes about every 8,000 records here.
    let engine = store.builder().write_buffer_bytes(1 << 20).open().unwrap();
    let consumer = engine.consumer("billing").unwrap();
    let keys: Vec<String> = (0..80_000).map(|i| format!("order-{i:08}")).collect();
    for chunk in keys.chunks(256) {
        let messages: Vec<idemdb::Message<'_>> = chunk
            .iter()
            .map(|key| idemdb::Message::new(key, Fingerprint::of(key)))
            .collect();
        let batch = consumer.begin_batch(&messages).unwrap();
        batch.commit(|_| b"ok").unwrap();
    }
    // The records table has switched memtables (and WAL files) about ten times; RocksDB
    // deletes a flushed WAL file on the flush's own thread, right after the flush.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut left = wal_files(store.dir.path());
    while left > 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        left = wal_files(store.dir.path());
    }
    assert!(
        left <= 3,
        "{left} WAL files kept after the records table flushed"
    );
}
