//! The idempotent consumer, the part to copy: each worker claims an order, stages its effects
//! on the claim and commits them with the marker in one batch, through a pipeline that keeps a
//! few commits in flight and acknowledges each delivery once its commit (and every one before
//! it) is durable; a redelivery of a committed order is a duplicate. The workers crash on
//! purpose now and then.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idemdb::{Durable, Engine, Fingerprint, Outcome, Settled, TableOptions, merge_ops};

use crate::Args;
use crate::broker::{Broker, Delivery, Rng};

/// One worker crash before commit per this many fresh claims.
const CRASH_BEFORE_COMMIT_EVERY: u64 = 5_000;
/// One worker crash between commit and ack per this many commits.
const CRASH_BEFORE_ACK_EVERY: u64 = 5_000;

/// The order's content: what its fingerprint covers.
pub(crate) fn order_body(order: u64) -> String {
    format!(
        "order {order}: {} units of sku-{}",
        order % 7 + 1,
        order % 101
    )
}

pub(crate) fn order_key(order: u64) -> String {
    format!("order-{order:010}")
}

#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) deliveries: AtomicU64,
    pub(crate) fresh: AtomicU64,
    pub(crate) committed: AtomicU64,
    pub(crate) duplicate: AtomicU64,
    pub(crate) in_progress: AtomicU64,
    pub(crate) conflict: AtomicU64,
    pub(crate) crash_before_commit: AtomicU64,
    pub(crate) crash_before_ack: AtomicU64,
}

pub(crate) fn open(args: &Args, dir: &std::path::Path) -> idemdb::Result<Engine> {
    Engine::builder(dir)
        .durability(args.durability)
        .business_table(TableOptions::new("orders"))
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()
}

/// Commits one worker keeps in flight: it claims the next deliveries while the engine makes
/// the earlier ones durable.
const PIPELINE_DEPTH: usize = 4;

/// What a worker does with a delivery once its entry in the pipeline settles.
enum Then {
    Ack,
    /// A crash after the commit, before the ack: the redelivery must be a duplicate.
    CrashBeforeAck,
}

/// One worker: takes deliveries until the queue is drained or the process "crashes".
fn work(
    engine: &Engine,
    broker: &Broker,
    counts: &Counts,
    crash: &AtomicBool,
    seed: u64,
) -> idemdb::Result<()> {
    let consumer = engine.consumer("order-service")?;
    let orders = engine.business_table("orders")?;
    let effects = engine.business_table("effects")?;
    let mut pipeline = consumer.pipeline::<(Delivery, Then)>(PIPELINE_DEPTH)?;
    let mut rng = Rng(seed);
    while broker.unacked.load(Ordering::SeqCst) > 0 {
        settle(&mut pipeline.settled(), broker, counts)?;
        let Ok(delivery) = broker.deliveries.recv_timeout(Duration::from_millis(5)) else {
            continue;
        };
        if crash.load(Ordering::SeqCst) {
            // The process died with this delivery and those in its pipeline unacknowledged:
            // the broker redelivers them all (commits in flight stand: their redeliveries are
            // duplicates).
            broker.redeliver(delivery);
            for settled in pipeline.wait() {
                if let Durable::Claim(_) = settled.outcome? {
                    counts.committed.fetch_add(1, Ordering::Relaxed);
                }
                broker.redeliver(settled.tag.0);
            }
            return Ok(());
        }
        counts.deliveries.fetch_add(1, Ordering::Relaxed);
        let key = order_key(delivery.order);
        let body = order_body(delivery.order);
        match consumer.begin(&key, Fingerprint::of(&body))? {
            Outcome::Fresh(mut claim) => {
                counts.fresh.fetch_add(1, Ordering::Relaxed);
                claim.put(&orders, &key, &body)?;
                claim.merge(&effects, &key, 1u64.to_be_bytes())?;
                claim.merge(&effects, "total", 1u64.to_be_bytes())?;
                if rng.below(CRASH_BEFORE_COMMIT_EVERY) == 0 {
                    // Crash before commit: the claim is dropped, nothing is written.
                    counts.crash_before_commit.fetch_add(1, Ordering::Relaxed);
                    drop(claim);
                    broker.redeliver(delivery);
                    continue;
                }
                let then = if rng.below(CRASH_BEFORE_ACK_EVERY) == 0 {
                    Then::CrashBeforeAck
                } else {
                    Then::Ack
                };
                // Acknowledged once durable, after every delivery before it.
                pipeline.commit(claim, format!("accepted {key}"), (delivery, then));
            }
            Outcome::Duplicate { .. } => {
                counts.duplicate.fetch_add(1, Ordering::Relaxed);
                pipeline.pass((delivery, Then::Ack));
            }
            Outcome::InProgress { .. } => {
                // Another worker (or a commit in flight) holds this order right now: nack, the
                // broker redelivers.
                counts.in_progress.fetch_add(1, Ordering::Relaxed);
                broker.redeliver(delivery);
            }
            Outcome::Conflict { .. } => {
                counts.conflict.fetch_add(1, Ordering::Relaxed);
                pipeline.pass((delivery, Then::Ack));
            }
            // The demo's messages carry no production time or version, so neither the admission
            // floor nor the ordering guard can apply.
            Outcome::TooLate { .. } | Outcome::Stale { .. } => {
                unreachable!("no admission floor or ordering guard in this demo")
            }
        }
    }
    settle(&mut pipeline.wait(), broker, counts)
}

/// Acknowledges the deliveries whose entries settled, in order.
fn settle(
    settled: &mut Vec<Settled<(Delivery, Then)>>,
    broker: &Broker,
    counts: &Counts,
) -> idemdb::Result<()> {
    for Settled {
        tag: (delivery, then),
        outcome,
    } in settled.drain(..)
    {
        if let Durable::Claim(_) = outcome? {
            counts.committed.fetch_add(1, Ordering::Relaxed);
        }
        match then {
            Then::Ack => broker.ack(),
            Then::CrashBeforeAck => {
                counts.crash_before_ack.fetch_add(1, Ordering::Relaxed);
                broker.redeliver(delivery);
            }
        }
    }
    Ok(())
}

pub(crate) fn run_workers(
    engine: &Engine,
    broker: &Arc<Broker>,
    counts: &Arc<Counts>,
    args: &Args,
    crash_at: Option<usize>,
    round: u64,
) -> idemdb::Result<()> {
    let crash = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..args.workers)
        .map(|index| {
            let (engine, broker, counts, crash) = (
                engine.clone(),
                broker.clone(),
                counts.clone(),
                crash.clone(),
            );
            std::thread::spawn(move || {
                work(
                    &engine,
                    &broker,
                    &counts,
                    &crash,
                    round * 1000 + index as u64 + 1,
                )
            })
        })
        .collect();
    if let Some(crash_at) = crash_at {
        while broker.unacked.load(Ordering::SeqCst) > crash_at {
            std::thread::sleep(Duration::from_millis(1));
        }
        crash.store(true, Ordering::SeqCst);
    }
    for worker in workers {
        worker.join().expect("worker thread panicked")?;
    }
    Ok(())
}
