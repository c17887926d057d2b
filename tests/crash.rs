//! Crash-kill harness: "no effect applied twice, no acknowledged effect lost", proven by
//! SIGKILL.
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
//! Children alternate between `Durability::Sync` and `Durability::Buffered` (odd cycles): a
//! buffered commit is not fsynced, but it is in the OS's page cache when `commit` returns, so a
//! process kill must not lose it either (a power loss could; this harness does not cut power).
//!
//! The child flushes its memtables every few deliveries, so that WAL files are retired and
//! recycled (overwritten in place) during the run: recovery must also stop cleanly at the
//! previous incarnation's leftovers in a recycled file.
//!
//! `IDEMDB_CRASH_CYCLES` sets the number of kill cycles (default 50, the CI profile; the long
//! profile is 1000) and `IDEMDB_CRASH_SEED` the seed.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idemdb::{
    BatchOutcome, Durability, Engine, Fingerprint, Message, Outcome, TableOptions, merge_ops,
};

const CHILD_ENV: &str = "IDEMDB_CRASH_CHILD";
/// New message ids each cycle brings into the stream, so that every cycle has fresh work.
const NEW_PER_CYCLE: u64 = 150;
/// The lease of external claims, in real time: a killed holder's key is taken over after it.
const LEASE: Duration = Duration::from_millis(300);
/// Length of a derived key: "idk1-" and 32 hex digits.
const DERIVED_KEY_LEN: usize = 5 + 32;
/// Deliveries between two memtable flushes in a child.
const FLUSH_EVERY: usize = 25;
/// Named kill points, used on every fifth cycle in turn.
const POINTS: [&str; 2] = [
    "after-commit-before-ack",
    "after-side-effect-before-complete",
];

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

fn open(store: &Path, durability: Durability) -> Engine {
    Engine::builder(store)
        .durability(durability)
        .business_table(TableOptions::new("rows"))
        .business_table(
            TableOptions::new("counters").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()
        .expect("open the crash store")
}

fn key(id: u64) -> String {
    format!("m{id:06}")
}

fn fingerprint(id: u64) -> Fingerprint {
    Fingerprint::of(format!("body of message {id}"))
}

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child();
        return;
    }
    let cycles: u64 = std::env::var("IDEMDB_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let seed: u64 = std::env::var("IDEMDB_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x1de4);
    let report = parent(cycles.max(1), seed);
    println!("{report}");
    if !report.ok() {
        eprintln!("crash harness: FAILED");
        std::process::exit(1);
    }
    println!("1 passed, 0 failed");
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
    let engine = open(&store, durability);
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
    say("READY");

    for (handled, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.expect("stdin");
        // Flush the memtables every few deliveries: each flush retires a WAL file, so the WAL
        // soon lives in recycled files (the engine keeps 4) and kills land in those too.
        if handled % FLUSH_EVERY == FLUSH_EVERY - 1 {
            engine.flush().expect("flush");
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
                    Outcome::Fresh(mut claim) => {
                        claim.put(&rows, key(id), b"t").expect("put");
                        claim.merge(&counters, key(id), one).expect("merge");
                        claim.commit(b"done").expect("commit");
                        if point.as_deref() == Some(POINTS[0]) {
                            stop_at(POINTS[0]);
                        }
                        say(&format!("ACK {id}"));
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
                let acked: Vec<u64> = (0..ids.len())
                    .filter(|&i| {
                        !matches!(
                            batch.outcomes()[i],
                            BatchOutcome::Settled(Outcome::InProgress { .. })
                        )
                    })
                    .map(|i| ids[i])
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
                for id in acked {
                    say(&format!("ACK {id}"));
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
                            say(&format!("ACK {id}"));
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
    say("DONE");
}

// ---------------------------------------------------------------------------------------------
// The parent: delivers, kills, checks.

#[derive(Default)]
struct Report {
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
}

impl Report {
    fn ok(&self) -> bool {
        self.lost.is_empty()
            && self.duplicated.is_empty()
            && self.torn.is_empty()
            && self.left_in_progress == 0
            && self.bad_exits.is_empty()
            && self.never_applied.is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "crash harness: {} kill cycles ({} at named points, {} buffered), {} deliveries, {} takeovers",
            self.cycles, self.point_kills, self.buffered_cycles, self.deliveries, self.takeovers
        )?;
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
            ("bad exits", format!("{:?}", self.bad_exits)),
        ] {
            if list != "[]" {
                writeln!(f, "  {what}: {}", &list[..list.len().min(400)])?;
            }
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

/// Runs one child over `lines`; kills it after `kill_after` (or at its named point) unless
/// `kill_after` is `None`. Returns whether it was killed.
fn run_child(
    store: &Path,
    ledger: &Path,
    lines: &[String],
    kill_after: Option<Duration>,
    point: Option<&str>,
    durability: Durability,
    report: &mut Report,
) -> bool {
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
        .stdout(Stdio::piped());
    if let Some(point) = point {
        command.env("IDEMDB_CRASH_POINT", point);
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
    // Feed every delivery; a killed child simply stops reading.
    let mut stdin = child.stdin.take().expect("stdin");
    let input = lines.join("\n") + "\n";
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    report.deliveries += lines.len() as u64;

    let mut deadline: Option<Instant> = None;
    let mut killed = false;
    loop {
        let timeout = match deadline {
            Some(at) => at.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(120),
        };
        match lines_rx.recv_timeout(timeout) {
            Ok(line) if line == "READY" => {
                deadline = kill_after.map(|after| Instant::now() + after);
            }
            Ok(line) if line.starts_with("ACK ") => {
                report
                    .acknowledged
                    .insert(line[4..].parse().expect("acked id"));
            }
            Ok(line) if line.starts_with("TAKEOVER ") => report.takeovers += 1,
            Ok(line) if line.starts_with("AT ") => {
                child.kill().expect("SIGKILL");
                report.point_kills += 1;
                killed = true;
                break;
            }
            Ok(line) if line == "DONE" => break,
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) if deadline.is_some() => {
                child.kill().expect("SIGKILL");
                killed = true;
                break;
            }
            Err(_) => break,
        }
    }
    let status = child.wait().expect("wait child");
    // Acks printed before the kill are acknowledged too.
    for line in lines_rx.iter() {
        if let Some(id) = line.strip_prefix("ACK ") {
            report.acknowledged.insert(id.parse().expect("acked id"));
        }
        if line.starts_with("TAKEOVER ") {
            report.takeovers += 1;
        }
    }
    let _ = reader.join();
    let _ = writer.join();
    let died_by_kill = killed && status.signal() == Some(9);
    let finished = !killed && status.success();
    if !died_by_kill && !finished {
        report.bad_exits.push(format!("{status:?}"));
    }
    killed
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

/// Checks the store against everything acknowledged so far.
fn check(store: &Path, ledger: &Path, window: u64, report: &mut Report, last: bool) {
    let engine = open(store, Durability::Sync);
    let consumer = engine.consumer("crash").expect("consumer");
    let rows = engine.business_table("rows").expect("rows");
    let counters = engine.business_table("counters").expect("counters");
    let ledger = read_ledger(ledger);
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

fn parent(cycles: u64, seed: u64) -> Report {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("store");
    let ledger = dir.path().join("ledger");
    let mut rng = Rng(seed);
    let mut report = Report::default();
    let window = |cycle: u64| (cycle + 1) * NEW_PER_CYCLE;
    for cycle in 0..cycles {
        let lines = deliveries(&mut rng, &report.acknowledged, window(cycle));
        for line in &lines {
            for id in line.split_whitespace().skip(1) {
                report.attempted.insert(id.parse().expect("id"));
            }
        }
        let point = (cycle % 5 == 4).then(|| POINTS[((cycle / 5) % 2) as usize]);
        let kill_after = Duration::from_millis(20 + rng.below(180));
        let durability = if cycle % 2 == 1 {
            report.buffered_cycles += 1;
            Durability::Buffered
        } else {
            Durability::Sync
        };
        run_child(
            &store,
            &ledger,
            &lines,
            Some(kill_after),
            point,
            durability,
            &mut report,
        );
        report.cycles += 1;
        check(&store, &ledger, window(cycle), &mut report, false);
        if !report.ok() {
            return report;
        }
    }
    // Recovery: a child without kills delivers everything still unacknowledged.
    let lines = deliveries(&mut Rng(seed ^ 1), &report.acknowledged, window(cycles - 1));
    for line in &lines {
        for id in line.split_whitespace().skip(1) {
            report.attempted.insert(id.parse().expect("id"));
        }
    }
    run_child(
        &store,
        &ledger,
        &lines,
        None,
        None,
        Durability::Sync,
        &mut report,
    );
    check(&store, &ledger, window(cycles - 1), &mut report, true);
    report
}
