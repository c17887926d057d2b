//! The write commands: resolve, release, invalidate, purge-expired and import. They need the
//! store to themselves: on a store another process has open they write nothing (exit 3).

use std::fs::File;
use std::io::{self, BufRead, IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use idemdb::admin::{ImportPosition, ImportRecord, Invalidation, Store};
use idemdb::format::printable;
use idemdb::transfer::{ReadError, read_lines};
use idemdb::{Error, Resolution};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{ImportArgs, InProgressKeyArgs, KeyArgs, ResolveOpenArgs, WaitArg};
use crate::json::{import_json, invalidated_json, purge_json, resolved_json, write_json};
use crate::render::{write_import, write_invalidated, write_purge, write_resolved};
use crate::{EXIT_OK, EXIT_PROBLEM, Failure};

/// How often `--wait` retries the exclusive open.
const WAIT_POLL: Duration = Duration::from_millis(200);

/// Opens the store for writing, retrying for up to `wait` while another process holds it.
pub fn open_write(
    path: &Path,
    retention: Option<Duration>,
    wait: &WaitArg,
) -> Result<Store, Failure> {
    let started = Instant::now();
    loop {
        let mut builder = Store::builder(path);
        if let Some(retention) = retention {
            builder = builder.retention(retention);
        }
        match builder.open_exclusive() {
            Err(Error::AlreadyOpen { .. })
                if wait.wait.is_some_and(|wait| started.elapsed() < wait) =>
            {
                std::thread::sleep(WAIT_POLL);
            }
            other => return other.map_err(Failure::opening),
        }
    }
}

/// `resolve` and `release`: ends an in-progress key with `resolution`, whoever holds it.
pub fn resolve(
    held: &InProgressKeyArgs,
    resolution: Resolution,
    open: &ResolveOpenArgs,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let (consumer, key) = (&held.consumer.0, &held.key.0);
    let store = open_write(&held.store.store, Some(open.retention), &open.wait)?;
    let action = match &resolution {
        Resolution::Complete(_) => "completed",
        _ => "released",
    };
    match store.resolve(consumer, key, resolution) {
        Ok(()) => {
            if json {
                write_json(out, &resolved_json(consumer, key, action))?;
            } else {
                write_resolved(out, consumer, key, action)?;
            }
            Ok(EXIT_OK)
        }
        Err(Error::NotInProgress { current_epoch }) => {
            eprintln!(
                "idemdb: {} {} is not in progress (epoch {current_epoch}); nothing written",
                printable(consumer),
                printable(key)
            );
            Ok(EXIT_PROBLEM)
        }
        Err(error) => Err(error.into()),
    }
}

pub fn invalidate(
    path: &Path,
    key: KeyArgs,
    wait: &WaitArg,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let (target, key) = key.target();
    let store = open_write(path, None, wait)?;
    match store.invalidate(&target, &key)? {
        Invalidation::Invalidated { epoch } => {
            if json {
                write_json(out, &invalidated_json(&key, epoch))?;
            } else {
                write_invalidated(out, &key, epoch)?;
            }
            Ok(EXIT_OK)
        }
        Invalidation::NotCompleted { state, epoch } => {
            let holds = state.map_or_else(
                || "nothing".to_owned(),
                |state| format!("a record that is {state} (epoch {epoch})"),
            );
            eprintln!(
                "idemdb: {} holds {holds}, not a live completed record; nothing written",
                printable(&key)
            );
            Ok(EXIT_PROBLEM)
        }
        _ => Ok(EXIT_PROBLEM),
    }
}

pub fn purge_expired(
    path: &Path,
    wait: &WaitArg,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let store = open_write(path, None, wait)?;
    let bar = compaction_progress(json);
    let report = store.purge_expired(|table, index, count| {
        bar.set_length(count as u64);
        bar.set_position(index as u64);
        bar.set_message(table.to_owned());
    });
    bar.finish_and_clear();
    let report = report?;
    if json {
        write_json(out, &purge_json(&report))?;
    } else {
        write_purge(out, &report)?;
    }
    Ok(EXIT_OK)
}

/// The spinner shown while the tables compact: only on a terminal, never with `--json`.
fn compaction_progress(json: bool) -> ProgressBar {
    let bar = if json || !io::stdout().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} compacting {msg} [{pos}/{len}] {elapsed}")
    {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

pub fn import(args: &ImportArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    // Parse everything first: malformed input writes nothing.
    let (records, positions) = read_import_lines(args.input.as_deref())?;
    let store = open_write(&args.store.store, None, &args.wait)?;
    // The records first: a consumer resuming from an imported position finds the records of
    // every message before it, even if the positions' write fails. Their checks first of all:
    // a refused position writes nothing.
    store.check_import_positions(&positions)?;
    let counts = store.import(&records, args.overwrite)?;
    let moved = store.import_positions(&positions, args.overwrite)?;
    if json {
        write_json(out, &import_json(&counts, &moved))?;
    } else {
        write_import(out, &counts, &moved, args.overwrite)?;
    }
    Ok(if counts.skipped == 0 && moved.skipped == 0 {
        EXIT_OK
    } else {
        EXIT_PROBLEM
    })
}

/// The records and read positions of export's JSON lines in `input` (standard input for `-` or
/// none), all read and checked before any is written: blank lines are passed over, a malformed
/// one is an input error naming its line number.
fn read_import_lines(
    input: Option<&Path>,
) -> Result<(Vec<ImportRecord>, Vec<ImportPosition>), Failure> {
    let input: Box<dyn BufRead> = match input {
        Some(path) if path.as_os_str() != "-" => Box::new(io::BufReader::new(File::open(path)?)),
        _ => Box::new(io::stdin().lock()),
    };
    let lines = read_lines(input).map_err(|error| match error {
        ReadError::Io(error) => Failure::from(error),
        line => Failure::Input(line.to_string()),
    })?;
    let positions = lines
        .positions
        .into_iter()
        .map(|(line, moved)| {
            ImportPosition::new(moved.consumer(), moved.position().clone())
                .map_err(|error| Failure::Input(format!("import line {line}: {error}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let records = lines
        .records
        .into_iter()
        .map(|(line, record)| {
            let stored = record.record();
            ImportRecord::new(
                record.table(),
                record.consumer(),
                record.key(),
                stored.epoch,
                stored.fingerprint,
                stored.state.clone(),
            )
            .map_err(|error| Failure::Input(format!("import line {line}: {error}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((records, positions))
}
