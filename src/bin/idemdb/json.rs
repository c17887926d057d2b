//! What `--json` prints: the record type export writes and import reads back, and the documents
//! of the other commands.

use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use hex::FromHex;
use idemdb::admin::{
    Entry, ImportCounts, ImportRecord, Page, PurgeReport, StateCounts, Store, StoreStats, Transfer,
    TransferReport, VerifyReport,
};
use idemdb::format::printable;
use idemdb::{Fingerprint, Record, RecordState};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Failure;
use crate::render::stored_key_labels;

/// One record as JSON: an `export` line (read back by `import`, from the exact `*_hex` fields),
/// or a `get` / `list` entry (with `status`; corrupt entries with `error`).
#[derive(Default, Serialize, Deserialize)]
pub struct RecordJson {
    table: String,
    consumer: Option<String>,
    consumer_hex: Option<String>,
    key: String,
    key_hex: String,
    /// What the record means now (not in export lines, which hold stored facts only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<String>,
    /// `completed`, `in_progress`, `released`, or `corrupt`.
    state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    epoch: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fingerprint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    committed_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    succeeded: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result_hex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    since_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lease_until_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    holder_hex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    token: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    released_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    removable_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl RecordJson {
    /// `now_ms` adds the `status` (get, list); export leaves it out.
    pub fn of(entry: &Entry, now_ms: Option<u64>) -> RecordJson {
        let json = RecordJson {
            table: entry.table.clone(),
            consumer: entry.consumer.as_deref().map(printable),
            consumer_hex: entry.consumer.as_deref().map(hex::encode),
            key: printable(&entry.key),
            key_hex: hex::encode(&entry.key),
            status: now_ms.map(|now_ms| entry.state_at(now_ms).to_string()),
            ..RecordJson::default()
        };
        match &entry.record {
            Ok(record) => json.with_record(record),
            Err(reason) => RecordJson {
                state: "corrupt".to_owned(),
                error: Some(reason.to_string()),
                ..json
            },
        }
    }

    /// These fields with the ones of a decoded record.
    fn with_record(mut self, record: &Record) -> RecordJson {
        self.epoch = Some(record.epoch);
        self.fingerprint = Some(record.fingerprint.to_string());
        let state = match &record.state {
            RecordState::Completed {
                committed_at_ms,
                expires_at_ms,
                result,
                succeeded,
            } => {
                self.committed_at_ms = Some(*committed_at_ms);
                self.expires_at_ms = Some(*expires_at_ms);
                self.succeeded = Some(*succeeded);
                self.result = Some(printable(result));
                self.result_hex = Some(hex::encode(result));
                "completed"
            }
            RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                token,
            } => {
                self.holder = Some(printable(holder));
                self.holder_hex = Some(hex::encode(holder));
                self.token = Some(*token);
                self.since_ms = Some(*since_ms);
                self.lease_until_ms = Some(*lease_until_ms);
                "in_progress"
            }
            RecordState::Released {
                released_at_ms,
                removable_at_ms,
            } => {
                self.released_at_ms = Some(*released_at_ms);
                self.removable_at_ms = Some(*removable_at_ms);
                "released"
            }
            // A state this CLI does not know (a newer library): say so rather than guess.
            _ => "unknown",
        };
        self.state = state.to_owned();
        self
    }

    /// The record an export line describes, from its exact fields (`*_hex`, numbers).
    pub fn into_import(self) -> Result<ImportRecord, String> {
        let key = unhex_field(&self.key_hex, "key_hex")?;
        let consumer = match &self.consumer_hex {
            Some(consumer) => Some(unhex_field(consumer, "consumer_hex")?),
            None => None,
        };
        let epoch = required(self.epoch, "epoch")?;
        let fingerprint = required(self.fingerprint.as_deref(), "fingerprint")?;
        // Export writes the fingerprint's Display form: 32 hex digits, most significant first.
        let fingerprint = <[u8; 16]>::from_hex(fingerprint)
            .map(|bytes| Fingerprint::from_u128(u128::from_be_bytes(bytes)))
            .map_err(|_| "\"fingerprint\" is not 32 hex digits")?;
        let state = self.stored_state()?;
        ImportRecord::new(
            self.table,
            consumer.as_deref(),
            &key,
            epoch,
            fingerprint,
            state,
        )
        .map_err(|error| error.to_string())
    }

    /// The state an export line describes, from its `state` and that state's fields.
    fn stored_state(&self) -> Result<RecordState, String> {
        Ok(match self.state.as_str() {
            "completed" => RecordState::Completed {
                committed_at_ms: required(self.committed_at_ms, "committed_at_ms")?,
                expires_at_ms: required(self.expires_at_ms, "expires_at_ms")?,
                result: required_bytes(self.result_hex.as_deref(), "result_hex")?,
                succeeded: required(self.succeeded, "succeeded")?,
            },
            "in_progress" => RecordState::InProgress {
                since_ms: required(self.since_ms, "since_ms")?,
                lease_until_ms: required(self.lease_until_ms, "lease_until_ms")?,
                holder: required_bytes(self.holder_hex.as_deref(), "holder_hex")?,
                token: required(self.token, "token")?,
            },
            "released" => RecordState::Released {
                released_at_ms: required(self.released_at_ms, "released_at_ms")?,
                removable_at_ms: required(self.removable_at_ms, "removable_at_ms")?,
            },
            other => return Err(format!("state {other:?} cannot be imported")),
        })
    }
}

/// A field an import line must have for its state.
fn required<T>(value: Option<T>, name: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("missing {name:?}"))
}

/// The bytes of a `*_hex` field an import line must have.
fn required_bytes(value: Option<&str>, name: &str) -> Result<Bytes, String> {
    unhex_field(required(value, name)?, name).map(Bytes::from)
}

/// The bytes a `*_hex` field spells.
fn unhex_field(digits: &str, name: &str) -> Result<Vec<u8>, String> {
    hex::decode(digits).map_err(|_| format!("{name:?} is not hex"))
}

pub fn write_json(out: &mut impl Write, value: &impl Serialize) -> Result<(), Failure> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(io::Error::from)?;
    writeln!(out)?;
    Ok(())
}

fn counts_json(counts: &StateCounts) -> Value {
    serde_json::json!({
        "live": counts.live,
        "expired": counts.expired,
        "in_progress": counts.in_progress,
        "released": counts.released,
        "corrupt": counts.corrupt,
        "total": counts.total(),
    })
}

/// `stats`: the store, its tables, and the counts per (table, consumer) group.
pub fn stats_json(store: &Store, stats: &StoreStats) -> Value {
    let groups: Vec<_> = stats
        .groups
        .iter()
        .map(|group| {
            let mut value = counts_json(&group.counts);
            value["table"] = group.table.clone().into();
            value["consumer"] = group.consumer.as_deref().map(printable).into();
            value["consumer_hex"] = group.consumer.as_deref().map(hex::encode).into();
            value["oldest_ms"] = group.oldest_ms.into();
            value
        })
        .collect();
    let tables: Vec<_> = store
        .tables()
        .iter()
        .map(|table| serde_json::json!({"name": table.name, "kind": table.kind.label()}))
        .collect();
    serde_json::json!({
        "store": store.path().display().to_string(),
        "now_ms": stats.now_ms,
        "disk_bytes": stats.disk_bytes,
        "disk_files": stats.disk_files,
        "space": stats.space.map(|space| serde_json::json!({
            "total_bytes": space.total_bytes,
            "available_bytes": space.available_bytes,
            "full": space.is_full(),
        })),
        "tables": tables,
        "totals": counts_json(&stats.totals()),
        "groups": groups,
    })
}

/// `list` and `in-progress`: a page of entries and the cursor of the next one.
pub fn page_json(page: &Page, now_ms: u64) -> Value {
    let entries: Vec<_> = page
        .entries
        .iter()
        .map(|entry| RecordJson::of(entry, Some(now_ms)))
        .collect();
    let next = page.next.as_ref().map(ToString::to_string);
    serde_json::json!({"entries": entries, "next": next})
}

/// `verify`: how many entries were checked, and the corrupt ones.
pub fn verify_json(report: &VerifyReport) -> Value {
    let problems: Vec<_> = report
        .problems
        .iter()
        .map(|problem| {
            let (consumer, key) = stored_key_labels(&problem.table, &problem.stored_key);
            serde_json::json!({
                "table": problem.table,
                "consumer": consumer,
                "key": key,
                "stored_key_hex": hex::encode(&problem.stored_key),
                "reason": problem.reason.to_string(),
            })
        })
        .collect();
    serde_json::json!({
        "checked": report.checked,
        "problems_total": report.problems_total,
        "problems": problems,
    })
}

/// `resolve` and `release`: the key and what became of it (`completed` or `released`).
pub fn resolved_json(consumer: &[u8], key: &[u8], action: &str) -> Value {
    serde_json::json!({
        "consumer": printable(consumer),
        "key": printable(key),
        "resolved": action,
    })
}

/// `invalidate`: the key and the epoch that was invalidated.
pub fn invalidated_json(key: &[u8], epoch: u64) -> Value {
    serde_json::json!({"key": printable(key), "invalidated_epoch": epoch})
}

/// `purge-expired`: the counts before and after.
pub fn purge_json(report: &PurgeReport) -> Value {
    serde_json::json!({
        "before": counts_json(&report.before),
        "after": counts_json(&report.after),
    })
}

/// `import`: what was imported, replaced and left alone.
pub fn import_json(counts: &ImportCounts) -> Value {
    serde_json::json!({
        "imported": counts.imported,
        "overwritten": counts.overwritten,
        "skipped": counts.skipped,
    })
}

/// `backup` and `restore`: the two directories, what was written and how, and how long it took.
pub fn transfer_json(
    store: &Path,
    backup: &Path,
    report: &TransferReport,
    elapsed: Duration,
) -> Value {
    let transfer = match report.transfer {
        Transfer::HardLinks => "hard_links",
        _ => "copy",
    };
    serde_json::json!({
        "store": store.display().to_string(),
        "backup": backup.display().to_string(),
        "files": report.files,
        "bytes": report.bytes,
        "linked_files": report.linked_files,
        "transfer": transfer,
        "seconds": elapsed.as_secs_f64(),
    })
}
