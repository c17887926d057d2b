//! Moving the dedup memory in and out: every row as an export line (`idemdb::transfer`, the
//! lines `idemdb export` writes and `idemdb import` reads), records and log consumers' read
//! positions, and imports of such lines under each key's lock and each position's row lock.

use std::collections::HashSet;
use std::io::{BufRead, Write};

use futures_util::StreamExt;
use idemdb::EXPIRES_NEVER_MS;
use idemdb::format::{Record, RecordState};
use idemdb::transfer::{
    CONSUMERS_TABLE, ExportLine, PositionLine, TransferPosition, TransferRecord, read_lines,
};
use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

use crate::error::{Error, Result};
use crate::storage::positions::{POSITION_OFFSET_MAX, position};
use crate::storage::records::expires_column;
use crate::storage::records::lock_id;
use crate::storage::store::PgConsumer;
use crate::storage::store::PgStore;

/// The most records one import transaction writes: its locks are held until it commits, so a
/// claim of one of its keys waits (gets `InProgress`) for at most one transaction's worth.
pub const IMPORT_TRANSACTION_RECORDS: usize = 1000;

/// What an import did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportCounts {
    /// Records written to keys that held none.
    pub imported: u64,
    /// Records written over the record a key held (only with `overwrite`).
    pub overwritten: u64,
    /// Records not written because the key held a record (without `overwrite`).
    pub skipped: u64,
    /// The read positions' counts ([`PgStore::import_lines`]; zero for [`PgStore::import`],
    /// which takes records only).
    pub positions: PositionImportCounts,
}

/// What an import of read positions did, one count per position given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PositionImportCounts {
    /// Positions written where the consumer had none.
    pub imported: u64,
    /// Positions written over a stored one behind them (without `overwrite`).
    pub advanced: u64,
    /// Positions written over a stored one whatever its offset (only with `overwrite`).
    pub overwritten: u64,
    /// Positions not written because the stored one is at or ahead of them (without
    /// `overwrite`).
    pub skipped: u64,
}

/// What an export did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExportReport {
    /// Record lines written.
    pub exported: u64,
    /// Read position lines written (after the records).
    pub positions: u64,
    /// Rows whose record does not decode: left out of the export, named here.
    pub corrupt: Vec<CorruptRow>,
}

/// A row an export left out because its record does not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CorruptRow {
    /// The consumer id.
    pub consumer: Vec<u8>,
    /// The message key.
    pub key: Vec<u8>,
    /// What is wrong with the record.
    pub detail: String,
}

impl PgStore {
    /// Writes every record, of every consumer, to `out` as export lines, then every read
    /// position as a position line, in the order `idemdb export` writes them: by consumer id
    /// (shorter first), then by key; positions by consumer id and source, byte by byte, and
    /// partition. One statement, so one snapshot: claims go on meanwhile, each
    /// line is a record or position as it was at that snapshot, and no position points past
    /// a record the export lacks. Expired rows not yet removed are exported as they are, as
    /// the embedded store's export does.
    ///
    /// # Errors
    /// [`Error::Postgres`] when the read fails; [`Error::ExportOutput`] when writing fails.
    /// A row that does not decode is no error: it is left out and named in the report.
    pub async fn export(&self, client: &Client, out: &mut impl Write) -> Result<ExportReport> {
        export_rows(self, client, None, out).await
    }

    /// Writes `records` (an export's, typically) as they are (epochs, timestamps, tokens): a
    /// key that holds no row gets its record; a key that holds one (any state, expired included)
    /// keeps it unless `overwrite`, which replaces it. As the embedded store's import does.
    ///
    /// Everything is checked before anything is written. Then the records are written in
    /// transactions of up to
    /// [`IMPORT_TRANSACTION_RECORDS`], each under its keys' advisory locks, taken as claims
    /// take them but waiting for them: a claim in flight finishes first (and its record is then
    /// the one that stays, without `overwrite`), and a claim that comes during the transaction
    /// gets `InProgress`. So an import never makes two records of one key. A failure leaves
    /// the transactions before it written; a rerun with the same input finishes the job.
    ///
    /// # Errors
    /// Before anything is written: [`Error::NotImportable`] for a record of another table than
    /// the consumers' (entity tables have no place here), one without a consumer, or a key
    /// given twice. [`Error::Postgres`] when a statement fails.
    pub async fn import(
        &self,
        client: &mut Client,
        records: &[TransferRecord],
        overwrite: bool,
    ) -> Result<ImportCounts> {
        let positions: Vec<u64> = (1..=records.len() as u64).collect();
        self.import_checked(client, records, &positions, overwrite)
            .await
    }

    /// Reads export lines from `input` (blank lines are passed over) and imports them once
    /// every line has been read and checked: the records as [`PgStore::import`] does, then
    /// the read positions as [`PgStore::import_positions`] does (records first, so that a
    /// consumer resuming from an imported position finds the records of every message
    /// before it).
    ///
    /// ```no_run
    /// # async fn example(client: &mut tokio_postgres::Client, store: idemdb_postgres::PgStore)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// // An embedded store's `idemdb export`: records, then read positions.
    /// let file = std::io::BufReader::new(std::fs::File::open("orders.jsonl").unwrap());
    /// let counts = store.import_lines(client, file, false).await?;
    /// println!(
    ///     "records: {} imported, {} skipped; positions: {} imported, {} advanced, {} skipped",
    ///     counts.imported,
    ///     counts.skipped,
    ///     counts.positions.imported,
    ///     counts.positions.advanced,
    ///     counts.positions.skipped,
    /// );
    /// // The moved consumer resumes where the embedded one stopped.
    /// let billing = store.consumer("billing")?;
    /// let resume_at = billing.positions().get(&*client, "orders", 0).await?.map_or(0, |p| p.next_offset());
    /// # let _ = resume_at;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::ImportInput`] for a malformed line (naming its number) or a failed read;
    /// [`Error::NotImportable`] with the line's number; otherwise as [`PgStore::import`] and
    /// [`PgStore::import_positions`]. Nothing is written on any of the first two.
    pub async fn import_lines(
        &self,
        client: &mut Client,
        input: impl BufRead,
        overwrite: bool,
    ) -> Result<ImportCounts> {
        let lines = read_lines(input)?;
        let (position_lines, positions): (Vec<u64>, Vec<TransferPosition>) =
            lines.positions.into_iter().unzip();
        let position_rows = check_positions(&positions, &position_lines)?;
        let (record_lines, records): (Vec<u64>, Vec<TransferRecord>) =
            lines.records.into_iter().unzip();
        let mut counts = self
            .import_checked(client, &records, &record_lines, overwrite)
            .await?;
        counts.positions = self
            .write_positions(client, &position_rows, overwrite)
            .await?;
        Ok(counts)
    }

    /// Writes `positions` (an export's, typically), each with its offset and time as given.
    /// As the positions API moves a position, an import moves it forward only: where the
    /// consumer has none, or one behind, the imported one is written; where it has one at or
    /// ahead of it, that one stays (counted as skipped), since this store's consumer has read
    /// further. With `overwrite`, every position is written whatever the stored one (an
    /// operator's reset, as [`PgPositions::set`](crate::PgPositions::set)). As the embedded
    /// store's import does. Import the records first ([`PgStore::import`]).
    ///
    /// Written in transactions of up to [`IMPORT_TRANSACTION_RECORDS`] positions, each
    /// locking its positions' rows first: a commit in flight that moves one is waited for,
    /// and compared against once it has landed. A consumer that commits a position afterwards
    /// is held to the imported one as to any other (refused behind it).
    ///
    /// # Errors
    /// Before anything is written: [`Error::NotImportable`] for an offset past
    /// [`POSITION_OFFSET_MAX`], an `updated_at_ms` past `i64::MAX` (the column's range: a time
    /// is kept as exported or refused, never changed), or a position given twice (consumer,
    /// source and partition).
    /// [`Error::Postgres`] when a statement fails; the transactions before it stay written.
    pub async fn import_positions(
        &self,
        client: &mut Client,
        positions: &[TransferPosition],
        overwrite: bool,
    ) -> Result<PositionImportCounts> {
        let indexes: Vec<u64> = (1..=positions.len() as u64).collect();
        let rows = check_positions(positions, &indexes)?;
        self.write_positions(client, &rows, overwrite).await
    }

    /// Writes positions checked by `check_positions`.
    async fn write_positions(
        &self,
        client: &mut Client,
        rows: &[PositionRow<'_>],
        overwrite: bool,
    ) -> Result<PositionImportCounts> {
        let positions_table = self.inner.names.positions();
        let locked = format!(
            "SELECT p.consumer, p.source, p.partition, p.read_offset FROM {positions_table} AS p \
             JOIN unnest($1::bytea[], $2::text[], $3::int8[]) AS i(consumer, source, partition) \
             ON p.consumer = i.consumer AND p.source = i.source AND p.partition = i.partition \
             ORDER BY p.consumer, p.source COLLATE \"C\", p.partition FOR UPDATE OF p"
        );
        // The guard again in the statement: a row made after the lock's read (its first
        // commit, racing the import) is moved forward only, as every writer moves it.
        let upsert = format!(
            "INSERT INTO {positions_table} AS p \
                 (consumer, source, partition, read_offset, updated_at_ms) \
             SELECT * FROM unnest($1::bytea[], $2::text[], $3::int8[], $4::int8[], $5::int8[]) \
             ON CONFLICT (consumer, source, partition) DO UPDATE \
             SET read_offset = excluded.read_offset, updated_at_ms = excluded.updated_at_ms \
             WHERE $6::bool OR p.read_offset < excluded.read_offset"
        );
        let mut counts = PositionImportCounts::default();
        for chunk in rows.chunks(IMPORT_TRANSACTION_RECORDS) {
            let consumers: Vec<&[u8]> = chunk.iter().map(|row| row.consumer).collect();
            let sources: Vec<&str> = chunk.iter().map(|row| row.source).collect();
            let partitions: Vec<i64> = chunk.iter().map(|row| row.partition).collect();
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
                .start()
                .await?;
            let written = async {
                let stored: std::collections::HashMap<(Vec<u8>, String, i64), i64> = tx
                    .query(&locked, &[&consumers, &sources, &partitions])
                    .await?
                    .iter()
                    .map(|row| ((row.get(0), row.get(1), row.get(2)), row.get(3)))
                    .collect();
                let mut chunk_counts = PositionImportCounts::default();
                let mut written: Vec<&PositionRow> = Vec::with_capacity(chunk.len());
                for row in chunk {
                    let key = (row.consumer.to_vec(), row.source.to_owned(), row.partition);
                    let counter = match stored.get(&key) {
                        None => &mut chunk_counts.imported,
                        Some(_) if overwrite => &mut chunk_counts.overwritten,
                        Some(&offset) if offset < row.offset => &mut chunk_counts.advanced,
                        Some(_) => {
                            chunk_counts.skipped += 1;
                            continue;
                        }
                    };
                    *counter += 1;
                    written.push(row);
                }
                let consumers: Vec<&[u8]> = written.iter().map(|row| row.consumer).collect();
                let sources: Vec<&str> = written.iter().map(|row| row.source).collect();
                let partitions: Vec<i64> = written.iter().map(|row| row.partition).collect();
                let offsets: Vec<i64> = written.iter().map(|row| row.offset).collect();
                let times: Vec<i64> = written.iter().map(|row| row.updated_at_ms).collect();
                tx.execute(
                    &upsert,
                    &[
                        &consumers,
                        &sources,
                        &partitions,
                        &offsets,
                        &times,
                        &overwrite,
                    ],
                )
                .await?;
                Ok::<PositionImportCounts, Error>(chunk_counts)
            }
            .await;
            let chunk_counts = match written {
                Ok(counted) => counted,
                Err(error) => {
                    let _ = tx.rollback().await;
                    return Err(error);
                }
            };
            tx.commit().await?;
            counts.imported += chunk_counts.imported;
            counts.advanced += chunk_counts.advanced;
            counts.overwritten += chunk_counts.overwritten;
            counts.skipped += chunk_counts.skipped;
        }
        Ok(counts)
    }

    async fn import_checked(
        &self,
        client: &mut Client,
        records: &[TransferRecord],
        positions: &[u64],
        overwrite: bool,
    ) -> Result<ImportCounts> {
        let rows = check_import(records, positions, &self.inner.lock_namespace)?;
        let records_table = self.inner.names.records();
        let existing = format!(
            "SELECT r.consumer, r.message_key FROM {records_table} AS r \
             JOIN unnest($1::bytea[], $2::bytea[]) AS i(consumer, message_key) \
             ON r.consumer = i.consumer AND r.message_key = i.message_key"
        );
        let delete = format!(
            "DELETE FROM {records_table} AS r \
             USING unnest($1::bytea[], $2::bytea[]) AS d(consumer, message_key) \
             WHERE r.consumer = d.consumer AND r.message_key = d.message_key"
        );
        let insert = format!(
            "INSERT INTO {records_table} (consumer, message_key, record, expires_at_ms) \
             SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::int8[])"
        );
        let mut counts = ImportCounts::default();
        for chunk in rows.chunks(IMPORT_TRANSACTION_RECORDS) {
            let mut chunk: Vec<&ImportRow> = chunk.iter().collect();
            // In one order (the locks' numbers) for every importer: two imports of the same
            // keys wait for each other instead of deadlocking.
            chunk.sort_by_key(|row| row.lock);
            let locks: Vec<i64> = chunk.iter().map(|row| row.lock).collect();
            let consumers: Vec<&[u8]> = chunk.iter().map(|row| row.consumer).collect();
            let keys: Vec<&[u8]> = chunk.iter().map(|row| row.key).collect();
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
                .start()
                .await?;
            // An error rolls back, waited for, so that the chunk's keys are free when it
            // returns (a transaction dropped open rolls back a moment later).
            let written = async {
                tx.execute(
                    "SELECT count(pg_advisory_xact_lock(id)) FROM unnest($1::int8[]) AS id",
                    &[&locks],
                )
                .await?;
                // A statement of its own, after the locks were granted: under READ COMMITTED its
                // snapshot holds every commit of the keys' earlier holders.
                let held: HashSet<(Vec<u8>, Vec<u8>)> = tx
                    .query(&existing, &[&consumers, &keys])
                    .await?
                    .iter()
                    .map(|row| (row.get(0), row.get(1)))
                    .collect();
                let holds =
                    |row: &&ImportRow| held.contains(&(row.consumer.to_vec(), row.key.to_vec()));
                let written: Vec<&ImportRow> = if overwrite {
                    chunk.clone()
                } else {
                    chunk.iter().copied().filter(|row| !holds(row)).collect()
                };
                let replaced = chunk.iter().filter(|row| holds(row)).count() as u64;
                if overwrite && replaced > 0 {
                    let replaced_rows: Vec<&&ImportRow> =
                        chunk.iter().filter(|row| holds(row)).collect();
                    let consumers: Vec<&[u8]> =
                        replaced_rows.iter().map(|row| row.consumer).collect();
                    let keys: Vec<&[u8]> = replaced_rows.iter().map(|row| row.key).collect();
                    tx.execute(&delete, &[&consumers, &keys]).await?;
                }
                let consumers: Vec<&[u8]> = written.iter().map(|row| row.consumer).collect();
                let keys: Vec<&[u8]> = written.iter().map(|row| row.key).collect();
                let values: Vec<&[u8]> = written.iter().map(|row| row.value.as_slice()).collect();
                let expiries: Vec<i64> = written.iter().map(|row| row.expires_at_ms).collect();
                let inserted = tx
                    .execute(&insert, &[&consumers, &keys, &values, &expiries])
                    .await?;
                // A plain INSERT writes every row or fails; anything else is the server's
                // oddity, and the chunk rolls back rather than count what it did not write.
                if inserted != written.len() as u64 {
                    return Err(Error::UnexpectedAnswer {
                        detail: "an import's insert wrote another number of rows than it was given",
                    });
                }
                Ok::<(u64, u64), Error>((replaced, inserted))
            }
            .await;
            let (replaced, inserted) = match written {
                Ok(counted) => counted,
                Err(error) => {
                    let _ = tx.rollback().await;
                    return Err(error);
                }
            };
            tx.commit().await?;
            if overwrite {
                counts.overwritten += replaced;
                counts.imported += chunk.len() as u64 - replaced;
            } else {
                counts.skipped += replaced;
                counts.imported += inserted;
            }
        }
        Ok(counts)
    }
}

impl PgConsumer {
    /// Writes this consumer's records to `out` as export lines, by key, then its read
    /// positions; as [`PgStore::export`].
    ///
    /// # Errors
    /// As [`PgStore::export`].
    pub async fn export(&self, client: &Client, out: &mut impl Write) -> Result<ExportReport> {
        export_rows(&self.store, client, Some(&self.id), out).await
    }
}

/// The rows of `consumer` (every consumer's for `None`) as export lines: its records, then its
/// read positions, read by one statement (one snapshot).
async fn export_rows(
    store: &PgStore,
    client: &Client,
    consumer: Option<&[u8]>,
    out: &mut impl Write,
) -> Result<ExportReport> {
    let records_table = store.inner.names.records();
    let positions_table = store.inner.names.positions();
    let only = if consumer.is_some() {
        "WHERE consumer = $1"
    } else {
        ""
    };
    // The embedded export's order: records first, in their stored keys' order (the consumer's
    // length, the consumer and the key, compared byte by byte, as bytea compares); then
    // positions as its positions are listed, by consumer and source byte by byte (text in the
    // "C" collation) and partition.
    let statement = format!(
        "SELECT * FROM ( \
             SELECT 0 AS kind, consumer, message_key, record, NULL::text AS source, \
                    NULL::int8 AS partition, NULL::int8 AS read_offset, \
                    NULL::int8 AS updated_at_ms \
             FROM {records_table} {only} \
             UNION ALL \
             SELECT 1, consumer, NULL, NULL, source, partition, read_offset, updated_at_ms \
             FROM {positions_table} {only} \
         ) AS lines \
         ORDER BY kind, CASE WHEN kind = 0 THEN length(consumer) END, consumer, message_key, \
                  source COLLATE \"C\", partition"
    );
    let params: Vec<&(dyn ToSql + Sync)> = match &consumer {
        Some(consumer) => vec![consumer],
        None => Vec::new(),
    };
    let rows = client.query_raw(&statement, params).await?;
    let mut rows = std::pin::pin!(rows);
    let mut report = ExportReport::default();
    while let Some(row) = rows.next().await {
        let row = row?;
        let consumer: &[u8] = row.get(1);
        if row.get::<_, i32>(0) == 1 {
            let moved = position(row.get(4), row.get(5), row.get(6), row.get(7));
            PositionLine::of(consumer, &moved)
                .write_to(out)
                .map_err(Error::ExportOutput)?;
            report.positions += 1;
            continue;
        }
        let key: &[u8] = row.get(2);
        let record = match Record::decode(row.get(3)) {
            Ok(record) => record,
            Err(error) => {
                report.corrupt.push(CorruptRow {
                    consumer: consumer.to_vec(),
                    key: key.to_vec(),
                    detail: error.to_string(),
                });
                continue;
            }
        };
        ExportLine::of(CONSUMERS_TABLE, Some(consumer), key, &record)
            .write_to(out)
            .map_err(Error::ExportOutput)?;
        report.exported += 1;
    }
    out.flush().map_err(Error::ExportOutput)?;
    Ok(report)
}

/// A record checked for this backend, as its row.
struct ImportRow<'a> {
    consumer: &'a [u8],
    key: &'a [u8],
    /// The record's bytes (docs/design.md, section 4).
    value: Vec<u8>,
    expires_at_ms: i64,
    lock: i64,
}

/// Checks every record before anything is written: the consumers' table only, with a consumer,
/// no key twice; and makes their rows, each with its key's lock (the claims' lock).
fn check_import<'a>(
    records: &'a [TransferRecord],
    positions: &[u64],
    lock_namespace: &str,
) -> Result<Vec<ImportRow<'a>>> {
    // Both callers make `positions` from the same list as `records` (no input can part them).
    debug_assert_eq!(records.len(), positions.len(), "a position per record");
    let mut seen = HashSet::with_capacity(records.len());
    let mut rows = Vec::with_capacity(records.len());
    for (record, &position) in records.iter().zip(positions) {
        let refuse = |reason: String| Error::NotImportable { position, reason };
        if record.table() != CONSUMERS_TABLE {
            return Err(refuse(format!(
                "a record of table {:?}: PostgreSQL keeps the consumers' records ({CONSUMERS_TABLE:?}) only",
                record.table()
            )));
        }
        let Some(consumer) = record.consumer() else {
            return Err(refuse(format!(
                "a record of {CONSUMERS_TABLE:?} without a consumer"
            )));
        };
        if !seen.insert((consumer, record.key())) {
            return Err(refuse(format!(
                "consumer {} key {} is given twice",
                idemdb::format::printable(consumer),
                idemdb::format::printable(record.key())
            )));
        }
        // Checked by TransferRecord: the stored key encodes.
        let stored_key = idemdb::format::encode_key(consumer, record.key())?;
        rows.push(ImportRow {
            consumer,
            key: record.key(),
            value: record.record().encode(),
            expires_at_ms: row_expiry(record.record()),
            lock: lock_id(lock_namespace, &stored_key),
        });
    }
    Ok(rows)
}

/// The row's `expires_at_ms` for a record: when it becomes removable, as the claims write it.
fn row_expiry(record: &Record) -> i64 {
    let removable_at_ms = match &record.state {
        RecordState::Completed { expires_at_ms, .. } => *expires_at_ms,
        RecordState::Released {
            removable_at_ms, ..
        } => *removable_at_ms,
        // In progress: never removable by itself, whatever the lease (as external claims
        // write it).
        _ => EXPIRES_NEVER_MS,
    };
    expires_column(removable_at_ms)
}

/// A read position checked for this backend, as its row.
struct PositionRow<'a> {
    consumer: &'a [u8],
    source: &'a str,
    partition: i64,
    offset: i64,
    updated_at_ms: i64,
}

/// Checks every position before anything is written: an offset PostgreSQL stores, no position
/// twice; and makes their rows, sorted by consumer, source and partition, so that two imports
/// lock shared rows in one order. `lines` are the positions' places in the input (line
/// numbers, or indexes from 1).
fn check_positions<'a>(
    positions: &'a [TransferPosition],
    lines: &[u64],
) -> Result<Vec<PositionRow<'a>>> {
    assert_eq!(positions.len(), lines.len(), "a line per position");
    let mut seen = HashSet::with_capacity(positions.len());
    let mut rows = Vec::with_capacity(positions.len());
    for (given, &line) in positions.iter().zip(lines) {
        let refuse = |reason: String| Error::NotImportable {
            position: line,
            reason,
        };
        let moved = given.position();
        let label = || {
            format!(
                "the read position of consumer {} in partition {} of {:?}",
                idemdb::format::printable(given.consumer()),
                moved.partition,
                moved.source
            )
        };
        let offset = i64::try_from(moved.offset).map_err(|_| {
            refuse(format!(
                "{}: offset {} is past POSITION_OFFSET_MAX ({POSITION_OFFSET_MAX}), the largest \
                 PostgreSQL stores",
                label(),
                moved.offset
            ))
        })?;
        // Kept as it is, or refused: a time changed on the way would not be the one exported.
        let updated_at_ms = i64::try_from(moved.updated_at_ms).map_err(|_| {
            refuse(format!(
                "{}: updated_at_ms {} is past {}, the largest PostgreSQL stores",
                label(),
                moved.updated_at_ms,
                i64::MAX
            ))
        })?;
        if !seen.insert((given.consumer(), moved.source.as_str(), moved.partition)) {
            return Err(refuse(format!("{} is given twice", label())));
        }
        rows.push(PositionRow {
            consumer: given.consumer(),
            source: &moved.source,
            partition: i64::from(moved.partition),
            offset,
            updated_at_ms,
        });
    }
    rows.sort_by(|a, b| {
        (a.consumer, a.source, a.partition).cmp(&(b.consumer, b.source, b.partition))
    });
    Ok(rows)
}
