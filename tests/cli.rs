//! Guards the `idemdb` operator binary: every command against a store built with the library,
//! its exit codes, read commands on a live store, write commands refused on one, the repairs
//! (resolve, release, invalidate, purge, export/import round trip) checked through the library,
//! and backup / restore (round trip with unflushed merge operands, busy and existing targets
//! refused, the backup never changed, a copy to another file system), and a store moved to
//! PostgreSQL and back through `idemdb export`, `idemdb-pg import`, `idemdb-pg export` and
//! `idemdb import`, every record and read position exact, positions imported forward only
//! unless `--overwrite` and bad position lines refused on both backends, and a log consumer
//! moved from the embedded engine to PostgreSQL and back mid-stream with every message applied
//! once (needs PostgreSQL and the idemdb-pg binary; skipped without them unless
//! `IDEMDB_PG_BIN` is set).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idemdb::{
    Durability, Engine, EngineBuilder, Expiry, FailurePolicy, Fingerprint, MockClock, Outcome,
    TableOptions, format, merge_ops,
};
use serde_json::Value;

#[path = "support/files.rs"]
mod files;
#[path = "support/tmpfs.rs"]
mod tmpfs;
use files::{contents, names};
use tmpfs::Tmpfs;

const MINUTE_MS: u64 = 60 * 1000;
const DAY_MS: u64 = 24 * 60 * MINUTE_MS;

/// Runs `idemdb` with `args`; `stdin` is written to its standard input.
fn idemdb_with_input(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemdb"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run idemdb");
    let input = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        use std::io::Write;
        let mut input = input;
        input.write_all(bytes).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn idemdb(args: &[&str]) -> Output {
    idemdb_with_input(args, None)
}

#[track_caller]
fn expect_code(output: &Output, code: i32) {
    assert_eq!(
        output.status.code(),
        Some(code),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

#[track_caller]
fn json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "not JSON ({error}):\n{}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

fn real_now_ms() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    u64::try_from(since.as_millis()).unwrap()
}

/// A store the tests work on, with a mock clock so records can be made in the past; the
/// binary reads them with the real clock.
struct Fixture {
    dir: tempfile::TempDir,
    clock: MockClock,
}

impl Fixture {
    fn path(&self) -> &str {
        self.dir.path().to_str().unwrap()
    }

    fn open(&self) -> Engine {
        builder(self.dir.path(), &self.clock).open().unwrap()
    }
}

fn builder(path: &Path, clock: &MockClock) -> EngineBuilder {
    Engine::builder(path)
        .clock(clock.clone())
        .durability(Durability::Buffered)
        .business_table(TableOptions::new("orders"))
        .business_table(TableOptions::new("counters").merge_operator("add_u64", merge_ops::add_u64))
        .entity_table("customers")
}

fn commit(engine: &Engine, consumer: &str, key: &[u8], result: &str) {
    let consumer = engine.consumer(consumer).unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();
    match consumer.begin(key, Fingerprint::of(key)).unwrap() {
        Outcome::Fresh(mut claim) => {
            claim.put(&orders, key, result).unwrap();
            claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
            claim.commit(result).unwrap();
        }
        other => panic!("expected fresh, got {other:?}"),
    }
}

/// The store: consumer `billing` with `old-order` (expired), `order-1`, `order-2`, a binary
/// key `00 ff 'bin'` (live) and `broken` (an undecodable value); consumer `payments` with
/// `charge-stuck` (in progress for an hour, lease run out) and `charge-fresh` (in progress,
/// lease live); entity `customers/cust-1`. Business `counters` holds unflushed merge operands.
/// Returns the engine still open: the store is live.
fn fixture() -> (Fixture, Engine) {
    let now_ms = real_now_ms();
    let fixture = Fixture {
        dir: tempfile::tempdir().unwrap(),
        clock: MockClock::new(now_ms - 10 * DAY_MS),
    };
    // The corrupt value is written with plain RocksDB before any merge operand exists, which
    // plain RocksDB (without the business table's merge operator) could not flush.
    drop(fixture.open());
    {
        let names = rocksdb::DB::list_cf(&rocksdb::Options::default(), fixture.path()).unwrap();
        let db = rocksdb::DB::open_cf(&rocksdb::Options::default(), fixture.path(), names).unwrap();
        let records = db.cf_handle("idemdb.records").unwrap();
        let key = format::encode_key(b"billing", b"broken").unwrap();
        db.put_cf(records, key, b"\x01garbage").unwrap();
    }
    let engine = fixture.open();
    commit(&engine, "billing", b"old-order", "accepted old-order");
    fixture.clock.set(now_ms - 60 * MINUTE_MS);
    let payments = engine.consumer("payments").unwrap();
    let lease = Duration::from_secs(30);
    let Outcome::Fresh(_) = payments
        .begin_external("charge-stuck", Fingerprint::of("c1"), lease, "worker-1")
        .unwrap()
    else {
        panic!("charge-stuck: expected fresh");
    };
    fixture.clock.set(now_ms);
    let Outcome::Fresh(_) = payments
        .begin_external(
            "charge-fresh",
            Fingerprint::of("c2"),
            Duration::from_secs(3600),
            "worker-2",
        )
        .unwrap()
    else {
        panic!("charge-fresh: expected fresh");
    };
    commit(&engine, "billing", b"order-1", "accepted order-1");
    commit(&engine, "billing", b"order-2", "accepted order-2");
    commit(&engine, "billing", b"\x00\xffbin", "bin");
    let customers = engine.entity_table("customers").unwrap();
    let Outcome::Fresh(claim) = customers.begin("cust-1", Fingerprint::of("Ada")).unwrap() else {
        panic!("cust-1: expected fresh");
    };
    claim.commit("Ada").unwrap();
    (fixture, engine)
}

fn group<'a>(stats: &'a Value, consumer: &str) -> &'a Value {
    stats["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|group| group["consumer"] == consumer)
        .unwrap_or_else(|| panic!("no group for {consumer} in {stats}"))
}

#[test]
fn read_commands_work_on_a_live_store() {
    let (fixture, engine) = fixture();
    let store = fixture.path();

    let output = idemdb(&["stats", store, "--json"]);
    expect_code(&output, 0);
    let stats = json(&output);
    let billing = group(&stats, "billing");
    assert_eq!(billing["live"], 3);
    assert_eq!(billing["expired"], 1);
    assert_eq!(billing["corrupt"], 1);
    assert_eq!(group(&stats, "payments")["in_progress"], 2);
    assert_eq!(stats["totals"]["total"], 8);
    assert!(stats["disk_bytes"].as_u64().unwrap() > 0);
    let output = idemdb(&["stats", store]);
    expect_code(&output, 0);
    let text = stdout(&output);
    assert!(text.contains("CONSUMER"), "{text}");
    assert!(text.contains("payments"), "{text}");
    assert!(
        text.contains("8: 4 live, 1 expired, 2 in progress, 0 released, 1 corrupt"),
        "{text}"
    );

    let output = idemdb(&["get", store, "billing", "order-1", "--json"]);
    expect_code(&output, 0);
    let record = json(&output);
    assert_eq!(record["status"], "live");
    assert_eq!(record["result"], "accepted order-1");
    assert_eq!(record["epoch"], 1);
    let output = idemdb(&["get", store, "billing", "order-1"]);
    expect_code(&output, 0);
    assert!(stdout(&output).contains("accepted order-1"));
    expect_code(&idemdb(&["get", store, "billing", "no-such-order"]), 1);
    let output = idemdb(&["get", store, "billing", "hex:00ff62696e", "--json"]);
    expect_code(&output, 0);
    assert_eq!(
        json(&output)["key"],
        "0x00ff62696e",
        "binary keys print as hex"
    );
    let output = idemdb(&["get", store, "--entity", "customers", "cust-1", "--json"]);
    expect_code(&output, 0);
    assert_eq!(json(&output)["result"], "Ada");

    let output = idemdb(&["list", store, "--state", "expired", "--json"]);
    expect_code(&output, 0);
    let listed = json(&output);
    let keys: Vec<&str> = listed["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["old-order"]);

    let output = idemdb(&["in-progress", store, "--older-than", "5m", "--json"]);
    expect_code(&output, 0);
    let stuck = json(&output);
    assert_eq!(stuck["entries"].as_array().unwrap().len(), 1);
    assert_eq!(stuck["entries"][0]["key"], "charge-stuck");
    assert_eq!(stuck["entries"][0]["holder"], "worker-1");
    let output = idemdb(&["in-progress", store, "--older-than", "5m"]);
    expect_code(&output, 0);
    let text = stdout(&output);
    assert!(
        text.contains("charge-stuck") && !text.contains("charge-fresh"),
        "{text}"
    );

    let output = idemdb(&["verify", store]);
    expect_code(&output, 1);
    assert!(stdout(&output).contains("broken"), "{}", stdout(&output));
    let output = idemdb(&["verify", store, "--json"]);
    expect_code(&output, 1);
    let report = json(&output);
    assert_eq!(report["problems_total"], 1);
    assert_eq!(report["problems"][0]["key"], "broken");

    let output = idemdb(&["export", store]);
    expect_code(&output, 1);
    assert!(stderr(&output).contains("broken"));
    let lines: Vec<Value> = stdout(&output)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 7, "every decodable record");
    drop(engine);
}

#[test]
fn pages_are_joined_by_cursors() {
    let (fixture, _engine) = fixture();
    let store = fixture.path();
    let mut keys = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..10 {
        let mut args = vec!["list", store, "--limit", "3", "--json"];
        if let Some(cursor) = &after {
            args.extend(["--after", cursor.as_str()]);
        }
        let output = idemdb(&args);
        expect_code(&output, 0);
        let page = json(&output);
        keys.extend(
            page["entries"]
                .as_array()
                .unwrap()
                .iter()
                .map(|entry| entry["key_hex"].as_str().unwrap().to_owned()),
        );
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(
        keys.len(),
        8,
        "every entry, corrupt included, once: {keys:?}"
    );
    keys.dedup();
    assert_eq!(keys.len(), 8, "no entry twice: {keys:?}");
    let output = idemdb(&["list", store, "--limit", "3"]);
    expect_code(&output, 0);
    assert!(stdout(&output).contains("more: --after idemdb.records:"));
}

#[test]
fn write_commands_refuse_a_live_store_with_the_busy_code() {
    let (fixture, engine) = fixture();
    let store = fixture.path();
    for args in [
        vec![
            "resolve",
            store,
            "payments",
            "charge-stuck",
            "--result",
            "done",
        ],
        vec!["release", store, "payments", "charge-stuck"],
        vec!["invalidate", store, "billing", "order-1"],
        vec!["purge-expired", store],
    ] {
        let output = idemdb(&args);
        expect_code(&output, 3);
        assert!(stderr(&output).contains("busy"), "{}", stderr(&output));
    }
    let output = idemdb_with_input(&["import", store], Some(b""));
    expect_code(&output, 3);
    let started = Instant::now();
    expect_code(
        &idemdb(&[
            "release",
            store,
            "payments",
            "charge-stuck",
            "--wait",
            "300ms",
        ]),
        3,
    );
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "--wait retries"
    );
    // Nothing changed.
    let payments = engine.consumer("payments").unwrap();
    assert!(matches!(
        payments.get("charge-stuck").unwrap().unwrap().state,
        idemdb::RecordState::InProgress { .. }
    ));
}

#[test]
fn resolve_and_release_in_progress_keys_of_a_stopped_store() {
    let (fixture, engine) = fixture();
    let store = fixture.path();
    drop(engine);
    let output = idemdb(&[
        "resolve",
        store,
        "payments",
        "charge-stuck",
        "--result",
        "settled",
    ]);
    expect_code(&output, 0);
    assert!(stdout(&output).contains("completed"));
    expect_code(&idemdb(&["release", store, "payments", "charge-fresh"]), 0);
    let output = idemdb(&[
        "resolve",
        store,
        "payments",
        "charge-stuck",
        "--result",
        "again",
    ]);
    expect_code(&output, 1);
    assert!(stderr(&output).contains("not in progress"));

    let engine = fixture.open();
    let payments = engine.consumer("payments").unwrap();
    match payments
        .begin("charge-stuck", Fingerprint::of("c1"))
        .unwrap()
    {
        Outcome::Duplicate { result, .. } => assert_eq!(result, "settled"),
        other => panic!("expected the resolved result, got {other:?}"),
    }
    match payments
        .begin_external(
            "charge-fresh",
            Fingerprint::of("c2"),
            Duration::from_secs(30),
            "w",
        )
        .unwrap()
    {
        Outcome::Fresh(claim) => assert_eq!(claim.epoch(), 2),
        other => panic!("expected the released key to be free, got {other:?}"),
    }
}

#[test]
fn invalidate_makes_the_next_delivery_fresh_at_the_next_epoch() {
    let (fixture, engine) = fixture();
    let store = fixture.path();
    drop(engine);
    expect_code(&idemdb(&["invalidate", store, "billing", "order-1"]), 0);
    let output = idemdb(&["invalidate", store, "billing", "order-1"]);
    expect_code(&output, 1);
    assert!(stderr(&output).contains("released"), "{}", stderr(&output));
    let output = idemdb(&["get", store, "billing", "order-1", "--json"]);
    expect_code(&output, 0);
    assert_eq!(json(&output)["status"], "released");

    let engine = fixture.open();
    let billing = engine.consumer("billing").unwrap();
    match billing
        .begin("order-1", Fingerprint::of("order-1"))
        .unwrap()
    {
        Outcome::Fresh(claim) => assert_eq!(claim.commit("again").unwrap().epoch, 2),
        other => panic!("expected fresh after invalidate, got {other:?}"),
    }
    assert_eq!(billing.get("order-2").unwrap().unwrap().epoch, 1);
    // The business data written with the records survived the operator's open.
    let counters = engine.business_table("counters").unwrap();
    let n = counters
        .get("n")
        .unwrap()
        .and_then(|v| merge_ops::read_u64(&v));
    assert_eq!(n, Some(4));
}

#[test]
fn export_import_round_trips_exactly() {
    let (fixture, engine) = fixture();
    let exported_a = fixture.dir.path().join("a.jsonl");
    let exported_a = exported_a.to_str().unwrap();
    drop(engine);
    // The corrupt entry is reported and left out.
    expect_code(&idemdb(&["export", fixture.path(), "-o", exported_a]), 1);

    let target = Fixture {
        dir: tempfile::tempdir().unwrap(),
        clock: MockClock::new(real_now_ms()),
    };
    drop(target.open());
    let output = idemdb(&["import", target.path(), exported_a, "--json"]);
    expect_code(&output, 0);
    assert_eq!(json(&output)["imported"], 7);
    let output = idemdb(&["export", target.path()]);
    expect_code(&output, 0);
    let a = std::fs::read(exported_a).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&a),
        "export | import | export is the identity"
    );

    // Again: everything exists already, so it is skipped (exit 1); --overwrite replaces.
    let output = idemdb_with_input(&["import", target.path(), "--json"], Some(&a));
    expect_code(&output, 1);
    assert_eq!(json(&output)["skipped"], 7);
    let output = idemdb_with_input(
        &["import", target.path(), "-", "--overwrite", "--json"],
        Some(&a),
    );
    expect_code(&output, 0);
    assert_eq!(json(&output)["overwritten"], 7);
    expect_code(&idemdb(&["export", target.path(), "-o", exported_a]), 0);
    assert_eq!(std::fs::read(exported_a).unwrap(), a);

    // The imported in-progress record is the same claim: its holder's lease and epoch hold.
    let engine = target.open();
    let payments = engine.consumer("payments").unwrap();
    assert!(matches!(
        payments
            .begin("charge-fresh", Fingerprint::of("c2"))
            .unwrap(),
        Outcome::InProgress { epoch: Some(1), .. }
    ));
}

#[test]
fn purge_expired_removes_expired_records_and_keeps_the_rest() {
    let (fixture, engine) = fixture();
    let store = fixture.path();
    drop(engine);
    let output = idemdb(&["purge-expired", store, "--json"]);
    expect_code(&output, 0);
    let report = json(&output);
    assert_eq!(report["before"]["expired"], 1);
    assert_eq!(report["after"]["expired"], 0);
    assert_eq!(report["after"]["in_progress"], 2);
    assert_eq!(report["after"]["live"], 4);
    assert_eq!(
        report["after"]["corrupt"], 1,
        "undecodable values are kept as evidence"
    );
    let output = idemdb(&["purge-expired", store]);
    expect_code(&output, 0);
    assert!(
        stdout(&output).contains("after   7: 4 live, 0 expired"),
        "{}",
        stdout(&output)
    );
}

#[test]
fn bad_input_gets_the_documented_codes() {
    let (fixture, engine) = fixture();
    let store = fixture.path();
    let empty = tempfile::tempdir().unwrap();
    let missing = empty.path().join("missing");
    expect_code(&idemdb(&["stats", empty.path().to_str().unwrap()]), 4);
    expect_code(&idemdb(&["stats", missing.to_str().unwrap()]), 4);
    expect_code(
        &idemdb(&["release", missing.to_str().unwrap(), "c", "k"]),
        4,
    );
    assert!(!missing.exists(), "no command creates a store");
    for args in [
        vec!["get", store, "billing", "hex:0"],
        vec!["get", store, "billing", "hex:zz"],
        vec!["get", store, "billing", "a", "b"],
        vec!["get", store, "--entity", "customers", "a", "b"],
        vec!["get", store, "--entity", "orders", "a"],
        vec!["list", store, "--after", "nonsense"],
        vec!["list", store, "--older-than", "soon"],
        vec!["list", store, "--state", "sleeping"],
        vec!["list", store, "--table", "orders"],
        vec!["no-such-command", store],
    ] {
        expect_code(&idemdb(&args), 2);
    }
    drop(engine);
    // Malformed import input is refused before anything is written.
    let input = b"{\"table\":\"idemdb.records\"}\n";
    let output = idemdb_with_input(&["import", store], Some(input));
    expect_code(&output, 2);
    assert!(stderr(&output).contains("line 1"), "{}", stderr(&output));
}

#[test]
fn help_documents_the_exit_codes_and_the_live_store_rule() {
    let output = idemdb(&["--help"]);
    expect_code(&output, 0);
    let help = stdout(&output);
    assert!(help.contains("3  store busy"), "{help}");
    assert!(help.contains("Consumer::resolve"), "{help}");
    assert!(help.contains("Engine::checkpoint"), "{help}");
    assert!(help.contains("backup"), "{help}");
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Checks that the store at `path` holds what `fixture()` committed: the records (compared
/// through `export`, byte for byte, with the original's) and the business rows, the counter's
/// unflushed merge operands summed.
#[track_caller]
fn expect_fixture_contents(path: &Path, clock: &MockClock, original_export: &str) {
    let output = idemdb(&["export", path_str(path)]);
    expect_code(&output, 1);
    assert_eq!(stdout(&output), original_export, "every record, exactly");
    let engine = builder(path, clock).open().unwrap();
    let orders = engine.business_table("orders").unwrap();
    for key in ["old-order", "order-1", "order-2"] {
        assert!(orders.get(key).unwrap().is_some(), "no orders row {key}");
    }
    let counters = engine.business_table("counters").unwrap();
    let n = counters
        .get("n")
        .unwrap()
        .and_then(|v| merge_ops::read_u64(&v));
    assert_eq!(n, Some(4), "one merge operand per commit, none flushed");
    drop(engine);
}

#[test]
fn backup_then_restore_keeps_every_record_and_business_row() {
    let (fixture, engine) = fixture();
    drop(engine);
    let store = fixture.path();
    let original_export = stdout(&idemdb(&["export", store]));
    let elsewhere = tempfile::tempdir().unwrap();
    let backup = elsewhere.path().join("backup");

    let output = idemdb(&["backup", store, path_str(&backup), "--json"]);
    expect_code(&output, 0);
    let report = json(&output);
    assert_eq!(report["transfer"], "hard_links", "{report}");
    assert_eq!(report["backup"], path_str(&backup));
    let files = contents(&backup);
    assert_eq!(report["files"], files.len());
    assert_eq!(
        report["bytes"],
        files.values().map(Vec::len).sum::<usize>(),
        "{report}"
    );
    assert!(
        files
            .iter()
            .any(|(name, bytes)| name.ends_with(".log") && !bytes.is_empty()),
        "the unflushed commits travel in the WAL: {:?}",
        files.keys()
    );

    let restored = elsewhere.path().join("restored");
    let output = idemdb(&["restore", path_str(&backup), path_str(&restored), "--json"]);
    expect_code(&output, 0);
    let report = json(&output);
    assert_eq!(report["transfer"], "copy");
    assert_eq!(report["store"], path_str(&restored));
    assert_eq!(report["files"], files.len());
    assert_eq!(contents(&backup), files, "restore changed the backup");
    {
        use std::os::unix::fs::MetadataExt;
        let inode = |path: std::path::PathBuf| std::fs::metadata(path).unwrap().ino();
        for name in files.keys() {
            assert_ne!(
                inode(backup.join(name)),
                inode(restored.join(name)),
                "{name}: restored as a hard link to the backup"
            );
        }
    }

    expect_fixture_contents(&restored, &fixture.clock, &original_export);
    // The restored store was opened, written (its WAL replayed and flushed) and closed.
    assert_eq!(
        contents(&backup),
        files,
        "the restored store reached the backup"
    );
    assert_eq!(
        names(elsewhere.path()),
        ["backup", "restored"],
        "no staging directory left"
    );

    // The summary as a table.
    let output = idemdb(&["backup", store, path_str(&elsewhere.path().join("again"))]);
    expect_code(&output, 0);
    let text = stdout(&output);
    assert!(
        text.contains("FILES") && text.contains("hard links"),
        "{text}"
    );
    let output = idemdb(&[
        "restore",
        path_str(&backup),
        path_str(&elsewhere.path().join("restored-again")),
    ]);
    expect_code(&output, 0);
    assert!(stdout(&output).contains("copy"), "{}", stdout(&output));
}

#[test]
fn backup_of_a_live_store_is_busy_and_writes_nothing() {
    let (fixture, engine) = fixture();
    let elsewhere = tempfile::tempdir().unwrap();
    let backup = elsewhere.path().join("backup");
    let output = idemdb(&["backup", fixture.path(), path_str(&backup)]);
    expect_code(&output, 3);
    let message = stderr(&output);
    assert!(message.contains("busy"), "{message}");
    assert!(message.contains("Engine::checkpoint"), "{message}");
    assert!(names(elsewhere.path()).is_empty(), "nothing written");
    // Restoring from a live store is refused too: its files change while they are copied.
    let restored = elsewhere.path().join("restored");
    let output = idemdb(&["restore", fixture.path(), path_str(&restored)]);
    expect_code(&output, 3);
    assert!(names(elsewhere.path()).is_empty(), "nothing written");
    // The online way works meanwhile.
    engine.checkpoint(&backup).unwrap();
}

#[test]
fn backup_to_an_existing_or_impossible_directory_is_refused() {
    let (fixture, engine) = fixture();
    drop(engine);
    let store_files = contents(fixture.dir.path());
    let elsewhere = tempfile::tempdir().unwrap();
    let existing = elsewhere.path().join("existing");
    std::fs::create_dir(&existing).unwrap();
    std::fs::write(existing.join("keep"), b"mine").unwrap();
    for target in [
        existing.clone(),
        existing.join("keep"),
        elsewhere.path().join("no-parent/backup"),
    ] {
        let output = idemdb(&["backup", fixture.path(), path_str(&target)]);
        expect_code(&output, 2);
    }
    assert_eq!(names(elsewhere.path()), ["existing"]);
    assert_eq!(names(&existing), ["keep"]);
    assert_eq!(std::fs::read(existing.join("keep")).unwrap(), b"mine");
    assert_eq!(
        contents(fixture.dir.path()),
        store_files,
        "a refused backup does not open the store"
    );
}

#[test]
fn restore_onto_an_existing_path_or_from_a_non_store_is_refused() {
    let (fixture, engine) = fixture();
    drop(engine);
    let elsewhere = tempfile::tempdir().unwrap();
    let backup = elsewhere.path().join("backup");
    expect_code(&idemdb(&["backup", fixture.path(), path_str(&backup)]), 0);
    let files = contents(&backup);

    // Onto an existing store: refused, and neither directory changes.
    let store_files = contents(fixture.dir.path());
    let output = idemdb(&["restore", path_str(&backup), fixture.path()]);
    expect_code(&output, 2);
    assert!(stderr(&output).contains("exists"), "{}", stderr(&output));
    assert_eq!(contents(fixture.dir.path()), store_files);
    assert_eq!(contents(&backup), files);
    let empty = elsewhere.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    expect_code(
        &idemdb(&["restore", path_str(&backup), path_str(&empty)]),
        2,
    );
    assert!(names(&empty).is_empty());

    // From directories that hold no store: the not-a-store code.
    let not_a_store = elsewhere.path().join("not-a-store");
    std::fs::create_dir(&not_a_store).unwrap();
    std::fs::write(not_a_store.join("notes.txt"), b"hello").unwrap();
    let restored = elsewhere.path().join("restored");
    for source in [
        not_a_store.clone(),
        empty.clone(),
        elsewhere.path().join("missing"),
    ] {
        let output = idemdb(&["restore", path_str(&source), path_str(&restored)]);
        expect_code(&output, 4);
    }
    assert_eq!(names(elsewhere.path()), ["backup", "empty", "not-a-store"]);
    assert_eq!(contents(&backup), files);
}

#[test]
fn backup_to_another_file_system_copies_every_byte() {
    let Some(tmpfs) = Tmpfs::mount(64) else {
        eprintln!(
            "skipped backup_to_another_file_system_copies_every_byte: mounting a tmpfs was \
             refused (the test needs root or CAP_SYS_ADMIN)"
        );
        return;
    };
    let (fixture, engine) = fixture();
    drop(engine);
    let original_export = stdout(&idemdb(&["export", fixture.path()]));
    let store_parent = fixture.dir.path().parent().unwrap().to_path_buf();
    let beside_store = names(&store_parent);
    let backup = tmpfs.path().join("backup");

    let output = idemdb(&["backup", fixture.path(), path_str(&backup), "--json"]);
    expect_code(&output, 0);
    let report = json(&output);
    assert_eq!(report["transfer"], "copy", "{report}");
    assert_eq!(report["linked_files"], 0);
    let files = contents(&backup);
    assert_eq!(report["files"], files.len());
    assert_eq!(report["bytes"], files.values().map(Vec::len).sum::<usize>());
    assert_eq!(names(tmpfs.path()), ["backup"], "no partial copy left");
    // The staging checkpoint beside the store is gone. (The parent is the shared temporary
    // directory: other tests' entries come and go, so only ours are looked for.)
    let staging_left: Vec<String> = names(&store_parent)
        .into_iter()
        .filter(|name| name.contains(".idemdb-") && !beside_store.contains(name))
        .collect();
    assert!(staging_left.is_empty(), "{staging_left:?}");

    // Restored from the other file system onto this one, and opened.
    let elsewhere = tempfile::tempdir().unwrap();
    let restored = elsewhere.path().join("restored");
    expect_code(
        &idemdb(&["restore", path_str(&backup), path_str(&restored)]),
        0,
    );
    assert_eq!(contents(&backup), files);
    expect_fixture_contents(&restored, &fixture.clock, &original_export);
    assert_eq!(contents(&backup), files);
}

#[test]
fn stats_shows_a_full_disk() {
    let Some(tmpfs) = Tmpfs::mount(16) else {
        eprintln!(
            "skipped stats_shows_a_full_disk: mounting a tmpfs was refused (the test needs root \
             or CAP_SYS_ADMIN)"
        );
        return;
    };
    let store = tmpfs.path().join("store");
    drop(Engine::builder(&store).open().unwrap());
    let store = path_str(&store);
    let roomy = json(&idemdb(&["stats", store, "--json"]));
    assert_eq!(roomy["space"]["full"], false, "{roomy}");
    assert!(!stdout(&idemdb(&["stats", store])).contains("FULL"));

    // Fill the file system to the last byte.
    let ballast_path = tmpfs.path().join("ballast");
    let mut ballast = std::fs::File::create(&ballast_path).unwrap();
    let chunk = vec![0u8; 64 << 10];
    loop {
        use std::io::Write;
        if let Err(error) = ballast.write_all(&chunk) {
            assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "{error}");
            break;
        }
    }
    drop(ballast);
    let output = idemdb(&["stats", store]);
    expect_code(&output, 0);
    let text = stdout(&output);
    let line = text
        .lines()
        .find(|line| line.starts_with("space"))
        .unwrap_or_else(|| panic!("no space line:\n{text}"));
    assert!(line.contains("0 B free") && line.contains("FULL"), "{line}");
    let full = json(&idemdb(&["stats", store, "--json"]));
    assert_eq!(full["space"]["full"], true, "{full}");
    assert_eq!(full["space"]["available_bytes"], 0, "{full}");
    assert_eq!(full["space"]["total_bytes"], 16 << 20, "{full}");

    std::fs::remove_file(&ballast_path).unwrap();
    let freed = json(&idemdb(&["stats", store, "--json"]));
    assert_eq!(freed["space"]["full"], false, "{freed}");
}

// The PostgreSQL backend's private server (skipped where PostgreSQL is not installed).
#[path = "../postgres/tests/support/server.rs"]
mod pg_server;

/// The `idemdb-pg` binary: `IDEMDB_PG_BIN` (required to exist when set: scripts/test.sh sets
/// it), else beside this test's directory in the build cache, where the postgres crate's tests
/// leave it.
fn idemdb_pg_binary() -> Option<std::path::PathBuf> {
    if let Ok(path) = std::env::var("IDEMDB_PG_BIN") {
        let path = std::path::PathBuf::from(path);
        assert!(
            path.is_file(),
            "IDEMDB_PG_BIN={} is no file",
            path.display()
        );
        return Some(path);
    }
    let exe = std::env::current_exe().ok()?;
    let beside = exe.parent()?.parent()?.join("idemdb-pg");
    beside.is_file().then_some(beside)
}

fn idemdb_pg(binary: &Path, args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write as _;
    let mut child = Command::new(binary)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

/// A stored record: table, consumer (consumers' table), key and the decoded record.
type StoredRecord = (String, Option<Vec<u8>>, Vec<u8>, format::Record);

/// Every record of the store at `path`, in table and key order, read through the library (not
/// through the export lines): table, consumer, key and the decoded record.
fn stored_records(path: &Path) -> Vec<StoredRecord> {
    let store = idemdb::admin::Store::builder(path)
        .open_read_only()
        .unwrap();
    let mut records = Vec::new();
    store
        .scan(&idemdb::admin::Filter::new(), None, |entry| {
            let record = entry.record.expect("every record decodes");
            records.push((
                entry.table,
                entry.consumer.map(|consumer| consumer.to_vec()),
                entry.key.to_vec(),
                record,
            ));
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    records
}

/// The state of a record as export lines name it.
fn state_label(record: &format::Record) -> &'static str {
    match record.state {
        format::RecordState::Completed { .. } => "completed",
        format::RecordState::InProgress { .. } => "in_progress",
        format::RecordState::Released { .. } => "released",
        _ => "unknown",
    }
}

#[test]
fn a_store_moves_to_postgres_and_back_through_the_operator_tools() {
    let Some(pg_tool) = idemdb_pg_binary() else {
        eprintln!(
            "skipped: no idemdb-pg binary (cargo build --release -p idemdb-postgres, or set \
             IDEMDB_PG_BIN)"
        );
        return;
    };
    let server = match pg_server::Server::start() {
        Ok(server) => server,
        Err(why) => {
            eprintln!("skipped: cannot start PostgreSQL ({why})");
            return;
        }
    };
    let url = server.url();
    // Consumers' records in every state: completed (one expired, one binary key, one never
    // expiring), a recorded failure, in progress (external claims), released. Consumer `tax`
    // has the shortest id but sorts last byte by byte: both exports must put it first.
    let now_ms = real_now_ms();
    let store = Fixture {
        dir: tempfile::tempdir().unwrap(),
        clock: MockClock::new(now_ms - 10 * DAY_MS),
    };
    let engine = store.open();
    commit(&engine, "billing", b"old-order", "accepted old-order");
    store.clock.set(now_ms - 60 * MINUTE_MS);
    let payments = engine.consumer("payments").unwrap();
    let external = |key: &str, holder: &str| match payments
        .begin_external(key, Fingerprint::of(key), Duration::from_secs(3600), holder)
        .unwrap()
    {
        Outcome::Fresh(claim) => claim,
        other => panic!("{key}: expected fresh, got {other:?}"),
    };
    drop(external("charge-stuck", "worker-1"));
    store.clock.set(now_ms);
    drop(external("charge-fresh", "worker-2"));
    external("charge-failed", "worker-3")
        .fail(FailurePolicy::RecordFailure("card declined".into()))
        .unwrap();
    external("charge-released", "worker-4").release().unwrap();
    commit(&engine, "billing", b"order-1", "accepted order-1");
    commit(&engine, "billing", b"\x00\xffbin", "bin");
    let audit = engine.consumer("audit").unwrap();
    let Outcome::Fresh(mut claim) = audit.begin("entry-1", Fingerprint::of("e")).unwrap() else {
        panic!("entry-1: expected fresh");
    };
    claim.set_expiry(Expiry::Never).unwrap();
    claim.commit("kept").unwrap();
    commit(&engine, "tax", b"vat-1", "filed");
    // Read positions: both exports write them after the records, by consumer id and source
    // byte by byte (not the records' shorter-first order) and partition.
    let billing = engine.consumer("billing").unwrap().positions();
    billing.advance("orders", 0, 41).unwrap();
    billing.advance("orders", 2, 7).unwrap();
    billing.advance("aaa", 0, u64::MAX >> 1).unwrap();
    billing.advance("zz", 4_000_000_000, 0).unwrap();
    store.clock.set(now_ms + MINUTE_MS);
    engine
        .consumer("tax")
        .unwrap()
        .positions()
        .advance("filings", 0, 3)
        .unwrap();
    drop(engine);
    let positions = 5;

    // One record per key made above, in the stored key's order (consumer id shorter first).
    // The export writes every record that decodes, expired and released ones included (it
    // leaves out only undecodable values, reported with exit code 1): one line per record.
    let original = stored_records(store.dir.path());
    let made: Vec<(&str, &[u8], &str)> = original
        .iter()
        .map(|(table, consumer, key, record)| {
            assert_eq!(table, idemdb::transfer::CONSUMERS_TABLE);
            let consumer = std::str::from_utf8(consumer.as_deref().unwrap()).unwrap();
            (consumer, key.as_slice(), state_label(record))
        })
        .collect();
    assert_eq!(
        made,
        [
            ("tax", &b"vat-1"[..], "completed"),
            ("audit", b"entry-1", "completed"),
            ("billing", b"\x00\xffbin", "completed"),
            ("billing", b"old-order", "completed"),
            ("billing", b"order-1", "completed"),
            ("payments", b"charge-failed", "completed"),
            ("payments", b"charge-fresh", "in_progress"),
            ("payments", b"charge-released", "released"),
            ("payments", b"charge-stuck", "in_progress"),
        ]
    );
    let records = original.len();
    let output = idemdb(&["export", store.path()]);
    expect_code(&output, 0);
    let first = output.stdout;
    let (record_lines, position_lines): (Vec<&str>, Vec<&str>) = std::str::from_utf8(&first)
        .unwrap()
        .lines()
        .partition(|line| !line.starts_with("{\"kind\":\"position\""));
    assert_eq!(
        position_lines,
        [
            ("aaa", 0, u64::MAX >> 1),
            ("orders", 0, 41),
            ("orders", 2, 7),
            ("zz", 4_000_000_000u64, 0u64),
        ]
        .map(|(source, partition, offset)| {
            format!(
                "{{\"kind\":\"position\",\"consumer\":\"billing\",\"consumer_hex\":\
                 \"62696c6c696e67\",\"source\":\"{source}\",\"partition\":{partition},\
                 \"offset\":{offset},\"updated_at_ms\":{now_ms}}}"
            )
        })
        .into_iter()
        .chain([format!(
            "{{\"kind\":\"position\",\"consumer\":\"tax\",\"consumer_hex\":\"746178\",\
             \"source\":\"filings\",\"partition\":0,\"offset\":3,\"updated_at_ms\":{}}}",
            now_ms + MINUTE_MS
        )])
        .collect::<Vec<String>>(),
        "every position after every record, by consumer and source byte by byte"
    );
    assert_eq!(
        record_lines.len() + position_lines.len(),
        String::from_utf8_lossy(&first).lines().count()
    );
    assert!(
        String::from_utf8_lossy(&first)
            .lines()
            .skip(record_lines.len())
            .all(|line| line.starts_with("{\"kind\":\"position\"")),
        "the positions come last"
    );
    let first_keys: Vec<Value> = record_lines
        .iter()
        .map(|line| {
            let line: Value = serde_json::from_str(line).unwrap();
            serde_json::json!([line["consumer"], line["key"], line["state"]])
        })
        .collect();
    let made_keys: Vec<Value> = made
        .iter()
        .map(|(consumer, key, state)| serde_json::json!([consumer, format::printable(key), state]))
        .collect();
    assert_eq!(
        first_keys, made_keys,
        "one line per record, in the store's order"
    );

    let connection = ["--url", url.as_str(), "--schema", "moved"];
    let with = |command: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec![command.to_owned()];
        args.extend(connection.iter().chain(extra).map(|arg| (*arg).to_owned()));
        args
    };
    let run = |args: Vec<String>, stdin: &[u8]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        idemdb_pg(&pg_tool, &args, stdin)
    };
    expect_code(&run(with("install", &[]), b""), 0);
    let output = run(with("import", &[]), &first);
    expect_code(&output, 0);
    assert!(
        stdout(&output).contains(&format!(
            "imported {records}, overwritten 0, skipped 0\nread positions: imported {positions}, \
             advanced 0, overwritten 0, skipped 0"
        )),
        "{}",
        stdout(&output)
    );
    let output = run(with("export", &[]), b"");
    expect_code(&output, 0);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&first),
        "PostgreSQL's export is the embedded store's, byte for byte and in its order"
    );
    let from_postgres = output.stdout;

    let back = Fixture {
        dir: tempfile::tempdir().unwrap(),
        clock: MockClock::new(now_ms),
    };
    drop(back.open());
    let output = idemdb_with_input(&["import", back.path(), "--json"], Some(&from_postgres));
    expect_code(&output, 0);
    assert_eq!(json(&output)["imported"], records);
    assert_eq!(
        json(&output)["positions"],
        serde_json::json!({"imported": positions, "advanced": 0, "overwritten": 0, "skipped": 0})
    );
    let output = idemdb(&["export", back.path()]);
    expect_code(&output, 0);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&first),
        "embedded -> PostgreSQL -> embedded keeps every record exactly"
    );
    // Compared as records too, not only as lines: a field the line format lost on the way
    // (written by neither export, defaulted on reading) would leave the lines equal.
    assert_eq!(
        stored_records(back.dir.path()),
        original,
        "every record, field for field, read through the library"
    );
    let stored_positions = |path: &Path| {
        idemdb::admin::Store::builder(path)
            .open_read_only()
            .unwrap()
            .positions(None)
            .unwrap()
    };
    assert_eq!(
        stored_positions(back.dir.path()),
        stored_positions(store.dir.path()),
        "every read position, offset and time, read through the library"
    );

    // An entity table's record has no place in PostgreSQL: refused, nothing written.
    let (entities, engine) = fixture();
    drop(engine);
    let output = idemdb(&["export", entities.path()]);
    let output = run(with("import", &["--overwrite"]), &output.stdout);
    expect_code(&output, 2);
    assert!(stderr(&output).contains("customers"), "{}", stderr(&output));
    let output = run(with("export", &[]), b"");
    assert_eq!(
        output.stdout, from_postgres,
        "nothing of the refused input was written"
    );

    // A position moves forward only, unless --overwrite: behind the stored one it is skipped
    // (exit 1), ahead of it it advances it, and --overwrite sets it backwards too; the same on
    // both backends.
    let moved = |offset: u64| {
        format!(
            "{{\"kind\":\"position\",\"consumer\":\"billing\",\"consumer_hex\":\
             \"62696c6c696e67\",\"source\":\"orders\",\"partition\":0,\"offset\":{offset},\
             \"updated_at_ms\":5}}\n"
        )
    };
    let pg_offset = || {
        let listed = idemdb_pg(
            &pg_tool,
            &[
                "positions",
                "list",
                "--url",
                &url,
                "--schema",
                "moved",
                "--consumer",
                "billing",
            ],
            b"",
        );
        expect_code(&listed, 0);
        stdout(&listed)
            .lines()
            .find(|line| line.starts_with("orders ") && line.split_whitespace().nth(1) == Some("0"))
            .and_then(|line| line.split_whitespace().nth(2))
            .unwrap()
            .to_owned()
    };
    let embedded_offset = || {
        stored_positions(back.dir.path())
            .into_iter()
            .find(|entry| entry.position.source == "orders" && entry.position.partition == 0)
            .unwrap()
            .position
            .offset
            .to_string()
    };
    for (offset, overwrite, code, counts, after) in [
        (
            40,
            false,
            1,
            "imported 0, advanced 0, overwritten 0, skipped 1",
            "41",
        ),
        (
            41,
            false,
            1,
            "imported 0, advanced 0, overwritten 0, skipped 1",
            "41",
        ),
        (
            50,
            false,
            0,
            "imported 0, advanced 1, overwritten 0, skipped 0",
            "50",
        ),
        (
            40,
            true,
            0,
            "imported 0, advanced 0, overwritten 1, skipped 0",
            "40",
        ),
    ] {
        let flag: &[&str] = if overwrite { &["--overwrite"] } else { &[] };
        let output = run(with("import", flag), moved(offset).as_bytes());
        expect_code(&output, code);
        assert!(
            stdout(&output).contains(&format!("read positions: {counts}")),
            "{offset}: {}",
            stdout(&output)
        );
        assert_eq!(pg_offset(), after, "PostgreSQL, {offset}");
        let mut args = vec!["import", back.path()];
        args.extend(flag);
        let output = idemdb_with_input(&args, Some(moved(offset).as_bytes()));
        expect_code(&output, code);
        assert!(
            stdout(&output).contains(&format!("read positions: {counts}")),
            "{offset}: {}",
            stdout(&output)
        );
        assert_eq!(embedded_offset(), after, "embedded, {offset}");
    }
    // Refused before anything is written, on both backends: a position given twice, one
    // PostgreSQL cannot store (offset past i64::MAX; the embedded store takes it), a line of a
    // kind this release does not know.
    // Each after a record of a new key (`tax` `new`), which is not written either.
    let new_record = format!(
        "{}\n",
        record_lines[0].replace("\"key_hex\":\"7661742d31\"", "\"key_hex\":\"6e6577\"")
    );
    assert_ne!(new_record.trim_end(), record_lines[0]);
    let twice = format!("{new_record}{}{}", moved(60), moved(61));
    let too_far = format!("{new_record}{}", moved(u64::MAX));
    let unknown = format!("{new_record}{}", moved(60)).replace("\"position\"", "\"watermark\"");
    for (input, embedded_refuses) in [(&twice, true), (&too_far, false), (&unknown, true)] {
        let output = run(with("import", &["--overwrite"]), input.as_bytes());
        expect_code(&output, 2);
        assert_eq!(pg_offset(), "40", "nothing written: {}", stderr(&output));
        let exported = run(with("export", &[]), b"");
        assert!(
            !stdout(&exported).contains("6e6577"),
            "no record written: {}",
            stderr(&output)
        );
        if embedded_refuses {
            let output = idemdb_with_input(&["import", back.path()], Some(input.as_bytes()));
            expect_code(&output, 2);
            assert_eq!(
                embedded_offset(),
                "40",
                "nothing written: {}",
                stderr(&output)
            );
            assert!(
                !stored_records(back.dir.path())
                    .iter()
                    .any(|(_, _, key, _)| key == b"new"),
                "no record written: {}",
                stderr(&output)
            );
        }
    }
    assert!(
        stderr(&run(with("import", &[]), unknown.as_bytes())).contains("\"watermark\""),
        "the refusal names the kind"
    );
    drop(server);
}

#[test]
fn positions_are_listed_beside_a_live_consumer_and_reset_only_when_it_is_stopped() {
    let fixture = Fixture {
        dir: tempfile::tempdir().unwrap(),
        clock: MockClock::new(real_now_ms()),
    };
    let store = fixture.path();
    let engine = fixture.open();
    let billing = engine.consumer("billing").unwrap();
    billing.positions().advance("orders", 0, 41).unwrap();
    billing.positions().advance("orders", 3, 7).unwrap();
    engine
        .consumer("audit")
        .unwrap()
        .positions()
        .advance("events", 0, 5)
        .unwrap();

    // Listed while the consumer runs, all or one consumer's, as a table or JSON.
    let listed = idemdb(&["positions", "list", store]);
    expect_code(&listed, 0);
    let text = stdout(&listed);
    assert!(text.contains("RESUME AT"), "{text}");
    assert_eq!(
        text.lines().count(),
        4,
        "a header and three positions: {text}"
    );
    let listed = json(&idemdb(&[
        "--json",
        "positions",
        "list",
        store,
        "--consumer",
        "billing",
    ]));
    let positions = listed["positions"].as_array().unwrap();
    assert_eq!(positions.len(), 2);
    assert_eq!(positions[0]["source"], "orders");
    assert_eq!(positions[0]["offset"], 41);
    assert_eq!(positions[0]["next_offset"], 42);
    assert_eq!(positions[1]["partition"], 3);

    // A reset needs the store to itself.
    let busy = idemdb(&["positions", "set", store, "billing", "orders", "0", "9"]);
    expect_code(&busy, 3);
    assert!(stderr(&busy).contains("busy"), "{}", stderr(&busy));
    expect_code(
        &idemdb(&["positions", "remove", store, "billing", "orders", "3"]),
        3,
    );
    assert_eq!(
        billing
            .positions()
            .get("orders", 0)
            .unwrap()
            .unwrap()
            .offset,
        41
    );
    drop((billing, engine));

    // Backwards, to replay from offset 10; and removed.
    let set = json(&idemdb(&[
        "--json",
        "positions",
        "set",
        store,
        "billing",
        "orders",
        "0",
        "9",
    ]));
    assert_eq!(set["previous_offset"], 41);
    assert_eq!(set["offset"], 9);
    let removed = idemdb(&["positions", "remove", store, "billing", "orders", "3"]);
    expect_code(&removed, 0);
    assert!(
        stdout(&removed).contains("removed (was offset 7)"),
        "{}",
        stdout(&removed)
    );
    let bad = idemdb(&["positions", "set", store, "billing", "", "0", "1"]);
    expect_code(&bad, 2);

    let engine = fixture.open();
    let billing = engine.consumer("billing").unwrap();
    assert_eq!(
        billing
            .positions()
            .get("orders", 0)
            .unwrap()
            .unwrap()
            .next_offset(),
        10
    );
    assert!(billing.positions().get("orders", 3).unwrap().is_none());
    // The consumer moves on from the reset position.
    billing.positions().advance("orders", 0, 10).unwrap();
    drop((billing, engine));
    let empty = tempfile::tempdir().unwrap();
    drop(builder(empty.path(), &fixture.clock).open().unwrap());
    let none = idemdb(&["positions", "list", path_str(empty.path())]);
    expect_code(&none, 0);
    assert_eq!(stdout(&none).trim(), "no read positions");
}

/// The log of the moved consumer: the message at offset `i` is `log[i]`, its key. A key
/// published again later (a producer's retry) is the same message: its second delivery is a
/// duplicate, never applied.
fn moved_log(length: usize) -> Vec<String> {
    (0..length)
        .map(|offset| {
            let original = if offset % 7 == 3 { offset - 2 } else { offset };
            format!("order-{original}")
        })
        .collect()
}

/// How many messages before its position a consumer reads again when it starts: a broker
/// redelivering what was not acknowledged. Their claims are duplicates.
const MOVED_REPLAY: u64 = 3;

/// Where a run of the moved consumer starts: one past its position, less the replay; without
/// a position, at the log's end as published so far (a consumer configured to start at the
/// latest offset, as a new Kafka consumer group is by default), so a position lost on the way
/// skips the messages published before the consumer started.
fn moved_start(position: Option<idemdb::Position>, published: usize) -> u64 {
    position.map_or(published as u64, |position| {
        position.next_offset().saturating_sub(MOVED_REPLAY)
    })
}

/// One run of the moved consumer on the embedded engine: from its start (`moved_start`) to
/// `until`, each fresh message's effect (one more in `applied`, under its key) and the read
/// position in its claim's batch, a duplicate past the position moving the position alone;
/// then the message at `until` claimed, its effect staged and the claim dropped (a crash
/// before its commit). Returns where it started.
fn moved_embedded_run(engine: &Engine, log: &[String], published: usize, until: usize) -> u64 {
    let consumer = engine.consumer("mover").unwrap();
    let applied = engine.business_table("applied").unwrap();
    let positions = consumer.positions();
    let start = moved_start(positions.get("orders", 0).unwrap(), published);
    for offset in start..=until as u64 {
        let key = &log[offset as usize];
        let stored = positions.get("orders", 0).unwrap().map(|p| p.offset);
        match consumer.begin(key, Fingerprint::of(key)).unwrap() {
            Outcome::Fresh(mut claim) => {
                claim.merge(&applied, key, 1u64.to_be_bytes()).unwrap();
                claim.stage_position("orders", 0, offset).unwrap();
                if offset == until as u64 {
                    drop(claim);
                } else {
                    claim.commit(format!("applied at {offset}")).unwrap();
                }
            }
            Outcome::Duplicate { .. } if stored.is_none_or(|stored| stored < offset) => {
                positions.advance("orders", 0, offset).unwrap();
            }
            Outcome::Duplicate { .. } => {}
            other => panic!("offset {offset}: {other:?}"),
        }
    }
    start
}

/// The same run on PostgreSQL: each fresh message's effect is a row of `moved.applied` in the
/// claim's transaction, with the read position.
async fn moved_postgres_run(
    store: &idemdb_postgres::PgStore,
    client: &mut tokio_postgres::Client,
    log: &[String],
    published: usize,
    until: usize,
) -> u64 {
    use tokio_postgres::types::Type;
    let consumer = store.consumer("mover").unwrap();
    let positions = consumer.positions();
    let start = moved_start(
        positions.get(&*client, "orders", 0).await.unwrap(),
        published,
    );
    let insert = "INSERT INTO moved.applied (message_key, at_offset) VALUES ($1, $2)";
    for offset in start..=until as u64 {
        let key = log[offset as usize].as_str();
        let stored = positions
            .get(&*client, "orders", 0)
            .await
            .unwrap()
            .map(|p| p.offset);
        let duplicate = match consumer
            .begin(client, key, Fingerprint::of(key))
            .await
            .unwrap()
        {
            Outcome::Fresh(mut claim) => {
                claim.stage_position("orders", 0, offset).unwrap();
                if offset == until as u64 {
                    drop(claim);
                    continue;
                }
                let at = offset as i64;
                claim
                    .commit_with(
                        format!("applied at {offset}"),
                        &[(insert, &[(&key, Type::TEXT), (&at, Type::INT8)])],
                    )
                    .await
                    .unwrap();
                false
            }
            Outcome::Duplicate { .. } => true,
            other => panic!("offset {offset}: {other:?}"),
        };
        // Past the match: the outcome borrowed the connection.
        if duplicate && stored.is_none_or(|stored| stored < offset) {
            positions
                .advance(client, "orders", 0, offset)
                .await
                .unwrap();
        }
    }
    start
}

/// The effects the embedded store at `path` holds: key -> times applied.
fn moved_embedded_effects(
    path: &Path,
    clock: &MockClock,
    log: &[String],
) -> std::collections::BTreeMap<String, u64> {
    let engine = moved_builder(path, clock).open().unwrap();
    let applied = engine.business_table("applied").unwrap();
    let mut effects = std::collections::BTreeMap::new();
    for key in log {
        if let Some(count) = applied.get(key).unwrap() {
            effects.insert(key.clone(), u64::from_be_bytes(count.try_into().unwrap()));
        }
    }
    effects
}

fn moved_builder(path: &Path, clock: &MockClock) -> EngineBuilder {
    Engine::builder(path)
        .clock(clock.clone())
        .durability(Durability::Buffered)
        .business_table(TableOptions::new("applied").merge_operator("add_u64", merge_ops::add_u64))
}

#[test]
fn a_log_consumer_moves_to_postgres_and_back_mid_stream_without_loss_or_double() {
    let Some(pg_tool) = idemdb_pg_binary() else {
        eprintln!(
            "skipped: no idemdb-pg binary (cargo build --release -p idemdb-postgres, or set \
             IDEMDB_PG_BIN)"
        );
        return;
    };
    let server = match pg_server::Server::start() {
        Ok(server) => server,
        Err(why) => {
            eprintln!("skipped: cannot start PostgreSQL ({why})");
            return;
        }
    };
    let url = server.url();
    let connection = ["--url", url.as_str(), "--schema", "moved"];
    let pg = |command: &str, extra: &[&str], stdin: &[u8]| {
        let mut args = vec![command];
        args.extend(connection.iter().chain(extra));
        idemdb_pg(&pg_tool, &args, stdin)
    };
    let log = moved_log(60);
    let clock = MockClock::new(real_now_ms());

    // On the embedded engine: a first run from the log's start (nothing published yet), to
    // offset 12, a crash there; a second from its position to offset 30 of the 45 published.
    let first = Fixture {
        dir: tempfile::tempdir().unwrap(),
        clock: clock.clone(),
    };
    let engine = moved_builder(first.dir.path(), &clock).open().unwrap();
    assert_eq!(moved_embedded_run(&engine, &log, 0, 12), 0);
    assert_eq!(moved_embedded_run(&engine, &log, 25, 30), 12 - MOVED_REPLAY);
    let stopped_at = engine
        .consumer("mover")
        .unwrap()
        .positions()
        .get("orders", 0)
        .unwrap()
        .expect("a position")
        .offset;
    assert_eq!(stopped_at, 29, "the crashed claim at 30 moved nothing");
    drop(engine);

    // Moved to PostgreSQL by the operator tools, position and all.
    let output = idemdb(&["export", first.path()]);
    expect_code(&output, 0);
    let exported = output.stdout;
    let last_line = String::from_utf8_lossy(&exported)
        .lines()
        .last()
        .unwrap()
        .to_owned();
    assert!(
        last_line.starts_with("{\"kind\":\"position\"") && last_line.contains("\"offset\":29,"),
        "the position is the export's last line: {last_line}"
    );
    expect_code(&pg("install", &[], b""), 0);
    let output = pg("import", &[], &exported);
    expect_code(&output, 0);
    assert!(
        stdout(&output)
            .contains("read positions: imported 1, advanced 0, overwritten 0, skipped 0"),
        "{}",
        stdout(&output)
    );

    // On PostgreSQL: resumes where the embedded consumer stopped (the replay's duplicates
    // found among the imported records), to offset 51 of the 60 published, a crash there.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let pg_effects = runtime.block_on(async {
        let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
            .batch_execute(
                "CREATE TABLE moved.applied (message_key text NOT NULL, at_offset bigint NOT NULL)",
            )
            .await
            .unwrap();
        let store = idemdb_postgres::PgStore::builder()
            .names(idemdb_postgres::Names::new("moved", "records").unwrap())
            .open(&client)
            .await
            .unwrap();
        let start = moved_postgres_run(&store, &mut client, &log, 45, 51).await;
        let rows = client
            .query(
                "SELECT message_key, count(*) FROM moved.applied GROUP BY 1",
                &[],
            )
            .await
            .unwrap();
        let effects = rows
            .iter()
            .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1) as u64))
            .collect::<std::collections::BTreeMap<String, u64>>();
        (start, effects)
    });
    let (pg_start, pg_effects) = pg_effects;

    // Back to a new embedded store, opened once by its application (its tables made).
    let output = pg("export", &[], b"");
    expect_code(&output, 0);
    let back = Fixture {
        dir: tempfile::tempdir().unwrap(),
        clock: clock.clone(),
    };
    drop(moved_builder(back.dir.path(), &clock).open().unwrap());
    let back_import = idemdb_with_input(&["import", back.path(), "--json"], Some(&output.stdout));
    expect_code(&back_import, 0);
    let engine = moved_builder(back.dir.path(), &clock).open().unwrap();
    let back_start = moved_embedded_run(&engine, &log, 60, 59);
    let end = engine
        .consumer("mover")
        .unwrap()
        .positions()
        .get("orders", 0)
        .unwrap()
        .map(|position| position.offset);
    drop(engine);

    // Every message of the log applied exactly once, over the three stores.
    let mut applied = moved_embedded_effects(first.dir.path(), &clock, &log);
    for (key, count) in
        pg_effects
            .into_iter()
            .chain(moved_embedded_effects(back.dir.path(), &clock, &log))
    {
        *applied.entry(key).or_default() += count;
    }
    let expected: std::collections::BTreeMap<String, u64> =
        log.iter().map(|key| (key.clone(), 1)).collect();
    let lost: Vec<&String> = expected
        .keys()
        .filter(|key| !applied.contains_key(*key))
        .collect();
    let twice: Vec<(&String, &u64)> = applied.iter().filter(|(_, count)| **count > 1).collect();
    assert!(lost.is_empty(), "messages never applied: {lost:?}");
    assert!(
        twice.is_empty(),
        "messages applied more than once: {twice:?}"
    );
    assert_eq!(applied, expected);
    assert_eq!(
        json(&back_import)["positions"]["imported"],
        1,
        "{}",
        stdout(&back_import)
    );
    // The message at 59 is a duplicate (of 57): it moves the position on its own.
    assert_eq!(end, Some(59), "read to the log's end");
    // Each move resumed exactly at the position exported (less the replay).
    assert_eq!(
        pg_start,
        30 - MOVED_REPLAY,
        "PostgreSQL resumed at the imported position"
    );
    assert_eq!(
        back_start,
        51 - MOVED_REPLAY,
        "the embedded engine resumed at the position PostgreSQL exported"
    );
    drop(server);
}
