//! The ring's size: a new log's first slots, a slot added when every slot holds records not
//! yet stored elsewhere ([`CommitLog::grow_for`]), a slot of its own for a record larger than a
//! segment, and the large slot given back once free ([`CommitLog::trim`]); the slots a burst
//! added given back once the store is quiet ([`CommitLog::shrink`]). Which slot the next
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
    fill_with_zeros(&file, path, 0, bytes)?;
    Ok(file)
}

/// The size of each write that fills a new segment with zeros: one page. The page cache holds
/// a page written by a larger write as part of a larger folio, and the file system then walks
/// every block of that folio on each of the log's small writes into it (ext4 on Linux 6.18:
/// 30% of a lone writer's time went to `ext4_block_write_begin` and `block_commit_write` after
/// 1 MiB fills).
const FILL_CHUNK_BYTES: usize = 4096;

/// Writes zeros over `from..to` of `file` (at `path`) and syncs it, its size with it.
fn fill_with_zeros(file: &File, path: &Path, from: u64, to: u64) -> Result<()> {
    let zeros = vec![0u8; FILL_CHUNK_BYTES.min(to.saturating_sub(from) as usize)];
    let mut at = from;
    while at < to {
        let chunk = (to - at).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..chunk], at)
            .map_err(|error| io_error("filling", path, &error))?;
        at += chunk as u64;
    }
    file.sync_all()
        .map_err(|error| io_error("syncing", path, &error))
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

    /// Whether `slot` may take a new segment: never used, or holding only released records.
    fn is_free(&self, slot: usize) -> bool {
        let held = &self.slots[slot];
        held.header.is_none() || held.end_lsn <= self.released_before
    }

    /// Whether appending `bytes` of records switches segments into the ring's last free slot,
    /// or finds none: then the next switch would start making one more slot.
    pub(crate) fn switch_would_fill(&self, bytes: u64) -> bool {
        self.write_at + bytes > self.slots[self.active].bytes
            && (0..self.slots.len())
                .filter(|&slot| slot != self.active && self.is_free(slot))
                .count()
                <= 1
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
                self.is_free(slot)
                    && self.slots[slot].bytes >= LOG_SEGMENT_HEADER_BYTES as u64 + needed
            })
            .min_by_key(|&slot| {
                let held = &self.slots[slot];
                (
                    held.bytes > self.segment_bytes,
                    held.header.map(|header| header.segment),
                )
            })
    }

    /// Gives back what large records took once the tables hold them: every free slot larger
    /// than the ring's segments is cut back to their size (the active one too once closed: a
    /// large record's slot takes no record after it), and a slot made beyond the ring's most
    /// is removed while it is the last one, free and not active (a reader takes the slots by
    /// number, up to the first missing one). A power cut that forgets a cut or a removal
    /// leaves a free slot, larger or one more, which the next open keeps.
    ///
    /// # Errors
    /// [`Error::Storage`] if a file cannot be cut, removed or synced.
    pub(crate) fn trim(&mut self) -> Result<()> {
        for slot in 0..self.slots.len() {
            let held = &self.slots[slot];
            let closed = slot != self.active || self.write_at >= held.bytes;
            if self.is_free(slot) && closed && held.bytes > self.segment_bytes {
                self.resize(slot, self.segment_bytes)?;
                if slot == self.active {
                    // Still closed: the next record starts a segment elsewhere.
                    self.write_at = self.segment_bytes;
                }
            }
        }
        // A slot being made is named after the last one: it stays until that one is taken.
        if self.preparing.is_some() {
            return Ok(());
        }
        while let Some(last) = self.slots.len().checked_sub(1) {
            if !(last >= self.slots_max && last != self.active && self.is_free(last)) {
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

    /// Gives back every slot from `keep` up (`keep` at least [`LOG_SLOTS_MIN`]), a slot made
    /// ahead of need among them, and cuts back the free slots enlarged for large records, once
    /// no record the ring holds is still needed: the ring a quiet store returns to after a
    /// burst grew it. Whether the ring is now `keep` slots of its segment size
    /// ([`CommitLog::grown_beyond`]); `false`, removing nothing, while any record is appended
    /// and unwritten or not yet released (the tables' files must hold every record first: a
    /// removed slot takes its records with it), while no slot below `keep` is free, or while a
    /// slot is being made ahead of need.
    ///
    /// Order, for power cuts: when the segment being written is in a slot to give back, a new
    /// segment is started below `keep` and its header written and synced first, so that the
    /// log's end never lies in a removed slot; then the slots are removed from the last one
    /// down and the directory synced. A cut that forgets some removals leaves slots that hold
    /// only released segments (older than the new one, so no reader follows them), free like
    /// any other; one that forgets the new header leaves a log that ends before the tables'
    /// LSN, which an open takes as every record released.
    ///
    /// # Errors
    /// [`Error::Storage`] if the header cannot be written or a slot removed (the ring then
    /// keeps the slots not yet removed).
    pub(crate) fn shrink(&mut self, keep: usize) -> Result<bool> {
        let keep = keep.max(super::LOG_SLOTS_MIN);
        // A slot being made ahead of need is given back too, once made (taken into the ring
        // here; one still under way puts the shrink off).
        self.adopt_prepared();
        if self.preparing.is_some() {
            return Ok(false);
        }
        if self.slots.len() > keep {
            // The slots given back, and the one written (its records go nowhere else), must
            // hold released records only.
            let needed = (keep..self.slots.len())
                .chain([self.active])
                .any(|slot| !self.is_free(slot));
            if needed || !self.pending.is_empty() {
                return Ok(false);
            }
            if self.active >= keep {
                let Some(below) = (0..keep).find(|&slot| self.is_free(slot)) else {
                    return Ok(false);
                };
                self.start_segment(below);
                self.sync()?;
            }
            while self.slots.len() > keep {
                let last = self.slots.len() - 1;
                let path = slot_path(&self.dir, last);
                std::fs::remove_file(&path).map_err(|error| io_error("removing", &path, &error))?;
                self.slots.pop();
                if let Some(direct) = &mut self.direct {
                    direct.files.pop();
                }
            }
            crate::storage::directory::sync_directory(&self.dir)
                .map_err(|error| io_error("syncing", &self.dir, &error))?;
        }
        // A slot enlarged for a large record, once free, is cut back too.
        self.trim()?;
        Ok(!self.grown_beyond(keep))
    }

    /// Whether the ring holds more than `keep` slots of its segment size: more slots, one
    /// being made ahead of need, or one enlarged for a large record.
    pub(crate) fn grown_beyond(&self, keep: usize) -> bool {
        self.slots.len() > keep
            || self.preparing.is_some()
            || self
                .slots
                .iter()
                .any(|held| held.bytes > self.segment_bytes)
    }

    /// Makes free slot `slot` `bytes` long: grown with zeros, or cut; synced, its size with it.
    /// A power cut midway leaves it at one of the two sizes or between, still free.
    fn resize(&mut self, slot: usize, bytes: u64) -> Result<()> {
        let path = slot_path(&self.dir, slot);
        let held = &self.slots[slot];
        if bytes > held.bytes {
            fill_with_zeros(&held.file, &path, held.bytes, bytes)?;
        } else {
            held.file
                .set_len(bytes)
                .and_then(|()| held.file.sync_all())
                .map_err(|error| io_error("cutting", &path, &error))?;
        }
        self.slots[slot].bytes = bytes;
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
    /// For a record that no segment holds, a free slot is enlarged in place; without one, a
    /// slot of its size is made, even when the ring has its most slots (one more at most).
    /// Either is given back once free ([`CommitLog::trim`]). Large records take no more than
    /// the ring's most (`segments` x `segment_bytes`) on top of it: past that, `false`, and the
    /// caller's flush frees and cuts back the slots they hold.
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
        let ring: u64 = self.slots.iter().map(|held| held.bytes).sum();
        // What large records may take on top of the ring's most: as much again (and the one
        // slot beyond its most). Past it, the records holding the enlarged slots are flushed
        // first, and the slots cut back: then any record the log takes fits.
        let budget = (self.slots_max as u64).saturating_mul(self.segment_bytes);
        let limit = budget.saturating_mul(2).saturating_add(self.segment_bytes);
        let within = |extra: u64| ring.saturating_add(extra) <= limit;
        if bytes > self.segment_bytes {
            // A free slot enlarged in place (the largest free one): the ring keeps its slots,
            // and the slot is cut back once the tables hold the record (`trim`).
            let free = (0..self.slots.len())
                .filter(|&slot| slot != self.active && self.is_free(slot))
                .max_by_key(|&slot| self.slots[slot].bytes);
            if let Some(slot) = free {
                let extra = bytes.saturating_sub(self.slots[slot].bytes);
                if !within(extra) || !has_room(&slot_path(&self.dir, slot), extra, ring)? {
                    return Ok(false);
                }
                self.resize(slot, bytes)?;
                return Ok(true);
            }
        }
        // At its most, the ring takes one slot more for a large record, no second: the
        // records that hold the others are flushed first, and their slots enlarged.
        if self.slots.len() > self.slots_max
            || (self.slots.len() == self.slots_max && bytes == self.segment_bytes)
            || (bytes > self.segment_bytes && !within(bytes))
        {
            return Ok(false);
        }
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

    /// Whether a slot made ahead of need is ready to be taken: its thread has ended (the
    /// slot's file is named into the directory before that).
    pub(super) fn ahead_ready(&self) -> bool {
        self.preparing.as_ref().is_some_and(|preparing| {
            preparing
                .thread
                .as_ref()
                .is_none_or(|thread| thread.is_finished())
        })
    }

    /// Takes a slot made ahead of need if it is ready (without waiting).
    pub(super) fn adopt_prepared(&mut self) {
        if !self.ahead_ready() {
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

/// Whether the file system of the log's file `path` has room for `extra` more bytes of slots
/// and, after them, for as many bytes as the ring (`ring` bytes before them) then holds: what
/// a flush of every record in it writes to table files, at most.
fn has_room(path: &Path, extra: u64, ring: u64) -> Result<bool> {
    match check_space(path, 1, extra.saturating_mul(2).saturating_add(ring), 0) {
        Ok(()) => Ok(true),
        Err(Error::Storage {
            kind: crate::format::error::StorageErrorKind::NoSpace,
            ..
        }) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Makes slot `slot` of `bytes` in the log `dir` (holding `ring` bytes of slots): under a name a
/// reader does not take for a slot, then renamed, and the directory synced, so that a power
/// cut never forgets the name of a slot records went into. `None` when the file system lacks
/// room for the slot and, after it, for as many bytes as the ring then holds.
fn make_slot(dir: &Path, slot: usize, bytes: u64, ring: u64) -> Result<Option<Made>> {
    let (growing, path) = (growing_path(dir, slot), slot_path(dir, slot));
    if !has_room(&growing, bytes, ring)? {
        return Ok(None);
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
