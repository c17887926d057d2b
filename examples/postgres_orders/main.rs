//! A consumer of a fleet that shares one queue: any of its processes may get any order, and
//! the claims live in PostgreSQL (`idemdb-postgres`), so every process sees what the others
//! processed.
//!
//! ```text
//! cargo run --release --features tokio --example postgres_orders -- \
//!     --amqp amqp://guest:guest@127.0.0.1:15673/%2f --queue orders.fleet --workers 4 \
//!     --pg 'host=127.0.0.1 port=5432 user=postgres dbname=postgres target_session_attrs=read-write' \
//!     --ledger /tmp/fleet-ledger.log
//! ```
//!
//! The queue and the effects table `fleet.applied` must exist: `scripts/postgres-fleet.sh`
//! makes them, starts the servers and runs a fleet of these under its checker
//! (`e2e/src/bin/postgres_fleet.rs`).
//!
//! Each worker has its own AMQP channel and its own PostgreSQL connection, and handles one
//! delivery at a time:
//!
//! - `Fresh`: the order's effect (a row of `fleet.applied`, counting how often it was applied)
//!   is written in the claim's transaction; the commit writes the marker with it; then the ack.
//! - `Duplicate`: ack. `Conflict`: dead-letter with both fingerprints, then ack.
//! - `InProgress` (another process holds the order right now): nack with requeue.
//! - A database error the docs call retryable (the primary is gone, a failover is under way):
//!   nack with requeue, and reconnect into the same variable. A commit whose outcome is
//!   unknown is nacked too: its redelivery finds the order `Duplicate` (the commit landed) or
//!   `Fresh` (it did not), never half of it. Any other error stops the process, which the
//!   checker counts as an unexpected exit: a consumer following the error docs would have
//!   dead-lettered the message.
//!
//! Odd-numbered workers handle an order with `PgConsumer::apply` (the claim, the effect and the
//! commit in one call), the others with `begin`, the effect in the claim's transaction and
//! `commit`: both kinds of call run on connections rebuilt after every failover.
//!
//! `--pg` takes a libpq-style connection string; with several hosts and
//! `target_session_attrs=read-write` a reconnect finds whichever server is the primary.
//!
//! `--embedded DIR` is the negative control of `postgres_fleet`: each process claims in an
//! embedded store of its own instead, and applies the effect in its own transaction. Competing
//! consumers then cannot see each other's claims, and the checker must catch orders applied
//! twice.
//!
//! Message format and dead-letter headers: `common/orders.rs`. Ledger lines:
//! `common/handler.rs` (kinds `fresh`, `by_apply` (a `fresh` committed by `apply`),
//! `duplicate`, `conflict`, `in_progress`, `db_error`, `unknown_commit`, `reconnected`,
//! `self-kill`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use idemdb_postgres::PgStore;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio_postgres::{Client, NoTls};

#[path = "../common/args.rs"]
mod args;
#[path = "../common/handler.rs"]
mod handler;
#[path = "../common/ledger.rs"]
mod ledger;
#[path = "../common/orders.rs"]
mod orders;
mod worker;
use args::Flags;
use handler::BoxError;
use ledger::Ledger;
use orders::chain;
use orders::open_store;
use worker::{Claims, Worker};

struct Options {
    amqp: String,
    queue: String,
    pg: String,
    workers: usize,
    ledger: PathBuf,
    embedded: Option<PathBuf>,
    kill_after_commit_per_mille: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        amqp: "amqp://guest:guest@127.0.0.1:15673/%2f".into(),
        queue: "orders.fleet".into(),
        pg: String::new(),
        workers: 4,
        ledger: PathBuf::from("/tmp/idemdb-fleet-ledger"),
        embedded: None,
        kill_after_commit_per_mille: 0,
    };
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--amqp" => options.amqp = flags.value(&flag)?,
            "--queue" => options.queue = flags.value(&flag)?,
            "--pg" => options.pg = flags.value(&flag)?,
            "--workers" => options.workers = flags.parse(&flag)?,
            "--ledger" => options.ledger = flags.value(&flag)?.into(),
            "--embedded" => options.embedded = Some(flags.value(&flag)?.into()),
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = flags.parse(&flag)?;
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.pg.is_empty() || options.workers == 0 {
        return Err("--pg is required, and --workers must be at least 1".into());
    }
    Ok(options)
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("postgres_orders: {}", chain(&*error));
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    let ledger = Arc::new(Ledger::open(&options.ledger)?);
    let claims = Arc::new(match &options.embedded {
        Some(dir) => Claims::Embedded(open_store(dir)?.consumer("orders")?),
        None => Claims::Postgres(open_pg(&options.pg, &ledger).await?.consumer("orders")?),
    });
    let connection = Connection::connect(&options.amqp, ConnectionProperties::default()).await?;
    let draws = Arc::new(AtomicU64::new(0));
    let mut workers = tokio::task::JoinSet::new();
    let mut subscriptions = Vec::new();
    for index in 0..options.workers {
        let consuming = connection.create_channel().await?;
        let publisher = connection.create_channel().await?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        // One delivery in hand and one on the way: the rest stay in the queue for the
        // other workers and processes.
        consuming.basic_qos(2, BasicQosOptions::default()).await?;
        let deliveries = consuming
            .basic_consume(
                options.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        subscriptions.push((consuming.clone(), deliveries.tag()));
        let worker = Worker {
            claims: claims.clone(),
            pg: options.pg.clone(),
            publisher,
            ledger: ledger.clone(),
            kill_after_commit_per_mille: options.kill_after_commit_per_mille,
            draws: draws.clone(),
            apply: index % 2 == 1,
        };
        workers.spawn(async move { worker.consume(deliveries).await });
    }
    eprintln!(
        "postgres_orders: pid {} consuming {} with {} workers",
        std::process::id(),
        options.queue,
        options.workers
    );
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        Some(done) = workers.join_next() => return done?,
        _ = terminate.recv() => {}
    }
    // A graceful stop: no new deliveries; each worker finishes the one in hand and its
    // subscription ends. What was delivered and not handled goes back to the queue when the
    // connection closes.
    eprintln!("postgres_orders: pid {} stopping", std::process::id());
    for (channel, tag) in subscriptions {
        channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await?;
    }
    eprintln!("postgres_orders: subscriptions cancelled");
    while let Some(done) = workers.join_next().await {
        done??;
    }
    eprintln!("postgres_orders: workers done");
    // Everything in hand was acked or nacked: a failed close loses nothing (the broker
    // requeues what a closed connection held). Bounded: the close has been seen to hang after
    // the subscriptions were cancelled, and the process's exit closes the socket anyway.
    match tokio::time::timeout(
        Duration::from_secs(5),
        connection.close(200, "stopping".into()),
    )
    .await
    {
        Ok(Ok(())) => {}
        Ok(Err(error)) => eprintln!("postgres_orders: closing the broker connection: {error}"),
        Err(_) => eprintln!("postgres_orders: the broker connection did not close within 5 s"),
    }
    Ok(())
}

/// Connects to whichever server accepts writes, retrying until one does (during a failover
/// none does for a while).
/// Opens the store, on a new connection as often as a failover under way cuts the last one
/// (a process restarted during a failover must not exit on it).
async fn open_pg(pg: &str, ledger: &Ledger) -> Result<PgStore, BoxError> {
    loop {
        let client = connect(pg, ledger).await;
        match PgStore::builder().open(&client).await {
            Ok(store) => return Ok(store),
            Err(error) if error.is_retryable() => {
                eprintln!(
                    "postgres_orders: opening the store: {}; retrying",
                    chain(&error)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

async fn connect(pg: &str, ledger: &Ledger) -> Client {
    let mut attempts = 0u64;
    loop {
        match tokio_postgres::connect(pg, NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                if attempts > 0 {
                    ledger.event("reconnected", &attempts.to_string(), None);
                }
                return client;
            }
            Err(_) => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
