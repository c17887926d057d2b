//! The stores users pick today for a dedup check: Redis `SET NX PX`, SQLite `INSERT OR IGNORE`,
//! PostgreSQL `INSERT ... ON CONFLICT DO NOTHING`. Each stores the same 22-byte key and 64-byte
//! value as the embedded contenders' marker; none of them also writes a business row in the same
//! step, which idemdb does, so the comparison favours them.

use std::path::Path;

use anyhow::{Result, bail};

use crate::servers::postgres_url;
use crate::workloads::{Delivery, Session};

/// How long the Redis marker lives: one hour, like a typical retention.
const REDIS_TTL_MS: u64 = 3_600_000;

pub struct RedisSession {
    connection: redis::Connection,
}

impl RedisSession {
    pub fn connect(port: u16) -> Result<RedisSession> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
        Ok(RedisSession {
            connection: client.get_connection()?,
        })
    }

    pub fn flush_all(port: u16) -> Result<()> {
        let mut session = RedisSession::connect(port)?;
        redis::cmd("FLUSHALL")
            .arg("SYNC")
            .query::<()>(&mut session.connection)?;
        Ok(())
    }
}

impl Session for RedisSession {
    /// One round trip: all deliveries as pipelined `SET key value NX PX ttl` commands.
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let mut pipe = redis::pipe();
        for delivery in deliveries {
            pipe.cmd("SET")
                .arg(&delivery.peer_key()[..])
                .arg(&delivery.value()[..])
                .arg("NX")
                .arg("PX")
                .arg(REDIS_TTL_MS);
        }
        // Each reply is OK (claimed) or nil (a duplicate).
        let replies: Vec<Option<String>> = pipe.query(&mut self.connection)?;
        if replies.len() != deliveries.len() {
            bail!(
                "redis answered {} of {} commands",
                replies.len(),
                deliveries.len()
            );
        }
        Ok(())
    }
}

/// SQLite's `synchronous` setting for a WAL-mode database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SqliteSync {
    /// fsync at checkpoints only: a commit survives a process crash, not a power loss.
    Normal,
    /// fsync of the WAL at every commit.
    Full,
}

pub struct SqliteSession {
    connection: rusqlite::Connection,
}

impl SqliteSession {
    pub fn open(path: &Path, sync: SqliteSync) -> Result<SqliteSession> {
        let connection = rusqlite::Connection::open(path)?;
        connection.pragma_update(None, "journal_mode", "WAL")?;
        let level = match sync {
            SqliteSync::Normal => "NORMAL",
            SqliteSync::Full => "FULL",
        };
        connection.pragma_update(None, "synchronous", level)?;
        connection.execute_batch(
            "CREATE TABLE IF NOT EXISTS inbox (key BLOB PRIMARY KEY, value BLOB NOT NULL) \
             WITHOUT ROWID",
        )?;
        Ok(SqliteSession { connection })
    }
}

impl Session for SqliteSession {
    /// One transaction with one `INSERT OR IGNORE` per delivery.
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let transaction = self.connection.transaction()?;
        {
            let mut insert = transaction
                .prepare_cached("INSERT OR IGNORE INTO inbox (key, value) VALUES (?1, ?2)")?;
            for delivery in deliveries {
                insert.execute((&delivery.peer_key()[..], &delivery.value()[..]))?;
            }
        }
        transaction.commit()?;
        Ok(())
    }
}

pub struct PostgresSession {
    client: postgres::Client,
    /// Each inserted message's business row is written too, by the same statement.
    business_row: bool,
    /// Prepared multi-row inserts, by row count.
    statements: Vec<(usize, postgres::Statement)>,
}

impl PostgresSession {
    pub fn connect(
        port: u16,
        synchronous_commit: bool,
        business_row: bool,
    ) -> Result<PostgresSession> {
        let mut client = postgres::Client::connect(&postgres_url(port), postgres::NoTls)?;
        let setting = if synchronous_commit { "on" } else { "off" };
        client.batch_execute(&format!("SET synchronous_commit = {setting}"))?;
        Ok(PostgresSession {
            client,
            business_row,
            statements: Vec::new(),
        })
    }

    /// Creates (or empties) the inbox table and the business table.
    pub fn reset(port: u16) -> Result<()> {
        let mut client = postgres::Client::connect(&postgres_url(port), postgres::NoTls)?;
        client.batch_execute(
            "CREATE TABLE IF NOT EXISTS inbox (key bytea PRIMARY KEY, value bytea NOT NULL); \
             CREATE TABLE IF NOT EXISTS inbox_orders (key bytea PRIMARY KEY, value bytea NOT NULL); \
             TRUNCATE inbox, inbox_orders; CHECKPOINT;",
        )?;
        Ok(())
    }

    /// Writes every dirty buffer of the server (between runs).
    pub fn checkpoint(port: u16) -> Result<()> {
        let mut client = postgres::Client::connect(&postgres_url(port), postgres::NoTls)?;
        client.batch_execute("CHECKPOINT")?;
        Ok(())
    }

    fn statement(&mut self, rows: usize) -> Result<postgres::Statement> {
        if let Some((_, statement)) = self.statements.iter().find(|(n, _)| *n == rows) {
            return Ok(statement.clone());
        }
        let values: Vec<String> = (0..rows)
            .map(|row| format!("(${}, ${})", 2 * row + 1, 2 * row + 2))
            .collect();
        let insert = format!(
            "INSERT INTO inbox (key, value) VALUES {} ON CONFLICT DO NOTHING",
            values.join(", ")
        );
        // The rows the insert wrote (the new messages) go on to the business table.
        let sql = if self.business_row {
            format!(
                "WITH inserted AS ({insert} RETURNING key, value) \
                 INSERT INTO inbox_orders (key, value) SELECT key, value FROM inserted"
            )
        } else {
            insert
        };
        let statement = self.client.prepare(&sql)?;
        self.statements.push((rows, statement.clone()));
        Ok(statement)
    }
}

impl Session for PostgresSession {
    /// One transaction: one multi-row `INSERT ... ON CONFLICT DO NOTHING` of every delivery.
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let statement = self.statement(deliveries.len())?;
        let keys: Vec<Vec<u8>> = deliveries.iter().map(|d| d.peer_key().to_vec()).collect();
        let values: Vec<Vec<u8>> = deliveries.iter().map(|d| d.value().to_vec()).collect();
        let mut params: Vec<&(dyn postgres::types::ToSql + Sync)> =
            Vec::with_capacity(2 * deliveries.len());
        for (key, value) in keys.iter().zip(&values) {
            params.push(key);
            params.push(value);
        }
        self.client.execute(&statement, &params)?;
        Ok(())
    }
}
