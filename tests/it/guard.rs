//! Guards the admission floor (old messages are `TooLate`, opt-in) and the ordering guard
//! (versions not newer than the applied one are `Stale`, recorded in the commit's batch).

use std::time::Duration;

use crate::util::TestStore;
use idemdb::{Clock, Error, Fingerprint, Message, Outcome};

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn admission_floor_reports_too_late_only_when_on() {
    let store = TestStore::new();
    let floor = store
        .builder()
        .retention(HOUR)
        .admission_floor(true)
        .open()
        .unwrap();
    let consumer = floor.consumer("c").unwrap();
    let now = store.clock.now_ms();
    let old = now - 2 * 3_600_000;
    let fp = Fingerprint::of(b"m");

    match consumer
        .begin_message(&Message::new("old", fp).produced_at_ms(old))
        .unwrap()
    {
        Outcome::TooLate {
            produced_at_ms,
            horizon_ms,
            ..
        } => {
            assert_eq!(produced_at_ms, old);
            assert_eq!(horizon_ms, now - 3_600_000);
        }
        other => panic!("expected too late, got {other:?}"),
    }
    assert!(matches!(
        consumer
            .begin_external_message(&Message::new("old", fp).produced_at_ms(old), HOUR, "w")
            .unwrap(),
        Outcome::TooLate { .. }
    ));
    // Within the horizon: new.
    let recent = Message::new("recent", fp).produced_at_ms(now - 1_800_000);
    let Outcome::Fresh(claim) = consumer.begin_message(&recent).unwrap() else {
        panic!("a recent message is fresh");
    };
    claim.commit(b"ok").unwrap();
    // A recorded key stays a duplicate however old the copy claims to be.
    let old_copy = Message::new("recent", fp).produced_at_ms(old);
    assert!(matches!(
        consumer.begin_message(&old_copy).unwrap(),
        Outcome::Duplicate { .. }
    ));
    drop(consumer);
    drop(floor);

    // Off (the default): an old message is treated as new.
    let open = store.builder().retention(HOUR).open().unwrap();
    let consumer = open.consumer("c").unwrap();
    assert!(matches!(
        consumer
            .begin_message(&Message::new("old", fp).produced_at_ms(old))
            .unwrap(),
        Outcome::Fresh(_)
    ));
}

fn apply(consumer: &idemdb::Consumer, key: &str, entity: &str, version: u64) -> Outcome {
    let message = Message::new(key, Fingerprint::of(key)).version(entity, version);
    consumer.begin_message(&message).unwrap()
}

#[test]
fn ordering_guard_rejects_versions_not_newer_across_reopen() {
    let store = TestStore::new();
    {
        let engine = store.open();
        let consumer = engine.consumer("c").unwrap();
        let Outcome::Fresh(claim) = apply(&consumer, "m-1", "customer-7", 1) else {
            panic!("first version applies");
        };
        claim.commit(b"").unwrap();
        for (key, version) in [("m-1b", 1), ("m-0", 0)] {
            assert!(matches!(
                apply(&consumer, key, "customer-7", version),
                Outcome::Stale {
                    current_version: 1,
                    ..
                }
            ));
        }
        // Another entity has its own sequence; another consumer its own versions.
        assert!(matches!(
            apply(&consumer, "x-1", "customer-8", 1),
            Outcome::Fresh(_)
        ));
        let other = engine.consumer("d").unwrap();
        assert!(matches!(
            apply(&other, "m-1", "customer-7", 1),
            Outcome::Fresh(_)
        ));

        let Outcome::Fresh(claim) = apply(&consumer, "m-3", "customer-7", 3) else {
            panic!("a newer version applies");
        };
        // While it is held the entity is busy: a concurrent message of it must wait.
        assert!(matches!(
            apply(&consumer, "m-4", "customer-7", 4),
            Outcome::InProgress { .. }
        ));
        claim.commit(b"").unwrap();
        // A dropped claim records no version.
        let Outcome::Fresh(claim) = apply(&consumer, "m-5", "customer-7", 5) else {
            panic!("fresh expected");
        };
        drop(claim);
    }
    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    assert!(matches!(
        apply(&consumer, "m-2", "customer-7", 2),
        Outcome::Stale {
            current_version: 3,
            ..
        }
    ));
    assert!(matches!(
        apply(&consumer, "m-5", "customer-7", 5),
        Outcome::Fresh(_)
    ));
}

#[test]
fn ordering_guard_is_not_for_external_claims() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    let message = Message::new("k", Fingerprint::of(b"")).version("e", 1);
    assert!(matches!(
        consumer.begin_external_message(&message, HOUR, "w"),
        Err(Error::InvalidArgument { .. })
    ));
}
