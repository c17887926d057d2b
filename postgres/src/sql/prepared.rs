//! The store's statements, prepared once per connection and then only bound and run.
//!
//! An unnamed statement is parsed and planned every time it runs, and planning a statement on
//! the partitioned records table costs more than running it (every day partition is a
//! relation to open and lock at plan time). A named statement is parsed once per connection,
//! and the server keeps its plan.
//!
//! tokio-postgres has no handle on "this connection" to hang statements on, and the API takes
//! the caller's `&Client` on every call, so the statements are kept by the client's address.
//! A kept plan has a trap: it is planned once, on the table as it was then. A plan made while a
//! day partition was nearly empty scans it whole (the cheapest way to read a page or two),
//! and keeps scanning it whole as it grows to millions of rows, until an `ANALYZE` happens to
//! throw the plan away. So the store's statements are always planned with sequential scans
//! off ([`crate::sql::txn::ClaimTransaction`] turns them off for its own statements and back to
//! the session's setting before the caller's run): their plans look keys up in the indexes,
//! right at every size.
//!
//! An address can outlive its connection (a client dropped, another built in its place). That
//! is safe: statement names are unique within the process (tokio-postgres numbers them from
//! one counter), so a statement kept for a gone connection does not exist on the new one, and
//! running it fails with `invalid_sql_statement_name` (26000) before anything is written. Every
//! transaction starts with [`crate::sql::txn::ClaimTransaction::begin_with`] or
//! [`crate::sql::txn::ClaimTransaction::run_whole`], and each sends the setting restored behind the
//! store's statements, which every kind of transaction shares: so whatever kinds of call the
//! old connection made, the new one meets a missing statement at the start of its first
//! transaction, in any answer (the restored setting's included), forgets the address and runs
//! again with statements prepared anew. A commit that still meets one (deallocated after its
//! claim began) forgets the address and fails with `StatementDeallocated`, nothing written.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Statement};

use crate::sql::pipeline::in_order;

/// How many connections' statements are kept; past it the least recently used connection's
/// are dropped (and closed on the server, when that connection is still open).
const CONNECTIONS_MAX: usize = 1024;

/// The statements prepared on each connection a store ran on.
#[derive(Debug)]
pub(crate) struct StatementCache {
    /// False: every statement is sent unnamed (see `StoreBuilder::prepared_statements`).
    enabled: bool,
    connections: Mutex<Connections>,
}

#[derive(Debug, Default)]
struct Connections {
    /// Bumped at every use, to find the least recently used connection.
    clock: u64,
    by_address: HashMap<usize, Prepared>,
}

#[derive(Debug)]
struct Prepared {
    last_used: u64,
    by_sql: HashMap<String, Statement>,
}

impl StatementCache {
    /// Whether statements are prepared (and kept).
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    pub(crate) fn new(enabled: bool) -> StatementCache {
        StatementCache {
            enabled,
            connections: Mutex::new(Connections::default()),
        }
    }

    /// The prepared form of each statement, in order, on `client`: those kept already, and the
    /// others prepared now (together, in one round trip). All `None` when the cache is off.
    ///
    /// # Errors
    /// The first error of a `PREPARE` (a table that does not exist, say).
    pub(crate) async fn prepare(
        &self,
        client: &Client,
        statements: &[(&str, Vec<Type>)],
    ) -> Result<Vec<Option<Statement>>, tokio_postgres::Error> {
        if !self.enabled {
            return Ok(vec![None; statements.len()]);
        }
        let address = address(client);
        let mut found = self.kept(address, statements);
        let missing: Vec<usize> = (0..statements.len())
            .filter(|&index| found[index].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(found);
        }
        let prepared = in_order(missing.iter().map(|&index| {
            let (sql, types) = &statements[index];
            client.prepare_typed(sql, types)
        }))
        .await
        .into_iter()
        .collect::<Result<Vec<Statement>, _>>()?;
        let mut connections = self.lock();
        let connections = &mut *connections;
        connections.clock += 1;
        let now = connections.clock;
        if !connections.by_address.contains_key(&address)
            && connections.by_address.len() >= CONNECTIONS_MAX
        {
            let oldest = connections
                .by_address
                .iter()
                .min_by_key(|(_, prepared)| prepared.last_used)
                .map(|(&oldest, _)| oldest);
            if let Some(oldest) = oldest {
                connections.by_address.remove(&oldest);
            }
        }
        let kept = connections
            .by_address
            .entry(address)
            .or_insert_with(|| Prepared {
                last_used: now,
                by_sql: HashMap::new(),
            });
        for (index, statement) in missing.into_iter().zip(prepared) {
            kept.by_sql
                .insert(statements[index].0.to_owned(), statement.clone());
            found[index] = Some(statement);
        }
        Ok(found)
    }

    /// Drops what is kept for `client`'s address: it was another connection's.
    pub(crate) fn forget(&self, client: &Client) {
        self.lock().by_address.remove(&address(client));
    }

    /// The statements kept for `address`, `None` where one is not.
    fn kept(&self, address: usize, statements: &[(&str, Vec<Type>)]) -> Vec<Option<Statement>> {
        let mut connections = self.lock();
        connections.clock += 1;
        let now = connections.clock;
        match connections.by_address.get_mut(&address) {
            Some(prepared) => {
                prepared.last_used = now;
                statements
                    .iter()
                    .map(|(sql, _)| prepared.by_sql.get(*sql).cloned())
                    .collect()
            }
            None => vec![None; statements.len()],
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connections> {
        // Nothing here can leave the maps half-updated, so a panic elsewhere does not poison
        // them for good.
        self.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn address(client: &Client) -> usize {
    std::ptr::from_ref(client) as usize
}

/// A statement that failed because a named statement is missing on the connection: the
/// cache kept it for another connection at the same address.
pub(crate) fn is_stale(error: &tokio_postgres::Error) -> bool {
    error.code() == Some(&tokio_postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME)
}
