//! The store's statements, prepared once per connection and then only bound and run.
//!
//! An unnamed statement is parsed and planned every time it runs; a named statement is parsed
//! once per connection, and the server keeps its plan (and makes it again when the table's
//! statistics change). Reads are planned with sequential scans off (see
//! [`crate::sql::txn::ClaimTransaction::begin_with`]), so that a plan kept from when the table
//! was small does not scan it whole once it is large.
//!
//! tokio-postgres has no handle on "this connection" to hang statements on, and the API takes
//! the caller's `&Client` on every call, so the statements are kept by the client's address.
//! An address can outlive its connection (a client dropped, another built in its place). That
//! is safe: statement names are unique within the process (tokio-postgres numbers them from
//! one counter), so a statement kept for a gone connection does not exist on the new one, and
//! running it fails with `invalid_sql_statement_name` (26000) before anything is written. Every
//! transaction starts with [`crate::sql::txn::ClaimTransaction::begin_with`] or
//! [`crate::sql::txn::ClaimTransaction::run_whole`], which look at every answer for a missing
//! statement, forget the address and run once more with statements prepared anew; a
//! statement run on its own does the same ([`run_prepared`]). A commit that meets one
//! (deallocated after its claim began) forgets the address and fails with
//! `StatementDeallocated`, nothing written.

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
    /// The store's statements by their SQL, and the caller's by [`caller_key`].
    by_sql: HashMap<String, Statement>,
    /// How many of `by_sql` are the caller's.
    callers: usize,
}

/// The most statements of the caller's kept per connection: a handler's SQL is a few fixed
/// texts, and one that builds its SQL anew each time stops being prepared past this many (its
/// statements are then sent unnamed), so the server's memory does not grow with it.
pub const CALLER_STATEMENTS_MAX: usize = 64;

/// The key of a caller's statement: its SQL and its parameters' types (the same text may come
/// with other types). A NUL byte cannot occur in SQL that is sent (`check_sendable`).
fn caller_key(sql: &str, types: &[Type]) -> String {
    let mut key = String::with_capacity(sql.len() + 8 * types.len() + 1);
    key.push_str(sql);
    key.push('\0');
    for ty in types {
        key.push_str(&ty.oid().to_string());
        key.push(',');
    }
    key
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
        let (mut found, _) = self.kept(address, statements.iter().map(|(sql, _)| *sql));
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
                callers: 0,
            });
        for (index, statement) in missing.into_iter().zip(prepared) {
            kept.by_sql
                .insert(statements[index].0.to_owned(), statement.clone());
            found[index] = Some(statement);
        }
        Ok(found)
    }

    /// The prepared form of each of the caller's `statements`, in order, on `client`: kept, or
    /// prepared now (one round trip for all that are missing). `Ok(None)` where a statement is
    /// to be sent unnamed: the cache is off, or the connection keeps
    /// [`CALLER_STATEMENTS_MAX`] of the caller's already. `Err` where preparing failed (the
    /// statement's own error: it would fail the same way when run).
    pub(crate) async fn prepare_callers(
        &self,
        client: &Client,
        statements: &[(&str, Vec<Type>)],
    ) -> Vec<Result<Option<Statement>, tokio_postgres::Error>> {
        if !self.enabled || statements.is_empty() {
            return statements.iter().map(|_| Ok(None)).collect();
        }
        let address = address(client);
        let keys: Vec<String> = statements
            .iter()
            .map(|(sql, types)| caller_key(sql, types))
            .collect();
        let (mut found, callers) = self.kept(address, keys.iter().map(String::as_str));
        let room = CALLER_STATEMENTS_MAX.saturating_sub(callers);
        let missing: Vec<usize> = (0..statements.len())
            .filter(|&index| found[index].is_none())
            .take(room)
            .collect();
        if missing.is_empty() {
            return sendable(found, statements).into_iter().map(Ok).collect();
        }
        let prepared = in_order(missing.iter().map(|&index| {
            let (sql, types) = &statements[index];
            client.prepare_typed(sql, types)
        }))
        .await;
        let mut errors: Vec<Option<tokio_postgres::Error>> =
            statements.iter().map(|_| None).collect();
        let mut connections = self.lock();
        let kept = connections
            .by_address
            .entry(address)
            .or_insert_with(|| Prepared {
                last_used: 0,
                by_sql: HashMap::new(),
                callers: 0,
            });
        for (index, answer) in missing.into_iter().zip(prepared) {
            match answer {
                Ok(statement) => {
                    if kept
                        .by_sql
                        .insert(keys[index].clone(), statement.clone())
                        .is_none()
                    {
                        kept.callers += 1;
                    }
                    found[index] = Some(statement);
                }
                Err(error) => errors[index] = Some(error),
            }
        }
        drop(connections);
        sendable(found, statements)
            .into_iter()
            .zip(errors)
            .map(|(statement, error)| match error {
                Some(error) => Err(error),
                None => Ok(statement),
            })
            .collect()
    }

    /// Drops what is kept for `client`'s address: it was another connection's.
    pub(crate) fn forget(&self, client: &Client) {
        self.lock().by_address.remove(&address(client));
    }

    /// The statements kept for `address` under `keys`, `None` where one is not, and how many
    /// of the caller's the address keeps.
    fn kept<'k>(
        &self,
        address: usize,
        keys: impl Iterator<Item = &'k str>,
    ) -> (Vec<Option<Statement>>, usize) {
        let mut connections = self.lock();
        connections.clock += 1;
        let now = connections.clock;
        match connections.by_address.get_mut(&address) {
            Some(prepared) => {
                prepared.last_used = now;
                let found = keys.map(|key| prepared.by_sql.get(key).cloned()).collect();
                (found, prepared.callers)
            }
            None => (keys.map(|_| None).collect(), 0),
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

/// `found`, with `None` for a prepared statement that takes another number of parameters than
/// its caller gives (SQL with more placeholders than types given: the server inferred the
/// rest). tokio-postgres refuses to bind it on the client, so it would never reach the server,
/// and nothing would abort the transaction: the `COMMIT` behind it would commit the record
/// without it. Sent unnamed instead, the server refuses it, which aborts the transaction.
fn sendable(
    found: Vec<Option<Statement>>,
    statements: &[(&str, Vec<Type>)],
) -> Vec<Option<Statement>> {
    found
        .into_iter()
        .zip(statements)
        .map(|(statement, (_, types))| {
            statement.filter(|statement| statement.params().len() == types.len())
        })
        .collect()
}

fn address(client: &Client) -> usize {
    std::ptr::from_ref(client) as usize
}

/// A statement that failed because a named statement is missing on the connection: the
/// cache kept it for another connection at the same address.
pub(crate) fn is_stale(error: &tokio_postgres::Error) -> bool {
    error.code() == Some(&tokio_postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME)
}
