//! The model both checkers run sequences against: the operations, a plain in-memory model of
//! what each key must read, and the comparison of an outcome with it. It knows no backend: the
//! embedded engine's checker (`model_core.rs`, also the stateful fuzz target) and the
//! PostgreSQL backend's (`postgres/tests/postgres.rs`) include it, and run the same sequences
//! against the same model. It depends only on idemdb's outcome types and std.

use std::collections::HashMap;

use idemdb::format::{Record, RecordState};
use idemdb::{Fingerprint, Outcome};

/// Fails the run with a message unless `cond` holds. (Unused where the includer has its own.)
#[allow(unused_macros)]
macro_rules! ensure {
    ($cond:expr, $($message:tt)+) => {
        if !$cond {
            return Err(format!($($message)+));
        }
    };
}

/// Fails the run unless both sides are equal.
macro_rules! ensure_eq {
    ($left:expr, $right:expr) => {{
        let (left, right) = (&$left, &$right);
        if left != right {
            return Err(format!(
                "{} = {:?}, expected {:?} ({}:{})",
                stringify!($left),
                left,
                right,
                file!(),
                line!()
            ));
        }
    }};
}

pub const KEYS: u8 = 4;
pub const RETENTION_MS: u64 = 1_000;
pub const LEASE_MS: u64 = 500;

#[derive(Clone, Debug)]
pub enum Op {
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
    /// Take key under a lease.
    BeginExternal {
        key: u8,
        content: u8,
    },
    /// Renew the external claim at this index.
    Renew {
        claim: usize,
    },
    /// Complete the external claim at this index.
    Complete {
        claim: usize,
        result: u8,
    },
    /// Fail the external claim at this index: record the failure, or release.
    Fail {
        claim: usize,
        record: bool,
    },
    /// Deliver key and, when it is fresh, commit it at once with its business write, in one
    /// call: PostgreSQL's `apply`; the engine's `begin` then `commit`.
    Apply {
        key: u8,
        content: u8,
        result: u8,
    },
    /// Claim a batch of (key, content) and commit every fresh claim.
    Batch {
        messages: Vec<(u8, u8)>,
        result: u8,
    },
    AdvanceClock {
        ms: u64,
    },
    Compact,
    Reopen,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ModelRecord {
    Completed {
        content: u8,
        result: u8,
        committed_at_ms: u64,
        expires_at_ms: u64,
        succeeded: bool,
    },
    InProgress {
        content: u8,
        holder: u32,
        lease_until_ms: u64,
    },
    Released,
}

/// What `begin` must report for a key, as the model sees it.
#[derive(Debug, PartialEq)]
pub enum Expected {
    Fresh { takeover: bool },
    Duplicate { result: u8, succeeded: bool },
    Conflict,
    InProgress,
}

#[derive(Default)]
pub struct Model {
    pub records: HashMap<u8, ModelRecord>,
    pub commits: u64,
    pub next_holder: u32,
}

impl Model {
    pub fn expect(&self, key: u8, content: u8, latched: bool, now_ms: u64) -> Expected {
        if latched {
            return Expected::InProgress;
        }
        match self.records.get(&key) {
            Some(ModelRecord::InProgress { lease_until_ms, .. }) if *lease_until_ms > now_ms => {
                Expected::InProgress
            }
            Some(ModelRecord::InProgress { .. }) => Expected::Fresh { takeover: true },
            Some(ModelRecord::Completed {
                content: stored,
                result,
                expires_at_ms,
                succeeded,
                ..
            }) if *expires_at_ms > now_ms => {
                if *stored == content {
                    Expected::Duplicate {
                        result: *result,
                        succeeded: *succeeded,
                    }
                } else {
                    Expected::Conflict
                }
            }
            _ => Expected::Fresh { takeover: false },
        }
    }

    pub fn holds(&self, key: u8, holder: u32) -> bool {
        matches!(self.records.get(&key), Some(ModelRecord::InProgress { holder: h, .. }) if *h == holder)
    }

    pub fn complete(&mut self, key: u8, content: u8, result: u8, succeeded: bool, now_ms: u64) {
        self.records.insert(
            key,
            ModelRecord::Completed {
                content,
                result,
                committed_at_ms: now_ms,
                expires_at_ms: now_ms + RETENTION_MS,
                succeeded,
            },
        );
    }
}

pub fn observed<C: std::fmt::Debug>(outcome: &Outcome<C>) -> (Expected, Option<bool>) {
    match outcome {
        Outcome::Fresh(_) => (Expected::Fresh { takeover: false }, None),
        Outcome::Duplicate {
            result, succeeded, ..
        } => (
            Expected::Duplicate {
                result: result.first().copied().unwrap_or(0),
                succeeded: *succeeded,
            },
            None,
        ),
        Outcome::Conflict { .. } => (Expected::Conflict, None),
        Outcome::InProgress { .. } => (Expected::InProgress, None),
        other => panic!("the model never produces {other:?}"),
    }
}

/// Compares an outcome with the model's expectation; `takeover` is what the claim reports.
pub fn check_outcome<C: std::fmt::Debug>(
    what: &str,
    outcome: &Outcome<C>,
    expected: &Expected,
    takeover: Option<bool>,
) -> Result<(), String> {
    let (got, _) = observed(outcome);
    let matches = match (&got, expected) {
        (Expected::Fresh { .. }, Expected::Fresh { takeover: t }) => takeover == Some(*t),
        (got, expected) => got == expected,
    };
    if !matches {
        return Err(format!(
            "{what}: got {outcome:?} (takeover {takeover:?}), model expected {expected:?}"
        ));
    }
    Ok(())
}

pub fn message_key(key: u8) -> String {
    format!("key-{key}")
}

pub fn fingerprint(content: u8) -> Fingerprint {
    Fingerprint::of([content])
}

/// Compares what a backend stores under `key` (`None`: nothing a read would find) with what
/// the model says at `now_ms`.
pub fn check_record(
    key: u8,
    stored: Option<&Record>,
    model: &Model,
    now_ms: u64,
) -> Result<(), String> {
    let expected = match model.records.get(&key) {
        Some(ModelRecord::Completed { expires_at_ms, .. }) if *expires_at_ms <= now_ms => None,
        Some(ModelRecord::Released) | None => None,
        Some(record) => Some(record),
    };
    match (stored.map(|r| (&r.state, r.fingerprint)), expected) {
        (None, None) => {}
        (
            Some((
                RecordState::Completed {
                    result,
                    expires_at_ms,
                    succeeded,
                    ..
                },
                stored_fingerprint,
            )),
            Some(ModelRecord::Completed {
                content,
                result: expected_result,
                expires_at_ms: expected_expiry,
                succeeded: expected_succeeded,
                ..
            }),
        ) => {
            ensure_eq!(&result[..], &[*expected_result][..]);
            ensure_eq!(stored_fingerprint, fingerprint(*content));
            ensure_eq!(expires_at_ms, expected_expiry);
            ensure_eq!(succeeded, expected_succeeded);
        }
        (
            Some((RecordState::InProgress { lease_until_ms, .. }, _)),
            Some(ModelRecord::InProgress {
                lease_until_ms: expected_lease,
                ..
            }),
        ) => {
            ensure_eq!(lease_until_ms, expected_lease);
        }
        (stored, expected) => {
            return Err(format!("key {key}: stored {stored:?}, model {expected:?}"));
        }
    }
    Ok(())
}
