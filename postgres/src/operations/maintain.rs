//! Removal and the partitions ahead: [`PgStore::maintain`], [`PgStore::partitions`], and the
//! partitions a claim makes sure of before its transaction.

use std::sync::atomic::Ordering;

use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::sql::clock::database_now_ms;
use crate::sql::clock::local_now_ms;
use crate::storage::records::now_on_store_clock;
use crate::storage::store::PgStore;
use crate::tables::names::DAY_MS;
use crate::tables::partitions::{self, DayPartition, RemovalTurn};

/// What [`PgStore::maintain`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Maintenance {
    /// The last day (since 1970-01-01, UTC) whose partition now exists.
    pub partitions_through_day: i64,
    /// The day partitions dropped, every row of them expired.
    pub dropped: Vec<String>,
}

/// A partition of the records table, as [`PgStore::partitions`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partition {
    /// Qualified: `schema.table_dN`, N its first day.
    pub name: String,
    /// Its first day (since 1970-01-01, UTC): it holds the rows that become removable on this
    /// day and the `days - 1` days after it.
    pub first_day: i64,
    /// The days it covers: the store's partition width (`InstallOptions::partition_days`).
    pub days: u32,
    /// Every row of it is removable now, on the store's clock: [`PgStore::maintain`] drops it.
    pub removable: bool,
}

impl PgStore {
    /// The partitions of the records table, oldest first, with what [`maintain`](Self::maintain)
    /// would do to each now. For operators and monitoring: a removable partition that stays
    /// means `maintain` is not running.
    ///
    /// # Errors
    /// [`Error::Postgres`] when a statement fails.
    pub async fn partitions(&self, client: &Client) -> Result<Vec<Partition>> {
        let removable = self.removable_rule(client).await?;
        Ok(partitions::day_partitions(client, &self.inner.names)
            .await?
            .into_iter()
            .map(|partition| Partition {
                removable: removable(&partition),
                name: partition.name,
                first_day: partition.day,
                days: self.inner.partition_days,
            })
            .collect())
    }

    /// Whether every row of a partition is removable now, on the store's clock: once the day
    /// after its last has begun.
    async fn removable_rule(
        &self,
        client: &Client,
    ) -> Result<impl Fn(&DayPartition) -> bool + use<>> {
        let now_ms = i64::try_from(now_on_store_clock(client, self).await?).unwrap_or(i64::MAX);
        let days = i64::from(self.inner.partition_days);
        Ok(move |partition: &DayPartition| {
            partition.day.saturating_add(days).saturating_mul(DAY_MS) <= now_ms
        })
    }

    /// Creates the partitions of the days ahead and drops those whose rows have all expired.
    /// Run it regularly (hourly, say, from one process or several): removal is one dropped
    /// partition per day, never a `DELETE` of rows, so it costs the same at any number of
    /// records and leaves no dead rows behind.
    ///
    /// Calls that overlap, from one process or several, take turns: each waits for the
    /// removals that began before it (a session-level advisory lock on the connection) and
    /// then drops what is still removable, so every call succeeds, and when one returns
    /// every partition removable when it took its turn is gone. A call given up half way (its
    /// future dropped) gives its turn back once the server has run what it sent; a partition
    /// it detached but did not drop is dropped by the next call (and listed in its
    /// [`Maintenance::dropped`]). A dropped partition is first detached
    /// concurrently (a lock that claims do not wait for), so claims go on meanwhile; the
    /// detach itself waits for the transactions that began before it (claims open then, and
    /// any other), so `maintain` takes as long as the longest of them.
    ///
    /// Claims create the partitions they need on their own (before their transaction, once a
    /// day per process); only removal needs this call. Without it, expired records stay
    /// (reads treat them as absent, exactly at their expiry millisecond) and take space.
    ///
    /// A drop gives a day's files back to the file system at once, and on the file system of
    /// the server's WAL that holds up the commits syncing it meanwhile (tens of milliseconds
    /// for a gigabyte on ext4, measured in BENCHMARKS.md). Partitions follow the records
    /// table's tablespace (`ALTER TABLE <schema>.<table> SET TABLESPACE <name>`, which moves
    /// nothing and places every partition made later), so a tablespace on another file system
    /// keeps the drops off the WAL's. That eased the stall in the harness without removing it:
    /// the detaches make every session plan its statements again.
    ///
    /// # Errors
    /// [`Error::Postgres`] when a statement fails. A detach interrupted by a lost connection is
    /// finished by the next call.
    pub async fn maintain(&self, client: &mut Client) -> Result<Maintenance> {
        let through_day = self.ensure_partitions(client, true).await?;
        let client: &Client = client;
        // Partitions are listed once the turn is taken, so that a call that waited finds
        // what the one before it dropped gone.
        let turn = RemovalTurn::take(client, &self.inner.names).await?;
        let mut dropped = Vec::new();
        let removed = async {
            // One reading of the clock decides both lists.
            let removable = self.removable_rule(client).await?;
            for partition in partitions::day_partitions(client, &self.inner.names).await? {
                if removable(&partition) {
                    partitions::drop_partition(client, &self.inner.names, &partition).await?;
                    dropped.push(partition.name);
                }
            }
            // What an earlier call detached and was given up before it could drop.
            for table in partitions::detached_day_tables(client, &self.inner.names).await? {
                if removable(&table) {
                    partitions::drop_detached(client, &table).await?;
                    dropped.push(table.name);
                }
            }
            Ok::<(), Error>(())
        }
        .await;
        // Given up on an error too, and waited for: the next call's turn comes at once.
        let ended = turn.end().await;
        removed?;
        ended?;
        Ok(Maintenance {
            partitions_through_day: through_day,
            dropped,
        })
    }

    /// Makes sure the partitions from today through the day after the last a record written
    /// now can expire on exist; skipped when this process already made sure, unless `always`.
    /// Today is by this process's clock and, when no clock is injected, by the database's too
    /// (read here: records take its time, and the two may be days apart); the extra day
    /// covers the database's day turning before this process's does.
    ///
    /// # Errors
    /// [`idemdb::Error::ClockOutOfRange`] for an injected clock beyond
    /// [`idemdb::CLOCK_MS_MAX`], as the embedded engine; [`Error::Postgres`] when a statement
    /// fails.
    pub(crate) async fn ensure_partitions(&self, client: &mut Client, always: bool) -> Result<i64> {
        let injected = match &self.inner.clock {
            Some(clock) => {
                let now_ms = clock.now_ms();
                if now_ms > idemdb::CLOCK_MS_MAX {
                    return Err(idemdb::Error::ClockOutOfRange { now_ms }.into());
                }
                Some(now_ms)
            }
            None => None,
        };
        let local_ms = injected.unwrap_or_else(local_now_ms);
        let retention_ms = self.inner.retention_ms;
        let known = &self.inner.partitions_through_day;
        if !always
            && known.load(Ordering::Acquire) >= partition_span(local_ms, local_ms, retention_ms).1
        {
            return Ok(known.load(Ordering::Acquire));
        }
        let db_ms = match injected {
            Some(now_ms) => now_ms,
            None => database_now_ms(client).await?,
        };
        let (first_day, last_day) =
            partition_span(local_ms.min(db_ms), local_ms.max(db_ms), retention_ms);
        partitions::ensure_partitions(
            client,
            &self.inner.names,
            first_day,
            last_day,
            self.inner.partition_days,
        )
        .await?;
        known.fetch_max(last_day, Ordering::AcqRel);
        Ok(last_day)
    }

    /// Now, on the store's clock: the injected one, or the database's reading `db_now_ms`.
    pub(crate) fn now_ms(&self, db_now_ms: i64) -> u64 {
        match &self.inner.clock {
            Some(clock) => clock.now_ms(),
            None => u64::try_from(db_now_ms).unwrap_or(0),
        }
    }
}

/// The days whose partitions records written between `from_ms` and `to_ms` need: from the
/// first's day through the day after the last expiry, `retention_ms` after `to_ms`, and never
/// past the last day that has a partition of its own (later rows go to the open partition).
pub(crate) fn partition_span(from_ms: u64, to_ms: u64, retention_ms: u64) -> (i64, i64) {
    let day_of = |ms: u64| i64::try_from(ms).unwrap_or(i64::MAX) / DAY_MS;
    let last_day = (day_of(to_ms.saturating_add(retention_ms)) + 1)
        .min(crate::tables::names::DAY_PARTITION_LAST);
    (day_of(from_ms).min(last_day), last_day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::names::DAY_MS;

    const DAY: u64 = DAY_MS as u64;

    #[test]
    fn partitions_cover_both_clocks_days_and_stop_at_the_last_day_partition() {
        // The database three days ahead of this process: its records' days are covered.
        let local = 100 * DAY + DAY / 2;
        let db = local + 3 * DAY;
        assert_eq!(partition_span(local, db, 7 * DAY), (100, 111));
        // Behind it: from the database's day on.
        assert_eq!(partition_span(local - 2 * DAY, local, 7 * DAY), (98, 108));
        // Clocks at the far end: no overflow, and no day partition past the last.
        let last = crate::tables::names::DAY_PARTITION_LAST;
        assert_eq!(
            partition_span(u64::MAX / 2, u64::MAX, 7 * DAY),
            (last, last)
        );
        assert_eq!(partition_span(0, idemdb::CLOCK_MS_MAX, 0), (0, last));
    }
}
