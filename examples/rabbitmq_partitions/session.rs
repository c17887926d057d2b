//! One broker connection of the process (a session): it subscribes to every partition queue,
//! watches for the connection's loss (an error from the connection, or a pause longer than the
//! heartbeat), and releases every partition it owns before it returns.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::watch;

use crate::Shared;
use crate::orders::BoxError;
use crate::orders::{DEAD_LETTER_QUEUE, partition_queue, partition_queue_arguments};
use crate::partition::own_partition;

pub(crate) enum Ended {
    Terminated,
    ConnectionLost,
}

/// How long a pause (the process stopped or starved) must last for this process to presume
/// its connection lost: the heartbeat interval of the connection string in `main.rs`'s header
/// (2 s), past which the broker starts counting missed heartbeats.
const PAUSE_PRESUMED_LOST: Duration = Duration::from_secs(2);

/// One broker connection: subscribes to every partition queue, owns whichever partitions the
/// broker delivers, and releases all of them before it returns.
pub(crate) async fn session(
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
            const TICK: Duration = Duration::from_millis(200);
            let mut last = Instant::now();
            loop {
                tokio::time::sleep(TICK).await;
                let late = last.elapsed().saturating_sub(TICK);
                last = Instant::now();
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
    // Subscribing takes a while (the pause between preferred and other partitions), and the
    // partitions subscribed first may be owned, and committing, before it is done. A lost
    // connection or a SIGTERM meanwhile ends it: a request to the broker on a connection that
    // went away during a pause (SIGSTOP) can wait forever, and this session must still notice,
    // and release the partitions already owned, below.
    let subscribing = tokio::select! {
        subscribed = subscribe(
            shared,
            &connection,
            &publisher,
            &connected,
            &lost_tx,
            &stop_rx,
            &mut partitions,
        ) => match subscribed {
            Ok(()) => None,
            Err(error) => {
                eprintln!("rabbitmq_partitions: subscribing: {error}");
                Some(Ended::ConnectionLost)
            }
        },
        _ = lost_rx.wait_for(|lost| *lost) => Some(Ended::ConnectionLost),
        _ = terminate.recv() => Some(Ended::Terminated),
    };
    let ended = match subscribing {
        Some(ended) => ended,
        None => tokio::select! {
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
