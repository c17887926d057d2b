//! One worker: its own channel and PostgreSQL connection, one delivery at a time, claimed in
//! PostgreSQL (with `begin` and `commit`, or with `apply`) or, as the negative control, in a
//! store of this process's own; what became of each delivery, and why one was not handled.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_lite::StreamExt;
use idemdb::{Fingerprint, Message, Outcome};
use idemdb_postgres::PgConsumer;
use lapin::Channel;
use lapin::options::BasicAckOptions;
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use crate::connect;
use crate::handler::{self, BoxError, dead_letter, requeue};
use crate::ledger::{Ledger, monotonic_ns};
use crate::orders::{APPLY_EFFECT, chain};

/// Where claims are made: the shared PostgreSQL tables, or (negative control) a store of this
/// process's own.
pub(crate) enum Claims {
    Postgres(PgConsumer),
    Embedded(idemdb::Consumer),
}

pub(crate) struct Worker {
    pub(crate) claims: Arc<Claims>,
    pub(crate) pg: String,
    pub(crate) publisher: Channel,
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) kill_after_commit_per_mille: u64,
    pub(crate) draws: Arc<AtomicU64>,
    /// Handles orders with `PgConsumer::apply` instead of `begin` and `commit`.
    pub(crate) apply: bool,
}

impl Worker {
    pub(crate) async fn consume(self, mut deliveries: lapin::Consumer) -> Result<(), BoxError> {
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
        let began_ns = monotonic_ns();
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
