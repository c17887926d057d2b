//! `idemdb-pg`: moves idemdb's dedup memory in and out of PostgreSQL as the export lines of
//! `idemdb export` / `idemdb import`, so a store moves from one machine's embedded store to
//! PostgreSQL and back; installs the tables, removes expired records, and lists and resets
//! log consumers' read positions. `idemdb-pg --help` says how.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Write};
use std::process::ExitCode;

use idemdb::Position;
use idemdb_postgres::{Error, ExportReport, Names, POSITION_OFFSET_MAX, PgStore, Removal, install};
use tokio_postgres::{Client, NoTls};

const HELP: &str = "\
idemdb-pg: idemdb's records in PostgreSQL, exported and imported as export lines

USAGE:
    idemdb-pg export [OPTIONS] [--consumer ID] [-o FILE]
    idemdb-pg import [OPTIONS] [--overwrite] [FILE | -]
    idemdb-pg install [OPTIONS]
    idemdb-pg maintain [OPTIONS] [--busy-percent N]
    idemdb-pg positions list [OPTIONS] --consumer ID
    idemdb-pg positions set [OPTIONS] --consumer ID SOURCE PARTITION OFFSET
    idemdb-pg positions remove [OPTIONS] --consumer ID SOURCE PARTITION

The lines are those `idemdb export` writes and `idemdb import` reads (one JSON object per line,
bytes as exact hex), so a store moves either way:

    idemdb export STORE > lines.jsonl && idemdb-pg import < lines.jsonl
    idemdb-pg export > lines.jsonl && idemdb import NEW_STORE lines.jsonl

(NEW_STORE made by the application, which declares its tables, and stopped.)

export   every record (of one consumer with --consumer), in the order `idemdb export` writes
         them: by consumer id (shorter first), then by key; then every read position of a log
         consumer, as a position line (kind \"position\"). One snapshot; claims go on.
import   reads every line and checks it before anything is written. A key that holds a record
         keeps it (counted as skipped) unless --overwrite. Records are written as they are
         (epochs, timestamps, in-progress leases and tokens), in transactions under each key's
         lock, so a claim running meanwhile is never doubled. PostgreSQL keeps consumers'
         records only: a line of an embedded store's entity table is refused. Read positions
         are written after the records, with their offsets and times, forward only: one
         stored at or ahead of the imported one stays (counted as skipped) unless
         --overwrite, which sets each as `positions set` does. An offset past
         9223372036854775807 is refused.
install  creates the tables (as idemdb_postgres::install does), if they are missing, or
         migrates older ones.
maintain deletes the records that have expired (as PgStore::maintain does: oldest first, in
         batches of 1,000 rows, each its own transaction) and prints how many. It keeps a
         batch running --busy-percent of the time, a whole number from 1 to 100 (default
         10, as Removal::busy_percent; 100 runs the batches back to back), and waits the
         rest.
positions
         a log consumer's read positions (PgConsumer::positions): where it resumes each
         partition of each source (a topic, a stream) it reads.
         list    every position of the consumer: source, partition, offset (the last
                 message committed), where it resumes (offset + 1), when it was written.
         set     sets the position of PARTITION (0 to 4294967295) of SOURCE to OFFSET (0 to
                 9223372036854775807), forwards or backwards: the consumer resumes at
                 OFFSET + 1 when it next starts (to read again from offset N, set N - 1).
         remove  removes the position: the consumer starts the partition without one (at
                 its beginning, as it chooses). Exits with 1 when there was none.
         Stop the consumer's processes before set or remove: a running one goes on from
         where it is, and its next commit moves the position forward again (after a set
         backwards) or is refused as behind it (after a set forwards).

OPTIONS:
    --url URL        the connection (libpq keywords or postgresql://...; no TLS);
                     default: the environment variable IDEMDB_PG_URL
    --schema NAME    the tables' schema (default idemdb)
    --table NAME     the records table (default records)

EXIT CODES:
    0  done
    1  done, with records left alone: import skipped keys that held a record, or read
       positions at or ahead of the imported ones (no --overwrite);
       export left out rows that do not decode (named on standard error); positions remove
       found no position to remove
    2  bad usage or input: nothing was written
    4  the database or a file failed
";

const EXIT_PROBLEM: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_FAILED: u8 = 4;

/// The parsed command line.
struct Args {
    command: String,
    url: Option<String>,
    schema: String,
    table: String,
    consumer: Option<String>,
    output: Option<String>,
    input: Option<String>,
    overwrite: bool,
    /// `maintain --busy-percent`, checked to be within 1..=100.
    busy_percent: Option<u8>,
    /// `positions`: what to do, with its checked arguments.
    positions: Option<PositionsCommand>,
}

/// `positions list`, `set` and `remove`, their arguments checked.
enum PositionsCommand {
    List,
    Set {
        source: String,
        partition: u32,
        offset: u64,
    },
    Remove {
        source: String,
        partition: u32,
    },
}

fn parse_args(mut words: impl Iterator<Item = String>) -> Result<Args, String> {
    let command = words.next().ok_or("no command given")?;
    if !["export", "import", "install", "maintain", "positions"].contains(&command.as_str()) {
        return Err(format!("unknown command {command:?}"));
    }
    // `positions` names what to do first, then takes the options anywhere.
    let action = if command == "positions" {
        let action = words.next().ok_or("positions needs list, set or remove")?;
        if !["list", "set", "remove"].contains(&action.as_str()) {
            return Err(format!(
                "unknown positions command {action:?}: list, set or remove"
            ));
        }
        Some(action)
    } else {
        None
    };
    let mut args = Args {
        command,
        url: std::env::var("IDEMDB_PG_URL").ok(),
        schema: "idemdb".to_owned(),
        table: "records".to_owned(),
        consumer: None,
        output: None,
        input: None,
        overwrite: false,
        busy_percent: None,
        positions: None,
    };
    let takes_consumer = matches!(args.command.as_str(), "export" | "positions");
    let mut operands = Vec::new();
    while let Some(word) = words.next() {
        let mut value = |name: &str| words.next().ok_or(format!("{name} needs a value"));
        match word.as_str() {
            "--url" => args.url = Some(value("--url")?),
            "--schema" => args.schema = value("--schema")?,
            "--table" => args.table = value("--table")?,
            "--consumer" if takes_consumer => args.consumer = Some(value("--consumer")?),
            "-o" | "--output" if args.command == "export" => args.output = Some(value("-o")?),
            "--overwrite" if args.command == "import" => args.overwrite = true,
            "--busy-percent" if args.command == "maintain" => {
                args.busy_percent = Some(busy_percent(&value("--busy-percent")?)?);
            }
            other
                if args.command == "import" && args.input.is_none() && !other.starts_with("--") =>
            {
                args.input = Some(other.to_owned());
            }
            other if action.is_some() && !other.starts_with("--") => {
                operands.push(other.to_owned());
            }
            other => {
                return Err(format!(
                    "unexpected argument {other:?} for {}",
                    args.command
                ));
            }
        }
    }
    if let Some(action) = action {
        if args.consumer.is_none() {
            return Err(format!("positions {action} needs --consumer ID"));
        }
        args.positions = Some(positions_command(&action, operands)?);
    }
    Ok(args)
}

/// `--busy-percent`: a whole number from 1 to 100 (refused, not clamped as
/// `Removal::busy_percent` clamps: an operator who typed 0 or 500 meant something else).
fn busy_percent(word: &str) -> Result<u8, String> {
    match word.parse::<u8>() {
        Ok(percent @ 1..=100) => Ok(percent),
        _ => Err(format!(
            "--busy-percent takes a whole number from 1 to 100, not {word:?}"
        )),
    }
}

/// The operands of `positions <action>`: none for `list`, SOURCE PARTITION for `remove`, and
/// OFFSET after them for `set`, each checked.
fn positions_command(action: &str, operands: Vec<String>) -> Result<PositionsCommand, String> {
    let wanted = match action {
        "list" => "",
        "remove" => " SOURCE PARTITION",
        _ => " SOURCE PARTITION OFFSET",
    };
    let count = wanted.split_whitespace().count();
    if operands.len() != count {
        return Err(format!(
            "positions {action} takes{} (got {})",
            if count == 0 { " no operands" } else { wanted },
            if operands.is_empty() {
                "none".to_owned()
            } else {
                format!("{operands:?}")
            }
        ));
    }
    let mut operands = operands.into_iter();
    let (Some(source), Some(partition)) = (operands.next(), operands.next()) else {
        return Ok(PositionsCommand::List);
    };
    if source.is_empty() {
        return Err("SOURCE is empty: name the topic or stream".to_owned());
    }
    let partition = partition.parse::<u32>().map_err(|_| {
        format!(
            "PARTITION takes a whole number from 0 to {}, not {partition:?}",
            u32::MAX
        )
    })?;
    let Some(offset) = operands.next() else {
        return Ok(PositionsCommand::Remove { source, partition });
    };
    let offset = match offset.parse::<u64>() {
        Ok(value) if value <= POSITION_OFFSET_MAX => value,
        _ => {
            return Err(format!(
                "OFFSET takes a whole number from 0 to {POSITION_OFFSET_MAX}, not {offset:?}"
            ));
        }
    };
    Ok(PositionsCommand::Set {
        source,
        partition,
        offset,
    })
}

fn main() -> ExitCode {
    let words: Vec<String> = std::env::args().skip(1).collect();
    if words.is_empty() || words.iter().any(|word| word == "--help" || word == "-h") {
        print!("{HELP}");
        return ExitCode::from(if words.is_empty() { EXIT_USAGE } else { 0 });
    }
    let args = match parse_args(words.into_iter()) {
        Ok(args) => args,
        Err(why) => {
            eprintln!("idemdb-pg: {why} (see idemdb-pg --help)");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idemdb-pg: cannot start the runtime: {error}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    match runtime.block_on(run(&args)) {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            // With the causes: a database error says only "db error" by itself.
            let mut why = error.to_string();
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                why = format!("{why}: {cause}");
                source = cause.source();
            }
            eprintln!("idemdb-pg: {why}");
            let code = match error {
                Error::Idemdb(_)
                | Error::InvalidName { .. }
                | Error::ImportInput(_)
                | Error::NotImportable { .. } => EXIT_USAGE,
                _ => EXIT_FAILED,
            };
            ExitCode::from(code)
        }
    }
}

async fn run(args: &Args) -> Result<u8, Error> {
    let names = Names::new(&args.schema, &args.table)?;
    let Some(url) = &args.url else {
        eprintln!("idemdb-pg: no connection: give --url or set IDEMDB_PG_URL");
        return Ok(EXIT_USAGE);
    };
    let mut client = connect(url).await?;
    if args.command == "install" {
        install(&mut client, &names).await?;
        return Ok(0);
    }
    let store = PgStore::builder().names(names).open(&client).await?;
    if args.command == "maintain" {
        let busy_percent = args.busy_percent.unwrap_or(BUSY_PERCENT_DEFAULT);
        let removal = Removal::default().busy_percent(busy_percent);
        let done = store.maintain_with(&client, removal).await?;
        println!(
            "removed {} expired records in {} batches, busy {busy_percent}% of the time",
            done.removed, done.batches
        );
        return Ok(0);
    }
    if let (Some(command), Some(consumer)) = (&args.positions, &args.consumer) {
        return positions(&client, &store, consumer, command).await;
    }
    if args.command == "export" {
        let mut out: Box<dyn Write> = match &args.output {
            Some(path) => Box::new(BufWriter::new(
                File::create(path).map_err(Error::ExportOutput)?,
            )),
            None => Box::new(BufWriter::new(io::stdout().lock())),
        };
        let report = match &args.consumer {
            Some(consumer) => store.consumer(consumer)?.export(&client, &mut out).await?,
            None => store.export(&client, &mut out).await?,
        };
        return Ok(export_code(&report));
    }
    let counts = match args.input.as_deref() {
        Some(path) if path != "-" => {
            let file = File::open(path)
                .map_err(|error| Error::ImportInput(idemdb::transfer::ReadError::Io(error)))?;
            store
                .import_lines(&mut client, BufReader::new(file), args.overwrite)
                .await?
        }
        _ => {
            store
                .import_lines(&mut client, io::stdin().lock(), args.overwrite)
                .await?
        }
    };
    println!(
        "imported {}, overwritten {}, skipped {}",
        counts.imported, counts.overwritten, counts.skipped
    );
    let moved = &counts.positions;
    println!(
        "read positions: imported {}, advanced {}, overwritten {}, skipped {}",
        moved.imported, moved.advanced, moved.overwritten, moved.skipped
    );
    Ok(if counts.skipped == 0 && moved.skipped == 0 {
        0
    } else {
        EXIT_PROBLEM
    })
}

/// `maintain`'s share of the time without `--busy-percent`: `Removal`'s default.
const BUSY_PERCENT_DEFAULT: u8 = 10;

/// `positions list`, `set` and `remove` for `consumer`.
async fn positions(
    client: &Client,
    store: &PgStore,
    consumer: &str,
    command: &PositionsCommand,
) -> Result<u8, Error> {
    let positions = store.consumer(consumer)?.positions();
    let label = |source: &str, partition: u32| format!("{consumer} {source} partition {partition}");
    let was = |previous: &Option<Position>| {
        previous.as_ref().map_or("none".to_owned(), |position| {
            format!("offset {}", position.offset)
        })
    };
    match command {
        PositionsCommand::List => {
            let listed = positions.list(client).await?;
            print!("{}", positions_table(consumer, &listed));
            Ok(0)
        }
        PositionsCommand::Set {
            source,
            partition,
            offset,
        } => {
            let previous = positions.set(client, source, *partition, *offset).await?;
            println!(
                "{}: offset {offset} (was {}); the consumer resumes at {} when it next starts",
                label(source, *partition),
                was(&previous),
                offset.saturating_add(1)
            );
            Ok(0)
        }
        PositionsCommand::Remove { source, partition } => {
            let previous = positions.remove(client, source, *partition).await?;
            if previous.is_none() {
                println!(
                    "{}: no position stored, nothing removed",
                    label(source, *partition)
                );
                return Ok(EXIT_PROBLEM);
            }
            println!(
                "{}: removed (was {}); the consumer starts without a position",
                label(source, *partition),
                was(&previous)
            );
            Ok(0)
        }
    }
}

/// `positions list`: a line per position under a header, columns aligned; a sentence when
/// there is none.
fn positions_table(consumer: &str, listed: &[Position]) -> String {
    if listed.is_empty() {
        return format!("no read positions for consumer {consumer}\n");
    }
    let mut rows = vec![[
        "SOURCE".to_owned(),
        "PARTITION".to_owned(),
        "OFFSET".to_owned(),
        "RESUME AT".to_owned(),
        "UPDATED AT (MS)".to_owned(),
    ]];
    for position in listed {
        rows.push([
            position.source.clone(),
            position.partition.to_string(),
            position.offset.to_string(),
            position.next_offset().to_string(),
            position.updated_at_ms.to_string(),
        ]);
    }
    let mut widths = [0; 5];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// Names the rows an export left out; 1 when there were any.
fn export_code(report: &ExportReport) -> u8 {
    for row in &report.corrupt {
        eprintln!(
            "idemdb-pg: skipped a record that does not decode: consumer {}, key {}: {}",
            idemdb::format::printable(&row.consumer),
            idemdb::format::printable(&row.key),
            row.detail
        );
    }
    if report.corrupt.is_empty() {
        0
    } else {
        EXIT_PROBLEM
    }
}

async fn connect(url: &str) -> Result<Client, Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            eprintln!("idemdb-pg: connection: {error}");
        }
    });
    Ok(client)
}
