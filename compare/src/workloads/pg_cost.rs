//! `pg-cost`: what the PostgreSQL server spends per claim, the claim floor beside
//! idemdb-postgres: statements, WAL bytes and shared buffers touched (from
//! `pg_stat_statements`), and the CPU time of the session's backend (its time on CPU, from
//! `/proc/<pid>/schedstat`).
//!
//! Counts, not rates: each contender delivers the same messages on one connection, one call
//! at a time, so the figures do not depend on how busy the machine is (the CPU time does a
//! little: cache misses). The server is the harness's own, started with `pg_stat_statements`
//! loaded (`track = top`: a function's statements count in its call, as its WAL and buffers
//! do).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::contenders::{self, Ports};
use crate::servers;
use crate::workloads::{Delivery, Generator};

#[derive(Args, Clone)]
pub struct PgCostArgs {
    /// Messages each contender delivers while counted (after as many uncounted, to warm up).
    #[arg(long, default_value_t = 20_000)]
    pub messages: u64,
    /// Share of deliveries that re-send an earlier message.
    #[arg(long, default_value_t = 0.1)]
    pub duplicate_ratio: f64,
    /// Only contenders whose name contains one of these (all of [`CONTENDERS`] when absent).
    #[arg(long)]
    pub only: Vec<String>,
    #[arg(long, default_value_t = 16382)]
    pub port: u16,
    /// Where the table goes (`pg-cost.md`).
    #[arg(long, default_value = "docs/bench")]
    pub out: PathBuf,
    /// Also print each contender's statements (stderr): calls, execution time per call, and
    /// how often each was planned, the costliest first.
    #[arg(long)]
    pub statements: bool,
}

/// The contenders measured, by their names in `contenders::all()`; each runs on one connection
/// whatever its client count there.
pub const CONTENDERS: [&str; 10] = [
    "postgres claim floor, 1 client",
    "postgres claim floor, two round trips, 1 client",
    "postgres record floor, 1 client",
    "postgres record floor, two round trips, 1 client",
    "idemdb-postgres, 1 client",
    "idemdb-postgres apply, 1 client",
    "postgres claim floor, 8 clients, batch 64",
    "postgres claim floor answering duplicates, 8 clients, batch 64",
    "postgres record floor answering duplicates, 8 clients, batch 64",
    "idemdb-postgres, 8 clients, batch 64",
];

/// One contender's server-side cost, per message.
pub struct Cost {
    pub name: String,
    pub statements: f64,
    pub wal_bytes: f64,
    pub buffers_hit: f64,
    pub buffers_read: f64,
    pub buffers_dirtied: f64,
    /// `pg_stat_statements`' execution time (what the server spent in the executor).
    pub exec_us: f64,
    /// The session's backend's time on CPU.
    pub cpu_us: f64,
    /// The harness process's time on CPU (the contender's client: its library, the driver,
    /// the runtime), every thread.
    pub client_cpu_us: f64,
    /// Time from the first call to the last returning, per message.
    pub wall_us: f64,
}

pub fn run(args: &PgCostArgs) -> Result<Vec<Cost>> {
    let run_dir = tempfile::Builder::new()
        .prefix("idemdb-pg-cost-")
        .tempdir()
        .context("temporary directory")?;
    let server = servers::postgres_with(
        run_dir.path(),
        args.port,
        &[
            "shared_preload_libraries=pg_stat_statements",
            "pg_stat_statements.track=top",
            "pg_stat_statements.max=10000",
            // Planning counted apart from execution (`plans`, and its time in neither column
            // of the table): a statement planned at every run shows there.
            "pg_stat_statements.track_planning=on",
        ],
    )?;
    let ports = Ports {
        redis: 0,
        redis_fsync: 0,
        postgres: args.port,
    };
    let mut observer =
        postgres::Client::connect(&servers::postgres_url(args.port), postgres::NoTls)?;
    observer.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")?;
    let mut costs = Vec::new();
    for name in CONTENDERS {
        if !args.only.is_empty() && !args.only.iter().any(|only| name.contains(only)) {
            continue;
        }
        let mut spec = contenders::all()
            .into_iter()
            .find(|spec| spec.name == name)
            .with_context(|| format!("no contender named {name:?}"))?;
        spec.shape.threads = 1;
        let dir = run_dir.path().join("store");
        std::fs::create_dir_all(&dir)?;
        let mut prepared = contenders::prepare(&spec, &dir, ports)?;
        let session = prepared
            .sessions
            .first_mut()
            .context("the contender has no session")?;
        let per_call = spec.shape.batch;
        let calls = args.messages.div_ceil(per_call as u64);
        let mut generator = Generator::new(0, 0x1de3_d000, args.duplicate_ratio);
        let mut deliveries: Vec<Delivery> = Vec::with_capacity(per_call);
        let mut deliver = |session: &mut Box<dyn crate::workloads::Session>| {
            for _ in 0..calls {
                deliveries.clear();
                deliveries.extend((0..per_call).map(|_| generator.next_delivery()));
                session.deliver(&deliveries)?;
            }
            anyhow::Ok(())
        };
        // Warm up (statements prepared, plans kept, the tables' first pages there), then count.
        deliver(session)?;
        observer.batch_execute("CHECKPOINT")?;
        observer.execute("SELECT pg_stat_statements_reset()", &[])?;
        let cpu_before = backends_cpu_ns(&mut observer)?;
        let client_before = own_cpu_ns();
        let started = std::time::Instant::now();
        deliver(session)?;
        let wall = started.elapsed();
        let client_after = own_cpu_ns();
        let cpu_after = backends_cpu_ns(&mut observer)?;
        let row = observer.query_one(
            "SELECT sum(calls)::float8, sum(wal_bytes)::float8, \
                 sum(shared_blks_hit)::float8, sum(shared_blks_read)::float8, \
                 sum(shared_blks_dirtied)::float8, sum(total_exec_time)::float8 \
             FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%'",
            &[],
        )?;
        if args.statements {
            print_statements(&mut observer)?;
        }
        drop(prepared);
        std::fs::remove_dir_all(&dir)?;
        let messages = calls * per_call as u64;
        let per = |total: Option<f64>| total.unwrap_or(0.0) / messages as f64;
        let cost = Cost {
            name: name.to_owned(),
            statements: per(row.get(0)),
            wal_bytes: per(row.get(1)),
            buffers_hit: per(row.get(2)),
            buffers_read: per(row.get(3)),
            buffers_dirtied: per(row.get(4)),
            exec_us: per(row.get::<_, Option<f64>>(5).map(|ms| ms * 1000.0)),
            cpu_us: cpu_after.saturating_sub(cpu_before) as f64 / 1000.0 / messages as f64,
            client_cpu_us: client_after.saturating_sub(client_before) as f64
                / 1000.0
                / messages as f64,
            wall_us: wall.as_secs_f64() * 1e6 / messages as f64,
        };
        eprintln!(
            "{:<64} {:>5.2} statements  {:>6.0} WAL bytes  {:>6.1} hit  {:>5.2} dirtied  {:>6.1} us exec  {:>6.1} us backend CPU  {:>6.1} us client CPU  {:>6.1} us wall",
            cost.name,
            cost.statements,
            cost.wal_bytes,
            cost.buffers_hit,
            cost.buffers_dirtied,
            cost.exec_us,
            cost.cpu_us,
            cost.client_cpu_us,
            cost.wall_us
        );
        costs.push(cost);
    }
    drop(server);
    Ok(costs)
}

/// Prints the statements counted since the last reset, the costliest first: calls, execution
/// time per call, times planned, and the text's start.
fn print_statements(observer: &mut postgres::Client) -> Result<()> {
    let rows = observer.query(
        "SELECT calls::float8, total_exec_time::float8, plans::float8, \
             total_plan_time::float8, left(regexp_replace(query, '\\s+', ' ', 'g'), 120) \
         FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_%' \
         ORDER BY total_exec_time DESC",
        &[],
    )?;
    for row in rows {
        let (calls, exec_ms, plans, plan_ms, query): (f64, f64, f64, f64, String) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        eprintln!(
            "    {calls:>8.0} calls {:>8.2} us exec a call {plans:>6.0} plans {:>8.2} us planning a call  {query}",
            exec_ms * 1000.0 / calls.max(1.0),
            plan_ms * 1000.0 / calls.max(1.0)
        );
    }
    Ok(())
}

/// The time on CPU of this process, every thread (`/proc/self/task/*/schedstat`; a thread that
/// ended meanwhile is left out, so the harness's threads must outlive the count), nanoseconds.
fn own_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|task| task.ok())
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|schedstat| schedstat.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The time on CPU of the server's client backends other than the observer's (the session's
/// own backend: the other processes, autovacuum and the writers, are left out), nanoseconds.
fn backends_cpu_ns(observer: &mut postgres::Client) -> Result<u64> {
    let rows = observer.query(
        "SELECT pid FROM pg_stat_activity \
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        &[],
    )?;
    let mut total = 0;
    for row in rows {
        let pid: i32 = row.get(0);
        // A backend may end between the listing and the read: it is skipped.
        let Ok(schedstat) = std::fs::read_to_string(format!("/proc/{pid}/schedstat")) else {
            continue;
        };
        total += schedstat
            .split_whitespace()
            .next()
            .and_then(|field| field.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(total)
}

/// The table of `costs`, as markdown.
pub fn table(args: &PgCostArgs, costs: &[Cost]) -> String {
    let mut out = format!(
        "Command: `./scripts/compare.sh pg-cost --messages {}`. Each contender delivers {} \
         messages on one connection, one call at a time ({}% re-sent), after as many \
         uncounted; per message: statements, WAL bytes, shared buffers hit, read and dirtied and \
         execution time from `pg_stat_statements` (`track = top`, `BEGIN` and `COMMIT` \
         included), the CPU time of the session's backend process (`/proc/<pid>/schedstat`; autovacuum and \
         the server's writers left out), the CPU time of the harness's process, which is the \
         contender's client (every thread), and the time from the first call to the last.\n\n\
         | contender | statements | WAL bytes | buffers hit | buffers read | buffers dirtied | executor us | backend CPU us | client CPU us | wall us |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        args.messages,
        args.messages,
        args.duplicate_ratio * 100.0
    );
    for cost in costs {
        out.push_str(&format!(
            "| {} | {:.2} | {:.0} | {:.1} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            cost.name,
            cost.statements,
            cost.wal_bytes,
            cost.buffers_hit,
            cost.buffers_read,
            cost.buffers_dirtied,
            cost.exec_us,
            cost.cpu_us,
            cost.client_cpu_us,
            cost.wall_us
        ));
    }
    out
}
