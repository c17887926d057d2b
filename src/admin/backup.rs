//! Offline backups and restores: [`Store::backup`] copies a stopped store into a new directory,
//! [`Backup::open`] and [`Backup::restore`] put such a copy back as a store. A running
//! application takes its backups itself, online, with [`crate::Engine::checkpoint`]; both
//! kinds restore the same way.
//!
//! A backup is a RocksDB checkpoint taken without a flush (the exclusive open's business tables
//! have a stand-in merge operator, which must never fold their operands): table files, the
//! MANIFEST, and the WAL files holding what was not flushed yet, replayed when the copy opens.
//!
//! Neither operation leaves a half-written directory under the name asked for: files are
//! written into a hidden sibling (`.NAME.idemdb-…`), fsynced with their directory, and the
//! sibling is renamed to the name asked for, whose parent is then fsynced. A failure removes
//! the sibling. A process killed midway leaves the sibling behind, recognisable by its name.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::format::error::{Error, Result};
use crate::storage::store_lock::StoreLock;

use super::open::{Store, TableInfo, discover};

/// The size of the reads and writes that copy a file: large enough for a disk's sequential
/// speed, small enough that the progress callback is called often.
const COPY_CHUNK_BYTES: usize = 1 << 20;

/// How a backup's files came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transfer {
    /// The backup directory is on the store's file system: table files are hard links to the
    /// store's (immutable) table files, the small rest is copied. It takes little time or
    /// space, and shares the store's disk: it does not survive the loss of that disk.
    HardLinks,
    /// Every byte was copied (another file system, or a restore).
    Copy,
}

impl Transfer {
    /// A lowercase name for display: `hard links` or `copy`.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Transfer::HardLinks => "hard links",
            Transfer::Copy => "copy",
        }
    }
}

/// What a backup or a restore wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferReport {
    /// The directory written.
    pub path: PathBuf,
    /// The files in it.
    pub files: u64,
    /// Their total size in bytes.
    pub bytes: u64,
    /// How many of them share their storage with another directory's file (hard links).
    pub linked_files: u64,
    /// How they came to be.
    pub transfer: Transfer,
}

/// Checks that `dir` can be the new directory of a backup or restore: it does not exist (not
/// even as a dangling symlink) and its parent is a directory. [`Store::backup`] and
/// [`Backup::restore`] check this themselves; a tool calls it before opening the store, so that
/// a wrong target is refused before the store is touched.
///
/// # Errors
/// [`Error::InvalidArgument`] when `dir` exists, has no name, or its parent is not a directory;
/// [`Error::Storage`] when the file system cannot say.
pub fn check_new_dir(dir: &Path) -> Result<()> {
    NewDir::check(dir).map(|_| ())
}

impl Store {
    /// Writes a backup of the store to the new directory `dir` (its parent must exist) and
    /// returns what it holds. The store must be open exclusively ([`Error::ReadOnly`]
    /// otherwise), so the backup is the store's state at the call: every commit the application
    /// made before it stopped.
    ///
    /// On the store's file system the backup's table files are hard links (see
    /// [`Transfer::HardLinks`]); elsewhere the checkpoint is made into a hidden sibling of the
    /// store (hard links, on the store's file system) and copied file by file into `dir`,
    /// `progress(bytes_copied, bytes_total)` being called as it goes, then the sibling is
    /// removed. Every file is fsynced, and so are `dir` and its parent.
    ///
    /// Nothing of the store changes, and no merge operand of a business table is folded: the
    /// data the WAL holds is copied as WAL.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `dir` exists, is inside the store, or its parent is not
    /// a directory (nothing is written); [`Error::ReadOnly`] on a read-only store; [`Error::Storage`] when a
    /// file cannot be read, written or synced (then nothing is left under `dir`).
    pub fn backup(&self, dir: &Path, mut progress: impl FnMut(u64, u64)) -> Result<TransferReport> {
        let engine = self.engine()?;
        let target = NewDir::check(dir)?;
        target.refuse_inside(&self.path, "the store")?;
        let store_device = device(&self.path)?;
        if store_device == device(&target.parent)? {
            let staging = Sibling::new(&target.parent, &target.stem, "backup")?;
            engine.storage().checkpoint_without_flush(&staging.path)?;
            // RocksDB has fsynced every file it wrote and the directory.
            let (files, bytes, linked_files) = census(&staging.path)?;
            staging.rename_to(&target)?;
            return Ok(TransferReport {
                path: target.path,
                files,
                bytes,
                linked_files,
                transfer: Transfer::HardLinks,
            });
        }
        // Checkpoint where hard links work, beside the store (which may be named `.`), then
        // copy the bytes across.
        let store = fs::canonicalize(&self.path)
            .map_err(|error| io_error("resolving the path of", &self.path, &error))?;
        let store_parent = store.parent().unwrap_or(&store);
        let staging = Sibling::new(store_parent, &stem(&store)?, "backup-staging")?;
        engine.storage().checkpoint_without_flush(&staging.path)?;
        let report = copy_dir(&staging.path, target, "backup", &mut progress)?;
        drop(staging);
        Ok(report)
    }
}

/// A backup to restore from: a store directory (written by [`Store::backup`] or
/// [`crate::Engine::checkpoint`]) checked to be an idemdb store, and locked so that no engine
/// opens it while it is copied. Opening it writes nothing into it.
#[derive(Debug)]
pub struct Backup {
    path: PathBuf,
    tables: Vec<TableInfo>,
    /// Held so that no engine or tool opens the backup for writing during the copy.
    _lock: StoreLock,
}

impl Backup {
    /// Opens the backup at `path`: takes its directory lock and reads its metadata read-only.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] when a process has the directory open as a store (a live store
    /// is no backup: its files change while they are copied); [`Error::IncompatibleStore`]
    /// when it holds no idemdb store; [`Error::Storage`] when it cannot be read.
    pub fn open(path: impl AsRef<Path>) -> Result<Backup> {
        let path = path.as_ref().to_path_buf();
        super::open::check_store_exists(&path)?;
        let lock = StoreLock::acquire(&path)?;
        let (_, tables) = discover(&path)?;
        Ok(Backup {
            path,
            tables,
            _lock: lock,
        })
    }

    /// The backup's directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tables the backup holds, as [`Store::tables`] lists them.
    #[must_use]
    pub fn tables(&self) -> &[TableInfo] {
        &self.tables
    }

    /// Copies every file of the backup into the new store directory `store` (its parent must
    /// exist), calling `progress(bytes_copied, bytes_total)` as it goes. The files are copied,
    /// never linked, so nothing the restored store does (recycling its WAL files, say) reaches
    /// the backup. Every file is fsynced, and so are `store` and its parent. Then `store` opens
    /// with the declaration the backed-up store had.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `store` exists, is inside the backup, or its parent is
    /// not a directory (nothing is written); [`Error::IncompatibleStore`] when the backup holds something other than
    /// files; [`Error::Storage`] when a file cannot be read, written or synced (then nothing is
    /// left under `store`).
    pub fn restore(
        &self,
        store: &Path,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<TransferReport> {
        let target = NewDir::check(store)?;
        target.refuse_inside(&self.path, "the backup")?;
        copy_dir(&self.path, target, "restore", &mut progress)
    }
}

/// A directory to create: checked absent, with an existing parent.
struct NewDir {
    path: PathBuf,
    parent: PathBuf,
    /// The last component of `path`, which names the hidden siblings made for it.
    stem: String,
}

impl NewDir {
    fn check(dir: &Path) -> Result<NewDir> {
        match dir.symlink_metadata() {
            Ok(_) => {
                return Err(Error::invalid_argument(format!(
                    "{} exists already; give a new directory",
                    dir.display()
                )));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(io_error("looking for", dir, &error)),
        }
        // `x/..` and `/` name no new directory.
        let stem = stem(dir)?;
        let parent = match dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !parent.is_dir() {
            return Err(Error::invalid_argument(format!(
                "{} is not a directory; create it first",
                parent.display()
            )));
        }
        Ok(NewDir {
            path: dir.to_path_buf(),
            parent,
            stem,
        })
    }
}

impl NewDir {
    /// Refuses a new directory inside `dir` (`what`, for the message): a backup inside its
    /// store would become part of the store, and a restore inside its backup would write into
    /// the backup.
    fn refuse_inside(&self, dir: &Path, what: &str) -> Result<()> {
        let resolve = |path: &Path| {
            fs::canonicalize(path).map_err(|error| io_error("resolving the path of", path, &error))
        };
        if resolve(&self.parent)?.starts_with(resolve(dir)?) {
            return Err(Error::invalid_argument(format!(
                "{} is inside {what} {}; give a directory outside it",
                self.path.display(),
                dir.display()
            )));
        }
        Ok(())
    }
}

/// The last component of `dir`.
fn stem(dir: &Path) -> Result<String> {
    match dir.file_name() {
        Some(name) => Ok(name.to_string_lossy().into_owned()),
        None => Err(Error::invalid_argument(format!(
            "{} names no directory to create",
            dir.display()
        ))),
    }
}

/// A hidden directory beside a [`NewDir`], removed when dropped unless it was renamed to it.
struct Sibling {
    path: PathBuf,
    kept: bool,
}

impl Sibling {
    /// A fresh name in `parent` for a sibling of `stem`, not created (RocksDB's checkpoint
    /// creates its directory itself).
    fn new(parent: &Path, stem: &str, purpose: &str) -> Result<Sibling> {
        // Unique within the process (the counter) and across processes (the pid), so two
        // tools never share a sibling, and never remove one another's.
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            ".{stem}.idemdb-{purpose}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = parent.join(name);
        if path.symlink_metadata().is_ok() {
            return Err(Error::invalid_argument(format!(
                "{} exists already (left by an interrupted run?); remove it",
                path.display()
            )));
        }
        Ok(Sibling { path, kept: false })
    }

    /// Renames the sibling to `target` and fsyncs their parent, so the rename survives a crash.
    fn rename_to(mut self, target: &NewDir) -> Result<()> {
        // Checked again: the target may have appeared since it was first checked, and a
        // rename would replace an empty directory.
        if target.path.symlink_metadata().is_ok() {
            return Err(Error::invalid_argument(format!(
                "{} appeared while it was written; nothing was put there",
                target.path.display()
            )));
        }
        fs::rename(&self.path, &target.path)
            .map_err(|error| io_error("renaming into place", &target.path, &error))?;
        self.kept = true;
        sync_dir(&target.parent)
    }
}

impl Drop for Sibling {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        // Best effort: a failure to clean up must not hide the error that got us here. RocksDB
        // writes a checkpoint into `<dir>.tmp` first, and removes it itself on failure; it is
        // removed here too in case it could not.
        let _ = fs::remove_dir_all(&self.path);
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        let _ = fs::remove_dir_all(PathBuf::from(tmp));
    }
}

/// The files of `dir`: (count, total bytes, count of those with more than one link).
fn census(dir: &Path) -> Result<(u64, u64, u64)> {
    let (mut files, mut bytes, mut linked) = (0, 0, 0);
    for (_, metadata) in regular_files(dir)? {
        files += 1;
        bytes += metadata.len();
        if metadata.nlink() > 1 {
            linked += 1;
        }
    }
    Ok((files, bytes, linked))
}

/// The entries of `dir`, by name, each checked to be a regular file: a store directory holds
/// nothing else, and a copy must not follow a symlink out of it.
fn regular_files(dir: &Path) -> Result<Vec<(PathBuf, fs::Metadata)>> {
    let entries = fs::read_dir(dir).map_err(|error| io_error("listing", dir, &error))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|error| io_error("listing", dir, &error))?;
        let path = entry.path();
        let metadata = path
            .symlink_metadata()
            .map_err(|error| io_error("reading the metadata of", &path, &error))?;
        if !metadata.is_file() {
            return Err(Error::IncompatibleStore {
                path: dir.to_path_buf(),
                reason: format!(
                    "{} is not a regular file; a store directory holds files only",
                    path.display()
                ),
            });
        }
        files.push((path, metadata));
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// Copies every file of `source` into a hidden sibling of `target`, fsyncs each file and the
/// directory, and renames it to `target`. Every byte is copied: no file is linked.
fn copy_dir(
    source: &Path,
    target: NewDir,
    purpose: &str,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<TransferReport> {
    let files = regular_files(source)?;
    let total: u64 = files.iter().map(|(_, metadata)| metadata.len()).sum();
    let partial = Sibling::new(&target.parent, &target.stem, purpose)?;
    fs::create_dir(&partial.path).map_err(|error| io_error("creating", &partial.path, &error))?;
    let mut buffer = vec![0u8; COPY_CHUNK_BYTES];
    let mut copied = 0u64;
    progress(0, total);
    for (path, _) in &files {
        let Some(name) = path.file_name() else {
            continue;
        };
        let to = partial.path.join(name);
        copy_file(path, &to, &mut buffer, &mut |chunk| {
            copied += chunk;
            // A file that grew since it was listed could take the count past the total.
            progress(copied, total.max(copied));
        })?;
    }
    sync_dir(&partial.path)?;
    partial.rename_to(&target)?;
    Ok(TransferReport {
        path: target.path,
        files: files.len() as u64,
        bytes: copied,
        linked_files: 0,
        transfer: Transfer::Copy,
    })
}

/// Copies `from` to the new file `to` and fsyncs it; `copied(n)` after each chunk of n bytes.
fn copy_file(from: &Path, to: &Path, buffer: &mut [u8], copied: &mut dyn FnMut(u64)) -> Result<()> {
    let mut source = File::open(from).map_err(|error| io_error("opening", from, &error))?;
    let mut target = File::create_new(to).map_err(|error| io_error("creating", to, &error))?;
    loop {
        let read = match source.read(buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(io_error("reading", from, &error)),
        };
        target
            .write_all(&buffer[..read])
            .map_err(|error| io_error("writing", to, &error))?;
        copied(read as u64);
    }
    target
        .sync_all()
        .map_err(|error| io_error("syncing", to, &error))
}

/// Fsyncs a directory, so the entries created or renamed in it survive a crash.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|directory| directory.sync_all())
        .map_err(|error| io_error("syncing the directory", dir, &error))
}

/// The device a path is on.
fn device(path: &Path) -> Result<u64> {
    fs::metadata(path)
        .map(|metadata| metadata.dev())
        .map_err(|error| io_error("reading the metadata of", path, &error))
}

fn io_error(doing: &str, path: &Path, error: &io::Error) -> Error {
    Error::io(&format!("{doing} {}", path.display()), error)
}
