//! Opening the store: every check of the declaration against the stored metadata, then
//! RocksDB's open for writing with every table, the commit log's open or retirement, and the
//! metadata an accepted open writes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use rocksdb::{Cache, ColumnFamilyDescriptor, DB, WriteBatch, WriteOptions};

use super::{MarkerTable, OpenDb, RECORDS_TABLE, Storage, TableHandles, VERSIONS_TABLE};
use crate::format::error::{Error, Result};
use crate::format::position::POSITIONS_TABLE;
use crate::storage::latch::Latches;
use crate::storage::options::{Durability, EngineBuilder, MergeOperator, OpenMode};
use crate::storage::rocksdb_options::{
    admin_db_options, db_options, marker_table_options, meta_table_options,
    positions_table_options, set_opaque_merge_operator, table_options,
};
use crate::storage::store_lock::StoreLock;
use crate::storage::store_meta::{
    DeclaredKind, META_FORMAT_KEY, META_MERGE_OPERATOR_PREFIX, META_TABLE_KIND_PREFIX, MetaToWrite,
    STORE_FORMAT_V2, StoredMeta, encode_merge_operator, new_store_meta, stored_merge_operators,
};

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
        let log = match (builder.log_shape(), builder.open_mode) {
            (Some((segments, segment_bytes)), OpenMode::Application) => Some(Arc::new(
                crate::storage::log::logged_writes::LogWriter::open(
                    &builder.path,
                    &db,
                    segments,
                    segment_bytes,
                    builder.durability == Durability::Sync,
                )?,
            )),
            // Without the log (or by an operator tool): a log left by an earlier open goes
            // into RocksDB's WAL first, then away.
            _ => {
                crate::storage::log::replay::retire_log(&builder.path, &db)?;
                None
            }
        };
        let mut write_options = WriteOptions::default();
        write_options.set_sync(builder.durability == Durability::Sync);
        write_options.disable_wal(false);
        // Writes never wait inside RocksDB (`storage/unstalled_write.rs`).
        write_options.set_no_slowdown(true);
        let markers: Vec<MarkerTable> = std::iter::once(RECORDS_TABLE.to_owned())
            .chain(builder.entity_tables.iter().cloned())
            .map(|name| MarkerTable {
                name,
                latches: Latches::new(),
            })
            .collect();
        let open = OpenDb::new(Arc::new(db), |db| {
            TableHandles::of(db, &markers, &builder.business_tables)
        });
        let storage = Storage {
            shrinker: parking_lot::Mutex::new(None),
            shrink_after: builder.commit_log_shrink_after,
            open,
            path: builder.path.clone(),
            clock: builder.clock.clone(),
            retention_ms: builder.retention_ms,
            admission_floor: builder.admission_floor,
            write_options,
            point_reads: rocksdb::ReadOptions::default(),
            sync_writes: builder.durability == Durability::Sync,
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
        if let Some(log) = &storage.log {
            storage.watch_log_growth(log);
        }
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
        (builder.log_shape(), builder.open_mode)
    {
        crate::storage::log::replay::check_new_log_fits(path, segments, segment_bytes)?;
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
            meta_table_options(builder, &cache),
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
        OpenMode::Application if builder.log_shape().is_some() => {
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
    /// Writes the metadata an accepted open found missing (a new store's format marker, or the
    /// current marker over an earlier release's, the kinds of newly declared tables), fsynced
    /// whatever the durability mode: the marker must be durable before any record is.
    fn write_meta(&self, to_write: MetaToWrite) -> Result<()> {
        let meta = self.cf(rocksdb::DEFAULT_COLUMN_FAMILY_NAME);
        let mut batch = WriteBatch::default();
        if to_write.format {
            batch.put_cf(meta, META_FORMAT_KEY, STORE_FORMAT_V2);
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
            // after a crash read them all. With the commit log every table is flushed with it:
            // this table holds the log's LSN, which the open's replay has just advanced, and
            // its files alone would say that the tables hold records the others have only in
            // memory (a crash then lost them: the next open replayed nothing).
            if self.log.is_some() {
                super::flush_all(self.db(), &self.table_names())?;
            } else {
                self.db().flush_cf(meta)?;
            }
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
