//! End-to-end check of `nats_orders` against a real `nats-server` with JetStream, with SIGKILLs
//! of the consumers and of the server itself.
//!
//! Starts a private server (127.0.0.1:`--port`, its store in the work folder), makes the orders'
//! stream (duplicate window `--duplicate-window-ms`) and one durable pull consumer per shard
//! (explicit acks, redelivery after `--ack-wait-ms`), and runs one consumer process per shard
//! (store `<work>/store-<shard>`). Publishes orders (with producer-side resends of the same
//! order, and some order ids reused with other content), each until the stream acknowledges
//! it, with `Nats-Msg-Id` set to the content (`--msg-id on`, the default) or not. Meanwhile it
//! SIGKILLs consumers at random moments (the consumers also SIGKILL themselves between a
//! commit and its ack, `--kill-after-commit-per-mille`) and SIGKILLs the server
//! `--server-kills` times, restarting each. Once every consumer has acknowledged everything, it
//! checks the stores and the dead-letter stream, and prints: published, deduplicated by the
//! stream, distinct orders, effects applied, duplicates suppressed by idemdb, conflicts
//! dead-lettered, redeliveries, kills, lost (must be 0) and applied twice (must be 0).
//!
//! `--backend postgres` runs the other shape: `--consumers` processes pull from ONE durable
//! consumer of every shard's orders (competing consumers, so a redelivery may go to another
//! process), and claim in a private PostgreSQL server (127.0.0.1, a free port, its data in the
//! work folder), half of them with `begin` and `commit`, half with `apply`; the effects are rows
//! of the same database's `fleet.applied`, which the check reads.
//!
//! Negative controls, each of which must be caught: `--ack before-commit` (the ack sent
//! before the commit: lost > 0) and `--markers off` (no idemdb markers, the broker's
//! `Nats-Msg-Id` deduplication alone: applied twice > 0). Exits 0 when the run passed (or the
//! control was caught), 1 when a check failed, 2 when the run could not be made.
//!
//! `scripts/nats-e2e.sh` installs `nats-server` and runs this. Options: `--port PORT`,
//! `--backend embedded|postgres`, `--shards N`, `--consumers N` (with `postgres`), `--kill-after-commit-per-mille N`, `--server-kills N`, `--ack-wait-ms N`,
//! `--duplicate-window-ms N`, `--msg-id on|off`, `--ack after-commit|before-commit`,
//! `--markers on|off`, and the workload's `--orders N`, `--resend-percent P`, `--reused N`,
//! `--rate MSGS_PER_S`, `--min-kills N`, `--work DIR`, `--seed N`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idemdb_e2e::args::{Args, Workload, check};
use idemdb_e2e::jetstream::subject;
use idemdb_e2e::nats::{self, Durable, Outgoing, Published, Server};
use idemdb_e2e::orders::{open_store, shard_of};
use idemdb_e2e::pg_cluster::Cluster;
use idemdb_e2e::report::{Control, Report, median_max};
use idemdb_e2e::supervisor::{Supervisor, recipe};
use idemdb_e2e::verdict::{Verdict, check_applied};
use idemdb_e2e::{BoxError, effects_table, fresh_folder, ledger, verdict};

struct Options {
    port: u16,
    /// Claims in PostgreSQL, by `consumers` processes sharing one durable consumer; otherwise
    /// in an embedded store per shard.
    postgres: bool,
    shards: usize,
    consumers: usize,
    kill_after_commit_per_mille: u64,
    server_kills: u64,
    ack_wait: Duration,
    duplicate_window: Duration,
    msg_id: bool,
    /// The consumers' `--ack` and `--markers`: a negative control when not the defaults.
    ack: String,
    markers: String,
    load: Workload,
}

fn on_off(value: &str, option: &str) -> Result<bool, BoxError> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("--{option} is on or off, not {other}").into()),
    }
}

fn parse_options() -> Result<Options, BoxError> {
    let mut args = Args::from_env();
    let msg_id: String = args.value("msg-id", "on".to_owned())?;
    let backend: String = args.value("backend", "embedded".to_owned())?;
    let options = Options {
        port: args.value("port", 14222)?,
        postgres: match backend.as_str() {
            "embedded" => false,
            "postgres" => true,
            other => return Err(format!("--backend is embedded or postgres, not {other}").into()),
        },
        shards: args.value("shards", 3)?,
        consumers: args.value("consumers", 3)?,
        kill_after_commit_per_mille: args.value("kill-after-commit-per-mille", 5)?,
        server_kills: args.value("server-kills", 2)?,
        ack_wait: Duration::from_millis(args.value("ack-wait-ms", 2000)?),
        duplicate_window: Duration::from_millis(args.value("duplicate-window-ms", 2000)?),
        msg_id: on_off(&msg_id, "msg-id")?,
        ack: args.value("ack", "after-commit".to_owned())?,
        markers: args.value("markers", "on".to_owned())?,
        load: Workload::parse(&mut args, "nats-e2e", 400)?,
    };
    args.finish()?;
    check(
        options.shards > 0 && options.consumers > 0,
        "--shards and --consumers must be at least 1",
    )?;
    check(
        options.kill_after_commit_per_mille <= 1000,
        "--kill-after-commit-per-mille is 0..=1000",
    )?;
    check(
        ["after-commit", "before-commit"].contains(&options.ack.as_str()),
        "--ack is after-commit or before-commit",
    )?;
    on_off(&options.markers, "markers")?;
    // A shorter ack wait redelivers messages still being committed; a shorter window is none.
    check(
        options.ack_wait >= Duration::from_millis(500)
            && options.duplicate_window >= Duration::from_millis(100),
        "--ack-wait-ms is at least 500 and --duplicate-window-ms at least 100",
    )?;
    Ok(options)
}

/// The `nats_orders` processes, each with its ledger: one per shard with its durable consumer
/// and its store, or (`pg`, the database's connection string) `--consumers` of them on the one
/// durable consumer, claiming in PostgreSQL, every other one with `apply`.
fn consumers(
    options: &Options,
    url: &str,
    durables: &[Durable],
    pg: Option<String>,
) -> Result<Supervisor, BoxError> {
    let url = url.to_owned();
    let work = options.load.work.clone();
    let kill = options.kill_after_commit_per_mille.to_string();
    let (ack, markers) = (options.ack.clone(), options.markers.clone());
    let names: Vec<String> = durables
        .iter()
        .map(|durable| durable.name.clone())
        .collect();
    let processes = if pg.is_some() {
        options.consumers
    } else {
        names.len()
    };
    let command_line = move |slot: usize, command: &mut std::process::Command| {
        command
            .arg("--nats")
            .arg(&url)
            .arg("--consumer")
            .arg(&names[slot % names.len()])
            .arg("--events")
            .arg(work.join(format!("events-{slot}.log")));
        match &pg {
            Some(pg) => {
                let claim = if slot.is_multiple_of(2) {
                    "begin"
                } else {
                    "apply"
                };
                command.arg("--pg").arg(pg).arg("--claim").arg(claim);
            }
            None => {
                command.arg("--dir").arg(work.join(format!("store-{slot}")));
            }
        }
        command
            .arg("--kill-after-commit-per-mille")
            .arg(&kill)
            .arg("--ack")
            .arg(&ack)
            .arg("--markers")
            .arg(&markers);
        Ok(())
    };
    Ok(Supervisor::new(
        recipe("nats_orders")?,
        &options.load.work,
        processes,
        Box::new(command_line),
    ))
}

fn main() {
    idemdb_e2e::main("nats_e2e", run());
}

async fn run() -> Result<bool, BoxError> {
    let options = parse_options()?;
    let load = &options.load;
    let shards = options.shards;
    let started = Instant::now();
    let (plan, mut rng) = load.plan();
    fresh_folder(&load.work)?;

    let mut server = Server::start(options.port, &load.work.join("server"))?;
    // The PostgreSQL shape's database: the claims' tables and the effects table. Its folder is
    // the postgres user's (as root the server runs as that user, who may not enter the work
    // folder): a temporary folder of its own, kept if the run fails.
    let mut database = None;
    if options.postgres {
        let dir = tempfile::Builder::new()
            .prefix("idemdb-nats-pg-")
            .tempdir()?
            .keep();
        let cluster = Cluster::new(&dir, false)?;
        effects_table::create(&cluster.primary).await?;
        database = Some((cluster, dir));
    }
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(server.url())
        .await?;
    let context = async_nats::jetstream::new(client);
    let durables = nats::durables(shards, options.postgres);
    nats::topology(
        &context,
        &durables,
        options.duplicate_window,
        options.ack_wait,
    )
    .await?;
    let pg = database.as_ref().map(|(cluster, _)| cluster.conninfo());
    let mut consumers = consumers(&options, &server.url(), &durables, pg)?;
    consumers.start_all()?;
    let processes = consumers.slots();
    println!(
        "nats_e2e: {} orders, {} messages to publish at {}/s, {shards} shards, {processes} \
         consumer processes claiming in {}, work dir {}",
        load.orders,
        plan.messages.len(),
        load.rate,
        if options.postgres {
            "PostgreSQL on one shared durable consumer"
        } else {
            "a store per shard"
        },
        load.work.display()
    );

    let messages = plan
        .messages
        .iter()
        .map(|message| Outgoing {
            subject: subject(shard_of(&message.order_id, shards)),
            order_id: message.order_id.clone(),
            body: message.body.clone(),
            // The content: a resend of the same content inside the window is dropped by the
            // stream; a reused id with other content is not.
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
    // The server's kills are spread over the publishing time; the consumers' come every
    // 100-800 ms until both the producer is done and enough were made. Each kill is kept with
    // its time, from which the restarted consumers' resume is measured.
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
        "nats_e2e",
    )
    .await?;
    producer.await??;
    println!(
        "nats_e2e: all published; {} consumer kills done; draining",
        kills.len()
    );

    let progress = || ledger::bytes(&load.work, "events-");
    nats::drain(&context, &durables, &mut consumers, progress).await?;
    let dead_letters = nats::dead_letters(&context).await?;
    let verdict: Verdict = match &database {
        Some((cluster, _)) => {
            let applied = effects_table::read(&cluster.primary).await?;
            check_applied(&plan, &dead_letters, &applied)
        }
        None => {
            let mut stores = Vec::new();
            for shard in 0..shards {
                let dir = load.work.join(format!("store-{shard}"));
                stores.push((format!("shard {shard}"), open_store(&dir)?));
            }
            verdict::verify(&stores, &plan, &dead_letters)?
        }
    };
    let events = ledger::read_all(&load.work, "events-")?;
    let count = |kind: &str| ledger::count(&events, kind, 0);
    println!(
        "nats_e2e: accounting ({:.0} s from first publish to last check)",
        started.elapsed().as_secs_f64()
    );
    let mut report = Report::new("nats_e2e");
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
        "publishes retried (server down)",
        published.retried.load(Ordering::Relaxed),
    );
    report.figure("distinct orders", plan.contents.len());
    report.figure("effects applied", verdict.effects_applied);
    if options.postgres {
        report.figure("of them committed by one apply call", count("by_apply"));
        report.figure("database errors (nacked)", count("db_error"));
    }
    report.figure("duplicates suppressed by idemdb", count("duplicate"));
    report.figure("conflicts dead-lettered", verdict.conflicts_dead_lettered);
    report.figure("deliveries redelivered by JetStream", count("redelivered"));
    report.figure("in-progress nacked", count("in_progress"));
    report.figure("consumers SIGKILLed at random moments", kills.len());
    report.figure(
        "consumers SIGKILLed between commit and ack",
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
    // A consumer's resume: from its SIGKILL to its restarted process pulling again; after a
    // server SIGKILL, from the kill to each consumer pulling again from the restarted server.
    let mut consumer_resume_ms = Vec::new();
    let mut server_resume_ms = Vec::new();
    for slot in 0..processes {
        let events = ledger::read(&load.work.join(format!("events-{slot}.log")))?;
        let ready_after = |at_ns: u64| {
            events
                .iter()
                .find(|event| event.kind == "ready" && event.at_ns > at_ns)
                .map(|ready| (ready.at_ns - at_ns) as f64 / 1_000_000.0)
        };
        for &(_, at_ns) in kills.iter().filter(|(killed, _)| *killed == slot) {
            consumer_resume_ms.extend(ready_after(at_ns));
        }
        for &at_ns in &server_kills_at {
            server_resume_ms.extend(ready_after(at_ns));
        }
    }
    for (label, values) in [
        (
            "resume after a consumer SIGKILL (to pulling again)",
            &consumer_resume_ms,
        ),
        (
            "resume after a server SIGKILL (each consumer pulling again)",
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
    report.figure("consumer starts", consumers.starts);
    report.zero(
        "consumer exits not caused by us",
        consumers.unexpected_exits,
    );
    report.verdict(
        &verdict,
        "dead-lettered",
        (!options.postgres).then_some("shards"),
    );
    let control = if options.ack == "before-commit" {
        Control::Negative {
            caught: verdict.lost > 0,
            flaw: "orders lost with the ack sent before the commit",
        }
    } else if options.markers == "off" {
        Control::Negative {
            caught: verdict.applied_twice > 0,
            flaw: "orders applied twice with Nats-Msg-Id deduplication alone",
        }
    } else {
        Control::Run {
            claim: "lost = 0, applied twice = 0",
        }
    };
    drop(server);
    let passed = report.finish(control);
    if let Some((cluster, dir)) = database {
        drop(cluster);
        if passed {
            std::fs::remove_dir_all(&dir)?;
        } else {
            println!(
                "nats_e2e: the database's folder and log are kept in {}",
                dir.display()
            );
        }
    }
    Ok(passed)
}
