//! The handles on top: [`Engine`] (open, flush, compact, counts), [`Consumer`] and
//! [`EntityTable`]; the engine also hands out [`BusinessTable`] handles. Each holds the open
//! store ([`Storage`]) and calls the operations below it (claims, batches, leases).

use std::path::Path;
use std::sync::Arc;

use rocksdb::IteratorMode;

use crate::consumer::Consumer;
use crate::format::error::{Error, Result};
use crate::format::fingerprint::Fingerprint;
use crate::format::key::{StoredKey, check_message_key, consumer_prefix};
use crate::format::record::{Record, Standing};
use crate::operations::claim::{Expiry, Outcome, Request, begin};
use crate::storage::business_table::BusinessTable;
use crate::storage::observe::{ConsumerMetrics, Stats};
use crate::storage::options::{EngineBuilder, OpenMode};
use crate::storage::store::{RECORDS_MARKER, Storage};
use crate::storage::store_lock::StoreLock;
use crate::storage::store_meta::{self, StoredMeta};

/// The embedded dedup store. Cheap to clone (an `Arc`); every handle keeps the store open, and it
/// closes when the last clone and handle are dropped, and the last commit handed to the
/// committer (by a [`crate::Pipeline`] or `commit_async`, whose pipeline or future may be gone)
/// is written.
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
    inner: Arc<Storage>,
}

impl EngineBuilder {
    /// Validates the options and opens (or creates) the store, creating its directory (and
    /// missing parents) if needed, unless the path goes through `..`.
    ///
    /// An open that is refused changes nothing in the store: every check below runs before
    /// RocksDB opens it for writing. A business table's merge operator is fixed when the table
    /// is created; declare it as before on every open.
    ///
    /// # Errors
    /// The refusals come in this order: [`Error::LimitExceeded`] or [`Error::InvalidOption`]
    /// for bad options; [`Error::AlreadyOpen`] when another process, or another `Engine` or
    /// exclusive operator tool here, holds the store, through whatever path;
    /// [`Error::IncompatibleStore`] when the directory is not a matching idemdb store (a table
    /// of the store undeclared or declared as another kind, a merge operator changed, added or
    /// removed, a foreign format). [`Error::Storage`] for RocksDB and file-system failures, at
    /// any step (the directory cannot be created or opened, say).
    pub fn open(self) -> Result<Engine> {
        self.validate()?;
        if self.open_mode == OpenMode::Application {
            if let (Some((segments, segment_bytes)), false) = (self.log_shape(), self.path.exists())
            {
                // Before the directory is made: a refusal for the log's size creates nothing.
                // (An existing store is checked once it is locked and its metadata read, so
                // that a held one is `AlreadyOpen` first.)
                crate::storage::log::replay::check_new_log_fits(
                    &self.path,
                    segments,
                    segment_bytes,
                )?;
            }
            create_store_directory(&self.path)?;
        }
        // The lock before anything is read: a held store is `AlreadyOpen` whatever else is
        // wrong with the declaration.
        let lock = StoreLock::acquire(&self.path)?;
        let stored = StoredMeta::read(&self.path)?;
        // A new store is created under a marker (written by `Storage::open` once every check
        // has passed), removed here when the store is complete.
        let creating = match &stored {
            None => self.open_mode == OpenMode::Application,
            Some(stored) => stored.creation_interrupted,
        };
        let engine = Engine::open_locked(&self, lock, stored)?;
        if creating {
            store_meta::finish_creation(&self.path)?;
        }
        Ok(engine)
    }
}

/// Creates the store directory and its missing parents, unless it exists. A path through `..`
/// is not created: `store/missing/..` names no directory until `missing` exists, and creating
/// `missing` would put a stray directory into whatever `..` leads to (the store itself, say)
/// before the open could be refused.
fn create_store_directory(path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    if path
        .components()
        .any(|component| component == std::path::Component::ParentDir)
    {
        let missing = std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the path does not exist, and a path through `..` is not created; give it without `..`",
        );
        return Err(Error::io("creating the store directory", &missing));
    }
    // Each directory created here is an entry in its parent, durable only once the parent is
    // fsynced: without that, a power cut can take the whole new store, commits acknowledged
    // as durable included (the power-cut harness in tests/crash.rs found this).
    let mut created = Vec::new();
    let mut missing = Some(path);
    while let Some(dir) = missing.filter(|dir| !dir.as_os_str().is_empty() && !dir.exists()) {
        created.push(dir);
        missing = dir.parent();
    }
    std::fs::create_dir_all(path)
        .and_then(|()| {
            created
                .iter()
                .filter_map(|dir| dir.parent())
                .filter(|parent| !parent.as_os_str().is_empty())
                .try_for_each(crate::storage::directory::sync_directory)
        })
        .map_err(|error| Error::io("creating the store directory", &error))
}

impl Engine {
    /// Opens the store under a directory lock the caller holds, with the metadata the caller
    /// read under it (the operator tools read it to find the tables). See [`Storage::open`].
    pub(crate) fn open_locked(
        builder: &EngineBuilder,
        lock: StoreLock,
        stored: Option<StoredMeta>,
    ) -> Result<Engine> {
        Ok(Engine {
            inner: Arc::new(Storage::open(builder, lock, stored)?),
        })
    }

    /// Starts building an engine over the store directory `path` (created if missing).
    pub fn builder(path: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder::new(path)
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
                    let metrics = Arc::new(ConsumerMetrics::new(
                        consumer_id,
                        &self.inner.metrics_labels,
                    ));
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
            write_batches: self.inner.write_batches(),
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
    /// [`crate::Durability::Buffered`]; with [`crate::Durability::Sync`] each commit already is.
    ///
    /// # Errors
    /// [`Error::Poisoned`] if an earlier write failed; a failure here poisons the engine too.
    pub fn flush_wal(&self) -> Result<()> {
        self.inner.sync_wal()
    }

    /// Writes a consistent copy of the store, while it is in use, to the new directory `dir`
    /// (on the same file system, table files are hard links, so a checkpoint costs little
    /// space until compaction rewrites them). The copy holds every commit acknowledged before
    /// the call and possibly some made during it, each whole: a claim's marker and its staged
    /// writes are in the copy together or not at all. It is a store of its own: open it with
    /// the same declaration as this one (a backup, or the seed of a moved partition). A
    /// restored copy lacks every commit made after it: a redelivery of such a message is
    /// processed again unless the admission floor refuses it (`EngineBuilder::admission_floor`).
    ///
    /// ```
    /// use idemdb::{Engine, Fingerprint, Outcome};
    /// let dir = tempfile::tempdir()?;
    /// let engine = Engine::builder(dir.path().join("store")).open()?;
    /// let billing = engine.consumer("billing")?;
    /// if let Outcome::Fresh(claim) = billing.begin(b"order-1", Fingerprint::of(b"body"))? {
    ///     claim.commit(b"charged")?;
    /// }
    /// engine.checkpoint(dir.path().join("backup"))?;
    /// let copy = Engine::builder(dir.path().join("backup")).open()?;
    /// assert!(copy.consumer("billing")?.get(b"order-1")?.is_some());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `dir` exists already; [`Error::Poisoned`] after a failed
    /// write; [`Error::Storage`] if RocksDB cannot write the copy (nothing of the store
    /// changes then, and the engine is not poisoned).
    pub fn checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.inner.checkpoint(dir.as_ref())
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
        self.inner.flush_tables()
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
            self.inner.compact_marker(marker)?;
        }
        Ok(())
    }

    /// The open store, for the operator tools (`crate::admin`).
    pub(crate) fn storage(&self) -> &Storage {
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
        let cf = self.inner.marker_cf(RECORDS_MARKER);
        for entry in self.inner.db().iterator_cf(cf, IteratorMode::Start) {
            let (_, value) = entry?;
            let counter = match Record::decode(&value).map(|record| record.standing_at(now_ms)) {
                Ok(Standing::Live) => &mut counts.live,
                Ok(Standing::Expired) => &mut counts.expired,
                Ok(Standing::InProgress) => &mut counts.in_progress,
                Ok(Standing::Released) => &mut counts.released,
                Err(_) => &mut counts.corrupt,
            };
            *counter += 1;
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

/// A table whose records are themselves the markers: `begin(entity_key)` inserts the
/// entity if absent, and a second insert of the same key is a duplicate or a conflict.
/// The committed result *is* the entity. Records never expire unless the claim sets an expiry.
#[derive(Clone)]
pub struct EntityTable {
    inner: Arc<Storage>,
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
            stored_key: StoredKey::from_slice(entity_key),
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
