//! End-to-end check of a partitioned fleet (`rabbitmq_partitions`) against a real RabbitMQ
//! server: the broker decides each partition's owner, the partition's store moves with it.
//!
//! Publishes orders (with producer-side resends, and some order ids reused with other content)
//! to a consistent-hash exchange that routes them by order id to P partition queues, each with a
//! single active consumer. C consumer processes subscribe to every partition queue and share one
//! directory of partition stores (`<work>/stores/partition-<p>`, standing for volumes that move
//! with their partitions). While the producer runs, this SIGKILLs consumers at random moments
//! and restarts them, and once SIGSTOPs a consumer that owns partitions for at least
//! `--zombie-stop-s` and then until the broker has handed one of its partitions to another
//! consumer (at most 60 s; how long a broker takes to notice a paused consumer varies with its
//! load), then SIGCONTs it (a zombie: it must notice, stop committing, and release its stores).
//! Consumers also SIGKILL themselves between a commit and its ack, and take an online backup
//! (`Engine::checkpoint`) of each partition they own every `--checkpoint-every-ms`.
//!
//! Then it checks and prints, from the stores, the dead-letter queue and the consumers'
//! ledgers (lines with the system's monotonic clock):
//! - every order applied exactly once over all stores, with content that was published; every
//!   other content dead-lettered; nothing dead-lettered without a conflict; per-partition totals;
//! - every commit made by the partition's latest opener, the handoffs, the handoff time after
//!   each SIGKILL (p50 and p99), and the zombie's behaviour ([`idemdb_e2e::handoffs`]);
//! - each backup restored and checked whole ([`idemdb_e2e::backups`]).
//!
//! `--negative-control` gives each consumer its own stores instead (a store that does NOT move
//! with its partition): the check must then find orders applied twice, and the run passes only
//! if it does.
//!
//! `scripts/rabbitmq-handoff.sh` starts a private server and runs this. Options: `--amqp URL`,
//! `--orders N`, `--partitions P`, `--consumers C`, `--resend-percent P`, `--reused N`,
//! `--rate MSGS_PER_S`, `--min-kills N`, `--transient-failure-percent P`,
//! `--kill-after-commit-per-mille N`, `--heartbeat-s S`, `--zombie-stop-s S`,
//! `--checkpoint-every-ms MS` (0: none), `--negative-control`, `--metrics-port-base PORT`,
//! `--work DIR`, `--seed N`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemdb_e2e::amqp::{self, Outgoing};
use idemdb_e2e::args::{Args, Workload, check};
use idemdb_e2e::handoffs::{self, Faults, Paused};
use idemdb_e2e::ledger;
use idemdb_e2e::orders::{
    DEAD_LETTER_QUEUE, PARTITION_EXCHANGE, open_store, partition_queue, partition_queue_arguments,
};
use idemdb_e2e::report::{Control, Report};
use idemdb_e2e::supervisor::{Supervisor, recipe};
use idemdb_e2e::{BoxError, backups, fresh_folder, verdict};
use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};

/// The command line (see the header).
struct Options {
    amqp: String,
    partitions: usize,
    consumers: usize,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    heartbeat_s: u64,
    zombie_stop_s: u64,
    checkpoint_every_ms: u64,
    negative_control: bool,
    metrics_port_base: u16,
    load: Workload,
}

/// Parses and checks the command line; fills in the defaults that depend on other options.
fn parse_options() -> Result<Options, BoxError> {
    let mut args = Args::from_env();
    let mut options = Options {
        amqp: args.value("amqp", "amqp://guest:guest@127.0.0.1:15673/%2f".to_owned())?,
        partitions: args.value("partitions", 6)?,
        consumers: args.value("consumers", 3)?,
        transient_failure_percent: args.value("transient-failure-percent", 3)?,
        kill_after_commit_per_mille: args.value("kill-after-commit-per-mille", 5)?,
        heartbeat_s: args.value("heartbeat-s", 2)?,
        zombie_stop_s: args.value("zombie-stop-s", 0)?,
        checkpoint_every_ms: args.value("checkpoint-every-ms", 2000)?,
        negative_control: args.flag("negative-control"),
        metrics_port_base: args.value("metrics-port-base", 19200)?,
        load: Workload::parse(&mut args, "rabbitmq-handoff", 400)?,
    };
    args.finish()?;
    check(options.partitions > 0, "--partitions must be at least 1")?;
    let standby = "--consumers must be at least 2: a partition needs a standby";
    check(options.consumers >= 2, standby)?;
    let heartbeat = "--heartbeat-s must be at least 1: it is how the broker finds a zombie";
    check(options.heartbeat_s > 0, heartbeat)?;
    if options.zombie_stop_s == 0 {
        // Long enough for the broker to miss two heartbeats and close the connection.
        options.zombie_stop_s = 3 * options.heartbeat_s + 2;
    }
    check(
        options.transient_failure_percent <= 100,
        "percentages are 0..=100",
    )?;
    let per_mille = "--kill-after-commit-per-mille is 0..=1000";
    check(options.kill_after_commit_per_mille <= 1000, per_mille)?;
    if options.negative_control {
        // Each consumer's own stores: a backup's ledger check would compare unrelated stores.
        options.checkpoint_every_ms = 0;
    }
    Ok(options)
}

/// How long the random kills spare a zombie after its SIGCONT.
const ZOMBIE_SPARED: Duration = Duration::from_secs(3);

/// The longest a zombie is held paused waiting for the broker to hand one of its partitions on.
const ZOMBIE_HOLD_MAX: Duration = Duration::from_secs(60);

/// The folder of consumer `consumer`'s partition stores: one shared by the fleet, or (the
/// negative control) one of its own.
fn stores(work: &Path, negative_control: bool, consumer: usize) -> PathBuf {
    if negative_control {
        work.join(format!("stores/consumer-{consumer}"))
    } else {
        work.join("stores")
    }
}

/// One `rabbitmq_partitions` process per fleet member: every partition queue, its preferred
/// partitions (`p % C == c`), the stores, its ledger, its metrics port, and the heartbeat by
/// which the broker finds a paused member.
fn consumers(options: &Options) -> Result<Supervisor, BoxError> {
    let separator = if options.amqp.contains('?') { '&' } else { '?' };
    let amqp = format!(
        "{}{separator}heartbeat={}",
        options.amqp, options.heartbeat_s
    );
    let (partitions, fleet) = (options.partitions, options.consumers);
    let (negative, base) = (options.negative_control, options.metrics_port_base);
    let transient = options.transient_failure_percent.to_string();
    let kill = options.kill_after_commit_per_mille.to_string();
    let checkpoint_every_ms = options.checkpoint_every_ms;
    let work = options.load.work.clone();
    let command_line = move |consumer: usize, command: &mut std::process::Command| {
        let preferred: Vec<String> = (0..partitions)
            .filter(|p| p % fleet == consumer)
            .map(|p| p.to_string())
            .collect();
        let port = base + u16::try_from(consumer)?;
        command
            .arg("--amqp")
            .arg(&amqp)
            .arg("--partitions")
            .arg(partitions.to_string())
            .arg("--stores")
            .arg(stores(&work, negative, consumer))
            .arg("--preferred")
            .arg(preferred.join(","))
            .arg("--ledger")
            .arg(work.join(format!("ledger-{consumer}.log")))
            .arg("--metrics")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--transient-failure-percent")
            .arg(&transient)
            .arg("--kill-after-commit-per-mille")
            .arg(&kill);
        if checkpoint_every_ms > 0 {
            command
                .arg("--checkpoint-every-ms")
                .arg(checkpoint_every_ms.to_string())
                .arg("--backups")
                .arg(work.join("backups"));
        }
        Ok(())
    };
    let binary = recipe("rabbitmq_partitions")?;
    let work = &options.load.work;
    Ok(Supervisor::new(binary, work, fleet, Box::new(command_line)))
}

/// Declares the consistent-hash exchange, the partition queues and the dead-letter queue, and
/// empties them.
async fn topology(channel: &Channel, partitions: usize) -> Result<(), BoxError> {
    channel
        .exchange_declare(
            PARTITION_EXCHANGE.into(),
            ExchangeKind::Custom("x-consistent-hash".into()),
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    for partition in 0..partitions {
        // The binding key of a consistent-hash exchange is the queue's weight on the ring.
        let binding = Some((PARTITION_EXCHANGE, "1"));
        let queue = partition_queue(partition);
        amqp::declare_empty_queue(channel, &queue, partition_queue_arguments(), binding).await?;
    }
    amqp::declare_empty_queue(channel, DEAD_LETTER_QUEUE, FieldTable::default(), None).await
}

fn main() {
    idemdb_e2e::main("rabbitmq_handoff", run());
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let load = &options.load;
    let negative = options.negative_control;
    let started = Instant::now();
    let (plan, mut rng) = load.plan();
    fresh_folder(&load.work)?;
    std::fs::create_dir_all(load.work.join("backups"))?;

    let amqp::Session {
        connection,
        channel,
        publisher,
    } = amqp::session(&options.amqp).await?;
    topology(&channel, options.partitions).await?;
    let cli = backups::restore_cli()?;
    let faults = Faults::open(&load.work)?;
    let mut consumers = consumers(&options)?;
    consumers.start_all()?;
    let fleet = options.consumers;
    let own_stores = " (NEGATIVE CONTROL: each consumer its own stores)";
    let control = if negative { own_stores } else { "" };
    let (orders, messages, rate) = (load.orders, plan.messages.len(), load.rate);
    let (partitions, work) = (options.partitions, load.work.display());
    println!(
        "rabbitmq_handoff: {orders} orders, {messages} messages at {rate}/s, {partitions} \
         partitions, {fleet} consumers{control}, work dir {work}"
    );
    // Let the fleet subscribe, so that the first partitions are spread over it.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The consistent-hash exchange hashes the routing key: the order id.
    let messages = plan
        .messages
        .iter()
        .map(|message| Outgoing {
            routing_key: message.order_id.clone(),
            order_id: message.order_id.clone(),
            body: message.body.clone(),
        })
        .collect();
    let published = Arc::new(AtomicU64::new(0));
    let producer = tokio::spawn(amqp::publish(
        publisher,
        PARTITION_EXCHANGE,
        messages,
        load.rate,
        published.clone(),
    ));

    // The chaos: random SIGKILLs (restarted at once), and after the third one a zombie.
    let zombie_stop = Duration::from_secs(options.zombie_stop_s);
    let mut kills = 0u64;
    // The consumer now stopped (SIGSTOP), which the random kills leave alone.
    let mut stopped: Option<usize> = None;
    let mut zombie: Option<Paused> = None;
    let mut resumed: Option<Instant> = None;
    let mut published_at: Option<Instant> = None;
    loop {
        let pause = 100 + rng.below(700);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        // The pause lasts at least --zombie-stop-s, and then until the broker has handed one
        // of the zombie's partitions to another consumer (the case the run exists for: a
        // broker under load noticed a paused consumer 12.9 s into a pause with a 2 s
        // heartbeat), bounded by ZOMBIE_HOLD_MAX.
        if let Some(paused) = zombie.as_ref().filter(|z| z.since.elapsed() >= zombie_stop) {
            let handed_on = faults.handed_on(paused)?;
            let held_max = paused.since.elapsed() >= ZOMBIE_HOLD_MAX.max(zombie_stop);
            // The negative control checks no zombie: its pause is the minimum.
            if handed_on || held_max || negative {
                faults.resume(&consumers, paused)?;
                let seconds = paused.since.elapsed().as_secs_f64();
                zombie = None;
                resumed = Some(Instant::now());
                let why = if handed_on {
                    "resumed once the broker had handed a partition of it on"
                } else if negative {
                    "resumed (the negative control checks no zombie)"
                } else {
                    "the broker handed none of its partitions on within the bound"
                };
                println!("rabbitmq_handoff: zombie paused {seconds:.1} s; {why}");
            }
        }
        // The resumed zombie is spared for a while: the run checks what it does on waking.
        if resumed.is_some_and(|at| at.elapsed() >= ZOMBIE_SPARED) {
            stopped = None;
        }
        // The run has its zombie before it ends: it is looked for while orders flow (a run
        // that finds no owner to pause within a few seconds of the last publish fails).
        let finished = producer.is_finished();
        if finished && published_at.is_none() {
            published_at = Some(Instant::now());
        }
        let zombie_over =
            resumed.is_some() || published_at.is_some_and(|at| at.elapsed() > ZOMBIE_SPARED);
        if finished && kills >= load.min_kills && zombie_over && stopped.is_none() {
            break;
        }
        if kills >= 3 && resumed.is_none() && zombie.is_none() {
            // A consumer that owns partitions now, paused past the broker's heartbeat timeout.
            consumers.restart_exited()?;
            zombie = faults.pause_an_owner(&consumers)?;
            if let Some(paused) = &zombie {
                stopped = Some(paused.slot);
                continue;
            }
        }
        let victim = usize::try_from(rng.below(options.consumers as u64))?;
        if Some(victim) == stopped {
            continue;
        }
        if faults.kill(&mut consumers, victim)? {
            kills += 1;
            consumers.start(victim)?;
        }
        consumers.restart_exited()?;
    }
    producer.await??;
    println!("rabbitmq_handoff: all published; {kills} kills done; draining");

    // Drain, with a scrape of a consumer's per-partition metrics once the queues are quiet.
    let queues: Vec<String> = (0..options.partitions).map(partition_queue).collect();
    let progress = || handoffs::deliveries_handled(&load.work);
    let mut metrics = None;
    let ports = (0..fleet).map(|c| options.metrics_port_base + u16::try_from(c).unwrap_or(0));
    let scrape = || {
        if metrics.is_none() {
            metrics = idemdb_e2e::scrape_first(ports.clone(), "partition=\"");
        }
    };
    amqp::drain(&channel, &queues, &mut consumers, progress, scrape).await?;
    let dead_letters = amqp::drain_dead_letters(&channel).await?;
    connection.close(200, "done".into()).await?;

    // Every partition store: the fleet's, or (the negative control) each consumer's own.
    let mut roots: Vec<PathBuf> = (0..fleet)
        .map(|c| stores(&load.work, negative, c))
        .collect();
    roots.dedup();
    let mut stores = Vec::new();
    for root in &roots {
        for dir in (0..partitions).map(|p| root.join(format!("partition-{p}"))) {
            if dir.exists() {
                stores.push((dir.display().to_string(), open_store(&dir)?));
            }
        }
    }
    let verdict = verdict::verify(&stores, &plan, &dead_letters)?;
    drop(stores);
    let events = handoffs::events(&load.work)?;
    let count = |kind: &str| ledger::count(&events, kind, 0);
    let handoffs = handoffs::analyse(&events);
    let backups = backups::check(&load.work, &events, &plan, cli.as_deref())?;

    if let Some(sample) = &metrics {
        std::fs::write(load.work.join("metrics-sample.txt"), sample)?;
        println!(
            "rabbitmq_handoff: metrics of one consumer, per partition (full scrape in the work dir):"
        );
        let commits = |line: &&str| line.starts_with("idemdb_commits_total");
        for line in sample.lines().filter(commits).take(6) {
            println!("  {line}");
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("rabbitmq_handoff: accounting ({seconds:.0} s from first publish to last check)");
    let mut report = Report::new("rabbitmq_handoff");
    let published = published.load(Ordering::Relaxed);
    report.figure("published (confirmed by the broker)", published);
    report.figure("distinct orders", plan.contents.len());
    report.figure("effects applied", verdict.effects_applied);
    report.figure("duplicates suppressed", count("duplicate"));
    report.figure("conflicts dead-lettered", verdict.conflicts_dead_lettered);
    report.figure("deliveries marked redelivered", count("redelivered"));
    report.figure("transient failures nacked", count("transient"));
    report.figure("in-progress nacked", count("in_progress"));
    report.figure("consumers SIGKILLed at random moments", kills);
    let (self_kills, exits) = (consumers.self_kills, consumers.unexpected_exits);
    report.figure("consumers SIGKILLed between commit and ack", self_kills);
    report.figure("consumer starts", consumers.starts);
    report.zero("consumer exits not caused by us", exits);
    handoffs.report(&mut report, negative);
    backups.report(&mut report, options.checkpoint_every_ms > 0);
    report.verdict(&verdict, "dead-lettered", Some("stores"));
    let caught = verdict.applied_twice > 0;
    let flaw = "with stores that stay behind, orders applied twice";
    let claim = "lost = 0, applied twice = 0, every backup whole";
    Ok(report.finish(if negative {
        Control::Negative { caught, flaw }
    } else {
        Control::Run { claim }
    }))
}
