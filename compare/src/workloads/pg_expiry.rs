//! Commit latency of idemdb's PostgreSQL backend while millions of expired records are removed:
//! by [`PgStore::maintain`], which drops whole day partitions, and, for contrast, by the
//! `DELETE ... WHERE expires_at_ms < now` that an inbox table without partitions needs. Two
//! controls tell what the drops cost: the same drops with the partitions' files out of the
//! page cache, and an `unlink` of as many bytes of files that are not PostgreSQL's.
//!
//! One continuous run per removal method, on a fresh server: the expired records are written
//! straight into the day partitions of three days ago (one SQL statement, real encoded records),
//! then clients claim and commit new messages (the business row in the claim's transaction, as
//! in the peers run) for a quiet window, then the removal starts on its own connection while
//! they go on. Reported: the p99 of the commits started in the quiet window, and of those
//! started while the removal ran.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::Args;
use idemdb::format::Record;
use idemdb::{Fingerprint, MockClock};
use idemdb_postgres::{DAY_MS, PgStore};

use crate::contenders::pg_backend::{self, IdemdbPgSession};
use crate::workloads::{Generator, Session, quantile};

#[derive(Args, Clone)]
pub struct PgExpiryArgs {
    /// Expired records present when the removal starts.
    #[arg(long, default_value_t = 10_000_000)]
    pub records: u64,
    /// Concurrent clients claiming and committing throughout.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Seconds of the quiet window before the removal starts (and the least the run goes on
    /// after it started).
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// The port of the private PostgreSQL server.
    #[arg(long, default_value_t = 16381)]
    pub port: u16,
    /// Where the results go.
    #[arg(long, default_value = "docs/bench")]
    pub out: std::path::PathBuf,
}

impl PgExpiryArgs {
    pub fn defaults(out: std::path::PathBuf) -> PgExpiryArgs {
        PgExpiryArgs {
            records: 10_000_000,
            clients: 8,
            seconds: 20.0,
            port: 16381,
            out,
        }
    }
}

/// How the expired records are removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// `PgStore::maintain`: detach and drop the expired day partitions.
    DropPartitions,
    /// One `DELETE` of every expired row.
    Delete,
    /// `maintain`'s two steps apart, to tell which one the commits feel: every expired day
    /// partition detached concurrently, then a pause, then every one dropped.
    StepsApart,
    /// [`Removal::DropPartitions`] after the expired partitions' files were pushed out of the
    /// operating system's page cache, as after a retention period of other writes on a server
    /// whose memory is smaller than that: whether freeing cached pages is what costs.
    DropColdPartitions,
    /// No PostgreSQL at all: files of as many bytes as the expired partitions', written beside
    /// the server's data directory on the same file system, removed with `unlink`. What
    /// freeing that much disk space costs the commits, whoever frees it.
    UnlinkOtherFiles,
    /// [`Removal::DropPartitions`] with the records table in a tablespace on a file system of
    /// its own (an ext4 image on the same disk, loop-mounted), the WAL and the business table
    /// where they were: whether keeping the partitions' files out of the WAL's file system
    /// spares the commits. Skipped where mounting is refused.
    DropOnOwnFileSystem,
}

/// The pause between the detaches and the drops of [`Removal::StepsApart`].
const STEPS_PAUSE: Duration = Duration::from_secs(3);

impl Removal {
    pub fn name(self) -> &'static str {
        match self {
            Removal::DropPartitions => "maintain (drops day partitions)",
            Removal::Delete => "DELETE WHERE expires_at_ms < now",
            Removal::StepsApart => "maintain's steps apart (detach all, pause, drop all)",
            Removal::DropColdPartitions => "maintain, the expired partitions out of the page cache",
            Removal::UnlinkOtherFiles => {
                "unlink of as many bytes of other files (not PostgreSQL's; its records stay)"
            }
            Removal::DropOnOwnFileSystem => {
                "maintain, the records table's tablespace on a file system of its own"
            }
        }
    }
}

/// One removal method's run.
pub struct ExpiryRun {
    pub removal: Removal,
    pub removal_seconds: f64,
    pub quiet_commits: usize,
    pub quiet_p50_us: f64,
    pub quiet_p99_us: f64,
    pub during_commits: usize,
    pub during_p50_us: f64,
    pub during_p99_us: f64,
    /// The slowest commit started while the removal ran: unlike a p99, not raised by a short
    /// removal's having few commits.
    pub during_max_us: f64,
    /// Commits started in the `--seconds` after the removal started (its aftermath too).
    pub after_commits: usize,
    pub after_p99_us: f64,
    pub rows_left: i64,
    /// For [`Removal::StepsApart`]: the commits started while the partitions were being
    /// detached, during the pause, and while they were being dropped.
    pub steps: Option<[Step; 3]>,
}

/// One step of [`Removal::StepsApart`].
pub struct Step {
    pub name: &'static str,
    pub seconds: f64,
    pub commits: usize,
    pub p50_us: f64,
    pub p99_us: f64,
}

pub fn run(args: &PgExpiryArgs) -> Result<Vec<ExpiryRun>> {
    let mut runs = Vec::new();
    for removal in [
        Removal::DropPartitions,
        Removal::StepsApart,
        Removal::Delete,
        Removal::DropColdPartitions,
        Removal::UnlinkOtherFiles,
        Removal::DropOnOwnFileSystem,
    ] {
        let dir = tempfile::Builder::new()
            .prefix("idemdb-pg-expiry-")
            .tempdir()
            .context("temporary directory")?;
        // Mounted before the server starts and unmounted after it stopped (drop order).
        let own_file_system = if removal == Removal::DropOnOwnFileSystem {
            match LoopMount::new(&dir.path().join("records-fs"), args.records) {
                Ok(mounted) => Some(mounted),
                Err(why) => {
                    eprintln!(
                        "skipped \"{}\": cannot mount a file system ({why:#})",
                        removal.name()
                    );
                    continue;
                }
            }
        } else {
            None
        };
        eprintln!("starting postgres on 127.0.0.1:{}", args.port);
        let server = crate::servers::postgres(dir.path(), args.port)?;
        runs.push(one(args, removal, dir.path(), own_file_system.as_ref())?);
        drop(server);
        drop(own_file_system);
    }
    Ok(runs)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// (start since the run began, latency) of one commit, in nanoseconds.
type Call = (u64, u64);

fn one(
    args: &PgExpiryArgs,
    removal: Removal,
    dir: &Path,
    own_file_system: Option<&LoopMount>,
) -> Result<ExpiryRun> {
    let port = args.port;
    pg_backend::reset(port, 1)?;
    if let Some(mounted) = own_file_system {
        records_on(port, &mounted.point, &dir.join("postgres"))?;
    }
    let runtime = pg_backend::runtime()?;
    // The day partitions of three days ago onward, made by a store whose clock is then.
    let filled_from_ms = now_ms() - 3 * DAY_MS as u64;
    let fill_started = Instant::now();
    let mut other_files = Vec::new();
    runtime.block_on(async {
        let mut client = pg_backend::connect(port, true).await?;
        let past = PgStore::builder()
            .names(pg_backend::names()?)
            .clock(MockClock::new(filled_from_ms))
            .open(&client)
            .await?;
        past.maintain(&mut client).await?;
        // Committed three days ago, expired two days ago (the default retention is 7 days,
        // but what matters is when the row is removable): half in each of two day partitions.
        let day0 = filled_from_ms as i64 / DAY_MS * DAY_MS;
        let record = Record::new(
            1,
            filled_from_ms,
            day0 as u64 + 1,
            Fingerprint::of(b"expired"),
            bytes::Bytes::new(),
        )
        .encode();
        eprintln!("writing {} expired records", args.records);
        client
            .execute(
                "INSERT INTO bench_idemdb.records (consumer, message_key, record, expires_at_ms) \
                 SELECT 'bench'::bytea, convert_to('x' || lpad(i::text, 15, '0'), 'UTF8'), $1, \
                        $2 + (i % 2) * $3 + (i % 1000) \
                 FROM generate_series(1, $4::int8) AS i",
                &[&record, &(day0 + 1), &DAY_MS, &(args.records as i64)],
            )
            .await?;
        // Nothing left for autovacuum to do during the measurement, and no dirty buffers.
        client
            .batch_execute("VACUUM (ANALYZE) bench_idemdb.records")
            .await?;
        client.batch_execute("CHECKPOINT").await?;
        let files = expired_files(&client, &dir.join("postgres")).await?;
        if removal == Removal::DropOnOwnFileSystem {
            anyhow::ensure!(
                files
                    .iter()
                    .all(|file| file.to_string_lossy().contains("/pg_tblspc/")),
                "the expired partitions are not in the tablespace: {files:?}"
            );
        }
        match removal {
            Removal::DropColdPartitions => evict(&files)?,
            Removal::UnlinkOtherFiles => other_files = write_other_files(dir, &files)?,
            _ => {}
        }
        anyhow::Ok(())
    })?;
    let fill_seconds = fill_started.elapsed().as_secs_f64();
    eprintln!(
        "filled in {fill_seconds:.0} s; {} clients start",
        args.clients
    );

    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let clients: Vec<_> = (0..args.clients)
        .map(|thread| {
            let stop = stop.clone();
            let mut session = IdemdbPgSession::connect(port, true, false)?;
            Ok(std::thread::spawn(move || -> Result<Vec<Call>> {
                let mut generator = Generator::new(thread, 0x5eed, 0.1);
                let mut calls = Vec::with_capacity(1 << 16);
                while !stop.load(Ordering::Relaxed) {
                    let delivery = generator.next_delivery();
                    let at = started.elapsed().as_nanos() as u64;
                    let call = Instant::now();
                    session.deliver(&[delivery])?;
                    calls.push((at, call.elapsed().as_nanos() as u64));
                }
                Ok(calls)
            }))
        })
        .collect::<Result<_>>()?;
    let quiet = Duration::from_secs_f64(args.seconds);
    std::thread::sleep(quiet);
    let removal_start = started.elapsed();
    let mut step_windows = Vec::new();
    let (removal_end, rows_left) = runtime.block_on(async {
        let mut client = pg_backend::connect(port, true).await?;
        match removal {
            Removal::StepsApart => {
                let store = PgStore::builder()
                    .names(pg_backend::names()?)
                    .open(&client)
                    .await?;
                let expired: Vec<String> = store
                    .partitions(&client)
                    .await?
                    .into_iter()
                    .filter(|partition| partition.removable)
                    .map(|partition| partition.name)
                    .collect();
                let mut step = |name: &'static str, from: Duration| {
                    step_windows.push((name, from, started.elapsed()));
                };
                let from = started.elapsed();
                for partition in &expired {
                    client
                        .batch_execute(&format!(
                            "ALTER TABLE bench_idemdb.records DETACH PARTITION {partition} CONCURRENTLY"
                        ))
                        .await?;
                }
                step("detach", from);
                let from = started.elapsed();
                tokio::time::sleep(STEPS_PAUSE).await;
                step("pause", from);
                let from = started.elapsed();
                for partition in &expired {
                    client
                        .batch_execute(&format!("DROP TABLE {partition}"))
                        .await?;
                }
                step("drop", from);
                eprintln!("detached, then dropped {expired:?}");
            }
            Removal::UnlinkOtherFiles => {
                for file in &other_files {
                    std::fs::remove_file(file)?;
                }
                eprintln!("unlinked {} files", other_files.len());
            }
            Removal::DropPartitions
            | Removal::DropColdPartitions
            | Removal::DropOnOwnFileSystem => {
                let store = PgStore::builder()
                    .names(pg_backend::names()?)
                    .open(&client)
                    .await?;
                let done = store.maintain(&mut client).await?;
                eprintln!("maintain dropped {:?}", done.dropped);
            }
            Removal::Delete => {
                let deleted = client
                    .execute(
                        "DELETE FROM bench_idemdb.records \
                         WHERE expires_at_ms < floor(extract(epoch FROM now()) * 1000)::int8",
                        &[],
                    )
                    .await?;
                eprintln!("DELETE removed {deleted} rows");
            }
        }
        let end = started.elapsed();
        let left: i64 = client
            .query_one(
                "SELECT count(*) FROM bench_idemdb.records WHERE message_key >= 'x' AND message_key < 'y'",
                &[],
            )
            .await?
            .get(0);
        anyhow::Ok((end, left))
    })?;
    // At least `quiet` after the removal started, so that a short removal's aftermath counts.
    let until = removal_start + quiet;
    if let Some(rest) = until.checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    stop.store(true, Ordering::Relaxed);
    let mut calls = Vec::new();
    for client in clients {
        calls.extend(
            client
                .join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))??,
        );
    }
    let window = |from: Duration, to: Duration| -> Vec<u32> {
        let (from, to) = (from.as_nanos() as u64, to.as_nanos() as u64);
        let mut latencies: Vec<u32> = calls
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, latency)| u32::try_from(*latency).unwrap_or(u32::MAX))
            .collect();
        latencies.sort_unstable();
        latencies
    };
    // The quiet window skips the first second (connections warming up).
    let quiet_calls = window(Duration::from_secs(1), removal_start);
    let during_calls = window(
        removal_start,
        removal_end.max(removal_start + Duration::from_millis(1)),
    );
    let after_calls = window(removal_start, until);
    let us = |sorted: &[u32], q: f64| quantile(sorted, q) / 1000.0;
    let steps: Vec<Step> = step_windows
        .iter()
        .map(|(name, from, to)| {
            let calls = window(*from, (*to).max(*from + Duration::from_millis(1)));
            Step {
                name,
                seconds: (*to - *from).as_secs_f64(),
                commits: calls.len(),
                p50_us: us(&calls, 0.5),
                p99_us: us(&calls, 0.99),
            }
        })
        .collect();
    let steps = <[Step; 3]>::try_from(steps).ok();
    let result = ExpiryRun {
        removal,
        removal_seconds: (removal_end - removal_start).as_secs_f64(),
        quiet_commits: quiet_calls.len(),
        quiet_p50_us: us(&quiet_calls, 0.5),
        quiet_p99_us: us(&quiet_calls, 0.99),
        during_commits: during_calls.len(),
        during_p50_us: us(&during_calls, 0.5),
        during_p99_us: us(&during_calls, 0.99),
        during_max_us: us(&during_calls, 1.0),
        after_commits: after_calls.len(),
        after_p99_us: us(&after_calls, 0.99),
        rows_left,
        steps,
    };
    eprintln!(
        "{}: removal {:.2} s; p99 quiet {:.0} us ({} commits), during {:.0} us ({} commits); {} expired rows left",
        removal.name(),
        result.removal_seconds,
        result.quiet_p99_us,
        result.quiet_commits,
        result.during_p99_us,
        result.during_commits,
        rows_left
    );
    Ok(result)
}

/// The files of the expired partitions (each one's table and indexes, every 1 GB segment), in
/// the server's data directory `data`.
async fn expired_files(client: &tokio_postgres::Client, data: &Path) -> Result<Vec<PathBuf>> {
    // A relation in a tablespace is under pg_tblspc/<oid>/, a link to the tablespace.
    let store = PgStore::builder()
        .names(pg_backend::names()?)
        .open(client)
        .await?;
    let mut files = Vec::new();
    for partition in store.partitions(client).await? {
        if !partition.removable {
            continue;
        }
        let relations = client
            .query(
                "SELECT pg_relation_filepath(c.oid) FROM pg_class c \
                 WHERE c.oid = $1::text::regclass \
                    OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = $1::text::regclass)",
                &[&partition.name],
            )
            .await?;
        for relation in relations {
            let path: String = relation.get(0);
            let first = data.join(&path);
            files.push(first.clone());
            for segment in 1.. {
                let next = data.join(format!("{path}.{segment}"));
                if !next.exists() {
                    break;
                }
                files.push(next);
            }
        }
    }
    anyhow::ensure!(!files.is_empty(), "no expired partition has files");
    Ok(files)
}

/// Pushes `files` out of the page cache (they are clean: the checkpoint wrote them).
fn evict(files: &[PathBuf]) -> Result<()> {
    let mut bytes = 0;
    for path in files {
        let file = std::fs::File::open(path).with_context(|| format!("opening {path:?}"))?;
        bytes += file.metadata()?.len();
        // SAFETY: a plain system call on a file descriptor this function owns.
        let error =
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        anyhow::ensure!(error == 0, "posix_fadvise on {path:?} failed: {error}");
    }
    eprintln!("pushed {bytes} bytes of expired partitions out of the page cache");
    Ok(())
}

/// Writes, under `dir` (the file system of the server's data directory), one file per file of
/// `like` with as many bytes, synced: what [`Removal::UnlinkOtherFiles`] removes.
fn write_other_files(dir: &Path, like: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let other = dir.join("other-files");
    std::fs::create_dir_all(&other)?;
    let mut written = Vec::new();
    let mut bytes = 0;
    for (index, path) in like.iter().enumerate() {
        let len = std::fs::metadata(path)?.len();
        let target = other.join(format!("file-{index}"));
        write_synced(&target, len, 0x5a)?;
        bytes += len;
        written.push(target);
    }
    eprintln!("wrote {bytes} bytes of other files to unlink");
    Ok(written)
}

/// Writes a file of `len` bytes of `byte` at `path` (every block written, none left a hole),
/// and syncs it.
fn write_synced(path: &Path, len: u64, byte: u8) -> Result<()> {
    let chunk = vec![byte; 1 << 20];
    let mut file = std::fs::File::create(path)?;
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.sync_all()?;
    Ok(())
}

/// An ext4 file system in an image file, loop-mounted at `point`; unmounted when dropped.
struct LoopMount {
    point: PathBuf,
}

impl LoopMount {
    /// An image under `at` with room for `records` expired records and the run's new ones
    /// (about 160 bytes each on disk, twice over), written out in full first, so that the
    /// file system's writes never allocate blocks of the disk's file system under it.
    fn new(at: &Path, records: u64) -> Result<LoopMount> {
        std::fs::create_dir_all(at)?;
        let image = at.join("image");
        let point = at.join("mnt");
        std::fs::create_dir_all(&point)?;
        let bytes = (records * 320).max(1 << 30);
        write_synced(&image, bytes, 0)?;
        // No discard (on an image file, mkfs would punch the written blocks out again) and
        // the inode tables and journal written now, not by a kernel thread during the run.
        run_tool(
            std::process::Command::new("mkfs.ext4")
                .args([
                    "-q",
                    "-F",
                    "-E",
                    "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                ])
                .arg(&image),
        )?;
        run_tool(
            std::process::Command::new("mount")
                .args(["-o", "loop"])
                .arg(&image)
                .arg(&point),
        )?;
        eprintln!(
            "mounted a {bytes}-byte ext4 image at {point:?} (a run interrupted before its end \
             leaves it mounted: umount it by hand)"
        );
        Ok(LoopMount { point })
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        let unmounted = std::process::Command::new("umount")
            .arg(&self.point)
            .status();
        if !unmounted.is_ok_and(|status| status.success()) {
            eprintln!("could not unmount {:?}: unmount it by hand", self.point);
        }
    }
}

fn run_tool(command: &mut std::process::Command) -> Result<()> {
    let output = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    anyhow::ensure!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(())
}

/// A tablespace at `point` (a directory there owned as the data directory `data` is), set as
/// the records table's: every partition made from now on goes there.
fn records_on(port: u16, point: &Path, data: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let location = point.join("tablespace");
    std::fs::create_dir_all(&location)?;
    let owner = std::fs::metadata(data)?;
    std::os::unix::fs::chown(point, Some(owner.uid()), Some(owner.gid()))?;
    std::os::unix::fs::chown(&location, Some(owner.uid()), Some(owner.gid()))?;
    let runtime = pg_backend::runtime()?;
    runtime.block_on(async {
        let client = pg_backend::connect(port, true).await?;
        client
            .batch_execute(&format!(
                "CREATE TABLESPACE bench_records LOCATION '{}'",
                location.display()
            ))
            .await?;
        client
            .batch_execute("ALTER TABLE bench_idemdb.records SET TABLESPACE bench_records")
            .await?;
        anyhow::Ok(())
    })
}
