//! The decision core: what a claimant gets, from the record stored under its key, the
//! request and the time. Pure functions over plain values, no storage and no I/O, so every
//! backend and the model checker decide the same way. The backend supplies the read and the
//! claim type: [`Outcome`] is generic over it (the crate root's `Outcome` is this type with the
//! embedded engine's `Claim` as its default).

use bytes::Bytes;

use crate::format::fingerprint::Fingerprint;
use crate::format::record::{Record, RecordState};

/// What `begin` found. Match every variant: each asks the caller for a different action.
///
/// `C` is the claim a fresh outcome carries: with the embedded engine, a `Claim` from
/// `Consumer::begin` (the crate root's `Outcome` is this type with that default) or an
/// `ExternalClaim` from `Consumer::begin_external`; another backend brings its own.
#[derive(Debug)]
#[must_use = "an outcome tells the caller whether to process, skip or dead-letter the message"]
pub enum Outcome<C> {
    /// The key was free and this caller now owns it: process the message, stage the business
    /// writes on the claim and commit. For a `Claim`, dropping it releases the key and writes
    /// nothing (a transient failure: let the broker redeliver).
    Fresh(C),
    /// The message was processed before: acknowledge it without effect and, if useful, return
    /// the stored result.
    #[non_exhaustive]
    Duplicate {
        /// The result stored by the first commit.
        result: Bytes,
        /// When the first commit happened (engine clock, ms since the Unix epoch).
        first_committed_at_ms: u64,
        /// When the record expires ([`crate::EXPIRES_NEVER_MS`] for never).
        expires_at_ms: u64,
        /// The record's epoch.
        epoch: u64,
        /// False when the first attempt's failure was recorded as the result
        /// (`FailurePolicy::RecordFailure`): replay it, do not retry.
        succeeded: bool,
    },
    /// Another holder has the key right now: do not acknowledge; let the broker redeliver later.
    /// Either a claim in this process (`holder` and `lease_until_ms` are `None`), or a durable
    /// external claim whose lease is live.
    #[non_exhaustive]
    InProgress {
        /// When the holder took the key (engine clock, ms since the Unix epoch).
        since_ms: u64,
        /// The external holder's identity.
        holder: Option<Bytes>,
        /// Until when the external holder's lease runs.
        lease_until_ms: Option<u64>,
        /// The external holder's epoch.
        epoch: Option<u64>,
    },
    /// The message was produced before the retention horizon (the admission floor): its
    /// record may already have expired, so it cannot be told apart from a new message. Do not
    /// process it; dead-letter or alert.
    #[non_exhaustive]
    TooLate {
        /// When the message was produced, as given.
        produced_at_ms: u64,
        /// Messages produced at or before this instant are too late (now minus the retention).
        horizon_ms: u64,
    },
    /// The ordering guard: the entity already has this version or a newer one applied.
    /// Acknowledge the message without applying it.
    #[non_exhaustive]
    Stale {
        /// The entity's highest applied version.
        current_version: u64,
    },
    /// The key was completed with different content: the producer reused an id or the
    /// message changed. Route the message to a dead-letter path and alert; do not process it.
    #[non_exhaustive]
    Conflict {
        /// The fingerprint stored by the first commit.
        stored_fingerprint: Fingerprint,
        /// The fingerprint given to this `begin`.
        new_fingerprint: Fingerprint,
        /// When the first commit happened.
        first_committed_at_ms: u64,
    },
}

/// An earlier holder's attempt that a new claim took over after its lease expired. Its side
/// effect may have been partly applied: reconcile before repeating it (for example query the
/// downstream service with the same idempotency key).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PreviousAttempt {
    /// The earlier holder's epoch (the new claim's epoch is one more).
    pub epoch: u64,
    /// The earlier holder's identity.
    pub holder: Bytes,
    /// When it took the key.
    pub since_ms: u64,
    /// When its lease ran out.
    pub lease_until_ms: u64,
}

/// What a claimant's read of its key decided, under whatever makes it the key's only
/// claimant (the embedded engine's latch, another backend's lock): [`inspect_record`], then
/// [`admit`].
#[derive(Debug)]
pub enum Found {
    /// The key may be claimed: the new record's epoch is `replaces_epoch + 1`, and it must
    /// replace the record with `replaces_epoch` (0: none).
    Claimable {
        /// The epoch of the record the claim replaces; 0 when the key has none.
        replaces_epoch: u64,
        /// The external attempt whose lease ran out, which the claim takes over.
        previous: Option<PreviousAttempt>,
    },
    /// Anything but fresh: the outcome to return as it is (`map_fresh` gives it the backend's
    /// claim type).
    Settled(Outcome<std::convert::Infallible>),
}

impl<C> Outcome<C> {
    #[cfg(feature = "engine")]
    pub(crate) fn settled(outcome: Outcome<std::convert::Infallible>) -> Outcome<C> {
        outcome.map_fresh(|never| match never {})
    }

    /// The same outcome with the fresh claim (if any) turned into another value by `f`.
    pub fn map_fresh<D>(self, f: impl FnOnce(C) -> D) -> Outcome<D> {
        match self {
            Outcome::Fresh(claim) => Outcome::Fresh(f(claim)),
            Outcome::Duplicate {
                result,
                first_committed_at_ms,
                expires_at_ms,
                epoch,
                succeeded,
            } => Outcome::Duplicate {
                result,
                first_committed_at_ms,
                expires_at_ms,
                epoch,
                succeeded,
            },
            Outcome::InProgress {
                since_ms,
                holder,
                lease_until_ms,
                epoch,
            } => Outcome::InProgress {
                since_ms,
                holder,
                lease_until_ms,
                epoch,
            },
            Outcome::Conflict {
                stored_fingerprint,
                new_fingerprint,
                first_committed_at_ms,
            } => Outcome::Conflict {
                stored_fingerprint,
                new_fingerprint,
                first_committed_at_ms,
            },
            Outcome::TooLate {
                produced_at_ms,
                horizon_ms,
            } => Outcome::TooLate {
                produced_at_ms,
                horizon_ms,
            },
            Outcome::Stale { current_version } => Outcome::Stale { current_version },
        }
    }

    /// `InProgress` because a transactional claim holds the key (or the entity) right now: in
    /// the embedded engine a claim in this process; in a backend with transactions, one not yet
    /// committed. It has no holder identity, lease or epoch; `since_ms` is when it was seen
    /// held if the holder's start is unknown.
    pub fn held_by_claim(since_ms: u64) -> Outcome<C> {
        Outcome::InProgress {
            since_ms,
            holder: None,
            lease_until_ms: None,
            epoch: None,
        }
    }
}

/// Decides what a claimant gets from the record it read (`None`: the key is absent) at
/// `now_ms` on the backend's clock.
///
/// ```
/// use idemdb::decision::{Found, inspect_record};
/// use idemdb::{Fingerprint, Outcome, format::Record};
/// let body = Fingerprint::of(b"body");
/// let stored = Record::new(1, 1_000, 2_000, body, "ok".into());
/// assert!(matches!(inspect_record(None, body, 1_500), Found::Claimable { replaces_epoch: 0, .. }));
/// assert!(matches!(
///     inspect_record(Some(stored.clone()), body, 1_500),
///     Found::Settled(Outcome::Duplicate { .. })
/// ));
/// // Expired at its expiry millisecond: claimable again, replacing epoch 1.
/// assert!(matches!(inspect_record(Some(stored), body, 2_000), Found::Claimable { replaces_epoch: 1, .. }));
/// ```
#[must_use]
pub fn inspect_record(record: Option<Record>, fingerprint: Fingerprint, now_ms: u64) -> Found {
    let Some(record) = record else {
        return Found::Claimable {
            replaces_epoch: 0,
            previous: None,
        };
    };
    if record.is_absent_at(now_ms) {
        return Found::Claimable {
            replaces_epoch: record.epoch,
            previous: None,
        };
    }
    let epoch = record.epoch;
    match record.state {
        RecordState::InProgress {
            since_ms,
            lease_until_ms,
            holder,
            ..
        } => held_under_lease(epoch, since_ms, lease_until_ms, holder, now_ms),
        RecordState::Completed {
            committed_at_ms,
            expires_at_ms,
            result,
            succeeded,
        } if record.fingerprint == fingerprint => Found::Settled(Outcome::Duplicate {
            result,
            first_committed_at_ms: committed_at_ms,
            expires_at_ms,
            epoch,
            succeeded,
        }),
        RecordState::Completed {
            committed_at_ms, ..
        } => Found::Settled(Outcome::Conflict {
            stored_fingerprint: record.fingerprint,
            new_fingerprint: fingerprint,
            first_committed_at_ms: committed_at_ms,
        }),
        // Released records are absent (handled above).
        RecordState::Released { .. } => unreachable!("released records read as absent"),
    }
}

/// What a claimant of a key held by an external claim gets: the key is taken over once the
/// holder's lease ran out (the new claim is told of the earlier attempt), and in progress until
/// then.
fn held_under_lease(
    epoch: u64,
    since_ms: u64,
    lease_until_ms: u64,
    holder: Bytes,
    now_ms: u64,
) -> Found {
    if lease_until_ms <= now_ms {
        return Found::Claimable {
            replaces_epoch: epoch,
            previous: Some(PreviousAttempt {
                epoch,
                holder,
                since_ms,
                lease_until_ms,
            }),
        };
    }
    Found::Settled(Outcome::InProgress {
        since_ms,
        holder: Some(holder),
        lease_until_ms: Some(lease_until_ms),
        epoch: Some(epoch),
    })
}

/// The ordering guard: a message carrying `version` of an entity whose highest applied version
/// is `current_version` (`None`: none recorded) is applied only if it is newer; otherwise the
/// outcome is [`Outcome::Stale`]. `None` means go on (the claim then records `version`).
///
/// ```
/// use idemdb::Outcome;
/// use idemdb::decision::guard_order;
/// assert!(guard_order(None, 1).is_none());
/// assert!(guard_order(Some(4), 5).is_none());
/// assert!(matches!(guard_order(Some(5), 5), Some(Outcome::Stale { current_version: 5, .. })));
/// ```
#[must_use]
pub fn guard_order(
    current_version: Option<u64>,
    version: u64,
) -> Option<Outcome<std::convert::Infallible>> {
    match current_version {
        Some(current_version) if version <= current_version => {
            Some(Outcome::Stale { current_version })
        }
        _ => None,
    }
}

/// The admission floor: with it on (`floor_retention_ms` is then the retention), a claimable
/// message produced longer ago than the retention is too late (its record may have expired
/// already), not new.
#[must_use]
pub fn admit(
    found: Found,
    produced_at_ms: Option<u64>,
    now_ms: u64,
    floor_retention_ms: Option<u64>,
) -> Found {
    let Some(retention_ms) = floor_retention_ms else {
        return found;
    };
    let horizon_ms = now_ms.saturating_sub(retention_ms);
    match (found, produced_at_ms) {
        (Found::Claimable { .. }, Some(produced_at_ms)) if produced_at_ms <= horizon_ms => {
            Found::Settled(Outcome::TooLate {
                produced_at_ms,
                horizon_ms,
            })
        }
        (found, _) => found,
    }
}
