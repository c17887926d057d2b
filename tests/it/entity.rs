//! Guards entity-as-marker mode (R5): the business record itself is inserted if absent, with
//! the same fresh / duplicate / conflict outcomes, and never expires by default.

use std::time::Duration;

use crate::util::TestStore;
use idemdb::{EXPIRES_NEVER_MS, Fingerprint, Outcome};

#[test]
fn entity_is_inserted_once_and_conflicts_are_reported() {
    let store = TestStore::new();
    let engine = store.open();
    let customers = engine.entity_table("customers").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let alice = b"{\"name\":\"alice\"}";

    let Outcome::Fresh(mut claim) = customers.begin(b"cust-1", Fingerprint::of(alice)).unwrap()
    else {
        panic!("fresh expected");
    };
    // Other writes can ride in the same batch as the entity.
    claim.put(&orders, b"welcome/cust-1", b"queued").unwrap();
    let committed = claim.commit(alice).unwrap();
    assert_eq!(committed.expires_at_ms, EXPIRES_NEVER_MS);
    assert_eq!(orders.get(b"welcome/cust-1").unwrap().unwrap(), b"queued");

    match customers.begin(b"cust-1", Fingerprint::of(alice)).unwrap() {
        Outcome::Duplicate { result, .. } => assert_eq!(&result[..], alice),
        other => panic!("duplicate expected, got {other:?}"),
    }
    let bob = b"{\"name\":\"bob\"}";
    assert!(matches!(
        customers.begin(b"cust-1", Fingerprint::of(bob)).unwrap(),
        Outcome::Conflict { .. }
    ));

    store
        .clock
        .advance(Duration::from_secs(50 * 365 * 24 * 3600));
    assert_eq!(
        &customers
            .get(b"cust-1")
            .unwrap()
            .unwrap()
            .result()
            .unwrap()
            .clone()[..],
        alice
    );
    engine.compact().unwrap();
    assert_eq!(
        &customers
            .get(b"cust-1")
            .unwrap()
            .unwrap()
            .result()
            .unwrap()
            .clone()[..],
        alice
    );
}

#[test]
fn entity_keys_do_not_collide_with_consumer_keys() {
    let store = TestStore::new();
    let engine = store.open();
    let customers = engine.entity_table("customers").unwrap();
    let consumer = engine.consumer("customers").unwrap();
    let fp = Fingerprint::of(b"");
    let Outcome::Fresh(claim) = customers.begin(b"k", fp).unwrap() else {
        panic!("fresh expected");
    };
    // A claim on the entity key does not hold the consumer's key of the same bytes.
    let Outcome::Fresh(other) = consumer.begin(b"k", fp).unwrap() else {
        panic!("fresh expected");
    };
    claim.commit(b"entity").unwrap();
    other.commit(b"marker").unwrap();
    assert_eq!(
        customers
            .get(b"k")
            .unwrap()
            .unwrap()
            .result()
            .unwrap()
            .clone(),
        "entity"
    );
    assert_eq!(
        consumer
            .get(b"k")
            .unwrap()
            .unwrap()
            .result()
            .unwrap()
            .clone(),
        "marker"
    );
}
