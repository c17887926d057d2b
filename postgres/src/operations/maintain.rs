//! Removal of expired records: [`PgStore::maintain`] deletes them oldest first, in small
//! batches that each commit on their own.

use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, SimpleQueryMessage};

use crate::error::{Error, Result};
use crate::storage::records::{Locked, now_on_store_clock, remove_expired_sql};
use crate::storage::store::{PgStore, clock_in_range};
use crate::tables::names::NEVER_MS;

/// How [`PgStore::maintain_with`] removes: how many rows each batch deletes, the share of the
/// time it keeps a batch running, and a fixed pause between batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Removal {
    batch_rows: u32,
    busy_percent: u8,
    pause: Duration,
}

impl Default for Removal {
    /// Batches of 1,000 rows, busy 10% of the time, no fixed pause.
    fn default() -> Removal {
        Removal {
            batch_rows: 1_000,
            busy_percent: 10,
            pause: Duration::ZERO,
        }
    }
}

impl Removal {
    /// Rows deleted per batch (default 1,000; 0 is taken as 1). Each batch is one transaction: its
    /// rows' locks and its WAL are that small, whatever has expired.
    #[must_use]
    pub fn batch_rows(mut self, rows: u32) -> Removal {
        self.batch_rows = rows.max(1);
        self
    }

    /// The share of the time removal keeps a batch running, in percent (default 10; taken
    /// into 1..=100; 100 runs the batches back to back). After a full batch that took `t`, it
    /// waits `t * (100 - percent) / percent`, so it paces itself by what its batches cost: a
    /// loaded server makes its batches slower and its pauses longer, and a backlog of
    /// millions never takes more than this share of a connection's time, whatever the batch
    /// size. The default leaves the server to the claims while a backlog is removed
    /// (BENCHMARKS.md, PG4); 100 removes it as fast as the server deletes.
    #[must_use]
    pub fn busy_percent(mut self, percent: u8) -> Removal {
        self.busy_percent = percent.clamp(1, 100);
        self
    }

    /// A fixed pause after every batch that chose a full batch (default none), added to the
    /// one [`busy_percent`](Self::busy_percent) asks for: spreads a large backlog over time,
    /// leaving the server's disk and processors to the claims meanwhile.
    #[must_use]
    pub fn pause(mut self, pause: Duration) -> Removal {
        self.pause = pause;
        self
    }

    /// The wait after a full batch that took `took`.
    fn wait_after(&self, took: Duration) -> Duration {
        let idle = u32::from(100 - self.busy_percent);
        self.pause + took * idle / u32::from(self.busy_percent)
    }
}

/// What [`PgStore::maintain`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Maintenance {
    /// The expired records deleted.
    pub removed: u64,
    /// The batches (transactions) sent, the last one included, which chose fewer rows than
    /// a batch holds and may have found none: 2,000 expired rows in batches of 1,000 are 3
    /// batches, an empty table 1. A batch sent again after meeting a held row counts once.
    pub batches: u64,
}

impl PgStore {
    /// Deletes the records that had expired when the call began, on the store's clock, with
    /// [`Removal`]'s defaults. Run it regularly (every minute or so, from one process or
    /// several): each run costs what expired since the last, not what the table holds.
    ///
    /// Expired records are found through the index on their removal time, oldest first, and
    /// deleted in batches, each its own transaction, which commits without waiting for its
    /// WAL to reach the disk (a removal lost in a crash is done again by the next call; a
    /// claim's own commit makes it durable). A batch that meets a row another transaction
    /// holds (a claim replacing an expired record, an overlapping call) waits at most 20 ms,
    /// then goes around it, leaving it to the next call: a claim never waits for more than
    /// one batch. A row whose record was replaced since it was found is looked at again and
    /// kept (its new removal time is later). Calls that overlap share the work. A call given
    /// up half way (its future dropped) has committed the batches before; the one running
    /// commits or rolls back as a whole.
    ///
    /// Each batch is a transaction of its own at READ COMMITTED, whatever the session's
    /// default: call it outside any transaction of the caller's (as every call of this crate).
    /// Inside one, at any isolation level, whether it has run a statement or only `BEGIN`, in
    /// a savepoint or not, the first batch fails with `Error::Postgres` (SQLSTATE 25001,
    /// `active_sql_transaction`) before it deletes or sets anything, and nothing is removed.
    /// The failure aborts the caller's transaction, as any failed statement does: its
    /// `COMMIT` rolls back, its own writes with it (a `ROLLBACK TO SAVEPOINT` of a savepoint
    /// taken before the call keeps them), so the batch's settings (`synchronous_commit` off,
    /// its lock timeout) never reach a commit of the caller's. Every batch checks it, the one
    /// sent again around held rows too. The 20 ms bound is for rows; a lock on the
    /// whole table (a DDL statement's) is waited for as any statement waits, under the
    /// session's own `lock_timeout`.
    ///
    /// Deleted rows leave their space to autovacuum, which the table is installed to run after
    /// 1% of it changed, so new records reuse it and the table stays near the size of its
    /// live records. Nothing is given back to the file system at once.
    ///
    /// Without it, expired records stay (reads treat them as absent, exactly at their expiry
    /// millisecond) and take space.
    ///
    /// ```no_run
    /// # async fn example(client: &tokio_postgres::Client, store: idemdb_postgres::PgStore)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// let done = store.maintain(client).await?;
    /// println!("{} expired records removed in {} batches", done.removed, done.batches);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::Postgres`](crate::Error::Postgres) when a statement fails (the batches before
    /// it stay removed), with SQLSTATE 25001 when called inside a transaction of the caller's
    /// (see above); [`idemdb::Error::ClockOutOfRange`] for an injected clock beyond
    /// [`idemdb::CLOCK_MS_MAX`], before anything is removed.
    pub async fn maintain(&self, client: &Client) -> Result<Maintenance> {
        self.maintain_with(client, Removal::default()).await
    }

    /// [`maintain`](Self::maintain) in batches of [`Removal::batch_rows`], busy
    /// [`Removal::busy_percent`] of the time, with [`Removal::pause`] between batches.
    ///
    /// ```no_run
    /// # async fn example(client: &tokio_postgres::Client, store: idemdb_postgres::PgStore)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use idemdb_postgres::Removal;
    /// // A backlog of millions, spread out: batches of 500 rows, running a quarter of the time.
    /// let gentle = Removal::default().batch_rows(500).busy_percent(25);
    /// store.maintain_with(client, gentle).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`maintain`](Self::maintain).
    pub async fn maintain_with(&self, client: &Client, removal: Removal) -> Result<Maintenance> {
        // The clock is read once: what is checked is what decides.
        let now_ms = clock_in_range(now_on_store_clock(client, self.read_clock()?).await?)?;
        // Never the never-removable rows' value, whatever the clock says.
        let now_ms = i64::try_from(now_ms).unwrap_or(i64::MAX).min(NEVER_MS - 1);
        let limit = i64::from(removal.batch_rows);
        let records = self.inner.names.records();
        let mut done = Maintenance::default();
        loop {
            let started = Instant::now();
            let (chosen, removed) = remove_batch(client, &records, now_ms, limit).await?;
            done.removed += u64::try_from(removed).unwrap_or(0);
            done.batches += 1;
            // A short choice is the end; a short delete is not (rows chosen and then taken
            // again by claims, or by an overlapping call, are not deleted).
            if chosen < limit {
                return Ok(done);
            }
            let wait = removal.wait_after(started.elapsed());
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// One batch of removal: (rows chosen, rows deleted). Deletes without locking first (one WAL
/// record per row instead of two); where that would wait for a row another transaction holds
/// (a claim replacing an expired record, an overlapping call), the batch rolls back at its
/// lock timeout and is sent again skipping locked rows.
async fn remove_batch(
    client: &Client,
    records: &str,
    now_ms: i64,
    limit: i64,
) -> Result<(i64, i64)> {
    let waiting = remove_expired_sql(records, now_ms, limit, Locked::Wait);
    match client.simple_query(&waiting).await {
        Ok(messages) => counts(&messages),
        Err(error)
            if matches!(
                error.code(),
                Some(&SqlState::LOCK_NOT_AVAILABLE | &SqlState::T_R_DEADLOCK_DETECTED)
            ) =>
        {
            let skipping = remove_expired_sql(records, now_ms, limit, Locked::Skip);
            counts(&client.simple_query(&skipping).await?)
        }
        Err(error) => Err(error.into()),
    }
}

/// The counts a batch of removal answers with: the one row among the simple query's messages.
fn counts(messages: &[SimpleQueryMessage]) -> Result<(i64, i64)> {
    let count = |row: &tokio_postgres::SimpleQueryRow, at| {
        row.get(at)
            .and_then(|count: &str| count.parse::<i64>().ok())
    };
    messages
        .iter()
        .find_map(|message| match message {
            SimpleQueryMessage::Row(row) => Some((count(row, 0)?, count(row, 1)?)),
            _ => None,
        })
        .ok_or(Error::UnexpectedAnswer {
            detail: "a batch of removal answered no count",
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_is_the_idle_share_of_the_batch_plus_the_pause() {
        let batch = Duration::from_millis(40);
        assert_eq!(Removal::default().wait_after(batch), batch * 9);
        assert_eq!(
            Removal::default().busy_percent(100).wait_after(batch),
            Duration::ZERO
        );
        assert_eq!(Removal::default().busy_percent(50).wait_after(batch), batch);
        assert_eq!(
            Removal::default().busy_percent(20).wait_after(batch),
            Duration::from_millis(160)
        );
        assert_eq!(
            Removal::default()
                .busy_percent(0)
                .pause(Duration::from_millis(5))
                .wait_after(Duration::from_millis(1)),
            Duration::from_millis(104)
        );
        assert_eq!(
            Removal::default().busy_percent(255),
            Removal::default().busy_percent(100)
        );
    }
}
