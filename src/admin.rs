//! Operator access to a store: what the `idemdb` CLI is built on, usable from any Rust tool.
//!
//! An operator tool does not know the application's table declarations. [`Store`] finds them
//! in the store itself: the column families RocksDB lists, and the kind idemdb recorded for
//! each table (`idemdb.table-kind/<name>` in the metadata, docs/design.md section 2). Marker
//! tables (the consumers' `idemdb.records` and the entity tables) are opened with idemdb's
//! merge operator, so reads see folded records. Business tables may have merge operators of
//! the application's own, which a tool does not have: they are opened with a stand-in that
//! lets the WAL be replayed, and are never read, flushed or compacted.
//!
//! Two ways to open:
//!
//! - [`StoreBuilder::open_read_only`]: RocksDB's read-only open. It takes no lock, so it works
//!   while the application has the store open (a *live* store); it sees what the store's files
//!   and WAL held when it opened, and never writes.
//! - [`StoreBuilder::open_exclusive`]: the store opened for writing, which RocksDB allows to one
//!   process at a time. On a live store it fails with [`Error::AlreadyOpen`]: a write to a live
//!   store cannot be made from outside the process that has it open. That process uses the
//!   library instead ([`crate::Consumer::resolve`], [`crate::Consumer::in_progress`]).
//!
//! Writes made here keep the record state machine's rules: [`Store::resolve`] is the same
//! fenced step as [`crate::Consumer::resolve`]; [`Store::invalidate`] and [`Store::import`]
//! replace a key's value with a deletion and an install operand in one batch, which only an
//! exclusive open makes safe (no claim can run between the read and the write).
//!
//! ```
//! use idemdb::admin::{EntryState, Filter, Store};
//! use idemdb::{Engine, Fingerprint, Outcome};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path()).open()?;
//! let billing = engine.consumer("billing")?;
//! if let Outcome::Fresh(claim) = billing.begin(b"order-1", Fingerprint::of(b"body"))? {
//!     claim.commit(b"charged")?;
//! }
//! // The application still has the store open: a read-only open works beside it.
//! let store = Store::builder(dir.path()).open_read_only()?;
//! let page = store.list(&Filter::new().state(EntryState::Live), None, 10)?;
//! assert_eq!(page.entries.len(), 1);
//! assert_eq!(&page.entries[0].key[..], b"order-1");
//! // A write needs the store to itself.
//! assert!(matches!(
//!     Store::builder(dir.path()).open_exclusive(),
//!     Err(idemdb::Error::AlreadyOpen { .. })
//! ));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rocksdb::{
    Cache, ColumnFamily, ColumnFamilyDescriptor, DB, Direction, IteratorMode, WriteBatch,
};

use crate::claim::Expiry;
use crate::clock::{Clock, SystemClock};
use crate::engine::Engine;
use crate::error::{Error, Limit, Result, check_limit};
use crate::fingerprint::Fingerprint;
use crate::key::{check_message_key, consumer_prefix, decode_key, encode_with_prefix};
use crate::lease::Resolution;
use crate::options::{
    EngineBuilder, OpenMode, RETENTION_MS_DEFAULT, RETENTION_MS_MAX, RETENTION_MS_MIN, TableOptions,
};
use crate::record::{
    DecodeError, HOLDER_BYTES_MAX, Operand, RESULT_BYTES_MAX, Record, RecordState, is_expired,
};
use crate::storage::{db_options, marker_table_options, set_opaque_merge_operator, table_options};
use crate::store_lock::StoreLock;
use crate::store_meta::{DeclaredKind, FormatMarker, RECORDS_TABLE, StoredMeta, VERSIONS_TABLE};

/// The name of the table holding every consumer's records (the other marker tables are the
/// entity tables, named by the application).
pub const CONSUMERS_TABLE: &str = RECORDS_TABLE;

/// The block cache of a store opened by a tool, in bytes: tools scan once, so a small cache
/// does as well as a large one.
const TOOL_BLOCK_CACHE_BYTES: usize = 8 << 20;
/// How often a read-only open is tried. A live application's compaction may delete a table
/// file between RocksDB's reading of the file list and its opening of the file; the next
/// attempt reads the new list.
const READ_ONLY_OPEN_ATTEMPTS: u32 = 3;
/// How long a write waits for a key's latch, as a lease step does (only another thread of this
/// process using the same [`Store`] can hold it).
const LATCH_WAIT: Duration = Duration::from_millis(100);
/// The most problems a [`VerifyReport`] lists; it counts all of them.
pub const VERIFY_PROBLEMS_MAX: usize = 10_000;
/// The most records [`Store::import`] writes in one write batch.
const IMPORT_BATCH_RECORDS: usize = 1024;
/// The most bytes (keys and records) [`Store::import`] writes in one write batch.
const IMPORT_BATCH_BYTES: usize = 64 << 20;

/// What a table (a RocksDB column family) of the store holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum TableKind {
    /// `idemdb.records`: every consumer's dedup records, keyed by (consumer id, message key).
    Consumers,
    /// An entity table: records keyed by entity key (the record is the entity).
    Entity,
    /// A business table: the application's own data. Tools never read or compact it.
    Business,
    /// idemdb's own bookkeeping: `default` (metadata) and `idemdb.versions` (ordering guard).
    Internal,
    /// A column family without a recorded kind: not created by idemdb. Left alone; a store
    /// holding one is not opened for writing.
    Unknown,
}

impl TableKind {
    /// True for the tables whose values are idemdb records.
    #[must_use]
    pub fn is_marker(self) -> bool {
        matches!(self, TableKind::Consumers | TableKind::Entity)
    }

    /// A lowercase name for display.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            TableKind::Consumers => "consumers",
            TableKind::Entity => "entity",
            TableKind::Business => "business",
            TableKind::Internal => "internal",
            TableKind::Unknown => "unknown",
        }
    }
}

/// A table found in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableInfo {
    /// The column family's name.
    pub name: String,
    /// What it holds.
    pub kind: TableKind,
}

/// What a stored record means at a given instant (its [`RecordState`] plus the clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum EntryState {
    /// Completed (or a recorded failure) and not expired: redeliveries are duplicates.
    Live,
    /// Completed but expired: reads treat it as absent; compaction removes it later.
    Expired,
    /// Held by an external claim (live lease or not).
    InProgress,
    /// Released: reads treat it as absent; kept so the key's epoch keeps increasing.
    Released,
    /// The value (or, in the consumers' table, the key) does not decode.
    Corrupt,
}

impl EntryState {
    /// Every state, in display order.
    pub const ALL: [EntryState; 5] = [
        EntryState::Live,
        EntryState::Expired,
        EntryState::InProgress,
        EntryState::Released,
        EntryState::Corrupt,
    ];

    /// A lowercase name for display: `live`, `expired`, `in-progress`, `released`, `corrupt`.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            EntryState::Live => "live",
            EntryState::Expired => "expired",
            EntryState::InProgress => "in-progress",
            EntryState::Released => "released",
            EntryState::Corrupt => "corrupt",
        }
    }
}

impl fmt::Display for EntryState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One stored record, as a tool sees it: where it is, and what it decodes to.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Entry {
    /// The marker table holding it.
    pub table: String,
    /// The consumer id, for a record of the consumers' table whose key decodes.
    pub consumer: Option<Bytes>,
    /// The message key (consumers' table) or entity key; the whole stored key if it does not
    /// decode.
    pub key: Bytes,
    /// The key as stored.
    pub stored_key: Bytes,
    /// The record, or why the value (or the consumers' table key) does not decode.
    pub record: std::result::Result<Record, DecodeError>,
}

impl Entry {
    fn decode(table: &str, kind: TableKind, stored_key: &[u8], value: &[u8]) -> Entry {
        let split = match kind {
            TableKind::Consumers => {
                decode_key(stored_key).map(|(consumer, key)| (Some(consumer), key))
            }
            _ => Ok((None, stored_key)),
        };
        let (consumer, key, record) = match split {
            Ok((consumer, key)) => (consumer, key, Record::decode(value)),
            Err(reason) => (None, stored_key, Err(reason)),
        };
        Entry {
            table: table.to_owned(),
            consumer: consumer.map(Bytes::copy_from_slice),
            key: Bytes::copy_from_slice(key),
            stored_key: Bytes::copy_from_slice(stored_key),
            record,
        }
    }

    /// What the record means at `now_ms`.
    #[must_use]
    pub fn state_at(&self, now_ms: u64) -> EntryState {
        self.record.as_ref().map_or(EntryState::Corrupt, |record| {
            record_state_at(record, now_ms)
        })
    }

    /// When the record entered its state: committed (completed), taken (in progress) or
    /// released; `None` when it does not decode.
    #[must_use]
    pub fn since_ms(&self) -> Option<u64> {
        self.record.as_ref().ok().map(|record| match &record.state {
            RecordState::Completed {
                committed_at_ms, ..
            } => *committed_at_ms,
            RecordState::InProgress { since_ms, .. } => *since_ms,
            RecordState::Released { released_at_ms, .. } => *released_at_ms,
        })
    }

    /// The position just after this entry, for [`Store::list`]'s next page.
    #[must_use]
    pub fn cursor(&self) -> Cursor {
        Cursor {
            table: self.table.clone(),
            stored_key: self.stored_key.to_vec(),
        }
    }
}

/// What a decoded record means at `now_ms`.
fn record_state_at(record: &Record, now_ms: u64) -> EntryState {
    match &record.state {
        RecordState::Completed { expires_at_ms, .. } if is_expired(*expires_at_ms, now_ms) => {
            EntryState::Expired
        }
        RecordState::Completed { .. } => EntryState::Live,
        RecordState::InProgress { .. } => EntryState::InProgress,
        RecordState::Released { .. } => EntryState::Released,
    }
}

/// Which record a key names: a consumer's message key, or an entity table's key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A message key of this consumer (in `idemdb.records`).
    Consumer(Vec<u8>),
    /// A key of this entity table.
    Entity(String),
}

/// Which entries [`Store::list`] and [`Store::scan`] return. Every condition given must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Filter {
    table: Option<String>,
    consumer: Option<Vec<u8>>,
    state: Option<EntryState>,
    older_than: Option<Duration>,
}

impl Filter {
    /// Every entry of every marker table.
    pub fn new() -> Filter {
        Filter::default()
    }

    /// Only this marker table.
    pub fn table(mut self, name: impl Into<String>) -> Filter {
        self.table = Some(name.into());
        self
    }

    /// Only this consumer's records (in the consumers' table).
    pub fn consumer(mut self, consumer_id: impl Into<Vec<u8>>) -> Filter {
        self.consumer = Some(consumer_id.into());
        self
    }

    /// Only entries in this state.
    pub fn state(mut self, state: EntryState) -> Filter {
        self.state = Some(state);
        self
    }

    /// Only records that entered their state at least `age` ago ([`Entry::since_ms`]); corrupt
    /// entries have no age and are left out.
    pub fn older_than(mut self, age: Duration) -> Filter {
        self.older_than = Some(age);
        self
    }

    fn matches(&self, entry: &Entry, now_ms: u64) -> bool {
        if self
            .state
            .is_some_and(|state| entry.state_at(now_ms) != state)
        {
            return false;
        }
        match self.older_than {
            None => true,
            Some(age) => {
                let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
                entry
                    .since_ms()
                    .is_some_and(|since_ms| now_ms.saturating_sub(since_ms) >= age_ms)
            }
        }
    }
}

/// A position in a listing: the entry after which the next page starts. Its text form,
/// `<table>:<stored key in hex>`, is what the CLI prints and takes back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cursor {
    table: String,
    stored_key: Vec<u8>,
}

impl Cursor {
    /// Parses the text form made by `Display`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for anything else.
    pub fn parse(text: &str) -> Result<Cursor> {
        let bad = || Error::invalid_option(format!("{text:?} is not a cursor (<table>:<hex>)"));
        let (table, digits) = text.rsplit_once(':').ok_or_else(bad)?;
        if table.is_empty() {
            return Err(bad());
        }
        Ok(Cursor {
            table: table.to_owned(),
            stored_key: hex::decode(digits).map_err(|_| bad())?,
        })
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.table, hex::encode(&self.stored_key))
    }
}

/// One page of [`Store::list`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// The entries, in table order (the consumers' table first, then entity tables by name)
    /// and key order.
    pub entries: Vec<Entry>,
    /// Where the next page starts, if more entries match.
    pub next: Option<Cursor>,
}

/// Entries counted by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateCounts {
    /// Completed and not expired.
    pub live: u64,
    /// Expired, not yet removed by compaction (they already read as absent).
    pub expired: u64,
    /// In progress, whatever their lease.
    pub in_progress: u64,
    /// Released (they read as absent).
    pub released: u64,
    /// Undecodable.
    pub corrupt: u64,
}

impl StateCounts {
    /// All entries counted.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.live + self.expired + self.in_progress + self.released + self.corrupt
    }

    /// The count of one state.
    #[must_use]
    pub fn get(&self, state: EntryState) -> u64 {
        match state {
            EntryState::Live => self.live,
            EntryState::Expired => self.expired,
            EntryState::InProgress => self.in_progress,
            EntryState::Released => self.released,
            EntryState::Corrupt => self.corrupt,
        }
    }

    fn count(&mut self, state: EntryState) {
        let counter = match state {
            EntryState::Live => &mut self.live,
            EntryState::Expired => &mut self.expired,
            EntryState::InProgress => &mut self.in_progress,
            EntryState::Released => &mut self.released,
            EntryState::Corrupt => &mut self.corrupt,
        };
        *counter += 1;
    }

    fn add(&mut self, other: &StateCounts) {
        self.live += other.live;
        self.expired += other.expired;
        self.in_progress += other.in_progress;
        self.released += other.released;
        self.corrupt += other.corrupt;
    }
}

/// The records of one consumer (or of one entity table) by state.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupStats {
    /// The marker table.
    pub table: String,
    /// The consumer, in the consumers' table; `None` for an entity table, and for the
    /// consumers' table keys that do not decode (counted as corrupt).
    pub consumer: Option<Bytes>,
    /// Records by state.
    pub counts: StateCounts,
    /// The earliest [`Entry::since_ms`] of the group's decodable records.
    pub oldest_ms: Option<u64>,
}

/// What [`Store::stats`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// The clock reading the states were decided at.
    pub now_ms: u64,
    /// The size of the files in the store's directory, in bytes.
    pub disk_bytes: u64,
    /// The number of those files.
    pub disk_files: u64,
    /// One group per consumer and per entity table holding records, in table and key order.
    pub groups: Vec<GroupStats>,
}

impl StoreStats {
    /// The counts of every group together.
    #[must_use]
    pub fn totals(&self) -> StateCounts {
        let mut totals = StateCounts::default();
        for group in &self.groups {
            totals.add(&group.counts);
        }
        totals
    }
}

/// An entry that failed verification.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// The table holding it.
    pub table: String,
    /// Its stored key.
    pub stored_key: Bytes,
    /// Why it does not decode.
    pub reason: DecodeError,
}

/// What [`Store::verify`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Entries read: every marker table's and the ordering guard's versions.
    pub checked: u64,
    /// Entries that do not decode.
    pub problems_total: u64,
    /// The first [`VERIFY_PROBLEMS_MAX`] of them.
    pub problems: Vec<Problem>,
}

/// The result of [`Store::invalidate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalidation {
    /// The completed record (at `epoch`) is now released: the next delivery of the key is
    /// claimed afresh, at `epoch + 1`.
    Invalidated {
        /// The epoch of the record that was invalidated.
        epoch: u64,
    },
    /// Nothing was written: the key holds no live completed record.
    NotCompleted {
        /// What it holds (`None`: nothing).
        state: Option<EntryState>,
        /// Its epoch (0 when it holds nothing).
        epoch: u64,
    },
}

/// A record to write with [`Store::import`], checked when built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportRecord {
    table: String,
    consumer: Option<Vec<u8>>,
    stored_key: Vec<u8>,
    record: Record,
}

impl ImportRecord {
    /// A record for `key` in `table`: a consumer's message key when `consumer` is given (the
    /// consumers' table), an entity key otherwise.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a consumer id, key, result or holder outside its limits;
    /// [`Error::InvalidOption`] for epoch 0 (epochs start at 1).
    pub fn new(
        table: impl Into<String>,
        consumer: Option<&[u8]>,
        key: &[u8],
        epoch: u64,
        fingerprint: Fingerprint,
        state: RecordState,
    ) -> Result<ImportRecord> {
        let stored_key = match consumer {
            Some(consumer) => encode_with_prefix(&consumer_prefix(consumer)?, key)?,
            None => {
                check_message_key(key)?;
                key.to_vec()
            }
        };
        if epoch == 0 {
            return Err(Error::invalid_option(
                "a record's epoch is 0; epochs start at 1",
            ));
        }
        // Record::encode asserts these bounds; bad input must be an error instead.
        match &state {
            RecordState::Completed { result, .. } => {
                check_limit(Limit::ResultBytes, result.len(), 0, RESULT_BYTES_MAX)?;
            }
            RecordState::InProgress { holder, .. } => {
                check_limit(Limit::HolderBytes, holder.len(), 0, HOLDER_BYTES_MAX)?;
            }
            RecordState::Released { .. } => {}
        }
        Ok(ImportRecord {
            table: table.into(),
            consumer: consumer.map(<[u8]>::to_vec),
            stored_key,
            record: Record {
                epoch,
                fingerprint,
                state,
            },
        })
    }
}

/// What [`Store::import`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportCounts {
    /// Records written to keys that held nothing.
    pub imported: u64,
    /// Records written over an existing value (only with `overwrite`).
    pub overwritten: u64,
    /// Records not written because the key held a value (without `overwrite`).
    pub skipped: u64,
}

/// What [`Store::purge_expired`] did: the marker tables' records before and after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Before the compaction.
    pub before: StateCounts,
    /// After it.
    pub after: StateCounts,
}

/// Opens a [`Store`]. Defaults: the system clock, the default retention.
#[derive(Clone, Debug)]
#[must_use]
pub struct StoreBuilder {
    path: PathBuf,
    clock: Arc<dyn Clock>,
    retention_ms: u64,
}

impl StoreBuilder {
    /// The clock that decides which records are expired, and stamps the records written.
    /// Default [`SystemClock`].
    pub fn clock(mut self, clock: impl Clock) -> StoreBuilder {
        self.clock = Arc::new(clock);
        self
    }

    /// The application's retention, used by writes: a record completed by [`Store::resolve`]
    /// expires this long after, and a released one is kept this long (as the application's
    /// engine would). Default 7 days ([`crate::RETENTION_MS_DEFAULT`]); bounds
    /// [`crate::RETENTION_MS_MIN`]..=[`crate::RETENTION_MS_MAX`], checked by
    /// [`StoreBuilder::open_exclusive`].
    pub fn retention(mut self, retention: Duration) -> StoreBuilder {
        self.retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// Opens the store read-only: no lock is taken and nothing is written, so this works on a
    /// live store. Writes on the result fail with [`Error::InvalidOption`].
    ///
    /// # Errors
    /// [`Error::IncompatibleStore`] when the directory holds no idemdb store;
    /// [`Error::Storage`] when RocksDB cannot open it.
    pub fn open_read_only(self) -> Result<Store> {
        let tables = discover(&self.path)?;
        let mut builder = EngineBuilder::new(&self.path);
        builder.clock = self.clock.clone();
        let cache = Cache::new_lru_cache(TOOL_BLOCK_CACHE_BYTES);
        let mut options = db_options();
        options.create_if_missing(false);
        options.create_missing_column_families(false);
        let mut attempt = 1;
        let db = loop {
            let descriptors = tables.iter().map(|table| {
                let table_options = if table.kind.is_marker() {
                    marker_table_options(&builder, &cache)
                } else {
                    let mut options = table_options(&builder, &cache);
                    set_opaque_merge_operator(&mut options, None);
                    options
                };
                ColumnFamilyDescriptor::new(table.name.as_str(), table_options)
            });
            match DB::open_cf_descriptors_read_only(&options, &self.path, descriptors, false) {
                Ok(db) => break db,
                Err(error)
                    if attempt < READ_ONLY_OPEN_ATTEMPTS
                        && matches!(
                            error.kind(),
                            rocksdb::ErrorKind::IOError | rocksdb::ErrorKind::NotFound
                        ) =>
                {
                    attempt += 1;
                }
                Err(error) => return Err(error.into()),
            }
        };
        Ok(Store {
            path: self.path,
            clock: self.clock,
            tables,
            access: Access::ReadOnly(db),
        })
    }

    /// Opens the store for writing, which needs it to itself: the application must be stopped.
    /// Business tables are opened with a stand-in for their merge operators (which a tool does
    /// not have) and are never compacted or flushed; their unflushed data stays in the WAL
    /// until the application's next open. Writes are fsynced before they return.
    ///
    /// Limit: the WAL is replayed into memtables of [`crate::WRITE_BUFFER_BYTES_MAX`]; if a
    /// business table with merge operands has more unflushed data than that, RocksDB would
    /// flush it and fail the open (nothing is changed). Open the store with the application
    /// first.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] when another process (the application) has the store open;
    /// [`Error::IncompatibleStore`] when the directory holds no idemdb store, or holds a table
    /// idemdb did not create; [`Error::LimitExceeded`] for a retention outside its bounds;
    /// [`Error::Storage`] when RocksDB cannot open it.
    pub fn open_exclusive(self) -> Result<Store> {
        if !(RETENTION_MS_MIN..=RETENTION_MS_MAX).contains(&self.retention_ms) {
            return Err(Error::LimitExceeded {
                limit: Limit::RetentionMs,
                actual: self.retention_ms,
                min: RETENTION_MS_MIN,
                max: RETENTION_MS_MAX,
            });
        }
        check_store_exists(&self.path)?;
        // The lock before anything is read: a store held by the application is `AlreadyOpen`,
        // whatever else its tables would say.
        let lock = StoreLock::acquire(&self.path)?;
        let tables = discover(&self.path)?;
        if let Some(unknown) = tables.iter().find(|table| table.kind == TableKind::Unknown) {
            return Err(Error::IncompatibleStore {
                path: self.path.clone(),
                reason: format!(
                    "table {:?} has no recorded kind (idemdb did not create it); \
                     it is not opened for writing",
                    unknown.name
                ),
            });
        }
        let mut builder = EngineBuilder::new(&self.path);
        builder.clock = self.clock.clone();
        builder.retention_ms = self.retention_ms;
        builder.durability = crate::Durability::Sync;
        builder.open_mode = OpenMode::Admin;
        for table in &tables {
            match table.kind {
                TableKind::Business => builder
                    .business_tables
                    .push(TableOptions::new(table.name.clone())),
                TableKind::Entity => builder.entity_tables.push(table.name.clone()),
                _ => {}
            }
        }
        let engine = Engine::open_locked(&builder, lock)?;
        Ok(Store {
            path: self.path,
            clock: self.clock,
            tables,
            access: Access::Exclusive(engine),
        })
    }
}

/// Refuses a directory without a RocksDB store, which RocksDB would report as an I/O error about
/// a file.
fn check_store_exists(path: &Path) -> Result<()> {
    if path.join("CURRENT").is_file() {
        Ok(())
    } else {
        Err(no_store(path))
    }
}

fn no_store(path: &Path) -> Error {
    Error::IncompatibleStore {
        path: path.to_path_buf(),
        reason: "no RocksDB store here (no CURRENT file)".to_owned(),
    }
}

/// Finds the tables of the store at `path` and their kinds, and checks that it is an idemdb
/// store. Reads the metadata through a read-only open of the `default` column family alone,
/// which works beside a live writer.
fn discover(path: &Path) -> Result<Vec<TableInfo>> {
    let incompatible = |reason: String| Error::IncompatibleStore {
        path: path.to_path_buf(),
        reason,
    };
    check_store_exists(path)?;
    let meta = StoredMeta::read(path)?.ok_or_else(|| no_store(path))?;
    meta.check_format(path)?;
    if meta.format != FormatMarker::Current {
        // An application's first open that crashed before writing the marker: the tools do
        // not finish it for the application.
        return Err(incompatible(
            "not an idemdb store (no format marker)".to_owned(),
        ));
    }
    let mut tables = Vec::with_capacity(meta.tables.len());
    for name in &meta.tables {
        let kind = if name == rocksdb::DEFAULT_COLUMN_FAMILY_NAME || name == VERSIONS_TABLE {
            TableKind::Internal
        } else if name == RECORDS_TABLE {
            TableKind::Consumers
        } else {
            match meta.kind(name) {
                Some(Some(DeclaredKind::Business)) => TableKind::Business,
                Some(Some(DeclaredKind::Entity)) => TableKind::Entity,
                _ => TableKind::Unknown,
            }
        };
        tables.push(TableInfo {
            name: name.clone(),
            kind,
        });
    }
    // Listing order: the consumers' table, then entity tables by name; the rest after.
    tables.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
    Ok(tables)
}

/// A store opened by an operator tool (see the module documentation).
pub struct Store {
    path: PathBuf,
    clock: Arc<dyn Clock>,
    tables: Vec<TableInfo>,
    access: Access,
}

enum Access {
    ReadOnly(DB),
    /// An engine opened with [`OpenMode::Admin`]: writes go through its one write path.
    Exclusive(Engine),
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .field("exclusive", &self.is_exclusive())
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Starts opening the store at `path`.
    pub fn builder(path: impl AsRef<Path>) -> StoreBuilder {
        StoreBuilder {
            path: path.as_ref().to_path_buf(),
            clock: Arc::new(SystemClock),
            retention_ms: RETENTION_MS_DEFAULT,
        }
    }

    /// The store's directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the store was opened for writing.
    #[must_use]
    pub fn is_exclusive(&self) -> bool {
        matches!(self.access, Access::Exclusive(_))
    }

    /// Every table of the store: the consumers' table, entity tables, business tables, then
    /// idemdb's own.
    #[must_use]
    pub fn tables(&self) -> &[TableInfo] {
        &self.tables
    }

    /// The clock's reading, which decides what is expired.
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    fn db(&self) -> &DB {
        match &self.access {
            Access::ReadOnly(db) => db,
            Access::Exclusive(engine) => &engine.storage().db,
        }
    }

    fn engine(&self) -> Result<&Engine> {
        match &self.access {
            Access::Exclusive(engine) => Ok(engine),
            Access::ReadOnly(_) => Err(Error::invalid_option(
                "the store was opened read-only; writes need StoreBuilder::open_exclusive",
            )),
        }
    }

    fn cf(&self, name: &str) -> Result<&ColumnFamily> {
        // Every table discovered was opened; a missing handle means the name is not a table.
        self.db()
            .cf_handle(name)
            .ok_or_else(|| Error::UnknownTable {
                name: name.to_owned(),
                expected: "marker",
            })
    }

    fn kind(&self, name: &str) -> Option<TableKind> {
        self.tables
            .iter()
            .find(|table| table.name == name)
            .map(|table| table.kind)
    }

    fn marker_tables(&self) -> impl Iterator<Item = &TableInfo> {
        self.tables.iter().filter(|table| table.kind.is_marker())
    }

    /// The table and stored key of `key` under `target`.
    fn locate(&self, target: &Target, key: &[u8]) -> Result<(String, Vec<u8>)> {
        match target {
            Target::Consumer(consumer) => Ok((
                RECORDS_TABLE.to_owned(),
                encode_with_prefix(&consumer_prefix(consumer)?, key)?,
            )),
            Target::Entity(table) => {
                if self.kind(table) != Some(TableKind::Entity) {
                    return Err(Error::UnknownTable {
                        name: table.clone(),
                        expected: "entity",
                    });
                }
                check_message_key(key)?;
                Ok((table.clone(), key.to_vec()))
            }
        }
    }

    /// The record stored under `key`, in whatever state (expired, released and corrupt
    /// included), or `None` if the key holds nothing.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a consumer id or key outside its limits,
    /// [`Error::UnknownTable`] for a table that is not an entity table here, [`Error::Storage`]
    /// if the read fails.
    pub fn get(&self, target: &Target, key: &[u8]) -> Result<Option<Entry>> {
        let (table, stored_key) = self.locate(target, key)?;
        let kind = self.kind(&table).unwrap_or(TableKind::Unknown);
        let Some(value) = self.db().get_pinned_cf(self.cf(&table)?, &stored_key)? else {
            return Ok(None);
        };
        Ok(Some(Entry::decode(&table, kind, &stored_key, &value)))
    }

    /// Calls `visit` with every entry `filter` selects, in table and key order, starting after
    /// `after`, until it returns `Break`.
    ///
    /// # Errors
    /// [`Error::UnknownTable`] for a filter table that is not a marker table,
    /// [`Error::InvalidOption`] for a consumer filter with an entity table or a cursor outside
    /// the filter's tables, [`Error::LimitExceeded`] for a consumer id outside its limits,
    /// [`Error::Storage`] if the scan fails.
    pub fn scan(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        mut visit: impl FnMut(Entry) -> ControlFlow<()>,
    ) -> Result<()> {
        let now_ms = self.now_ms();
        let tables = self.scan_tables(filter)?;
        let prefix = filter
            .consumer
            .as_deref()
            .map(consumer_prefix)
            .transpose()?;
        let start = match after {
            None => None,
            Some(cursor) => {
                let index = tables
                    .iter()
                    .position(|table| table.name == cursor.table)
                    .ok_or_else(|| {
                        Error::invalid_option(format!(
                            "the cursor is in table {:?}, which this listing does not cover",
                            cursor.table
                        ))
                    })?;
                Some((index, cursor.stored_key.as_slice()))
            }
        };
        for (index, table) in tables.iter().enumerate() {
            let resume_key = match start {
                Some((start_index, _)) if index < start_index => continue,
                Some((start_index, key)) if index == start_index => Some(key),
                _ => None,
            };
            let mut lower: &[u8] = prefix.as_deref().unwrap_or_default();
            if let Some(key) = resume_key
                && key > lower
            {
                lower = key;
            }
            let mode = IteratorMode::From(lower, Direction::Forward);
            for item in self.db().iterator_cf(self.cf(&table.name)?, mode) {
                let (key, value) = item?;
                if prefix
                    .as_ref()
                    .is_some_and(|prefix| !key.starts_with(prefix))
                {
                    break;
                }
                if resume_key == Some(&key[..]) {
                    continue;
                }
                let entry = Entry::decode(&table.name, table.kind, &key, &value);
                if filter.matches(&entry, now_ms) && visit(entry).is_break() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The marker tables a filter covers, in listing order.
    fn scan_tables(&self, filter: &Filter) -> Result<Vec<&TableInfo>> {
        if let Some(name) = &filter.table
            && !self.kind(name).is_some_and(TableKind::is_marker)
        {
            return Err(Error::UnknownTable {
                name: name.clone(),
                expected: "marker",
            });
        }
        if filter.consumer.is_some()
            && filter
                .table
                .as_deref()
                .is_some_and(|name| name != RECORDS_TABLE)
        {
            return Err(Error::invalid_option(
                "a consumer's records are in the consumers' table, not in an entity table",
            ));
        }
        Ok(self
            .marker_tables()
            .filter(|table| filter.table.as_ref().is_none_or(|name| *name == table.name))
            .filter(|table| filter.consumer.is_none() || table.kind == TableKind::Consumers)
            .collect())
    }

    /// Up to `limit` entries `filter` selects, starting after `after`, and the cursor of the
    /// next page if more match.
    ///
    /// # Errors
    /// As for [`Store::scan`].
    pub fn list(&self, filter: &Filter, after: Option<&Cursor>, limit: usize) -> Result<Page> {
        let mut entries = Vec::new();
        let mut more = false;
        self.scan(filter, after, |entry| {
            if entries.len() == limit {
                more = true;
                return ControlFlow::Break(());
            }
            entries.push(entry);
            ControlFlow::Continue(())
        })?;
        let next = more.then(|| entries.last().map(Entry::cursor)).flatten();
        Ok(Page { entries, next })
    }

    /// Counts every marker table's records per consumer (per entity table) and state, and the
    /// files of the store's directory. Reads every record.
    ///
    /// # Errors
    /// [`Error::Storage`] if the scan fails; I/O errors reading the directory as
    /// [`Error::Storage`] too.
    pub fn stats(&self) -> Result<StoreStats> {
        let now_ms = self.now_ms();
        let order: Vec<&str> = self
            .marker_tables()
            .map(|table| table.name.as_str())
            .collect();
        let mut groups: BTreeMap<(usize, Option<Bytes>), (StateCounts, Option<u64>)> =
            BTreeMap::new();
        self.scan(&Filter::new(), None, |entry| {
            let table_index = order
                .iter()
                .position(|name| *name == entry.table)
                .unwrap_or(order.len());
            let group = groups
                .entry((table_index, entry.consumer.clone()))
                .or_default();
            group.0.count(entry.state_at(now_ms));
            if let Some(since_ms) = entry.since_ms() {
                group.1 = Some(group.1.map_or(since_ms, |oldest| oldest.min(since_ms)));
            }
            ControlFlow::Continue(())
        })?;
        let (disk_bytes, disk_files) = directory_size(&self.path)?;
        Ok(StoreStats {
            now_ms,
            disk_bytes,
            disk_files,
            groups: groups
                .into_iter()
                .map(
                    |((table_index, consumer), (counts, oldest_ms))| GroupStats {
                        table: order
                            .get(table_index)
                            .copied()
                            .unwrap_or_default()
                            .to_owned(),
                        consumer,
                        counts,
                        oldest_ms,
                    },
                )
                .collect(),
        })
    }

    /// The marker tables' records by state.
    fn marker_counts(&self) -> Result<StateCounts> {
        let now_ms = self.now_ms();
        let mut counts = StateCounts::default();
        self.scan(&Filter::new(), None, |entry| {
            counts.count(entry.state_at(now_ms));
            ControlFlow::Continue(())
        })?;
        Ok(counts)
    }

    /// Reads every record of every marker table and every version of the ordering guard, and
    /// reports those that do not decode. RocksDB checks block checksums as it reads; damage it
    /// detects fails the scan with [`Error::Storage`] (`Corruption`).
    ///
    /// # Errors
    /// [`Error::Storage`] if the scan fails.
    pub fn verify(&self) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let problem = |report: &mut VerifyReport, table: &str, key: &[u8], reason: DecodeError| {
            report.problems_total += 1;
            if report.problems.len() < VERIFY_PROBLEMS_MAX {
                report.problems.push(Problem {
                    table: table.to_owned(),
                    stored_key: Bytes::copy_from_slice(key),
                    reason,
                });
            }
        };
        self.scan(&Filter::new(), None, |entry| {
            report.checked += 1;
            if let Err(reason) = &entry.record {
                problem(&mut report, &entry.table, &entry.stored_key, reason.clone());
            }
            ControlFlow::Continue(())
        })?;
        let versions = self.cf(VERSIONS_TABLE)?;
        for item in self.db().iterator_cf(versions, IteratorMode::Start) {
            let (key, value) = item?;
            report.checked += 1;
            if let Err(reason) = decode_key(&key) {
                problem(&mut report, VERSIONS_TABLE, &key, reason);
            } else if value.len() != 8 {
                let reason = DecodeError::Invalid {
                    reason: "an entity version is not 8 bytes",
                };
                problem(&mut report, VERSIONS_TABLE, &key, reason);
            }
        }
        Ok(report)
    }

    /// Resolves a consumer's in-progress key, whoever holds it: completes it with a result
    /// (expiring after the builder's retention) or releases it. The same fenced step as
    /// [`crate::Consumer::resolve`]; a holder that comes back gets [`Error::LeaseLost`].
    ///
    /// # Errors
    /// [`Error::NotInProgress`] if the key is not in progress (nothing is written);
    /// [`Error::InvalidOption`] on a read-only store; [`Error::LimitExceeded`] for a bad
    /// consumer id, key or result; [`Error::Corrupt`] if the record does not decode;
    /// [`Error::Storage`] if the write fails.
    pub fn resolve(&self, consumer: &[u8], key: &[u8], resolution: Resolution) -> Result<()> {
        let engine = self.engine()?;
        let stored_key = encode_with_prefix(&consumer_prefix(consumer)?, key)?;
        let retention = Duration::from_millis(engine.storage().retention_ms);
        crate::lease::resolve(
            engine.storage(),
            0,
            &stored_key,
            resolution,
            Expiry::After(retention),
        )
    }

    /// Makes a live completed record re-processable: it becomes a released record with the
    /// same epoch, so the next delivery of the key is claimed afresh (`Fresh`) at the next
    /// epoch, like after a release. The released record is kept until the completed one would
    /// have expired, so the epoch keeps increasing for as long as the record would have been
    /// remembered.
    ///
    /// No merge operand turns a completed record into a released one (a record is never
    /// changed by a write that did not expect it), so this writes a deletion of the key and an
    /// install of the released record in one batch. Only the exclusive open makes that safe.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] on a read-only store; as for [`Store::get`];
    /// [`Error::Corrupt`] if the record does not decode; [`Error::Storage`] if the write fails.
    pub fn invalidate(&self, target: &Target, key: &[u8]) -> Result<Invalidation> {
        let engine = self.engine()?;
        let inner = engine.storage();
        let (table, stored_key) = self.locate(target, key)?;
        let marker = marker_index(engine, &table)?;
        let now_ms = inner.write_clock_ms()?;
        let _latch = inner.markers[marker]
            .latches
            .acquire_waiting(&stored_key, now_ms, LATCH_WAIT)
            .ok_or(Error::KeyBusy)?;
        let Some(record) = inner.read_record_raw(marker, &stored_key)? else {
            return Ok(Invalidation::NotCompleted {
                state: None,
                epoch: 0,
            });
        };
        let expires_at_ms = match record.state {
            RecordState::Completed { expires_at_ms, .. } if !is_expired(expires_at_ms, now_ms) => {
                expires_at_ms
            }
            _ => {
                return Ok(Invalidation::NotCompleted {
                    state: Some(record_state_at(&record, now_ms)),
                    epoch: record.epoch,
                });
            }
        };
        let released = Record {
            epoch: record.epoch,
            fingerprint: record.fingerprint,
            state: RecordState::Released {
                released_at_ms: now_ms,
                removable_at_ms: expires_at_ms,
            },
        };
        let cf = inner.cf(&table);
        let mut batch = WriteBatch::default();
        batch.delete_cf(cf, &stored_key);
        // Over the deletion the install applies whatever epoch it expects (merge rule 1).
        batch.merge_cf(
            cf,
            &stored_key,
            Operand::encode_install(record.epoch - 1, &released),
        );
        inner.write(batch)?;
        Ok(Invalidation::Invalidated {
            epoch: record.epoch,
        })
    }

    /// Compacts every marker table fully, so the compaction filter removes the expired records
    /// (and released records past their removal time), and counts the records before and
    /// after. `progress` is called before each table with its name, index and the number of
    /// tables. Business tables are not compacted.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] on a read-only store; [`Error::Storage`] if a scan, flush or
    /// compaction fails.
    pub fn purge_expired(
        &self,
        mut progress: impl FnMut(&str, usize, usize),
    ) -> Result<PurgeReport> {
        let engine = self.engine()?;
        let before = self.marker_counts()?;
        let markers = &engine.storage().markers;
        for (index, marker) in markers.iter().enumerate() {
            progress(&marker.name, index, markers.len());
            engine.storage().compact_marker(index)?;
        }
        let after = self.marker_counts()?;
        Ok(PurgeReport { before, after })
    }

    /// Writes `records` (an export, typically) into the store: a key that holds nothing gets
    /// its record; a key that holds a value (any state, corrupt included) keeps it unless
    /// `overwrite`, which replaces it. Records are written exactly as given (epochs,
    /// timestamps, tokens), in batches of up to 1024; a failure leaves the batches before it
    /// written, so a rerun with the same input finishes the job.
    ///
    /// # Errors
    /// Checked before anything is written: [`Error::UnknownTable`] for a table that is not a
    /// marker table here, [`Error::InvalidOption`] for a consumer given for an entity table or
    /// missing for the consumers' table, or a key given twice. [`Error::InvalidOption`] on a
    /// read-only store; [`Error::Storage`] if a read or write fails.
    pub fn import(&self, records: &[ImportRecord], overwrite: bool) -> Result<ImportCounts> {
        let engine = self.engine()?;
        let inner = engine.storage();
        let mut seen = HashSet::with_capacity(records.len());
        for record in records {
            let kind = self.kind(&record.table).filter(|kind| kind.is_marker());
            match (kind, &record.consumer) {
                (None, _) => {
                    return Err(Error::UnknownTable {
                        name: record.table.clone(),
                        expected: "marker",
                    });
                }
                (Some(TableKind::Consumers), None) => {
                    return Err(Error::invalid_option(format!(
                        "a record for {RECORDS_TABLE:?} has no consumer"
                    )));
                }
                (Some(TableKind::Entity), Some(_)) => {
                    return Err(Error::invalid_option(format!(
                        "a record for entity table {:?} has a consumer",
                        record.table
                    )));
                }
                _ => {}
            }
            if !seen.insert((record.table.as_str(), record.stored_key.as_slice())) {
                return Err(Error::invalid_option(format!(
                    "key {} of table {:?} is given twice",
                    crate::format::printable(&record.stored_key),
                    record.table
                )));
            }
        }
        let mut counts = ImportCounts::default();
        let mut batch = WriteBatch::default();
        let mut batch_bytes = 0;
        for record in records {
            let cf = inner.cf(&record.table);
            let exists = inner.db.get_pinned_cf(cf, &record.stored_key)?.is_some();
            if exists && !overwrite {
                counts.skipped += 1;
                continue;
            }
            if exists {
                batch.delete_cf(cf, &record.stored_key);
                counts.overwritten += 1;
            } else {
                counts.imported += 1;
            }
            // Over nothing (or the deletion) an install applies whatever epoch it expects.
            let operand = Operand::encode_install(record.record.epoch - 1, &record.record);
            batch_bytes += record.stored_key.len() + operand.len();
            batch.merge_cf(cf, &record.stored_key, operand);
            if batch.len() >= IMPORT_BATCH_RECORDS || batch_bytes >= IMPORT_BATCH_BYTES {
                inner.write(std::mem::take(&mut batch))?;
                batch_bytes = 0;
            }
        }
        if !batch.is_empty() {
            inner.write(batch)?;
        }
        Ok(counts)
    }
}

/// The index of a marker table among the engine's.
fn marker_index(engine: &Engine, table: &str) -> Result<usize> {
    engine
        .storage()
        .markers
        .iter()
        .position(|marker| marker.name == table)
        .ok_or_else(|| Error::UnknownTable {
            name: table.to_owned(),
            expected: "marker",
        })
}

/// The total size and number of the regular files in `path` (RocksDB keeps a store's files in
/// one directory).
fn directory_size(path: &Path) -> Result<(u64, u64)> {
    let io = |error: std::io::Error| Error::io(&format!("reading {}", path.display()), &error);
    let mut bytes = 0;
    let mut files = 0;
    for entry in std::fs::read_dir(path).map_err(io)? {
        // On a live store, a compaction may delete a file between the listing and this look.
        let metadata = match entry.map_err(io)?.metadata() {
            Ok(metadata) => metadata,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(io(error)),
        };
        if metadata.is_file() {
            bytes += metadata.len();
            files += 1;
        }
    }
    Ok((bytes, files))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_text_round_trips_and_rejects_garbage() {
        let cursor = Cursor {
            table: "idemdb.records".to_owned(),
            stored_key: vec![3, b'a', 0, 0xff],
        };
        assert_eq!(cursor.to_string(), "idemdb.records:036100ff");
        assert_eq!(Cursor::parse(&cursor.to_string()).unwrap(), cursor);
        for bad in ["", "no-colon", ":00", "t:0", "t:zz", "t:0g", "t:+f"] {
            assert!(Cursor::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn import_records_are_checked_when_built() {
        let state = RecordState::Released {
            released_at_ms: 1,
            removable_at_ms: 2,
        };
        let fingerprint = Fingerprint::of(b"");
        assert!(ImportRecord::new("t", Some(b""), b"k", 1, fingerprint, state.clone()).is_err());
        assert!(ImportRecord::new("t", None, b"", 1, fingerprint, state.clone()).is_err());
        assert!(ImportRecord::new("t", None, b"k", 0, fingerprint, state.clone()).is_err());
        let holder = Bytes::from(vec![b'h'; HOLDER_BYTES_MAX + 1]);
        let in_progress = RecordState::InProgress {
            since_ms: 1,
            lease_until_ms: 2,
            holder,
            token: 3,
        };
        assert!(ImportRecord::new("t", None, b"k", 1, fingerprint, in_progress).is_err());
        let record = ImportRecord::new("t", Some(b"c"), b"k", 1, fingerprint, state).unwrap();
        assert_eq!(record.stored_key, b"\x01ck");
    }
}
