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
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};

use crate::sql::pipeline::in_order;

/// How many connections' statements are kept; past it the least recently used connection's
/// are dropped (and closed on the server, when that connection is still open).
const CONNECTIONS_MAX: usize = 1024;

/// A statement as the transactions send it: its SQL and its parameters with their types (the
/// cache looks at the types only). The same shape as `crate::sql::txn::Statement`, spelled out
/// so that this module does not look up at the one that uses it.
type Sent<'a> = (&'a str, &'a [(&'a (dyn ToSql + Sync), Type)]);

/// The statements prepared on each connection a store ran on.
#[derive(Debug)]
pub(crate) struct StatementCache {
    /// False: every statement is sent unnamed (see `StoreBuilder::prepared_statements`).
    enabled: bool,
    connections: Mutex<Connections>,
}

/// Hashes a key with one xxh3 call per write: the keys are SQL texts of a few hundred bytes,
/// looked up on every claim, and SipHash (the standard maps' default) cost about 600
/// instructions a text. The maps hold a store's own statements and at most
/// [`CALLER_STATEMENTS_MAX`] of the caller's per connection, so a key that collides on purpose
/// slows one connection's lookups at most.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Default)]
struct Connections {
    /// Bumped at every use, to find the least recently used connection.
    clock: u64,
    by_address: KeyMap<usize, Prepared>,
}

impl Connections {
    /// What is kept for `address`, made empty if nothing is, marked used; past
    /// [`CONNECTIONS_MAX`] connections the least recently used one's is dropped first.
    fn entry(&mut self, address: usize) -> &mut Prepared {
        self.clock += 1;
        let now = self.clock;
        if !self.by_address.contains_key(&address) && self.by_address.len() >= CONNECTIONS_MAX {
            let oldest = self
                .by_address
                .iter()
                .min_by_key(|(_, prepared)| prepared.last_used)
                .map(|(&oldest, _)| oldest);
            if let Some(oldest) = oldest {
                self.by_address.remove(&oldest);
            }
        }
        let kept = self.by_address.entry(address).or_default();
        kept.last_used = now;
        kept
    }
}

#[derive(Debug, Default)]
struct Prepared {
    last_used: u64,
    /// The store's statements by their SQL.
    by_sql: KeyMap<String, Statement>,
    /// The caller's statements by [`caller_hash`] of their SQL and parameter types (the same
    /// text may come with other types); texts whose hashes meet share the list.
    callers: KeyMap<u64, Vec<CallerStatement>>,
    /// How many statements `callers` holds.
    caller_count: usize,
    /// Whether this connection's claims may run as one plain statement.
    plain_claim: PlainClaimGate,
}

/// What a connection knows of the records table's size, for the plain claim statement
/// (`crate::storage::store::PLAIN_CLAIM_TABLE_BYTES`).
#[derive(Debug, Default)]
struct PlainClaimGate {
    /// The table had reached the size when last looked at: it stays open (a table that
    /// shrinks back leaves kept plans made on the index).
    open: bool,
    /// Claims left before the size is looked at again, while closed.
    until_check: u32,
}

/// Claims run on a connection between two looks at the records table's size while it is too
/// small for the plain claim statement: the look is one more round trip, and a table reaches
/// the size after some thousands of records.
const PLAIN_CLAIM_CHECK_EVERY: u32 = 1024;

/// Whether a claim may run as the plain claim statement on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PlainClaim {
    Use,
    Skip,
    /// Look at the table's size first, and say what was found with
    /// [`StatementCache::plain_claim_checked`].
    Check,
}

/// A caller's statement kept, with what it was prepared from.
#[derive(Debug)]
struct CallerStatement {
    sql: String,
    types: Vec<Type>,
    statement: Statement,
}

impl CallerStatement {
    fn is(&self, (sql, params): &Sent<'_>) -> bool {
        self.sql == *sql
            && self.types.len() == params.len()
            && self
                .types
                .iter()
                .zip(params.iter())
                .all(|(kept, (_, ty))| kept == ty)
    }
}

impl Prepared {
    fn caller(&self, hash: u64, sent: &Sent<'_>) -> Option<&Statement> {
        self.callers
            .get(&hash)?
            .iter()
            .find(|kept| kept.is(sent))
            .map(|kept| &kept.statement)
    }
}

/// The most statements of the caller's kept per connection: a handler's SQL is a few fixed
/// texts, and one that builds its SQL anew each time stops being prepared past this many (its
/// statements are then sent unnamed), so the server's memory does not grow with it.
pub const CALLER_STATEMENTS_MAX: usize = 64;

/// The key of a caller's statement: its SQL and its parameters' types, hashed without copying
/// either.
fn caller_hash((sql, params): &Sent<'_>) -> u64 {
    let mut hasher = KeyHasher::default();
    hasher.write(sql.as_bytes());
    for (_, ty) in params.iter() {
        hasher.write(&ty.oid().to_le_bytes());
    }
    hasher.finish()
}

/// The parameters' types of `statement`, to prepare it with.
fn types((_, params): &Sent<'_>) -> Vec<Type> {
    params.iter().map(|(_, ty)| ty.clone()).collect()
}

/// Prepares the statements of `statements` at `indexes`, together (one round trip), with their
/// parameters' types; each one's own answer, in that order.
async fn prepare_each(
    client: &Client,
    statements: &[Sent<'_>],
    indexes: &[usize],
) -> Vec<Result<Statement, tokio_postgres::Error>> {
    in_order(indexes.iter().map(|&index| {
        let statement = &statements[index];
        async move { client.prepare_typed(statement.0, &types(statement)).await }
    }))
    .await
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

    /// The prepared form of each of the store's statements, in order, on `client`: those kept
    /// already, and the others prepared now (together, in one round trip). All `None` when the
    /// cache is off.
    ///
    /// # Errors
    /// The first error of a `PREPARE` (a table that does not exist, say).
    pub(crate) async fn prepare(
        &self,
        client: &Client,
        statements: &[Sent<'_>],
    ) -> Result<Vec<Option<Statement>>, tokio_postgres::Error> {
        if !self.enabled {
            return Ok(vec![None; statements.len()]);
        }
        let address = address(client);
        let mut found: Vec<Option<Statement>> = self.kept(address, |prepared| {
            statements
                .iter()
                .map(|(sql, _)| prepared.and_then(|prepared| prepared.by_sql.get(*sql).cloned()))
                .collect()
        });
        let missing: Vec<usize> = (0..statements.len())
            .filter(|&index| found[index].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(found);
        }
        let prepared = prepare_each(client, statements, &missing)
            .await
            .into_iter()
            .collect::<Result<Vec<Statement>, _>>()?;
        let mut connections = self.lock();
        let kept = connections.entry(address);
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
        statements: &[Sent<'_>],
    ) -> Vec<Result<Option<Statement>, tokio_postgres::Error>> {
        if !self.enabled || statements.is_empty() {
            return statements.iter().map(|_| Ok(None)).collect();
        }
        let address = address(client);
        let hashes: Vec<u64> = statements.iter().map(caller_hash).collect();
        let (mut found, callers) = self.kept(address, |prepared| {
            let found: Vec<Option<Statement>> = statements
                .iter()
                .zip(&hashes)
                .map(|(sent, &hash)| {
                    prepared.and_then(|prepared| prepared.caller(hash, sent).cloned())
                })
                .collect();
            (found, prepared.map_or(0, |prepared| prepared.caller_count))
        });
        let room = CALLER_STATEMENTS_MAX.saturating_sub(callers);
        let missing: Vec<usize> = (0..statements.len())
            .filter(|&index| found[index].is_none())
            .take(room)
            .collect();
        if missing.is_empty() {
            return sendable(found, statements).into_iter().map(Ok).collect();
        }
        let prepared = prepare_each(client, statements, &missing).await;
        let mut errors: Vec<Option<tokio_postgres::Error>> =
            statements.iter().map(|_| None).collect();
        let mut connections = self.lock();
        let kept = connections.entry(address);
        for (index, answer) in missing.into_iter().zip(prepared) {
            match answer {
                Ok(statement) => {
                    let sent = &statements[index];
                    // The same statement twice in one call is prepared twice and kept once.
                    if kept.caller(hashes[index], sent).is_none() {
                        kept.callers
                            .entry(hashes[index])
                            .or_default()
                            .push(CallerStatement {
                                sql: sent.0.to_owned(),
                                types: types(sent),
                                statement: statement.clone(),
                            });
                        kept.caller_count += 1;
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

    /// Whether a claim on `client` may run as the plain claim statement: never with the cache
    /// off (an unnamed statement is planned at every run, which costs more than the function's
    /// call saves); `Check` on a connection's first claim, and then every
    /// [`PLAIN_CLAIM_CHECK_EVERY`] claims until the table is large enough.
    pub(crate) fn plain_claim(&self, client: &Client) -> PlainClaim {
        if !self.enabled {
            return PlainClaim::Skip;
        }
        let mut connections = self.lock();
        let Some(gate) = connections
            .by_address
            .get_mut(&address(client))
            .map(|prepared| &mut prepared.plain_claim)
        else {
            return PlainClaim::Check;
        };
        if gate.open {
            PlainClaim::Use
        } else if gate.until_check == 0 {
            PlainClaim::Check
        } else {
            gate.until_check -= 1;
            PlainClaim::Skip
        }
    }

    /// Keeps what a [`PlainClaim::Check`] found on `client`: whether the table is large enough.
    pub(crate) fn plain_claim_checked(&self, client: &Client, large: bool) {
        let mut connections = self.lock();
        let kept = connections.entry(address(client));
        kept.plain_claim = PlainClaimGate {
            open: large,
            until_check: PLAIN_CLAIM_CHECK_EVERY,
        };
    }

    /// Drops what is kept for `client`'s address: it was another connection's.
    pub(crate) fn forget(&self, client: &Client) {
        self.lock().by_address.remove(&address(client));
    }

    /// What `look` finds among the statements kept for `address` (`None`: nothing is kept for
    /// it), marking the address used.
    fn kept<T>(&self, address: usize, look: impl FnOnce(Option<&Prepared>) -> T) -> T {
        let mut connections = self.lock();
        connections.clock += 1;
        let now = connections.clock;
        let prepared = connections.by_address.get_mut(&address).map(|prepared| {
            prepared.last_used = now;
            &*prepared
        });
        look(prepared)
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
fn sendable(found: Vec<Option<Statement>>, statements: &[Sent<'_>]) -> Vec<Option<Statement>> {
    found
        .into_iter()
        .zip(statements)
        .map(|(statement, (_, params))| {
            statement.filter(|statement| statement.params().len() == params.len())
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
