//! The least a claim can cost on PostgreSQL when it and the business row are statements between
//! `BEGIN` and `COMMIT`: the floor under idemdb-postgres, measured beside it and beside the raw
//! insert it is held against.
//!
//! A delivery is one transaction on a table whose primary key is the dedup key: `BEGIN`, an
//! `INSERT ... ON CONFLICT DO NOTHING` of the key that fails (division by zero) when the key
//! was there, which aborts the rest, the business row, `COMMIT`; all four sent together, in
//! one round trip, as `PgConsumer::apply` sends its statements. A batch claims its keys with
//! one multi-row insert that returns the winners (first round trip) and writes the winners'
//! business rows and commits (second), as `begin_batch` and `commit_with` do. Its batch that
//! answers duplicates in one round trip does both in one statement: the markers' insert returns
//! the winners, whose business rows the same statement inserts, sent with `BEGIN` and `COMMIT`.
//!
//! What it leaves out, and idemdb-postgres does not: a second claimant of a held key waits
//! for the holder's transaction to end instead of hearing "in progress" at once; a duplicate
//! gets no stored result, fingerprint or state; nothing expires. So it bounds from above what
//! a design of the backend that runs its statements between `BEGIN` and `COMMIT`, as
//! tokio-postgres sends them, could reach on the same server, whatever it does about those.

use anyhow::Result;
use futures_util::future::{join, join3, join4};
use tokio::runtime::Runtime;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Statement};

use crate::contenders::pg_backend::runtime;
use crate::workloads::{Delivery, Session};

/// The floor's own schema, apart from the raw peer's tables and idemdb-postgres's.
const SCHEMA: &str = "bench_floor";

/// The claim of one key: fails, and aborts the transaction, when the key was already there.
const CLAIM: &str = "WITH claimed AS ( \
         INSERT INTO bench_floor.inbox (key, value) VALUES ($1, $2) \
         ON CONFLICT DO NOTHING RETURNING 1 \
     ) SELECT 1 / count(*)::int4 FROM claimed";

/// The business row of a fresh delivery.
const ORDER: &str = "INSERT INTO bench_floor.orders (key, value) VALUES ($1, $2)";

/// The claim of a batch's keys: the rows it inserted are the winners.
const CLAIM_MANY: &str = "INSERT INTO bench_floor.inbox (key, value) \
     SELECT * FROM unnest($1::bytea[], $2::bytea[]) ON CONFLICT DO NOTHING \
     RETURNING key, value";

/// A batch's keys claimed and the winners' business rows written in one statement, which
/// answers the winners (every key it does not return was a duplicate).
const CLAIM_MANY_WITH_ROWS: &str = "WITH claimed AS ( \
         INSERT INTO bench_floor.inbox (key, value) \
         SELECT * FROM unnest($1::bytea[], $2::bytea[]) ON CONFLICT DO NOTHING \
         RETURNING key, value \
     ), ordered AS ( \
         INSERT INTO bench_floor.orders (key, value) SELECT key, value FROM claimed \
     ) SELECT key FROM claimed";

/// The business rows of a batch's winners.
const ORDERS: &str = "INSERT INTO bench_floor.orders (key, value) \
     SELECT * FROM unnest($1::bytea[], $2::bytea[])";

/// Drops and re-creates the floor's tables: every run starts empty.
pub fn reset(port: u16) -> Result<()> {
    runtime()?.block_on(async {
        let client = crate::contenders::pg_backend::connect(port, true).await?;
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}; \
                 CREATE TABLE {SCHEMA}.inbox (key bytea PRIMARY KEY, value bytea NOT NULL); \
                 CREATE TABLE {SCHEMA}.orders (key bytea PRIMARY KEY, value bytea NOT NULL); \
                 CHECKPOINT;"
            ))
            .await?;
        Ok(())
    })
}

pub struct ClaimFloorSession {
    /// A single delivery waits for its claim's answer before sending the business row and
    /// `COMMIT` (two round trips).
    two_trips: bool,
    /// A batch claims its keys, writes the winners' business rows and commits in one round
    /// trip ([`CLAIM_MANY_WITH_ROWS`]) instead of two.
    one_trip_batch: bool,
    runtime: Runtime,
    client: Client,
    claim: Statement,
    order: Statement,
    claim_many: Statement,
    orders: Statement,
    claim_many_with_rows: Statement,
}

impl ClaimFloorSession {
    pub fn connect(port: u16, two_trips: bool, one_trip_batch: bool) -> Result<ClaimFloorSession> {
        let runtime = runtime()?;
        let (client, [claim, order, claim_many, orders, claim_many_with_rows]) =
            runtime.block_on(async {
                let client = crate::contenders::pg_backend::connect(port, true).await?;
                let mut prepared = Vec::new();
                for sql in [CLAIM, ORDER, CLAIM_MANY, ORDERS, CLAIM_MANY_WITH_ROWS] {
                    prepared.push(client.prepare(sql).await?);
                }
                let prepared: [Statement; 5] = prepared
                    .try_into()
                    .map_err(|_| anyhow::anyhow!("five statements prepared"))?;
                anyhow::Ok((client, prepared))
            })?;
        Ok(ClaimFloorSession {
            two_trips,
            one_trip_batch,
            runtime,
            client,
            claim,
            order,
            claim_many,
            orders,
            claim_many_with_rows,
        })
    }
}

impl Session for ClaimFloorSession {
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let ClaimFloorSession {
            two_trips,
            one_trip_batch,
            runtime,
            client,
            claim,
            order,
            claim_many,
            orders,
            claim_many_with_rows,
        } = self;
        let client: &Client = client;
        runtime.block_on(async {
            if let [delivery] = deliveries
                && *two_trips
            {
                let (key, value) = (delivery.peer_key(), delivery.value());
                let (key, value): (&[u8], &[u8]) = (&key, &value);
                let (begun, claimed) = join(
                    client.batch_execute("BEGIN"),
                    client.execute(claim, &[&key, &value]),
                )
                .await;
                begun?;
                match claimed {
                    Ok(_) => {
                        let (ordered, committed) = join(
                            client.execute(order, &[&key, &value]),
                            client.batch_execute("COMMIT"),
                        )
                        .await;
                        ordered?;
                        committed?;
                    }
                    Err(error) if error.code() == Some(&SqlState::DIVISION_BY_ZERO) => {
                        client.batch_execute("ROLLBACK").await?;
                    }
                    Err(error) => return Err(error.into()),
                }
                return Ok(());
            }
            if let [delivery] = deliveries {
                let (key, value) = (delivery.peer_key(), delivery.value());
                let (key, value): (&[u8], &[u8]) = (&key, &value);
                // Polled in order, so sent in order without waiting in between.
                let (begun, claimed, ordered, committed) = join4(
                    client.batch_execute("BEGIN"),
                    client.execute(claim, &[&key, &value]),
                    client.execute(order, &[&key, &value]),
                    client.batch_execute("COMMIT"),
                )
                .await;
                begun?;
                match claimed {
                    Ok(_) => {
                        ordered?;
                        committed?;
                    }
                    // A duplicate: the transaction rolled back with nothing written.
                    Err(error) if error.code() == Some(&SqlState::DIVISION_BY_ZERO) => {
                        committed?;
                    }
                    Err(error) => return Err(error.into()),
                }
                return Ok(());
            }
            let keys: Vec<Vec<u8>> = deliveries.iter().map(|d| d.peer_key().to_vec()).collect();
            let values: Vec<Vec<u8>> = deliveries.iter().map(|d| d.value().to_vec()).collect();
            if *one_trip_batch {
                let (begun, winners, committed) = join3(
                    client.batch_execute("BEGIN"),
                    client.query(claim_many_with_rows, &[&keys, &values]),
                    client.batch_execute("COMMIT"),
                )
                .await;
                begun?;
                // The winners are the answer a consumer acknowledges by; a failed statement
                // rolled everything back (the COMMIT then answers a rollback).
                let winners = winners?;
                committed?;
                anyhow::ensure!(winners.len() <= keys.len(), "more winners than keys");
                return Ok(());
            }
            let (begun, winners) = join(
                client.batch_execute("BEGIN"),
                client.query(claim_many, &[&keys, &values]),
            )
            .await;
            begun?;
            let winners = match winners {
                Ok(winners) => winners,
                Err(error) => {
                    client.batch_execute("ROLLBACK").await?;
                    return Err(error.into());
                }
            };
            let keys: Vec<&[u8]> = winners.iter().map(|row| row.get(0)).collect();
            let values: Vec<&[u8]> = winners.iter().map(|row| row.get(1)).collect();
            let (ordered, committed) = join(
                client.execute(orders, &[&keys, &values]),
                client.batch_execute("COMMIT"),
            )
            .await;
            ordered?;
            committed?;
            Ok(())
        })
    }
}
