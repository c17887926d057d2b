//! `neighbour` (P13): the latency of a durable commit from one thread while another process
//! writes to the same file system, for the default path (the commit log) and for RocksDB's WAL
//! (the opt-out), side by side, against the same contenders on a quiet file system.
//!
//! Why: a log rewritten in place syncs data only, while a file that grows needs a journal commit
//! per sync, which on ext4 waits for the data other writers' ordered-mode pages put in the same
//! transaction. Which neighbour hurts is the question, so several are run, each in a process of
//! its own (this binary, `neighbour-load`), started a second before the contender and killed
//! after it:
//! - `big-writes`: a 2 GiB file written in 1 MiB buffered writes, again and again, never synced
//!   (a copy, a download, a log shipper);
//! - `big-writes-fsync`: the same, synced every 64 MiB (a backup tool);
//! - `small-fsyncs`: 16 KiB files written, synced and renamed into place, one after another (a
//!   build, a second database's commits);
//! - `second-store`: a second idemdb store taking batches of 1 KiB results as fast as it can
//!   (its flushes and compactions);
//! - `second-store-idle-cpu`: the same at the scheduler's idle priority (`SCHED_IDLE`), its
//!   disk use unchanged: the control that tells whether `second-store` hurts through the CPU
//!   (two cores, both busy with it) or through the disk.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use crate::contenders::{self, Ports};
use crate::report::machine::Machine;
use crate::workloads::{self, Generator, Sample};

/// The contenders measured: one thread, each commit synced, on each durable path; and the
/// disk's floor (a 4 KiB direct write, as the commit log writes, in place, with its flush), the
/// control that tells a neighbour that slows the disk itself from one that slows idemdb.
const CONTENDERS: [&str; 3] = [
    "idemdb default sync, 1 thread",
    "idemdb sync on RocksDB's WAL, 1 thread",
    "direct write 4 KiB",
];

/// The loads, by the name `neighbour-load` takes; "quiet" runs none.
const LOADS: [&str; 6] = [
    "quiet",
    "big-writes",
    "big-writes-fsync",
    "small-fsyncs",
    "second-store",
    "second-store-idle-cpu",
];

#[derive(Args, Clone)]
pub struct NeighbourArgs {
    /// Seconds each contender runs per round, beside each neighbour.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Rounds; each round runs every neighbour with every contender, in the same order.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Run only the neighbours whose name contains one of these ("quiet" always runs).
    #[arg(long)]
    pub only: Vec<String>,
    /// Where the stores and the neighbours' files go: the file system measured.
    #[arg(long, default_value = "target/neighbour")]
    pub dir: PathBuf,
    /// Where the report (`neighbour.md`, `neighbour.csv`) goes.
    #[arg(long, default_value = "docs/bench")]
    pub out: PathBuf,
}

#[derive(Args, Clone)]
pub struct LoadArgs {
    /// One of `big-writes`, `big-writes-fsync`, `small-fsyncs`, `second-store`,
    /// `second-store-idle-cpu`.
    #[arg(long)]
    pub kind: String,
    /// The folder the load writes in (made, and left for the caller to remove).
    #[arg(long)]
    pub dir: PathBuf,
}

/// One contender beside one neighbour, every round.
struct Cell {
    load: &'static str,
    contender: &'static str,
    rounds: Vec<Sample>,
}

impl Cell {
    fn median(&self, figure: impl Fn(&Sample) -> f64) -> f64 {
        let mut values: Vec<f64> = self.rounds.iter().map(figure).collect();
        workloads::median(&mut values)
    }
}

pub fn run(args: &NeighbourArgs) -> Result<()> {
    let loads: Vec<&'static str> = LOADS
        .into_iter()
        .filter(|load| {
            *load == "quiet" || args.only.is_empty() || args.only.iter().any(|o| load.contains(o))
        })
        .collect();
    let specs: Vec<contenders::Spec> = CONTENDERS
        .iter()
        .map(|name| {
            contenders::all()
                .into_iter()
                .find(|spec| spec.name == *name)
                .with_context(|| format!("no contender named {name:?}"))
        })
        .collect::<Result<_>>()?;
    std::fs::create_dir_all(&args.dir)?;
    let machine = Machine::describe(&args.dir);
    eprintln!("{machine}");
    let ports = Ports {
        redis: 0,
        redis_fsync: 0,
        postgres: 0,
    };
    let mut cells: Vec<Cell> = loads
        .iter()
        .flat_map(|&load| {
            CONTENDERS.iter().map(move |&contender| Cell {
                load,
                contender,
                rounds: Vec::new(),
            })
        })
        .collect();
    let duration = Duration::from_secs_f64(args.seconds);
    for round in 0..args.rounds {
        for cell in &mut cells {
            let spec = specs
                .iter()
                .find(|spec| spec.name == cell.contender)
                .expect("every contender was found");
            // Each cell starts from clean page caches' dirt: nothing left by the one before.
            // SAFETY: sync(2) takes no arguments and cannot fail.
            unsafe { libc::sync() };
            let store = args.dir.join("store");
            std::fs::create_dir_all(&store)?;
            let prepared = contenders::prepare(spec, &store, ports)
                .with_context(|| format!("setting up {}", spec.name))?;
            let load_dir = args.dir.join("load");
            let neighbour = match cell.load {
                "quiet" => None,
                load => Some(Neighbour::start(load, &load_dir)?),
            };
            // The neighbour's writes get going (dirty pages pile up) before the contender runs.
            if neighbour.is_some() {
                std::thread::sleep(Duration::from_secs(1));
            }
            let seed = 0x1de3_d000 + round as u64;
            let sample = workloads::drive(prepared.sessions, spec.shape, duration, |thread| {
                Generator::new(thread, seed, 0.1)
            })
            .with_context(|| format!("running {} beside {}", spec.name, cell.load))?;
            drop(neighbour);
            drop(prepared.store);
            std::fs::remove_dir_all(&store)?;
            let _ = std::fs::remove_dir_all(&load_dir);
            eprintln!(
                "round {}/{}  {:<17} {:<40} {:>8.0} msg/s  p50 {:>8.1} us  p99 {:>9.1} us  max {:>10.1} us",
                round + 1,
                args.rounds,
                cell.load,
                cell.contender,
                sample.per_second(),
                sample.latency_us(0.5),
                sample.latency_us(0.99),
                sample.latency_us(1.0),
            );
            cell.rounds.push(sample);
        }
    }
    write_report(args, &machine, &cells)
}

/// A load running in a process of its own; killed (and waited for) when dropped.
struct Neighbour(Child);

impl Neighbour {
    fn start(kind: &str, dir: &Path) -> Result<Neighbour> {
        let exe = std::env::current_exe().context("the harness's own path")?;
        let child = Command::new(exe)
            .arg("neighbour-load")
            .arg("--kind")
            .arg(kind)
            .arg("--dir")
            .arg(dir)
            .spawn()
            .with_context(|| format!("starting the {kind} neighbour"))?;
        Ok(Neighbour(child))
    }
}

impl Drop for Neighbour {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The neighbour process: writes until it is killed.
pub fn load(args: &LoadArgs) -> Result<()> {
    std::fs::create_dir_all(&args.dir)?;
    match args.kind.as_str() {
        "big-writes" => big_writes(&args.dir, None),
        "big-writes-fsync" => big_writes(&args.dir, Some(64 << 20)),
        "small-fsyncs" => small_fsyncs(&args.dir),
        "second-store" => second_store(&args.dir),
        "second-store-idle-cpu" => {
            idle_cpu()?;
            second_store(&args.dir)
        }
        other => anyhow::bail!("no neighbour load named {other:?}"),
    }
}

/// A 2 GiB file in 1 MiB buffered writes, again and again; synced every `sync_every` bytes.
fn big_writes(dir: &Path, sync_every: Option<u64>) -> Result<()> {
    let chunk = vec![0x5a_u8; 1 << 20];
    loop {
        let path = dir.join("big");
        let mut file = std::fs::File::create(&path)?;
        let mut written = 0u64;
        while written < 2 << 30 {
            file.write_all(&chunk)?;
            written += chunk.len() as u64;
            if sync_every.is_some_and(|every| written.is_multiple_of(every)) {
                file.sync_data()?;
            }
        }
        drop(file);
        std::fs::remove_file(&path)?;
    }
}

/// 16 KiB files, each written, synced and renamed into place over one of 64 names.
fn small_fsyncs(dir: &Path) -> Result<()> {
    let body = vec![0xa5_u8; 16 << 10];
    for n in 0u64.. {
        let staged = dir.join("staged");
        let mut file = std::fs::File::create(&staged)?;
        file.write_all(&body)?;
        file.sync_all()?;
        std::fs::rename(&staged, dir.join(format!("file-{}", n % 64)))?;
    }
    Ok(())
}

/// Puts this thread, and every thread it starts from now on (RocksDB's background threads
/// among them), at the scheduler's idle priority: it runs only when no other thread wants the
/// CPU. Its I/O priority is left as it is.
fn idle_cpu() -> Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call's duration; pid 0 is this thread.
    let status = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if status != 0 {
        return Err(std::io::Error::last_os_error()).context("setting SCHED_IDLE");
    }
    Ok(())
}

/// A second store taking batches of 256 claims with 1 KiB results, as fast as it can.
fn second_store(dir: &Path) -> Result<()> {
    let engine = idemdb::Engine::builder(dir.join("store"))
        .durability(idemdb::Durability::Buffered)
        .open()?;
    let consumer = engine.consumer("neighbour")?;
    let result = vec![0x3c_u8; 1024];
    for batch in 0u64.. {
        let keys: Vec<String> = (0..256).map(|n| format!("{batch}-{n}")).collect();
        let messages: Vec<idemdb::Message> = keys
            .iter()
            .map(|key| idemdb::Message::new(key, idemdb::Fingerprint::of(key)))
            .collect();
        let claims = consumer.begin_batch(&messages)?;
        claims.commit(|_| result.as_slice())?;
    }
    Ok(())
}

fn write_report(args: &NeighbourArgs, machine: &Machine, cells: &[Cell]) -> Result<()> {
    let quiet_p99 = |contender: &str| {
        cells
            .iter()
            .find(|cell| cell.load == "quiet" && cell.contender == contender)
            .map_or(f64::NAN, |cell| cell.median(|s| s.latency_us(0.99)))
    };
    let mut md = String::new();
    md.push_str(&format!(
        "# Durable commits beside a noisy neighbour (P13)\n\n{machine}\n\n{} rounds x {} s per \
         contender and neighbour, medians of the rounds; the neighbour runs in a process of its \
         own on the same file system, started 1 s before the contender. Made by `cargo run \
         --release -p idemdb-compare -- neighbour`.\n\n",
        args.rounds, args.seconds
    ));
    md.push_str(
        "| neighbour | contender | msg/s | p50 us | p99 us | p99.9 us | max us | p99 / quiet p99 |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut csv = String::from("neighbour,contender,msg_per_s,p50_us,p99_us,p999_us,max_us\n");
    for cell in cells {
        let per_second = cell.median(Sample::per_second);
        let p50 = cell.median(|s| s.latency_us(0.5));
        let p99 = cell.median(|s| s.latency_us(0.99));
        let p999 = cell.median(|s| s.latency_us(0.999));
        let max = cell.median(|s| s.latency_us(1.0));
        md.push_str(&format!(
            "| {} | {} | {per_second:.0} | {p50:.1} | {p99:.1} | {p999:.1} | {max:.1} | {:.2}x |\n",
            cell.load,
            cell.contender,
            p99 / quiet_p99(cell.contender)
        ));
        csv.push_str(&format!(
            "{},{},{per_second:.0},{p50:.1},{p99:.1},{p999:.1},{max:.1}\n",
            cell.load, cell.contender
        ));
    }
    std::fs::create_dir_all(&args.out)?;
    let name = if args.only.is_empty() {
        "neighbour"
    } else {
        "neighbour-only"
    };
    std::fs::write(args.out.join(format!("{name}.md")), &md)?;
    std::fs::write(args.out.join(format!("{name}.csv")), &csv)?;
    println!("{md}");
    Ok(())
}
