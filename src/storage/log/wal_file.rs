//! RocksDB's formats we write ourselves: a write batch's header (read to join batches into one,
//! [`join`]) and the WAL file, written for one reader: an operator
//! tool's read-only open beside an application on the commit log. The table files do not
//! hold the commits the log holds after the tables' LSN, and a read-only RocksDB cannot be
//! written to; but it replays the WAL files it finds into its memtables. So the reader writes those log records, in LSN order, as
//! a WAL file of a private WAL directory, and RocksDB's own recovery applies them (merge
//! operands included) exactly as the application's replay does.
//!
//! The format (RocksDB's `db/log_format.h`, unchanged since LevelDB for what is used here):
//! 32 KiB blocks of physical records, each a 7-byte header (a masked CRC32C of the type byte
//! and the payload, u32 LE; the payload's length, u16 LE; the type) and the payload. A record
//! that does not fit in a block's rest is cut into FIRST, MIDDLE and LAST fragments; a block
//! rest shorter than a header is zero-filled. Each payload is a write batch whose first 8 bytes
//! are its sequence number (little-endian) and the next 4 its count of entries: recovery
//! wants the batches' sequence numbers increasing, each one past the previous batch's entries.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use rocksdb::WriteBatch;

use crate::format::error::{Error, Result};

const BLOCK_BYTES: usize = 32 << 10;
const HEADER_BYTES: usize = 7;
const FULL: u8 = 1;
const FIRST: u8 = 2;
const MIDDLE: u8 = 3;
const LAST: u8 = 4;
/// RocksDB stores a CRC rotated and offset by this (`crc32c::Mask`): the CRC of a string
/// holding CRCs is then not trivially related to them.
const MASK_DELTA: u32 = 0xa282_ead8;
/// A write batch's header (`WriteBatch::data`, RocksDB's `WriteBatch::rep_`): its sequence
/// number (8 bytes, little-endian) and its count of entries (4 bytes, little-endian).
pub(crate) const BATCH_HEADER_BYTES: usize = 12;

/// The count of entries in the write batch `rep`, or `None` if it is shorter than its header.
pub(crate) fn batch_count(rep: &[u8]) -> Option<u32> {
    rep.get(8..BATCH_HEADER_BYTES)
        .map(|count| u32::from_le_bytes(count.try_into().expect("4 bytes")))
}

/// One write batch holding every record of `batches`, in order: RocksDB applies it atomically,
/// as it would each of them.
pub(crate) fn join(batches: impl IntoIterator<Item = WriteBatch>) -> WriteBatch {
    let mut batches: smallvec::SmallVec<[WriteBatch; 1]> = batches.into_iter().collect();
    if batches.len() == 1 {
        return batches.pop().unwrap_or_default();
    }
    let batches = batches.iter();
    let records: usize = batches.clone().map(|batch| batch.len()).sum();
    let bytes: usize = batches
        .clone()
        .map(|batch| batch.data().len() - BATCH_HEADER_BYTES)
        .sum();
    let mut rep = Vec::with_capacity(BATCH_HEADER_BYTES + bytes);
    // The sequence number is assigned by the write.
    rep.extend_from_slice(&0u64.to_le_bytes());
    // The async committer's group stops taking jobs at GROUP_CLAIMS_MAX claims, and one job
    // (a batch) holds at most BATCH_MESSAGES_MAX claims of at most STAGED_WRITES_MAX + 2
    // records each: about 335 million records, well inside a u32. The commit log's groups are
    // of blocked writers, one batch each.
    let count = u32::try_from(records).expect("a group's record count fits RocksDB's u32");
    rep.extend_from_slice(&count.to_le_bytes());
    for batch in batches {
        rep.extend_from_slice(&batch.data()[BATCH_HEADER_BYTES..]);
    }
    WriteBatch::from_data(&rep)
}

fn masked_crc(kind: u8, payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c_append(crc32c::crc32c(&[kind]), payload);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// The path of WAL file `number` in `dir`, named as RocksDB names it.
pub(crate) fn wal_file_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:06}.log"))
}

/// Writes a WAL file of write batches.
pub(crate) struct WalFileWriter {
    out: BufWriter<File>,
    path: PathBuf,
    /// Where in its block the next record starts.
    block_offset: usize,
    next_sequence: u64,
}

impl WalFileWriter {
    /// Creates the file at `path` (which must not exist); the first batch gets sequence number
    /// `first_sequence`.
    pub(crate) fn create(path: &Path, first_sequence: u64) -> Result<WalFileWriter> {
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|error| Error::io(&format!("creating {}", path.display()), &error))?;
        Ok(WalFileWriter {
            out: BufWriter::with_capacity(1 << 20, file),
            path: path.to_path_buf(),
            block_offset: 0,
            next_sequence: first_sequence,
        })
    }

    /// Appends the write batch `rep` (RocksDB's bytes of a batch) with the next sequence
    /// number.
    pub(crate) fn append_batch(&mut self, rep: &[u8]) -> Result<()> {
        let Some(count) = batch_count(rep) else {
            return Err(Error::invalid_argument(
                "a write batch shorter than its header",
            ));
        };
        let mut batch = rep.to_vec();
        batch[..8].copy_from_slice(&self.next_sequence.to_le_bytes());
        self.next_sequence += u64::from(count.max(1));
        self.write_record(&batch)
    }

    fn write_record(&mut self, payload: &[u8]) -> Result<()> {
        let mut rest = payload;
        let mut first = true;
        loop {
            let block_rest = BLOCK_BYTES - self.block_offset;
            if block_rest < HEADER_BYTES {
                self.write(&[0u8; HEADER_BYTES][..block_rest])?;
                self.block_offset = 0;
            }
            let room = BLOCK_BYTES - self.block_offset - HEADER_BYTES;
            let length = rest.len().min(room);
            let last = length == rest.len();
            let kind = match (first, last) {
                (true, true) => FULL,
                (true, false) => FIRST,
                (false, true) => LAST,
                (false, false) => MIDDLE,
            };
            let (fragment, after) = rest.split_at(length);
            let mut header = [0u8; HEADER_BYTES];
            header[..4].copy_from_slice(&masked_crc(kind, fragment).to_le_bytes());
            // A fragment fits in a block, so in 16 bits.
            header[4..6].copy_from_slice(&(length as u16).to_le_bytes());
            header[6] = kind;
            self.write(&header)?;
            self.write(fragment)?;
            self.block_offset += HEADER_BYTES + length;
            rest = after;
            first = false;
            if last {
                return Ok(());
            }
        }
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|error| Error::io(&format!("writing {}", self.path.display()), &error))
    }

    /// Writes out what is buffered. The file is for a reader on this machine now: not synced.
    pub(crate) fn finish(mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(|error| Error::io(&format!("writing {}", self.path.display()), &error))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RocksDB itself reads what the writer wrote: batches of every size (fragments across
    /// blocks, block rests too short for a header) come back whole, in order, with their
    /// sequence numbers.
    #[test]
    fn rocksdb_replays_the_written_batches() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let wal_dir = dir.path().join("wal");
        std::fs::create_dir(&wal_dir).unwrap();
        {
            let mut options = rocksdb::Options::default();
            options.create_if_missing(true);
            let db = rocksdb::DB::open(&options, &store).unwrap();
            db.put(b"before", b"1").unwrap();
            db.flush().unwrap();
        }
        let mut writer = WalFileWriter::create(&wal_file_path(&wal_dir, 1 << 40), 1 << 40).unwrap();
        // Sizes around a block and its header, so that records end 0..7 bytes short of a
        // block's end and some span three blocks.
        let sizes: Vec<usize> = (0..60)
            .map(|i| [10, 32_700, 32_750, 32_761, 32_768, 70_000][i % 6] + i)
            .collect();
        for (i, size) in sizes.iter().enumerate() {
            let mut batch = rocksdb::WriteBatch::default();
            batch.put(format!("k{i:03}"), vec![i as u8; *size]);
            writer.append_batch(batch.data()).unwrap();
        }
        writer.finish().unwrap();
        let mut options = rocksdb::Options::default();
        options.set_wal_dir(&wal_dir);
        let db = rocksdb::DB::open_for_read_only(&options, &store, false).unwrap();
        assert_eq!(db.get(b"before").unwrap().as_deref(), Some(&b"1"[..]));
        for (i, size) in sizes.iter().enumerate() {
            let value = db.get(format!("k{i:03}")).unwrap().unwrap();
            assert_eq!(value, vec![i as u8; *size], "batch {i}");
        }
        assert_eq!(db.latest_sequence_number(), (1 << 40) + 59);
    }
}
