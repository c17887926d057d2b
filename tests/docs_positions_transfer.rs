//! The docs' promises about read positions in export lines, tested as a new user would read
//! them (docs/guide/07-operations.md "Export lines" and "Moving a log consumer between
//! backends", docs/guide/04-postgresql-fleet.md "Moving between backends",
//! docs/guide/05-log-consumers.md, and the rustdoc of `idemdb::transfer`,
//! `idemdb::admin::Store::import_positions` and `idemdb_postgres::PgStore::import_lines` /
//! `import_positions`), written from the docs alone. Each test's name is the promise.
//!
//! The embedded tests run the `idemdb` binary; the PostgreSQL ones start a private server
//! (`postgres/tests/support/server.rs`) and run `idemdb-pg` (built with
//! `cargo build --release -p idemdb-postgres --bin idemdb-pg`, or `IDEMDB_PG_BIN`), and are
//! skipped without them.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use idemdb::admin::{ImportPosition, PositionEntry, Store};
use idemdb::transfer::{
    self, LineError, POSITION_KIND, PositionLine, ReadError, TransferLine, TransferPosition,
};
use idemdb::{Engine, Error, Fingerprint, Outcome, Position};
use serde_json::{Value, json};

#[path = "../postgres/tests/support/server.rs"]
mod pg_server;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Runs `idemdb` with `args`, `stdin` on its standard input.
fn idemdb(args: &[&str], stdin: &[u8]) -> Output {
    run(Path::new(env!("CARGO_BIN_EXE_idemdb")), args, stdin)
}

fn run(binary: &Path, args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(binary)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the binary");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn out(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn err(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[track_caller]
fn expect_code(output: &Output, code: i32) {
    assert_eq!(
        output.status.code(),
        Some(code),
        "stdout:\n{}\nstderr:\n{}",
        out(output),
        err(output)
    );
}

#[track_caller]
fn json_of(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}\n{}", out(output), err(output)))
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A new embedded store, opened once by its application (so its tables exist), then closed.
fn new_store() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    drop(Engine::builder(dir.path()).open().unwrap());
    dir
}

/// Commits a fresh claim of `key` for `consumer`.
fn commit(engine: &Engine, consumer: &str, key: &str) {
    match engine
        .consumer(consumer)
        .unwrap()
        .begin(key, Fingerprint::of(key))
        .unwrap()
    {
        Outcome::Fresh(claim) => {
            claim.commit(format!("done {key}")).unwrap();
        }
        other => panic!("{key}: expected Fresh, got {other:?}"),
    }
}

/// Every stored position, read through the library.
fn positions_of(path: &Path) -> Vec<PositionEntry> {
    Store::builder(path)
        .open_read_only()
        .unwrap()
        .positions(None)
        .unwrap()
}

/// The export of the store at `path`, split into record lines and position lines (in order);
/// asserts every position line comes after every record line.
fn export_of(path: &Path) -> (Vec<String>, Vec<String>) {
    let output = idemdb(&["export", path_str(path)], b"");
    expect_code(&output, 0);
    split_lines(&out(&output))
}

#[track_caller]
fn split_lines(text: &str) -> (Vec<String>, Vec<String>) {
    let mut records = Vec::new();
    let mut positions = Vec::new();
    for line in text.lines() {
        if line.starts_with("{\"kind\":") {
            positions.push(line.to_owned());
        } else {
            assert!(
                positions.is_empty(),
                "a record line after a position line:\n{text}"
            );
            records.push(line.to_owned());
        }
    }
    (records, positions)
}

/// A position line as the docs show it, written with the library.
fn position_line(consumer: &[u8], source: &str, partition: u32, offset: u64, at: u64) -> String {
    let mut text = Vec::new();
    PositionLine::of(consumer, &Position::new(source, partition, offset, at))
        .write_to(&mut text)
        .unwrap();
    String::from_utf8(text).unwrap()
}

/// A position line built by hand (for fields the library would refuse to build).
fn raw_position_line(consumer_hex: &str, source: &str, partition: u64, offset: u64) -> String {
    let mut line = serde_json::to_string(&json!({
        "kind": "position",
        "consumer": "c",
        "consumer_hex": consumer_hex,
        "source": source,
        "partition": partition,
        "offset": offset,
        "updated_at_ms": 1_765_000_000_000_u64,
    }))
    .unwrap();
    line.push('\n');
    line
}

/// Record lines of another store's export: consumer `donor`, keys `donor-1` and `donor-2`.
fn donor_record_lines() -> String {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    commit(&engine, "donor", "donor-1");
    commit(&engine, "donor", "donor-2");
    drop(engine);
    let (records, positions) = export_of(dir.path());
    assert_eq!(records.len(), 2);
    assert!(positions.is_empty());
    records.iter().map(|line| format!("{line}\n")).collect()
}

/// (consumer, source, partition) -> (offset, updated_at_ms), for comparisons.
fn position_map(entries: &[PositionEntry]) -> Vec<(Vec<u8>, String, u32, u64, u64)> {
    entries
        .iter()
        .map(|e| {
            (
                e.consumer.clone(),
                e.position.source.clone(),
                e.position.partition,
                e.position.offset,
                e.position.updated_at_ms,
            )
        })
        .collect()
}

/// A store with `billing`'s positions of source `orders`: partitions 0, 1 and 2 at offset 10.
fn store_with_positions_at_10() -> (tempfile::TempDir, Vec<PositionEntry>) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let positions = engine.consumer("billing").unwrap().positions();
    for partition in 0..3 {
        positions.advance("orders", partition, 10).unwrap();
    }
    drop(engine);
    let before = positions_of(dir.path());
    (dir, before)
}

/// The file the forward-only tests import: ahead (0), equal (1), behind (2), new (3).
const IMPORTED_AT: u64 = 1_700_000_000_123;
fn forward_only_file() -> String {
    [(0, 11), (1, 10), (2, 9), (3, 5)]
        .iter()
        .map(|&(partition, offset)| {
            position_line(b"billing", "orders", partition, offset, IMPORTED_AT)
        })
        .collect()
}

/// Asserts the store at `path` holds no record and exactly the positions `before`.
#[track_caller]
fn expect_unchanged(path: &Path, before: &[PositionEntry]) {
    let (records, _) = export_of(path);
    assert!(records.is_empty(), "records were written: {records:?}");
    assert_eq!(positions_of(path), before, "positions changed");
}

// ---------------------------------------------------------------------------------------------
// The export line format (idemdb::transfer)
// ---------------------------------------------------------------------------------------------

#[test]
fn a_position_line_writes_kind_first_and_reads_back_exactly() {
    let line = position_line(b"billing", "orders", 3, 41, 1_765_000_000_000);
    assert_eq!(
        line,
        "{\"kind\":\"position\",\"consumer\":\"billing\",\"consumer_hex\":\"62696c6c696e67\",\
         \"source\":\"orders\",\"partition\":3,\"offset\":41,\"updated_at_ms\":1765000000000}\n",
        "the docs' example line"
    );
    for (partition, offset) in [(0, 0), (u32::MAX, u64::MAX), (7, i64::MAX as u64 + 1)] {
        let position = Position::new("orders", partition, offset, 99);
        let line = position_line(b"\x00\xff", "orders", partition, offset, 99);
        match transfer::parse_line(line.trim_end()).unwrap() {
            TransferLine::Position(read) => {
                assert_eq!(read.consumer(), b"\x00\xff");
                assert_eq!(read.position(), &position);
                assert_eq!(
                    read.position().next_offset(),
                    offset.saturating_add(1),
                    "resumes one past, saturating at u64::MAX"
                );
            }
            other => panic!("read as {other:?}"),
        }
    }
}

#[test]
fn a_line_of_an_unknown_kind_is_refused_by_the_reader() {
    let line = r#"{"kind":"checkpoint","consumer":"billing","consumer_hex":"62696c6c696e67"}"#;
    match transfer::parse_line(line) {
        Err(LineError::UnknownKind { kind }) => assert_eq!(kind, "checkpoint"),
        other => panic!("expected UnknownKind, got {other:?}"),
    }
}

#[test]
fn read_lines_numbers_lines_from_1_counting_blank_ones_and_names_the_bad_one() {
    let text = format!(
        "{}\n{}{}",
        donor_record_lines(),
        position_line(b"billing", "orders", 0, 1, 2),
        "{\"kind\":\"later\"}\n"
    );
    // Lines: 1 and 2 records, 3 blank, 4 position, 5 unknown kind.
    match transfer::read_lines(text.as_bytes()) {
        Err(ReadError::Line { line, error }) => {
            assert_eq!(line, 5, "{error}");
            assert!(matches!(error, LineError::UnknownKind { .. }), "{error}");
        }
        other => panic!("expected a refused line 5, got {other:?}"),
    }
    let good = text.lines().take(4).collect::<Vec<_>>().join("\n");
    let lines = transfer::read_lines(good.as_bytes()).unwrap();
    assert_eq!(lines.records.len(), 2);
    assert_eq!(
        lines.records.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        [1, 2]
    );
    assert_eq!(lines.positions.len(), 1);
    assert_eq!(lines.positions[0].0, 4, "blank lines count");
}

#[test]
fn the_reader_refuses_sources_and_consumers_outside_their_limits() {
    let long_source = "s".repeat(256);
    let long_consumer = hex::encode([b'c'; 256]);
    let cases: Vec<(&str, String)> = vec![
        ("empty source", raw_position_line("62", "", 0, 1)),
        (
            "256-byte source",
            raw_position_line("62", &long_source, 0, 1),
        ),
        ("source with NUL", raw_position_line("62", "a\0b", 0, 1)),
        (
            "256-byte consumer",
            raw_position_line(&long_consumer, "s", 0, 1),
        ),
        ("empty consumer", raw_position_line("", "s", 0, 1)),
        ("consumer not hex", raw_position_line("zz", "s", 0, 1)),
        (
            "partition past u32",
            raw_position_line("62", "s", 1 << 32, 1),
        ),
    ];
    for (what, line) in cases {
        assert!(
            transfer::parse_line(line.trim_end()).is_err(),
            "{what}: accepted {line}"
        );
    }
    let at_limits = raw_position_line(&hex::encode([b'c'; 255]), &"s".repeat(255), 0, 1);
    assert!(
        transfer::parse_line(at_limits.trim_end()).is_ok(),
        "255-byte consumer and source are within the limits"
    );
}

// ---------------------------------------------------------------------------------------------
// The embedded engine: idemdb export / import
// ---------------------------------------------------------------------------------------------

#[test]
fn export_writes_every_position_line_after_every_record_line_in_the_documented_shape() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let billing = engine.consumer("billing").unwrap();
    let Outcome::Fresh(mut claim) = billing.begin("order-1", Fingerprint::of("1")).unwrap() else {
        panic!("fresh");
    };
    claim.stage_position("orders", 3, 41).unwrap();
    claim.commit("ok").unwrap();
    engine
        .consumer("tax")
        .unwrap()
        .positions()
        .advance("filings", 0, 0)
        .unwrap();
    // Records of `zzz`, whose id sorts after both consumers with positions.
    commit(&engine, "zzz", "late-record");
    drop(engine);
    let stored = positions_of(dir.path());
    let (records, positions) = export_of(dir.path());
    assert_eq!(records.len(), 2);
    assert_eq!(positions.len(), 2);
    for (line, entry) in positions.iter().zip(&stored) {
        assert!(
            line.starts_with("{\"kind\":\"position\","),
            "kind first: {line}"
        );
        let value: Value = serde_json::from_str(line).unwrap();
        assert_eq!(value["kind"], POSITION_KIND);
        assert_eq!(value["consumer_hex"], hex::encode(&entry.consumer));
        assert_eq!(value["source"], entry.position.source.as_str());
        assert_eq!(value["partition"], entry.position.partition);
        assert_eq!(value["offset"], entry.position.offset);
        assert_eq!(value["updated_at_ms"], entry.position.updated_at_ms);
    }
}

/// Odd positions: a binary, a unicode and a 255-byte consumer id; 1-byte, 255-byte and
/// unicode sources; partitions 0 and u32::MAX; offsets 0, past i64::MAX and u64::MAX.
fn store_with_odd_positions(max_offset: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    commit(&engine, "billing", "order-1");
    let long_consumer = "c".repeat(255);
    let unicode_source = "топик-🦀";
    let long_unicode_source = format!("{}a", "é".repeat(127));
    assert_eq!(long_unicode_source.len(), 255);
    let billing = engine.consumer("billing").unwrap().positions();
    billing.advance("s", 0, 0).unwrap();
    billing
        .advance(&"x".repeat(255), u32::MAX, max_offset)
        .unwrap();
    billing.advance(unicode_source, 1, 41).unwrap();
    billing
        .advance(&long_unicode_source, 0, max_offset - 1)
        .unwrap();
    engine
        .consumer("ünïcødé-€")
        .unwrap()
        .positions()
        .advance("orders", u32::MAX, 0)
        .unwrap();
    engine
        .consumer(&long_consumer)
        .unwrap()
        .positions()
        .advance("orders", 0, 7)
        .unwrap();
    drop(billing);
    drop(engine);
    let store = Store::builder(dir.path()).open_exclusive().unwrap();
    store
        .set_position(b"\x00\xff\x01", "orders", 0, max_offset)
        .unwrap();
    drop(store);
    assert_eq!(positions_of(dir.path()).len(), 7);
    dir
}

#[test]
fn export_then_import_into_an_empty_store_round_trips_odd_positions_byte_for_byte() {
    let source = store_with_odd_positions(u64::MAX);
    let output = idemdb(&["export", path_str(source.path())], b"");
    expect_code(&output, 0);
    let exported = output.stdout;
    let target = new_store();
    let import = idemdb(&["import", path_str(target.path())], &exported);
    expect_code(&import, 0);
    assert!(
        out(&import).contains("read positions: imported 7, advanced 0, overwritten 0, skipped 0"),
        "{}",
        out(&import)
    );
    assert_eq!(
        position_map(&positions_of(target.path())),
        position_map(&positions_of(source.path())),
        "every position, its offset and its time"
    );
    let again = idemdb(&["export", path_str(target.path())], b"");
    expect_code(&again, 0);
    assert_eq!(
        out(&again),
        String::from_utf8(exported).unwrap(),
        "the export of the imported store is the same bytes"
    );
    // The u64::MAX position resumes at u64::MAX (saturating).
    let maxed = positions_of(target.path())
        .into_iter()
        .find(|e| e.consumer == b"\x00\xff\x01")
        .unwrap();
    assert_eq!(maxed.position.next_offset(), u64::MAX);
}

#[test]
fn import_moves_positions_forward_only_and_reports_each_case_with_code_1() {
    let (dir, before) = store_with_positions_at_10();
    let output = idemdb(
        &["import", path_str(dir.path())],
        forward_only_file().as_bytes(),
    );
    expect_code(&output, 1);
    assert!(
        out(&output).contains("read positions: imported 1, advanced 1, overwritten 0, skipped 2"),
        "{}",
        out(&output)
    );
    let after = positions_of(dir.path());
    let offsets: Vec<(u32, u64)> = after
        .iter()
        .map(|e| (e.position.partition, e.position.offset))
        .collect();
    assert_eq!(offsets, [(0, 11), (1, 10), (2, 10), (3, 5)]);
    // Written ones keep the imported time; the ones that stayed keep their own.
    assert_eq!(
        after[0].position.updated_at_ms, IMPORTED_AT,
        "advanced: time kept as it is"
    );
    assert_eq!(after[1], before[1], "equal: the stored one stays");
    assert_eq!(after[2], before[2], "behind: the stored one stays");
    assert_eq!(
        after[3].position.updated_at_ms, IMPORTED_AT,
        "imported: time kept as it is"
    );

    // Again, with --json: every position is now at or ahead, so all are skipped.
    let output = idemdb(
        &["import", path_str(dir.path()), "--json"],
        forward_only_file().as_bytes(),
    );
    expect_code(&output, 1);
    let report = json_of(&output);
    assert_eq!(
        report["positions"],
        json!({"imported": 0, "advanced": 0, "overwritten": 0, "skipped": 4}),
        "{report}"
    );
    assert_eq!(positions_of(dir.path()), after);
}

#[test]
fn import_with_overwrite_writes_every_position_backwards_too_with_code_0() {
    let (dir, _) = store_with_positions_at_10();
    let output = idemdb(
        &["import", path_str(dir.path()), "--overwrite", "--json"],
        forward_only_file().as_bytes(),
    );
    expect_code(&output, 0);
    let report = json_of(&output);
    assert_eq!(
        report["positions"],
        json!({"imported": 1, "advanced": 0, "overwritten": 3, "skipped": 0}),
        "{report}"
    );
    let after: Vec<(u32, u64, u64)> = positions_of(dir.path())
        .iter()
        .map(|e| {
            (
                e.position.partition,
                e.position.offset,
                e.position.updated_at_ms,
            )
        })
        .collect();
    assert_eq!(
        after,
        [
            (0, 11, IMPORTED_AT),
            (1, 10, IMPORTED_AT),
            (2, 9, IMPORTED_AT),
            (3, 5, IMPORTED_AT)
        ]
    );
}

#[test]
fn a_position_given_twice_is_refused_with_code_2_and_nothing_is_written() {
    let (dir, before) = store_with_positions_at_10();
    let records = donor_record_lines();
    let twice_other_offset = format!(
        "{records}{}{}",
        position_line(b"billing", "orders", 5, 1, 1),
        position_line(b"billing", "orders", 5, 2, 1)
    );
    let twice_identical = format!(
        "{records}{}{}",
        position_line(b"billing", "orders", 5, 1, 1),
        position_line(b"billing", "orders", 5, 1, 1)
    );
    for file in [twice_other_offset, twice_identical] {
        for overwrite in [false, true] {
            let mut args = vec!["import", path_str(dir.path())];
            if overwrite {
                args.push("--overwrite");
            }
            let output = idemdb(&args, file.as_bytes());
            expect_code(&output, 2);
            expect_unchanged(dir.path(), &before);
        }
    }
}

#[test]
fn a_line_of_an_unknown_kind_is_refused_naming_the_line_with_code_2_and_nothing_written() {
    let (dir, before) = store_with_positions_at_10();
    let file = format!(
        "{}{}{{\"kind\":\"checkpoint\",\"consumer\":\"billing\"}}\n",
        donor_record_lines(),
        position_line(b"billing", "orders", 0, 50, 1),
    );
    let output = idemdb(&["import", path_str(dir.path())], file.as_bytes());
    expect_code(&output, 2);
    assert!(
        err(&output).contains("line 4"),
        "names line 4: {}",
        err(&output)
    );
    expect_unchanged(dir.path(), &before);
}

#[test]
fn bad_position_lines_are_refused_with_code_2_before_anything_is_written() {
    let (dir, before) = store_with_positions_at_10();
    let records = donor_record_lines();
    let good = position_line(b"billing", "orders", 0, 50, 1);
    let bad = [
        raw_position_line("62", "", 0, 1),
        raw_position_line("62", &"s".repeat(256), 0, 1),
        raw_position_line("62", "a\0b", 0, 1),
        raw_position_line(&hex::encode([b'c'; 256]), "s", 0, 1),
        raw_position_line("zz", "s", 0, 1),
        "{\"kind\":\"position\",\"consumer\":\"b\",\"consumer_hex\":\"62\",\"source\":\"s\",\"partition\":0}\n"
            .to_owned(),
    ];
    for line in bad {
        let file = format!("{records}{good}{line}");
        let output = idemdb(&["import", path_str(dir.path())], file.as_bytes());
        expect_code(&output, 2);
        assert!(
            err(&output).contains("line 4"),
            "names line 4 for {line}: {}",
            err(&output)
        );
        expect_unchanged(dir.path(), &before);
    }
}

#[test]
fn a_position_line_before_the_record_lines_is_still_imported_with_them() {
    let dir = new_store();
    let file = format!(
        "{}{}",
        position_line(b"donor", "orders", 0, 9, 1),
        donor_record_lines()
    );
    let output = idemdb(&["import", path_str(dir.path()), "--json"], file.as_bytes());
    expect_code(&output, 0);
    let report = json_of(&output);
    assert_eq!(report["positions"]["imported"], 1, "{report}");
    let (records, positions) = export_of(dir.path());
    assert_eq!(records.len(), 2);
    assert_eq!(
        positions,
        [position_line(b"donor", "orders", 0, 9, 1).trim_end()]
    );
}

#[test]
fn an_export_of_an_earlier_release_without_position_lines_imports_its_records() {
    let dir = new_store();
    let output = idemdb(
        &["import", path_str(dir.path())],
        donor_record_lines().as_bytes(),
    );
    expect_code(&output, 0);
    assert!(
        out(&output).contains("read positions: imported 0, advanced 0, overwritten 0, skipped 0"),
        "{}",
        out(&output)
    );
    let (records, positions) = export_of(dir.path());
    assert_eq!(records.len(), 2);
    assert!(positions.is_empty());
}

#[test]
fn an_empty_or_blank_input_imports_nothing_with_code_0() {
    let (dir, before) = store_with_positions_at_10();
    for input in [&b""[..], b"\n\n  \n"] {
        let output = idemdb(&["import", path_str(dir.path()), "--json"], input);
        expect_code(&output, 0);
        let report = json_of(&output);
        assert_eq!(
            report["positions"],
            json!({"imported": 0, "advanced": 0, "overwritten": 0, "skipped": 0}),
            "{report}"
        );
        expect_unchanged(dir.path(), &before);
    }
}

#[test]
fn crlf_line_endings_import_as_the_same_lines() {
    // Not a sentence of the docs: a file passed through a Windows editor. JSON allows the
    // carriage return as whitespace, so each line is still one JSON object.
    let dir = new_store();
    let file = format!(
        "{}{}",
        donor_record_lines(),
        position_line(b"donor", "orders", 2, 9, 1)
    )
    .replace('\n', "\r\n");
    let output = idemdb(&["import", path_str(dir.path())], file.as_bytes());
    expect_code(&output, 0);
    let (records, positions) = export_of(dir.path());
    assert_eq!(records.len(), 2);
    assert_eq!(positions.len(), 1);
}

#[test]
fn import_from_a_file_argument_reads_the_same_as_standard_input() {
    let dir = new_store();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), position_line(b"donor", "orders", 0, 3, 1)).unwrap();
    let output = idemdb(
        &["import", path_str(dir.path()), path_str(file.path())],
        b"",
    );
    expect_code(&output, 0);
    assert_eq!(positions_of(dir.path())[0].position.offset, 3);
}

#[test]
fn import_into_a_live_store_exits_3_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    engine
        .consumer("billing")
        .unwrap()
        .positions()
        .advance("orders", 0, 10)
        .unwrap();
    let file = position_line(b"billing", "orders", 0, 20, 1);
    let output = idemdb(&["import", path_str(dir.path())], file.as_bytes());
    expect_code(&output, 3);
    let output = idemdb(
        &["import", path_str(dir.path()), "--overwrite"],
        file.as_bytes(),
    );
    expect_code(&output, 3);
    assert_eq!(
        engine
            .consumer("billing")
            .unwrap()
            .positions()
            .get("orders", 0)
            .unwrap()
            .unwrap()
            .offset,
        10
    );
    drop(engine);
    assert_eq!(positions_of(dir.path())[0].position.offset, 10);
}

#[test]
fn a_consumer_resumes_one_past_the_imported_position_and_is_held_to_it() {
    let dir = new_store();
    let output = idemdb(
        &["import", path_str(dir.path())],
        position_line(b"billing", "orders", 0, 41, 1).as_bytes(),
    );
    expect_code(&output, 0);
    let engine = Engine::builder(dir.path()).open().unwrap();
    let billing = engine.consumer("billing").unwrap();
    let positions = billing.positions();
    let stored = positions.get("orders", 0).unwrap().unwrap();
    assert_eq!(stored.next_offset(), 42);
    assert!(matches!(
        positions.advance("orders", 0, 40),
        Err(Error::PositionBehind { .. })
    ));
    let Outcome::Fresh(mut claim) = billing.begin("late", Fingerprint::of("l")).unwrap() else {
        panic!("fresh");
    };
    claim.stage_position("orders", 0, 40).unwrap();
    assert!(matches!(
        claim.commit("x"),
        Err(Error::PositionBehind { .. })
    ));
    positions.advance("orders", 0, 41).unwrap();
    positions.advance("orders", 0, 42).unwrap();
    assert_eq!(positions.get("orders", 0).unwrap().unwrap().offset, 42);
}

#[test]
fn store_import_positions_checks_everything_before_writing() {
    let (dir, before) = store_with_positions_at_10();
    let new = |partition, offset| {
        ImportPosition::new(b"billing", Position::new("orders", partition, offset, 5)).unwrap()
    };
    // Read-only open: refused.
    let read_only = Store::builder(dir.path()).open_read_only().unwrap();
    assert!(matches!(
        read_only.import_positions(&[new(0, 50)], false),
        Err(Error::ReadOnly)
    ));
    drop(read_only);
    let store = Store::builder(dir.path()).open_exclusive().unwrap();
    // Given twice (a good one first): refused, nothing written.
    let twice = [new(0, 50), new(7, 1), new(7, 2)];
    assert!(matches!(
        store.check_import_positions(&twice),
        Err(Error::InvalidArgument { .. })
    ));
    for overwrite in [false, true] {
        assert!(matches!(
            store.import_positions(&twice, overwrite),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert_eq!(store.positions(None).unwrap(), before);
    // Empty: nothing to count.
    let counts = store.import_positions(&[], false).unwrap();
    assert_eq!(
        (
            counts.imported,
            counts.advanced,
            counts.overwritten,
            counts.skipped
        ),
        (0, 0, 0, 0)
    );
    drop(store);
    // ImportPosition refuses what every backend refuses.
    assert!(matches!(
        ImportPosition::new(b"billing", Position::new("", 0, 1, 1)),
        Err(Error::LimitExceeded { .. })
    ));
    assert!(matches!(
        ImportPosition::new(b"billing", Position::new("s".repeat(256), 0, 1, 1)),
        Err(Error::LimitExceeded { .. })
    ));
    assert!(matches!(
        ImportPosition::new(b"billing", Position::new("a\0b", 0, 1, 1)),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        ImportPosition::new(&[b'c'; 256], Position::new("s", 0, 1, 1)),
        Err(Error::LimitExceeded { .. })
    ));
    assert_eq!(positions_of(dir.path()), before);
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL: idemdb-pg export / import, PgStore::import_lines / import_positions
// ---------------------------------------------------------------------------------------------

/// The `idemdb-pg` binary: `IDEMDB_PG_BIN`, else the one built beside this test.
fn idemdb_pg_binary() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("IDEMDB_PG_BIN") {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok()?;
    let beside = exe.parent()?.parent()?.join("idemdb-pg");
    beside.is_file().then_some(beside)
}

/// A private PostgreSQL server and the tool, or why the test is skipped.
struct Pg {
    server: pg_server::Server,
    tool: PathBuf,
}

impl Pg {
    fn start() -> Option<Pg> {
        let Some(tool) = idemdb_pg_binary() else {
            eprintln!("skipped: no idemdb-pg binary (cargo build --release -p idemdb-postgres)");
            return None;
        };
        match pg_server::Server::start() {
            Ok(server) => Some(Pg { server, tool }),
            Err(why) => {
                eprintln!("skipped: cannot start PostgreSQL ({why})");
                None
            }
        }
    }

    fn url(&self) -> String {
        self.server.url()
    }

    /// `idemdb-pg COMMAND --url URL --schema SCHEMA EXTRA...`.
    fn tool(&self, command: &[&str], schema: &str, extra: &[&str], stdin: &[u8]) -> Output {
        let url = self.url();
        let mut args: Vec<&str> = command.to_vec();
        args.extend(["--url", url.as_str(), "--schema", schema]);
        args.extend(extra);
        run(&self.tool, &args, stdin)
    }

    /// Installs the tables in `schema`.
    fn install(&self, schema: &str) {
        expect_code(&self.tool(&["install"], schema, &[], b""), 0);
    }

    /// The export of `schema`, split into record and position lines.
    fn export(&self, schema: &str) -> (Vec<String>, Vec<String>) {
        let output = self.tool(&["export"], schema, &[], b"");
        expect_code(&output, 0);
        split_lines(&out(&output))
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn connect(url: &str, schema: &str) -> (tokio_postgres::Client, idemdb_postgres::PgStore) {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let store = idemdb_postgres::PgStore::builder()
        .names(idemdb_postgres::Names::new(schema, "records").unwrap())
        .open(&client)
        .await
        .unwrap();
    (client, store)
}

#[test]
fn positions_move_embedded_to_postgres_and_back_byte_for_byte() {
    let Some(pg) = Pg::start() else { return };
    // The largest offset PostgreSQL keeps.
    let max = idemdb_postgres::POSITION_OFFSET_MAX;
    assert_eq!(max, i64::MAX as u64);
    let source = store_with_odd_positions(max);
    let (records, positions) = export_of(source.path());
    let exported = idemdb(&["export", path_str(source.path())], b"").stdout;
    pg.install("moved");
    let import = pg.tool(&["import"], "moved", &[], &exported);
    expect_code(&import, 0);
    assert!(
        out(&import).contains("read positions: imported 7, advanced 0, overwritten 0, skipped 0"),
        "{}",
        out(&import)
    );
    let (pg_records, pg_positions) = pg.export("moved");
    assert_eq!(
        pg_positions, positions,
        "the same position lines, in the same order"
    );
    assert_eq!(pg_records, records, "the same record lines");

    // And back into a new embedded store.
    let output = pg.tool(&["export"], "moved", &[], b"");
    let back = new_store();
    let import = idemdb(&["import", path_str(back.path()), "--json"], &output.stdout);
    expect_code(&import, 0);
    assert_eq!(
        json_of(&import)["positions"],
        json!({"imported": 7, "advanced": 0, "overwritten": 0, "skipped": 0})
    );
    assert_eq!(
        position_map(&positions_of(back.path())),
        position_map(&positions_of(source.path()))
    );
}

#[test]
fn postgres_refuses_an_offset_past_i64_max_and_writes_nothing() {
    let Some(pg) = Pg::start() else { return };
    pg.install("limits");
    // An embedded store at the limit and one past it.
    let file = format!(
        "{}{}{}",
        donor_record_lines(),
        position_line(b"donor", "orders", 0, i64::MAX as u64, 1),
        position_line(b"donor", "orders", 1, i64::MAX as u64 + 1, 1),
    );
    for overwrite in [false, true] {
        let extra: &[&str] = if overwrite { &["--overwrite"] } else { &[] };
        let output = pg.tool(&["import"], "limits", extra, file.as_bytes());
        expect_code(&output, 2);
        let (records, positions) = pg.export("limits");
        assert!(
            records.is_empty() && positions.is_empty(),
            "{records:?} {positions:?}"
        );
    }
    // The library says the same, before writing anything.
    runtime().block_on(async {
        let (mut client, store) = connect(&pg.url(), "limits").await;
        let positions = [
            TransferPosition::new(b"donor".to_vec(), Position::new("orders", 0, 1, 1)).unwrap(),
            TransferPosition::new(b"donor".to_vec(), Position::new("orders", 1, u64::MAX, 1))
                .unwrap(),
        ];
        for overwrite in [false, true] {
            match store
                .import_positions(&mut client, &positions, overwrite)
                .await
            {
                Err(idemdb_postgres::Error::NotImportable { position, .. }) => {
                    assert_eq!(position, 2, "the second position given")
                }
                other => panic!("expected NotImportable, got {other:?}"),
            }
            match store
                .import_lines(&mut client, file.as_bytes(), overwrite)
                .await
            {
                Err(idemdb_postgres::Error::NotImportable { position, .. }) => {
                    assert_eq!(position, 4, "line 4")
                }
                other => panic!("expected NotImportable, got {other:?}"),
            }
        }
        let consumer = store.consumer("donor").unwrap();
        assert!(consumer.positions().list(&client).await.unwrap().is_empty());
    });
    let (records, positions) = pg.export("limits");
    assert!(records.is_empty() && positions.is_empty());
}

#[test]
fn postgres_import_moves_positions_forward_only_unless_overwrite() {
    let Some(pg) = Pg::start() else { return };
    for schema in ["fwd", "over"] {
        pg.install(schema);
        for partition in ["0", "1", "2"] {
            let output = pg.tool(
                &["positions", "set"],
                schema,
                &["--consumer", "billing", "orders", partition, "10"],
                b"",
            );
            expect_code(&output, 0);
        }
    }
    let output = pg.tool(&["import"], "fwd", &[], forward_only_file().as_bytes());
    expect_code(&output, 1);
    assert!(
        out(&output).contains("read positions: imported 1, advanced 1, overwritten 0, skipped 2"),
        "{}",
        out(&output)
    );
    let output = pg.tool(
        &["import"],
        "over",
        &["--overwrite"],
        forward_only_file().as_bytes(),
    );
    expect_code(&output, 0);
    assert!(
        out(&output).contains("read positions: imported 1, advanced 0, overwritten 3, skipped 0"),
        "{}",
        out(&output)
    );
    runtime().block_on(async {
        for (schema, expected) in [("fwd", [11, 10, 10, 5]), ("over", [11, 10, 9, 5])] {
            let (client, store) = connect(&pg.url(), schema).await;
            let list = store
                .consumer("billing")
                .unwrap()
                .positions()
                .list(&client)
                .await
                .unwrap();
            let offsets: Vec<u64> = list.iter().map(|p| p.offset).collect();
            assert_eq!(offsets, expected, "{schema}");
            // Written ones keep the imported time.
            assert_eq!(list[3].updated_at_ms, IMPORTED_AT, "{schema}: imported");
            assert_eq!(list[0].updated_at_ms, IMPORTED_AT, "{schema}: advanced");
            if schema == "over" {
                assert_eq!(list[2].updated_at_ms, IMPORTED_AT, "overwritten backwards");
            }
        }
    });
}

#[test]
fn postgres_refuses_bad_files_with_code_2_and_writes_nothing() {
    let Some(pg) = Pg::start() else { return };
    pg.install("bad");
    let records = donor_record_lines();
    let good = position_line(b"donor", "orders", 0, 5, 1);
    let files = [
        // Given twice.
        format!("{records}{good}{good}"),
        format!(
            "{records}{good}{}",
            position_line(b"donor", "orders", 0, 6, 1)
        ),
        // A kind it does not know.
        format!("{records}{good}{{\"kind\":\"checkpoint\"}}\n"),
        // Sources and consumers outside the limits.
        format!("{records}{good}{}", raw_position_line("62", "", 0, 1)),
        format!(
            "{records}{good}{}",
            raw_position_line("62", &"s".repeat(256), 0, 1)
        ),
        format!("{records}{good}{}", raw_position_line("62", "a\0b", 0, 1)),
        format!(
            "{records}{good}{}",
            raw_position_line(&hex::encode([b'c'; 256]), "s", 0, 1)
        ),
    ];
    for file in &files {
        let output = pg.tool(&["import"], "bad", &[], file.as_bytes());
        expect_code(&output, 2);
        // Named as a line, or as the import's record number (its line number, as
        // `Error::NotImportable` documents).
        assert!(
            err(&output).contains("line 4") || err(&output).contains("record 4"),
            "names line 4: {}",
            err(&output)
        );
        let (records, positions) = pg.export("bad");
        assert!(
            records.is_empty() && positions.is_empty(),
            "written after a refusal of {file}"
        );
    }
    // Empty input: nothing, code 0. Old format (records only): the records, code 0.
    let output = pg.tool(&["import"], "bad", &[], b"");
    expect_code(&output, 0);
    let output = pg.tool(&["import"], "bad", &[], records.as_bytes());
    expect_code(&output, 0);
    assert!(
        out(&output).contains("read positions: imported 0, advanced 0, overwritten 0, skipped 0"),
        "{}",
        out(&output)
    );
    assert_eq!(pg.export("bad").0.len(), 2);
    // CRLF and a position line first: imported.
    let file = format!("{good}{records}").replace('\n', "\r\n");
    let output = pg.tool(&["import"], "bad", &[], file.as_bytes());
    expect_code(&output, 1); // the records are already there: skipped
    assert_eq!(pg.export("bad").1, [good.trim_end()]);
}

#[test]
fn postgres_import_lines_counts_and_the_consumer_is_held_to_the_imported_position() {
    let Some(pg) = Pg::start() else { return };
    pg.install("lib");
    let file = format!(
        "{}{}{}",
        donor_record_lines(),
        position_line(b"donor", "orders", 0, 41, 1),
        position_line(b"donor", "orders", 1, 0, 1),
    );
    runtime().block_on(async {
        let (mut client, store) = connect(&pg.url(), "lib").await;
        let counts = store
            .import_lines(&mut client, file.as_bytes(), false)
            .await
            .unwrap();
        assert_eq!(
            (counts.imported, counts.overwritten, counts.skipped),
            (2, 0, 0)
        );
        let p = counts.positions;
        assert_eq!(
            (p.imported, p.advanced, p.overwritten, p.skipped),
            (2, 0, 0, 0)
        );
        // Again: records held, positions equal: skipped.
        let counts = store
            .import_lines(&mut client, file.as_bytes(), false)
            .await
            .unwrap();
        assert_eq!((counts.imported, counts.skipped), (0, 2));
        assert_eq!(counts.positions.skipped, 2);
        // The moved consumer resumes one past; a replay finds the records; behind is refused.
        let donor = store.consumer("donor").unwrap();
        let positions = donor.positions();
        let at = positions.get(&client, "orders", 0).await.unwrap().unwrap();
        assert_eq!(at.next_offset(), 42);
        match donor
            .begin(&mut client, "donor-1", Fingerprint::of("donor-1"))
            .await
            .unwrap()
        {
            Outcome::Duplicate { .. } => {}
            other => panic!("the moved record: {other:?}"),
        }
        match positions.advance(&client, "orders", 0, 40).await {
            Err(idemdb_postgres::Error::Idemdb(Error::PositionBehind { .. })) => {}
            other => panic!("expected PositionBehind, got {other:?}"),
        }
        {
            let outcome = donor
                .begin(&mut client, "new", Fingerprint::of("new"))
                .await
                .unwrap();
            let Outcome::Fresh(mut claim) = outcome else {
                panic!("fresh");
            };
            claim.stage_position("orders", 0, 40).unwrap();
            let committed = claim.commit("x").await;
            assert!(
                matches!(
                    committed,
                    Err(idemdb_postgres::Error::Idemdb(Error::PositionBehind { .. }))
                ),
                "{committed:?}"
            );
        }
        positions.advance(&client, "orders", 0, 41).await.unwrap();
    });
}

// ---------------------------------------------------------------------------------------------
// Moving a log consumer mid-stream, both ways
// ---------------------------------------------------------------------------------------------

/// A log of 60 messages whose keys repeat (a producer's resends): offset `i` holds key
/// `m{i}`, except every 7th, which resends the key of the offset 3 before it.
fn the_log() -> Vec<String> {
    (0..60)
        .map(|i| {
            if i % 7 == 6 {
                format!("m{}", i - 3)
            } else {
                format!("m{i}")
            }
        })
        .collect()
}

/// How many messages before the stored position the broker replays after a move.
const REPLAY: u64 = 3;

/// Consumes `log[from..=to]` on the embedded engine: a fresh key is committed with the position
/// staged, a duplicate moves the position alone. Returns the keys found Fresh.
fn consume_embedded(engine: &Engine, log: &[String], from: u64, to: u64) -> Vec<String> {
    let consumer = engine.consumer("mover").unwrap();
    let positions = consumer.positions();
    let mut fresh = Vec::new();
    for offset in from..=to {
        let key = &log[offset as usize];
        match consumer.begin(key, Fingerprint::of(key)).unwrap() {
            Outcome::Fresh(mut claim) => {
                claim.stage_position("orders", 0, offset).unwrap();
                claim.commit(format!("applied at {offset}")).unwrap();
                fresh.push(key.clone());
            }
            Outcome::Duplicate { .. } => {
                let stored = positions.get("orders", 0).unwrap().map(|p| p.offset);
                if stored.is_none_or(|s| s < offset) {
                    positions.advance("orders", 0, offset).unwrap();
                }
            }
            other => panic!("offset {offset}: {other:?}"),
        }
    }
    fresh
}

/// The same on PostgreSQL.
async fn consume_postgres(
    store: &idemdb_postgres::PgStore,
    client: &mut tokio_postgres::Client,
    log: &[String],
    from: u64,
    to: u64,
) -> Vec<String> {
    let consumer = store.consumer("mover").unwrap();
    let positions = consumer.positions();
    let mut fresh = Vec::new();
    for offset in from..=to {
        let key = &log[offset as usize];
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
                claim.commit(format!("applied at {offset}")).await.unwrap();
                fresh.push(key.clone());
                false
            }
            Outcome::Duplicate { .. } => true,
            other => panic!("offset {offset}: {other:?}"),
        };
        if duplicate && stored.is_none_or(|s| s < offset) {
            positions
                .advance(client, "orders", 0, offset)
                .await
                .unwrap();
        }
    }
    fresh
}

#[test]
fn a_log_consumer_moved_mid_stream_both_ways_loses_nothing_and_applies_nothing_twice() {
    let Some(pg) = Pg::start() else { return };
    let log = the_log();
    let mut fresh = Vec::new();

    // Embedded: offsets 0..=19, then stopped.
    let first = tempfile::tempdir().unwrap();
    let engine = Engine::builder(first.path()).open().unwrap();
    fresh.extend(consume_embedded(&engine, &log, 0, 19));
    drop(engine);

    // Stop, export, import.
    let exported = idemdb(&["export", path_str(first.path())], b"");
    expect_code(&exported, 0);
    pg.install("mover");
    let import = pg.tool(&["import"], "mover", &[], &exported.stdout);
    expect_code(&import, 0);

    // PostgreSQL: resumes one past the imported position; the broker replays a few before it.
    let runtime = runtime();
    let resumed_pg = runtime.block_on(async {
        let (mut client, store) = connect(&pg.url(), "mover").await;
        let at = store
            .consumer("mover")
            .unwrap()
            .positions()
            .get(&client, "orders", 0)
            .await
            .unwrap()
            .expect("the imported position");
        let resume = at.next_offset();
        let replayed =
            consume_postgres(&store, &mut client, &log, resume - REPLAY, resume - 1).await;
        assert!(
            replayed.is_empty(),
            "replayed messages were applied again: {replayed:?}"
        );
        let more = consume_postgres(&store, &mut client, &log, resume, 39).await;
        (resume, more)
    });
    assert_eq!(
        resumed_pg.0, 20,
        "resumes one past where the embedded consumer stopped"
    );
    fresh.extend(resumed_pg.1);

    // Back to a new embedded store.
    let back_lines = pg.tool(&["export"], "mover", &[], b"");
    expect_code(&back_lines, 0);
    let back = new_store();
    let import = idemdb(&["import", path_str(back.path())], &back_lines.stdout);
    expect_code(&import, 0);
    let engine = Engine::builder(back.path()).open().unwrap();
    let resume = engine
        .consumer("mover")
        .unwrap()
        .positions()
        .get("orders", 0)
        .unwrap()
        .expect("the position moved back")
        .next_offset();
    assert_eq!(resume, 40, "resumes one past where PostgreSQL stopped");
    let replayed = consume_embedded(&engine, &log, resume - REPLAY, resume - 1);
    assert!(
        replayed.is_empty(),
        "replayed messages were applied again: {replayed:?}"
    );
    fresh.extend(consume_embedded(&engine, &log, resume, 59));
    drop(engine);

    // Every distinct key applied exactly once.
    let mut expected: Vec<String> = log.clone();
    expected.sort();
    expected.dedup();
    let mut applied = fresh.clone();
    applied.sort();
    let mut distinct = applied.clone();
    distinct.dedup();
    assert_eq!(applied, distinct, "applied twice");
    assert_eq!(distinct, expected, "lost");
}

// ---------------------------------------------------------------------------------------------
// More ways a caller could break the promises without meaning to
// ---------------------------------------------------------------------------------------------

/// Two positions whose consumer id and source, run together, spell the same bytes
/// (`a` + `bc` and `ab` + `c`): different positions, not one given twice.
fn split_lookalikes() -> String {
    format!(
        "{}{}{}",
        position_line(b"a", "bc", 0, 1, 1),
        position_line(b"ab", "c", 0, 2, 1),
        position_line(b"a", "bc", 1, 3, 1),
    )
}

#[test]
fn positions_that_differ_only_in_where_consumer_and_source_split_are_not_given_twice() {
    let dir = new_store();
    let output = idemdb(
        &["import", path_str(dir.path()), "--json"],
        split_lookalikes().as_bytes(),
    );
    expect_code(&output, 0);
    assert_eq!(json_of(&output)["positions"]["imported"], 3);
    let stored: Vec<(Vec<u8>, String, u32, u64)> = positions_of(dir.path())
        .into_iter()
        .map(|e| {
            (
                e.consumer,
                e.position.source,
                e.position.partition,
                e.position.offset,
            )
        })
        .collect();
    assert_eq!(
        stored,
        [
            (b"a".to_vec(), "bc".to_owned(), 0, 1),
            (b"a".to_vec(), "bc".to_owned(), 1, 3),
            (b"ab".to_vec(), "c".to_owned(), 0, 2),
        ]
    );
}

#[test]
fn the_exact_consumer_hex_decides_not_the_printable_consumer_field() {
    // "Reading a line takes only the exact fields (`*_hex`, numbers); the printable ones are
    // for people."
    let dir = new_store();
    let line = position_line(b"billing", "orders", 0, 9, 1)
        .replace("\"consumer\":\"billing\"", "\"consumer\":\"someone else\"");
    assert!(line.contains("someone else"));
    let output = idemdb(&["import", path_str(dir.path())], line.as_bytes());
    expect_code(&output, 0);
    let stored = positions_of(dir.path());
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].consumer, b"billing");
}

#[test]
fn a_bad_record_line_after_good_position_lines_writes_no_position() {
    let (dir, before) = store_with_positions_at_10();
    let records = donor_record_lines();
    let first_record = records.lines().next().unwrap();
    // Positions first, then a record whose key is given twice.
    let file = format!(
        "{}{records}{first_record}\n",
        position_line(b"billing", "orders", 0, 99, 1)
    );
    for extra in [&[][..], &["--overwrite"][..]] {
        let mut args = vec!["import", path_str(dir.path())];
        args.extend(extra);
        let output = idemdb(&args, file.as_bytes());
        expect_code(&output, 2);
        expect_unchanged(dir.path(), &before);
    }
}

#[test]
fn position_numbers_outside_their_types_are_refused_with_code_2() {
    let (dir, before) = store_with_positions_at_10();
    let good = position_line(b"billing", "orders", 0, 50, 1);
    let base = position_line(b"billing", "orders", 1, 7, 1);
    let bad = [
        base.replace("\"offset\":7", "\"offset\":\"7\""),
        base.replace("\"offset\":7", "\"offset\":-7"),
        base.replace("\"offset\":7", "\"offset\":7.5"),
        base.replace("\"offset\":7", "\"offset\":18446744073709551616"),
        base.replace("\"partition\":1", "\"partition\":-1"),
        base.replace("\"partition\":1", "\"partition\":4294967296"),
        base.replace(",\"updated_at_ms\":1", ""),
        base.replace("\"kind\":\"position\"", "\"kind\":\"Position\""),
    ];
    for line in bad {
        assert_ne!(line, base);
        let file = format!("{good}{line}");
        let output = idemdb(&["import", path_str(dir.path())], file.as_bytes());
        expect_code(&output, 2);
        assert!(
            err(&output).contains("line 2"),
            "names line 2 for {line}: {}",
            err(&output)
        );
        expect_unchanged(dir.path(), &before);
    }
}

#[test]
fn an_export_of_one_consumer_carries_that_consumers_positions() {
    // `idemdb export --consumer C`: "Only this consumer's records". Moving one consumer
    // between backends needs its positions too (a position is never dropped on the way
    // without a word).
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    commit(&engine, "billing", "order-1");
    commit(&engine, "tax", "vat-1");
    for consumer in ["billing", "tax"] {
        engine
            .consumer(consumer)
            .unwrap()
            .positions()
            .advance("orders", 0, 5)
            .unwrap();
    }
    drop(engine);
    let output = idemdb(
        &["export", path_str(dir.path()), "--consumer", "billing"],
        b"",
    );
    expect_code(&output, 0);
    let (records, positions) = split_lines(&out(&output));
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        positions,
        [position_line(
            b"billing",
            "orders",
            0,
            5,
            positions_of(dir.path())[0].position.updated_at_ms
        )
        .trim_end()],
        "billing's position, and only billing's"
    );
}

#[test]
fn postgres_one_consumers_export_carries_its_positions_and_lookalikes_are_not_twice() {
    let Some(pg) = Pg::start() else { return };
    pg.install("one");
    let file = format!(
        "{}{}{}",
        donor_record_lines(),
        split_lookalikes(),
        position_line(b"donor", "orders", 4, 8, 1)
    );
    let output = pg.tool(&["import"], "one", &[], file.as_bytes());
    expect_code(&output, 0);
    assert!(
        out(&output).contains("read positions: imported 4, advanced 0, overwritten 0, skipped 0"),
        "{}",
        out(&output)
    );
    // PgConsumer::export: "this consumer's records ... by key, then its read positions".
    let text = runtime().block_on(async {
        let (client, store) = connect(&pg.url(), "one").await;
        let mut text = Vec::new();
        let report = store
            .consumer("donor")
            .unwrap()
            .export(&client, &mut text)
            .await
            .unwrap();
        assert_eq!((report.exported, report.positions), (2, 1));
        String::from_utf8(text).unwrap()
    });
    let (records, positions) = split_lines(&text);
    assert_eq!(records.len(), 2);
    assert_eq!(
        positions,
        [position_line(b"donor", "orders", 4, 8, 1).trim_end()]
    );
    // The tool's --consumer: the same lines.
    let output = pg.tool(&["export"], "one", &["--consumer", "donor"], b"");
    expect_code(&output, 0);
    assert_eq!(out(&output), text);
    // A bad record after good positions: nothing written (a record given twice).
    let first_record = donor_record_lines().lines().next().unwrap().to_owned();
    let bad = format!(
        "{}{first_record}\n{first_record}\n",
        position_line(b"fresh", "orders", 0, 1, 1)
    );
    let output = pg.tool(&["import"], "one", &["--overwrite"], bad.as_bytes());
    expect_code(&output, 2);
    let output = pg.tool(&["export"], "one", &["--consumer", "fresh"], b"");
    assert!(out(&output).is_empty(), "{}", out(&output));
    // Blank lines only: nothing, code 0.
    let output = pg.tool(&["import"], "one", &[], b"\n\n \n");
    expect_code(&output, 0);
}

#[test]
fn an_imported_position_is_what_the_consumer_finds_when_it_opens_the_store_again() {
    // The consumer's last commits may still be in its commit log when it stops: the import
    // must compare against them, and what it writes must not be undone when the consumer
    // opens the store again.
    for overwrite in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::builder(dir.path()).open().unwrap();
        let consumer = engine.consumer("billing").unwrap();
        for offset in 0..=10 {
            let key = format!("k{offset}");
            let Outcome::Fresh(mut claim) = consumer.begin(&key, Fingerprint::of(&key)).unwrap()
            else {
                panic!("fresh");
            };
            claim.stage_position("orders", 0, offset).unwrap();
            claim.stage_position("orders", 1, offset).unwrap();
            claim.commit("ok").unwrap();
        }
        drop(consumer);
        drop(engine);
        // Partition 0 backwards (9), partition 1 forwards (12).
        let file = format!(
            "{}{}",
            position_line(b"billing", "orders", 0, 9, IMPORTED_AT),
            position_line(b"billing", "orders", 1, 12, IMPORTED_AT)
        );
        let mut args = vec!["import", path_str(dir.path()), "--json"];
        if overwrite {
            args.push("--overwrite");
        }
        let output = idemdb(&args, file.as_bytes());
        let report = json_of(&output);
        if overwrite {
            expect_code(&output, 0);
            assert_eq!(report["positions"]["overwritten"], 2, "{report}");
        } else {
            expect_code(&output, 1);
            assert_eq!(
                (
                    &report["positions"]["advanced"],
                    &report["positions"]["skipped"]
                ),
                (&json!(1), &json!(1)),
                "{report}"
            );
        }
        let expected_0 = if overwrite { 9 } else { 10 };
        for round in 0..2 {
            let engine = Engine::builder(dir.path()).open().unwrap();
            let positions = engine.consumer("billing").unwrap().positions();
            let got: Vec<u64> = positions.list().unwrap().iter().map(|p| p.offset).collect();
            assert_eq!(
                got,
                [expected_0, 12],
                "overwrite {overwrite}, open {round}: the imported positions"
            );
            // Resuming one past each is accepted.
            positions.advance("orders", 0, expected_0 + 1).unwrap();
            positions.advance("orders", 1, 13).unwrap();
            drop(positions);
            drop(engine);
            let again = Engine::builder(dir.path()).open().unwrap();
            let got: Vec<u64> = again
                .consumer("billing")
                .unwrap()
                .positions()
                .list()
                .unwrap()
                .iter()
                .map(|p| p.offset)
                .collect();
            assert_eq!(
                got,
                [expected_0 + 1, 13],
                "overwrite {overwrite}, after resuming"
            );
            drop(again);
            // The second round starts from what the first left.
            if round == 0 {
                let store = Store::builder(dir.path()).open_exclusive().unwrap();
                store
                    .set_position(b"billing", "orders", 0, expected_0)
                    .unwrap();
                store.set_position(b"billing", "orders", 1, 12).unwrap();
            }
        }
    }
}

#[test]
fn both_exports_order_positions_byte_by_byte_whatever_the_databases_collation() {
    // PgStore::export: "positions by consumer id and source, byte by byte, and partition", "in
    // the order `idemdb export` writes them". A database made with a linguistic collation
    // (ICU en-US sorts "a" < "B" < "b"; bytes sort "B" < "a") must not change the order.
    let Some(pg) = Pg::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let consumers = ["b", "B", "aa", "é", "a"];
    let sources = ["b", "B", "aa", "Z", "é", "a"];
    for consumer in consumers {
        for key in ["B", "a", "b", "é", "aa"] {
            commit(&engine, consumer, key);
        }
        let positions = engine.consumer(consumer).unwrap().positions();
        for source in sources {
            for partition in [10, 0, 2] {
                positions.advance(source, partition, 1).unwrap();
            }
        }
    }
    drop(engine);
    let exported = idemdb(&["export", path_str(dir.path())], b"");
    expect_code(&exported, 0);
    let (records, positions) = split_lines(&out(&exported));
    // The documented order, computed here.
    let mut expected: Vec<(Vec<u8>, Vec<u8>, u32)> = Vec::new();
    for consumer in consumers {
        for source in sources {
            for partition in [10, 0, 2] {
                expected.push((consumer.into(), source.into(), partition));
            }
        }
    }
    expected.sort();
    let got: Vec<(Vec<u8>, Vec<u8>, u32)> = positions
        .iter()
        .map(|line| match transfer::parse_line(line).unwrap() {
            TransferLine::Position(p) => (
                p.consumer().to_vec(),
                p.position().source.clone().into_bytes(),
                p.position().partition,
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(got, expected, "idemdb export: byte by byte");

    // A database with ICU's en-US collation beside the default one.
    runtime().block_on(async {
        let (client, connection) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
            .batch_execute(
                "CREATE DATABASE icu TEMPLATE template0 ENCODING 'UTF8' LOCALE_PROVIDER icu \
                 ICU_LOCALE 'en-US' LOCALE 'C.utf8'",
            )
            .await
            .unwrap();
    });
    let icu_url = format!("{} dbname=icu", pg.url());
    for url in [pg.url(), icu_url] {
        let tool = |command: &str, stdin: &[u8]| {
            run(
                &pg.tool,
                &[command, "--url", &url, "--schema", "ordering"],
                stdin,
            )
        };
        expect_code(&tool("install", b""), 0);
        expect_code(&tool("import", &exported.stdout), 0);
        let output = tool("export", b"");
        expect_code(&output, 0);
        let (pg_records, pg_positions) = split_lines(&out(&output));
        assert_eq!(pg_positions, positions, "{url}: the positions' order");
        assert_eq!(pg_records, records, "{url}: the records' order");
    }
}

#[test]
fn export_of_a_live_store_has_the_positions_of_its_latest_commits() {
    // "Read commands ... open the store read-only: they take no lock and work while the
    // application runs, seeing what its files and WAL hold at that moment."
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let consumer = engine.consumer("live").unwrap();
    for offset in 0..=20u64 {
        let key = format!("k{offset}");
        let Outcome::Fresh(mut claim) = consumer.begin(&key, Fingerprint::of(&key)).unwrap() else {
            panic!("fresh");
        };
        claim.stage_position("orders", 0, offset).unwrap();
        claim.commit("ok").unwrap();
        if offset % 10 == 0 {
            let (records, positions) = export_of(dir.path());
            assert_eq!(records.len() as u64, offset + 1, "every committed record");
            assert_eq!(positions.len(), 1);
            assert!(
                positions[0].contains(&format!("\"offset\":{offset},")),
                "the latest commit's position: {}",
                positions[0]
            );
        }
    }
    // And that export moves the consumer: imported into a new store, it resumes at 21.
    let output = idemdb(&["export", path_str(dir.path())], b"");
    let target = new_store();
    expect_code(
        &idemdb(&["import", path_str(target.path())], &output.stdout),
        0,
    );
    assert_eq!(positions_of(target.path())[0].position.next_offset(), 21);
}

#[test]
fn more_positions_than_one_import_transaction_move_both_ways_with_exact_counts() {
    // PgStore::import_positions: "Written in transactions of up to IMPORT_TRANSACTION_RECORDS
    // positions".
    let Some(pg) = Pg::start() else { return };
    let count = 2 * idemdb_postgres::IMPORT_TRANSACTION_RECORDS as u32 + 345;
    let file: String = (0..count)
        .map(|partition| position_line(b"bulk", "s", partition, u64::from(partition), 7))
        .collect();
    pg.install("bulk");
    let output = pg.tool(&["import"], "bulk", &[], file.as_bytes());
    expect_code(&output, 0);
    assert!(
        out(&output).contains(&format!(
            "read positions: imported {count}, advanced 0, overwritten 0, skipped 0"
        )),
        "{}",
        out(&output)
    );
    // Again, even partitions one ahead: half advanced, half skipped.
    let ahead: String = (0..count)
        .map(|p| position_line(b"bulk", "s", p, u64::from(p) + u64::from(p % 2 == 0), 8))
        .collect();
    let output = pg.tool(&["import"], "bulk", &[], ahead.as_bytes());
    expect_code(&output, 1);
    let even = count.div_ceil(2);
    assert!(
        out(&output).contains(&format!(
            "read positions: imported 0, advanced {even}, overwritten 0, skipped {}",
            count - even
        )),
        "{}",
        out(&output)
    );
    // Back to an embedded store: every one, exact.
    let (_, pg_positions) = pg.export("bulk");
    assert_eq!(pg_positions.len(), count as usize);
    let back = new_store();
    let lines: String = pg_positions.iter().map(|l| format!("{l}\n")).collect();
    let output = idemdb(
        &["import", path_str(back.path()), "--json"],
        lines.as_bytes(),
    );
    expect_code(&output, 0);
    assert_eq!(json_of(&output)["positions"]["imported"], count);
    let stored = positions_of(back.path());
    assert_eq!(stored.len(), count as usize);
    for entry in stored {
        let p = entry.position.partition;
        let even = p % 2 == 0;
        assert_eq!(entry.position.offset, u64::from(p) + u64::from(even));
        assert_eq!(entry.position.updated_at_ms, if even { 8 } else { 7 });
    }
}

/// A PostgreSQL consumer `live` of source `orders` partition 0 on its own thread: commits
/// `k{offset}` with the position staged, from 0 up to `last`; a commit refused as behind
/// (an import moved the position past it) is recorded, and it resumes one past the stored
/// position. Returns the refused offsets and the committed ones.
type Committed = (Vec<u64>, Vec<u64>);
fn spawn_pg_consumer(
    url: String,
    schema: &'static str,
    last: u64,
) -> std::thread::JoinHandle<Committed> {
    std::thread::spawn(move || {
        runtime().block_on(async {
            let (mut client, store) = connect(&url, schema).await;
            let consumer = store.consumer("live").unwrap();
            let mut refused = Vec::new();
            let mut accepted = Vec::new();
            let mut offset = 0;
            while offset <= last {
                let key = format!("k{offset}");
                let committed = match consumer
                    .begin(&mut client, &key, Fingerprint::of(&key))
                    .await
                    .unwrap()
                {
                    Outcome::Fresh(mut claim) => {
                        claim.stage_position("orders", 0, offset).unwrap();
                        claim.commit("ok").await
                    }
                    other => panic!("{key}: {other:?}"),
                };
                match committed {
                    Ok(()) => {
                        accepted.push(offset);
                        offset += 1;
                    }
                    Err(idemdb_postgres::Error::Idemdb(Error::PositionBehind { .. })) => {
                        refused.push(offset);
                        offset = consumer
                            .positions()
                            .get(&client, "orders", 0)
                            .await
                            .unwrap()
                            .unwrap()
                            .next_offset();
                    }
                    Err(other) => panic!("{key}: {other:?}"),
                }
            }
            (refused, accepted)
        })
    })
}

#[test]
fn a_postgres_export_taken_while_a_consumer_commits_has_no_position_past_its_records() {
    // PgStore::export: "One statement, so one snapshot: claims go on meanwhile, ... and no
    // position points past a record the export lacks."
    let Some(pg) = Pg::start() else { return };
    pg.install("snap");
    let consumer = spawn_pg_consumer(pg.url(), "snap", 400);
    let mut checked = 0;
    while !consumer.is_finished() || checked == 0 {
        let (records, positions) = pg.export("snap");
        checked += 1;
        let keys: std::collections::BTreeSet<Vec<u8>> = records
            .iter()
            .map(|line| match transfer::parse_line(line).unwrap() {
                TransferLine::Record(r) => r.key().to_vec(),
                other => panic!("{other:?}"),
            })
            .collect();
        if let Some(line) = positions.first() {
            let TransferLine::Position(p) = transfer::parse_line(line).unwrap() else {
                panic!("{line}");
            };
            for offset in 0..=p.position().offset {
                assert!(
                    keys.contains(format!("k{offset}").as_bytes()),
                    "export {checked}: the position is at {} but k{offset} is missing",
                    p.position().offset
                );
            }
        }
    }
    assert!(consumer.join().unwrap().0.is_empty());
}

#[test]
fn a_postgres_import_beside_a_committing_consumer_only_moves_its_position_forward() {
    // PgStore::import_positions: "a commit in flight that moves one is waited for, and
    // compared against once it has landed. A consumer that commits a position afterwards is
    // held to the imported one as to any other (refused behind it)."
    let Some(pg) = Pg::start() else { return };
    pg.install("beside");
    let imported = 150;
    let consumer = spawn_pg_consumer(pg.url(), "beside", 300);
    let file = position_line(b"live", "orders", 0, imported, 1);
    let output = pg.tool(&["import"], "beside", &[], file.as_bytes());
    let (refused, accepted) = consumer.join().unwrap();
    let report = out(&output);
    assert!(
        matches!(output.status.code(), Some(0 | 1)),
        "{report}{}",
        err(&output)
    );
    assert!(
        refused.iter().all(|&offset| offset <= imported),
        "refused only behind the imported position: {refused:?}"
    );
    let (records, positions) = pg.export("beside");
    assert_eq!(positions.len(), 1);
    assert!(positions[0].contains("\"offset\":300,"), "{}", positions[0]);
    // Every commit that was accepted left its record; refused ones left none. The consumer
    // resumed one past the imported position when refused.
    assert_eq!(
        records.len(),
        accepted.len(),
        "{report} refused {refused:?}"
    );
    if !refused.is_empty() {
        let resumed = accepted.iter().find(|&&o| o > refused[0]).copied();
        assert_eq!(resumed, Some(imported + 1), "{report} refused {refused:?}");
    }
    // Skipped (the consumer was at or past it): then nothing of the consumer's was refused.
    if report.contains("advanced 0, overwritten 0, skipped 1") {
        assert!(
            refused.is_empty(),
            "skipped, yet the consumer was refused: {refused:?}"
        );
    }
}

/// A store as written before positions existed: its positions table dropped with plain
/// RocksDB.
fn store_without_a_positions_table() -> tempfile::TempDir {
    let dir = new_store();
    let names = rocksdb::DB::list_cf(&rocksdb::Options::default(), dir.path()).unwrap();
    assert!(names.iter().any(|n| n == "idemdb.positions"), "{names:?}");
    let mut db = rocksdb::DB::open_cf(&rocksdb::Options::default(), dir.path(), &names).unwrap();
    db.drop_cf("idemdb.positions").unwrap();
    drop(db);
    dir
}

#[test]
fn positions_imported_into_a_store_without_a_positions_table_write_nothing_not_even_records() {
    // Store::import_positions: "InvalidArgument ... for positions given to a store with no
    // positions table (written before positions existed: open it once with the
    // application)", checked before anything is written; the CLI "reads and checks every
    // line before it writes anything".
    let dir = store_without_a_positions_table();
    let store = Store::builder(dir.path()).open_exclusive().unwrap();
    let position = [ImportPosition::new(b"donor", Position::new("orders", 0, 1, 1)).unwrap()];
    assert!(matches!(
        store.check_import_positions(&position),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        store.import_positions(&position, true),
        Err(Error::InvalidArgument { .. })
    ));
    // Nothing to write: no refusal.
    assert!(store.import_positions(&[], false).is_ok());
    drop(store);
    let file = format!(
        "{}{}",
        donor_record_lines(),
        position_line(b"donor", "orders", 0, 1, 1)
    );
    let output = idemdb(&["import", path_str(dir.path())], file.as_bytes());
    assert!(
        !matches!(output.status.code(), Some(0 | 1)),
        "refused: {}{}",
        out(&output),
        err(&output)
    );
    let (records, positions) = export_of(dir.path());
    assert!(
        records.is_empty(),
        "records written before the refusal: {records:?}"
    );
    assert!(positions.is_empty());
    // Records alone (the docs' `grep -v '^{"kind":"position"'`) import.
    let records_only: String = file
        .lines()
        .filter(|line| !line.starts_with("{\"kind\":\"position\""))
        .map(|line| format!("{line}\n"))
        .collect();
    let output = idemdb(&["import", path_str(dir.path())], records_only.as_bytes());
    expect_code(&output, 0);
    assert_eq!(export_of(dir.path()).0.len(), 2);
}

#[test]
fn postgres_refuses_an_entity_tables_line_and_writes_no_record_and_no_position() {
    // 04-postgresql-fleet.md: "the import refuses an embedded entity table's lines"; 07:
    // "An import reads and checks every line before it writes anything".
    let Some(pg) = Pg::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path())
        .entity_table("accounts")
        .open()
        .unwrap();
    commit(&engine, "billing", "order-1");
    match engine
        .entity_table("accounts")
        .unwrap()
        .begin("acct-1", Fingerprint::of("a"))
        .unwrap()
    {
        Outcome::Fresh(claim) => {
            claim.commit("opened").unwrap();
        }
        other => panic!("{other:?}"),
    }
    engine
        .consumer("billing")
        .unwrap()
        .positions()
        .advance("orders", 0, 3)
        .unwrap();
    drop(engine);
    let exported = idemdb(&["export", path_str(dir.path())], b"");
    expect_code(&exported, 0);
    assert!(
        out(&exported).contains("\"accounts\""),
        "{}",
        out(&exported)
    );
    pg.install("entity");
    for extra in [&[][..], &["--overwrite"][..]] {
        let output = pg.tool(&["import"], "entity", extra, &exported.stdout);
        expect_code(&output, 2);
        let (records, positions) = pg.export("entity");
        assert!(
            records.is_empty() && positions.is_empty(),
            "{records:?} {positions:?}"
        );
    }
}

#[test]
fn import_into_a_path_with_no_store_is_refused_with_code_4_and_makes_nothing() {
    // "The embedded store imported into must exist: the application opens it once first ...
    // `idemdb import` on a path with no store refuses with exit code 4 and writes nothing."
    let parent = tempfile::tempdir().unwrap();
    let new_path = parent.path().join("new-store");
    let empty_dir = tempfile::tempdir().unwrap();
    let file = format!(
        "{}{}",
        donor_record_lines(),
        position_line(b"donor", "orders", 3, 41, 1)
    );
    for target in [new_path.as_path(), empty_dir.path()] {
        let output = idemdb(&["import", path_str(target)], file.as_bytes());
        expect_code(&output, 4);
    }
    assert!(!new_path.exists(), "the import made the path");
    assert_eq!(std::fs::read_dir(empty_dir.path()).unwrap().count(), 0);
}

#[test]
fn export_to_a_file_imports_from_that_file_or_from_dash_on_both_backends() {
    // `idemdb export STORE -o FILE`; `idemdb import STORE [FILE]` (`-` or nothing for standard
    // input); `idemdb-pg import [FILE | -]`.
    let Some(pg) = Pg::start() else { return };
    let source = store_with_odd_positions(idemdb_postgres::POSITION_OFFSET_MAX);
    let file = tempfile::tempdir().unwrap();
    let lines = file.path().join("moved.jsonl");
    let output = idemdb(
        &["export", path_str(source.path()), "-o", path_str(&lines)],
        b"",
    );
    expect_code(&output, 0);
    let bytes = std::fs::read(&lines).unwrap();
    let by_dash = new_store();
    expect_code(
        &idemdb(&["import", path_str(by_dash.path()), "-"], &bytes),
        0,
    );
    assert_eq!(
        position_map(&positions_of(by_dash.path())),
        position_map(&positions_of(source.path()))
    );
    pg.install("files");
    pg.install("dash");
    expect_code(&pg.tool(&["import"], "files", &[path_str(&lines)], b""), 0);
    expect_code(&pg.tool(&["import"], "dash", &["-"], &bytes), 0);
    assert_eq!(pg.export("files"), pg.export("dash"));
    assert_eq!(pg.export("files").1.len(), 7);
}

#[test]
fn postgres_positions_belong_to_the_records_table_they_were_imported_beside() {
    // `--table NAME the records table`: a second records table in the same schema is another
    // store, with positions of its own.
    let Some(pg) = Pg::start() else { return };
    let url = pg.url();
    let tool = |command: &str, table: &str, stdin: &[u8]| {
        let args = [
            command,
            "--url",
            url.as_str(),
            "--schema",
            "two",
            "--table",
            table,
        ];
        run(&pg.tool, &args, stdin)
    };
    expect_code(&tool("install", "first", b""), 0);
    expect_code(&tool("install", "second", b""), 0);
    let file = position_line(b"billing", "orders", 0, 5, 1);
    expect_code(&tool("import", "first", file.as_bytes()), 0);
    let first = tool("export", "first", b"");
    expect_code(&first, 0);
    assert_eq!(out(&first), file);
    let second = tool("export", "second", b"");
    expect_code(&second, 0);
    assert_eq!(out(&second), "", "the other table's store has no position");
    // Imported into the second too: imported there, not skipped because of the first.
    let output = tool("import", "second", file.as_bytes());
    expect_code(&output, 0);
    assert!(
        out(&output).contains("read positions: imported 1,"),
        "{}",
        out(&output)
    );
}

/// Imports a position with time `at` into PostgreSQL (schema `schema`) beside two records:
/// either kept exactly (code 0) or refused before anything is written (code 2).
fn postgres_keeps_or_refuses_time(pg: &Pg, schema: &str, at: u64) {
    pg.install(schema);
    let line = position_line(b"donor", "orders", 0, 5, at);
    let file = format!("{}{line}", donor_record_lines());
    let output = pg.tool(&["import"], schema, &[], file.as_bytes());
    let (records, positions) = pg.export(schema);
    match output.status.code() {
        Some(0) => {
            assert_eq!(records.len(), 2);
            assert_eq!(positions, [line.trim_end()], "{at}: kept as it is");
        }
        Some(2) => assert!(
            records.is_empty() && positions.is_empty(),
            "{at}: refused, yet written: {records:?} {positions:?}"
        ),
        other => panic!(
            "{at}: code {other:?}, {}{}; written: {records:?} {positions:?}",
            out(&output),
            err(&output)
        ),
    }
}

#[test]
fn a_position_time_up_to_i64_max_is_kept_as_it_is_on_both_backends() {
    // "`updated_at_ms` is when the position last moved, kept as it is".
    for at in [0, i64::MAX as u64, u64::MAX] {
        let dir = new_store();
        let line = position_line(b"donor", "orders", 0, 5, at);
        expect_code(
            &idemdb(&["import", path_str(dir.path())], line.as_bytes()),
            0,
        );
        assert_eq!(
            positions_of(dir.path())[0].position.updated_at_ms,
            at,
            "embedded"
        );
    }
    let Some(pg) = Pg::start() else { return };
    postgres_keeps_or_refuses_time(&pg, "t0", 0);
    postgres_keeps_or_refuses_time(&pg, "t1", i64::MAX as u64);
}

#[test]
fn a_position_time_past_i64_max_is_kept_or_refused_by_postgres_never_changed() {
    // "`updated_at_ms` is when the position last moved, kept as it is"; an import "reads and
    // checks every line before it writes anything". A time PostgreSQL cannot keep must be
    // kept exactly or refused up front, never written changed.
    let Some(pg) = Pg::start() else { return };
    postgres_keeps_or_refuses_time(&pg, "t3", u64::MAX);
    postgres_keeps_or_refuses_time(&pg, "t2", i64::MAX as u64 + 1);
}

/// Record lines, then a line that is not UTF-8 (line 3).
fn not_utf8_file() -> Vec<u8> {
    let mut file = donor_record_lines().into_bytes();
    file.extend_from_slice(b"{\"kind\":\"position\",\"consumer\":\"\xff\"}\n");
    file
}

#[test]
fn input_that_is_not_utf8_is_refused_as_malformed_with_code_2_and_nothing_written() {
    // Exit codes: "2 usage error (arguments, malformed import input)".
    let (dir, before) = store_with_positions_at_10();
    let output = idemdb(&["import", path_str(dir.path())], &not_utf8_file());
    expect_unchanged(dir.path(), &before);
    expect_code(&output, 2);
}

#[test]
fn postgres_input_that_is_not_utf8_is_refused_as_bad_input_with_code_2_and_nothing_written() {
    // idemdb-pg: "2 bad usage or input: nothing was written".
    let Some(pg) = Pg::start() else { return };
    pg.install("utf");
    let output = pg.tool(&["import"], "utf", &[], &not_utf8_file());
    assert_eq!(pg.export("utf"), (vec![], vec![]));
    expect_code(&output, 2);
}

/// Input that yields `text`, then fails.
struct FailingInput {
    text: std::io::Cursor<Vec<u8>>,
}

impl std::io::Read for FailingInput {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.text.read(buf)?;
        if n == 0 {
            return Err(std::io::Error::other("the disk went away"));
        }
        Ok(n)
    }
}

#[test]
fn postgres_import_lines_writes_nothing_when_reading_its_input_fails() {
    // PgStore::import_lines: "[`Error::ImportInput`] for a malformed line (naming its
    // number) or a failed read ... Nothing is written on any of the first two."
    let Some(pg) = Pg::start() else { return };
    pg.install("fail");
    let text = format!(
        "{}{}",
        donor_record_lines(),
        position_line(b"donor", "orders", 0, 5, 1)
    );
    runtime().block_on(async {
        let (mut client, store) = connect(&pg.url(), "fail").await;
        let input = std::io::BufReader::new(FailingInput {
            text: std::io::Cursor::new(text.into_bytes()),
        });
        match store.import_lines(&mut client, input, false).await {
            Err(idemdb_postgres::Error::ImportInput(_)) => {}
            other => panic!("expected ImportInput, got {other:?}"),
        }
    });
    assert_eq!(pg.export("fail"), (vec![], vec![]));
}

#[test]
fn the_moved_position_is_listed_with_where_it_resumes_on_both_backends() {
    // 07: `idemdb-pg positions list --url "$DB" --consumer billing   # where it resumes`;
    // `idemdb export --json` prints "JSON lines for export": the same lines.
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    commit(&engine, "billing", "order-1");
    engine
        .consumer("billing")
        .unwrap()
        .positions()
        .advance("orders", 3, 41)
        .unwrap();
    drop(engine);
    let plain = idemdb(&["export", path_str(dir.path())], b"");
    let json_lines = idemdb(&["export", path_str(dir.path()), "--json"], b"");
    expect_code(&json_lines, 0);
    assert_eq!(out(&json_lines), out(&plain), "--json: the same lines");
    let target = new_store();
    expect_code(
        &idemdb(&["import", path_str(target.path())], &plain.stdout),
        0,
    );
    let listed = idemdb(&["positions", "list", path_str(target.path())], b"");
    expect_code(&listed, 0);
    assert!(
        out(&listed).contains("41") && out(&listed).contains("42"),
        "offset 41, resumes at 42: {}",
        out(&listed)
    );
    let Some(pg) = Pg::start() else { return };
    pg.install("listed");
    expect_code(&pg.tool(&["import"], "listed", &[], &plain.stdout), 0);
    let listed = pg.tool(
        &["positions", "list"],
        "listed",
        &["--consumer", "billing"],
        b"",
    );
    expect_code(&listed, 0);
    let text = out(&listed);
    assert!(
        text.contains("orders") && text.contains("41") && text.contains("42"),
        "offset 41, resumes at 42: {text}"
    );
}
