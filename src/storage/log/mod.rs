//! The durable write path's machinery: the commit log (`commit_log.rs`: its segment files as a
//! ring; `logged_writes.rs`: the writes through it, their replay at open and a reader's copy),
//! the async commits' group committer (`committer.rs`), and the RocksDB formats they write
//! themselves (`wal_file.rs`). [`crate::storage::store::Storage::write`] chooses between the
//! log and RocksDB's own WAL; nothing here knows of a claim.

pub(crate) mod commit_log;
#[cfg(feature = "tokio")]
pub(crate) mod committer;
pub(crate) mod logged_writes;
pub(crate) mod wal_file;
