//! Reading a log's segments from an LSN at open: which slot holds which segment, the records
//! handed to the replay, and where the log ends and the next append goes.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use super::{Slot, io_error, slot_path};
use crate::format::commit_log::{
    LOG_RECORD_HEADER_BYTES, LOG_SEGMENT_BYTES_MIN, LOG_SEGMENT_HEADER_BYTES, LogEnd,
    LogSegmentHeader, read_log_records,
};
use crate::format::error::{Error, Result};

/// The header at the start of the segment file `file` (at `path`), `None` where there is none
/// (never written, or a file shorter than a header).
pub(super) fn read_segment_header(file: &File, path: &Path) -> Result<Option<LogSegmentHeader>> {
    let mut head = [0u8; LOG_SEGMENT_HEADER_BYTES];
    match file.read_exact_at(&mut head, 0) {
        Ok(()) => Ok(LogSegmentHeader::decode(&head)),
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(error) => Err(io_error("reading", path, &error)),
    }
}

/// How [`Chain::read`] opens the segment files.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    /// For the log's owner, which appends next.
    Write,
    /// For a reader beside the owner: read-only.
    Read,
}

/// What reading a log from an LSN found: its slots, where its records end, and where the next
/// append would go.
pub(super) struct Chain {
    /// The ring's segment size: its smallest slot's (a slot made for a larger record is
    /// larger).
    pub(super) segment_bytes: u64,
    pub(super) slots: Vec<Slot>,
    /// Whether any segment was ever started.
    pub(super) started: bool,
    pub(super) active: usize,
    pub(super) write_at: u64,
    pub(super) next_lsn: u64,
    pub(super) next_segment: u64,
    pub(super) recovered: u64,
    pub(super) end: LogEnd,
    /// The slots read and the header each held when read.
    pub(super) read_headers: Vec<(usize, LogSegmentHeader)>,
}

impl Chain {
    /// Opens `dir`'s segments and hands `replay` every record from `from_lsn` on: from the
    /// last segment starting at or before `from_lsn`, onward through segments that continue
    /// exactly where the previous one ended. One segment in memory at a time.
    pub(super) fn read(
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
            if length < LOG_SEGMENT_BYTES_MIN {
                return Err(Error::invalid_argument(format!(
                    "{} is {length} bytes, less than a commit-log segment",
                    path.display()
                )));
            }
            segment_bytes = Some(segment_bytes.map_or(length, |bytes: u64| bytes.min(length)));
            let header = read_segment_header(&file, &path)?;
            slots.push(Slot {
                file: Arc::new(file),
                bytes: length,
                header,
                end_lsn: header.map_or(0, |header| header.first_lsn),
            });
        }
        #[cfg(test)]
        super::AFTER_HEADERS_READ.with(|hook| {
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
