//! idemdb's PostgreSQL backend (`idemdb-postgres`) as a contender: each delivery is a claim
//! whose transaction also writes the business row, sent with the commit of the completed
//! record (`commit_with`: two round trips in all), or sent with the claim (`apply`: one round
//! trip for a new key).
//! Its peer is the raw `INSERT ... ON CONFLICT DO NOTHING` of [`crate::contenders::peers::PostgresSession`],
//! on the same server with the same `synchronous_commit`, which writes the dedup row only.
//!
//! The backend is async (tokio-postgres); each session drives its own single-threaded runtime,
//! as the synchronous `postgres` client of the raw peer does internally.

use anyhow::{Context, Result};
use idemdb::{Fingerprint, Message, Outcome};
use idemdb_postgres::{Names, PgBatchOutcome, PgConsumer, PgStore, install};
use tokio::runtime::Runtime;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, NoTls};

use crate::servers::postgres_url;
use crate::workloads::{CONSUMER, Delivery, Session};

/// The schema of the backend's tables and the business table, apart from the raw peer's.
const SCHEMA: &str = "bench_idemdb";

/// The business row of a fresh delivery, in the claim's transaction.
const INSERT_ORDER: &str = "INSERT INTO bench_idemdb.orders (key, value) VALUES ($1, $2)";

/// The business rows of a batch's winners, in one statement.
const INSERT_ORDERS: &str = "INSERT INTO bench_idemdb.orders (key, value) \
     SELECT * FROM unnest($1::bytea[], $2::bytea[])";

/// The single-threaded runtime each PostgreSQL session of the harness drives.
pub fn runtime() -> Result<Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

pub async fn connect(port: u16, synchronous_commit: bool) -> Result<Client> {
    let (client, connection) = tokio_postgres::connect(&postgres_url(port), NoTls)
        .await
        .context("connecting to postgres")?;
    tokio::spawn(connection);
    let setting = if synchronous_commit { "on" } else { "off" };
    client
        .batch_execute(&format!("SET synchronous_commit = {setting}"))
        .await?;
    Ok(client)
}

pub fn names() -> Result<Names> {
    Ok(Names::new(SCHEMA, "records")?)
}

/// Drops and re-creates the backend's tables and the business table: every run starts empty.
pub fn reset(port: u16) -> Result<()> {
    runtime()?.block_on(async {
        let mut client = connect(port, true).await?;
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}; \
                 CREATE TABLE {SCHEMA}.orders (key bytea PRIMARY KEY, value bytea NOT NULL);"
            ))
            .await?;
        install(&mut client, &names()?).await?;
        client.batch_execute("CHECKPOINT").await?;
        Ok(())
    })
}

pub struct IdemdbPgSession {
    runtime: Runtime,
    client: Client,
    consumer: PgConsumer,
    /// Single deliveries go through `PgConsumer::apply` instead of `begin` + `commit_with`.
    apply: bool,
}

impl IdemdbPgSession {
    pub fn connect(port: u16, synchronous_commit: bool, apply: bool) -> Result<IdemdbPgSession> {
        IdemdbPgSession::connect_with(port, synchronous_commit, apply, None)
    }

    /// [`IdemdbPgSession::connect`] with a store of `retention` (the default when `None`).
    pub fn connect_with(
        port: u16,
        synchronous_commit: bool,
        apply: bool,
        retention: Option<std::time::Duration>,
    ) -> Result<IdemdbPgSession> {
        let runtime = runtime()?;
        let (client, consumer) = runtime.block_on(async {
            let client = connect(port, synchronous_commit).await?;
            let mut builder = PgStore::builder().names(names()?);
            if let Some(retention) = retention {
                builder = builder.retention(retention);
            }
            let store = builder.open(&client).await?;
            let consumer = store.consumer(CONSUMER)?;
            anyhow::Ok((client, consumer))
        })?;
        Ok(IdemdbPgSession {
            runtime,
            client,
            consumer,
            apply,
        })
    }
}

impl Session for IdemdbPgSession {
    /// One delivery: a claim, the business row in its transaction, the commit. Several: one
    /// batch claim, the winners' business rows in one statement, one commit.
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let IdemdbPgSession {
            runtime,
            client,
            consumer,
            apply,
        } = self;
        runtime.block_on(async {
            if let [delivery] = deliveries
                && *apply
            {
                let value = delivery.value();
                let params: [(&(dyn ToSql + Sync), Type); 2] = [
                    (&&delivery.key[..], Type::BYTEA),
                    (&&value[..], Type::BYTEA),
                ];
                let message = Message::new(&delivery.key[..], Fingerprint::of(value));
                match consumer
                    .apply(client, &message, b"", &[(INSERT_ORDER, &params)])
                    .await?
                {
                    Outcome::Fresh(_) | Outcome::Duplicate { .. } => {}
                    other => anyhow::bail!("unexpected outcome {other:?}"),
                }
                return Ok(());
            }
            if let [delivery] = deliveries {
                let value = delivery.value();
                let fingerprint = Fingerprint::of(value);
                match consumer.begin(client, delivery.key, fingerprint).await? {
                    Outcome::Fresh(claim) => {
                        let params: [(&(dyn ToSql + Sync), Type); 2] = [
                            (&&delivery.key[..], Type::BYTEA),
                            (&&value[..], Type::BYTEA),
                        ];
                        claim.commit_with(b"", &[(INSERT_ORDER, &params)]).await?;
                    }
                    Outcome::Duplicate { .. } => {}
                    other => anyhow::bail!("unexpected outcome {other:?}"),
                }
                return Ok(());
            }
            let values: Vec<_> = deliveries.iter().map(Delivery::value).collect();
            let messages: Vec<_> = deliveries
                .iter()
                .zip(&values)
                .map(|(delivery, value)| (delivery.key, Fingerprint::of(value)))
                .collect();
            let batch = consumer.begin_batch(client, &messages).await?;
            let mut keys: Vec<&[u8]> = Vec::new();
            let mut fresh_values: Vec<&[u8]> = Vec::new();
            for (index, outcome) in batch.outcomes().iter().enumerate() {
                match outcome {
                    PgBatchOutcome::Fresh => {
                        keys.push(&deliveries[index].key);
                        fresh_values.push(&values[index]);
                    }
                    PgBatchOutcome::DuplicateInBatch { .. }
                    | PgBatchOutcome::Settled(Outcome::Duplicate { .. }) => {}
                    other => anyhow::bail!("unexpected batch outcome {other:?}"),
                }
            }
            let params: [(&(dyn ToSql + Sync), Type); 2] = [
                (&keys, Type::BYTEA_ARRAY),
                (&fresh_values, Type::BYTEA_ARRAY),
            ];
            let orders: &[idemdb_postgres::TypedStatement<'_>] = if keys.is_empty() {
                &[]
            } else {
                &[(INSERT_ORDERS, &params)]
            };
            batch.commit_with(|_| b"", orders).await?;
            Ok(())
        })
    }
}
