//! The storage layer: the open RocksDB store ([`store::Storage`]) and what it is built from:
//! its options and their validation, its metadata and lock, the in-process latches, the fault
//! seam in front of every write, the business tables, the durable write path (`log/`: the commit
//! log and the group committer) and the counters.
//! It knows records and keys (the format layer) but no claim: the operations above it decide
//! what to write, and [`store::Storage::write`] is the one way anything is written.

pub(crate) mod business_table;
pub(crate) mod directory;
pub(crate) mod fault;
pub(crate) mod latch;
pub(crate) mod log;
pub(crate) mod observe;
pub(crate) mod options;
pub(crate) mod rocksdb_options;
pub(crate) mod store;
pub(crate) mod store_lock;
pub(crate) mod store_meta;
pub(crate) mod unstalled_write;
