//! Medians, ratios and targets, printed and written as markdown and CSV under the output folder.
//!
//! Beside it: `charts` (the PNG charts of a run) and `machine` (the machine a run measured).

pub mod charts;
pub mod machine;

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use idemdb::Durability;

use crate::contenders::Kind;
use crate::contenders::peers::SqliteSync;
use crate::workloads::median;
use crate::workloads::scale::{ScaleArgs, ScalePoint, TtlArgs, TtlPoint};
use crate::workloads::tuning::{ReadArgs, ReadRow, WalArgs, WalRow};
use crate::{Measured, PeersRun};

/// A contender's medians over the rounds.
#[derive(Clone, Copy, Debug)]
pub struct Summary {
    pub per_second: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

pub fn summarize(measured: &Measured) -> Summary {
    let mut per_second: Vec<f64> = measured.rounds.iter().map(|s| s.per_second()).collect();
    let mut p50: Vec<f64> = measured.rounds.iter().map(|s| s.latency_us(0.5)).collect();
    let mut p99: Vec<f64> = measured.rounds.iter().map(|s| s.latency_us(0.99)).collect();
    Summary {
        per_second: median(&mut per_second),
        p50_us: median(&mut p50),
        p99_us: median(&mut p99),
    }
}

/// Whether a contender's acknowledgement means the write survives a power loss.
fn durable(kind: Kind) -> bool {
    match kind {
        Kind::Idemdb(durability)
        | Kind::IdemdbWal(durability)
        | Kind::Raw(durability, _)
        | Kind::Transaction(durability) => durability == Durability::Sync,
        Kind::IdemdbPipelined { .. }
        | Kind::IdemdbLibraryPipeline { .. }
        | Kind::IdemdbCommitLog
        | Kind::IdemdbCommitLogPipelined { .. } => true,
        Kind::IdemdbDuplicates { .. } => false,
        Kind::Redis { fsync_always } => fsync_always,
        Kind::Sqlite(sync) => sync == SqliteSync::Full,
        Kind::Postgres { synchronous_commit } => synchronous_commit,
        Kind::IdemdbPostgres { .. } | Kind::PostgresWithRow | Kind::PostgresClaimFloor(_) => true,
        Kind::Fdatasync { .. } => true,
    }
}

/// The idemdb row a peer row is compared with: same durability, same messages per call, the
/// nearest producer count.
fn baseline<'a>(run: &'a PeersRun, row: &Measured) -> Option<&'a Measured> {
    let wanted_durable = durable(row.spec.kind);
    run.measured
        .iter()
        .filter(|m| matches!(m.spec.kind, Kind::Idemdb(_)))
        .filter(|m| {
            durable(m.spec.kind) == wanted_durable && m.spec.shape.batch == row.spec.shape.batch
        })
        .min_by_key(|m| m.spec.shape.threads.abs_diff(row.spec.shape.threads))
}

fn find(run: &PeersRun, name: &str) -> Option<Summary> {
    run.measured
        .iter()
        .find(|m| m.spec.name == name)
        .map(summarize)
}

/// One target of the performance issue: a ratio measured in this run against its goal.
pub struct Target {
    pub id: &'static str,
    pub what: String,
    pub measured: f64,
    /// `>= goal` when `at_least`, `<= goal` otherwise.
    pub goal: f64,
    pub at_least: bool,
}

impl Target {
    pub fn holds(&self) -> bool {
        if self.at_least {
            self.measured >= self.goal
        } else {
            self.measured <= self.goal
        }
    }
}

/// What a ratio target compares: a figure of each summary.
#[derive(Clone, Copy)]
enum Figure {
    Throughput,
    P50,
}

impl Figure {
    fn of(self, summary: Summary) -> f64 {
        match self {
            Figure::Throughput => summary.per_second,
            Figure::P50 => summary.p50_us,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Figure::Throughput => "throughput",
            Figure::P50 => "p50 latency",
        }
    }
}

/// The ratio targets: (id, idemdb's contender, the peer, figure, goal, whether the ratio must
/// be at least the goal rather than at most).
const RATIO_TARGETS: [(&str, &str, &str, Figure, f64, bool); 67] = [
    (
        "P1",
        "idemdb default buffered, batch 64",
        "rocksdb blind put, batch 64",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "P3",
        "idemdb default sync, 1 thread",
        "fdatasync 4 KiB",
        Figure::P50,
        1.10,
        false,
    ),
    (
        "P3",
        "idemdb sync on RocksDB's WAL, 1 thread",
        "fdatasync 4 KiB",
        Figure::P50,
        1.15,
        false,
    ),
    (
        "P3",
        "idemdb sync + commit log, 1 thread",
        "fdatasync 4 KiB",
        Figure::P50,
        1.15,
        false,
    ),
    (
        "P3",
        "idemdb default sync, 1 thread",
        "fdatasync append 200 B",
        Figure::P50,
        1.15,
        false,
    ),
    (
        "P4",
        "idemdb default sync, 32 threads",
        "redis fsync always, 50 clients",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P4",
        "idemdb default sync, 32 threads",
        "postgres sync on, 32 clients",
        Figure::Throughput,
        3.0,
        true,
    ),
    (
        "P4",
        "idemdb sync + commit log, 32 threads",
        "redis fsync always, 50 clients",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P4",
        "idemdb sync + commit log, 32 threads",
        "postgres sync on, 32 clients",
        Figure::Throughput,
        3.0,
        true,
    ),
    (
        "P5",
        "idemdb default sync, batch 64, library pipeline 4",
        "sqlite FULL, 64 rows/txn",
        Figure::Throughput,
        2.0,
        true,
    ),
    (
        "P5",
        "idemdb default sync, batch 64, library pipeline 4",
        "postgres sync on, 8 clients, 64 rows/txn",
        Figure::Throughput,
        2.0,
        true,
    ),
    (
        "P5",
        "idemdb default sync, batch 64",
        "sqlite FULL, 64 rows/txn",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P5",
        "idemdb default sync, batch 64",
        "postgres sync on, 8 clients, 64 rows/txn",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P5",
        "idemdb default sync, batch 64, 2 in flight",
        "sqlite FULL, 64 rows/txn",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P5",
        "idemdb default sync, batch 64, 2 in flight",
        "postgres sync on, 8 clients, 64 rows/txn",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P5",
        "idemdb sync + commit log, batch 64, 4 in flight",
        "sqlite FULL, 64 rows/txn",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P5",
        "idemdb sync + commit log, batch 64, 4 in flight",
        "postgres sync on, 8 clients, 64 rows/txn",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P9",
        "idemdb default sync, batch 64, library pipeline 4",
        "rocksdb blind put sync, batch 64",
        Figure::Throughput,
        1.8,
        true,
    ),
    (
        "P9",
        "idemdb default sync, batch 64",
        "rocksdb blind put sync, batch 64",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P9",
        "idemdb sync + commit log, batch 64",
        "rocksdb blind put sync, batch 64",
        Figure::Throughput,
        1.5,
        true,
    ),
    (
        "P9",
        "idemdb sync + commit log, batch 64, 4 in flight",
        "rocksdb blind put sync, batch 64",
        Figure::Throughput,
        1.5,
        true,
    ),
    // P9's control: the same blind puts made durable by a log written in place (the commit
    // log's design without deduplication): the floor of that design on this disk.
    (
        "P9",
        "rocksdb blind put, own log in place, batch 64",
        "rocksdb blind put sync, batch 64",
        Figure::Throughput,
        1.5,
        true,
    ),
    // The PostgreSQL backend against the claim floor that does the same work (`pg_floor`: a
    // unique-key insert and the business row between `BEGIN` and `COMMIT`): `begin` answers
    // before the caller's SQL runs, so it is held against the floor with two round trips;
    // `apply` against the floor's one; a batch against the floor's batch that answers
    // duplicates in one round trip, and beside it the floor's batch of two.
    (
        "PG1",
        "idemdb-postgres, 1 client",
        "postgres claim floor, two round trips, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1",
        "idemdb-postgres, 8 clients",
        "postgres claim floor, two round trips, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1",
        "idemdb-postgres, 32 clients",
        "postgres claim floor, two round trips, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG2",
        "idemdb-postgres apply, 1 client",
        "postgres claim floor, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG2",
        "idemdb-postgres apply, 8 clients",
        "postgres claim floor, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG2",
        "idemdb-postgres apply, 32 clients",
        "postgres claim floor, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG3",
        "idemdb-postgres, 8 clients, batch 64",
        "postgres claim floor answering duplicates, 8 clients, batch 64",
        Figure::Throughput,
        0.85,
        true,
    ),
    (
        "PG3 (floor's batch of two round trips)",
        "idemdb-postgres, 8 clients, batch 64",
        "postgres claim floor, 8 clients, batch 64",
        Figure::Throughput,
        0.85,
        true,
    ),
    (
        "PG1 (one-round-trip floor)",
        "idemdb-postgres, 1 client",
        "postgres claim floor, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1 (one-round-trip floor)",
        "idemdb-postgres, 8 clients",
        "postgres claim floor, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1 (one-round-trip floor)",
        "idemdb-postgres, 32 clients",
        "postgres claim floor, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    // The floors against each other: what the second round trip costs the floor itself, and
    // what answering duplicates in one round trip costs the floor's batch.
    (
        "PG1 control (reference, not idemdb)",
        "postgres claim floor, two round trips, 1 client",
        "postgres claim floor, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1 control (reference, not idemdb)",
        "postgres claim floor, two round trips, 8 clients",
        "postgres claim floor, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1 control (reference, not idemdb)",
        "postgres claim floor, two round trips, 32 clients",
        "postgres claim floor, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG3 control (reference, not idemdb)",
        "postgres claim floor answering duplicates, 8 clients, batch 64",
        "postgres claim floor, 8 clients, batch 64",
        Figure::Throughput,
        0.85,
        true,
    ),
    // The same targets against the floor on idemdb's table (`pg_floor`'s `records`: the
    // backend's key, record and removal index, without its lock, read or function), and that
    // floor against the key-only one: what the table alone costs.
    (
        "PG1 (record floor)",
        "idemdb-postgres, 1 client",
        "postgres record floor, two round trips, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1 (record floor)",
        "idemdb-postgres, 8 clients",
        "postgres record floor, two round trips, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG1 (record floor)",
        "idemdb-postgres, 32 clients",
        "postgres record floor, two round trips, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG2 (record floor)",
        "idemdb-postgres apply, 1 client",
        "postgres record floor, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG2 (record floor)",
        "idemdb-postgres apply, 8 clients",
        "postgres record floor, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG2 (record floor)",
        "idemdb-postgres apply, 32 clients",
        "postgres record floor, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG3 (record floor)",
        "idemdb-postgres, 8 clients, batch 64",
        "postgres record floor answering duplicates, 8 clients, batch 64",
        Figure::Throughput,
        0.85,
        true,
    ),
    (
        "PG table control (reference, not idemdb)",
        "postgres record floor, two round trips, 1 client",
        "postgres claim floor, two round trips, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG table control (reference, not idemdb)",
        "postgres record floor, two round trips, 8 clients",
        "postgres claim floor, two round trips, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG table control (reference, not idemdb)",
        "postgres record floor, two round trips, 32 clients",
        "postgres claim floor, two round trips, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG table control (reference, not idemdb)",
        "postgres record floor, 1 client",
        "postgres claim floor, 1 client",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG table control (reference, not idemdb)",
        "postgres record floor, 8 clients",
        "postgres claim floor, 8 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG table control (reference, not idemdb)",
        "postgres record floor, 32 clients",
        "postgres claim floor, 32 clients",
        Figure::Throughput,
        0.9,
        true,
    ),
    (
        "PG table control (reference, not idemdb)",
        "postgres record floor answering duplicates, 8 clients, batch 64",
        "postgres claim floor answering duplicates, 8 clients, batch 64",
        Figure::Throughput,
        0.85,
        true,
    ),
    // The PostgreSQL backend (claim, business row, commit: one transaction) against the raw
    // dedup insert, which writes no business row.
    (
        "PG",
        "idemdb-postgres, 1 client",
        "postgres sync on, 1 client",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG",
        "idemdb-postgres, 8 clients",
        "postgres sync on, 8 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG",
        "idemdb-postgres, 32 clients",
        "postgres sync on, 32 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG",
        "idemdb-postgres apply, 1 client",
        "postgres sync on, 1 client",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG",
        "idemdb-postgres apply, 8 clients",
        "postgres sync on, 8 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG",
        "idemdb-postgres apply, 32 clients",
        "postgres sync on, 32 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG",
        "idemdb-postgres, 8 clients, batch 64",
        "postgres sync on, 8 clients, 64 rows/txn",
        Figure::Throughput,
        0.8,
        true,
    ),
    // The same, against the raw insert that writes the business row too (in the same
    // statement): what a claim costs beyond the rows both write.
    (
        "PG+row",
        "idemdb-postgres, 1 client",
        "postgres sync on + business row, 1 client",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG+row",
        "idemdb-postgres, 8 clients",
        "postgres sync on + business row, 8 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG+row",
        "idemdb-postgres, 32 clients",
        "postgres sync on + business row, 32 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG+row",
        "idemdb-postgres, 8 clients, batch 64",
        "postgres sync on + business row, 8 clients, 64 rows/txn",
        Figure::Throughput,
        0.8,
        true,
    ),
    // Reference rows, peer against peer: the claim floor (`pg_floor`: a unique-key insert and
    // the business row between `BEGIN` and `COMMIT`, nothing else) against the raw insert,
    // with the backend's goal: whether a design built that way could reach it on this server.
    (
        "PG floor (reference, not idemdb)",
        "postgres claim floor, 1 client",
        "postgres sync on, 1 client",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG floor (reference, not idemdb)",
        "postgres claim floor, 8 clients",
        "postgres sync on, 8 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG floor (reference, not idemdb)",
        "postgres claim floor, 32 clients",
        "postgres sync on, 32 clients",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "PG floor (reference, not idemdb)",
        "postgres claim floor, 8 clients, batch 64",
        "postgres sync on, 8 clients, 64 rows/txn",
        Figure::Throughput,
        0.8,
        true,
    ),
    (
        "P6",
        "idemdb duplicates, 1 thread",
        "idemdb default buffered, 1 thread",
        Figure::Throughput,
        2.0,
        true,
    ),
];

pub fn targets(run: &PeersRun) -> Vec<Target> {
    let mut out = Vec::new();
    for (id, a, b, figure, goal, at_least) in RATIO_TARGETS {
        if let (Some(x), Some(y)) = (find(run, a), find(run, b)) {
            out.push(Target {
                id,
                what: format!("{}: {a} / {b}", figure.name()),
                measured: figure.of(x) / figure.of(y),
                goal,
                at_least,
            });
        }
    }
    // P2 allows up to 2 threads: the better of idemdb's 1- and 2-thread runs.
    let best_single = [
        "idemdb default buffered, 1 thread",
        "idemdb default buffered, 2 threads",
    ]
    .into_iter()
    .filter_map(|name| find(run, name).map(|summary| (name, summary)))
    .max_by(|a, b| a.1.per_second.total_cmp(&b.1.per_second));
    if let Some((name, idemdb)) = best_single {
        for (peer, goal) in [
            ("redis no persistence, 50 clients", 1.5),
            ("redis no persistence, 50 clients -P 16", 1.2),
        ] {
            if let Some(peer_summary) = find(run, peer) {
                out.push(Target {
                    id: "P2",
                    what: format!("throughput: {name} / {peer}"),
                    measured: idemdb.per_second / peer_summary.per_second,
                    goal,
                    at_least: true,
                });
            }
        }
    }
    if let Some(single) = find(run, "idemdb default buffered, 1 thread") {
        out.push(Target {
            id: "P6",
            what: "claim+commit p99 (us), idemdb default buffered, 1 thread".to_owned(),
            measured: single.p99_us,
            goal: 10.0,
            at_least: false,
        });
    }
    out
}

/// A results document: its title and, where given, the machine it was measured on.
fn document(title: &str, machine: Option<&crate::report::machine::Machine>) -> Result<String> {
    let mut md = format!("# {title}\n\n");
    if let Some(machine) = machine {
        writeln!(md, "```\n{machine}\n```\n")?;
    }
    Ok(md)
}

fn machine_here() -> crate::report::machine::Machine {
    crate::report::machine::Machine::describe(&std::env::temp_dir())
}

/// Writes `md` to `out_dir/file` and prints it.
fn publish(out_dir: &Path, file: &str, md: &str) -> Result<()> {
    std::fs::create_dir_all(out_dir)?;
    std::fs::write(out_dir.join(file), md)?;
    println!("{md}");
    Ok(())
}

/// Writes the report as `<name>.md` and its figures as `<name>.csv`.
pub fn write_peers(out_dir: &Path, run: &PeersRun, name: &str) -> Result<()> {
    let mut md = document("Comparison run", Some(&run.machine))?;
    writeln!(
        md,
        "Command: `./scripts/compare.sh peers{} --seconds {} --rounds {}`. Every contender ran {} s \
         per round, {} rounds, interleaved (each round runs every contender once, in the order \
         below); figures are medians over the rounds. Workload: 16-byte message keys (22-byte \
         stored keys), 64-byte values, {:.0}% of deliveries re-send an earlier message. Latency \
         is per call (one message, one batch, or one pipelined round trip).\n",
        run.only
            .iter()
            .map(|only| format!(" --only \"{only}\""))
            .collect::<String>(),
        run.seconds,
        run.rounds,
        run.seconds,
        run.rounds,
        run.duplicate_ratio * 100.0
    )?;
    writeln!(
        md,
        "| contender | durable | msg/s | p50 us/call | p99 us/call | idemdb / it | compared with |"
    )?;
    writeln!(md, "|---|---|---:|---:|---:|---:|---|")?;
    let mut csv = String::from("contender,round,messages_per_second,p50_us,p99_us\n");
    for row in &run.measured {
        let summary = summarize(row);
        let (ratio, against) = match baseline(run, row) {
            Some(base) if !std::ptr::eq(base, row) => (
                format!("{:.2}x", summarize(base).per_second / summary.per_second),
                base.spec.name.clone(),
            ),
            _ => ("".to_owned(), "".to_owned()),
        };
        writeln!(
            md,
            "| {} | {} | {:.0} | {:.1} | {:.1} | {} | {} |",
            row.spec.name,
            if durable(row.spec.kind) { "yes" } else { "no" },
            summary.per_second,
            summary.p50_us,
            summary.p99_us,
            ratio,
            against
        )?;
        for (round, sample) in row.rounds.iter().enumerate() {
            writeln!(
                csv,
                "\"{}\",{},{:.0},{:.2},{:.2}",
                row.spec.name,
                round + 1,
                sample.per_second(),
                sample.latency_us(0.5),
                sample.latency_us(0.99)
            )?;
        }
    }
    writeln!(md, "\n## Targets\n")?;
    writeln!(md, "| target | ratio | goal | holds |")?;
    writeln!(md, "|---|---:|---:|---|")?;
    for target in targets(run) {
        writeln!(
            md,
            "| {} {} | {:.2} | {} {} | {} |",
            target.id,
            target.what,
            target.measured,
            if target.at_least { ">=" } else { "<=" },
            target.goal,
            if target.holds() { "yes" } else { "**no**" }
        )?;
    }
    publish(out_dir, &format!("{name}.md"), &md)?;
    std::fs::write(out_dir.join(format!("{name}.csv")), csv)?;
    Ok(())
}

pub fn write_scale(out_dir: &Path, args: &ScaleArgs, points: &[ScalePoint]) -> Result<()> {
    let mut md = document("Scale run", Some(&machine_here()))?;
    writeln!(
        md,
        "Command: `./scripts/compare.sh scale --records {} --window {} --threads {}`. idemdb, \
         Buffered durability, {} threads of single-message claim + commit, 16-byte keys in a \
         scattered (UUID-like) order, no result, no business write. Each row is one window of new \
         records.\n",
        args.records, args.window, args.threads, args.threads
    )?;
    writeln!(
        md,
        "| stored records | msg/s | p50 us | p99 us | disk bytes / record |"
    )?;
    writeln!(md, "|---:|---:|---:|---:|---:|")?;
    for point in points {
        writeln!(
            md,
            "| {} | {:.0} | {:.1} | {:.1} | {:.1} |",
            point.records,
            point.per_second,
            point.p50_us,
            point.p99_us,
            point.disk_bytes_per_record
        )?;
    }
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        writeln!(
            md,
            "\nThroughput at {} records / at {} records: {:.2}. After a full compaction: {:.1} \
             disk bytes per record ({} bytes of table files for {} records).",
            last.records,
            first.records,
            last.per_second / first.per_second,
            last.compacted_bytes_per_record,
            last.compacted_bytes,
            last.records
        )?;
    }
    publish(out_dir, "scale.md", &md)
}

pub fn write_ttl(out_dir: &Path, args: &TtlArgs, points: &[TtlPoint]) -> Result<()> {
    let mut md = document("Expiry steady state", None)?;
    writeln!(
        md,
        "Command: `./scripts/compare.sh ttl --periods {} --per-period {}`. A mock clock; \
         retention = 1 period; {} new records (16-byte keys in scattered order, no result) per \
         period, written in batches of 256 with the clock advanced evenly; 4 MiB memtables. \
         The live set is the records of the last period; its size is the table files after a \
         full compaction at the end.\n",
        args.periods, args.per_period, args.per_period
    )?;
    writeln!(
        md,
        "| period | records written | table files (bytes) | / live set |"
    )?;
    writeln!(md, "|---:|---:|---:|---:|")?;
    for point in points {
        writeln!(
            md,
            "| {} | {} | {} | {:.2} |",
            point.period, point.written, point.disk_bytes, point.over_live
        )?;
    }
    publish(out_dir, "ttl.md", &md)
}

pub fn write_wal_options(out_dir: &Path, args: &WalArgs, rows: &[WalRow]) -> Result<()> {
    let mut md = document("Durable write path: RocksDB options", Some(&machine_here()))?;
    writeln!(
        md,
        "Command: `./scripts/compare.sh wal-options --seconds {} --rounds {}`. idemdb's durable \
         write pattern on raw RocksDB: one write batch per message (a 22-byte marker with a \
         46-byte value and a 16-byte key with a 64-byte value), `sync = true`, N threads. \
         Medians over interleaved rounds.\n",
        args.seconds, args.rounds
    )?;
    let threads: Vec<usize> = rows
        .first()
        .map(|r| r.by_threads.iter().map(|(t, _, _)| *t).collect())
        .unwrap_or_default();
    write!(md, "| options |")?;
    for t in &threads {
        write!(md, " {t} thr msg/s | p50 us |")?;
    }
    writeln!(md)?;
    write!(md, "|---|")?;
    for _ in &threads {
        write!(md, "---:|---:|")?;
    }
    writeln!(md)?;
    for row in rows {
        write!(md, "| {} |", row.name)?;
        for (_, per_second, p50) in &row.by_threads {
            write!(md, " {per_second:.0} | {p50:.0} |")?;
        }
        writeln!(md)?;
    }
    publish(out_dir, "wal-options.md", &md)
}

pub fn write_read_options(out_dir: &Path, args: &ReadArgs, rows: &[ReadRow]) -> Result<()> {
    let mut md = document("Lookups: RocksDB read-path options", Some(&machine_here()))?;
    writeln!(
        md,
        "Command: `./scripts/compare.sh read-options --seconds {} --rounds {} --keys {}`. Raw \
         RocksDB with idemdb's other options, 1 thread, 22-byte keys with 46-byte values: {} \
         keys compacted into table files, then 500,000 more in the memtable. Medians over \
         interleaved rounds; each cell is operations/s and p50 / p99 in microseconds.\n",
        args.seconds, args.rounds, args.keys, args.keys
    )?;
    let workloads: Vec<&str> = rows
        .first()
        .map(|r| r.by_workload.iter().map(|w| w.0).collect())
        .unwrap_or_default();
    writeln!(md, "| options | {} |", workloads.join(" | "))?;
    writeln!(md, "|---|{}", "---:|".repeat(workloads.len()))?;
    for row in rows {
        let cells: Vec<String> = row
            .by_workload
            .iter()
            .map(|(_, rate, p50, p99)| format!("{rate:.0}/s, {p50:.2} / {p99:.2}"))
            .collect();
        writeln!(md, "| {} | {} |", row.name, cells.join(" | "))?;
    }
    publish(out_dir, "read-options.md", &md)
}

pub fn write_pg_expiry(
    out_dir: &Path,
    args: &crate::workloads::pg_expiry::PgExpiryArgs,
    report: &crate::workloads::pg_expiry::ExpiryReport,
) -> Result<()> {
    use crate::workloads::pg_expiry::Removal;
    let mut md = document(
        "PostgreSQL backend: commits during removal, and the table over many retention periods",
        Some(&machine_here()),
    )?;
    writeln!(
        md,
        "Command: `./scripts/compare.sh pg-expiry --records {} --clients {} --rate {} --busy-percent {} \
         --seconds {} --retention-s {} --periods {}{}{}`.\n\n\
         **Backlog.** {} expired records are written into the records table ({}), then {} \
         clients claim and commit new messages at {} messages/s in all (business row in the \
         claim's transaction, `synchronous_commit` on, 10% resends) for {} s before the removal \
         starts on its own connection; it runs until every expired record is gone. Each removal \
         method runs on a fresh server; last, the control: the same backlog and clients on a \
         fresh server for as long as the longest removal, with nothing removed. Latency is per \
         commit call (claim, business row, commit), by when the call started; each removal's \
         p99 is set against the control's over the same span of its run.\n",
        args.records,
        args.clients,
        args.rate,
        args.busy_percent,
        args.seconds,
        args.retention_s,
        args.periods,
        if args.only_default {
            " --only-default"
        } else {
            ""
        },
        if args.scattered { " --scattered" } else { "" },
        args.records,
        if args.scattered {
            "their removal times cycling through a minute, neighbouring rows a minute apart"
        } else {
            "their removal times rising with their place in the table, as claims over time write them"
        },
        args.clients,
        args.rate,
        args.seconds,
    )?;
    writeln!(
        md,
        "| removal | removed | removal s | p99 before, us | commits during | p50 us | p99 us | control's p99, same span | p99 / control's | longest during, us | control's longest | expired rows left |"
    )?;
    writeln!(
        md,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )?;
    for run in report
        .backlog
        .iter()
        .filter(|run| run.removal != Removal::Control)
    {
        writeln!(
            md,
            "| {} | {} | {:.1} | {:.0} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {} |",
            run.removal.name(args),
            run.removed,
            run.removal_seconds,
            run.quiet_p99_us,
            run.during_commits,
            run.during_p50_us,
            run.during_p99_us,
            run.control_p99_us,
            run.during_p99_us / run.control_p99_us,
            run.during_max_us,
            run.control_max_us,
            run.rows_left
        )?;
    }
    if let Some(control) = report
        .backlog
        .iter()
        .find(|run| run.removal == Removal::Control)
    {
        writeln!(
            md,
            "\nThe control over its whole {:.0} s: {} commits, p50 {:.0} us, p99 {:.0} us, longest {:.0} us (p99 of its quiet window {:.0} us).",
            control.removal_seconds,
            control.during_commits,
            control.during_p50_us,
            control.during_p99_us,
            control.during_max_us,
            control.quiet_p99_us
        )?;
    }
    if !report.steady.is_empty() {
        writeln!(
            md,
            "\n**Steady state.** A fresh server; retention {} s; {} clients at {} messages/s in \
             all for {} retention periods; `maintain` (its defaults) every tenth of a \
             period; autovacuum's naptime set to 1 s, as the run squeezes days into seconds. At \
             the end of each period the records table with its indexes is weighed against a \
             copy of its live rows built fresh with the same indexes (the least they take).\n",
            args.retention_s, args.clients, args.rate, args.periods
        )?;
        writeln!(
            md,
            "| period | table MB | live copy MB | table / live | live rows | expired rows left | removed in the period | commits | p99 us |"
        )?;
        writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
        for (index, period) in report.steady.iter().enumerate() {
            writeln!(
                md,
                "| {} | {:.1} | {:.1} | {:.2} | {} | {} | {} | {} | {:.0} |",
                index + 1,
                period.table_bytes as f64 / 1e6,
                period.live_bytes as f64 / 1e6,
                period.table_bytes as f64 / period.live_bytes.max(1) as f64,
                period.live_rows,
                period.expired_rows,
                period.removed,
                period.commits,
                period.p99_us
            )?;
        }
    }
    let verdict = |holds: bool| if holds { "holds" } else { "**does not hold**" };
    for run in report
        .backlog
        .iter()
        .filter(|run| run.removal == Removal::Maintain)
    {
        let ratio = run.during_p99_us / run.control_p99_us;
        writeln!(
            md,
            "\nPG4, commits: p99 while {} removed {} expired records / the control's p99 over the \
             same span <= 1.5: {ratio:.2}, {}.",
            run.removal.name(args),
            run.removed,
            verdict(ratio <= 1.5 && run.removed >= 10_000_000)
        )?;
    }
    // The last periods, once the table has reached its steady size (the first periods fill it).
    if report.steady.len() >= 2 {
        let worst = report.steady[1..]
            .iter()
            .map(|period| period.table_bytes as f64 / period.live_bytes.max(1) as f64)
            .fold(0.0, f64::max);
        writeln!(
            md,
            "\nPG4, size: the largest table / live ratio from period 2 on <= 1.5: {worst:.2}, {}.",
            verdict(worst <= 1.5)
        )?;
    }
    publish(out_dir, "pg-expiry.md", &md)
}

#[cfg(test)]
mod tests {
    use super::RATIO_TARGETS;
    use crate::contenders;

    /// A target whose contender is misnamed is never reported (its row is silently missing):
    /// every name a target compares must be a contender's.
    #[test]
    fn every_ratio_target_names_contenders() {
        let names: Vec<String> = contenders::all()
            .into_iter()
            .map(|spec| spec.name)
            .collect();
        for (id, ours, peer, ..) in RATIO_TARGETS {
            for name in [ours, peer] {
                assert!(
                    names.iter().any(|known| known == name),
                    "{id} names {name:?}, which is no contender"
                );
            }
        }
    }

    /// `pg-cost` runs its contenders by name: each must be one.
    #[test]
    fn every_pg_cost_contender_exists() {
        let names: Vec<String> = contenders::all()
            .into_iter()
            .map(|spec| spec.name)
            .collect();
        for name in crate::workloads::pg_cost::CONTENDERS {
            assert!(names.iter().any(|known| known == name), "{name:?}");
        }
    }
}
