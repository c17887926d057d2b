//! End-to-end check of the Kafka recipe (`recipes/kafka`) against a real Kafka-protocol broker,
//! with SIGKILLs, in one of two shapes:
//!
//! - `--shape manual`: one consumer process per partition, each `assign`ing its partition at
//!   the offset after its store's position;
//! - `--shape group`: `--members N` processes in one consumer group; Kafka moves partitions
//!   between them as members are SIGKILLed and restarted, and each new owner opens the
//!   partition's store and resumes at its position (no offset commits to Kafka).
//!
//! Publishes orders (with producer-side resends and order ids reused with other content) to a
//! topic of `--partitions` partitions (which the script created), each order to one partition by
//! its id, every publish acknowledged by the broker; SIGKILLs consumers at random moments (every
//! `--kill-gap-ms` plus up to `--kill-spread-ms`) and restarts them, while they SIGKILL
//! themselves at their position's weak point (`--kill-at-commit-per-mille`). Once every
//! partition's last offset is committed, the consumers are stopped, each partition is read back
//! from its start as the reference, and the stores (`<work>/stores/partition-<p>`) checked as
//! the RabbitMQ streams run checks them (`reads.rs`): lost = 0, applied twice = 0, every offset
//! settled by a commit with the outcome the partition's order makes, each store's position at
//! its partition's last offset, and **read again after a restart beyond the last commit's
//! group** = 0. It prints the accounting and the time from each SIGKILL to the partition's
//! next owner assigned at its position.
//!
//! With `--position broker-before-commit` or `broker-after-commit` (manual shape) it runs a
//! negative control, the consumers keeping their position in the group's committed offsets
//! instead: it exits 0 when the check it exists for caught the flaw (lost > 0 before the commit;
//! read again > 0, still applied twice = 0, after it).
//!
//! `scripts/kafka-e2e.sh` starts the broker and runs this. Options: `--bootstrap HOST:PORT`,
//! `--protocol 0.9|modern`, `--topic NAME`, `--partitions N`, `--shape manual|group`,
//! `--members N`, `--kill-gap-ms MS`, `--kill-spread-ms MS`, `--kill-at-commit-per-mille N`,
//! `--kill-after-last-commit` (manual shape: each partition's consumer SIGKILLs itself once
//! right after the commit of the partition's last offset, so that its successor finds nothing
//! left to read),
//! `--position PLACEMENT`, `--orders N`, `--resend-percent P`, `--reused N`, `--rate MSGS_PER_S`,
//! `--min-kills N`, `--work DIR`, `--seed N`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use idemdb_e2e::args::{Args, Workload, check};
use idemdb_e2e::kafka::{self, Protocol};
use idemdb_e2e::ledger::{self, Event, monotonic_ns};
use idemdb_e2e::orders::shard_of;
use idemdb_e2e::reads::{self, Reads};
use idemdb_e2e::report::{Control, Report, median_max};
use idemdb_e2e::streams::{CONSUMER_ID, Placement, open_stream_store};
use idemdb_e2e::supervisor::Supervisor;
use idemdb_e2e::{BoxError, fresh_folder, verdict};

struct Options {
    bootstrap: String,
    protocol: Protocol,
    topic: String,
    partitions: usize,
    group: bool,
    members: usize,
    kill_gap_ms: u64,
    kill_spread_ms: u64,
    kill_at_commit_per_mille: u64,
    kill_after_last_commit: bool,
    placement: Placement,
    load: Workload,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut args = Args::from_env();
    let position: String = args.value("position", Placement::Store.label().to_owned())?;
    let protocol: String = args.value("protocol", "modern".to_owned())?;
    let shape: String = args.value("shape", "manual".to_owned())?;
    let options = Options {
        bootstrap: args.value("bootstrap", "127.0.0.1:19092".to_owned())?,
        protocol: Protocol::parse(&protocol)
            .ok_or_else(|| format!("unknown protocol {protocol}"))?,
        topic: args.value("topic", "idemdb-orders".to_owned())?,
        partitions: args.value("partitions", 3)?,
        group: match shape.as_str() {
            "manual" => false,
            "group" => true,
            other => return Err(format!("unknown shape {other}").into()),
        },
        members: args.value("members", 3)?,
        kill_gap_ms: args.value("kill-gap-ms", 100)?,
        kill_spread_ms: args.value("kill-spread-ms", 700)?,
        kill_at_commit_per_mille: args.value("kill-at-commit-per-mille", 20)?,
        kill_after_last_commit: args.flag("kill-after-last-commit"),
        placement: Placement::parse(&position)
            .ok_or_else(|| format!("unknown placement {position}"))?,
        load: Workload::parse(&mut args, "kafka-e2e", 400)?,
    };
    args.finish()?;
    check(options.partitions > 0, "--partitions must be at least 1")?;
    check(options.members > 0, "--members must be at least 1")?;
    check(
        !options.group || options.placement == Placement::Store,
        "the group shape keeps its position in the store only",
    )?;
    check(
        !options.kill_after_last_commit
            || (!options.group && options.placement == Placement::Store),
        "--kill-after-last-commit is for the manual shape with the position in the store",
    )?;
    check(
        options.kill_at_commit_per_mille <= 1000,
        "--kill-at-commit-per-mille is 0..=1000",
    )?;
    Ok(options)
}

/// The ledger of partition `partition` (every process that owns it appends to it).
fn ledger_of(work: &Path, partition: usize) -> PathBuf {
    work.join(format!("ledger-{partition}.log"))
}

/// The consumer processes: one per partition (manual) or `--members` of one group.
/// `planned_kills` holds, per partition (manual shape), the offset after whose commit the
/// consumer SIGKILLs itself once (`--kill-after-last-commit`).
fn consumers(options: &Options, planned_kills: Vec<Option<u64>>) -> Result<Supervisor, BoxError> {
    let work = options.load.work.clone();
    let bootstrap = options.bootstrap.clone();
    let protocol = options.protocol.label();
    let topic = options.topic.clone();
    let placement = options.placement.label();
    let kill = options.kill_at_commit_per_mille.to_string();
    let (group, seed) = (options.group, options.load.seed);
    let mut starts = 0u64;
    let command_line = move |slot: usize, command: &mut Command| {
        starts += 1;
        command
            .arg("--bootstrap")
            .arg(&bootstrap)
            .arg("--protocol")
            .arg(protocol)
            .arg("--topic")
            .arg(&topic)
            .arg("--dir")
            .arg(work.join("stores"))
            .arg("--ledgers")
            .arg(&work)
            .arg("--position")
            .arg(placement)
            .arg("--kill-at-commit-per-mille")
            .arg(&kill)
            .arg("--seed")
            .arg((seed ^ (starts << 20)).to_string());
        if group {
            command.arg("--group").arg(format!("{topic}.group"));
        } else {
            command.arg("--partitions").arg(slot.to_string());
        }
        // Once: until the partition's ledger shows the kill done.
        if let Some(offset) = planned_kills.get(slot).copied().flatten() {
            let events = ledger::read(&ledger_of(&work, slot))?;
            if !events.iter().any(|event| event.kind == "planned-kill") {
                command.arg("--kill-at-commit-of").arg(offset.to_string());
            }
        }
        Ok(())
    };
    let binary = std::env::current_exe()?.with_file_name("idemdb-kafka-recipe");
    if !binary.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release -p idemdb-kafka-recipe`",
            binary.display()
        )
        .into());
    }
    let slots = if group {
        options.members
    } else {
        options.partitions
    };
    let work = &options.load.work;
    Ok(Supervisor::new(binary, work, slots, Box::new(command_line)))
}

fn main() {
    idemdb_e2e::main("kafka_e2e", run());
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let load = &options.load;
    let (partitions, placement, work) = (options.partitions, options.placement, &load.work);
    let (bootstrap, protocol, topic) = (&options.bootstrap, options.protocol, &options.topic);
    let started = Instant::now();
    let (plan, mut rng) = load.plan();
    fresh_folder(work)?;
    std::fs::create_dir_all(work.join("stores"))?;
    kafka::wait_for_topic(bootstrap, protocol, topic, partitions)?;
    let messages: Vec<(i32, String, String)> = plan
        .messages
        .iter()
        .map(|message| {
            let partition = shard_of(&message.order_id, partitions);
            let partition = i32::try_from(partition).expect("a partition number fits in i32");
            (partition, message.order_id.clone(), message.body.clone())
        })
        .collect();
    // A fresh topic's partition holds its messages at offsets 0, 1, ...: its last offset is
    // its count less one, the planned kill's.
    let planned_kills: Vec<Option<u64>> = (0..partitions)
        .map(|partition| {
            let mine = messages.iter().filter(|(p, _, _)| *p as usize == partition);
            (mine.count() as u64)
                .checked_sub(1)
                .filter(|_| options.kill_after_last_commit)
        })
        .collect();
    let mut consumers = consumers(&options, planned_kills.clone())?;
    println!(
        "kafka_e2e: {} orders, {} messages at {}/s over {partitions} partitions of {topic} at \
         {bootstrap} (protocol {}), {} shape, position {}, work dir {}",
        load.orders,
        messages.len(),
        load.rate,
        protocol.label(),
        if options.group { "group" } else { "manual" },
        placement.label(),
        work.display()
    );
    consumers.start_all()?;

    let producer = {
        let (bootstrap, topic, rate) = (bootstrap.clone(), topic.clone(), load.rate);
        std::thread::spawn(move || kafka::publish(&bootstrap, protocol, &topic, &messages, rate))
    };

    // Kills at random moments while the producer publishes (and until enough were made), each
    // with its time and the killed process, from which the next owner's resume is measured.
    let mut kills: Vec<(u32, u64)> = Vec::new();
    loop {
        let gap = options.kill_gap_ms + rng.below(options.kill_spread_ms);
        tokio::time::sleep(Duration::from_millis(gap)).await;
        consumers.restart_exited()?;
        if producer.is_finished() && kills.len() as u64 >= load.min_kills {
            break;
        }
        let slot = usize::try_from(rng.below(consumers.slots() as u64))?;
        let at_ns = monotonic_ns();
        if let Some(pid) = consumers.kill_and_restart(slot)? {
            kills.push((pid, at_ns));
        }
    }
    let acknowledged = producer
        .join()
        .map_err(|_| "the producer thread panicked")??;
    let published: u64 = acknowledged.values().sum();
    println!(
        "kafka_e2e: all published; {} kills done; reading the partitions and waiting for the \
         consumers",
        kills.len()
    );

    // The reference: every partition read from its start.
    let mut reference = Vec::new();
    for partition in 0..partitions {
        let partition = i32::try_from(partition)?;
        let published = acknowledged.get(&partition).copied().unwrap_or(0);
        let read_back = kafka::read_partition(bootstrap, protocol, topic, partition, published)?;
        reference.push(read_back);
    }
    // Wait until each partition's consumers committed its last offset.
    let ledger = |partition: usize| ledger_of(work, partition);
    reads::wait_until_consumed(&mut consumers, &reference, ledger, placement, "partition").await?;
    consumers.stop_gracefully()?;

    // Each store checked against its partition read back and its ledger.
    let mut found = Reads::default();
    let (mut positions_not_at_end, mut planned_kills_missing) = (0u64, 0u64);
    let mut resume_ms = Vec::new();
    let mut stores = Vec::new();
    let mut dead_letters = Vec::new();
    let mut all_events: Vec<Vec<Event>> = Vec::new();
    for (partition, read_back) in reference.iter().enumerate() {
        let engine = open_stream_store(&work.join(format!("stores/partition-{partition}")))?;
        let events = ledger::read(&ledger_of(work, partition))?;
        reads::check_reads(&engine, read_back, &events, &mut found)?;
        let last = read_back.last().map(|(offset, _)| *offset);
        if placement == Placement::Store {
            let positions = engine.consumer(CONSUMER_ID)?.positions();
            let stored = positions.get(topic, u32::try_from(partition)?)?;
            let stored = stored.map(|position| position.offset);
            if stored != last {
                positions_not_at_end += 1;
                eprintln!("POSITION: partition {partition}: stored {stored:?}, last {last:?}");
            }
        }
        // The planned kill done once, after the commit of the partition's last offset.
        if planned_kills[partition].is_some() {
            let done: Vec<u64> = events
                .iter()
                .filter(|event| event.kind == "planned-kill")
                .filter_map(|event| event.subject.parse::<u64>().ok())
                .collect();
            if last.is_none() || done.len() != 1 || done.first().copied() != last {
                planned_kills_missing += 1;
                eprintln!("PLANNED KILL: partition {partition}: after {done:?}, last {last:?}");
            }
        }
        dead_letters.extend(reads::recorded_conflicts(&engine, read_back)?);
        stores.push((format!("{topic}/{partition}"), engine));
        all_events.push(events);
    }
    // Each kill -> every partition the killed process owned assigned again at its position,
    // and whether its next owner is a member that was running before the kill (the partition
    // moved) or the killed one's replacement.
    let mut moved_to_survivor = 0u64;
    let seen_before = |pid: u32, at_ns: u64| {
        all_events
            .iter()
            .flatten()
            .any(|event| event.pid == pid && event.kind == "ready" && event.at_ns < at_ns)
    };
    for &(pid, at_ns) in &kills {
        for events in &all_events {
            let owner = events
                .iter()
                .rfind(|event| event.kind == "ready" && event.at_ns < at_ns);
            if owner.is_none_or(|event| event.pid != pid) {
                continue;
            }
            let next = events
                .iter()
                .find(|event| event.kind == "ready" && event.at_ns > at_ns);
            if let Some(ready) = next {
                resume_ms.push((ready.at_ns - at_ns) as f64 / 1_000_000.0);
                if seen_before(ready.pid, at_ns) {
                    moved_to_survivor += 1;
                }
            }
        }
    }
    let verdict = verdict::verify(&stores, &plan, &dead_letters)?;

    println!(
        "kafka_e2e: accounting, {} shape, position {} ({:.0} s from first publish to last check)",
        if options.group { "group" } else { "manual" },
        placement.label(),
        started.elapsed().as_secs_f64()
    );
    let mut report = Report::new("kafka_e2e");
    report.figure("published (acknowledged by the broker)", published);
    let in_partitions = reference.iter().map(Vec::len).sum::<usize>() as u64;
    report.figure("messages in the partitions", in_partitions);
    report.zero(
        "acknowledged publishes missing from the partitions",
        published.saturating_sub(in_partitions),
    );
    report.figure("distinct orders", plan.contents.len());
    report.figure("effects applied", verdict.effects_applied);
    report.figure("duplicates (true resends) settled", found.duplicates);
    report.figure(
        "duplicates the partitions' order makes",
        found.duplicates_expected,
    );
    report.zero(
        "offsets settled with another outcome",
        found.outcome_mismatches,
    );
    report.figure("conflicts recorded", dead_letters.len());
    report.figure("consumers SIGKILLed at random moments", kills.len());
    report.figure(
        "consumers SIGKILLed at the commit point",
        consumers.self_kills,
    );
    if options.kill_after_last_commit {
        report.zero(
            "planned kills after a partition's last commit not done",
            planned_kills_missing,
        );
    }
    report.figure("consumer starts", consumers.starts);
    if options.group {
        report.figure(
            "partitions of a killed member resumed by a surviving member",
            moved_to_survivor,
        );
    }
    report.zero(
        "consumer exits not caused by us",
        consumers.unexpected_exits,
    );
    report.verdict(&verdict, "recorded", Some("partitions"));
    report.zero("offsets never settled by a commit", found.unsettled_offsets);
    report.zero(
        "stores whose position is not their partition's last offset",
        positions_not_at_end,
    );
    report.zero(
        "read again after a restart beyond the last commit's group",
        found.read_again,
    );
    if let Some((median, max)) = median_max(&resume_ms) {
        report.figure(
            "resume after a SIGKILL (kill to assigned at the position), median ms",
            format!("{median:.0}"),
        );
        report.figure("resume after a SIGKILL, max ms", format!("{max:.0}"));
    }
    Ok(report.finish(match placement {
        Placement::Store => Control::Run {
            claim: "lost = 0, applied twice = 0, read again = 0",
        },
        Placement::BrokerBeforeCommit => Control::Negative {
            caught: verdict.lost > 0,
            flaw: "the offset committed to Kafka before the commit loses messages (lost > 0)",
        },
        Placement::BrokerAfterCommit => Control::Negative {
            caught: found.read_again > 0 && verdict.applied_twice == 0,
            flaw: "the offset committed to Kafka after the commit reads committed messages \
                   again (read again > 0; the markers keep applied twice = 0)",
        },
    }))
}
