//! An idempotent RabbitMQ consumer: orders from one queue, processed with idemdb, exactly-once
//! effects behind an at-least-once broker.
//!
//! ```text
//! cargo run --release --features tokio --example rabbitmq_orders -- \
//!     --amqp amqp://guest:guest@127.0.0.1:15673/%2f --queue orders.0 --dir /tmp/orders-0 \
//!     --metrics 127.0.0.1:19100
//! ```
//!
//! Each delivery is handled as `common/handler.rs` describes (manual acks, prefetch > 1,
//! deliveries processed concurrently): fresh orders are committed with their business writes in
//! one durable batch and then acked; duplicates are acked; conflicts are dead-lettered.
//!
//! A crash anywhere (SIGKILL) is safe: before the commit nothing was written and the broker
//! redelivers; between commit and ack the redelivery is a duplicate. An embedded store belongs
//! to one process, so consumers scale by partition: each process owns one queue (a shard of
//! the order ids) and its own store. `e2e/src/bin/rabbitmq_e2e.rs` runs several of these under
//! SIGKILLs against a real server (`scripts/rabbitmq-e2e.sh`).
//!
//! Message format: `message_id` = order id, body = `<order id>:<amount>:<variant>`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

#[path = "common/args.rs"]
mod args;
#[path = "common/handler.rs"]
mod handler;
#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/orders.rs"]
mod orders;
use args::Flags;
use handler::{BoxError, Handler};
use ledger::Ledger;
use orders::{DEAD_LETTER_QUEUE, open_store};

struct Options {
    amqp: String,
    queue: String,
    dir: PathBuf,
    prefetch: u16,
    metrics: Option<SocketAddr>,
    /// Appends one line per outcome here (`fresh <id> ...`, see `common/handler.rs`).
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
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--amqp" => options.amqp = flags.value(&flag)?,
            "--queue" => options.queue = flags.value(&flag)?,
            "--dir" => options.dir = flags.value(&flag)?.into(),
            "--prefetch" => options.prefetch = flags.parse(&flag)?,
            "--metrics" => options.metrics = Some(flags.parse(&flag)?),
            "--events" => options.events = Some(flags.value(&flag)?.into()),
            "--transient-failure-percent" => {
                options.transient_failure_percent = flags.parse(&flag)?
            }
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = flags.parse(&flag)?;
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

    let ledger = match &options.events {
        Some(path) => Some(Arc::new(Ledger::open(path)?)),
        None => None,
    };
    let handler = Arc::new(Handler {
        consumer: engine.consumer("orders")?,
        orders: engine.business_table("orders")?,
        effects: engine.business_table("effects")?,
        publisher,
        ledger,
        partition: None,
        // One queue, one store: when the connection goes, the process exits (below).
        connected: Arc::new(AtomicBool::new(true)),
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

    // One task takes the deliveries in order and keeps up to `prefetch` commits in flight
    // through a pipeline: each delivery is acked once its commit is durable, in the order
    // they came, while the next ones are claimed.
    let mut pipeline = handler
        .consumer
        .async_pipeline(usize::from(options.prefetch))?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            delivery = deliveries.next() => {
                let Some(delivery) = delivery else { break };
                if let Some(staged) = handler.start(delivery?).await? {
                    pipeline.commit(staged.claim, b"accepted", staged.then).await;
                }
            }
            Some(settled) = pipeline.next_settled(), if !pipeline.is_empty() => {
                handler.finish(settled.tag, settled.outcome.map(|_| ())).await?;
            }
            _ = terminate.recv() => break,
        }
    }
    // A graceful stop: finish what is in flight; whatever was delivered but not yet started
    // goes back to the queue when the channel closes.
    for settled in pipeline.wait().await {
        handler
            .finish(settled.tag, settled.outcome.map(|_| ()))
            .await?;
    }
    consuming.close(200, "stopping".into()).await?;
    connection.close(200, "stopping".into()).await?;
    Ok(())
}
