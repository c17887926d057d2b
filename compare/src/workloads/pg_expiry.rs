//! idemdb's PostgreSQL backend while expired records are removed, at a constant rate of
//! claims: what removal costs the commits, and what the table weighs after many retention
//! periods.
//!
//! Two runs. **Backlog**: the expired records are written straight into the records table
//! (one SQL statement, real encoded records, their removal times rising with their place in
//! the table as claims over time would have written them), then clients claim and commit new
//! messages (the business row in the claim's transaction, as in the peers run) at a constant
//! total rate for a quiet window, then the removal starts on its own connection while they go
//! on, until the backlog is gone. Each removal method runs on a fresh server, and last the
//! control: the same backlog and the same clients for as long as the longest removal, with no
//! removal. Reported per method: the p99 of the commits started while the removal ran, against
//! the control's p99 over the same span of its run (checkpoints and autovacuum come in both).
//! **Steady state**: a fresh server, a short retention, claims at a constant rate for several
//! retention periods, `maintain` every tenth of a period; at the end of every period the
//! records table with its indexes is weighed against a freshly built copy of its live rows
//! (same indexes), which is what the live records take at the least.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::Args;
use idemdb::Fingerprint;
use idemdb::format::Record;
use idemdb_postgres::PgStore;

use crate::contenders::pg_backend::{self, IdemdbPgSession};
use crate::workloads::{Generator, Session, quantile};

#[derive(Args, Clone)]
pub struct PgExpiryArgs {
    /// Expired records present when the removal starts (backlog run).
    #[arg(long, default_value_t = 10_000_000)]
    pub records: u64,
    /// Concurrent clients claiming and committing throughout.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Messages per second, all clients together (paced; a client behind schedule sends at once).
    #[arg(long, default_value_t = 2_000)]
    pub rate: u64,
    /// The share of its connection's time of the second removal, `maintain_with`, in percent
    /// (`Removal::busy_percent`; backlog run; 100: as fast as it goes).
    #[arg(long, default_value_t = 100)]
    pub busy_percent: u8,
    /// Spread the backlog's removal times over a minute regardless of the rows' place in the
    /// table (each batch of removal then touches a page per row), as runs before session 33 did.
    #[arg(long)]
    pub scattered: bool,
    /// Seconds of the quiet window before the removal starts (backlog run).
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// Run only `maintain` (its defaults) and the control of the backlog runs.
    #[arg(long)]
    pub only_default: bool,
    /// Retention of the steady-state run, in seconds.
    #[arg(long, default_value_t = 30)]
    pub retention_s: u64,
    /// Retention periods of the steady-state run (0: no steady-state run).
    #[arg(long, default_value_t = 10)]
    pub periods: u32,
    /// The port of the private PostgreSQL server.
    #[arg(long, default_value_t = 16381)]
    pub port: u16,
    /// Where the results go.
    #[arg(long, default_value = "docs/bench")]
    pub out: std::path::PathBuf,
}

impl PgExpiryArgs {
    pub fn defaults(out: std::path::PathBuf) -> PgExpiryArgs {
        PgExpiryArgs {
            records: 10_000_000,
            clients: 8,
            rate: 2_000,
            busy_percent: 100,
            scattered: false,
            only_default: false,
            seconds: 20.0,
            retention_s: 30,
            periods: 10,
            port: 16381,
            out,
        }
    }
}

/// How the expired records are removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// `PgStore::maintain`, its defaults: batches of 1,000 rows, each its own transaction,
    /// busy 10% of the time.
    Maintain,
    /// `PgStore::maintain_with`, batches of 1,000 rows, busy `--busy-percent` of the time.
    MaintainWith,
    /// One `DELETE` of every expired row: what a hand-written inbox table's removal does.
    Delete,
    /// No removal: the control, as long as the longest removal.
    Control,
}

impl Removal {
    pub fn name(self, args: &PgExpiryArgs) -> String {
        match self {
            Removal::Maintain => "maintain (batches of 1,000 rows, busy 10% of the time)".into(),
            Removal::MaintainWith => format!(
                "maintain_with (batches of 1,000 rows, busy {}% of the time)",
                args.busy_percent
            ),
            Removal::Delete => "one DELETE of every expired row".into(),
            Removal::Control => "none (the control)".into(),
        }
    }
}

/// One removal method's backlog run.
pub struct ExpiryRun {
    pub removal: Removal,
    pub removal_seconds: f64,
    pub removed: u64,
    pub quiet_commits: usize,
    pub quiet_p99_us: f64,
    pub during_commits: usize,
    pub during_p50_us: f64,
    pub during_p99_us: f64,
    /// The slowest commit started while the removal ran.
    pub during_max_us: f64,
    pub rows_left: i64,
    /// The p99 of the control's commits started in the same span of its run as this removal's.
    pub control_p99_us: f64,
    /// The control's slowest commit in that span.
    pub control_max_us: f64,
}

/// One retention period of the steady-state run, weighed at its end.
pub struct Period {
    /// Bytes of the records table with its indexes (and TOAST).
    pub table_bytes: i64,
    /// Bytes of a freshly built copy of the live rows with the same indexes.
    pub live_bytes: i64,
    pub live_rows: i64,
    /// Expired rows still in the table when it was weighed.
    pub expired_rows: i64,
    /// Rows `maintain` removed during the period.
    pub removed: u64,
    pub commits: usize,
    pub p99_us: f64,
}

pub struct ExpiryReport {
    pub backlog: Vec<ExpiryRun>,
    pub steady: Vec<Period>,
}

pub fn run(args: &PgExpiryArgs) -> Result<ExpiryReport> {
    let mut backlog = Vec::new();
    for removal in [Removal::Maintain, Removal::MaintainWith, Removal::Delete] {
        if args.only_default && removal != Removal::Maintain {
            continue;
        }
        let dir = tempdir()?;
        eprintln!("starting postgres on 127.0.0.1:{}", args.port);
        let server = crate::servers::postgres(dir.path(), args.port)?;
        backlog.push(backlog_run(args, removal, Duration::ZERO)?.0);
        drop(server);
    }
    // The control runs as long as the longest removal ran, on a fresh server of its own.
    let longest = backlog
        .iter()
        .map(|run| run.removal_seconds)
        .fold(0.0, f64::max);
    let dir = tempdir()?;
    let server = crate::servers::postgres(dir.path(), args.port)?;
    let (control, calls) = backlog_run(args, Removal::Control, Duration::from_secs_f64(longest))?;
    drop(server);
    let from = Duration::from_secs_f64(args.seconds);
    for run in &mut backlog {
        let span = window(
            &calls,
            from,
            from + Duration::from_secs_f64(run.removal_seconds.max(0.001)),
        );
        run.control_p99_us = us(&span, 0.99);
        run.control_max_us = us(&span, 1.0);
    }
    backlog.push(control);
    let mut steady = Vec::new();
    if args.periods > 0 {
        let dir = tempdir()?;
        let server = crate::servers::postgres(dir.path(), args.port)?;
        steady = steady_run(args)?;
        drop(server);
    }
    Ok(ExpiryReport { backlog, steady })
}

fn tempdir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("idemdb-pg-expiry-")
        .tempdir()
        .context("temporary directory")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// (start since the run began, latency) of one commit, in nanoseconds.
type Call = (u64, u64);

/// Clients delivering at `rate` messages per second in all until `stop`, each on its own
/// connection, with the store's `retention`.
fn paced_clients(
    args: &PgExpiryArgs,
    retention: Option<Duration>,
    started: Instant,
    stop: &Arc<AtomicBool>,
) -> Result<Vec<std::thread::JoinHandle<Result<Vec<Call>>>>> {
    let interval = Duration::from_secs_f64(args.clients as f64 / args.rate.max(1) as f64);
    (0..args.clients)
        .map(|thread| {
            let stop = stop.clone();
            let mut session = IdemdbPgSession::connect_with(args.port, true, false, retention)?;
            Ok(std::thread::spawn(move || -> Result<Vec<Call>> {
                let mut generator = Generator::new(thread, 0x5eed, 0.1);
                let mut calls = Vec::with_capacity(1 << 16);
                // Clients start spread over one interval, not all at once.
                let mut next = started + interval.mul_f64(thread as f64 / 8.0);
                while !stop.load(Ordering::Relaxed) {
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    next += interval;
                    let delivery = generator.next_delivery();
                    let at = started.elapsed().as_nanos() as u64;
                    let call = Instant::now();
                    session.deliver(&[delivery])?;
                    calls.push((at, call.elapsed().as_nanos() as u64));
                }
                Ok(calls)
            }))
        })
        .collect()
}

fn join_all(clients: Vec<std::thread::JoinHandle<Result<Vec<Call>>>>) -> Result<Vec<Call>> {
    let mut calls = Vec::new();
    for client in clients {
        calls.extend(
            client
                .join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))??,
        );
    }
    Ok(calls)
}

/// The latencies of the calls started between `from` and `to`, sorted.
fn window(calls: &[Call], from: Duration, to: Duration) -> Vec<u32> {
    let (from, to) = (from.as_nanos() as u64, to.as_nanos() as u64);
    let mut latencies: Vec<u32> = calls
        .iter()
        .filter(|(at, _)| (from..to).contains(at))
        .map(|(_, latency)| u32::try_from(*latency).unwrap_or(u32::MAX))
        .collect();
    latencies.sort_unstable();
    latencies
}

fn us(sorted: &[u32], q: f64) -> f64 {
    quantile(sorted, q) / 1000.0
}

/// One backlog run; the control (no removal) lasts `control_for` after the quiet window.
/// Answers the run and its calls.
fn backlog_run(
    args: &PgExpiryArgs,
    removal: Removal,
    control_for: Duration,
) -> Result<(ExpiryRun, Vec<Call>)> {
    let port = args.port;
    pg_backend::reset(port)?;
    let runtime = pg_backend::runtime()?;
    let fill_started = Instant::now();
    runtime.block_on(async {
        let client = pg_backend::connect(port, true).await?;
        // Committed a day ago, expired an hour ago (what matters is when the row is removable),
        // their removal times spread over a minute: rising with the row's place in the table,
        // as claims committed one after the other at a constant retention write them, or
        // (--scattered) cycling through the minute so neighbouring rows are a minute apart.
        let expired_at_ms = now_ms() - 3_600_000;
        let spread = if args.scattered {
            "$2::int8 - (i % 60000)"
        } else {
            "$2::int8 - 60000 + (i * 60000 / $3::int8)"
        };
        let record = Record::new(
            1,
            expired_at_ms - 86_400_000,
            expired_at_ms,
            Fingerprint::of(b"expired"),
            bytes::Bytes::new(),
        )
        .encode();
        eprintln!("writing {} expired records", args.records);
        client
            .execute(
                &format!(
                    "INSERT INTO bench_idemdb.records (consumer, message_key, record, expires_at_ms) \
                     SELECT 'bench'::bytea, convert_to('x' || lpad(i::text, 15, '0'), 'UTF8'), $1, \
                            {spread} \
                     FROM generate_series(1, $3::int8) AS i"
                ),
                &[&record, &(expired_at_ms as i64), &(args.records as i64)],
            )
            .await?;
        // Nothing left for autovacuum to do before the measurement, and no dirty buffers.
        // Separate queries: VACUUM refuses to run in the implicit transaction of several.
        client
            .batch_execute("VACUUM (ANALYZE) bench_idemdb.records")
            .await?;
        client.batch_execute("CHECKPOINT").await?;
        anyhow::Ok(())
    })?;
    eprintln!(
        "filled in {:.0} s; {} clients start at {} messages/s",
        fill_started.elapsed().as_secs_f64(),
        args.clients,
        args.rate
    );
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let clients = paced_clients(args, None, started, &stop)?;
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    let removal_start = started.elapsed();
    let (removal_end, removed, rows_left) = runtime.block_on(async {
        let client = pg_backend::connect(port, true).await?;
        let store = PgStore::builder()
            .names(pg_backend::names()?)
            .open(&client)
            .await?;
        let removed = match removal {
            Removal::Maintain => store.maintain(&client).await?.removed,
            Removal::MaintainWith => {
                let removal = idemdb_postgres::Removal::default().busy_percent(args.busy_percent);
                store.maintain_with(&client, removal).await?.removed
            }
            Removal::Control => {
                tokio::time::sleep(control_for).await;
                0
            }
            Removal::Delete => {
                client
                    .execute(
                        "DELETE FROM bench_idemdb.records \
                     WHERE expires_at_ms <= floor(extract(epoch FROM now()) * 1000)::int8",
                        &[],
                    )
                    .await?
            }
        };
        let end = started.elapsed();
        let left: i64 = client
            .query_one(
                "SELECT count(*) FROM bench_idemdb.records \
                 WHERE message_key >= 'x' AND message_key < 'y'",
                &[],
            )
            .await?
            .get(0);
        anyhow::Ok((end, removed, left))
    })?;
    stop.store(true, Ordering::Relaxed);
    let calls = join_all(clients)?;
    // The quiet window skips the first second (connections warming up).
    let quiet = window(&calls, Duration::from_secs(1), removal_start);
    let during = window(
        &calls,
        removal_start,
        removal_end.max(removal_start + Duration::from_millis(1)),
    );
    let result = ExpiryRun {
        removal,
        removal_seconds: (removal_end - removal_start).as_secs_f64(),
        removed,
        quiet_commits: quiet.len(),
        quiet_p99_us: us(&quiet, 0.99),
        during_commits: during.len(),
        during_p50_us: us(&during, 0.5),
        during_p99_us: us(&during, 0.99),
        during_max_us: us(&during, 1.0),
        rows_left,
        control_p99_us: 0.0,
        control_max_us: 0.0,
    };
    eprintln!(
        "{}: {} removed in {:.1} s; p99 quiet {:.0} us ({} commits), during {:.0} us ({} commits); {} expired rows left",
        removal.name(args),
        result.removed,
        result.removal_seconds,
        result.quiet_p99_us,
        result.quiet_commits,
        result.during_p99_us,
        result.during_commits,
        result.rows_left
    );
    Ok((result, calls))
}

fn steady_run(args: &PgExpiryArgs) -> Result<Vec<Period>> {
    let port = args.port;
    pg_backend::reset(port)?;
    let runtime = pg_backend::runtime()?;
    let retention = Duration::from_secs(args.retention_s);
    // The run squeezes days into seconds; autovacuum's pass over the tables is squeezed with
    // them (once a minute by default, against a retention of days in production).
    runtime.block_on(async {
        let client = pg_backend::connect(port, true).await?;
        client
            .batch_execute("ALTER SYSTEM SET autovacuum_naptime = '1s'")
            .await?;
        client.batch_execute("SELECT pg_reload_conf()").await?;
        anyhow::Ok(())
    })?;
    eprintln!(
        "steady state: {} periods of {} s at {} messages/s",
        args.periods, args.retention_s, args.rate
    );
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let clients = paced_clients(args, Some(retention), started, &stop)?;
    let mut periods = Vec::new();
    let mut marks = Vec::new();
    runtime.block_on(async {
        let client = pg_backend::connect(port, true).await?;
        let store = PgStore::builder()
            .names(pg_backend::names()?)
            .retention(retention)
            .open(&client)
            .await?;
        for period in 1..=args.periods {
            let mut removed = 0;
            let period_end = retention * period;
            while started.elapsed() < period_end {
                removed += store.maintain(&client).await?.removed;
                let next = (started.elapsed() + retention / 10).min(period_end);
                if let Some(wait) = next.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
            let (table_bytes, live_bytes, live_rows, expired_rows) = weigh(&client).await?;
            eprintln!(
                "period {period}: table {:.1} MB, live copy {:.1} MB ({:.2}x), {live_rows} live rows, {expired_rows} expired left, {removed} removed",
                table_bytes as f64 / 1e6,
                live_bytes as f64 / 1e6,
                table_bytes as f64 / live_bytes.max(1) as f64
            );
            marks.push(started.elapsed());
            periods.push(Period {
                table_bytes,
                live_bytes,
                live_rows,
                expired_rows,
                removed,
                commits: 0,
                p99_us: 0.0,
            });
        }
        anyhow::Ok(())
    })?;
    stop.store(true, Ordering::Relaxed);
    let calls = join_all(clients)?;
    let mut from = Duration::from_secs(1);
    for (period, to) in periods.iter_mut().zip(marks) {
        let latencies = window(&calls, from, to);
        period.commits = latencies.len();
        period.p99_us = us(&latencies, 0.99);
        from = to;
    }
    Ok(periods)
}

/// The records table with its indexes, and a copy of its live rows built fresh with the same
/// indexes: (table bytes, copy bytes, live rows, expired rows left).
async fn weigh(client: &tokio_postgres::Client) -> Result<(i64, i64, i64, i64)> {
    let now = floor_now_sql();
    client
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS bench_idemdb.live_copy; \
             CREATE TABLE bench_idemdb.live_copy AS \
                 SELECT * FROM bench_idemdb.records WHERE expires_at_ms > {now}; \
             ALTER TABLE bench_idemdb.live_copy ADD PRIMARY KEY (consumer, message_key); \
             CREATE INDEX ON bench_idemdb.live_copy (expires_at_ms);"
        ))
        .await?;
    let row = client
        .query_one(
            &format!(
                "SELECT pg_total_relation_size('bench_idemdb.records'), \
                        pg_total_relation_size('bench_idemdb.live_copy'), \
                        (SELECT count(*) FROM bench_idemdb.live_copy), \
                        (SELECT count(*) FROM bench_idemdb.records WHERE expires_at_ms <= {now})"
            ),
            &[],
        )
        .await?;
    client
        .batch_execute("DROP TABLE bench_idemdb.live_copy")
        .await?;
    Ok((row.get(0), row.get(1), row.get(2), row.get(3)))
}

fn floor_now_sql() -> &'static str {
    "floor(extract(epoch FROM clock_timestamp()) * 1000)::int8"
}
