//! Where `nats_orders` claims an order and writes its effects: an embedded store of the
//! process's own (the effects staged on the claim, one durable batch), or PostgreSQL (the
//! effect written in the claim's transaction, with `begin` and `commit` or with one `apply`),
//! whose claims every process of a fleet sees.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream;
use idemdb::{BusinessTable, Fingerprint, Message, Outcome};
use idemdb_postgres::{PgConsumer, PgStore};
use tokio::sync::Mutex;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, NoTls};

use crate::Handler;
use crate::orders::{APPLY_EFFECT, BoxError, TOTAL_AMOUNT_KEY, chain, open_store, parse_amount};

/// What the handler does with a message once its claim is settled.
pub enum Decision {
    /// The effects are committed: ack (after the commit).
    Committed,
    /// Processed before: ack without effect.
    Duplicate,
    /// The order id was used before with other content (the stored fingerprint): dead-letter.
    Conflict(Fingerprint),
    /// No usable order id: dead-letter.
    Invalid,
    /// An outcome this consumer does not use (the admission floor, the ordering guard): ack.
    Skipped,
    /// Not processed now (the ledger kind says why): nack for a redelivery a little later.
    Later(&'static str),
}

pub enum Claims {
    Embedded {
        consumer: idemdb::Consumer,
        orders: BusinessTable,
        effects: BusinessTable,
    },
    Postgres {
        consumer: PgConsumer,
        /// One message at a time per process: the connection is the handler's alone, made anew
        /// when the server has closed it.
        client: Mutex<Client>,
        pg: String,
        apply: bool,
    },
}

impl Claims {
    pub fn embedded(dir: &Path) -> Result<Claims, BoxError> {
        let engine = open_store(dir)?;
        Ok(Claims::Embedded {
            consumer: engine.consumer("orders")?,
            orders: engine.business_table("orders")?,
            effects: engine.business_table("effects")?,
        })
    }

    /// The store in the database at `pg`, whose tables must be installed.
    pub async fn postgres(pg: &str, apply: bool) -> Result<Claims, BoxError> {
        let client = connect(pg).await;
        let store = PgStore::builder().open(&client).await?;
        Ok(Claims::Postgres {
            consumer: store.consumer("orders")?,
            client: Mutex::new(client),
            pg: pg.to_owned(),
            apply,
        })
    }

    /// Where the claims go, for the start-up line.
    pub fn describe(&self, dir: &Path) -> String {
        match self {
            Claims::Embedded { .. } => dir.display().to_string(),
            Claims::Postgres { apply: true, .. } => "PostgreSQL (apply)".into(),
            Claims::Postgres { apply: false, .. } => "PostgreSQL (begin and commit)".into(),
        }
    }

    /// Claims the order and, when the claim is won, commits its effects with the marker.
    pub async fn claim_and_apply(
        &self,
        handler: &Handler,
        message: &jetstream::Message,
        order_id: &str,
        fingerprint: Fingerprint,
    ) -> Result<Decision, BoxError> {
        match self {
            Claims::Embedded {
                consumer,
                orders,
                effects,
            } => {
                let mut claim = match consumer.begin(order_id, fingerprint) {
                    Ok(Outcome::Fresh(claim)) => claim,
                    Ok(other) => return Ok(settled(other)),
                    Err(idemdb::Error::LimitExceeded { .. }) => return Ok(Decision::Invalid),
                    Err(error) if error.is_retryable() => return Ok(Decision::Later("retry")),
                    Err(error) => return Err(error.into()),
                };
                let amount = parse_amount(&message.payload).unwrap_or(0);
                claim.put(orders, order_id, &message.payload)?;
                claim.merge(effects, order_id, 1u64.to_be_bytes())?;
                claim.merge(effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
                handler.ack_before_commit(message, order_id).await?;
                handler.event("submit", order_id);
                match claim.commit_async(b"accepted").await {
                    Ok(_) => Ok(Decision::Committed),
                    Err(error) if error.is_retryable() => Ok(Decision::Later("retry")),
                    Err(error) => Err(error.into()),
                }
            }
            Claims::Postgres {
                consumer,
                client,
                pg,
                apply,
            } => {
                let mut client = client.lock().await;
                if client.is_closed() {
                    *client = connect(pg).await;
                }
                let body = String::from_utf8_lossy(&message.payload).into_owned();
                let decided = if *apply {
                    handler.ack_before_commit(message, order_id).await?;
                    handler.event("submit", order_id);
                    let effect: [(&(dyn ToSql + Sync), Type); 2] =
                        [(&order_id, Type::TEXT), (&body, Type::TEXT)];
                    consumer
                        .apply(
                            &mut client,
                            &Message::new(order_id, fingerprint),
                            b"accepted",
                            &[(APPLY_EFFECT, &effect)],
                        )
                        .await
                        .map(|outcome| match outcome {
                            Outcome::Fresh(_) => {
                                handler.event("by_apply", order_id);
                                Decision::Committed
                            }
                            other => settled(other),
                        })
                } else {
                    claim_in_postgres(handler, consumer, &mut client, message, order_id, &body)
                        .await
                };
                match decided {
                    Ok(decision) => Ok(decision),
                    Err(idemdb_postgres::Error::Idemdb(idemdb::Error::LimitExceeded {
                        ..
                    })) => Ok(Decision::Invalid),
                    // The connection or the server, as the error docs say: a redelivery finds
                    // the order `Duplicate` (a commit that landed) or `Fresh`, never half of it.
                    Err(error) if error.is_retryable() => {
                        eprintln!("nats_orders: {order_id}: {}; nack", chain(&error));
                        Ok(Decision::Later("db_error"))
                    }
                    Err(error) => Err(error.into()),
                }
            }
        }
    }

    /// The negative control without markers: the same effects committed for every delivery (a
    /// store that does not deduplicate), each under a key of its own in the embedded store and
    /// in a transaction of its own in PostgreSQL. A redelivery applies the order again.
    pub async fn apply_without_markers(
        &self,
        handler: &Handler,
        message: &jetstream::Message,
        order_id: &str,
    ) -> Result<Decision, BoxError> {
        match self {
            Claims::Embedded {
                consumer,
                orders,
                effects,
            } => {
                let delivery = format!(
                    "{order_id}/{}/{}",
                    std::process::id(),
                    handler.draws.fetch_add(1, Ordering::Relaxed)
                );
                let Outcome::Fresh(mut claim) =
                    consumer.begin(&delivery, Fingerprint::of(&message.payload))?
                else {
                    return Err(format!("{delivery} was not fresh").into());
                };
                let amount = parse_amount(&message.payload).unwrap_or(0);
                claim.put(orders, order_id, &message.payload)?;
                claim.merge(effects, order_id, 1u64.to_be_bytes())?;
                claim.merge(effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
                claim.commit_async(b"accepted").await?;
            }
            Claims::Postgres { client, pg, .. } => {
                let mut client = client.lock().await;
                if client.is_closed() {
                    *client = connect(pg).await;
                }
                let body = String::from_utf8_lossy(&message.payload).into_owned();
                if let Err(error) = client.execute(APPLY_EFFECT, &[&order_id, &body]).await {
                    eprintln!("nats_orders: {order_id}: {error}; nack");
                    return Ok(Decision::Later("db_error"));
                }
            }
        }
        Ok(Decision::Committed)
    }
}

/// `begin`, the effect in the claim's transaction, and `commit`.
async fn claim_in_postgres(
    handler: &Handler,
    consumer: &PgConsumer,
    client: &mut Client,
    message: &jetstream::Message,
    order_id: &str,
    body: &str,
) -> Result<Decision, idemdb_postgres::Error> {
    let fingerprint = Fingerprint::of(&message.payload);
    let claim = match consumer.begin(client, order_id, fingerprint).await? {
        Outcome::Fresh(claim) => claim,
        other => return Ok(settled(other)),
    };
    claim
        .transaction()
        .execute(APPLY_EFFECT, &[&order_id, &body])
        .await?;
    // The control's ack cannot fail the claim: a failure to send it only leaves the order for
    // a redelivery, as a lost ack would.
    if let Err(error) = handler.ack_before_commit(message, order_id).await {
        eprintln!("nats_orders: {order_id}: early ack: {error}");
    }
    handler.event("submit", order_id);
    claim.commit(b"accepted").await?;
    Ok(Decision::Committed)
}

/// Every outcome but `Fresh`, whichever store it came from.
fn settled<C>(outcome: Outcome<C>) -> Decision {
    match outcome {
        Outcome::Duplicate { .. } => Decision::Duplicate,
        Outcome::Conflict {
            stored_fingerprint, ..
        } => Decision::Conflict(stored_fingerprint),
        Outcome::InProgress { .. } => Decision::Later("in_progress"),
        Outcome::TooLate { .. } | Outcome::Stale { .. } => Decision::Skipped,
        // A won claim is handled by the caller before it asks here.
        Outcome::Fresh(_) => Decision::Later("unexpected"),
    }
}

/// A connection to `pg`, retried until the server answers.
async fn connect(pg: &str) -> Client {
    loop {
        match tokio_postgres::connect(pg, NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                return client;
            }
            Err(error) => {
                eprintln!("nats_orders: connecting to PostgreSQL: {error}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
