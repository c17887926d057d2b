//! `idemdb-pg`: moves idemdb's dedup memory in and out of PostgreSQL as the export lines of
//! `idemdb export` / `idemdb import`, so a store moves from one machine's embedded store to
//! PostgreSQL and back. `idemdb-pg --help` says how.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Write};
use std::process::ExitCode;

use idemdb_postgres::{Error, ExportReport, Names, PgStore, install};
use tokio_postgres::{Client, NoTls};

const HELP: &str = "\
idemdb-pg: idemdb's records in PostgreSQL, exported and imported as export lines

USAGE:
    idemdb-pg export [OPTIONS] [--consumer ID] [-o FILE]
    idemdb-pg import [OPTIONS] [--overwrite] [FILE | -]
    idemdb-pg install [OPTIONS]
    idemdb-pg maintain [OPTIONS]

The lines are those `idemdb export` writes and `idemdb import` reads (one JSON object per line,
bytes as exact hex), so a store moves either way:

    idemdb export STORE > lines.jsonl && idemdb-pg import < lines.jsonl
    idemdb-pg export > lines.jsonl && idemdb import NEW_STORE lines.jsonl

export   every record (of one consumer with --consumer), in the order `idemdb export` writes
         them: by consumer id (shorter first), then by key. One snapshot; claims go on.
import   reads every line and checks it before anything is written. A key that holds a record
         keeps it (counted as skipped) unless --overwrite. Records are written as they are
         (epochs, timestamps, in-progress leases and tokens), in transactions under each key's
         lock, so a claim running meanwhile is never doubled. PostgreSQL keeps consumers'
         records only: a line of an embedded store's entity table is refused.
install  creates the tables (as idemdb_postgres::install does), if they are missing, or
         migrates older ones.
maintain deletes the records that have expired (as PgStore::maintain does: oldest first, in
         batches of 1,000 rows, each its own transaction, busy a tenth of the time) and
         prints how many.

OPTIONS:
    --url URL        the connection (libpq keywords or postgresql://...; no TLS);
                     default: the environment variable IDEMDB_PG_URL
    --schema NAME    the tables' schema (default idemdb)
    --table NAME     the records table (default records)

EXIT CODES:
    0  done
    1  done, with records left alone: import skipped keys that held a record (no --overwrite);
       export left out rows that do not decode (named on standard error)
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
}

fn parse_args(mut words: impl Iterator<Item = String>) -> Result<Args, String> {
    let command = words.next().ok_or("no command given")?;
    if !["export", "import", "install", "maintain"].contains(&command.as_str()) {
        return Err(format!("unknown command {command:?}"));
    }
    let mut args = Args {
        command,
        url: std::env::var("IDEMDB_PG_URL").ok(),
        schema: "idemdb".to_owned(),
        table: "records".to_owned(),
        consumer: None,
        output: None,
        input: None,
        overwrite: false,
    };
    while let Some(word) = words.next() {
        let mut value = |name: &str| words.next().ok_or(format!("{name} needs a value"));
        match word.as_str() {
            "--url" => args.url = Some(value("--url")?),
            "--schema" => args.schema = value("--schema")?,
            "--table" => args.table = value("--table")?,
            "--consumer" if args.command == "export" => args.consumer = Some(value("--consumer")?),
            "-o" | "--output" if args.command == "export" => args.output = Some(value("-o")?),
            "--overwrite" if args.command == "import" => args.overwrite = true,
            other
                if args.command == "import" && args.input.is_none() && !other.starts_with("--") =>
            {
                args.input = Some(other.to_owned());
            }
            other => {
                return Err(format!(
                    "unexpected argument {other:?} for {}",
                    args.command
                ));
            }
        }
    }
    Ok(args)
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
        let done = store.maintain(&client).await?;
        println!(
            "removed {} expired records in {} batches",
            done.removed, done.batches
        );
        return Ok(0);
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
    Ok(if counts.skipped == 0 { 0 } else { EXIT_PROBLEM })
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
