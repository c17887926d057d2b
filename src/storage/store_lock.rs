//! One writer per store directory, however its path is spelled: the directory's identity
//! (device and inode) registered in this process, and an exclusive `flock` on the directory
//! itself, both taken before anything else of an open that may write.
//!
//! RocksDB's own `LOCK` file cannot give this guarantee inside one process. It is held with a
//! POSIX record lock, which the kernel grants again to the process that already holds it, so
//! RocksDB refuses a second open in the same process by comparing path strings: `/s` and `/s/`,
//! `/s/.`, `/t/../s`, a relative path, a symlink or a bind mount of the same directory all got
//! through, and two engines with two sets of latches then handed out the same key twice.
//!
//! - In this process, the registry of held (device, inode) pairs refuses a second open at once,
//!   whatever path reaches the directory.
//! - Across processes, the `flock` does: it belongs to the open file description, so the OS
//!   arbitrates it between processes (and would within one too), and releases it when the file
//!   is closed, including when the process dies.
//!
//! Both refuse with [`Error::AlreadyOpen`], before any metadata check or recovery runs.
//!
//! A process forked from this one shares every open file until it execs, the locked directory
//! included (Rust opens files close-on-exec, so the exec closes it). A store this process just
//! closed may therefore still be locked, for that moment, by a child another thread is
//! spawning: an open that finds the lock held by no engine of this process waits for it up to
//! `FORKED_HOLDER_WAIT` before it reports `AlreadyOpen`.
//!
//! Limits:
//! - On NFS, Linux emulates `flock` with a POSIX record lock, which is per process; the
//!   registry still refuses a second open in this process.
//! - A process that opens the store without this lock (an idemdb from before it, a RocksDB
//!   tool) is refused by RocksDB's own `LOCK` when the engine opens for writing, so only after
//!   the declaration was checked: a mismatch is then `IncompatibleStore`, not `AlreadyOpen`.
//! - A child forked without exec keeps the store locked until it exits, even after the parent
//!   dropped its engine; a reopen then waits, and reports `AlreadyOpen`.

use std::collections::BTreeSet;
use std::fs::{File, TryLockError};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::format::error::{Error, Result};

/// How long an open waits for a directory lock that no engine of this process holds. A process
/// this one forks holds a copy of every open file, the locked directory's included, until it
/// execs (which closes it): a store closed here a moment ago can still be locked by such a
/// child. A store held by another process is `AlreadyOpen` after this wait.
const FORKED_HOLDER_WAIT: Duration = Duration::from_millis(500);

/// The directories (device, inode) the engines of this process hold. Identifying a store by
/// what the file system says, not by its path, refuses a second open here at once, whatever
/// the spelling, without waiting for the lock.
static HELD_HERE: Mutex<BTreeSet<(u64, u64)>> = Mutex::new(BTreeSet::new());

/// The exclusive lock on a store directory, held for as long as this value lives.
#[derive(Debug)]
pub(crate) struct StoreLock {
    /// The open directory; closing it releases the lock.
    directory: File,
    /// Its (device, inode), registered in [`HELD_HERE`].
    identity: (u64, u64),
}

impl StoreLock {
    /// Takes the lock on the existing directory `path`.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] if another open holds it: at once for one in this process, after
    /// at most [`FORKED_HOLDER_WAIT`] for one in another process; [`Error::Storage`] if `path`
    /// is not a directory that can be opened.
    pub(crate) fn acquire(path: &Path) -> Result<StoreLock> {
        let directory =
            File::open(path).map_err(|error| Error::io("opening the store directory", &error))?;
        let metadata = directory
            .metadata()
            .map_err(|error| Error::io("reading the store directory's metadata", &error))?;
        if !metadata.is_dir() {
            return Err(Error::io(
                "opening the store directory",
                &std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
            ));
        }
        let identity = (metadata.dev(), metadata.ino());
        let already_open = || Error::AlreadyOpen {
            path: path.to_path_buf(),
        };
        if !held_here(|held| held.insert(identity)) {
            return Err(already_open());
        }
        // From here the identity is ours: the lock's drop (or the error path) unregisters it.
        let lock = StoreLock {
            directory,
            identity,
        };
        let started = Instant::now();
        loop {
            match lock.directory.try_lock() {
                Ok(()) => return Ok(lock),
                Err(TryLockError::WouldBlock) if started.elapsed() < FORKED_HOLDER_WAIT => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(TryLockError::WouldBlock) => return Err(already_open()),
                Err(TryLockError::Error(error)) => {
                    return Err(Error::io("locking the store directory", &error));
                }
            }
        }
    }
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        held_here(|held| held.remove(&self.identity));
    }
}

/// Runs `change` on the set of directories held here. A panic elsewhere while the set was
/// locked cannot leave it half-changed (each change is one insert or remove), so a poisoned
/// mutex is used as it is.
fn held_here(change: impl FnOnce(&mut BTreeSet<(u64, u64)>) -> bool) -> bool {
    change(&mut HELD_HERE.lock().unwrap_or_else(PoisonError::into_inner))
}
