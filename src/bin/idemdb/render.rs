//! What the commands print without `--json`: plain-text tables and `name value` lines, and the
//! labels they use for keys, instants, ages and sizes.

use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use idemdb::admin::{
    CONSUMERS_TABLE, Entry, EntryState, ImportCounts, Page, PositionImportCounts, PurgeReport,
    StateCounts, Store, StoreStats, TableKind, TransferReport, VerifyReport,
};
use idemdb::format::{decode_key, printable};
use idemdb::{Record, RecordState};

/// Results and holders longer than this are cut in tables (the JSON has them whole).
const DETAIL_CHARS_MAX: usize = 48;

/// `stats`: the store's summary lines, then the counts per (table, consumer) group.
pub fn write_stats(out: &mut impl Write, store: &Store, stats: &StoreStats) -> io::Result<()> {
    let tables: Vec<String> = store
        .tables()
        .iter()
        .filter(|table| table.kind != TableKind::Internal)
        .map(|table| format!("{} ({})", table.name, table.kind.label()))
        .collect();
    writeln!(out, "store     {}", store.path().display())?;
    writeln!(out, "tables    {}", tables.join(", "))?;
    writeln!(
        out,
        "disk      {} in {} files",
        size(stats.disk_bytes),
        stats.disk_files
    )?;
    if let Some(space) = stats.space {
        write!(
            out,
            "space     {} free of {} on its file system",
            size(space.available_bytes),
            size(space.total_bytes)
        )?;
        if space.is_full() {
            write!(
                out,
                " -- FULL: commits fail with NoSpace; free space, then reopen the store"
            )?;
        }
        writeln!(out)?;
    }
    writeln!(out, "records   {}", counts_line(&stats.totals()))?;
    writeln!(out, "as of     {}", time(stats.now_ms))?;
    writeln!(out)?;
    if stats.groups.is_empty() {
        return writeln!(out, "(no records)");
    }
    groups_table(stats).write(out, &[2, 3, 4, 5, 6])
}

/// One row per (table, consumer) group: its count in each state and its oldest record.
fn groups_table(stats: &StoreStats) -> TextTable {
    let mut table = TextTable::new(&[
        "TABLE",
        "CONSUMER",
        "LIVE",
        "EXPIRED",
        "IN-PROGRESS",
        "RELEASED",
        "CORRUPT",
        "OLDEST",
    ]);
    for group in &stats.groups {
        let mut row = vec![
            group.table.clone(),
            consumer_label(group.consumer.as_deref(), &group.table),
        ];
        row.extend(
            EntryState::ALL
                .iter()
                .map(|state| group.counts.get(*state).to_string()),
        );
        row.push(group.oldest_ms.map_or_else(
            || "-".to_owned(),
            |ms| format!("{} ({})", time(ms), age(stats.now_ms, ms)),
        ));
        table.row(row);
    }
    table
}

/// `get`: the record's fields, one `name value` line each.
pub fn write_record(out: &mut impl Write, entry: &Entry, now_ms: u64) -> io::Result<()> {
    let mut lines: Vec<(&str, String)> = vec![("table", entry.table.clone())];
    if let Some(consumer) = &entry.consumer {
        lines.push(("consumer", printable(consumer)));
    }
    lines.push(("key", printable(&entry.key)));
    lines.push(("state", entry.state_at(now_ms).to_string()));
    match &entry.record {
        Err(reason) => lines.push(("error", reason.to_string())),
        Ok(record) => {
            lines.push(("epoch", record.epoch.to_string()));
            lines.push(("fingerprint", record.fingerprint.to_string()));
            lines.extend(state_lines(&record.state, now_ms));
        }
    }
    for (name, value) in lines {
        writeln!(out, "{name:<12} {value}")?;
    }
    Ok(())
}

/// The `get` lines of what a record's state holds.
fn state_lines(state: &RecordState, now_ms: u64) -> Vec<(&'static str, String)> {
    match state {
        RecordState::Completed {
            committed_at_ms,
            expires_at_ms,
            result,
            succeeded,
        } => vec![
            ("committed", when(now_ms, *committed_at_ms)),
            ("expires", when(now_ms, *expires_at_ms)),
            ("succeeded", succeeded.to_string()),
            ("result", printable(result)),
        ],
        RecordState::InProgress {
            since_ms,
            lease_until_ms,
            holder,
            token,
        } => vec![
            ("holder", printable(holder)),
            ("taken", when(now_ms, *since_ms)),
            ("lease until", when(now_ms, *lease_until_ms)),
            ("token", format!("{token:016x}")),
        ],
        RecordState::Released {
            released_at_ms,
            removable_at_ms,
        } => vec![
            ("released", when(now_ms, *released_at_ms)),
            ("removable", when(now_ms, *removable_at_ms)),
        ],
        _ => Vec::new(),
    }
}

/// Which columns a page of records is shown in.
#[derive(Clone, Copy)]
pub enum ListView {
    /// `list`: every state, with a state-specific detail column.
    Records,
    /// `in-progress`: who holds each key, since when, and how its lease stands.
    InProgress,
}

/// `list` and `in-progress`: the page as a table, then the cursor of the next page.
pub fn write_page(
    out: &mut impl Write,
    page: &Page,
    view: ListView,
    now_ms: u64,
) -> io::Result<()> {
    if page.entries.is_empty() {
        return writeln!(out, "(no records)");
    }
    let (table, epoch_column) = match view {
        ListView::Records => records_table(&page.entries, now_ms),
        ListView::InProgress => in_progress_table(&page.entries, now_ms),
    };
    table.write(out, &[epoch_column])?;
    if let Some(next) = &page.next {
        writeln!(out, "more: --after {next}")?;
    }
    Ok(())
}

/// `list`'s table and the index of its EPOCH column. The TABLE column is there only when the
/// page holds entity records: the consumers' records all live in one table.
fn records_table(entries: &[Entry], now_ms: u64) -> (TextTable, usize) {
    let with_table = entries.iter().any(|entry| entry.consumer.is_none());
    let columns = ["CONSUMER", "KEY", "STATE", "EPOCH", "SINCE", "DETAIL"];
    let header: Vec<&str> = with_table
        .then_some("TABLE")
        .into_iter()
        .chain(columns)
        .collect();
    let mut table = TextTable::new(&header);
    for entry in entries {
        let epoch = entry
            .record
            .as_ref()
            .map_or_else(|_| "-".to_owned(), |record| record.epoch.to_string());
        let since = entry
            .since_ms()
            .map_or_else(|| "-".to_owned(), |since_ms| age(now_ms, since_ms));
        let mut row = Vec::with_capacity(header.len());
        if with_table {
            row.push(entry.table.clone());
        }
        row.extend([
            consumer_label(entry.consumer.as_deref(), &entry.table),
            printable(&entry.key),
            entry.state_at(now_ms).to_string(),
            epoch,
            since,
            detail(entry, now_ms),
        ]);
        table.row(row);
    }
    (table, usize::from(with_table) + 3)
}

/// `in-progress`'s table and the index of its EPOCH column.
fn in_progress_table(entries: &[Entry], now_ms: u64) -> (TextTable, usize) {
    let mut table = TextTable::new(&["CONSUMER", "KEY", "EPOCH", "HOLDER", "TAKEN", "LEASE"]);
    for entry in entries {
        // The page was filtered to in-progress records; anything else has no row here.
        let Ok(Record {
            epoch,
            state:
                RecordState::InProgress {
                    since_ms,
                    lease_until_ms,
                    holder,
                    ..
                },
            ..
        }) = &entry.record
        else {
            continue;
        };
        let lease = if *lease_until_ms <= now_ms {
            format!("expired {}", age(now_ms, *lease_until_ms))
        } else {
            format!("runs {}", age(now_ms, *lease_until_ms))
        };
        table.row(vec![
            consumer_label(entry.consumer.as_deref(), &entry.table),
            printable(&entry.key),
            epoch.to_string(),
            cut(&printable(holder)),
            age(now_ms, *since_ms),
            lease,
        ]);
    }
    (table, 2)
}

/// The last column of `list`: what the record holds, in a few words.
fn detail(entry: &Entry, now_ms: u64) -> String {
    match &entry.record {
        Err(reason) => reason.to_string(),
        Ok(record) => match &record.state {
            RecordState::Completed {
                result, succeeded, ..
            } => {
                let outcome = if *succeeded { "result" } else { "failure" };
                format!("{outcome} {}", cut(&printable(result)))
            }
            RecordState::InProgress {
                holder,
                lease_until_ms,
                ..
            } => format!(
                "holder {}, lease {}",
                cut(&printable(holder)),
                age(now_ms, *lease_until_ms)
            ),
            RecordState::Released {
                removable_at_ms, ..
            } => format!("removable {}", age(now_ms, *removable_at_ms)),
            _ => String::new(),
        },
    }
}

/// `verify`: the corrupt entries (when there are any), then how many were checked.
pub fn write_problems(out: &mut impl Write, report: &VerifyReport) -> io::Result<()> {
    let mut table = TextTable::new(&["TABLE", "CONSUMER", "KEY", "PROBLEM"]);
    for problem in &report.problems {
        let (consumer, key) = stored_key_labels(&problem.table, &problem.stored_key);
        table.row(vec![
            problem.table.clone(),
            consumer.unwrap_or_else(|| "-".to_owned()),
            key,
            problem.reason.to_string(),
        ]);
    }
    if !report.problems.is_empty() {
        table.write(out, &[])?;
    }
    let shown = if report.problems_total > report.problems.len() as u64 {
        format!(" (the first {} listed)", report.problems.len())
    } else {
        String::new()
    };
    writeln!(
        out,
        "checked {} entries: {} corrupt{shown}",
        report.checked, report.problems_total
    )
}

/// `resolve` and `release`: the key and what became of it (`completed` or `released`).
pub fn write_resolved(
    out: &mut impl Write,
    consumer: &[u8],
    key: &[u8],
    action: &str,
) -> io::Result<()> {
    writeln!(out, "{} {}: {action}", printable(consumer), printable(key))
}

/// `invalidate`: the epoch invalidated and the one the next delivery gets.
pub fn write_invalidated(out: &mut impl Write, key: &[u8], epoch: u64) -> io::Result<()> {
    writeln!(
        out,
        "{}: invalidated (epoch {epoch}); its next delivery is processed again, at epoch {}",
        printable(key),
        epoch + 1
    )
}

/// `purge-expired`: the counts before and after.
pub fn write_purge(out: &mut impl Write, report: &PurgeReport) -> io::Result<()> {
    writeln!(out, "before  {}", counts_line(&report.before))?;
    writeln!(out, "after   {}", counts_line(&report.after))
}

/// `import`: what was imported, replaced and left alone (and how to replace those).
pub fn write_import(
    out: &mut impl Write,
    counts: &ImportCounts,
    positions: &PositionImportCounts,
    overwrite: bool,
) -> io::Result<()> {
    let hint = if overwrite {
        ""
    } else {
        "; --overwrite replaces them"
    };
    writeln!(
        out,
        "imported {}, overwritten {}, skipped {} (already present{hint})",
        counts.imported, counts.overwritten, counts.skipped,
    )?;
    writeln!(
        out,
        "read positions: imported {}, advanced {}, overwritten {}, skipped {} (at or ahead \
         of the imported ones{hint})",
        positions.imported, positions.advanced, positions.overwritten, positions.skipped,
    )
}

/// `backup` and `restore` (`what`): the two directories, then what was written, as a table.
pub fn write_transfer(
    out: &mut impl Write,
    what: &str,
    from: &Path,
    to: &Path,
    report: &TransferReport,
    elapsed: Duration,
) -> io::Result<()> {
    writeln!(
        out,
        "{what} of {} written to {}",
        from.display(),
        to.display()
    )?;
    let mut table = TextTable::new(&["FILES", "BYTES", "LINKED", "TRANSFER", "TIME"]);
    table.row(vec![
        report.files.to_string(),
        size(report.bytes),
        report.linked_files.to_string(),
        report.transfer.label().to_owned(),
        format!("{:.3} s", elapsed.as_secs_f64()),
    ]);
    table.write(out, &[0, 1, 2, 4])
}

fn counts_line(counts: &StateCounts) -> String {
    format!(
        "{}: {} live, {} expired, {} in progress, {} released, {} corrupt",
        counts.total(),
        counts.live,
        counts.expired,
        counts.in_progress,
        counts.released,
        counts.corrupt
    )
}

/// The consumer column: the consumer, or `-` for an entity table's record (and `?` for a
/// consumers' table key that does not decode).
pub fn consumer_label(consumer: Option<&[u8]>, table: &str) -> String {
    match consumer {
        Some(consumer) => printable(consumer),
        None if table == CONSUMERS_TABLE => "?".to_owned(),
        None => "-".to_owned(),
    }
}

/// The consumer and the key a stored key names: in the consumers' table both, decoded; in an
/// entity table (or when it does not decode) no consumer and the stored key as it is.
pub fn stored_key_labels(table: &str, stored_key: &[u8]) -> (Option<String>, String) {
    match decode_key(stored_key) {
        Ok((consumer, key)) if table == CONSUMERS_TABLE => {
            (Some(printable(consumer)), printable(key))
        }
        _ => (None, printable(stored_key)),
    }
}

/// `positions list`: one row per position.
pub fn write_positions(
    out: &mut impl Write,
    entries: &[idemdb::admin::PositionEntry],
    now_ms: u64,
) -> io::Result<()> {
    if entries.is_empty() {
        return writeln!(out, "no read positions");
    }
    let mut table = TextTable::new(&[
        "CONSUMER",
        "SOURCE",
        "PARTITION",
        "OFFSET",
        "RESUME AT",
        "UPDATED",
    ]);
    for entry in entries {
        let position = &entry.position;
        table.row(vec![
            printable(&entry.consumer),
            position.source.clone(),
            position.partition.to_string(),
            position.offset.to_string(),
            position.next_offset().to_string(),
            age(now_ms, position.updated_at_ms),
        ]);
    }
    table.write(out, &[2, 3, 4])
}

/// `positions set` and `remove`: what the position was and is.
pub fn write_position_change(
    out: &mut impl Write,
    label: &str,
    previous: Option<&idemdb::Position>,
    offset: Option<u64>,
) -> io::Result<()> {
    let was = previous.map_or("none".to_owned(), |position| {
        format!("offset {}", position.offset)
    });
    match offset {
        Some(offset) => writeln!(
            out,
            "{label}: offset {offset} (was {was}); the consumer resumes at {} when it next starts",
            offset.saturating_add(1)
        ),
        None => writeln!(
            out,
            "{label}: removed (was {was}); the consumer starts without a position"
        ),
    }
}

/// An instant as RFC 3339 (UTC, seconds), `never` for the never-expires marker.
fn time(ms: u64) -> String {
    // humantime formats up to year 9999 (and fails, rather than panics, beyond).
    const SECONDS_MAX: u64 = 253_402_300_799;
    if ms == idemdb::EXPIRES_NEVER_MS {
        return "never".to_owned();
    }
    if ms / 1000 > SECONDS_MAX {
        return format!("{ms} ms after the epoch");
    }
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// An instant relative to now: `5m 3s ago`, `in 6days 23h`.
fn age(now_ms: u64, ms: u64) -> String {
    if ms == idemdb::EXPIRES_NEVER_MS {
        return "never".to_owned();
    }
    let span = |ms: u64| {
        // The two largest units ("6days 23h", "5m 3s"): finer parts only add noise to a table.
        let text = humantime::format_duration(Duration::from_secs(ms / 1000)).to_string();
        text.split(' ').take(2).collect::<Vec<_>>().join(" ")
    };
    if ms <= now_ms {
        format!("{} ago", span(now_ms - ms))
    } else {
        format!("in {}", span(ms - now_ms))
    }
}

/// An instant both ways: `2026-01-02T03:04:05Z (5m 3s ago)`.
fn when(now_ms: u64, ms: u64) -> String {
    if ms == idemdb::EXPIRES_NEVER_MS {
        return "never".to_owned();
    }
    format!("{} ({})", time(ms), age(now_ms, ms))
}

/// A byte count in binary units, one decimal: `512 B`, `1.5 MiB`.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `text` cut to `DETAIL_CHARS_MAX` characters, `...` marking the cut.
fn cut(text: &str) -> String {
    if text.chars().count() <= DETAIL_CHARS_MAX {
        return text.to_owned();
    }
    let kept: String = text.chars().take(DETAIL_CHARS_MAX - 3).collect();
    format!("{kept}...")
}

/// A plain-text table: columns padded to their widest cell.
struct TextTable {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl TextTable {
    fn new(header: &[&str]) -> TextTable {
        TextTable {
            header: header.iter().map(|cell| (*cell).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    /// Writes the table; the columns in `right` are right-aligned (numbers).
    fn write(&self, out: &mut impl Write, right: &[usize]) -> io::Result<()> {
        let mut widths: Vec<usize> = self
            .header
            .iter()
            .map(|cell| cell.chars().count())
            .collect();
        for row in &self.rows {
            for (column, cell) in row.iter().enumerate() {
                if let Some(width) = widths.get_mut(column) {
                    *width = (*width).max(cell.chars().count());
                }
            }
        }
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (column, cell) in row.iter().enumerate() {
                let width = widths.get(column).copied().unwrap_or(0);
                let padding = " ".repeat(width.saturating_sub(cell.chars().count()));
                if column > 0 {
                    line.push_str("  ");
                }
                if right.contains(&column) {
                    line.push_str(&padding);
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.push_str(&padding);
                }
            }
            writeln!(out, "{}", line.trim_end())?;
        }
        Ok(())
    }
}
