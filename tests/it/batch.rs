//! Guards batch claims: outcomes match what single claims would give (pre-existing keys,
//! repeats inside the batch, keys held elsewhere), the winners commit in one write batch, and
//! released winners write nothing.

use crate::util::{TestStore, counter};
use idemdb::{BatchOutcome, Fingerprint, Message, Outcome};

#[test]
fn batch_outcomes_match_single_claims_and_commit_in_one_write() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("batch").unwrap();
    let counters = engine.business_table("counters").unwrap();
    let fp = |key: &str| Fingerprint::of(key);

    // Pre-existing: "done" completed, "held" claimed right now by someone else.
    let Outcome::Fresh(claim) = consumer.begin("done", fp("done")).unwrap() else {
        panic!("fresh expected");
    };
    claim.commit(b"earlier").unwrap();
    let Outcome::Fresh(held) = consumer.begin("held", fp("held")).unwrap() else {
        panic!("fresh expected");
    };

    let keys = ["a", "done", "b", "a", "held", "c", "changed"];
    let messages: Vec<Message> = keys
        .iter()
        .map(|key| {
            let content = if *key == "changed" { "new" } else { key };
            Message::new(*key, fp(content))
        })
        .collect();
    // "changed" was completed before with other content.
    let Outcome::Fresh(claim) = consumer.begin("changed", fp("old")).unwrap() else {
        panic!("fresh expected");
    };
    claim.commit(b"").unwrap();

    let writes_before = engine.stats().write_batches;
    let mut batch = consumer.begin_batch(&messages).unwrap();
    let outcomes = batch.outcomes();
    assert!(matches!(outcomes[0], BatchOutcome::Fresh));
    assert!(matches!(
        outcomes[1],
        BatchOutcome::Settled(Outcome::Duplicate { .. })
    ));
    assert!(matches!(outcomes[2], BatchOutcome::Fresh));
    assert!(matches!(
        outcomes[3],
        BatchOutcome::DuplicateInBatch { first: 0 }
    ));
    assert!(matches!(
        outcomes[4],
        BatchOutcome::Settled(Outcome::InProgress { .. })
    ));
    assert!(matches!(outcomes[5], BatchOutcome::Fresh));
    assert!(matches!(
        outcomes[6],
        BatchOutcome::Settled(Outcome::Conflict { .. })
    ));
    assert!(batch.claim_mut(3).is_none() && batch.claim_mut(4).is_none());

    for index in [0, 2, 5] {
        let claim = batch.claim_mut(index).unwrap();
        claim
            .merge(&counters, keys[index], 1u64.to_be_bytes())
            .unwrap();
    }
    // The handler of "b" failed: release it; its staged write must not land.
    batch.release(2);
    let committed = batch.commit(|index| format!("result-{index}")).unwrap();
    assert_eq!(committed.iter().filter(|c| c.is_some()).count(), 2);
    assert_eq!(
        engine.stats().write_batches,
        writes_before + 1,
        "one write for the batch"
    );

    assert_eq!(counter(&engine, "a"), 1);
    assert_eq!(counter(&engine, "c"), 1);
    assert_eq!(counter(&engine, "b"), 0);
    assert!(matches!(
        consumer.begin("b", fp("b")).unwrap(),
        Outcome::Fresh(_)
    ));
    match consumer.begin("c", fp("c")).unwrap() {
        Outcome::Duplicate { result, .. } => assert_eq!(result, "result-5"),
        other => panic!("expected duplicate, got {other:?}"),
    }
    drop(held);
    assert_eq!(engine.open_claims(), 0);
}

#[test]
fn a_batch_releases_every_key_when_dropped() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("batch").unwrap();
    let messages: Vec<Message> = ["x", "y"]
        .iter()
        .map(|key| Message::new(*key, Fingerprint::of(key)))
        .collect();
    let batch = consumer.begin_batch(&messages).unwrap();
    assert_eq!(engine.open_claims(), 2);
    drop(batch);
    assert_eq!(engine.open_claims(), 0);
    assert!(consumer.get("x").unwrap().is_none());
}

#[test]
fn a_repeat_with_other_content_in_a_batch_is_never_a_duplicate() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("batch").unwrap();
    let (a, b, c) = (
        Fingerprint::of("a"),
        Fingerprint::of("b"),
        Fingerprint::of("c"),
    );

    // A new key: the first copy is claimed, a copy with other content conflicts with it, and an
    // identical copy is a duplicate of it.
    let messages = [
        Message::new("k", a),
        Message::new("k", b),
        Message::new("k", a),
    ];
    let batch = consumer.begin_batch(&messages).unwrap();
    assert!(matches!(batch.outcomes()[0], BatchOutcome::Fresh));
    match &batch.outcomes()[1] {
        BatchOutcome::ConflictInBatch {
            first: 0,
            first_fingerprint,
            new_fingerprint,
        } => {
            assert_eq!(*first_fingerprint, a);
            assert_eq!(*new_fingerprint, b);
        }
        other => panic!("expected ConflictInBatch, got {other:?}"),
    }
    assert!(matches!(
        batch.outcomes()[2],
        BatchOutcome::DuplicateInBatch { first: 0 }
    ));
    batch.commit(|_| b"first").unwrap();
    assert_eq!(engine.stats().consumers[0].conflict, 1);

    // Against the stored record, each copy gets what `begin` gives it, whatever the first copy got.
    let messages = [
        Message::new("k", b),
        Message::new("k", a),
        Message::new("k", c),
    ];
    let batch = consumer.begin_batch(&messages).unwrap();
    let conflict_with = |outcome: &BatchOutcome, received: Fingerprint| {
        matches!(
            outcome,
            BatchOutcome::Settled(Outcome::Conflict { stored_fingerprint, new_fingerprint, .. })
                if *stored_fingerprint == a && *new_fingerprint == received
        )
    };
    assert!(conflict_with(&batch.outcomes()[0], b), "{batch:?}");
    assert!(
        matches!(&batch.outcomes()[1], BatchOutcome::Settled(Outcome::Duplicate { result, .. }) if result.as_ref() == b"first"),
        "{batch:?}"
    );
    assert!(conflict_with(&batch.outcomes()[2], c), "{batch:?}");
}
