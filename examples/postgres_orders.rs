//! A consumer of a fleet that shares one queue: any of its processes may get any order, and
//! the claims live in PostgreSQL (`idemdb-postgres`), so every process sees what the others
//! processed.
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_lite::StreamExt;
use idemdb::{Fingerprint, Message, Outcome};
use idemdb_postgres::{PgConsumer, PgStore};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, NoTls};

#[path = "common/handler.rs"]
mod handler;
#[path = "common/orders.rs"]
mod orders;
use handler::{BoxError, Ledger, chain, dead_letter, requeue};
use orders::open_store;

/// The business table the effects go to, created by the checker.
pub const APPLY_EFFECT: &str = "INSERT INTO fleet.applied (order_id, body, times) \
     VALUES ($1, $2, 1) \
     ON CONFLICT (order_id) DO UPDATE SET times = fleet.applied.times + 1";

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
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--amqp" => options.amqp = value()?,
            "--queue" => options.queue = value()?,
            "--pg" => options.pg = value()?,
            "--workers" => options.workers = value()?.parse()?,
            "--ledger" => options.ledger = value()?.into(),
            "--embedded" => options.embedded = Some(value()?.into()),
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = value()?.parse()?;
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

/// Where claims are made: the shared PostgreSQL tables, or (negative control) a store of this
/// process's own.
enum Claims {
    Postgres(PgConsumer),
    Embedded(idemdb::Consumer),
}

struct Worker {
    claims: Arc<Claims>,
    pg: String,
    publisher: Channel,
    ledger: Arc<Ledger>,
    kill_after_commit_per_mille: u64,
    draws: Arc<AtomicU64>,
    /// Handles orders with `PgConsumer::apply` instead of `begin` and `commit`.
    apply: bool,
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

impl Worker {
    async fn consume(self, mut deliveries: lapin::Consumer) -> Result<(), BoxError> {
        let mut client = connect(&self.pg, &self.ledger).await;
        while let Some(delivery) = deliveries.next().await {
            let delivery = delivery?;
            if client.is_closed() {
                client = connect(&self.pg, &self.ledger).await;
            }
            let order_id = handler::order_id(&delivery);
            match self.handle(&mut client, &delivery, &order_id).await {
                Ok(()) => {}
                Err(Failure::Database(error)) => {
                    self.ledger.event("db_error", &order_id, None);
                    eprintln!("postgres_orders: {order_id}: {}; nack", chain(&error));
                    delivery.nack(requeue()).await?;
                }
                Err(Failure::Other(error)) => return Err(error),
            }
        }
        Ok(())
    }

    async fn handle(
        &self,
        client: &mut Client,
        delivery: &lapin::message::Delivery,
        order_id: &str,
    ) -> Result<(), Failure> {
        let fingerprint = Fingerprint::of(&delivery.data);
        let began_ns = handler::monotonic_ns();
        let outcome = match &*self.claims {
            Claims::Postgres(consumer) => {
                self.claim_in_postgres(consumer, client, delivery, order_id, fingerprint)
                    .await?
            }
            Claims::Embedded(consumer) => {
                self.claim_embedded(consumer, client, delivery, order_id, fingerprint)
                    .await?
            }
        };
        match outcome {
            Handled::Committed => {
                // With when its claim began: the checker times failovers by the first commit
                // that began after the primary was killed.
                self.ledger.event_since("fresh", order_id, None, began_ns);
                if self.draw(1000) < self.kill_after_commit_per_mille {
                    self.ledger.event("self-kill", order_id, None);
                    // SAFETY: raising a signal on our own process.
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Handled::Duplicate => {
                self.ledger.event("duplicate", order_id, None);
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Handled::Conflict(stored) => {
                dead_letter(
                    &self.publisher,
                    delivery,
                    order_id,
                    Some(stored),
                    fingerprint,
                )
                .await?;
                self.ledger.event("conflict", order_id, None);
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Handled::Retry(kind) => {
                self.ledger.event(kind, order_id, None);
                // Another process holds it: give it back, a little later.
                tokio::time::sleep(Duration::from_millis(5)).await;
                delivery.nack(requeue()).await?;
            }
        }
        Ok(())
    }

    async fn claim_in_postgres(
        &self,
        consumer: &PgConsumer,
        client: &mut Client,
        delivery: &lapin::message::Delivery,
        order_id: &str,
        fingerprint: Fingerprint,
    ) -> Result<Handled, Failure> {
        if self.apply {
            let body = String::from_utf8_lossy(&delivery.data).into_owned();
            let message = Message::new(order_id, fingerprint);
            let effect: [(&(dyn ToSql + Sync), Type); 2] =
                [(&order_id, Type::TEXT), (&body, Type::TEXT)];
            let outcome = consumer
                .apply(client, &message, b"accepted", &[(APPLY_EFFECT, &effect)])
                .await?;
            if matches!(outcome, Outcome::Fresh(_)) {
                self.ledger.event("by_apply", order_id, None);
                return Ok(Handled::Committed);
            }
            return Ok(settled(outcome));
        }
        let outcome = consumer.begin(client, order_id, fingerprint).await?;
        Ok(match outcome {
            Outcome::Fresh(claim) => {
                let body = String::from_utf8_lossy(&delivery.data).into_owned();
                claim
                    .transaction()
                    .execute(APPLY_EFFECT, &[&order_id, &body])
                    .await
                    .map_err(idemdb_postgres::Error::from)?;
                if let Err(error) = claim.commit(b"accepted").await {
                    // Landed or not: the redelivery will tell.
                    self.ledger.event("unknown_commit", order_id, None);
                    return Err(error.into());
                }
                Handled::Committed
            }
            other => settled(other),
        })
    }

    async fn claim_embedded(
        &self,
        consumer: &idemdb::Consumer,
        client: &mut Client,
        delivery: &lapin::message::Delivery,
        order_id: &str,
        fingerprint: Fingerprint,
    ) -> Result<Handled, Failure> {
        let outcome = consumer
            .begin(order_id, fingerprint)
            .map_err(|error| Failure::Other(error.into()))?;
        Ok(match outcome {
            Outcome::Fresh(claim) => {
                let body = String::from_utf8_lossy(&delivery.data).into_owned();
                client
                    .execute(APPLY_EFFECT, &[&order_id, &body])
                    .await
                    .map_err(idemdb_postgres::Error::from)?;
                claim
                    .commit(b"accepted")
                    .map_err(|error| Failure::Other(error.into()))?;
                Handled::Committed
            }
            other => settled(other),
        })
    }

    /// A pseudo-random draw in 0..bound, different in every process.
    fn draw(&self, bound: u64) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let seed = u64::from(std::process::id());
        xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), seed) % bound
    }
}

/// What became of a delivery.
enum Handled {
    Committed,
    Duplicate,
    Conflict(Fingerprint),
    /// Nack and requeue; the ledger kind says why.
    Retry(&'static str),
}

/// Every outcome but `Fresh`, whichever store it came from.
fn settled<C>(outcome: Outcome<C>) -> Handled {
    match outcome {
        Outcome::Duplicate { .. } => Handled::Duplicate,
        Outcome::Conflict {
            stored_fingerprint, ..
        } => Handled::Conflict(stored_fingerprint),
        Outcome::InProgress { .. } => Handled::Retry("in_progress"),
        // Neither the admission floor nor the ordering guard is used here; a Fresh claim never
        // reaches this function.
        _ => Handled::Retry("unexpected"),
    }
}

/// Why a delivery was not handled: the database (nack and reconnect), or anything else (the
/// process stops and the broker requeues what it held).
enum Failure {
    Database(idemdb_postgres::Error),
    Other(BoxError),
}

impl From<idemdb_postgres::Error> for Failure {
    fn from(error: idemdb_postgres::Error) -> Failure {
        // The connection or the server, as the error docs say: retry on a fresh connection.
        // Anything else is a bug or corruption (a consumer would dead-letter the message):
        // stop, and the checker counts the exit.
        if error.is_retryable() {
            Failure::Database(error)
        } else {
            Failure::Other(error.into())
        }
    }
}

impl From<lapin::Error> for Failure {
    fn from(error: lapin::Error) -> Failure {
        Failure::Other(error.into())
    }
}

impl From<BoxError> for Failure {
    fn from(error: BoxError) -> Failure {
        Failure::Other(error)
    }
}
