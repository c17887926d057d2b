//! The storage layer: the open RocksDB store (column families, latches, the clock), its open
//! path with the RocksDB options we depend on, the reads every operation shares, and the one
//! write path with its fault seam and poisoning.
//!
//! Everything above (claims, batches, leases, the handles, the operator tools) reaches RocksDB
//! through [`Storage`], and the committer's jobs carry `Storage::write`; nothing here knows of
//! a claim or a handle.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rocksdb::{
    BottommostLevelCompaction, Cache, ColumnFamily, ColumnFamilyDescriptor, CompactOptions, DB,
    WriteBatch, WriteOptions,
};

use smallvec::SmallVec;

use crate::format::clock::Clock;
use crate::format::error::{Error, Result};
use crate::format::position::{POSITIONS_TABLE, decode_position_key, decode_position_value};
use crate::format::record::{Record, decode_entity_version};
use crate::storage::fault::{Fault, FaultInjector, IoPoint};
use crate::storage::latch::Latches;
use crate::storage::observe::ConsumerMetrics;
use crate::storage::options::{Durability, EngineBuilder, MergeOperator, OpenMode, TableOptions};
use crate::storage::rocksdb_options::{
    admin_db_options, db_options, marker_table_options, positions_table_options,
    set_opaque_merge_operator, table_options,
};
use crate::storage::store_lock::StoreLock;
use crate::storage::store_meta::{
    DeclaredKind, META_FORMAT_KEY, META_MERGE_OPERATOR_PREFIX, META_TABLE_KIND_PREFIX, MetaToWrite,
    STORE_FORMAT_V1, StoredMeta, encode_merge_operator, new_store_meta, stored_merge_operators,
};
pub(crate) use crate::storage::store_meta::{RECORDS_TABLE, VERSIONS_TABLE};

/// The position of the consumers' records table among the marker tables (`Storage::markers`);
/// entity tables follow it.
pub(crate) const RECORDS_MARKER: usize = 0;

/// The open store: the RocksDB handle, its tables and latches, and the one write path. The
/// engine and every handle, claim and batch hold it through an `Arc`; the store closes when
/// the last one is dropped.
pub(crate) struct Storage {
    open: OpenDb,
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
    committer: crate::storage::log::committer::CommitterSlot,
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
    /// Per position key this open has checked: the highest offset written (or stored before)
    /// and the offsets of commits accepted and not yet finished, which a commit's staged
    /// positions are checked against ([`Storage::accept_positions`]).
    accepted_positions: parking_lot::Mutex<HashMap<Vec<u8>, AcceptedOffsets>>,
    /// Per-consumer numbers, in the order consumers were first opened.
    pub(crate) consumer_metrics: parking_lot::Mutex<Vec<Arc<ConsumerMetrics>>>,
    /// Labels the opener added to every metric ([`EngineBuilder::metrics_label`]).
    pub(crate) metrics_labels: Vec<(String, String)>,
    /// Write batches written (each one `DB::write`, one WAL record).
    write_batches: AtomicU64,
    /// The business tables as declared, in declaration order.
    pub(crate) business: Vec<TableOptions>,
    /// The commit log, when the builder asked for it
    /// (`EngineBuilder::commit_log`): the durable path instead of RocksDB's WAL.
    log: Option<crate::storage::log::logged_writes::LogWriter>,
    /// The directory lock, last so that it is released after RocksDB has closed the store.
    _store_lock: StoreLock,
}

self_cell::self_cell!(
    /// The open RocksDB database and the handles of the tables claims read and write, looked up
    /// once: rust-rocksdb finds a handle by searching its map of table names, which the
    /// instruction profile counted at about 210 instructions a lookup, three lookups a claim.
    struct OpenDb {
        owner: DB,
        #[covariant]
        dependent: TableHandles,
    }
);

/// Column-family handles of an open database, by the positions the engine uses.
struct TableHandles<'db> {
    /// By marker index: [`RECORDS_TABLE`], then the entity tables.
    markers: Vec<&'db ColumnFamily>,
    /// By business table index, in declaration order.
    business: Vec<&'db ColumnFamily>,
    versions: &'db ColumnFamily,
    /// `None` only for an operator tool's open of a store written before positions existed.
    positions: Option<&'db ColumnFamily>,
}

impl TableHandles<'_> {
    fn of<'db>(
        db: &'db DB,
        markers: &[MarkerTable],
        business: &[TableOptions],
    ) -> TableHandles<'db> {
        // Every table was declared and created at open, and tables are never dropped.
        let handle = |name: &str| {
            db.cf_handle(name)
                .expect("table declared at open is present")
        };
        TableHandles {
            markers: markers.iter().map(|table| handle(&table.name)).collect(),
            business: business.iter().map(|table| handle(&table.name)).collect(),
            versions: handle(VERSIONS_TABLE),
            positions: db.cf_handle(POSITIONS_TABLE),
        }
    }
}

/// A column family whose values are idemdb records (the consumers' table or an entity table).
pub(crate) struct MarkerTable {
    pub(crate) name: String,
    pub(crate) latches: Latches,
}

impl Storage {
    /// Opens the store at `builder.path` under the directory lock `lock`.
    ///
    /// The order is the contract: the caller took the directory lock first (so a held store is
    /// [`Error::AlreadyOpen`] whatever else is wrong) and then read the metadata through a
    /// read-only view (`stored`, [`StoredMeta::read`], once per open); every check against it
    /// runs here; only then does RocksDB open the store for writing,
    /// which replays and may flush the WAL. A refused open changes nothing. With
    /// [`OpenMode::Admin`] (`builder.open_mode`) this is the operator tools' open of an existing
    /// store (`crate::admin`), every table it holds declared.
    pub(crate) fn open(
        builder: &EngineBuilder,
        lock: StoreLock,
        stored: Option<StoredMeta>,
    ) -> Result<Storage> {
        let new_store = stored.is_none() && builder.open_mode == OpenMode::Application;
        let meta_to_write = check_before_open(builder, stored)?;
        if new_store {
            // Every check has passed: a new store is created under a marker, so that a crash
            // midway is finished by the next open instead of leaving a database it would refuse
            // (`store_meta.rs`).
            crate::storage::store_meta::begin_creation(&builder.path)?;
        }
        let db = open_db(builder)?;
        let log = match (builder.commit_log, builder.open_mode) {
            (Some((segments, segment_bytes)), OpenMode::Application) => {
                Some(crate::storage::log::logged_writes::LogWriter::open(
                    &builder.path,
                    &db,
                    segments,
                    segment_bytes,
                    builder.durability == Durability::Sync,
                )?)
            }
            // Without the log (or by an operator tool): a log left by an earlier open goes
            // into RocksDB's WAL first, then away.
            _ => {
                crate::storage::log::logged_writes::retire_log(&builder.path, &db)?;
                None
            }
        };
        let mut write_options = WriteOptions::default();
        write_options.set_sync(builder.durability == Durability::Sync);
        write_options.disable_wal(false);
        let markers: Vec<MarkerTable> = std::iter::once(RECORDS_TABLE.to_owned())
            .chain(builder.entity_tables.iter().cloned())
            .map(|name| MarkerTable {
                name,
                latches: Latches::new(),
            })
            .collect();
        let open = OpenDb::new(db, |db| {
            TableHandles::of(db, &markers, &builder.business_tables)
        });
        let storage = Storage {
            open,
            path: builder.path.clone(),
            clock: builder.clock.clone(),
            retention_ms: builder.retention_ms,
            admission_floor: builder.admission_floor,
            write_options,
            #[cfg(feature = "tokio")]
            sync_writes: builder.durability == Durability::Sync,
            #[cfg(feature = "tokio")]
            committer: crate::storage::log::committer::CommitterSlot::default(),
            poisoned: AtomicBool::new(false),
            fault_injector: builder.fault_injector.clone(),
            token_seed: token_seed(),
            token_counter: AtomicU64::new(0),
            markers,
            version_latches: Latches::new(),
            accepted_positions: parking_lot::Mutex::new(HashMap::new()),
            consumer_metrics: parking_lot::Mutex::new(Vec::new()),
            metrics_labels: builder.metrics_labels.clone(),
            write_batches: AtomicU64::new(0),
            business: builder.business_tables.clone(),
            log,
            _store_lock: lock,
        };
        storage.write_meta(meta_to_write)?;
        Ok(storage)
    }
}

/// Every check of the stored metadata (`stored`, read under the lock; `None` for no store yet)
/// against the declaration: what the open must then write of the metadata.
fn check_before_open(builder: &EngineBuilder, stored: Option<StoredMeta>) -> Result<MetaToWrite> {
    let path = &builder.path;
    let declared = declared_kinds(builder);
    let operators = builder.business_tables.iter().map(|table| {
        let operator = table.merge_operator.as_ref();
        (table.name.as_str(), operator.map(|op| op.name.as_str()))
    });
    let to_write = match stored {
        None => {
            let operators = operators
                .map(|(table, op)| (table.to_owned(), op.map(str::to_owned)))
                .collect();
            new_store_meta(&declared, operators)
        }
        Some(stored) => {
            let mut to_write = stored.check_declaration(path, &declared)?;
            // The operator tools do not know the application's operators: they neither check
            // nor record them.
            if builder.open_mode == OpenMode::Application {
                to_write.operators = stored.check_merge_operators(path, operators)?;
            }
            to_write
        }
    };
    // A log this open would make must fit the disk: refused here, the WAL is neither replayed
    // nor flushed, and a new store is not begun.
    if let (Some((segments, segment_bytes)), OpenMode::Application) =
        (builder.commit_log, builder.open_mode)
    {
        crate::storage::log::logged_writes::check_new_log_fits(path, segments, segment_bytes)?;
    }
    Ok(to_write)
}

/// RocksDB's open for writing, with every table the builder declares.
fn open_db(builder: &EngineBuilder) -> Result<DB> {
    let mode = builder.open_mode;
    let path = &builder.path;
    let stored_operators = match mode {
        OpenMode::Admin => stored_merge_operators(path),
        OpenMode::Application => None,
    };
    let cache = Cache::new_lru_cache(builder.block_cache_bytes);
    let mut descriptors = vec![
        ColumnFamilyDescriptor::new(
            rocksdb::DEFAULT_COLUMN_FAMILY_NAME,
            table_options(builder, &cache),
        ),
        ColumnFamilyDescriptor::new(RECORDS_TABLE, marker_table_options(builder, &cache)),
        ColumnFamilyDescriptor::new(VERSIONS_TABLE, table_options(builder, &cache)),
    ];
    // An application's open creates the positions table in a store written before it existed;
    // an operator tool creates nothing, and opens it only where it is.
    let positions = match mode {
        OpenMode::Application => true,
        OpenMode::Admin => DB::list_cf(&rocksdb::Options::default(), path)?
            .iter()
            .any(|table| table == POSITIONS_TABLE),
    };
    if positions {
        descriptors.push(ColumnFamilyDescriptor::new(
            POSITIONS_TABLE,
            positions_table_options(builder, &cache),
        ));
    }
    for table in &builder.business_tables {
        let mut options = table_options(builder, &cache);
        if mode == OpenMode::Admin {
            // An operator tool has no business table's merge operator: a compaction that
            // reached a merge operand would fail, and RocksDB would then refuse every write.
            options.set_disable_auto_compactions(true);
            // The stand-in takes the application's operator name, so the OPTIONS file this
            // open writes still names it.
            let stored = stored_operators
                .as_ref()
                .map(|stored| stored.get(table.name.as_str()).map(String::as_str));
            set_opaque_merge_operator(&mut options, stored);
        } else if let Some(operator) = &table.merge_operator {
            set_business_merge_operator(&mut options, operator);
        }
        descriptors.push(ColumnFamilyDescriptor::new(table.name.as_str(), options));
    }
    for name in &builder.entity_tables {
        let options = marker_table_options(builder, &cache);
        descriptors.push(ColumnFamilyDescriptor::new(name.as_str(), options));
    }
    let db_options = match mode {
        OpenMode::Application if builder.commit_log.is_some() => {
            // The tables without RocksDB's WAL: they flush all together, so that their files
            // hold exactly the batches up to the LSN they record, and a close leaves the
            // memtables to the commit log's replay.
            let mut options = db_options();
            options.set_atomic_flush(true);
            options.get_options_from_string("avoid_flush_during_shutdown=true")?
        }
        OpenMode::Application => db_options(),
        OpenMode::Admin => admin_db_options()?,
    };
    DB::open_cf_descriptors(&db_options, path, descriptors).map_err(|error| {
        // RocksDB reports a held LOCK file as an I/O error naming the file.
        if is_lock_held(&error) {
            Error::AlreadyOpen { path: path.clone() }
        } else {
            Error::from(error)
        }
    })
}

/// Gives a business table the application's merge operator.
fn set_business_merge_operator(options: &mut rocksdb::Options, operator: &MergeOperator) {
    let full = operator.merge.clone();
    let partial = operator.associative.then(|| operator.merge.clone());
    options.set_merge_operator(
        operator.name.as_str(),
        move |key: &[u8], existing: Option<&[u8]>, operands: &rocksdb::MergeOperands| {
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

impl Storage {
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
        if now_ms > crate::format::clock::CLOCK_MS_MAX {
            return Err(Error::ClockOutOfRange { now_ms });
        }
        Ok(now_ms)
    }

    /// The ordering guard's highest applied version of an entity (its versions-table key).
    pub(crate) fn read_version(&self, version_key: &[u8]) -> Result<Option<u64>> {
        let Some(value) = self.db().get_pinned_cf(self.versions_cf(), version_key)? else {
            return Ok(None);
        };
        let version = decode_entity_version(&value).map_err(|reason| Error::Corrupt {
            key: version_key.to_vec(),
            reason,
        })?;
        Ok(Some(version))
    }

    /// The open RocksDB database.
    pub(crate) fn db(&self) -> &DB {
        self.open.borrow_owner()
    }

    /// The column family of marker table `marker` ([`RECORDS_MARKER`], then the entity tables).
    pub(crate) fn marker_cf(&self, marker: usize) -> &ColumnFamily {
        self.open.borrow_dependent().markers[marker]
    }

    /// The column family of the ordering guard's entity versions.
    pub(crate) fn versions_cf(&self) -> &ColumnFamily {
        self.open.borrow_dependent().versions
    }

    /// The column family of the read positions, `None` in an operator tool's open of a store
    /// that has none.
    pub(crate) fn positions_cf(&self) -> Option<&ColumnFamily> {
        self.open.borrow_dependent().positions
    }

    /// The column family of the business table declared at `index`.
    pub(crate) fn business_cf(&self, index: usize) -> &ColumnFamily {
        self.open.borrow_dependent().business[index]
    }

    pub(crate) fn cf(&self, name: &str) -> &ColumnFamily {
        // Every name asked for was declared and created at open, and tables are never dropped.
        self.db()
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
    pub(crate) fn committer(&self) -> Result<&crate::storage::log::committer::Committer> {
        // With the commit log a second thread applies each group to the tables while the first
        // writes and syncs the next one's records; RocksDB's own WAL has no such halves.
        self.committer.get_or_start(self.log.is_some())
    }

    pub(crate) fn check_not_poisoned(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(Error::Poisoned);
        }
        Ok(())
    }

    /// The one write path: writes `batch` atomically with the engine's durability.
    pub(crate) fn write(&self, batch: WriteBatch) -> Result<()> {
        self.check_not_poisoned()?;
        if let Some(log) = &self.log {
            log.write(
                self.db(),
                batch,
                |call| self.io_result(IoPoint::Write, call),
                || self.flush_every_table(),
            )?;
            self.write_batches.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.write_without_log(batch)
    }

    /// [`Storage::write`] in two halves, for the async committer: this one makes `batches`
    /// (each a commit's, numbered by the caller) durable. With the commit log each is a record
    /// of one group, and those the ring had no room for are returned, for the next call (the
    /// committer can start it while [`Storage::complete_write`] applies this group to the
    /// tables); without the log they are joined into one write batch and written whole.
    #[cfg(feature = "tokio")]
    pub(crate) fn write_durable(
        &self,
        batches: Vec<(usize, WriteBatch)>,
    ) -> (StagedWrite, Vec<(usize, WriteBatch)>) {
        let numbers: Vec<usize> = batches.iter().map(|(number, _)| *number).collect();
        if let Err(error) = self.check_not_poisoned() {
            return (StagedWrite::Done(numbers, Err(error)), Vec::new());
        }
        match &self.log {
            Some(log) => {
                let (group, left) = log.write_durable(
                    batches,
                    |call| self.io_result(IoPoint::Write, call),
                    || self.flush_every_table(),
                );
                (StagedWrite::Logged(group), left)
            }
            None => {
                let joined =
                    crate::storage::log::wal_file::join(batches.into_iter().map(|(_, b)| b));
                (
                    StagedWrite::Done(numbers, self.write_without_log(joined)),
                    Vec::new(),
                )
            }
        }
    }

    /// The second half of [`Storage::write_durable`]: each batch's outcome, by its number.
    #[cfg(feature = "tokio")]
    pub(crate) fn complete_write(&self, staged: StagedWrite) -> Vec<(usize, Result<()>)> {
        match staged {
            StagedWrite::Done(numbers, outcome) => numbers
                .into_iter()
                .map(|number| (number, outcome.clone()))
                .collect(),
            StagedWrite::Logged(group) => {
                let log = self.log.as_ref().expect("a logged write has the log");
                let outcomes = log.apply(self.db(), group);
                let written = outcomes
                    .iter()
                    .filter(|(_, outcome)| outcome.is_ok())
                    .count();
                self.write_batches
                    .fetch_add(written as u64, Ordering::Relaxed);
                outcomes
            }
        }
    }

    /// A write through RocksDB's WAL (no commit log).
    fn write_without_log(&self, batch: WriteBatch) -> Result<()> {
        self.io(IoPoint::Write, |synced| {
            if synced {
                self.db().write_opt(batch, &self.write_options)
            } else {
                let mut unsynced = WriteOptions::default();
                unsynced.set_sync(false);
                self.db().write_opt(batch, &unsynced)
            }
        })?;
        self.write_batches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Runs one RocksDB call at `point` through [`Storage::io_result`].
    fn io(
        &self,
        point: IoPoint,
        call: impl FnOnce(bool) -> std::result::Result<(), rocksdb::Error>,
    ) -> Result<()> {
        self.io_result(point, |synced| call(synced).map_err(Error::from))
    }

    /// Runs one I/O call at `point` (RocksDB's, or the commit log's), applying an injected
    /// fault if one is installed, and poisons the engine on any failure that is not known to
    /// have written nothing. The call is told whether to sync as its durability asks (`false`
    /// only under [`Fault::Unsynced`]).
    fn io_result(&self, point: IoPoint, call: impl FnOnce(bool) -> Result<()>) -> Result<()> {
        let fault = self
            .fault_injector
            .as_ref()
            .map_or(Fault::None, |injector| injector.fault(point));
        let poison = |outcome: Result<()>| {
            outcome.inspect_err(|error| {
                if !error.is_retryable() {
                    self.poisoned.store(true, Ordering::Release);
                }
            })
        };
        match fault {
            Fault::None => poison(call(true)),
            Fault::Unsynced if point == IoPoint::SyncWal => Ok(()),
            Fault::Unsynced => poison(call(false)),
            Fault::FailBefore | Fault::FailAfter => {
                if fault == Fault::FailAfter {
                    // Its own outcome is hidden from the caller, as a failed fsync would be.
                    let _ = call(true);
                }
                self.poisoned.store(true, Ordering::Release);
                Err(crate::storage::fault::injected(point))
            }
        }
    }

    /// Fsyncs the WAL (or the commit log): every write so far becomes durable.
    pub(crate) fn sync_wal(&self) -> Result<()> {
        self.check_not_poisoned()?;
        if let Some(log) = &self.log {
            return self.io_result(IoPoint::SyncWal, |_| log.sync());
        }
        self.io(IoPoint::SyncWal, |_| self.db().flush_wal(true))
    }

    /// Every table's name: the marker tables (the records table first), the business tables,
    /// and the tables of our own that are not marker tables.
    fn table_names(&self) -> Vec<&str> {
        let positions = self.positions_cf().map(|_| POSITIONS_TABLE);
        [rocksdb::DEFAULT_COLUMN_FAMILY_NAME, VERSIONS_TABLE]
            .into_iter()
            .chain(positions)
            .chain(self.markers.iter().map(|m| m.name.as_str()))
            .chain(self.business.iter().map(|t| t.name.as_str()))
            .collect()
    }

    /// Flushes every table at once (one atomic flush with the commit log): what the tables
    /// then hold on disk is every batch written before the call.
    fn flush_every_table(&self) -> Result<()> {
        let tables: Vec<&ColumnFamily> =
            self.table_names().into_iter().map(|t| self.cf(t)).collect();
        self.io(IoPoint::Flush, |_| {
            self.db()
                .flush_cfs_opt(&tables, &rocksdb::FlushOptions::default())
        })
    }

    /// Writes a RocksDB checkpoint of the store to the new directory `dir`: the memtables are
    /// flushed, table files hard-linked (copied across file systems), and the WAL files still
    /// needed copied up to their size at that moment. A batch is one WAL record, and recovery
    /// of the copy replays whole records only, so every claim is in it whole or not at all.
    /// A failure leaves the store as it was: it is not a write of ours, so nothing is poisoned.
    pub(crate) fn checkpoint(&self, dir: &Path) -> Result<()> {
        // 0: RocksDB flushes every memtable first, so the copy needs little of the WAL.
        self.create_checkpoint(dir, 0)
    }

    /// Writes a RocksDB checkpoint to the new directory `dir` without flushing anything: what
    /// the memtables hold reaches the copy in the WAL files, copied up to their size at that
    /// moment, and is replayed when the copy opens. The operator tools' exclusive open needs
    /// this: its business tables have a stand-in merge operator, and a flush could fold their
    /// merge operands with it (`set_opaque_merge_operator`).
    pub(crate) fn checkpoint_without_flush(&self, dir: &Path) -> Result<()> {
        // RocksDB flushes before a checkpoint only when the live WAL files total more than
        // this many bytes, which no WAL reaches.
        self.create_checkpoint(dir, u64::MAX)
    }

    fn create_checkpoint(&self, dir: &Path, log_size_for_flush: u64) -> Result<()> {
        self.check_not_poisoned()?;
        // A dangling symlink counts as existing: RocksDB would write through it.
        if dir.symlink_metadata().is_ok() {
            return Err(Error::invalid_argument(format!(
                "the checkpoint directory {} exists already; give a new one",
                dir.display()
            )));
        }
        let checkpoint = rocksdb::checkpoint::Checkpoint::new(self.db())?;
        Ok(checkpoint.create_checkpoint_with_log_size(dir, log_size_for_flush)?)
    }

    /// Flushes every table's memtable to table files (with the commit log, all at once, and
    /// the log's segments the flush covered are free again).
    pub(crate) fn flush_tables(&self) -> Result<()> {
        self.check_not_poisoned()?;
        if let Some(log) = &self.log {
            let written = log.written_lsn();
            self.flush_every_table()?;
            log.flushed(written);
            return Ok(());
        }
        for table in self.table_names() {
            let cf = self.cf(table);
            self.io(IoPoint::Flush, |_| self.db().flush_cf(cf))?;
        }
        Ok(())
    }

    /// Flushes and fully compacts one marker table (index into [`Storage::markers`]) twice, so the
    /// compaction filter sees every record in it. `Engine::compact` does every marker table;
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
        let cf = self.marker_cf(marker);
        if self.log.is_some() {
            // With the commit log, a table never flushes alone (see `flush_tables`).
            self.flush_tables()?;
        } else {
            self.io(IoPoint::Flush, |_| self.db().flush_cf(cf))?;
        }
        self.io(IoPoint::Compaction, |_| {
            for _pass in 0..2 {
                self.db()
                    .compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &options);
            }
            Ok(())
        })
    }

    /// The retention when the admission floor is on (see `decision::admit`), else `None`.
    pub(crate) fn admission_floor_ms(&self) -> Option<u64> {
        self.admission_floor.then_some(self.retention_ms)
    }

    /// The number of write batches written since the store was opened.
    pub(crate) fn write_batches(&self) -> u64 {
        self.write_batches.load(Ordering::Relaxed)
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
            self.db().write_opt(batch, &sync)?;
            // Flushed at once. RocksDB deletes a WAL file only once every table has flushed
            // what the file holds, and nothing else writes this table: left in its memtable,
            // this one small batch kept every later WAL file until they reached RocksDB's
            // bound on their total size (8 times all the memtables: 1.5 GB at the default size
            // with no business table, more with each; seen in the scale run), and a reopen
            // after a crash read them all.
            self.db().flush_cf(meta)?;
        }
        Ok(())
    }
}

#[cfg(feature = "tokio")]
impl crate::storage::log::committer::BatchWriter for Storage {
    fn write_durable(
        &self,
        batches: Vec<(usize, WriteBatch)>,
    ) -> (StagedWrite, Vec<(usize, WriteBatch)>) {
        Storage::write_durable(self, batches)
    }

    fn complete_write(&self, staged: StagedWrite) -> Vec<(usize, Result<()>)> {
        Storage::complete_write(self, staged)
    }
}

/// A write [`Storage::write_durable`] started: done (the numbers of its batches and their
/// one outcome), or durable in the commit log and still to be applied to the tables.
#[cfg(feature = "tokio")]
pub(crate) enum StagedWrite {
    Done(Vec<usize>, Result<()>),
    Logged(crate::storage::log::logged_writes::DurableGroup),
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

impl Storage {
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
        let cf = self.marker_cf(marker);
        let Some(value) = self.db().get_pinned_cf(cf, stored_key)? else {
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

impl Storage {
    /// Reads a stored read position: (offset, updated_at_ms).
    pub(crate) fn read_position(&self, key: &[u8]) -> Result<Option<(u64, u64)>> {
        let Some(cf) = self.positions_cf() else {
            return Ok(None);
        };
        let Some(value) = self.db().get_pinned_cf(cf, key)? else {
            return Ok(None);
        };
        decode_position_value(&value)
            .map(Some)
            .map_err(|reason| Error::Corrupt {
                key: key.to_vec(),
                reason,
            })
    }

    /// Checks a commit's staged positions (position key, offset; one entry per key) against
    /// the highest offset stored, written by this open, or accepted for a commit still in
    /// flight, and accepts them all, or none: [`Error::PositionBehind`] for the first one
    /// behind. Checked and accepted under one lock, so of two commits racing for a partition
    /// the later offset wins and the other is refused whatever order they write in; the
    /// positions table's merge keeps the highest offset too, so the stored position never
    /// moves backwards even for writes this check did not see.
    ///
    /// The acceptance lasts until the commit is settled: [`AcceptedPositions::written`] makes
    /// its offsets the written ones; a commit that fails, or is dropped before its write, gives
    /// its offsets back, so a later commit behind them (the same work split smaller, say) is
    /// checked against what was written. After a failure that poisons the engine nothing more
    /// is written anyway.
    pub(crate) fn accept_positions(
        self: &Arc<Self>,
        staged: SmallVec<[(Vec<u8>, u64); 1]>,
    ) -> Result<AcceptedPositions> {
        let mut accepted = self.accepted_positions.lock();
        for (key, offset) in &staged {
            if !accepted.contains_key(key) {
                let written = self.read_position(key)?.map(|(offset, _)| offset);
                accepted.insert(
                    key.clone(),
                    AcceptedOffsets {
                        written,
                        in_flight: SmallVec::new(),
                    },
                );
            }
            let highest = accepted[key].highest();
            if let Some(highest) = highest.filter(|&highest| *offset < highest) {
                let (_, source, partition) =
                    decode_position_key(key).map_err(|reason| Error::Corrupt {
                        key: key.clone(),
                        reason,
                    })?;
                return Err(Error::PositionBehind {
                    source_name: source.to_owned(),
                    partition,
                    stored: highest,
                    staged: *offset,
                });
            }
        }
        for (key, offset) in &staged {
            if let Some(offsets) = accepted.get_mut(key) {
                offsets.in_flight.push(*offset);
            }
        }
        Ok(AcceptedPositions {
            storage: self.clone(),
            staged,
        })
    }

    /// Ends the acceptance of `staged`: each offset leaves the commits in flight and, if the
    /// commit was `written`, raises the written offset.
    fn settle_positions(&self, staged: &[(Vec<u8>, u64)], written: bool) {
        let mut accepted = self.accepted_positions.lock();
        for (key, offset) in staged {
            let Some(offsets) = accepted.get_mut(key) else {
                continue;
            };
            if let Some(at) = offsets.in_flight.iter().position(|o| o == offset) {
                offsets.in_flight.swap_remove(at);
            }
            if written {
                offsets.written = offsets.written.max(Some(*offset));
            }
        }
    }
}

/// What this open knows of one position key: the highest offset written (by this open, or
/// stored before it), and the offsets of the commits accepted and not yet settled.
struct AcceptedOffsets {
    written: Option<u64>,
    in_flight: SmallVec<[u64; 2]>,
}

impl AcceptedOffsets {
    /// The highest offset a new commit of the key must not be behind.
    fn highest(&self) -> Option<u64> {
        self.written.max(self.in_flight.iter().copied().max())
    }
}

/// The read positions of one commit, accepted by [`Storage::accept_positions`] and held until
/// the commit's write is settled: [`AcceptedPositions::written`] once it is written; dropped
/// without it (the write failed, or an error came before it), the offsets are given back.
#[must_use = "dropping the acceptance gives the offsets back"]
pub(crate) struct AcceptedPositions {
    storage: Arc<Storage>,
    staged: SmallVec<[(Vec<u8>, u64); 1]>,
}

impl AcceptedPositions {
    /// The accepted (position key, offset) pairs.
    pub(crate) fn offsets(&self) -> &[(Vec<u8>, u64)] {
        &self.staged
    }

    /// The commit was written: its offsets are the written ones.
    pub(crate) fn written(mut self) {
        let staged = std::mem::take(&mut self.staged);
        self.storage.settle_positions(&staged, true);
    }

    /// Settles by the write's outcome: [`AcceptedPositions::written`] if it succeeded, given
    /// back if it failed.
    pub(crate) fn settle(self, outcome: &Result<()>) {
        if outcome.is_ok() {
            self.written();
        }
    }
}

impl Drop for AcceptedPositions {
    fn drop(&mut self) {
        if !self.staged.is_empty() {
            self.storage.settle_positions(&self.staged, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::position::encode_position_key;

    fn open(dir: &Path) -> Arc<Storage> {
        let builder = EngineBuilder::new(dir);
        let lock = StoreLock::acquire(dir).unwrap();
        let stored = StoredMeta::read(dir).unwrap();
        Arc::new(Storage::open(&builder, lock, stored).unwrap())
    }

    fn staged(key: &[u8], offset: u64) -> SmallVec<[(Vec<u8>, u64); 1]> {
        smallvec::smallvec![(key.to_vec(), offset)]
    }

    fn behind(storage: &Arc<Storage>, key: &[u8], offset: u64) -> Option<u64> {
        match storage.accept_positions(staged(key, offset)) {
            Err(Error::PositionBehind { stored, .. }) => Some(stored),
            Ok(_) => None,
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_acceptance_given_back_leaves_the_highest_written_or_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let storage = open(dir.path());
        let key = encode_position_key(b"\x01c", "s", 0).unwrap();
        storage
            .accept_positions(staged(&key, 10))
            .unwrap()
            .written();
        // Two commits in flight, 20 then 30.
        let twenty = storage.accept_positions(staged(&key, 20)).unwrap();
        let thirty = storage.accept_positions(staged(&key, 30)).unwrap();
        assert_eq!(behind(&storage, &key, 25), Some(30));
        // The higher one fails: the lower one, still in flight, is the bar.
        drop(thirty);
        assert_eq!(behind(&storage, &key, 15), Some(20));
        // It fails too: back to what was written.
        twenty.settle(&Err(Error::Poisoned));
        assert_eq!(behind(&storage, &key, 9), Some(10));
        // Accepted at 15 (not behind 10), and it is written.
        storage
            .accept_positions(staged(&key, 15))
            .unwrap()
            .written();
        assert_eq!(behind(&storage, &key, 14), Some(15));
        // A lower commit written after a higher one does not lower the bar.
        let forty = storage.accept_positions(staged(&key, 40)).unwrap();
        let refused = storage.accept_positions(staged(&key, 39));
        assert!(refused.is_err());
        forty.settle(&Ok(()));
        assert_eq!(behind(&storage, &key, 39), Some(40));
        // Two commits at the same offset: settling one leaves the other in flight.
        let first = storage.accept_positions(staged(&key, 50)).unwrap();
        let second = storage.accept_positions(staged(&key, 50)).unwrap();
        drop(first);
        assert_eq!(behind(&storage, &key, 45), Some(50));
        drop(second);
        assert_eq!(behind(&storage, &key, 45), None);
    }
}
