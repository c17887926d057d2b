//! idemdb's comparison harness: one dedup workload, run side by side against idemdb and the
//! stores users would otherwise pick, interleaved (A B C ... A B C ...), reported as medians and
//! ratios from the same run, with the machine it ran on.
//!
//! Run with `./scripts/compare.sh` (installs Redis and PostgreSQL when missing, then runs
//! `cargo run --release -p idemdb-compare -- all`). See BENCHMARKS.md.

// By concept: the contenders (each one's setup, in one place), the workloads they run and the
// other runs, and the reports and charts of a run. The servers the harness starts for itself
// are one file.
mod contenders;
mod report;
mod servers;
mod workloads;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use crate::contenders::{Kind, Ports, Spec};
use crate::report::{charts, machine};
use crate::workloads::{Generator, Sample};
use crate::workloads::{
    footprint, http_peer, http_peer_crash, neighbour, pg_cost, pg_expiry, profile, scale, tuning,
};

#[derive(Parser)]
#[command(about = "Runs one dedup workload against idemdb and its peers, side by side")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// idemdb against raw RocksDB, TransactionDB, Redis, SQLite and PostgreSQL.
    Peers(PeersArgs),
    /// Throughput and p99 as the store grows; disk bytes per record.
    Scale(scale::ScaleArgs),
    /// Disk usage over many retention periods with a mock clock.
    Ttl(scale::TtlArgs),
    /// RocksDB's write-path options for durable commits, evaluated on idemdb's write pattern.
    WalOptions(tuning::WalArgs),
    /// RocksDB's read-path options on the lookups of new and duplicate keys.
    ReadOptions(tuning::ReadArgs),
    /// Commit latency of the PostgreSQL backend while millions of expired records are removed.
    PgExpiry(pg_expiry::PgExpiryArgs),
    /// What the PostgreSQL server spends per claim: the claim floor beside idemdb-postgres.
    PgCost(pg_cost::PgCostArgs),
    /// The default durable path's footprint: a new store's first open (time, bytes), and the
    /// log after a burst and a quiet spell.
    Footprint(footprint::FootprintArgs),
    /// A durable commit's latency from one thread while another process writes to the same
    /// file system (P13), on the default path and on RocksDB's WAL.
    Neighbour(neighbour::NeighbourArgs),
    /// The load of one neighbour (started by `neighbour`); writes until it is killed.
    #[command(hide = true)]
    NeighbourLoad(neighbour::LoadArgs),
    /// One embedded contender's deliveries on this thread, for callgrind (scripts/profile.sh).
    Profile(profile::ProfileArgs),
    /// HTTP idempotency keys under concurrent retries: idemdb-http against axum-idempotent.
    HttpPeer(http_peer::HttpPeerArgs),
    /// HTTP idempotency keys under SIGKILLs while clients retry: idemdb-http against
    /// axum-idempotent with a durable session store.
    HttpPeerCrash(http_peer_crash::HttpPeerCrashArgs),
    /// The server behind one middleware (started by `http-peer-crash`); serves until killed.
    #[command(hide = true)]
    HttpPeerServe(http_peer_crash::HttpPeerServeArgs),
    /// Everything BENCHMARKS.md shows: peers (with these options), then scale, ttl,
    /// wal-options, read-options and pg-expiry with their defaults.
    All(PeersArgs),
}

#[derive(Args, Clone)]
struct PeersArgs {
    /// Seconds each contender runs per round.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds; each round runs every contender once, in the same order.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Share of deliveries that re-send an earlier message.
    #[arg(long, default_value_t = 0.1)]
    duplicate_ratio: f64,
    /// Run only contenders whose name contains one of these. The report is printed, and written
    /// to `peers-only.md` instead of `peers.md` (the charts are not drawn): a partial run does
    /// not replace the last full one.
    #[arg(long)]
    only: Vec<String>,
    /// First of the three ports for the servers (Redis, Redis with fsync, PostgreSQL).
    #[arg(long, default_value_t = 16379)]
    base_port: u16,
    /// Where results (markdown, CSV) and charts go.
    #[arg(long, default_value = "docs/bench")]
    out: PathBuf,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Peers(args) => {
            let results = peers(&args)?;
            if args.only.is_empty() {
                report::write_peers(&args.out, &results, "peers")?;
                charts::peers(&args.out, &results)?;
            } else {
                report::write_peers(&args.out, &results, "peers-only")?;
            }
        }
        Command::Scale(args) => {
            let points = scale::scale(&args)?;
            report::write_scale(&args.out, &args, &points)?;
            charts::scale(&args.out, &points)?;
        }
        Command::Ttl(args) => {
            let points = scale::ttl(&args)?;
            report::write_ttl(&args.out, &args, &points)?;
        }
        Command::WalOptions(args) => {
            let rows = tuning::wal_options(&args)?;
            report::write_wal_options(&args.out, &args, &rows)?;
        }
        Command::ReadOptions(args) => {
            let rows = tuning::read_options(&args)?;
            report::write_read_options(&args.out, &args, &rows)?;
        }
        Command::PgExpiry(args) => {
            let runs = pg_expiry::run(&args)?;
            report::write_pg_expiry(&args.out, &args, &runs)?;
        }
        Command::PgCost(args) => {
            let costs = pg_cost::run(&args)?;
            std::fs::create_dir_all(&args.out)?;
            std::fs::write(args.out.join("pg-cost.md"), pg_cost::table(&args, &costs))?;
        }
        Command::Profile(args) => profile::run(&args)?,
        Command::Footprint(args) => footprint::run(&args)?,
        Command::HttpPeer(args) => http_peer::run(&args)?,
        Command::HttpPeerCrash(args) => http_peer_crash::run(&args)?,
        Command::HttpPeerServe(args) => http_peer_crash::serve(&args)?,
        Command::Neighbour(args) => neighbour::run(&args)?,
        Command::NeighbourLoad(args) => neighbour::load(&args)?,
        Command::All(args) => {
            let results = peers(&args)?;
            report::write_peers(&args.out, &results, "peers")?;
            charts::peers(&args.out, &results)?;
            let scale_args = scale::ScaleArgs::defaults(args.out.clone());
            let points = scale::scale(&scale_args)?;
            report::write_scale(&args.out, &scale_args, &points)?;
            charts::scale(&args.out, &points)?;
            let ttl_args = scale::TtlArgs::defaults(args.out.clone());
            let points = scale::ttl(&ttl_args)?;
            report::write_ttl(&args.out, &ttl_args, &points)?;
            let wal_args = tuning::WalArgs::defaults(args.out.clone());
            let rows = tuning::wal_options(&wal_args)?;
            report::write_wal_options(&args.out, &wal_args, &rows)?;
            let read_args = tuning::ReadArgs::defaults(args.out.clone());
            let rows = tuning::read_options(&read_args)?;
            report::write_read_options(&args.out, &read_args, &rows)?;
            let expiry_args = pg_expiry::PgExpiryArgs::defaults(args.out.clone());
            let runs = pg_expiry::run(&expiry_args)?;
            report::write_pg_expiry(&args.out, &expiry_args, &runs)?;
        }
    }
    Ok(())
}

/// Every round's sample of one contender.
pub struct Measured {
    pub spec: Spec,
    pub rounds: Vec<Sample>,
}

/// The run's settings, echoed into the report.
pub struct PeersRun {
    pub seconds: f64,
    pub rounds: usize,
    pub duplicate_ratio: f64,
    /// The `--only` filters of a partial run (empty: every contender ran).
    pub only: Vec<String>,
    pub machine: machine::Machine,
    pub measured: Vec<Measured>,
}

fn peers(args: &PeersArgs) -> Result<PeersRun> {
    let specs: Vec<Spec> = contenders::all()
        .into_iter()
        .filter(|spec| args.only.is_empty() || args.only.iter().any(|o| spec.name.contains(o)))
        .collect();
    anyhow::ensure!(!specs.is_empty(), "no contender matches --only");
    let run_dir = tempfile::Builder::new()
        .prefix("idemdb-compare-")
        .tempdir()
        .context("temporary directory")?;
    let ports = Ports {
        redis: args.base_port,
        redis_fsync: args.base_port + 1,
        postgres: args.base_port + 2,
    };
    let machine = machine::Machine::describe(run_dir.path());
    eprintln!("{machine}");
    // Started once, stopped (by pid) when these drop at the end of the run or on an error.
    let _redis_servers = if specs.iter().any(|s| s.needs_redis()) {
        eprintln!(
            "starting redis-server on 127.0.0.1:{} and :{}",
            ports.redis, ports.redis_fsync
        );
        Some((
            servers::redis(run_dir.path(), ports.redis, false)?,
            servers::redis(run_dir.path(), ports.redis_fsync, true)?,
        ))
    } else {
        None
    };
    let postgres_server = if specs.iter().any(|s| s.needs_postgres()) {
        eprintln!("starting postgres on 127.0.0.1:{}", ports.postgres);
        Some(servers::postgres(run_dir.path(), ports.postgres)?)
    } else {
        None
    };

    let duration = Duration::from_secs_f64(args.seconds);
    let mut measured: Vec<Measured> = specs
        .iter()
        .map(|spec| Measured {
            spec: spec.clone(),
            rounds: Vec::new(),
        })
        .collect();
    for round in 0..args.rounds {
        for entry in &mut measured {
            let spec = &entry.spec;
            // No contender pays for another's deferred writes: PostgreSQL writes its dirty
            // buffers now, and every file system writes back its dirty pages.
            if postgres_server.is_some() {
                contenders::peers::PostgresSession::checkpoint(ports.postgres)?;
            }
            // SAFETY: sync(2) takes no arguments and cannot fail.
            unsafe { libc::sync() };
            let dir = run_dir.path().join(format!("store-{round}"));
            std::fs::create_dir_all(&dir)?;
            let prepared = contenders::prepare(spec, &dir, ports)
                .with_context(|| format!("setting up {}", spec.name))?;
            let seed = 0x1de3_d000 + round as u64;
            let duplicate_ratio = args.duplicate_ratio;
            let replay = matches!(spec.kind, Kind::IdemdbDuplicates { .. });
            let sample = workloads::drive(prepared.sessions, spec.shape, duration, |thread| {
                let generator = Generator::new(thread, seed, duplicate_ratio);
                if replay {
                    generator.replaying(contenders::DUPLICATE_RUN_KEYS)
                } else {
                    generator
                }
            })
            .with_context(|| format!("running {}", spec.name))?;
            drop(prepared.store);
            std::fs::remove_dir_all(&dir)?;
            eprintln!(
                "round {}/{}  {:<45} {:>10.0} msg/s  p50 {:>8.1} us  p99 {:>8.1} us",
                round + 1,
                args.rounds,
                spec.name,
                sample.per_second(),
                sample.latency_us(0.5),
                sample.latency_us(0.99),
            );
            entry.rounds.push(sample);
        }
    }
    Ok(PeersRun {
        seconds: args.seconds,
        rounds: args.rounds,
        duplicate_ratio: args.duplicate_ratio,
        only: args.only.clone(),
        machine,
        measured,
    })
}
