//! The engine-versus-model checker shared by the proptest in `model.rs` and the stateful
//! fuzz target (`fuzz/engine/fuzz_targets/engine_model.rs`, which includes this file): runs a
//! sequence of operations (`model_spec.rs`) against the engine and the plain in-memory model
//! and compares them after every step. It depends only on idemdb, tempfile and std.

// The operations, the model and the checks, shared with the PostgreSQL backend's checker.
#[macro_use]
#[path = "model_spec.rs"]
mod spec;
use spec::{
    Expected, LEASE_MS, Model, ModelRecord, check_outcome, check_record, fingerprint, message_key,
};
pub use spec::{KEYS, Op, RETENTION_MS};

use std::collections::HashMap;
use std::time::Duration;

use idemdb::{
    BatchOutcome, BusinessTable, Claim, Clock, Consumer, Durability, Engine, Error, ExternalClaim,
    FailurePolicy, LeaseTicket, Message, MockClock, Outcome, TableOptions, merge_ops,
};

/// A temporary store on a mock clock, with the tables the model writes.
pub struct Store {
    pub dir: tempfile::TempDir,
    pub clock: MockClock,
}

impl Store {
    pub fn new() -> Store {
        Store {
            dir: tempfile::tempdir().expect("temp dir"),
            // 2026-01-01T00:00:00Z
            clock: MockClock::new(1_767_225_600_000),
        }
    }
}

fn counter(engine: &Engine, name: &str) -> u64 {
    let counters = engine.business_table("counters").unwrap();
    counters.get(name).unwrap().map_or(0, |value| {
        merge_ops::read_u64(&value).expect("8-byte counter")
    })
}

fn open(store: &Store) -> Engine {
    Engine::builder(store.dir.path())
        .clock(store.clock.clone())
        .durability(Durability::Buffered)
        .write_buffer_bytes(4 << 20)
        .retention(Duration::from_millis(RETENTION_MS))
        .business_table(
            TableOptions::new("counters").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()
        .unwrap()
}

struct External {
    key: u8,
    content: u8,
    holder: u32,
    claim: ExternalClaim,
}

pub fn run(ops: Vec<Op>) -> Result<(), String> {
    let store = Store::new();
    let mut engine = open(&store);
    let mut model = Model::default();
    // Open transactional claims, with the key and content each holds.
    let mut claims: Vec<(u8, u8, Claim)> = Vec::new();
    let mut externals: Vec<External> = Vec::new();
    let lease = Duration::from_millis(LEASE_MS);

    for op in ops {
        let now_ms = store.clock.now_ms();
        let consumer = engine.consumer("model").unwrap();
        let counters = engine.business_table("counters").unwrap();
        match op {
            Op::Begin { key, content } => {
                let step = Step {
                    key,
                    content,
                    now_ms,
                };
                if let Some(claim) = step.begin("begin", &consumer, &model, &claims)? {
                    claims.push((key, content, claim));
                }
            }
            Op::Commit { claim, result } => {
                if claims.is_empty() {
                    continue;
                }
                let (key, content, claim) = claims.remove(claim % claims.len());
                let step = Step {
                    key,
                    content,
                    now_ms,
                };
                step.commit(claim, result, &counters, &mut model)?;
            }
            Op::Apply {
                key,
                content,
                result,
            } => {
                let step = Step {
                    key,
                    content,
                    now_ms,
                };
                if let Some(claim) = step.begin("apply", &consumer, &model, &claims)? {
                    step.commit(claim, result, &counters, &mut model)?;
                }
            }
            Op::Abort { claim } => {
                if !claims.is_empty() {
                    claims.remove(claim % claims.len()).2.abort();
                }
            }
            Op::BeginExternal { key, content } => {
                let latched = claims.iter().any(|(held, _, _)| *held == key);
                let expected = model.expect(key, content, latched, now_ms);
                let outcome = consumer
                    .begin_external(message_key(key), fingerprint(content), lease, "model")
                    .unwrap();
                let takeover = match &outcome {
                    Outcome::Fresh(claim) => Some(claim.previous_attempt().is_some()),
                    _ => None,
                };
                check_outcome("begin_external", &outcome, &expected, takeover)?;
                if let Outcome::Fresh(claim) = outcome {
                    model.next_holder += 1;
                    let holder = model.next_holder;
                    model.records.insert(
                        key,
                        ModelRecord::InProgress {
                            content,
                            holder,
                            lease_until_ms: now_ms + LEASE_MS,
                        },
                    );
                    externals.push(External {
                        key,
                        content,
                        holder,
                        claim,
                    });
                }
            }
            Op::Renew { claim } => {
                if externals.is_empty() {
                    continue;
                }
                let index = claim % externals.len();
                let External { key, holder, .. } = externals[index];
                let latched = claims.iter().any(|(held, _, _)| *held == key);
                let result = externals[index].claim.renew(lease);
                if latched {
                    ensure!(matches!(result, Err(Error::KeyBusy)), "{result:?}");
                } else if model.holds(key, holder) {
                    ensure_eq!(result.unwrap(), now_ms + LEASE_MS);
                    if let Some(ModelRecord::InProgress { lease_until_ms, .. }) =
                        model.records.get_mut(&key)
                    {
                        *lease_until_ms = now_ms + LEASE_MS;
                    }
                } else {
                    ensure!(matches!(result, Err(Error::LeaseLost { .. })), "{result:?}");
                }
            }
            Op::Complete { claim, result } => {
                if externals.is_empty() {
                    continue;
                }
                let External {
                    key,
                    content,
                    holder,
                    mut claim,
                } = externals.remove(claim % externals.len());
                claim
                    .merge(&counters, message_key(key), 1u64.to_be_bytes())
                    .unwrap();
                let latched = claims.iter().any(|(held, _, _)| *held == key);
                let completed = claim.complete([result]);
                if latched {
                    ensure!(matches!(completed, Err(Error::KeyBusy)), "{completed:?}");
                } else if model.holds(key, holder) {
                    completed.unwrap();
                    model.commits += 1;
                    model.complete(key, content, result, true, now_ms);
                } else {
                    ensure!(
                        matches!(completed, Err(Error::LeaseLost { .. })),
                        "{completed:?}"
                    );
                }
            }
            Op::Fail { claim, record } => {
                if externals.is_empty() {
                    continue;
                }
                let External {
                    key,
                    content,
                    holder,
                    claim,
                } = externals.remove(claim % externals.len());
                let policy = if record {
                    FailurePolicy::RecordFailure(vec![0xee].into())
                } else {
                    FailurePolicy::Release
                };
                let latched = claims.iter().any(|(held, _, _)| *held == key);
                let failed = claim.fail(policy);
                if latched {
                    ensure!(matches!(failed, Err(Error::KeyBusy)), "{failed:?}");
                } else if model.holds(key, holder) {
                    failed.unwrap();
                    if record {
                        model.complete(key, content, 0xee, false, now_ms);
                    } else {
                        model.records.insert(key, ModelRecord::Released);
                    }
                } else {
                    ensure!(matches!(failed, Err(Error::LeaseLost { .. })), "{failed:?}");
                }
            }
            Op::Batch { messages, result } => {
                let keys: Vec<String> = messages.iter().map(|(key, _)| message_key(*key)).collect();
                let batch_messages: Vec<Message> = messages
                    .iter()
                    .zip(&keys)
                    .map(|((_, content), key)| Message::new(key, fingerprint(*content)))
                    .collect();
                let mut batch = consumer.begin_batch(&batch_messages).unwrap();
                let mut first_seen: HashMap<u8, usize> = HashMap::new();
                // Keys a fresh claim of this batch holds.
                let mut claimed_in_batch: Vec<u8> = Vec::new();
                for (index, &(key, content)) in messages.iter().enumerate() {
                    let outcome = &batch.outcomes()[index];
                    if let Some(&first) = first_seen.get(&key) {
                        let first_content = messages[first].1;
                        if content == first_content {
                            ensure!(
                                matches!(outcome, BatchOutcome::DuplicateInBatch { first: f } if *f == first),
                                "{outcome:?}"
                            );
                            continue;
                        }
                        if matches!(batch.outcomes()[first], BatchOutcome::Fresh) {
                            ensure!(
                                matches!(
                                    outcome,
                                    BatchOutcome::ConflictInBatch { first: f, first_fingerprint, new_fingerprint }
                                        if *f == first
                                            && *first_fingerprint == fingerprint(first_content)
                                            && *new_fingerprint == fingerprint(content)
                                ),
                                "{outcome:?}"
                            );
                            continue;
                        }
                        // Otherwise decided as `begin` would, after the first copy: below.
                    } else {
                        first_seen.insert(key, index);
                    }
                    let latched = claims.iter().any(|(held, _, _)| *held == key)
                        || claimed_in_batch.contains(&key);
                    let expected = model.expect(key, content, latched, now_ms);
                    match outcome {
                        BatchOutcome::Fresh => {
                            let claim = batch.claim_mut(index).unwrap();
                            let takeover = claim.previous_attempt().is_some();
                            ensure_eq!(&expected, &Expected::Fresh { takeover });
                            claim
                                .merge(&counters, message_key(key), 1u64.to_be_bytes())
                                .unwrap();
                            claimed_in_batch.push(key);
                        }
                        BatchOutcome::Settled(settled) => {
                            check_outcome("batch", settled, &expected, None)?;
                        }
                        other => return Err(format!("message {index}: unexpected {other:?}")),
                    }
                }
                let committed = batch.commit(|_| [result]).unwrap();
                for (index, committed) in committed.iter().enumerate() {
                    if committed.is_some() {
                        let (key, content) = messages[index];
                        model.commits += 1;
                        model.complete(key, content, result, true, now_ms);
                    }
                }
            }
            Op::AdvanceClock { ms } => store.clock.advance(Duration::from_millis(ms)),
            Op::Compact => engine.compact().unwrap(),
            Op::Reopen => {
                // A restart drops every in-process claim; external holders keep their tickets.
                claims.clear();
                let tickets: Vec<(u8, u8, u32, LeaseTicket)> = externals
                    .drain(..)
                    .map(|e| (e.key, e.content, e.holder, e.claim.ticket().clone()))
                    .collect();
                drop(consumer);
                drop(counters);
                drop(engine);
                engine = open(&store);
                let consumer = engine.consumer("model").unwrap();
                for (key, content, holder, ticket) in tickets {
                    externals.push(External {
                        key,
                        content,
                        holder,
                        claim: consumer.resume(&ticket).unwrap(),
                    });
                }
            }
        }
        check(&engine, &model, store.clock.now_ms(), claims.len())?;
    }
    Ok(())
}

/// A delivery of `key` with `content` at `now_ms`, begun and committed as the model expects.
struct Step {
    key: u8,
    content: u8,
    now_ms: u64,
}

impl Step {
    /// Begins the delivery (`what`: the operation, for the report) and checks the outcome
    /// against the model, `claims` being the claims open in this process; the claim if fresh.
    fn begin(
        &self,
        what: &str,
        consumer: &Consumer,
        model: &Model,
        claims: &[(u8, u8, Claim)],
    ) -> Result<Option<Claim>, String> {
        let latched = claims.iter().any(|(held, _, _)| *held == self.key);
        let expected = model.expect(self.key, self.content, latched, self.now_ms);
        let outcome = consumer
            .begin(message_key(self.key), fingerprint(self.content))
            .unwrap();
        let takeover = match &outcome {
            Outcome::Fresh(claim) => Some(claim.previous_attempt().is_some()),
            _ => None,
        };
        check_outcome(what, &outcome, &expected, takeover)?;
        Ok(match outcome {
            Outcome::Fresh(claim) => Some(claim),
            _ => None,
        })
    }

    /// Commits `claim` with its business write (the key's counter plus one), and records the
    /// commit in the model.
    fn commit(
        &self,
        mut claim: Claim,
        result: u8,
        counters: &BusinessTable,
        model: &mut Model,
    ) -> Result<(), String> {
        claim
            .merge(counters, message_key(self.key), 1u64.to_be_bytes())
            .unwrap();
        let committed = claim.commit([result]).unwrap();
        ensure_eq!(committed.expires_at_ms, self.now_ms + RETENTION_MS);
        model.commits += 1;
        model.complete(self.key, self.content, result, true, self.now_ms);
        Ok(())
    }
}

/// After every step: each key reads exactly as the model says, and the business counters
/// staged with commits add up to the number of commits.
fn check(engine: &Engine, model: &Model, now_ms: u64, open_claims: usize) -> Result<(), String> {
    let consumer = engine.consumer("model").unwrap();
    let mut applied = 0;
    for key in 0..KEYS {
        let stored = consumer.get(message_key(key)).unwrap();
        check_record(key, stored.as_ref(), model, now_ms)?;
        applied += counter(engine, &message_key(key));
    }
    ensure_eq!(applied, model.commits);
    ensure_eq!(engine.open_claims(), open_claims);
    Ok(())
}
