//! Read positions of log consumers on PostgreSQL: the positions a claim or a batch stages, their
//! write (`<table>_advance_positions`, in the claim's transaction) and what its refusal means,
//! and a stored row as a [`Position`]. The handle is `operations/positions.rs`.

use idemdb::Position;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::sql::txn::Statement;
use crate::storage::store::PgStore;
use crate::tables::install::POSITION_BEHIND_SQLSTATE;

/// The highest offset PostgreSQL stores (a `bigint`): offsets past it are refused.
pub const POSITION_OFFSET_MAX: u64 = i64::MAX as u64;

/// The positions a commit writes: (source, partition, offset), one entry per partition with
/// the highest offset staged for it, sorted, so that two transactions moving the same
/// partitions lock their rows in one order.
#[derive(Debug, Default)]
pub(crate) struct StagedPositions {
    entries: Vec<(String, i64, i64)>,
}

impl StagedPositions {
    /// Stages `offset` for `partition` of `source`, checked.
    pub(crate) fn stage(&mut self, source: &str, partition: u32, offset: u64) -> Result<()> {
        idemdb::format::check_position_source(source)?;
        let offset = check_offset(offset)?;
        let partition = i64::from(partition);
        match self
            .entries
            .iter_mut()
            .find(|(staged, at, _)| staged == source && *at == partition)
        {
            Some((_, _, highest)) => *highest = (*highest).max(offset),
            None => {
                self.entries.push((source.to_owned(), partition, offset));
                self.entries.sort();
            }
        }
        Ok(())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The statement's parameters: the consumer, the three arrays, the time.
    pub(crate) fn params(&self, consumer: &[u8], now_ms: u64) -> PositionParams {
        PositionParams {
            consumer: consumer.to_vec(),
            sources: self.entries.iter().map(|(s, _, _)| s.clone()).collect(),
            partitions: self.entries.iter().map(|(_, p, _)| *p).collect(),
            offsets: self.entries.iter().map(|(_, _, o)| *o).collect(),
            at_ms: i64::try_from(now_ms).unwrap_or(i64::MAX),
        }
    }
}

/// The owned parameters of one call of `<table>_advance_positions`.
pub(crate) struct PositionParams {
    consumer: Vec<u8>,
    sources: Vec<String>,
    partitions: Vec<i64>,
    offsets: Vec<i64>,
    at_ms: i64,
}

impl PositionParams {
    pub(crate) fn typed(&self) -> [(&(dyn ToSql + Sync), Type); 5] {
        [
            (&self.consumer, Type::BYTEA),
            (&self.sources, Type::TEXT_ARRAY),
            (&self.partitions, Type::INT8_ARRAY),
            (&self.offsets, Type::INT8_ARRAY),
            (&self.at_ms, Type::INT8),
        ]
    }
}

/// The statement that moves positions: `SELECT <table>_advance_positions($1, ..., $5)`.
pub(crate) fn advance_sql(store: &PgStore) -> &str {
    &store.inner.advance_positions
}

/// A statement of `advance_sql` with its parameters.
pub(crate) fn advance_statement<'a>(
    store: &'a PgStore,
    params: &'a [(&'a (dyn ToSql + Sync), Type)],
) -> Statement<'a> {
    (advance_sql(store), params)
}

fn check_offset(offset: u64) -> Result<i64> {
    i64::try_from(offset).map_err(|_| {
        Error::Idemdb(idemdb::Error::InvalidArgument {
            reason: format!(
                "offset {offset} is past POSITION_OFFSET_MAX ({POSITION_OFFSET_MAX}), the \
                 largest PostgreSQL stores"
            ),
        })
    })
}

/// The error `<table>_advance_positions` raised for a position behind the stored one, as the
/// embedded engine's [`idemdb::Error::PositionBehind`]; `None` for any other error.
pub(crate) fn position_behind(error: &tokio_postgres::Error) -> Option<Error> {
    let db = error.as_db_error()?;
    if db.code().code() != POSITION_BEHIND_SQLSTATE {
        return None;
    }
    let detail = db.detail()?;
    let mut parts = detail.splitn(4, ' ');
    let stored = parts.next()?.parse().ok()?;
    let staged = parts.next()?.parse().ok()?;
    let partition = parts.next()?.parse().ok()?;
    let source_name = parts.next()?.to_owned();
    Some(Error::Idemdb(idemdb::Error::PositionBehind {
        source_name,
        partition,
        stored,
        staged,
    }))
}

/// A row's columns as a [`Position`] (the table's types are wider than the values written).
pub(crate) fn position(
    source: String,
    partition: i64,
    offset: i64,
    updated_at_ms: i64,
) -> Position {
    Position::new(
        source,
        u32::try_from(partition).unwrap_or(u32::MAX),
        u64::try_from(offset).unwrap_or(0),
        u64::try_from(updated_at_ms).unwrap_or(0),
    )
}
