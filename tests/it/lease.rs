//! Guards work outside the batch: durable in-progress records under a lease, renewal,
//! takeover with a new fencing epoch, `LeaseLost` for stale holders (also across reopen),
//! failure policies, and reconciliation of stuck keys. All on the mock clock.

use std::time::Duration;

use crate::util::TestStore;
use idemdb::{
    Clock, Consumer, Error, ExternalClaim, FailurePolicy, Fingerprint, Outcome, RecordState,
    Resolution,
};

const LEASE: Duration = Duration::from_secs(30);

fn fp() -> Fingerprint {
    Fingerprint::of(b"charge 10 EUR")
}

fn take(consumer: &Consumer, key: &str, holder: &str) -> ExternalClaim {
    match consumer.begin_external(key, fp(), LEASE, holder).unwrap() {
        Outcome::Fresh(claim) => claim,
        other => panic!("{holder} expected to take {key}, got {other:?}"),
    }
}

#[track_caller]
fn assert_lease_lost<T: std::fmt::Debug>(result: Result<T, Error>, epoch: u64) {
    match result {
        Err(Error::LeaseLost { current_epoch }) => assert_eq!(current_epoch, epoch),
        other => panic!("expected LeaseLost at epoch {epoch}, got {other:?}"),
    }
}

#[track_caller]
fn assert_held_by_a<C: std::fmt::Debug>(outcome: Outcome<C>, lease_until: u64) {
    match outcome {
        Outcome::InProgress {
            holder,
            lease_until_ms,
            epoch,
            ..
        } => {
            assert_eq!(holder.as_deref(), Some(&b"worker-a"[..]));
            assert_eq!(lease_until_ms, Some(lease_until));
            assert_eq!(epoch, Some(1));
        }
        other => panic!("expected in progress, got {other:?}"),
    }
}

#[test]
fn live_lease_reports_holder_and_renewal_keeps_it() {
    let store = TestStore::new();
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();
    let mut first = take(&payments, "pay-1", "worker-a");
    assert_eq!(first.epoch(), 1);
    assert!(first.previous_attempt().is_none());

    // The in-progress record is durable and visible.
    let record = payments.get("pay-1").unwrap().unwrap();
    assert!(matches!(record.state, RecordState::InProgress { .. }));

    store.clock.advance(LEASE - Duration::from_millis(1));
    let lease_until_ms = first.lease_until_ms();
    assert_held_by_a(
        payments
            .begin_external("pay-1", fp(), LEASE, "worker-b")
            .unwrap(),
        lease_until_ms,
    );
    assert_held_by_a(payments.begin("pay-1", fp()).unwrap(), lease_until_ms);
    // A heartbeat moves the deadline: past the first deadline the key is still held.
    let renewed = first.renew(LEASE).unwrap();
    store.clock.advance(Duration::from_secs(10));
    assert!(renewed > store.clock.now_ms());
    assert!(matches!(
        payments
            .begin_external("pay-1", fp(), LEASE, "worker-b")
            .unwrap(),
        Outcome::InProgress { .. }
    ));
    first.complete(b"charged").unwrap();
    assert!(matches!(
        payments.begin("pay-1", fp()).unwrap(),
        Outcome::Duplicate {
            succeeded: true,
            ..
        }
    ));
}

#[test]
fn expired_lease_is_taken_over_and_the_stale_holder_is_fenced() {
    let store = TestStore::new();
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let mut stale = take(&payments, "pay-2", "worker-a");
    stale
        .put(&orders, "pay-2", "from the stale holder")
        .unwrap();

    store.clock.advance(LEASE);
    let mut fresh = take(&payments, "pay-2", "worker-b");
    assert_eq!(fresh.epoch(), 2);
    let previous = fresh.previous_attempt().unwrap();
    assert_eq!(previous.epoch, 1);
    assert_eq!(&previous.holder[..], b"worker-a");

    assert_lease_lost(stale.renew(LEASE), 2);
    let stale_ticket = stale.ticket().clone();
    assert_lease_lost(stale.complete(b"stale"), 2);
    assert_lease_lost(payments.resume(&stale_ticket).unwrap().release(), 2);
    assert_eq!(
        orders.get("pay-2").unwrap(),
        None,
        "a fenced holder's write landed"
    );

    fresh.put(&orders, "pay-2", "from the new holder").unwrap();
    fresh.complete(b"charged once").unwrap();
    assert_eq!(
        orders.get("pay-2").unwrap().unwrap(),
        b"from the new holder"
    );
    match payments.begin("pay-2", fp()).unwrap() {
        Outcome::Duplicate { result, epoch, .. } => {
            assert_eq!(result, "charged once");
            assert_eq!(epoch, 2);
        }
        other => panic!("expected duplicate, got {other:?}"),
    }
    // A completed key cannot be completed again by the stale ticket either.
    assert_lease_lost(payments.resume(&stale_ticket).unwrap().complete(b"x"), 2);
}

#[test]
fn fencing_holds_across_reopen() {
    let store = TestStore::new();
    let ticket = {
        let engine = store.open();
        let payments = engine.consumer("payments").unwrap();
        take(&payments, "pay-3", "worker-a").ticket().clone()
    };
    // Restart, lease expires, another worker takes over; restart again.
    store.clock.advance(LEASE + Duration::from_secs(1));
    {
        let engine = store.open();
        let payments = engine.consumer("payments").unwrap();
        let taken = take(&payments, "pay-3", "worker-b");
        assert_eq!(taken.epoch(), 2);
        assert_eq!(taken.previous_attempt().unwrap().epoch, 1);
    }
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let mut stale = payments.resume(&ticket).unwrap();
    assert_eq!(stale.epoch(), 1);
    stale.put(&orders, "pay-3", "stale").unwrap();
    assert_lease_lost(stale.complete(b"stale"), 2);
    assert_eq!(orders.get("pay-3").unwrap(), None);
    // The key is still the new holder's.
    assert!(matches!(
        payments.begin("pay-3", fp()).unwrap(),
        Outcome::InProgress { epoch: Some(2), .. }
    ));
    // A ticket is bound to its consumer.
    let other = engine.consumer("refunds").unwrap();
    assert!(matches!(other.resume(&ticket), Err(Error::ForeignTicket)));
}

#[test]
fn failure_policies_release_or_record() {
    let store = TestStore::new();
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();

    // Release: the redelivery processes the key again, at the next epoch.
    take(&payments, "transient", "a")
        .fail(FailurePolicy::Release)
        .unwrap();
    assert!(payments.get("transient").unwrap().is_none());
    let Outcome::Fresh(claim) = payments.begin("transient", fp()).unwrap() else {
        panic!("a released key is fresh");
    };
    assert_eq!(claim.epoch(), 2);
    drop(claim);

    // Record: duplicates replay the failure.
    take(&payments, "declined", "a")
        .fail(FailurePolicy::RecordFailure("card declined".into()))
        .unwrap();
    match payments.begin("declined", fp()).unwrap() {
        Outcome::Duplicate {
            result, succeeded, ..
        } => {
            assert_eq!(result, "card declined");
            assert!(!succeeded);
        }
        other => panic!("expected the recorded failure, got {other:?}"),
    }
}

#[test]
fn transactional_claim_takes_over_an_expired_lease() {
    let store = TestStore::new();
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();
    let stale = take(&payments, "pay-4", "worker-a");
    store.clock.advance(LEASE);
    let Outcome::Fresh(claim) = payments.begin("pay-4", fp()).unwrap() else {
        panic!("an expired lease can be taken over");
    };
    assert_eq!(claim.previous_attempt().unwrap().epoch, 1);
    assert_eq!(claim.epoch(), 2);
    claim.commit(b"done").unwrap();
    assert_lease_lost(stale.complete(b"late"), 2);
}

#[test]
fn reconciliation_lists_and_resolves_stuck_keys() {
    let store = TestStore::new();
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();
    let refunds = engine.consumer("refunds").unwrap();
    let old_a = take(&payments, "old-a", "w");
    let _old_b = take(&payments, "old-b", "w");
    let _other_consumer = take(&refunds, "old-c", "w");
    store.clock.advance(Duration::from_secs(600));
    let _young = take(&payments, "young", "w");
    take(&payments, "done", "w").complete(b"ok").unwrap();

    let keys = |entries: Vec<idemdb::InProgressEntry>| -> Vec<String> {
        entries
            .iter()
            .map(|entry| String::from_utf8(entry.message_key.to_vec()).unwrap())
            .collect()
    };
    let older = payments.in_progress(Duration::from_secs(300), 100).unwrap();
    assert_eq!(keys(older), ["old-a", "old-b"]);
    assert_eq!(
        keys(payments.in_progress(Duration::ZERO, 100).unwrap()),
        ["old-a", "old-b", "young"]
    );
    assert_eq!(
        keys(payments.in_progress(Duration::ZERO, 1).unwrap()),
        ["old-a"]
    );

    payments
        .resolve("old-a", Resolution::Complete("settled by hand".into()))
        .unwrap();
    payments.resolve("old-b", Resolution::Release).unwrap();
    assert!(matches!(
        payments.resolve("done", Resolution::Release),
        Err(Error::NotInProgress { current_epoch: 1 })
    ));
    assert!(matches!(
        payments.begin("old-a", fp()).unwrap(),
        Outcome::Duplicate { .. }
    ));
    assert!(matches!(
        payments.begin("old-b", fp()).unwrap(),
        Outcome::Fresh(_)
    ));
    assert_lease_lost(old_a.complete(b"late"), 1);
    assert_eq!(
        keys(payments.in_progress(Duration::ZERO, 100).unwrap()),
        ["young"]
    );
}

#[test]
fn compaction_keeps_in_progress_records_whatever_their_lease() {
    let store = TestStore::new();
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();
    let _held = take(&payments, "held", "w");
    store.clock.advance(Duration::from_secs(365 * 24 * 3600));
    engine.compact().unwrap();
    assert_eq!(engine.record_counts().unwrap().in_progress, 1);
}

#[test]
fn downstream_keys_are_the_same_for_every_attempt_and_restart() {
    let store = TestStore::new();
    let (first_key, ticket_key) = {
        let engine = store.open();
        let payments = engine.consumer("payments").unwrap();
        let attempt = take(&payments, "pay-9", "worker-a");
        let key = attempt.derive_key("charge-card");
        assert_ne!(key, attempt.derive_key("send-receipt"));
        (key, attempt.ticket().clone())
    };
    store.clock.advance(LEASE);
    let engine = store.open();
    let payments = engine.consumer("payments").unwrap();
    let takeover = take(&payments, "pay-9", "worker-b");
    assert_eq!(takeover.derive_key("charge-card"), first_key);
    assert_eq!(
        payments
            .resume(&ticket_key)
            .unwrap()
            .derive_key("charge-card"),
        first_key
    );
    // A transactional claim on the same message derives the same key, another consumer not.
    drop(takeover);
    store.clock.advance(LEASE);
    let Outcome::Fresh(claim) = payments.begin("pay-9", fp()).unwrap() else {
        panic!("fresh expected");
    };
    assert_eq!(claim.derive_key("charge-card"), first_key);
    let refunds = engine.consumer("refunds").unwrap();
    let Outcome::Fresh(other) = refunds.begin("pay-9", fp()).unwrap() else {
        panic!("fresh expected");
    };
    assert_ne!(other.derive_key("charge-card"), first_key);
}
