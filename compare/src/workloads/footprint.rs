//! The default durable path's footprint (P10): how long a new store's first open takes and how
//! many bytes it writes, with the default (the commit log) and with RocksDB's WAL side by side;
//! and the log's size after a burst that grew its ring and a quiet minute.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use idemdb::{Engine, Fingerprint, Outcome};

#[derive(Args, Clone)]
pub struct FootprintArgs {
    /// First opens measured per path, alternating.
    #[arg(long, default_value_t = 21)]
    pub opens: usize,
    /// Bytes committed in the burst that grows the ring (one thread, batches through a
    /// pipeline of 4).
    #[arg(long, default_value_t = 256 << 20)]
    pub burst_bytes: u64,
    /// How long the store stays quiet after the burst before the log is measured.
    #[arg(long, default_value_t = 60)]
    pub quiet_seconds: u64,
    /// Where the stores are made (the file system measured).
    #[arg(long, default_value = "target/footprint")]
    pub dir: PathBuf,
}

/// Bytes this process has written through `write` and its kin so far (`/proc/self/io`).
fn written_bytes() -> Result<u64> {
    let io = std::fs::read_to_string("/proc/self/io")?;
    io.lines()
        .find_map(|line| line.strip_prefix("wchar: "))
        .context("no wchar in /proc/self/io")?
        .trim()
        .parse()
        .context("wchar")
}

/// The bytes of the files under `dir`, allocated on disk.
fn allocated(dir: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let metadata = entry.metadata()?;
        total += if metadata.is_dir() {
            allocated(&entry.path())?
        } else {
            metadata.blocks() * 512
        };
    }
    Ok(total)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub fn run(args: &FootprintArgs) -> Result<()> {
    std::fs::create_dir_all(&args.dir)?;
    println!(
        "first open of a new store, {} opens per path, alternating, in {}",
        args.opens,
        args.dir.display()
    );
    // Per path: the first opens' milliseconds, MiB written and MiB on disk.
    type Row = (&'static str, Vec<f64>, Vec<f64>, Vec<f64>);
    let mut rows: Vec<Row> = vec![
        ("default (commit log)", Vec::new(), Vec::new(), Vec::new()),
        (
            "without_commit_log (RocksDB's WAL)",
            Vec::new(),
            Vec::new(),
            Vec::new(),
        ),
    ];
    for round in 0..args.opens {
        for (index, row) in rows.iter_mut().enumerate() {
            let path = args.dir.join(format!("open-{round}-{index}"));
            let _ = std::fs::remove_dir_all(&path);
            let before = written_bytes()?;
            let started = Instant::now();
            let builder = Engine::builder(&path);
            let engine = if index == 1 {
                builder.without_commit_log().open()?
            } else {
                builder.open()?
            };
            let took = started.elapsed();
            let written = written_bytes()? - before;
            let on_disk = allocated(&path)?;
            drop(engine);
            row.1.push(took.as_secs_f64() * 1e3);
            row.2.push(written as f64 / f64::from(1 << 20));
            row.3.push(on_disk as f64 / f64::from(1 << 20));
            std::fs::remove_dir_all(&path)?;
        }
    }
    println!(
        "| path | first open, median ms | bytes written, median MiB | on disk while open, MiB |"
    );
    println!("|---|---|---|---|");
    for (name, mut ms, mut written, mut on_disk) in rows {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} |",
            median(&mut ms),
            median(&mut written),
            median(&mut on_disk)
        );
    }
    burst_then_quiet(args)
}

/// A burst that grows the ring, then a quiet spell: the log's size at each step.
fn burst_then_quiet(args: &FootprintArgs) -> Result<()> {
    let path = args.dir.join("burst");
    let _ = std::fs::remove_dir_all(&path);
    let engine = Engine::builder(&path).open()?;
    let log = path.join("idemdb-log");
    let start = allocated(&log)?;
    let consumer = engine.consumer("orders")?;
    let mut pipeline = consumer.pipeline::<u64>(4)?;
    let value = vec![0x5a_u8; 1024];
    let mut written = 0_u64;
    let mut n = 0_u64;
    while written < args.burst_bytes {
        let key = format!("order-{n}");
        if let Outcome::Fresh(claim) = consumer.begin(&key, Fingerprint::of(&key))? {
            pipeline.commit(claim, &value, n);
        }
        for settled in pipeline.settled() {
            settled.outcome?;
        }
        written += value.len() as u64;
        n += 1;
    }
    for settled in pipeline.wait() {
        settled.outcome?;
    }
    let after_burst = allocated(&log)?;
    std::thread::sleep(Duration::from_secs(args.quiet_seconds));
    let after_quiet = allocated(&log)?;
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    println!(
        "burst of {:.0} MiB in {n} commits: log {:.1} MiB at first, {:.1} MiB after the burst, \
         {:.1} MiB after {} s quiet ({:.2}x its starting size)",
        mib(args.burst_bytes),
        mib(start),
        mib(after_burst),
        mib(after_quiet),
        args.quiet_seconds,
        after_quiet as f64 / start as f64
    );
    drop((pipeline, consumer, engine));
    std::fs::remove_dir_all(&path)?;
    Ok(())
}
