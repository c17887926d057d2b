//! Guards the engine against a plain in-memory model: random sequences of begin, commit, abort,
//! clock advances, compactions and close-and-reopen over a small key space, compared after
//! every step.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use crate::util::{TestStore, counter};
use idemdb::{Claim, Clock, Engine, Fingerprint, Outcome, RecordState};

const KEYS: u8 = 4;
const RETENTION_MS: u64 = 1_000;

#[derive(Clone, Debug)]
enum Op {
    /// Deliver key with one of two contents.
    Begin {
        key: u8,
        content: u8,
    },
    /// Commit the open claim at this index (modulo the number of open claims).
    Commit {
        claim: usize,
        result: u8,
    },
    /// Abort the open claim at this index.
    Abort {
        claim: usize,
    },
    AdvanceClock {
        ms: u64,
    },
    Compact,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..KEYS, 0..2u8).prop_map(|(key, content)| Op::Begin { key, content }),
        4 => (any::<usize>(), any::<u8>()).prop_map(|(claim, result)| Op::Commit { claim, result }),
        1 => any::<usize>().prop_map(|claim| Op::Abort { claim }),
        2 => (0..2 * RETENTION_MS).prop_map(|ms| Op::AdvanceClock { ms }),
        1 => Just(Op::Compact),
        1 => Just(Op::Reopen),
    ]
}

#[derive(Clone, Debug, PartialEq)]
struct ModelRecord {
    content: u8,
    result: u8,
    committed_at_ms: u64,
    expires_at_ms: u64,
}

#[derive(Default)]
struct Model {
    records: HashMap<u8, ModelRecord>,
    commits: u64,
}

impl Model {
    fn live(&self, key: u8, now_ms: u64) -> Option<&ModelRecord> {
        self.records
            .get(&key)
            .filter(|record| record.expires_at_ms > now_ms)
    }
}

fn message_key(key: u8) -> String {
    format!("key-{key}")
}

fn fingerprint(content: u8) -> Fingerprint {
    Fingerprint::of([content])
}

fn open(store: &TestStore) -> Engine {
    store
        .builder()
        .retention(Duration::from_millis(RETENTION_MS))
        .open()
        .unwrap()
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let store = TestStore::new();
    let mut engine = open(&store);
    let mut model = Model::default();
    // Open claims, with the key and content each holds.
    let mut claims: Vec<(u8, u8, Claim)> = Vec::new();

    for op in ops {
        let now_ms = store.clock.now_ms();
        match op {
            Op::Begin { key, content } => {
                let consumer = engine.consumer("model").unwrap();
                let outcome = consumer
                    .begin(message_key(key), fingerprint(content))
                    .unwrap();
                let held = claims.iter().any(|(held, _, _)| *held == key);
                match (outcome, held, model.live(key, now_ms)) {
                    (Outcome::InProgress { .. }, true, _) => {}
                    (Outcome::Fresh(claim), false, None) => claims.push((key, content, claim)),
                    (
                        Outcome::Duplicate {
                            result,
                            first_committed_at_ms,
                            ..
                        },
                        false,
                        Some(r),
                    ) if r.content == content => {
                        prop_assert_eq!(&result[..], &[r.result][..]);
                        prop_assert_eq!(first_committed_at_ms, r.committed_at_ms);
                    }
                    (
                        Outcome::Conflict {
                            stored_fingerprint, ..
                        },
                        false,
                        Some(r),
                    ) if r.content != content => {
                        prop_assert_eq!(stored_fingerprint, fingerprint(r.content));
                    }
                    (outcome, held, expected) => {
                        return Err(TestCaseError::fail(format!(
                            "begin({key}, {content}) gave {outcome:?}; held={held}, model={expected:?}"
                        )));
                    }
                }
            }
            Op::Commit { claim, result } => {
                if claims.is_empty() {
                    continue;
                }
                let (key, content, claim) = claims.remove(claim % claims.len());
                let counters = engine.business_table("counters").unwrap();
                let mut claim = claim;
                claim
                    .merge(&counters, message_key(key), 1u64.to_be_bytes())
                    .unwrap();
                let committed = claim.commit([result]).unwrap();
                prop_assert_eq!(committed.expires_at_ms, now_ms + RETENTION_MS);
                model.commits += 1;
                model.records.insert(
                    key,
                    ModelRecord {
                        content,
                        result,
                        committed_at_ms: now_ms,
                        expires_at_ms: now_ms + RETENTION_MS,
                    },
                );
            }
            Op::Abort { claim } => {
                if !claims.is_empty() {
                    claims.remove(claim % claims.len()).2.abort();
                }
            }
            Op::AdvanceClock { ms } => store.clock.advance(Duration::from_millis(ms)),
            Op::Compact => engine.compact().unwrap(),
            Op::Reopen => {
                // Closing drops every open claim first: a claim is in-process state.
                claims.clear();
                drop(engine);
                engine = open(&store);
            }
        }
        check(&engine, &model, store.clock.now_ms(), claims.len())?;
    }
    Ok(())
}

/// After every step: each key reads exactly as the model says, and the business counters
/// staged with commits add up to the number of commits.
fn check(
    engine: &Engine,
    model: &Model,
    now_ms: u64,
    open_claims: usize,
) -> Result<(), TestCaseError> {
    let consumer = engine.consumer("model").unwrap();
    let mut applied = 0;
    for key in 0..KEYS {
        let stored = consumer.get(message_key(key)).unwrap();
        match (stored, model.live(key, now_ms)) {
            (None, None) => {}
            (Some(record), Some(expected)) => {
                let RecordState::Completed {
                    result,
                    expires_at_ms,
                    ..
                } = &record.state
                else {
                    return Err(TestCaseError::fail(format!(
                        "key {key}: not completed: {record:?}"
                    )));
                };
                prop_assert_eq!(&result[..], &[expected.result][..]);
                prop_assert_eq!(record.fingerprint, fingerprint(expected.content));
                prop_assert_eq!(*expires_at_ms, expected.expires_at_ms);
            }
            (stored, expected) => {
                return Err(TestCaseError::fail(format!(
                    "key {key}: stored {stored:?}, model {expected:?}"
                )));
            }
        }
        applied += counter(engine, &message_key(key));
    }
    prop_assert_eq!(applied, model.commits);
    prop_assert_eq!(engine.open_claims(), open_claims);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(ops)?;
    }
}
