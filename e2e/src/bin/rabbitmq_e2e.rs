//! End-to-end check of `rabbitmq_orders` against a real RabbitMQ server, with SIGKILLs.
//!
//! Publishes orders (with producer-side resends of the same order, and some order ids reused
//! with other content), runs one consumer process per shard (queue `orders.<shard>`, store
//! `<work>/store-<shard>`), SIGKILLs consumers at random moments and restarts them, until every
//! queue is drained. Then it checks, from the stores and the dead-letter queue, and prints:
//! published, distinct orders, effects applied, duplicates suppressed, conflicts dead-lettered,
//! lost (must be 0) and applied twice (must be 0). Exits non-zero if any check fails.
//!
//! `scripts/rabbitmq-e2e.sh` starts a private server on 127.0.0.1 and runs this; the server's
//! address is `--amqp`. Options: `--orders N`, `--shards N`, `--resend-percent P`,
//! `--reused N`, `--rate MSGS_PER_S`, `--min-kills N`, `--transient-failure-percent P`,
//! `--kill-after-commit-per-mille N` (consumers SIGKILL themselves between a commit and its
//! ack), `--metrics-port-base PORT`, `--work DIR`, `--seed N`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemdb_e2e::amqp::{self, Outgoing};
use idemdb_e2e::args::{Args, Workload, check};
use idemdb_e2e::orders::{DEAD_LETTER_QUEUE, EXCHANGE, open_store, queue_name, shard_of};
use idemdb_e2e::report::{Control, Report};
use idemdb_e2e::supervisor::{Supervisor, recipe};
use idemdb_e2e::{BoxError, fresh_folder, ledger, verdict};
use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};

struct Options {
    amqp: String,
    shards: usize,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    metrics_port_base: u16,
    load: Workload,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut args = Args::from_env();
    let options = Options {
        amqp: args.value("amqp", "amqp://guest:guest@127.0.0.1:15673/%2f".to_owned())?,
        shards: args.value("shards", 3)?,
        transient_failure_percent: args.value("transient-failure-percent", 3)?,
        kill_after_commit_per_mille: args.value("kill-after-commit-per-mille", 5)?,
        metrics_port_base: args.value("metrics-port-base", 19100)?,
        load: Workload::parse(&mut args, "rabbitmq-e2e", 400)?,
    };
    args.finish()?;
    check(options.shards > 0, "--shards must be at least 1")?;
    check(
        options.transient_failure_percent <= 100,
        "--transient-failure-percent is 0..=100",
    )?;
    check(
        options.kill_after_commit_per_mille <= 1000,
        "--kill-after-commit-per-mille is 0..=1000",
    )?;
    Ok(options)
}

/// One `rabbitmq_orders` process per shard: its queue, its store, its ledger, its metrics port.
fn consumers(options: &Options) -> Result<Supervisor, BoxError> {
    let amqp = options.amqp.clone();
    let work = options.load.work.clone();
    let base = options.metrics_port_base;
    let transient = options.transient_failure_percent.to_string();
    let kill = options.kill_after_commit_per_mille.to_string();
    let command_line = move |shard: usize, command: &mut std::process::Command| {
        let port = base + u16::try_from(shard)?;
        command
            .arg("--amqp")
            .arg(&amqp)
            .arg("--queue")
            .arg(queue_name(shard))
            .arg("--dir")
            .arg(work.join(format!("store-{shard}")))
            .arg("--events")
            .arg(work.join(format!("events-{shard}.log")))
            .arg("--metrics")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--transient-failure-percent")
            .arg(&transient)
            .arg("--kill-after-commit-per-mille")
            .arg(&kill);
        Ok(())
    };
    let binary = recipe("rabbitmq_orders")?;
    let work = &options.load.work;
    Ok(Supervisor::new(
        binary,
        work,
        options.shards,
        Box::new(command_line),
    ))
}

/// Declares the exchange, the shard queues and the dead-letter queue, and empties them.
async fn topology(channel: &Channel, shards: usize) -> Result<(), BoxError> {
    channel
        .exchange_declare(
            EXCHANGE.into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    for shard in 0..shards {
        let binding_key = shard.to_string();
        let binding = Some((EXCHANGE, binding_key.as_str()));
        let queue = queue_name(shard);
        amqp::declare_empty_queue(channel, &queue, FieldTable::default(), binding).await?;
    }
    amqp::declare_empty_queue(channel, DEAD_LETTER_QUEUE, FieldTable::default(), None).await
}

fn main() {
    idemdb_e2e::main("rabbitmq_e2e", run());
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let load = &options.load;
    let shards = options.shards;
    let started = Instant::now();
    let (plan, mut rng) = load.plan();
    fresh_folder(&load.work)?;

    let amqp::Session {
        connection,
        channel,
        publisher,
    } = amqp::session(&options.amqp).await?;
    topology(&channel, shards).await?;
    let mut consumers = consumers(&options)?;
    consumers.start_all()?;
    println!(
        "rabbitmq_e2e: {} orders, {} messages to publish at {}/s, {shards} shards, work dir {}",
        load.orders,
        plan.messages.len(),
        load.rate,
        load.work.display()
    );

    // The producer publishes at a steady rate (each publish confirmed), while this task kills
    // consumers at random moments and restarts them.
    let messages = plan
        .messages
        .iter()
        .map(|message| Outgoing {
            routing_key: shard_of(&message.order_id, shards).to_string(),
            order_id: message.order_id.clone(),
            body: message.body.clone(),
        })
        .collect();
    let published = Arc::new(AtomicU64::new(0));
    let producer = tokio::spawn(amqp::publish(
        publisher,
        EXCHANGE,
        messages,
        load.rate,
        published.clone(),
    ));
    let mut kills = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(100 + rng.below(700))).await;
        if producer.is_finished() && kills >= load.min_kills {
            break;
        }
        let shard = usize::try_from(rng.below(shards as u64))?;
        if consumers.kill_and_restart(shard)?.is_some() {
            kills += 1;
        }
        consumers.restart_exited()?;
    }
    producer.await??;
    println!("rabbitmq_e2e: all published; {kills} kills done; draining");

    // Drain, with a scrape of consumer 0's metrics once the queues are quiet.
    let queues: Vec<String> = (0..shards).map(queue_name).collect();
    let progress = || ledger::bytes(&load.work, "events-");
    let mut metrics = None;
    let scrape = || {
        if metrics.is_none() {
            metrics = idemdb_e2e::scrape_first([options.metrics_port_base], "");
        }
    };
    amqp::drain(&channel, &queues, &mut consumers, progress, scrape).await?;
    let dead_letters = amqp::drain_dead_letters(&channel).await?;
    connection.close(200, "done".into()).await?;

    let mut stores = Vec::new();
    for shard in 0..shards {
        let dir = load.work.join(format!("store-{shard}"));
        stores.push((format!("shard {shard}"), open_store(&dir)?));
    }
    let verdict = verdict::verify(&stores, &plan, &dead_letters)?;
    let events = ledger::read_all(&load.work, "events-")?;
    let count = |kind: &str| ledger::count(&events, kind, 0);
    if let Some(sample) = &metrics {
        std::fs::write(load.work.join("metrics-shard-0.txt"), sample)?;
        println!("rabbitmq_e2e: metrics of consumer 0 (full scrape in the work dir):");
        let shown = sample
            .lines()
            .filter(|line| line.starts_with("idemdb_outcomes_total") || line.contains("_count"));
        for line in shown.take(8) {
            println!("  {line}");
        }
    }
    println!(
        "rabbitmq_e2e: accounting ({:.0} s from first publish to last check)",
        started.elapsed().as_secs_f64()
    );
    let mut report = Report::new("rabbitmq_e2e");
    report.figure(
        "published (confirmed by the broker)",
        published.load(Ordering::Relaxed),
    );
    report.figure("distinct orders", plan.contents.len());
    report.figure("effects applied", verdict.effects_applied);
    report.figure("duplicates suppressed", count("duplicate"));
    report.figure("conflicts dead-lettered", verdict.conflicts_dead_lettered);
    report.figure("deliveries marked redelivered", count("redelivered"));
    report.figure("transient failures nacked", count("transient"));
    report.figure("in-progress nacked", count("in_progress"));
    report.figure("consumers SIGKILLed at random moments", kills);
    report.figure(
        "consumers SIGKILLed between commit and ack",
        consumers.self_kills,
    );
    report.figure("consumer starts", consumers.starts);
    report.zero(
        "consumer exits not caused by us",
        consumers.unexpected_exits,
    );
    report.verdict(&verdict, "dead-lettered", Some("shards"));
    Ok(report.finish(Control::Run {
        claim: "lost = 0, applied twice = 0",
    }))
}
