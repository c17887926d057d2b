//! Moving the dedup memory in and out: every row as an export line (`idemdb::transfer`, the
//! lines `idemdb export` writes and `idemdb import` reads), and imports of such lines under
//! each key's lock.

use std::collections::HashSet;
use std::io::{BufRead, Write};

use futures_util::StreamExt;
use idemdb::EXPIRES_NEVER_MS;
use idemdb::format::{Record, RecordState};
use idemdb::transfer::{CONSUMERS_TABLE, ExportLine, TransferRecord, read_lines};
use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

use crate::error::{Error, Result};
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
}

/// What an export did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExportReport {
    /// Lines written.
    pub exported: u64,
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
    /// Writes every record, of every consumer, to `out` as export lines, in the order
    /// `idemdb export` writes a consumers' table: by consumer id (shorter first), then by key.
    /// One statement, so one snapshot: claims go on meanwhile, and each line is a record as it
    /// was at that snapshot. Expired rows not yet removed are exported as they are, as the
    /// embedded store's export does.
    ///
    /// # Errors
    /// [`Error::Postgres`] when the read fails; [`Error::ExportOutput`] when writing fails.
    /// A row that does not decode is no error: it is left out and named in the report.
    pub async fn export(&self, client: &Client, out: &mut impl Write) -> Result<ExportReport> {
        export_rows(self, client, None, out).await
    }

    /// Writes `records` (an export, typically) as they are (epochs, timestamps, tokens): a key
    /// that holds no row gets its record; a key that holds one (any state, expired included)
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

    /// Reads export lines from `input` (blank lines are passed over) and imports them as
    /// [`PgStore::import`] does, once every line has been read and checked.
    ///
    /// # Errors
    /// [`Error::ImportInput`] for a malformed line (naming its number) or a failed read;
    /// [`Error::NotImportable`] with the line's number; otherwise as [`PgStore::import`].
    /// Nothing is written on any of the first two.
    pub async fn import_lines(
        &self,
        client: &mut Client,
        input: impl BufRead,
        overwrite: bool,
    ) -> Result<ImportCounts> {
        let (positions, records): (Vec<u64>, Vec<TransferRecord>) =
            read_lines(input)?.into_iter().unzip();
        self.import_checked(client, &records, &positions, overwrite)
            .await
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
    /// Writes this consumer's records to `out` as export lines, by key; as [`PgStore::export`].
    ///
    /// # Errors
    /// As [`PgStore::export`].
    pub async fn export(&self, client: &Client, out: &mut impl Write) -> Result<ExportReport> {
        export_rows(&self.store, client, Some(&self.id), out).await
    }
}

/// The rows of `consumer` (every consumer's for `None`) as export lines.
async fn export_rows(
    store: &PgStore,
    client: &Client,
    consumer: Option<&[u8]>,
    out: &mut impl Write,
) -> Result<ExportReport> {
    let records_table = store.inner.names.records();
    let only = if consumer.is_some() {
        "WHERE consumer = $1"
    } else {
        ""
    };
    // The embedded store's order: its stored key is the consumer's length, the consumer and
    // the key, compared byte by byte (bytea compares that way too).
    let statement = format!(
        "SELECT consumer, message_key, record FROM {records_table} {only} \
         ORDER BY length(consumer), consumer, message_key"
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
        let consumer: &[u8] = row.get(0);
        let key: &[u8] = row.get(1);
        let record = match Record::decode(row.get(2)) {
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
    assert_eq!(records.len(), positions.len(), "a position per record");
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
