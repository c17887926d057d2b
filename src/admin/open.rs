//! Opening a store as an operator tool: read-only beside a live application, or exclusive,
//! with the tables and their kinds found in the store itself.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rocksdb::{Cache, ColumnFamily, ColumnFamilyDescriptor, DB};

use crate::engine::Engine;
use crate::format::clock::{Clock, SystemClock};
use crate::format::error::{Error, Limit, Result, check_limit_u64};
use crate::format::position::POSITIONS_TABLE;
use crate::storage::log::reader_wal::log_as_wal;
use crate::storage::log::replay::tables_lsn;
use crate::storage::options::{
    EngineBuilder, OpenMode, RETENTION_MS_DEFAULT, RETENTION_MS_MAX, RETENTION_MS_MIN, TableOptions,
};
use crate::storage::rocksdb_options::{
    db_options, marker_table_options, positions_table_options, retry_read_only_open,
    set_opaque_merge_operator, table_options,
};
use crate::storage::store_lock::StoreLock;
use crate::storage::store_meta::{
    DeclaredKind, FormatMarker, RECORDS_TABLE, StoredMeta, VERSIONS_TABLE,
};

/// The block cache of a store opened by a tool, in bytes: tools scan once, so a small cache
/// does as well as a large one.
pub(super) const TOOL_BLOCK_CACHE_BYTES: usize = 8 << 20;

/// How often a read-only open beside an application on the commit log reads the log again
/// when the application flushed and reused the log's segments during the read.
pub(super) const LOG_READ_ATTEMPTS: u32 = 10;

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
    /// idemdb's own bookkeeping: `default` (metadata), `idemdb.versions` (ordering guard) and
    /// `idemdb.positions` (log consumers' read positions).
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

/// Opens a [`Store`]. Defaults: the system clock, the default retention.
#[derive(Clone, Debug)]
#[must_use]
pub struct StoreBuilder {
    pub(super) path: PathBuf,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) retention_ms: u64,
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

    /// Opens the store read-only: no lock is taken and nothing in the store is written, so
    /// this works on a live store. Writes on the result fail with [`Error::ReadOnly`]. It sees
    /// every commit acknowledged before it was called.
    ///
    /// A store whose application runs on the commit log (`EngineBuilder::commit_log`): the
    /// commits the table files do not hold yet are read from the log and handed to RocksDB's
    /// recovery as a WAL file in a temporary directory (of the system's temporary folder,
    /// removed before this returns). Its cost grows with what the log holds after the last
    /// flush, up to the log's size, in time and in memory (the open holds those commits in
    /// memtables).
    ///
    /// # Errors
    /// [`Error::IncompatibleStore`] when the directory holds no idemdb store;
    /// [`Error::Storage`] when RocksDB cannot open it, when the temporary folder cannot be
    /// written, or (kind `Retryable`) when the application flushed and reused its log's
    /// segments during each of 10 reads.
    pub fn open_read_only(self) -> Result<Store> {
        let (_, tables) = discover(&self.path)?;
        let mut builder = EngineBuilder::new(&self.path);
        builder.clock = self.clock.clone();
        let cache = Cache::new_lru_cache(TOOL_BLOCK_CACHE_BYTES);
        let open = |wal_dir: Option<&Path>| {
            open_read_only_db(&self.path, &tables, &builder, &cache, wal_dir)
        };
        // A store on the commit log: the commits after the LSN its table files hold are only in
        // the log (the application writes its tables without RocksDB's WAL). They are handed to
        // another open as a WAL file (without their LSN puts), and that open is kept if its
        // table files hold the same LSN (the application did not flush in between: no record
        // is applied twice); a read during which the log's segments were reused (records may
        // be missing) is refused by `log_as_wal` itself. Else again from the LSN that open found,
        // or from the tables' LSN after a refused read.
        let mut db = open(None)?;
        // Whether `db` holds the table files alone (no record of the log applied).
        let mut clean = true;
        let mut lsn = tables_lsn(&db)?;
        let db = 'read: {
            for attempt in 1..=LOG_READ_ATTEMPTS {
                let last = attempt == LOG_READ_ATTEMPTS;
                match log_as_wal(&self.path, lsn, db.latest_sequence_number()) {
                    Ok(None) if clean => break 'read db,
                    Ok(Some(wal)) => {
                        let with_log = open(Some(wal.dir()))?;
                        let held = tables_lsn(&with_log)?;
                        if held == lsn {
                            break 'read with_log;
                        }
                        (db, clean, lsn) = (with_log, false, held);
                    }
                    Err(error) if last => return Err(error),
                    // Nothing after the LSN, but `db` applied records the tables now hold; or
                    // the log no longer holds the LSN (the application flushed and reused its
                    // segment).
                    Ok(None) | Err(_) if !last => {
                        db = open(None)?;
                        (clean, lsn) = (true, tables_lsn(&db)?);
                    }
                    // The last attempt found the tables moved on: give up.
                    _ => {}
                }
            }
            return Err(Error::Storage {
                kind: crate::format::error::StorageErrorKind::Retryable,
                detail: format!(
                    "the application flushed its commit log during each of \
                     {LOG_READ_ATTEMPTS} reads of it; try again"
                ),
            });
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
    /// until the application's next open. Writes are fsynced before they return. Like the
    /// application's open, it marks a store an earlier release left with the current store
    /// format, whatever it then writes: earlier releases refuse the store from then on.
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
        let retention_ms = self.retention_ms;
        check_limit_u64(
            Limit::RetentionMs,
            retention_ms,
            RETENTION_MS_MIN,
            RETENTION_MS_MAX,
        )?;
        check_store_exists(&self.path)?;
        // The lock before anything is read: a store held by the application is `AlreadyOpen`,
        // whatever else its tables would say.
        let lock = StoreLock::acquire(&self.path)?;
        let (stored, tables) = discover(&self.path)?;
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
        builder.durability = crate::storage::options::Durability::Sync;
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
        let engine = Engine::open_locked(&builder, lock, Some(stored))?;
        Ok(Store {
            path: self.path,
            clock: self.clock,
            tables,
            access: Access::Exclusive(engine),
        })
    }
}

/// RocksDB's read-only open of every table in `tables`, with `wal_dir` as its WAL directory
/// when given (tried again while files vanish under it: `retry_read_only_open`).
fn open_read_only_db(
    path: &Path,
    tables: &[TableInfo],
    builder: &EngineBuilder,
    cache: &Cache,
    wal_dir: Option<&Path>,
) -> Result<DB> {
    let mut options = db_options();
    options.create_if_missing(false);
    options.create_missing_column_families(false);
    // RocksDB opens every table file at open, by default with up to 16 threads started for
    // each table (column family) and joined: on 2 cores about 12 ms of a read-only open of
    // a handful of small files went to that. A tool's open has few files to open; one thread.
    let mut options = options.get_options_from_string("max_file_opening_threads=1")?;
    if let Some(wal_dir) = wal_dir {
        options.set_wal_dir(wal_dir);
    }
    Ok(retry_read_only_open(|| {
        let descriptors = tables.iter().map(|table| {
            let table_options = if table.kind.is_marker() {
                marker_table_options(builder, cache)
            } else if table.name == POSITIONS_TABLE {
                positions_table_options(builder, cache)
            } else {
                let mut options = table_options(builder, cache);
                set_opaque_merge_operator(&mut options, None);
                options
            };
            ColumnFamilyDescriptor::new(table.name.as_str(), table_options)
        });
        DB::open_cf_descriptors_read_only(&options, path, descriptors, false)
    })?)
}

/// Refuses a directory without a RocksDB store, which RocksDB would report as an I/O error about
/// a file.
pub(super) fn check_store_exists(path: &Path) -> Result<()> {
    if path.join("CURRENT").is_file() {
        Ok(())
    } else {
        Err(no_store(path))
    }
}

pub(super) fn no_store(path: &Path) -> Error {
    Error::IncompatibleStore {
        path: path.to_path_buf(),
        reason: "no RocksDB store here (no CURRENT file)".to_owned(),
    }
}

/// Finds the tables of the store at `path` and their kinds, and checks that it is an idemdb
/// store. Reads the metadata through a read-only open of the `default` column family alone,
/// which works beside a live writer.
pub(super) fn discover(path: &Path) -> Result<(StoredMeta, Vec<TableInfo>)> {
    let incompatible = |reason: String| Error::IncompatibleStore {
        path: path.to_path_buf(),
        reason,
    };
    check_store_exists(path)?;
    let meta = StoredMeta::read(path)?.ok_or_else(|| no_store(path))?;
    meta.check_format(path)?;
    if !matches!(meta.format, FormatMarker::Current | FormatMarker::Earlier) {
        // An application's first open that crashed before writing the marker: the tools do
        // not finish it for the application.
        return Err(incompatible(
            "not an idemdb store (no format marker)".to_owned(),
        ));
    }
    let mut tables = Vec::with_capacity(meta.tables.len());
    for name in &meta.tables {
        let kind = if name == rocksdb::DEFAULT_COLUMN_FAMILY_NAME
            || name == VERSIONS_TABLE
            || name == POSITIONS_TABLE
        {
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
    Ok((meta, tables))
}

/// A store opened by an operator tool (see the module documentation).
pub struct Store {
    pub(super) path: PathBuf,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) tables: Vec<TableInfo>,
    pub(super) access: Access,
}

pub(super) enum Access {
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

    pub(super) fn db(&self) -> &DB {
        match &self.access {
            Access::ReadOnly(db) => db,
            Access::Exclusive(engine) => engine.storage().db(),
        }
    }

    pub(super) fn engine(&self) -> Result<&Engine> {
        match &self.access {
            Access::Exclusive(engine) => Ok(engine),
            Access::ReadOnly(_) => Err(Error::ReadOnly),
        }
    }

    pub(super) fn cf(&self, name: &str) -> Result<&ColumnFamily> {
        // Every table discovered was opened; a missing handle means the name is not a table.
        self.db()
            .cf_handle(name)
            .ok_or_else(|| Error::UnknownTable {
                name: name.to_owned(),
                expected: "marker",
            })
    }

    pub(super) fn kind(&self, name: &str) -> Option<TableKind> {
        self.tables
            .iter()
            .find(|table| table.name == name)
            .map(|table| table.kind)
    }

    pub(super) fn marker_tables(&self) -> impl Iterator<Item = &TableInfo> {
        self.tables.iter().filter(|table| table.kind.is_marker())
    }
}
