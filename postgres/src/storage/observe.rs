//! Observability: the embedded engine's metric names, labels and `tracing` events, with the
//! label `backend="postgres"` on every series and the field `backend = "postgres"` on every
//! event, so that one dashboard reads both backends and a process running both tells them apart.
//!
//! The embedded engine keeps these in a module built only with RocksDB, so this crate repeats
//! them; the names are the crate docs' table (Observability) and must stay the embedded ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idemdb::Outcome;
use metrics::{Counter, Gauge, Histogram, Label};

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
    /// The `outcome` label value (the embedded engine's).
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

    /// The kind of `outcome`.
    pub(crate) fn of<C>(outcome: &Outcome<C>) -> OutcomeKind {
        match outcome {
            Outcome::Fresh(_) => OutcomeKind::Fresh,
            Outcome::Duplicate { .. } => OutcomeKind::Duplicate,
            Outcome::InProgress { .. } => OutcomeKind::InProgress,
            Outcome::Conflict { .. } => OutcomeKind::Conflict,
            Outcome::TooLate { .. } => OutcomeKind::TooLate,
            Outcome::Stale { .. } => OutcomeKind::Stale,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// For a duplicate, how long before `now_ms` its first commit was.
pub(crate) fn duplicate_age_ms<C>(outcome: &Outcome<C>, now_ms: u64) -> Option<u64> {
    match outcome {
        Outcome::Duplicate {
            first_committed_at_ms,
            ..
        } => Some(now_ms.saturating_sub(*first_committed_at_ms)),
        _ => None,
    }
}

/// One consumer's metric handles, registered with the recorder installed when the consumer's
/// handle is made ([`crate::storage::store::PgStore::consumer`]).
pub(crate) struct ConsumerMetrics {
    /// The consumer id as text (lossy for ids that are not UTF-8), for labels and logs.
    pub(crate) consumer: String,
    outcome_counters: [Counter; KINDS.len()],
    commit_counter: Counter,
    /// External claims alive in this process (see [`Alive`]).
    in_progress_gauge: Gauge,
    lease_lost_counter: Counter,
    claim_seconds: Histogram,
    commit_seconds: Histogram,
    duplicate_age_seconds: Histogram,
}

impl std::fmt::Debug for ConsumerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerMetrics")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl ConsumerMetrics {
    pub(crate) fn new(consumer: &[u8]) -> ConsumerMetrics {
        let consumer = String::from_utf8_lossy(consumer).into_owned();
        // The embedded engine's order: consumer, outcome (outcome counts only), backend.
        let labels = |outcome: Option<OutcomeKind>| {
            let mut labels = vec![Label::new("consumer", consumer.clone())];
            if let Some(kind) = outcome {
                labels.push(Label::new("outcome", kind.label()));
            }
            labels.push(Label::new("backend", "postgres"));
            labels
        };
        ConsumerMetrics {
            outcome_counters: KINDS
                .map(|kind| metrics::counter!("idemdb_outcomes_total", labels(Some(kind)))),
            commit_counter: metrics::counter!("idemdb_commits_total", labels(None)),
            in_progress_gauge: metrics::gauge!("idemdb_in_progress", labels(None)),
            lease_lost_counter: metrics::counter!("idemdb_lease_lost_total", labels(None)),
            claim_seconds: metrics::histogram!("idemdb_claim_seconds", labels(None)),
            commit_seconds: metrics::histogram!("idemdb_commit_seconds", labels(None)),
            duplicate_age_seconds: metrics::histogram!(
                "idemdb_duplicate_age_seconds",
                labels(None)
            ),
            consumer,
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

    /// Counts and logs the outcome of a `begin` of `key`, decided at `now_ms` after `elapsed`:
    /// the outcome's time and, for a duplicate, its age.
    pub(crate) fn begun<C>(
        &self,
        outcome: &Outcome<C>,
        now_ms: u64,
        elapsed: Duration,
        key: &[u8],
        correlation_id: Option<&str>,
    ) {
        let kind = OutcomeKind::of(outcome);
        self.outcome(kind, elapsed, duplicate_age_ms(outcome, now_ms));
        self.log_begin(key, kind, correlation_id);
    }

    /// A new external claim, counted in the `idemdb_in_progress` gauge until it and every
    /// clone of it are gone.
    pub(crate) fn alive(&self) -> Arc<Alive> {
        self.in_progress_gauge.increment(1.0);
        Arc::new(Alive {
            gauge: self.in_progress_gauge.clone(),
            counted: AtomicBool::new(true),
        })
    }

    /// Counts one outcome of `kind` (a batch message's, whose time is the batch's).
    pub(crate) fn count(&self, kind: OutcomeKind) {
        self.outcome_counters[kind.index()].increment(1);
    }

    /// Counts a written commit (or completion) and the time it took.
    pub(crate) fn commit(&self, elapsed: Duration) {
        self.commit_counter.increment(1);
        self.commit_seconds.record(elapsed.as_secs_f64());
    }

    /// Counts a lease step refused with `LeaseLost`.
    pub(crate) fn lease_lost(&self) {
        self.lease_lost_counter.increment(1);
    }

    /// Logs the `begin` of `key` (the message key) and its outcome, as the embedded engine does,
    /// with `backend` (as on the metrics) so that a process running both backends tells their
    /// events apart.
    pub(crate) fn log_begin(&self, key: &[u8], kind: OutcomeKind, correlation_id: Option<&str>) {
        tracing::debug!(
            target: "idemdb",
            consumer = %self.consumer,
            key = %idemdb::format::printable(key),
            outcome = kind.label(),
            correlation_id,
            backend = "postgres",
            "begin"
        );
    }

    /// Logs a step (`commit`, `renew`, `complete`, `release`, `fail`) of the claim on
    /// `stored_key` at `epoch`; `current_epoch` when the step was refused because another
    /// holder has the key at that epoch. The embedded engine's event, field for field, and
    /// `backend` as in [`ConsumerMetrics::log_begin`].
    pub(crate) fn log_step(
        &self,
        step: &'static str,
        stored_key: &[u8],
        epoch: u64,
        current_epoch: Option<u64>,
        correlation_id: Option<&str>,
    ) {
        tracing::debug!(
            target: "idemdb",
            consumer = %self.consumer,
            key = %idemdb::format::printable(stored_key),
            epoch,
            current_epoch,
            correlation_id,
            backend = "postgres",
            "{step}{}",
            if current_epoch.is_some() { ": lease lost" } else { "" }
        );
    }
}

/// An external claim alive in this process: shared by the claim's clones, it takes the claim
/// off the `idemdb_in_progress` gauge once it is finished (completed, released or failed) or
/// the last clone is dropped, as the embedded engine's gauge counts its claim handles. (A
/// completion borrows the claim, so the end is marked, not waited for.)
pub(crate) struct Alive {
    gauge: Gauge,
    /// Still on the gauge.
    counted: AtomicBool,
}

impl Alive {
    /// The claim is finished: off the gauge, once.
    pub(crate) fn finish(&self) {
        if self.counted.swap(false, Ordering::AcqRel) {
            self.gauge.decrement(1.0);
        }
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.finish();
    }
}

impl std::fmt::Debug for Alive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alive").finish_non_exhaustive()
    }
}
