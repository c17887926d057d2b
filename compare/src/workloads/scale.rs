//! Runs of idemdb alone: as the store grows (scale) and over many retention periods (ttl).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Args;
use idemdb::{BatchOutcome, Durability, Engine, Fingerprint, Message, MockClock, Outcome};

use crate::workloads::{elapsed_ns, quantile};

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
pub fn mix64(mut z: u64) -> u64 {
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
    let consumer = engine.consumer(crate::workloads::CONSUMER)?;
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
                            latencies.push(elapsed_ns(call));
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
    let consumer = engine.consumer(crate::workloads::CONSUMER)?;
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
