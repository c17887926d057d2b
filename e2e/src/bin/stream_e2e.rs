//! End-to-end check of `stream_orders` against a real RabbitMQ server's streams, with SIGKILLs.
//!
//! Publishes orders (with producer-side resends and order ids reused with other content) to
//! `--streams` streams, each order to one stream by its id; runs one consumer process per stream
//! (store `<work>/store-<stream>`), SIGKILLs consumers at random moments and restarts them, and
//! lets them SIGKILL themselves at the weak point of their position's placement
//! (`--kill-at-commit-per-mille`); with `--kill-after-last-commit`, each stream's consumer also
//! SIGKILLs itself there once in the group that holds the stream's last offset, so that the
//! restarted consumer finds nothing left to read. Once every stream's last offset is committed
//! the consumers are stopped, the streams are read again from the start as the reference, and
//! the stores are checked:
//!
//! - lost (an order never applied) = 0, applied twice = 0, conflicts in `conflicts` only;
//! - every offset of every stream settled by a commit (`reads`): none skipped; with the position
//!   in the store, each store's position at the stream's last offset;
//! - **read again after a restart beyond the last commit's group** = 0: a read, by a process,
//!   of an offset that an earlier process had already committed. A restarted consumer may read
//!   again only what it had read and not committed when it died.
//!
//! It prints the accounting, and the time from each SIGKILL to the restarted consumer reading
//! again (subscribed at its position). With `--position store` (the default) it exits 0 when
//! every check holds. With `--position broker-before-commit` or `broker-after-commit` it runs a
//! negative control, the consumers keeping their position at the broker instead: it exits 0
//! when the check it exists for caught the flaw (lost > 0 before the commit; read again > 0,
//! still applied twice = 0, after it), so that a check that cannot fail is found out.
//!
//! `scripts/rabbitmq-streams.sh` starts a private server on 127.0.0.1 and runs this. Options:
//! `--port PORT` (the stream protocol's), `--orders N`, `--streams N`, `--resend-percent P`,
//! `--reused N`, `--rate MSGS_PER_S`, `--min-kills N`, `--kill-at-commit-per-mille N`,
//! `--kill-after-last-commit`, `--position PLACEMENT`, `--work DIR`, `--seed N`.
//!
//! A stream counts as committed to its end from the ledger: a consumer's `commit` event, or,
//! where the position is written with or after the commit (the store; the broker after the
//! commit), a restarted consumer's `ready N`, read from that position: offsets below N were
//! committed. The second is what tells a kill between a commit and its `commit` event, after
//! which nothing may be left to read. Neither is taken as proof of the accounting: that reads
//! the stores (`reads`, the positions) once the consumers have stopped.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use idemdb::{Engine, Fingerprint};
use rabbitmq_stream_client::Environment;
use rabbitmq_stream_client::types::{Message, OffsetSpecification};

#[path = "../checker.rs"]
mod checker;
#[path = "../../../examples/common/handler.rs"]
mod handler;
#[path = "../../../examples/common/orders.rs"]
mod orders;
#[path = "../../../examples/common/streams.rs"]
mod streams;
use checker::{BoxError, Children, DeadLetter, Rng, die_with_parent, plan, verify};
use handler::monotonic_ns;
use orders::shard_of;
use streams::{
    CONSUMER_ID, Placement, conflict_key, open_stream_store, order_id_of, read_key, stream_name,
};

struct Options {
    port: u16,
    orders: usize,
    streams: usize,
    resend_percent: u64,
    reused: usize,
    rate: u64,
    min_kills: usize,
    kill_at_commit_per_mille: u64,
    kill_after_last_commit: bool,
    placement: Placement,
    work: PathBuf,
    seed: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        port: 15552,
        orders: 2000,
        streams: 3,
        resend_percent: 20,
        reused: 20,
        rate: 400,
        min_kills: 10,
        kill_at_commit_per_mille: 20,
        kill_after_last_commit: false,
        placement: Placement::Store,
        work: std::env::temp_dir().join("idemdb-stream-e2e"),
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--port" => options.port = value()?.parse()?,
            "--orders" => options.orders = value()?.parse()?,
            "--streams" => options.streams = value()?.parse()?,
            "--resend-percent" => options.resend_percent = value()?.parse()?,
            "--reused" => options.reused = value()?.parse()?,
            "--rate" => options.rate = value()?.parse()?,
            "--min-kills" => options.min_kills = value()?.parse()?,
            "--kill-at-commit-per-mille" => options.kill_at_commit_per_mille = value()?.parse()?,
            "--kill-after-last-commit" => options.kill_after_last_commit = true,
            "--position" => {
                let text = value()?;
                options.placement =
                    Placement::parse(&text).ok_or_else(|| format!("unknown placement {text}"))?;
            }
            "--work" => options.work = value()?.into(),
            "--seed" => options.seed = value()?.parse()?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.orders == 0 || options.streams == 0 || options.rate == 0 {
        return Err("--orders, --streams and --rate must be at least 1".into());
    }
    if options.reused > options.orders || options.resend_percent > 100 {
        return Err("--reused is at most --orders; --resend-percent is 0..=100".into());
    }
    if options.kill_at_commit_per_mille > 1000 {
        return Err("--kill-at-commit-per-mille is 0..=1000".into());
    }
    Ok(options)
}

/// The consumer processes, one per stream.
struct Fleet {
    binary: PathBuf,
    options: Options,
    children: Children,
    starts: usize,
    /// Per stream, the offset of its planned kill (`--kill-after-last-commit`): its last
    /// offset, as the stream is created empty and each publish takes one offset.
    planned_kills: Vec<Option<u64>>,
}

impl Fleet {
    fn ledger(&self, stream: usize) -> PathBuf {
        self.options.work.join(format!("ledger-{stream}.log"))
    }

    fn start(&mut self, stream: usize) -> Result<(), BoxError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.options.work.join(format!("consumer-{stream}.log")))?;
        let seed = self.options.seed ^ ((self.starts as u64 + 1) << 20);
        let mut command = Command::new(&self.binary);
        command
            .arg("--port")
            .arg(self.options.port.to_string())
            .arg("--stream")
            .arg(stream_name(stream))
            .arg("--dir")
            .arg(self.options.work.join(format!("store-{stream}")))
            .arg("--ledger")
            .arg(self.ledger(stream))
            .arg("--position")
            .arg(self.options.placement.label())
            .arg("--kill-at-commit-per-mille")
            .arg(self.options.kill_at_commit_per_mille.to_string())
            .arg("--seed")
            .arg(seed.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // Once: until the stream's ledger shows the kill done (a consumer killed after the
        // stream's last commit reads nothing again; one keeping its position at the broker
        // after the commit would read that group again, and die there again).
        if let Some(offset) = self.planned_kills[stream] {
            let events = read_ledger(&self.ledger(stream))?;
            if !events.iter().any(|event| event.kind == "planned-kill") {
                command.arg("--kill-at-commit-of").arg(offset.to_string());
            }
        }
        die_with_parent(&mut command);
        self.children.set(stream, command.spawn()?);
        self.starts += 1;
        Ok(())
    }

    fn restart_exited(&mut self) -> Result<(), BoxError> {
        for stream in self.children.exited()? {
            self.start(stream)?;
        }
        Ok(())
    }
}

/// One line of a consumer's ledger: `<kind> <subject> - <monotonic ns> <pid>`.
struct Event {
    kind: String,
    subject: String,
    at_ns: u64,
    pid: u32,
}

fn read_ledger(path: &Path) -> Result<Vec<Event>, BoxError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(Vec::new());
    };
    let mut events = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.len() < 5 {
            return Err(format!("{}: malformed line {line:?}", path.display()).into());
        }
        events.push(Event {
            kind: fields[0].to_owned(),
            subject: fields[1].to_owned(),
            at_ns: fields[3].parse()?,
            pid: fields[4].parse()?,
        });
    }
    Ok(events)
}

/// The highest offset among a stream's ledger events of `kind` ("commit": committed; "read":
/// read).
fn highest_offset(events: &[Event], kind: &str) -> Option<u64> {
    events
        .iter()
        .filter(|event| event.kind == kind)
        .filter_map(|event| event.subject.parse::<u64>().ok())
        .max()
}

/// The highest offset a stream's ledger shows committed: its highest `commit` event, or below
/// a `ready N` (a process starting at N) where the position it was read from is written with
/// the commit or after it, which a SIGKILL between a commit and its `commit` event leaves as
/// the only evidence. With the position at the broker before the commit, `ready N` proves
/// nothing: the offsets below N may be lost.
fn committed_through(events: &[Event], placement: Placement) -> Option<u64> {
    let committed = highest_offset(events, "commit");
    if placement == Placement::BrokerBeforeCommit {
        return committed;
    }
    let resumed = highest_offset(events, "ready").and_then(|start| start.checked_sub(1));
    committed.max(resumed)
}

/// How long a stream's ledger must stand still, its last offset read, before the
/// broker-before-commit control stops waiting for a commit of it that will never come.
const LEDGER_STILL: Duration = Duration::from_secs(5);

/// Every message of a stream from its start: (offset, body), `expected` of them.
async fn read_stream(
    environment: &Environment,
    stream: &str,
    expected: usize,
) -> Result<Vec<(u64, String)>, BoxError> {
    let mut consumer = environment
        .consumer()
        .offset(OffsetSpecification::First)
        .build(stream)
        .await?;
    let mut messages = Vec::with_capacity(expected);
    while messages.len() < expected {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .map_err(|_| format!("{stream}: {} of {expected} messages read", messages.len()))?
            .ok_or("the stream's connection closed")??;
        let body = delivery
            .message()
            .data()
            .map(|data| String::from_utf8_lossy(data).into_owned())
            .unwrap_or_default();
        messages.push((delivery.offset(), body));
    }
    let _ = consumer.handle().close().await;
    Ok(messages)
}

/// The run's accounting.
#[derive(Default)]
struct Accounting {
    published: u64,
    distinct_orders: u64,
    applied: u64,
    duplicates: u64,
    duplicates_expected: u64,
    outcome_mismatches: u64,
    conflicts: u64,
    kills: u64,
    self_kills: u64,
    planned_kills_missing: u64,
    starts: u64,
    unexpected_exits: u64,
    lost: u64,
    applied_twice: u64,
    wrong_content: u64,
    missing_conflicts: u64,
    false_conflicts: u64,
    total_mismatches: u64,
    unsettled_offsets: u64,
    positions_not_at_end: u64,
    read_again: u64,
    resume_ms: Vec<f64>,
}

impl Accounting {
    fn print(&self) {
        let rows = [
            ("published (confirmed by the broker)", self.published),
            ("distinct orders", self.distinct_orders),
            ("effects applied", self.applied),
            ("duplicates (true resends) settled", self.duplicates),
            (
                "duplicates the stream's order makes",
                self.duplicates_expected,
            ),
            (
                "offsets settled with another outcome",
                self.outcome_mismatches,
            ),
            ("conflicts recorded", self.conflicts),
            ("consumers SIGKILLed at random moments", self.kills),
            ("consumers SIGKILLed at the commit point", self.self_kills),
            (
                "planned kills after a stream's last commit not done",
                self.planned_kills_missing,
            ),
            ("consumer starts", self.starts),
            ("consumer exits not caused by us", self.unexpected_exits),
            ("lost", self.lost),
            ("applied twice", self.applied_twice),
            ("applied with content never published", self.wrong_content),
            ("conflicting content not recorded", self.missing_conflicts),
            ("recorded as a conflict without one", self.false_conflicts),
            (
                "streams whose total amount disagrees",
                self.total_mismatches,
            ),
            ("offsets never settled by a commit", self.unsettled_offsets),
            (
                "stores whose position is not their stream's last offset",
                self.positions_not_at_end,
            ),
            (
                "read again after a restart beyond the last commit's group",
                self.read_again,
            ),
        ];
        for (label, value) in rows {
            println!("  {label:<58} {value:>9}");
        }
        let mut resume = self.resume_ms.clone();
        resume.sort_by(f64::total_cmp);
        if !resume.is_empty() {
            println!(
                "  {:<58} {:>9}",
                "resume after a SIGKILL (restart to subscribed), median ms",
                format!("{:.0}", resume[resume.len() / 2])
            );
            println!(
                "  {:<58} {:>9}",
                "resume after a SIGKILL, max ms",
                format!("{:.0}", resume[resume.len() - 1])
            );
        }
    }

    /// Every check of the store placement.
    fn all_hold(&self) -> bool {
        self.unexpected_exits == 0
            && self.lost == 0
            && self.applied_twice == 0
            && self.wrong_content == 0
            && self.missing_conflicts == 0
            && self.false_conflicts == 0
            && self.total_mismatches == 0
            && self.unsettled_offsets == 0
            && self.positions_not_at_end == 0
            && self.planned_kills_missing == 0
            && self.read_again == 0
            && self.outcome_mismatches == 0
    }
}

#[tokio::main]
async fn main() {
    match run().await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("stream_e2e: {}", handler::chain(error.as_ref()));
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
    let environment = connect(options.port).await?;
    for stream in 0..options.streams {
        let name = stream_name(stream);
        let _ = environment.delete_stream(&name).await;
        environment.stream_creator().create(&name).await?;
    }
    let binary = std::env::current_exe()?.with_file_name("stream_orders");
    if !binary.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release --features tokio --examples`",
            binary.display()
        )
        .into());
    }
    let streams = options.streams;
    let placement = options.placement;
    let mut planned_kills = vec![None; streams];
    if options.kill_after_last_commit {
        for (stream, planned) in planned_kills.iter_mut().enumerate() {
            let count = plan
                .messages
                .iter()
                .filter(|message| shard_of(&message.order_id, streams) == stream)
                .count();
            *planned = (count as u64).checked_sub(1);
        }
    }
    let min_kills = options.min_kills;
    let rate = options.rate;
    let work = options.work.clone();
    println!(
        "stream_e2e: {} orders, {} messages at {}/s over {} streams, position {}, work dir {}",
        options.orders,
        plan.messages.len(),
        rate,
        streams,
        placement.label(),
        work.display()
    );
    let mut fleet = Fleet {
        binary,
        options,
        children: Children::new(streams),
        starts: 0,
        planned_kills,
    };
    for stream in 0..streams {
        fleet.start(stream)?;
    }

    // One producer per stream, together at the requested rate, each publish confirmed.
    let mut producers = Vec::new();
    for stream in 0..streams {
        let messages: Vec<String> = plan
            .messages
            .iter()
            .filter(|message| shard_of(&message.order_id, streams) == stream)
            .map(|message| message.body.clone())
            .collect();
        let producer = environment
            .producer()
            .batch_delay(Duration::from_millis(1))
            .build(&stream_name(stream))
            .await?;
        let interval = Duration::from_micros(1_000_000 * streams as u64 / rate);
        producers.push(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            let mut confirmed = 0usize;
            for body in messages {
                ticker.tick().await;
                let status = producer
                    .send_with_confirm(Message::builder().body(body).build())
                    .await?;
                if !status.confirmed() {
                    return Err::<usize, BoxError>("the broker refused a publish".into());
                }
                confirmed += 1;
            }
            let _ = producer.close().await;
            Ok(confirmed)
        }));
    }

    // Kills at random moments while the producers publish (and until enough were made).
    let mut kills: Vec<(usize, u64)> = Vec::new();
    loop {
        let pause = 100 + rng.below(700);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        fleet.restart_exited()?;
        if producers.iter().all(|p| p.is_finished()) && kills.len() >= min_kills {
            break;
        }
        let stream = usize::try_from(rng.below(streams as u64))?;
        let at_ns = monotonic_ns();
        if fleet.children.kill(stream)?.is_some() {
            kills.push((stream, at_ns));
            fleet.start(stream)?;
        }
    }
    let mut published = Vec::new();
    for producer in producers {
        published.push(producer.await??);
    }
    println!(
        "stream_e2e: all published; {} kills done; reading the streams and waiting for the \
         consumers",
        kills.len()
    );

    // The reference: every stream read from its start.
    let mut reference = Vec::new();
    for (stream, &count) in published.iter().enumerate() {
        reference.push(read_stream(&environment, &stream_name(stream), count).await?);
    }
    // Wait until each stream's consumers committed its last offset. With the position stored
    // at the broker before the commit, a consumer killed between the two never reads that
    // offset again: there a stream is done once its last offset was read and its ledger has
    // stood still for a while (what was read and not committed is what the control loses).
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut still_since: Vec<(usize, Instant)> = vec![(0, Instant::now()); reference.len()];
    loop {
        fleet.restart_exited()?;
        let mut behind = Vec::new();
        for (stream, messages) in reference.iter().enumerate() {
            let last = messages.last().map(|(offset, _)| *offset);
            let events = read_ledger(&fleet.ledger(stream))?;
            let committed = committed_through(&events, placement);
            if last.is_none() || committed >= last {
                continue;
            }
            let read = highest_offset(&events, "read");
            if placement == Placement::BrokerBeforeCommit {
                if events.len() != still_since[stream].0 {
                    still_since[stream] = (events.len(), Instant::now());
                }
                if read >= last && still_since[stream].1.elapsed() >= LEDGER_STILL {
                    continue;
                }
            }
            behind.push(format!(
                "stream {stream}: last offset {last:?}, committed up to {committed:?}, \
                 read up to {read:?}"
            ));
        }
        if behind.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} stream(s) not consumed to the end in 300 s ({})",
                behind.len(),
                behind.join("; ")
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    fleet.children.stop_gracefully()?;
    let _ = environment.delete_stream("unused").await;

    let mut accounting = Accounting {
        published: published.iter().map(|&count| count as u64).sum(),
        distinct_orders: plan.contents.len() as u64,
        kills: kills.len() as u64,
        self_kills: fleet.children.self_kills as u64,
        starts: fleet.starts as u64,
        unexpected_exits: fleet.children.unexpected_exits as u64,
        ..Accounting::default()
    };
    let mut stores = Vec::new();
    let mut dead_letters = Vec::new();
    for (stream, read_back) in reference.iter().enumerate() {
        let engine = open_stream_store(&work.join(format!("store-{stream}")))?;
        let events = read_ledger(&fleet.ledger(stream))?;
        check_reads(&engine, read_back, &events, &mut accounting)?;
        let last = read_back.last().map(|(offset, _)| *offset);
        if placement == Placement::Store {
            // What the wait above took from the ledger, read from the store itself.
            let stored = engine
                .consumer(CONSUMER_ID)?
                .positions()
                .get(&stream_name(stream), 0)?
                .map(|position| position.offset);
            if stored != last {
                accounting.positions_not_at_end += 1;
                eprintln!("POSITION: stream {stream}: stored {stored:?}, last offset {last:?}");
            }
        }
        // The planned kill done once, after the commit of the stream's last offset. (A random
        // SIGKILL landing between that commit and its `planned-kill` line, microseconds apart,
        // would leave it undone: the run then fails here rather than pass without the case.)
        if fleet.planned_kills[stream].is_some() {
            let done = events
                .iter()
                .filter(|event| event.kind == "planned-kill")
                .filter_map(|event| event.subject.parse::<u64>().ok())
                .collect::<Vec<_>>();
            if last.is_none() || done.len() != 1 || done.first().copied() != last {
                accounting.planned_kills_missing += 1;
                eprintln!(
                    "PLANNED KILL: stream {stream}: done after {done:?}, last offset {last:?}"
                );
            }
        }
        dead_letters.extend(recorded_conflicts(&engine, read_back)?);
        // Each kill of this stream's consumer -> the restarted one subscribed.
        for &(_, at_ns) in kills.iter().filter(|(killed, _)| *killed == stream) {
            if let Some(ready) = events
                .iter()
                .find(|event| event.kind == "ready" && event.at_ns > at_ns)
            {
                accounting
                    .resume_ms
                    .push((ready.at_ns - at_ns) as f64 / 1_000_000.0);
            }
        }
        stores.push((stream_name(stream), engine));
    }
    accounting.conflicts = dead_letters.len() as u64;
    let verdict = verify(&stores, &plan, &dead_letters)?;
    accounting.applied = verdict.effects_applied;
    accounting.lost = verdict.lost;
    accounting.applied_twice = verdict.applied_twice;
    accounting.wrong_content = verdict.wrong_content;
    accounting.missing_conflicts = verdict.missing_conflicts;
    accounting.false_conflicts = verdict.false_conflicts;
    accounting.total_mismatches = verdict.total_mismatches;

    println!(
        "stream_e2e: accounting, position {} ({:.0} s from first publish to last check)",
        placement.label(),
        started.elapsed().as_secs_f64()
    );
    accounting.print();
    let passed = match placement {
        Placement::Store => {
            let passed = accounting.all_hold();
            println!(
                "stream_e2e: {}",
                if passed {
                    "PASSED: lost = 0, applied twice = 0, read again = 0"
                } else {
                    "FAILED"
                }
            );
            passed
        }
        Placement::BrokerBeforeCommit => {
            let caught = accounting.lost > 0;
            println!(
                "stream_e2e: negative control (offset stored at the broker before the commit): \
                 {}",
                if caught {
                    "the check caught it: lost > 0"
                } else {
                    "NOT CAUGHT: lost = 0"
                }
            );
            caught
        }
        Placement::BrokerAfterCommit => {
            let caught = accounting.read_again > 0 && accounting.applied_twice == 0;
            println!(
                "stream_e2e: negative control (offset stored at the broker after the commit): \
                 {}",
                if caught {
                    "the check caught it: read again > 0 (the markers kept applied twice = 0)"
                } else {
                    "NOT CAUGHT"
                }
            );
            caught
        }
    };
    Ok(passed)
}

async fn connect(port: u16) -> Result<Environment, BoxError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Environment::builder()
            .host("127.0.0.1")
            .port(port)
            .build()
            .await
        {
            Ok(environment) => return Ok(environment),
            Err(error) if Instant::now() < deadline => {
                eprintln!("stream_e2e: waiting for the broker's stream port ({error})");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Checks one stream's offsets against the `reads` rows its consumers committed: each offset
/// settled (by at least one commit), and no process reading an offset an earlier process had
/// committed. Counts the duplicates settled.
fn check_reads(
    engine: &Engine,
    reference: &[(u64, String)],
    events: &[Event],
    accounting: &mut Accounting,
) -> Result<(), BoxError> {
    let reads = engine.business_table("reads")?;
    // Processes in the order they started.
    let mut started: Vec<u32> = Vec::new();
    for event in events.iter().filter(|event| event.kind == "ready") {
        if !started.contains(&event.pid) {
            started.push(event.pid);
        }
    }
    let rank: HashMap<u32, usize> = started
        .iter()
        .enumerate()
        .map(|(index, pid)| (*pid, index))
        .collect();
    // For each offset, the processes whose commit settled it, with the outcome; and the
    // outcome the stream's order makes: an order's first message is fresh, a later one with
    // its content a duplicate, with other content a conflict.
    let mut committers: BTreeMap<u64, Vec<(u32, String)>> = BTreeMap::new();
    let mut winners: HashMap<&str, &str> = HashMap::new();
    for (offset, body) in reference {
        let order_id = order_id_of(body).unwrap_or_default();
        let expected = match winners.get(order_id) {
            None => {
                winners.insert(order_id, body);
                "fresh"
            }
            Some(winner) if winner == body => "duplicate",
            Some(_) => "conflict",
        };
        if expected == "duplicate" {
            accounting.duplicates_expected += 1;
        }
        for pid in &started {
            if let Some(outcome) = reads.get(read_key(*offset, *pid))? {
                committers
                    .entry(*offset)
                    .or_default()
                    .push((*pid, String::from_utf8_lossy(&outcome).into_owned()));
            }
        }
        match committers.get(offset) {
            None => accounting.unsettled_offsets += 1,
            Some(by) => {
                // The first commit's outcome (a later one, of a message read again, finds the
                // first's record).
                let first = by
                    .iter()
                    .min_by_key(|(pid, _)| rank.get(pid).copied().unwrap_or(usize::MAX))
                    .map(|(_, outcome)| outcome.as_str());
                if first == Some("duplicate") {
                    accounting.duplicates += 1;
                }
                if first != Some(expected) {
                    accounting.outcome_mismatches += 1;
                    eprintln!(
                        "OUTCOME: offset {offset} ({body}): {first:?}, the stream's order makes \
                         {expected}"
                    );
                }
            }
        }
    }
    for event in events.iter().filter(|event| event.kind == "read") {
        let offset: u64 = event.subject.parse()?;
        let reader = rank.get(&event.pid).copied().unwrap_or(usize::MAX);
        let committed_before = committers.get(&offset).is_some_and(|by| {
            by.iter()
                .any(|(pid, _)| *pid != event.pid && rank.get(pid).copied().unwrap_or(0) < reader)
        });
        if committed_before {
            accounting.read_again += 1;
        }
    }
    Ok(())
}

/// The conflicts a stream's consumers recorded, as the dead letters the shared check expects.
fn recorded_conflicts(
    engine: &Engine,
    reference: &[(u64, String)],
) -> Result<Vec<DeadLetter>, BoxError> {
    let conflicts = engine.business_table("conflicts")?;
    let orders = engine.business_table("orders")?;
    let mut found = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (_, body) in reference {
        let Some(order_id) = order_id_of(body) else {
            continue;
        };
        let fingerprint = Fingerprint::of(body.as_bytes());
        let key = conflict_key(order_id, &fingerprint);
        if !seen.insert(key.clone()) || conflicts.get(&key)?.is_none() {
            continue;
        }
        let stored = orders
            .get(order_id)?
            .map(|winner| Fingerprint::of(&winner).to_string());
        found.push(DeadLetter {
            order_id: order_id.to_owned(),
            received: fingerprint.to_string(),
            stored,
        });
    }
    Ok(found)
}
