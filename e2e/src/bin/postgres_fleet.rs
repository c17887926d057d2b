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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemdb_postgres::{Names, install};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel};

#[path = "../checker.rs"]
mod checker;
#[path = "../../../examples/common/handler.rs"]
mod handler;
#[path = "../../../examples/common/orders.rs"]
mod orders;
#[path = "../pg_cluster.rs"]
mod pg_cluster;
use checker::{
    Applied, BoxError, Children, Plan, Rng, check_applied, connect, declare_empty_queue,
    die_with_parent, drain_dead_letters, plan, ready_messages, wait_quiet,
};
use handler::{chain, monotonic_ns};
use orders::DEAD_LETTER_QUEUE;
use pg_cluster::{Binaries, Node, free_port};

/// The one queue every consumer of the fleet reads.
const QUEUE: &str = "orders.fleet";

struct Options {
    amqp: String,
    orders: usize,
    consumers: usize,
    workers: usize,
    resend_percent: u64,
    reused: usize,
    rate: u64,
    min_kills: usize,
    failovers: usize,
    kill_after_commit_per_mille: u64,
    work: PathBuf,
    seed: u64,
    negative_control: bool,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        amqp: "amqp://guest:guest@127.0.0.1:15673/%2f".into(),
        orders: 2000,
        consumers: 3,
        workers: 4,
        resend_percent: 20,
        reused: 20,
        rate: 300,
        min_kills: 10,
        failovers: 2,
        kill_after_commit_per_mille: 5,
        work: std::env::temp_dir().join("idemdb-postgres-fleet"),
        seed: 1,
        negative_control: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--amqp" => options.amqp = value()?,
            "--orders" => options.orders = value()?.parse()?,
            "--consumers" => options.consumers = value()?.parse()?,
            "--workers" => options.workers = value()?.parse()?,
            "--resend-percent" => options.resend_percent = value()?.parse()?,
            "--reused" => options.reused = value()?.parse()?,
            "--rate" => options.rate = value()?.parse()?,
            "--min-kills" => options.min_kills = value()?.parse()?,
            "--failovers" => options.failovers = value()?.parse()?,
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = value()?.parse()?;
            }
            "--work" => options.work = value()?.into(),
            "--seed" => options.seed = value()?.parse()?,
            "--negative-control" => options.negative_control = true,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.orders == 0 || options.consumers == 0 || options.workers == 0 || options.rate == 0 {
        return Err("--orders, --consumers, --workers and --rate must be at least 1".into());
    }
    if options.reused > options.orders {
        return Err("--reused cannot exceed --orders".into());
    }
    if options.resend_percent > 100 || options.kill_after_commit_per_mille > 1000 {
        return Err("--resend-percent is 0..=100, --kill-after-commit-per-mille 0..=1000".into());
    }
    if options.negative_control {
        options.failovers = 0;
    }
    Ok(options)
}

/// The primary and its synchronous standby; the standby's place is taken by a new copy after
/// every failover.
struct Cluster {
    binaries: Binaries,
    dir: PathBuf,
    primary: Node,
    standby: Option<Node>,
    /// Servers made so far: names and folders are `node<N>`.
    made: usize,
}

/// One failover's times, on the system-wide monotonic clock.
struct Failover {
    killed_ns: u64,
    promoted_ns: u64,
}

impl Cluster {
    fn new(dir: &Path, with_standby: bool) -> Result<Cluster, BoxError> {
        let binaries = Binaries::find()?;
        binaries.own(dir)?;
        let primary = binaries.primary("node0", dir.join("node0"))?;
        let mut cluster = Cluster {
            binaries,
            dir: dir.to_owned(),
            primary,
            standby: None,
            made: 1,
        };
        if with_standby {
            let port = free_port()?;
            cluster.add_standby(port)?;
        }
        Ok(cluster)
    }

    fn add_standby(&mut self, port: u16) -> Result<(), BoxError> {
        let name = format!("node{}", self.made);
        self.made += 1;
        let standby = self
            .binaries
            .standby(&self.primary, &name, self.dir.join(&name), port)?;
        self.standby = Some(standby);
        Ok(())
    }

    /// The consumers' connection string: both ports, and only a server that accepts writes
    /// will do, so a reconnect after a failover finds the new primary.
    fn conninfo(&self) -> String {
        let mut ports = vec![self.primary.port.to_string()];
        if let Some(standby) = &self.standby {
            ports.push(standby.port.to_string());
        }
        let hosts = vec!["127.0.0.1"; ports.len()];
        format!(
            "host={} port={} user=postgres dbname=postgres target_session_attrs=read-write \
             connect_timeout=2",
            hosts.join(","),
            ports.join(",")
        )
    }

    /// Kills the primary as a lost host dies, promotes the synchronous standby, and copies a
    /// new standby onto the old primary's port.
    async fn fail_over(&mut self) -> Result<Failover, BoxError> {
        // Only a primary with a streaming synchronous standby may be lost without losing an
        // acknowledged commit.
        self.primary.require_sync_standby().await?;
        let standby = self.standby.take().ok_or("no standby to promote")?;
        self.primary.kill()?;
        // Taken once every process of the primary has been sent its SIGKILL: until then its
        // backends still serve (the kill stops the postmaster, then lists its children), and
        // a commit they acknowledge is not one of the new primary's.
        let killed_ns = monotonic_ns();
        standby.promote().await?;
        let promoted_ns = monotonic_ns();
        let old = std::mem::replace(&mut self.primary, standby);
        let old_port = old.port;
        let old_data = old.data.clone();
        drop(old);
        std::fs::remove_dir_all(&old_data)?;
        self.add_standby(old_port)?;
        self.primary.require_sync_standby().await?;
        Ok(Failover {
            killed_ns,
            promoted_ns,
        })
    }
}

/// The consumer processes.
struct Fleet {
    binary: PathBuf,
    amqp: String,
    pg: String,
    work: PathBuf,
    workers: usize,
    negative_control: bool,
    kill_after_commit_per_mille: u64,
    children: Children,
    starts: usize,
}

impl Fleet {
    fn start(&mut self, slot: usize) -> Result<(), BoxError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.work.join(format!("consumer-{slot}.log")))?;
        let mut command = Command::new(&self.binary);
        command
            .arg("--amqp")
            .arg(&self.amqp)
            .arg("--queue")
            .arg(QUEUE)
            .arg("--pg")
            .arg(&self.pg)
            .arg("--workers")
            .arg(self.workers.to_string())
            .arg("--ledger")
            .arg(self.work.join(format!("ledger-{slot}.log")))
            .arg("--kill-after-commit-per-mille")
            .arg(self.kill_after_commit_per_mille.to_string());
        if self.negative_control {
            command
                .arg("--embedded")
                .arg(self.work.join(format!("store-{slot}")));
        }
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut command);
        self.children.set(slot, command.spawn()?);
        self.starts += 1;
        Ok(())
    }

    fn restart_exited(&mut self) -> Result<(), BoxError> {
        for slot in self.children.exited()? {
            self.start(slot)?;
        }
        Ok(())
    }

    /// Waits until the queue has drained and the consumers are idle, then stops them
    /// gracefully; starts them again and repeats until nothing came back to the queue. The
    /// consumers are stopped on return.
    async fn drain(&mut self, channel: &Channel, consumers: usize) -> Result<(), BoxError> {
        let queues = [QUEUE.to_owned()];
        for round in 0.. {
            let work = self.work.clone();
            wait_quiet(
                channel,
                &queues,
                || self.restart_exited(),
                || ledger_bytes(&work, consumers),
            )
            .await?;
            self.children.stop_gracefully()?;
            if ready_messages(channel, &queues).await? == 0 {
                return Ok(());
            }
            if round == 10 {
                return Err("messages keep coming back after ten drain rounds".into());
            }
            for slot in 0..consumers {
                self.start(slot)?;
            }
        }
        Ok(())
    }
}

/// The fleet, whoever poisoned its lock (a panic elsewhere is reported there).
fn lock(fleet: &Mutex<Fleet>) -> std::sync::MutexGuard<'_, Fleet> {
    fleet
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Total bytes of the consumers' ledgers: still growing means still processing.
fn ledger_bytes(work: &Path, consumers: usize) -> Result<u64, BoxError> {
    Ok((0..consumers)
        .filter_map(|slot| std::fs::metadata(work.join(format!("ledger-{slot}.log"))).ok())
        .map(|metadata| metadata.len())
        .sum::<u64>())
}

/// One ledger line: its kind, when it was written and (for a commit) when its claim began, on
/// the system-wide monotonic clock.
struct Event {
    kind: String,
    ns: u64,
    began_ns: Option<u64>,
}

/// Every ledger line.
fn ledger_events(work: &Path, consumers: usize) -> Vec<Event> {
    let mut events = Vec::new();
    for slot in 0..consumers {
        let Ok(text) = std::fs::read_to_string(work.join(format!("ledger-{slot}.log"))) else {
            continue;
        };
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if let (Some(kind), Some(ns)) = (fields.first(), fields.get(3))
                && let Ok(ns) = ns.parse()
            {
                events.push(Event {
                    kind: (*kind).to_owned(),
                    ns,
                    began_ns: fields.get(5).and_then(|began| began.parse().ok()),
                });
            }
        }
    }
    events
}

/// The effects table: how often each order was applied, and with which content.
async fn read_applied(cluster: &Cluster) -> Result<HashMap<String, Applied>, BoxError> {
    let client = cluster.primary.connect().await?;
    let rows = client
        .query("SELECT order_id, body, times FROM fleet.applied", &[])
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let times: i32 = row.get(2);
            (
                row.get::<_, String>(0),
                Applied {
                    times: u64::try_from(times).unwrap_or(0),
                    body: row.get(1),
                },
            )
        })
        .collect())
}

/// Publishes `messages` (order id, body) at `rate` per second, each confirmed by the broker;
/// `published` counts the confirmed ones as they go.
async fn publish(
    channel: Channel,
    messages: Vec<(String, String)>,
    rate: u64,
    published: Arc<AtomicU64>,
) -> Result<(), BoxError> {
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    for (order_id, body) in messages {
        ticker.tick().await;
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(order_id.as_str()))
            .with_delivery_mode(2);
        let confirm = channel
            .basic_publish(
                "".into(),
                QUEUE.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                properties,
            )
            .await?
            .await?;
        if !confirm.is_ack() {
            return Err("the broker refused a publish".into());
        }
        published.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

#[derive(Default)]
struct Accounting {
    published: u64,
    distinct_orders: u64,
    effects_applied: u64,
    duplicates: u64,
    conflicts_dead_lettered: u64,
    in_progress_nacks: u64,
    database_errors: u64,
    unknown_commits: u64,
    by_apply: u64,
    by_apply_after_failover: u64,
    kills: u64,
    self_kills: u64,
    unexpected_exits: u64,
    failovers: u64,
    lost: u64,
    applied_twice: u64,
    wrong_content: u64,
    missing_conflicts: u64,
    false_conflicts: u64,
    republished: u64,
    republished_duplicates: u64,
    republished_fresh: u64,
}

impl Accounting {
    fn print(&self) {
        let rows = [
            ("published (confirmed by the broker)", self.published),
            ("distinct orders", self.distinct_orders),
            ("effects applied", self.effects_applied),
            ("duplicates suppressed", self.duplicates),
            ("conflicts dead-lettered", self.conflicts_dead_lettered),
            (
                "in-progress nacked (held by another)",
                self.in_progress_nacks,
            ),
            ("database errors nacked", self.database_errors),
            ("commits with an unknown outcome", self.unknown_commits),
            ("effects committed by apply", self.by_apply),
            (
                "of them on a client rebuilt after a failover",
                self.by_apply_after_failover,
            ),
            ("consumers SIGKILLed at random moments", self.kills),
            (
                "consumers SIGKILLed between commit and ack",
                self.self_kills,
            ),
            ("consumer exits not caused by us", self.unexpected_exits),
            ("primary failovers", self.failovers),
            ("lost", self.lost),
            ("applied twice", self.applied_twice),
            ("applied with content never published", self.wrong_content),
            (
                "conflicting content not dead-lettered",
                self.missing_conflicts,
            ),
            ("dead-lettered without a conflict", self.false_conflicts),
            ("republished after the run", self.republished),
            (
                "republished and answered duplicate",
                self.republished_duplicates,
            ),
            ("republished but fresh", self.republished_fresh),
        ];
        for (label, value) in rows {
            println!("  {label:<44} {value:>9}");
        }
    }

    fn passed(&self) -> bool {
        self.unexpected_exits == 0
            && self.lost == 0
            && self.applied_twice == 0
            && self.wrong_content == 0
            && self.missing_conflicts == 0
            && self.false_conflicts == 0
            && self.republished_fresh == 0
    }
}

#[tokio::main]
async fn main() {
    match run().await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("postgres_fleet: {}", chain(&*error));
            std::process::exit(2);
        }
    }
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let name = if options.negative_control {
        "postgres_fleet (negative control)"
    } else {
        "postgres_fleet"
    };
    let started = Instant::now();
    let mut rng = Rng(options.seed);
    let plan: Plan = plan(
        options.orders,
        options.resend_percent,
        options.reused,
        &mut rng,
    );
    if options.work.exists() {
        std::fs::remove_dir_all(&options.work)?;
    }
    std::fs::create_dir_all(&options.work)?;
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
    {
        let mut client = cluster.primary.connect().await?;
        install(&mut client, &Names::default()).await?;
        client
            .batch_execute(
                "CREATE SCHEMA fleet;
                 CREATE TABLE fleet.applied (
                     order_id text PRIMARY KEY,
                     body text NOT NULL,
                     times integer NOT NULL
                 );",
            )
            .await?;
    }

    let connection = connect(&options.amqp).await?;
    let channel = connection.create_channel().await?;
    declare_empty_queue(&channel, QUEUE, FieldTable::default(), None).await?;
    declare_empty_queue(&channel, DEAD_LETTER_QUEUE, FieldTable::default(), None).await?;
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    let binary = std::env::current_exe()?.with_file_name("postgres_orders");
    if !binary.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release --features tokio --examples`",
            binary.display()
        )
        .into());
    }
    let mut fleet = Fleet {
        binary,
        amqp: options.amqp.clone(),
        pg: cluster.conninfo(),
        work: options.work.clone(),
        workers: options.workers,
        negative_control: options.negative_control,
        kill_after_commit_per_mille: options.kill_after_commit_per_mille,
        children: Children::new(options.consumers),
        starts: 0,
    };
    for slot in 0..options.consumers {
        fleet.start(slot)?;
    }
    println!(
        "{name}: {} orders, {} messages at {}/s to one queue, {} consumers x {} workers, \
         {} failovers planned, work dir {}",
        options.orders,
        plan.messages.len(),
        options.rate,
        options.consumers,
        options.workers,
        options.failovers,
        options.work.display()
    );

    // The producer publishes at a steady rate; this task kills consumers at random moments
    // and fails the primary over at evenly spaced points of the stream.
    let published = Arc::new(AtomicU64::new(0));
    let messages: Vec<(String, String)> = plan
        .messages
        .iter()
        .map(|message| (message.order_id.clone(), message.body.clone()))
        .collect();
    let total = messages.len() as u64;
    let producer = tokio::spawn(publish(
        publisher.clone(),
        messages,
        options.rate,
        published.clone(),
    ));
    let failover_points: Vec<u64> = (1..=options.failovers as u64)
        .map(|n| n * total / (options.failovers as u64 + 1))
        .collect();
    // Kills spread over the publishing time, so that they land while there is work.
    let publishing_ms = total * 1000 / options.rate;
    let mean_gap_ms = (publishing_ms / (options.min_kills as u64 + 1)).clamp(50, 1500);
    let mut failovers = Vec::new();
    let mut kills = 0u64;
    // Consumers that died (they also kill themselves between a commit and its ack) are
    // restarted at once by a task of their own, also while a failover keeps this one busy.
    let fleet = Arc::new(Mutex::new(fleet));
    let restarting = Arc::new(AtomicBool::new(true));
    let restarter = tokio::spawn({
        let fleet = fleet.clone();
        let restarting = restarting.clone();
        async move {
            while restarting.load(Ordering::Relaxed) {
                lock(&fleet).restart_exited()?;
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
        if done_publishing && kills >= options.min_kills as u64 {
            break;
        }
        let slot = usize::try_from(rng.below(options.consumers as u64))?;
        let mut fleet = lock(&fleet);
        if fleet.children.kill(slot)?.is_some() {
            kills += 1;
            fleet.start(slot)?;
        }
    }
    restarting.store(false, Ordering::Relaxed);
    restarter.await??;
    let mut fleet = Arc::into_inner(fleet)
        .ok_or("the restarter still holds the fleet")?
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    producer.await??;
    println!(
        "{name}: all published; {kills} kills, {} failovers; draining",
        failovers.len()
    );
    fleet.drain(&channel, options.consumers).await?;

    let applied = read_applied(&cluster).await?;
    let dead_letters = drain_dead_letters(&channel).await?;
    let verdict = check_applied(&plan, &dead_letters, &applied);

    // Every applied order once more, as a broker would redeliver it long after: each must be
    // a duplicate now.
    let before_republish = monotonic_ns();
    let again: Vec<(String, String)> = applied
        .iter()
        .map(|(order_id, applied)| (order_id.clone(), applied.body.clone()))
        .collect();
    let republished = Arc::new(AtomicU64::new(0));
    for slot in 0..options.consumers {
        fleet.start(slot)?;
    }
    publish(
        publisher,
        again,
        options.rate.max(1000),
        republished.clone(),
    )
    .await?;
    fleet.drain(&channel, options.consumers).await?;
    let after = read_applied(&cluster).await?;
    let republished_fresh = after
        .iter()
        .filter(|(order_id, now)| {
            applied
                .get(*order_id)
                .is_none_or(|then| now.times > then.times)
        })
        .count() as u64;
    let late_dead_letters = drain_dead_letters(&channel).await?;
    connection.close(200, "done".into()).await?;

    let events = ledger_events(&options.work, options.consumers);
    let count = |kind: &str, after_ns: u64| {
        events
            .iter()
            .filter(|event| event.kind == kind && event.ns >= after_ns)
            .count() as u64
    };
    let accounting = Accounting {
        published: published.load(Ordering::Relaxed),
        distinct_orders: plan.contents.len() as u64,
        effects_applied: verdict.effects_applied,
        duplicates: count("duplicate", 0) - count("duplicate", before_republish),
        conflicts_dead_lettered: verdict.conflicts_dead_lettered,
        in_progress_nacks: count("in_progress", 0),
        database_errors: count("db_error", 0),
        unknown_commits: count("unknown_commit", 0),
        by_apply: count("by_apply", 0),
        by_apply_after_failover: failovers
            .first()
            .map_or(0, |failover| count("by_apply", failover.killed_ns)),
        kills,
        self_kills: fleet.children.self_kills as u64,
        unexpected_exits: fleet.children.unexpected_exits as u64,
        failovers: failovers.len() as u64,
        lost: verdict.lost,
        applied_twice: verdict.applied_twice,
        wrong_content: verdict.wrong_content,
        missing_conflicts: verdict.missing_conflicts,
        false_conflicts: verdict.false_conflicts,
        republished: republished.load(Ordering::Relaxed),
        republished_duplicates: count("duplicate", before_republish),
        // A republished order that conflicted would be a wrong answer too.
        republished_fresh: republished_fresh + late_dead_letters.len() as u64,
    };
    println!(
        "{name}: accounting ({:.0} s from first publish to last check)",
        started.elapsed().as_secs_f64()
    );
    accounting.print();
    // Failover time: from the primary's SIGKILL to the first commit acknowledged by the new
    // primary (the consumers reconnect on their own): the first commit whose claim began after
    // the kill (one that began before may have been acknowledged by the old primary).
    let mut times_ms = Vec::new();
    for (index, failover) in failovers.iter().enumerate() {
        let first_commit = events
            .iter()
            .filter(|event| {
                event.kind == "fresh"
                    && event
                        .began_ns
                        .is_some_and(|began| began > failover.killed_ns)
            })
            .map(|event| event.ns)
            .min();
        match first_commit {
            Some(ns) => {
                let ms = (ns - failover.killed_ns) / 1_000_000;
                println!(
                    "  failover {}: promotion {} ms, first commit on the new primary after {ms} ms",
                    index + 1,
                    (failover.promoted_ns - failover.killed_ns) / 1_000_000
                );
                times_ms.push(ms);
            }
            None => println!("  failover {}: no commit after it", index + 1),
        }
    }
    if !times_ms.is_empty() {
        times_ms.sort_unstable();
        let middle = times_ms.len() / 2;
        let median = if times_ms.len() % 2 == 0 {
            (times_ms[middle - 1] + times_ms[middle]) / 2
        } else {
            times_ms[middle]
        };
        println!(
            "  failover time (kill -> first commit): median {median} ms, max {} ms",
            times_ms[times_ms.len() - 1]
        );
    }
    drop(cluster);
    let passed = if options.negative_control {
        // The checker must see what a fleet without a shared claim store does.
        let caught = accounting.applied_twice > 0;
        println!(
            "{name}: {}",
            if caught {
                "PASSED: the checker caught orders applied twice"
            } else {
                "FAILED: the checker found nothing wrong with per-process stores"
            }
        );
        caught
    } else {
        // Every connection dies with the primary: apply must have committed on one rebuilt
        // after a failover (a reconnected client once failed every apply).
        let passed = accounting.passed()
            && (options.failovers == 0 || accounting.by_apply_after_failover > 0)
            && accounting.failovers == options.failovers as u64
            && accounting.kills >= options.min_kills as u64;
        println!(
            "{name}: {}",
            if passed {
                "PASSED: lost = 0, applied twice = 0, republished but fresh = 0"
            } else {
                "FAILED"
            }
        );
        passed
    };
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
