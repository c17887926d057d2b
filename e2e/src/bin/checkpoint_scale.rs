//! How long a checkpoint of a large store takes when its table files can be hard-linked.
//!
//! Fills a store with N records (16-byte keys, claimed and committed through the batch API,
//! `Durability::Buffered`), flushes it so the data is in table files, then times
//! `Engine::checkpoint` five times, each into a fresh directory on the store's file system
//! (removed after), and prints the median, minimum and maximum. Then it closes the engine and
//! times what `idemdb backup` does offline: the operator tools' exclusive open
//! (`admin::Store::open_exclusive`) and `Store::backup` into a new directory beside the store.
//! With `--idemdb PATH` it also times the `idemdb backup` process itself.
//!
//! ```text
//! cargo run --release -p idemdb-e2e --bin checkpoint_scale -- [--records N] [--dir PATH] [--idemdb PATH]
//! ```
//!
//! `--dir` is where the store is written (a temporary directory in it, removed at the end);
//! default the system's temporary directory. Figures are in BENCHMARKS.md ("Checkpoints").

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use idemdb::admin::Store;
use idemdb::{BATCH_MESSAGES_MAX, BatchOutcome, Durability, Engine, Fingerprint, Message};

/// Checkpoints timed; the median is reported.
const CHECKPOINT_RUNS: usize = 5;
/// Records stored by default.
const RECORDS_DEFAULT: u64 = 10_000_000;

struct Args {
    records: u64,
    dir: PathBuf,
    idemdb: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        records: RECORDS_DEFAULT,
        dir: std::env::temp_dir(),
        idemdb: None,
    };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        let mut value = || words.next().ok_or_else(|| format!("{word} needs a value"));
        match word.as_str() {
            "--records" => {
                args.records = value()?
                    .parse()
                    .map_err(|error| format!("--records: {error}"))?;
            }
            "--dir" => args.dir = PathBuf::from(value()?),
            "--idemdb" => args.idemdb = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

/// The key of record `index`: 16 bytes, spread over the key space as message ids are (an odd
/// multiplier is a bijection modulo 2^128, so no two indexes share a key).
fn key(index: u64) -> [u8; 16] {
    const SPREAD: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;
    u128::from(index).wrapping_mul(SPREAD).to_be_bytes()
}

/// Claims and commits `records` messages, a full batch at a time.
fn fill(engine: &Engine, records: u64) -> Result<(), Box<dyn std::error::Error>> {
    let consumer = engine.consumer("orders")?;
    let mut next = 0u64;
    let mut reported = Instant::now();
    while next < records {
        let end = records.min(next + BATCH_MESSAGES_MAX as u64);
        let keys: Vec<[u8; 16]> = (next..end).map(key).collect();
        let messages: Vec<Message<'_>> = keys
            .iter()
            .map(|key| Message::new(key, Fingerprint::of(key)))
            .collect();
        let batch = consumer.begin_batch(&messages)?;
        if let Some(index) = batch
            .outcomes()
            .iter()
            .position(|outcome| !matches!(outcome, BatchOutcome::Fresh))
        {
            return Err(format!("record {} was not fresh", next + index as u64).into());
        }
        batch.commit(|_| b"ok")?;
        next = end;
        if reported.elapsed() >= Duration::from_secs(10) {
            eprintln!("  {next} records");
            reported = Instant::now();
        }
    }
    Ok(())
}

/// (files, bytes) of the regular files directly in `dir`.
fn usage(dir: &Path) -> std::io::Result<(u64, u64)> {
    let (mut files, mut bytes) = (0, 0);
    for entry in std::fs::read_dir(dir)? {
        let metadata = entry?.metadata()?;
        if metadata.is_file() {
            files += 1;
            bytes += metadata.len();
        }
    }
    Ok((files, bytes))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn seconds(duration: Duration) -> String {
    format!("{:.3} s", duration.as_secs_f64())
}

/// The machine, for the record: cores and, where Linux says, the CPU model.
fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|model| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    format!("{cores} cores, {model}")
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let work = tempfile::Builder::new()
        .prefix("idemdb-checkpoint-scale-")
        .tempdir_in(&args.dir)?;
    let store = work.path().join("store");
    println!("machine      {}", machine());
    let engine = Engine::builder(&store)
        .durability(Durability::Buffered)
        .open()?;
    let started = Instant::now();
    fill(&engine, args.records)?;
    let filled = started.elapsed();
    let started = Instant::now();
    engine.flush_wal()?;
    engine.flush()?;
    let flushed = started.elapsed();
    let (files, bytes) = usage(&store)?;
    println!(
        "records      {} (filled in {}, flushed in {})",
        args.records,
        seconds(filled),
        seconds(flushed)
    );
    println!("store        {:.1} MiB in {files} files", mib(bytes));

    let mut times = Vec::with_capacity(CHECKPOINT_RUNS);
    for run in 0..CHECKPOINT_RUNS {
        let dir = work.path().join(format!("checkpoint-{run}"));
        let started = Instant::now();
        engine.checkpoint(&dir)?;
        times.push(started.elapsed());
        let (files, bytes) = usage(&dir)?;
        if run == 0 {
            println!(
                "checkpoint   {files} files, {:.1} MiB (table files hard-linked)",
                mib(bytes)
            );
        }
        std::fs::remove_dir_all(&dir)?;
    }
    times.sort();
    println!(
        "Engine::checkpoint x{CHECKPOINT_RUNS}: median {}, min {}, max {}",
        seconds(times[CHECKPOINT_RUNS / 2]),
        seconds(times[0]),
        seconds(times[CHECKPOINT_RUNS - 1])
    );
    drop(engine);

    // Offline, as `idemdb backup` runs it: the exclusive open replays the WAL, then the backup.
    let started = Instant::now();
    let admin = Store::builder(&store).open_exclusive()?;
    let opened = started.elapsed();
    let backup_dir = work.path().join("backup");
    let started = Instant::now();
    let report = admin.backup(&backup_dir, |_, _| {})?;
    let backed_up = started.elapsed();
    drop(admin);
    println!(
        "offline backup: exclusive open {}, Store::backup {} ({} files, {:.1} MiB, {} hard-linked)",
        seconds(opened),
        seconds(backed_up),
        report.files,
        mib(report.bytes),
        report.linked_files
    );
    std::fs::remove_dir_all(&backup_dir)?;

    if let Some(idemdb) = &args.idemdb {
        let started = Instant::now();
        let output = Command::new(idemdb)
            .arg("backup")
            .arg(&store)
            .arg(&backup_dir)
            .output()?;
        let elapsed = started.elapsed();
        if !output.status.success() {
            return Err(format!(
                "idemdb backup failed: {}",
                String::from_utf8_lossy(&output.stderr)
            )
            .into());
        }
        println!("idemdb backup (whole process): {}", seconds(elapsed));
        std::fs::remove_dir_all(&backup_dir)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("checkpoint_scale: {message}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("checkpoint_scale: {error}");
            ExitCode::FAILURE
        }
    }
}
