//! End-to-end check of `nats_replay`, the NATS JetStream log consumer, against a real
//! `nats-server`, with SIGKILLs of the consumers and of the server itself.
//!
//! Starts a private server (127.0.0.1:`--port`, its store in the work folder), makes the orders'
//! stream (duplicate window `--duplicate-window-ms`) and no durable consumer: each shard's
//! process replays its subject with an ordered consumer from the sequence after its stored
//! position (store `<work>/store-<shard>`). Publishes orders (with producer-side resends and
//! order ids reused with other content), each until the stream acknowledges it, with
//! `Nats-Msg-Id` set to the content (`--msg-id on`, the default) or not. Meanwhile it SIGKILLs
//! consumers at random moments (they also SIGKILL themselves at their placement's weak point,
//! `--kill-at-commit-per-mille`) and SIGKILLs the server `--server-kills` times, restarting
//! each. Once every shard's last message is committed the consumers are stopped, the stream is
//! read back as the reference, and the stores are checked as the RabbitMQ streams run checks
//! them (`e2e/src/reads.rs`):
//!
//! - lost = 0, applied twice = 0, conflicts in `conflicts` only;
//! - every message of every shard settled by a commit; with the position in the store, each
//!   store's position at its shard's last sequence;
//! - **read again after a restart beyond the last commit's group** = 0.
//!
//! It prints the accounting and the resume times: from a consumer's SIGKILL to its restarted
//! process subscribed at its position, and from a server SIGKILL to each consumer subscribed
//! again. With `--position store` (the default) it exits 0 when every check holds. With
//! `--position broker-before-commit` or `broker-after-commit` it runs a negative control, the
//! consumers keeping their position at the server (the last message of the shard's subject in a
//! stream of positions), written before or after the commit: it exits 0 when the check it exists for caught the flaw (lost > 0 before; read
//! again > 0, still applied twice = 0, after). With `--markers off` as well (the consumers claim
//! every read under a key of its own: no dedup at all) and the position after the commit, it
//! passes only if it finds **applied twice > 0**: run it with `--resend-percent 0 --reused 0`,
//! so that only a message read again can be applied twice.
//!
//! `scripts/nats-e2e.sh` installs `nats-server` and runs this. Options: `--port PORT`,
//! `--shards N`, `--kill-at-commit-per-mille N`, `--server-kills N`, `--duplicate-window-ms N`,
//! `--msg-id on|off`, `--position PLACEMENT`, `--markers on|off`, and the workload's `--orders N`,
//! `--resend-percent P`, `--reused N`, `--rate MSGS_PER_S`, `--min-kills N`, `--work DIR`,
//! `--seed N`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idemdb_e2e::args::{Args, Workload, check};
use idemdb_e2e::jetstream::{STREAM, subject};
use idemdb_e2e::ledger;
use idemdb_e2e::nats::{self, Outgoing, Published, Server};
use idemdb_e2e::orders::shard_of;
use idemdb_e2e::reads::{self, Reads};
use idemdb_e2e::report::{Control, Report, median_max};
use idemdb_e2e::streams::{CONSUMER_ID, Placement, open_stream_store};
use idemdb_e2e::supervisor::{Supervisor, recipe};
use idemdb_e2e::{BoxError, fresh_folder, verdict};

struct Options {
    port: u16,
    shards: usize,
    kill_at_commit_per_mille: u64,
    server_kills: u64,
    duplicate_window: Duration,
    msg_id: bool,
    placement: Placement,
    markers: bool,
    load: Workload,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut args = Args::from_env();
    let position: String = args.value("position", Placement::Store.label().to_owned())?;
    let msg_id: String = args.value("msg-id", "on".to_owned())?;
    let options = Options {
        port: args.value("port", 14223)?,
        shards: args.value("shards", 3)?,
        kill_at_commit_per_mille: args.value("kill-at-commit-per-mille", 20)?,
        server_kills: args.value("server-kills", 2)?,
        duplicate_window: Duration::from_millis(args.value("duplicate-window-ms", 2000)?),
        msg_id: match msg_id.as_str() {
            "on" => true,
            "off" => false,
            other => return Err(format!("--msg-id is on or off, not {other}").into()),
        },
        placement: Placement::parse(&position)
            .ok_or_else(|| format!("unknown placement {position}"))?,
        markers: match args.value("markers", "on".to_owned())?.as_str() {
            "on" => true,
            "off" => false,
            other => return Err(format!("--markers is on or off, not {other}").into()),
        },
        load: Workload::parse(&mut args, "nats-replay-e2e", 400)?,
    };
    args.finish()?;
    check(options.shards > 0, "--shards must be at least 1")?;
    check(
        options.kill_at_commit_per_mille <= 1000,
        "--kill-at-commit-per-mille is 0..=1000",
    )?;
    check(
        options.duplicate_window >= Duration::from_millis(100),
        "--duplicate-window-ms is at least 100",
    )?;
    check(
        options.markers || options.placement == Placement::BrokerAfterCommit,
        "--markers off goes with --position broker-after-commit (the control it exists for)",
    )?;
    Ok(options)
}

/// The ledger of shard `shard`'s consumers (every process of the shard appends to it).
fn ledger_of(work: &Path, shard: usize) -> PathBuf {
    work.join(format!("ledger-{shard}.log"))
}

/// One `nats_replay` process per shard: its subject, its store, its ledger, the placement of
/// its position.
fn consumers(options: &Options, url: &str) -> Result<Supervisor, BoxError> {
    let url = url.to_owned();
    let work = options.load.work.clone();
    let placement = options.placement.label();
    let kill = options.kill_at_commit_per_mille.to_string();
    let markers = if options.markers { "on" } else { "off" };
    let seed = options.load.seed;
    let mut starts = 0u64;
    let command_line = move |shard: usize, command: &mut Command| {
        // Each process draws its kills at the commit point from a seed of its own.
        starts += 1;
        command
            .arg("--nats")
            .arg(&url)
            .arg("--shard")
            .arg(shard.to_string())
            .arg("--dir")
            .arg(work.join(format!("store-{shard}")))
            .arg("--ledger")
            .arg(ledger_of(&work, shard))
            .arg("--position")
            .arg(placement)
            .arg("--kill-at-commit-per-mille")
            .arg(&kill)
            .arg("--markers")
            .arg(markers)
            .arg("--seed")
            .arg((seed ^ (starts << 20)).to_string());
        Ok(())
    };
    Ok(Supervisor::new(
        recipe("nats_replay")?,
        &options.load.work,
        options.shards,
        Box::new(command_line),
    ))
}

fn main() {
    idemdb_e2e::main("nats_replay_e2e", run());
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let load = &options.load;
    let (shards, placement, work) = (options.shards, options.placement, &load.work);
    let started = Instant::now();
    let (plan, mut rng) = load.plan();
    fresh_folder(work)?;

    let mut server = Server::start(options.port, &work.join("server"))?;
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(server.url())
        .await?;
    let context = async_nats::jetstream::new(client);
    // The stream only: an ordered consumer is made by each process, where its position says.
    // (The ack wait is unused without durable consumers.)
    nats::topology(
        &context,
        &[],
        options.duplicate_window,
        Duration::from_secs(1),
    )
    .await?;
    let mut consumers = consumers(&options, &server.url())?;
    consumers.start_all()?;
    println!(
        "nats_replay_e2e: {} orders, {} messages to publish at {}/s, {shards} shards, position \
         {}, work dir {}",
        load.orders,
        plan.messages.len(),
        load.rate,
        placement.label(),
        work.display()
    );

    let messages = plan
        .messages
        .iter()
        .map(|message| Outgoing {
            subject: subject(shard_of(&message.order_id, shards)),
            order_id: message.order_id.clone(),
            body: message.body.clone(),
            message_id: options.msg_id.then(|| message.body.clone()),
        })
        .collect();
    let published = Arc::new(Published::default());
    let producer = tokio::spawn(nats::publish(
        context.clone(),
        messages,
        load.rate,
        published.clone(),
    ));
    // As the acked run: the server's kills spread over the publishing time, the consumers'
    // every 100-800 ms until both the producer is done and enough were made.
    let publishing = Duration::from_secs_f64(plan.messages.len() as f64 / load.rate as f64);
    let nats::Kills {
        consumers: kills,
        server_at: server_kills_at,
    } = nats::kill_while_publishing(
        &mut server,
        &mut consumers,
        &producer,
        publishing,
        options.server_kills,
        load.min_kills,
        &mut rng,
        "nats_replay_e2e",
    )
    .await?;
    producer.await??;
    println!(
        "nats_replay_e2e: all published; {} consumer kills done; reading the stream back and \
         waiting for the consumers",
        kills.len()
    );

    // The reference: the stream read back, by shard.
    let reference = nats::read_back(&context, shards).await?;
    // Wait until each shard's consumers committed its last sequence.
    let ledger = |shard: usize| ledger_of(work, shard);
    reads::wait_until_consumed(&mut consumers, &reference, ledger, placement, "shard").await?;
    consumers.stop_gracefully()?;

    // Each store checked against its shard read back and its ledger.
    let mut found = Reads::default();
    let mut positions_not_at_end = 0u64;
    let (mut consumer_resume_ms, mut server_resume_ms) = (Vec::new(), Vec::new());
    let mut stores = Vec::new();
    let mut dead_letters = Vec::new();
    for (shard, read_back) in reference.iter().enumerate() {
        let engine = open_stream_store(&work.join(format!("store-{shard}")))?;
        let events = ledger::read(&ledger_of(work, shard))?;
        reads::check_reads(&engine, read_back, &events, &mut found)?;
        let last = read_back.last().map(|(sequence, _)| *sequence);
        if placement == Placement::Store {
            let positions = engine.consumer(CONSUMER_ID)?.positions();
            let stored = positions.get(STREAM, u32::try_from(shard)?)?;
            let stored = stored.map(|position| position.offset);
            if stored != last {
                positions_not_at_end += 1;
                eprintln!("POSITION: shard {shard}: stored {stored:?}, last sequence {last:?}");
            }
        }
        dead_letters.extend(reads::recorded_conflicts(&engine, read_back)?);
        let ready_after = |at_ns: u64| {
            events
                .iter()
                .find(|event| event.kind == "ready" && event.at_ns > at_ns)
                .map(|ready| (ready.at_ns - at_ns) as f64 / 1_000_000.0)
        };
        for &(_, at_ns) in kills.iter().filter(|(killed, _)| *killed == shard) {
            consumer_resume_ms.extend(ready_after(at_ns));
        }
        for &at_ns in &server_kills_at {
            server_resume_ms.extend(ready_after(at_ns));
        }
        stores.push((format!("shard {shard}"), engine));
    }
    let verdict = verdict::verify(&stores, &plan, &dead_letters)?;

    println!(
        "nats_replay_e2e: accounting, position {} ({:.0} s from first publish to last check)",
        placement.label(),
        started.elapsed().as_secs_f64()
    );
    let mut report = Report::new("nats_replay_e2e");
    report.figure("messages planned", plan.messages.len());
    report.figure(
        "published (acknowledged by the stream)",
        published.acknowledged.load(Ordering::Relaxed),
    );
    report.figure(
        "dropped by the stream as duplicates (Nats-Msg-Id inside its window)",
        published.deduplicated.load(Ordering::Relaxed),
    );
    report.figure(
        "in the stream (read back)",
        reference.iter().map(Vec::len).sum::<usize>(),
    );
    report.figure("distinct orders", plan.contents.len());
    report.figure("effects applied", verdict.effects_applied);
    report.figure("duplicates (true resends) settled", found.duplicates);
    report.figure(
        "duplicates the stream's order makes",
        found.duplicates_expected,
    );
    report.zero(
        "messages settled with another outcome",
        found.outcome_mismatches,
    );
    report.figure("conflicts recorded", dead_letters.len());
    report.figure("consumers SIGKILLed at random moments", kills.len());
    report.figure(
        "consumers SIGKILLed at the commit point",
        consumers.self_kills,
    );
    report.figure("server SIGKILLed and restarted", server.kills);
    report.figure(
        "server, every write synced before its acknowledgement",
        format!(
            "{} ({})",
            if server.sync_always { "yes" } else { "no" },
            server.version
        ),
    );
    report.figure("consumer starts", consumers.starts);
    report.zero(
        "consumer exits not caused by us",
        consumers.unexpected_exits,
    );
    report.verdict(&verdict, "recorded", Some("shards"));
    report.zero(
        "messages never settled by a commit",
        found.unsettled_offsets,
    );
    report.zero(
        "stores whose position is not their shard's last sequence",
        positions_not_at_end,
    );
    report.zero(
        "read again after a restart beyond the last commit's group",
        found.read_again,
    );
    for (label, values) in [
        (
            "resume after a consumer SIGKILL (to subscribed at its position)",
            &consumer_resume_ms,
        ),
        (
            "resume after a server SIGKILL (each consumer subscribed again)",
            &server_resume_ms,
        ),
    ] {
        if let Some((median, max)) = median_max(values) {
            report.figure(
                &format!("{label}, median / max ms"),
                format!("{median:.0} / {max:.0}"),
            );
        }
    }
    drop(server);
    Ok(report.finish(match placement {
        Placement::Store => Control::Run {
            claim: "lost = 0, applied twice = 0, read again = 0",
        },
        Placement::BrokerBeforeCommit => Control::Negative {
            caught: verdict.lost > 0,
            flaw: "the position written at the server before the commit loses messages (lost > 0)",
        },
        Placement::BrokerAfterCommit if !options.markers => Control::Negative {
            caught: verdict.applied_twice > 0,
            flaw: "without markers, the position written at the server after the commit applies \
                   messages read again twice (applied twice > 0)",
        },
        Placement::BrokerAfterCommit => Control::Negative {
            caught: found.read_again > 0 && verdict.applied_twice == 0,
            flaw: "the position written at the server after the commit reads committed messages \
                   again (read again > 0; the markers keep applied twice = 0)",
        },
    }))
}
