//! The read commands: stats, get, list, in-progress, export and verify. They open the store
//! read-only, so they work while the application has it open.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::ops::ControlFlow;
use std::path::Path;

use idemdb::admin::{Filter, Store};
use idemdb::format::printable;
use idemdb::transfer::{ExportLine, PositionLine};

use crate::args::{ExportArgs, InProgressArgs, KeyArgs, ListArgs, PageArgs, StoreArg};
use crate::json::{RecordJson, page_json, stats_json, verify_json, write_json};
use crate::render::{
    ListView, consumer_label, write_page, write_problems, write_record, write_stats,
};
use crate::{EXIT_OK, EXIT_PROBLEM, Failure};

/// Opens the store read-only: that takes no lock, so the application may have it open.
pub fn open_read(path: &Path) -> Result<Store, Failure> {
    Store::builder(path)
        .open_read_only()
        .map_err(Failure::opening)
}

pub fn stats(args: &StoreArg, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    let store = open_read(&args.store)?;
    let stats = store.stats()?;
    if json {
        write_json(out, &stats_json(&store, &stats))?;
    } else {
        write_stats(out, &store, &stats)?;
    }
    Ok(EXIT_OK)
}

pub fn get(path: &Path, key: KeyArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    let (target, key) = key.target();
    let store = open_read(path)?;
    let Some(entry) = store.get(&target, &key)? else {
        if json {
            writeln!(out, "null")?;
        } else {
            eprintln!("idemdb: no record for {}", printable(&key));
        }
        return Ok(EXIT_PROBLEM);
    };
    let now_ms = store.now_ms();
    if json {
        write_json(out, &RecordJson::of(&entry, now_ms))?;
    } else {
        write_record(out, &entry, now_ms)?;
    }
    Ok(EXIT_OK)
}

pub fn list(args: &ListArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    show_page(
        &args.store.store,
        &args.filter(),
        &args.page,
        ListView::Records,
        json,
        out,
    )
}

pub fn in_progress(args: &InProgressArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    show_page(
        &args.store.store,
        &args.filter(),
        &args.page,
        ListView::InProgress,
        json,
        out,
    )
}

/// One page of the records `filter` selects, as JSON or as a table in `view`'s columns.
fn show_page(
    path: &Path,
    filter: &Filter,
    page: &PageArgs,
    view: ListView,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let store = open_read(path)?;
    let now_ms = store.now_ms();
    let listed = store.list(filter, page.after.as_ref(), page.limit)?;
    if json {
        write_json(out, &page_json(&listed, now_ms))?;
    } else {
        write_page(out, &listed, view, now_ms)?;
    }
    Ok(EXIT_OK)
}

pub fn export(args: &ExportArgs, out: &mut impl Write) -> Result<u8, Failure> {
    let store = open_read(&args.store.store)?;
    let mut file = match &args.output {
        Some(path) => Some(BufWriter::new(File::create(path)?)),
        None => None,
    };
    let writer: &mut dyn Write = match &mut file {
        Some(file) => file,
        None => out,
    };
    // The scan's callback cannot return an error: a failed write stops the scan, and is
    // returned after it.
    let mut failed: Option<io::Error> = None;
    let mut skipped = 0u64;
    store.scan(&args.scope.filter(), None, |entry| {
        let record = match &entry.record {
            Ok(record) => record,
            Err(reason) => {
                skipped += 1;
                eprintln!(
                    "idemdb: skipped corrupt entry: table {}, consumer {}, key {}: {reason}",
                    entry.table,
                    consumer_label(entry.consumer.as_deref(), &entry.table),
                    printable(&entry.key)
                );
                return ControlFlow::Continue(());
            }
        };
        let line = ExportLine::of(&entry.table, entry.consumer.as_deref(), &entry.key, record)
            .write_to(&mut *writer);
        match line {
            Ok(()) => ControlFlow::Continue(()),
            Err(error) => {
                failed = Some(error);
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(error) = failed {
        return Err(error.into());
    }
    // After every record: an import writes the positions last too, so that a consumer resuming
    // from one finds the records of every message before it.
    if let Some(consumer) = args.scope.positions() {
        for entry in store.positions(consumer)? {
            PositionLine::of(&entry.consumer, &entry.position).write_to(&mut *writer)?;
        }
    }
    writer.flush()?;
    Ok(if skipped == 0 { EXIT_OK } else { EXIT_PROBLEM })
}

pub fn verify(args: &StoreArg, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    let store = open_read(&args.store)?;
    let report = store.verify()?;
    if json {
        write_json(out, &verify_json(&report))?;
    } else {
        write_problems(out, &report)?;
    }
    Ok(if report.problems_total == 0 {
        EXIT_OK
    } else {
        EXIT_PROBLEM
    })
}
