//! What a store says about itself, read before RocksDB opens it for writing: its tables, the
//! format marker and each table's kind (the `default` column family), and each business table's
//! merge operator (RocksDB's OPTIONS file).
//!
//! Every check of the stored metadata against the declaration is made here, on a read-only view
//! (the builder's own checks are in `options.rs`, the lock in `store_lock.rs`), because RocksDB's
//! open for writing changes the store before the engine could look: it replays the WAL and, by
//! default, flushes what it replayed, under whatever merge operators the declaration gave, and
//! it rewrites the OPTIONS file. A refused open must leave the store as it found it, so that the
//! next open with the right declaration sees every acknowledged commit.

use std::collections::HashMap;
use std::path::Path;

use rocksdb::{DB, IteratorMode};

use crate::format::error::{Error, Result};
use crate::format::merge::{MERGE_OPERATOR_NAME, rocksdb_full_merge, rocksdb_partial_merge};

pub(crate) use crate::format::key::RECORDS_TABLE;
/// The column family holding the ordering guard's highest applied version per entity.
pub(crate) const VERSIONS_TABLE: &str = "idemdb.versions";
/// Meta key (default column family) holding the store format marker.
pub(crate) const META_FORMAT_KEY: &[u8] = b"idemdb.format";
/// Store format marker: magic and format version 2, the stores whose records may be in record
/// format 2. An open for writing of a format-1 store rewrites its marker to this one before any
/// record, so that an earlier release, which reads record format 1 alone, refuses the store
/// instead of finding records it cannot read.
pub(crate) const STORE_FORMAT_V2: &[u8] = b"idemdb store format 2";
/// The marker of stores written by earlier releases: every record in format 1.
pub(crate) const STORE_FORMAT_V1: &[u8] = b"idemdb store format 1";
/// Meta key prefix recording each table's kind, so a table cannot change kind between opens.
pub(crate) const META_TABLE_KIND_PREFIX: &str = "idemdb.table-kind/";
/// Meta key prefix recording each business table's merge operator, fixed when it is created:
/// `merge:<name>`, or `none`.
pub(crate) const META_MERGE_OPERATOR_PREFIX: &str = "idemdb.merge-operator/";
/// A file in the store directory while a new store is being created: RocksDB creates the
/// database first and its tables one by one after, so a process killed in between leaves a
/// database without idemdb's tables. Written (and fsynced) before RocksDB writes anything, and
/// removed once the store is complete, it tells such a leftover, which never held a commit,
/// from a foreign database: the next open finishes the creation.
pub(crate) const CREATING_MARKER_FILE: &str = "IDEMDB-CREATING";
/// What RocksDB's OPTIONS file says of a table without a merge operator.
const NO_MERGE_OPERATOR: &str = "nullptr";
/// The kind of a user-declared table, recorded in the metadata when it is first declared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeclaredKind {
    /// The caller's own data, written through claims.
    Business,
    /// A marker table whose records are the entities.
    Entity,
}

impl DeclaredKind {
    /// The metadata value recording this kind.
    pub(crate) fn stored(self) -> &'static [u8] {
        match self {
            DeclaredKind::Business => b"business",
            DeclaredKind::Entity => b"entity",
        }
    }

    fn parse(stored: &[u8]) -> Option<DeclaredKind> {
        match stored {
            b"business" => Some(DeclaredKind::Business),
            b"entity" => Some(DeclaredKind::Entity),
            _ => None,
        }
    }

    /// The kind in words, with its article ("a business").
    fn in_words(self) -> &'static str {
        match self {
            DeclaredKind::Business => "a business",
            DeclaredKind::Entity => "an entity",
        }
    }
}

/// The store's format marker, as found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum FormatMarker {
    /// The marker of the format this build reads and writes.
    Current,
    /// The marker of stores written by earlier releases (record format 1): read as they are,
    /// rewritten to the current one by an open for writing.
    Earlier,
    /// Another value: another format, or not idemdb's.
    Unknown,
    /// No marker, and the records table holds no record: a store whose very first open
    /// crashed between creating its tables and writing the marker. It is still new.
    MissingOnEmptyStore,
    /// No marker, and records are present: not an idemdb store.
    Missing,
}

/// The metadata of an existing store.
#[derive(Clone, Debug)]
pub(crate) struct StoredMeta {
    /// Every column family, `default` included, in RocksDB's order.
    pub(crate) tables: Vec<String>,
    /// The format marker.
    pub(crate) format: FormatMarker,
    /// The recorded kind (or an unreadable value) of each table that has one.
    kinds: HashMap<String, Vec<u8>>,
    /// The recorded merge operator of each business table that has one recorded.
    operators: HashMap<String, Vec<u8>>,
    /// Whether the store's creation began and did not finish ([`CREATING_MARKER_FILE`]).
    pub(crate) creation_interrupted: bool,
}

/// Metadata an accepted open must still write, with an fsync, before any record.
#[derive(Debug, Default)]
pub(crate) struct MetaToWrite {
    /// The format marker (a new store, or one an earlier release marked format 1).
    pub(crate) format: bool,
    /// Kinds of tables declared for the first time.
    pub(crate) kinds: Vec<(String, DeclaredKind)>,
    /// Merge operators of business tables not recorded yet (new tables, and tables created
    /// before operators were recorded).
    pub(crate) operators: Vec<(String, Option<String>)>,
}

/// The metadata value recording a business table's merge operator (`None`: none).
pub(crate) fn encode_merge_operator(operator: Option<&str>) -> Vec<u8> {
    match operator {
        Some(name) => [b"merge:", name.as_bytes()].concat(),
        None => b"none".to_vec(),
    }
}

impl StoredMeta {
    /// Reads the metadata of the store at `path`, or `None` if there is no store there yet.
    /// Opens the store read-only: no lock is taken, no data file is written, and the WAL is
    /// replayed into memory only. RocksDB starts a new info `LOG` file (renaming the previous
    /// one `LOG.old.<time>`), the one change. The replay is a cost every open now pays once
    /// more, in proportion to the unflushed WAL.
    ///
    /// # Errors
    /// [`Error::IncompatibleStore`] for a RocksDB database that has no records table;
    /// [`Error::Storage`] if RocksDB cannot read it.
    pub(crate) fn read(path: &Path) -> Result<Option<StoredMeta>> {
        if !path.join("CURRENT").exists() {
            return Ok(None);
        }
        let tables = DB::list_cf(&rocksdb::Options::default(), path)?;
        let has_records = tables.iter().any(|table| table == RECORDS_TABLE);
        let creation_interrupted = path
            .join(CREATING_MARKER_FILE)
            .try_exists()
            .map_err(|error| Error::io("looking for the creation marker", &error))?;
        if !has_records && !creation_interrupted {
            return Err(incompatible(
                path,
                format!("not an idemdb store (no {RECORDS_TABLE:?} table)"),
            ));
        }
        let meta = crate::storage::rocksdb_options::retry_read_only_open(|| {
            DB::open_cf_for_read_only(
                &rocksdb::Options::default(),
                path,
                [rocksdb::DEFAULT_COLUMN_FAMILY_NAME],
                false,
            )
        })?;
        let default = meta
            .cf_handle(rocksdb::DEFAULT_COLUMN_FAMILY_NAME)
            .ok_or_else(|| incompatible(path, "no default column family".to_owned()))?;
        let format = match meta.get_cf(default, META_FORMAT_KEY)? {
            Some(format) if format == STORE_FORMAT_V2 => FormatMarker::Current,
            Some(format) if format == STORE_FORMAT_V1 => FormatMarker::Earlier,
            Some(_) => FormatMarker::Unknown,
            // A creation cut short before the records table existed holds no record either.
            None if !has_records || records_table_is_empty(path)? => {
                FormatMarker::MissingOnEmptyStore
            }
            None => FormatMarker::Missing,
        };
        let mut kinds = HashMap::new();
        let mut operators = HashMap::new();
        for table in &tables {
            if let Some(kind) = meta.get_cf(default, format!("{META_TABLE_KIND_PREFIX}{table}"))? {
                kinds.insert(table.clone(), kind);
            }
            let key = format!("{META_MERGE_OPERATOR_PREFIX}{table}");
            if let Some(operator) = meta.get_cf(default, key)? {
                operators.insert(table.clone(), operator);
            }
        }
        Ok(Some(StoredMeta {
            tables,
            format,
            kinds,
            operators,
            creation_interrupted,
        }))
    }

    /// The kind recorded for `table`: `None` if none is, `Some(None)` for a value this build
    /// does not know.
    pub(crate) fn kind(&self, table: &str) -> Option<Option<DeclaredKind>> {
        self.kinds.get(table).map(|kind| DeclaredKind::parse(kind))
    }

    /// Checks that the format marker is one this build may open.
    ///
    /// # Errors
    /// [`Error::IncompatibleStore`] for another marker, or none on a store holding records.
    pub(crate) fn check_format(&self, path: &Path) -> Result<()> {
        match self.format {
            FormatMarker::Current | FormatMarker::Earlier | FormatMarker::MissingOnEmptyStore => {
                Ok(())
            }
            FormatMarker::Unknown => Err(incompatible(
                path,
                "written by an unknown idemdb store format".to_owned(),
            )),
            FormatMarker::Missing => Err(incompatible(
                path,
                "not an idemdb store (no format marker)".to_owned(),
            )),
        }
    }

    /// Checks a declaration of tables against the store, returning the metadata the open must
    /// write. `declared` is every user table with its kind.
    ///
    /// # Errors
    /// [`Error::IncompatibleStore`] for a bad format marker, a table of the store that is not
    /// declared, or a table declared as another kind than the one it was created as.
    pub(crate) fn check_declaration(
        &self,
        path: &Path,
        declared: &[(&str, DeclaredKind)],
    ) -> Result<MetaToWrite> {
        self.check_format(path)?;
        for table in &self.tables {
            let ours = [
                rocksdb::DEFAULT_COLUMN_FAMILY_NAME,
                RECORDS_TABLE,
                VERSIONS_TABLE,
                crate::format::position::POSITIONS_TABLE,
            ]
            .contains(&table.as_str());
            if !ours && !declared.iter().any(|(name, _)| name == table) {
                return Err(incompatible(
                    path,
                    format!(
                        "the store has table {table:?}, which was not declared; declare it \
                         with business_table or entity_table"
                    ),
                ));
            }
        }
        let mut to_write = MetaToWrite {
            format: self.format != FormatMarker::Current,
            ..MetaToWrite::default()
        };
        for &(name, kind) in declared {
            match self.kind(name) {
                Some(Some(stored)) if stored == kind => {}
                Some(stored) => {
                    let was = stored.map_or("an unknown kind of", DeclaredKind::in_words);
                    return Err(incompatible(
                        path,
                        format!(
                            "table {name:?} was created as {was} table and is declared as {} \
                             table; declare it as before",
                            kind.in_words()
                        ),
                    ));
                }
                None => to_write.kinds.push((name.to_owned(), kind)),
            }
        }
        Ok(to_write)
    }

    /// Refuses to open a business table with another merge operator than the one it was
    /// created with, with one where it had none, or with none where it had one; returns the
    /// operators to record (tables not recorded yet).
    ///
    /// This must be decided before RocksDB opens the store: replaying the WAL into a table
    /// without its merge operator stops recovery at the first merge operand (silently, under
    /// point-in-time recovery), dropping every later write of every table. Adding an operator
    /// later is refused too: accepted, it would leave a store that the previous declaration can
    /// no longer open (operands may be waiting), so a rolled-back deployment would be locked
    /// out. A new table takes a new operator.
    ///
    /// The operator is recorded in the metadata when the table is created. RocksDB's OPTIONS
    /// file also names it, but any plain RocksDB open (a debugging tool) rewrites that file, so
    /// it is read only for a table created before operators were recorded, with the rule of
    /// that time (a table that had none, or a stand-in, may gain one), once: that open records
    /// the declared operator.
    ///
    /// # Errors
    /// [`Error::IncompatibleStore`] naming the table and both operators.
    pub(crate) fn check_merge_operators<'a>(
        &self,
        path: &Path,
        declared: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
    ) -> Result<Vec<(String, Option<String>)>> {
        let mut options_file: Option<Option<HashMap<String, String>>> = None;
        let mut to_record = Vec::new();
        for (table, operator) in declared {
            let declared = encode_merge_operator(operator);
            match self.operators.get(table) {
                Some(recorded) if *recorded == declared => {}
                Some(recorded) => {
                    let recorded = String::from_utf8_lossy(recorded);
                    let recorded = match recorded.strip_prefix("merge:") {
                        Some(name) => format!("merge operator {name:?}"),
                        None => "no merge operator".to_owned(),
                    };
                    return Err(operator_mismatch(path, table, &recorded, operator));
                }
                None => {
                    if self.tables.iter().any(|name| name == table) {
                        let stored = options_file
                            .get_or_insert_with(|| stored_merge_operators(path))
                            .as_ref()
                            .and_then(|stored| stored.get(table));
                        let unchecked = [
                            NO_MERGE_OPERATOR,
                            crate::storage::rocksdb_options::OPAQUE_MERGE_OPERATOR_NAME,
                        ];
                        if let Some(stored) = stored
                            && Some(stored.as_str()) != operator
                            && !unchecked.contains(&stored.as_str())
                        {
                            let stored = format!("merge operator {stored:?}");
                            return Err(operator_mismatch(path, table, &stored, operator));
                        }
                    }
                    to_record.push((table.to_owned(), operator.map(str::to_owned)));
                }
            }
        }
        Ok(to_record)
    }
}

fn operator_mismatch(path: &Path, table: &str, recorded: &str, declared: Option<&str>) -> Error {
    let declared = match declared {
        Some(name) => format!("merge operator {name:?}"),
        None => "no merge operator".to_owned(),
    };
    incompatible(
        path,
        format!(
            "table {table:?} was created with {recorded}, and is declared with {declared}; \
             declare it as before (a table's merge operator is fixed when it is created: its \
             data may hold merge operands only that operator can fold)"
        ),
    )
}

/// Metadata of a store that does not exist yet: the marker, every declared table's kind, and
/// every business table's merge operator.
pub(crate) fn new_store_meta(
    declared: &[(&str, DeclaredKind)],
    operators: Vec<(String, Option<String>)>,
) -> MetaToWrite {
    MetaToWrite {
        format: true,
        kinds: declared
            .iter()
            .map(|&(name, kind)| (name.to_owned(), kind))
            .collect(),
        operators,
    }
}

/// Marks the creation of a new store at `path` as begun, durably, before RocksDB writes there.
pub(crate) fn begin_creation(path: &Path) -> Result<()> {
    let marker = path.join(CREATING_MARKER_FILE);
    std::fs::File::create(&marker)
        .and_then(|file| file.sync_all())
        .and_then(|()| crate::storage::directory::sync_directory(path))
        .map_err(|error| Error::io("writing the creation marker", &error))
}

/// Marks the creation of the store at `path` as finished (its tables and metadata are written
/// and synced).
pub(crate) fn finish_creation(path: &Path) -> Result<()> {
    std::fs::remove_file(path.join(CREATING_MARKER_FILE))
        .and_then(|()| crate::storage::directory::sync_directory(path))
        .map_err(|error| Error::io("removing the creation marker", &error))
}

/// Whether the records table holds nothing, read through a second read-only open (only needed
/// for a store without a format marker, so it is not paid on every open).
fn records_table_is_empty(path: &Path) -> Result<bool> {
    let mut records = rocksdb::Options::default();
    // Records are merge operands until compacted: an iterator needs the operator to fold them.
    records.set_merge_operator(
        MERGE_OPERATOR_NAME,
        rocksdb_full_merge,
        rocksdb_partial_merge,
    );
    let db = DB::open_cf_descriptors_read_only(
        &rocksdb::Options::default(),
        path,
        [
            rocksdb::ColumnFamilyDescriptor::new(
                rocksdb::DEFAULT_COLUMN_FAMILY_NAME,
                rocksdb::Options::default(),
            ),
            rocksdb::ColumnFamilyDescriptor::new(RECORDS_TABLE, records),
        ],
        false,
    )?;
    let table = db
        .cf_handle(RECORDS_TABLE)
        .ok_or_else(|| incompatible(path, format!("no {RECORDS_TABLE:?} table")))?;
    let mut entries = db.iterator_cf(table, IteratorMode::Start);
    Ok(entries.next().transpose()?.is_none())
}

/// Each table's merge operator name in the store's newest OPTIONS file, or `None` if there is
/// no readable one.
pub(crate) fn stored_merge_operators(path: &Path) -> Option<HashMap<String, String>> {
    let newest = std::fs::read_dir(path)
        .ok()?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            let number: u64 = name.strip_prefix("OPTIONS-")?.parse().ok()?;
            Some((number, name))
        })
        .max()?;
    let text = std::fs::read_to_string(path.join(newest.1)).ok()?;
    let mut operators = HashMap::new();
    let mut table: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if let Some(section) = line.strip_prefix('[') {
            table = section
                .strip_prefix("CFOptions \"")
                .and_then(|rest| rest.strip_suffix("\"]"))
                .map(str::to_owned);
        } else if let (Some(table), Some(name)) = (&table, line.strip_prefix("merge_operator=")) {
            operators.insert(table.clone(), name.to_owned());
        }
    }
    Some(operators)
}

fn incompatible(path: &Path, reason: String) -> Error {
    Error::IncompatibleStore {
        path: path.to_path_buf(),
        reason,
    }
}
