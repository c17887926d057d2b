//! The tables idemdb keeps in PostgreSQL, their names, and their versioned installation.

use tokio_postgres::{Client, GenericClient, Transaction};

use crate::error::{Error, Result};
use crate::tables::locks::install_lock;
use crate::tables::locks::schema_install_lock;
use crate::tables::names::DAY_MS;
use crate::tables::names::NEVER_MS;
use crate::tables::names::Names;
use crate::tables::partitions::create_day_partition;

/// The version of the tables this crate reads and writes. [`install`] creates them at this
/// version (or migrates older ones); a store at a newer version is refused, not touched.
///
/// Version 4 records the width of the records' partitions (`partition_days` in the version
/// table; 1 for tables made before); version 3 adds the ordering guard's table of entity
/// versions (`<table>_entity`); version 2 partitioned the records by the day they become
/// removable; version 1 was one plain table.
pub const SCHEMA_VERSION: i32 = 4;

/// The widest partition of removable records, in days ([`InstallOptions::partition_days`]).
pub const PARTITION_DAYS_MAX: u32 = 60;

/// How [`install_with`] creates the tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstallOptions {
    partition_days: Option<u32>,
}

impl Default for InstallOptions {
    /// Partitions of one day for a new table; an existing table keeps its width.
    fn default() -> InstallOptions {
        InstallOptions {
            partition_days: None,
        }
    }
}

impl InstallOptions {
    /// Records become removable by partitions of `days` days (1 to [`PARTITION_DAYS_MAX`]),
    /// aligned on multiples of `days` since 1970-01-01: every read of a key looks into each
    /// partition that can hold a live record, about `retention / days + 2` of them, so wider
    /// partitions make reads cheaper; a partition is dropped once its last day has passed, so
    /// expired records take space for up to `days` days longer. Fixed when the table is
    /// created: an install that asks an existing table for another width is refused.
    ///
    /// The count matters most under many concurrent claims: a claim's transaction locks every
    /// partition and its index, and PostgreSQL 15 takes only 16 relation locks per
    /// transaction by its fast path; past that (10 daily partitions and the open one lock 24
    /// relations) the locks go through the shared lock table, which the sessions contend for.
    /// With partitions as wide as the retention, a claim's own locks stay within 16, leaving
    /// room for its business SQL's.
    #[must_use]
    pub fn partition_days(mut self, days: u32) -> InstallOptions {
        self.partition_days = Some(days);
        self
    }
}

/// Creates the schema and tables at [`SCHEMA_VERSION`] if they are missing; leaves them as
/// they are if they are at it. Safe to run from several processes at once: they take turns
/// under a transaction-level advisory lock.
///
/// # Errors
/// [`Error::SchemaTooNew`] if the tables are at a newer version (written by a newer release:
/// upgrade this one); [`Error::Postgres`] if a statement fails (no privilege to create, say).
pub async fn install(client: &mut Client, names: &Names) -> Result<()> {
    install_with(client, names, InstallOptions::default()).await
}

/// [`install`] with options: a new records table gets partitions of
/// [`InstallOptions::partition_days`] days.
///
/// ```no_run
/// # async fn example(client: &mut tokio_postgres::Client) -> Result<(), idemdb_postgres::Error> {
/// use idemdb_postgres::{InstallOptions, Names, install_with};
/// // Seven days' retention: a read looks into about 3 weekly partitions instead of 9 daily ones.
/// install_with(client, &Names::default(), InstallOptions::default().partition_days(7)).await
/// # }
/// ```
///
/// # Errors
/// As [`install`]; [`Error::PartitionDays`] for a width outside 1 to [`PARTITION_DAYS_MAX`]
/// days, or another width than the existing table's.
pub async fn install_with(
    client: &mut Client,
    names: &Names,
    options: InstallOptions,
) -> Result<()> {
    if let Some(days) = options.partition_days
        && !(1..=PARTITION_DAYS_MAX).contains(&days)
    {
        return Err(Error::PartitionDays {
            requested: days,
            installed: None,
        });
    }
    let tx = client.transaction().await?;
    // One installer at a time per schema, whatever its table (creating the same schema
    // concurrently fails on the catalog's unique indexes), then the table's own lock, which
    // the makers of partitions take too. Always in this order, so no two installers deadlock.
    tx.execute(
        "SELECT pg_advisory_xact_lock($1), pg_advisory_xact_lock($2)",
        &[&schema_install_lock(names), &install_lock(names)],
    )
    .await?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {version} (
             singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
             version integer NOT NULL
         );",
        schema = names.schema,
        version = names.version(),
    ))
    .await?;
    let found: Option<i32> = tx
        .query_opt(&format!("SELECT version FROM {}", names.version()), &[])
        .await?
        .map(|row| row.get(0));
    match found {
        Some(version) if version > SCHEMA_VERSION => {
            return Err(Error::SchemaTooNew {
                found: version,
                supported: SCHEMA_VERSION,
            });
        }
        Some(SCHEMA_VERSION) => {}
        Some(1) => {
            migrate_from_1(&tx, names).await?;
            create_entity_versions(&tx, names).await?;
            add_partition_days(&tx, names).await?;
            set_version(&tx, names).await?;
        }
        Some(2) => {
            create_entity_versions(&tx, names).await?;
            add_partition_days(&tx, names).await?;
            set_version(&tx, names).await?;
        }
        Some(3) => {
            add_partition_days(&tx, names).await?;
            set_version(&tx, names).await?;
        }
        Some(other) => {
            return Err(Error::SchemaTooOld {
                found: other,
                supported: SCHEMA_VERSION,
            });
        }
        None => {
            create_records(&tx, names).await?;
            create_entity_versions(&tx, names).await?;
            add_partition_days(&tx, names).await?;
            let days = i32::try_from(options.partition_days.unwrap_or(1)).unwrap_or(1);
            tx.execute(
                &format!(
                    "INSERT INTO {} (version, partition_days) VALUES ({SCHEMA_VERSION}, $1)",
                    names.version()
                ),
                &[&days],
            )
            .await?;
        }
    }
    if let Some(requested) = options.partition_days {
        let installed = partition_days(&tx, names).await?;
        if installed != requested {
            return Err(Error::PartitionDays {
                requested,
                installed: Some(installed),
            });
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Version 4: the width of the records' partitions, in days; tables made before have daily
/// partitions.
async fn add_partition_days(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    tx.batch_execute(&format!(
        "ALTER TABLE {} ADD COLUMN partition_days integer NOT NULL DEFAULT 1 \
             CHECK (partition_days BETWEEN 1 AND {PARTITION_DAYS_MAX})",
        names.version()
    ))
    .await?;
    Ok(())
}

/// The width of the records' partitions, in days (version 4 on).
pub(crate) async fn partition_days(client: &impl GenericClient, names: &Names) -> Result<u32> {
    let days: i32 = client
        .query_one(
            &format!("SELECT partition_days FROM {}", names.version()),
            &[],
        )
        .await?
        .get(0);
    Ok(u32::try_from(days).unwrap_or(1))
}

/// Creates the records table at [`SCHEMA_VERSION`], without its day partitions.
///
/// One row per (consumer, message key): the advisory lock of the key decides who writes it.
/// `record` is the embedded format's record value (docs/design.md, section 4), so the decision
/// core reads it as the embedded engine does. `expires_at_ms` is when the row may be removed
/// ([`NEVER_MS`]: not by time), and the partition key: rows are range-partitioned by the day
/// they become removable, so that removal drops a whole day's partition once all of it has
/// expired, instead of deleting rows one by one. Rows that are not removable by time (records
/// in progress) live in the open-ended partition `_open`. (A DEFAULT partition would do the
/// same, but `DETACH PARTITION ... CONCURRENTLY` refuses a table that has one.) The primary key
/// must hold the partition key, so it is unique per partition only; one row per key across
/// partitions is the key's lock's doing: every writer holds it, and an update that moves a row
/// to another day moves it, not copies it.
async fn create_records(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    tx.batch_execute(&format!(
        "CREATE TABLE {records} (
             consumer bytea NOT NULL,
             message_key bytea NOT NULL,
             record bytea NOT NULL,
             expires_at_ms bigint NOT NULL,
             PRIMARY KEY (consumer, message_key, expires_at_ms)
         ) PARTITION BY RANGE (expires_at_ms);
         CREATE TABLE {records}_open PARTITION OF {records}
             FOR VALUES FROM ({NEVER_MS}) TO (MAXVALUE);",
        records = names.records(),
    ))
    .await?;
    Ok(())
}

/// Records the tables as at [`SCHEMA_VERSION`], after a migration.
async fn set_version(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    tx.execute(
        &format!("UPDATE {} SET version = {SCHEMA_VERSION}", names.version()),
        &[],
    )
    .await?;
    Ok(())
}

/// Creates the ordering guard's table (new at version 3): the highest applied version of each
/// (consumer, entity key), written by the commit of a claim that carried a version, in the
/// claim's transaction. `version` is the embedded engine's value byte for byte (a u64,
/// big-endian: 8 bytes, so byte order is numeric order). One small row per entity, never
/// removed, so not partitioned. Writers of a row hold the entity's advisory lock, as writers of
/// a record hold the key's; the primary key backs it up.
async fn create_entity_versions(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    tx.batch_execute(&format!(
        "CREATE TABLE {entity} (
             consumer bytea NOT NULL,
             entity_key bytea NOT NULL,
             version bytea NOT NULL CHECK (length(version) = 8),
             PRIMARY KEY (consumer, entity_key)
         );",
        entity = names.entity_versions(),
    ))
    .await?;
    Ok(())
}

/// Version 1 to 2: the plain table becomes the partitioned one. Rows already expired are
/// dropped (every read treats them as absent, and removal would drop them next); the others
/// are copied with their days' partitions.
async fn migrate_from_1(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    let records = names.records();
    let old_name = format!("{}_v1", names.table);
    tx.batch_execute(&format!("ALTER TABLE {records} RENAME TO {old_name}"))
        .await?;
    let old = format!("{}.{old_name}", names.schema);
    create_records(tx, names).await?;
    let now_ms = i64::try_from(crate::sql::clock::database_now_ms(tx).await?).unwrap_or(i64::MAX);
    let days = tx
        .query(
            &format!(
                "SELECT DISTINCT expires_at_ms / {DAY_MS} FROM {old} \
                 WHERE expires_at_ms IS NOT NULL AND expires_at_ms > $1"
            ),
            &[&now_ms],
        )
        .await?;
    for row in days {
        // Version 1 knew no width: its rows move into daily partitions.
        create_day_partition(tx, names, row.get(0), 1).await?;
    }
    tx.execute(
        &format!(
            "INSERT INTO {records} (consumer, message_key, record, expires_at_ms) \
             SELECT consumer, message_key, record, coalesce(expires_at_ms, {NEVER_MS}) \
             FROM {old} WHERE expires_at_ms IS NULL OR expires_at_ms > $1"
        ),
        &[&now_ms],
    )
    .await?;
    tx.batch_execute(&format!("DROP TABLE {old}")).await?;
    Ok(())
}

/// Checks that the tables exist at a version this crate reads, and returns the width of the
/// records' partitions in days.
///
/// # Errors
/// [`Error::SchemaMissing`] when [`install`] was never run for `names`;
/// [`Error::SchemaTooNew`] for a newer version; [`Error::SchemaTooOld`] for an older one
/// (run [`install`] to migrate it).
pub(crate) async fn check(client: &Client, names: &Names) -> Result<u32> {
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&names.version()])
        .await?
        .get(0);
    if !exists {
        return Err(Error::SchemaMissing {
            table: names.records(),
        });
    }
    let found: Option<i32> = client
        .query_opt(&format!("SELECT version FROM {}", names.version()), &[])
        .await?
        .map(|row| row.get(0));
    match found {
        None => Err(Error::SchemaMissing {
            table: names.records(),
        }),
        Some(version) if version > SCHEMA_VERSION => Err(Error::SchemaTooNew {
            found: version,
            supported: SCHEMA_VERSION,
        }),
        Some(version) if version < SCHEMA_VERSION => Err(Error::SchemaTooOld {
            found: version,
            supported: SCHEMA_VERSION,
        }),
        Some(_) => partition_days(client, names).await,
    }
}
