//! The durable write path's machinery: the commit log (`commit_log.rs`: its segment files as a
//! ring; `logged_writes.rs`: the group commit through it; `replay.rs`: its place in the store and
//! its replay; `reader_wal.rs`: a reader's copy of its records),
//! the shrinker that gives back a quiet store's grown segments (`quiet_shrink.rs`),
//! the async commits' group committer (`committer.rs`), and the RocksDB formats they write
//! themselves (`wal_file.rs`). [`crate::storage::store::Storage::write`] chooses between the
//! log and RocksDB's own WAL; nothing here knows of a claim.

#[cfg(feature = "tokio")]
pub(crate) mod commit_future;
pub(crate) mod commit_log;
pub(crate) mod committer;
pub(crate) mod logged_writes;
pub(crate) mod quiet_shrink;
pub(crate) mod reader_wal;
pub(crate) mod replay;
pub(crate) mod wal_file;
