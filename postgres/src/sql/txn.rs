//! The transaction of a claim or a lease step, opened and closed in the same round trip as the
//! statements around it.
//!
//! `tokio_postgres::Transaction` waits for the answer to `BEGIN` before anything else can be
//! sent, and takes itself by value to commit, so neither `BEGIN` nor `COMMIT` can travel with
//! another statement. Here `BEGIN` goes out with the claim's lock and read, and `COMMIT` with
//! the caller's SQL and the record's write (when the commit writes one): a claim and its commit
//! cost two round trips.
//! tokio-postgres sends a request when its future is first polled, and the server runs the
//! requests of a connection in the order they arrive, so futures joined in order are pipelined.
//!
//! A failed statement aborts the transaction, and PostgreSQL answers a `COMMIT` of an aborted
//! transaction with a rollback and no error: a `COMMIT` sent behind a write is only as good as
//! that write's own answer, which [`ClaimTransaction::commit_with`] checks first. So a write
//! that can touch no row without failing (an update of a row that is gone) must fail instead:
//! see `LOST_ROW`.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Waker};

use futures_util::future::join;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

use crate::error::{Error, Result};
use crate::sql::pipeline::in_order;
use crate::sql::prepared::{StatementCache, is_stale};

/// `BEGIN` of every claim and lease step: READ COMMITTED whatever the session's default. A
/// claim's read must take its snapshot after the key's lock was granted, which READ COMMITTED
/// does for every statement; under REPEATABLE READ the first statement's snapshot would hide
/// the previous holder's commit.
const BEGIN: &str = "START TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// [`BEGIN`] for a claim's reads when the store's statements are prepared: sequential scans
/// off for the rest of the transaction, the session's setting kept aside, so that kept plans
/// of the reads are made while it is off, whenever they are made (see [`SESSION_SCANS`]). One
/// simple query of three statements: one message, run in order.
const BEGIN_INDEXES_ONLY: &str = "START TRANSACTION ISOLATION LEVEL READ COMMITTED; \
     SELECT set_config('idemdb.enable_seqscan', current_setting('enable_seqscan'), true); \
     SET LOCAL enable_seqscan = off";

/// Sent after the store's reads at the start of a claim: the session's setting back, for the
/// caller's SQL.
///
/// Why reads are planned with sequential scans off: a kept plan of a read by key, made while
/// the table held a few rows (after an analyze), scans the table, and goes on scanning as the
/// table grows, until the next analyze makes the plan again (checked on PostgreSQL 15: a
/// generic plan made over 20 rows still scanned 100,000). Planned with scans off, a read looks
/// the key up in the index at any size. The writes need none of it: an insert, with or without
/// `ON CONFLICT`, has no plan to choose.
const SESSION_SCANS: &str =
    "SELECT set_config('enable_seqscan', current_setting('idemdb.enable_seqscan'), true)";

/// The SQLSTATE a write that must touch one row raises when it touched none: its statement
/// divides by the number of rows it wrote (`division_by_zero`).
pub(crate) const LOST_ROW: &tokio_postgres::error::SqlState =
    &tokio_postgres::error::SqlState::DIVISION_BY_ZERO;

/// A statement and its parameters with their types (so that it needs no round trip to be
/// prepared).
pub type Statement<'a> = (&'a str, &'a [(&'a (dyn ToSql + Sync), Type)]);

/// Each statement's rows, or its error.
pub(crate) type Answers = Vec<std::result::Result<Vec<Row>, tokio_postgres::Error>>;

/// The answers of [`ClaimTransaction::run_whole`].
pub(crate) struct Whole {
    /// Each store statement's rows or error, in order.
    pub(crate) store: Answers,
    /// Each caller's statement's rows or error, in order.
    pub(crate) staged: Answers,
    /// Each store statement's sent after the caller's: rows or error, in order.
    pub(crate) after: Answers,
    /// The `COMMIT`'s answer: a rollback when a statement failed.
    pub(crate) committed: std::result::Result<(), tokio_postgres::Error>,
}

/// Why [`ClaimTransaction::commit_with`] committed nothing (or may not have).
#[derive(Debug)]
pub(crate) enum CommitFailed {
    /// A statement of the caller's failed.
    Staged(tokio_postgres::Error),
    /// One of the store's writes failed.
    Store(tokio_postgres::Error),
    /// The `COMMIT` failed: the connection was lost (the outcome is unknown), or a deferred
    /// check of the caller's (a deferred constraint, a trigger) refused it.
    Commit(tokio_postgres::Error),
}

/// Sends `ROLLBACK` without waiting, when dropped armed: a call given up after its `BEGIN`
/// went out and before its transaction was handed to anyone.
struct RollbackOnDrop<'a> {
    client: &'a Client,
    armed: bool,
}

impl Drop for RollbackOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            send_rollback(self.client);
        }
    }
}

/// Sends `ROLLBACK` on `client` without waiting for the answer.
fn send_rollback(client: &Client) {
    send_without_waiting(client, "ROLLBACK");
}

/// Sends the simple query `sql` on `client` without waiting for the answer, for a drop that
/// cannot await: polled once, a simple query is handed to the connection's task, which runs it
/// after whatever it was sent before (and discards the answer).
pub(crate) fn send_without_waiting(client: &Client, sql: &str) {
    let mut sent = pin!(client.batch_execute(sql));
    let _ = sent.as_mut().poll(&mut Context::from_waker(Waker::noop()));
}

/// The connection a claim's transaction runs on: the caller's, borrowed for the claim's life,
/// or one the claim owns (a pooled connection, say), dropped (given back to its pool) with the
/// claim. An owned one lets a claim outlive the caller's borrow: an HTTP request's claim, kept
/// in the request while its handler runs.
pub(crate) enum Connection<'c> {
    Borrowed(&'c mut Client),
    Owned(Box<dyn std::ops::DerefMut<Target = Client> + Send + 'c>),
}

impl Connection<'_> {
    pub(crate) fn get(&self) -> &Client {
        match self {
            Connection::Borrowed(client) => client,
            Connection::Owned(client) => client,
        }
    }

    fn get_mut(&mut self) -> &mut Client {
        match self {
            Connection::Borrowed(client) => client,
            Connection::Owned(client) => client,
        }
    }
}

impl<'c> From<&'c mut Client> for Connection<'c> {
    fn from(client: &'c mut Client) -> Connection<'c> {
        Connection::Borrowed(client)
    }
}

/// An open READ COMMITTED transaction on a borrowed or owned connection. Dropped while open, it
/// sends `ROLLBACK` without waiting for the answer (as `tokio_postgres::Transaction` does); the
/// connection's next request runs after it.
pub(crate) struct ClaimTransaction<'c> {
    client: Connection<'c>,
    /// The store's statements prepared on this connection.
    cache: Arc<StatementCache>,
    open: bool,
}

impl<'c> ClaimTransaction<'c> {
    /// Sends `BEGIN` and then `statements`, in order, without waiting in between, and returns
    /// the transaction with every statement's answer. A statement's error aborts the
    /// transaction (every later statement then fails too); the caller decides what to do.
    ///
    /// The statements are the store's own: they run prepared (see [`crate::sql::prepared`]). One
    /// that meets a statement kept for another connection (an address reused) rolls back and
    /// runs once more, with the statements prepared anew.
    ///
    /// # Errors
    /// The error of `BEGIN` (nothing began; every statement failed with it), or of preparing
    /// a statement.
    pub(crate) async fn begin_with(
        client: impl Into<Connection<'c>>,
        cache: &Arc<StatementCache>,
        statements: &[Statement<'_>],
    ) -> Result<(ClaimTransaction<'c>, Answers)> {
        let (begin, guarded) = begin_and_guarded(cache, statements);
        ClaimTransaction::begin_sending(client, cache, statements.len(), begin, guarded).await
    }

    /// [`ClaimTransaction::begin_with`] for statements that need no guard around their plans:
    /// calls of the store's functions, which turn sequential scans off themselves while they
    /// run, and the plain claim statement, run only on a table large enough that no plan of
    /// its read scans it. Only `BEGIN` goes in front of them, nothing behind.
    pub(crate) async fn begin_with_functions(
        client: impl Into<Connection<'c>>,
        cache: &Arc<StatementCache>,
        statements: &[Statement<'_>],
    ) -> Result<(ClaimTransaction<'c>, Answers)> {
        ClaimTransaction::begin_sending(client, cache, statements.len(), BEGIN, statements.to_vec())
            .await
    }

    /// Sends `begin` and then `guarded`, whose first `count` statements are the caller's (the
    /// rest restore what `begin` set aside).
    async fn begin_sending(
        client: impl Into<Connection<'c>>,
        cache: &Arc<StatementCache>,
        count: usize,
        begin: &'static str,
        guarded: Vec<Statement<'_>>,
    ) -> Result<(ClaimTransaction<'c>, Answers)> {
        let mut connection = client.into();
        let mut retried = false;
        loop {
            let client = connection.get_mut();
            let prepared = cache.prepare(client, &guarded).await?;
            let (begun, mut answers) = {
                let shared: &Client = client;
                // From the first poll on, `BEGIN` and the key's lock are on their way: a call
                // given up while it waits for the answers (its future dropped, by a timeout
                // say) must still end the transaction, or the connection would sit in it,
                // holding the key, until its next use.
                let mut given_up = RollbackOnDrop {
                    client: shared,
                    armed: true,
                };
                let queries = guarded
                    .iter()
                    .zip(prepared)
                    .map(|(statement, prepared)| run(shared, prepared, *statement));
                let answered = join(shared.batch_execute(begin), in_order(queries)).await;
                given_up.armed = false;
                answered
            };
            // Looked for in every answer: a statement shared by several kinds of transaction
            // (the key's read) may be the only one kept for a connection that is gone.
            let stale = answers
                .iter()
                .any(|answer| answer.as_ref().is_err_and(is_stale));
            // The caller's statements' answers only.
            let restored = answers.split_off(count);
            if stale && !retried && begun.is_ok() {
                retried = true;
                cache.forget(client);
                client.batch_execute("ROLLBACK").await?;
                continue;
            }
            let mut transaction = ClaimTransaction {
                client: connection,
                cache: Arc::clone(cache),
                open: true,
            };
            if let Err(error) = begun {
                // Nothing began (the statements ran outside a transaction, and failed or
                // released their locks as they ended): nothing to roll back.
                transaction.open = false;
                return Err(error.into());
            }
            // The setting restored behind the store's statements failed on its own (every
            // statement before it answered): the transaction is aborted, and the caller's SQL
            // would fail in it. Reported as such, rolled back first.
            if answers.iter().all(std::result::Result::is_ok)
                && let Some(Err(error)) = restored.into_iter().next()
            {
                return transaction.fail(error).await;
            }
            return Ok((transaction, answers));
        }
    }

    /// A whole transaction in one round trip: `BEGIN`, the store's `statements` (prepared),
    /// the caller's `staged` statements, the store's `after` statements (prepared) and
    /// `COMMIT`, sent without waiting in between. Returns the answers of the store's
    /// statements, of the staged ones and of those after them, and the `COMMIT`'s. The store's
    /// writes that a commit makes after the caller's SQL (a read position) go `after`, so
    /// that they take their locks in the order a two-round-trip commit takes them. A failed statement aborts the transaction, and the `COMMIT` behind it then
    /// rolls back without an error: whoever reads the answers must look at every statement's
    /// before trusting the `COMMIT`'s. Every request is sent at the first poll, so a future
    /// dropped after it leaves no transaction open (the `COMMIT` or its rollback ends it).
    ///
    /// A store statement that meets a statement kept for another connection (an address
    /// reused) aborts the transaction before any of the caller's statements runs, and the
    /// `COMMIT` then rolls back: the whole runs once more, with the statements prepared anew.
    ///
    /// # Errors
    /// The error of `BEGIN` (nothing began), or of preparing a statement (nothing was sent).
    pub(crate) async fn run_whole(
        client: &mut Client,
        cache: &Arc<StatementCache>,
        statements: &[Statement<'_>],
        staged: &[Statement<'_>],
        after: &[Statement<'_>],
    ) -> Result<Whole> {
        let mut retried = false;
        let (mut answers, committed) = loop {
            // The store's statements before and after the caller's, prepared together.
            let mut prepared = cache.prepare(client, &[statements, after].concat()).await?;
            let prepared_after = prepared.split_off(statements.len());
            // A caller's statement that does not prepare is sent unnamed, and fails in the
            // transaction as it would have anyway (nothing was sent yet).
            let callers = cache
                .prepare_callers(client, staged)
                .await
                .into_iter()
                .map(|prepared| prepared.ok().flatten());
            let shared: &Client = client;
            let queries = statements
                .iter()
                .zip(prepared)
                .chain(staged.iter().zip(callers))
                .chain(after.iter().zip(prepared_after))
                .map(|(statement, prepared)| run(shared, prepared, *statement));
            let ((begun, answers), committed) = join(
                join(shared.batch_execute(BEGIN), in_order(queries)),
                shared.batch_execute("COMMIT"),
            )
            .await;
            begun?;
            // The caller's statements are kept per connection too: one kept for a gone
            // connection fails the same way, before anything lands.
            let stale = answers
                .iter()
                .any(|answer| answer.as_ref().is_err_and(is_stale));
            if stale && !retried {
                retried = true;
                cache.forget(client);
                continue;
            }
            break (answers, committed);
        };
        let mut staged_answers = answers.split_off(statements.len());
        let after_answers = staged_answers.split_off(staged.len());
        Ok(Whole {
            store: answers,
            staged: staged_answers,
            after: after_answers,
            committed,
        })
    }

    /// The connection, for the statements of the transaction.
    pub(crate) fn client(&self) -> &Client {
        self.client.get()
    }

    /// Sends the caller's `staged` statements, the store's `writes` (both prepared, when the
    /// store prepares statements) and then `COMMIT`, without waiting in between. The first
    /// statement's error is returned, if any (the `COMMIT` behind it rolled back: nothing of
    /// the transaction landed); otherwise
    /// the `COMMIT`'s (a lost connection leaves the outcome unknown); else every write's rows.
    pub(crate) async fn commit_with(
        mut self,
        staged: &[Statement<'_>],
        writes: &[Statement<'_>],
    ) -> std::result::Result<Vec<Vec<Row>>, CommitFailed> {
        let prepared = self.cache.prepare(self.client.get(), writes).await;
        let prepared = self
            .release_on_error(prepared)
            .await
            .map_err(CommitFailed::Store)?;
        // A caller's statement that does not prepare has aborted the transaction (a parse
        // error inside a transaction does): its own error, after the rollback.
        let mut callers = Vec::with_capacity(staged.len());
        for answer in self.cache.prepare_callers(self.client.get(), staged).await {
            match answer {
                Ok(prepared) => callers.push(prepared),
                Err(error) => {
                    self.roll_back_now().await;
                    return Err(CommitFailed::Staged(error));
                }
            }
        }
        self.open = false;
        let client: &Client = self.client.get();
        let queries = callers
            .into_iter()
            .zip(staged.iter().copied())
            .chain(prepared.into_iter().zip(writes.iter().copied()))
            .map(|(prepared, statement)| run(client, prepared, statement));
        let (written, committed) = join(in_order(queries), client.batch_execute("COMMIT")).await;
        let mut rows = Vec::with_capacity(writes.len());
        for (index, answer) in written.into_iter().enumerate() {
            match answer {
                Ok(answer) if index >= staged.len() => rows.push(answer),
                Ok(_) => {}
                // A caller's statement kept for a gone connection: the store's doing.
                Err(error) if index < staged.len() && !is_stale(&error) => {
                    return Err(CommitFailed::Staged(error));
                }
                Err(error) => {
                    if is_stale(&error) {
                        self.cache.forget(client);
                    }
                    return Err(CommitFailed::Store(error));
                }
            }
        }
        committed.map_err(CommitFailed::Commit)?;
        Ok(rows)
    }

    /// `result` as it is, after rolling back and waiting for the server's answer when it is an
    /// error: the transaction's locks (the key's) are free by the time the error reaches the
    /// caller. A transaction dropped open rolls back too, but without waiting, so another
    /// connection could still find the key held for a moment after the error returned.
    pub(crate) async fn release_on_error<T, E>(
        &mut self,
        result: std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        if result.is_err() {
            self.roll_back_now().await;
        }
        result
    }

    /// Rolls back and waits, for a call that fails with `error` before it ends the transaction.
    pub(crate) async fn fail<T>(mut self, error: impl Into<Error>) -> Result<T> {
        self.roll_back_now().await;
        Err(error.into())
    }

    /// Rolls back and waits for the answer, unless the transaction was ended already. A
    /// failure of the rollback is the connection's: the server rolls back on its own when it
    /// notices, and the caller is told of the error that made it roll back.
    async fn roll_back_now(&mut self) {
        if self.open {
            self.open = false;
            let _ = self.client.get().batch_execute("ROLLBACK").await;
        }
    }

    /// Commits.
    pub(crate) async fn commit(mut self) -> std::result::Result<(), tokio_postgres::Error> {
        self.open = false;
        self.client.get().batch_execute("COMMIT").await
    }

    /// Rolls back, and returns once the server has: the transaction's locks are free then.
    pub(crate) async fn rollback(mut self) -> std::result::Result<(), tokio_postgres::Error> {
        self.open = false;
        self.client.get().batch_execute("ROLLBACK").await
    }
}

impl Drop for ClaimTransaction<'_> {
    fn drop(&mut self) {
        if self.open {
            // Its answer is not waited for (the connection discards it).
            send_rollback(self.client.get());
        }
    }
}

/// The `BEGIN` for the store's `statements`, and the statements to send behind it: with
/// prepared statements, sequential scans go off in `BEGIN` and back on after them (see
/// [`SESSION_SCANS`]), before any of the caller's.
fn begin_and_guarded<'a>(
    cache: &StatementCache,
    statements: &[Statement<'a>],
) -> (&'static str, Vec<Statement<'a>>) {
    if cache.enabled() {
        let restored = statements.iter().copied().chain([(SESSION_SCANS, &[][..])]);
        (BEGIN_INDEXES_ONLY, restored.collect())
    } else {
        (BEGIN, statements.to_vec())
    }
}

/// Checks that each of the caller's `statements` can be sent, by encoding every parameter
/// once into a scratch buffer, before anything of them goes out. tokio-postgres encodes a
/// statement as it sends it, and one that fails there is never sent: nothing aborts the
/// transaction then, and the `COMMIT` pipelined behind it would commit the record and the
/// other statements without that one.
///
/// # Errors
/// [`Error::BadStatement`] for the first statement that cannot be sent.
pub(crate) fn check_sendable(statements: &[Statement<'_>]) -> Result<()> {
    let mut scratch = bytes::BytesMut::new();
    for (index, (sql, params)) in statements.iter().enumerate() {
        let refused = |detail: String| Error::BadStatement {
            statement: index,
            detail,
        };
        if sql.contains('\0') {
            return Err(refused("its SQL holds a NUL byte".to_owned()));
        }
        if params.len() > usize::from(u16::MAX) {
            return Err(refused(format!(
                "{} parameters, more than the protocol's {}",
                params.len(),
                u16::MAX
            )));
        }
        for (position, (value, ty)) in params.iter().enumerate() {
            scratch.clear();
            if let Err(error) = value.to_sql_checked(ty, &mut scratch) {
                return Err(refused(format!(
                    "parameter ${} does not encode as {ty}: {error}",
                    position + 1
                )));
            }
        }
    }
    Ok(())
}

/// Runs one statement: bound to its prepared form when there is one, else unnamed (parsed and
/// planned as it runs). The request is sent at the first poll.
async fn run(
    client: &Client,
    prepared: Option<tokio_postgres::Statement>,
    (sql, params): Statement<'_>,
) -> std::result::Result<Vec<Row>, tokio_postgres::Error> {
    match prepared {
        Some(statement) => {
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(value, _)| *value).collect();
            client.query(&statement, &values).await
        }
        None => client.query_typed(sql, params).await,
    }
}

/// The one row of a statement that always returns one (a `SELECT` without `FROM`).
pub(crate) fn single_row(rows: Vec<Row>) -> Result<Row> {
    rows.into_iter().next().ok_or(Error::UnexpectedAnswer {
        detail: "a statement that returns one row returned none",
    })
}
