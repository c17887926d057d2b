//! Reports over a whole store: counts by table, consumer and state (`stats`), and a check
//! of every value (`verify`).

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;

use bytes::Bytes;
use rocksdb::IteratorMode;

use crate::format::error::DecodeError;
use crate::format::error::{Error, Result};
use crate::format::key::decode_key;
use crate::format::record::decode_entity_version;
use crate::storage::store_meta::VERSIONS_TABLE;

use super::open::Store;
use super::scan::{EntryState, Filter};

/// The most problems a [`VerifyReport`] lists; it counts all of them.
pub const VERIFY_PROBLEMS_MAX: usize = 10_000;

/// Entries counted by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateCounts {
    /// Completed and not expired.
    pub live: u64,
    /// Expired, not yet removed by compaction (they already read as absent).
    pub expired: u64,
    /// In progress, whatever their lease.
    pub in_progress: u64,
    /// Released (they read as absent).
    pub released: u64,
    /// Undecodable.
    pub corrupt: u64,
}

impl StateCounts {
    /// All entries counted.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.live + self.expired + self.in_progress + self.released + self.corrupt
    }

    /// The count of one state.
    #[must_use]
    pub fn get(&self, state: EntryState) -> u64 {
        match state {
            EntryState::Live => self.live,
            EntryState::Expired => self.expired,
            EntryState::InProgress => self.in_progress,
            EntryState::Released => self.released,
            EntryState::Corrupt => self.corrupt,
        }
    }

    pub(super) fn count(&mut self, state: EntryState) {
        let counter = match state {
            EntryState::Live => &mut self.live,
            EntryState::Expired => &mut self.expired,
            EntryState::InProgress => &mut self.in_progress,
            EntryState::Released => &mut self.released,
            EntryState::Corrupt => &mut self.corrupt,
        };
        *counter += 1;
    }

    pub(super) fn add(&mut self, other: &StateCounts) {
        self.live += other.live;
        self.expired += other.expired;
        self.in_progress += other.in_progress;
        self.released += other.released;
        self.corrupt += other.corrupt;
    }
}

/// The records of one consumer (or of one entity table) by state.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupStats {
    /// The marker table.
    pub table: String,
    /// The consumer, in the consumers' table; `None` for an entity table, and for the
    /// consumers' table keys that do not decode (counted as corrupt).
    pub consumer: Option<Bytes>,
    /// Records by state.
    pub counts: StateCounts,
    /// The earliest [`super::Entry::since_ms`] of the group's decodable records.
    pub oldest_ms: Option<u64>,
}

/// What [`Store::stats`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// The clock reading the states were decided at.
    pub now_ms: u64,
    /// The size of the files in the store's directory, in bytes.
    pub disk_bytes: u64,
    /// The number of those files.
    pub disk_files: u64,
    /// The space of the file system holding the store; `None` where it cannot be read.
    pub space: Option<FileSystemSpace>,
    /// One group per consumer and per entity table holding records, in table and key order.
    pub groups: Vec<GroupStats>,
}

impl StoreStats {
    /// The counts of every group together.
    #[must_use]
    pub fn totals(&self) -> StateCounts {
        let mut totals = StateCounts::default();
        for group in &self.groups {
            totals.add(&group.counts);
        }
        totals
    }
}

/// The size and free space of the file system holding a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileSystemSpace {
    /// Its size, in bytes.
    pub total_bytes: u64,
    /// The bytes still free for unprivileged writers (what `df` shows as available).
    pub available_bytes: u64,
}

impl FileSystemSpace {
    /// Below this many free bytes the store counts as full: a memtable flush writes a table
    /// file of up to the write buffer's size (1 MiB at the smallest), so commits, flushes and
    /// compactions can fail with [`crate::StorageErrorKind::NoSpace`].
    pub const FULL_BELOW_BYTES: u64 = 1 << 20;

    /// Reads the file system holding `path`.
    ///
    /// # Errors
    /// [`Error::Storage`] when the file system cannot be asked (the path does not exist, say).
    pub fn of(path: &Path) -> Result<FileSystemSpace> {
        let stat = rustix::fs::statvfs(path).map_err(|error| {
            Error::io(
                &format!("reading the free space of {}", path.display()),
                &std::io::Error::from(error),
            )
        })?;
        Ok(FileSystemSpace {
            total_bytes: stat.f_blocks.saturating_mul(stat.f_frsize),
            available_bytes: stat.f_bavail.saturating_mul(stat.f_frsize),
        })
    }

    /// Whether the file system is full, or so nearly that the engine's next flush may fail.
    #[must_use]
    pub fn is_full(&self) -> bool {
        self.available_bytes < Self::FULL_BELOW_BYTES
    }
}

/// An entry that failed verification.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// The table holding it.
    pub table: String,
    /// Its stored key.
    pub stored_key: Bytes,
    /// Why it does not decode.
    pub reason: DecodeError,
}

/// What [`Store::verify`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Entries read: every marker table's and the ordering guard's versions.
    pub checked: u64,
    /// Entries that do not decode.
    pub problems_total: u64,
    /// The first [`VERIFY_PROBLEMS_MAX`] of them.
    pub problems: Vec<Problem>,
}

impl Store {
    /// Counts every marker table's records per consumer (per entity table) and state, and the
    /// files of the store's directory. Reads every record.
    ///
    /// # Errors
    /// [`Error::Storage`] if the scan fails; I/O errors reading the directory as
    /// [`Error::Storage`] too.
    pub fn stats(&self) -> Result<StoreStats> {
        let now_ms = self.now_ms();
        let order: Vec<&str> = self
            .marker_tables()
            .map(|table| table.name.as_str())
            .collect();
        let mut groups: BTreeMap<(usize, Option<Bytes>), (StateCounts, Option<u64>)> =
            BTreeMap::new();
        self.scan(&Filter::new(), None, |entry| {
            let table_index = order
                .iter()
                .position(|name| *name == entry.table)
                .unwrap_or(order.len());
            let group = groups
                .entry((table_index, entry.consumer.clone()))
                .or_default();
            group.0.count(entry.state_at(now_ms));
            if let Some(since_ms) = entry.since_ms() {
                group.1 = Some(group.1.map_or(since_ms, |oldest| oldest.min(since_ms)));
            }
            ControlFlow::Continue(())
        })?;
        let (disk_bytes, disk_files) = crate::storage::directory::directory_size(&self.path)?;
        Ok(StoreStats {
            now_ms,
            disk_bytes,
            disk_files,
            space: FileSystemSpace::of(&self.path).ok(),
            groups: groups
                .into_iter()
                .map(
                    |((table_index, consumer), (counts, oldest_ms))| GroupStats {
                        table: order
                            .get(table_index)
                            .copied()
                            .unwrap_or_default()
                            .to_owned(),
                        consumer,
                        counts,
                        oldest_ms,
                    },
                )
                .collect(),
        })
    }

    /// The marker tables' records by state.
    pub(super) fn marker_counts(&self) -> Result<StateCounts> {
        let now_ms = self.now_ms();
        let mut counts = StateCounts::default();
        self.scan(&Filter::new(), None, |entry| {
            counts.count(entry.state_at(now_ms));
            ControlFlow::Continue(())
        })?;
        Ok(counts)
    }

    /// Reads every record of every marker table and every version of the ordering guard, and
    /// reports those that do not decode. RocksDB checks block checksums as it reads; damage it
    /// detects fails the scan with [`Error::Storage`] (`Corruption`).
    ///
    /// # Errors
    /// [`Error::Storage`] if the scan fails.
    pub fn verify(&self) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let problem = |report: &mut VerifyReport, table: &str, key: &[u8], reason: DecodeError| {
            report.problems_total += 1;
            if report.problems.len() < VERIFY_PROBLEMS_MAX {
                report.problems.push(Problem {
                    table: table.to_owned(),
                    stored_key: Bytes::copy_from_slice(key),
                    reason,
                });
            }
        };
        self.scan(&Filter::new(), None, |entry| {
            report.checked += 1;
            if let Err(reason) = &entry.record {
                problem(&mut report, &entry.table, &entry.stored_key, reason.clone());
            }
            ControlFlow::Continue(())
        })?;
        let versions = self.cf(VERSIONS_TABLE)?;
        for item in self.db().iterator_cf(versions, IteratorMode::Start) {
            let (key, value) = item?;
            report.checked += 1;
            if let Err(reason) = decode_key(&key) {
                problem(&mut report, VERSIONS_TABLE, &key, reason);
            } else if let Err(reason) = decode_entity_version(&value) {
                problem(&mut report, VERSIONS_TABLE, &key, reason);
            }
        }
        Ok(report)
    }
}
