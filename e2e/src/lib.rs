//! What the end-to-end checkers share. Each checker (`src/bin/`) runs a consumer recipe of
//! `examples/` as processes against real servers and keeps only its scenario: its options, the
//! topology, the consumers' command lines, the faults it injects and when, and which figures it
//! reports. Everything else is here:
//!
//! - [`args`]: the `--name value` command lines;
//! - [`plan`]: the orders a run publishes (resends, reused ids), reproducible from a seed;
//! - [`supervisor`]: the consumer processes: spawn, SIGKILL, SIGSTOP/SIGCONT, restart, stop;
//! - [`amqp`]: RabbitMQ queues: set-up, publishing at a rate, draining, the dead-letter queue;
//! - [`ledger`]: the consumers' event lines and the system-wide monotonic clock they carry;
//! - [`verdict`]: every order checked against the stores or tables and the dead letters;
//! - [`handoffs`]: a partitioned fleet's owners, handoffs and paused zombie, from the ledgers;
//! - [`backups`]: a fleet's online backups restored and checked whole against the ledgers;
//! - [`kafka`]: a Kafka-protocol broker: client settings, publishing, partitions read back;
//! - [`reads`]: RabbitMQ streams read back; for every log consumer (RabbitMQ streams, NATS
//!   replay, Kafka) the wait until each log is committed to its end, and each offset's settlement
//!   and reads again checked;
//! - [`report`]: the accounting, its pass conditions and the negative-control switch;
//! - [`pg_cluster`]: a private PostgreSQL primary with a synchronous standby, and failovers;
//! - [`effects_table`]: the PostgreSQL fleet's effects table, read back and after a republish;
//! - [`failover_times`]: how long each primary failover kept the fleet from committing.
//!
//! The message format, the stores' layout and the queue names are the recipes' own
//! (`examples/common/`): the checkers include those files, so the two cannot drift apart.

pub mod amqp;
pub mod args;
pub mod backups;
pub mod effects_table;
pub mod failover_times;
pub mod handoffs;
pub mod kafka;
pub mod ledger;
pub mod nats;
pub mod pg_cluster;
pub mod plan;
pub mod reads;
pub mod report;
pub mod supervisor;
pub mod verdict;

/// The NATS JetStream recipe's stream, subjects, consumer names and headers.
#[path = "../../examples/common/jetstream.rs"]
pub mod jetstream;
/// The RabbitMQ recipes' store layout, queue names and message format.
#[path = "../../examples/common/orders.rs"]
pub mod orders;
/// Scraping a consumer's Prometheus endpoint.
#[path = "../../examples/common/prometheus.rs"]
pub mod prometheus;
/// The log consumer's streams, store layout and position placements.
#[path = "../../examples/common/streams.rs"]
pub mod streams;

pub use orders::{BoxError, chain};

/// The checker's `main`: runs `run` on a Tokio runtime and exits 0 when the run passed, 1 when a
/// check failed, 2 when the run could not be made (the error is printed with its sources).
pub fn main<F>(name: &str, run: F)
where
    F: std::future::Future<Output = Result<bool, BoxError>>,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{name}: {error}");
            std::process::exit(2);
        }
    };
    match runtime.block_on(run) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("{name}: {}", chain(error.as_ref()));
            std::process::exit(2);
        }
    }
}

/// The first scrape of a consumer's metrics endpoint (on 127.0.0.1, at one of `ports`) that
/// holds `wanted`, if any answers.
pub fn scrape_first(ports: impl IntoIterator<Item = u16>, wanted: &str) -> Option<String> {
    ports
        .into_iter()
        .filter_map(|port| {
            prometheus::scrape(std::net::SocketAddr::from(([127, 0, 0, 1], port))).ok()
        })
        .find(|sample| sample.contains(wanted))
}

/// Empties (or creates) a run's work folder.
pub fn fresh_folder(path: &std::path::Path) -> Result<(), BoxError> {
    if path.exists() {
        std::fs::remove_dir_all(path)?;
    }
    std::fs::create_dir_all(path)?;
    Ok(())
}
