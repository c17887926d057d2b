//! The commit log: segments made once, full size, and rewritten in place as a ring, so that a
//! durable append is a `pwrite` over written blocks and an `fdatasync` that writes data only
//! (a growing file makes every sync also journal its new size). A draft of the durable path of
//! docs/design.md's "commit log" notes: the engine does not write through it yet.
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

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::format::commit_log::{
    LOG_RECORD_HEADER_BYTES, LOG_RECORD_PAYLOAD_MAX, LOG_SEGMENT_HEADER_BYTES, LogEnd,
    LogSegmentHeader, encode_log_record, read_log_records,
};
use crate::format::error::{Error, Result};

/// The fewest slots of a ring: one being written, one to switch to.
pub(crate) const LOG_SLOTS_MIN: usize = 2;
/// The smallest segment: a header and a few records.
pub(crate) const LOG_SEGMENT_BYTES_MIN: u64 = 64 << 10;

/// One slot of the ring.
struct Slot {
    file: File,
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
}

/// What reopening found: the records from the LSN asked for on, in order.
pub(crate) struct Recovered {
    pub(crate) records: Vec<(u64, Vec<u8>)>,
    /// Why the log ends where it does (evidence for tests; every kind is a normal end).
    pub(crate) end: LogEnd,
}

fn io_error(doing: &str, path: &Path, error: &std::io::Error) -> Error {
    Error::io(&format!("{doing} {}", path.display()), error)
}

fn slot_path(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("segment-{slot}"))
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
        crate::storage::store_meta::sync_directory(dir)
            .map_err(|error| io_error("syncing", dir, &error))?;
        let mut log = CommitLog {
            dir: dir.to_path_buf(),
            segment_bytes,
            slots: files
                .into_iter()
                .map(|file| Slot {
                    file,
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
        };
        log.start_segment(0);
        log.sync()?;
        Ok(log)
    }

    /// Opens the log in `dir` after a stop or a crash, and returns with it every record from
    /// `from_lsn` on: the records the caller's other storage does not hold. Every record before
    /// `from_lsn` counts as released. The next append follows the last whole record.
    ///
    /// # Errors
    /// [`Error::Corrupt`]-free by design: a log that ends early ends there. [`Error::Storage`]
    /// if a file cannot be read; [`Error::InvalidArgument`] if no segment holds `from_lsn` (or
    /// the LSN before it) while the log has segments: records the caller needs are gone.
    pub(crate) fn open(dir: &Path, from_lsn: u64) -> Result<(CommitLog, Recovered)> {
        let mut slots = Vec::new();
        let mut bodies = Vec::new();
        let mut segment_bytes = None;
        for slot in 0.. {
            let path = slot_path(dir, slot);
            let mut file = match OpenOptions::new().read(true).write(true).open(&path) {
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
            let mut bytes = Vec::with_capacity(length as usize);
            file.seek(SeekFrom::Start(0))
                .and_then(|_| file.read_to_end(&mut bytes))
                .map_err(|error| io_error("reading", &path, &error))?;
            let header = LogSegmentHeader::decode(&bytes);
            slots.push(Slot {
                file,
                header,
                end_lsn: header.map_or(0, |header| header.first_lsn),
            });
            bodies.push(bytes);
        }
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
        // The chain to read: from the last segment starting at or before `from_lsn`, onward
        // through segments that continue exactly where the previous one ended.
        let start = order
            .iter()
            .rposition(|&s| slots[s].header.is_some_and(|h| h.first_lsn <= from_lsn));
        let mut records = Vec::new();
        let mut end = LogEnd::Unwritten;
        let (mut active, mut write_at, mut next_lsn) = (0, 0, from_lsn);
        if let Some(start) = start {
            let mut expected = None;
            for &slot in &order[start..] {
                let header = slots[slot].header.expect("ordered slots have headers");
                if expected.is_some_and(|expected| header.first_lsn != expected) {
                    break;
                }
                let body = &bodies[slot][LOG_SEGMENT_HEADER_BYTES..];
                let (found, why) = read_log_records(body, header.first_lsn);
                let used: usize = found
                    .iter()
                    .map(|(_, p)| LOG_RECORD_HEADER_BYTES + p.len())
                    .sum();
                let after = header.first_lsn + found.len() as u64;
                slots[slot].end_lsn = after;
                records.extend(
                    found
                        .into_iter()
                        .filter(|(lsn, _)| *lsn >= from_lsn)
                        .map(|(lsn, payload)| (lsn, payload.to_vec())),
                );
                active = slot;
                write_at = (LOG_SEGMENT_HEADER_BYTES + used) as u64;
                next_lsn = after;
                end = why;
                expected = Some(after);
            }
            if next_lsn < from_lsn {
                return Err(Error::invalid_argument(format!(
                    "the commit log in {} ends at LSN {next_lsn}, before LSN {from_lsn}",
                    dir.display()
                )));
            }
        } else if !order.is_empty() {
            return Err(Error::invalid_argument(format!(
                "no segment of the commit log in {} holds LSN {from_lsn}",
                dir.display()
            )));
        }
        let mut log = CommitLog {
            dir: dir.to_path_buf(),
            segment_bytes,
            slots,
            active,
            write_at,
            next_lsn,
            next_segment,
            released_before: from_lsn,
            pending: Vec::new(),
        };
        if start.is_none() {
            // No segment was ever started (a crash while the log was being made).
            log.start_segment(0);
        }
        Ok((log, Recovered { records, end }))
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
                "a batch of {} bytes is larger than a commit-log segment holds ({capacity})",
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
        let mut written = Vec::new();
        for (slot, at, bytes) in self.pending.drain(..) {
            let path = slot_path(&self.dir, slot);
            self.slots[slot]
                .file
                .write_all_at(&bytes, at)
                .map_err(|error| io_error("writing", &path, &error))?;
            if !written.contains(&slot) {
                written.push(slot);
            }
        }
        for slot in written {
            let path = slot_path(&self.dir, slot);
            self.slots[slot]
                .file
                .sync_data()
                .map_err(|error| io_error("syncing", &path, &error))?;
        }
        Ok(())
    }

    /// Every record before `lsn` is stored elsewhere (flushed to table files): the segments
    /// holding only such records may be written over.
    pub(crate) fn release_through(&mut self, lsn: u64) {
        self.released_before = self.released_before.max(lsn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEGMENT: u64 = LOG_SEGMENT_BYTES_MIN;

    fn payload(lsn: u64, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|i| (lsn as usize + i) as u8).collect()
    }

    #[test]
    fn records_come_back_from_any_lsn_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = CommitLog::create(&path, 4, SEGMENT, 100).unwrap();
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
            let (log, recovered) = CommitLog::open(&path, from).unwrap();
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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = CommitLog::create(&path, 2, SEGMENT, 1).unwrap();
        log.append(b"synced").unwrap();
        log.sync().unwrap();
        log.append(b"never written").unwrap();
        drop(log); // pending, never written
        let (_, recovered) = CommitLog::open(&path, 1).unwrap();
        assert_eq!(recovered.records, vec![(1, b"synced".to_vec())]);
        assert_eq!(recovered.end, LogEnd::Unwritten);
    }

    #[test]
    fn the_ring_reuses_released_segments_and_never_reads_an_old_lap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = CommitLog::create(&path, 2, SEGMENT, 0).unwrap();
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
        // ones, with older LSNs.
        let lap_start = lsn;
        for _ in 0..3 {
            lsn = log.append(&payload(lsn, 7_000)).unwrap() + 1;
        }
        log.sync().unwrap();
        drop(log);
        let (log, recovered) = CommitLog::open(&path, lap_start).unwrap();
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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = CommitLog::create(&path, 2, SEGMENT, 1).unwrap();
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
        let (mut log, recovered) = CommitLog::open(&path, 1).unwrap();
        assert_eq!(recovered.records.len(), 2);
        assert_eq!(recovered.end, LogEnd::Torn);
        assert_eq!(log.append(b"three").unwrap(), 3);
        log.sync().unwrap();
        drop(log);
        let (_, recovered) = CommitLog::open(&path, 1).unwrap();
        assert_eq!(recovered.records.last().unwrap(), &(3, b"three".to_vec()));
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
        // Records before the log's first are gone; past its end, nothing is missing.
        assert!(CommitLog::open(&path, 10).is_err());
        assert!(CommitLog::open(&path, 52).is_err());
        assert!(CommitLog::open(&dir.path().join("none"), 0).is_err());
    }
}
