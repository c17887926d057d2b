//! The names of the tables: validated and qualified.

use crate::error::{Error, Result};

/// Longest identifier PostgreSQL keeps (NAMEDATALEN - 1), less `_version`: the version table's
/// name, which is looked up by its text (`to_regclass`), is kept whole. The names with longer
/// suffixes (`_position`, `_claim_many`, `_advance_positions`) may be longer than PostgreSQL
/// keeps: it cuts them to 63 bytes the same way in the statement that creates each object and
/// in every statement that uses it, so they are found (the scenario
/// `the_longest_table_name_works_for_every_call` runs every call on a table of this length).
const NAME_BYTES_MAX: usize = 63 - "_version".len();

/// One day in milliseconds.
pub const DAY_MS: i64 = 86_400_000;

/// How far the record's time (this process's clock with the last offset seen) may be from the
/// database's clock when the record is written in one round trip; further, the message takes
/// the two-round-trip path, which writes the database's own time.
pub const CLOCK_TOLERANCE_MS: u64 = 1_000;

/// The `expires_at_ms` of a row that is never removable by time (in-progress records, and
/// removal times past what `int8` holds).
pub(crate) const NEVER_MS: i64 = i64::MAX;

/// The words PostgreSQL 15 does not take as a schema name unquoted (`pg_get_keywords()`,
/// categories R and T: reserved, and reserved but for function and type names), sorted.
const SCHEMA_WORDS_RESERVED: [&str; 100] = [
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

/// Where the records live: `schema.table`, plus `schema.table_version`. Names are lower-case
/// ASCII letters, digits and underscores, starting with a letter or underscore, so that they
/// never need quoting and never carry SQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    pub(crate) schema: String,
    pub(crate) table: String,
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
    /// anything but `a-z`, `0-9` and `_` (or starts with a digit); and for a schema name that
    /// PostgreSQL reserves (`user`, `select`, `table` and the other reserved words; names
    /// starting with `pg_`).
    pub fn new(schema: &str, table: &str) -> Result<Names> {
        // A schema name stands alone in statements (`CREATE SCHEMA name`, `name.table`), where
        // PostgreSQL takes no reserved word unquoted; a table name always follows `schema.`,
        // where any word goes.
        if SCHEMA_WORDS_RESERVED.binary_search(&schema).is_ok() || schema.starts_with("pg_") {
            return Err(Error::InvalidName {
                name: schema.to_owned(),
            });
        }
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

    /// `schema.table_entity`: the ordering guard's highest applied version of each entity.
    pub(crate) fn entity_versions(&self) -> String {
        format!("{}.{}_entity", self.schema, self.table)
    }

    /// `schema.table_position`: log consumers' read positions.
    pub(crate) fn positions(&self) -> String {
        format!("{}.{}_position", self.schema, self.table)
    }

    /// `schema.table_advance_positions`: the function that moves read positions forward, or
    /// fails the transaction.
    pub(crate) fn advance_positions(&self) -> String {
        format!("{}.{}_advance_positions", self.schema, self.table)
    }

    /// `schema.table_claim`: the function that takes a key's lock and reads its row in one
    /// statement (a claim's first round trip).
    pub(crate) fn claim_function(&self) -> String {
        format!("{}.{}_claim", self.schema, self.table)
    }

    /// `schema.table_claim_many`: the function that takes the locks of a batch's keys and reads
    /// their rows in one statement (a batch claim's first round trip).
    pub(crate) fn claim_many_function(&self) -> String {
        format!("{}.{}_claim_many", self.schema, self.table)
    }

    /// `schema.table_apply`: the function that inserts a new key's completed record, or
    /// fails with the key's row in its error (`apply`'s one round trip).
    pub(crate) fn apply_function(&self) -> String {
        format!("{}.{}_apply", self.schema, self.table)
    }

    /// `schema.table_version`.
    pub(crate) fn version(&self) -> String {
        format!("{}.{}_version", self.schema, self.table)
    }

    /// `table_expiry`: the records' index on their removal time (unqualified: an index is
    /// created in its table's schema).
    pub(crate) fn expiry_index(&self) -> String {
        format!("{}_expiry", self.table)
    }
}
