//! `idemdb`: the operator CLI. Parses arguments, calls [`idemdb::admin`], prints tables (or
//! JSON with `--json`). Every rule about what may be read or written lives in the library.

use std::fs::File;
use std::io::{self, BufRead, BufWriter, IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, UNIX_EPOCH};

use bytes::Bytes;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use idemdb::admin::{
    Cursor, Entry, EntryState, Filter, ImportRecord, Invalidation, StateCounts, Store, Target,
};
use idemdb::format::{decode_key, printable};
use idemdb::{Error, Fingerprint, Record, RecordState, Resolution};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

/// The command did what was asked.
const EXIT_OK: u8 = 0;
/// The command ran and found a problem (see the exit-code table in `--help`).
const EXIT_PROBLEM: u8 = 1;
/// Bad arguments or input (clap uses 2 for its own usage errors too).
const EXIT_USAGE: u8 = 2;
/// A write command found the store open by another process.
const EXIT_BUSY: u8 = 3;
/// The directory holds no idemdb store, or it cannot be opened.
const EXIT_NOT_A_STORE: u8 = 4;
/// Any other storage or I/O failure.
const EXIT_STORAGE: u8 = 5;

/// How often `--wait` retries the exclusive open.
const WAIT_POLL: Duration = Duration::from_millis(200);
/// Results and holders longer than this are cut in tables (the JSON has them whole).
const DETAIL_CHARS_MAX: usize = 48;

const ABOUT: &str = "Inspect and repair an idemdb store";

const LONG_ABOUT: &str = "\
Inspect and repair an idemdb store (a RocksDB directory written by the idemdb library).

Read commands (stats, get, list, in-progress, export, verify) open the store read-only: they
take no lock and work while the application has the store open, seeing what its files and WAL
hold at that moment. Write commands (resolve, release, invalidate, purge-expired, import) need
the store to themselves: RocksDB admits one writing process, so on a live store they exit with
code 3 and write nothing. Stop the application first (--wait DURATION retries while it shuts
down), or make the change from inside the running application with the library
(Consumer::in_progress, Consumer::resolve).

Keys: UTF-8 text as typed, `hex:<hex digits>` for binary keys, `text:<key>` for a text key that
starts with `hex:` or `text:`. Keys are shown as text when they are printable UTF-8, otherwise
as 0x<hex> (pass those back as hex:<hex>). Durations: 90s, 5m, 2h, 7days ...";

const EXIT_CODES: &str = "\
Exit codes:
  0  done
  1  the command ran and found a problem: verify found corrupt entries; get found no record;
     export skipped corrupt entries; import left existing records alone (no --overwrite);
     resolve/release found the key not in progress; invalidate found no live completed record
  2  usage error: bad arguments, a malformed key, cursor or duration, malformed import input
  3  store busy: a write command found the store open by another process (the application)
  4  not an idemdb store, or the store cannot be opened
  5  any other storage or I/O error";

#[derive(Parser)]
#[command(
    name = "idemdb",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = "Exit codes: 0 done, 1 problem found, 2 usage, 3 store busy, 4 not a store, \
                  5 storage error (--help for details)",
    after_long_help = EXIT_CODES
)]
struct Cli {
    /// Print JSON for scripts instead of tables: one document, or JSON lines for export.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Records per consumer and state, disk usage, oldest record (read-only).
    Stats(StoreArg),
    /// One record in whatever state: CONSUMER KEY, or --entity TABLE KEY (read-only).
    Get(GetArgs),
    /// Records by consumer, table, state and age, a page at a time (read-only).
    List(ListArgs),
    /// In-progress records (external claims) taken at least --older-than ago (read-only).
    InProgress(InProgressArgs),
    /// Complete an in-progress key with a result, whoever holds it (needs the store stopped).
    Resolve(ResolveArgs),
    /// Release an in-progress key so its next delivery is processed again (needs the store
    /// stopped).
    Release(ReleaseArgs),
    /// Make a completed record re-processable: the next delivery is fresh, at the next epoch
    /// (needs the store stopped).
    Invalidate(InvalidateArgs),
    /// Compact the marker tables so expired records are removed now (needs the store stopped).
    PurgeExpired(PurgeArgs),
    /// Every record as JSON lines, exact bytes in the *_hex fields (read-only).
    Export(ExportArgs),
    /// Records from JSON lines made by export into a store (needs the store stopped).
    Import(ImportArgs),
    /// Decode every record; print the corrupt ones (read-only). Exit 1 if any.
    Verify(StoreArg),
}

#[derive(Args)]
struct StoreArg {
    /// The store's directory.
    store: PathBuf,
}

#[derive(Args)]
struct WaitArg {
    /// While another process has the store open, retry for up to this long (e.g. 30s) instead
    /// of exiting with code 3.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    wait: Option<Duration>,
}

#[derive(Args)]
struct RetentionArg {
    /// The application's retention: a resolved record expires this long after, a released one
    /// is kept this long.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "7days")]
    retention: Duration,
}

#[derive(Args)]
struct KeyArgs {
    /// The key's entity table (then give only KEY).
    #[arg(long, value_name = "TABLE")]
    entity: Option<String>,
    /// CONSUMER KEY, or KEY alone with --entity.
    #[arg(value_name = "CONSUMER|KEY", num_args = 1..=2, required = true, value_parser = parse_bytes)]
    parts: Vec<Arg>,
}

impl KeyArgs {
    /// The record the arguments name; a usage error (exit 2) if they name none.
    fn target(self) -> (Target, Vec<u8>) {
        let mut parts = self.parts.into_iter().map(|part| part.0);
        match (self.entity, parts.next(), parts.next()) {
            (Some(table), Some(key), None) => (Target::Entity(table), key),
            (None, Some(consumer), Some(key)) => (Target::Consumer(consumer), key),
            (Some(_), _, _) => usage_error("with --entity TABLE give only the KEY"),
            (None, _, _) => usage_error("give CONSUMER and KEY (or --entity TABLE and KEY)"),
        }
    }
}

#[derive(Args)]
struct GetArgs {
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    key: KeyArgs,
}

#[derive(Clone, Copy, ValueEnum)]
enum StateArg {
    Live,
    Expired,
    InProgress,
    Released,
    Corrupt,
}

impl From<StateArg> for EntryState {
    fn from(state: StateArg) -> EntryState {
        match state {
            StateArg::Live => EntryState::Live,
            StateArg::Expired => EntryState::Expired,
            StateArg::InProgress => EntryState::InProgress,
            StateArg::Released => EntryState::Released,
            StateArg::Corrupt => EntryState::Corrupt,
        }
    }
}

#[derive(Args)]
struct PageArgs {
    /// At most this many entries.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// Start after this cursor (printed at the end of the previous page).
    #[arg(long, value_name = "CURSOR", value_parser = parse_cursor)]
    after: Option<Cursor>,
}

/// Which records `list` and `export` cover.
#[derive(Args)]
struct ScopeArgs {
    /// Only this consumer's records.
    #[arg(long, value_parser = parse_bytes)]
    consumer: Option<Arg>,
    /// Only this marker table (idemdb.records or an entity table).
    #[arg(long)]
    table: Option<String>,
}

impl ScopeArgs {
    fn filter(self) -> Filter {
        let mut filter = Filter::new();
        if let Some(consumer) = self.consumer {
            filter = filter.consumer(consumer.0);
        }
        if let Some(table) = self.table {
            filter = filter.table(table);
        }
        filter
    }
}

#[derive(Args)]
struct ListArgs {
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    scope: ScopeArgs,
    /// Only records in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only records that entered their state at least this long ago.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    older_than: Option<Duration>,
    #[command(flatten)]
    page: PageArgs,
}

#[derive(Args)]
struct InProgressArgs {
    #[command(flatten)]
    store: StoreArg,
    /// Only keys taken at least this long ago.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "0s")]
    older_than: Duration,
    /// Only this consumer's keys.
    #[arg(long, value_parser = parse_bytes)]
    consumer: Option<Arg>,
    #[command(flatten)]
    page: PageArgs,
}

#[derive(Args)]
struct ResolveArgs {
    #[command(flatten)]
    store: StoreArg,
    /// The consumer id.
    #[arg(value_parser = parse_bytes)]
    consumer: Arg,
    /// The message key.
    #[arg(value_parser = parse_bytes)]
    key: Arg,
    /// The result to store (what duplicates get), as text or hex:<hex>.
    #[arg(long, value_parser = parse_bytes)]
    result: Arg,
    #[command(flatten)]
    retention: RetentionArg,
    #[command(flatten)]
    wait: WaitArg,
}

#[derive(Args)]
struct ReleaseArgs {
    #[command(flatten)]
    store: StoreArg,
    /// The consumer id.
    #[arg(value_parser = parse_bytes)]
    consumer: Arg,
    /// The message key.
    #[arg(value_parser = parse_bytes)]
    key: Arg,
    #[command(flatten)]
    retention: RetentionArg,
    #[command(flatten)]
    wait: WaitArg,
}

#[derive(Args)]
struct InvalidateArgs {
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    key: KeyArgs,
    #[command(flatten)]
    wait: WaitArg,
}

#[derive(Args)]
struct PurgeArgs {
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    wait: WaitArg,
}

#[derive(Args)]
struct ExportArgs {
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    scope: ScopeArgs,
    /// Write to this file instead of standard output.
    #[arg(long, short)]
    output: Option<PathBuf>,
}

#[derive(Args)]
struct ImportArgs {
    #[command(flatten)]
    store: StoreArg,
    /// JSON lines made by export; `-` or nothing for standard input. Read whole before
    /// anything is written.
    input: Option<PathBuf>,
    /// Replace records the store already holds (by default they are left alone).
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    wait: WaitArg,
}

/// Why a command failed, and so its exit code.
enum Failure {
    /// From the library; `opening` when the store was being opened.
    Store { error: Error, opening: bool },
    /// Reading input or writing output.
    Io(io::Error),
    /// Malformed input (import lines).
    Input(String),
}

impl From<io::Error> for Failure {
    fn from(error: io::Error) -> Failure {
        Failure::Io(error)
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Failure {
        Failure::Store {
            error,
            opening: false,
        }
    }
}

impl Failure {
    fn opening(error: Error) -> Failure {
        Failure::Store {
            error,
            opening: true,
        }
    }

    fn report(self) -> u8 {
        match self {
            // The reader went away (`idemdb export | head`): nothing left to say.
            Failure::Io(error) if error.kind() == io::ErrorKind::BrokenPipe => EXIT_OK,
            Failure::Io(error) => {
                eprintln!("idemdb: {error}");
                EXIT_STORAGE
            }
            Failure::Input(message) => {
                eprintln!("idemdb: {message}");
                EXIT_USAGE
            }
            Failure::Store {
                error: Error::AlreadyOpen { path },
                ..
            } => {
                eprintln!(
                    "idemdb: store {} is busy: another process (the application?) has it open. \
                     Write commands need it stopped (or --wait DURATION); a running application \
                     can resolve keys itself with Consumer::resolve.",
                    path.display()
                );
                EXIT_BUSY
            }
            Failure::Store {
                error: Error::UnknownTable { name, expected },
                ..
            } => {
                // The library's wording speaks of an engine's declarations; here the tables are
                // the ones found in the store.
                eprintln!("idemdb: the store has no {expected} table {name:?}");
                EXIT_USAGE
            }
            Failure::Store { error, opening } => {
                eprintln!("idemdb: {error}");
                match error {
                    Error::LimitExceeded { .. }
                    | Error::InvalidOption { .. }
                    | Error::UnknownTable { .. } => EXIT_USAGE,
                    _ if opening => EXIT_NOT_A_STORE,
                    _ => EXIT_STORAGE,
                }
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let result = run(cli, &mut out).and_then(|code| {
        out.flush()?;
        Ok(code)
    });
    ExitCode::from(result.unwrap_or_else(Failure::report))
}

fn run(cli: Cli, out: &mut impl Write) -> Result<u8, Failure> {
    let json = cli.json;
    match cli.command {
        Command::Stats(args) => stats(&args, json, out),
        Command::Get(args) => get(&args.store.store, args.key, json, out),
        Command::List(args) => {
            let mut filter = args.scope.filter();
            if let Some(state) = args.state {
                filter = filter.state(state.into());
            }
            if let Some(age) = args.older_than {
                filter = filter.older_than(age);
            }
            list(&args.store.store, &filter, &args.page, false, json, out)
        }
        Command::InProgress(args) => {
            let mut filter = Filter::new()
                .state(EntryState::InProgress)
                .older_than(args.older_than);
            if let Some(consumer) = args.consumer {
                filter = filter.consumer(consumer.0);
            }
            list(&args.store.store, &filter, &args.page, true, json, out)
        }
        Command::Resolve(args) => resolve(
            &args.store.store,
            &args.consumer.0,
            &args.key.0,
            Resolution::Complete(Bytes::from(args.result.0)),
            &args.retention,
            &args.wait,
            json,
            out,
        ),
        Command::Release(args) => resolve(
            &args.store.store,
            &args.consumer.0,
            &args.key.0,
            Resolution::Release,
            &args.retention,
            &args.wait,
            json,
            out,
        ),
        Command::Invalidate(args) => invalidate(&args.store.store, args.key, &args.wait, json, out),
        Command::PurgeExpired(args) => purge_expired(&args.store.store, &args.wait, json, out),
        Command::Export(args) => export(args, out),
        Command::Import(args) => import(&args, json, out),
        Command::Verify(args) => verify(&args, json, out),
    }
}

fn open_read(path: &Path) -> Result<Store, Failure> {
    Store::builder(path)
        .open_read_only()
        .map_err(Failure::opening)
}

/// Opens the store for writing, retrying for up to `wait` while another process holds it.
fn open_write(path: &Path, retention: Option<Duration>, wait: &WaitArg) -> Result<Store, Failure> {
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

fn stats(args: &StoreArg, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    let store = open_read(&args.store)?;
    let stats = store.stats()?;
    let totals = stats.totals();
    if json {
        let groups: Vec<_> = stats
            .groups
            .iter()
            .map(|group| {
                let mut value = counts_json(&group.counts);
                value["table"] = group.table.clone().into();
                value["consumer"] = group.consumer.as_deref().map(printable).into();
                value["consumer_hex"] = group.consumer.as_deref().map(hex).into();
                value["oldest_ms"] = group.oldest_ms.into();
                value
            })
            .collect();
        let tables: Vec<_> = store
            .tables()
            .iter()
            .map(|table| serde_json::json!({"name": table.name, "kind": table.kind.label()}))
            .collect();
        let document = serde_json::json!({
            "store": store.path().display().to_string(),
            "now_ms": stats.now_ms,
            "disk_bytes": stats.disk_bytes,
            "disk_files": stats.disk_files,
            "tables": tables,
            "totals": counts_json(&totals),
            "groups": groups,
        });
        write_json(out, &document)?;
        return Ok(EXIT_OK);
    }
    let tables: Vec<String> = store
        .tables()
        .iter()
        .filter(|table| table.kind != idemdb::admin::TableKind::Internal)
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
    writeln!(out, "records   {}", counts_line(&totals))?;
    writeln!(out, "as of     {}", time(stats.now_ms))?;
    writeln!(out)?;
    if stats.groups.is_empty() {
        writeln!(out, "(no records)")?;
        return Ok(EXIT_OK);
    }
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
    table.write(out, &[2, 3, 4, 5, 6])?;
    Ok(EXIT_OK)
}

fn get(path: &Path, key: KeyArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
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
        write_json(out, &RecordJson::of(&entry, Some(now_ms)))?;
        return Ok(EXIT_OK);
    }
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
            match &record.state {
                RecordState::Completed {
                    committed_at_ms,
                    expires_at_ms,
                    result,
                    succeeded,
                } => {
                    lines.push(("committed", when(now_ms, *committed_at_ms)));
                    lines.push(("expires", when(now_ms, *expires_at_ms)));
                    lines.push(("succeeded", succeeded.to_string()));
                    lines.push(("result", printable(result)));
                }
                RecordState::InProgress {
                    since_ms,
                    lease_until_ms,
                    holder,
                    token,
                } => {
                    lines.push(("holder", printable(holder)));
                    lines.push(("taken", when(now_ms, *since_ms)));
                    lines.push(("lease until", when(now_ms, *lease_until_ms)));
                    lines.push(("token", format!("{token:016x}")));
                }
                RecordState::Released {
                    released_at_ms,
                    removable_at_ms,
                } => {
                    lines.push(("released", when(now_ms, *released_at_ms)));
                    lines.push(("removable", when(now_ms, *removable_at_ms)));
                }
                _ => {}
            }
        }
    }
    for (name, value) in lines {
        writeln!(out, "{name:<12} {value}")?;
    }
    Ok(EXIT_OK)
}

fn list(
    path: &Path,
    filter: &Filter,
    page: &PageArgs,
    in_progress_view: bool,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let store = open_read(path)?;
    let now_ms = store.now_ms();
    let listed = store.list(filter, page.after.as_ref(), page.limit)?;
    if json {
        let entries: Vec<_> = listed
            .entries
            .iter()
            .map(|entry| RecordJson::of(entry, Some(now_ms)))
            .collect();
        let next = listed.next.as_ref().map(ToString::to_string);
        write_json(out, &serde_json::json!({"entries": entries, "next": next}))?;
        return Ok(EXIT_OK);
    }
    if listed.entries.is_empty() {
        writeln!(out, "(no records)")?;
        return Ok(EXIT_OK);
    }
    let with_table = listed.entries.iter().any(|entry| entry.consumer.is_none());
    let mut table = if in_progress_view {
        TextTable::new(&["CONSUMER", "KEY", "EPOCH", "HOLDER", "TAKEN", "LEASE"])
    } else if with_table {
        TextTable::new(&[
            "TABLE", "CONSUMER", "KEY", "STATE", "EPOCH", "SINCE", "DETAIL",
        ])
    } else {
        TextTable::new(&["CONSUMER", "KEY", "STATE", "EPOCH", "SINCE", "DETAIL"])
    };
    for entry in &listed.entries {
        let consumer = consumer_label(entry.consumer.as_deref(), &entry.table);
        let epoch = entry
            .record
            .as_ref()
            .map_or_else(|_| "-".to_owned(), |record| record.epoch.to_string());
        if in_progress_view {
            if let Ok(Record {
                state:
                    RecordState::InProgress {
                        since_ms,
                        lease_until_ms,
                        holder,
                        ..
                    },
                ..
            }) = &entry.record
            {
                let lease = if *lease_until_ms <= now_ms {
                    format!("expired {}", age(now_ms, *lease_until_ms))
                } else {
                    format!("runs {}", age(now_ms, *lease_until_ms))
                };
                table.row(vec![
                    consumer,
                    printable(&entry.key),
                    epoch,
                    cut(&printable(holder)),
                    age(now_ms, *since_ms),
                    lease,
                ]);
            }
            continue;
        }
        let since = entry
            .since_ms()
            .map_or_else(|| "-".to_owned(), |since_ms| age(now_ms, since_ms));
        let mut row = Vec::with_capacity(7);
        if with_table {
            row.push(entry.table.clone());
        }
        row.extend([
            consumer,
            printable(&entry.key),
            entry.state_at(now_ms).to_string(),
            epoch,
            since,
            detail(entry, now_ms),
        ]);
        table.row(row);
    }
    let epoch_column = if in_progress_view {
        2
    } else {
        usize::from(with_table) + 3
    };
    table.write(out, &[epoch_column])?;
    if let Some(next) = &listed.next {
        writeln!(out, "more: --after {next}")?;
    }
    Ok(EXIT_OK)
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

#[allow(clippy::too_many_arguments)]
fn resolve(
    path: &Path,
    consumer: &[u8],
    key: &[u8],
    resolution: Resolution,
    retention: &RetentionArg,
    wait: &WaitArg,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let store = open_write(path, Some(retention.retention), wait)?;
    let action = match &resolution {
        Resolution::Complete(_) => "completed",
        _ => "released",
    };
    match store.resolve(consumer, key, resolution) {
        Ok(()) => {
            if json {
                write_json(
                    out,
                    &serde_json::json!({
                        "consumer": printable(consumer),
                        "key": printable(key),
                        "resolved": action,
                    }),
                )?;
            } else {
                writeln!(out, "{} {}: {action}", printable(consumer), printable(key))?;
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

fn invalidate(
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
                write_json(
                    out,
                    &serde_json::json!({"key": printable(&key), "invalidated_epoch": epoch}),
                )?;
            } else {
                writeln!(
                    out,
                    "{}: invalidated (epoch {epoch}); its next delivery is processed again, at \
                     epoch {}",
                    printable(&key),
                    epoch + 1
                )?;
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

fn purge_expired(
    path: &Path,
    wait: &WaitArg,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let store = open_write(path, None, wait)?;
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
    let report = store.purge_expired(|table, index, count| {
        bar.set_length(count as u64);
        bar.set_position(index as u64);
        bar.set_message(table.to_owned());
    });
    bar.finish_and_clear();
    let report = report?;
    if json {
        write_json(
            out,
            &serde_json::json!({
                "before": counts_json(&report.before),
                "after": counts_json(&report.after),
            }),
        )?;
    } else {
        writeln!(out, "before  {}", counts_line(&report.before))?;
        writeln!(out, "after   {}", counts_line(&report.after))?;
    }
    Ok(EXIT_OK)
}

fn export(args: ExportArgs, out: &mut impl Write) -> Result<u8, Failure> {
    let store = open_read(&args.store.store)?;
    let filter = args.scope.filter();
    let mut file = match &args.output {
        Some(path) => Some(BufWriter::new(File::create(path)?)),
        None => None,
    };
    let writer: &mut dyn Write = match &mut file {
        Some(file) => file,
        None => out,
    };
    let mut failed: Option<io::Error> = None;
    let mut skipped = 0u64;
    store.scan(&filter, None, |entry| {
        if let Err(reason) = &entry.record {
            skipped += 1;
            eprintln!(
                "idemdb: skipped corrupt entry: table {}, consumer {}, key {}: {reason}",
                entry.table,
                consumer_label(entry.consumer.as_deref(), &entry.table),
                printable(&entry.key)
            );
            return ControlFlow::Continue(());
        }
        let line = serde_json::to_writer(&mut *writer, &RecordJson::of(&entry, None))
            .map_err(io::Error::from)
            .and_then(|()| writer.write_all(b"\n"));
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
    writer.flush()?;
    Ok(if skipped == 0 { EXIT_OK } else { EXIT_PROBLEM })
}

fn import(args: &ImportArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    // Parse everything first: malformed input writes nothing.
    let input: Box<dyn BufRead> = match &args.input {
        Some(path) if path.as_os_str() != "-" => Box::new(io::BufReader::new(File::open(path)?)),
        _ => Box::new(io::stdin().lock()),
    };
    let mut records = Vec::new();
    for (index, line) in input.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str::<RecordJson>(&line)
            .map_err(|error| error.to_string())
            .and_then(RecordJson::into_import)
            .map_err(|reason| Failure::Input(format!("import line {}: {reason}", index + 1)))?;
        records.push(record);
    }
    let store = open_write(&args.store.store, None, &args.wait)?;
    let counts = store.import(&records, args.overwrite)?;
    if json {
        write_json(
            out,
            &serde_json::json!({
                "imported": counts.imported,
                "overwritten": counts.overwritten,
                "skipped": counts.skipped,
            }),
        )?;
    } else {
        writeln!(
            out,
            "imported {}, overwritten {}, skipped {} (already present{})",
            counts.imported,
            counts.overwritten,
            counts.skipped,
            if args.overwrite {
                ""
            } else {
                "; --overwrite replaces them"
            }
        )?;
    }
    Ok(if counts.skipped == 0 {
        EXIT_OK
    } else {
        EXIT_PROBLEM
    })
}

fn verify(args: &StoreArg, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    let store = open_read(&args.store)?;
    let report = store.verify()?;
    let located = |table: &str, stored_key: &[u8]| -> (Option<String>, String) {
        match decode_key(stored_key) {
            Ok((consumer, key)) if table == "idemdb.records" => {
                (Some(printable(consumer)), printable(key))
            }
            _ => (None, printable(stored_key)),
        }
    };
    if json {
        let problems: Vec<_> = report
            .problems
            .iter()
            .map(|problem| {
                let (consumer, key) = located(&problem.table, &problem.stored_key);
                serde_json::json!({
                    "table": problem.table,
                    "consumer": consumer,
                    "key": key,
                    "stored_key_hex": hex(&problem.stored_key),
                    "reason": problem.reason.to_string(),
                })
            })
            .collect();
        write_json(
            out,
            &serde_json::json!({
                "checked": report.checked,
                "problems_total": report.problems_total,
                "problems": problems,
            }),
        )?;
    } else {
        let mut table = TextTable::new(&["TABLE", "CONSUMER", "KEY", "PROBLEM"]);
        for problem in &report.problems {
            let (consumer, key) = located(&problem.table, &problem.stored_key);
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
        )?;
    }
    Ok(if report.problems_total == 0 {
        EXIT_OK
    } else {
        EXIT_PROBLEM
    })
}

/// One record as JSON: an `export` line (read back by `import`, from the exact `*_hex` fields),
/// or a `get` / `list` entry (with `status`; corrupt entries with `error`).
#[derive(Serialize, Deserialize)]
struct RecordJson {
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
    fn of(entry: &Entry, now_ms: Option<u64>) -> RecordJson {
        let mut json = RecordJson {
            table: entry.table.clone(),
            consumer: entry.consumer.as_deref().map(printable),
            consumer_hex: entry.consumer.as_deref().map(hex),
            key: printable(&entry.key),
            key_hex: hex(&entry.key),
            status: now_ms.map(|now_ms| entry.state_at(now_ms).to_string()),
            state: String::new(),
            epoch: None,
            fingerprint: None,
            committed_at_ms: None,
            expires_at_ms: None,
            succeeded: None,
            result: None,
            result_hex: None,
            since_ms: None,
            lease_until_ms: None,
            holder: None,
            holder_hex: None,
            token: None,
            released_at_ms: None,
            removable_at_ms: None,
            error: None,
        };
        let record = match &entry.record {
            Ok(record) => record,
            Err(reason) => {
                json.state = "corrupt".to_owned();
                json.error = Some(reason.to_string());
                return json;
            }
        };
        json.epoch = Some(record.epoch);
        json.fingerprint = Some(record.fingerprint.to_string());
        match &record.state {
            RecordState::Completed {
                committed_at_ms,
                expires_at_ms,
                result,
                succeeded,
            } => {
                json.state = "completed".to_owned();
                json.committed_at_ms = Some(*committed_at_ms);
                json.expires_at_ms = Some(*expires_at_ms);
                json.succeeded = Some(*succeeded);
                json.result = Some(printable(result));
                json.result_hex = Some(hex(result));
            }
            RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                token,
            } => {
                json.state = "in_progress".to_owned();
                json.since_ms = Some(*since_ms);
                json.lease_until_ms = Some(*lease_until_ms);
                json.holder = Some(printable(holder));
                json.holder_hex = Some(hex(holder));
                json.token = Some(*token);
            }
            RecordState::Released {
                released_at_ms,
                removable_at_ms,
            } => {
                json.state = "released".to_owned();
                json.released_at_ms = Some(*released_at_ms);
                json.removable_at_ms = Some(*removable_at_ms);
            }
            // A state this CLI does not know (a newer library): say so rather than guess.
            _ => json.state = "unknown".to_owned(),
        }
        json
    }

    /// The record an export line describes, from its exact fields (`*_hex`, numbers).
    fn into_import(self) -> Result<ImportRecord, String> {
        fn field<T>(value: Option<T>, name: &str) -> Result<T, String> {
            value.ok_or_else(|| format!("missing {name:?}"))
        }
        fn bytes(value: Option<String>, name: &str) -> Result<Bytes, String> {
            unhex(&field(value, name)?)
                .map(Bytes::from)
                .ok_or_else(|| format!("{name:?} is not hex"))
        }
        let key = unhex(&self.key_hex).ok_or("\"key_hex\" is not hex")?;
        let consumer = match self.consumer_hex {
            Some(consumer) => Some(unhex(&consumer).ok_or("\"consumer_hex\" is not hex")?),
            None => None,
        };
        let epoch = field(self.epoch, "epoch")?;
        let fingerprint = field(self.fingerprint, "fingerprint")?;
        let fingerprint = (fingerprint.len() == 32
            && fingerprint.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| u128::from_str_radix(&fingerprint, 16).ok())
        .flatten()
        .map(Fingerprint::from_u128)
        .ok_or("\"fingerprint\" is not 32 hex digits")?;
        let state = match self.state.as_str() {
            "completed" => RecordState::Completed {
                committed_at_ms: field(self.committed_at_ms, "committed_at_ms")?,
                expires_at_ms: field(self.expires_at_ms, "expires_at_ms")?,
                result: bytes(self.result_hex, "result_hex")?,
                succeeded: field(self.succeeded, "succeeded")?,
            },
            "in_progress" => RecordState::InProgress {
                since_ms: field(self.since_ms, "since_ms")?,
                lease_until_ms: field(self.lease_until_ms, "lease_until_ms")?,
                holder: bytes(self.holder_hex, "holder_hex")?,
                token: field(self.token, "token")?,
            },
            "released" => RecordState::Released {
                released_at_ms: field(self.released_at_ms, "released_at_ms")?,
                removable_at_ms: field(self.removable_at_ms, "removable_at_ms")?,
            },
            other => return Err(format!("state {other:?} cannot be imported")),
        };
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
}

fn counts_json(counts: &StateCounts) -> serde_json::Value {
    serde_json::json!({
        "live": counts.live,
        "expired": counts.expired,
        "in_progress": counts.in_progress,
        "released": counts.released,
        "corrupt": counts.corrupt,
        "total": counts.total(),
    })
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

fn write_json(out: &mut impl Write, value: &impl Serialize) -> Result<(), Failure> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(io::Error::from)?;
    writeln!(out)?;
    Ok(())
}

/// The consumer column: the consumer, or `-` for an entity table's record (and `?` for a
/// consumers' table key that does not decode).
fn consumer_label(consumer: Option<&[u8]>, table: &str) -> String {
    match consumer {
        Some(consumer) => printable(consumer),
        None if table == "idemdb.records" => "?".to_owned(),
        None => "-".to_owned(),
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

fn when(now_ms: u64, ms: u64) -> String {
    if ms == idemdb::EXPIRES_NEVER_MS {
        return "never".to_owned();
    }
    format!("{} ({})", time(ms), age(now_ms, ms))
}

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

fn cut(text: &str) -> String {
    if text.chars().count() <= DETAIL_CHARS_MAX {
        return text.to_owned();
    }
    let kept: String = text.chars().take(DETAIL_CHARS_MAX - 3).collect();
    format!("{kept}...")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    // from_str_radix alone would also take a sign ("+f").
    if !text.len().is_multiple_of(2) || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).ok())
        .collect()
}

/// Bytes given on the command line (a newtype: clap reads a `Vec<u8>` field as many `u8`s).
#[derive(Clone)]
struct Arg(Vec<u8>);

/// A key (or consumer id, or result) on the command line: `hex:<hex>`, `text:<text>`, or text.
fn parse_bytes(text: &str) -> Result<Arg, String> {
    if let Some(digits) = text.strip_prefix("hex:") {
        return unhex(digits)
            .map(Arg)
            .ok_or_else(|| format!("{digits:?} is not an even number of hex digits"));
    }
    Ok(Arg(text
        .strip_prefix("text:")
        .unwrap_or(text)
        .as_bytes()
        .to_vec()))
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|error| error.to_string())
}

fn parse_cursor(text: &str) -> Result<Cursor, String> {
    Cursor::parse(text).map_err(|error| error.to_string())
}

/// Exits with clap's usage error (code 2).
fn usage_error(message: &str) -> ! {
    Cli::command()
        .error(clap::error::ErrorKind::WrongNumberOfValues, message)
        .exit()
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
