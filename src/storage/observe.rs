//! Observability: per-consumer counters kept in process (for [`crate::Engine::stats`]),
//! the same numbers through the `metrics` facade. (The `tracing` events of each step are logged
//! where the step runs: `claim::Observer::log_step` and `Consumer::begin`.)
//!
//! The metric names are listed in the crate documentation (Observability).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Label};

use crate::decision::Outcome;

/// The kinds of outcome counted; `KINDS` lists them in the order of the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutcomeKind {
    Fresh,
    Duplicate,
    InProgress,
    Conflict,
    TooLate,
    Stale,
    DuplicateInBatch,
}

const KINDS: [OutcomeKind; 7] = [
    OutcomeKind::Fresh,
    OutcomeKind::Duplicate,
    OutcomeKind::InProgress,
    OutcomeKind::Conflict,
    OutcomeKind::TooLate,
    OutcomeKind::Stale,
    OutcomeKind::DuplicateInBatch,
];

impl OutcomeKind {
    /// The `outcome` label value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            OutcomeKind::Fresh => "fresh",
            OutcomeKind::Duplicate => "duplicate",
            OutcomeKind::InProgress => "in_progress",
            OutcomeKind::Conflict => "conflict",
            OutcomeKind::TooLate => "too_late",
            OutcomeKind::Stale => "stale",
            OutcomeKind::DuplicateInBatch => "duplicate_in_batch",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl<C> Outcome<C> {
    /// The kind of outcome, as the metrics count it.
    pub(crate) fn kind(&self) -> OutcomeKind {
        match self {
            Outcome::Fresh(_) => OutcomeKind::Fresh,
            Outcome::Duplicate { .. } => OutcomeKind::Duplicate,
            Outcome::InProgress { .. } => OutcomeKind::InProgress,
            Outcome::Conflict { .. } => OutcomeKind::Conflict,
            Outcome::TooLate { .. } => OutcomeKind::TooLate,
            Outcome::Stale { .. } => OutcomeKind::Stale,
        }
    }

    /// For a duplicate, how long before `now_ms` its first commit was.
    pub(crate) fn duplicate_age_ms(&self, now_ms: u64) -> Option<u64> {
        match self {
            Outcome::Duplicate {
                first_committed_at_ms,
                ..
            } => Some(now_ms.saturating_sub(*first_committed_at_ms)),
            _ => None,
        }
    }
}

/// One consumer's numbers: atomics for [`crate::Engine::stats`] and the metric handles.
pub(crate) struct ConsumerMetrics {
    pub(crate) consumer: String,
    outcomes: [AtomicU64; KINDS.len()],
    commits: AtomicU64,
    lease_lost: AtomicU64,
    in_progress: AtomicI64,
    outcome_counters: [Counter; KINDS.len()],
    commit_counter: Counter,
    lease_lost_counter: Counter,
    claim_seconds: Histogram,
    commit_seconds: Histogram,
    duplicate_age_seconds: Histogram,
    in_progress_gauge: Gauge,
}

impl ConsumerMetrics {
    /// `extra` are the opener's labels, added after `consumer` (and `outcome`) and `backend`.
    pub(crate) fn new(consumer: &str, extra: &[(String, String)]) -> ConsumerMetrics {
        let labels = |outcome: Option<OutcomeKind>| {
            let mut labels = vec![Label::new("consumer", consumer.to_owned())];
            if let Some(kind) = outcome {
                labels.push(Label::new("outcome", kind.label()));
            }
            // Told apart from idemdb-postgres's series (`backend="postgres"`) in one process.
            labels.push(Label::new("backend", "rocksdb"));
            labels.extend(
                extra
                    .iter()
                    .map(|(name, value)| Label::new(name.clone(), value.clone())),
            );
            labels
        };
        ConsumerMetrics {
            consumer: consumer.to_owned(),
            outcomes: Default::default(),
            commits: AtomicU64::new(0),
            lease_lost: AtomicU64::new(0),
            in_progress: AtomicI64::new(0),
            outcome_counters: KINDS
                .map(|kind| metrics::counter!("idemdb_outcomes_total", labels(Some(kind)))),
            commit_counter: metrics::counter!("idemdb_commits_total", labels(None)),
            lease_lost_counter: metrics::counter!("idemdb_lease_lost_total", labels(None)),
            claim_seconds: metrics::histogram!("idemdb_claim_seconds", labels(None)),
            commit_seconds: metrics::histogram!("idemdb_commit_seconds", labels(None)),
            duplicate_age_seconds: metrics::histogram!(
                "idemdb_duplicate_age_seconds",
                labels(None)
            ),
            in_progress_gauge: metrics::gauge!("idemdb_in_progress", labels(None)),
        }
    }

    /// Records one `begin` outcome of `kind`, the time it took and, for a duplicate, how long
    /// ago the first commit was.
    pub(crate) fn outcome(
        &self,
        kind: OutcomeKind,
        elapsed: Duration,
        duplicate_age_ms: Option<u64>,
    ) {
        self.count(kind);
        self.claim_seconds.record(elapsed.as_secs_f64());
        if let Some(age_ms) = duplicate_age_ms {
            self.duplicate_age_seconds.record(age_ms as f64 / 1000.0);
        }
    }

    pub(crate) fn count(&self, kind: OutcomeKind) {
        self.outcomes[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.outcome_counters[kind.index()].increment(1);
    }

    pub(crate) fn commit(&self, elapsed: Duration) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.commit_counter.increment(1);
        self.commit_seconds.record(elapsed.as_secs_f64());
    }

    pub(crate) fn lease_lost(&self) {
        self.lease_lost.fetch_add(1, Ordering::Relaxed);
        self.lease_lost_counter.increment(1);
    }

    /// Moves the in-progress gauge by `delta`.
    pub(crate) fn in_progress(&self, delta: i64) {
        self.in_progress.fetch_add(delta, Ordering::Relaxed);
        // Gauges take f64; a count of in-progress records is far below 2^53.
        self.in_progress_gauge.increment(delta as f64);
    }

    pub(crate) fn snapshot(&self) -> ConsumerStats {
        let load = |kind: OutcomeKind| self.outcomes[kind.index()].load(Ordering::Relaxed);
        ConsumerStats {
            consumer: self.consumer.clone(),
            fresh: load(OutcomeKind::Fresh),
            duplicate: load(OutcomeKind::Duplicate),
            in_progress: load(OutcomeKind::InProgress),
            conflict: load(OutcomeKind::Conflict),
            too_late: load(OutcomeKind::TooLate),
            stale: load(OutcomeKind::Stale),
            duplicate_in_batch: load(OutcomeKind::DuplicateInBatch),
            commits: self.commits.load(Ordering::Relaxed),
            lease_lost: self.lease_lost.load(Ordering::Relaxed),
            external_in_progress: self.in_progress.load(Ordering::Relaxed),
        }
    }
}

/// One consumer's counts since the engine was opened (see [`crate::Engine::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// The consumer id.
    pub consumer: String,
    /// `begin` outcomes: fresh claims.
    pub fresh: u64,
    /// Duplicates.
    pub duplicate: u64,
    /// In progress (held in this process or under a live lease).
    pub in_progress: u64,
    /// Conflicts.
    pub conflict: u64,
    /// Too late (admission floor).
    pub too_late: u64,
    /// Stale (ordering guard).
    pub stale: u64,
    /// Repeats of a key earlier in the same batch.
    pub duplicate_in_batch: u64,
    /// Commits and completes written.
    pub commits: u64,
    /// Lease steps refused with `LeaseLost`.
    pub lease_lost: u64,
    /// External claims alive in this process (begun, taken over or resumed; not yet finished
    /// or dropped).
    pub external_in_progress: i64,
}

/// An in-process snapshot of the engine's numbers, for users without a metrics exporter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Per consumer, in the order consumers were first opened.
    pub consumers: Vec<ConsumerStats>,
    /// Write batches the engine wrote: commits, batch commits, lease steps, one each, however
    /// they were grouped (with the commit log, each is one record of the log, and a group of
    /// them one write to the tables; without it, each is one WAL write).
    pub write_batches: u64,
    /// Claims held in this process right now.
    pub open_claims: usize,
}
