//! The records table's day partitions: made ahead (attached apart, a lock claims do not wait
//! for), listed, detached concurrently and dropped, one removal at a time ([`RemovalTurn`]).

use tokio_postgres::{Client, GenericClient, Transaction};

use crate::error::Result;
use crate::sql::txn::send_without_waiting;
use crate::tables::locks::advisory_lock_of;
use crate::tables::locks::install_lock;
use crate::tables::names::DAY_MS;
use crate::tables::names::Names;

/// The first day of the partition that holds the rows removable during `day`.
pub(crate) fn partition_first_day(day: i64, partition_days: u32) -> i64 {
    day - day.rem_euclid(i64::from(partition_days.max(1)))
}

/// Creates the partition that holds `day` unless it exists: the `partition_days` days from
/// its first, named after that day. Made apart and then attached, which takes a lock on the
/// records table that claims do not wait for (SHARE UPDATE EXCLUSIVE), where
/// `CREATE TABLE ... PARTITION OF` would take one that stops them (ACCESS EXCLUSIVE).
///
/// The partition goes to the records table's tablespace when it has one (`ALTER TABLE
/// <records> SET TABLESPACE`, which for a partitioned table says where partitions made later
/// go), where `PARTITION OF` would put it, and its index beside it (`PARTITION OF` would put
/// the index where the session's `default_tablespace` says); with none, both go where that
/// setting says. Set for the transaction only: the session keeps its own.
pub(crate) async fn create_day_partition(
    client: &impl GenericClient,
    names: &Names,
    day: i64,
    partition_days: u32,
) -> Result<()> {
    let day = partition_first_day(day, partition_days);
    let partition = names.day_partition(day);
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&partition])
        .await?
        .get(0);
    if exists {
        return Ok(());
    }
    let (from, to) = (day * DAY_MS, (day + i64::from(partition_days)) * DAY_MS);
    client
        .batch_execute(&format!(
            "SELECT set_config('default_tablespace', t.spcname, true)
                 FROM pg_class c JOIN pg_tablespace t ON t.oid = c.reltablespace
                 WHERE c.oid = '{records}'::regclass;
             CREATE TABLE {partition} (LIKE {records} INCLUDING ALL);
             ALTER TABLE {records} ATTACH PARTITION {partition} FOR VALUES FROM ({from}) TO ({to});",
            records = names.records(),
        ))
        .await?;
    Ok(())
}

/// Makes sure the partitions of every day from `first_day` through `last_day` exist. Safe to
/// run from several processes at once: they take turns under the installers' lock.
pub(crate) async fn ensure_partitions(
    client: &mut Client,
    names: &Names,
    first_day: i64,
    last_day: i64,
    partition_days: u32,
) -> Result<()> {
    let tx = client.transaction().await?;
    let made = async {
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&install_lock(names)])
            .await?;
        let step = usize::try_from(partition_days.max(1)).unwrap_or(1);
        for day in (partition_first_day(first_day, partition_days)..=last_day).step_by(step) {
            create_day_partition(&tx, names, day, partition_days).await?;
        }
        Ok(())
    }
    .await;
    end(tx, made).await
}

/// Commits `tx` if `made` is `Ok`; else rolls it back and waits, so that the installers' lock
/// it holds is free when the error returns (a transaction dropped open frees it a moment
/// later).
async fn end(tx: Transaction<'_>, made: Result<()>) -> Result<()> {
    match made {
        Ok(()) => {
            tx.commit().await?;
            Ok(())
        }
        Err(error) => {
            let _ = tx.rollback().await;
            Err(error)
        }
    }
}

/// Makes sure the partition of each of `days` exists (an import's rows, whatever their days).
/// Safe to run from several processes at once: they take turns under the installers' lock.
pub(crate) async fn ensure_day_partitions(
    client: &mut Client,
    names: &Names,
    days: impl IntoIterator<Item = i64>,
    partition_days: u32,
) -> Result<()> {
    let mut firsts: Vec<i64> = days
        .into_iter()
        .map(|day| partition_first_day(day, partition_days))
        .collect();
    firsts.sort_unstable();
    firsts.dedup();
    let tx = client.transaction().await?;
    let made = async {
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&install_lock(names)])
            .await?;
        for day in firsts {
            create_day_partition(&tx, names, day, partition_days).await?;
        }
        Ok(())
    }
    .await;
    end(tx, made).await
}

/// The day partitions of the records table, as (day, qualified name), oldest first.
pub(crate) async fn day_partitions(client: &Client, names: &Names) -> Result<Vec<DayPartition>> {
    let prefix = format!("{}_d", names.table);
    let rows = client
        .query(
            "SELECT c.relname::text, i.inhdetachpending FROM pg_inherits i \
             JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = to_regclass($1)",
            &[&names.records()],
        )
        .await?;
    Ok(day_tables(&rows, names, &prefix))
}

/// The day tables among `rows` (each a table's name and whether its detach is pending), named
/// `<prefix><day>`, oldest first.
fn day_tables(rows: &[tokio_postgres::Row], names: &Names, prefix: &str) -> Vec<DayPartition> {
    let mut found: Vec<DayPartition> = rows
        .iter()
        .filter_map(|row| {
            let name: String = row.get(0);
            let day = name.strip_prefix(prefix)?.parse().ok()?;
            Some(DayPartition {
                day,
                name: format!("{}.{name}", names.schema),
                detach_pending: row.get(1),
            })
        })
        .collect();
    found.sort_by_key(|partition| partition.day);
    found
}

/// Tables of day partitions that are no longer attached to the records table: left by a
/// removal given up between its detach and its drop (its future dropped while the detach
/// waited; the detach itself went on, the drop was never sent). Only a removal's detach makes
/// one, and it marks the partition first ([`detached_marker`]): a table of the schema that
/// only looks like one (an operator's detached partition, a table of the same name pattern) is
/// never taken for it, and a partition being made is attached in the transaction that creates
/// it, so no other session sees it unattached. Oldest first.
pub(crate) async fn detached_day_tables(
    client: &Client,
    names: &Names,
) -> Result<Vec<DayPartition>> {
    let prefix = format!("{}_d", names.table);
    let rows = client
        .query(
            "SELECT c.relname::text, false FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind = 'r' AND NOT c.relispartition \
             AND starts_with(c.relname::text, $2) \
             AND obj_description(c.oid, 'pg_class') = $3",
            &[&names.schema, &prefix, &detached_marker(names)],
        )
        .await?;
    Ok(day_tables(&rows, names, &prefix))
}

/// The comment a removal puts on a partition before it detaches it.
fn detached_marker(names: &Names) -> String {
    format!("idemdb: removed from {}", names.records())
}

/// Drops a table [`detached_day_tables`] found.
pub(crate) async fn drop_detached(client: &Client, table: &DayPartition) -> Result<()> {
    client
        .batch_execute(&format!("DROP TABLE IF EXISTS {}", table.name))
        .await?;
    Ok(())
}

/// A partition of removable rows: those of the table's `partition_days` days from `day`.
pub(crate) struct DayPartition {
    /// Its first day.
    pub(crate) day: i64,
    /// Qualified: `schema.table_dN`.
    pub(crate) name: String,
    /// A concurrent detach began and did not finish (its session was lost): it is finished
    /// with `DETACH PARTITION ... FINALIZE`.
    pub(crate) detach_pending: bool,
}

/// Detaches and drops the partition `partition` (qualified): `DETACH ... CONCURRENTLY` takes
/// only a lock claims do not wait for, and waits itself for the transactions that may still
/// read the partition; the drop then touches a table nobody reads. Runs outside any
/// transaction block (PostgreSQL refuses a concurrent detach inside one).
pub(crate) async fn drop_partition(
    client: &Client,
    names: &Names,
    partition: &DayPartition,
) -> Result<()> {
    let how = if partition.detach_pending {
        "FINALIZE"
    } else {
        "CONCURRENTLY"
    };
    // Marked first, so that a table this detach leaves behind (its call given up before the
    // drop) is known for one of ours, and no other table of the schema is ever taken for one.
    client
        .batch_execute(&format!(
            "COMMENT ON TABLE {} IS '{}'",
            partition.name,
            detached_marker(names)
        ))
        .await?;
    client
        .batch_execute(&format!(
            "ALTER TABLE {} DETACH PARTITION {} {how}",
            names.records(),
            partition.name
        ))
        .await?;
    client
        .batch_execute(&format!("DROP TABLE {}", partition.name))
        .await?;
    Ok(())
}

/// The turn of one removal (the partitions' detaches and drops) of the records table among
/// every process's: a session-level advisory lock, since a concurrent detach cannot run inside
/// a transaction block, where a transaction-level lock would be released. Two removals that
/// overlap would otherwise detach the same partition twice ("already pending detach"), drop
/// one the other is detaching, or deadlock on the detaches' waits.
pub(crate) struct RemovalTurn<'c> {
    client: &'c Client,
    lock: i64,
    held: bool,
}

impl<'c> RemovalTurn<'c> {
    /// Waits for the turn: for every removal of the table that began before it.
    pub(crate) async fn take(client: &'c Client, names: &Names) -> Result<RemovalTurn<'c>> {
        let lock = removal_lock(names);
        // Held from the moment the request goes out: a call given up while it waits (its
        // future dropped) is granted the lock later all the same, and the unlock its drop
        // sends runs after the grant (a connection runs its requests in order). Built after
        // the grant, it would leave the lock with the connection for good.
        let turn = RemovalTurn {
            client,
            lock,
            held: true,
        };
        client
            .batch_execute(&format!("SELECT pg_advisory_lock({lock})"))
            .await?;
        Ok(turn)
    }

    /// Gives the turn to the next removal, and returns once the server has.
    pub(crate) async fn end(mut self) -> Result<()> {
        self.held = false;
        self.client.batch_execute(&unlock_sql(self.lock)).await?;
        Ok(())
    }
}

impl Drop for RemovalTurn<'_> {
    fn drop(&mut self) {
        if self.held {
            // A removal given up half way (its future dropped, or an error): the unlock is
            // sent without waiting, and runs after whatever the connection was running. A
            // session-level lock would otherwise stay with the connection until it closes.
            send_without_waiting(self.client, &unlock_sql(self.lock));
        }
    }
}

fn unlock_sql(lock: i64) -> String {
    format!("SELECT pg_advisory_unlock({lock})")
}

/// The session-level advisory lock removals of the records table of `names` take turns under
/// ([`RemovalTurn`]).
fn removal_lock(names: &Names) -> i64 {
    advisory_lock_of(&format!("idemdb removal {}", names.records()))
}
