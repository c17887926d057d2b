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

use rocksdb::{BottommostLevelCompaction, ColumnFamily, CompactOptions, DB, WriteOptions};

use crate::format::clock::Clock;
use crate::format::error::{Error, Result};
use crate::format::position::POSITIONS_TABLE;
use crate::format::record::{Record, decode_entity_version};
use crate::storage::fault::{FaultInjector, IoPoint};
use crate::storage::latch::Latches;
use crate::storage::observe::ConsumerMetrics;
use crate::storage::options::TableOptions;
use crate::storage::store_lock::StoreLock;
pub(crate) use crate::storage::store_meta::{RECORDS_TABLE, VERSIONS_TABLE};

mod open;
mod positions;
mod write;

use positions::AcceptedOffsets;
pub(crate) use positions::AcceptedPositions;

/// The position of the consumers' records table among the marker tables (`Storage::markers`);
/// entity tables follow it.
pub(crate) const RECORDS_MARKER: usize = 0;

/// The open store: the RocksDB handle, its tables and latches, and the one write path. The
/// engine and every handle, claim and batch hold it through an `Arc`; the store closes when
/// the last one is dropped.
pub(crate) struct Storage {
    /// The thread that gives back the commit log's grown segments once the store is quiet,
    /// while one runs: first, so that it is stopped before the database closes.
    shrinker: parking_lot::Mutex<Option<crate::storage::log::quiet_shrink::Shrinker>>,
    /// How long the store must write nothing before the shrinker gives segments back.
    shrink_after: std::time::Duration,
    open: OpenDb,
    pub(crate) path: PathBuf,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) retention_ms: u64,
    pub(crate) admission_floor: bool,
    write_options: WriteOptions,
    /// The options of a point read (a marker, an entity's version), made once: made for every
    /// read, they cost 260 instructions a claim.
    point_reads: rocksdb::ReadOptions,
    /// Whether every write fsyncs the WAL ([`Durability::Sync`]).
    sync_writes: bool,
    /// The async commits' committer thread, started by the first one.
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
    log: Option<Arc<crate::storage::log::logged_writes::LogWriter>>,
    /// The directory lock, last so that it is released after RocksDB has closed the store.
    _store_lock: StoreLock,
}

self_cell::self_cell!(
    /// The open RocksDB database and the handles of the tables claims read and write, looked up
    /// once: rust-rocksdb finds a handle by searching its map of table names, which the
    /// instruction profile counted at about 210 instructions a lookup, three lookups a claim.
    struct OpenDb {
        // Shared with the shrinker thread, which flushes the tables of a quiet store.
        owner: Arc<DB>,
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
        let Some(value) =
            self.db()
                .get_pinned_cf_opt(self.versions_cf(), version_key, &self.point_reads)?
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
    pub(crate) fn syncs_each_write(&self) -> bool {
        self.sync_writes
    }

    /// The committer of async commits, started on first use.
    pub(crate) fn committer(&self) -> Result<&crate::storage::log::committer::Committer> {
        // With the commit log a second thread applies each group to the tables while the first
        // writes and syncs the next one's records; RocksDB's own WAL has no such halves.
        self.committer.get_or_start(self.log.is_some())
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
        self.io(IoPoint::Flush, |_| {
            flush_all(self.db(), &self.table_names())
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
}

/// Flushes the tables named `tables` of `db` at once (one atomic flush with the commit log).
pub(crate) fn flush_all(db: &DB, tables: &[&str]) -> std::result::Result<(), rocksdb::Error> {
    let handles: Vec<&ColumnFamily> = tables
        .iter()
        .map(|table| {
            db.cf_handle(table)
                .expect("table declared at open is present")
        })
        .collect();
    db.flush_cfs_opt(&handles, &rocksdb::FlushOptions::default())
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
        let Some(value) = self
            .db()
            .get_pinned_cf_opt(cf, stored_key, &self.point_reads)?
        else {
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
