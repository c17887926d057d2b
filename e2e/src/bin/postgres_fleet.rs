//! The fleet end to end: competing consumers on ONE queue, their claims in PostgreSQL, under
//! consumer SIGKILLs and primary failovers.
//!
//! Starts a PostgreSQL primary with a synchronous standby (`e2e/src/pg_cluster.rs`), publishes
//! orders to one RabbitMQ queue (with producer-side resends of the same order, and some order
//! ids reused with other content), and runs `--consumers` processes of `postgres_orders` on
//! it, any of which may get any order. Meanwhile it SIGKILLs consumers at random moments (and
//! they kill themselves between a commit and its ack now and then), and fails the primary over
//! `--failovers` times: SIGKILL of the primary's every process, promotion of the standby, a new
//! standby copied from the new primary. When the queue has drained it checks every order
//! against the effects table and the dead-letter queue, then republishes every applied order
//! once more: each must come back `Duplicate`. It prints the accounting and exits non-zero if a
//! check fails: lost, applied twice, republished-but-fresh must all be 0.
//!
//! `--negative-control` runs the same fleet with an embedded store per consumer process (no
//! standby, no failovers): consumers then cannot see each other's claims, and the run passes
//! only if the checker finds orders applied twice.
//!
//! `scripts/postgres-fleet.sh` starts a private RabbitMQ server and runs this. Options:
//! `--amqp URL`, `--orders N`, `--consumers N`, `--workers N` (per consumer), `--resend-percent
//! P`, `--reused N`, `--rate MSGS_PER_S`, `--min-kills N`, `--failovers N`,
//! `--kill-after-commit-per-mille N`, `--work DIR`, `--seed N`, `--negative-control`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idemdb_e2e::amqp::{self, Outgoing};
use idemdb_e2e::args::{Args, Workload, check};
use idemdb_e2e::ledger::{self, monotonic_ns};
use idemdb_e2e::orders::DEAD_LETTER_QUEUE;
use idemdb_e2e::pg_cluster::Cluster;
use idemdb_e2e::report::{Control, Report};
use idemdb_e2e::supervisor::{Supervisor, recipe};
use idemdb_e2e::verdict::check_applied;
use idemdb_e2e::{BoxError, effects_table, failover_times, fresh_folder};
use lapin::types::FieldTable;

/// The one queue every consumer of the fleet reads.
const QUEUE: &str = "orders.fleet";

/// The fleet's options; `load` holds those every checker shares.
struct Options {
    amqp: String,
    consumers: usize,
    workers: usize,
    failovers: usize,
    kill_after_commit_per_mille: u64,
    negative_control: bool,
    load: Workload,
}

/// The options from the command line; a negative control makes no failover (it has no standby).
fn parse_options() -> Result<Options, BoxError> {
    let mut args = Args::from_env();
    let mut options = Options {
        amqp: args.value("amqp", "amqp://guest:guest@127.0.0.1:15673/%2f".to_owned())?,
        consumers: args.value("consumers", 3)?,
        workers: args.value("workers", 4)?,
        failovers: args.value("failovers", 2)?,
        kill_after_commit_per_mille: args.value("kill-after-commit-per-mille", 5)?,
        negative_control: args.flag("negative-control"),
        load: Workload::parse(&mut args, "postgres-fleet", 300)?,
    };
    args.finish()?;
    check(
        options.consumers > 0 && options.workers > 0,
        "--consumers and --workers must be at least 1",
    )?;
    check(
        options.kill_after_commit_per_mille <= 1000,
        "--kill-after-commit-per-mille is 0..=1000",
    )?;
    if options.negative_control {
        options.failovers = 0;
    }
    Ok(options)
}

/// The fleet: `--consumers` processes of `postgres_orders` on the one queue, claiming in the
/// cluster at `pg` (or, in the negative control, each in an embedded store of its own), each
/// with its ledger.
fn consumers(options: &Options, pg: String) -> Result<Supervisor, BoxError> {
    let amqp = options.amqp.clone();
    let work = options.load.work.clone();
    let workers = options.workers.to_string();
    let kill = options.kill_after_commit_per_mille.to_string();
    let embedded = options.negative_control;
    let command_line = move |slot: usize, command: &mut std::process::Command| {
        command
            .arg("--amqp")
            .arg(&amqp)
            .arg("--queue")
            .arg(QUEUE)
            .arg("--pg")
            .arg(&pg)
            .arg("--workers")
            .arg(&workers)
            .arg("--ledger")
            .arg(work.join(format!("ledger-{slot}.log")))
            .arg("--kill-after-commit-per-mille")
            .arg(&kill);
        if embedded {
            command
                .arg("--embedded")
                .arg(work.join(format!("store-{slot}")));
        }
        Ok(())
    };
    let binary = recipe("postgres_orders")?;
    let work = &options.load.work;
    Ok(Supervisor::new(
        binary,
        work,
        options.consumers,
        Box::new(command_line),
    ))
}

/// The fleet, whoever poisoned its lock (a panic elsewhere is reported there).
fn lock(consumers: &Mutex<Supervisor>) -> MutexGuard<'_, Supervisor> {
    consumers.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `messages` (order id, body) as publishes to the fleet's queue through the default exchange.
fn to_queue<'a>(messages: impl Iterator<Item = (&'a String, &'a String)>) -> Vec<Outgoing> {
    messages
        .map(|(order_id, body)| Outgoing {
            routing_key: QUEUE.to_owned(),
            order_id: order_id.clone(),
            body: body.clone(),
        })
        .collect()
}

fn main() {
    idemdb_e2e::main("postgres_fleet", run());
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let load = &options.load;
    let name = if options.negative_control {
        "postgres_fleet (negative control)"
    } else {
        "postgres_fleet"
    };
    let started = Instant::now();
    let (plan, mut rng) = load.plan();
    fresh_folder(&load.work)?;
    // The servers' folders are the postgres user's (as root the servers run as that user, who
    // may not enter the work folder): a temporary folder of their own, kept if the run fails.
    let pg_dir = tempfile::Builder::new()
        .prefix("idemdb-fleet-pg-")
        .tempdir()?
        .keep();
    let mut cluster = Cluster::new(&pg_dir, !options.negative_control)?;
    if cluster.standby.is_some() {
        cluster.primary.require_sync_standby().await?;
    }
    effects_table::create(&cluster.primary).await?;

    let amqp::Session {
        connection,
        channel,
        publisher,
    } = amqp::session(&options.amqp).await?;
    amqp::declare_empty_queue(&channel, QUEUE, FieldTable::default(), None).await?;
    amqp::declare_empty_queue(&channel, DEAD_LETTER_QUEUE, FieldTable::default(), None).await?;
    let mut consumers = consumers(&options, cluster.conninfo())?;
    consumers.start_all()?;
    println!(
        "{name}: {} orders, {} messages at {}/s to one queue, {} consumers x {} workers, \
         {} failovers planned, work dir {}",
        load.orders,
        plan.messages.len(),
        load.rate,
        options.consumers,
        options.workers,
        options.failovers,
        load.work.display()
    );

    // The producer publishes at a steady rate; this task kills consumers at random moments
    // and fails the primary over at evenly spaced points of the stream.
    let published = Arc::new(AtomicU64::new(0));
    let messages = to_queue(plan.messages.iter().map(|m| (&m.order_id, &m.body)));
    let total = messages.len() as u64;
    let producer = tokio::spawn(amqp::publish(
        publisher.clone(),
        "",
        messages,
        load.rate,
        published.clone(),
    ));
    let planned_failovers = options.failovers as u64;
    let failover_points: Vec<u64> = (1..=planned_failovers)
        .map(|n| n * total / (planned_failovers + 1))
        .collect();
    // Kills spread over the publishing time, so that they land while there is work.
    let publishing_ms = total * 1000 / load.rate;
    let mean_gap_ms = (publishing_ms / (load.min_kills + 1)).clamp(50, 1500);
    let mut failovers = Vec::new();
    let mut kills = 0u64;
    // Consumers that died (they also kill themselves between a commit and its ack) are
    // restarted at once by a task of their own, also while a failover keeps this one busy.
    let consumers = Arc::new(Mutex::new(consumers));
    let restarting = Arc::new(AtomicBool::new(true));
    let restarter = tokio::spawn({
        let consumers = consumers.clone();
        let restarting = restarting.clone();
        async move {
            while restarting.load(Ordering::Relaxed) {
                lock(&consumers).restart_exited()?;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok::<(), BoxError>(())
        }
    });
    loop {
        let pause = mean_gap_ms / 2 + rng.below(mean_gap_ms);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let done_publishing = producer.is_finished();
        if let Some(point) = failover_points.get(failovers.len())
            && (published.load(Ordering::Relaxed) >= *point || done_publishing)
        {
            let failover = cluster.fail_over().await?;
            println!(
                "{name}: failover {}: primary killed, standby promoted in {} ms",
                failovers.len() + 1,
                (failover.promoted_ns - failover.killed_ns) / 1_000_000
            );
            failovers.push(failover);
            continue;
        }
        if done_publishing && kills >= load.min_kills {
            break;
        }
        let slot = usize::try_from(rng.below(options.consumers as u64))?;
        if lock(&consumers).kill_and_restart(slot)?.is_some() {
            kills += 1;
        }
    }
    restarting.store(false, Ordering::Relaxed);
    restarter.await??;
    let mut consumers = Arc::into_inner(consumers)
        .ok_or("the restarter still holds the fleet")?
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    producer.await??;
    println!(
        "{name}: all published; {kills} kills, {} failovers; draining",
        failovers.len()
    );
    let queues = [QUEUE.to_owned()];
    let progress = || ledger::bytes(&load.work, "ledger-");
    amqp::drain(&channel, &queues, &mut consumers, progress, || {}).await?;

    let applied = effects_table::read(&cluster.primary).await?;
    let dead_letters = amqp::drain_dead_letters(&channel).await?;
    let verdict = check_applied(&plan, &dead_letters, &applied);

    // Every applied order once more, as a broker would redeliver it long after: each must be
    // a duplicate now.
    let before_republish = monotonic_ns();
    let again = to_queue(applied.iter().map(|(order_id, a)| (order_id, &a.body)));
    let republished = Arc::new(AtomicU64::new(0));
    consumers.start_all()?;
    let rate = load.rate.max(1000);
    amqp::publish(publisher, "", again, rate, republished.clone()).await?;
    amqp::drain(&channel, &queues, &mut consumers, progress, || {}).await?;
    let after = effects_table::read(&cluster.primary).await?;
    let late_dead_letters = amqp::drain_dead_letters(&channel).await?;
    connection.close(200, "done".into()).await?;
    drop(cluster);

    let events = ledger::read_all(&load.work, "ledger-")?;
    let count = |kind: &str, since_ns: u64| ledger::count(&events, kind, since_ns);
    println!(
        "{name}: accounting ({:.0} s from first publish to last check)",
        started.elapsed().as_secs_f64()
    );
    let mut report = Report::new("postgres_fleet");
    report.figure(
        "published (confirmed by the broker)",
        published.load(Ordering::Relaxed),
    );
    report.figure("distinct orders", plan.contents.len());
    report.figure("effects applied", verdict.effects_applied);
    let duplicates = count("duplicate", 0) - count("duplicate", before_republish);
    report.figure("duplicates suppressed", duplicates);
    report.figure("conflicts dead-lettered", verdict.conflicts_dead_lettered);
    report.figure(
        "in-progress nacked (held by another)",
        count("in_progress", 0),
    );
    report.figure("database errors nacked", count("db_error", 0));
    report.figure(
        "commits with an unknown outcome",
        count("unknown_commit", 0),
    );
    report.figure("effects committed by apply", count("by_apply", 0));
    let by_apply_after_failover = failovers
        .first()
        .map_or(0, |failover| count("by_apply", failover.killed_ns));
    report.figure(
        "of them on a client rebuilt after a failover",
        by_apply_after_failover,
    );
    report.figure("consumers SIGKILLed at random moments", kills);
    report.figure(
        "consumers SIGKILLed between commit and ack",
        consumers.self_kills,
    );
    report.zero(
        "consumer exits not caused by us",
        consumers.unexpected_exits,
    );
    report.figure("primary failovers", failovers.len());
    // The fleet keeps no running total: no row for one.
    report.verdict(&verdict, "dead-lettered", None);
    report.figure(
        "republished after the run",
        republished.load(Ordering::Relaxed),
    );
    report.figure(
        "republished and answered duplicate",
        count("duplicate", before_republish),
    );
    // A republished order that conflicted would be a wrong answer too.
    report.zero(
        "republished but fresh",
        effects_table::applied_again(&applied, &after) + late_dead_letters.len() as u64,
    );
    failover_times::report(&mut report, &failovers, &events);
    // Every connection dies with the primary: apply must have committed on one rebuilt after
    // a failover (a reconnected client once failed every apply).
    report.require(
        options.failovers == 0 || by_apply_after_failover > 0,
        "no effect committed by apply on a client rebuilt after a failover",
    );
    report.require(
        failovers.len() == options.failovers,
        "fewer failovers than asked",
    );
    report.require(kills >= load.min_kills, "fewer kills than asked");
    let passed = report.finish(if options.negative_control {
        // The checker must see what a fleet without a shared claim store does.
        Control::Negative {
            caught: verdict.applied_twice > 0,
            flaw: "orders applied twice with per-process stores",
        }
    } else {
        Control::Run {
            claim: "lost = 0, applied twice = 0, republished but fresh = 0",
        }
    });
    if passed {
        std::fs::remove_dir_all(&pg_dir)?;
    } else {
        println!(
            "{name}: the servers' folders and logs are kept in {}",
            pg_dir.display()
        );
    }
    Ok(passed)
}
