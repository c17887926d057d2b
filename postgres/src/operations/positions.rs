//! A consumer's read positions on PostgreSQL ([`PgPositions`]): read to resume, moved on their
//! own for messages settled without a claim, reset by an operator. Claims and batches stage
//! theirs (`PgClaim::stage_position`, `PgClaimBatch::stage_position`), and `apply_at` takes
//! one ([`ReadPosition`]).

use idemdb::Position;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient};

use crate::error::{Error, Result};
use crate::storage::positions::{StagedPositions, advance_sql, position, position_behind};
use crate::storage::store::PgConsumer;

/// Where a message was read in a log: its `offset` in `partition` of `source` (a topic, a
/// stream), the position [`PgConsumer::apply_at`] writes with the message's record, as
/// [`PgClaim::stage_position`](crate::PgClaim::stage_position) takes it.
///
/// ```
/// let at = idemdb_postgres::ReadPosition::new("orders", 3, 41);
/// assert_eq!((at.source, at.partition, at.offset), ("orders", 3, 41));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadPosition<'a> {
    /// The log: a topic, a stream.
    pub source: &'a str,
    /// The partition of the source (0 for a log without partitions).
    pub partition: u32,
    /// The message's offset: the partition's position once the message is committed (a
    /// restart resumes at `offset + 1`).
    pub offset: u64,
}

impl<'a> ReadPosition<'a> {
    /// The message at `offset` of `partition` of `source`. Checked when used.
    #[must_use]
    pub fn new(source: &'a str, partition: u32, offset: u64) -> ReadPosition<'a> {
        ReadPosition {
            source,
            partition,
            offset,
        }
    }
}

/// One consumer's read positions on PostgreSQL ([`PgConsumer::positions`]): where it resumes
/// each partition of each log it reads. Written by
/// [`PgClaim::stage_position`](crate::PgClaim::stage_position) and
/// [`PgClaimBatch::stage_position`](crate::PgClaimBatch::stage_position) in the claim's
/// transaction, by [`PgConsumer::apply_at`] in `apply`'s, and by [`PgPositions::advance`] for
/// messages that need no claim; reset by an operator with [`PgPositions::set`] and
/// [`PgPositions::remove`].
#[derive(Clone, Debug)]
pub struct PgPositions {
    consumer: PgConsumer,
}

impl PgConsumer {
    /// This consumer's read positions in the logs it consumes, as the embedded engine's
    /// `Consumer::positions`: stage one with each claim's commit and resume from it after a
    /// restart.
    ///
    /// ```no_run
    /// # async fn example(client: &mut tokio_postgres::Client, billing: idemdb_postgres::PgConsumer)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// use idemdb::{Fingerprint, Outcome};
    /// let positions = billing.positions();
    /// // Where to start partition 3 of "orders": one past the last committed offset.
    /// let start = positions.get(client, "orders", 3).await?.map_or(0, |p| p.next_offset());
    /// # let _ = start;
    /// // The message at offset 41: its record, business SQL and position in one transaction.
    /// if let Outcome::Fresh(mut claim) = billing.begin(client, "order-42", Fingerprint::of(b"body")).await? {
    ///     claim.stage_position("orders", 3, 41)?;
    ///     claim.commit(b"charged").await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn positions(&self) -> PgPositions {
        PgPositions {
            consumer: self.clone(),
        }
    }
}

impl PgPositions {
    /// The stored position of `partition` of `source`, or `None` if nothing was committed
    /// there.
    ///
    /// # Errors
    /// [`Error::Idemdb`] with `LimitExceeded` for a source outside
    /// [`idemdb::POSITION_SOURCE_BYTES_MIN`]..=[`idemdb::POSITION_SOURCE_BYTES_MAX`] bytes,
    /// with `InvalidArgument` for one containing NUL (which a text column cannot hold);
    /// [`Error::Postgres`] if the read fails.
    pub async fn get(
        &self,
        client: &impl GenericClient,
        source: &str,
        partition: u32,
    ) -> Result<Option<Position>> {
        let statement = &self.consumer.store.inner.read_position;
        self.one_position(client, statement, source, partition)
            .await
    }

    /// Moves the position of `partition` of `source` to `offset` on its own (its own
    /// transaction): for messages read and settled without a claim (filtered out, a
    /// duplicate, `Stale`, `TooLate`).
    ///
    /// # Errors
    /// [`Error::Idemdb`] with [`idemdb::Error::PositionBehind`] if `offset` is behind the
    /// stored position (nothing is written); with `InvalidArgument` for an offset past
    /// [`crate::POSITION_OFFSET_MAX`]; otherwise as for [`PgPositions::get`].
    pub async fn advance(
        &self,
        client: &Client,
        source: &str,
        partition: u32,
        offset: u64,
    ) -> Result<()> {
        let mut staged = StagedPositions::default();
        staged.stage(source, partition, offset)?;
        let store = &self.consumer.store;
        // Read once (an injected clock checked before anything is sent).
        let now_ms =
            crate::storage::records::now_on_store_clock(client, store.read_clock()?).await?;
        let params = staged.params(&self.consumer.id, now_ms);
        let typed = params.typed();
        let values: Vec<&(dyn ToSql + Sync)> = typed.iter().map(|(value, _)| *value).collect();
        match client.execute(advance_sql(store), &values).await {
            Ok(_) => Ok(()),
            Err(error) => Err(position_behind(&error).unwrap_or(Error::Postgres(error))),
        }
    }

    /// Sets the position of `partition` of `source` to `offset`, forwards or backwards, and
    /// returns the one it replaced (`None`: there was none): an operator's reset, so that the
    /// consumer resumes at `offset + 1` when it next starts (to read again from offset `n`,
    /// set `n - 1`; to read a partition from its start, [`remove`](PgPositions::remove) the
    /// position). As the embedded engine's `admin::Store::set_position`, for a stopped
    /// consumer: stop the consumer's processes first. A running one goes on from where it
    /// is, and its next commit either moves the position forward again (after a reset
    /// backwards) or is refused as behind it (after a reset forwards).
    ///
    /// ```no_run
    /// # async fn example(client: &tokio_postgres::Client, billing: idemdb_postgres::PgConsumer)
    /// # -> Result<(), idemdb_postgres::Error> {
    /// // Read partition 3 of "orders" again from offset 100 on, once billing restarts.
    /// let was = billing.positions().set(client, "orders", 3, 99).await?;
    /// println!("was {:?}", was.map(|position| position.offset));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`PgPositions::advance`], without `PositionBehind`: any offset up to
    /// [`crate::POSITION_OFFSET_MAX`] is taken. [`idemdb::Error::ClockOutOfRange`] (in
    /// [`Error::Idemdb`]) for an injected clock past [`idemdb::CLOCK_MS_MAX`].
    pub async fn set(
        &self,
        client: &impl GenericClient,
        source: &str,
        partition: u32,
        offset: u64,
    ) -> Result<Option<Position>> {
        let mut staged = StagedPositions::default();
        staged.stage(source, partition, offset)?;
        let store = &self.consumer.store;
        // The injected clock's one reading, or the statement's own time.
        let at_ms: Option<i64> = store
            .read_clock()?
            .injected()
            .map(|now_ms| i64::try_from(now_ms).unwrap_or(i64::MAX));
        let consumer: &[u8] = &self.consumer.id;
        let offset = i64::try_from(offset).unwrap_or(i64::MAX);
        let row = client
            .query_opt(
                &store.inner.set_position,
                &[&consumer, &source, &i64::from(partition), &offset, &at_ms],
            )
            .await?;
        Ok(row.map(|row| row_position(source, partition, &row)))
    }

    /// Removes the position of `partition` of `source` and returns it (`None`: there was
    /// none, and nothing changed): the consumer then starts the partition wherever it starts
    /// without a position (its beginning, as the consumer chooses). An operator's reset, for
    /// a stopped consumer, as [`set`](PgPositions::set).
    ///
    /// # Errors
    /// As [`PgPositions::get`].
    pub async fn remove(
        &self,
        client: &impl GenericClient,
        source: &str,
        partition: u32,
    ) -> Result<Option<Position>> {
        let statement = &self.consumer.store.inner.remove_position;
        self.one_position(client, statement, source, partition)
            .await
    }

    /// Runs `statement` (reading or removing one position: consumer, source, partition) and
    /// gives the position its row holds, if any.
    async fn one_position(
        &self,
        client: &impl GenericClient,
        statement: &str,
        source: &str,
        partition: u32,
    ) -> Result<Option<Position>> {
        idemdb::format::check_position_source(source)?;
        let consumer: &[u8] = &self.consumer.id;
        let row = client
            .query_opt(statement, &[&consumer, &source, &i64::from(partition)])
            .await?;
        Ok(row.map(|row| row_position(source, partition, &row)))
    }

    /// Every stored position of this consumer, ordered by source (byte order of the name, as
    /// the embedded engine lists them) and partition.
    ///
    /// # Errors
    /// [`Error::Postgres`] if the read fails.
    pub async fn list(&self, client: &impl GenericClient) -> Result<Vec<Position>> {
        let consumer: &[u8] = &self.consumer.id;
        let rows = client
            .query(&self.consumer.store.inner.list_positions, &[&consumer])
            .await?;
        Ok(rows
            .iter()
            .map(|row| position(row.get(0), row.get(1), row.get(2), row.get(3)))
            .collect())
    }
}

/// The position of `partition` of `source` whose offset and time are a statement's row.
fn row_position(source: &str, partition: u32, row: &tokio_postgres::Row) -> Position {
    position(
        source.to_owned(),
        i64::from(partition),
        row.get(0),
        row.get(1),
    )
}
