//! What can go wrong, typed.

/// The result of every fallible call here.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a call failed. Every variant says what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad input the embedded engine refuses the same way (a key or consumer id outside its
    /// limits, say): fix the caller.
    #[error(transparent)]
    Idemdb(#[from] idemdb::Error),
    /// A schema or table name that is not a plain lower-case identifier, or a schema name
    /// PostgreSQL reserves.
    #[error(
        "{name:?} is not a valid name: use a-z, 0-9 and _, starting with a letter or _, at most 55 bytes; for a schema, not a reserved word and not pg_..."
    )]
    InvalidName {
        /// The name given.
        name: String,
    },
    /// The tables are not there: run [`crate::tables::install::install`] first.
    #[error("idemdb's tables are missing ({table}); run idemdb_postgres::install first")]
    SchemaMissing {
        /// The records table looked for.
        table: String,
    },
    /// The tables were written by a newer release of this crate; this one does not touch them.
    #[error(
        "idemdb's tables are at version {found}; this release reads version {supported}: upgrade it"
    )]
    SchemaTooNew {
        /// The version found.
        found: i32,
        /// The version this release reads.
        supported: i32,
    },
    /// The tables are at an older version: run [`crate::tables::install::install`] to migrate them.
    #[error(
        "idemdb's tables are at version {found}; run idemdb_postgres::install to migrate them to {supported}"
    )]
    SchemaTooOld {
        /// The version found.
        found: i32,
        /// The version this release reads.
        supported: i32,
    },
    /// A stored record that does not decode: reported, never overwritten.
    #[error("the record of {key:?} does not decode: {detail}")]
    Corrupt {
        /// The message key.
        key: Vec<u8>,
        /// What is wrong with it.
        detail: String,
    },
    /// The commit's marker write touched no row (another writer changed the key), or its
    /// ordering-guard write found the entity's version as new already (`key` is then the
    /// entity key): what the key's and the entity's locks should make impossible. Nothing was
    /// committed.
    #[error("the record of {key:?} changed under the claim; nothing was committed")]
    LostKey {
        /// The message key.
        key: Vec<u8>,
    },
    /// Bytes given to [`crate::operations::ticket::PgLeaseTicket::from_bytes`] that are not a ticket.
    #[error("not a lease ticket: {detail}")]
    MalformedTicket {
        /// What is wrong with them.
        detail: String,
    },
    /// An import's input is not export lines (a line is malformed, or reading it failed);
    /// nothing was written.
    #[error("{0}; nothing was imported")]
    ImportInput(#[from] idemdb::transfer::ReadError),
    /// An import's record that PostgreSQL does not keep (an entity table's, or one without a
    /// consumer) or a key given twice, or a read position it cannot keep (an offset past
    /// [`crate::POSITION_OFFSET_MAX`]) or given twice; nothing was written.
    #[error("import record {position}: {reason}; nothing was imported")]
    NotImportable {
        /// Where it is in the input, from 1: its line number in lines read, its index + 1 in
        /// records given.
        position: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// Writing an export failed.
    #[error("writing the export: {0}")]
    ExportOutput(#[source] std::io::Error),
    /// The server answered one of this crate's statements in a way it cannot (a statement that
    /// always returns a row returned none). Nothing was committed.
    #[error("unexpected answer from PostgreSQL: {detail}")]
    UnexpectedAnswer {
        /// What was unexpected.
        detail: &'static str,
    },
    /// One of the caller's statements cannot be sent: a parameter does not encode as the type
    /// given for it, the SQL holds a NUL byte, or it has more parameters than the protocol
    /// carries. Found before anything of the call was sent: nothing was written, and the key
    /// is free again by the time this returns (the claim's transaction rolled back and the
    /// server answered). Fix the caller; a retry fails the same way.
    #[error("the caller's statement {statement} cannot be sent: {detail}; nothing was written")]
    BadStatement {
        /// Its index in the statements given, from 0.
        statement: usize,
        /// What is wrong with it.
        detail: String,
    },
    /// A statement the store had prepared on the connection was gone from it when a commit
    /// sent it: deallocated on the connection (`DEALLOCATE`, or `DISCARD ALL` by a pooler
    /// resetting it between calls) since the store prepared it, and not sent since by the
    /// claim's start. Nothing was written and the key is free; the store prepares its
    /// statements anew at the next call on the connection. Retry: the redelivery claims afresh.
    #[error(
        "a statement prepared on this connection was deallocated before the commit; nothing was written: retry"
    )]
    StatementDeallocated,
    /// PostgreSQL or the connection failed. During a commit, the outcome may be unknown (the
    /// connection dropped after COMMIT was sent): do not acknowledge; the redelivery finds
    /// either `Duplicate` or `Fresh`, never half of the commit.
    #[error("PostgreSQL: {}", postgres_detail(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

/// What a PostgreSQL error says, in one line: the server's message and SQLSTATE for a database
/// error (tokio-postgres's own text is only "db error"), else the error and its cause.
fn postgres_detail(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} {}: {}", db.severity(), db.code().code(), db.message()),
        None => match std::error::Error::source(error) {
            Some(cause) => format!("{error}: {cause}"),
            None => error.to_string(),
        },
    }
}

impl Error {
    /// True when the same message may be handled again later with success: nothing of the
    /// failed call was written, or (a commit whose connection dropped) its outcome is unknown
    /// and the redelivery finds out. The connection's loss, a server shutting down or starting
    /// up, too many connections, a deadlock or serialization failure of the caller's SQL, a
    /// lock wait that timed out, `KeyBusy`, and `StatementDeallocated`. Nack the message (or retry on a new
    /// connection); anything else needs a fix, not a retry.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Idemdb(error) => error.is_retryable(),
            Error::StatementDeallocated => true,
            Error::Postgres(error) => {
                if error.is_closed() {
                    return true;
                }
                let Some(code) = error.code() else {
                    // No SQLSTATE: the connection or the protocol failed, not a statement.
                    return true;
                };
                use tokio_postgres::error::SqlState;
                // Class 08: connection exceptions, but for a protocol violation, which is how
                // the server refuses a statement sent with the wrong number of parameters: a
                // retry sends it the same way.
                (code.code().starts_with("08") && *code != SqlState::PROTOCOL_VIOLATION)
                    || [
                        SqlState::T_R_SERIALIZATION_FAILURE,
                        SqlState::T_R_DEADLOCK_DETECTED,
                        SqlState::LOCK_NOT_AVAILABLE,
                        SqlState::ADMIN_SHUTDOWN,
                        SqlState::CRASH_SHUTDOWN,
                        SqlState::CANNOT_CONNECT_NOW,
                        SqlState::TOO_MANY_CONNECTIONS,
                        SqlState::READ_ONLY_SQL_TRANSACTION,
                    ]
                    .contains(code)
            }
            _ => false,
        }
    }
}
