//! Every RocksDB option the store depends on, set explicitly: database-wide options, those of
//! every table and of the marker tables (merge operator, the expiry compaction filter), the
//! operator tools' read-only variants, and the compaction filter itself.

use std::ffi::CStr;
use std::sync::Arc;

use rocksdb::{BlockBasedIndexType, BlockBasedOptions, Cache, DBCompressionType, DBRecoveryMode};

use crate::format::clock::Clock;
use crate::format::error::Result;
use crate::format::merge::{MERGE_OPERATOR_NAME, rocksdb_full_merge, rocksdb_partial_merge};
use crate::format::position::{
    POSITION_MERGE_OPERATOR_NAME, rocksdb_position_full_merge, rocksdb_position_partial_merge,
};
use crate::format::ttl::{COMPACTION_FILTER_NAME, FilterDecision, compaction_decision};
use crate::storage::options::{EngineBuilder, OpenMode};

/// The memtable size of every table in [`OpenMode::Admin`]: the largest an application may
/// configure ([`crate::WRITE_BUFFER_BYTES_MAX`]). A memtable that fills while the WAL is
/// replayed is flushed even with `avoid_flush_during_recovery`, so it must hold whatever the
/// application left unflushed; memory is taken only as data is replayed.
pub(crate) const ADMIN_WRITE_BUFFER_BYTES: usize = crate::storage::options::WRITE_BUFFER_BYTES_MAX;

/// The stand-in merge operator's name, written to the OPTIONS file by operator tools for a table
/// whose operator they cannot find ([`set_opaque_merge_operator`]).
pub(crate) const OPAQUE_MERGE_OPERATOR_NAME: &str = "idemdb.opaque";

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
pub(crate) fn admin_db_options() -> Result<rocksdb::Options> {
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
    // fewer L0 files' filters. Measured at 80M+ records (P7; docs/bench/history/
    // 2026-12-04-second-performance-pass.md): 17.9 us of CPU per stored record against
    // 21.1-23.9 in four runs without it, the same at 3M.
    options.set_max_subcompactions(2);
    options
}

/// RocksDB's default ZSTD window (its `CompressionOptions`), passed along with the level.
const ZSTD_WINDOW_BITS: i32 = -14;
/// The ZSTD level of flushes and of the levels above the last, whose files are rewritten soon.
const UPPER_ZSTD_LEVEL: i32 = 1;
/// The last level's ZSTD level (ZSTD's default), where records stay until they expire.
const BOTTOMMOST_ZSTD_LEVEL: i32 = 3;

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
    // ZSTD on every level: a record's random bytes (its key's tail and its fingerprint) do not
    // compress, and ZSTD's entropy coding of the rest takes a stored record of a 16-byte key
    // from 36 bytes to 30 where LZ4's matches could not (BENCHMARKS.md, P7). Above the last
    // level too, at ZSTD's fastest level: with LZ4 there, files holding no expired record
    // stood at 1.85x the same records compacted (P8's first period), and the single claim's and
    // the batch's throughput did not move (history, 2026-12-07).
    options.set_compression_type(DBCompressionType::Zstd);
    options.set_compression_options(ZSTD_WINDOW_BITS, UPPER_ZSTD_LEVEL, 0, 0);
    options.set_bottommost_compression_type(DBCompressionType::Zstd);
    options.set_bottommost_compression_options(ZSTD_WINDOW_BITS, BOTTOMMOST_ZSTD_LEVEL, 0, 0, true);
    options.set_write_buffer_size(builder.write_buffer_bytes);
    if builder.open_mode == OpenMode::Admin {
        options.set_memtable_prefix_bloom_ratio(0.0);
        options.set_write_buffer_size(ADMIN_WRITE_BUFFER_BYTES);
    }
    options.set_level_compaction_dynamic_level_bytes(true);
    options.set_optimize_filters_for_hits(false);
    options
}

/// Options of the `default` table, which holds the store's metadata and the LSN of the commit
/// log's last batch in the tables (`storage/log/replay.rs`). That LSN is put with every group
/// the log writes to the tables: updated in place, it stays one entry of the memtable instead of
/// one more entry per commit in its skiplist (the lone writer's commit measured 1,100
/// instructions fewer). In-place updates need RocksDB's memtable writes to be serial
/// ([`db_options`] makes them so). Their price: this table's iterators get no point-in-time
/// view, and RocksDB then refuses explicit snapshots for the **whole** database
/// (`GetSnapshot` returns none, and a read "at" it reads the latest data). Nothing in the engine
/// takes one (iterators of the other tables keep their implicit point in time): code that needs
/// a consistent view across reads must not reach for `DB::snapshot`. One lock, as the log's
/// applier is the only writer while the store is open.
///
/// Uncompressed: the format marker lives here, and a release built without ZSTD (every release
/// before record format 2) must read it to refuse the store as `IncompatibleStore`; a ZSTD block
/// would fail its read with RocksDB's "unsupported compression" instead. The table holds a few
/// hundred bytes.
pub(crate) fn meta_table_options(builder: &EngineBuilder, cache: &Cache) -> rocksdb::Options {
    let mut options = table_options(builder, cache);
    options.set_compression_type(DBCompressionType::None);
    options.set_bottommost_compression_type(DBCompressionType::None);
    options.set_inplace_update_support(true);
    options.set_inplace_update_locks(1);
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

/// Options of the read-positions table: a merge operator that keeps the highest offset, so
/// that positions written as operands never move backwards; no compaction filter (positions do
/// not expire).
pub(crate) fn positions_table_options(builder: &EngineBuilder, cache: &Cache) -> rocksdb::Options {
    let mut options = table_options(builder, cache);
    options.set_merge_operator(
        POSITION_MERGE_OPERATOR_NAME,
        rocksdb_position_full_merge,
        rocksdb_position_partial_merge,
    );
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

/// How often a read-only open is tried. A live application's flush or compaction may delete a
/// table file between RocksDB's reading of the file list and its opening of the file (RocksDB
/// reports it as an I/O error, a missing file, or a corrupt MANIFEST naming a missing file);
/// the next attempt reads the new list. A store really damaged fails every attempt.
pub(crate) const READ_ONLY_OPEN_ATTEMPTS: u32 = 10;

/// Runs `open` (a read-only open of a store another process may be writing) until it succeeds,
/// fails otherwise than by a file gone meanwhile, or has failed [`READ_ONLY_OPEN_ATTEMPTS`]
/// times.
pub(crate) fn retry_read_only_open<T>(
    mut open: impl FnMut() -> std::result::Result<T, rocksdb::Error>,
) -> std::result::Result<T, rocksdb::Error> {
    let mut attempt = 1;
    loop {
        match open() {
            Err(error)
                if attempt < READ_ONLY_OPEN_ATTEMPTS
                    && matches!(
                        error.kind(),
                        rocksdb::ErrorKind::IOError
                            | rocksdb::ErrorKind::NotFound
                            | rocksdb::ErrorKind::Corruption
                    ) =>
            {
                attempt += 1;
            }
            outcome => return outcome,
        }
    }
}
