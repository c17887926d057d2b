//! The tables idemdb keeps in PostgreSQL, their names, and their versioned installation.

use tokio_postgres::{Client, Transaction};

use crate::error::{Error, Result};
use crate::tables::locks::install_lock;
use crate::tables::locks::schema_install_lock;
use crate::tables::names::NEVER_MS;
use crate::tables::names::Names;

/// The version of the tables this crate reads and writes. [`install`] creates them at this
/// version (or migrates older ones); a store at a newer version is refused, not touched.
///
/// Version 10 changes no table: the claim's function (`<table>_claim`) takes a new key's
/// record and inserts it when the key has no row, so that a claim's commit usually writes no
/// record of its own; releases before it call the function with the key alone.
/// Version 9 changes no table: from it on, records may be stored in record format 2 (shorter;
/// the embedded engine's, docs/design.md section 4), which releases before it cannot read, so
/// they refuse version 9 instead. Version 8 adds the function a batch claim takes its keys' locks and reads their rows with
/// (`<table>_claim_many`); version 7 adds the function a claim takes its key's lock and reads
/// its row with (`<table>_claim`), and the one `apply` inserts a new key's record with
/// (`<table>_apply`); version 6 adds the read positions of log consumers (`<table>_position`, and the function
/// that moves them, `<table>_advance_positions`); version 5 keeps the records in one plain table whose primary key is the key, with an index
/// on the removal time; version 4 recorded the width of day partitions; version 3 added the
/// ordering guard's table of entity versions (`<table>_entity`); version 2 partitioned the
/// records by the day they become removable; version 1 was one plain table.
pub const SCHEMA_VERSION: i32 = 10;

/// Creates the schema and tables at [`SCHEMA_VERSION`] if they are missing; leaves them as
/// they are if they are at it, and migrates older ones (see the crate's docs on upgrading).
/// Safe to run from several processes at once: they take turns under a transaction-level
/// advisory lock.
///
/// # Errors
/// [`Error::SchemaTooNew`] if the tables are at a newer version (written by a newer release:
/// upgrade this one); [`Error::Postgres`] if a statement fails (no privilege to create, say).
pub async fn install(client: &mut Client, names: &Names) -> Result<()> {
    let tx = client.transaction().await?;
    // One installer at a time per schema, whatever its table (creating the same schema
    // concurrently fails on the catalog's unique indexes), then the table's own lock. Always
    // in this order, so no two installers deadlock.
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
        Some(version @ 1..=9) => {
            if version <= 2 {
                create_entity_versions(&tx, names).await?;
            }
            if version <= 4 {
                migrate_records(&tx, names).await?;
            }
            if version <= 5 {
                create_positions(&tx, names).await?;
            }
            create_claim_functions(&tx, names).await?;
            tx.batch_execute(&format!(
                "ALTER TABLE {} DROP COLUMN IF EXISTS partition_days; \
                 UPDATE {} SET version = {SCHEMA_VERSION}",
                names.version(),
                names.version()
            ))
            .await?;
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
            create_positions(&tx, names).await?;
            create_claim_functions(&tx, names).await?;
            tx.execute(
                &format!(
                    "INSERT INTO {} (version) VALUES ({SCHEMA_VERSION})",
                    names.version()
                ),
                &[],
            )
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Creates the records table at [`SCHEMA_VERSION`].
///
/// One row per (consumer, message key), the primary key: a claim's write is decided by that
/// one unique index, and a read of a key is one probe of it, however many records the table
/// holds. `record` is the embedded format's record value (docs/design.md, section 4), so the
/// decision core reads it as the embedded engine does. `expires_at_ms` is when the row may be
/// removed ([`NEVER_MS`]: not by time); its index lets removal find the expired rows oldest
/// first, in small batches, at a cost that follows what expired and not what the table holds.
///
/// Autovacuum is told to visit the table after 1% of its rows changed (the default waits for
/// 20%), so that the space of removed rows is reused by new ones while there is little of it,
/// and the table stays near the size of its live records.
async fn create_records(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    tx.batch_execute(&format!(
        "CREATE TABLE {records} (
             consumer bytea NOT NULL,
             message_key bytea NOT NULL,
             record bytea NOT NULL,
             expires_at_ms bigint NOT NULL,
             PRIMARY KEY (consumer, message_key)
         ) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.01,
                 autovacuum_analyze_scale_factor = 0.02);
         CREATE INDEX {expiry} ON {records} (expires_at_ms);",
        records = names.records(),
        expiry = names.expiry_index(),
    ))
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

/// The SQLSTATE `<table>_advance_positions` raises for a position behind the stored one, with
/// `stored staged partition source` in its detail.
pub(crate) const POSITION_BEHIND_SQLSTATE: &str = "IP001";

/// Creates the read positions (new at version 6): one row per (consumer, source, partition),
/// the offset of the last message whose effects are committed, written in the transaction of
/// the claim or batch that read it. Never removed by time.
///
/// The function moves a consumer's positions forward in one call (a batch may move several),
/// each to an offset at or past the stored one, and otherwise fails the statement, and so the
/// transaction with the claim's record and business SQL: a reader behind the stored position
/// is stale, and nothing it did lands. A failed statement is the only way to stop the `COMMIT`
/// sent behind it from committing the rest (PostgreSQL answers the `COMMIT` of an aborted
/// transaction with a rollback). The row's lock orders two writers of one partition: the later
/// one waits for the first's transaction to end (its `COMMIT` is already on its way) and then
/// compares against what it committed.
async fn create_positions(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    tx.batch_execute(&format!(
        "CREATE TABLE {positions} (
             consumer bytea NOT NULL,
             source text NOT NULL,
             partition bigint NOT NULL,
             read_offset bigint NOT NULL CHECK (read_offset >= 0),
             updated_at_ms bigint NOT NULL,
             PRIMARY KEY (consumer, source, partition)
         );
         CREATE FUNCTION {advance}(p_consumer bytea, p_sources text[], p_partitions bigint[],
                                   p_offsets bigint[], p_at_ms bigint)
         RETURNS void LANGUAGE plpgsql AS $idemdb$
         DECLARE
             i integer;
             stored bigint;
         BEGIN
             FOR i IN 1 .. coalesce(array_length(p_sources, 1), 0) LOOP
                 INSERT INTO {positions} AS p (consumer, source, partition, read_offset, updated_at_ms)
                 VALUES (p_consumer, p_sources[i], p_partitions[i], p_offsets[i], p_at_ms)
                 ON CONFLICT (consumer, source, partition) DO UPDATE
                     SET read_offset = excluded.read_offset, updated_at_ms = excluded.updated_at_ms
                     WHERE p.read_offset <= excluded.read_offset;
                 IF NOT FOUND THEN
                     SELECT read_offset INTO stored FROM {positions}
                      WHERE consumer = p_consumer AND source = p_sources[i]
                        AND partition = p_partitions[i];
                     RAISE EXCEPTION 'idemdb: read position behind the stored one'
                         USING ERRCODE = '{POSITION_BEHIND_SQLSTATE}',
                               DETAIL = format('%s %s %s %s', stored, p_offsets[i],
                                               p_partitions[i], p_sources[i]);
                 END IF;
             END LOOP;
         END
         $idemdb$;",
        positions = names.positions(),
        advance = names.advance_positions(),
    ))
    .await?;
    Ok(())
}

/// Creates the claim's functions (new at version 7; `<table>_claim_many` at version 8), each one
/// statement parsed and planned once per connection (PL/pgSQL keeps the plans of its
/// statements).
///
/// `<table>_claim`, a claim's first round trip: the key's advisory lock tried without waiting,
/// the database's time, and, when the lock was granted, the key's row; when there is no row and
/// the caller sent a record for a new key whose time `p_check_ms` is within the tolerance of the
/// database's clock (null: an injected clock decides), that record is inserted too (`o_inserted`),
/// so that the claim's commit sends no write of its own when it would write the same record. `<table>_claim_many`,
/// a batch claim's first round trip: the lock of every key (the caller gives them sorted and
/// each once) tried without waiting, in that order, the database's time, the locks refused,
/// and the row of every key that has one, as one row of arrays: the batch's answer is one row
/// to send and parse instead of two per key. Its read is one statement that looks each key up
/// on its own (a scalar subquery per key; `OFFSET 0` keeps the outer query from being
/// flattened, which would copy that subquery into the filter and the aggregate and look each
/// key up twice): a kept plan of `message_key = ANY(...)` made while the table was small
/// searches the index by `consumer` alone and filters every row of the consumer, and goes on
/// doing so as the table grows. `<table>_apply`,
/// `apply`'s one round trip: the key's lock, the key's row, and the new key's completed record
/// inserted when the key has no row, the lock was granted and the record's time `p_check_ms`
/// is within the tolerance of the database's clock (null: an injected clock decides); else it
/// fails with [`NOT_NEW_SQLSTATE`], which aborts the caller's statements behind it, and its
/// detail carries the database's time and the key's row, so that a duplicate is answered
/// without a second round trip. The row is read after the lock was granted or refused; the
/// insert's unique key backs the read up (a row it did not see fails the insert).
///
/// The reads run after the lock was granted and takes its own snapshot then (a volatile
/// function's statements each take a new one under READ COMMITTED), so it sees the commit of
/// whoever held the lock before; a plain statement's one snapshot would be taken before its
/// lock. Sequential scans are off while the function runs, so that the read's kept plan,
/// however small the table was when it was made, looks the key up in the index; the caller's
/// own setting is back when the function returns.
async fn create_claim_functions(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    tx.batch_execute(&format!(
        "DROP FUNCTION IF EXISTS {claim}(bigint, bytea, bytea);
         CREATE OR REPLACE FUNCTION {claim}(p_lock bigint, p_consumer bytea, p_key bytea,
                                           p_record bytea, p_expires_at_ms bigint,
                                           p_check_ms bigint,
                                           OUT o_locked boolean, OUT o_now_ms bigint,
                                           OUT o_record bytea, OUT o_inserted boolean)
         LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $idemdb$
         BEGIN
             o_now_ms := floor(extract(epoch FROM statement_timestamp()) * 1000)::int8;
             o_locked := pg_try_advisory_xact_lock(p_lock);
             o_inserted := false;
             IF o_locked THEN
                 SELECT r.record INTO o_record FROM {records} AS r
                  WHERE r.consumer = p_consumer AND r.message_key = p_key;
                 IF o_record IS NULL AND p_record IS NOT NULL
                    AND (p_check_ms IS NULL OR abs(o_now_ms - p_check_ms) <= {tolerance}) THEN
                     INSERT INTO {records} (consumer, message_key, record, expires_at_ms)
                     VALUES (p_consumer, p_key, p_record, p_expires_at_ms);
                     o_inserted := true;
                 END IF;
             END IF;
         END
         $idemdb$;
         CREATE OR REPLACE FUNCTION {claim_many}(p_locks bigint[], p_consumer bytea,
                                                p_keys bytea[], OUT o_now_ms bigint,
                                                OUT o_refused bigint[], OUT o_keys bytea[],
                                                OUT o_records bytea[])
         LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $idemdb$
         DECLARE
             v_lock bigint;
         BEGIN
             o_now_ms := floor(extract(epoch FROM statement_timestamp()) * 1000)::int8;
             o_refused := '{{}}';
             FOREACH v_lock IN ARRAY p_locks LOOP
                 IF NOT pg_try_advisory_xact_lock(v_lock) THEN
                     o_refused := o_refused || v_lock;
                 END IF;
             END LOOP;
             SELECT coalesce(array_agg(f.message_key), '{{}}'), coalesce(array_agg(f.record), '{{}}')
               INTO o_keys, o_records
               FROM (SELECT k.message_key,
                            (SELECT r.record FROM {records} AS r
                              WHERE r.consumer = p_consumer AND r.message_key = k.message_key)
                                AS record
                       FROM unnest(p_keys) AS k(message_key) OFFSET 0) AS f
              WHERE f.record IS NOT NULL;
         END
         $idemdb$;
         CREATE OR REPLACE FUNCTION {apply}(p_consumer bytea, p_key bytea, p_record bytea,
                                           p_expires_at_ms bigint, p_check_ms bigint,
                                           p_lock bigint)
         RETURNS bigint
         LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $idemdb$
         DECLARE
             v_now_ms bigint := floor(extract(epoch FROM statement_timestamp()) * 1000)::int8;
             v_locked boolean := pg_try_advisory_xact_lock(p_lock);
             v_stored bytea;
         BEGIN
             SELECT r.record INTO v_stored FROM {records} AS r
              WHERE r.consumer = p_consumer AND r.message_key = p_key;
             IF v_stored IS NOT NULL OR NOT v_locked
                OR (p_check_ms IS NOT NULL AND abs(v_now_ms - p_check_ms) > {tolerance}) THEN
                 RAISE EXCEPTION 'idemdb: the key is not new'
                     USING ERRCODE = '{NOT_NEW_SQLSTATE}',
                           DETAIL = v_now_ms::text || ' ' || coalesce(encode(v_stored, 'hex'), '');
             END IF;
             INSERT INTO {records} (consumer, message_key, record, expires_at_ms)
             VALUES (p_consumer, p_key, p_record, p_expires_at_ms);
             RETURN v_now_ms;
         END
         $idemdb$;",
        claim = names.claim_function(),
        claim_many = names.claim_many_function(),
        apply = names.apply_function(),
        records = names.records(),
        tolerance = crate::tables::names::CLOCK_TOLERANCE_MS,
    ))
    .await?;
    Ok(())
}

/// The SQLSTATE `<table>_apply` raises when it inserted nothing: the key has a row, its lock is
/// held elsewhere, or the record's time is too far from the database's clock. Its detail is
/// the database's time and the key's row in hex (empty without a row).
pub(crate) const NOT_NEW_SQLSTATE: &str = "IP002";

/// Versions 1 to 4 to 5: the records move into the plain table. The old table (plain at
/// version 1, partitioned by removal day at 2 to 4) is renamed aside, the new one created, and
/// every row whose removal time has not passed copied over (every read treats the others as
/// absent already); then the old table goes with its partitions, and so do tables a removal of
/// version 2 to 4 detached and did not drop (marked by a comment when detached).
async fn migrate_records(tx: &Transaction<'_>, names: &Names) -> Result<()> {
    let records = names.records();
    let old_name = format!("{}_old", names.table);
    tx.batch_execute(&format!("ALTER TABLE {records} RENAME TO {old_name}"))
        .await?;
    // A primary key's index is named after its table when made: the old one keeps the name
    // the new table's would take.
    tx.batch_execute(&format!(
        "ALTER INDEX IF EXISTS {schema}.{table}_pkey RENAME TO {old_name}_pkey",
        schema = names.schema,
        table = names.table
    ))
    .await?;
    let old = format!("{}.{old_name}", names.schema);
    create_records(tx, names).await?;
    let now_ms = i64::try_from(crate::sql::clock::database_now_ms(tx).await?).unwrap_or(i64::MAX);
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
    let leftovers = tx
        .query(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind = 'r' \
               AND obj_description(c.oid, 'pg_class') = $2",
            &[&names.schema, &detached_marker(names)],
        )
        .await?;
    for row in leftovers {
        let table: &str = row.get(0);
        tx.batch_execute(&format!("DROP TABLE {}.{table}", names.schema))
            .await?;
    }
    Ok(())
}

/// The comment versions 2 to 4 put on a day partition before detaching it for removal.
fn detached_marker(names: &Names) -> String {
    format!("idemdb: removed from {}", names.records())
}

/// Checks that the tables exist at a version this crate reads.
///
/// # Errors
/// [`Error::SchemaMissing`] when [`install`] was never run for `names`;
/// [`Error::SchemaTooNew`] for a newer version; [`Error::SchemaTooOld`] for an older one
/// (run [`install`] to migrate it).
pub(crate) async fn check(client: &Client, names: &Names) -> Result<()> {
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
        Some(_) => Ok(()),
    }
}
