//! The storage layer: the open RocksDB store (column families, latches, the clock), its open
//! path with the RocksDB options we depend on, the reads every operation shares, and the one
//! write path with its fault seam and poisoning.
//!
//! Everything above (claims, batches, leases, the handles, the operator tools) reaches RocksDB
//! through [`Storage`], and the committer's jobs carry `Storage::write`; nothing here knows of
//! a claim or a handle.

use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rocksdb::{
    BlockBasedIndexType, BlockBasedOptions, BottommostLevelCompaction, Cache, ColumnFamily,
    ColumnFamilyDescriptor, CompactOptions, DB, DBCompressionType, DBRecoveryMode, WriteBatch,
    WriteOptions,
};

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::fault::{Fault, FaultInjector, IoPoint};
use crate::latch::Latches;
use crate::merge::{MERGE_OPERATOR_NAME, rocksdb_full_merge, rocksdb_partial_merge};
use crate::observe::ConsumerMetrics;
use crate::options::{Durability, EngineBuilder, MergeOperator, OpenMode, TableOptions};
use crate::record::{Record, decode_entity_version};
use crate::store_lock::StoreLock;
use crate::store_meta::{
    DeclaredKind, META_FORMAT_KEY, META_MERGE_OPERATOR_PREFIX, META_TABLE_KIND_PREFIX, MetaToWrite,
    OPAQUE_MERGE_OPERATOR_NAME, STORE_FORMAT_V1, StoredMeta, encode_merge_operator, new_store_meta,
    stored_merge_operators,
};
pub(crate) use crate::store_meta::{RECORDS_TABLE, VERSIONS_TABLE};
use crate::ttl::{COMPACTION_FILTER_NAME, FilterDecision, compaction_decision};

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
    pub(crate) consumer_metrics: parking_lot::Mutex<Vec<Arc<ConsumerMetrics>>>,
    /// Labels the opener added to every metric ([`EngineBuilder::metrics_label`]).
    pub(crate) metrics_labels: Vec<(String, String)>,
    /// Write batches written (each one `DB::write`, one WAL record).
    write_batches: AtomicU64,
    /// The business tables as declared, in declaration order.
    pub(crate) business: Vec<TableOptions>,
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
}

impl TableHandles<'_> {
    fn of<'db>(db: &'db DB, markers: &[MarkerTable], business: &[TableOptions]) -> TableHandles<'db> {
        // Every table was declared and created at open, and tables are never dropped.
        let handle = |name: &str| db.cf_handle(name).expect("table declared at open is present");
        TableHandles {
            markers: markers.iter().map(|table| handle(&table.name)).collect(),
            business: business.iter().map(|table| handle(&table.name)).collect(),
            versions: handle(VERSIONS_TABLE),
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
        let meta_to_write = check_before_open(builder, stored)?;
        let db = open_db(builder)?;
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
            committer: crate::committer::CommitterSlot::default(),
            poisoned: AtomicBool::new(false),
            fault_injector: builder.fault_injector.clone(),
            token_seed: token_seed(),
            token_counter: AtomicU64::new(0),
            markers,
            version_latches: Latches::new(),
            consumer_metrics: parking_lot::Mutex::new(Vec::new()),
            metrics_labels: builder.metrics_labels.clone(),
            write_batches: AtomicU64::new(0),
            business: builder.business_tables.clone(),
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
    let Some(stored) = stored else {
        let operators = operators
            .map(|(table, op)| (table.to_owned(), op.map(str::to_owned)))
            .collect();
        return Ok(new_store_meta(&declared, operators));
    };
    let mut to_write = stored.check_declaration(path, &declared)?;
    // The operator tools do not know the application's operators: they neither check nor
    // record them.
    if builder.open_mode == OpenMode::Application {
        to_write.operators = stored.check_merge_operators(path, operators)?;
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
        if now_ms > crate::CLOCK_MS_MAX {
            return Err(Error::ClockOutOfRange { now_ms });
        }
        Ok(now_ms)
    }

    /// The ordering guard's highest applied version of an entity (its versions-table key).
    pub(crate) fn read_version(&self, version_key: &[u8]) -> Result<Option<u64>> {
        let Some(value) = self
            .db()
            .get_pinned_cf(self.versions_cf(), version_key)?
        else {
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

    /// Runs one I/O call at `point`, applying an injected fault if one is installed, and
    /// poisons the engine on any failure that is not known to have written nothing. The call
    /// is told whether to sync as its durability asks (`false` only under
    /// [`Fault::Unsynced`]).
    fn io(
        &self,
        point: IoPoint,
        call: impl FnOnce(bool) -> std::result::Result<(), rocksdb::Error>,
    ) -> Result<()> {
        let fault = self
            .fault_injector
            .as_ref()
            .map_or(Fault::None, |injector| injector.fault(point));
        match fault {
            Fault::None => self.poison_on_failure(call(true)),
            Fault::Unsynced if point == IoPoint::SyncWal => Ok(()),
            Fault::Unsynced => self.poison_on_failure(call(false)),
            Fault::FailBefore | Fault::FailAfter => {
                if fault == Fault::FailAfter {
                    // Its own outcome is hidden from the caller, as a failed fsync would be.
                    let _ = call(true);
                }
                self.poisoned.store(true, Ordering::Release);
                Err(crate::fault::injected(point))
            }
        }
    }

    /// Fsyncs the WAL: every write so far becomes durable.
    pub(crate) fn sync_wal(&self) -> Result<()> {
        self.check_not_poisoned()?;
        self.io(IoPoint::SyncWal, |_| self.db().flush_wal(true))
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

    /// Flushes every table's memtable to table files.
    pub(crate) fn flush_tables(&self) -> Result<()> {
        self.check_not_poisoned()?;
        // The marker tables (the records table first) and the business tables, plus the two
        // tables of our own that are not marker tables.
        let tables = [rocksdb::DEFAULT_COLUMN_FAMILY_NAME, VERSIONS_TABLE]
            .into_iter()
            .chain(self.markers.iter().map(|m| m.name.as_str()))
            .chain(self.business.iter().map(|t| t.name.as_str()));
        for table in tables {
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
        self.io(IoPoint::Flush, |_| self.db().flush_cf(cf))?;
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
impl crate::committer::BatchWriter for Storage {
    fn write_batch(&self, batch: WriteBatch) -> Result<()> {
        self.write(batch)
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
    // Durable commits: RocksDB already commits concurrent writers as a group (one leader
    // writes the WAL and fsyncs it for all waiting writers; the next group queues meanwhile).
    // Measured on this write pattern (BENCHMARKS.md, `compare.sh wal-options`): the leader
    // inserting the whole group into the memtables is faster than waking every writer to insert
    // its own at 32 producers (+24%, +37% and +39% in three runs on 2 cores; at 8 producers the
    // runs disagreed); pipelined writes, larger write groups and a group commit of our own over
    // `manual_wal_flush` gained nothing.
    options.set_allow_concurrent_memtable_write(false);
    options.set_enable_pipelined_write(false);
    // No WAL recycling, although reusing obsolete WAL files made a durable commit's fdatasync
    // cheaper (no file size to journal; p50 of a 1-producer durable write 207 -> 135 us). A
    // recycled file is cut to its new length when RocksDB closes it, and that truncation is
    // never fsynced: after a power cut the file can come back with the previous incarnation's
    // bytes behind its last record. Recovery reads them as a damaged record and stops there,
    // so every later WAL file is dropped (acknowledged commits with it), or the open fails
    // when a table was already flushed past that file ("SST file contains data beyond the
    // point of corruption"). The power-cut harness in tests/crash.rs hit the second case;
    // RocksDB's own test of it is disabled (DBWALTest.RecycleMultipleWalsCrash) and its crash
    // test runs without recycling.
    options.set_recycle_log_file_num(0);
    options.set_use_fsync(false);
    options.set_max_background_jobs(2);
    options.set_max_open_files(-1);
    // An L0-to-L1 compaction split in two: L0 drains sooner, so a new key's lookup consults
    // fewer L0 files' filters. Measured at 80M+ records (BENCHMARKS.md, Targets, P7): 17.9 us of
    // CPU per stored record against 21.1-23.9 in four runs without it, the same at 3M.
    options.set_max_subcompactions(2);
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
    options.set_compaction_filter_factory(ExpiryFilterFactory {
        clock: builder.clock.clone(),
    });
    options.set_periodic_compaction_seconds(builder.periodic_compaction_s);
    options
}

/// How many records the expiry filter decides per reading of the clock. Reading it for every
/// record cost 7% of a compaction's CPU at 100M records (`clock_gettime` in the profile); a
/// time up to this many records old only keeps a record that expired meanwhile until the next
/// compaction (reads hide it at its expiry millisecond whatever the filter does).
const RECORDS_PER_CLOCK_READING: u32 = 256;

/// Makes the marker tables' compaction filter, one per compaction (each runs on one thread).
struct ExpiryFilterFactory {
    clock: Arc<dyn Clock>,
}

/// Removes expired records in one compaction ([`compaction_decision`]).
struct ExpiryFilter {
    clock: Arc<dyn Clock>,
    now_ms: u64,
    /// Records left to decide with `now_ms` before the clock is read again.
    left: u32,
}

impl rocksdb::compaction_filter_factory::CompactionFilterFactory for ExpiryFilterFactory {
    type Filter = ExpiryFilter;

    fn create(
        &mut self,
        _context: rocksdb::compaction_filter_factory::CompactionFilterContext,
    ) -> ExpiryFilter {
        ExpiryFilter {
            clock: Arc::clone(&self.clock),
            now_ms: 0,
            left: 0,
        }
    }

    fn name(&self) -> &CStr {
        COMPACTION_FILTER_NAME
    }
}

impl rocksdb::compaction_filter::CompactionFilter for ExpiryFilter {
    fn filter(&mut self, _level: u32, _key: &[u8], value: &[u8]) -> rocksdb::CompactionDecision {
        if self.left == 0 {
            self.now_ms = self.clock.now_ms();
            self.left = RECORDS_PER_CLOCK_READING;
        }
        self.left -= 1;
        match compaction_decision(value, self.now_ms) {
            FilterDecision::Keep => rocksdb::CompactionDecision::Keep,
            FilterDecision::Remove => rocksdb::CompactionDecision::Remove,
        }
    }

    fn name(&self) -> &CStr {
        COMPACTION_FILTER_NAME
    }
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
