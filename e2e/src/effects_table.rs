//! The fleet's effects table in PostgreSQL, `fleet.applied`: one row per order the consumers
//! applied, with the content and how often (`postgres_orders` adds one to `times` on every
//! apply). Created beside the claims' tables, read back for the check of every order, and read
//! again after the republish of every applied order: an order applied more often than before is
//! a republished order that came back fresh.

use std::collections::HashMap;

use idemdb_postgres::{Names, install};

use crate::BoxError;
use crate::pg_cluster::Node;
use crate::verdict::Applied;

/// Installs the claims' tables and creates the effects table on `primary`.
pub async fn create(primary: &Node) -> Result<(), BoxError> {
    let mut client = primary.connect().await?;
    install(&mut client, &Names::default()).await?;
    client
        .batch_execute(
            "CREATE SCHEMA fleet;
             CREATE TABLE fleet.applied (
                 order_id text PRIMARY KEY,
                 body text NOT NULL,
                 times integer NOT NULL
             );",
        )
        .await?;
    Ok(())
}

/// The effects table on `primary`: how often each order was applied, and with which content.
pub async fn read(primary: &Node) -> Result<HashMap<String, Applied>, BoxError> {
    let client = primary.connect().await?;
    let rows = client
        .query("SELECT order_id, body, times FROM fleet.applied", &[])
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let times: i32 = row.get(2);
            (
                row.get::<_, String>(0),
                Applied {
                    times: u64::try_from(times).unwrap_or(0),
                    body: row.get(1),
                },
            )
        })
        .collect())
}

/// The orders of `after` applied more often than in `before` (or not at all then).
pub fn applied_again(before: &HashMap<String, Applied>, after: &HashMap<String, Applied>) -> u64 {
    after
        .iter()
        .filter(|(order_id, now)| {
            before
                .get(*order_id)
                .is_none_or(|then| now.times > then.times)
        })
        .count() as u64
}
