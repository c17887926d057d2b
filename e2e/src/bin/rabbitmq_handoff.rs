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
//! load), then SIGCONTs it (a zombie: it must notice, stop committing, and release its stores). Consumers also SIGKILL
//! themselves between a commit and its ack, and take an online backup (`Engine::checkpoint`)
//! of each partition they own every `--checkpoint-every-ms`.
//!
//! Then it checks and prints, from the stores, the dead-letter queue and the consumers'
//! ledgers (lines with the system's monotonic clock):
//! - every order applied exactly once over all stores, with content that was published; every
//!   other content dead-lettered; nothing dead-lettered without a conflict; per-partition totals;
//! - every commit made by the partition's latest opener (the store lock keeps two owners apart);
//! - the zombie committed nothing after it noticed the lost connection, and released its stores
//!   (or SIGKILLed itself at a commit point before it released them all: its death did);
//! - handoffs counted, and the handoff time after each SIGKILL (kill -> the new owner's first
//!   commit on that partition), p50 and p99;
//! - each backup, restored into a scratch store (with `idemdb restore` when that binary is
//!   built), holds every claim with all its writes or none of them, and every commit
//!   acknowledged before the backup began.
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

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idemdb::{RecordState, merge_ops};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, ExchangeKind};

#[path = "../checker.rs"]
mod checker;
#[path = "../../../examples/common/handler.rs"]
mod handler;
#[path = "../../../examples/common/orders.rs"]
mod orders;
#[path = "../../../examples/common/prometheus.rs"]
mod prometheus;
use checker::{
    BoxError, Children, Plan, Rng, connect, declare_empty_queue, die_with_parent,
    drain_dead_letters, plan, ready_messages, verify, wait_quiet,
};
use handler::{Ledger, monotonic_ns};
use orders::{
    DEAD_LETTER_QUEUE, PARTITION_EXCHANGE, TOTAL_AMOUNT_KEY, open_store, parse_amount,
    partition_queue, partition_queue_arguments,
};

struct Options {
    amqp: String,
    orders: usize,
    partitions: usize,
    consumers: usize,
    resend_percent: u64,
    reused: usize,
    rate: u64,
    min_kills: usize,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    heartbeat_s: u64,
    zombie_stop_s: u64,
    checkpoint_every_ms: u64,
    negative_control: bool,
    metrics_port_base: u16,
    work: PathBuf,
    seed: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        amqp: "amqp://guest:guest@127.0.0.1:15673/%2f".into(),
        orders: 2000,
        partitions: 6,
        consumers: 3,
        resend_percent: 20,
        reused: 20,
        rate: 400,
        min_kills: 10,
        transient_failure_percent: 3,
        kill_after_commit_per_mille: 5,
        heartbeat_s: 2,
        zombie_stop_s: 0,
        checkpoint_every_ms: 2000,
        negative_control: false,
        metrics_port_base: 19200,
        work: std::env::temp_dir().join("idemdb-rabbitmq-handoff"),
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--negative-control" {
            options.negative_control = true;
            continue;
        }
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--amqp" => options.amqp = value()?,
            "--orders" => options.orders = value()?.parse()?,
            "--partitions" => options.partitions = value()?.parse()?,
            "--consumers" => options.consumers = value()?.parse()?,
            "--resend-percent" => options.resend_percent = value()?.parse()?,
            "--reused" => options.reused = value()?.parse()?,
            "--rate" => options.rate = value()?.parse()?,
            "--min-kills" => options.min_kills = value()?.parse()?,
            "--transient-failure-percent" => {
                options.transient_failure_percent = value()?.parse()?;
            }
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = value()?.parse()?;
            }
            "--heartbeat-s" => options.heartbeat_s = value()?.parse()?,
            "--zombie-stop-s" => options.zombie_stop_s = value()?.parse()?,
            "--checkpoint-every-ms" => options.checkpoint_every_ms = value()?.parse()?,
            "--metrics-port-base" => options.metrics_port_base = value()?.parse()?,
            "--work" => options.work = value()?.into(),
            "--seed" => options.seed = value()?.parse()?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.orders == 0 || options.partitions == 0 || options.rate == 0 {
        return Err("--orders, --partitions and --rate must be at least 1".into());
    }
    if options.consumers < 2 {
        return Err("--consumers must be at least 2: a partition needs a standby".into());
    }
    if options.heartbeat_s == 0 {
        return Err("--heartbeat-s must be at least 1: it is how the broker finds a zombie".into());
    }
    if options.zombie_stop_s == 0 {
        // Long enough for the broker to miss two heartbeats and close the connection.
        options.zombie_stop_s = 3 * options.heartbeat_s + 2;
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
    if options.negative_control {
        // Each consumer's own stores: a backup's ledger check would compare unrelated stores.
        options.checkpoint_every_ms = 0;
    }
    Ok(options)
}

/// The fewest handoffs after a SIGKILL a passing run has timed: fewer means the kills did not
/// hit owners, and the run proved little.
const MIN_TIMED_HANDOFFS: usize = 5;

/// How long the random kills spare a zombie after its SIGCONT.
const ZOMBIE_SPARED: Duration = Duration::from_secs(3);

/// The longest a zombie is held paused waiting for the broker to hand one of its partitions on.
const ZOMBIE_HOLD_MAX: Duration = Duration::from_secs(60);

/// Whether a partition `pid` owned when it was stopped (at `stop_ns`) became active on another
/// consumer since: the broker noticed the pause and handed it on.
fn handed_on(events: &[Event], pid: u32, stop_ns: u64, partitions: &[usize]) -> bool {
    events.iter().any(|event| {
        event.kind == "active"
            && event.pid != pid
            && event.at_ns > stop_ns
            && event.partition.is_some_and(|p| partitions.contains(&p))
    })
}

/// The consumer processes.
struct Fleet {
    binary: PathBuf,
    options: Options,
    children: Children,
    /// The consumer now stopped (SIGSTOP), which the random kills leave alone.
    stopped: Option<usize>,
    starts: usize,
    ledger: Ledger,
}

impl Fleet {
    fn amqp(&self) -> String {
        let separator = if self.options.amqp.contains('?') {
            '&'
        } else {
            '?'
        };
        format!(
            "{}{separator}heartbeat={}",
            self.options.amqp, self.options.heartbeat_s
        )
    }

    fn stores(&self, consumer: usize) -> PathBuf {
        if self.options.negative_control {
            self.options
                .work
                .join(format!("stores/consumer-{consumer}"))
        } else {
            self.options.work.join("stores")
        }
    }

    fn start(&mut self, consumer: usize) -> Result<(), BoxError> {
        let work = &self.options.work;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(work.join(format!("consumer-{consumer}.log")))?;
        let preferred: Vec<String> = (0..self.options.partitions)
            .filter(|p| p % self.options.consumers == consumer)
            .map(|p| p.to_string())
            .collect();
        let port = self.options.metrics_port_base + u16::try_from(consumer)?;
        let mut command = Command::new(&self.binary);
        command
            .arg("--amqp")
            .arg(self.amqp())
            .arg("--partitions")
            .arg(self.options.partitions.to_string())
            .arg("--stores")
            .arg(self.stores(consumer))
            .arg("--preferred")
            .arg(preferred.join(","))
            .arg("--ledger")
            .arg(work.join(format!("ledger-{consumer}.log")))
            .arg("--metrics")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--transient-failure-percent")
            .arg(self.options.transient_failure_percent.to_string())
            .arg("--kill-after-commit-per-mille")
            .arg(self.options.kill_after_commit_per_mille.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if self.options.checkpoint_every_ms > 0 {
            command
                .arg("--checkpoint-every-ms")
                .arg(self.options.checkpoint_every_ms.to_string())
                .arg("--backups")
                .arg(work.join("backups"));
        }
        die_with_parent(&mut command);
        self.children.set(consumer, command.spawn()?);
        self.starts += 1;
        Ok(())
    }

    /// SIGKILLs the consumer (logged); false if it had exited already.
    fn kill(&mut self, consumer: usize) -> Result<bool, BoxError> {
        if !self.children.running(consumer)? {
            return Ok(false);
        }
        if let Some(pid) = self.children.pid(consumer) {
            // Logged first: the kill is the moment the handoff times start from.
            self.ledger.event("kill", &pid.to_string(), None);
        }
        Ok(self.children.kill(consumer)?.is_some())
    }

    /// SIGSTOP or SIGCONT to the consumer, logged.
    fn signal(&mut self, consumer: usize, signal: libc::c_int) -> Result<(), BoxError> {
        if let Some(pid) = self.children.pid(consumer) {
            let kind = if signal == libc::SIGSTOP {
                "stop"
            } else {
                "cont"
            };
            self.ledger.event(kind, &pid.to_string(), None);
            self.children.signal(consumer, signal)?;
        }
        Ok(())
    }

    /// Restarts every consumer that is not running.
    fn restart_exited(&mut self) -> Result<(), BoxError> {
        for consumer in self.children.exited()? {
            self.start(consumer)?;
        }
        Ok(())
    }
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
        declare_empty_queue(channel, &queue, partition_queue_arguments(), binding).await?;
    }
    declare_empty_queue(channel, DEAD_LETTER_QUEUE, FieldTable::default(), None).await
}

/// The partition queues' names.
fn partition_queues(partitions: usize) -> Vec<String> {
    (0..partitions).map(partition_queue).collect()
}

/// One ledger line: `<kind> <subject> <partition> <monotonic ns> <pid>`.
#[derive(Clone, Debug)]
struct Event {
    kind: String,
    subject: String,
    partition: Option<usize>,
    at_ns: u64,
    pid: u32,
    /// When what the line reports began: a commit's start (its line is written when it was
    /// acknowledged); the line's own time for every other event.
    began_ns: u64,
}

/// Every ledger line of the run (the consumers' and this checker's), in time order.
fn read_events(work: &Path) -> Result<Vec<Event>, BoxError> {
    let mut events = Vec::new();
    for entry in std::fs::read_dir(work)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with("ledger-") && name.ends_with(".log")) {
            continue;
        }
        for line in std::fs::read_to_string(&path)?.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let (&[kind, subject, partition, at_ns, pid], began) =
                fields.split_at(5.min(fields.len()))
            else {
                return Err(format!("{}: malformed line {line:?}", path.display()).into());
            };
            let at_ns = at_ns.parse()?;
            events.push(Event {
                kind: kind.to_owned(),
                subject: subject.to_owned(),
                partition: partition.parse().ok(),
                at_ns,
                pid: pid.parse()?,
                began_ns: match began {
                    [] => at_ns,
                    [began] => began.parse()?,
                    _ => return Err(format!("{}: malformed line {line:?}", path.display()).into()),
                },
            });
        }
    }
    events.sort_by_key(|event| event.at_ns);
    Ok(events)
}

/// How many deliveries the consumers have handled so far: still growing means still
/// processing. (Backups are not counted: an owner takes one after its last commit.)
fn deliveries_handled(work: &Path) -> Result<u64, BoxError> {
    Ok(read_events(work)?
        .iter()
        .filter(|event| !event.kind.starts_with("checkpoint"))
        .count() as u64)
}

/// The partitions process `pid` owns at `at_ns`: opened by it and not released since.
fn owned_at(events: &[Event], pid: u32, at_ns: u64) -> Vec<usize> {
    let mut owner: BTreeMap<usize, bool> = BTreeMap::new();
    for event in events.iter().take_while(|event| event.at_ns <= at_ns) {
        let (Some(partition), true) = (event.partition, event.pid == pid) else {
            continue;
        };
        match event.kind.as_str() {
            "open" => {
                owner.insert(partition, true);
            }
            "release" => {
                owner.insert(partition, false);
            }
            _ => {}
        }
    }
    // A process that SIGKILLed itself owns nothing any more.
    if events
        .iter()
        .any(|event| event.kind == "self-kill" && event.pid == pid && event.at_ns < at_ns)
    {
        return Vec::new();
    }
    owner
        .into_iter()
        .filter_map(|(partition, owned)| owned.then_some(partition))
        .collect()
}

/// Nearest-rank percentile of sorted milliseconds.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What the ledgers say about ownership, handoffs and the zombie.
#[derive(Default)]
struct Handoffs {
    /// Opens of a partition by another process than its previous opener.
    handoffs: u64,
    /// Kill (of an owner) -> the new owner's first commit on each partition it owned, ms.
    to_first_commit_ms: Vec<f64>,
    /// Kill -> the first delivery to the new owner (the broker's detection and redelivery), ms.
    to_active_ms: Vec<f64>,
    /// Kills of a process that owned no partition, or whose partitions saw no commit after.
    kills_without_handoff: u64,
    /// Handoffs after a kill that overlap the zombie's pause (not in the handoff times).
    overlapping_pause: u64,
    /// Commits begun by a process that was not the partition's latest opener (must be 0).
    foreign_commits: u64,
    zombie: Option<Zombie>,
}

struct Zombie {
    partitions: Vec<usize>,
    /// SIGSTOP -> first delivery of one of its partitions to another process, ms.
    broker_detection_ms: Option<f64>,
    /// SIGCONT -> the zombie notices its connection is gone, ms.
    noticed_after_cont_ms: Option<f64>,
    /// SIGCONT -> the zombie SIGKILLs itself at a commit point, before it opened a store again,
    /// ms: its death stands for noticing (if it had not) and for releasing every store it still
    /// held (the system drops a dead process's locks), as a dead process writes neither `lost`
    /// nor `release`.
    died_after_cont_ms: Option<f64>,
    /// Commits between SIGCONT and noticing (safe: it still held the stores).
    commits_before_noticing: u64,
    /// Commits on its old partitions after it noticed, before it opened them again (must be 0).
    commits_after_noticing: u64,
    /// Of its partitions, those it released after noticing.
    released: usize,
    /// Of its partitions, those delivered to another process before the zombie released them.
    contested: usize,
    /// Of those, the ones opened next (by anyone) only after the zombie released them (must
    /// be all).
    held_back: usize,
    /// Its release -> the new owner's first commit, ms (per partition).
    release_to_commit_ms: Vec<f64>,
    withheld: u64,
}

fn analyse(events: &[Event]) -> Handoffs {
    let mut result = Handoffs::default();
    let mut latest_opener: HashMap<usize, u32> = HashMap::new();
    for event in events {
        let Some(partition) = event.partition else {
            continue;
        };
        match event.kind.as_str() {
            "open" => {
                if let Some(previous) = latest_opener.insert(partition, event.pid)
                    && previous != event.pid
                {
                    result.handoffs += 1;
                }
            }
            // A commit is checked when it begins: one begun by the latest opener stays safe,
            // as no other process can open the store before it is written.
            "submit" if latest_opener.get(&partition) != Some(&event.pid) => {
                result.foreign_commits += 1;
                eprintln!(
                    "COMMIT BY A NON-OWNER: pid {} on partition {partition}",
                    event.pid
                );
            }
            _ => {}
        }
    }
    let first_after = |kind: &str, partition: usize, not_pid: u32, after: u64| {
        events
            .iter()
            .find(|e| {
                e.kind == kind
                    && e.partition == Some(partition)
                    && e.pid != not_pid
                    && e.at_ns > after
            })
            .map(|e| e.at_ns)
    };
    let ms = |from: u64, to: u64| (to.saturating_sub(from)) as f64 / 1e6;
    let pause = events
        .iter()
        .find(|e| e.kind == "stop")
        .zip(events.iter().find(|e| e.kind == "cont"))
        .map(|(stop, cont)| (stop.at_ns, cont.at_ns));
    for kill in events
        .iter()
        .filter(|e| e.kind == "kill" || e.kind == "self-kill")
    {
        let pid = if kill.kind == "kill" {
            kill.subject.parse().unwrap_or(0)
        } else {
            kill.pid
        };
        let owned = owned_at(events, pid, kill.at_ns);
        let mut handed = false;
        for partition in owned {
            let Some(committed) = first_after("fresh", partition, pid, kill.at_ns) else {
                continue;
            };
            handed = true;
            // While the zombie is paused the broker may hand a partition to it (first in
            // line), which answers only after the heartbeat timeout: such handoffs are
            // counted apart.
            if pause.is_some_and(|(stop, cont)| kill.at_ns < cont && committed > stop) {
                result.overlapping_pause += 1;
                continue;
            }
            result.to_first_commit_ms.push(ms(kill.at_ns, committed));
            if let Some(at) = first_after("active", partition, pid, kill.at_ns) {
                result.to_active_ms.push(ms(kill.at_ns, at));
            }
        }
        if !handed {
            result.kills_without_handoff += 1;
        }
    }
    let stop = events.iter().find(|e| e.kind == "stop");
    let cont = events.iter().find(|e| e.kind == "cont");
    if let (Some(stop), Some(cont)) = (stop, cont) {
        let pid: u32 = stop.subject.parse().unwrap_or(0);
        let partitions = owned_at(events, pid, stop.at_ns);
        let noticed = events
            .iter()
            .find(|e| e.kind == "lost" && e.pid == pid && e.at_ns > cont.at_ns)
            .map(|e| e.at_ns);
        // A SIGKILL at a commit point still in the session the pause ended (before the zombie
        // opened a store again): the death releases whatever it had not released yet.
        let reopened_any = events
            .iter()
            .find(|e| e.kind == "open" && e.pid == pid && e.at_ns > cont.at_ns)
            .map_or(u64::MAX, |e| e.at_ns);
        let died = events
            .iter()
            .find(|e| e.kind == "self-kill" && e.pid == pid && e.at_ns > cont.at_ns)
            .map(|e| e.at_ns)
            .filter(|died| *died < reopened_any);
        let detection = partitions
            .iter()
            .filter_map(|p| first_after("active", *p, pid, stop.at_ns))
            .min();
        let mut zombie = Zombie {
            partitions: partitions.clone(),
            broker_detection_ms: detection.map(|at| ms(stop.at_ns, at)),
            noticed_after_cont_ms: noticed.map(|at| ms(cont.at_ns, at)),
            died_after_cont_ms: died.map(|at| ms(cont.at_ns, at)),
            commits_before_noticing: 0,
            commits_after_noticing: 0,
            released: 0,
            contested: 0,
            held_back: 0,
            release_to_commit_ms: Vec::new(),
            withheld: 0,
        };
        let noticed = noticed.or(died).unwrap_or(u64::MAX);
        for partition in &partitions {
            let reopened = events
                .iter()
                .find(|e| {
                    e.kind == "open"
                        && e.pid == pid
                        && e.partition == Some(*partition)
                        && e.at_ns > cont.at_ns
                })
                .map_or(u64::MAX, |e| e.at_ns);
            for event in events
                .iter()
                .filter(|e| e.pid == pid && e.partition == Some(*partition) && e.at_ns > cont.at_ns)
            {
                match event.kind.as_str() {
                    // A commit counts from when it began: one the zombie started before it
                    // noticed may be acknowledged just after.
                    "fresh" if event.began_ns < noticed => zombie.commits_before_noticing += 1,
                    "fresh" if event.began_ns < reopened => zombie.commits_after_noticing += 1,
                    "withheld" => zombie.withheld += 1,
                    _ => {}
                }
            }
            let released = events
                .iter()
                .find(|e| {
                    e.kind == "release"
                        && e.pid == pid
                        && e.partition == Some(*partition)
                        && e.at_ns > cont.at_ns
                })
                .map(|e| e.at_ns)
                .or(died);
            if let Some(released) = released {
                zombie.released += 1;
                if let Some(at) = first_after("fresh", *partition, pid, released) {
                    zombie.release_to_commit_ms.push(ms(released, at));
                }
            }
            // The lock at work: a partition delivered to its next owner while the zombie still
            // held its store (contested) was refused, and opened only after the zombie let go.
            // (One with no delivery until then was never contested.)
            let contested = first_after("active", *partition, pid, stop.at_ns)
                .zip(released)
                .is_some_and(|(active, released)| active < released);
            if !contested {
                continue;
            }
            zombie.contested += 1;
            // The next open by anyone: the zombie itself may win the partition back, once it
            // has released it and reconnected.
            let next_open = events.iter().find(|e| {
                e.kind == "open" && e.partition == Some(*partition) && e.at_ns > stop.at_ns
            });
            // (The wait shows as refusals, or inside one open: an open waits up to 0.5 s for
            // the lock before it refuses.)
            if let (Some(open), Some(released)) = (next_open, released)
                && open.at_ns > released
            {
                zombie.held_back += 1;
            }
        }
        result.zombie = Some(zombie);
    }
    result
}

/// What the backups held, checked against the stores' rules and the ledgers.
#[derive(Default)]
struct Backups {
    taken: u64,
    /// Checkpoints that returned an error (must be 0).
    failed: u64,
    checked: u64,
    restored_with_cli: bool,
    /// A record without its order row or effect, or the reverse (must be 0).
    torn: u64,
    /// A commit acknowledged before the backup began, missing from it (must be 0).
    missing_acknowledged: u64,
    total_mismatches: u64,
    checkpoint_ms: Vec<f64>,
}

/// Restores every backup into a scratch store and checks it.
fn check_backups(
    work: &Path,
    events: &[Event],
    plan: &Plan,
    cli: Option<&Path>,
) -> Result<Backups, BoxError> {
    let mut result = Backups {
        restored_with_cli: cli.is_some(),
        ..Backups::default()
    };
    let scratch = work.join("restored");
    std::fs::create_dir_all(&scratch)?;
    result.failed = events
        .iter()
        .filter(|e| e.kind == "checkpoint-failed")
        .count() as u64;
    for done in events.iter().filter(|e| e.kind == "checkpoint-done") {
        result.taken += 1;
        let Some(partition) = done.partition else {
            continue;
        };
        let Some(start) = events
            .iter()
            .find(|e| e.kind == "checkpoint-start" && e.subject == done.subject)
        else {
            return Err(format!("backup {} has no start", done.subject).into());
        };
        result
            .checkpoint_ms
            .push((done.at_ns - start.at_ns) as f64 / 1e6);
        let backup = work.join("backups").join(&done.subject);
        let restored = scratch.join(&done.subject);
        match cli {
            Some(cli) => {
                let status = Command::new(cli)
                    .arg("restore")
                    .arg(&backup)
                    .arg(&restored)
                    .stdout(Stdio::null())
                    .status()?;
                if !status.success() {
                    return Err(format!("idemdb restore {} failed: {status}", done.subject).into());
                }
            }
            None => copy_dir(&backup, &restored)?,
        }
        let engine = open_store(&restored)?;
        let consumer = engine.consumer("orders")?;
        let orders = engine.business_table("orders")?;
        let effects = engine.business_table("effects")?;
        // Commits on this partition acknowledged (by any owner) before the backup began.
        let acknowledged: std::collections::HashSet<&str> = events
            .iter()
            .take_while(|e| e.at_ns < start.at_ns)
            .filter(|e| e.kind == "fresh" && e.partition == Some(partition))
            .map(|e| e.subject.as_str())
            .collect();
        let mut sum = 0;
        for order_id in plan.contents.keys() {
            let committed = matches!(
                consumer.get(order_id)?.map(|record| record.state),
                Some(RecordState::Completed { .. })
            );
            let row = orders.get(order_id)?;
            let applied = effects
                .get(order_id)?
                .and_then(|value| merge_ops::read_u64(&value))
                .unwrap_or(0);
            let whole = if committed {
                row.is_some() && applied == 1
            } else {
                row.is_none() && applied == 0
            };
            if !whole {
                result.torn += 1;
                eprintln!(
                    "TORN in backup {}: {order_id}: record {committed}, row {}, effects {applied}",
                    done.subject,
                    row.is_some()
                );
            }
            if let Some(row) = row {
                sum += parse_amount(&row).unwrap_or(0);
            }
            if acknowledged.contains(order_id.as_str()) && !committed {
                result.missing_acknowledged += 1;
                eprintln!(
                    "ACKNOWLEDGED BEFORE BACKUP {} BUT MISSING: {order_id}",
                    done.subject
                );
            }
        }
        let total = effects
            .get(TOTAL_AMOUNT_KEY)?
            .and_then(|value| merge_ops::read_u64(&value))
            .unwrap_or(0);
        if total != sum {
            result.total_mismatches += 1;
            eprintln!(
                "TOTAL MISMATCH in backup {}: {total} vs {sum}",
                done.subject
            );
        }
        result.checked += 1;
        // Every handle closes before the scratch store is removed.
        drop((consumer, orders, effects, engine));
        std::fs::remove_dir_all(&restored)?;
    }
    Ok(result)
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    match run().await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("rabbitmq_handoff: {error}");
            std::process::exit(2);
        }
    }
}

#[allow(clippy::too_many_lines)]
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
    std::fs::create_dir_all(options.work.join("backups"))?;

    let connection = connect(&options.amqp).await?;
    let channel = connection.create_channel().await?;
    topology(&channel, options.partitions).await?;
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    let here = std::env::current_exe()?;
    let binary = here.with_file_name("rabbitmq_partitions");
    if !binary.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release --features tokio --examples`",
            binary.display()
        )
        .into());
    }
    // The operator CLI, when built beside this checker (`--features cli`): backups are
    // restored with it, as an operator would.
    let cli = here
        .parent()
        .map(|release| release.join("idemdb"))
        .filter(|cli| {
            Command::new(cli)
                .args(["restore", "--help"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        });
    let consumers = options.consumers;
    let mut fleet = Fleet {
        binary,
        ledger: Ledger::open(&options.work.join("ledger-checker.log"))?,
        children: Children::new(consumers),
        stopped: None,
        starts: 0,
        options,
    };
    for consumer in 0..consumers {
        fleet.start(consumer)?;
    }
    let options = &fleet.options;
    println!(
        "rabbitmq_handoff: {} orders, {} messages at {}/s, {} partitions, {} consumers{}, work dir {}",
        options.orders,
        plan.messages.len(),
        options.rate,
        options.partitions,
        consumers,
        if options.negative_control {
            " (NEGATIVE CONTROL: each consumer its own stores)"
        } else {
            ""
        },
        options.work.display()
    );
    // Let the fleet subscribe, so that the first partitions are spread over it.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let producer = {
        let messages = plan.messages.clone();
        let interval = Duration::from_micros(1_000_000 / options.rate);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            let mut confirmed = 0u64;
            for message in messages {
                ticker.tick().await;
                let properties = BasicProperties::default()
                    .with_message_id(ShortString::from(message.order_id.as_str()))
                    .with_delivery_mode(2);
                // The consistent-hash exchange hashes the routing key: the order id.
                let confirm = publisher
                    .basic_publish(
                        PARTITION_EXCHANGE.into(),
                        message.order_id.as_str().into(),
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

    // The chaos: random SIGKILLs (restarted at once), and after the third one a zombie.
    let min_kills = fleet.options.min_kills as u64;
    let zombie_stop = Duration::from_secs(fleet.options.zombie_stop_s);
    let mut kills = 0u64;
    let mut zombie: Option<(usize, Instant)> = None;
    // The paused consumer's pid, when it was stopped, and the partitions it owned then.
    let mut zombie_owned: Option<(u32, u64, Vec<usize>)> = None;
    let mut resumed: Option<Instant> = None;
    let mut published_at: Option<Instant> = None;
    loop {
        let pause = 100 + rng.below(700);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        // The pause lasts at least --zombie-stop-s, and then until the broker has handed one
        // of the zombie's partitions to another consumer (the case the run exists for: a
        // broker under load noticed a paused consumer 12.9 s into a pause with a 2 s
        // heartbeat), bounded by ZOMBIE_HOLD_MAX.
        if let Some((consumer, since)) = zombie
            && since.elapsed() >= zombie_stop
        {
            let handed_on = match &zombie_owned {
                Some((pid, stop_ns, partitions)) => handed_on(
                    &read_events(&fleet.options.work)?,
                    *pid,
                    *stop_ns,
                    partitions,
                ),
                None => false,
            };
            let held_max = since.elapsed() >= ZOMBIE_HOLD_MAX.max(zombie_stop);
            // The negative control checks no zombie: its pause is the minimum.
            if handed_on || held_max || fleet.options.negative_control {
                fleet.signal(consumer, libc::SIGCONT)?;
                zombie = None;
                resumed = Some(Instant::now());
                println!(
                    "rabbitmq_handoff: zombie paused {:.1} s; {}",
                    since.elapsed().as_secs_f64(),
                    if handed_on {
                        "resumed once the broker had handed a partition of it on"
                    } else if fleet.options.negative_control {
                        "resumed (the negative control checks no zombie)"
                    } else {
                        "the broker handed none of its partitions on within the bound"
                    }
                );
            }
        }
        // The resumed zombie is spared for a while: the run checks what it does on waking.
        if resumed.is_some_and(|at| at.elapsed() >= ZOMBIE_SPARED) {
            fleet.stopped = None;
        }
        // The run has its zombie before it ends: it is looked for while orders flow (a run
        // that finds no owner to pause within a few seconds of the last publish fails).
        let finished = producer.is_finished();
        if finished && published_at.is_none() {
            published_at = Some(Instant::now());
        }
        let zombie_over =
            resumed.is_some() || published_at.is_some_and(|at| at.elapsed() > ZOMBIE_SPARED);
        if finished && kills >= min_kills && zombie_over && fleet.stopped.is_none() {
            break;
        }
        if kills >= 3 && resumed.is_none() && zombie.is_none() {
            // A consumer that owns partitions now, paused past the broker's heartbeat timeout.
            fleet.restart_exited()?;
            let events = read_events(&fleet.options.work)?;
            let now = monotonic_ns();
            let owner = (0..consumers).find(|c| {
                fleet
                    .children
                    .pid(*c)
                    .is_some_and(|pid| !owned_at(&events, pid, now).is_empty())
            });
            if let Some(consumer) = owner {
                let pid = fleet.children.pid(consumer).unwrap_or(0);
                let stop_ns = monotonic_ns();
                fleet.signal(consumer, libc::SIGSTOP)?;
                fleet.stopped = Some(consumer);
                zombie = Some((consumer, Instant::now()));
                zombie_owned = Some((pid, stop_ns, owned_at(&events, pid, now)));
                continue;
            }
        }
        let victim = usize::try_from(rng.below(consumers as u64))?;
        if Some(victim) == fleet.stopped {
            continue;
        }
        if fleet.kill(victim)? {
            kills += 1;
            fleet.start(victim)?;
        }
        fleet.restart_exited()?;
    }
    let published = producer.await??;
    println!("rabbitmq_handoff: all published; {kills} kills done; draining");

    let mut metrics_sample = None;
    for round in 0.. {
        let work = fleet.options.work.clone();
        wait_quiet(
            &channel,
            &partition_queues(fleet.options.partitions),
            || fleet.restart_exited(),
            || deliveries_handled(&work),
        )
        .await?;
        if metrics_sample.is_none() {
            let addrs = (0..consumers).map(|c| {
                std::net::SocketAddr::from((
                    [127, 0, 0, 1],
                    fleet.options.metrics_port_base + u16::try_from(c).unwrap_or(0),
                ))
            });
            metrics_sample = addrs
                .filter_map(|addr| prometheus::scrape(addr).ok())
                .find(|sample| sample.contains("partition=\""));
        }
        fleet.children.stop_gracefully()?;
        if ready_messages(&channel, &partition_queues(fleet.options.partitions)).await? == 0 {
            break;
        }
        if round == 10 {
            return Err("messages keep coming back after ten drain rounds".into());
        }
        for consumer in 0..consumers {
            fleet.start(consumer)?;
        }
    }
    let dead_letters = drain_dead_letters(&channel).await?;
    connection.close(200, "done".into()).await?;

    let options = &fleet.options;
    let mut stores = Vec::new();
    let store_roots: Vec<PathBuf> = if options.negative_control {
        (0..consumers)
            .map(|c| options.work.join(format!("stores/consumer-{c}")))
            .collect()
    } else {
        vec![options.work.join("stores")]
    };
    for root in &store_roots {
        for partition in 0..options.partitions {
            let dir = root.join(format!("partition-{partition}"));
            if dir.exists() {
                stores.push((dir.display().to_string(), open_store(&dir)?));
            }
        }
    }
    let verdict = verify(&stores, &plan, &dead_letters)?;
    drop(stores);
    let events = read_events(&options.work)?;
    let count = |kind: &str| events.iter().filter(|e| e.kind == kind).count() as u64;
    let handoffs = analyse(&events);
    let backups = check_backups(&options.work, &events, &plan, cli.as_deref())?;

    println!(
        "rabbitmq_handoff: accounting ({:.0} s from first publish to last check)",
        started.elapsed().as_secs_f64()
    );
    let mut rows: Vec<(String, String)> = Vec::new();
    let mut row = |label: &str, value: String| rows.push((label.to_owned(), value));
    row("published (confirmed by the broker)", published.to_string());
    row("distinct orders", plan.contents.len().to_string());
    row("effects applied", verdict.effects_applied.to_string());
    row("duplicates suppressed", count("duplicate").to_string());
    row(
        "conflicts dead-lettered",
        verdict.conflicts_dead_lettered.to_string(),
    );
    row(
        "deliveries marked redelivered",
        count("redelivered").to_string(),
    );
    row("transient failures nacked", count("transient").to_string());
    row("in-progress nacked", count("in_progress").to_string());
    row("consumers SIGKILLed at random moments", kills.to_string());
    row(
        "consumers SIGKILLed between commit and ack",
        fleet.children.self_kills.to_string(),
    );
    row("consumer starts", fleet.starts.to_string());
    row(
        "consumer exits not caused by us",
        fleet.children.unexpected_exits.to_string(),
    );
    row(
        "partition handoffs (store opened by a new owner)",
        handoffs.handoffs.to_string(),
    );
    let mut to_commit = handoffs.to_first_commit_ms.clone();
    to_commit.sort_by(f64::total_cmp);
    let mut to_active = handoffs.to_active_ms.clone();
    to_active.sort_by(f64::total_cmp);
    row(
        "handoff after SIGKILL: kill -> new owner's delivery",
        format!(
            "p50 {:.0} ms, p99 {:.0} ms (n={})",
            percentile(&to_active, 50.0),
            percentile(&to_active, 99.0),
            to_active.len()
        ),
    );
    row(
        "handoff after SIGKILL: kill -> new owner's commit",
        format!(
            "p50 {:.0} ms, p99 {:.0} ms (n={})",
            percentile(&to_commit, 50.0),
            percentile(&to_commit, 99.0),
            to_commit.len()
        ),
    );
    row(
        "kills followed by no handoff (owned nothing, or idle)",
        handoffs.kills_without_handoff.to_string(),
    );
    row(
        "handoffs overlapping the zombie's pause (not timed)",
        handoffs.overlapping_pause.to_string(),
    );
    row(
        "commits begun by a process not the latest opener",
        handoffs.foreign_commits.to_string(),
    );
    let mut zombie_failures = 0;
    match &handoffs.zombie {
        Some(zombie) => {
            let fmt =
                |value: Option<f64>| value.map_or("never".to_owned(), |v| format!("{v:.0} ms"));
            row(
                "zombie: partitions it owned when stopped",
                format!("{:?}", zombie.partitions),
            );
            row(
                "zombie: SIGSTOP -> broker hands a partition on",
                fmt(zombie.broker_detection_ms),
            );
            row(
                "zombie: SIGCONT -> it notices the lost channel",
                fmt(zombie.noticed_after_cont_ms),
            );
            if zombie.died_after_cont_ms.is_some() {
                row(
                    "zombie: SIGCONT -> it SIGKILLed itself at a commit point",
                    fmt(zombie.died_after_cont_ms),
                );
            }
            row(
                "zombie: commits before it noticed (lock held)",
                zombie.commits_before_noticing.to_string(),
            );
            row(
                "zombie: claims withheld (not committed)",
                zombie.withheld.to_string(),
            );
            row(
                "zombie: commits after it noticed",
                zombie.commits_after_noticing.to_string(),
            );
            row(
                "zombie: stores released",
                format!("{} of {}", zombie.released, zombie.partitions.len()),
            );
            let mut after = zombie.release_to_commit_ms.clone();
            after.sort_by(f64::total_cmp);
            row(
                "zombie: release -> new owner's commit",
                format!("max {:.0} ms", after.last().copied().unwrap_or(f64::NAN)),
            );
            row(
                "zombie: contested partitions whose next owner waited",
                format!("{} of {}", zombie.held_back, zombie.contested),
            );
            if zombie.commits_after_noticing > 0
                || zombie.partitions.is_empty()
                || zombie.released < zombie.partitions.len()
                || zombie.contested == 0
                || zombie.held_back < zombie.contested
                || zombie.broker_detection_ms.is_none()
                || (zombie.noticed_after_cont_ms.is_none() && zombie.died_after_cont_ms.is_none())
            {
                zombie_failures += 1;
            }
        }
        None if options.negative_control => row("zombie", "none (negative control)".into()),
        None => {
            row("zombie", "NONE: no consumer owned a partition".into());
            zombie_failures += 1;
        }
    }
    let mut checkpoint_ms = backups.checkpoint_ms.clone();
    checkpoint_ms.sort_by(f64::total_cmp);
    row(
        "online backups taken / restored and checked",
        format!(
            "{} / {} (restored with {})",
            backups.taken,
            backups.checked,
            if backups.restored_with_cli {
                "idemdb restore"
            } else {
                "a file copy"
            }
        ),
    );
    row(
        "backup time (checkpoint under load)",
        format!(
            "p50 {:.1} ms, max {:.1} ms",
            percentile(&checkpoint_ms, 50.0),
            checkpoint_ms.last().copied().unwrap_or(f64::NAN)
        ),
    );
    row("backups that failed", backups.failed.to_string());
    row(
        "backups: claims and writes torn apart",
        backups.torn.to_string(),
    );
    row(
        "backups: acknowledged before, missing",
        backups.missing_acknowledged.to_string(),
    );
    row(
        "backups: totals that disagree",
        backups.total_mismatches.to_string(),
    );
    row("lost", verdict.lost.to_string());
    row("applied twice", verdict.applied_twice.to_string());
    row(
        "applied with content never published",
        verdict.wrong_content.to_string(),
    );
    row(
        "conflicting content not dead-lettered",
        verdict.missing_conflicts.to_string(),
    );
    row(
        "dead-lettered without a conflict",
        verdict.false_conflicts.to_string(),
    );
    row(
        "stores whose total amount disagrees",
        verdict.total_mismatches.to_string(),
    );
    for (label, value) in &rows {
        println!("  {label:<52} {value:>24}");
    }
    if let Some(sample) = &metrics_sample {
        std::fs::write(options.work.join("metrics-sample.txt"), sample)?;
        let shown: Vec<&str> = sample
            .lines()
            .filter(|line| line.starts_with("idemdb_commits_total"))
            .take(6)
            .collect();
        println!(
            "rabbitmq_handoff: metrics of one consumer, per partition (full scrape in the work dir):"
        );
        for line in shown {
            println!("  {line}");
        }
    }

    if options.negative_control {
        let caught = verdict.applied_twice > 0;
        println!(
            "rabbitmq_handoff: negative control {}",
            if caught {
                "PASSED: with stores that stay behind, the check finds orders applied twice"
            } else {
                "FAILED: stores that stay behind went unnoticed"
            }
        );
        return Ok(caught);
    }
    let passed = verdict.passed()
        && fleet.children.unexpected_exits == 0
        && handoffs.foreign_commits == 0
        && handoffs.handoffs > 0
        && zombie_failures == 0
        && backups.failed == 0
        && to_commit.len() >= MIN_TIMED_HANDOFFS
        && backups.torn == 0
        && backups.missing_acknowledged == 0
        && backups.total_mismatches == 0
        && (fleet.options.checkpoint_every_ms == 0 || backups.checked > 0);
    println!(
        "rabbitmq_handoff: {}",
        if passed {
            "PASSED: lost = 0, applied twice = 0, every backup whole"
        } else {
            "FAILED"
        }
    );
    Ok(passed)
}
