//! Making a file system's directory changes durable: an entry created, renamed or removed is
//! only durable once its directory is fsynced. Below every file the store writes.

use std::path::Path;

/// Fsyncs a directory: the entries created, renamed or removed in it become durable.
pub(crate) fn sync_directory(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}
