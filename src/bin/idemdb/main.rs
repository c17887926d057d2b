//! `idemdb`: the operator CLI. Parses arguments, calls [`idemdb::admin`], prints tables (or
//! JSON with `--json`). Every rule about what may be read or written lives in the library.
//!
//! This file dispatches the commands and maps their failures to the documented exit codes;
//! `args` defines the command line, `read` and `repair` run the read and the write commands,
//! `backup` the backup and the restore, `positions` the log consumers' read positions, `json` and `render` print what they found.

mod args;
mod backup;
mod json;
mod positions;
mod read;
mod render;
mod repair;

use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use bytes::Bytes;
use clap::Parser;
use idemdb::{Error, Resolution};

use crate::args::{Cli, Command};

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

/// Why a command failed, and so its exit code.
enum Failure {
    /// From the library; `opening` when the store was being opened.
    Store { error: Error, opening: bool },
    /// Another process has the directory at `path` open; `remedy` says what to do instead.
    Busy { path: PathBuf, remedy: &'static str },
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
            } => Failure::Busy {
                path,
                remedy: "Write commands need it stopped (or --wait DURATION); a running \
                         application can resolve keys itself with Consumer::resolve.",
            }
            .report(),
            Failure::Busy { path, remedy } => {
                eprintln!(
                    "idemdb: store {} is busy: another process (the application?) has it open. \
                     {remedy}",
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
                    | Error::InvalidArgument { .. }
                    | Error::ReadOnly
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
        Command::Stats(args) => read::stats(&args, json, out),
        Command::Get(args) => read::get(&args.store.store, args.key, json, out),
        Command::List(args) => read::list(&args, json, out),
        Command::InProgress(args) => read::in_progress(&args, json, out),
        Command::Export(args) => read::export(&args, out),
        Command::Verify(args) => read::verify(&args, json, out),
        Command::Resolve(args) => {
            let result = Resolution::Complete(Bytes::from(args.result.0));
            repair::resolve(&args.held, result, &args.open, json, out)
        }
        Command::Release(args) => {
            repair::resolve(&args.held, Resolution::Release, &args.open, json, out)
        }
        Command::Invalidate(args) => {
            repair::invalidate(&args.store.store, args.key, &args.wait, json, out)
        }
        Command::PurgeExpired(args) => {
            repair::purge_expired(&args.store.store, &args.wait, json, out)
        }
        Command::Import(args) => repair::import(&args, json, out),
        Command::Backup(args) => backup::backup(&args, json, out),
        Command::Restore(args) => backup::restore(&args, json, out),
        Command::Positions(command) => positions::run(command, json, out),
    }
}
