//! # idemdb
//!
//! An embedded, in-process record-keeper that makes message consumers idempotent. Brokers
//! deliver at least once; idemdb turns that into exactly-once *effects*.
//!
//! For each message the consumer calls [`Consumer::begin`] with the message's business key and a
//! [`Fingerprint`] of its content, and matches the [`Outcome`]:
//!
//! - [`Outcome::Fresh`]: the caller owns the key. It stages its business writes on the
//!   [`Claim`] and commits; the marker record and the staged writes land in **one RocksDB write
//!   batch**, so either both are durable or neither is.
//! - [`Outcome::Duplicate`]: processed before; the stored result is returned.
//! - [`Outcome::InProgress`]: another claim in this process holds the key right now.
//! - [`Outcome::Conflict`]: the key was completed with different content.
//! - [`Outcome::TooLate`], [`Outcome::Stale`]: the admission floor and the ordering guard, when
//!   the message carries a production time or an entity version ([`Message`]).
//!
//! Side effects that cannot join the batch use [`Consumer::begin_external`]: a durable
//! in-progress record under a lease with a fencing epoch ([`ExternalClaim`]).
//!
//! Records expire exactly at read time after a retention period; a RocksDB compaction filter
//! reclaims their space later.
//!
//! ```
//! use idemdb::{Engine, Fingerprint, Outcome, TableOptions, merge_ops};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path())
//!     .business_table(TableOptions::new("orders"))
//!     .business_table(TableOptions::new("totals").associative_merge_operator("add_u64", merge_ops::add_u64))
//!     .open()?;
//! let billing = engine.consumer("billing")?;
//! let orders = engine.business_table("orders")?;
//! let totals = engine.business_table("totals")?;
//!
//! for delivery in [&b"order-7:3 apples"[..], b"order-7:3 apples"] {
//!     match billing.begin(b"order-7", Fingerprint::of(delivery))? {
//!         Outcome::Fresh(mut claim) => {
//!             claim.put(&orders, b"order-7", delivery)?;
//!             claim.merge(&totals, b"apples", 3u64.to_be_bytes())?;
//!             claim.commit(b"accepted")?; // marker + both writes, one batch
//!         }
//!         Outcome::Duplicate { result, .. } => assert_eq!(result, "accepted"),
//!         Outcome::InProgress { .. } => { /* nack: the broker redelivers later */ }
//!         Outcome::Conflict { .. } => { /* dead-letter: same id, other content */ }
//!         Outcome::TooLate { .. } => { /* older than retention: dead-letter */ }
//!         Outcome::Stale { .. } => { /* an older version of the entity: ack, skip */ }
//!     }
//! }
//! let apples = totals.get(b"apples")?.and_then(|v| merge_ops::read_u64(&v));
//! assert_eq!(apples, Some(3));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Observability
//!
//! Every `begin`, commit and lease step emits a `tracing` debug event (target `idemdb`) with
//! the consumer, the key in printable form, the outcome, the epoch and the message's correlation
//! id. Metrics go through the `metrics` facade (labels: `consumer`, and `outcome` for the
//! first); [`Engine::stats`] returns the same counts without an exporter:
//!
//! | name | kind | what |
//! |---|---|---|
//! | `idemdb_outcomes_total` | counter | `begin` outcomes: fresh, duplicate, in_progress, conflict, too_late, stale, duplicate_in_batch |
//! | `idemdb_commits_total` | counter | commits and completes that were written |
//! | `idemdb_lease_lost_total` | counter | lease steps refused with `LeaseLost` |
//! | `idemdb_claim_seconds` | histogram | latency of `begin` (and of each batch message's share) |
//! | `idemdb_commit_seconds` | histogram | latency of a commit or complete |
//! | `idemdb_duplicate_age_seconds` | histogram | time since the first commit when a duplicate arrives |
//! | `idemdb_in_progress` | gauge | external claims alive in this process (begun, taken over or resumed; not yet finished or dropped) |
//!
//! Metric handles are registered when a consumer is first asked for, with the recorder
//! installed then: install the recorder before opening consumers. The in-progress gauge
//! counts [`ExternalClaim`]s alive in this process.
//!
//! See `ARCHITECTURE.md` for the write path and `docs/design.md` for the on-disk format.

#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "engine")]
mod batch;
#[cfg(feature = "engine")]
mod claim;
mod clock;
#[cfg(feature = "engine")]
mod engine;
mod error;
#[cfg(feature = "engine")]
mod fault;
mod fingerprint;
mod key;
#[cfg(feature = "engine")]
mod latch;
#[cfg(feature = "engine")]
mod lease;
mod merge;
pub mod merge_ops;
#[cfg(feature = "engine")]
mod message;
#[cfg(feature = "engine")]
mod observe;
#[cfg(feature = "engine")]
mod options;
mod record;
mod ttl;

#[cfg(feature = "engine")]
pub use batch::{BATCH_MESSAGES_MAX, BatchOutcome, ClaimBatch};
#[cfg(feature = "engine")]
pub use claim::{
    Claim, Committed, Expiry, Outcome, PreviousAttempt, STAGED_BYTES_MAX, STAGED_WRITES_MAX,
    TABLE_KEY_BYTES_MAX, TABLE_KEY_BYTES_MIN, TABLE_VALUE_BYTES_MAX,
};
pub use clock::{CLOCK_MS_MAX, Clock, MockClock, SystemClock};
#[cfg(feature = "engine")]
pub use engine::{BusinessTable, Consumer, Engine, EntityTable, RecordCounts};
pub use error::{Error, Limit, Result, StorageErrorKind};
#[cfg(feature = "engine")]
pub use fault::{Fault, FaultInjector, IoPoint};
pub use fingerprint::Fingerprint;
pub use key::{
    CONSUMER_ID_BYTES_MAX, CONSUMER_ID_BYTES_MIN, MESSAGE_KEY_BYTES_MAX, MESSAGE_KEY_BYTES_MIN,
    cloudevents_key,
};
#[cfg(feature = "engine")]
pub use lease::{
    ExternalClaim, FailurePolicy, InProgressEntry, LEASE_MS_MAX, LEASE_MS_MIN, LeaseTicket,
    Resolution,
};
#[cfg(feature = "engine")]
pub use message::Message;
#[cfg(feature = "engine")]
pub use observe::{ConsumerStats, Stats};
#[cfg(feature = "engine")]
pub use options::{
    BLOCK_CACHE_BYTES_DEFAULT, BLOCK_CACHE_BYTES_MAX, BLOCK_CACHE_BYTES_MIN, Durability,
    EngineBuilder, PERIODIC_COMPACTION_S_DEFAULT, PERIODIC_COMPACTION_S_MAX,
    PERIODIC_COMPACTION_S_MIN, RETENTION_MS_DEFAULT, RETENTION_MS_MAX, RETENTION_MS_MIN,
    TABLE_NAME_BYTES_MAX, TABLE_NAME_BYTES_MIN, TABLES_MAX, TableMergeFn, TableOptions,
    WRITE_BUFFER_BYTES_DEFAULT, WRITE_BUFFER_BYTES_MAX, WRITE_BUFFER_BYTES_MIN,
};
pub use record::{EXPIRES_NEVER_MS, HOLDER_BYTES_MAX, RESULT_BYTES_MAX, Record, RecordState};

/// The on-disk format, for tools, fuzzers and tests: key and record codecs and the compaction
/// filter's decision. Specified byte by byte in docs/design.md.
pub mod format {
    pub use crate::key::{decode_key, derive_key, encode_key, printable};
    pub use crate::merge::apply_operands;
    pub use crate::record::{
        DecodeError, Record, RecordState, encode_commit_operand, encode_replace_operand,
    };
    pub use crate::ttl::{FilterDecision, compaction_decision};
}
