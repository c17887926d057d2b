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
//! of its first record.
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
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::format::commit_log::{
    LOG_RECORD_HEADER_BYTES, LOG_RECORD_PAYLOAD_MAX, LOG_SEGMENT_HEADER_BYTES, LogEnd,
    LogSegmentHeader, encode_log_record, read_log_records,
};
use crate::format::error::{Error, Result};

#[cfg(test)]
thread_local! {
    /// Tests' seam: runs in a read of the log between the segment headers' read and the
    /// records' (where a writer beside the reader may reuse a segment).
    pub(crate) static AFTER_HEADERS_READ: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
        const { std::cell::RefCell::new(None) };
}

/// The fewest slots of a ring: one being written, one to switch to.
pub(crate) const LOG_SLOTS_MIN: usize = 2;
/// The smallest segment: a header and a few records.
pub(crate) const LOG_SEGMENT_BYTES_MIN: u64 = 64 << 10;
/// The block of direct writes: their offset, length and memory are multiples of it. 4 KiB
/// covers the logical block of every common disk (512 B or 4 KiB).
const DIRECT_BLOCK: usize = 4096;

/// One slot of the ring.
struct Slot {
    file: Arc<File>,
    /// The segment the slot holds, if any has been started in it.
    header: Option<LogSegmentHeader>,
    /// The LSN after the slot's last record (its first LSN while it is empty).
    end_lsn: u64,
}

/// The open commit log.
pub(crate) struct CommitLog {
    dir: PathBuf,
    segment_bytes: u64,
    slots: Vec<Slot>,
    /// The slot being written.
    active: usize,
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
}

/// The log's direct writes: a descriptor per slot opened with `O_DIRECT | O_DSYNC`, and the
/// bytes of the block where the log ends, which the next write rewrites.
struct Direct {
    files: Vec<Arc<File>>,
    /// The slot and offset of the block holding the log's end, and its bytes up to the end.
    tail_slot: usize,
    tail_at: u64,
    tail: Vec<u8>,
}

/// Bytes at an address aligned to [`DIRECT_BLOCK`], as direct writes need them (the vector is
/// longer by a block, and the bytes start where its address is aligned).
struct Aligned {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        let raw = vec![0u8; len + DIRECT_BLOCK];
        let start = (DIRECT_BLOCK - raw.as_ptr().addr() % DIRECT_BLOCK) % DIRECT_BLOCK;
        Aligned { raw, start, len }
    }

    fn bytes(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// Whether `error` is a file system's refusal of direct I/O (tmpfs before Linux 6.6, some FUSE
/// ones), at the open or at the first write.
fn refuses_direct(error: &std::io::Error) -> bool {
    error.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error())
}

fn block_below(at: u64) -> u64 {
    at - at % DIRECT_BLOCK as u64
}

fn block_above(at: u64) -> u64 {
    block_below(at + DIRECT_BLOCK as u64 - 1)
}

/// A write the log has taken out to be made ([`perform_writes`]).
pub(crate) struct PendingWrite {
    file: Arc<File>,
    /// The slot's `O_DIRECT | O_DSYNC` descriptor, for a write of whole aligned blocks.
    direct: Option<Arc<File>>,
    path: PathBuf,
    at: u64,
    bytes: Written,
}

/// A write's bytes.
enum Written {
    Plain(Vec<u8>),
    Blocks(Aligned),
}

impl PendingWrite {
    fn bytes(&self) -> &[u8] {
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
            .map_err(|error| io_error("writing", &write.path, &error))?;
    }
    if sync {
        let mut synced: Vec<&Path> = Vec::new();
        for write in writes {
            if write.direct.is_some() || synced.contains(&write.path.as_path()) {
                continue;
            }
            write
                .file
                .sync_data()
                .map_err(|error| io_error("syncing", &write.path, &error))?;
            synced.push(&write.path);
        }
    }
    Ok(())
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

/// The header at the start of the segment file `file` (at `path`), `None` where there is none
/// (never written, or a file shorter than a header).
fn read_segment_header(file: &File, path: &Path) -> Result<Option<LogSegmentHeader>> {
    let mut head = [0u8; LOG_SEGMENT_HEADER_BYTES];
    match file.read_exact_at(&mut head, 0) {
        Ok(()) => Ok(LogSegmentHeader::decode(&head)),
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(error) => Err(io_error("reading", path, &error)),
    }
}

/// How [`Chain::read`] opens the segment files.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    /// For the log's owner, which appends next.
    Write,
    /// For a reader beside the owner: read-only.
    Read,
}

/// What reading a log from an LSN found: its slots, where its records end, and where the next
/// append would go.
struct Chain {
    segment_bytes: u64,
    slots: Vec<Slot>,
    /// Whether any segment was ever started.
    started: bool,
    active: usize,
    write_at: u64,
    next_lsn: u64,
    next_segment: u64,
    recovered: u64,
    end: LogEnd,
    /// The slots read and the header each held when read.
    read_headers: Vec<(usize, LogSegmentHeader)>,
}

impl Chain {
    /// Opens `dir`'s segments and hands `replay` every record from `from_lsn` on: from the
    /// last segment starting at or before `from_lsn`, onward through segments that continue
    /// exactly where the previous one ended. One segment in memory at a time.
    fn read(
        dir: &Path,
        from_lsn: u64,
        access: Access,
        mut replay: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<Chain> {
        let mut slots = Vec::new();
        let mut segment_bytes = None;
        for slot in 0.. {
            let path = slot_path(dir, slot);
            let opened = OpenOptions::new()
                .read(true)
                .write(access == Access::Write)
                .open(&path);
            let mut file = match opened {
                Ok(file) => file,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => break,
                Err(error) => return Err(io_error("opening", &path, &error)),
            };
            let length = file
                .seek(SeekFrom::End(0))
                .map_err(|error| io_error("reading", &path, &error))?;
            if *segment_bytes.get_or_insert(length) != length {
                return Err(Error::invalid_argument(format!(
                    "{} is {length} bytes, unlike the log's other segments",
                    path.display()
                )));
            }
            let header = read_segment_header(&file, &path)?;
            slots.push(Slot {
                file: Arc::new(file),
                header,
                end_lsn: header.map_or(0, |header| header.first_lsn),
            });
        }
        #[cfg(test)]
        AFTER_HEADERS_READ.with(|hook| {
            if let Some(hook) = hook.borrow_mut().as_mut() {
                hook();
            }
        });
        let segment_bytes = segment_bytes.ok_or_else(|| {
            Error::invalid_argument(format!("no commit log in {}", dir.display()))
        })?;
        // The segments in the order they were started.
        let mut order: Vec<usize> = (0..slots.len())
            .filter(|&s| slots[s].header.is_some())
            .collect();
        order.sort_by_key(|&s| slots[s].header.map(|h| h.segment));
        let next_segment = order
            .last()
            .and_then(|&s| slots[s].header)
            .map_or(0, |header| header.segment + 1);
        let start = order
            .iter()
            .rposition(|&s| slots[s].header.is_some_and(|h| h.first_lsn <= from_lsn));
        let mut chain = Chain {
            segment_bytes,
            slots: Vec::new(),
            started: start.is_some(),
            active: 0,
            write_at: 0,
            next_lsn: from_lsn,
            next_segment,
            recovered: 0,
            end: LogEnd::Unwritten,
            read_headers: Vec::new(),
        };
        if let Some(start) = start {
            let mut expected = None;
            let mut body = Vec::new();
            for &slot in &order[start..] {
                let header = slots[slot].header.expect("ordered slots have headers");
                if expected.is_some_and(|expected| header.first_lsn != expected) {
                    break;
                }
                let path = slot_path(dir, slot);
                body.clear();
                let mut file: &File = &slots[slot].file;
                file.seek(SeekFrom::Start(LOG_SEGMENT_HEADER_BYTES as u64))
                    .and_then(|_| file.read_to_end(&mut body))
                    .map_err(|error| io_error("reading", &path, &error))?;
                chain.read_headers.push((slot, header));
                let (found, why) = read_log_records(&body, header.first_lsn);
                let mut used = 0;
                for (lsn, payload) in &found {
                    used += LOG_RECORD_HEADER_BYTES + payload.len();
                    if *lsn >= from_lsn {
                        replay(*lsn, payload)?;
                        chain.recovered += 1;
                    }
                }
                let after = header.first_lsn + found.len() as u64;
                slots[slot].end_lsn = after;
                chain.active = slot;
                chain.write_at = (LOG_SEGMENT_HEADER_BYTES + used) as u64;
                chain.next_lsn = after;
                chain.end = why;
                expected = Some(after);
            }
        } else if !order.is_empty() {
            return Err(Error::invalid_argument(format!(
                "no segment of the commit log in {} holds LSN {from_lsn}",
                dir.display()
            )));
        }
        chain.slots = slots;
        Ok(chain)
    }
}

/// Refuses a log of `slots` segments of `segment_bytes` to be made as `dir` when its file
/// system has less free space than that ([`StorageErrorKind::NoSpace`]): every byte of a new
/// log is written, so a log larger than the free space would fill the disk before failing.
/// The store's open runs this before it writes anything, [`CommitLog::create`] again.
///
/// [`StorageErrorKind::NoSpace`]: crate::format::error::StorageErrorKind::NoSpace
pub(crate) fn check_space(dir: &Path, slots: usize, segment_bytes: u64) -> Result<()> {
    let needed = (slots as u64).saturating_mul(segment_bytes);
    let parent = dir
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let space = rustix::fs::statvfs(parent).map_err(|error| {
        io_error(
            "reading the free space of",
            parent,
            &std::io::Error::from(error),
        )
    })?;
    let free = space.f_bavail.saturating_mul(space.f_frsize);
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
        check_space(dir, slots, segment_bytes)?;
        // Made under a temporary name and renamed into place once complete: a crash while it
        // is made leaves no log (the next open makes it again), never a partial one.
        let target = dir;
        let building = building_path(target);
        if building.exists() {
            std::fs::remove_dir_all(&building)
                .map_err(|error| io_error("removing", &building, &error))?;
        }
        let dir = building.as_path();
        std::fs::create_dir(dir).map_err(|error| io_error("creating", dir, &error))?;
        let zeros = vec![0u8; 1 << 20];
        let mut files = Vec::with_capacity(slots);
        for slot in 0..slots {
            let path = slot_path(dir, slot);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|error| io_error("creating", &path, &error))?;
            // Written, not only allocated: a later write over these blocks changes neither the
            // size nor the allocation, so its sync has no metadata to journal.
            let mut at = 0;
            while at < segment_bytes {
                let chunk = (segment_bytes - at).min(zeros.len() as u64) as usize;
                file.write_all_at(&zeros[..chunk], at)
                    .map_err(|error| io_error("filling", &path, &error))?;
                at += chunk as u64;
            }
            file.sync_all()
                .map_err(|error| io_error("syncing", &path, &error))?;
            files.push(file);
        }
        // The files' names (in the log's directory), and the directory's own name (in its
        // parent): a power cut forgets either until its directory is synced.
        crate::storage::store_meta::sync_directory(dir)
            .map_err(|error| io_error("syncing", dir, &error))?;
        std::fs::rename(dir, target).map_err(|error| io_error("renaming", dir, &error))?;
        if let Some(parent) = target
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
        {
            crate::storage::store_meta::sync_directory(parent)
                .map_err(|error| io_error("syncing", parent, &error))?;
        }
        let mut log = CommitLog {
            dir: target.to_path_buf(),
            segment_bytes,
            slots: files
                .into_iter()
                .map(|file| Slot {
                    file: Arc::new(file),
                    header: None,
                    end_lsn: first_lsn,
                })
                .collect(),
            active: 0,
            write_at: 0,
            next_lsn: first_lsn,
            next_segment: 0,
            released_before: first_lsn,
            pending: Vec::new(),
            direct: None,
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
        let chain = Chain::read(dir, from_lsn, Access::Write, replay)?;
        let mut log = CommitLog {
            dir: dir.to_path_buf(),
            segment_bytes: chain.segment_bytes,
            slots: chain.slots,
            active: chain.active,
            write_at: chain.write_at,
            next_lsn: chain.next_lsn,
            next_segment: chain.next_segment,
            released_before: from_lsn,
            pending: Vec::new(),
            direct: None,
        };
        if !chain.started {
            // No segment was ever started.
            log.start_segment(0);
        } else if log.next_lsn < from_lsn {
            // The log ends before records the caller already holds (an unsynced tail lost
            // while table files written from it survived): those are released, and the next
            // record starts a segment of its own where the caller's records end.
            log.next_lsn = from_lsn;
            let next = (log.active + 1) % log.slots.len();
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
    /// the same segment: if so, no record read from them was overwritten during the read.
    ///
    /// # Errors
    /// [`Error::Storage`] if a header cannot be read.
    pub(crate) fn unchanged_since(
        dir: &Path,
        headers: &[(usize, LogSegmentHeader)],
    ) -> Result<bool> {
        for (slot, header) in headers {
            let path = slot_path(dir, *slot);
            let file = File::open(&path).map_err(|error| io_error("opening", &path, &error))?;
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
    /// [`Error::InvalidArgument`] for a payload larger than a segment holds;
    /// [`Error::Storage`] with kind `Retryable` when the ring has no segment to switch to
    /// (every other one holds records not yet released): nothing is appended.
    pub(crate) fn append(&mut self, payload: &[u8]) -> Result<u64> {
        let needed = (LOG_RECORD_HEADER_BYTES + payload.len()) as u64;
        let capacity = self.segment_bytes - LOG_SEGMENT_HEADER_BYTES as u64;
        if payload.len() > LOG_RECORD_PAYLOAD_MAX || needed > capacity {
            return Err(Error::invalid_argument(format!(
                "a batch of {} bytes is a log record of {needed} bytes (with its \
                 {LOG_RECORD_HEADER_BYTES}-byte header), more than a commit-log segment holds \
                 ({capacity} bytes after its own header); split the commit",
                payload.len()
            )));
        }
        if self.write_at + needed > self.segment_bytes {
            let next = (self.active + 1) % self.slots.len();
            if self.slots[next].header.is_some() && self.slots[next].end_lsn > self.released_before
            {
                return Err(Error::Storage {
                    kind: crate::format::error::StorageErrorKind::Retryable,
                    detail: "the commit log is full: its oldest segment holds records not yet \
                             stored elsewhere"
                        .to_owned(),
                });
            }
            self.start_segment(next);
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
    pub(crate) fn take_writes(&mut self) -> Result<Vec<PendingWrite>> {
        let mut writes = Vec::with_capacity(self.pending.len());
        for (slot, at, bytes) in std::mem::take(&mut self.pending) {
            let path = slot_path(&self.dir, slot);
            let file = self.slots[slot].file.clone();
            let Some(direct) = &mut self.direct else {
                writes.push(PendingWrite {
                    file,
                    direct: None,
                    path,
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
                    file.read_exact_at(buffer, first)
                        .map_err(|error| io_error("reading", &path, &error))?;
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
                path,
                at: first,
                bytes: Written::Blocks(blocks),
            });
        }
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
        if !self.segment_bytes.is_multiple_of(DIRECT_BLOCK as u64) {
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
        let tail_at = block_below(end);
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

#[cfg(test)]
mod tests {
    use super::*;

    const SEGMENT: u64 = LOG_SEGMENT_BYTES_MIN;

    /// A new log whose synced writes are direct or not: the tests below run both ways.
    fn create(path: &Path, slots: usize, first_lsn: u64, direct: bool) -> CommitLog {
        let mut log = CommitLog::create(path, slots, SEGMENT, first_lsn).unwrap();
        if direct {
            assert!(
                log.write_direct().unwrap(),
                "the test directory's file system takes direct writes"
            );
        }
        log
    }

    /// Reopens for appending, direct or not.
    fn reopen(path: &Path, from_lsn: u64, direct: bool) -> (CommitLog, Collected) {
        let (mut log, collected) = open_collecting(path, from_lsn).unwrap();
        if direct {
            assert!(log.write_direct().unwrap());
        }
        (log, collected)
    }

    fn payload(lsn: u64, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|i| (lsn as usize + i) as u8).collect()
    }

    /// A segment whose size is not a multiple of the direct block keeps `fdatasync`: its last
    /// block is short, and a direct write of it would grow the file.
    #[test]
    fn segments_of_an_odd_size_keep_fdatasync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let odd = SEGMENT + 512;
        let mut log = CommitLog::create(&path, 2, odd, 1).unwrap();
        assert!(!log.write_direct().unwrap());
        assert!(log.direct.is_none());
        let mut lsn = 1;
        while log.active == 0 {
            lsn = log.append(&payload(lsn, 3_000)).unwrap() + 1;
            log.sync().unwrap();
        }
        drop(log);
        let (_, recovered) = open_collecting(&path, 1).unwrap();
        assert_eq!(recovered.records.len() as u64, lsn - 1);
        for slot in 0..2 {
            let length = std::fs::metadata(slot_path(&path, slot)).unwrap().len();
            assert_eq!(length, odd, "the segment files keep their size");
        }
    }

    #[test]
    fn records_come_back_from_any_lsn_across_segments() {
        records_come_back_from_any_lsn_across_segments_with(false);
        records_come_back_from_any_lsn_across_segments_with(true);
    }

    fn records_come_back_from_any_lsn_across_segments_with(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = create(&path, 4, 100, direct);
        // About 10 KiB each: six or so per segment, three segments.
        for lsn in 100..118 {
            assert_eq!(log.append(&payload(lsn, 10_000)).unwrap(), lsn);
            if lsn % 5 == 0 {
                log.sync().unwrap();
            }
        }
        log.sync().unwrap();
        drop(log);
        for from in [100, 107, 117, 118] {
            let (log, recovered) = open_collecting(&path, from).unwrap();
            let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
            assert_eq!(lsns, (from..118).collect::<Vec<_>>());
            for (lsn, bytes) in &recovered.records {
                assert_eq!(bytes, &payload(*lsn, 10_000));
            }
            assert_eq!(log.next_lsn(), 118);
        }
    }

    #[test]
    fn unsynced_records_are_not_recovered_but_synced_ones_are() {
        unsynced_records_are_not_recovered_but_synced_ones_are_with(false);
        unsynced_records_are_not_recovered_but_synced_ones_are_with(true);
    }

    fn unsynced_records_are_not_recovered_but_synced_ones_are_with(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = create(&path, 2, 1, direct);
        log.append(b"synced").unwrap();
        log.sync().unwrap();
        log.append(b"never written").unwrap();
        drop(log); // pending, never written
        let (_, recovered) = open_collecting(&path, 1).unwrap();
        assert_eq!(recovered.records, vec![(1, b"synced".to_vec())]);
        assert_eq!(recovered.end, LogEnd::Unwritten);
    }

    #[test]
    fn the_ring_reuses_released_segments_and_never_reads_an_old_lap() {
        the_ring_reuses_released_segments_and_never_reads_an_old_lap_with(false);
        the_ring_reuses_released_segments_and_never_reads_an_old_lap_with(true);
    }

    fn the_ring_reuses_released_segments_and_never_reads_an_old_lap_with(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = create(&path, 2, 0, direct);
        let mut lsn = 0;
        // Fill the first segment and start the second.
        while log.active == 0 {
            lsn = log.append(&payload(lsn, 5_000)).unwrap() + 1;
            log.sync().unwrap();
        }
        // Filling the second needs the first back: refused until released.
        let refused = loop {
            match log.append(&payload(lsn, 5_000)) {
                Ok(written) => lsn = written + 1,
                Err(error) => break error,
            }
        };
        assert!(refused.is_retryable(), "{refused:?}");
        log.sync().unwrap();
        log.release_through(lsn);
        // The first slot is written over by a new lap: its old records stay behind the new
        // ones, with older LSNs. The new lap ends on a block's end, so that direct writes,
        // which fill the rest of their last block with zeros, leave old bytes after it too.
        let lap_start = lsn;
        let lap_end = 6 * DIRECT_BLOCK;
        let last = lap_end - LOG_SEGMENT_HEADER_BYTES - 3 * LOG_RECORD_HEADER_BYTES - 2 * 7_000;
        for bytes in [7_000, 7_000, last] {
            lsn = log.append(&payload(lsn, bytes)).unwrap() + 1;
        }
        assert_eq!(log.write_at, lap_end as u64);
        log.sync().unwrap();
        drop(log);
        let (log, recovered) = open_collecting(&path, lap_start).unwrap();
        let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
        assert_eq!(lsns, (lap_start..lsn).collect::<Vec<_>>());
        assert!(
            matches!(
                recovered.end,
                LogEnd::OtherLsn { .. } | LogEnd::Torn | LogEnd::Garbage
            ),
            "the old lap's bytes follow: {:?}",
            recovered.end
        );
        assert_eq!(log.next_lsn(), lsn);
    }

    #[test]
    fn a_torn_tail_ends_the_log_and_the_next_append_writes_over_it() {
        a_torn_tail_ends_the_log_and_the_next_append_writes_over_it_with(false);
        a_torn_tail_ends_the_log_and_the_next_append_writes_over_it_with(true);
    }

    fn a_torn_tail_ends_the_log_and_the_next_append_writes_over_it_with(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = create(&path, 2, 1, direct);
        log.append(b"one").unwrap();
        log.append(b"two").unwrap();
        log.sync().unwrap();
        let tail_at = log.write_at;
        drop(log);
        // A write cut short: part of a third record's header.
        let file = OpenOptions::new()
            .write(true)
            .open(slot_path(&path, 0))
            .unwrap();
        let mut torn = Vec::new();
        encode_log_record(3, b"three, torn", &mut torn);
        file.write_all_at(&torn[..30], tail_at).unwrap();
        drop(file);
        let (mut log, recovered) = reopen(&path, 1, direct);
        assert_eq!(recovered.records.len(), 2);
        assert_eq!(recovered.end, LogEnd::Torn);
        assert_eq!(log.append(b"three").unwrap(), 3);
        log.sync().unwrap();
        drop(log);
        let (_, recovered) = open_collecting(&path, 1).unwrap();
        assert_eq!(recovered.records.last().unwrap(), &(3, b"three".to_vec()));
    }

    /// Reopening a full 1 GiB log: the time to find and read every record (the engine's
    /// replay adds the memtable writes). Writes 2 GiB (the zero fill and the records), so it
    /// runs by hand: `cargo test --release --lib one_gib -- --ignored --nocapture` (the store's
    /// disk: set TMPDIR to a directory on it).
    #[test]
    #[ignore = "writes 2 GiB; run by hand (see the doc comment)"]
    #[allow(clippy::print_stdout)] // the figure is the point
    fn reopening_a_one_gib_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let segment = 128 << 20;
        let made = std::time::Instant::now();
        let mut log = CommitLog::create(&path, 8, segment, 1).unwrap();
        let made = made.elapsed();
        // Batches of about 64 claims' writes.
        let payload = vec![0xa5u8; 16 << 10];
        let written = std::time::Instant::now();
        let mut bytes = 0u64;
        while bytes + (payload.len() + LOG_RECORD_HEADER_BYTES) as u64 * 2
            < 8 * (segment - LOG_SEGMENT_HEADER_BYTES as u64)
        {
            log.append(&payload).unwrap();
            bytes += (payload.len() + LOG_RECORD_HEADER_BYTES) as u64;
            if log.next_lsn().is_multiple_of(64) {
                log.sync().unwrap();
            }
        }
        log.sync().unwrap();
        let written = written.elapsed();
        let records = log.next_lsn() - 1;
        drop(log);
        // Cold: the page cache dropped, as after a reboot (needs root; skipped otherwise).
        let cold = std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
        let reopened = std::time::Instant::now();
        let mut replayed = 0u64;
        let (_, recovered) = CommitLog::open(&path, 1, |_, payload| {
            replayed += payload.len() as u64;
            Ok(())
        })
        .unwrap();
        let reopened = reopened.elapsed();
        assert_eq!(recovered.recovered, records);
        println!(
            "1 GiB commit log: made in {made:.2?}, {records} records ({} MiB) written in \
             {written:.2?}, reopened and replayed in {reopened:.2?} ({:.0} MiB/s{})",
            bytes >> 20,
            replayed as f64 / f64::from(1 << 20) / reopened.as_secs_f64(),
            if cold { ", cold cache" } else { ", warm cache" }
        );
    }

    #[test]
    fn bad_shapes_and_missing_records_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        assert!(CommitLog::create(&dir.path().join("a"), 1, SEGMENT, 0).is_err());
        assert!(CommitLog::create(&dir.path().join("b"), 2, 1024, 0).is_err());
        let path = dir.path().join("log");
        let mut log = CommitLog::create(&path, 2, SEGMENT, 50).unwrap();
        assert!(matches!(
            log.append(&vec![0; SEGMENT as usize]),
            Err(Error::InvalidArgument { .. })
        ));
        log.append(b"x").unwrap();
        log.sync().unwrap();
        drop(log);
        // Records before the log's first are gone.
        assert!(open_collecting(&path, 10).is_err());
        // Past its end (table files written from an unsynced tail survived it): the log goes
        // on from there, in a segment of its own.
        let (mut log, collected) = open_collecting(&path, 60).unwrap();
        assert!(collected.records.is_empty());
        assert_eq!(log.append(b"y").unwrap(), 60);
        log.sync().unwrap();
        drop(log);
        let (_, collected) = open_collecting(&path, 60).unwrap();
        assert_eq!(collected.records, vec![(60, b"y".to_vec())]);
        assert!(open_collecting(&dir.path().join("none"), 0).is_err());
    }
}

/// The log under power cuts: a FUSE file system that keeps only what was synced
/// (`powercut/`), cut at random writes, sometimes tearing the last one, over many cycles of
/// appends, syncs, segment switches and reuses. Skipped where FUSE cannot be mounted.
#[cfg(test)]
mod power_cut_tests {
    use std::collections::HashMap;

    use idemdb_powercut::{Event, PowerCut};

    use super::*;

    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % n
        }
    }

    /// What the cycles counted.
    #[derive(Debug, Default)]
    struct Tally {
        cuts: u32,
        torn_ends: u32,
        stale_lap_ends: u32,
        switches: u32,
        reuses: u32,
        recovered: u64,
    }

    #[test]
    fn every_synced_record_survives_power_cuts_at_any_write() {
        every_synced_record_survives_power_cuts_at_any_write_with(false);
        every_synced_record_survives_power_cuts_at_any_write_with(true);
    }

    #[allow(clippy::print_stdout)] // the tally, or why it was skipped
    fn every_synced_record_survives_power_cuts_at_any_write_with(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let (backing, mnt) = (dir.path().join("disk"), dir.path().join("mnt"));
        std::fs::create_dir(&backing).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        // The FUSE mount needs root (or fusermount3) and the kernel's fuse module.
        match PowerCut::mount(&backing, &mnt) {
            Ok(fs) => drop(fs.unmount()),
            Err(error) => {
                println!("commit log power cuts skipped: cannot mount FUSE here ({error})");
                return;
            }
        }
        let mut rng = Rng(0x1de3_5eed);
        let mut appended: HashMap<u64, Vec<u8>> = HashMap::new();
        // Stored elsewhere (as table files would hold them): records before this LSN.
        let mut stored_before = 1u64;
        // Every record up to here was synced (acknowledged) before its cut, or recovered since.
        let mut synced_through = 0u64;
        let mut created = false;
        let mut tally = Tally::default();
        for cycle in 0..80 {
            let fs = PowerCut::mount(&backing, &mnt).unwrap();
            let path = fs.path().join("log");
            // Cut at a random write of this cycle (some cycles, inside the log's creation).
            fs.arm(Event::Write(String::new()), rng.below(60) as u32);
            let opened = if created {
                open_collecting(&path, stored_before).map(Some)
            } else {
                match CommitLog::create(&path, 3, LOG_SEGMENT_BYTES_MIN, 1) {
                    Ok(log) => {
                        created = true;
                        Ok(Some((
                            log,
                            Collected {
                                records: Vec::new(),
                                end: LogEnd::Unwritten,
                            },
                        )))
                    }
                    // Cut while being made: the next cycle makes it again from nothing.
                    Err(_) => Ok(None),
                }
            };
            let Some((mut log, recovered)) = opened
                .unwrap_or_else(|error| panic!("cycle {cycle}: the log does not reopen: {error}"))
            else {
                drop(fs.power_off(None));
                let _ = std::fs::remove_dir_all(backing.join("log"));
                continue;
            };
            // Every acknowledged record is back, in order, each exactly as appended.
            let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
            let expected: Vec<u64> = (stored_before..stored_before + lsns.len() as u64).collect();
            assert_eq!(
                lsns, expected,
                "cycle {cycle}: contiguous from {stored_before}"
            );
            let through = stored_before + lsns.len() as u64;
            assert!(
                through > synced_through,
                "cycle {cycle}: synced through {synced_through}, recovered up to {}",
                through - 1
            );
            for (lsn, payload) in &recovered.records {
                assert_eq!(
                    appended.get(lsn),
                    Some(payload),
                    "cycle {cycle}: LSN {lsn} is not what was appended"
                );
            }
            match recovered.end {
                LogEnd::Torn => tally.torn_ends += 1,
                LogEnd::OtherLsn { .. } => tally.stale_lap_ends += 1,
                _ => {}
            }
            tally.recovered += lsns.len() as u64;
            // What came back is the log now (a torn write may keep a whole unsynced record).
            synced_through = through - 1;
            if direct {
                match log.write_direct() {
                    Ok(true) => {}
                    Ok(false) => panic!("the power-cut file system refuses direct writes"),
                    // Cut while the log's last block was written back.
                    Err(_) => {
                        tally.cuts += 1;
                        drop(log);
                        fs.power_off(None).unwrap();
                        continue;
                    }
                }
            }
            // Appends until the power goes.
            loop {
                // Sizes at random, then one size for every record: a lap of the ring then
                // lays its records exactly over the previous lap's, so a stale record, whole
                // and with a good checksum, follows the last new one.
                let bytes = if cycle < 40 {
                    100 + rng.below(9_000) as usize
                } else {
                    3_000
                };
                let lsn = log.next_lsn();
                let payload: Vec<u8> = (0..bytes).map(|i| (lsn as usize * 31 + i) as u8).collect();
                let before = log.active;
                match log.append(&payload) {
                    Ok(written) => {
                        assert_eq!(written, lsn);
                        appended.insert(lsn, payload);
                        if log.active != before {
                            tally.switches += 1;
                            if log.slots[log.active].header.is_some_and(|h| h.segment >= 3) {
                                tally.reuses += 1;
                            }
                        }
                    }
                    Err(error) if error.is_retryable() => {
                        // The ring is full: "flush" what is synced, as the engine would.
                        stored_before = synced_through + 1;
                        log.release_through(stored_before);
                        continue;
                    }
                    Err(error) => panic!("cycle {cycle}: {error}"),
                }
                if rng.below(3) == 0 {
                    continue;
                }
                match log.sync() {
                    Ok(()) => synced_through = log.next_lsn() - 1,
                    Err(_) => break,
                }
                if fs.is_cut() {
                    break;
                }
            }
            tally.cuts += 1;
            drop(log);
            let tear = (rng.below(2) == 0).then(|| rng.below(1 << 20));
            fs.power_off(tear).unwrap();
        }
        println!("commit log power cuts (direct writes: {direct}): {tally:?}");
        assert!(tally.cuts >= 60, "{tally:?}");
        assert!(
            tally.switches > 0 && tally.reuses > 0,
            "the ring went round: {tally:?}"
        );
        assert!(tally.torn_ends > 0, "some cuts tore a record: {tally:?}");
        // Direct writes fill their last block out with zeros, so the old lap's records follow
        // the new ones only after a block boundary: the plain run checks that they are refused.
        assert!(
            direct || tally.stale_lap_ends > 0,
            "some ends were a stale lap's record: {tally:?}"
        );
    }
}
