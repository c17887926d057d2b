//! Stores written before claims stored their records as plain values. A claim's commit used to
//! write an install merge operand; it now writes the record itself (the latch already makes the
//! claim the key's only writer). Both read as the same record, so a store holding operands from
//! an older engine must behave exactly as before: duplicates and conflicts found, expired records
//! claimed again over their operands, leases fenced, and all of it surviving a compaction and a
//! reopen.

use crate::util::{START_MS, TABLES, TestStore};
use idemdb::{Fingerprint, Outcome, format};

const HOUR_MS: u64 = 3_600_000;

/// Writes each `(message key, record)` of consumer `c` as an install operand over nothing,
/// with plain RocksDB and the store's merge operator, and leaves the operands unflushed (in the
/// WAL), as an older engine's commits were before its next flush.
fn write_install_operands(store: &TestStore, records: &[(&str, format::Record)]) {
    let mut records_options = rocksdb::Options::default();
    records_options.set_merge_operator(
        "idemdb.record.v1",
        |_key: &[u8], existing: Option<&[u8]>, operands: &rocksdb::MergeOperands| {
            Some(format::apply_operands(existing, operands))
        },
        |_: &[u8], _: Option<&[u8]>, _: &rocksdb::MergeOperands| None,
    );
    let descriptors = TABLES.map(|name| {
        let options = if name == "idemdb.records" {
            records_options.clone()
        } else {
            rocksdb::Options::default()
        };
        rocksdb::ColumnFamilyDescriptor::new(name, options)
    });
    let db = rocksdb::DB::open_cf_descriptors(
        &rocksdb::Options::default(),
        store.dir.path(),
        descriptors,
    )
    .unwrap();
    let table = db.cf_handle("idemdb.records").unwrap();
    for (key, record) in records {
        let stored_key = format::encode_key(b"c", key.as_bytes()).unwrap();
        // An install operand as the older engine wrote it: the operand's 10-byte header
        // (docs/design.md, section 5), then the record in format 1.
        let mut operand = format::encode_commit_operand(record.epoch - 1, record);
        operand.truncate(10);
        operand.extend(record.encode_v1());
        db.merge_cf(table, stored_key, operand).unwrap();
    }
}

fn completed(epoch: u64, expires_at_ms: u64, payload: &[u8], result: &str) -> format::Record {
    format::Record::new(
        epoch,
        START_MS - HOUR_MS,
        expires_at_ms,
        Fingerprint::of(payload),
        result.to_owned().into(),
    )
}

#[test]
fn records_held_as_install_operands_by_an_older_engine_read_and_are_replaced_as_before() {
    let store = TestStore::new();
    drop(store.open());
    write_install_operands(
        &store,
        &[
            ("live", completed(1, START_MS + HOUR_MS, b"live", "kept")),
            ("expired", completed(3, START_MS - 1, b"expired", "old")),
            ("leased", completed(1, START_MS - 1, b"leased", "old")),
        ],
    );

    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    // A record held as an operand is found: a duplicate with its result, or a conflict.
    match consumer.begin("live", Fingerprint::of(b"live")).unwrap() {
        Outcome::Duplicate { epoch, result, .. } => {
            assert_eq!((epoch, &result[..]), (1, &b"kept"[..]));
        }
        other => panic!("expected the operand's record as a duplicate, got {other:?}"),
    }
    assert!(matches!(
        consumer.begin("live", Fingerprint::of(b"other")).unwrap(),
        Outcome::Conflict { .. }
    ));
    // An expired one is claimed again; the new record, a plain value written over the
    // operand, takes the next epoch.
    let Outcome::Fresh(claim) = consumer
        .begin("expired", Fingerprint::of(b"again"))
        .unwrap()
    else {
        panic!("an expired operand's key must be claimable");
    };
    assert_eq!(claim.epoch(), 4);
    assert_eq!(claim.commit(b"new").unwrap().epoch, 4);
    // A lease over an expired operand's record, then its fenced completion.
    let Outcome::Fresh(external) = consumer
        .begin_external(
            "leased",
            Fingerprint::of(b"leased"),
            std::time::Duration::from_secs(60),
            "worker",
        )
        .unwrap()
    else {
        panic!("an expired operand's key must be leasable");
    };
    assert_eq!(external.epoch(), 2);
    external.complete(b"done").unwrap();

    let check = |engine: &idemdb::Engine| {
        let consumer = engine.consumer("c").unwrap();
        for (key, payload, epoch, result) in [
            ("live", &b"live"[..], 1, &b"kept"[..]),
            ("expired", b"again", 4, b"new"),
            ("leased", b"leased", 2, b"done"),
        ] {
            match consumer.begin(key, Fingerprint::of(payload)).unwrap() {
                Outcome::Duplicate {
                    epoch: found,
                    result: found_result,
                    ..
                } => assert_eq!((found, &found_result[..]), (epoch, result), "{key}"),
                other => panic!("{key}: expected a duplicate, got {other:?}"),
            }
        }
    };
    check(&engine);
    engine.compact().unwrap();
    check(&engine);
    drop((consumer, engine));
    check(&store.open());
}

/// The clock of the fixture's writer (`tests/fixtures/make_wal_store.rs`).
const FIXTURE_NOW_MS: u64 = 1_800_000_000_000;

/// The fixture of the tests below, unpacked into a new directory (removed when the first value
/// is dropped), and the store's path in it.
fn untar_fixture() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/wal-store-976bea9.tar.gz");
    let untar = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&fixture)
        .arg("-C")
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(untar.success());
    let path = dir.path().join("store");
    (dir, path)
}

/// The fixture's declaration, as its writer made it.
fn fixture_builder(path: &std::path::Path) -> idemdb::EngineBuilder {
    idemdb::Engine::builder(path)
        .clock(idemdb::MockClock::new(FIXTURE_NOW_MS))
        .business_table(idemdb::TableOptions::new("orders"))
        .business_table(
            idemdb::TableOptions::new("totals")
                .associative_merge_operator("add_u64", idemdb::merge_ops::add_u64),
        )
        .entity_table("accounts")
}

/// A store written on RocksDB's WAL by the release before the commit log became the default
/// (`tests/fixtures/wal-store-976bea9.tar.gz`: records with results, a lease in progress and a
/// released one, read positions, business rows and a merged total, an entity, two consumers;
/// half flushed, half in the WAL) opens on the default path, moves to the commit log and
/// answers every key as before, again after a reopen on the log, and once more after a reopen
/// with the opt-out, which replays the log into RocksDB's WAL and removes it.
#[test]
fn a_store_written_on_the_wal_by_the_release_before_opens_on_the_default_log() {
    let (_dir, path) = untar_fixture();
    let log = path.join("idemdb-log");
    assert!(!log.exists());
    let builder = || fixture_builder(&path);
    for open in ["default", "default again", "without the log"] {
        let engine = if open == "without the log" {
            builder().without_commit_log().open().unwrap()
        } else {
            builder().open().unwrap()
        };
        assert_eq!(log.exists(), open != "without the log", "{open}");
        answers_as_written(&engine, open);
    }
}

/// The format marker of the store at `path` and the stored value of billing's `key`, read with
/// plain RocksDB (no idemdb code between the test and the bytes).
fn marker_and_value(path: &std::path::Path, key: &str) -> (Vec<u8>, Option<Vec<u8>>) {
    let tables = rocksdb::DB::list_cf(&rocksdb::Options::default(), path).unwrap();
    let db = rocksdb::DB::open_cf_for_read_only(&rocksdb::Options::default(), path, &tables, false)
        .unwrap();
    let marker = db.get(b"idemdb.format").unwrap().expect("a format marker");
    let stored_key = format::encode_key(b"billing", key.as_bytes()).unwrap();
    let value = db
        .get_cf(db.cf_handle("idemdb.records").unwrap(), stored_key)
        .unwrap();
    (marker, value)
}

/// The fixture's records are in record format 1, under store format 1. Read-only opens leave
/// the store as it is; the first open for writing moves the marker to store format 2 (an
/// earlier release then refuses the store instead of misreading a record), and new records are
/// written in record format 2, shorter, beside the old ones, which read as before.
#[test]
fn a_store_of_record_format_1_reads_as_before_and_is_marked_format_2_by_a_writer() {
    let (_dir, path) = untar_fixture();
    let (marker, old) = marker_and_value(&path, "order-0007");
    assert_eq!(marker, b"idemdb store format 1");
    assert_eq!(
        old.expect("a plain value")[0],
        1,
        "the fixture's record format"
    );

    let reader = idemdb::admin::Store::builder(&path)
        .clock(idemdb::MockClock::new(FIXTURE_NOW_MS))
        .open_read_only()
        .unwrap();
    assert!(!reader.tables().is_empty());
    drop(reader);
    assert_eq!(
        marker_and_value(&path, "order-0007").0,
        b"idemdb store format 1"
    );

    // RocksDB's WAL, so that plain RocksDB sees the new commit without the engine's log.
    let builder = || fixture_builder(&path).without_commit_log();
    let engine = builder().open().unwrap();
    let billing = engine.consumer("billing").unwrap();
    let Outcome::Fresh(claim) = billing
        .begin("order-new", Fingerprint::of(b"order-new"))
        .unwrap()
    else {
        panic!("a new key is fresh");
    };
    claim.commit(b"new").unwrap();
    answers_as_written(&engine, "after the upgrade");
    drop((billing, engine));

    let (marker, new) = marker_and_value(&path, "order-new");
    assert_eq!(marker, b"idemdb store format 2");
    let new = new.expect("the new record, a plain value");
    assert_eq!(new[0], 2, "the record format this release writes");
    let written = format::Record::decode(&new).unwrap();
    assert!(new.len() < written.encode_v1().len());

    let engine = builder().open().unwrap();
    answers_as_written(&engine, "reopened");
    engine.compact().unwrap();
    answers_as_written(&engine, "compacted");
    assert!(matches!(
        engine
            .consumer("billing")
            .unwrap()
            .begin("order-new", Fingerprint::of(b"order-new"))
            .unwrap(),
        Outcome::Duplicate { .. }
    ));
}

/// Every key of the fixture, as its writer left it.
fn answers_as_written(engine: &idemdb::Engine, open: &str) {
    let billing = engine.consumer("billing").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let totals = engine.business_table("totals").unwrap();
    for n in 0..200_u64 {
        let key = format!("order-{n:04}");
        match billing
            .begin(&key, Fingerprint::of(key.as_bytes()))
            .unwrap()
        {
            Outcome::Duplicate { result, .. } => {
                assert_eq!(
                    &result[..],
                    format!("result-{n}").as_bytes(),
                    "{open}: {key}"
                );
            }
            other => panic!("{open}: {key}: {other:?}"),
        }
        assert_eq!(
            orders.get(&key).unwrap().as_deref(),
            Some(format!("row-{n}").as_bytes()),
            "{open}: {key}"
        );
    }
    let sum: u64 = (0..200).sum();
    assert_eq!(
        totals.get("sum").unwrap().as_deref(),
        Some(&sum.to_be_bytes()[..]),
        "{open}"
    );
    let positions = billing.positions();
    for partition in 0..4_u32 {
        let position = positions.get("orders", partition).unwrap().expect("stored");
        assert_eq!(position.offset, 196 + u64::from(partition), "{open}");
    }
    assert!(
        matches!(
            billing
                .begin("leased-1", Fingerprint::of(b"leased-1"))
                .unwrap(),
            Outcome::InProgress { .. }
        ),
        "{open}: the lease stands"
    );
    assert!(
        matches!(
            billing
                .begin("released-1", Fingerprint::of(b"released-1"))
                .unwrap(),
            Outcome::Fresh(_)
        ),
        "{open}: the released key is free"
    );
    let accounts = engine.entity_table("accounts").unwrap();
    assert!(matches!(
        accounts
            .begin("account-7", Fingerprint::of(b"account-7"))
            .unwrap(),
        Outcome::Duplicate { .. }
    ));
    let shipping = engine.consumer("shipping").unwrap();
    assert!(matches!(
        shipping
            .begin("order-0000", Fingerprint::of(b"other"))
            .unwrap(),
        Outcome::Duplicate { .. }
    ));
    assert!(matches!(
        shipping
            .begin("order-0000", Fingerprint::of(b"order-0000"))
            .unwrap(),
        Outcome::Conflict { .. }
    ));
}
