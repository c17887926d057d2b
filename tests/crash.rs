//! Crash harness: "no effect applied twice, no acknowledged effect lost", proven by SIGKILL
//! and by power cuts.
//!
//! The test binary re-runs itself as a child process that consumes a seeded stream of message
//! ids through the public API, in three modes: a transactional claim
//! with staged business writes, a batch claim, and an external two-phase claim whose "side
//! effect" is a line appended (and fsynced) to a ledger file before `complete`. After each
//! commit returns the child prints `ACK <id>` on its stdout pipe. The parent SIGKILLs the child
//! at random moments, and at named points (after a commit but before its ack; between the
//! external side effect and `complete`), reopens the store to check it, and starts a new child
//! on the same store that redelivers every unacknowledged id plus a share of acknowledged ones.
//! A last child runs without kills until everything is acknowledged.
//!
//! Checked after every cycle, Jepsen style: no acknowledged id lost (its marker is completed and
//! its business writes are there), no effect applied twice (each id's counter is 0 or 1, and a
//! ledger line per id and epoch at most once, all with the same derived key), no torn batch (a
//! batch's record row exists exactly when all its members' writes do). At the end, no
//! in-progress record is left and every id was applied exactly once. The child must only ever
//! die by the kill.
//!
//! Children alternate between `Durability::Sync` and `Durability::Buffered` (odd cycles). The
//! child flushes its memtables every few deliveries, so that WAL files are retired and new ones
//! begun during the run, and recovery spans several WAL files and table files.
//!
//! **Kills** (`IDEMDB_CRASH_CYCLES`, default 50; the long profile is 1000): a buffered commit is
//! in the operating system's page cache when `commit` returns, so a process kill must not lose
//! it either. A build that never fsyncs passes this part: the page cache survives a kill.
//!
//! **Power cuts** (`IDEMDB_CRASH_CUTS`, default 20; the long profile is 500): the child's store
//! lives on the power-cut file system (`powercut/`, FUSE), which forgets, when the parent cuts
//! the power, every byte and directory entry not covered by an fsync. The parent cuts at random
//! moments, right after a commit returned (before its ack), at a counted operation inside a
//! memtable flush, inside a compaction, and around the creation of a new WAL file; one cut
//! in three tears the last unsynced write at a sector boundary. Then it kills the child, writes
//! the durable state out and opens the store on it (it must open; a corruption fails the run
//! and is printed). A `Sync` commit acknowledged before the cut must be there whole; a
//! `Buffered` one only if acknowledged before the child's last returned `flush_wal`, and the
//! buffered commits that survive past it are a prefix of those acknowledged after it (the WAL
//! is lost from its end). Lost buffered commits are redelivered. Buffered children call
//! `flush_wal` after `begin_external`, before the side effect, as external claims need.
//!
//! **Mutation check**: a short power-cut run whose engine skips every fsync (the public fault
//! injector's `Fault::Unsynced`) must fail: lost acknowledged commits or renewed leases, or an
//! external side effect done twice under one epoch (its in-progress record was lost). If it passes, the
//! harness could not see a durability bug, and the test fails.
//!
//! Every open is on the default durable path (the commit log, its default shape) unless
//! `IDEMDB_CRASH_COMMIT_LOG=1` (a small ring, up to 8 segments of 64 KiB: transactional claims
//! stage 32 KiB of padding, so the ring grows between the children's flushes, and the children
//! pause now and then, long enough for it to give the segments back; power cuts then also cut
//! at the ring's growth and at its shrink) or `IDEMDB_CRASH_WAL=1` (RocksDB's WAL, the opt-out:
//! `EngineBuilder::without_commit_log`; power cuts then also cut at its WAL file switches).
//!
//! `IDEMDB_CRASH_SEED` sets the seed. Power cuts need root and FUSE; where mounting is refused
//! they are skipped with a message (`IDEMDB_CRASH_REQUIRE_FUSE=1` makes that a failure).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idemdb::{
    BatchOutcome, Durability, Engine, Fault, FaultInjector, Fingerprint, IoPoint, Message, Outcome,
    TableOptions, merge_ops,
};
use idemdb_powercut::{Event, PowerCut};

const CHILD_ENV: &str = "IDEMDB_CRASH_CHILD";
/// New message ids each cycle brings into the stream, so that every cycle has fresh work.
const NEW_PER_CYCLE: u64 = 150;
/// The lease of external claims, in real time: a killed holder's key is taken over after it.
const LEASE: Duration = Duration::from_millis(300);
/// Length of a derived key: "idk1-" and 32 hex digits.
const DERIVED_KEY_LEN: usize = 5 + 32;
/// Deliveries between two memtable flushes in a child.
const FLUSH_EVERY: usize = 25;
/// Deliveries between two full compactions in a power-cut child.
const COMPACT_EVERY: usize = 60;
/// Deliveries between two `flush_wal` calls in a buffered power-cut child.
const FLUSH_WAL_EVERY: usize = 7;
/// Named kill points, used on every fifth cycle in turn.
const POINTS: [&str; 2] = [
    "after-commit-before-ack",
    "after-side-effect-before-complete",
];
/// The power-cut point right after a transactional commit's ack: the commit must survive
/// (with async commits, a future resolved before its group was durable would not).
const AFTER_ACK: &str = "after-ack";

/// How the id is processed: transactional, batch, or external two-phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Transactional,
    Batch,
    External,
}

fn mode(id: u64) -> Mode {
    match id % 3 {
        0 => Mode::Transactional,
        1 => Mode::Batch,
        _ => Mode::External,
    }
}

/// SplitMix64, seeded: every run of a seed delivers the same stream and picks the same kills.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn builder(store: &Path, durability: Durability) -> idemdb::EngineBuilder {
    let builder = Engine::builder(store)
        .durability(durability)
        .business_table(TableOptions::new("rows"))
        .business_table(
            TableOptions::new("counters").associative_merge_operator("add_u64", merge_ops::add_u64),
        );
    // IDEMDB_CRASH_COMMIT_LOG=1: every open (children and checks) with a small ring that
    // grows between flushes (the children stage padding) and shrinks back when they pause.
    if small_ring() {
        return builder
            .commit_log(RING_SEGMENTS, RING_SEGMENT_BYTES)
            .commit_log_shrink_after(RING_QUIET);
    }
    if on_rocksdb_wal() {
        return builder.without_commit_log();
    }
    builder
}

/// `IDEMDB_CRASH_COMMIT_LOG=1`: the commit log as a small ring that grows and shrinks.
fn small_ring() -> bool {
    std::env::var_os("IDEMDB_CRASH_COMMIT_LOG").is_some()
}

/// The small ring: at most this many segments of the smallest size, given back after this
/// long without a write.
const RING_SEGMENTS: usize = 8;
const RING_SEGMENT_BYTES: u64 = 64 << 10;
const RING_QUIET: Duration = Duration::from_millis(30);
/// Padding a transactional claim stages in the small-ring profile: the deliveries between two
/// flushes then fill more than the ring's two first segments.
const RING_PADDING: usize = 32 << 10;
/// Deliveries between two pauses of a small-ring child, each long enough for the ring to
/// shrink.
const RING_PAUSE_EVERY: usize = 40;
const RING_PAUSE: Duration = Duration::from_millis(150);

/// `IDEMDB_CRASH_WAL=1`: every open on RocksDB's WAL (the opt-out) instead of the commit log.
fn on_rocksdb_wal() -> bool {
    std::env::var_os("IDEMDB_CRASH_WAL").is_some()
}

/// The mutation check's engine: every write and WAL sync reports success without an fsync.
#[derive(Debug)]
struct NeverSync;

impl FaultInjector for NeverSync {
    fn fault(&self, point: IoPoint) -> Fault {
        match point {
            IoPoint::Write | IoPoint::SyncWal => Fault::Unsynced,
            _ => Fault::None,
        }
    }
}

fn key(id: u64) -> String {
    format!("m{id:06}")
}

fn fingerprint(id: u64) -> Fingerprint {
    Fingerprint::of(format!("body of message {id}"))
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child();
        return;
    }
    let cycles = env_u64("IDEMDB_CRASH_CYCLES", 50);
    let cuts = env_u64("IDEMDB_CRASH_CUTS", 20);
    let seed = env_u64("IDEMDB_CRASH_SEED", 0x1de4);
    let mut failed = false;
    if cycles > 0 {
        let report = parent(cycles, seed, Ending::Kill);
        println!("{report}");
        failed |= !report.ok();
    }
    if cuts > 0 && !failed {
        match power_cuts_possible() {
            Err(why) if std::env::var_os("IDEMDB_CRASH_REQUIRE_FUSE").is_some() => {
                eprintln!("crash harness: power cuts need FUSE and cannot mount: {why}");
                failed = true;
            }
            Err(why) => {
                println!(
                    "crash harness: power cuts skipped: cannot mount the power-cut file system here ({why})"
                );
            }
            Ok(()) => {
                let report = parent(cuts, seed, Ending::PowerCut { fsync: true });
                println!("{report}");
                failed |= !report.ok();
                // The mutation check: an engine that never fsyncs must be caught losing
                // acknowledged commits.
                let mutant = parent(8, seed ^ 0x5eed, Ending::PowerCut { fsync: false });
                println!("mutation check (no fsync at all): {mutant}");
                if mutant.lost.is_empty()
                    && mutant.duplicated.is_empty()
                    && mutant.lost_leases.is_empty()
                {
                    eprintln!(
                        "crash harness: the mutation check lost nothing and applied nothing twice: these power cuts cannot see a missing fsync"
                    );
                    failed = true;
                }
                if !mutant.bad_exits.is_empty() || !mutant.bad_opens.is_empty() {
                    eprintln!("crash harness: the mutation check's run broke in another way");
                    failed = true;
                }
            }
        }
    }
    if failed {
        eprintln!("crash harness: FAILED");
        std::process::exit(1);
    }
    println!("1 passed, 0 failed");
}

/// How a cycle ends the child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// SIGKILL: the operating system keeps what was written.
    Kill,
    /// The power goes out, then SIGKILL: only what was fsynced is kept. With `fsync: false`
    /// the engine under test skips every fsync (the mutation check).
    PowerCut { fsync: bool },
}

/// Mounts the power-cut file system once, to see whether this machine allows it.
fn power_cuts_possible() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (backing, mnt) = (dir.path().join("disk"), dir.path().join("mnt"));
    std::fs::create_dir(&backing).map_err(|e| e.to_string())?;
    std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
    let fs = PowerCut::mount(&backing, &mnt).map_err(|e| e.to_string())?;
    fs.unmount().map_err(|e| e.to_string())?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The child: consumes delivery lines from stdin, prints ACK lines.

/// Prints a line to the parent at once (the pipe must carry it before a kill).
fn say(line: &str) {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}").expect("parent reads stdout");
    stdout.flush().expect("parent reads stdout");
}

/// Stops at a named point: tells the parent, which kills the child there.
fn stop_at(point: &str) -> ! {
    say(&format!("AT {point}"));
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn child() {
    let store = PathBuf::from(std::env::var("IDEMDB_CRASH_STORE").expect("store path"));
    let ledger_path = PathBuf::from(std::env::var("IDEMDB_CRASH_LEDGER").expect("ledger path"));
    let point = std::env::var("IDEMDB_CRASH_POINT").ok();
    let durability = match std::env::var("IDEMDB_CRASH_DURABILITY").as_deref() {
        Ok("buffered") => Durability::Buffered,
        _ => Durability::Sync,
    };
    // Power-cut children mark the start of a flush or compaction by creating a file here,
    // which the parent's armed cut counts from.
    let phases = std::env::var_os("IDEMDB_CRASH_PHASES").map(PathBuf::from);
    let mut builder = builder(&store, durability);
    let unsynced = std::env::var_os("IDEMDB_CRASH_UNSYNCED").is_some();
    if unsynced {
        builder = builder.fault_injector(NeverSync);
    }
    let engine = builder.open().expect("open the crash store");
    let mark = |phase: &str| {
        if let Some(dir) = &phases {
            let marker = dir.join(format!("phase-{phase}"));
            std::fs::write(&marker, b"").expect("phase marker");
            std::fs::remove_file(&marker).expect("phase marker");
        }
    };
    let consumer = engine.consumer("crash").expect("consumer");
    let rows = engine.business_table("rows").expect("rows");
    let counters = engine.business_table("counters").expect("counters");
    let mut ledger = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .read(true)
        .open(&ledger_path)
        .expect("ledger");
    // A line cut by a kill before its fsync was never a completed side effect: end it, so the
    // next line starts on its own.
    let existing = std::fs::read(&ledger_path).expect("read ledger");
    if existing.last().is_some_and(|&byte| byte != b'\n') {
        ledger.write_all(b"\n").expect("ledger");
        ledger.sync_data().expect("ledger fsync");
    }
    let one = 1u64.to_be_bytes();
    let holder = format!("pid-{}", std::process::id());
    // IDEMDB_CRASH_ASYNC (some `Sync` children): transactional commits go through
    // `commit_async`, up to ASYNC_IN_FLIGHT at a time, each acknowledged when its future
    // resolves (with the commit log: the committer and applier threads).
    #[cfg(feature = "tokio")]
    let mut in_flight = AsyncCommits::new(
        durability == Durability::Sync && std::env::var_os("IDEMDB_CRASH_ASYNC").is_some(),
    );
    say("READY");

    for (handled, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.expect("stdin");
        // Flush the memtables every few deliveries: each flush retires a WAL file, so kills and
        // cuts land in every stage of a WAL's life.
        if handled % FLUSH_EVERY == FLUSH_EVERY - 1 {
            mark("flush");
            engine.flush().expect("flush");
        }
        if small_ring() && !unsynced && handled % RING_PAUSE_EVERY == RING_PAUSE_EVERY - 1 {
            // Quiet: the ring gives back what it grew. (Not in the mutation check: the shrink's
            // flush would make its unsynced commits durable in the tables.)
            std::thread::sleep(RING_PAUSE);
        }
        if phases.is_some() && handled % COMPACT_EVERY == COMPACT_EVERY - 1 {
            mark("compact");
            engine.compact().expect("compact");
        }
        if phases.is_some()
            && durability == Durability::Buffered
            && handled % FLUSH_WAL_EVERY == FLUSH_WAL_EVERY - 1
        {
            // Every commit acknowledged so far is durable once this returns.
            engine.flush_wal().expect("flush_wal");
            say("FLUSHED");
        }
        let ids: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|id| id.parse().expect("id"))
            .collect();
        match line.as_bytes()[0] {
            b'T' => {
                let id = ids[0];
                match consumer.begin(key(id), fingerprint(id)).expect("begin") {
                    #[cfg(feature = "tokio")]
                    Outcome::Fresh(mut claim) if in_flight.enabled => {
                        claim.put(&rows, key(id), b"t").expect("put");
                        claim.merge(&counters, key(id), one).expect("merge");
                        in_flight.push(id, claim.commit_async(b"done"), point.as_deref());
                    }
                    Outcome::Fresh(mut claim) => {
                        claim.put(&rows, key(id), b"t").expect("put");
                        claim.merge(&counters, key(id), one).expect("merge");
                        if small_ring() {
                            let padding = vec![(id % 251) as u8; RING_PADDING];
                            claim.put(&rows, format!("pad/{id}"), padding).expect("put");
                        }
                        claim.commit(b"done").expect("commit");
                        if point.as_deref() == Some(POINTS[0]) {
                            stop_at(POINTS[0]);
                        }
                        say(&format!("ACK {id} new"));
                        if point.as_deref() == Some(AFTER_ACK) {
                            stop_at(AFTER_ACK);
                        }
                    }
                    Outcome::Duplicate { .. } => say(&format!("ACK {id}")),
                    other => panic!("transactional {id}: unexpected {other:?}"),
                }
            }
            b'B' => {
                let keys: Vec<String> = ids.iter().map(|&id| key(id)).collect();
                let messages: Vec<Message> = ids
                    .iter()
                    .zip(&keys)
                    .map(|(&id, key)| Message::new(key, fingerprint(id)))
                    .collect();
                let mut batch = consumer.begin_batch(&messages).expect("begin_batch");
                let fresh: Vec<usize> = (0..ids.len())
                    .filter(|&i| matches!(batch.outcomes()[i], BatchOutcome::Fresh))
                    .collect();
                for &i in &fresh {
                    let claim = batch.claim_mut(i).expect("fresh claim");
                    claim.put(&rows, key(ids[i]), b"b").expect("put");
                    claim.merge(&counters, key(ids[i]), one).expect("merge");
                }
                if let Some(&first) = fresh.first() {
                    // The batch's own record: which ids it committed, in the same write batch.
                    let members: Vec<String> = fresh.iter().map(|&i| ids[i].to_string()).collect();
                    let claim = batch.claim_mut(first).expect("fresh claim");
                    claim
                        .put(&rows, format!("batch/{}", ids[first]), members.join(" "))
                        .expect("put");
                }
                // (id, committed by this batch) for every member not left in progress.
                let acked: Vec<(u64, bool)> = (0..ids.len())
                    .filter(|&i| {
                        !matches!(
                            batch.outcomes()[i],
                            BatchOutcome::Settled(Outcome::InProgress { .. })
                        )
                    })
                    .map(|i| (ids[i], fresh.contains(&i)))
                    .collect();
                for outcome in batch.outcomes() {
                    if let BatchOutcome::Settled(settled) = outcome {
                        assert!(
                            matches!(
                                settled,
                                Outcome::Duplicate { .. } | Outcome::InProgress { .. }
                            ),
                            "batch: unexpected {settled:?}"
                        );
                    }
                }
                batch.commit(|_| b"done").expect("batch commit");
                if !fresh.is_empty() && point.as_deref() == Some(POINTS[0]) {
                    stop_at(POINTS[0]);
                }
                for (id, new) in acked {
                    say(&format!("ACK {id}{}", if new { " new" } else { "" }));
                }
            }
            b'E' => {
                let id = ids[0];
                loop {
                    match consumer
                        .begin_external(key(id), fingerprint(id), LEASE, &holder)
                        .expect("begin_external")
                    {
                        Outcome::Fresh(mut claim) => {
                            if claim.previous_attempt().is_some() {
                                say(&format!("TAKEOVER {id}"));
                            }
                            if durability == Durability::Buffered {
                                // The in-progress record (its epoch) must outlive a power cut
                                // before the side effect happens, or a redelivery would redo it
                                // under the same epoch.
                                engine.flush_wal().expect("flush_wal");
                            }
                            // A heartbeat: once it returns, the longer lease must survive.
                            let until = claim.renew(LEASE * 2).expect("renew");
                            say(&format!("LEASED {id} {} {until}", claim.epoch()));
                            // The side effect, made durable before `complete`.
                            let downstream = claim.derive_key("ledger");
                            writeln!(ledger, "{id} {} {downstream}", claim.epoch())
                                .expect("ledger");
                            ledger.sync_data().expect("ledger fsync");
                            if point.as_deref() == Some(POINTS[1]) {
                                stop_at(POINTS[1]);
                            }
                            claim.put(&rows, key(id), b"e").expect("put");
                            claim.merge(&counters, key(id), one).expect("merge");
                            claim.complete(b"done").expect("complete");
                            say(&format!("ACK {id} new"));
                        }
                        Outcome::Duplicate { .. } => say(&format!("ACK {id}")),
                        // A killed holder's lease: wait for it to run out, then take over.
                        Outcome::InProgress { .. } => {
                            std::thread::sleep(LEASE / 4);
                            continue;
                        }
                        other => panic!("external {id}: unexpected {other:?}"),
                    }
                    break;
                }
            }
            other => panic!("unknown delivery line {:?}", other as char),
        }
    }
    #[cfg(feature = "tokio")]
    in_flight.drain(point.as_deref());
    say("DONE");
}

/// Most async commits a child keeps in flight.
#[cfg(feature = "tokio")]
const ASYNC_IN_FLIGHT: usize = 4;

/// A child's async commits in flight, oldest first, acknowledged as their futures resolve.
#[cfg(feature = "tokio")]
struct AsyncCommits {
    enabled: bool,
    runtime: tokio::runtime::Runtime,
    futures: std::collections::VecDeque<(u64, idemdb::CommitFuture)>,
}

#[cfg(feature = "tokio")]
impl AsyncCommits {
    fn new(enabled: bool) -> AsyncCommits {
        AsyncCommits {
            enabled,
            runtime: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime"),
            futures: std::collections::VecDeque::new(),
        }
    }

    /// Adds a commit; with too many in flight, waits for the oldest.
    fn push(&mut self, id: u64, future: idemdb::CommitFuture, point: Option<&str>) {
        self.futures.push_back((id, future));
        while self.futures.len() > ASYNC_IN_FLIGHT {
            self.complete_oldest(point);
        }
    }

    fn complete_oldest(&mut self, point: Option<&str>) {
        let Some((id, future)) = self.futures.pop_front() else {
            return;
        };
        self.runtime.block_on(future).expect("async commit");
        if point == Some(POINTS[0]) {
            stop_at(POINTS[0]);
        }
        say(&format!("ACK {id} new"));
        if point == Some(AFTER_ACK) {
            stop_at(AFTER_ACK);
        }
    }

    fn drain(&mut self, point: Option<&str>) {
        while !self.futures.is_empty() {
            self.complete_oldest(point);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The parent: delivers, kills, checks.

/// How a power cut was placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum CutAt {
    /// After a random time.
    Random,
    /// Right after a commit returned, before its ack.
    AfterCommit,
    /// Right after a transactional commit's ack.
    AfterAck,
    /// At a counted operation after the child began a memtable flush.
    Flush,
    /// At a counted operation after the child began a full compaction.
    Compaction,
    /// At or just after the creation of a new WAL file (a memtable switch).
    WalSwitch,
    /// With the commit log: at or just after the first write to its second segment file, a
    /// segment switch (a reuse of the file, after the first lap).
    LogSegment,
    /// With the small ring: at or just after the creation of a segment the ring grows by
    /// (while it is filled, renamed into place and its name synced, or first written).
    RingGrowth,
    /// With the small ring: at or just after the removal of a segment the ring gives back
    /// (the other removals, the directory's sync, the next writes).
    RingShrink,
}

const CUT_PLACES: [CutAt; 6] = [
    CutAt::Random,
    CutAt::AfterCommit,
    CutAt::AfterAck,
    CutAt::Flush,
    CutAt::Compaction,
    CutAt::WalSwitch,
];

struct Report {
    ending: Ending,
    cycles: u64,
    /// Cycles whose child committed with `Durability::Buffered`.
    buffered_cycles: u64,
    point_kills: u64,
    attempted: HashSet<u64>,
    acknowledged: HashSet<u64>,
    deliveries: u64,
    takeovers: u64,
    lost: Vec<u64>,
    duplicated: Vec<u64>,
    torn: Vec<String>,
    left_in_progress: usize,
    bad_exits: Vec<String>,
    never_applied: Vec<u64>,
    /// Power cuts, by where they were placed (an armed cut not reached by its deadline is
    /// counted as random).
    cuts: BTreeMap<CutAt, u64>,
    /// Cuts that tore the last unsynced write at a sector boundary.
    torn_writes: u64,
    /// Cuts that came after the child had delivered everything and closed the store.
    cuts_after_exit: u64,
    /// Buffered commits acknowledged after the child's last `flush_wal` and lost with the
    /// power: allowed, and redelivered.
    lost_unflushed: u64,
    /// Buffered commits kept past one that was lost (the WAL must be lost from its end only).
    not_prefix: Vec<String>,
    /// Opens of the store after a cut that failed (RocksDB's message says where).
    bad_opens: Vec<String>,
    /// Renewed leases (of claims not completed) missing after the cut, or with an older
    /// epoch or deadline.
    lost_leases: Vec<String>,
    /// What the children asked of the power-cut file system.
    fs: idemdb_powercut::Stats,
    /// How the latest cycle's power cut went, for a failure's message.
    last_cut: String,
    /// Where a failed run left its work directory.
    evidence: Option<String>,
}

impl Report {
    fn new(ending: Ending) -> Report {
        Report {
            ending,
            cycles: 0,
            buffered_cycles: 0,
            point_kills: 0,
            attempted: HashSet::new(),
            acknowledged: HashSet::new(),
            deliveries: 0,
            takeovers: 0,
            lost: Vec::new(),
            duplicated: Vec::new(),
            torn: Vec::new(),
            left_in_progress: 0,
            bad_exits: Vec::new(),
            never_applied: Vec::new(),
            cuts: BTreeMap::new(),
            torn_writes: 0,
            cuts_after_exit: 0,
            lost_unflushed: 0,
            not_prefix: Vec::new(),
            bad_opens: Vec::new(),
            lost_leases: Vec::new(),
            fs: idemdb_powercut::Stats::default(),
            last_cut: String::new(),
            evidence: None,
        }
    }

    fn ok(&self) -> bool {
        self.lost.is_empty()
            && self.duplicated.is_empty()
            && self.torn.is_empty()
            && self.left_in_progress == 0
            && self.bad_exits.is_empty()
            && self.never_applied.is_empty()
            && self.not_prefix.is_empty()
            && self.bad_opens.is_empty()
            && self.lost_leases.is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.ending {
            Ending::Kill => writeln!(
                f,
                "crash harness: {} kill cycles ({} at named points, {} buffered), {} deliveries, {} takeovers",
                self.cycles,
                self.point_kills,
                self.buffered_cycles,
                self.deliveries,
                self.takeovers
            )?,
            Ending::PowerCut { .. } => {
                let places: Vec<String> = self
                    .cuts
                    .iter()
                    .map(|(place, n)| format!("{place:?} {n}"))
                    .collect();
                writeln!(
                    f,
                    "crash harness: {} power cuts ({}; {} torn writes; {} after the child closed the store), {} buffered, {} deliveries, {} takeovers",
                    self.cycles,
                    places.join(", "),
                    self.torn_writes,
                    self.cuts_after_exit,
                    self.buffered_cycles,
                    self.deliveries,
                    self.takeovers
                )?;
                writeln!(
                    f,
                    "file system: {} writes ({} MiB), {} file fsyncs, {} directory fsyncs, {} renames, {} creates, {} removes",
                    self.fs.writes,
                    self.fs.bytes_written >> 20,
                    self.fs.file_syncs,
                    self.fs.dir_syncs,
                    self.fs.renames,
                    self.fs.creates,
                    self.fs.removes
                )?;
                writeln!(
                    f,
                    "buffered commits lost after the last flush_wal (allowed, redelivered) {} / kept past a lost one {} / store failed to open {} / renewed leases lost {}",
                    self.lost_unflushed,
                    self.not_prefix.len(),
                    self.bad_opens.len(),
                    self.lost_leases.len()
                )?;
            }
        }
        writeln!(
            f,
            "attempted {} / acknowledged {} / lost {} / duplicated {} / torn {} / left in progress {} / not applied at the end {} / bad exits {}",
            self.attempted.len(),
            self.acknowledged.len(),
            self.lost.len(),
            self.duplicated.len(),
            self.torn.len(),
            self.left_in_progress,
            self.never_applied.len(),
            self.bad_exits.len()
        )?;
        for (what, list) in [
            ("lost", format!("{:?}", self.lost)),
            ("duplicated", format!("{:?}", self.duplicated)),
            ("torn", format!("{:?}", self.torn)),
            ("kept past a lost one", format!("{:?}", self.not_prefix)),
            ("store failed to open", format!("{:?}", self.bad_opens)),
            ("renewed leases lost", format!("{:?}", self.lost_leases)),
            ("bad exits", format!("{:?}", self.bad_exits)),
        ] {
            if list != "[]" {
                writeln!(f, "  {what}: {}", &list[..list.len().min(2000)])?;
            }
        }
        if let Some(evidence) = &self.evidence {
            writeln!(f, "  failed at {evidence}")?;
        }
        Ok(())
    }
}

/// The delivery lines of one cycle: every unacknowledged id, a share of acknowledged ones
/// (redeliveries), batch ids grouped by up to eight with an occasional repeat inside a batch.
fn deliveries(rng: &mut Rng, acknowledged: &HashSet<u64>, window: u64) -> Vec<String> {
    let mut ids: Vec<u64> = (0..window)
        .filter(|id| !acknowledged.contains(id) || rng.below(10) == 0)
        .collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut lines = Vec::new();
    let mut batch: Vec<u64> = Vec::new();
    for id in ids {
        match mode(id) {
            Mode::Transactional => lines.push(format!("T {id}")),
            Mode::External => lines.push(format!("E {id}")),
            Mode::Batch => {
                batch.push(id);
                if rng.below(8) == 0 {
                    batch.push(id); // a repeat inside one batch
                }
                if batch.len() >= 8 {
                    lines.push(format!("B {}", join(&batch)));
                    batch.clear();
                }
            }
        }
    }
    if !batch.is_empty() {
        lines.push(format!("B {}", join(&batch)));
    }
    lines
}

fn join(ids: &[u64]) -> String {
    ids.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
}

/// One child's run, as the parent saw it.
struct ChildRun {
    /// Killed (or cut) where it announced a named point.
    at_point: bool,
    /// Every ack in order: (id, committed by this child rather than found a duplicate).
    acks: Vec<(u64, bool)>,
    /// How many of `acks` came before the child's last returned `flush_wal`.
    flushed: usize,
    /// The power was cut by an armed cut inside the file system (not by the parent).
    cut_by_fs: bool,
    /// Per id, the latest lease the child reported renewed: (epoch, until ms).
    leases: HashMap<u64, (u64, u64)>,
    /// It delivered everything and exited before any kill or cut.
    finished: bool,
}

/// Runs one child over `lines`, on the power-cut file system `power` if given. It is killed
/// after `kill_after` from its start (or at its named point, or, under `power`, once an armed
/// cut fired); with `power`, the power is cut first. `kill_after` `None`: it runs to the end.
#[allow(clippy::too_many_arguments)]
fn run_child(
    store: &Path,
    ledger: &Path,
    lines: &[String],
    kill_after: Option<Duration>,
    point: Option<&str>,
    durability: Durability,
    power: Option<(&PowerCut, bool)>,
    report: &mut Report,
) -> ChildRun {
    let mut command = Command::new(std::env::current_exe().expect("own path"));
    command
        .env(CHILD_ENV, "1")
        .env("IDEMDB_CRASH_STORE", store)
        .env("IDEMDB_CRASH_LEDGER", ledger)
        .env(
            "IDEMDB_CRASH_DURABILITY",
            match durability {
                Durability::Buffered => "buffered",
                _ => "sync",
            },
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(point) = point {
        command.env("IDEMDB_CRASH_POINT", point);
    }
    // Every second `Sync` child commits its transactional deliveries with `commit_async`.
    static SYNC_CHILDREN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    if durability == Durability::Sync
        && SYNC_CHILDREN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 2 == 1
    {
        command.env("IDEMDB_CRASH_ASYNC", "1");
    }
    if let Some((fs, fsync)) = power {
        command.env("IDEMDB_CRASH_PHASES", fs.path());
        if !fsync {
            command.env("IDEMDB_CRASH_UNSYNCED", "1");
        }
    }
    let mut child = command.spawn().expect("spawn child");
    let stdout = child.stdout.take().expect("stdout");
    let (lines_tx, lines_rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    // The child's complaints, shown only if it died in a way we did not cause (after a power
    // cut every call fails, and a child may panic before the kill lands).
    let mut stderr = child.stderr.take().expect("stderr");
    let complaints = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    // Feed every delivery; a killed child simply stops reading.
    let mut stdin = child.stdin.take().expect("stdin");
    let input = lines.join("\n") + "\n";
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    report.deliveries += lines.len() as u64;

    let mut run = ChildRun {
        at_point: false,
        acks: Vec::new(),
        flushed: 0,
        cut_by_fs: false,
        finished: false,
        leases: HashMap::new(),
    };
    let on_line = |line: &str, run: &mut ChildRun, report: &mut Report| {
        if let Some(rest) = line.strip_prefix("ACK ") {
            let mut words = rest.split_whitespace();
            let id = words.next().expect("acked id").parse().expect("acked id");
            run.acks.push((id, words.next() == Some("new")));
        } else if line.starts_with("TAKEOVER ") {
            report.takeovers += 1;
        } else if line == "FLUSHED" {
            run.flushed = run.acks.len();
        } else if let Some(rest) = line.strip_prefix("LEASED ") {
            let numbers: Vec<u64> = rest
                .split_whitespace()
                .map(|n| n.parse().expect("lease numbers"))
                .collect();
            run.leases.insert(numbers[0], (numbers[1], numbers[2]));
        }
    };
    let cut = |power: Option<(&PowerCut, bool)>| {
        if let Some((fs, _)) = power {
            fs.cut();
        }
    };
    let is_cut = || power.is_some_and(|(fs, _)| fs.is_cut());
    // Under power cuts, look for an armed cut this often.
    let poll = if power.is_some() {
        Duration::from_millis(5)
    } else {
        Duration::from_secs(120)
    };
    let mut deadline: Option<Instant> = None;
    let mut killed = false;
    let mut done = false;
    loop {
        if is_cut() {
            child.kill().expect("SIGKILL");
            run.cut_by_fs = true;
            killed = true;
            break;
        }
        let timeout = match deadline {
            Some(at) => at.saturating_duration_since(Instant::now()).min(poll),
            None => poll,
        };
        match lines_rx.recv_timeout(timeout) {
            Ok(line) if line == "READY" => {
                deadline = kill_after.map(|after| Instant::now() + after);
            }
            Ok(line) if line.starts_with("AT ") => {
                cut(power);
                child.kill().expect("SIGKILL");
                report.point_kills += 1;
                run.at_point = true;
                killed = true;
                break;
            }
            Ok(line) if line == "DONE" => {
                done = true;
                break;
            }
            Ok(line) => on_line(&line, &mut run, report),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if deadline.is_some_and(|at| Instant::now() >= at) {
                    cut(power);
                    child.kill().expect("SIGKILL");
                    killed = true;
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // A child that died after the power went out died of it, whatever its status.
    let cut_before_exit = is_cut();
    let status = child.wait().expect("wait child");
    // Acks printed before the kill are acknowledged too.
    for line in lines_rx.iter() {
        on_line(&line, &mut run, report);
    }
    let _ = reader.join();
    let _ = writer.join();
    let complaints = complaints.join().unwrap_or_default();
    let died_by_kill = killed && status.signal() == Some(9);
    let finished = done && status.success();
    run.finished = finished;
    if !died_by_kill && !finished && !cut_before_exit {
        let tail = &complaints[complaints.len().saturating_sub(1500)..];
        report.bad_exits.push(format!("{status:?}: {tail}"));
    }
    run
}

/// Reads the ledger: id -> (epoch -> lines), and id -> derived keys.
fn read_ledger(ledger: &Path) -> HashMap<u64, Vec<(u64, String)>> {
    let mut by_id: HashMap<u64, Vec<(u64, String)>> = HashMap::new();
    let Ok(text) = std::fs::read_to_string(ledger) else {
        return by_id;
    };
    for line in text.lines() {
        // A line cut by a kill before its fsync (never followed by an ack) is skipped.
        let parts: Vec<&str> = line.split_whitespace().collect();
        let [id, epoch, key] = parts[..] else {
            continue;
        };
        if key.len() != DERIVED_KEY_LEN {
            continue;
        }
        let (Ok(id), Ok(epoch)) = (id.parse(), epoch.parse()) else {
            continue;
        };
        by_id.entry(id).or_default().push((epoch, key.to_owned()));
    }
    by_id
}

/// Checks the store against everything acknowledged so far. `unflushed` are the acks of a
/// buffered child after its last `flush_wal` before a power cut: those that survived join the
/// acknowledged set; those lost must be lost from the end (a prefix of the child's own commits
/// survives).
fn check(
    store: &Path,
    ledger: &Path,
    window: u64,
    report: &mut Report,
    last: bool,
    unflushed: &[(u64, bool)],
    leases: &HashMap<u64, (u64, u64)>,
) {
    let engine = match builder(store, Durability::Sync).open() {
        Ok(engine) => engine,
        Err(error) => {
            report.bad_opens.push(error.to_string());
            return;
        }
    };
    let consumer = engine.consumer("crash").expect("consumer");
    let rows = engine.business_table("rows").expect("rows");
    let counters = engine.business_table("counters").expect("counters");
    let ledger = read_ledger(ledger);
    // A renewed lease whose claim did not complete is there, with its epoch and at least the
    // renewed deadline: a heartbeat that returned is durable, and fencing resumes from it.
    if !leases.is_empty() {
        let in_progress: HashMap<Vec<u8>, (u64, u64)> = consumer
            .in_progress(Duration::ZERO, usize::MAX)
            .expect("in-progress scan")
            .into_iter()
            .map(|entry| {
                (
                    entry.message_key.to_vec(),
                    (entry.epoch, entry.lease_until_ms),
                )
            })
            .collect();
        for (&id, &(epoch, until)) in leases {
            let completed = consumer
                .get(key(id))
                .expect("marker")
                .is_some_and(|record| record.result().is_some());
            match in_progress.get(key(id).as_bytes()) {
                _ if completed => {}
                Some(&(held, held_until)) if held == epoch && held_until >= until => {}
                found => report.lost_leases.push(format!(
                    "{id}: renewed epoch {epoch} until {until}, found {found:?}"
                )),
            }
        }
    }
    let mut lost_one: Option<u64> = None;
    for &(id, new) in unflushed {
        let kept = consumer
            .get(key(id))
            .expect("marker")
            .is_some_and(|record| record.result().is_some());
        if kept {
            if let (true, Some(lost)) = (new, lost_one) {
                report
                    .not_prefix
                    .push(format!("{id} kept after {lost} was lost"));
            }
            report.acknowledged.insert(id);
        } else if new {
            report.lost_unflushed += 1;
            lost_one.get_or_insert(id);
        }
    }
    report.lost.clear();
    report.duplicated.clear();
    report.torn.clear();
    report.never_applied.clear();
    for id in 0..window {
        let applied = counters.get(key(id)).expect("counter").map_or(0, |value| {
            merge_ops::read_u64(&value).expect("counter bytes")
        });
        let row = rows.get(key(id)).expect("row").is_some();
        let marker = consumer.get(key(id)).expect("marker");
        let completed = marker
            .as_ref()
            .is_some_and(|record| record.result().is_some());
        if applied > 1 {
            report.duplicated.push(id);
        }
        if completed != (applied == 1 && row) {
            report.torn.push(format!(
                "{id}: marker {completed}, applied {applied}, row {row}"
            ));
        }
        if report.acknowledged.contains(&id) && !(completed && applied == 1 && row) {
            report.lost.push(id);
        }
        if let Some(lines) = ledger.get(&id) {
            let epochs: HashSet<u64> = lines.iter().map(|(epoch, _)| *epoch).collect();
            let keys: HashSet<&String> = lines.iter().map(|(_, key)| key).collect();
            if epochs.len() != lines.len() || keys.len() != 1 {
                report.duplicated.push(id);
            }
        }
        if last && (!completed || applied != 1) {
            report.never_applied.push(id);
        }
    }
    // Batch atomicity: a batch's record row exists exactly when its members were all applied.
    let mut batch_rows = 0;
    for id in (0..window).filter(|&id| mode(id) == Mode::Batch) {
        if let Some(members) = rows.get(format!("batch/{id}")).expect("batch row") {
            batch_rows += 1;
            for member in String::from_utf8(members).expect("utf8").split_whitespace() {
                let member: u64 = member.parse().expect("member");
                if rows.get(key(member)).expect("row").is_none() {
                    report
                        .torn
                        .push(format!("batch {id}: member {member} missing"));
                }
            }
        }
    }
    assert!(!last || batch_rows > 0, "no batch was ever committed");
    if last {
        report.left_in_progress = consumer
            .in_progress(Duration::ZERO, usize::MAX)
            .expect("in-progress scan")
            .len();
    }
}

fn parent(cycles: u64, seed: u64, ending: Ending) -> Report {
    let dir = tempfile::tempdir().expect("temp dir");
    // Under power cuts the child's store is on the mount (`mnt`), and the parent checks what
    // a cut left in the backing directory (`disk`).
    let (disk, mnt) = (dir.path().join("disk"), dir.path().join("mnt"));
    let (store, child_store) = match ending {
        Ending::Kill => (dir.path().join("store"), dir.path().join("store")),
        Ending::PowerCut { .. } => {
            std::fs::create_dir(&disk).expect("backing dir");
            std::fs::create_dir(&mnt).expect("mount point");
            (disk.join("store"), mnt.join("store"))
        }
    };
    let ledger = dir.path().join("ledger");
    let mut rng = Rng(seed);
    let mut report = Report::new(ending);
    let window = |cycle: u64| (cycle + 1) * NEW_PER_CYCLE;
    for cycle in 0..cycles {
        let lines = deliveries(&mut rng, &report.acknowledged, window(cycle));
        for line in &lines {
            for id in line.split_whitespace().skip(1) {
                report.attempted.insert(id.parse().expect("id"));
            }
        }
        // The mutation check runs `Sync` only: its losses must be acknowledged ones.
        let durability = if cycle % 2 == 1 && ending != (Ending::PowerCut { fsync: false }) {
            report.buffered_cycles += 1;
            Durability::Buffered
        } else {
            Durability::Sync
        };
        let mut unflushed = Vec::new();
        // Renewed leases to find after the cycle: every one after a kill (the page cache keeps
        // them), only `Sync` ones after a power cut.
        let mut leases = HashMap::new();
        match ending {
            Ending::Kill => {
                let point = (cycle % 5 == 4).then(|| POINTS[((cycle / 5) % 2) as usize]);
                let kill_after = Duration::from_millis(20 + rng.below(180));
                let run = run_child(
                    &store,
                    &ledger,
                    &lines,
                    Some(kill_after),
                    point,
                    durability,
                    None,
                    &mut report,
                );
                leases = run.leases;
                report
                    .acknowledged
                    .extend(run.acks.iter().map(|&(id, _)| id));
            }
            Ending::PowerCut { fsync } => {
                let fs = PowerCut::mount(&disk, &mnt).expect("mount the power-cut file system");
                // Shifted by one every round of places, so that `Sync` (even) and `Buffered`
                // (odd) cycles both meet every place.
                // The small ring adds its growth and shrink to the places.
                let ring_places = [CutAt::RingGrowth, CutAt::RingShrink];
                let extra = if small_ring() { &ring_places[..] } else { &[] };
                let all: Vec<CutAt> = CUT_PLACES.iter().chain(extra).copied().collect();
                let places = all.len() as u64;
                let mut place = all[((cycle + cycle / places) % places) as usize];
                // The commit log's stores create no WAL files to cut at: cut at its segments.
                if place == CutAt::WalSwitch && !on_rocksdb_wal() {
                    place = CutAt::LogSegment;
                }
                match place {
                    CutAt::Flush => fs.arm(
                        Event::Create("phase-flush".into()),
                        2 + rng.below(40) as u32,
                    ),
                    CutAt::Compaction => fs.arm(
                        Event::Create("phase-compact".into()),
                        2 + rng.below(150) as u32,
                    ),
                    CutAt::WalSwitch => fs.arm(Event::Create(".log".into()), rng.below(6) as u32),
                    CutAt::LogSegment => {
                        fs.arm(Event::Write("segment-1".into()), rng.below(6) as u32);
                    }
                    CutAt::RingGrowth => {
                        fs.arm(Event::Create("segment-".into()), rng.below(8) as u32);
                    }
                    CutAt::RingShrink => {
                        fs.arm(Event::Remove("segment-".into()), rng.below(6) as u32);
                    }
                    CutAt::Random | CutAt::AfterCommit | CutAt::AfterAck => {}
                }
                // An armed cut not reached by then becomes a random one.
                let kill_after = match place {
                    CutAt::Random => Duration::from_millis(10 + rng.below(200)),
                    _ => Duration::from_secs(3),
                };
                let point = match place {
                    CutAt::AfterCommit => Some(POINTS[0]),
                    CutAt::AfterAck => Some(AFTER_ACK),
                    _ => None,
                };
                let run = run_child(
                    &child_store,
                    &ledger,
                    &lines,
                    Some(kill_after),
                    point,
                    durability,
                    Some((&fs, fsync)),
                    &mut report,
                );
                // A named place not reached (the child finished or the deadline came first)
                // made a random cut.
                let reached = match place {
                    CutAt::Random => true,
                    CutAt::AfterCommit | CutAt::AfterAck => run.at_point,
                    CutAt::Flush
                    | CutAt::Compaction
                    | CutAt::WalSwitch
                    | CutAt::LogSegment
                    | CutAt::RingGrowth
                    | CutAt::RingShrink => run.cut_by_fs,
                };
                let tear = (rng.below(3) == 0).then(|| rng.next());
                let cut = fs.power_off(tear).expect("power off");
                let place = if reached { place } else { CutAt::Random };
                report.last_cut = format!(
                    "cut {place:?}, torn {:?}, child finished {}",
                    cut.torn, run.finished
                );
                *report.cuts.entry(place).or_default() += 1;
                report.torn_writes += u64::from(cut.torn.is_some());
                report.cuts_after_exit += u64::from(run.finished);
                add_stats(&mut report.fs, &cut.stats);
                if durability == Durability::Buffered {
                    report
                        .acknowledged
                        .extend(run.acks[..run.flushed].iter().map(|&(id, _)| id));
                    unflushed = run.acks[run.flushed..].to_vec();
                } else {
                    report
                        .acknowledged
                        .extend(run.acks.iter().map(|&(id, _)| id));
                    leases = run.leases;
                }
            }
        }
        report.cycles += 1;
        if matches!(ending, Ending::PowerCut { .. }) {
            // The store as the cut left it, before the check's open replays (and may flush or
            // shrink) it: a failure keeps this copy as its evidence.
            let as_cut = dir.path().join("store-as-cut");
            let _ = std::fs::remove_dir_all(&as_cut);
            let _ = std::process::Command::new("cp")
                .arg("-a")
                .arg(&store)
                .arg(&as_cut)
                .status();
        }
        check(
            &store,
            &ledger,
            window(cycle),
            &mut report,
            false,
            &unflushed,
            &leases,
        );
        if !report.ok() && ending == (Ending::PowerCut { fsync: false }) {
            // The mutation check, failing as it must: nothing to keep.
            return report;
        }
        if !report.ok() {
            // Keep the evidence: the store as the failed check found it.
            let kept =
                std::env::temp_dir().join(format!("idemdb-crash-failure-{}", std::process::id()));
            let _ = std::process::Command::new("cp")
                .arg("-a")
                .arg(dir.path())
                .arg(&kept)
                .status();
            report.evidence = Some(format!(
                "cycle {cycle} ({durability:?}, {}): work dir kept in {}",
                report.last_cut,
                kept.display()
            ));
            return report;
        }
    }
    // Recovery: a child without kills (or power cuts) delivers everything still unacknowledged.
    let lines = deliveries(&mut Rng(seed ^ 1), &report.acknowledged, window(cycles - 1));
    for line in &lines {
        for id in line.split_whitespace().skip(1) {
            report.attempted.insert(id.parse().expect("id"));
        }
    }
    let run = run_child(
        &store,
        &ledger,
        &lines,
        None,
        None,
        Durability::Sync,
        None,
        &mut report,
    );
    report
        .acknowledged
        .extend(run.acks.iter().map(|&(id, _)| id));
    check(
        &store,
        &ledger,
        window(cycles - 1),
        &mut report,
        true,
        &[],
        &HashMap::new(),
    );
    report
}

fn add_stats(total: &mut idemdb_powercut::Stats, more: &idemdb_powercut::Stats) {
    total.writes += more.writes;
    total.bytes_written += more.bytes_written;
    total.file_syncs += more.file_syncs;
    total.dir_syncs += more.dir_syncs;
    total.renames += more.renames;
    total.creates += more.creates;
    total.removes += more.removes;
}
