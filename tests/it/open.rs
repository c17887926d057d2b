//! Guards opening a store: a store held by another process or engine is a typed error, and a
//! store opened with tables (or business-table merge operators) that do not match is refused
//! with a reason, before RocksDB recovers anything.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::util::TestStore;
use idemdb::{Engine, Error, TableOptions};

/// Environment variable telling the child test which store to hold open.
const HOLD_ENV: &str = "IDEMDB_TEST_HOLD_STORE";
const HOLDING: &str = "IDEMDB-HOLDING";

#[test]
fn second_engine_in_this_process_gets_already_open() {
    let store = TestStore::new();
    let _engine = store.open();
    assert!(matches!(
        store.builder().open(),
        Err(Error::AlreadyOpen { .. })
    ));
}

/// Not a test on its own: the child half of `another_process_holding_the_store_...`.
#[test]
#[ignore = "run by another test as a child process"]
fn child_holds_store_open() {
    let Ok(path) = std::env::var(HOLD_ENV) else {
        return;
    };
    let _engine = Engine::builder(&path)
        .open()
        .expect("child opens the store");
    println!("{HOLDING}");
    // Hold the store until the parent closes our stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn another_process_holding_the_store_gives_already_open() {
    let store = TestStore::new();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "open::child_holds_store_open",
            "--ignored",
            "--nocapture",
        ])
        .env(HOLD_ENV, store.dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let holding = lines.by_ref().any(|line| line.unwrap().contains(HOLDING));
    assert!(holding, "the child never opened the store");

    let result = Engine::builder(store.dir.path()).open();
    drop(child.stdin.take());
    // Keep reading so the child can finish writing its test report.
    lines.for_each(drop);
    assert!(child.wait().unwrap().success());
    match result {
        Err(error @ Error::AlreadyOpen { .. }) => {
            assert!(error.to_string().contains("already open"));
        }
        other => panic!("expected AlreadyOpen, got {other:?}"),
    }
    // Once the child is gone the store opens.
    Engine::builder(store.dir.path()).open().unwrap();
}

#[test]
fn mismatched_tables_are_refused_with_a_reason() {
    let store = TestStore::new();
    drop(store.open());
    // `orders` exists in the store but is not declared.
    let result = Engine::builder(store.dir.path())
        .entity_table("customers")
        .open();
    assert!(
        matches!(&result, Err(Error::IncompatibleStore { reason, .. }) if reason.contains("orders")),
        "{result:?}"
    );
    // `customers` was created as an entity table; declaring it as a business table is refused.
    let result = Engine::builder(store.dir.path())
        .business_table(TableOptions::new("orders"))
        .business_table(
            TableOptions::new("counters").merge_operator("add_u64", idemdb::merge_ops::add_u64),
        )
        .business_table(TableOptions::new("customers"))
        .open();
    assert!(
        matches!(&result, Err(Error::IncompatibleStore { reason, .. }) if reason.contains("customers")),
        "{result:?}"
    );
    // A new table can be added to an existing store.
    store
        .builder()
        .business_table(TableOptions::new("audit"))
        .open()
        .unwrap();
}

/// Creates a plain RocksDB database at `path` with the given column families, and `records`
/// raw entries in `idemdb.records` if that family is among them.
fn create_raw(path: &std::path::Path, families: &[&str], records: &[(&[u8], &[u8])]) {
    let mut options = rocksdb::Options::default();
    options.create_if_missing(true);
    options.create_missing_column_families(true);
    let db = rocksdb::DB::open_cf(&options, path, families).unwrap();
    for (key, value) in records {
        db.put_cf(db.cf_handle("idemdb.records").unwrap(), key, value)
            .unwrap();
    }
}

#[test]
fn a_plain_rocksdb_database_is_not_an_idemdb_store() {
    let store = TestStore::new();
    create_raw(store.dir.path(), &["default", "other"], &[]);
    let result = Engine::builder(store.dir.path()).open();
    assert!(
        matches!(&result, Err(Error::IncompatibleStore { reason, .. }) if reason.contains("not an idemdb store")),
        "{result:?}"
    );
}

#[test]
fn a_store_without_format_marker_opens_only_while_it_holds_no_record() {
    // As left by a crash during the first open: tables created, marker not yet written.
    let empty = TestStore::new();
    create_raw(empty.dir.path(), &["default", "idemdb.records"], &[]);
    Engine::builder(empty.dir.path()).open().unwrap();
    // Reopening finds the marker written by the first successful open.
    Engine::builder(empty.dir.path()).open().unwrap();

    let holding = TestStore::new();
    create_raw(
        holding.dir.path(),
        &["default", "idemdb.records"],
        &[(b"\x01ck", b"value")],
    );
    let result = Engine::builder(holding.dir.path()).open();
    assert!(
        matches!(&result, Err(Error::IncompatibleStore { reason, .. }) if reason.contains("format marker")),
        "{result:?}"
    );
}

#[test]
fn a_business_table_reopened_with_another_merge_operator_is_refused_before_recovery() {
    let store = TestStore::new();
    {
        let engine = store.open();
        let billing = engine.consumer("billing").unwrap();
        let counters = engine.business_table("counters").unwrap();
        let idemdb::Outcome::Fresh(mut claim) = billing
            .begin(b"m1", idemdb::Fingerprint::of(b"m1"))
            .unwrap()
        else {
            panic!("fresh");
        };
        // Left unflushed: the merge operand is only in the WAL, which the next open replays.
        claim.merge(&counters, "n", 5u64.to_be_bytes()).unwrap();
        claim.commit(b"").unwrap();
    }
    let with_counters = |options: TableOptions| {
        Engine::builder(store.dir.path())
            .clock(store.clock.clone())
            .business_table(TableOptions::new("orders"))
            .business_table(options)
            .entity_table("customers")
            .open()
    };
    for declared in [
        TableOptions::new("counters"),
        TableOptions::new("counters").merge_operator("renamed", idemdb::merge_ops::add_u64),
    ] {
        match with_counters(declared) {
            Err(Error::IncompatibleStore { reason, .. }) => {
                assert!(reason.contains("\"counters\""), "{reason}");
                assert!(reason.contains("\"add_u64\""), "{reason}");
            }
            other => panic!("expected IncompatibleStore, got {other:?}"),
        }
    }
    // Refused before RocksDB replayed anything: the right declaration finds every write.
    let engine = store.open();
    assert_eq!(crate::util::counter(&engine, "n"), 5);
    assert!(
        engine
            .consumer("billing")
            .unwrap()
            .get(b"m1")
            .unwrap()
            .is_some()
    );
}
