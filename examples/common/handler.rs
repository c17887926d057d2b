//! The delivery handler the RabbitMQ consumers share (`rabbitmq_orders`: a store per process;
//! `rabbitmq_partitions`: a store per partition it owns).
//!
//! For each delivery:
//!
//! - `Fresh`: stage the business writes on the claim (the order row, a per-order effect counter,
//!   the running total), commit them with the marker in one durable batch, then ack (`start`
//!   stages, the caller commits through its pipeline, and `finish` acks once it settles).
//! - `Duplicate`: ack without effect (the broker redelivered, or the producer resent).
//! - `Conflict` (same order id, other content): publish to the dead-letter queue with both
//!   fingerprints in headers, wait for the broker's confirm, then ack.
//! - `InProgress` (another delivery of the order is being processed), a transient failure, or a
//!   retryable idemdb error: nack with requeue; the broker redelivers it later. Any other idemdb
//!   error (a poisoned engine) is returned: the caller stops, the broker requeues what it held.

// Each consumer uses its own part of this module.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use idemdb::{Fingerprint, Outcome};
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};

use crate::ledger::{Ledger, monotonic_ns};

use crate::orders::{
    DEAD_LETTER_QUEUE, HEADER_ORDER_ID, HEADER_RECEIVED_FINGERPRINT, HEADER_STORED_FINGERPRINT,
    TOTAL_AMOUNT_KEY, parse_amount,
};

pub use crate::orders::BoxError;

/// Everything a delivery handler needs, shared by the concurrent handlers of one store.
pub struct Handler {
    pub consumer: idemdb::Consumer,
    pub orders: idemdb::BusinessTable,
    pub effects: idemdb::BusinessTable,
    pub publisher: Channel,
    pub ledger: Option<Arc<Ledger>>,
    /// The partition this store belongs to, for the ledger (`None`: a consumer of one queue).
    pub partition: Option<usize>,
    /// Cleared when the broker connection is lost: a claim not yet committed is then dropped,
    /// so a process that lost its channel stops committing (its deliveries go to another
    /// consumer, which must find their keys free or committed, never half done).
    pub connected: Arc<AtomicBool>,
    /// Percent of fresh claims dropped and nacked, as a transient failure would.
    pub transient_failure_percent: u64,
    /// Per mille of commits after which the process SIGKILLs itself before the ack: the crash
    /// point that turns a redelivery into a duplicate, hit on purpose.
    pub kill_after_commit_per_mille: u64,
    pub draws: AtomicU64,
    pub seed: u64,
}

impl Handler {
    fn event(&self, kind: &str, order_id: &str) {
        if let Some(ledger) = &self.ledger {
            ledger.event(kind, order_id, self.partition);
        }
    }

    /// A pseudo-random draw in 0..bound, different in every process.
    fn draw(&self, bound: u64) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), self.seed) % bound
    }

    /// Handles one delivery up to its commit: every outcome but a fresh claim is settled here
    /// (acked, nacked or dead-lettered); a fresh claim comes back with its writes staged, for
    /// the caller to commit through its pipeline and then to [`Handler::finish`].
    pub async fn start(
        &self,
        delivery: lapin::message::Delivery,
    ) -> Result<Option<Staged>, BoxError> {
        let order_id = order_id(&delivery);
        if delivery.redelivered {
            // Evidence that the kills bite: the broker hands over what a dead consumer held.
            self.event("redelivered", &order_id);
        }
        let fingerprint = Fingerprint::of(&delivery.data);
        let outcome = match self.consumer.begin(&order_id, fingerprint) {
            Ok(outcome) => outcome,
            Err(idemdb::Error::LimitExceeded { .. }) => {
                // No usable order id: a poison message, not something a retry can fix.
                dead_letter(&self.publisher, &delivery, &order_id, None, fingerprint).await?;
                self.event("invalid", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
                return Ok(None);
            }
            Err(error) if error.is_retryable() => {
                // The store is busy for a moment: let the broker redeliver.
                self.event("retry", &order_id);
                delivery.nack(requeue()).await?;
                return Ok(None);
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
                    return Ok(None);
                }
                let amount = parse_amount(&delivery.data).unwrap_or(0);
                claim.put(&self.orders, &order_id, &delivery.data)?;
                claim.merge(&self.effects, &order_id, 1u64.to_be_bytes())?;
                claim.merge(&self.effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
                let began_ns = monotonic_ns();
                if !self.connected.load(Ordering::Acquire) {
                    // The broker has given this delivery to another consumer: write nothing.
                    drop(claim);
                    self.event("withheld", &order_id);
                    return Ok(None);
                }
                // Logged before the commit is handed over: a commit still runs if this task is
                // aborted, and must be accounted for then too.
                self.event("submit", &order_id);
                return Ok(Some(Staged {
                    claim,
                    then: Committing {
                        delivery,
                        order_id,
                        began_ns,
                    },
                }));
            }
            Outcome::Duplicate { .. } => {
                self.event("duplicate", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Outcome::Conflict {
                stored_fingerprint, ..
            } => {
                let stored = Some(stored_fingerprint);
                dead_letter(&self.publisher, &delivery, &order_id, stored, fingerprint).await?;
                self.event("conflict", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Outcome::InProgress { .. } => {
                // Another delivery of the order is being processed (here, a commit in flight).
                self.event("in_progress", &order_id);
                delivery.nack(requeue()).await?;
            }
            // Neither the admission floor nor the ordering guard is used here.
            Outcome::TooLate { .. } | Outcome::Stale { .. } => {
                self.event("skipped", &order_id);
                delivery.ack(BasicAckOptions::default()).await?;
            }
        }
        Ok(None)
    }

    /// Settles a delivery whose commit has its outcome: acked once durable (fsynced, grouped
    /// with other commits); nacked if nothing may have been written (a retryable error, or a
    /// pipeline that an earlier failure broke: a commit that did land makes the redelivery a
    /// duplicate); any other error is returned.
    pub async fn finish(
        &self,
        committing: Committing,
        outcome: Result<(), idemdb::Error>,
    ) -> Result<(), BoxError> {
        let Committing {
            delivery,
            order_id,
            began_ns,
        } = committing;
        match outcome {
            Ok(()) => {}
            Err(error)
                if error.is_retryable()
                    || matches!(error, idemdb::Error::PipelineBroken { .. }) =>
            {
                self.event("retry", &order_id);
                delivery.nack(requeue()).await?;
                return Ok(());
            }
            Err(error) => return Err(error.into()),
        }
        if let Some(ledger) = &self.ledger {
            ledger.event_since("fresh", &order_id, self.partition, began_ns);
        }
        if self.draw(1000) < self.kill_after_commit_per_mille {
            self.event("self-kill", &order_id);
            // SAFETY: raising a signal on our own process.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        delivery.ack(BasicAckOptions::default()).await?;
        Ok(())
    }
}

/// A fresh claim with its writes staged, and what settles its delivery once committed.
pub struct Staged {
    pub claim: idemdb::Claim,
    pub then: Committing,
}

/// A delivery whose claim is being committed.
pub struct Committing {
    pub delivery: lapin::message::Delivery,
    order_id: String,
    /// When its claim was staged, for the ledger's commit latency.
    began_ns: u64,
}

/// Publishes the delivery to the dead-letter queue through `publisher` (a channel in confirm
/// mode) with the order id and both fingerprints in headers, and waits for the broker's
/// confirm, so that the ack that follows never drops a message the DLQ does not hold.
pub async fn dead_letter(
    publisher: &Channel,
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
    let confirm = publisher
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

/// The delivery's order id: its AMQP `message_id` (empty when it has none).
pub fn order_id(delivery: &lapin::message::Delivery) -> String {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned())
        .unwrap_or_default()
}

pub fn requeue() -> BasicNackOptions {
    BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    }
}
