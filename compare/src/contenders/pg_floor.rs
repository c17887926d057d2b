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
//! Its twin on idemdb's table (`records`) claims into a table of the backend's shape instead:
//! the key is (consumer, message key), the row holds a completed record of the backend's size
//! and its removal time, with an index on that time, and the table has the backend's
//! autovacuum settings. It is the same statements on the same rows idemdb-postgres writes,
//! without the lock, the read before the write or the function: what the backend's table
//! alone costs the floor.
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
use tokio_postgres::types::ToSql;
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

/// The claim of one key on idemdb's table: as [`CLAIM`].
const CLAIM_RECORD: &str = "WITH claimed AS ( \
         INSERT INTO bench_floor.records (consumer, message_key, record, expires_at_ms) \
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING 1 \
     ) SELECT 1 / count(*)::int4 FROM claimed";

/// The claim of a batch's keys on idemdb's table: as [`CLAIM_MANY`], the winners' keys.
const CLAIM_MANY_RECORDS: &str = "INSERT INTO bench_floor.records (consumer, message_key, record, expires_at_ms) \
     SELECT $1, n.message_key, n.record, $4 FROM unnest($2::bytea[], $3::bytea[]) \
         AS n(message_key, record) \
     ON CONFLICT DO NOTHING RETURNING message_key";

/// [`CLAIM_MANY_WITH_ROWS`] on idemdb's table: a business row's value is its key followed by
/// `$5` (as [`Delivery::value`] makes it).
const CLAIM_MANY_RECORDS_WITH_ROWS: &str = "WITH claimed AS ( \
         INSERT INTO bench_floor.records (consumer, message_key, record, expires_at_ms) \
         SELECT $1, n.message_key, n.record, $4 FROM unnest($2::bytea[], $3::bytea[]) \
             AS n(message_key, record) \
         ON CONFLICT DO NOTHING RETURNING message_key \
     ), ordered AS ( \
         INSERT INTO bench_floor.orders (key, value) \
         SELECT message_key, message_key || $5 FROM claimed \
     ) SELECT message_key FROM claimed";

/// The length of the completed record idemdb-postgres stores for a message of the harness: an
/// empty result, epoch 1, in record format 2 (docs/design.md, section 4).
const RECORD_BYTES: usize = 31;

/// Drops and re-creates the floor's tables: every run starts empty.
pub fn reset(port: u16) -> Result<()> {
    runtime()?.block_on(async {
        let client = crate::contenders::pg_backend::connect(port, true).await?;
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}; \
                 CREATE TABLE {SCHEMA}.inbox (key bytea PRIMARY KEY, value bytea NOT NULL); \
                 CREATE TABLE {SCHEMA}.orders (key bytea PRIMARY KEY, value bytea NOT NULL); \
                 CREATE TABLE {SCHEMA}.records ( \
                     consumer bytea NOT NULL, message_key bytea NOT NULL, \
                     record bytea NOT NULL, expires_at_ms bigint NOT NULL, \
                     PRIMARY KEY (consumer, message_key) \
                 ) WITH (autovacuum_vacuum_scale_factor = 0.01, \
                         autovacuum_vacuum_insert_scale_factor = 0.01, \
                         autovacuum_analyze_scale_factor = 0.02); \
                 CREATE INDEX ON {SCHEMA}.records (expires_at_ms); \
                 CHECKPOINT;"
            ))
            .await?;
        Ok(())
    })
}

/// The floor's shape: how many round trips, and on which table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloorShape {
    /// A single delivery waits for its claim's answer before sending the business row and
    /// `COMMIT` (two round trips).
    pub two_trips: bool,
    /// A batch claims its keys, writes the winners' business rows and commits in one round
    /// trip ([`CLAIM_MANY_WITH_ROWS`]) instead of two.
    pub one_trip_batch: bool,
    /// Claims into idemdb's table (`records`) instead of the key-only `inbox`.
    pub records: bool,
}

pub struct ClaimFloorSession {
    shape: FloorShape,
    runtime: Runtime,
    client: Client,
    claim: Statement,
    order: Statement,
    claim_many: Statement,
    orders: Statement,
    claim_many_with_rows: Statement,
}

impl ClaimFloorSession {
    pub fn connect(port: u16, shape: FloorShape) -> Result<ClaimFloorSession> {
        let runtime = runtime()?;
        let claims = if shape.records {
            [
                CLAIM_RECORD,
                CLAIM_MANY_RECORDS,
                CLAIM_MANY_RECORDS_WITH_ROWS,
            ]
        } else {
            [CLAIM, CLAIM_MANY, CLAIM_MANY_WITH_ROWS]
        };
        let (client, [claim, order, claim_many, orders, claim_many_with_rows]) =
            runtime.block_on(async {
                let client = crate::contenders::pg_backend::connect(port, true).await?;
                let mut prepared = Vec::new();
                for sql in [claims[0], ORDER, claims[1], ORDERS, claims[2]] {
                    prepared.push(client.prepare(sql).await?);
                }
                let prepared: [Statement; 5] = prepared
                    .try_into()
                    .map_err(|_| anyhow::anyhow!("five statements prepared"))?;
                anyhow::Ok((client, prepared))
            })?;
        Ok(ClaimFloorSession {
            shape,
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

/// What a delivery's claim inserts: into `inbox`, its peer key and value; into idemdb's
/// `records`, its consumer, message key, a record and the record's removal time.
enum Marker {
    Inbox {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Record {
        consumer: &'static [u8],
        key: Vec<u8>,
        record: Vec<u8>,
        expires_at_ms: i64,
    },
}

impl Marker {
    /// The marker of `delivery`; a record's removal time is `expires_at_ms` (read once for a
    /// batch).
    fn of(delivery: &Delivery, records: bool, expires_at_ms: i64) -> Marker {
        let value = delivery.value();
        if records {
            Marker::Record {
                consumer: crate::workloads::CONSUMER.as_bytes(),
                key: delivery.key.to_vec(),
                record: value[..RECORD_BYTES].to_vec(),
                expires_at_ms,
            }
        } else {
            Marker::Inbox {
                key: delivery.peer_key().to_vec(),
                value: value.to_vec(),
            }
        }
    }

    /// The key the marker is claimed by, which the business row is keyed by too.
    fn key(&self) -> &[u8] {
        match self {
            Marker::Inbox { key, .. } | Marker::Record { key, .. } => key,
        }
    }

    /// What the marker's row holds beside its key: the inbox's value, or the record.
    fn value(&self) -> &[u8] {
        match self {
            Marker::Inbox { value, .. } => value,
            Marker::Record { record, .. } => record,
        }
    }

    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        match self {
            Marker::Inbox { key, value } => vec![key, value],
            Marker::Record {
                consumer,
                key,
                record,
                expires_at_ms,
            } => vec![consumer, key, record, expires_at_ms],
        }
    }
}

/// A record's removal time if written now: the wall clock plus the default retention.
fn expires_at_ms() -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        });
    now.saturating_add(i64::try_from(idemdb_postgres::RETENTION_MS_DEFAULT).unwrap_or(0))
}

impl Session for ClaimFloorSession {
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let ClaimFloorSession {
            shape,
            runtime,
            client,
            claim,
            order,
            claim_many,
            orders,
            claim_many_with_rows,
        } = self;
        let shape = *shape;
        let client: &Client = client;
        runtime.block_on(async {
            if let [delivery] = deliveries {
                let marker = Marker::of(delivery, shape.records, expires_at_ms());
                // The business row: keyed as the claim's key is (idemdb's rows by the message
                // key, the inbox's by its peer key).
                let value = delivery.value();
                let (key, value): (&[u8], &[u8]) = (marker.key(), &value);
                let marker = marker.params();
                if shape.two_trips {
                    let (begun, claimed) = join(
                        client.batch_execute("BEGIN"),
                        client.execute(claim, &marker),
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
                // Polled in order, so sent in order without waiting in between.
                let (begun, claimed, ordered, committed) = join4(
                    client.batch_execute("BEGIN"),
                    client.execute(claim, &marker),
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
            let expires = expires_at_ms();
            let markers: Vec<Marker> = deliveries
                .iter()
                .map(|delivery| Marker::of(delivery, shape.records, expires))
                .collect();
            let keys: Vec<&[u8]> = markers.iter().map(Marker::key).collect();
            let values: Vec<&[u8]> = markers.iter().map(Marker::value).collect();
            let consumer: &[u8] = crate::workloads::CONSUMER.as_bytes();
            // What follows the key in a delivery's value.
            let padded = Delivery {
                key: [0; crate::workloads::MESSAGE_KEY_BYTES],
            }
            .value();
            let padding: &[u8] = &padded[crate::workloads::MESSAGE_KEY_BYTES..];
            let params: Vec<&(dyn ToSql + Sync)> = match (shape.records, shape.one_trip_batch) {
                (true, true) => vec![&consumer, &keys, &values, &expires, &padding],
                (true, false) => vec![&consumer, &keys, &values, &expires],
                (false, _) => vec![&keys, &values],
            };
            if shape.one_trip_batch {
                let (begun, winners, committed) = join3(
                    client.batch_execute("BEGIN"),
                    client.query(claim_many_with_rows, &params),
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
                client.query(claim_many, &params),
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
            // The winners' business rows: the inbox answers each winner's value; on idemdb's
            // table the value is made from the key, as the delivery made it.
            let won: Vec<&[u8]> = winners.iter().map(|row| row.get(0)).collect();
            // (The inbox's values are borrowed from its answer, not copied: the floor's client
            // does no more than it must.)
            let made: Vec<Vec<u8>> = if shape.records {
                won.iter().map(|key| [*key, padding].concat()).collect()
            } else {
                Vec::new()
            };
            let won_values: Vec<&[u8]> = if shape.records {
                made.iter().map(Vec::as_slice).collect()
            } else {
                winners.iter().map(|row| row.get(1)).collect()
            };
            let (ordered, committed) = join(
                client.execute(orders, &[&won, &won_values]),
                client.batch_execute("COMMIT"),
            )
            .await;
            ordered?;
            committed?;
            Ok(())
        })
    }
}
