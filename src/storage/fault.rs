//! Fault injection: a seam in the engine's own I/O calls, so that tests (ours and our users')
//! can make a write, a WAL sync, a flush or a compaction fail and check what the caller sees.
//!
//! It sits where idemdb calls RocksDB, not inside RocksDB: rust-rocksdb exposes no fault-
//! injecting environment. What it exercises is idemdb's handling of each failure: the typed
//! error, poisoning, and that a reopen recovers a consistent state. `FailAfter` models the worst
//! case of a failed fsync: the batch reached the WAL, but the caller is told it failed.

/// Where in the engine an I/O call is about to happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IoPoint {
    /// A write batch (a commit, a batch commit, a lease step) going to the commit log (or
    /// RocksDB's WAL, with [`crate::EngineBuilder::without_commit_log`]) and the memtables.
    Write,
    /// [`crate::Engine::flush_wal`]'s fsync of the WAL.
    SyncWal,
    /// A memtable flush ([`crate::Engine::compact`] flushes first).
    Flush,
    /// A manual compaction.
    Compaction,
}

/// What to do with one I/O call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Let it happen.
    None,
    /// Fail it without doing it.
    FailBefore,
    /// Do it, then report it as failed (the WAL write happened; its durability is unknown to
    /// the caller). Only meaningful for [`IoPoint::Write`] and [`IoPoint::SyncWal`].
    FailAfter,
    /// Do it without the fsync its durability asks for, and report success: a disk that
    /// acknowledges a flush it never did. A [`IoPoint::Write`] goes to the WAL unsynced even
    /// under [`crate::Durability::Sync`]; a [`IoPoint::SyncWal`] does nothing. Elsewhere the
    /// same as [`Fault::None`]. For tests that must show a lost acknowledged commit is
    /// detected (a power-cut harness's mutation check).
    Unsynced,
}

/// Decides the fault for each I/O call. Install with [`crate::EngineBuilder::fault_injector`].
pub trait FaultInjector: Send + Sync + std::fmt::Debug + 'static {
    /// Called before every I/O call at `point`.
    fn fault(&self, point: IoPoint) -> Fault;
}

/// The error an injected fault surfaces as: an I/O error, like a real one.
pub(crate) fn injected(point: IoPoint) -> crate::format::error::Error {
    crate::format::error::Error::Storage {
        kind: crate::format::error::StorageErrorKind::Io,
        detail: format!("injected fault at {point:?}"),
    }
}
