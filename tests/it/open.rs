//! Guards opening a store: a store held by another process or engine is a typed error, whatever
//! spelling of its path the second opener uses, and a store opened with tables (or
//! business-table merge operators) that do not match is refused with a reason, before RocksDB
//! recovers anything: a refused open leaves every file as it was.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::util::{TestStore, assert_refused_without_change, incompatible};
use idemdb::{Engine, EngineBuilder, Error, Fingerprint, Outcome, TableOptions, merge_ops};

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

/// The path of `target` relative to the current directory, without changing it (the test
/// binary's threads share the current directory).
fn relative_path(target: &Path) -> PathBuf {
    let cwd = std::env::current_dir().unwrap();
    let mut relative = PathBuf::new();
    for _ in cwd.components().skip(1) {
        relative.push("..");
    }
    relative.push(target.strip_prefix("/").unwrap());
    relative
}

/// Asserts that opening the store through `spelling`, as an application and as an operator
/// tool, is refused as `AlreadyOpen`.
fn assert_already_open(spelling: &Path) {
    let result = Engine::builder(spelling).open();
    assert!(
        matches!(result, Err(Error::AlreadyOpen { .. })),
        "{spelling:?}: {result:?}"
    );
    let result = idemdb::admin::Store::builder(spelling).open_exclusive();
    assert!(
        matches!(result, Err(Error::AlreadyOpen { .. })),
        "admin, {spelling:?}: {result:?}"
    );
}

/// Claims `key` through `engine` and commits it.
fn commit_key(engine: &Engine, key: &str) {
    let consumer = engine.consumer("c").unwrap();
    let Outcome::Fresh(claim) = consumer.begin(key, Fingerprint::of(key)).unwrap() else {
        panic!("{key} should be fresh");
    };
    claim.commit(b"done").unwrap();
}

#[test]
fn every_spelling_of_an_open_stores_path_is_already_open() {
    let root = tempfile::tempdir().unwrap();
    let store = root.path().join("s");
    std::fs::create_dir(root.path().join("sub")).unwrap();
    let link = root.path().join("link");
    std::os::unix::fs::symlink(&store, &link).unwrap();
    let engine = Engine::builder(&store).open().unwrap();
    // A claim held by the first engine: a second engine would have had latches of its own.
    let consumer = engine.consumer("c").unwrap();
    let Outcome::Fresh(held) = consumer.begin("k", Fingerprint::of("k")).unwrap() else {
        panic!("fresh");
    };

    let spellings = [
        PathBuf::from(format!("{}/", store.display())),
        store.join("."),
        root.path().join("sub").join("..").join("s"),
        link.clone(),
        PathBuf::from(format!("{}/", link.display())),
        relative_path(&store),
        relative_path(&link),
    ];
    for spelling in &spellings {
        assert_already_open(spelling);
    }
    // The store as given is refused too, as an application and as a tool.
    assert_already_open(&store);
    // A read-only operator open takes no lock and still works beside the owner.
    idemdb::admin::Store::builder(&link)
        .open_read_only()
        .unwrap();

    held.commit(b"done").unwrap();
    commit_key(&engine, "after");
    drop(consumer);
    drop(engine);
    // Every acknowledged commit is there, through any spelling, and the store opens again.
    let reopened = Engine::builder(&spellings[3]).open().unwrap();
    let consumer = reopened.consumer("c").unwrap();
    assert!(consumer.get("k").unwrap().is_some());
    assert!(consumer.get("after").unwrap().is_some());
}

/// Unmounts a bind mount when dropped, whatever happened meanwhile.
struct BindMount(PathBuf);

impl BindMount {
    fn new(source: &Path, target: &Path) -> Option<BindMount> {
        std::fs::create_dir_all(target).ok()?;
        let status = Command::new("mount")
            .arg("--bind")
            .arg(source)
            .arg(target)
            .stderr(Stdio::null())
            .status()
            .ok()?;
        status.success().then(|| BindMount(target.to_path_buf()))
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_bind_mount_of_an_open_store_is_already_open() {
    let root = tempfile::tempdir().unwrap();
    let store = root.path().join("s");
    let engine = Engine::builder(&store).open().unwrap();
    let Some(mount) = BindMount::new(&store, &root.path().join("mnt")) else {
        eprintln!("skipped: bind mounts are refused here (mount --bind needs root)");
        return;
    };
    assert_already_open(&mount.0);
    commit_key(&engine, "k");
    drop(engine);
    // Once the engine is closed, the store opens through the mount and has the commit.
    let through_mount = Engine::builder(&mount.0).open().unwrap();
    assert!(
        through_mount
            .consumer("c")
            .unwrap()
            .get("k")
            .unwrap()
            .is_some()
    );
}

#[test]
fn an_operator_tools_exclusive_open_holds_the_store_against_every_spelling() {
    let root = tempfile::tempdir().unwrap();
    let store = root.path().join("s");
    drop(Engine::builder(&store).open().unwrap());
    let tool = idemdb::admin::Store::builder(&store)
        .open_exclusive()
        .unwrap();
    assert_already_open(&store.join("."));
    assert_already_open(&relative_path(&store));
    drop(tool);
    Engine::builder(store.join(".")).open().unwrap();
}

#[test]
fn already_open_wins_over_a_mismatched_declaration() {
    let store = TestStore::new();
    let _engine = store.open();
    // `orders` and `counters` are left undeclared, and `customers` is declared as a business
    // table: both would be refused as incompatible, but the cause to act on is the holder.
    let result = Engine::builder(store.dir.path())
        .business_table(TableOptions::new("customers"))
        .open();
    assert!(
        matches!(result, Err(Error::AlreadyOpen { .. })),
        "{result:?}"
    );
}

#[test]
fn a_refused_open_changes_nothing_and_loses_no_unflushed_commit() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("store");
    let sums = || TableOptions::new("sums").merge_operator("add_u64", merge_ops::add_u64);
    let declared = |sums: Option<TableOptions>, plain: TableOptions, things: Option<bool>| {
        let mut builder = Engine::builder(&path).business_table(plain);
        if let Some(sums) = sums {
            builder = builder.business_table(sums);
        }
        match things {
            Some(true) => builder.entity_table("things"),
            Some(false) => builder.business_table(TableOptions::new("things")),
            None => builder,
        }
    };
    let right = || declared(Some(sums()), TableOptions::new("plain"), Some(true));
    {
        // A put of 5 and three merges of +2, all left in the WAL (no flush): 11.
        let engine = right().open().unwrap();
        let consumer = engine.consumer("c").unwrap();
        let table = engine.business_table("sums").unwrap();
        let plain = engine.business_table("plain").unwrap();
        for (index, operand) in [5u64, 2, 2, 2].into_iter().enumerate() {
            let key = format!("m{index}");
            let Outcome::Fresh(mut claim) = consumer.begin(&key, Fingerprint::of(&key)).unwrap()
            else {
                panic!("fresh");
            };
            if index == 0 {
                claim.put(&table, "s", operand.to_be_bytes()).unwrap();
                claim.put(&plain, "p", b"kept").unwrap();
            } else {
                claim.merge(&table, "s", operand.to_be_bytes()).unwrap();
            }
            claim.commit(b"").unwrap();
        }
        let things = engine.entity_table("things").unwrap();
        let Outcome::Fresh(claim) = things.begin("t", Fingerprint::of("t")).unwrap() else {
            panic!("fresh");
        };
        claim.commit(b"thing").unwrap();
    }

    let renamed = TableOptions::new("sums").merge_operator("renamed", merge_ops::add_u64);
    let gained = TableOptions::new("plain").merge_operator("add_u64", merge_ops::add_u64);
    let refusals: Vec<(&str, EngineBuilder)> = vec![
        (
            "sums declared as an entity table",
            declared(None, TableOptions::new("plain"), Some(true)).entity_table("sums"),
        ),
        (
            "sums without its merge operator",
            declared(
                Some(TableOptions::new("sums")),
                TableOptions::new("plain"),
                Some(true),
            ),
        ),
        (
            "sums with another merge operator",
            declared(Some(renamed), TableOptions::new("plain"), Some(true)),
        ),
        (
            "plain with a merge operator it was not created with",
            declared(Some(sums()), gained, Some(true)),
        ),
        (
            "things undeclared",
            declared(Some(sums()), TableOptions::new("plain"), None),
        ),
        (
            "things declared as a business table",
            declared(Some(sums()), TableOptions::new("plain"), Some(false)),
        ),
        (
            "sums undeclared",
            declared(None, TableOptions::new("plain"), Some(true)),
        ),
    ];
    for (what, builder) in refusals {
        assert_refused_without_change(&path, what, incompatible, || builder.open());
    }
    assert_refused_without_change(
        &path,
        "a retention out of bounds",
        |error| matches!(error, Error::LimitExceeded { .. }),
        || right().retention(Duration::ZERO).open(),
    );

    // The right declaration finds every acknowledged effect.
    let engine = right().open().unwrap();
    let total = engine.business_table("sums").unwrap().get("s").unwrap();
    assert_eq!(total.as_deref().and_then(merge_ops::read_u64), Some(11));
    let plain = engine.business_table("plain").unwrap().get("p").unwrap();
    assert_eq!(plain.as_deref(), Some(&b"kept"[..]));
    let things = engine.entity_table("things").unwrap();
    assert!(things.get("t").unwrap().is_some());
    let consumer = engine.consumer("c").unwrap();
    for index in 0..4 {
        assert!(consumer.get(format!("m{index}")).unwrap().is_some());
    }
}

#[test]
fn a_refused_open_of_a_foreign_database_changes_nothing() {
    for (what, marker) in [
        ("another format marker", Some(&b"some other format"[..])),
        ("records but no format marker", None),
    ] {
        let dir = tempfile::tempdir().unwrap();
        {
            // Left unflushed: only the WAL holds these.
            let mut options = rocksdb::Options::default();
            options.create_if_missing(true);
            options.create_missing_column_families(true);
            let db =
                rocksdb::DB::open_cf(&options, dir.path(), ["default", "idemdb.records"]).unwrap();
            if let Some(marker) = marker {
                db.put(b"idemdb.format", marker).unwrap();
            }
            db.put_cf(db.cf_handle("idemdb.records").unwrap(), b"\x01ck", b"value")
                .unwrap();
        }
        assert_refused_without_change(dir.path(), what, incompatible, || {
            Engine::builder(dir.path()).open()
        });
        assert_refused_without_change(dir.path(), what, incompatible, || {
            idemdb::admin::Store::builder(dir.path())
                .open_exclusive()
                .map(|_| unreachable!("refused"))
        });
    }
}

#[test]
fn a_business_table_keeps_the_merge_operator_it_was_created_with() {
    let store = TestStore::new();
    drop(store.open());
    // `orders` was created without a merge operator: gaining one is refused, so that no
    // accepted open can lock the original declaration out.
    let gained = || {
        Engine::builder(store.dir.path())
            .clock(store.clock.clone())
            .business_table(
                TableOptions::new("orders").merge_operator("add_u64", merge_ops::add_u64),
            )
            .business_table(
                TableOptions::new("counters").merge_operator("add_u64", merge_ops::add_u64),
            )
            .entity_table("customers")
            .open()
    };
    match gained() {
        Err(Error::IncompatibleStore { reason, .. }) => {
            assert!(reason.contains("\"orders\""), "{reason}");
            assert!(reason.contains("no merge operator"), "{reason}");
        }
        other => panic!("expected IncompatibleStore, got {other:?}"),
    }
    // An operator tool's open in between changes neither answer.
    drop(
        idemdb::admin::Store::builder(store.dir.path())
            .open_exclusive()
            .unwrap(),
    );
    assert!(matches!(gained(), Err(Error::IncompatibleStore { .. })));
    drop(store.open());
}

#[test]
fn a_plain_rocksdb_open_between_two_opens_locks_nobody_out() {
    // A debugging tool (ldb, say) opens the store with RocksDB's defaults: no merge operators,
    // and a new OPTIONS file that records none.
    let store = TestStore::new();
    drop(store.open());
    let families = rocksdb::DB::list_cf(&rocksdb::Options::default(), store.dir.path()).unwrap();
    drop(rocksdb::DB::open_cf(&rocksdb::Options::default(), store.dir.path(), &families).unwrap());
    // The operators recorded at creation still decide: the application's declaration opens,
    // and one without `counters`' operator is still refused.
    drop(store.open());
    let result = Engine::builder(store.dir.path())
        .business_table(TableOptions::new("orders"))
        .business_table(TableOptions::new("counters"))
        .entity_table("customers")
        .open();
    assert!(
        matches!(&result, Err(Error::IncompatibleStore { reason, .. }) if reason.contains("\"add_u64\"")),
        "{result:?}"
    );
}

#[test]
fn a_child_process_between_fork_and_exec_does_not_keep_the_store_locked() {
    use std::os::unix::process::CommandExt;
    let store = TestStore::new();
    let engine = store.open();
    // Another thread spawns a process while the engine is open. The child inherits every open
    // file, the store directory's locked one included, until it execs (which closes it): hold
    // it there for a while. `spawn` returns once the child has exec'd.
    let spawner = std::thread::spawn(|| {
        let mut command = Command::new("true");
        // SAFETY: the hook only sleeps; it touches no memory shared with the parent.
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(|| {
                std::thread::sleep(Duration::from_millis(200));
                Ok(())
            });
        }
        command.spawn().unwrap().wait().unwrap()
    });
    std::thread::sleep(Duration::from_millis(100));
    drop(engine);
    // The engine is gone: reopening succeeds although the child still holds its copy.
    let reopened = store.builder().open();
    spawner.join().unwrap();
    assert!(reopened.is_ok(), "{:?}", reopened.err());
}

#[test]
fn a_path_through_a_missing_directory_and_dotdot_creates_nothing() {
    // `s/missing/..` names no directory; creating `missing` to make it name `s` would put a
    // stray directory into the store before the open is refused.
    let root = tempfile::tempdir().unwrap();
    let store = root.path().join("s");
    let engine = Engine::builder(&store).open().unwrap();
    let spelling = store.join("missing").join("..");
    let held = Engine::builder(&spelling).open();
    assert!(matches!(held, Err(Error::Storage { .. })), "{held:?}");
    drop(engine);
    let declared_otherwise = Engine::builder(&spelling).entity_table("t").open();
    assert!(
        matches!(declared_otherwise, Err(Error::Storage { .. })),
        "{declared_otherwise:?}"
    );
    assert!(!store.join("missing").exists());
    // A new store through a path without `..` is still created with its parents.
    Engine::builder(root.path().join("new").join("deeper"))
        .open()
        .unwrap();
}

/// A process killed while it creates a store leaves a RocksDB database with only some of the
/// store's tables (RocksDB creates them one by one after the database). The creation marker,
/// written first, lets the next open finish the creation; without it the store was refused as
/// foreign forever (found by the partitioned-fleet end-to-end run, a SIGKILL during a first
/// open).
#[test]
fn a_store_whose_creation_was_cut_short_is_finished_by_the_next_open() {
    for tables in [&["default"][..], &["default", "orders"][..]] {
        let store = TestStore::new();
        let path = store.dir.path();
        std::fs::write(path.join("IDEMDB-CREATING"), b"").unwrap();
        create_raw(path, tables, &[]);
        let engine = store.open();
        assert!(
            !path.join("IDEMDB-CREATING").exists(),
            "the marker is removed once the store is complete ({tables:?})"
        );
        commit_key(&engine, "k");
        drop(engine);
        let engine = store.open();
        assert!(engine.consumer("c").unwrap().get("k").unwrap().is_some());
    }
}

#[test]
fn a_new_store_keeps_no_creation_marker_and_a_foreign_database_stays_refused() {
    let store = TestStore::new();
    drop(store.open());
    assert!(!store.dir.path().join("IDEMDB-CREATING").exists());

    // The marker alone decides: the same leftover without it is a foreign database.
    let foreign = TestStore::new();
    create_raw(foreign.dir.path(), &["default"], &[]);
    assert!(matches!(
        foreign.builder().open(),
        Err(Error::IncompatibleStore { .. })
    ));
}
