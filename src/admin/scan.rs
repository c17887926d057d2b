//! Reading records: one key, or a filtered scan of the marker tables in pages with a cursor.

use std::fmt;
use std::ops::ControlFlow;
use std::time::Duration;

use bytes::Bytes;
use rocksdb::{Direction, IteratorMode};

use crate::format::error::DecodeError;
use crate::format::error::{Error, Result};
use crate::format::key::{check_message_key, consumer_prefix, decode_key, encode_with_prefix};
use crate::format::record::{Record, RecordState, Standing};
use crate::storage::store_meta::RECORDS_TABLE;

use super::open::{Store, TableInfo, TableKind};

/// What a stored record means at a given instant (its [`RecordState`] plus the clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum EntryState {
    /// Completed (or a recorded failure) and not expired: redeliveries are duplicates.
    Live,
    /// Completed but expired: reads treat it as absent; compaction removes it later.
    Expired,
    /// Held by an external claim (live lease or not).
    InProgress,
    /// Released: reads treat it as absent; kept so the key's epoch keeps increasing.
    Released,
    /// The value (or, in the consumers' table, the key) does not decode.
    Corrupt,
}

impl EntryState {
    /// Every state, in display order.
    pub const ALL: [EntryState; 5] = [
        EntryState::Live,
        EntryState::Expired,
        EntryState::InProgress,
        EntryState::Released,
        EntryState::Corrupt,
    ];

    /// A lowercase name for display: `live`, `expired`, `in-progress`, `released`, `corrupt`.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            EntryState::Live => "live",
            EntryState::Expired => "expired",
            EntryState::InProgress => "in-progress",
            EntryState::Released => "released",
            EntryState::Corrupt => "corrupt",
        }
    }
}

impl fmt::Display for EntryState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One stored record, as a tool sees it: where it is, and what it decodes to.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Entry {
    /// The marker table holding it.
    pub table: String,
    /// The consumer id, for a record of the consumers' table whose key decodes.
    pub consumer: Option<Bytes>,
    /// The message key (consumers' table) or entity key; the whole stored key if it does not
    /// decode.
    pub key: Bytes,
    /// The key as stored.
    pub stored_key: Bytes,
    /// The record, or why the value (or the consumers' table key) does not decode.
    pub record: std::result::Result<Record, DecodeError>,
}

impl Entry {
    pub(super) fn decode(table: &str, kind: TableKind, stored_key: &[u8], value: &[u8]) -> Entry {
        let split = match kind {
            TableKind::Consumers => {
                decode_key(stored_key).map(|(consumer, key)| (Some(consumer), key))
            }
            _ => Ok((None, stored_key)),
        };
        let (consumer, key, record) = match split {
            Ok((consumer, key)) => (consumer, key, Record::decode(value)),
            Err(reason) => (None, stored_key, Err(reason)),
        };
        Entry {
            table: table.to_owned(),
            consumer: consumer.map(Bytes::copy_from_slice),
            key: Bytes::copy_from_slice(key),
            stored_key: Bytes::copy_from_slice(stored_key),
            record,
        }
    }

    /// What the record means at `now_ms`.
    #[must_use]
    pub fn state_at(&self, now_ms: u64) -> EntryState {
        self.record.as_ref().map_or(EntryState::Corrupt, |record| {
            record_state_at(record, now_ms)
        })
    }

    /// When the record entered its state: committed (completed), taken (in progress) or
    /// released; `None` when it does not decode.
    #[must_use]
    pub fn since_ms(&self) -> Option<u64> {
        self.record.as_ref().ok().map(|record| match &record.state {
            RecordState::Completed {
                committed_at_ms, ..
            } => *committed_at_ms,
            RecordState::InProgress { since_ms, .. } => *since_ms,
            RecordState::Released { released_at_ms, .. } => *released_at_ms,
        })
    }

    /// The position just after this entry, for [`Store::list`]'s next page.
    #[must_use]
    pub fn cursor(&self) -> Cursor {
        Cursor {
            table: self.table.clone(),
            stored_key: self.stored_key.to_vec(),
        }
    }
}

/// What a decoded record means at `now_ms`.
pub(super) fn record_state_at(record: &Record, now_ms: u64) -> EntryState {
    match record.standing_at(now_ms) {
        Standing::Live => EntryState::Live,
        Standing::Expired => EntryState::Expired,
        Standing::InProgress => EntryState::InProgress,
        Standing::Released => EntryState::Released,
    }
}

/// Which record a key names: a consumer's message key, or an entity table's key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A message key of this consumer (in `idemdb.records`).
    Consumer(Vec<u8>),
    /// A key of this entity table.
    Entity(String),
}

/// Which entries [`Store::list`] and [`Store::scan`] return. Every condition given must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Filter {
    pub(super) table: Option<String>,
    pub(super) consumer: Option<Vec<u8>>,
    pub(super) state: Option<EntryState>,
    pub(super) older_than: Option<Duration>,
}

impl Filter {
    /// Every entry of every marker table.
    pub fn new() -> Filter {
        Filter::default()
    }

    /// Only this marker table.
    pub fn table(mut self, name: impl Into<String>) -> Filter {
        self.table = Some(name.into());
        self
    }

    /// Only this consumer's records (in the consumers' table).
    pub fn consumer(mut self, consumer_id: impl Into<Vec<u8>>) -> Filter {
        self.consumer = Some(consumer_id.into());
        self
    }

    /// Only entries in this state.
    pub fn state(mut self, state: EntryState) -> Filter {
        self.state = Some(state);
        self
    }

    /// Only records that entered their state at least `age` ago ([`Entry::since_ms`]); corrupt
    /// entries have no age and are left out.
    pub fn older_than(mut self, age: Duration) -> Filter {
        self.older_than = Some(age);
        self
    }

    pub(super) fn matches(&self, entry: &Entry, now_ms: u64) -> bool {
        if self
            .state
            .is_some_and(|state| entry.state_at(now_ms) != state)
        {
            return false;
        }
        match self.older_than {
            None => true,
            Some(age) => {
                let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
                entry
                    .since_ms()
                    .is_some_and(|since_ms| now_ms.saturating_sub(since_ms) >= age_ms)
            }
        }
    }
}

/// A position in a listing: the entry after which the next page starts. Its text form,
/// `<table>:<stored key in hex>`, is what the CLI prints and takes back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub(super) table: String,
    pub(super) stored_key: Vec<u8>,
}

impl Cursor {
    /// Parses the text form made by `Display`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for anything else.
    pub fn parse(text: &str) -> Result<Cursor> {
        let bad = || Error::invalid_argument(format!("{text:?} is not a cursor (<table>:<hex>)"));
        let (table, digits) = text.rsplit_once(':').ok_or_else(bad)?;
        if table.is_empty() {
            return Err(bad());
        }
        Ok(Cursor {
            table: table.to_owned(),
            stored_key: hex::decode(digits).map_err(|_| bad())?,
        })
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.table, hex::encode(&self.stored_key))
    }
}

/// One page of [`Store::list`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// The entries, in table order (the consumers' table first, then entity tables by name)
    /// and key order.
    pub entries: Vec<Entry>,
    /// Where the next page starts, if more entries match.
    pub next: Option<Cursor>,
}

impl Store {
    /// The table and stored key of `key` under `target`.
    pub(super) fn locate(&self, target: &Target, key: &[u8]) -> Result<(String, Vec<u8>)> {
        match target {
            Target::Consumer(consumer) => Ok((
                RECORDS_TABLE.to_owned(),
                encode_with_prefix(&consumer_prefix(consumer)?, key)?,
            )),
            Target::Entity(table) => {
                if self.kind(table) != Some(TableKind::Entity) {
                    return Err(Error::UnknownTable {
                        name: table.clone(),
                        expected: "entity",
                    });
                }
                check_message_key(key)?;
                Ok((table.clone(), key.to_vec()))
            }
        }
    }

    /// The record stored under `key`, in whatever state (expired, released and corrupt
    /// included), or `None` if the key holds nothing.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a consumer id or key outside its limits,
    /// [`Error::UnknownTable`] for a table that is not an entity table here, [`Error::Storage`]
    /// if the read fails.
    pub fn get(&self, target: &Target, key: &[u8]) -> Result<Option<Entry>> {
        let (table, stored_key) = self.locate(target, key)?;
        let kind = self.kind(&table).unwrap_or(TableKind::Unknown);
        let Some(value) = self.db().get_pinned_cf(self.cf(&table)?, &stored_key)? else {
            return Ok(None);
        };
        Ok(Some(Entry::decode(&table, kind, &stored_key, &value)))
    }

    /// Calls `visit` with every entry `filter` selects, in table and key order, starting after
    /// `after`, until it returns `Break`.
    ///
    /// # Errors
    /// [`Error::UnknownTable`] for a filter table that is not a marker table,
    /// [`Error::InvalidArgument`] for a consumer filter with an entity table or a cursor outside
    /// the filter's tables, [`Error::LimitExceeded`] for a consumer id outside its limits,
    /// [`Error::Storage`] if the scan fails.
    pub fn scan(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        mut visit: impl FnMut(Entry) -> ControlFlow<()>,
    ) -> Result<()> {
        let now_ms = self.now_ms();
        let tables = self.scan_tables(filter)?;
        let prefix = filter
            .consumer
            .as_deref()
            .map(consumer_prefix)
            .transpose()?;
        let start = match after {
            None => None,
            Some(cursor) => {
                let index = tables
                    .iter()
                    .position(|table| table.name == cursor.table)
                    .ok_or_else(|| {
                        Error::invalid_argument(format!(
                            "the cursor is in table {:?}, which this listing does not cover",
                            cursor.table
                        ))
                    })?;
                Some((index, cursor.stored_key.as_slice()))
            }
        };
        for (index, table) in tables.iter().enumerate() {
            let resume_key = match start {
                Some((start_index, _)) if index < start_index => continue,
                Some((start_index, key)) if index == start_index => Some(key),
                _ => None,
            };
            let mut lower: &[u8] = prefix.as_deref().unwrap_or_default();
            if let Some(key) = resume_key
                && key > lower
            {
                lower = key;
            }
            let mode = IteratorMode::From(lower, Direction::Forward);
            for item in self.db().iterator_cf(self.cf(&table.name)?, mode) {
                let (key, value) = item?;
                if prefix
                    .as_ref()
                    .is_some_and(|prefix| !key.starts_with(prefix))
                {
                    break;
                }
                if resume_key == Some(&key[..]) {
                    continue;
                }
                let entry = Entry::decode(&table.name, table.kind, &key, &value);
                if filter.matches(&entry, now_ms) && visit(entry).is_break() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The marker tables a filter covers, in listing order.
    pub(super) fn scan_tables(&self, filter: &Filter) -> Result<Vec<&TableInfo>> {
        if let Some(name) = &filter.table
            && !self.kind(name).is_some_and(TableKind::is_marker)
        {
            return Err(Error::UnknownTable {
                name: name.clone(),
                expected: "marker",
            });
        }
        if filter.consumer.is_some()
            && filter
                .table
                .as_deref()
                .is_some_and(|name| name != RECORDS_TABLE)
        {
            return Err(Error::invalid_argument(
                "a consumer's records are in the consumers' table, not in an entity table",
            ));
        }
        Ok(self
            .marker_tables()
            .filter(|table| filter.table.as_ref().is_none_or(|name| *name == table.name))
            .filter(|table| filter.consumer.is_none() || table.kind == TableKind::Consumers)
            .collect())
    }

    /// Up to `limit` entries `filter` selects, starting after `after`, and the cursor of the
    /// next page if more match.
    ///
    /// # Errors
    /// As for [`Store::scan`].
    pub fn list(&self, filter: &Filter, after: Option<&Cursor>, limit: usize) -> Result<Page> {
        let mut entries = Vec::new();
        let mut more = false;
        self.scan(filter, after, |entry| {
            if entries.len() == limit {
                more = true;
                return ControlFlow::Break(());
            }
            entries.push(entry);
            ControlFlow::Continue(())
        })?;
        let next = more.then(|| entries.last().map(Entry::cursor)).flatten();
        Ok(Page { entries, next })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_text_round_trips_and_rejects_garbage() {
        let cursor = Cursor {
            table: "idemdb.records".to_owned(),
            stored_key: vec![3, b'a', 0, 0xff],
        };
        assert_eq!(cursor.to_string(), "idemdb.records:036100ff");
        assert_eq!(Cursor::parse(&cursor.to_string()).unwrap(), cursor);
        for bad in ["", "no-colon", ":00", "t:0", "t:zz", "t:0g", "t:+f"] {
            assert!(Cursor::parse(bad).is_err(), "{bad:?}");
        }
    }
}
