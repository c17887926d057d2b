//! What `--json` prints: the documents of the commands. Export lines are the library's
//! (`idemdb::transfer`), shared with the other backends.

use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

use idemdb::admin::{
    Entry, ImportCounts, Page, PositionImportCounts, PurgeReport, StateCounts, Store, StoreStats,
    Transfer, TransferReport, VerifyReport,
};
use idemdb::format::printable;
use idemdb::transfer::{LineKey, LineRecord};
use serde::Serialize;
use serde_json::Value;

use crate::Failure;
use crate::render::stored_key_labels;

/// One entry of `get` and `list`: an export line's fields (the shared [`LineKey`] and
/// [`LineRecord`]) with what the record means now (`status`) after the key, and for a corrupt
/// entry (state `corrupt`) the reason after the rest. Export lines themselves are
/// [`idemdb::transfer::ExportLine`]s.
#[derive(Serialize)]
pub struct RecordJson {
    #[serde(flatten)]
    key: LineKey,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<String>,
    #[serde(flatten)]
    record: LineRecord,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl RecordJson {
    /// `now_ms` adds the `status`.
    pub fn of(entry: &Entry, now_ms: u64) -> RecordJson {
        let (record, error) = match &entry.record {
            Ok(record) => (LineRecord::of(record), None),
            Err(reason) => (LineRecord::corrupt(), Some(reason.to_string())),
        };
        RecordJson {
            key: LineKey::new(&entry.table, entry.consumer.as_deref(), &entry.key),
            status: Some(entry.state_at(now_ms).to_string()),
            record,
            error,
        }
    }
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
        .map(|entry| RecordJson::of(entry, now_ms))
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
/// `import`: the records' counts, and the read positions' under `positions`.
pub fn import_json(counts: &ImportCounts, positions: &PositionImportCounts) -> Value {
    serde_json::json!({
        "imported": counts.imported,
        "overwritten": counts.overwritten,
        "skipped": counts.skipped,
        "positions": {
            "imported": positions.imported,
            "advanced": positions.advanced,
            "overwritten": positions.overwritten,
            "skipped": positions.skipped,
        },
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

/// `positions list`: every position with its consumer.
pub fn positions_json(entries: &[idemdb::admin::PositionEntry]) -> Value {
    let positions: Vec<Value> = entries
        .iter()
        .map(|entry| {
            serde_json::json!({
                "consumer": printable(&entry.consumer),
                "source": entry.position.source,
                "partition": entry.position.partition,
                "offset": entry.position.offset,
                "next_offset": entry.position.next_offset(),
                "updated_at_ms": entry.position.updated_at_ms,
            })
        })
        .collect();
    serde_json::json!({ "positions": positions })
}

/// `positions set` and `remove`: the position before and after (`null`: none).
pub fn position_change_json(
    consumer: &[u8],
    args: &crate::args::PositionArgs,
    previous: Option<&idemdb::Position>,
    offset: Option<u64>,
) -> Value {
    serde_json::json!({
        "consumer": printable(consumer),
        "source": args.source,
        "partition": args.partition,
        "previous_offset": previous.map(|position| position.offset),
        "offset": offset,
    })
}
