//! Options for opening an engine: the builder, durability modes and table declarations.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::format::clock::{Clock, SystemClock};
use crate::format::error::{Error, Limit, Result, check_limit, check_limit_u64};
use crate::storage::fault::FaultInjector;

/// The shortest default retention, in milliseconds. Zero would expire records as they are written.
pub const RETENTION_MS_MIN: u64 = 1;
/// The longest retention, in milliseconds (3650 days). Use [`crate::Expiry::Never`] for records
/// that must never expire.
pub const RETENTION_MS_MAX: u64 = 3650 * 24 * 3600 * 1000;
/// The default retention: 7 days, in milliseconds.
pub const RETENTION_MS_DEFAULT: u64 = 7 * 24 * 3600 * 1000;

/// The shortest periodic-compaction interval, in seconds (1 hour).
pub const PERIODIC_COMPACTION_S_MIN: u64 = 3600;
/// The longest periodic-compaction interval, in seconds (365 days).
pub const PERIODIC_COMPACTION_S_MAX: u64 = 365 * 24 * 3600;
/// The default periodic-compaction interval, in seconds (1 day).
pub const PERIODIC_COMPACTION_S_DEFAULT: u64 = 24 * 3600;

/// The smallest block cache, in bytes (1 MiB).
pub const BLOCK_CACHE_BYTES_MIN: usize = 1 << 20;
/// The largest block cache, in bytes (64 GiB).
pub const BLOCK_CACHE_BYTES_MAX: usize = 64 << 30;
/// The default block cache, in bytes (64 MiB), shared by all tables.
pub const BLOCK_CACHE_BYTES_DEFAULT: usize = 64 << 20;

/// The smallest memtable (write buffer) per table, in bytes (1 MiB).
pub const WRITE_BUFFER_BYTES_MIN: usize = 1 << 20;
/// The largest memtable (write buffer) per table, in bytes (1 GiB).
pub const WRITE_BUFFER_BYTES_MAX: usize = 1 << 30;
/// The default memtable (write buffer) per table, in bytes (64 MiB).
pub const WRITE_BUFFER_BYTES_DEFAULT: usize = 64 << 20;
/// The fewest segments of a commit log ([`EngineBuilder::commit_log`]): one being written, one
/// to switch to.
pub const COMMIT_LOG_SEGMENTS_MIN: usize = crate::format::commit_log::LOG_SLOTS_MIN;
/// The most segments of a commit log.
pub const COMMIT_LOG_SEGMENTS_MAX: usize = 1024;
/// The smallest commit-log segment, in bytes (64 KiB).
pub const COMMIT_LOG_SEGMENT_BYTES_MIN: u64 = crate::format::commit_log::LOG_SEGMENT_BYTES_MIN;
/// The largest commit-log segment, in bytes (4 GiB).
pub const COMMIT_LOG_SEGMENT_BYTES_MAX: u64 = 4 << 30;
/// The default commit log's segment, in bytes (4 MiB): a new store's first open writes two
/// ([`EngineBuilder::commit_log`]).
pub const COMMIT_LOG_SEGMENT_BYTES_DEFAULT: u64 = 4 << 20;
/// How long a store writes nothing before its commit log gives back the segments a burst
/// added (10 s; [`EngineBuilder::commit_log_shrink_after`]).
pub const COMMIT_LOG_SHRINK_AFTER_DEFAULT: std::time::Duration = std::time::Duration::from_secs(10);
/// The most labels [`EngineBuilder::metrics_label`] adds to an engine's metrics.
pub const METRICS_LABELS_MAX: usize = 8;
/// The longest value of a label [`EngineBuilder::metrics_label`] adds, in bytes.
pub const METRICS_LABEL_VALUE_BYTES_MAX: usize = 256;

/// The shortest table name, in bytes.
pub const TABLE_NAME_BYTES_MIN: usize = 1;
/// The longest table name, in bytes.
pub const TABLE_NAME_BYTES_MAX: usize = 64;
/// The most tables (business and entity together) one engine declares.
pub const TABLES_MAX: usize = 64;

/// Table names starting with this are reserved for idemdb's own column families.
pub(crate) const RESERVED_TABLE_PREFIX: &str = "idemdb";

/// When a commit returns relative to the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Durability {
    /// The WAL is written and fsynced before `commit` returns: an acknowledged commit survives
    /// a power failure. The default.
    #[default]
    Sync,
    /// The WAL is written (to the OS page cache) before `commit` returns, not fsynced: a commit
    /// survives a process crash but not a power failure until [`crate::Engine::flush_wal`] returns.
    Buffered,
}

/// A user merge function for a business table: `(key, existing value, operands oldest first)`
/// to the new value, or `None` to report a corrupt operand (RocksDB then fails the read).
pub type TableMergeFn = dyn Fn(&[u8], Option<&[u8]>, &[&[u8]]) -> Option<Vec<u8>> + Send + Sync;

/// Declares a business table (a RocksDB column family) that claims can stage writes into.
#[derive(Clone)]
#[must_use]
pub struct TableOptions {
    pub(crate) name: String,
    pub(crate) merge_operator: Option<MergeOperator>,
}

/// A business table's merge operator, as declared.
#[derive(Clone)]
pub(crate) struct MergeOperator {
    pub(crate) name: String,
    pub(crate) merge: Arc<TableMergeFn>,
    /// Whether RocksDB may also combine operands without the base value (partial merge).
    pub(crate) associative: bool,
}

impl TableOptions {
    /// A business table called `name`: 1..=[`TABLE_NAME_BYTES_MAX`] bytes of ASCII letters,
    /// digits, `_`, `-` and `.`, not starting with `idemdb` (reserved). Checked at open.
    pub fn new(name: impl Into<String>) -> TableOptions {
        TableOptions {
            name: name.into(),
            merge_operator: None,
        }
    }

    /// Gives the table a merge operator, so claims can stage `merge` writes into it. The name
    /// (not empty) is recorded when the table is created, and fixed: every later open must
    /// declare the same name, and a table created without an operator cannot gain one (declare
    /// a new table). Default: none (staging a merge into the table is then an
    /// [`Error::NoMergeOperator`]).
    ///
    /// RocksDB calls `merge` only with the base value known (full merges), so operands of one key
    /// accumulate until a read or compaction reaches the base. For an associative operation use
    /// [`TableOptions::associative_merge_operator`] instead.
    pub fn merge_operator(
        self,
        name: impl Into<String>,
        merge: impl Fn(&[u8], Option<&[u8]>, &[&[u8]]) -> Option<Vec<u8>> + Send + Sync + 'static,
    ) -> TableOptions {
        self.with_merge(name.into(), Arc::new(merge), false)
    }

    /// Like [`TableOptions::merge_operator`], for an operation where combining operands first
    /// gives the same result (`merge(merge(v, a), b) == merge(v, merge(None, a, b))`): RocksDB
    /// may then also fold operands without the base (partial merges), so a hot key does not
    /// accumulate operands. [`crate::merge_ops::add_u64`] is such a counter.
    pub fn associative_merge_operator(
        self,
        name: impl Into<String>,
        merge: impl Fn(&[u8], Option<&[u8]>, &[&[u8]]) -> Option<Vec<u8>> + Send + Sync + 'static,
    ) -> TableOptions {
        self.with_merge(name.into(), Arc::new(merge), true)
    }

    fn with_merge(mut self, name: String, merge: Arc<TableMergeFn>, associative: bool) -> Self {
        self.merge_operator = Some(MergeOperator {
            name,
            merge,
            associative,
        });
        self
    }
}

impl fmt::Debug for TableOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TableOptions")
            .field("name", &self.name)
            .field(
                "merge_operator",
                &self.merge_operator.as_ref().map(|operator| &operator.name),
            )
            .finish()
    }
}

/// Builds an [`crate::Engine`]. Every setter documents its default and bounds; all are checked by
/// [`EngineBuilder::open`].
#[derive(Clone, Debug)]
#[must_use]
pub struct EngineBuilder {
    pub(crate) path: PathBuf,
    pub(crate) retention_ms: u64,
    pub(crate) admission_floor: bool,
    pub(crate) durability: Durability,
    pub(crate) business_tables: Vec<TableOptions>,
    pub(crate) entity_tables: Vec<String>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) periodic_compaction_s: u64,
    pub(crate) block_cache_bytes: usize,
    pub(crate) write_buffer_bytes: usize,
    pub(crate) fault_injector: Option<Arc<dyn FaultInjector>>,
    /// Labels added to every metric of this engine, e.g. `partition`, in the order given.
    pub(crate) metrics_labels: Vec<(String, String)>,
    /// [`OpenMode::Admin`] only for the operator tools' open (`crate::admin`).
    pub(crate) open_mode: OpenMode,
    /// The durable path: the commit log of the default shape or of the caller's, or RocksDB's
    /// WAL.
    pub(crate) commit_log: LogChoice,
    /// How long the store writes nothing before the log's grown segments are given back
    /// (`Duration::MAX`: never).
    pub(crate) commit_log_shrink_after: std::time::Duration,
}

/// More than the largest single claim's commit takes in the log: its staged writes and result
/// at their limit (256 MiB), with the batch's encoding and headers around them
/// (`operations::staging` checks it against its limits in a test).
pub(crate) const LARGEST_CLAIM_COMMIT_BYTES: u64 = 320 << 20;

/// What the builder was told of the commit log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LogChoice {
    /// The default: the log, shaped by [`EngineBuilder::default_log_shape`].
    Default,
    /// The log, with (most segments, bytes per segment).
    Shape(usize, u64),
    /// RocksDB's WAL ([`EngineBuilder::without_commit_log`]).
    Off,
}

impl EngineBuilder {
    pub(crate) fn new(path: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder {
            path: path.as_ref().to_path_buf(),
            retention_ms: RETENTION_MS_DEFAULT,
            admission_floor: false,
            durability: Durability::default(),
            business_tables: Vec::new(),
            entity_tables: Vec::new(),
            clock: Arc::new(SystemClock),
            periodic_compaction_s: PERIODIC_COMPACTION_S_DEFAULT,
            block_cache_bytes: BLOCK_CACHE_BYTES_DEFAULT,
            write_buffer_bytes: WRITE_BUFFER_BYTES_DEFAULT,
            fault_injector: None,
            metrics_labels: Vec::new(),
            open_mode: OpenMode::Application,
            commit_log: LogChoice::Default,
            commit_log_shrink_after: COMMIT_LOG_SHRINK_AFTER_DEFAULT,
        }
    }

    /// How long a consumer's completed record is remembered, unless its claim sets its own
    /// expiry. Keep it longer than the broker can redeliver (max deliveries x visibility
    /// timeout, plus message TTL, plus dead-letter resubmission delay).
    /// Default 7 days ([`RETENTION_MS_DEFAULT`]); bounds [`RETENTION_MS_MIN`]..=[`RETENTION_MS_MAX`].
    pub fn retention(mut self, retention: Duration) -> EngineBuilder {
        self.retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// The admission floor: when on, a message whose production time
    /// ([`crate::Message::produced_at_ms`]) is at or before now minus the retention, and whose
    /// key is not recorded, is [`crate::Outcome::TooLate`] instead of new: its record may have
    /// expired already. Default off (such a message is treated as new).
    pub fn admission_floor(mut self, on: bool) -> EngineBuilder {
        self.admission_floor = on;
        self
    }

    /// When commits return relative to the disk. Default [`Durability::Sync`].
    pub fn durability(mut self, durability: Durability) -> EngineBuilder {
        self.durability = durability;
        self
    }

    /// Declares a business table claims can stage writes into. Default: none. At most
    /// [`TABLES_MAX`] tables in all. A store must always be opened with every table it has.
    pub fn business_table(mut self, table: TableOptions) -> EngineBuilder {
        self.business_tables.push(table);
        self
    }

    /// Declares an entity table: a table whose records are themselves the markers (the entity
    /// is inserted if absent; see [`crate::EntityTable`]). Its records never expire unless a
    /// claim sets an expiry. Same naming rules as [`TableOptions::new`]. Default: none.
    pub fn entity_table(mut self, name: impl Into<String>) -> EngineBuilder {
        self.entity_tables.push(name.into());
        self
    }

    /// The clock for timestamps, expiry and the compaction filter. Default [`SystemClock`];
    /// tests inject a [`crate::MockClock`].
    pub fn clock(mut self, clock: impl Clock) -> EngineBuilder {
        self.clock = Arc::new(clock);
        self
    }

    /// How often RocksDB recompacts files that no other compaction touched, so that the
    /// compaction filter also reclaims expired records in cold files. Default 1 day
    /// ([`PERIODIC_COMPACTION_S_DEFAULT`]); bounds
    /// [`PERIODIC_COMPACTION_S_MIN`]..=[`PERIODIC_COMPACTION_S_MAX`] seconds.
    pub fn periodic_compaction(mut self, every: Duration) -> EngineBuilder {
        self.periodic_compaction_s = every.as_secs();
        self
    }

    /// The block cache shared by all tables, in bytes. Default 64 MiB
    /// ([`BLOCK_CACHE_BYTES_DEFAULT`]); bounds [`BLOCK_CACHE_BYTES_MIN`]..=[`BLOCK_CACHE_BYTES_MAX`].
    pub fn block_cache_bytes(mut self, bytes: usize) -> EngineBuilder {
        self.block_cache_bytes = bytes;
        self
    }

    /// The memtable size of each table, in bytes. Default 64 MiB
    /// ([`WRITE_BUFFER_BYTES_DEFAULT`]); bounds [`WRITE_BUFFER_BYTES_MIN`]..=[`WRITE_BUFFER_BYTES_MAX`].
    pub fn write_buffer_bytes(mut self, bytes: usize) -> EngineBuilder {
        self.write_buffer_bytes = bytes;
        self
    }

    /// Adds the label `name="value"` to every metric this engine reports through the
    /// `metrics` facade, beside `consumer` (and `outcome`) and `backend="rocksdb"`. A process that owns several stores,
    /// one per partition, tells their numbers apart this way:
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let engine = idemdb::Engine::builder(dir.path().join("partition-3"))
    ///     .metrics_label("partition", "3") // idemdb_commits_total{consumer="..",partition="3"}
    ///     .open()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// At most [`METRICS_LABELS_MAX`] labels. `name` is a Prometheus label name (an ASCII
    /// letter or `_`, then letters, digits or `_`; not starting with `__`), none of `consumer`,
    /// `outcome` and `backend`, and not given twice; `value` has at most [`METRICS_LABEL_VALUE_BYTES_MAX`]
    /// bytes. Otherwise the open fails with [`Error::InvalidOption`]. The labels are not
    /// stored: each open declares its own.
    pub fn metrics_label(mut self, name: &str, value: &str) -> EngineBuilder {
        self.metrics_labels
            .push((name.to_owned(), value.to_owned()));
        self
    }

    /// Shapes the commit log: up to `segments` files of `segment_bytes` each in
    /// `<store>/idemdb-log`, rewritten in place as a ring. Commits are made durable there
    /// instead of RocksDB's write-ahead log, which the store's tables then do without. The log
    /// is the default; without this call its segments are [`COMMIT_LOG_SEGMENT_BYTES_DEFAULT`]
    /// and it may grow to as many as hold every table's write buffer
    /// ([`EngineBuilder::write_buffer_bytes`]) twice over, and to at least 320 MiB, so that
    /// any single claim's commit fits (with 64 MiB buffers and no declared table: 96 segments,
    /// 384 MiB). [`EngineBuilder::without_commit_log`] opts out: RocksDB's WAL, into which a
    /// store replays its log and removes it.
    ///
    /// Why: a sync of a file rewritten in place writes data only, where RocksDB's growing WAL
    /// also journals its new size; with `Durability::Sync` the records go out as direct writes
    /// (`O_DIRECT | O_DSYNC`, whole 4 KiB blocks) where the file system takes them and
    /// `segment_bytes` is a multiple of 4 KiB, else as a write and an `fdatasync`; groups of
    /// commits are pipelined (one group synced while the one before it is applied to the
    /// tables). Measured in BENCHMARKS.md
    /// ("The commit log"): durable commits from one thread, 32 threads and async batches with
    /// several in flight all faster than on RocksDB's WAL. The guarantees are the same:
    /// `Durability::Sync` survives power loss, `Buffered` a process crash, batches are never
    /// torn, and the operator tools' read-only open beside the application sees every
    /// acknowledged commit.
    ///
    /// What it costs: the segments' bytes of disk, each written (with zeros) and synced when
    /// it is made: [`COMMIT_LOG_SEGMENTS_MIN`] of them at the first open with the log; when a
    /// segment switch leaves no segment free, one more is made on a thread of its own (before
    /// a commit goes into it; a commit that needs it sooner waits for it) while the ring has
    /// fewer than `segments` and the disk has room for it and then for as many bytes again
    /// (what flushing the ring's records writes, at most); once it has them all (or the disk
    /// has no such room), the commit that needs room flushes every table first (the records in
    /// the tables' files no longer need the log). A commit larger than a segment gets a free
    /// segment enlarged to its size (or, with none free, one more segment, beyond `segments`
    /// if need be), which takes no commit after it and is cut back (or removed) once the
    /// tables hold it; such commits take at most as much again as the ring's most before the
    /// tables are flushed for them. One larger than the whole log is refused
    /// ([`Error::InvalidArgument`]: the log holds `segments` x (`segment_bytes` less 32 bytes
    /// of header), and a commit takes 24 bytes of record header besides its write batch's
    /// encoding). Segments: [`COMMIT_LOG_SEGMENTS_MIN`]..=
    /// [`COMMIT_LOG_SEGMENTS_MAX`] of [`COMMIT_LOG_SEGMENT_BYTES_MIN`]..=
    /// [`COMMIT_LOG_SEGMENT_BYTES_MAX`] bytes ([`Error::LimitExceeded`] otherwise, at open); a
    /// new log whose first segments are larger than the free space of the store's file system
    /// is refused before anything is written ([`Error::Storage`] of kind `NoSpace`). The
    /// segments' size is fixed when the log is made; a later open may let the ring grow to
    /// more segments, not fewer: it keeps those it has (open once without the log, then with
    /// it, to make it anew).
    ///
    /// ```
    /// use idemdb::{Durability, Engine, Fingerprint, Outcome};
    ///
    /// let dir = tempfile::tempdir()?;
    /// let engine = Engine::builder(dir.path())
    ///     .durability(Durability::Sync)
    ///     .commit_log(4, 1 << 20) // 4 segments of 1 MiB
    ///     .open()?;
    /// let orders = engine.consumer("orders")?;
    /// if let Outcome::Fresh(claim) = orders.begin("m-1", Fingerprint::of(b"m-1"))? {
    ///     claim.commit(b"done")?; // durable in the log when this returns
    /// }
    /// drop(orders);
    /// drop(engine); // the tables are not flushed at close: the next open replays the log
    /// let engine = Engine::builder(dir.path()).commit_log(4, 1 << 20).open()?;
    /// let orders = engine.consumer("orders")?;
    /// assert!(matches!(
    ///     orders.begin("m-1", Fingerprint::of(b"m-1"))?,
    ///     Outcome::Duplicate { .. }
    /// ));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn commit_log(mut self, segments: usize, segment_bytes: u64) -> EngineBuilder {
        self.commit_log = LogChoice::Shape(segments, segment_bytes);
        self
    }

    /// Makes commits durable in RocksDB's write-ahead log instead of the commit log
    /// ([`EngineBuilder::commit_log`], the default): for file systems or operators that need
    /// RocksDB's own WAL (its tools, its replication, a file system where rewriting a file in
    /// place is not cheaper than appending to it). A store that has a commit log replays it
    /// into RocksDB's WAL at this open and removes it; a later open without this call makes a
    /// new one. The guarantees are the same on either path.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// let engine = idemdb::Engine::builder(dir.path()).without_commit_log().open()?;
    /// # drop(engine);
    /// assert!(!dir.path().join("idemdb-log").exists());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn without_commit_log(mut self) -> EngineBuilder {
        self.commit_log = LogChoice::Off;
        self
    }

    /// Gives back the commit log's grown segments once the store has written nothing for
    /// `quiet` (default [`COMMIT_LOG_SHRINK_AFTER_DEFAULT`], 10 s): the ring returns to the two
    /// segments of a new log, so that a store whose burst grew it does not keep that disk
    /// space while idle. `Duration::MAX` keeps them (a store whose bursts come back soon saves
    /// making them again).
    ///
    /// How: when a write grows the ring (more segments, one made ahead of need, or one enlarged
    /// for a large commit), or an open finds it grown, the store starts a thread that wakes
    /// once per `quiet` (wall-clock time, whatever the engine's clock); after a whole period
    /// without a write it flushes every table (their files then hold every commit, so no
    /// segment is needed for recovery), moves the log's end into one of the first two
    /// segments, removes the others, cuts an enlarged one back, and syncs the directory. A
    /// commit that comes
    /// meanwhile puts it off to the next quiet period; the thread ends once the ring is back to
    /// two segments, so idle stores run none. The flush writes the memtables' contents to
    /// table files a little earlier than RocksDB would have.
    ///
    /// A zero `quiet` is refused at open ([`Error::InvalidOption`]).
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let dir = tempfile::tempdir()?;
    /// let engine = idemdb::Engine::builder(dir.path())
    ///     .commit_log_shrink_after(Duration::from_secs(60))
    ///     .open()?;
    /// # drop(engine);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn commit_log_shrink_after(mut self, quiet: std::time::Duration) -> EngineBuilder {
        self.commit_log_shrink_after = quiet;
        self
    }

    /// The commit log this open runs with, (most segments, bytes per segment), or `None` for
    /// RocksDB's WAL.
    pub(crate) fn log_shape(&self) -> Option<(usize, u64)> {
        match self.commit_log {
            LogChoice::Default => Some(self.default_log_shape()),
            LogChoice::Shape(segments, segment_bytes) => Some((segments, segment_bytes)),
            LogChoice::Off => None,
        }
    }

    /// The default log: segments of [`COMMIT_LOG_SEGMENT_BYTES_DEFAULT`], at most as many as
    /// hold every table's write buffer twice over (the tables flush together once one of them
    /// fills its buffer, so the log rarely fills first; twice for the buffers being flushed
    /// while the next fill), and never fewer than take the largest single claim's commit (its
    /// staged writes and its result at their limits), so that no commit RocksDB's WAL takes
    /// is refused for the log's size.
    pub(crate) fn default_log_shape(&self) -> (usize, u64) {
        // The records, versions and positions tables, and those declared.
        let tables = 3 + self.business_tables.len() + self.entity_tables.len();
        let buffers = 2 * (self.write_buffer_bytes as u64) * tables as u64;
        let room = COMMIT_LOG_SEGMENT_BYTES_DEFAULT
            - crate::format::commit_log::LOG_SEGMENT_HEADER_BYTES as u64;
        let segments = buffers.max(LARGEST_CLAIM_COMMIT_BYTES).div_ceil(room);
        (
            usize::try_from(segments)
                .unwrap_or(usize::MAX)
                .clamp(COMMIT_LOG_SEGMENTS_MIN, COMMIT_LOG_SEGMENTS_MAX),
            COMMIT_LOG_SEGMENT_BYTES_DEFAULT,
        )
    }

    /// Installs a fault injector: before each of its I/O calls the engine asks it whether to
    /// fail the call (see [`crate::FaultInjector`]). For testing failure handling, ours and
    /// yours. Default: none.
    pub fn fault_injector(mut self, injector: impl FaultInjector) -> EngineBuilder {
        self.fault_injector = Some(Arc::new(injector));
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.path.as_os_str().is_empty() {
            return Err(Error::invalid_option("the store path is empty"));
        }
        if self.commit_log_shrink_after.is_zero() {
            return Err(Error::invalid_option(
                "commit_log_shrink_after must be longer than zero (Duration::MAX keeps the \
                 segments)",
            ));
        }
        if let LogChoice::Shape(segments, segment_bytes) = self.commit_log {
            check_limit_u64(
                Limit::CommitLogSegments,
                u64::try_from(segments).unwrap_or(u64::MAX),
                COMMIT_LOG_SEGMENTS_MIN as u64,
                COMMIT_LOG_SEGMENTS_MAX as u64,
            )?;
            check_limit_u64(
                Limit::CommitLogSegmentBytes,
                segment_bytes,
                COMMIT_LOG_SEGMENT_BYTES_MIN,
                COMMIT_LOG_SEGMENT_BYTES_MAX,
            )?;
        }
        check_limit_u64(
            Limit::RetentionMs,
            self.retention_ms,
            RETENTION_MS_MIN,
            RETENTION_MS_MAX,
        )?;
        check_limit_u64(
            Limit::PeriodicCompactionS,
            self.periodic_compaction_s,
            PERIODIC_COMPACTION_S_MIN,
            PERIODIC_COMPACTION_S_MAX,
        )?;
        check_limit(
            Limit::BlockCacheBytes,
            self.block_cache_bytes,
            BLOCK_CACHE_BYTES_MIN,
            BLOCK_CACHE_BYTES_MAX,
        )?;
        check_limit(
            Limit::WriteBufferBytes,
            self.write_buffer_bytes,
            WRITE_BUFFER_BYTES_MIN,
            WRITE_BUFFER_BYTES_MAX,
        )?;
        self.validate_metrics_labels()?;
        let names: Vec<&str> = self.table_names().collect();
        check_limit(Limit::Tables, names.len(), 0, TABLES_MAX)?;
        for table in &self.business_tables {
            if let Some(operator) = &table.merge_operator
                && operator.name.is_empty()
            {
                return Err(Error::invalid_option(format!(
                    "the merge operator of table {:?} has an empty name",
                    table.name
                )));
            }
        }
        for (index, name) in names.iter().enumerate() {
            check_table_name(name)?;
            if names[..index].contains(name) {
                return Err(Error::invalid_option(format!(
                    "table {name:?} is declared twice"
                )));
            }
        }
        Ok(())
    }

    fn validate_metrics_labels(&self) -> Result<()> {
        if self.metrics_labels.len() > METRICS_LABELS_MAX {
            return Err(Error::invalid_option(format!(
                "{} metrics labels; at most {METRICS_LABELS_MAX}",
                self.metrics_labels.len()
            )));
        }
        for (index, (name, value)) in self.metrics_labels.iter().enumerate() {
            let mut chars = name.chars();
            let well_formed = chars
                .next()
                .is_some_and(|first| first.is_ascii_alphabetic() || first == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with("__");
            if !well_formed {
                return Err(Error::invalid_option(format!(
                    "metrics label name {name:?} is not a Prometheus label name"
                )));
            }
            // The engine sets these itself; a second one would make the series ambiguous.
            if ["consumer", "outcome", "backend"].contains(&name.as_str()) {
                return Err(Error::invalid_option(format!(
                    "metrics label {name:?} is set by the engine"
                )));
            }
            if self.metrics_labels[..index].iter().any(|(n, _)| n == name) {
                return Err(Error::invalid_option(format!(
                    "metrics label {name:?} is given twice"
                )));
            }
            if value.len() > METRICS_LABEL_VALUE_BYTES_MAX {
                return Err(Error::invalid_option(format!(
                    "the value of metrics label {name:?} has {} bytes; at most \
                     {METRICS_LABEL_VALUE_BYTES_MAX}",
                    value.len()
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn table_names(&self) -> impl Iterator<Item = &str> {
        self.business_tables
            .iter()
            .map(|table| table.name.as_str())
            .chain(self.entity_tables.iter().map(String::as_str))
    }
}

/// Table names become RocksDB column-family names: they are persisted, shown by tools and passed
/// through C strings, so they are kept to a plain, printable alphabet.
fn check_table_name(name: &str) -> Result<()> {
    check_limit(
        Limit::TableNameBytes,
        name.len(),
        TABLE_NAME_BYTES_MIN,
        TABLE_NAME_BYTES_MAX,
    )?;
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if !name.chars().all(allowed) {
        return Err(Error::invalid_option(format!(
            "table name {name:?} may hold only ASCII letters, digits, '_', '-' and '.'"
        )));
    }
    if name.starts_with(RESERVED_TABLE_PREFIX) || name == rocksdb::DEFAULT_COLUMN_FAMILY_NAME {
        return Err(Error::invalid_option(format!(
            "table name {name:?} is reserved (names starting with {RESERVED_TABLE_PREFIX:?}, \
             and \"default\")"
        )));
    }
    Ok(())
}

/// How a store is opened (`EngineBuilder::open_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpenMode {
    /// An application's open: creates the store and any missing table.
    Application,
    /// An operator tool's exclusive open of an existing store, with every table it holds
    /// declared and business tables given a stand-in for their (unknown) merge operators
    /// (`rocksdb_options::set_opaque_merge_operator`). Nothing is created, business tables are never
    /// compacted, and recovery does not flush (`rocksdb_options::admin_db_options`). Memtables are
    /// `rocksdb_options::ADMIN_WRITE_BUFFER_BYTES`, so replaying the WAL does not fill one either, and have no
    /// bloom filter, which would be allocated up front at that size.
    Admin,
}
