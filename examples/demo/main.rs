//! A simulated at-least-once broker feeding an idempotent consumer built on idemdb.
//!
//! ```text
//! cargo run --release --example demo -- [--messages N] [--workers N] [--durability sync|buffered] [--dir PATH]
//!     [--metrics 127.0.0.1:19090|off]
//! ```
//!
//! While it runs, the demo serves its Prometheus metrics on `--metrics` (loopback only; default
//! 127.0.0.1:19090), and at the end it scrapes that endpoint itself and prints idemdb's lines.
//!
//! The producer publishes orders and resends about 10% of them (lost publisher acks). Workers
//! take deliveries, claim each order, stage the business effects (the order row and counters)
//! on the claim and commit; the broker redelivers every delivery that was not acknowledged.
//! Workers "crash" now and then, before the commit (the claim is dropped) or between the commit
//! and the ack (the commit is durable, the ack lost). Halfway through, the whole consumer
//! process "crashes": every worker stops where it is, the engine is dropped and reopened from
//! disk, and everything unacknowledged is redelivered. At the end the demo checks that every
//! order's effect was applied exactly once.

#[path = "../common/args.rs"]
mod args;
mod broker;
mod consumer;
#[path = "../common/prometheus.rs"]
mod prometheus;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use idemdb::{Durability, merge_ops};

use args::Flags;
use broker::{Broker, publication};
use consumer::{Counts, open, order_key, run_workers};

struct Args {
    messages: u64,
    workers: usize,
    durability: Durability,
    dir: Option<PathBuf>,
    metrics: Option<std::net::SocketAddr>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        messages: 1_000_000,
        workers: 4,
        durability: Durability::Buffered,
        dir: None,
        metrics: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 19090))),
    };
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--messages" => args.messages = flags.parse(&flag)?,
            "--workers" => args.workers = flags.parse(&flag)?,
            "--durability" => {
                args.durability = match flags.value(&flag)?.as_str() {
                    "sync" => Durability::Sync,
                    "buffered" => Durability::Buffered,
                    other => return Err(format!("--durability sync|buffered, not {other}")),
                }
            }
            "--dir" => args.dir = Some(PathBuf::from(flags.value(&flag)?)),
            "--metrics" => {
                args.metrics = match flags.value(&flag)?.as_str() {
                    "off" => None,
                    addr => {
                        let addr: std::net::SocketAddr =
                            addr.parse().map_err(|e| format!("--metrics: {e}"))?;
                        if !addr.ip().is_loopback() {
                            return Err("--metrics serves on loopback addresses only".into());
                        }
                        Some(addr)
                    }
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.messages < 10 || args.workers == 0 || args.workers > 256 {
        return Err("need --messages >= 10 and 1 <= --workers <= 256".into());
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("demo: {message}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("demo: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let temp = tempfile::tempdir()?;
    let dir = match &args.dir {
        // The final check counts effects from this run only, so the store must start empty.
        Some(dir) if dir.exists() && dir.read_dir()?.next().is_some() => {
            return Err(format!("{} is not empty; give a new directory", dir.display()).into());
        }
        Some(dir) => dir.clone(),
        None => temp.path().to_path_buf(),
    };

    let (published, distinct) = publication(args.messages);
    let broker = Arc::new(Broker::new(&published));
    let counts = Arc::new(Counts::default());

    println!(
        "idemdb demo: {} deliveries published ({} distinct orders, {} producer resends), {} workers, {:?} durability",
        published.len(),
        distinct,
        published.len() as u64 - distinct,
        args.workers,
        args.durability
    );
    // Installed before the first consumer handle: idemdb registers its metrics then.
    let metrics = args.metrics.filter(|addr| {
        let installed = metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(*addr)
            .install();
        if let Err(error) = &installed {
            eprintln!("metrics endpoint on {addr} not started: {error}");
        }
        installed.is_ok()
    });
    let started = Instant::now();
    let engine = open(args, &dir)?;
    run_workers(
        &engine,
        &broker,
        &counts,
        args,
        Some(published.len() / 2),
        0,
    )?;
    let in_flight = broker.unacked.load(Ordering::SeqCst);
    drop(engine);
    println!(
        "consumer process crashed with {in_flight} deliveries unacknowledged; reopening the store"
    );
    let engine = open(args, &dir)?;
    run_workers(&engine, &broker, &counts, args, None, 1)?;
    engine.flush_wal()?;
    let elapsed = started.elapsed();

    let load = |counter: &AtomicU64| counter.load(Ordering::SeqCst);
    let deliveries = load(&counts.deliveries);
    println!("deliveries processed      {deliveries:>10}");
    println!("  fresh claims            {:>10}", load(&counts.fresh));
    println!("    committed             {:>10}", load(&counts.committed));
    println!(
        "    crashed before commit {:>10}",
        load(&counts.crash_before_commit)
    );
    println!(
        "    crashed before ack    {:>10}",
        load(&counts.crash_before_ack)
    );
    println!("  duplicates              {:>10}", load(&counts.duplicate));
    println!(
        "  in progress (nacked)    {:>10}",
        load(&counts.in_progress)
    );
    println!("  conflicts               {:>10}", load(&counts.conflict));
    println!(
        "throughput                {:>10.0} deliveries/s ({:.2} s)",
        deliveries as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );

    // The check: every distinct order applied exactly once, and nothing else applied.
    let effects = engine.business_table("effects")?;
    let orders = engine.business_table("orders")?;
    let consumer = engine.consumer("order-service")?;
    let read = |key: &str| -> idemdb::Result<u64> {
        Ok(effects
            .get(key)?
            .and_then(|v| merge_ops::read_u64(&v))
            .unwrap_or(0))
    };
    let mut wrong = 0u64;
    for order in 0..distinct {
        let key = order_key(order);
        let applied = read(&key)?;
        let marked = consumer.get(&key)?.is_some();
        let row = orders.get(&key)?.is_some();
        if applied != 1 || !marked || !row {
            wrong += 1;
            if wrong <= 5 {
                eprintln!("order {order}: applied {applied} times, marker {marked}, row {row}");
            }
        }
    }
    let total = read("total")?;
    let committed = load(&counts.committed);
    if let Some(addr) = metrics {
        print_scrape(addr);
    }
    let ok = wrong == 0 && total == distinct && committed == distinct;
    println!(
        "check: {distinct} distinct orders, effects applied {total}, commits {committed}, \
         orders applied other than once {wrong}: {}",
        if ok { "EXACTLY ONCE" } else { "FAILED" }
    );
    Ok(ok)
}

/// Scrapes the demo's own Prometheus endpoint, as a monitoring system would, and prints
/// idemdb's counters (histograms are summarised by their count and sum lines).
fn print_scrape(addr: std::net::SocketAddr) {
    match prometheus::scrape(addr) {
        Ok(body) => {
            println!("metrics scraped from http://{addr}/metrics (idemdb lines):");
            for line in body.lines().filter(|line| {
                line.starts_with("idemdb_")
                    && !line.contains("quantile=")
                    && !line.contains("_bucket")
            }) {
                println!("  {line}");
            }
        }
        Err(error) => eprintln!("scraping {addr} failed: {error}"),
    }
}
