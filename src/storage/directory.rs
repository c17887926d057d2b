//! A directory of the store's as a whole: its changes made durable (an entry created, renamed
//! or removed is only durable once its directory is fsynced), and the bytes of its files.
//! Below every file the store writes.

use std::path::Path;

use crate::format::error::{Error, Result};

/// Fsyncs a directory: the entries created, renamed or removed in it become durable.
pub(crate) fn sync_directory(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

/// The total size and number of the regular files in `path` (RocksDB keeps a store's files in
/// one directory).
pub(crate) fn directory_size(path: &Path) -> Result<(u64, u64)> {
    let io = |error: std::io::Error| Error::io(&format!("reading {}", path.display()), &error);
    let mut bytes = 0;
    let mut files = 0;
    for entry in std::fs::read_dir(path).map_err(io)? {
        // On a live store, a compaction may delete a file between the listing and this look.
        let metadata = match entry.map_err(io)?.metadata() {
            Ok(metadata) => metadata,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(io(error)),
        };
        if metadata.is_file() {
            bytes += metadata.len();
            files += 1;
        }
    }
    Ok((bytes, files))
}
