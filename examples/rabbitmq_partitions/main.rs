//! A consumer of a partitioned fleet: the broker decides which process owns which partition,
//! and each partition's store moves with it.
//!
//! ```text
//! cargo run --release --features tokio --example rabbitmq_partitions -- \
//!     --amqp 'amqp://guest:guest@127.0.0.1:15673/%2f?heartbeat=2' --partitions 6 \
//!     --stores /tmp/orders-stores --ledger /tmp/orders-ledger.log
//! ```
//!
//! Orders go through RabbitMQ's consistent-hash exchange to P partition queues, each declared
//! with `x-single-active-consumer`. Every process of the fleet subscribes to every partition
//! queue; the broker delivers each queue to one of them at a time and, when that one's
//! connection goes (a crash, a lost network, missed heartbeats), to the next. The store of
//! partition `p` is the directory `<stores>/partition-<p>`: it stands for a volume that moves
//! with the partition (a Kubernetes PersistentVolume, an EBS volume). The handoff:
//!
//! 1. The first delivery from partition `p`'s queue tells this process it is now the owner.
//! 2. It opens the partition's store. While the previous owner still holds it (a process
//!    paused, not yet aware that the broker gave its partitions away), the open is refused
//!    with `AlreadyOpen` (after the engine's own wait of up to 0.5 s for the lock, which it
//!    takes within milliseconds of its release); it tries again 50 ms later, holding the
//!    deliveries unacked.
//! 3. It handles the partition's deliveries (`common/handler.rs`) with that store.
//! 4. When the connection is lost it stops committing (claims not yet committed are dropped),
//!    stops its handlers, closes every store it owns, and only then connects again, as a
//!    standby for every partition.
//!
//! While it owns a partition it can also take an online backup of its store every
//! `--checkpoint-every-ms` (`Engine::checkpoint`) into `<backups>`.
//!
//! `e2e/src/bin/rabbitmq_handoff.rs` runs a fleet of these against a real server, SIGKILLs and
//! SIGSTOPs them, and checks the effects (`scripts/rabbitmq-handoff.sh`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

#[path = "../common/args.rs"]
mod args;
#[path = "../common/handler.rs"]
mod handler;
#[path = "../common/ledger.rs"]
mod ledger;
#[path = "../common/orders.rs"]
mod orders;
mod partition;
mod session;
use args::Flags;
use handler::BoxError;
use ledger::Ledger;
use session::{Ended, session};

struct Options {
    amqp: String,
    partitions: usize,
    stores: PathBuf,
    /// Partitions subscribed to first, so that a fleet started together spreads ownership.
    preferred: Vec<usize>,
    prefetch: u16,
    metrics: Option<SocketAddr>,
    ledger: Option<PathBuf>,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    checkpoint_every: Option<Duration>,
    backups: Option<PathBuf>,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        amqp: "amqp://guest:guest@127.0.0.1:15673/%2f?heartbeat=2".into(),
        partitions: 6,
        stores: PathBuf::from("/tmp/idemdb-partitions"),
        preferred: Vec::new(),
        prefetch: 32,
        metrics: None,
        ledger: None,
        transient_failure_percent: 0,
        kill_after_commit_per_mille: 0,
        checkpoint_every: None,
        backups: None,
    };
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--amqp" => options.amqp = flags.value(&flag)?,
            "--partitions" => options.partitions = flags.parse(&flag)?,
            "--stores" => options.stores = flags.value(&flag)?.into(),
            "--preferred" => {
                options.preferred = flags
                    .value(&flag)?
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .map(str::parse)
                    .collect::<Result<_, _>>()?;
            }
            "--prefetch" => options.prefetch = flags.parse(&flag)?,
            "--metrics" => options.metrics = Some(flags.parse(&flag)?),
            "--ledger" => options.ledger = Some(flags.value(&flag)?.into()),
            "--transient-failure-percent" => {
                options.transient_failure_percent = flags.parse(&flag)?;
            }
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = flags.parse(&flag)?;
            }
            "--checkpoint-every-ms" => {
                options.checkpoint_every = Some(Duration::from_millis(flags.parse(&flag)?));
            }
            "--backups" => options.backups = Some(flags.value(&flag)?.into()),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.partitions == 0 || options.prefetch == 0 {
        return Err("--partitions and --prefetch must be at least 1".into());
    }
    if let Some(p) = options.preferred.iter().find(|p| **p >= options.partitions) {
        return Err(format!("--preferred names partition {p} of {}", options.partitions).into());
    }
    if options.checkpoint_every.is_some() != options.backups.is_some() {
        return Err("--checkpoint-every-ms and --backups go together".into());
    }
    if let Some(addr) = options.metrics
        && !addr.ip().is_loopback()
    {
        return Err("--metrics must be a 127.0.0.0/8 address".into());
    }
    Ok(options)
}

/// What every partition task of one process shares.
struct Shared {
    options: Options,
    ledger: Option<Arc<Ledger>>,
    draws: AtomicU64,
    checkpoints: AtomicU64,
}

impl Shared {
    fn event(&self, kind: &str, subject: &str, partition: Option<usize>) {
        if let Some(ledger) = &self.ledger {
            ledger.event(kind, subject, partition);
        }
    }
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("rabbitmq_partitions: {error}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    if let Some(addr) = options.metrics {
        // Install before any store opens: idemdb registers its metrics then.
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()?;
    }
    std::fs::create_dir_all(&options.stores)?;
    let ledger = match &options.ledger {
        Some(path) => Some(Arc::new(Ledger::open(path)?)),
        None => None,
    };
    let shared = Arc::new(Shared {
        options,
        ledger,
        draws: AtomicU64::new(0),
        checkpoints: AtomicU64::new(0),
    });
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        match session(&shared, &mut terminate).await {
            Ok(Ended::Terminated) => return Ok(()),
            Ok(Ended::ConnectionLost) => {}
            // A failed connect (the broker restarting): try again.
            Err(error) => eprintln!("rabbitmq_partitions: session: {error}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
