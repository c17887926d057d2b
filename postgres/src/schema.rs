//! The tables idemdb keeps in PostgreSQL, their names, and their versioned installation.

use std::future::Future;

use tokio_postgres::{Client, GenericClient, Transaction};

use crate::error::{Error, Result};

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

/// Longest identifier PostgreSQL keeps (NAMEDATALEN - 1), less the longest suffix added to the
/// table's name (`_version`; a day's partition adds `_d` and at most 6 digits, `_entity` 7,
/// `_open` 5).
const NAME_BYTES_MAX: usize = 63 - "_version".len();

/// One day in milliseconds: the width of a partition of removable rows.
pub const DAY_MS: i64 = 86_400_000;

/// The last day with a partition of its own: its name (`_d` and the day) must fit
/// [`NAME_BYTES_MAX`]'s allowance of 6 digits. Rows removable later (after the year 4707) go to
/// the open partition, as rows that are never removable do.
pub(crate) const DAY_PARTITION_LAST: i64 = 999_999;

/// The `expires_at_ms` of a row that is never removable by time (in-progress records, and
/// retentions past what `int8` holds): the first value of the open partition.
pub(crate) const NEVER_MS: i64 = i64::MAX;

/// The words PostgreSQL 15 does not take as a schema name unquoted (`pg_get_keywords()`,
/// categories R and T: reserved, and reserved but for function and type names), sorted.
const SCHEMA_WORDS_RESERVED: [&str; 100] = [
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

/// Where the records live: `schema.table`, plus `schema.table_version`. Names are lower-case
/// ASCII letters, digits and underscores, starting with a letter or underscore, so that they
/// never need quoting and never carry SQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    schema: String,
    table: String,
}

impl Default for Names {
    /// `idemdb.records`.
    fn default() -> Names {
        Names {
            schema: "idemdb".to_owned(),
            table: "records".to_owned(),
        }
    }
}

impl Names {
    /// Checks and keeps the names.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a name that is empty, too long (over 55 bytes), or holds
    /// anything but `a-z`, `0-9` and `_` (or starts with a digit); and for a schema name that
    /// PostgreSQL reserves (`user`, `select`, `table` and the other reserved words; names
    /// starting with `pg_`).
    pub fn new(schema: &str, table: &str) -> Result<Names> {
        // A schema name stands alone in statements (`CREATE SCHEMA name`, `name.table`), where
        // PostgreSQL takes no reserved word unquoted; a table name always follows `schema.`,
        // where any word goes.
        if SCHEMA_WORDS_RESERVED.binary_search(&schema).is_ok() || schema.starts_with("pg_") {
            return Err(Error::InvalidName {
                name: schema.to_owned(),
            });
        }
        for name in [schema, table] {
            let mut bytes = name.bytes();
            let first_ok = bytes
                .next()
                .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
            let rest_ok = bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !first_ok || !rest_ok || name.len() > NAME_BYTES_MAX {
                return Err(Error::InvalidName {
                    name: name.to_owned(),
                });
            }
        }
        Ok(Names {
            schema: schema.to_owned(),
            table: table.to_owned(),
        })
    }

    /// `schema.table`.
    pub(crate) fn records(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// `schema.table_entity`: the ordering guard's highest applied version of each entity.
    pub(crate) fn entity_versions(&self) -> String {
        format!("{}.{}_entity", self.schema, self.table)
    }

    /// `schema.table_version`.
    fn version(&self) -> String {
        format!("{}.{}_version", self.schema, self.table)
    }

    /// The partition of the rows removable during `day` (days since 1970-01-01, UTC).
    fn day_partition(&self, day: i64) -> String {
        format!("{}.{}_d{day}", self.schema, self.table)
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
async fn partition_days(client: &impl GenericClient, names: &Names) -> Result<u32> {
    let days: i32 = client
        .query_one(
            &format!("SELECT partition_days FROM {}", names.version()),
            &[],
        )
        .await?
        .get(0);
    Ok(u32::try_from(days).unwrap_or(1))
}

/// The first day of the partition that holds the rows removable during `day`.
pub(crate) fn partition_first_day(day: i64, partition_days: u32) -> i64 {
    day - day.rem_euclid(i64::from(partition_days.max(1)))
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
    let now_ms = i64::try_from(crate::database_now_ms(tx).await?).unwrap_or(i64::MAX);
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
async fn create_day_partition(
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
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&install_lock(names)])
        .await?;
    let step = usize::try_from(partition_days.max(1)).unwrap_or(1);
    for day in (partition_first_day(first_day, partition_days)..=last_day).step_by(step) {
        create_day_partition(&tx, names, day, partition_days).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Makes sure the partition of each of `days` exists (an import's rows, whatever their days).
/// Safe to run from several processes at once: they take turns under the installers' lock.
pub(crate) async fn ensure_day_partitions(
    client: &mut Client,
    names: &Names,
    days: impl IntoIterator<Item = i64>,
    partition_days: u32,
) -> Result<()> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&install_lock(names)])
        .await?;
    let mut firsts: Vec<i64> = days
        .into_iter()
        .map(|day| partition_first_day(day, partition_days))
        .collect();
    firsts.sort_unstable();
    firsts.dedup();
    for day in firsts {
        create_day_partition(&tx, names, day, partition_days).await?;
    }
    tx.commit().await?;
    Ok(())
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
    let mut found: Vec<DayPartition> = rows
        .iter()
        .filter_map(|row| {
            let name: String = row.get(0);
            let day = name.strip_prefix(&prefix)?.parse().ok()?;
            Some(DayPartition {
                day,
                name: format!("{}.{name}", names.schema),
                detach_pending: row.get(1),
            })
        })
        .collect();
    found.sort_by_key(|partition| partition.day);
    Ok(found)
}

/// Tables of day partitions that are no longer attached to the records table: left by a
/// removal given up between its detach and its drop (its future dropped while the detach
/// waited; the detach itself went on, the drop was never sent). Only a detach makes one: a
/// partition being made is attached in the transaction that creates it, so no other session
/// sees it unattached. Oldest first.
pub(crate) async fn detached_day_tables(
    client: &Client,
    names: &Names,
) -> Result<Vec<DayPartition>> {
    let prefix = format!("{}_d", names.table);
    let rows = client
        .query(
            "SELECT c.relname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind = 'r' AND NOT c.relispartition \
             AND starts_with(c.relname::text, $2)",
            &[&names.schema, &prefix],
        )
        .await?;
    let mut found: Vec<DayPartition> = rows
        .iter()
        .filter_map(|row| {
            let name: String = row.get(0);
            let day = name.strip_prefix(&prefix)?.parse().ok()?;
            Some(DayPartition {
                day,
                name: format!("{}.{name}", names.schema),
                detach_pending: false,
            })
        })
        .collect();
    found.sort_by_key(|table| table.day);
    Ok(found)
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
            // sent without waiting (a simple query goes out at its first poll), and runs after
            // whatever the connection was running. A session-level lock would otherwise stay
            // with the connection until it closes.
            let sql = unlock_sql(self.lock);
            let mut unlock = std::pin::pin!(self.client.batch_execute(&sql));
            let _ = unlock
                .as_mut()
                .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        }
    }
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

/// The advisory lock installers into the schema of `names` take turns under, before
/// [`install_lock`].
fn schema_install_lock(names: &Names) -> i64 {
    advisory_lock_of(&format!("idemdb install schema {}", names.schema))
}

/// The advisory lock installers of `names` take turns under.
fn install_lock(names: &Names) -> i64 {
    advisory_lock_of(&format!("idemdb install {}", names.records()))
}

fn unlock_sql(lock: i64) -> String {
    format!("SELECT pg_advisory_unlock({lock})")
}

/// The session-level advisory lock removals of the records table of `names` take turns under
/// ([`RemovalTurn`]).
fn removal_lock(names: &Names) -> i64 {
    advisory_lock_of(&format!("idemdb removal {}", names.records()))
}

/// An advisory lock's number: a 64-bit hash of what it stands for.
fn advisory_lock_of(what: &str) -> i64 {
    i64::from_ne_bytes(xxhash_rust::xxh3::xxh3_64(what.as_bytes()).to_ne_bytes())
}
