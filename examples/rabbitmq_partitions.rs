//! A consumer of a partitioned fleet: the broker decides which process owns which partition,
//! and each partition's store moves with it.
//!
//! Orders go through RabbitMQ's consistent-hash exchange to P partition queues, each declared
//! with `x-single-active-consumer`. Every process of the fleet subscribes to every partition
//! queue; the broker delivers each queue to one of them at a time and, when that one's
//! connection goes (a crash, a lost network, missed heartbeats), to the next. The store of
//! partition `p` is the directory `<stores>/partition-<p>`: it stands for a volume that moves
//! with the partition (a Kubernetes PersistentVolume, an EBS volume). The handoff:
//!
//! 1. The first delivery from partition `p`'s queue tells this process it is now the owner.
//! 2. It opens the partition's store. While the previous owner still holds it (a process
//!    paused, not yet aware that the broker gave its partitions away), the open is refused
//!    with `AlreadyOpen` (after the engine's own wait of up to 0.5 s for the lock, which it
//!    takes within milliseconds of its release); it tries again 50 ms later, holding the
//!    deliveries unacked.
//! 3. It handles the partition's deliveries (`common/handler.rs`) with that store.
//! 4. When the connection is lost it stops committing (claims not yet committed are dropped),
//!    stops its handlers, closes every store it owns, and only then connects again, as a
//!    standby for every partition.
//!
//! While it owns a partition it can also take an online backup of its store every
//! `--checkpoint-every-ms` (`Engine::checkpoint`) into `<backups>`.
//!
//! `examples/rabbitmq_handoff.rs` runs a fleet of these against a real server, SIGKILLs and
//! SIGSTOPs them, and checks the effects (`scripts/rabbitmq-handoff.sh`).
//!
//! ```text
//! cargo run --release --features tokio --example rabbitmq_partitions -- \
//!     --amqp 'amqp://guest:guest@127.0.0.1:15673/%2f?heartbeat=2' --partitions 6 \
//!     --stores /tmp/orders-stores --ledger /tmp/orders-ledger.log
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::watch;

#[path = "common/handler.rs"]
mod handler;
#[path = "common/orders.rs"]
mod orders;
use handler::{BoxError, Handler, Ledger};
use orders::{DEAD_LETTER_QUEUE, open_partition_store, partition_queue, partition_queue_arguments};

struct Options {
    amqp: String,
    partitions: usize,
    stores: PathBuf,
    /// Partitions subscribed to first, so that a fleet started together spreads ownership.
    preferred: Vec<usize>,
    prefetch: u16,
    metrics: Option<SocketAddr>,
    ledger: Option<PathBuf>,
    transient_failure_percent: u64,
    kill_after_commit_per_mille: u64,
    checkpoint_every: Option<Duration>,
    backups: Option<PathBuf>,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        amqp: "amqp://guest:guest@127.0.0.1:15673/%2f?heartbeat=2".into(),
        partitions: 6,
        stores: PathBuf::from("/tmp/idemdb-partitions"),
        preferred: Vec::new(),
        prefetch: 32,
        metrics: None,
        ledger: None,
        transient_failure_percent: 0,
        kill_after_commit_per_mille: 0,
        checkpoint_every: None,
        backups: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--amqp" => options.amqp = value()?,
            "--partitions" => options.partitions = value()?.parse()?,
            "--stores" => options.stores = value()?.into(),
            "--preferred" => {
                options.preferred = value()?
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .map(str::parse)
                    .collect::<Result<_, _>>()?;
            }
            "--prefetch" => options.prefetch = value()?.parse()?,
            "--metrics" => options.metrics = Some(value()?.parse()?),
            "--ledger" => options.ledger = Some(value()?.into()),
            "--transient-failure-percent" => {
                options.transient_failure_percent = value()?.parse()?;
            }
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = value()?.parse()?;
            }
            "--checkpoint-every-ms" => {
                options.checkpoint_every = Some(Duration::from_millis(value()?.parse()?));
            }
            "--backups" => options.backups = Some(value()?.into()),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.partitions == 0 || options.prefetch == 0 {
        return Err("--partitions and --prefetch must be at least 1".into());
    }
    if let Some(p) = options.preferred.iter().find(|p| **p >= options.partitions) {
        return Err(format!("--preferred names partition {p} of {}", options.partitions).into());
    }
    if options.checkpoint_every.is_some() != options.backups.is_some() {
        return Err("--checkpoint-every-ms and --backups go together".into());
    }
    if let Some(addr) = options.metrics
        && !addr.ip().is_loopback()
    {
        return Err("--metrics must be a 127.0.0.0/8 address".into());
    }
    Ok(options)
}

/// What every partition task of one process shares.
struct Shared {
    options: Options,
    ledger: Option<Arc<Ledger>>,
    draws: AtomicU64,
    checkpoints: AtomicU64,
}

impl Shared {
    fn event(&self, kind: &str, subject: &str, partition: Option<usize>) {
        if let Some(ledger) = &self.ledger {
            ledger.event(kind, subject, partition);
        }
    }
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("rabbitmq_partitions: {error}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    if let Some(addr) = options.metrics {
        // Install before any store opens: idemdb registers its metrics then.
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()?;
    }
    std::fs::create_dir_all(&options.stores)?;
    let ledger = match &options.ledger {
        Some(path) => Some(Arc::new(Ledger::open(path)?)),
        None => None,
    };
    let shared = Arc::new(Shared {
        options,
        ledger,
        draws: AtomicU64::new(0),
        checkpoints: AtomicU64::new(0),
    });
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        match session(&shared, &mut terminate).await {
            Ok(Ended::Terminated) => return Ok(()),
            Ok(Ended::ConnectionLost) => {}
            // A failed connect (the broker restarting): try again.
            Err(error) => eprintln!("rabbitmq_partitions: session: {error}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

enum Ended {
    Terminated,
    ConnectionLost,
}

/// One broker connection: subscribes to every partition queue, owns whichever partitions the
/// broker delivers, and releases all of them before it returns.
/// How long a pause (the process stopped or starved) must last for this process to presume
/// its connection lost: the heartbeat interval of the connection string above (2 s), past which
/// the broker starts counting missed heartbeats.
const PAUSE_PRESUMED_LOST: std::time::Duration = std::time::Duration::from_secs(2);

async fn session(
    shared: &Arc<Shared>,
    terminate: &mut tokio::signal::unix::Signal,
) -> Result<Ended, BoxError> {
    let connection =
        Connection::connect(&shared.options.amqp, ConnectionProperties::default()).await?;
    // Cleared the moment this process learns the connection is gone; the handlers check it
    // before every commit.
    let connected = Arc::new(AtomicBool::new(true));
    let (lost_tx, mut lost_rx) = watch::channel(false);
    let watcher = {
        let connected = connected.clone();
        let lost_tx = lost_tx.clone();
        let mut events = connection.events_listener();
        tokio::spawn(async move {
            while let Some(event) = events.next().await {
                if let lapin::Event::Error(error) = event {
                    connected.store(false, Ordering::Release);
                    let _ = lost_tx.send(true);
                    eprintln!("rabbitmq_partitions: connection lost: {error}");
                }
            }
        })
    };
    // A process that was paused (SIGSTOP, a VM freeze, a long GC-like stall) for longer than
    // the heartbeat may have lost its partitions to another consumer without its connection
    // library noticing yet: a tick that comes late by more than that ends the session as a lost
    // connection, as a missed lease would. (The monotonic clock runs on while the process is
    // stopped.)
    let pause_watch = {
        let connected = connected.clone();
        let lost_tx = lost_tx.clone();
        tokio::spawn(async move {
            const TICK: std::time::Duration = std::time::Duration::from_millis(200);
            let mut last = std::time::Instant::now();
            loop {
                tokio::time::sleep(TICK).await;
                let late = last.elapsed().saturating_sub(TICK);
                last = std::time::Instant::now();
                if late > PAUSE_PRESUMED_LOST {
                    connected.store(false, Ordering::Release);
                    let _ = lost_tx.send(true);
                    eprintln!(
                        "rabbitmq_partitions: paused for {} ms: the connection is presumed lost",
                        late.as_millis()
                    );
                    return;
                }
            }
        })
    };
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    publisher
        .queue_declare(
            DEAD_LETTER_QUEUE.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut partitions = tokio::task::JoinSet::new();
    // Subscribing takes a while (the pause between preferred and other partitions): a
    // connection lost meanwhile must still release the partitions already owned, below.
    let subscribed = subscribe(
        shared,
        &connection,
        &publisher,
        &connected,
        &lost_tx,
        &stop_rx,
        &mut partitions,
    )
    .await;
    let ended = match subscribed {
        Err(error) => {
            eprintln!("rabbitmq_partitions: subscribing: {error}");
            Ended::ConnectionLost
        }
        Ok(()) => tokio::select! {
            _ = terminate.recv() => Ended::Terminated,
            _ = lost_rx.wait_for(|lost| *lost) => Ended::ConnectionLost,
            // A partition task that fails (a poisoned store) ends the session too.
            Some(done) = partitions.join_next() => {
                if let Ok(Err(error)) = done {
                    eprintln!("rabbitmq_partitions: {error}");
                }
                Ended::ConnectionLost
            }
        },
    };
    if matches!(ended, Ended::ConnectionLost) {
        connected.store(false, Ordering::Release);
        shared.event("lost", "connection", None);
    }
    // Stop every partition: a graceful stop finishes the deliveries in flight; after a lost
    // connection they are cut short (nothing uncommitted is written). Either way each task
    // closes its store before it returns.
    let _ = stop_tx.send(true);
    while let Some(done) = partitions.join_next().await {
        if let Ok(Err(error)) = done {
            eprintln!("rabbitmq_partitions: {error}");
        }
    }
    watcher.abort();
    pause_watch.abort();
    if matches!(ended, Ended::Terminated) {
        let _ = connection.close(200, "stopping".into()).await;
    }
    Ok(ended)
}

/// Subscribes to every partition queue (preferred ones first), one channel and one partition
/// task each.
async fn subscribe(
    shared: &Arc<Shared>,
    connection: &Connection,
    publisher: &Channel,
    connected: &Arc<AtomicBool>,
    lost_tx: &watch::Sender<bool>,
    stop_rx: &watch::Receiver<bool>,
    partitions: &mut tokio::task::JoinSet<Result<(), BoxError>>,
) -> Result<(), BoxError> {
    let options = &shared.options;
    let mut order: Vec<usize> = options.preferred.clone();
    order.extend((0..options.partitions).filter(|p| !options.preferred.contains(p)));
    for (index, partition) in order.into_iter().enumerate() {
        if index == options.preferred.len() && index > 0 {
            // The fleet's other members subscribe to their preferred partitions meanwhile, and
            // become their active consumers: first subscribed, first active.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(options.prefetch, BasicQosOptions::default())
            .await?;
        let queue = partition_queue(partition);
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::durable(),
                partition_queue_arguments(),
            )
            .await?;
        let deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                format!("pid-{}-partition-{partition}", std::process::id())
                    .as_str()
                    .into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        partitions.spawn(own_partition(
            shared.clone(),
            partition,
            channel,
            deliveries,
            publisher.clone(),
            connected.clone(),
            lost_tx.clone(),
            stop_rx.clone(),
        ));
    }
    eprintln!(
        "rabbitmq_partitions: pid {} subscribed to {} partitions",
        std::process::id(),
        options.partitions
    );

    Ok(())
}

/// One partition queue's subscription: idle while another process is its active consumer;
/// the owner of the partition's store from its first delivery until the session ends.
#[allow(clippy::too_many_arguments)]
async fn own_partition(
    shared: Arc<Shared>,
    partition: usize,
    channel: Channel,
    mut deliveries: lapin::Consumer,
    publisher: Channel,
    connected: Arc<AtomicBool>,
    lost: watch::Sender<bool>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), BoxError> {
    // The store and the handler of its deliveries, from the first delivery on.
    let mut owned: Option<(idemdb::Engine, Arc<Handler>)> = None;
    let mut waiting = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    let mut checkpoint_tick = shared.options.checkpoint_every.map(|every| {
        let mut tick = tokio::time::interval(every);
        // A standby that becomes the owner backs up once, not once per tick it missed.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        tick
    });
    // Write batches at the last backup: an idle store is not backed up again.
    let mut backed_up_at = u64::MAX;
    let result = loop {
        tokio::select! {
            _ = stop.changed() => break Ok(()),
            delivery = deliveries.next() => {
                let delivery = match delivery {
                    Some(Ok(delivery)) => delivery,
                    // The channel or the connection closed under us.
                    Some(Err(_)) | None => {
                        connected.store(false, Ordering::Release);
                        let _ = lost.send(true);
                        break Ok(());
                    }
                };
                match &owned {
                    Some((_, handler)) => {
                        let handler = handler.clone();
                        tasks.spawn(async move { handler.handle(delivery).await });
                    }
                    None => {
                        // The broker made this process the partition's active consumer: the
                        // store is opened below, outside this `select!`.
                        if waiting.is_empty() {
                            shared.event("active", "-", Some(partition));
                        }
                        waiting.push(delivery);
                    }
                }
            }
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                match done {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => {
                        // A failed ack means the channel is gone; anything else (a poisoned
                        // store) ends the session as well: the broker hands the partition on.
                        break Err(error);
                    }
                    Err(join) => break Err(join.into()),
                }
            }
            _ = async { checkpoint_tick.as_mut().expect("guarded").tick().await },
                if checkpoint_tick.is_some() && owned.is_some() =>
            {
                let engine = owned.as_ref().map(|(engine, _)| engine.clone()).expect("guarded");
                let written = engine.stats().write_batches;
                if written != backed_up_at {
                    backed_up_at = written;
                    backup(&shared, partition, engine).await;
                }
            }
        }
        if owned.is_none() && !waiting.is_empty() {
            let opened = tokio::select! {
                _ = stop.changed() => break Ok(()),
                opened = open_when_free(&shared, partition) => opened,
            };
            let engine = match opened {
                Ok(engine) => engine,
                Err(error) => break Err(error),
            };
            let handler = match handler_for(&shared, &engine, partition, &publisher, &connected) {
                Ok(handler) => Arc::new(handler),
                Err(error) => break Err(error),
            };
            for delivery in waiting.drain(..) {
                let handler = handler.clone();
                tasks.spawn(async move { handler.handle(delivery).await });
            }
            owned = Some((engine, handler));
        }
    };
    if connected.load(Ordering::Acquire) && result.is_ok() {
        // A graceful stop: let the deliveries in flight finish (commit and ack).
        while let Some(done) = tasks.join_next().await {
            if let Ok(Err(error)) = done {
                eprintln!("rabbitmq_partitions: partition {partition}: {error}");
            }
        }
    } else {
        // The broker has given these deliveries to another consumer: cut them short. A claim
        // dropped before its commit writes nothing.
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    drop(waiting);
    if let Some(owned) = owned.take() {
        // The last handles of the store (the tasks above are gone): dropping them closes the
        // store and releases its lock, once a commit already handed to the committer thread
        // has been written.
        drop(owned);
        shared.event("release", "-", Some(partition));
    }
    let _ = channel.close(200, "partition released".into()).await;
    result
}

/// Opens the partition's store, retrying while another process still holds it.
async fn open_when_free(shared: &Shared, partition: usize) -> Result<idemdb::Engine, BoxError> {
    let dir = shared.options.stores.join(format!("partition-{partition}"));
    let mut refusals = 0u64;
    loop {
        let dir_for_open = dir.clone();
        let opened =
            tokio::task::spawn_blocking(move || open_partition_store(&dir_for_open, partition))
                .await?;
        match opened {
            Ok(engine) => {
                shared.event("open", &refusals.to_string(), Some(partition));
                return Ok(engine);
            }
            Err(idemdb::Error::AlreadyOpen { .. }) => {
                // The previous owner has not let go yet (paused, or still closing).
                refusals += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

fn handler_for(
    shared: &Shared,
    engine: &idemdb::Engine,
    partition: usize,
    publisher: &Channel,
    connected: &Arc<AtomicBool>,
) -> Result<Handler, BoxError> {
    let draws = shared.draws.fetch_add(1 << 32, Ordering::Relaxed);
    Ok(Handler {
        consumer: engine.consumer("orders")?,
        orders: engine.business_table("orders")?,
        effects: engine.business_table("effects")?,
        publisher: publisher.clone(),
        ledger: shared.ledger.clone(),
        partition: Some(partition),
        connected: connected.clone(),
        transient_failure_percent: shared.options.transient_failure_percent,
        kill_after_commit_per_mille: shared.options.kill_after_commit_per_mille,
        draws: AtomicU64::new(draws),
        seed: u64::from(std::process::id()) ^ engine.now_ms(),
    })
}

/// An online backup of the partition's store, taken while its handlers commit.
async fn backup(shared: &Shared, partition: usize, engine: idemdb::Engine) {
    let Some(backups) = &shared.options.backups else {
        return;
    };
    let sequence = shared.checkpoints.fetch_add(1, Ordering::Relaxed);
    let name = format!(
        "partition-{partition}-pid-{}-{sequence}",
        std::process::id()
    );
    let dir = backups.join(&name);
    shared.event("checkpoint-start", &name, Some(partition));
    let taken = tokio::task::spawn_blocking(move || engine.checkpoint(&dir)).await;
    match taken {
        Ok(Ok(())) => shared.event("checkpoint-done", &name, Some(partition)),
        Ok(Err(error)) => {
            eprintln!("rabbitmq_partitions: checkpoint {name}: {error}");
            shared.event("checkpoint-failed", &name, Some(partition));
        }
        Err(error) => {
            eprintln!("rabbitmq_partitions: checkpoint {name}: {error}");
            shared.event("checkpoint-failed", &name, Some(partition));
        }
    }
}
