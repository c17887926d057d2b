//! One writer per store directory, however its path is spelled: an exclusive `flock` on the
//! directory itself, taken before anything else of an open that may write.
//!
//! RocksDB's own `LOCK` file cannot give this guarantee inside one process. It is held with a
//! POSIX record lock, which the kernel grants again to the process that already holds it, so
//! RocksDB refuses a second open in the same process by comparing path strings: `/s` and `/s/`,
//! `/s/.`, `/t/../s`, a relative path, a symlink or a bind mount of the same directory all got
//! through, and two engines with two sets of latches then handed out the same key twice.
//!
//! A `flock` lock belongs to the open file description, not to the process: a second open of
//! the same directory (the same inode, by whatever path) conflicts with the first one even in
//! the same process, and one in another process conflicts too. So the directory lock refuses
//! every second opener with [`Error::AlreadyOpen`], before any metadata check or recovery runs.
//! The kernel releases it when the file is closed, including when the process dies.
//!
//! Limits:
//! - On NFS, Linux emulates `flock` with a POSIX record lock, which is per process again; a
//!   store on NFS is not protected against a second open in the same process.
//! - A process that opens the store without this lock (an idemdb from before it, a RocksDB
//!   tool) is refused by RocksDB's own `LOCK` when the engine opens for writing, so only after
//!   the declaration was checked: a mismatch is then `IncompatibleStore`, not `AlreadyOpen`.
//! - The lock belongs to the open directory, which a `fork` without `exec` shares: such a child
//!   keeps the store locked until it exits, even after the parent dropped its engine. (Rust
//!   opens files close-on-exec, so a spawned `Command` does not inherit it.)

use std::fs::{File, TryLockError};
use std::path::Path;

use crate::error::{Error, Result};

/// The exclusive lock on a store directory, held for as long as this value lives.
#[derive(Debug)]
pub(crate) struct StoreLock {
    /// The open directory; closing it releases the lock.
    _directory: File,
}

impl StoreLock {
    /// Takes the lock on the existing directory `path` without waiting.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] if another open (in this process or another) holds it;
    /// [`Error::Storage`] if `path` is not a directory that can be opened.
    pub(crate) fn acquire(path: &Path) -> Result<StoreLock> {
        let directory =
            File::open(path).map_err(|error| Error::io("opening the store directory", &error))?;
        let is_directory = directory
            .metadata()
            .map_err(|error| Error::io("reading the store directory's metadata", &error))?
            .is_dir();
        if !is_directory {
            return Err(Error::io(
                "opening the store directory",
                &std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
            ));
        }
        match directory.try_lock() {
            Ok(()) => Ok(StoreLock {
                _directory: directory,
            }),
            Err(TryLockError::WouldBlock) => Err(Error::AlreadyOpen {
                path: path.to_path_buf(),
            }),
            Err(TryLockError::Error(error)) => {
                Err(Error::io("locking the store directory", &error))
            }
        }
    }
}
