//! Direct writes of whole blocks (`O_DIRECT | O_DSYNC`) and the pending writes of a group,
//! performed and synced through the page cache or directly.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{DIRECT_BLOCK, io_error};
use crate::format::error::Result;

/// The log's direct writes: a descriptor per slot opened with `O_DIRECT | O_DSYNC`, and the
/// bytes of the block where the log ends, which the next write rewrites.
pub(super) struct Direct {
    pub(super) files: Vec<Arc<File>>,
    /// The slot and offset of the block holding the log's end, and its bytes up to the end.
    pub(super) tail_slot: usize,
    pub(super) tail_at: u64,
    pub(super) tail: Vec<u8>,
}

/// Bytes at an address aligned to [`DIRECT_BLOCK`], as direct writes need them (the vector is
/// longer by a block, and the bytes start where its address is aligned).
pub(super) struct Aligned {
    pub(super) raw: Vec<u8>,
    pub(super) start: usize,
    pub(super) len: usize,
}

impl Aligned {
    pub(super) fn zeroed(len: usize) -> Aligned {
        let raw = vec![0u8; len + DIRECT_BLOCK];
        let start = (DIRECT_BLOCK - raw.as_ptr().addr() % DIRECT_BLOCK) % DIRECT_BLOCK;
        Aligned { raw, start, len }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// Whether `error` is a file system's refusal of direct I/O (tmpfs before Linux 6.6, some FUSE
/// ones), at the open or at the first write.
pub(super) fn refuses_direct(error: &std::io::Error) -> bool {
    error.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error())
}

pub(super) fn block_below(at: u64) -> u64 {
    at - at % DIRECT_BLOCK as u64
}

pub(super) fn block_above(at: u64) -> u64 {
    block_below(at + DIRECT_BLOCK as u64 - 1)
}

/// The writes of a group, taken out together: most groups' records are contiguous, one write,
/// kept inline (no allocation on a lone writer's path).
pub(crate) type PendingWrites = smallvec::SmallVec<[PendingWrite; 1]>;

/// A write the log has taken out to be made ([`perform_writes`]).
pub(crate) struct PendingWrite {
    pub(super) file: Arc<File>,
    /// The slot's `O_DIRECT | O_DSYNC` descriptor, for a write of whole aligned blocks.
    pub(super) direct: Option<Arc<File>>,
    /// The log's folder and the slot's number: its file's path, made only for an error.
    pub(super) dir: Arc<Path>,
    pub(super) slot: usize,
    pub(super) at: u64,
    pub(super) bytes: Written,
}

/// A write's bytes.
pub(super) enum Written {
    Plain(Vec<u8>),
    Blocks(Aligned),
}

impl PendingWrite {
    fn path(&self) -> PathBuf {
        super::slot_path(&self.dir, self.slot)
    }

    pub(super) fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Written::Plain(bytes) => bytes,
            Written::Blocks(blocks) => blocks.bytes(),
        }
    }
}

/// Makes `writes`, then, with `sync`, syncs each file written (`fdatasync`). With `sync`, a
/// write of whole blocks goes through its direct descriptor, durable when it returns; without
/// (a fault test's unsynced write), through the page cache like the others.
pub(crate) fn perform_writes(writes: &[PendingWrite], sync: bool) -> Result<()> {
    for write in writes {
        let file = match &write.direct {
            Some(direct) if sync => direct,
            _ => &write.file,
        };
        file.write_all_at(write.bytes(), write.at)
            .map_err(|error| io_error("writing", &write.path(), &error))?;
    }
    if sync {
        // Every write is to a slot of the same log: the slot names the file.
        let mut synced: Vec<usize> = Vec::new();
        for write in writes {
            if write.direct.is_some() || synced.contains(&write.slot) {
                continue;
            }
            write
                .file
                .sync_data()
                .map_err(|error| io_error("syncing", &write.path(), &error))?;
            synced.push(write.slot);
        }
    }
    Ok(())
}
