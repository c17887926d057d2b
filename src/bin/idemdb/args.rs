//! The command line: clap's definitions of every command and argument, the help texts, and the
//! parsers of keys, durations and cursors.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use idemdb::admin::{Cursor, EntryState, Filter, Target};

const ABOUT: &str = "Inspect, repair, back up and restore an idemdb store";

const LONG_ABOUT: &str = "\
Inspect, repair, back up and restore an idemdb store (a RocksDB directory written by the
idemdb library).

Read commands (stats, get, list, in-progress, export, verify, positions list) open the store
read-only: they
take no lock and work while the application has the store open, seeing what its files and WAL
hold at that moment. Write commands (resolve, release, invalidate, purge-expired, import,
positions set and remove) need
the store to themselves: RocksDB admits one writing process, so on a live store they exit with
code 3 and write nothing. Stop the application first (--wait DURATION retries while it shuts
down), or make the change from inside the running application with the library
(Consumer::in_progress, Consumer::resolve).

Backups: `backup STORE DIR` copies a stopped store (an offline backup; like the write commands
it exits with code 3 on a live store). A running application takes online backups itself with
Engine::checkpoint. On the store's file system the backup's table files are hard links (fast,
but on the same disk); elsewhere every byte is copied, with a progress bar. `restore BACKUP
STORE` copies a backup (from either) into a new store directory, which the application then
opens with its usual declaration. A restored store lacks every commit made after its backup:
those messages are processed again when redelivered, unless the admission floor refuses them.
Neither command writes into the backup, nor over an existing directory.

Keys: UTF-8 text as typed, `hex:<hex digits>` for binary keys, `text:<key>` for a text key that
starts with `hex:` or `text:`. Keys are shown as text when they are printable UTF-8, otherwise
as 0x<hex> (pass those back as hex:<hex>). Durations: 90s, 5m, 2h, 7days ...";

// The codes themselves are the EXIT_* constants in main.rs.
const EXIT_CODES: &str = "\
Exit codes:
  0  done
  1  the command ran and found a problem: verify found corrupt entries; get found no record;
     export skipped corrupt entries; import left existing records, or read positions at or
     ahead of the imported ones, alone (no --overwrite);
     resolve/release found the key not in progress; invalidate found no live completed record
  2  usage error: bad arguments, a malformed key, cursor or duration, malformed import input
  3  store busy: a write command or backup found the store open by another process (the
     application), or restore found the backup open as a store
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
pub struct Cli {
    /// Print JSON for scripts instead of tables: one document, or JSON lines for export.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
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
    /// Every record, then every log consumer's read position, as JSON lines, exact bytes in
    /// the *_hex fields (read-only).
    Export(ExportArgs),
    /// Records and read positions from JSON lines made by export into a store (needs the
    /// store stopped). A stored position at or ahead of the imported one stays unless
    /// --overwrite.
    Import(ImportArgs),
    /// Decode every record; print the corrupt ones (read-only). Exit 1 if any.
    Verify(StoreArg),
    /// Copy the store into the new directory DIR (needs the store stopped; a running
    /// application backs up with Engine::checkpoint).
    Backup(BackupArgs),
    /// Copy a backup into the new store directory STORE, ready for the application to open.
    Restore(RestoreArgs),
    /// Log consumers' read positions: list (read-only), or set and remove to replay (needs
    /// the store stopped).
    #[command(subcommand)]
    Positions(PositionsCommand),
}

#[derive(Subcommand)]
pub enum PositionsCommand {
    /// Every stored read position, by consumer, source and partition (read-only).
    List(PositionsListArgs),
    /// Set a consumer's position: it resumes at OFFSET + 1 when it next starts, forwards or
    /// backwards (to replay from offset N, set N - 1). Needs the store stopped.
    Set(PositionSetArgs),
    /// Remove a consumer's position: it next starts where it starts without one (the
    /// beginning of the partition, as the consumer chooses). Needs the store stopped.
    Remove(PositionArgs),
}

#[derive(Args)]
pub struct PositionsListArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Only this consumer's positions.
    #[arg(long, value_parser = parse_bytes)]
    pub consumer: Option<Arg>,
}

#[derive(Args)]
pub struct PositionArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// The consumer id.
    #[arg(value_parser = parse_bytes)]
    pub consumer: Arg,
    /// The source: a topic, a stream.
    pub source: String,
    /// The partition of the source (0 for a log without partitions).
    pub partition: u32,
    #[command(flatten)]
    pub wait: WaitArg,
}

#[derive(Args)]
pub struct PositionSetArgs {
    #[command(flatten)]
    pub position: PositionArgs,
    /// The offset of the last message to count as read.
    pub offset: u64,
}

#[derive(Args)]
pub struct StoreArg {
    /// The store's directory.
    pub store: PathBuf,
}

#[derive(Args)]
pub struct WaitArg {
    /// While another process has the store open, retry for up to this long (e.g. 30s) instead
    /// of exiting with code 3.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub wait: Option<Duration>,
}

#[derive(Args)]
pub struct KeyArgs {
    /// The key's entity table (then give only KEY).
    #[arg(long, value_name = "TABLE")]
    entity: Option<String>,
    /// CONSUMER KEY, or KEY alone with --entity.
    #[arg(value_name = "CONSUMER|KEY", num_args = 1..=2, required = true, value_parser = parse_bytes)]
    parts: Vec<Arg>,
}

impl KeyArgs {
    /// The record the arguments name; a usage error (exit 2) if they name none.
    pub fn target(self) -> (Target, Vec<u8>) {
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
pub struct GetArgs {
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub key: KeyArgs,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum StateArg {
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
pub struct PageArgs {
    /// At most this many entries.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Start after this cursor (printed at the end of the previous page).
    #[arg(long, value_name = "CURSOR", value_parser = parse_cursor)]
    pub after: Option<Cursor>,
}

/// Which records `list` and `export` cover.
#[derive(Args)]
pub struct ScopeArgs {
    /// Only this consumer's records.
    #[arg(long, value_parser = parse_bytes)]
    consumer: Option<Arg>,
    /// Only this marker table (idemdb.records or an entity table).
    #[arg(long)]
    table: Option<String>,
}

impl ScopeArgs {
    pub fn filter(&self) -> Filter {
        let mut filter = Filter::new();
        if let Some(consumer) = &self.consumer {
            filter = filter.consumer(consumer.0.clone());
        }
        if let Some(table) = &self.table {
            filter = filter.table(table.clone());
        }
        filter
    }

    /// Whose read positions `export` writes: `None` for none (an entity table's scope),
    /// `Some(None)` for every consumer's, `Some(Some(id))` for one consumer's.
    pub fn positions(&self) -> Option<Option<&[u8]>> {
        let consumers = self
            .table
            .as_deref()
            .is_none_or(|table| table == idemdb::admin::CONSUMERS_TABLE);
        consumers.then(|| self.consumer.as_ref().map(|consumer| consumer.0.as_slice()))
    }
}

#[derive(Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    scope: ScopeArgs,
    /// Only records in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only records that entered their state at least this long ago.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    older_than: Option<Duration>,
    #[command(flatten)]
    pub page: PageArgs,
}

impl ListArgs {
    pub fn filter(&self) -> Filter {
        let mut filter = self.scope.filter();
        if let Some(state) = self.state {
            filter = filter.state(state.into());
        }
        if let Some(age) = self.older_than {
            filter = filter.older_than(age);
        }
        filter
    }
}

#[derive(Args)]
pub struct InProgressArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Only keys taken at least this long ago.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "0s")]
    older_than: Duration,
    /// Only this consumer's keys.
    #[arg(long, value_parser = parse_bytes)]
    consumer: Option<Arg>,
    #[command(flatten)]
    pub page: PageArgs,
}

impl InProgressArgs {
    pub fn filter(&self) -> Filter {
        let filter = Filter::new()
            .state(EntryState::InProgress)
            .older_than(self.older_than);
        match &self.consumer {
            Some(consumer) => filter.consumer(consumer.0.clone()),
            None => filter,
        }
    }
}

/// The in-progress key `resolve` and `release` act on.
#[derive(Args)]
pub struct InProgressKeyArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// The consumer id.
    #[arg(value_parser = parse_bytes)]
    pub consumer: Arg,
    /// The message key.
    #[arg(value_parser = parse_bytes)]
    pub key: Arg,
}

/// How `resolve` and `release` open the store: with the application's retention, which dates
/// the record they write.
#[derive(Args)]
pub struct ResolveOpenArgs {
    /// The application's retention: a resolved record expires this long after, a released one
    /// is kept this long.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "7days")]
    pub retention: Duration,
    #[command(flatten)]
    pub wait: WaitArg,
}

#[derive(Args)]
pub struct ResolveArgs {
    #[command(flatten)]
    pub held: InProgressKeyArgs,
    /// The result to store (what duplicates get), as text or hex:<hex>.
    #[arg(long, value_parser = parse_bytes)]
    pub result: Arg,
    // After --result, so the options keep their order in `resolve --help`.
    #[command(flatten)]
    pub open: ResolveOpenArgs,
}

#[derive(Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub held: InProgressKeyArgs,
    #[command(flatten)]
    pub open: ResolveOpenArgs,
}

#[derive(Args)]
pub struct InvalidateArgs {
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub key: KeyArgs,
    #[command(flatten)]
    pub wait: WaitArg,
}

#[derive(Args)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub wait: WaitArg,
}

#[derive(Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// Write to this file instead of standard output.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
}

#[derive(Args)]
pub struct ImportArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// JSON lines made by export; `-` or nothing for standard input. Read whole before
    /// anything is written.
    pub input: Option<PathBuf>,
    /// Replace records the store already holds (by default they are left alone), and set
    /// read positions to the imported ones, backwards too (by default a stored position
    /// moves forward only).
    #[arg(long)]
    pub overwrite: bool,
    #[command(flatten)]
    pub wait: WaitArg,
}

#[derive(Args)]
pub struct BackupArgs {
    /// The store's directory.
    pub store: PathBuf,
    /// The backup's directory: it must not exist; its parent must.
    pub dir: PathBuf,
    #[command(flatten)]
    pub wait: WaitArg,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// The backup's directory (made by `idemdb backup` or Engine::checkpoint); only read.
    pub backup: PathBuf,
    /// The store directory to create: it must not exist; its parent must.
    pub store: PathBuf,
}

/// Bytes given on the command line (a newtype: clap reads a `Vec<u8>` field as many `u8`s).
#[derive(Clone)]
pub struct Arg(pub Vec<u8>);

/// A key (or consumer id, or result) on the command line: `hex:<hex>`, `text:<text>`, or text.
fn parse_bytes(text: &str) -> Result<Arg, String> {
    if let Some(digits) = text.strip_prefix("hex:") {
        return hex::decode(digits)
            .map(Arg)
            .map_err(|_| format!("{digits:?} is not an even number of hex digits"));
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
