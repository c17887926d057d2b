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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, ExchangeKind};

#[path = "../checker.rs"]
mod checker;
#[path = "../../../examples/common/orders.rs"]
mod orders;
#[path = "../../../examples/common/prometheus.rs"]
mod prometheus;
use checker::{
    BoxError, Children, Rng, connect, declare_empty_queue, die_with_parent, drain_dead_letters,
    plan, ready_messages, verify, wait_quiet,
};
use orders::{DEAD_LETTER_QUEUE, EXCHANGE, open_store, queue_name, shard_of};

struct Options {
    amqp: String,
    orders: usize,
    shards: usize,
    resend_percent: u64,
    reused: usize,
    rate: u64,
    min_kills: usize,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    metrics_port_base: u16,
    work: PathBuf,
    seed: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        amqp: "amqp://guest:guest@127.0.0.1:15673/%2f".into(),
        orders: 2000,
        shards: 3,
        resend_percent: 20,
        reused: 20,
        rate: 400,
        min_kills: 10,
        transient_failure_percent: 3,
        kill_after_commit_per_mille: 5,
        metrics_port_base: 19100,
        work: std::env::temp_dir().join("idemdb-rabbitmq-e2e"),
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--amqp" => options.amqp = value()?,
            "--orders" => options.orders = value()?.parse()?,
            "--shards" => options.shards = value()?.parse()?,
            "--resend-percent" => options.resend_percent = value()?.parse()?,
            "--reused" => options.reused = value()?.parse()?,
            "--rate" => options.rate = value()?.parse()?,
            "--min-kills" => options.min_kills = value()?.parse()?,
            "--transient-failure-percent" => {
                options.transient_failure_percent = value()?.parse()?
            }
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = value()?.parse()?;
            }
            "--metrics-port-base" => options.metrics_port_base = value()?.parse()?,
            "--work" => options.work = value()?.into(),
            "--seed" => options.seed = value()?.parse()?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.orders == 0 || options.shards == 0 || options.rate == 0 {
        return Err("--orders, --shards and --rate must be at least 1".into());
    }
    if options.reused > options.orders {
        return Err("--reused cannot exceed --orders".into());
    }
    if options.resend_percent > 100 || options.transient_failure_percent > 100 {
        return Err("percentages are 0..=100".into());
    }
    if options.kill_after_commit_per_mille > 1000 {
        return Err("--kill-after-commit-per-mille is 0..=1000".into());
    }
    Ok(options)
}

/// The consumer processes, one per shard.
struct Fleet {
    binary: PathBuf,
    options_amqp: String,
    work: PathBuf,
    metrics_port_base: u16,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    children: Children,
    starts: usize,
}

impl Fleet {
    fn start(&mut self, shard: usize) -> Result<(), BoxError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.work.join(format!("consumer-{shard}.log")))?;
        let port = self.metrics_port_base + u16::try_from(shard)?;
        let mut command = Command::new(&self.binary);
        command
            .arg("--amqp")
            .arg(&self.options_amqp)
            .arg("--queue")
            .arg(queue_name(shard))
            .arg("--dir")
            .arg(self.work.join(format!("store-{shard}")))
            .arg("--events")
            .arg(self.work.join(format!("events-{shard}.log")))
            .arg("--metrics")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--transient-failure-percent")
            .arg(self.transient_failure_percent.to_string())
            .arg("--kill-after-commit-per-mille")
            .arg(self.kill_after_commit_per_mille.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut command);
        self.children.set(shard, command.spawn()?);
        self.starts += 1;
        Ok(())
    }

    /// Restarts every consumer that is not running: one that killed itself between a commit
    /// and its ack, or one that exited for another reason (it should not; reported).
    fn restart_exited(&mut self) -> Result<(), BoxError> {
        for shard in self.children.exited()? {
            self.start(shard)?;
        }
        Ok(())
    }
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
        declare_empty_queue(channel, &queue_name(shard), FieldTable::default(), binding).await?;
    }
    declare_empty_queue(channel, DEAD_LETTER_QUEUE, FieldTable::default(), None).await
}

/// The shard queues' names.
fn shard_queues(shards: usize) -> Vec<String> {
    (0..shards).map(queue_name).collect()
}

/// Total bytes of the consumers' event logs: still growing means still processing.
fn events_bytes(work: &Path, shards: usize) -> Result<u64, BoxError> {
    Ok((0..shards)
        .filter_map(|shard| std::fs::metadata(work.join(format!("events-{shard}.log"))).ok())
        .map(|metadata| metadata.len())
        .sum::<u64>())
}

/// The run's accounting, checked and printed at the end.
#[derive(Default)]
struct Accounting {
    published: u64,
    distinct_orders: u64,
    effects_applied: u64,
    duplicates_suppressed: u64,
    conflicts_dead_lettered: u64,
    redelivered: u64,
    transient_nacks: u64,
    in_progress_nacks: u64,
    kills: u64,
    self_kills: u64,
    starts: u64,
    unexpected_exits: u64,
    lost: u64,
    applied_twice: u64,
    wrong_content: u64,
    missing_conflicts: u64,
    false_conflicts: u64,
    total_mismatches: u64,
}

impl Accounting {
    fn passed(&self) -> bool {
        // A consumer that dies on its own is a bug even when nothing was lost.
        self.unexpected_exits == 0
            && self.lost == 0
            && self.applied_twice == 0
            && self.wrong_content == 0
            && self.missing_conflicts == 0
            && self.false_conflicts == 0
            && self.total_mismatches == 0
    }

    fn print(&self) {
        let rows = [
            ("published (confirmed by the broker)", self.published),
            ("distinct orders", self.distinct_orders),
            ("effects applied", self.effects_applied),
            ("duplicates suppressed", self.duplicates_suppressed),
            ("conflicts dead-lettered", self.conflicts_dead_lettered),
            ("deliveries marked redelivered", self.redelivered),
            ("transient failures nacked", self.transient_nacks),
            ("in-progress nacked", self.in_progress_nacks),
            ("consumers SIGKILLed at random moments", self.kills),
            (
                "consumers SIGKILLed between commit and ack",
                self.self_kills,
            ),
            ("consumer starts", self.starts),
            ("consumer exits not caused by us", self.unexpected_exits),
            ("lost", self.lost),
            ("applied twice", self.applied_twice),
            ("applied with content never published", self.wrong_content),
            (
                "conflicting content not dead-lettered",
                self.missing_conflicts,
            ),
            ("dead-lettered without a conflict", self.false_conflicts),
            ("shards whose total amount disagrees", self.total_mismatches),
        ];
        for (label, value) in rows {
            println!("  {label:<44} {value:>9}");
        }
    }
}

/// Counts the consumers' logged outcomes by kind.
fn count_events(work: &Path, shards: usize) -> Result<HashMap<String, u64>, BoxError> {
    let mut counts = HashMap::new();
    for shard in 0..shards {
        let path = work.join(format!("events-{shard}.log"));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for line in text.lines() {
            let kind = line.split(' ').next().unwrap_or_default();
            *counts.entry(kind.to_owned()).or_insert(0) += 1;
        }
    }
    Ok(counts)
}

#[tokio::main]
async fn main() {
    match run().await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("rabbitmq_e2e: {error}");
            std::process::exit(2);
        }
    }
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let started = Instant::now();
    let mut rng = Rng(options.seed);
    let plan = plan(
        options.orders,
        options.resend_percent,
        options.reused,
        &mut rng,
    );
    if options.work.exists() {
        std::fs::remove_dir_all(&options.work)?;
    }
    std::fs::create_dir_all(&options.work)?;

    let connection = connect(&options.amqp).await?;
    let channel = connection.create_channel().await?;
    topology(&channel, options.shards).await?;
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    let binary = std::env::current_exe()?.with_file_name("rabbitmq_orders");
    if !binary.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release --features tokio --examples`",
            binary.display()
        )
        .into());
    }
    let mut fleet = Fleet {
        binary,
        options_amqp: options.amqp.clone(),
        work: options.work.clone(),
        metrics_port_base: options.metrics_port_base,
        transient_failure_percent: options.transient_failure_percent,
        kill_after_commit_per_mille: options.kill_after_commit_per_mille,
        children: Children::new(options.shards),
        starts: 0,
    };
    for shard in 0..options.shards {
        fleet.start(shard)?;
    }
    println!(
        "rabbitmq_e2e: {} orders, {} messages to publish at {}/s, {} shards, work dir {}",
        options.orders,
        plan.messages.len(),
        options.rate,
        options.shards,
        options.work.display()
    );

    // The producer publishes at a steady rate (each publish confirmed), while this task kills
    // consumers at random moments and restarts them.
    let producer = {
        let messages = plan.messages.clone();
        let shards = options.shards;
        let interval = Duration::from_micros(1_000_000 / options.rate);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            let mut confirmed = 0u64;
            for message in messages {
                ticker.tick().await;
                let properties = BasicProperties::default()
                    .with_message_id(ShortString::from(message.order_id.as_str()))
                    .with_delivery_mode(2);
                let routing_key = shard_of(&message.order_id, shards).to_string();
                let confirm = publisher
                    .basic_publish(
                        EXCHANGE.into(),
                        routing_key.into(),
                        BasicPublishOptions::default(),
                        message.body.as_bytes(),
                        properties,
                    )
                    .await?
                    .await?;
                if !confirm.is_ack() {
                    return Err::<u64, BoxError>("the broker refused a publish".into());
                }
                confirmed += 1;
            }
            Ok(confirmed)
        })
    };
    let mut kills = 0u64;
    loop {
        let pause = 100 + rng.below(700);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        if producer.is_finished() && kills >= options.min_kills as u64 {
            break;
        }
        let shard = usize::try_from(rng.below(options.shards as u64))?;
        if fleet.children.kill(shard)?.is_some() {
            kills += 1;
            fleet.start(shard)?;
        }
        fleet.restart_exited()?;
    }
    let published = producer.await??;
    println!("rabbitmq_e2e: all published; {kills} kills done; draining");

    // Drain: wait for quiet, stop the consumers gracefully, and check nothing is left (a
    // message delivered to a stopping consumer goes back to its queue: start again then).
    let mut metrics_sample = None;
    for round in 0.. {
        wait_quiet(
            &channel,
            &shard_queues(options.shards),
            || fleet.restart_exited(),
            || events_bytes(&options.work, options.shards),
        )
        .await?;
        if metrics_sample.is_none() {
            let consumer_0 =
                std::net::SocketAddr::from(([127, 0, 0, 1], options.metrics_port_base));
            metrics_sample = prometheus::scrape(consumer_0).ok();
        }
        fleet.children.stop_gracefully()?;
        if ready_messages(&channel, &shard_queues(options.shards)).await? == 0 {
            break;
        }
        if round == 10 {
            return Err("messages keep coming back after ten drain rounds".into());
        }
        for shard in 0..options.shards {
            fleet.start(shard)?;
        }
    }
    if let Some(sample) = &metrics_sample {
        std::fs::write(options.work.join("metrics-shard-0.txt"), sample)?;
    }
    let dead_letters = drain_dead_letters(&channel).await?;
    connection.close(200, "done".into()).await?;

    let events = count_events(&options.work, options.shards)?;
    let event = |kind: &str| events.get(kind).copied().unwrap_or(0);
    let mut accounting = Accounting {
        published,
        distinct_orders: plan.contents.len() as u64,
        duplicates_suppressed: event("duplicate"),
        redelivered: event("redelivered"),
        transient_nacks: event("transient"),
        in_progress_nacks: event("in_progress"),
        kills,
        self_kills: fleet.children.self_kills as u64,
        starts: fleet.starts as u64,
        unexpected_exits: fleet.children.unexpected_exits as u64,
        ..Accounting::default()
    };
    let mut stores = Vec::new();
    for shard in 0..options.shards {
        let dir = options.work.join(format!("store-{shard}"));
        stores.push((format!("shard {shard}"), open_store(&dir)?));
    }
    let verdict = verify(&stores, &plan, &dead_letters)?;
    accounting.effects_applied = verdict.effects_applied;
    accounting.lost = verdict.lost;
    accounting.applied_twice = verdict.applied_twice;
    accounting.wrong_content = verdict.wrong_content;
    accounting.missing_conflicts = verdict.missing_conflicts;
    accounting.false_conflicts = verdict.false_conflicts;
    accounting.conflicts_dead_lettered = verdict.conflicts_dead_lettered;
    accounting.total_mismatches = verdict.total_mismatches;
    println!(
        "rabbitmq_e2e: accounting ({:.0} s from first publish to last check)",
        started.elapsed().as_secs_f64()
    );
    accounting.print();
    if let Some(sample) = metrics_sample {
        let shown: Vec<&str> = sample
            .lines()
            .filter(|line| line.starts_with("idemdb_outcomes_total") || line.contains("_count"))
            .take(8)
            .collect();
        println!("rabbitmq_e2e: metrics of consumer 0 (full scrape in the work dir):");
        for line in shown {
            println!("  {line}");
        }
    }
    let passed = accounting.passed();
    println!(
        "rabbitmq_e2e: {}",
        if passed {
            "PASSED: lost = 0, applied twice = 0"
        } else {
            "FAILED"
        }
    );
    Ok(passed)
}
