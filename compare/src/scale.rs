//! Runs of idemdb alone: as the store grows (scale), over many retention periods (ttl), and
//! RocksDB's durable write-path options on idemdb's write pattern (wal-options).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use idemdb::{BatchOutcome, Durability, Engine, Fingerprint, Message, MockClock, Outcome};
use rocksdb::{DB, WriteBatch, WriteOptions};

use crate::workload::{Delivery, SplitMix64, median, quantile};

#[derive(Args, Clone)]
pub struct ScaleArgs {
    /// Records to store in all. 100,000,000 is the long run (see BENCHMARKS.md for its time).
    #[arg(long, default_value_t = 10_000_000)]
    pub records: u64,
    /// Records per measured window.
    #[arg(long, default_value_t = 1_000_000)]
    pub window: u64,
    /// Producer threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Where the store goes (default: a temporary directory, removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    #[arg(long, default_value = "docs/bench")]
    pub out: PathBuf,
}

impl ScaleArgs {
    pub fn defaults(out: PathBuf) -> ScaleArgs {
        ScaleArgs {
            records: 10_000_000,
            window: 1_000_000,
            threads: 2,
            dir: None,
            out,
        }
    }
}

/// One window of the scale run.
#[derive(Clone, Debug)]
pub struct ScalePoint {
    /// Records stored at the end of the window.
    pub records: u64,
    pub per_second: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Every file of the store (tables, WAL, manifest) over the records stored.
    pub disk_bytes_per_record: f64,
    /// After a full compaction at the end of the run (last point only; 0 elsewhere).
    pub compacted_bytes: u64,
    pub compacted_bytes_per_record: f64,
}

/// A unique, scattered 16-byte key: the producer's number, then a bijective mix of its counter
/// (so keys never collide and arrive in no particular order, like UUIDs).
fn scattered_key(thread: usize, counter: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[0] = thread as u8;
    key[1..9].copy_from_slice(&mix64(counter).to_be_bytes());
    key
}

/// The SplitMix64 finalizer: a bijection on u64.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn store_dir(dir: &Option<PathBuf>) -> Result<(PathBuf, Option<tempfile::TempDir>)> {
    match dir {
        Some(dir) => {
            if dir.exists() {
                bail!("{} exists; the run needs a new directory", dir.display());
            }
            Ok((dir.clone(), None))
        }
        None => {
            let temp = tempfile::Builder::new().prefix("idemdb-scale-").tempdir()?;
            Ok((temp.path().to_path_buf(), Some(temp)))
        }
    }
}

/// Bytes of the files in `dir` whose names end with `suffix` ("" for all files).
fn bytes_of(dir: &Path, suffix: &str) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().ends_with(suffix) {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

pub fn scale(args: &ScaleArgs) -> Result<Vec<ScalePoint>> {
    anyhow::ensure!(
        args.window > 0 && args.threads > 0,
        "window and threads must be > 0"
    );
    let (dir, _temp) = store_dir(&args.dir)?;
    let engine = Engine::builder(&dir)
        .durability(Durability::Buffered)
        .open()?;
    let consumer = engine.consumer(crate::workload::CONSUMER)?;
    let mut points = Vec::new();
    let mut stored = 0u64;
    let mut next_counter = vec![0u64; args.threads];
    let started = Instant::now();
    while stored < args.records {
        let window = args.window.min(args.records - stored);
        let per_thread = window / args.threads as u64;
        let window_started = Instant::now();
        let latencies: Vec<Vec<u32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..args.threads)
                .map(|thread| {
                    let consumer = consumer.clone();
                    let first = next_counter[thread];
                    scope.spawn(move || -> Result<Vec<u32>> {
                        let mut latencies = Vec::with_capacity(per_thread as usize);
                        for counter in first..first + per_thread {
                            let key = scattered_key(thread, counter);
                            let call = Instant::now();
                            let Outcome::Fresh(claim) =
                                consumer.begin(key, Fingerprint::of(key))?
                            else {
                                bail!("scattered keys are unique, yet one was not fresh");
                            };
                            claim.commit(b"")?;
                            latencies.push(call.elapsed().as_nanos().min(u32::MAX as u128) as u32);
                        }
                        Ok(latencies)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("producer thread"))
                .collect::<Result<Vec<_>>>()
        })?;
        let elapsed = window_started.elapsed();
        for counter in &mut next_counter {
            *counter += per_thread;
        }
        let written = per_thread * args.threads as u64;
        stored += written;
        let mut all: Vec<u32> = latencies.into_iter().flatten().collect();
        all.sort_unstable();
        let point = ScalePoint {
            records: stored,
            per_second: written as f64 / elapsed.as_secs_f64(),
            p50_us: quantile(&all, 0.5) / 1000.0,
            p99_us: quantile(&all, 0.99) / 1000.0,
            disk_bytes_per_record: bytes_of(&dir, "")? as f64 / stored as f64,
            compacted_bytes: 0,
            compacted_bytes_per_record: 0.0,
        };
        eprintln!(
            "scale: {:>11} records  {:>8.0} msg/s  p50 {:>6.1} us  p99 {:>7.1} us  {:>6.1} B/record  ({:.0} s)",
            point.records,
            point.per_second,
            point.p50_us,
            point.p99_us,
            point.disk_bytes_per_record,
            started.elapsed().as_secs_f64()
        );
        points.push(point);
        if written == 0 {
            break;
        }
    }
    engine.compact()?;
    let compacted = bytes_of(&dir, ".sst")?;
    if let Some(last) = points.last_mut() {
        last.compacted_bytes = compacted;
        last.compacted_bytes_per_record = compacted as f64 / last.records as f64;
    }
    Ok(points)
}

#[derive(Args, Clone)]
pub struct TtlArgs {
    /// Retention periods to run.
    #[arg(long, default_value_t = 10)]
    pub periods: u64,
    /// New records per period.
    #[arg(long, default_value_t = 1_000_000)]
    pub per_period: u64,
    #[arg(long, default_value = "docs/bench")]
    pub out: PathBuf,
}

impl TtlArgs {
    pub fn defaults(out: PathBuf) -> TtlArgs {
        TtlArgs {
            periods: 10,
            per_period: 1_000_000,
            out,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TtlPoint {
    pub period: u64,
    pub written: u64,
    pub disk_bytes: u64,
    /// Table files over the live set's compacted size.
    pub over_live: f64,
}

/// Mock time per retention period (10 minutes); only ratios of it matter.
const PERIOD_MS: u64 = 600_000;
const TTL_BATCH: u64 = 256;

pub fn ttl(args: &TtlArgs) -> Result<Vec<TtlPoint>> {
    anyhow::ensure!(
        args.per_period >= TTL_BATCH,
        "per-period must be at least {TTL_BATCH}"
    );
    let temp = tempfile::Builder::new().prefix("idemdb-ttl-").tempdir()?;
    let clock = MockClock::new(1_780_000_000_000);
    let engine = Engine::builder(temp.path())
        .durability(Durability::Buffered)
        .clock(clock.clone())
        .retention(Duration::from_millis(PERIOD_MS))
        .write_buffer_bytes(4 << 20)
        .open()?;
    let consumer = engine.consumer(crate::workload::CONSUMER)?;
    let step = Duration::from_micros(PERIOD_MS * 1000 * TTL_BATCH / args.per_period);
    let mut counter = 0u64;
    let mut points = Vec::new();
    for period in 1..=args.periods {
        for _ in 0..args.per_period / TTL_BATCH {
            let keys: Vec<[u8; 16]> = (0..TTL_BATCH)
                .map(|i| scattered_key(0, counter + i))
                .collect();
            counter += TTL_BATCH;
            let messages: Vec<Message<'_>> = keys
                .iter()
                .map(|key| Message::new(key, Fingerprint::of(key)))
                .collect();
            let batch = consumer.begin_batch(&messages)?;
            if !batch
                .outcomes()
                .iter()
                .all(|o| matches!(o, BatchOutcome::Fresh))
            {
                bail!("scattered keys are unique, yet one was not fresh");
            }
            batch.commit(|_| b"")?;
            clock.advance(step);
        }
        let disk_bytes = bytes_of(temp.path(), ".sst")?;
        eprintln!(
            "ttl: period {period:>3}  {counter:>11} written  {disk_bytes:>12} bytes of table files"
        );
        points.push(TtlPoint {
            period,
            written: counter,
            disk_bytes,
            over_live: 0.0,
        });
    }
    // The live set: what a full compaction keeps (the last period's records).
    engine.compact()?;
    let live = bytes_of(temp.path(), ".sst")?.max(1);
    let counts = engine.record_counts()?;
    eprintln!("ttl: after a full compaction {live} bytes of table files; records kept: {counts:?}");
    for point in &mut points {
        point.over_live = point.disk_bytes as f64 / live as f64;
    }
    Ok(points)
}

#[derive(Args, Clone)]
pub struct WalArgs {
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long, default_value = "docs/bench")]
    pub out: PathBuf,
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
    /// What idemdb keeps: serial memtable writes and recycled WAL files.
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
            WalVariant::IdemdbChoice => "idemdb: + recycle logs + serial memtable writes",
            WalVariant::ManualFlushGroupCommit => "manual_wal_flush + own group commit",
        }
    }

    fn options(self) -> Result<rocksdb::Options> {
        let mut options = crate::embedded::base_db_options();
        match self {
            WalVariant::Baseline | WalVariant::ManualFlushGroupCommit => {}
            WalVariant::PipelinedWrite => options.set_enable_pipelined_write(true),
            WalVariant::RecycleLogs => options.set_recycle_log_file_num(4),
            WalVariant::NoAdaptiveYield => options.set_enable_write_thread_adaptive_yield(false),
            WalVariant::SerialMemtableWrites => options.set_allow_concurrent_memtable_write(false),
            WalVariant::IdemdbChoice => options = crate::embedded::db_options(),
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
                    latencies.push(call.elapsed().as_nanos().min(u32::MAX as u128) as u32);
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
