//! The engine: opening the RocksDB store, the table handles, and the one write path.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rocksdb::{
    BlockBasedIndexType, BlockBasedOptions, BottommostLevelCompaction, Cache, ColumnFamily,
    ColumnFamilyDescriptor, CompactOptions, DB, DBCompressionType, DBRecoveryMode, IteratorMode,
    WriteBatch, WriteOptions,
};

use crate::claim::{Expiry, Outcome, Request, begin};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::fault::{Fault, FaultInjector, IoPoint};
use crate::fingerprint::Fingerprint;
use crate::key::{check_message_key, consumer_prefix, decode_key, encode_with_prefix};
use crate::latch::Latches;
use crate::lease::{ExternalClaim, InProgressEntry, LeaseTicket, Resolution};
use crate::merge::{MERGE_OPERATOR_NAME, rocksdb_full_merge, rocksdb_partial_merge};
use crate::message::Message;
use crate::observe::{ConsumerMetrics, Kind, Stats};
use crate::options::{Durability, EngineBuilder, TableOptions};
use crate::record::{Record, RecordState};
use crate::store_lock::StoreLock;
use crate::store_meta::{
    DeclaredKind, META_FORMAT_KEY, META_MERGE_OPERATOR_PREFIX, META_TABLE_KIND_PREFIX, MetaToWrite,
    OPAQUE_MERGE_OPERATOR_NAME, STORE_FORMAT_V1, StoredMeta, encode_merge_operator, new_store_meta,
    stored_merge_operators,
};
use crate::ttl::{COMPACTION_FILTER_NAME, FilterDecision, compaction_decision};
use bytes::Bytes;
use std::time::Instant;

pub(crate) use crate::store_meta::{RECORDS_TABLE, VERSIONS_TABLE};

/// The embedded dedup store. Cheap to clone (an `Arc`); every handle keeps the store open, and it
/// closes when the last clone and handle are dropped.
///
/// ```
/// use idemdb::{Engine, Fingerprint, Outcome};
/// let dir = tempfile::tempdir()?;
/// let engine = Engine::builder(dir.path()).open()?;
/// let billing = engine.consumer("billing")?;
/// match billing.begin(b"order-42", Fingerprint::of(b"payload"))? {
///     Outcome::Fresh(claim) => { claim.commit(b"charged")?; }
///     _ => unreachable!("a new store has seen nothing"),
/// }
/// assert!(matches!(
///     billing.begin(b"order-42", Fingerprint::of(b"payload"))?,
///     Outcome::Duplicate { .. }
/// ));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// The state shared by the engine and all its handles.
pub(crate) struct Inner {
    pub(crate) db: DB,
    pub(crate) path: PathBuf,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) retention_ms: u64,
    pub(crate) admission_floor: bool,
    write_options: WriteOptions,
    /// Whether every write fsyncs the WAL ([`Durability::Sync`]).
    #[cfg(feature = "tokio")]
    sync_writes: bool,
    /// The async commits' committer thread, started by the first one.
    #[cfg(feature = "tokio")]
    committer: crate::committer::CommitterSlot,
    /// Set by a write whose durability is unknown; every later write is refused.
    poisoned: AtomicBool,
    /// Test seam: decides injected faults for the engine's I/O calls.
    fault_injector: Option<Arc<dyn FaultInjector>>,
    /// Lease tokens: a per-open random seed hashed with a counter, so tokens never repeat.
    token_seed: u64,
    token_counter: AtomicU64,
    /// One latch set per marker table: index 0 is [`RECORDS_TABLE`], then the entity tables.
    pub(crate) markers: Vec<MarkerTable>,
    /// Latches of the ordering guard's entity versions.
    pub(crate) version_latches: Latches,
    /// Per-consumer numbers, in the order consumers were first opened.
    consumer_metrics: parking_lot::Mutex<Vec<Arc<ConsumerMetrics>>>,
    /// Write batches written (each one `DB::write`, one WAL record).
    write_batches: AtomicU64,
    business: Vec<TableOptions>,
    /// The directory lock, last so that it is released after RocksDB has closed the store.
    _store_lock: StoreLock,
}

/// A column family whose values are idemdb records (the consumers' table or an entity table).
pub(crate) struct MarkerTable {
    pub(crate) name: String,
    pub(crate) latches: Latches,
}

impl Engine {
    /// Starts building an engine over the store directory `path` (created if missing).
    pub fn builder(path: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder::new(path)
    }

    /// Opens the store (an application's open; the operator tools' open of an existing store,
    /// [`OpenMode::Admin`], goes through [`Engine::open_locked`]).
    ///
    /// The order is the contract: the directory lock first (so a held store is
    /// [`Error::AlreadyOpen`] whatever else is wrong), then every check that can refuse, on a
    /// read-only view ([`StoredMeta`]), and only then RocksDB's open for writing, which replays
    /// and may flush the WAL. A refused open changes nothing.
    pub(crate) fn open(builder: EngineBuilder) -> Result<Engine> {
        if builder.open_mode == OpenMode::Application {
            std::fs::create_dir_all(&builder.path)
                .map_err(|error| Error::io("creating the store directory", &error))?;
        }
        let lock = StoreLock::acquire(&builder.path)?;
        Engine::open_locked(builder, lock)
    }

    /// [`Engine::open`] under a directory lock the caller already holds (the operator tools take
    /// it before they read the store's tables). With [`OpenMode::Admin`] (`builder.open_mode`)
    /// this is the operator tools' open of an existing store (`crate::admin`), every table it
    /// holds declared.
    pub(crate) fn open_locked(builder: EngineBuilder, lock: StoreLock) -> Result<Engine> {
        let mode = builder.open_mode;
        let path = builder.path.clone();
        let declared = declared_kinds(&builder);
        let operators = builder.business_tables.iter().map(|table| {
            let operator = table.merge_operator.as_ref();
            (table.name.as_str(), operator.map(|op| op.name.as_str()))
        });
        let meta_to_write = match StoredMeta::read(&path)? {
            None => new_store_meta(
                &declared,
                operators
                    .map(|(table, op)| (table.to_owned(), op.map(str::to_owned)))
                    .collect(),
            ),
            Some(stored) => {
                let mut to_write = stored.check_declaration(&path, &declared)?;
                // The operator tools do not know the application's operators: they neither
                // check nor record them.
                if mode == OpenMode::Application {
                    to_write.operators = stored.check_merge_operators(&path, operators)?;
                }
                to_write
            }
        };

        let stored_operators = match mode {
            OpenMode::Admin => stored_merge_operators(&path),
            OpenMode::Application => None,
        };
        let cache = Cache::new_lru_cache(builder.block_cache_bytes);
        let mut descriptors = vec![
            ColumnFamilyDescriptor::new(
                rocksdb::DEFAULT_COLUMN_FAMILY_NAME,
                table_options(&builder, &cache),
            ),
            ColumnFamilyDescriptor::new(RECORDS_TABLE, marker_table_options(&builder, &cache)),
            ColumnFamilyDescriptor::new(VERSIONS_TABLE, table_options(&builder, &cache)),
        ];
        for table in &builder.business_tables {
            let mut options = table_options(&builder, &cache);
            if let Some(operator) = &table.merge_operator {
                let full = operator.merge.clone();
                let partial = operator.associative.then(|| operator.merge.clone());
                options.set_merge_operator(
                    operator.name.as_str(),
                    move |key: &[u8],
                          existing: Option<&[u8]>,
                          operands: &rocksdb::MergeOperands| {
                        let operands: Vec<&[u8]> = operands.iter().collect();
                        full(key, existing, &operands)
                    },
                    // Declining a partial merge is always correct: RocksDB keeps the operands.
                    move |key: &[u8], _: Option<&[u8]>, operands: &rocksdb::MergeOperands| {
                        let partial = partial.as_ref()?;
                        let operands: Vec<&[u8]> = operands.iter().collect();
                        partial(key, None, &operands)
                    },
                );
            }
            if mode == OpenMode::Admin {
                // An operator tool has no business table's merge operator: a compaction that
                // reached a merge operand would fail, and RocksDB would then refuse every write.
                options.set_disable_auto_compactions(true);
                // The stand-in takes the application's operator name, so the OPTIONS file this
                // open writes still names it and the application's next open is still checked.
                let stored = stored_operators
                    .as_ref()
                    .map(|stored| stored.get(table.name.as_str()).map(String::as_str));
                set_opaque_merge_operator(&mut options, stored);
            }
            descriptors.push(ColumnFamilyDescriptor::new(table.name.as_str(), options));
        }
        for name in &builder.entity_tables {
            descriptors.push(ColumnFamilyDescriptor::new(
                name.as_str(),
                marker_table_options(&builder, &cache),
            ));
        }

        let db_options = match mode {
            OpenMode::Application => db_options(),
            OpenMode::Admin => admin_db_options()?,
        };
        let db = DB::open_cf_descriptors(&db_options, &path, descriptors).map_err(|error| {
            // RocksDB reports a held LOCK file as an I/O error naming the file.
            if is_lock_held(&error) {
                Error::AlreadyOpen { path: path.clone() }
            } else {
                Error::from(error)
            }
        })?;

        let mut write_options = WriteOptions::default();
        write_options.set_sync(builder.durability == Durability::Sync);
        write_options.disable_wal(false);

        let markers = std::iter::once(RECORDS_TABLE.to_owned())
            .chain(builder.entity_tables.iter().cloned())
            .map(|name| MarkerTable {
                name,
                latches: Latches::new(),
            })
            .collect();
        let inner = Inner {
            db,
            path,
            clock: builder.clock.clone(),
            retention_ms: builder.retention_ms,
            admission_floor: builder.admission_floor,
            write_options,
            #[cfg(feature = "tokio")]
            sync_writes: builder.durability == Durability::Sync,
            #[cfg(feature = "tokio")]
            committer: crate::committer::CommitterSlot::default(),
            poisoned: AtomicBool::new(false),
            fault_injector: builder.fault_injector.clone(),
            token_seed: token_seed(),
            token_counter: AtomicU64::new(0),
            markers,
            version_latches: Latches::new(),
            consumer_metrics: parking_lot::Mutex::new(Vec::new()),
            write_batches: AtomicU64::new(0),
            business: builder.business_tables.clone(),
            _store_lock: lock,
        };
        inner.write_meta(meta_to_write)?;
        Ok(Engine {
            inner: Arc::new(inner),
        })
    }

    /// A handle on one consumer's dedup records. Consumers sharing a store never see each
    /// other's keys.
    ///
    /// A consumer id is text (UTF-8): it labels the consumer's metrics and log events. The
    /// on-disk key format would hold any bytes (the operator tools read such ids, as
    /// [`crate::admin::Filter::consumer`] takes bytes), but the API creates only text ids.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] unless `consumer_id` has
    /// [`crate::CONSUMER_ID_BYTES_MIN`]..=[`crate::CONSUMER_ID_BYTES_MAX`] bytes.
    pub fn consumer(&self, consumer_id: &str) -> Result<Consumer> {
        let prefix = consumer_prefix(consumer_id.as_bytes())?;
        let metrics = {
            let mut registered = self.inner.consumer_metrics.lock();
            match registered.iter().find(|m| m.consumer == consumer_id) {
                Some(metrics) => metrics.clone(),
                None => {
                    let metrics = Arc::new(ConsumerMetrics::new(consumer_id));
                    registered.push(metrics.clone());
                    metrics
                }
            }
        };
        Ok(Consumer {
            inner: self.inner.clone(),
            id: consumer_id.to_owned(),
            prefix,
            metrics,
        })
    }

    /// A snapshot of the engine's numbers since it was opened: outcomes, commits and
    /// `LeaseLost` refusals per consumer, write batches, open claims. The same numbers go to
    /// the `metrics` facade (names in the crate docs' Observability section).
    #[must_use]
    pub fn stats(&self) -> Stats {
        Stats {
            consumers: self
                .inner
                .consumer_metrics
                .lock()
                .iter()
                .map(|metrics| metrics.snapshot())
                .collect(),
            write_batches: self.inner.write_batches.load(Ordering::Relaxed),
            open_claims: self.open_claims(),
        }
    }

    /// A handle on a business table declared with [`EngineBuilder::business_table`].
    ///
    /// # Errors
    /// [`Error::UnknownTable`] if no business table of that name was declared.
    pub fn business_table(&self, name: &str) -> Result<BusinessTable> {
        let index = self
            .inner
            .business
            .iter()
            .position(|table| table.name == name)
            .ok_or_else(|| Error::UnknownTable {
                name: name.to_owned(),
                expected: "business",
            })?;
        let declared = &self.inner.business[index];
        Ok(BusinessTable {
            inner: self.inner.clone(),
            index,
            name: declared.name.clone(),
            has_merge_operator: declared.merge_operator.is_some(),
        })
    }

    /// A handle on an entity table declared with [`EngineBuilder::entity_table`].
    ///
    /// # Errors
    /// [`Error::UnknownTable`] if no entity table of that name was declared.
    pub fn entity_table(&self, name: &str) -> Result<EntityTable> {
        let index = self
            .inner
            .markers
            .iter()
            .skip(1)
            .position(|marker| marker.name == name)
            .ok_or_else(|| Error::UnknownTable {
                name: name.to_owned(),
                expected: "entity",
            })?;
        Ok(EntityTable {
            inner: self.inner.clone(),
            marker: index + 1,
        })
    }

    /// Makes every commit so far durable: fsyncs the WAL. Needed only with
    /// [`Durability::Buffered`]; with [`Durability::Sync`] each commit already is.
    ///
    /// # Errors
    /// [`Error::Poisoned`] if an earlier write failed; a failure here poisons the engine too.
    pub fn flush_wal(&self) -> Result<()> {
        self.inner.check_not_poisoned()?;
        self.inner
            .io(IoPoint::SyncWal, || self.inner.db.flush_wal(true))
    }

    /// Flushes every table's memtable to table files. RocksDB flushes on its own when a
    /// memtable fills; this is for operators (before a backup, say) and benchmarks that want a
    /// store in its steady state. Durability does not depend on it: the WAL already holds every
    /// commit.
    ///
    /// # Errors
    /// [`Error::Poisoned`] if an earlier write failed; [`Error::Storage`] if a flush fails (which
    /// poisons the engine).
    pub fn flush(&self) -> Result<()> {
        self.inner.check_not_poisoned()?;
        // The marker tables (the records table first) and the business tables, plus the two
        // tables of our own that are not marker tables.
        let tables = [rocksdb::DEFAULT_COLUMN_FAMILY_NAME, VERSIONS_TABLE]
            .into_iter()
            .chain(self.inner.markers.iter().map(|m| m.name.as_str()))
            .chain(self.inner.business.iter().map(|t| t.name.as_str()));
        for table in tables {
            let cf = self.inner.cf(table);
            self.inner
                .io(IoPoint::Flush, || self.inner.db.flush_cf(cf))?;
        }
        Ok(())
    }

    /// Compacts every marker table fully, so that no record expired by now is stored any more.
    /// In-progress records are kept, whatever their lease; released records are kept until the
    /// compaction filter's removal time for them has passed. It writes every marker table's
    /// memtable to a table file first. RocksDB also removes expired
    /// records on its own (size-triggered and periodic compactions); this is for tests and
    /// operators who want the space back now. Records expiring after the call are not touched.
    ///
    /// # Errors
    /// [`Error::Storage`] if the flush fails (which poisons the engine). RocksDB reports no error
    /// from a manual compaction (rust-rocksdb's `compact_range` returns nothing), so a failed
    /// compaction shows only in RocksDB's LOG and leaves expired records in place, where they
    /// still read as absent.
    pub fn compact(&self) -> Result<()> {
        for marker in 0..self.inner.markers.len() {
            self.compact_marker(marker)?;
        }
        Ok(())
    }

    /// Flushes and fully compacts one marker table (index into `Inner::markers`) twice, so the
    /// compaction filter sees every record in it. [`Engine::compact`] does every marker table;
    /// the operator tools do them one by one to report progress.
    ///
    /// Why twice: a record written since the table's last full compaction is a merge operand
    /// (an install or replace), not a value. RocksDB offers a compaction filter the values it
    /// reads and, through a hook rust-rocksdb does not expose, the operands; the value a
    /// compaction folds from operands is written out without being filtered. The first pass
    /// folds every operand into a value, the second filters those values.
    pub(crate) fn compact_marker(&self, marker: usize) -> Result<()> {
        let mut options = CompactOptions::default();
        options.set_bottommost_level_compaction(BottommostLevelCompaction::Force);
        let cf = self.inner.cf(&self.inner.markers[marker].name);
        self.inner
            .io(IoPoint::Flush, || self.inner.db.flush_cf(cf))?;
        self.inner.io(IoPoint::Compaction, || {
            for _pass in 0..2 {
                self.inner
                    .db
                    .compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &options);
            }
            Ok(())
        })
    }

    /// The shared state, for the operator tools (`crate::admin`).
    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Counts the records physically present in the consumers' table, by what a read at this
    /// instant would make of them. Walks the whole table: meant for tests and operators.
    ///
    /// # Errors
    /// [`Error::Storage`] if the iteration fails.
    pub fn record_counts(&self) -> Result<RecordCounts> {
        let now_ms = self.inner.clock.now_ms();
        let mut counts = RecordCounts::default();
        let cf = self.inner.cf(RECORDS_TABLE);
        for entry in self.inner.db.iterator_cf(cf, IteratorMode::Start) {
            let (_, value) = entry?;
            match Record::decode(&value).map(|record| record.state) {
                Ok(RecordState::Completed { expires_at_ms, .. })
                    if crate::record::is_expired(expires_at_ms, now_ms) =>
                {
                    counts.expired += 1;
                }
                Ok(RecordState::Completed { .. }) => counts.live += 1,
                Ok(RecordState::InProgress { .. }) => counts.in_progress += 1,
                Ok(RecordState::Released { .. }) => counts.released += 1,
                Err(_) => counts.corrupt += 1,
            }
        }
        Ok(counts)
    }

    /// The number of claims this process holds open right now, over all marker tables.
    #[must_use]
    pub fn open_claims(&self) -> usize {
        self.inner
            .markers
            .iter()
            .map(|marker| marker.latches.held())
            .sum()
    }

    /// The store's directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The engine clock's current reading, in ms since the Unix epoch.
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

/// Records in the consumers' table by state, as counted by [`Engine::record_counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordCounts {
    /// Completed records not yet expired.
    pub live: u64,
    /// Expired records that compaction has not removed yet (they already read as absent).
    pub expired: u64,
    /// In-progress records of external claims, whether their lease is live or not.
    pub in_progress: u64,
    /// Released records kept so epochs keep increasing (they read as absent).
    pub released: u64,
    /// Values that do not decode.
    pub corrupt: u64,
}

/// A seed that differs between opens, processes and machines without a random-number crate:
/// the wall clock's nanoseconds, the process id and a stack address, hashed.
fn token_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    let local = 0u8;
    let address = std::ptr::addr_of!(local) as usize;
    let mut bytes = Vec::with_capacity(32);
    bytes.extend_from_slice(&nanos.to_le_bytes());
    bytes.extend_from_slice(&std::process::id().to_le_bytes());
    bytes.extend_from_slice(&address.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

impl Inner {
    /// A fresh lease token. Together with the epoch it identifies one holder, so a holder whose
    /// record was removed and whose epoch a later holder reached again is still fenced out.
    pub(crate) fn next_token(&self) -> u64 {
        let count = self.token_counter.fetch_add(1, Ordering::Relaxed);
        xxhash_rust::xxh3::xxh3_64_with_seed(&count.to_le_bytes(), self.token_seed)
    }

    /// The clock reading for a write, refused beyond [`crate::CLOCK_MS_MAX`]: past it, a
    /// record's expiry (now + retention) would saturate and the record could be born expired.
    pub(crate) fn write_clock_ms(&self) -> Result<u64> {
        let now_ms = self.clock.now_ms();
        if now_ms > crate::CLOCK_MS_MAX {
            return Err(Error::ClockOutOfRange { now_ms });
        }
        Ok(now_ms)
    }

    /// The ordering guard's highest applied version of an entity (its versions-table key).
    pub(crate) fn read_version(&self, version_key: &[u8]) -> Result<Option<u64>> {
        let Some(value) = self
            .db
            .get_pinned_cf(self.cf(VERSIONS_TABLE), version_key)?
        else {
            return Ok(None);
        };
        let bytes = <[u8; 8]>::try_from(&value[..]).map_err(|_| Error::Corrupt {
            key: version_key.to_vec(),
            reason: crate::record::DecodeError::Invalid {
                reason: "an entity version is not 8 bytes",
            },
        })?;
        Ok(Some(u64::from_be_bytes(bytes)))
    }

    /// The column family of the business table declared at `index`.
    pub(crate) fn business_cf(&self, index: usize) -> &ColumnFamily {
        self.cf(&self.business[index].name)
    }

    pub(crate) fn cf(&self, name: &str) -> &ColumnFamily {
        // Every name asked for was declared and created at open, and tables are never dropped.
        self.db
            .cf_handle(name)
            .expect("table declared at open is present")
    }

    /// Whether each write fsyncs the WAL before it returns ([`Durability::Sync`]).
    #[cfg(feature = "tokio")]
    pub(crate) fn syncs_each_write(&self) -> bool {
        self.sync_writes
    }

    /// The committer of async commits, started on first use.
    #[cfg(feature = "tokio")]
    pub(crate) fn committer(&self) -> Result<&crate::committer::Committer> {
        self.committer.get_or_start()
    }

    pub(crate) fn check_not_poisoned(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(Error::Poisoned);
        }
        Ok(())
    }

    /// Maps a write-path result, poisoning the engine unless the failure is known to have
    /// written nothing.
    fn poison_on_failure(&self, outcome: std::result::Result<(), rocksdb::Error>) -> Result<()> {
        outcome.map_err(|error| {
            let error = Error::from(error);
            if !error.is_retryable() {
                self.poisoned.store(true, Ordering::Release);
            }
            error
        })
    }

    /// The one write path: writes `batch` atomically with the engine's durability.
    pub(crate) fn write(&self, batch: WriteBatch) -> Result<()> {
        self.check_not_poisoned()?;
        self.io(IoPoint::Write, || {
            self.db.write_opt(batch, &self.write_options)
        })?;
        self.write_batches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Runs one I/O call at `point`, applying an injected fault if one is installed, and
    /// poisons the engine on any failure that is not known to have written nothing.
    fn io(
        &self,
        point: IoPoint,
        call: impl FnOnce() -> std::result::Result<(), rocksdb::Error>,
    ) -> Result<()> {
        let fault = self
            .fault_injector
            .as_ref()
            .map_or(Fault::None, |injector| injector.fault(point));
        match fault {
            Fault::None => self.poison_on_failure(call()),
            Fault::FailBefore | Fault::FailAfter => {
                if fault == Fault::FailAfter {
                    // Its own outcome is hidden from the caller, as a failed fsync would be.
                    let _ = call();
                }
                self.poisoned.store(true, Ordering::Release);
                Err(crate::fault::injected(point))
            }
        }
    }

    /// Writes the metadata an accepted open found missing (a new store's format marker, the
    /// kinds of newly declared tables), fsynced whatever the durability mode: the marker must be
    /// durable before any record is.
    fn write_meta(&self, to_write: MetaToWrite) -> Result<()> {
        let meta = self.cf(rocksdb::DEFAULT_COLUMN_FAMILY_NAME);
        let mut batch = WriteBatch::default();
        if to_write.format {
            batch.put_cf(meta, META_FORMAT_KEY, STORE_FORMAT_V1);
        }
        for (name, kind) in to_write.kinds {
            let key = format!("{META_TABLE_KIND_PREFIX}{name}");
            batch.put_cf(meta, key, kind.stored());
        }
        for (name, operator) in to_write.operators {
            let key = format!("{META_MERGE_OPERATOR_PREFIX}{name}");
            batch.put_cf(meta, key, encode_merge_operator(operator.as_deref()));
        }
        if !batch.is_empty() {
            let mut sync = WriteOptions::default();
            sync.set_sync(true);
            self.db.write_opt(batch, &sync)?;
        }
        Ok(())
    }
}

/// Every user table the builder declares, with its kind.
fn declared_kinds(builder: &EngineBuilder) -> Vec<(&str, DeclaredKind)> {
    builder
        .business_tables
        .iter()
        .map(|table| (table.name.as_str(), DeclaredKind::Business))
        .chain(
            builder
                .entity_tables
                .iter()
                .map(|name| (name.as_str(), DeclaredKind::Entity)),
        )
        .collect()
}

/// Whether an open failed because another opener holds the store's LOCK file: RocksDB reports
/// a lock held by another process as "While lock file: <dir>/LOCK: Resource temporarily
/// unavailable" and one held in this process as "lock hold by current process". Other I/O
/// errors on the LOCK file (permissions, say) are not a busy store.
fn is_lock_held(error: &rocksdb::Error) -> bool {
    let message = error.as_ref();
    error.kind() == rocksdb::ErrorKind::IOError
        && (message.contains("While lock file") || message.contains("lock hold by current process"))
}

/// How a store is opened (`EngineBuilder::open_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpenMode {
    /// An application's open: creates the store and any missing table.
    Application,
    /// An operator tool's exclusive open of an existing store, with every table it holds
    /// declared and business tables given a stand-in for their (unknown) merge operators
    /// ([`set_opaque_merge_operator`]). Nothing is created, business tables are never
    /// compacted, and recovery does not flush ([`admin_db_options`]). Memtables are
    /// [`ADMIN_WRITE_BUFFER_BYTES`], so replaying the WAL does not fill one either, and have no
    /// bloom filter, which would be allocated up front at that size.
    Admin,
}

/// The memtable size of every table in [`OpenMode::Admin`]: the largest an application may
/// configure ([`crate::WRITE_BUFFER_BYTES_MAX`]). A memtable that fills while the WAL is
/// replayed is flushed even with `avoid_flush_during_recovery`, so it must hold whatever the
/// application left unflushed; memory is taken only as data is replayed.
pub(crate) const ADMIN_WRITE_BUFFER_BYTES: usize = crate::WRITE_BUFFER_BYTES_MAX;

/// Gives a table whose merge operator is unknown (an operator tool opening a business table) a
/// stand-in. Without one, replaying the WAL stops silently at the table's first merge operand
/// (RocksDB refuses to insert it, and point-in-time recovery ends there): the tool would miss
/// every later write, and after a write of its own the store would not open again (sequence
/// numbers going backwards). Inserting operands into a memtable never calls the operator; the
/// tools never read, flush or compact these tables, and if RocksDB ever asked for a fold the
/// stand-in fails it rather than invent a value.
///
/// `stored` is what the store's OPTIONS file names for the table (`None`: no readable OPTIONS
/// file; `Some(None)`: the table is not in it). The stand-in takes the application's operator
/// name (RocksDB only writes the name down), so that a later application open is checked
/// against the application's operator, not the stand-in (`store_meta::check_merge_operators`).
/// A table the file records without an operator gets none: its operator is fixed when it is
/// created, so it holds no merge operand, and the application's next open still finds it
/// recorded without one.
pub(crate) fn set_opaque_merge_operator(
    options: &mut rocksdb::Options,
    stored: Option<Option<&str>>,
) {
    fn decline(_: &[u8], _: Option<&[u8]>, _: &rocksdb::MergeOperands) -> Option<Vec<u8>> {
        None
    }
    let name = match stored {
        Some(Some("nullptr")) => return,
        Some(Some(name)) => name,
        _ => OPAQUE_MERGE_OPERATOR_NAME,
    };
    options.set_merge_operator(name, decline, decline);
}

/// Database-wide options of [`OpenMode::Admin`]: those of [`db_options`], except that nothing
/// is created and the WAL is replayed into the memtables without flushing them. A recovery
/// flush of a business table holding merge operands would need the application's merge
/// operator, which an operator tool does not have, and would fail the open. The data stays in
/// the WAL, which RocksDB keeps until the application's next open flushes it.
fn admin_db_options() -> Result<rocksdb::Options> {
    let mut options = db_options();
    options.create_if_missing(false);
    options.create_missing_column_families(false);
    // rust-rocksdb has no setters for these; RocksDB's option-string parser sets them on a copy
    // of the options above. Without fallocate, the new WAL does not reserve 1.1 times an
    // ADMIN_WRITE_BUFFER_BYTES memtable of disk up front.
    const SETTINGS: &str = "avoid_flush_during_recovery=true;allow_fallocate=false";
    Ok(options.get_options_from_string(SETTINGS)?)
}

/// Database-wide options. Each is set explicitly because the engine's guarantees depend on it.
pub(crate) fn db_options() -> rocksdb::Options {
    let mut options = rocksdb::Options::default();
    options.create_if_missing(true);
    options.create_missing_column_families(true);
    // Verify checksums and refuse to open over detected corruption rather than guess.
    options.set_paranoid_checks(true);
    // After a crash, replay the WAL up to the first damaged entry: every write acknowledged with
    // fsync is before it. Later entries are dropped, never partially applied.
    options.set_wal_recovery_mode(DBRecoveryMode::PointInTime);
    // Writes reach the WAL inside `write`; a buffered WAL would make `Durability::Buffered` lose
    // commits on a process crash, not just on power loss.
    options.set_manual_wal_flush(false);
    // The WAL is always on, so a batch spanning tables is atomic through it; atomic flush (for
    // WAL-less setups) is not needed.
    options.set_atomic_flush(false);
    // Durable commits (B10): RocksDB already commits concurrent writers as a group (one leader
    // writes the WAL and fsyncs it for all waiting writers; the next group queues meanwhile).
    // Measured on this write pattern (BENCHMARKS.md, `compare.sh wal-options`): the leader
    // inserting the whole group into the memtables is faster than waking every writer to insert
    // its own at 32 producers (+24%, +37% and +39% in three runs on 2 cores; at 8 producers the
    // runs disagreed); pipelined writes, larger write groups and a group commit of our own over
    // `manual_wal_flush` gained nothing.
    options.set_allow_concurrent_memtable_write(false);
    options.set_enable_pipelined_write(false);
    // Reuse obsolete WAL files instead of appending to new ones: an fdatasync then has no file
    // size to journal (p50 of a 1-producer durable write 188 -> 130 us, and 207 -> 135 us in a
    // later run). Records carry their
    // log number, so recovery stops at the previous incarnation's leftovers; RocksDB supports
    // this with point-in-time recovery since its fix for it (facebook/rocksdb#12403, #13819).
    options.set_recycle_log_file_num(4);
    options.set_use_fsync(false);
    options.set_max_background_jobs(2);
    options.set_max_open_files(-1);
    options
}

/// Options common to every table.
pub(crate) fn table_options(builder: &EngineBuilder, cache: &Cache) -> rocksdb::Options {
    let mut block = BlockBasedOptions::default();
    block.set_block_cache(cache);
    // Most lookups are for keys never seen before: a whole-key bloom filter answers them without
    // touching data blocks.
    block.set_bloom_filter(10.0, false);
    block.set_whole_key_filtering(true);
    block.set_cache_index_and_filter_blocks(true);
    // Partitioned filters and index: a table file's filter is about 1.25 bytes per key, so a
    // 64 MiB file's whole filter (~1 MB) outgrows a shard of the block cache and was re-read
    // and re-checksummed from the file on every lookup (measured: p50 of a claim 10 -> 215 us
    // once the first files were flushed). 4 KiB partitions are cached like data blocks; the
    // small top-level index of each file stays pinned.
    block.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
    block.set_partition_filters(true);
    block.set_metadata_block_size(4096);
    block.set_pin_top_level_index_and_filter(true);
    block.set_cache_index_and_filter_blocks_with_high_priority(true);
    // No data-block hash index: measured on these lookups it gained nothing (BENCHMARKS.md,
    // read-options), and it makes every data block bigger.
    let mut options = rocksdb::Options::default();
    options.set_block_based_table_factory(&block);
    // A whole-key bloom filter over the memtable too: a new key's lookup skips the skiplist
    // search. 2% of the memtable's size.
    options.set_memtable_prefix_bloom_ratio(0.02);
    options.set_memtable_whole_key_filtering(true);
    options.set_compression_type(DBCompressionType::Lz4);
    options.set_write_buffer_size(builder.write_buffer_bytes);
    if builder.open_mode == OpenMode::Admin {
        options.set_memtable_prefix_bloom_ratio(0.0);
        options.set_write_buffer_size(ADMIN_WRITE_BUFFER_BYTES);
    }
    options.set_level_compaction_dynamic_level_bytes(true);
    options.set_optimize_filters_for_hits(false);
    options
}

/// Options of a marker table: the record merge operator, the TTL compaction filter, and periodic
/// compaction so cold files are filtered too.
pub(crate) fn marker_table_options(builder: &EngineBuilder, cache: &Cache) -> rocksdb::Options {
    let mut options = table_options(builder, cache);
    options.set_merge_operator(
        MERGE_OPERATOR_NAME,
        rocksdb_full_merge,
        rocksdb_partial_merge,
    );
    // Fold operands only on reads and compactions, never eagerly on the write path.
    options.set_max_successive_merges(0);
    let clock = builder.clock.clone();
    options.set_compaction_filter(COMPACTION_FILTER_NAME, move |_level, _key, value| {
        match compaction_decision(value, clock.now_ms()) {
            FilterDecision::Keep => rocksdb::CompactionDecision::Keep,
            FilterDecision::Remove => rocksdb::CompactionDecision::Remove,
        }
    });
    options.set_periodic_compaction_seconds(builder.periodic_compaction_s);
    options
}

/// A handle on one consumer's records: `begin` claims message keys, `get` inspects them.
#[derive(Clone)]
pub struct Consumer {
    inner: Arc<Inner>,
    id: String,
    prefix: Vec<u8>,
    metrics: Arc<ConsumerMetrics>,
}

impl Consumer {
    /// Claims `message_key` for processing, or reports why not. See [`Outcome`].
    ///
    /// `fingerprint` identifies the content: a redelivery whose fingerprint differs from the
    /// completed one is an [`Outcome::Conflict`].
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a bad key, [`Error::Corrupt`] if the stored record does not
    /// decode, [`Error::Storage`] if the read fails, [`Error::Poisoned`] after a failed write
    /// (nothing can be committed until the store is reopened).
    pub fn begin(
        &self,
        message_key: impl AsRef<[u8]>,
        fingerprint: Fingerprint,
    ) -> Result<Outcome> {
        self.begin_message(&Message::new(message_key.as_ref(), fingerprint))
    }

    /// Like [`Consumer::begin`], for a [`Message`] that may carry its production time (admission
    /// floor), an entity version (ordering guard) and a correlation id.
    ///
    /// # Errors
    /// As for [`Consumer::begin`]; the entity key of a version follows the message-key limits.
    pub fn begin_message(&self, message: &Message<'_>) -> Result<Outcome> {
        let started = Instant::now();
        let request = self.request(message)?;
        let mut outcome = begin(&self.inner, 0, request)?;
        if let Outcome::Fresh(claim) = &mut outcome {
            claim.observe(self.metrics.clone(), message.correlation_id);
        }
        self.observe(message, &outcome, started);
        Ok(outcome)
    }

    /// Counts an outcome and logs it.
    fn observe<C>(&self, message: &Message<'_>, outcome: &Outcome<C>, started: Instant) {
        let now_ms = self.inner.clock.now_ms();
        self.metrics.outcome(outcome, started.elapsed(), now_ms);
        tracing::debug!(
            target: "idemdb",
            consumer = %self.id,
            key = %crate::format::printable(message.key),
            outcome = Kind::of(outcome).label(),
            correlation_id = message.correlation_id,
            "begin"
        );
    }

    /// Claims a whole broker batch: one RocksDB multi-get for every key, an outcome per message
    /// (a repeated key is a [`crate::BatchOutcome::DuplicateInBatch`] of its first copy, or,
    /// with another fingerprint, a conflict: [`crate::BatchOutcome::ConflictInBatch`]), and
    /// [`crate::ClaimBatch::commit`] writes every claim still held in one write batch.
    ///
    /// # Errors
    /// As for [`Consumer::begin_message`], checked for every message before any key is taken;
    /// [`Error::LimitExceeded`] past [`crate::BATCH_MESSAGES_MAX`] messages.
    pub fn begin_batch(&self, messages: &[Message<'_>]) -> Result<crate::ClaimBatch> {
        let started = Instant::now();
        let requests = messages
            .iter()
            .map(|message| self.request(message))
            .collect::<Result<Vec<_>>>()?;
        let mut batch = crate::batch::begin_batch(&self.inner, 0, requests)?;
        let now_ms = self.inner.clock.now_ms();
        // Each message gets an equal share of the batch's latency.
        let share = started.elapsed() / u32::try_from(messages.len().max(1)).unwrap_or(u32::MAX);
        for (index, message) in messages.iter().enumerate() {
            if let Some(claim) = batch.claim_mut(index) {
                claim.observe(self.metrics.clone(), message.correlation_id);
            }
            let kind = match &batch.outcomes()[index] {
                crate::BatchOutcome::Fresh => Kind::Fresh,
                crate::BatchOutcome::DuplicateInBatch { .. } => Kind::DuplicateInBatch,
                crate::BatchOutcome::ConflictInBatch { .. } => Kind::Conflict,
                crate::BatchOutcome::Settled(outcome) => {
                    self.metrics.outcome(outcome, share, now_ms);
                    continue;
                }
            };
            self.metrics.count(kind);
        }
        Ok(batch)
    }

    /// The engine-side form of a message: keys encoded and checked.
    pub(crate) fn request(&self, message: &Message<'_>) -> Result<Request> {
        let version = match message.version {
            Some((entity, version)) => Some((encode_with_prefix(&self.prefix, entity)?, version)),
            None => None,
        };
        Ok(Request {
            stored_key: encode_with_prefix(&self.prefix, message.key)?,
            fingerprint: message.fingerprint,
            produced_at_ms: message.produced_at_ms,
            version,
            expiry: self.default_expiry(),
        })
    }

    /// The record for `message_key`, if any: completed and not expired, or in progress (an
    /// expired or released record reads as `None`).
    ///
    /// # Errors
    /// As for [`Consumer::begin`].
    pub fn get(&self, message_key: impl AsRef<[u8]>) -> Result<Option<Record>> {
        let stored_key = encode_with_prefix(&self.prefix, message_key.as_ref())?;
        self.inner.read_record(0, &stored_key)
    }

    /// Takes `message_key` under a durable lease for a side effect outside the batch (R7): the
    /// in-progress record, with `holder`'s identity, the lease deadline and a new fencing epoch,
    /// is written (honouring the durability mode) before this returns. A key whose holder's
    /// lease ran out is taken over: the claim's [`ExternalClaim::previous_attempt`] says so.
    ///
    /// # Errors
    /// As for [`Consumer::begin`], and [`Error::LimitExceeded`] for a lease outside
    /// [`crate::LEASE_MS_MIN`]..=[`crate::LEASE_MS_MAX`] or a holder longer than
    /// [`crate::HOLDER_BYTES_MAX`]; a failed write as for [`crate::Claim::commit`].
    pub fn begin_external(
        &self,
        message_key: impl AsRef<[u8]>,
        fingerprint: Fingerprint,
        lease: std::time::Duration,
        holder: impl AsRef<[u8]>,
    ) -> Result<Outcome<ExternalClaim>> {
        let message = Message::new(message_key.as_ref(), fingerprint);
        self.begin_external_message(&message, lease, holder)
    }

    /// Like [`Consumer::begin_external`], for a [`Message`] (production time, correlation id).
    ///
    /// # Errors
    /// As for [`Consumer::begin_external`], and [`Error::InvalidOption`] for a message with a
    /// version: the ordering guard works with [`Consumer::begin_message`] and batches, whose
    /// claims hold the entity until they commit.
    pub fn begin_external_message(
        &self,
        message: &Message<'_>,
        lease: std::time::Duration,
        holder: impl AsRef<[u8]>,
    ) -> Result<Outcome<ExternalClaim>> {
        if message.version.is_some() {
            return Err(Error::invalid_option(
                "the ordering guard (Message::version) works with begin_message and batches, \
                 not with begin_external",
            ));
        }
        let started = Instant::now();
        let request = self.request(message)?;
        let mut outcome = crate::lease::begin_external(
            &self.inner,
            0,
            request.stored_key,
            request.fingerprint,
            lease,
            holder.as_ref(),
            request.expiry,
            request.produced_at_ms,
        )?;
        if let Outcome::Fresh(claim) = &mut outcome {
            claim.observe(self.metrics.clone(), message.correlation_id);
        }
        self.observe(message, &outcome, started);
        Ok(outcome)
    }

    /// Rebuilds an external claim from its ticket, for example after a restart. Nothing is
    /// checked until the claim's next call, which fails with [`Error::LeaseLost`] if the key
    /// changed hands meanwhile.
    ///
    /// # Errors
    /// [`Error::ForeignTicket`] if the ticket was issued by another consumer.
    pub fn resume(&self, ticket: &LeaseTicket) -> Result<ExternalClaim> {
        let ours = ticket.stored_key.starts_with(&self.prefix)
            && decode_key(&ticket.stored_key).is_ok_and(|(id, _)| id == self.id.as_bytes());
        if !ours {
            return Err(Error::ForeignTicket);
        }
        let mut claim =
            ExternalClaim::resumed(self.inner.clone(), 0, ticket.clone(), self.default_expiry());
        claim.observe(self.metrics.clone(), None);
        Ok(claim)
    }

    /// Lists up to `limit` of this consumer's in-progress records taken at least `older_than`
    /// ago, in key order, whether their lease is live or not: the candidates for reconciliation.
    ///
    /// # Errors
    /// [`Error::Storage`] if the scan fails; [`Error::Corrupt`] for a record that does not decode.
    pub fn in_progress(
        &self,
        older_than: std::time::Duration,
        limit: usize,
    ) -> Result<Vec<InProgressEntry>> {
        let now_ms = self.inner.clock.now_ms();
        let age_ms = u64::try_from(older_than.as_millis()).unwrap_or(u64::MAX);
        let cf = self.inner.cf(RECORDS_TABLE);
        let mode = IteratorMode::From(&self.prefix, rocksdb::Direction::Forward);
        let mut found = Vec::new();
        for entry in self.inner.db.iterator_cf(cf, mode) {
            let (key, value) = entry?;
            if !key.starts_with(&self.prefix) || found.len() >= limit {
                break;
            }
            let record = Record::decode(&value).map_err(|reason| Error::Corrupt {
                key: key.to_vec(),
                reason,
            })?;
            if let RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                ..
            } = record.state
                && now_ms.saturating_sub(since_ms) >= age_ms
            {
                found.push(InProgressEntry {
                    message_key: Bytes::copy_from_slice(&key[self.prefix.len()..]),
                    epoch: record.epoch,
                    holder,
                    since_ms,
                    lease_until_ms,
                });
            }
        }
        Ok(found)
    }

    /// Resolves an in-progress key by hand (an operator's reconciliation): completes it with a
    /// result or releases it, whoever holds it. The holder's next call gets
    /// [`Error::LeaseLost`].
    ///
    /// # Errors
    /// [`Error::NotInProgress`] if the key is not in progress; as for [`Consumer::begin`].
    pub fn resolve(&self, message_key: impl AsRef<[u8]>, resolution: Resolution) -> Result<()> {
        let stored_key = encode_with_prefix(&self.prefix, message_key.as_ref())?;
        crate::lease::resolve(
            &self.inner,
            0,
            &stored_key,
            resolution,
            self.default_expiry(),
        )
    }

    fn default_expiry(&self) -> Expiry {
        Expiry::After(std::time::Duration::from_millis(self.inner.retention_ms))
    }

    /// The consumer id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer").field("id", &self.id).finish()
    }
}

/// A table whose records are themselves the markers (R5): `begin(entity_key)` inserts the
/// entity if absent, and a second insert of the same key is a duplicate or a conflict.
/// The committed result *is* the entity. Records never expire unless the claim sets an expiry.
#[derive(Clone)]
pub struct EntityTable {
    inner: Arc<Inner>,
    marker: usize,
}

impl EntityTable {
    /// Claims the entity key for insertion, or reports why not. Keys follow the message-key
    /// limits ([`crate::MESSAGE_KEY_BYTES_MIN`]..=[`crate::MESSAGE_KEY_BYTES_MAX`]).
    ///
    /// # Errors
    /// As for [`Consumer::begin`].
    pub fn begin(&self, entity_key: impl AsRef<[u8]>, fingerprint: Fingerprint) -> Result<Outcome> {
        let entity_key = entity_key.as_ref();
        check_message_key(entity_key)?;
        let request = Request {
            stored_key: entity_key.to_vec(),
            fingerprint,
            produced_at_ms: None,
            version: None,
            expiry: Expiry::Never,
        };
        begin(&self.inner, self.marker, request)
    }

    /// The entity's record, if present and not expired.
    ///
    /// # Errors
    /// As for [`Consumer::begin`].
    pub fn get(&self, entity_key: impl AsRef<[u8]>) -> Result<Option<Record>> {
        let entity_key = entity_key.as_ref();
        check_message_key(entity_key)?;
        self.inner.read_record(self.marker, entity_key)
    }

    /// The table's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.inner.markers[self.marker].name
    }
}

impl std::fmt::Debug for EntityTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityTable")
            .field("name", &self.name())
            .finish()
    }
}

/// A handle on a business table: claims stage writes into it; `get` reads it.
#[derive(Clone)]
pub struct BusinessTable {
    pub(crate) inner: Arc<Inner>,
    /// Position among the declared business tables.
    pub(crate) index: usize,
    pub(crate) name: String,
    pub(crate) has_merge_operator: bool,
}

impl BusinessTable {
    /// The current value under `key`, merges applied.
    ///
    /// # Errors
    /// [`Error::Storage`] if the read (or a merge) fails.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        Ok(self.inner.db.get_cf(self.inner.cf(&self.name), key)?)
    }

    /// The table's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Debug for BusinessTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusinessTable")
            .field("name", &self.name)
            .finish()
    }
}

impl Inner {
    /// Reads and decodes a marker record, treating an expired or released one as absent.
    pub(crate) fn read_record(&self, marker: usize, stored_key: &[u8]) -> Result<Option<Record>> {
        let now_ms = self.clock.now_ms();
        Ok(self
            .read_record_raw(marker, stored_key)?
            .filter(|record| !record.is_absent_at(now_ms)))
    }

    /// Reads and decodes a marker record, expired or not.
    pub(crate) fn read_record_raw(
        &self,
        marker: usize,
        stored_key: &[u8],
    ) -> Result<Option<Record>> {
        let cf = self.cf(&self.markers[marker].name);
        let Some(value) = self.db.get_pinned_cf(cf, stored_key)? else {
            return Ok(None);
        };
        Record::decode(&value)
            .map(Some)
            .map_err(|reason| Error::Corrupt {
                key: stored_key.to_vec(),
                reason,
            })
    }
}
