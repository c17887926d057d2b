//! The commit log: segments made once, full size, and rewritten in place as a ring, so that a
//! durable append is a `pwrite` over written blocks and an `fdatasync` that writes data only
//! (a growing file makes every sync also journal its new size). The engine's durable path when a
//! store is opened with `EngineBuilder::commit_log` (`storage/log/logged_writes.rs`).
//!
//! The format (segment headers, records, how a reader finds the end) is
//! `format/commit_log.rs`. Here: the files, the ring, appends and syncs, reopening after a
//! crash (the records from a given LSN on, and where to write next), and the reuse of a
//! segment once the caller says every record in it is stored elsewhere
//! ([`CommitLog::release_through`]).
//!
//! Layout: `<dir>/segment-<slot>` for slots 0..N, each `segment_bytes` long. A slot holds one
//! segment at a time; the segment's header says which (a number that only grows) and the LSN
//! of its first record. The ring is made with its first slots and grows a slot at a time, up to
//! its most ([`CommitLog::allow_growth_to`]), when every slot holds records not yet stored
//! elsewhere ([`CommitLog::grow_for`]): a new slot is made whole under another name, synced,
//! renamed into place and its name synced before a record goes into it. The next segment goes
//! into the slot holding the oldest one, so slot order is free and only the headers order the
//! log.
//!
//! Direct writes ([`CommitLog::write_direct`], the engine's `Durability::Sync`): each group's
//! records go out as whole 4 KiB blocks through a second descriptor opened with `O_DIRECT |
//! O_DSYNC`, durable when the write returns. On this project's VM that is 13-15% less time than
//! the same bytes written to the page cache and `fdatasync`ed (the kernel's writeback and its
//! page bookkeeping are skipped). The block holding the log's end is rewritten by the next
//! group with the bytes it already held, so a write torn anywhere in it leaves every earlier
//! record as it was (each sector holds its old bytes or identical new ones), as with the page
//! cache, which writes back that whole page too.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::format::commit_log::{
    LOG_RECORD_HEADER_BYTES, LOG_RECORD_PAYLOAD_MAX, LOG_SEGMENT_HEADER_BYTES, LogEnd,
    LogSegmentHeader, encode_log_record,
};
pub(crate) use crate::format::commit_log::{LOG_SEGMENT_BYTES_MIN, LOG_SLOTS_MIN};
use crate::format::error::{Error, Result};

mod chain;
mod direct;
mod growth;
#[cfg(test)]
mod power_cut_tests;
#[cfg(test)]
mod tests;

use chain::{Access, Chain, read_segment_header};
pub(crate) use direct::PendingWrites;
pub(crate) use direct::perform_writes;
use direct::{Aligned, Direct, PendingWrite, Written, block_above, block_below, refuses_direct};
use growth::{growing_path, make_segment_file};

#[cfg(test)]
thread_local! {
    /// Tests' seam: runs in a read of the log between the segment headers' read and the
    /// records' (where a writer beside the reader may reuse a segment).
    pub(crate) static AFTER_HEADERS_READ: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
        const { std::cell::RefCell::new(None) };
}

/// The slots a new log is made with: its first open writes these segments only; the ring grows
/// toward the most it is given as its writes need ([`CommitLog::grow_for`]).
pub(crate) const LOG_SLOTS_FIRST: usize = LOG_SLOTS_MIN;

/// The block of direct writes: their offset, length and memory are multiples of it. 4 KiB
/// covers the logical block of every common disk (512 B or 4 KiB).
const DIRECT_BLOCK: usize = 4096;

/// One slot of the ring.
struct Slot {
    file: Arc<File>,
    /// The slot's size: the log's segment size, or more for a record larger than a segment
    /// ([`CommitLog::grow_for`]).
    bytes: u64,
    /// The segment the slot holds, if any has been started in it.
    header: Option<LogSegmentHeader>,
    /// The LSN after the slot's last record (its first LSN while it is empty).
    end_lsn: u64,
}

/// The open commit log.
pub(crate) struct CommitLog {
    /// Shared with each write taken out ([`PendingWrite`]), which names its file only if it
    /// fails: a path made for every write cost a thousand instructions a commit.
    dir: Arc<Path>,
    /// The size of the ring's slots (a slot made for a larger record is larger).
    segment_bytes: u64,
    slots: Vec<Slot>,
    /// The slot being written.
    active: usize,
    /// The most slots the ring may grow to.
    slots_max: usize,
    /// Where in the active slot the next record goes.
    write_at: u64,
    next_lsn: u64,
    next_segment: u64,
    /// Every record before this LSN is stored elsewhere: its segment may be reused.
    released_before: u64,
    /// Encoded records not yet written: (slot, offset, bytes), in order.
    pending: Vec<(usize, u64, Vec<u8>)>,
    /// Set by [`CommitLog::write_direct`] where the file system takes direct writes.
    direct: Option<Direct>,
    /// The slot being made ahead of need, if one is.
    preparing: Option<growth::Preparing>,
}

/// What reopening found.
pub(crate) struct Recovered {
    /// How many records were handed to the replay.
    pub(crate) recovered: u64,
    /// Why the log ends where it does (evidence for tests; every kind is a normal end).
    pub(crate) end: LogEnd,
}

fn io_error(doing: &str, path: &Path, error: &std::io::Error) -> Error {
    Error::io(&format!("{doing} {}", path.display()), error)
}

/// Where a log is made before it is renamed into place.
pub(crate) fn building_path(dir: &Path) -> PathBuf {
    let mut name = dir.as_os_str().to_owned();
    name.push(".new");
    PathBuf::from(name)
}

fn slot_path(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("segment-{slot}"))
}

/// Refuses a log of `slots` segments of `segment_bytes` to be made as `dir` when its file
/// system has less free space than that, counting `reclaimable` bytes that making it frees
/// first ([`StorageErrorKind::NoSpace`]): every byte of a new log is written, so a log larger
/// than the free space would fill the disk before failing.
/// The store's open runs this before it writes anything (a missing store directory is
/// measured at its nearest existing parent), [`CommitLog::create`] again.
///
/// [`StorageErrorKind::NoSpace`]: crate::format::error::StorageErrorKind::NoSpace
pub(crate) fn check_space(
    dir: &Path,
    slots: usize,
    segment_bytes: u64,
    reclaimable: u64,
) -> Result<()> {
    let needed = (slots as u64).saturating_mul(segment_bytes);
    // The nearest directory that exists: a store's open checks before it creates the store's
    // directory (and its missing parents), so that the refusal creates nothing.
    let parent = dir
        .ancestors()
        .skip(1)
        .map(|parent| {
            if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            }
        })
        .find(|parent| parent.exists())
        .unwrap_or(Path::new("."));
    let space = rustix::fs::statvfs(parent).map_err(|error| {
        io_error(
            "reading the free space of",
            parent,
            &std::io::Error::from(error),
        )
    })?;
    let free = space
        .f_bavail
        .saturating_mul(space.f_frsize)
        .saturating_add(reclaimable);
    if needed > free {
        return Err(Error::Storage {
            kind: crate::format::error::StorageErrorKind::NoSpace,
            detail: format!(
                "a commit log of {slots} segments of {segment_bytes} bytes needs {needed} \
                 bytes; {} has {free} free",
                parent.display()
            ),
        });
    }
    Ok(())
}

impl CommitLog {
    /// Makes a new log in the new directory `dir`: `slots` segment files of `segment_bytes`
    /// each, zero-filled and synced (with the directory), the first segment started at
    /// `first_lsn`.
    pub(crate) fn create(
        dir: &Path,
        slots: usize,
        segment_bytes: u64,
        first_lsn: u64,
    ) -> Result<CommitLog> {
        if slots < LOG_SLOTS_MIN || segment_bytes < LOG_SEGMENT_BYTES_MIN {
            return Err(Error::invalid_argument(format!(
                "a commit log needs at least {LOG_SLOTS_MIN} segments of at least \
                 {LOG_SEGMENT_BYTES_MIN} bytes"
            )));
        }
        // Made under a temporary name and renamed into place once complete: a crash while it
        // is made leaves no log (the next open makes it again), never a partial one. What such
        // a crash left goes first, and its space with it.
        let target = dir;
        let building = building_path(target);
        if building.exists() {
            std::fs::remove_dir_all(&building)
                .map_err(|error| io_error("removing", &building, &error))?;
        }
        check_space(dir, slots, segment_bytes, 0)?;
        let dir = building.as_path();
        std::fs::create_dir(dir).map_err(|error| io_error("creating", dir, &error))?;
        let mut files = Vec::with_capacity(slots);
        for slot in 0..slots {
            files.push(make_segment_file(&slot_path(dir, slot), segment_bytes)?);
        }
        // The files' names (in the log's directory), and the directory's own name (in its
        // parent): a power cut forgets either until its directory is synced.
        crate::storage::directory::sync_directory(dir)
            .map_err(|error| io_error("syncing", dir, &error))?;
        std::fs::rename(dir, target).map_err(|error| io_error("renaming", dir, &error))?;
        if let Some(parent) = target
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
        {
            crate::storage::directory::sync_directory(parent)
                .map_err(|error| io_error("syncing", parent, &error))?;
        }
        let mut log = CommitLog {
            dir: Arc::from(target),
            segment_bytes,
            slots: files
                .into_iter()
                .map(|file| Slot {
                    file: Arc::new(file),
                    bytes: segment_bytes,
                    header: None,
                    end_lsn: first_lsn,
                })
                .collect(),
            active: 0,
            slots_max: slots,
            write_at: 0,
            next_lsn: first_lsn,
            next_segment: 0,
            released_before: first_lsn,
            pending: Vec::new(),
            direct: None,
            preparing: None,
        };
        log.start_segment(0);
        log.sync()?;
        Ok(log)
    }

    /// Opens the log in `dir` after a stop or a crash and hands `replay` every record from
    /// `from_lsn` on, in order: the records the caller's other storage does not hold. Every
    /// record before `from_lsn` counts as released. The next append follows the last whole
    /// record. Segments are read one at a time: memory holds one segment, whatever the log's
    /// size.
    ///
    /// # Errors
    /// [`Error::Storage`] if a file cannot be read; [`Error::InvalidArgument`] if no segment
    /// holds `from_lsn` while the log has segments (records the caller needs are gone), or if
    /// the segments differ in size; whatever `replay` returns (the log is not opened then).
    pub(crate) fn open(
        dir: &Path,
        from_lsn: u64,
        replay: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<(CommitLog, Recovered)> {
        let mut chain = Chain::read(dir, from_lsn, Access::Write, replay)?;
        forget_orphans(dir, &mut chain)?;
        // A slot a crash left half made: never named into the ring, it held no record.
        let growing = growing_path(dir, chain.slots.len());
        if growing.exists() {
            std::fs::remove_file(&growing)
                .map_err(|error| io_error("removing", &growing, &error))?;
        }
        let mut log = CommitLog {
            dir: Arc::from(dir),
            segment_bytes: chain.segment_bytes,
            slots_max: chain.slots.len(),
            slots: chain.slots,
            active: chain.active,
            write_at: chain.write_at,
            next_lsn: chain.next_lsn,
            next_segment: chain.next_segment,
            released_before: from_lsn,
            pending: Vec::new(),
            direct: None,
            preparing: None,
        };
        if log.slots[log.active].bytes > log.segment_bytes {
            // A slot enlarged for a large record takes nothing after it (`append`), across a
            // reopen too: the next record switches, and the slot can be cut back.
            log.write_at = log.slots[log.active].bytes;
        }
        if !chain.started {
            // No segment was ever started.
            log.start_segment(0);
        } else if log.next_lsn < from_lsn {
            // The log ends before records the caller already holds (an unsynced tail lost
            // while table files written from it survived): those are released, and the next
            // record starts a segment of its own where the caller's records end.
            log.next_lsn = from_lsn;
            // Every record before `from_lsn` is released: every other slot is free.
            let next = log.next_slot_for(0).unwrap_or(log.active);
            log.start_segment(next);
        }
        Ok((
            log,
            Recovered {
                recovered: chain.recovered,
                end: chain.end,
            },
        ))
    }

    /// Reads the log in `dir` beside its writer, which may be appending and reusing segments
    /// meanwhile: hands `read` every whole record from `from_lsn` on, in order, opening the
    /// files read-only and writing nothing. Returns the headers of the segments read, for
    /// [`CommitLog::unchanged_since`]: a segment the writer reused during the read may have cut
    /// the records short.
    ///
    /// # Errors
    /// As [`CommitLog::open`].
    pub(crate) fn read_beside_writer(
        dir: &Path,
        from_lsn: u64,
        read: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<Vec<(usize, LogSegmentHeader)>> {
        let chain = Chain::read(dir, from_lsn, Access::Read, read)?;
        Ok(chain.read_headers)
    }

    /// Whether every segment in `headers` (from [`CommitLog::read_beside_writer`]) still holds
    /// the same segment (and was not removed): if so, no record read from them was overwritten
    /// during the read.
    ///
    /// # Errors
    /// [`Error::Storage`] if a header cannot be read.
    pub(crate) fn unchanged_since(
        dir: &Path,
        headers: &[(usize, LogSegmentHeader)],
    ) -> Result<bool> {
        for (slot, header) in headers {
            let path = slot_path(dir, *slot);
            let file = match File::open(&path) {
                Ok(file) => file,
                // Given back by the owner's shrink (`CommitLog::shrink`) since.
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(false),
                Err(error) => return Err(io_error("opening", &path, &error)),
            };
            if read_segment_header(&file, &path)? != Some(*header) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The LSN the next append gets.
    pub(crate) fn next_lsn(&self) -> u64 {
        self.next_lsn
    }

    /// Starts a new segment in `slot` at the next LSN: its header is the slot's first write.
    fn start_segment(&mut self, slot: usize) {
        let header = LogSegmentHeader {
            segment: self.next_segment,
            first_lsn: self.next_lsn,
        };
        self.next_segment += 1;
        self.slots[slot].header = Some(header);
        self.slots[slot].end_lsn = self.next_lsn;
        self.pending.push((slot, 0, header.encode().to_vec()));
        self.active = slot;
        self.write_at = LOG_SEGMENT_HEADER_BYTES as u64;
    }

    /// Appends a record of `payload` (written by the next [`CommitLog::sync`]) and returns its
    /// LSN.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a payload larger than the whole log may hold (its most
    /// slots, each less its header);
    /// [`Error::Storage`] with kind `Retryable` when the ring has no free slot to switch to
    /// that holds the record (every other one holds records not yet released, or is too
    /// small: [`CommitLog::grow_for`]): nothing is appended.
    pub(crate) fn append(&mut self, payload: &[u8]) -> Result<u64> {
        let needed = (LOG_RECORD_HEADER_BYTES + payload.len()) as u64;
        let most = self.most_bytes();
        if payload.len() > LOG_RECORD_PAYLOAD_MAX || needed > most {
            return Err(Error::invalid_argument(format!(
                "a batch of {} bytes is a log record of {needed} bytes (with its \
                 {LOG_RECORD_HEADER_BYTES}-byte header), more than the whole commit log holds \
                 ({most} bytes in its most segments, after their headers); split the commit",
                payload.len()
            )));
        }
        if self.write_at + needed > self.slots[self.active].bytes {
            self.adopt_prepared();
            let Some(next) = self.next_slot_for(needed) else {
                return Err(Error::Storage {
                    kind: crate::format::error::StorageErrorKind::Retryable,
                    detail: "the commit log is full: no segment free for the record (every \
                             other one holds records not yet stored elsewhere)"
                        .to_owned(),
                });
            };
            self.start_segment(next);
            self.prepare_ahead();
        }
        let lsn = self.next_lsn;
        let mut bytes = Vec::with_capacity(needed as usize);
        encode_log_record(lsn, payload, &mut bytes);
        match self.pending.last_mut() {
            // Contiguous with the last pending write in the same slot: one write.
            Some((slot, at, pending))
                if *slot == self.active && *at + pending.len() as u64 == self.write_at =>
            {
                pending.extend_from_slice(&bytes);
            }
            _ => self.pending.push((self.active, self.write_at, bytes)),
        }
        self.write_at += needed;
        if self.slots[self.active].bytes > self.segment_bytes {
            // A slot enlarged for a large record takes nothing after it: the next record
            // switches, and the slot is cut back once the tables hold this one (`trim`).
            self.write_at = self.slots[self.active].bytes;
        }
        self.next_lsn += 1;
        self.slots[self.active].end_lsn = self.next_lsn;
        Ok(lsn)
    }

    /// Writes every pending record and syncs the files written (`fdatasync`): every record
    /// appended so far is durable when this returns.
    ///
    /// # Errors
    /// [`Error::Storage`] if a write or a sync fails: what was appended since the last sync is
    /// then of unknown durability.
    pub(crate) fn sync(&mut self) -> Result<()> {
        let writes = self.take_writes()?;
        perform_writes(&writes, true)
    }

    /// The pending writes, taken: [`perform_writes`] writes them without the log borrowed, so
    /// that the next group's records can be appended meanwhile. Direct writes are whole blocks:
    /// the block where the log ended is rewritten with the bytes it held, and the last block is
    /// filled out with zeros (past the log's end, where a reader stops anyway).
    ///
    /// # Errors
    /// [`Error::Storage`] if the bytes before a write in its first block must be read back and
    /// cannot be (not on the engine's path: each write starts where the last one ended).
    pub(crate) fn take_writes(&mut self) -> Result<PendingWrites> {
        let mut writes = PendingWrites::with_capacity(self.pending.len());
        // Drained, not taken: the list keeps its room for the next group's records (taken, it
        // was freed and made again for each commit: 250 instructions).
        let mut pending = std::mem::take(&mut self.pending);
        for (slot, at, bytes) in pending.drain(..) {
            let file = self.slots[slot].file.clone();
            let Some(direct) = &mut self.direct else {
                writes.push(PendingWrite {
                    file,
                    direct: None,
                    dir: self.dir.clone(),
                    slot,
                    at,
                    bytes: Written::Plain(bytes),
                });
                continue;
            };
            let first = block_below(at);
            let end = at + bytes.len() as u64;
            let last = block_above(end);
            let mut blocks = Aligned::zeroed((last - first) as usize);
            let before = (at - first) as usize;
            if before > 0 {
                let buffer = &mut blocks.bytes_mut()[..before];
                if direct.tail_slot == slot
                    && direct.tail_at == first
                    && direct.tail.len() == before
                {
                    buffer.copy_from_slice(&direct.tail);
                } else {
                    file.read_exact_at(buffer, first).map_err(|error| {
                        io_error("reading", &slot_path(&self.dir, slot), &error)
                    })?;
                }
            }
            blocks.bytes_mut()[before..before + bytes.len()].copy_from_slice(&bytes);
            let tail_at = block_below(end);
            direct.tail_slot = slot;
            direct.tail_at = tail_at;
            direct.tail.clear();
            direct.tail.extend_from_slice(
                &blocks.bytes()[(tail_at - first) as usize..(end - first) as usize],
            );
            writes.push(PendingWrite {
                file,
                direct: Some(direct.files[slot].clone()),
                dir: self.dir.clone(),
                slot,
                at: first,
                bytes: Written::Blocks(blocks),
            });
        }
        self.pending = pending;
        Ok(writes)
    }

    /// Makes later synced writes direct ([`perform_writes`]) if the file system takes them:
    /// whether it does. Writes what is pending first. Not for segments whose size is not a
    /// multiple of 4 KiB (their last block is short): those keep `fdatasync`.
    ///
    /// # Errors
    /// [`Error::Storage`] if the pending writes, or the block where the log ends, cannot be
    /// written.
    pub(crate) fn write_direct(&mut self) -> Result<bool> {
        if self.direct.is_some() {
            return Ok(true);
        }
        let blocks = |bytes: u64| bytes.is_multiple_of(DIRECT_BLOCK as u64);
        if !self.slots.iter().all(|held| blocks(held.bytes)) {
            return Ok(false);
        }
        self.sync()?;
        let mut files = Vec::with_capacity(self.slots.len());
        for slot in 0..self.slots.len() {
            let path = slot_path(&self.dir, slot);
            let flags = rustix::fs::OFlags::DIRECT | rustix::fs::OFlags::DSYNC;
            match OpenOptions::new()
                .write(true)
                .custom_flags(flags.bits().cast_signed())
                .open(&path)
            {
                Ok(file) => files.push(Arc::new(file)),
                Err(error) if refuses_direct(&error) => return Ok(false),
                Err(error) => return Err(io_error("opening", &path, &error)),
            }
        }
        // The block where the log ends, read and written back as it is: the file system may
        // open for direct I/O and still refuse these writes.
        let (slot, end) = (self.active, self.write_at);
        let path = slot_path(&self.dir, slot);
        // A closed slot (one enlarged for a large record) ends at its size: its last block.
        let tail_at = if end >= self.slots[slot].bytes {
            block_below(end - 1)
        } else {
            block_below(end)
        };
        let mut block = Aligned::zeroed(DIRECT_BLOCK);
        self.slots[slot]
            .file
            .read_exact_at(block.bytes_mut(), tail_at)
            .map_err(|error| io_error("reading", &path, &error))?;
        match files[slot].write_all_at(block.bytes(), tail_at) {
            Ok(()) => {}
            Err(error) if refuses_direct(&error) => return Ok(false),
            Err(error) => return Err(io_error("writing", &path, &error)),
        }
        self.direct = Some(Direct {
            files,
            tail_slot: slot,
            tail_at,
            tail: block.bytes()[..(end - tail_at) as usize].to_vec(),
        });
        Ok(true)
    }

    /// Syncs every segment file: what was written without a sync becomes durable.
    pub(crate) fn sync_files(&self) -> Result<()> {
        for (slot, segment) in self.slots.iter().enumerate() {
            segment
                .file
                .sync_data()
                .map_err(|error| io_error("syncing", &slot_path(&self.dir, slot), &error))?;
        }
        Ok(())
    }

    /// Every record before `lsn` is stored elsewhere (flushed to table files): the segments
    /// holding only such records may be written over.
    pub(crate) fn release_through(&mut self, lsn: u64) {
        self.released_before = self.released_before.max(lsn);
    }
}

/// Wipes the header of every segment newer than the last one the log's records reach (an
/// orphan), so that no later read takes it for the log's continuation.
///
/// How an orphan comes to be: a writer switches into a new segment and writes its header and
/// records there while the previous segment's last records are not yet durable; a power cut
/// then keeps the new segment's header (a disk may persist a later write and not an earlier
/// one) and loses those records. The log now ends before the orphan's first LSN, the next
/// writer appends from there, under the same LSNs, and its next segment gets a number above the
/// orphan's. A reader ordering segments by number meets the orphan first, finds it does not
/// continue the log, and stopped there: every record of the next writer's later segments was
/// lost (found by the crash harness's small ring, a Buffered child's torn last write). The
/// wipe is synced before anything is appended: the next writer's segments must never sit
/// behind an orphan that a later open still sees.
fn forget_orphans(dir: &Path, chain: &mut Chain) -> Result<()> {
    let Some(&(_, last)) = chain.read_headers.last() else {
        return Ok(());
    };
    for (slot, held) in chain.slots.iter_mut().enumerate() {
        if held
            .header
            .is_some_and(|header| header.segment > last.segment)
        {
            let path = slot_path(dir, slot);
            held.file
                .write_all_at(&[0u8; LOG_SEGMENT_HEADER_BYTES], 0)
                .and_then(|()| held.file.sync_data())
                .map_err(|error| io_error("wiping an orphan segment in", &path, &error))?;
            held.header = None;
            held.end_lsn = 0;
        }
    }
    Ok(())
}

/// Tests' reopening: the records replayed, collected, and why the log ends.
#[cfg(test)]
struct Collected {
    records: Vec<(u64, Vec<u8>)>,
    end: LogEnd,
}

#[cfg(test)]
fn open_collecting(dir: &Path, from_lsn: u64) -> Result<(CommitLog, Collected)> {
    let mut records = Vec::new();
    let (log, recovered) = CommitLog::open(dir, from_lsn, |lsn, payload| {
        records.push((lsn, payload.to_vec()));
        Ok(())
    })?;
    assert_eq!(recovered.recovered, records.len() as u64);
    Ok((
        log,
        Collected {
            records,
            end: recovered.end,
        },
    ))
}
