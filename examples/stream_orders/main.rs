//! A log consumer: orders read from one RabbitMQ stream, processed with idemdb, with the read
//! position committed in the same write batch as the markers and the effects.
//!
//! ```text
//! cargo run --release --features tokio --example stream_orders -- \
//!     --port 15552 --stream orders.stream.0 --dir /tmp/stream-store-0 --ledger /tmp/reads-0.log
//! ```
//!
//! A stream does not redeliver: a consumer says where to start reading, and starts there. So
//! the question a log consumer must answer after a crash is where it was, and the answer must
//! agree with the effects it committed. Here it does by construction: each group of messages
//! read together is claimed as one batch (`Consumer::begin_batch`), fresh orders stage their
//! effects on their claims, every message of the group stages a row in `reads` (this process
//! settled that offset, and how), and the batch stages the group's last offset as the
//! position (`ClaimBatch::stage_position`). One durable commit writes all of it. After a
//! SIGKILL the process starts again at `position + 1`: nothing committed is read again,
//! nothing read but uncommitted is skipped.
//!
//! Conflicts (an order id reused with other content) go to the `conflicts` table, in the same
//! commit. Duplicates (a producer's resend, at another offset) commit nothing but their row in
//! `reads` and the position.
//!
//! `--position broker-before-commit` and `--position broker-after-commit` keep the position at
//! the broker instead (`store_offset`, read back with `query_offset`), before or after the
//! commit: the two placements a consumer without idemdb's positions has, which the end-to-end
//! run (`e2e/src/bin/stream_e2e.rs`) uses as negative controls. `--kill-at-commit-per-mille N`
//! makes the process SIGKILL itself at the placement's weak point: right after the commit
//! (store), between the broker's offset and the commit (before), between the commit and the
//! broker's offset (after). `--kill-at-commit-of OFFSET` makes it SIGKILL itself at that same
//! point in the group that holds OFFSET (the first group reaching it), after writing
//! `planned-kill <group's last offset>` to its ledger: the checker passes the stream's last
//! offset, until the ledger shows the kill done, to test a kill after the stream's last commit,
//! when a restarted consumer finds nothing left to read.

use std::path::PathBuf;
use std::time::Duration;

use futures_lite::StreamExt;
use rabbitmq_stream_client::types::OffsetSpecification;
use rabbitmq_stream_client::{Client, ClientOptions, Environment};

#[path = "../common/args.rs"]
mod args;
mod group;
#[path = "../common/ledger.rs"]
mod ledger;
#[path = "../common/orders.rs"]
mod orders;
#[path = "../common/streams.rs"]
mod streams;
use args::Flags;
use group::{Read, Tables, claim_group};
use idemdb::Settled;
use ledger::Ledger;
use orders::{BoxError, chain};
use streams::{BROKER_REFERENCE, CONSUMER_ID, Placement, open_stream_store};

/// The most messages committed as one group.
const GROUP_MESSAGES_MAX: usize = 64;
/// The most groups whose commits are in flight at once.
const PIPELINE_DEPTH: usize = 4;
/// How long a group waits for one more message before it is committed.
const GROUP_WAIT: Duration = Duration::from_millis(3);

struct Options {
    port: u16,
    stream: String,
    dir: PathBuf,
    ledger: Option<PathBuf>,
    placement: Placement,
    kill_at_commit_per_mille: u64,
    kill_at_commit_of: Option<u64>,
    seed: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        port: 15552,
        stream: streams::stream_name(0),
        dir: PathBuf::from("/tmp/idemdb-stream-0"),
        ledger: None,
        placement: Placement::Store,
        kill_at_commit_per_mille: 0,
        kill_at_commit_of: None,
        seed: u64::from(std::process::id()),
    };
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--port" => options.port = flags.parse(&flag)?,
            "--stream" => options.stream = flags.value(&flag)?,
            "--dir" => options.dir = flags.value(&flag)?.into(),
            "--ledger" => options.ledger = Some(flags.value(&flag)?.into()),
            "--position" => {
                let text = flags.value(&flag)?;
                options.placement =
                    Placement::parse(&text).ok_or_else(|| format!("unknown placement {text}"))?;
            }
            "--kill-at-commit-per-mille" => {
                options.kill_at_commit_per_mille = flags.parse(&flag)?
            }
            "--kill-at-commit-of" => options.kill_at_commit_of = Some(flags.parse(&flag)?),
            "--seed" => options.seed = flags.parse(&flag)?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("stream_orders: {}", chain(error.as_ref()));
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    let engine = open_stream_store(&options.dir)?;
    let consumer = engine.consumer(CONSUMER_ID)?;
    let tables = Tables::of(&engine)?;
    let ledger = options.ledger.as_deref().map(Ledger::open).transpose()?;
    let mut draws = options.seed;

    let environment = Environment::builder()
        .host("127.0.0.1")
        .port(options.port)
        .build()
        .await?;
    // Where to start: one past the stored position.
    let stored = match options.placement {
        Placement::Store => consumer
            .positions()
            .get(&options.stream, 0)?
            .map(|position| position.offset),
        Placement::BrokerBeforeCommit | Placement::BrokerAfterCommit => {
            broker_offset(options.port, &options.stream).await?
        }
    };
    let start = match stored {
        Some(offset) => OffsetSpecification::Offset(offset + 1),
        None => OffsetSpecification::First,
    };
    let mut stream = environment
        .consumer()
        .name(BROKER_REFERENCE)
        .offset(start)
        .build(&options.stream)
        .await?;
    if let Some(ledger) = &ledger {
        let from = stored.map_or_else(|| "first".to_owned(), |offset| (offset + 1).to_string());
        ledger.event("ready", &from, None);
    }

    // Groups committed with their position through a pipeline: up to PIPELINE_DEPTH in flight
    // (the store placement; the broker placements commit one at a time, in their order with
    // the broker's offset).
    let mut pipeline = consumer.async_pipeline::<u64>(PIPELINE_DEPTH)?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        // A group: the first message waited for (or a SIGTERM: stop between groups), then
        // whatever follows within GROUP_WAIT, up to GROUP_MESSAGES_MAX.
        let first = tokio::select! {
            delivery = stream.next() => delivery,
            // A group's commit settles while the stream is quiet.
            Some(settled) = pipeline.next_settled(), if !pipeline.is_empty() => {
                committed(settled, &options, &mut draws, ledger.as_ref())?;
                continue;
            }
            _ = terminate.recv() => break,
        };
        let Some(first) = first else {
            return Err("the stream's connection closed".into());
        };
        let mut group = vec![read_of(first?)?];
        while group.len() < GROUP_MESSAGES_MAX {
            match tokio::time::timeout(GROUP_WAIT, stream.next()).await {
                Ok(Some(delivery)) => group.push(read_of(delivery?)?),
                Ok(None) => return Err("the stream's connection closed".into()),
                Err(_) => break,
            }
        }
        if let Some(ledger) = &ledger {
            for read in &group {
                ledger.event("read", &read.offset.to_string(), None);
            }
        }
        let last = group.last().map_or(0, |read| read.offset);
        // The planned kill: this group reaches the offset it is planned at.
        let planned_kill = options
            .kill_at_commit_of
            .is_some_and(|offset| last >= offset)
            .then_some(last);

        let per_mille = options.kill_at_commit_per_mille;
        let batch = loop {
            match claim_group(&consumer, &tables, &group)? {
                Some(batch) => break batch,
                // A resend of an order whose commit is in flight: once it is durable, the
                // message is a duplicate.
                None => {
                    for settled in pipeline.wait().await {
                        committed(settled, &options, &mut draws, ledger.as_ref())?;
                    }
                }
            }
        };
        match options.placement {
            Placement::Store => {
                let mut batch = batch;
                batch.stage_position(&options.stream, 0, last)?;
                // Durable with its position in the background; the next group is read and
                // claimed meanwhile.
                pipeline.commit_batch(batch, |_| b"applied", last).await;
                for settled in pipeline.settled() {
                    committed(settled, &options, &mut draws, ledger.as_ref())?;
                }
            }
            Placement::BrokerBeforeCommit => {
                stream.store_offset(last).await?;
                kill_point(&mut draws, per_mille, planned_kill, ledger.as_ref());
                batch.commit(|_| b"applied")?;
                if let Some(ledger) = &ledger {
                    ledger.event("commit", &last.to_string(), None);
                }
            }
            Placement::BrokerAfterCommit => {
                batch.commit(|_| b"applied")?;
                kill_point(&mut draws, per_mille, planned_kill, ledger.as_ref());
                stream.store_offset(last).await?;
                if let Some(ledger) = &ledger {
                    ledger.event("commit", &last.to_string(), None);
                }
            }
        }
    }
    for settled in pipeline.wait().await {
        committed(settled, &options, &mut draws, ledger.as_ref())?;
    }
    let _ = stream.handle().close().await;
    Ok(())
}

/// A group's commit (tagged with its last offset) settled: durable with its position, or the
/// error that stops the process (it restarts from the stored position). The crash point of
/// the store placement is here, right after the commit.
fn committed(
    settled: Settled<u64>,
    options: &Options,
    draws: &mut u64,
    ledger: Option<&Ledger>,
) -> Result<(), BoxError> {
    settled.outcome?;
    let last = settled.tag;
    let planned = options
        .kill_at_commit_of
        .is_some_and(|offset| last >= offset)
        .then_some(last);
    kill_point(draws, options.kill_at_commit_per_mille, planned, ledger);
    if let Some(ledger) = ledger {
        ledger.event("commit", &last.to_string(), None);
    }
    Ok(())
}

/// The offset the broker stores for this consumer on `stream`, if any.
async fn broker_offset(port: u16, stream: &str) -> Result<Option<u64>, BoxError> {
    let client = Client::connect(
        ClientOptions::builder()
            .host("127.0.0.1")
            .port(port)
            .build(),
    )
    .await?;
    let stored = client.query_offset(BROKER_REFERENCE.into(), stream).await;
    let _ = client.close().await;
    match stored {
        Ok(offset) => Ok(Some(offset)),
        // Nothing stored yet.
        Err(rabbitmq_stream_client::error::ClientError::RequestError(_)) => Ok(None),
        Err(error) => Err(error.into()),
    }
}

/// The crash point, hit on purpose: SIGKILLs this process surely when a kill is `planned` here
/// (the group's last offset, written to the ledger first: the checker's evidence that the kill
/// was done, since nothing after it can be written), else with probability `per_mille`/1000.
fn kill_point(draws: &mut u64, per_mille: u64, planned: Option<u64>, ledger: Option<&Ledger>) {
    if let Some(last) = planned {
        if let Some(ledger) = ledger {
            ledger.event("planned-kill", &last.to_string(), None);
        }
        // SAFETY: raising a signal at ourselves.
        unsafe { libc::raise(libc::SIGKILL) };
    }
    if per_mille == 0 {
        return;
    }
    *draws = draws
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    if (*draws >> 33) % 1000 < per_mille {
        // SAFETY: raising a signal at ourselves.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}

/// A delivery's offset and body.
fn read_of(delivery: rabbitmq_stream_client::types::Delivery) -> Result<Read, BoxError> {
    let body = delivery
        .message()
        .data()
        .map(|data| String::from_utf8_lossy(data).into_owned())
        .ok_or("a message without a body")?;
    Ok(Read {
        offset: delivery.offset(),
        body,
    })
}
