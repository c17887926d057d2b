//! The ring's size: a new log's first slots, a slot added when every slot holds records not
//! yet stored elsewhere ([`CommitLog::grow_for`]), a slot of its own for a record larger than a
//! segment, and the large slot given back once free ([`CommitLog::trim`]). Which slot the next
//! segment goes into ([`CommitLog::next_slot_for`]).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{CommitLog, DIRECT_BLOCK, Slot, check_space, io_error, slot_path};
use crate::format::commit_log::LOG_SEGMENT_HEADER_BYTES;
use crate::format::error::{Error, Result};

/// Where a slot is made before it is renamed into the ring ([`CommitLog::grow_for`]): a reader
/// finds the slots by their names, so a half-made one must not have its final name.
pub(super) fn growing_path(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("segment-{slot}.new"))
}

/// Makes the segment file `path` (which must not exist): `bytes` of zeros, written (not only
/// allocated, so that a later write over these blocks changes neither the size nor the
/// allocation, and its sync has no metadata to journal) and synced.
pub(super) fn make_segment_file(path: &Path, bytes: u64) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|error| io_error("creating", path, &error))?;
    let zeros = vec![0u8; (1 << 20).min(bytes as usize)];
    let mut at = 0;
    while at < bytes {
        let chunk = (bytes - at).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..chunk], at)
            .map_err(|error| io_error("filling", path, &error))?;
        at += chunk as u64;
    }
    file.sync_all()
        .map_err(|error| io_error("syncing", path, &error))?;
    Ok(file)
}

impl CommitLog {
    /// The largest record (with its header) the log takes: its most slots, each less its
    /// header.
    pub(super) fn most_bytes(&self) -> u64 {
        (self.slots_max as u64).saturating_mul(self.segment_bytes - LOG_SEGMENT_HEADER_BYTES as u64)
    }

    /// How many slots the ring has.
    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Lets the ring grow to `slots_max` slots ([`CommitLog::grow_for`]); never below the slots it
    /// has.
    pub(crate) fn allow_growth_to(&mut self, slots_max: usize) {
        self.slots_max = slots_max.max(self.slots.len());
    }

    /// The slot the next segment goes into when it starts with a record of `needed` bytes: a
    /// free one (never used, or holding only released records) large enough, of the ring's
    /// size if one is (a larger slot is kept for the records that need it, and given back once
    /// free: [`CommitLog::trim`]), never used before used, the oldest segment first. `None`
    /// when no slot is free and large enough.
    pub(super) fn next_slot_for(&self, needed: u64) -> Option<usize> {
        (0..self.slots.len())
            .filter(|&slot| slot != self.active)
            .filter(|&slot| {
                let held = &self.slots[slot];
                let free = held.header.is_none() || held.end_lsn <= self.released_before;
                free && held.bytes >= LOG_SEGMENT_HEADER_BYTES as u64 + needed
            })
            .min_by_key(|&slot| {
                let held = &self.slots[slot];
                (
                    held.bytes > self.segment_bytes,
                    held.header.map(|header| header.segment),
                )
            })
    }

    /// Gives back the last slot while it is larger than the ring's segments (made for one large
    /// record), free and not written: removed, and its name with it (a power cut that forgets
    /// the removal leaves a free slot, which the next open keeps). Only the last: a reader takes
    /// the slots by their numbers, up to the first missing one.
    ///
    /// # Errors
    /// [`Error::Storage`] if the file cannot be removed or the directory synced.
    pub(crate) fn trim(&mut self) -> Result<()> {
        // A slot being made is named after the last one: it stays until that one is taken.
        if self.preparing.is_some() {
            return Ok(());
        }
        while let Some(last) = self.slots.len().checked_sub(1) {
            let held = &self.slots[last];
            let free = held.header.is_none() || held.end_lsn <= self.released_before;
            if !(last != self.active && free && held.bytes > self.segment_bytes) {
                break;
            }
            let path = slot_path(&self.dir, last);
            std::fs::remove_file(&path).map_err(|error| io_error("removing", &path, &error))?;
            crate::storage::directory::sync_directory(&self.dir)
                .map_err(|error| io_error("syncing", &self.dir, &error))?;
            self.slots.pop();
            if let Some(direct) = &mut self.direct {
                direct.files.pop();
            }
        }
        Ok(())
    }

    /// Adds a slot large enough for a record of `needed` bytes to the ring, if it has fewer
    /// than its most slots and the file system has room for the slot and, after it, for as
    /// many bytes as the ring then holds (at most what a flush of every record in it writes to
    /// table files: a log that took the last of the disk would leave its records nowhere to
    /// go): whether it did. Made as [`CommitLog::create`] makes its slots, under a name a
    /// reader does not take for a slot, then renamed, and the directory synced: a record
    /// written into a slot whose name a power cut could forget would be lost with it. The next
    /// segment switch takes it.
    ///
    /// A slot larger than the ring's segments (for a record that no segment holds) is made even
    /// when the ring has its most slots (no slot could ever hold the record otherwise), and
    /// given back once free ([`CommitLog::trim`]).
    ///
    /// # Errors
    /// [`Error::Storage`] if the slot cannot be made (a full disk is not an error: `false`).
    pub(crate) fn grow_for(&mut self, needed: u64) -> Result<bool> {
        let bytes = (LOG_SEGMENT_HEADER_BYTES as u64 + needed)
            .next_multiple_of(DIRECT_BLOCK as u64)
            .max(self.segment_bytes);
        // A slot made ahead of need comes first (waited for: it is under way, and the next
        // slot's name is its).
        if let Some(preparing) = self.preparing.take() {
            match preparing.finish()? {
                Some(slot) => self.adopt(slot)?,
                None => return Ok(false),
            }
            if bytes == self.segment_bytes {
                return Ok(true);
            }
        }
        if self.slots.len() >= self.slots_max && bytes == self.segment_bytes {
            return Ok(false);
        }
        let ring: u64 = self.slots.iter().map(|held| held.bytes).sum();
        match make_slot(&self.dir, self.slots.len(), bytes, ring)? {
            Some(slot) => self.adopt(slot)?,
            None => return Ok(false),
        }
        Ok(true)
    }

    /// Starts making the next slot on a thread of its own when the ring has no free slot left
    /// and may grow, so that the commit that finds the ring full takes a slot already made
    /// instead of making one (writing and syncing a segment of zeros) while the log's other
    /// writers wait. One at a time; [`CommitLog::grow_for`] takes it.
    pub(super) fn prepare_ahead(&mut self) {
        self.adopt_prepared();
        if self.preparing.is_some()
            || self.slots.len() >= self.slots_max
            || self.next_slot_for(0).is_some()
        {
            return;
        }
        let (dir, slot, bytes) = (self.dir.clone(), self.slots.len(), self.segment_bytes);
        let ring: u64 = self.slots.iter().map(|held| held.bytes).sum();
        let (done, made) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("idemdb-log-grow".into())
            .spawn(move || drop(done.send(make_slot(&dir, slot, bytes, ring))));
        match thread {
            Ok(thread) => {
                self.preparing = Some(Preparing {
                    made,
                    thread: Some(thread),
                });
            }
            // No thread: the commit that needs the slot makes it.
            Err(error) => {
                tracing::debug!(target: "idemdb", %error, "no thread to grow the commit log ahead");
            }
        }
    }

    /// Takes a slot made ahead of need if it is ready (without waiting).
    pub(super) fn adopt_prepared(&mut self) {
        let ready = self.preparing.as_ref().is_some_and(|preparing| {
            preparing
                .thread
                .as_ref()
                .is_none_or(|thread| thread.is_finished())
        });
        if !ready {
            return;
        }
        if let Some(preparing) = self.preparing.take() {
            // A slot that could not be made is made again, or not, when it is needed.
            if let Ok(Some(slot)) = preparing.finish() {
                drop(self.adopt(slot));
            }
        }
    }

    /// Adds a made slot to the ring (with its direct descriptor when writes are direct).
    fn adopt(&mut self, slot: Made) -> Result<()> {
        debug_assert_eq!(slot.path, slot_path(&self.dir, self.slots.len()));
        if let Some(direct) = &mut self.direct {
            let flags = rustix::fs::OFlags::DIRECT | rustix::fs::OFlags::DSYNC;
            let descriptor = OpenOptions::new()
                .write(true)
                .custom_flags(flags.bits().cast_signed())
                .open(&slot.path)
                .map_err(|error| io_error("opening", &slot.path, &error))?;
            direct.files.push(Arc::new(descriptor));
        }
        self.slots.push(Slot {
            file: Arc::new(slot.file),
            bytes: slot.bytes,
            header: None,
            end_lsn: 0,
        });
        Ok(())
    }
}

/// A slot made and named into the log's directory, not yet in the ring.
pub(super) struct Made {
    file: File,
    path: PathBuf,
    bytes: u64,
}

/// The slot made ahead of need ([`CommitLog::prepare_ahead`]).
pub(super) struct Preparing {
    made: std::sync::mpsc::Receiver<Result<Option<Made>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Preparing {
    /// Waits for the slot: made, or `None` (no room).
    fn finish(mut self) -> Result<Option<Made>> {
        let made = self.made.recv().unwrap_or_else(|_| {
            Err(Error::Storage {
                kind: crate::format::error::StorageErrorKind::Other,
                detail: "the thread growing the commit log ended without a slot".into(),
            })
        });
        if let Some(thread) = self.thread.take() {
            drop(thread.join());
        }
        made
    }
}

impl Drop for Preparing {
    /// A log dropped while a slot is made waits for it: the slot's name must not appear under
    /// a later open of the store.
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            drop(thread.join());
        }
    }
}

/// Makes slot `slot` of `bytes` in the log `dir` (holding `ring` bytes of slots): under a name a
/// reader does not take for a slot, then renamed, and the directory synced, so that a power
/// cut never forgets the name of a slot records went into. `None` when the file system lacks
/// room for the slot and, after it, for as many bytes as the ring then holds.
fn make_slot(dir: &Path, slot: usize, bytes: u64, ring: u64) -> Result<Option<Made>> {
    let (growing, path) = (growing_path(dir, slot), slot_path(dir, slot));
    // Room for the slot, and then for as many bytes as the ring holds.
    match check_space(&growing, 1, bytes.saturating_mul(2).saturating_add(ring), 0) {
        Ok(()) => {}
        Err(Error::Storage {
            kind: crate::format::error::StorageErrorKind::NoSpace,
            ..
        }) => return Ok(None),
        Err(error) => return Err(error),
    }
    if growing.exists() {
        std::fs::remove_file(&growing).map_err(|error| io_error("removing", &growing, &error))?;
    }
    let file = make_segment_file(&growing, bytes)?;
    std::fs::rename(&growing, &path).map_err(|error| io_error("renaming", &growing, &error))?;
    crate::storage::directory::sync_directory(dir)
        .map_err(|error| io_error("syncing", dir, &error))?;
    Ok(Some(Made { file, path, bytes }))
}
