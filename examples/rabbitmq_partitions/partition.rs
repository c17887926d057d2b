//! One partition queue's subscription: the handoff of the partition's store (opened on the
//! first delivery, retried while the previous owner holds it, closed when the session ends),
//! its deliveries handled, and its online backups.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::Channel;
use tokio::sync::watch;

use crate::Shared;
use crate::handler::{BoxError, Committing, Handler};
use crate::orders::open_partition_store;

/// One partition queue's subscription: idle while another process is its active consumer;
/// the owner of the partition's store from its first delivery until the session ends.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn own_partition(
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
    // The commits in flight of the store's deliveries, acked in order once durable (a pipeline
    // of the prefetch's depth), from the store's opening on.
    let mut pipeline: Option<idemdb::AsyncPipeline<Committing>> = None;
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
                match (&owned, pipeline.as_mut()) {
                    (Some((_, handler)), Some(pipeline)) => {
                        match handler.start(delivery).await {
                            Ok(Some(staged)) => {
                                pipeline.commit(staged.claim, b"accepted", staged.then).await;
                            }
                            Ok(None) => {}
                            // A failed ack means the channel is gone; anything else (a poisoned
                            // store) ends the session as well: the broker hands the partition on.
                            Err(error) => break Err(error),
                        }
                    }
                    _ => {
                        // The broker made this process the partition's active consumer: the
                        // store is opened below, outside this `select!`.
                        if waiting.is_empty() {
                            shared.event("active", "-", Some(partition));
                        }
                        waiting.push(delivery);
                    }
                }
            }
            Some(settled) = async { pipeline.as_mut().expect("guarded").next_settled().await },
                if pipeline.as_ref().is_some_and(|pipeline| !pipeline.is_empty()) =>
            {
                let handler = owned.as_ref().map(|(_, handler)| handler.clone()).expect("guarded");
                if let Err(error) = handler.finish(settled.tag, settled.outcome.map(|_| ())).await {
                    break Err(error);
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
            let mut commits = match handler
                .consumer
                .async_pipeline(usize::from(shared.options.prefetch))
            {
                Ok(commits) => commits,
                Err(error) => break Err(error.into()),
            };
            let mut failed = None;
            for delivery in waiting.drain(..) {
                match handler.start(delivery).await {
                    Ok(Some(staged)) => {
                        commits.commit(staged.claim, b"accepted", staged.then).await
                    }
                    Ok(None) => {}
                    Err(error) => {
                        failed = Some(error);
                        break;
                    }
                }
            }
            pipeline = Some(commits);
            owned = Some((engine, handler));
            if let Some(error) = failed {
                break Err(error);
            }
        }
    };
    if let (Some(mut commits), Some((_, handler))) = (pipeline.take(), &owned) {
        // The commits in flight are written whatever happens (they were handed over); the
        // store closes once they are.
        let settled = commits.wait().await;
        if connected.load(Ordering::Acquire) && result.is_ok() {
            // A graceful stop: ack what is durable.
            for settled in settled {
                if let Err(error) = handler
                    .finish(settled.tag, settled.outcome.map(|_| ()))
                    .await
                {
                    eprintln!("rabbitmq_partitions: partition {partition}: {error}");
                }
            }
        }
        // Otherwise the broker has given these deliveries to another consumer: no ack (their
        // redeliveries there are duplicates).
    }
    drop(waiting);
    if let Some(owned) = owned.take() {
        // The last handles of the store (its pipeline is drained): dropping them closes the
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
