//! Operator access to a store: what the `idemdb` CLI is built on, usable from any Rust tool.
//!
//! An operator tool does not know the application's table declarations. [`Store`] finds them
//! in the store itself: the column families RocksDB lists, and the kind idemdb recorded for
//! each table (`idemdb.table-kind/<name>` in the metadata, docs/design.md section 2). Marker
//! tables (the consumers' `idemdb.records` and the entity tables) are opened with idemdb's
//! merge operator, so reads see folded records. Business tables may have merge operators of
//! the application's own, which a tool does not have: they are opened with a stand-in that
//! lets the WAL be replayed, and are never read, flushed or compacted.
//!
//! Two ways to open:
//!
//! - [`StoreBuilder::open_read_only`]: RocksDB's read-only open. It takes no lock, so it works
//!   while the application has the store open (a *live* store); it sees what the store's files
//!   and WAL held when it opened (and its commit log, if it has one), and never writes to the
//!   store.
//! - [`StoreBuilder::open_exclusive`]: the store opened for writing, which RocksDB allows to one
//!   process at a time. On a live store it fails with [`crate::Error::AlreadyOpen`]: a write to a live
//!   store cannot be made from outside the process that has it open. That process uses the
//!   library instead ([`crate::Consumer::resolve`], [`crate::Consumer::in_progress`]).
//!
//! Backups: [`Store::backup`] copies a store opened exclusively into a new directory (an
//! offline backup; a running application takes online ones with [`crate::Engine::checkpoint`]),
//! and [`Backup::restore`] copies either kind back into a new store directory.
//!
//! Writes made here keep the record state machine's rules: [`Store::resolve`] is the same
//! fenced step as [`crate::Consumer::resolve`]; [`Store::invalidate`] and [`Store::import`]
//! replace a key's value with a deletion and an install operand in one batch, which only an
//! exclusive open makes safe (no claim can run between the read and the write).
//!
//! ```
//! use idemdb::admin::{EntryState, Filter, Store};
//! use idemdb::{Engine, Fingerprint, Outcome};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path()).open()?;
//! let billing = engine.consumer("billing")?;
//! if let Outcome::Fresh(claim) = billing.begin(b"order-1", Fingerprint::of(b"body"))? {
//!     claim.commit(b"charged")?;
//! }
//! // The application still has the store open: a read-only open works beside it.
//! let store = Store::builder(dir.path()).open_read_only()?;
//! let page = store.list(&Filter::new().state(EntryState::Live), None, 10)?;
//! assert_eq!(page.entries.len(), 1);
//! assert_eq!(&page.entries[0].key[..], b"order-1");
//! // A write needs the store to itself.
//! assert!(matches!(
//!     Store::builder(dir.path()).open_exclusive(),
//!     Err(idemdb::Error::AlreadyOpen { .. })
//! ));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod backup;
mod open;
mod positions;
mod repair;
mod report;
mod scan;

pub use backup::{Backup, Transfer, TransferReport, check_new_dir};
pub use open::{Store, StoreBuilder, TableInfo, TableKind};
pub use positions::{ImportPosition, PositionEntry, PositionImportCounts};
pub use repair::{ImportCounts, ImportRecord, Invalidation, PurgeReport};
pub use report::{
    FileSystemSpace, GroupStats, Problem, StateCounts, StoreStats, VERIFY_PROBLEMS_MAX,
    VerifyReport,
};
pub use scan::{Cursor, Entry, EntryState, Filter, Page, Target};

use crate::storage::store_meta::RECORDS_TABLE;

/// The name of the table holding every consumer's records (the other marker tables are the
/// entity tables, named by the application).
pub const CONSUMERS_TABLE: &str = RECORDS_TABLE;
