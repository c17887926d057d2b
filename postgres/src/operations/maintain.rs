//! Removal of expired records: [`PgStore::maintain`] deletes them oldest first, in small
//! batches that each commit on their own.

use std::time::Duration;

use tokio_postgres::Client;
use tokio_postgres::types::Type;

use crate::error::Result;
use crate::storage::records::now_on_store_clock;
use crate::storage::store::PgStore;
use crate::tables::names::NEVER_MS;

/// How [`PgStore::maintain_with`] removes: how many rows each batch deletes, and the pause
/// between batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Removal {
    batch_rows: u32,
    pause: Duration,
}

impl Default for Removal {
    /// Batches of 1,000 rows, no pause.
    fn default() -> Removal {
        Removal {
            batch_rows: 1_000,
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

    /// A pause after every batch that deleted a full batch (default none): spreads a large
    /// backlog over time, leaving the server's disk and processors to the claims meanwhile.
    #[must_use]
    pub fn pause(mut self, pause: Duration) -> Removal {
        self.pause = pause;
        self
    }
}

/// What [`PgStore::maintain`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Maintenance {
    /// The expired records deleted.
    pub removed: u64,
    /// The batches (transactions) they were deleted in.
    pub batches: u64,
}

impl PgStore {
    /// Deletes the records that had expired when the call began, on the store's clock, with
    /// [`Removal`]'s defaults. Run it regularly (every minute or so, from one process or
    /// several): each run costs what expired since the last, not what the table holds.
    ///
    /// Expired records are found through the index on their removal time, oldest first, and
    /// deleted in batches, each its own transaction. A batch skips rows another transaction
    /// has locked (a claim replacing an expired record), so removal never waits for a claim
    /// and a claim never waits for more than one batch; a row whose record was replaced
    /// since it was found is looked at again and kept (its new removal time is later). Calls
    /// that overlap share the work: each skips the rows the other is deleting. A call given
    /// up half way (its future dropped) has committed the batches before; the one running
    /// commits or rolls back as a whole.
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
    /// it stay removed); [`idemdb::Error::ClockOutOfRange`] for an injected clock beyond
    /// [`idemdb::CLOCK_MS_MAX`], before anything is removed.
    pub async fn maintain(&self, client: &Client) -> Result<Maintenance> {
        self.maintain_with(client, Removal::default()).await
    }

    /// [`maintain`](Self::maintain) in batches of [`Removal::batch_rows`] with
    /// [`Removal::pause`] between them.
    ///
    /// ```no_run
    /// # async fn example(client: &tokio_postgres::Client, store: idemdb_postgres::PgStore)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use idemdb_postgres::Removal;
    /// // A backlog of millions, spread out: 500 rows, then 20 ms for the claims.
    /// let gentle = Removal::default().batch_rows(500).pause(std::time::Duration::from_millis(20));
    /// store.maintain_with(client, gentle).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`maintain`](Self::maintain).
    pub async fn maintain_with(&self, client: &Client, removal: Removal) -> Result<Maintenance> {
        self.check_clock()?;
        // Never the never-removable rows' value, whatever the clock says.
        let now_ms = i64::try_from(now_on_store_clock(client, self).await?)
            .unwrap_or(i64::MAX)
            .min(NEVER_MS - 1);
        let limit = i64::from(removal.batch_rows);
        let mut done = Maintenance::default();
        loop {
            let rows = client
                .query_typed(
                    &self.inner.remove_expired,
                    &[(&now_ms, Type::INT8), (&limit, Type::INT8)],
                )
                .await?;
            let removed: i64 = crate::sql::txn::single_row(rows)?.get(0);
            done.removed += u64::try_from(removed).unwrap_or(0);
            done.batches += 1;
            if removed < limit {
                return Ok(done);
            }
            if !removal.pause.is_zero() {
                tokio::time::sleep(removal.pause).await;
            }
        }
    }
}
