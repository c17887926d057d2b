//! RocksDB options evaluated on idemdb's own access patterns, on raw RocksDB so that each option
//! can be switched alone: the durable write path (wal-options) and the lookups of new and
//! duplicate keys (read-options). Each run interleaves the variants and reports medians.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use rocksdb::{DB, WriteBatch, WriteOptions};

use crate::workloads::{Delivery, SplitMix64, elapsed_ns, median, quantile};

#[derive(Args, Clone)]
pub struct WalArgs {
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long, default_value = "docs/bench")]
    pub out: PathBuf,
}

impl WalArgs {
    pub fn defaults(out: PathBuf) -> WalArgs {
        WalArgs {
            seconds: 2.0,
            rounds: 3,
            out,
        }
    }
}

/// One option set's medians per thread count: (threads, msg/s, p50 us).
pub struct WalRow {
    pub name: &'static str,
    pub by_threads: Vec<(usize, f64, f64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WalVariant {
    /// idemdb's other options, `sync = true` per write: RocksDB groups concurrent writers and
    /// one leader writes and fsyncs the WAL for the group.
    Baseline,
    PipelinedWrite,
    RecycleLogs,
    NoAdaptiveYield,
    LargeWriteGroups,
    SerialMemtableWrites,
    /// What idemdb keeps: serial memtable writes. (Recycled WAL files were kept too, until the
    /// power cuts of tests/crash.rs showed a store could then fail to open; docs/design.md.)
    IdemdbChoice,
    /// `manual_wal_flush`, writes with `sync = false`, and a group commit of our own: the first
    /// waiter calls `flush_wal(true)` for everyone written before it started; the next group
    /// forms while it syncs.
    ManualFlushGroupCommit,
}

impl WalVariant {
    const ALL: [WalVariant; 8] = [
        WalVariant::Baseline,
        WalVariant::PipelinedWrite,
        WalVariant::RecycleLogs,
        WalVariant::NoAdaptiveYield,
        WalVariant::LargeWriteGroups,
        WalVariant::SerialMemtableWrites,
        WalVariant::ManualFlushGroupCommit,
        WalVariant::IdemdbChoice,
    ];

    fn name(self) -> &'static str {
        match self {
            WalVariant::Baseline => "sync writes, RocksDB's write-path defaults",
            WalVariant::PipelinedWrite => "+ enable_pipelined_write",
            WalVariant::RecycleLogs => "+ recycle_log_file_num = 4",
            WalVariant::NoAdaptiveYield => "+ enable_write_thread_adaptive_yield = false",
            WalVariant::LargeWriteGroups => "+ max_write_batch_group_size_bytes = 16 MiB",
            WalVariant::SerialMemtableWrites => "+ allow_concurrent_memtable_write = false",
            WalVariant::IdemdbChoice => "idemdb: + serial memtable writes",
            WalVariant::ManualFlushGroupCommit => "manual_wal_flush + own group commit",
        }
    }

    fn options(self) -> Result<rocksdb::Options> {
        let mut options = crate::contenders::embedded::base_db_options();
        match self {
            WalVariant::Baseline | WalVariant::ManualFlushGroupCommit => {}
            WalVariant::PipelinedWrite => options.set_enable_pipelined_write(true),
            WalVariant::RecycleLogs => options.set_recycle_log_file_num(4),
            WalVariant::NoAdaptiveYield => options.set_enable_write_thread_adaptive_yield(false),
            WalVariant::SerialMemtableWrites => options.set_allow_concurrent_memtable_write(false),
            WalVariant::IdemdbChoice => options = crate::contenders::embedded::db_options(),
            WalVariant::LargeWriteGroups => {
                options = rocksdb::Options::get_options_from_string(
                    &mut options,
                    "max_write_batch_group_size_bytes=16777216",
                )?;
            }
        }
        if self == WalVariant::ManualFlushGroupCommit {
            options.set_manual_wal_flush(true);
        }
        Ok(options)
    }
}

/// Leader/follower group commit over `flush_wal(true)`.
#[derive(Default)]
struct GroupCommit {
    state: Mutex<GroupState>,
    synced: Condvar,
}

#[derive(Default)]
struct GroupState {
    /// Writes that returned from `DB::write` (numbered from 1).
    written: u64,
    /// Every write numbered up to this is durable.
    synced: u64,
    syncing: bool,
}

impl GroupCommit {
    fn written(&self) -> u64 {
        let mut state = self.state.lock().expect("group commit");
        state.written += 1;
        state.written
    }

    fn wait_durable(&self, db: &DB, ticket: u64) -> Result<()> {
        let mut state = self.state.lock().expect("group commit");
        loop {
            if state.synced >= ticket {
                return Ok(());
            }
            if state.syncing {
                state = self.synced.wait(state).expect("group commit");
                continue;
            }
            // Lead the next group: it covers every write that returned before this point.
            state.syncing = true;
            let target = state.written;
            drop(state);
            let outcome = db.flush_wal(true);
            state = self.state.lock().expect("group commit");
            state.syncing = false;
            if outcome.is_ok() {
                state.synced = state.synced.max(target);
            }
            self.synced.notify_all();
            outcome?;
        }
    }
}

pub fn wal_options(args: &WalArgs) -> Result<Vec<WalRow>> {
    let threads_list = [1usize, 8, 32];
    let duration = Duration::from_secs_f64(args.seconds);
    // samples[variant][threads] = per-round (msg/s, p50 us)
    let mut samples =
        vec![vec![Vec::<(f64, f64)>::new(); threads_list.len()]; WalVariant::ALL.len()];
    let root = tempfile::Builder::new().prefix("idemdb-wal-").tempdir()?;
    for round in 0..args.rounds {
        for (v, variant) in WalVariant::ALL.iter().enumerate() {
            for (t, &threads) in threads_list.iter().enumerate() {
                let dir = root.path().join(format!("{round}-{v}-{t}"));
                let (per_second, p50) = wal_run(*variant, &dir, threads, duration)
                    .with_context(|| format!("{} with {threads} threads", variant.name()))?;
                std::fs::remove_dir_all(&dir)?;
                eprintln!(
                    "wal-options round {}: {:<48} {threads:>2} threads {per_second:>8.0} msg/s p50 {p50:>7.0} us",
                    round + 1,
                    variant.name()
                );
                samples[v][t].push((per_second, p50));
            }
        }
    }
    Ok(WalVariant::ALL
        .iter()
        .zip(samples)
        .map(|(variant, by_threads)| WalRow {
            name: variant.name(),
            by_threads: threads_list
                .iter()
                .zip(by_threads)
                .map(|(&threads, rounds)| {
                    let mut rate: Vec<f64> = rounds.iter().map(|r| r.0).collect();
                    let mut p50: Vec<f64> = rounds.iter().map(|r| r.1).collect();
                    (threads, median(&mut rate), median(&mut p50))
                })
                .collect(),
        })
        .collect())
}

/// Writes before a timed run: about 9 MB of WAL.
const WARM_UP_WRITES: u64 = 60_000;

fn wal_run(
    variant: WalVariant,
    dir: &Path,
    threads: usize,
    duration: Duration,
) -> Result<(f64, f64)> {
    let options = variant.options()?;
    let db = Arc::new(DB::open(&options, dir)?);
    // Steady state, as in a store that has run for a while: the first WAL has filled, its
    // memtable was flushed, and the WAL file is obsolete (recycled where the options say so).
    let mut warm = WriteOptions::default();
    warm.set_sync(false);
    // Two flushes: the first makes the first WAL obsolete, the second switches to a new WAL,
    // which is where a recycled file would be taken.
    for pass in 0..2u64 {
        for n in 0..WARM_UP_WRITES {
            let mut batch = WriteBatch::default();
            batch.put((pass * WARM_UP_WRITES + n).to_be_bytes(), [0u8; 110]);
            db.write_opt(batch, &warm)?;
        }
        db.flush_wal(true)?;
        db.flush()?;
    }
    let group = Arc::new(GroupCommit::default());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|thread| {
            let (db, group, stop) = (db.clone(), group.clone(), stop.clone());
            std::thread::spawn(move || -> Result<(u64, Vec<u32>)> {
                let mut write_options = WriteOptions::default();
                write_options.set_sync(variant != WalVariant::ManualFlushGroupCommit);
                let mut rng = SplitMix64(thread as u64);
                let mut latencies = Vec::new();
                let mut count = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut key = [0u8; 16];
                    key[..8].copy_from_slice(&rng.next().to_be_bytes());
                    let delivery = Delivery { key };
                    let call = Instant::now();
                    let mut batch = WriteBatch::default();
                    batch.put(delivery.peer_key(), [1u8; 46]);
                    batch.put(delivery.key, delivery.value());
                    db.write_opt(batch, &write_options)?;
                    if variant == WalVariant::ManualFlushGroupCommit {
                        let ticket = group.written();
                        group.wait_durable(&db, ticket)?;
                    }
                    latencies.push(elapsed_ns(call));
                    count += 1;
                }
                Ok((count, latencies))
            })
        })
        .collect();
    std::thread::sleep(duration);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut messages = 0;
    let mut all = Vec::new();
    for handle in handles {
        let (count, latencies) = handle.join().expect("writer thread")?;
        messages += count;
        all.extend(latencies);
    }
    let elapsed = started.elapsed();
    all.sort_unstable();
    Ok((
        messages as f64 / elapsed.as_secs_f64(),
        quantile(&all, 0.5) / 1000.0,
    ))
}

#[derive(Args, Clone)]
pub struct ReadArgs {
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Keys stored before the lookups (flushed to table files for the table-file workloads).
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    #[arg(long, default_value = "docs/bench")]
    pub out: PathBuf,
}

impl ReadArgs {
    pub fn defaults(out: PathBuf) -> ReadArgs {
        ReadArgs {
            seconds: 2.0,
            rounds: 3,
            keys: 1_000_000,
            out,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadVariant {
    /// One filter block per table file, in the block cache: what idemdb had first.
    WholeFilters,
    /// Whole-key bloom filters in table files only (10 bits per key), partitioned.
    TableBloom,
    /// What idemdb keeps: partitioned filters and a memtable bloom filter.
    MemtableBloom,
    /// idemdb's choice plus a data-block hash index (evaluated, not kept).
    HashIndex,
    /// idemdb's options with an 8 MiB block cache instead of 64 MiB.
    SmallCache,
    /// idemdb's options with a 512 MiB block cache.
    LargeCache,
}

impl ReadVariant {
    const ALL: [ReadVariant; 6] = [
        ReadVariant::WholeFilters,
        ReadVariant::TableBloom,
        ReadVariant::MemtableBloom,
        ReadVariant::HashIndex,
        ReadVariant::SmallCache,
        ReadVariant::LargeCache,
    ];

    fn name(self) -> &'static str {
        match self {
            ReadVariant::WholeFilters => "unpartitioned filters, no memtable bloom, no hash index",
            ReadVariant::TableBloom => "partitioned table-file filters only",
            ReadVariant::MemtableBloom => "idemdb: + memtable bloom (2%, whole key)",
            ReadVariant::HashIndex => "idemdb + data-block hash index",
            ReadVariant::SmallCache => "idemdb, 8 MiB block cache",
            ReadVariant::LargeCache => "idemdb, 512 MiB block cache",
        }
    }

    fn options(self) -> rocksdb::Options {
        use ReadVariant::{TableBloom, WholeFilters};
        let memtable_bloom = !matches!(self, TableBloom | WholeFilters);
        let hash_index = self == ReadVariant::HashIndex;
        let partitioned = self != WholeFilters;
        let cache_bytes = match self {
            ReadVariant::SmallCache => 8 << 20,
            ReadVariant::LargeCache => 512 << 20,
            _ => 64 << 20,
        };
        let mut block = rocksdb::BlockBasedOptions::default();
        block.set_block_cache(&rocksdb::Cache::new_lru_cache(cache_bytes));
        block.set_bloom_filter(10.0, false);
        block.set_whole_key_filtering(true);
        block.set_cache_index_and_filter_blocks(true);
        if partitioned {
            block.set_index_type(rocksdb::BlockBasedIndexType::TwoLevelIndexSearch);
            block.set_partition_filters(true);
            block.set_metadata_block_size(4096);
            block.set_pin_top_level_index_and_filter(true);
            block.set_cache_index_and_filter_blocks_with_high_priority(true);
        }
        if hash_index {
            block.set_data_block_index_type(rocksdb::DataBlockIndexType::BinaryAndHash);
            block.set_data_block_hash_ratio(0.75);
        }
        let mut options = crate::contenders::embedded::db_options();
        options.set_block_based_table_factory(&block);
        options.set_compression_type(rocksdb::DBCompressionType::Lz4);
        options.set_write_buffer_size(64 << 20);
        options.set_level_compaction_dynamic_level_bytes(true);
        if memtable_bloom {
            options.set_memtable_prefix_bloom_ratio(0.02);
            options.set_memtable_whole_key_filtering(true);
        }
        options
    }
}

/// The lookups a claim makes, by where the key is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadWorkload {
    /// A new key: `get` (a miss) then the write of marker + business value, with 500k keys in
    /// the memtable: the insert path.
    NewKeyMemtable,
    /// `get` of a stored key still in the memtable: a duplicate soon after the original.
    DuplicateInMemtable,
    /// `get` of a stored key in table files: a late duplicate.
    DuplicateInTables,
    /// `get` of an absent key with everything in table files: a new key on a big store.
    MissInTables,
}

impl ReadWorkload {
    const ALL: [ReadWorkload; 4] = [
        ReadWorkload::NewKeyMemtable,
        ReadWorkload::DuplicateInMemtable,
        ReadWorkload::DuplicateInTables,
        ReadWorkload::MissInTables,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ReadWorkload::NewKeyMemtable => "new key: get + write",
            ReadWorkload::DuplicateInMemtable => "duplicate in memtable: get",
            ReadWorkload::DuplicateInTables => "duplicate in table files: get",
            ReadWorkload::MissInTables => "new key, store in table files: get",
        }
    }
}

/// One option set's medians per workload: (msg/s, p50 us, p99 us).
pub struct ReadRow {
    pub name: &'static str,
    pub by_workload: Vec<(&'static str, f64, f64, f64)>,
}

/// Marker key `n` of the read-options store (22 bytes, like idemdb's stored keys).
fn read_key(n: u64) -> [u8; 22] {
    let mut key = [0u8; 22];
    key[..6].copy_from_slice(b"bench:");
    key[6..14].copy_from_slice(&crate::workloads::scale::mix64(n).to_be_bytes());
    key
}

pub fn read_options(args: &ReadArgs) -> Result<Vec<ReadRow>> {
    let duration = Duration::from_secs_f64(args.seconds);
    let mut samples =
        vec![vec![Vec::<(f64, f64, f64)>::new(); ReadWorkload::ALL.len()]; ReadVariant::ALL.len()];
    let root = tempfile::Builder::new().prefix("idemdb-read-").tempdir()?;
    for round in 0..args.rounds {
        for (v, variant) in ReadVariant::ALL.iter().enumerate() {
            let dir = root.path().join(format!("{round}-{v}"));
            let db = DB::open(&variant.options(), &dir)?;
            let mut write = WriteOptions::default();
            write.set_sync(false);
            // Stored keys 0..keys, flushed to table files; then 500k more in the memtable.
            let mut next = 0u64;
            let fill = |db: &DB, count: u64, next: &mut u64| -> Result<()> {
                let mut batch = WriteBatch::default();
                for _ in 0..count {
                    batch.put(read_key(*next), [1u8; 46]);
                    *next += 1;
                    if batch.len() == 1024 {
                        db.write_opt(std::mem::take(&mut batch), &write)?;
                    }
                }
                db.write_opt(batch, &write)?;
                Ok(())
            };
            fill(&db, args.keys, &mut next)?;
            db.flush()?;
            db.compact_range(None::<&[u8]>, None::<&[u8]>);
            let in_tables = next;
            fill(&db, 500_000, &mut next)?;
            for (w, workload) in ReadWorkload::ALL.iter().enumerate() {
                let mut rng = SplitMix64(round as u64 * 31 + w as u64);
                let mut latencies = Vec::new();
                let started = Instant::now();
                let mut count = 0u64;
                while started.elapsed() < duration {
                    let call = Instant::now();
                    match workload {
                        ReadWorkload::NewKeyMemtable => {
                            let key = read_key(next);
                            next += 1;
                            if db.get_pinned(key)?.is_none() {
                                let mut batch = WriteBatch::default();
                                batch.put(key, [1u8; 46]);
                                batch.put(&key[6..], [2u8; 64]);
                                db.write_opt(batch, &write)?;
                            }
                        }
                        ReadWorkload::DuplicateInMemtable => {
                            let n = in_tables + rng.next() % 500_000;
                            anyhow::ensure!(db.get_pinned(read_key(n))?.is_some(), "stored key");
                        }
                        ReadWorkload::DuplicateInTables => {
                            let n = rng.next() % in_tables;
                            anyhow::ensure!(db.get_pinned(read_key(n))?.is_some(), "stored key");
                        }
                        ReadWorkload::MissInTables => {
                            let n = u64::MAX - rng.next() % (1 << 40);
                            anyhow::ensure!(db.get_pinned(read_key(n))?.is_none(), "absent key");
                        }
                    }
                    latencies.push(elapsed_ns(call));
                    count += 1;
                }
                let elapsed = started.elapsed();
                latencies.sort_unstable();
                let sample = (
                    count as f64 / elapsed.as_secs_f64(),
                    quantile(&latencies, 0.5) / 1000.0,
                    quantile(&latencies, 0.99) / 1000.0,
                );
                eprintln!(
                    "read-options round {}: {:<32} {:<36} {:>9.0}/s p50 {:>5.2} us p99 {:>6.2} us",
                    round + 1,
                    variant.name(),
                    workload.name(),
                    sample.0,
                    sample.1,
                    sample.2
                );
                samples[v][w].push(sample);
            }
            drop(db);
            std::fs::remove_dir_all(&dir)?;
        }
    }
    Ok(ReadVariant::ALL
        .iter()
        .zip(samples)
        .map(|(variant, by_workload)| ReadRow {
            name: variant.name(),
            by_workload: ReadWorkload::ALL
                .iter()
                .zip(by_workload)
                .map(|(workload, rounds)| {
                    let mut rate: Vec<f64> = rounds.iter().map(|r| r.0).collect();
                    let mut p50: Vec<f64> = rounds.iter().map(|r| r.1).collect();
                    let mut p99: Vec<f64> = rounds.iter().map(|r| r.2).collect();
                    (
                        workload.name(),
                        median(&mut rate),
                        median(&mut p50),
                        median(&mut p99),
                    )
                })
                .collect(),
        })
        .collect())
}
