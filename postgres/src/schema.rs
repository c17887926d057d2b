//! The tables idemdb keeps in PostgreSQL, their names, and their versioned installation.

use tokio_postgres::Client;

use crate::error::{Error, Result};

/// The version of the tables this crate reads and writes. [`install`] creates them at this
/// version (or migrates older ones); a store at a newer version is refused, not touched.
pub const SCHEMA_VERSION: i32 = 1;

/// Longest identifier PostgreSQL keeps (NAMEDATALEN - 1), less the suffix of the version table.
const NAME_BYTES_MAX: usize = 63 - "_version".len();

/// Where the records live: `schema.table`, plus `schema.table_version`. Names are lower-case
/// ASCII letters, digits and underscores, starting with a letter or underscore, so that they
/// never need quoting and never carry SQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    schema: String,
    table: String,
}

impl Default for Names {
    /// `idemdb.records`.
    fn default() -> Names {
        Names {
            schema: "idemdb".to_owned(),
            table: "records".to_owned(),
        }
    }
}

impl Names {
    /// Checks and keeps the names.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a name that is empty, too long (over 55 bytes), or holds
    /// anything but `a-z`, `0-9` and `_` (or starts with a digit).
    pub fn new(schema: &str, table: &str) -> Result<Names> {
        for name in [schema, table] {
            let mut bytes = name.bytes();
            let first_ok = bytes
                .next()
                .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
            let rest_ok = bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !first_ok || !rest_ok || name.len() > NAME_BYTES_MAX {
                return Err(Error::InvalidName {
                    name: name.to_owned(),
                });
            }
        }
        Ok(Names {
            schema: schema.to_owned(),
            table: table.to_owned(),
        })
    }

    /// `schema.table`.
    pub(crate) fn records(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// `schema.table_version`.
    fn version(&self) -> String {
        format!("{}.{}_version", self.schema, self.table)
    }
}

/// Creates the schema and tables at [`SCHEMA_VERSION`] if they are missing; leaves them as
/// they are if they are at it. Safe to run from several processes at once: they take turns
/// under a transaction-level advisory lock.
///
/// # Errors
/// [`Error::SchemaTooNew`] if the tables are at a newer version (written by a newer release:
/// upgrade this one); [`Error::Postgres`] if a statement fails (no privilege to create, say).
pub async fn install(client: &mut Client, names: &Names) -> Result<()> {
    let tx = client.transaction().await?;
    // One installer at a time: creating the same schema concurrently can fail on the catalog's
    // unique indexes.
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&install_lock(names)])
        .await?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {version} (
             singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
             version integer NOT NULL
         );",
        schema = names.schema,
        version = names.version(),
    ))
    .await?;
    let found: Option<i32> = tx
        .query_opt(&format!("SELECT version FROM {}", names.version()), &[])
        .await?
        .map(|row| row.get(0));
    match found {
        Some(version) if version > SCHEMA_VERSION => {
            return Err(Error::SchemaTooNew {
                found: version,
                supported: SCHEMA_VERSION,
            });
        }
        Some(_) => {}
        None => {
            // Version 1. One row per (consumer, message key): the advisory lock of the key
            // decides who writes it, the primary key backs that up. `record` is the
            // embedded format's record value (docs/design.md, section 4), so the decision core
            // reads it as the embedded engine does; `expires_at_ms` (NULL: never) is the one
            // field SQL needs, for removal.
            tx.batch_execute(&format!(
                "CREATE TABLE {records} (
                     consumer bytea NOT NULL,
                     message_key bytea NOT NULL,
                     record bytea NOT NULL,
                     expires_at_ms bigint,
                     PRIMARY KEY (consumer, message_key)
                 );
                 INSERT INTO {version} (version) VALUES ({SCHEMA_VERSION});",
                records = names.records(),
                version = names.version(),
            ))
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Checks that the tables exist at a version this crate reads.
///
/// # Errors
/// [`Error::SchemaMissing`] when [`install`] was never run for `names`;
/// [`Error::SchemaTooNew`] for a newer version; [`Error::SchemaTooOld`] for an older one
/// (run [`install`] to migrate it).
pub(crate) async fn check(client: &Client, names: &Names) -> Result<()> {
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&names.version()])
        .await?
        .get(0);
    if !exists {
        return Err(Error::SchemaMissing {
            table: names.records(),
        });
    }
    let found: Option<i32> = client
        .query_opt(&format!("SELECT version FROM {}", names.version()), &[])
        .await?
        .map(|row| row.get(0));
    match found {
        None => Err(Error::SchemaMissing {
            table: names.records(),
        }),
        Some(version) if version > SCHEMA_VERSION => Err(Error::SchemaTooNew {
            found: version,
            supported: SCHEMA_VERSION,
        }),
        Some(version) if version < SCHEMA_VERSION => Err(Error::SchemaTooOld {
            found: version,
            supported: SCHEMA_VERSION,
        }),
        Some(_) => Ok(()),
    }
}

/// The advisory lock installers of `names` take turns under.
fn install_lock(names: &Names) -> i64 {
    let hash = xxhash_rust::xxh3::xxh3_64(format!("idemdb install {}", names.records()).as_bytes());
    i64::from_ne_bytes(hash.to_ne_bytes())
}
