//! An idempotent RabbitMQ consumer: orders from one queue, processed with idemdb, exactly-once
//! effects behind an at-least-once broker.
//!
//! For each delivery (manual acks, prefetch > 1, deliveries processed concurrently):
//!
//! - `Fresh`: stage the business writes on the claim (the order row, a per-order effect counter,
//!   the running total), commit them with the marker in one durable batch, then ack.
//! - `Duplicate`: ack without effect (the broker redelivered, or the producer resent).
//! - `Conflict` (same order id, other content): publish to the dead-letter queue with both
//!   fingerprints in headers, wait for the broker's confirm, then ack.
//! - `InProgress` (the same order is being processed by another delivery right now), a
//!   transient failure, or a retryable idemdb error: nack with requeue, so the broker delivers
//!   it again later. Any other idemdb error (a poisoned engine) stops the process; the broker
//!   requeues what it held.
//!
//! A crash anywhere (SIGKILL) is safe: before the commit nothing was written and the broker
//! redelivers; between commit and ack the redelivery is a duplicate. An embedded store belongs
//! to one process, so consumers scale by partition: each process owns one queue (a shard of
//! the order ids) and its own store. `examples/rabbitmq_e2e.rs` runs several of these under
//! SIGKILLs against a real server (`scripts/rabbitmq-e2e.sh`).
//!
//! Message format: `message_id` = order id, body = `<order id>:<amount>:<variant>`.
//!
//! ```text
//! cargo run --release --features tokio --example rabbitmq_orders -- \
//!     --amqp amqp://guest:guest@127.0.0.1:15673/%2f --queue orders.0 --dir /tmp/orders-0 \
//!     --metrics 127.0.0.1:19100
//! ```

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_lite::StreamExt;
use idemdb::{Fingerprint, Outcome};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

#[path = "common/orders.rs"]
mod orders;
use orders::{
    DEAD_LETTER_QUEUE, HEADER_ORDER_ID, HEADER_RECEIVED_FINGERPRINT, HEADER_STORED_FINGERPRINT,
    TOTAL_AMOUNT_KEY, open_store, parse_amount,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Options {
    amqp: String,
    queue: String,
    dir: PathBuf,
    prefetch: u16,
    metrics: Option<SocketAddr>,
    /// Appends one line per outcome here (`fresh <id>`, `duplicate <id>`, ...).
    events: Option<PathBuf>,
    /// Percent of fresh claims dropped and nacked, as a transient failure would.
    transient_failure_percent: u64,
    /// Per mille of commits after which the process SIGKILLs itself before the ack: the
    /// crash point that turns a redelivery into a duplicate, hit on purpose.
    kill_after_commit_per_mille: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        amqp: "amqp://guest:guest@127.0.0.1:15673/%2f".into(),
        queue: "orders.0".into(),
        dir: PathBuf::from("/tmp/idemdb-orders-0"),
        prefetch: 32,
        metrics: None,
        events: None,
        transient_failure_percent: 0,
        kill_after_commit_per_mille: 0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--amqp" => options.amqp = value()?,
            "--queue" => options.queue = value()?,
            "--dir" => options.dir = value()?.into(),
            "--prefetch" => options.prefetch = value()?.parse()?,
            "--metrics" => options.metrics = Some(value()?.parse()?),
            "--events" => options.events = Some(value()?.into()),
            "--transient-failure-percent" => {
                options.transient_failure_percent = value()?.parse()?
            }
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = value()?.parse()?;
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.prefetch == 0 {
        return Err("--prefetch must be at least 1".into());
    }
    if let Some(addr) = options.metrics
        && !addr.ip().is_loopback()
    {
        return Err("--metrics must be a 127.0.0.0/8 address".into());
    }
    Ok(options)
}

/// Everything a delivery handler needs, shared by the concurrent handlers.
struct Handler {
    consumer: idemdb::Consumer,
    orders: idemdb::BusinessTable,
    effects: idemdb::BusinessTable,
    publisher: Channel,
    events: Option<std::sync::Mutex<std::fs::File>>,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    draws: AtomicU64,
    seed: u64,
}

impl Handler {
    /// Logs one outcome. One `write` per line on an `O_APPEND` file: a SIGKILL cannot tear it.
    fn event(&self, what: &str, order_id: &str) {
        if let Some(events) = &self.events {
            let line = format!("{what} {order_id}\n");
            let mut file = events
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // The log is evidence for the checker, not part of the effect: a failed write is
            // reported, and the message is still acked.
            if let Err(error) = file.write_all(line.as_bytes()) {
                eprintln!("rabbitmq_orders: event log: {error}");
            }
        }
    }

    /// A pseudo-random draw in 0..bound, different in every process.
    fn draw(&self, bound: u64) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), self.seed) % bound
    }

    async fn handle(&self, delivery: lapin::message::Delivery) -> Result<(), BoxError> {
        let order_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default();
        if delivery.redelivered {
            // Evidence that the kills bite: the broker hands over what a dead consumer held.
            self.event("redelivered", &order_id);
        }
        let fingerprint = Fingerprint::of(&delivery.data);
        let outcome = match self.consumer.begin(&order_id, fingerprint) {
            Ok(outcome) => outcome,
            Err(idemdb::Error::LimitExceeded { .. }) => {
                // No usable order id: a poison message, not something a retry can fix.
                self.dead_letter(&delivery, &order_id, None, fingerprint)
                    .await?;
                self.event("invalid", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
                return Ok(());
            }
            Err(error) if error.is_retryable() => {
                // The store is busy for a moment: let the broker redeliver.
                self.event("retry", &order_id);
                delivery.nack(requeue()).await?;
                return Ok(());
            }
            // Anything else (a poisoned engine, corruption) needs a restart: stop, and the
            // broker hands what this process held to the next one.
            Err(error) => return Err(error.into()),
        };
        match outcome {
            Outcome::Fresh(mut claim) => {
                if self.draw(100) < self.transient_failure_percent {
                    // A downstream hiccup: nothing was written; the broker redelivers.
                    drop(claim);
                    self.event("transient", &order_id);
                    delivery.nack(requeue()).await?;
                    return Ok(());
                }
                let amount = parse_amount(&delivery.data).unwrap_or(0);
                claim.put(&self.orders, &order_id, &delivery.data)?;
                claim.merge(&self.effects, &order_id, 1u64.to_be_bytes())?;
                claim.merge(&self.effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
                // Durable (fsynced, grouped with concurrent commits) before the ack.
                match claim.commit_async(b"accepted").await {
                    Ok(_) => {}
                    Err(error) if error.is_retryable() => {
                        // Nothing was written: the redelivery is claimed afresh.
                        self.event("retry", &order_id);
                        delivery.nack(requeue()).await?;
                        return Ok(());
                    }
                    Err(error) => return Err(error.into()),
                }
                self.event("fresh", &order_id);
                if self.draw(1000) < self.kill_after_commit_per_mille {
                    // SAFETY: raising a signal on our own process.
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Outcome::Duplicate { .. } => {
                self.event("duplicate", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Outcome::Conflict {
                stored_fingerprint, ..
            } => {
                self.dead_letter(&delivery, &order_id, Some(stored_fingerprint), fingerprint)
                    .await?;
                self.event("conflict", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Outcome::InProgress { .. } => {
                self.event("in_progress", &order_id);
                delivery.nack(requeue()).await?;
            }
            // Neither the admission floor nor the ordering guard is used here.
            Outcome::TooLate { .. } | Outcome::Stale { .. } => {
                self.event("skipped", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
            }
        }
        Ok(())
    }

    /// Publishes the delivery to the dead-letter queue and waits for the broker's confirm, so
    /// that the ack that follows never drops a message the DLQ does not hold.
    async fn dead_letter(
        &self,
        delivery: &lapin::message::Delivery,
        order_id: &str,
        stored: Option<Fingerprint>,
        received: Fingerprint,
    ) -> Result<(), BoxError> {
        let mut headers = FieldTable::default();
        headers.insert(
            HEADER_ORDER_ID.into(),
            AMQPValue::LongString(LongString::from(order_id)),
        );
        headers.insert(
            HEADER_RECEIVED_FINGERPRINT.into(),
            AMQPValue::LongString(LongString::from(received.to_string())),
        );
        if let Some(stored) = stored {
            headers.insert(
                HEADER_STORED_FINGERPRINT.into(),
                AMQPValue::LongString(LongString::from(stored.to_string())),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(order_id))
            .with_headers(headers);
        let confirm = self
            .publisher
            .basic_publish(
                "".into(),
                DEAD_LETTER_QUEUE.into(),
                BasicPublishOptions::default(),
                &delivery.data,
                properties,
            )
            .await?
            .await?;
        if !confirm.is_ack() {
            return Err("the broker refused the dead-letter publish".into());
        }
        Ok(())
    }
}

fn requeue() -> BasicNackOptions {
    BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    }
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("rabbitmq_orders: {error}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    if let Some(addr) = options.metrics {
        // Install before the consumer handle is taken: idemdb registers its metrics then.
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()?;
    }
    let engine = open_store(&options.dir)?;
    let connection = Connection::connect(&options.amqp, ConnectionProperties::default()).await?;
    let consuming = connection.create_channel().await?;
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for queue in [options.queue.as_str(), DEAD_LETTER_QUEUE] {
        consuming
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await?;
    }
    consuming
        .basic_qos(options.prefetch, BasicQosOptions::default())
        .await?;

    let events = match &options.events {
        Some(path) => Some(std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        )),
        None => None,
    };
    let handler = Arc::new(Handler {
        consumer: engine.consumer("orders")?,
        orders: engine.business_table("orders")?,
        effects: engine.business_table("effects")?,
        publisher,
        events,
        transient_failure_percent: options.transient_failure_percent,
        kill_after_commit_per_mille: options.kill_after_commit_per_mille,
        draws: AtomicU64::new(0),
        seed: u64::from(std::process::id()) ^ engine.now_ms(),
    });

    let mut deliveries = consuming
        .basic_consume(
            options.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    eprintln!(
        "rabbitmq_orders: pid {} consuming {} into {}",
        std::process::id(),
        options.queue,
        options.dir.display()
    );

    // Up to `prefetch` deliveries in flight at once, each in its own task.
    let mut tasks = tokio::task::JoinSet::new();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            delivery = deliveries.next() => {
                let Some(delivery) = delivery else { break };
                let delivery = delivery?;
                let handler = handler.clone();
                tasks.spawn(async move { handler.handle(delivery).await });
            }
            Some(done) = tasks.join_next(), if !tasks.is_empty() => done??,
            _ = terminate.recv() => break,
        }
    }
    // A graceful stop: finish what is in flight; whatever was delivered but not yet started
    // goes back to the queue when the channel closes.
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    consuming.close(200, "stopping".into()).await?;
    connection.close(200, "stopping".into()).await?;
    Ok(())
}
