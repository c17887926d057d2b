//! A simulated at-least-once broker feeding an idempotent consumer built on idemdb.
//!
//! The producer publishes orders and resends about 10% of them (lost publisher acks). Workers
//! take deliveries, claim each order, stage the business effects (the order row and counters)
//! on the claim and commit; the broker redelivers every delivery that was not acknowledged.
//! Workers "crash" now and then, before the commit (the claim is dropped) or between the commit
//! and the ack (the commit is durable, the ack lost). Halfway through, the whole consumer
//! process "crashes": every worker stops where it is, the engine is dropped and reopened from
//! disk, and everything unacknowledged is redelivered. At the end the demo checks that every
//! order's effect was applied exactly once.
//!
//! ```text
//! cargo run --release --example demo -- [--messages N] [--workers N] [--durability sync|buffered] [--dir PATH]
//!     [--metrics 127.0.0.1:19090|off]
//! ```
//!
//! While it runs, the demo serves its Prometheus metrics on `--metrics` (loopback only; default
//! 127.0.0.1:19090), and at the end it scrapes that endpoint itself and prints idemdb's lines.

#[path = "common/prometheus.rs"]
mod prometheus;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender, unbounded};
use idemdb::{Durability, Engine, Fingerprint, Outcome, TableOptions, merge_ops};

/// One worker crash before commit per this many fresh claims.
const CRASH_BEFORE_COMMIT_EVERY: u64 = 5_000;
/// One worker crash between commit and ack per this many commits.
const CRASH_BEFORE_ACK_EVERY: u64 = 5_000;
/// Share of orders the producer publishes twice, in percent.
const RESEND_PERCENT: u64 = 10;

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
    let mut words = std::env::args().skip(1);
    while let Some(flag) = words.next() {
        let mut value = || words.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--messages" => {
                args.messages = value()?.parse().map_err(|e| format!("--messages: {e}"))?;
            }
            "--workers" => {
                args.workers = value()?.parse().map_err(|e| format!("--workers: {e}"))?
            }
            "--durability" => {
                args.durability = match value()?.as_str() {
                    "sync" => Durability::Sync,
                    "buffered" => Durability::Buffered,
                    other => return Err(format!("--durability sync|buffered, not {other}")),
                }
            }
            "--dir" => args.dir = Some(PathBuf::from(value()?)),
            "--metrics" => {
                args.metrics = match value()?.as_str() {
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

/// A delivery as the broker hands it out.
#[derive(Clone, Copy)]
struct Delivery {
    order: u64,
}

/// SplitMix64: a small, seeded generator, so a run is reproducible without extra dependencies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The order's content: what its fingerprint covers.
fn order_body(order: u64) -> String {
    format!(
        "order {order}: {} units of sku-{}",
        order % 7 + 1,
        order % 101
    )
}

fn order_key(order: u64) -> String {
    format!("order-{order:010}")
}

#[derive(Default)]
struct Counts {
    deliveries: AtomicU64,
    fresh: AtomicU64,
    committed: AtomicU64,
    duplicate: AtomicU64,
    in_progress: AtomicU64,
    conflict: AtomicU64,
    crash_before_commit: AtomicU64,
    crash_before_ack: AtomicU64,
}

/// The broker: a queue of deliveries; anything not acknowledged goes back on it.
struct Broker {
    queue: Sender<Delivery>,
    deliveries: Receiver<Delivery>,
    unacked: AtomicUsize,
}

impl Broker {
    fn redeliver(&self, delivery: Delivery) {
        self.queue.send(delivery).expect("broker queue open");
    }
    fn ack(&self) {
        self.unacked.fetch_sub(1, Ordering::SeqCst);
    }
}

fn open(args: &Args, dir: &std::path::Path) -> idemdb::Result<Engine> {
    Engine::builder(dir)
        .durability(args.durability)
        .business_table(TableOptions::new("orders"))
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()
}

/// One worker: takes deliveries until the queue is drained or the process "crashes".
fn work(
    engine: &Engine,
    broker: &Broker,
    counts: &Counts,
    crash: &AtomicBool,
    seed: u64,
) -> idemdb::Result<()> {
    let consumer = engine.consumer("order-service")?;
    let orders = engine.business_table("orders")?;
    let effects = engine.business_table("effects")?;
    let mut rng = Rng(seed);
    while broker.unacked.load(Ordering::SeqCst) > 0 {
        let Ok(delivery) = broker.deliveries.recv_timeout(Duration::from_millis(5)) else {
            continue;
        };
        if crash.load(Ordering::SeqCst) {
            // The process died with this delivery unacknowledged: the broker redelivers it.
            broker.redeliver(delivery);
            return Ok(());
        }
        counts.deliveries.fetch_add(1, Ordering::Relaxed);
        let key = order_key(delivery.order);
        let body = order_body(delivery.order);
        match consumer.begin(&key, Fingerprint::of(&body))? {
            Outcome::Fresh(mut claim) => {
                counts.fresh.fetch_add(1, Ordering::Relaxed);
                claim.put(&orders, &key, &body)?;
                claim.merge(&effects, &key, 1u64.to_be_bytes())?;
                claim.merge(&effects, "total", 1u64.to_be_bytes())?;
                if rng.below(CRASH_BEFORE_COMMIT_EVERY) == 0 {
                    // Crash before commit: the claim is dropped, nothing is written.
                    counts.crash_before_commit.fetch_add(1, Ordering::Relaxed);
                    drop(claim);
                    broker.redeliver(delivery);
                    continue;
                }
                claim.commit(format!("accepted {key}"))?;
                counts.committed.fetch_add(1, Ordering::Relaxed);
                if rng.below(CRASH_BEFORE_ACK_EVERY) == 0 {
                    // Crash after commit, before ack: the redelivery must be a duplicate.
                    counts.crash_before_ack.fetch_add(1, Ordering::Relaxed);
                    broker.redeliver(delivery);
                    continue;
                }
                broker.ack();
            }
            Outcome::Duplicate { .. } => {
                counts.duplicate.fetch_add(1, Ordering::Relaxed);
                broker.ack();
            }
            Outcome::InProgress { .. } => {
                // Another worker holds this order right now: nack, the broker redelivers.
                counts.in_progress.fetch_add(1, Ordering::Relaxed);
                broker.redeliver(delivery);
            }
            Outcome::Conflict { .. } => {
                counts.conflict.fetch_add(1, Ordering::Relaxed);
                broker.ack();
            }
            // The demo's messages carry no production time or version, so neither the admission
            // floor nor the ordering guard can apply.
            Outcome::TooLate { .. } | Outcome::Stale { .. } => {
                unreachable!("no admission floor or ordering guard in this demo")
            }
        }
    }
    Ok(())
}

fn run_workers(
    engine: &Engine,
    broker: &Arc<Broker>,
    counts: &Arc<Counts>,
    args: &Args,
    crash_at: Option<usize>,
    round: u64,
) -> idemdb::Result<()> {
    let crash = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..args.workers)
        .map(|index| {
            let (engine, broker, counts, crash) = (
                engine.clone(),
                broker.clone(),
                counts.clone(),
                crash.clone(),
            );
            std::thread::spawn(move || {
                work(
                    &engine,
                    &broker,
                    &counts,
                    &crash,
                    round * 1000 + index as u64 + 1,
                )
            })
        })
        .collect();
    if let Some(crash_at) = crash_at {
        while broker.unacked.load(Ordering::SeqCst) > crash_at {
            std::thread::sleep(Duration::from_millis(1));
        }
        crash.store(true, Ordering::SeqCst);
    }
    for worker in workers {
        worker.join().expect("worker thread panicked")?;
    }
    Ok(())
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

    // The producer's publication: every order once, and ~10% of them a second time, shuffled.
    let mut rng = Rng(42);
    let distinct = args.messages * 100 / (100 + RESEND_PERCENT);
    let mut published: Vec<Delivery> = (0..distinct).map(|order| Delivery { order }).collect();
    while (published.len() as u64) < args.messages {
        published.push(Delivery {
            order: rng.below(distinct),
        });
    }
    for i in (1..published.len()).rev() {
        published.swap(i, rng.below(i as u64 + 1) as usize);
    }

    let (queue, deliveries) = unbounded();
    let broker = Arc::new(Broker {
        queue,
        deliveries,
        unacked: AtomicUsize::new(published.len()),
    });
    for delivery in &published {
        broker.redeliver(*delivery);
    }
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
