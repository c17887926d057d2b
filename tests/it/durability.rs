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
