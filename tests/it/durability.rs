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

#[test]
fn flush_writes_every_table_to_table_files_and_keeps_the_data() {
    let store = TestStore::new();
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
        let engine = store.builder().open().unwrap();
        let consumer = engine.consumer("billing").unwrap();
        let orders = engine.business_table("orders").unwrap();
        let Outcome::Fresh(mut claim) = consumer.begin("order-1", Fingerprint::of("a")).unwrap()
        else {
            panic!("fresh expected");
        };
        claim.put(&orders, "order-1", "paid").unwrap();
        claim.commit("ok").unwrap();
        assert_eq!(table_files(store.dir.path()), 0, "all still in memtables");
        engine.flush().unwrap();
        // One file each for the record, the business write and the store's metadata.
        assert_eq!(table_files(store.dir.path()), 3);
    }
    let engine = store.builder().open().unwrap();
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
