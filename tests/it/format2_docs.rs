//! The promises of record format 2 and the store format marker, tested from the docs alone
//! (README.md, "Guarantees": "Stores of earlier releases open"; docs/design.md sections 2 and
//! 4): a new store is marked format 2; a store an earlier release left (marker `idemdb store
//! format 1`, records in record format 1) reads as before, is marked format 2 by the first open
//! that writes and by no other, and keeps its old records as they are until they are written
//! again; a marker of another format is refused by every open, which changes nothing; and
//! record format 2 is exactly the byte layout section 4 spells, anything else a `DecodeError`.
//!
//! A store of an earlier release is built the way one is left on disk: this release creates it
//! (the tables and metadata are the same), then plain RocksDB, with the engine closed, writes
//! the format-1 marker and records encoded by `Record::encode_v1` under `format::encode_key`
//! keys. Stored bytes are read back with plain RocksDB too, with no idemdb code between the
//! test and the bytes (but the merge operator, so that keys holding operands fold).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use idemdb::admin::{Store, Target};
use idemdb::format::{self, DecodeError, Record, RecordState};
use idemdb::{EXPIRES_NEVER_MS, Error, Fingerprint, Outcome, RecordCounts, Resolution};

use crate::util::{
    START_MS, TABLES, TestStore, assert_refused_without_change, incompatible, store_files,
};

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;
/// The retention `TestStore` keeps (the default): 7 days.
const RETENTION_MS: u64 = idemdb::RETENTION_MS_DEFAULT;

/// docs/design.md section 2: the metadata key and the two markers, byte for byte.
const MARKER_KEY: &[u8] = b"idemdb.format";
const FORMAT_1: &[u8] = b"idemdb store format 1";
const FORMAT_2: &[u8] = b"idemdb store format 2";

/// The consumer every test's records belong to.
const CONSUMER: &str = "c";
/// The records table (docs/design.md section 1) and `TestStore`'s entity table.
const RECORDS: &str = "idemdb.records";
const CUSTOMERS: &str = "customers";

/// The stored key of `key` in `table`: consumer `c`'s composite key in the records table, the
/// entity key as given in an entity table (docs/design.md section 3).
fn stored_key(table: &str, key: &str) -> Vec<u8> {
    if table == RECORDS {
        format::encode_key(CONSUMER.as_bytes(), key.as_bytes()).unwrap()
    } else {
        key.as_bytes().to_vec()
    }
}

fn completed(
    epoch: u64,
    committed_at_ms: u64,
    expires_at_ms: u64,
    content: &str,
    result: &str,
) -> Record {
    Record::new(
        epoch,
        committed_at_ms,
        expires_at_ms,
        Fingerprint::of(content),
        result.to_owned().into(),
    )
}

/// A recorded failure (`succeeded: false`), stored as state 4.
fn failed(
    epoch: u64,
    committed_at_ms: u64,
    expires_at_ms: u64,
    content: &str,
    result: &str,
) -> Record {
    let mut record = completed(epoch, committed_at_ms, expires_at_ms, content, result);
    if let RecordState::Completed { succeeded, .. } = &mut record.state {
        *succeeded = false;
    }
    record
}

fn released(epoch: u64, released_at_ms: u64, removable_at_ms: u64, content: &str) -> Record {
    let mut record = completed(epoch, released_at_ms, removable_at_ms, content, "");
    record.state = RecordState::Released {
        released_at_ms,
        removable_at_ms,
    };
    record
}

fn leased(
    epoch: u64,
    content: &str,
    since_ms: u64,
    lease_until_ms: u64,
    holder: &str,
    token: u64,
) -> Record {
    Record::in_progress(
        epoch,
        Fingerprint::of(content),
        since_ms,
        lease_until_ms,
        holder.to_owned().into(),
        token,
    )
}

/// Writes with plain RocksDB (the engine closed) `marker` as the store's format marker, if
/// given, and each `(table, stored key, value)` as a plain value.
fn write_raw(path: &Path, marker: Option<&[u8]>, values: &[(&str, Vec<u8>, Vec<u8>)]) {
    let db = rocksdb::DB::open_cf(&rocksdb::Options::default(), path, TABLES).unwrap();
    if let Some(marker) = marker {
        db.put(MARKER_KEY, marker).unwrap();
    }
    for (table, key, value) in values {
        db.put_cf(db.cf_handle(table).unwrap(), key, value).unwrap();
    }
}

/// The store's format marker and the values under `keys` (`(table, stored key)`), read through
/// a plain RocksDB read-only open.
fn read_raw(path: &Path, keys: &[(&str, &[u8])]) -> (Vec<u8>, Vec<Option<Vec<u8>>>) {
    let mut markers = rocksdb::Options::default();
    markers.set_merge_operator(
        "idemdb.record.v1",
        |_key: &[u8], existing: Option<&[u8]>, operands: &rocksdb::MergeOperands| {
            Some(format::apply_operands(existing, operands))
        },
        |_: &[u8], _: Option<&[u8]>, _: &rocksdb::MergeOperands| None,
    );
    let tables = rocksdb::DB::list_cf(&rocksdb::Options::default(), path).unwrap();
    let descriptors = tables.iter().map(|name| {
        let options = if name == RECORDS || name == CUSTOMERS {
            markers.clone()
        } else {
            rocksdb::Options::default()
        };
        rocksdb::ColumnFamilyDescriptor::new(name.as_str(), options)
    });
    let db = rocksdb::DB::open_cf_descriptors_read_only(
        &rocksdb::Options::default(),
        path,
        descriptors,
        false,
    )
    .unwrap();
    let marker = db.get(MARKER_KEY).unwrap().expect("a format marker");
    let values = keys
        .iter()
        .map(|(table, key)| db.get_cf(db.cf_handle(table).unwrap(), key).unwrap())
        .collect();
    (marker, values)
}

fn raw_marker(path: &Path) -> Vec<u8> {
    read_raw(path, &[]).0
}

/// The value under `key` of `table`, read with plain RocksDB.
fn raw_value(path: &Path, table: &str, key: &str) -> Option<Vec<u8>> {
    let key = stored_key(table, key);
    let (_, mut values) = read_raw(path, &[(table, key.as_slice())]);
    values.remove(0)
}

/// A store as the release before record format 2 left it: the tables and metadata this
/// release's first open creates, then, with the engine closed, the marker `idemdb store format
/// 1` and every `(table, key, record)` written in record format 1 as a plain value.
fn earlier_release_store(records: &[(&str, &str, &Record)]) -> TestStore {
    let store = TestStore::new();
    drop(store.open());
    let values: Vec<(&str, Vec<u8>, Vec<u8>)> = records
        .iter()
        .map(|(table, key, record)| {
            let value = record.encode_v1();
            assert_eq!(value[0], 1, "encode_v1 writes record format 1");
            (*table, stored_key(table, key), value)
        })
        .collect();
    write_raw(store.dir.path(), Some(FORMAT_1), &values);
    assert_eq!(raw_marker(store.dir.path()), FORMAT_1);
    store
}

fn assert_duplicate(outcome: Outcome, epoch: u64, result: &[u8], what: &str) {
    match outcome {
        Outcome::Duplicate {
            epoch: found,
            result: found_result,
            ..
        } => assert_eq!((found, &found_result[..]), (epoch, result), "{what}"),
        other => panic!("{what}: expected a duplicate, got {other:?}"),
    }
}

/// A duplicate's result, first commit, expiry, epoch and success, in that order.
fn duplicate_in_full(outcome: Outcome, what: &str) -> (Vec<u8>, u64, u64, u64, bool) {
    match outcome {
        Outcome::Duplicate {
            result,
            first_committed_at_ms,
            expires_at_ms,
            epoch,
            succeeded,
            ..
        } => (
            result.to_vec(),
            first_committed_at_ms,
            expires_at_ms,
            epoch,
            succeeded,
        ),
        other => panic!("{what}: expected a duplicate, got {other:?}"),
    }
}

fn counts(live: u64, expired: u64, in_progress: u64, released: u64) -> RecordCounts {
    let mut counts = RecordCounts::default();
    counts.live = live;
    counts.expired = expired;
    counts.in_progress = in_progress;
    counts.released = released;
    counts
}

/// docs/design.md section 2: a store this release creates holds the marker `idemdb store
/// format 2` (21 ASCII bytes) once its first open returns, before any record; section 4: a
/// claim's record is written in record format 2, and one with an empty result kept the default
/// retention (7 days) is 31 bytes.
/// RocksDB's aggregated table properties of `table`'s files in the store at `path`, as numbers
/// by name ("# data blocks", "data block size", ...).
fn table_properties(path: &Path, table: &str) -> BTreeMap<String, u64> {
    let tables = rocksdb::DB::list_cf(&rocksdb::Options::default(), path).unwrap();
    let db = rocksdb::DB::open_cf_for_read_only(&rocksdb::Options::default(), path, &tables, false)
        .unwrap();
    let properties = db
        .property_value_cf(
            db.cf_handle(table).unwrap(),
            "rocksdb.aggregated-table-properties",
        )
        .unwrap()
        .expect("table properties");
    properties
        .split(';')
        .filter_map(|pair| {
            let (name, value) = pair.split_once('=')?;
            Some((name.trim().to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The marker's table is stored uncompressed, so that an earlier release, built without the
/// ZSTD the other tables are in, can read the marker and refuse the store as
/// `IncompatibleStore` (README, "Stores of earlier releases open"), while the records' table is
/// compressed.
#[test]
fn the_marker_is_stored_uncompressed_and_the_records_compressed() {
    let store = TestStore::new();
    {
        let engine = store.open();
        let consumer = engine.consumer(CONSUMER).unwrap();
        for n in 0..2_000 {
            let key = format!("order-{n}");
            let Outcome::Fresh(claim) = consumer.begin(&key, Fingerprint::of(&key)).unwrap() else {
                panic!("{key}: a new key is fresh");
            };
            claim.commit(b"accepted").unwrap();
        }
        engine.flush().unwrap();
    }
    let meta = table_properties(store.dir.path(), "default");
    let blocks = meta["# data blocks"];
    assert!(blocks > 0, "the marker's table has a file: {meta:?}");
    assert_eq!(
        meta["# data blocks compression bypassed"], blocks,
        "the marker's table is not compressed: {meta:?}"
    );
    let records = table_properties(store.dir.path(), RECORDS);
    // Blocks are compressed unless bypassed (no codec) or rejected (too little gain).
    assert_eq!(
        records["# data blocks compression bypassed"], 0,
        "{records:?}"
    );
    assert!(
        records["# data blocks compression rejected"] < records["# data blocks"],
        "the records are compressed: {records:?}"
    );
}

#[test]
fn a_new_store_is_marked_format_2_and_a_claim_writes_a_31_byte_record() {
    let store = TestStore::new();
    drop(store.open());
    let marker = raw_marker(store.dir.path());
    assert_eq!(marker, FORMAT_2);
    assert_eq!(marker.len(), 21);

    {
        let engine = store.open();
        let consumer = engine.consumer(CONSUMER).unwrap();
        let Outcome::Fresh(claim) = consumer
            .begin("order-1", Fingerprint::of(b"order-1"))
            .unwrap()
        else {
            panic!("a new key is fresh");
        };
        let committed = claim.commit(b"").unwrap();
        assert_eq!(
            (
                committed.epoch,
                committed.committed_at_ms,
                committed.expires_at_ms
            ),
            (1, START_MS, START_MS + RETENTION_MS)
        );
        // With the commit log, a record reaches RocksDB's tables at a flush.
        engine.flush().unwrap();
    }
    let value = raw_value(store.dir.path(), RECORDS, "order-1").expect("the claim's record");
    assert_eq!(value[0], 2, "record format 2");
    assert_eq!(value[1], 1, "state 1, completed");
    assert_eq!(value.len(), 31, "{value:?}");
    assert_eq!(
        Record::decode(&value).unwrap(),
        Record::new(
            1,
            START_MS,
            START_MS + RETENTION_MS,
            Fingerprint::of(b"order-1"),
            Bytes::new(),
        )
    );
    assert_eq!(raw_marker(store.dir.path()), FORMAT_2);
}

/// README.md, "Stores of earlier releases open. Their records read as before": in a store an
/// earlier release left, a live record is a duplicate (with its result, epoch and times) or a
/// conflict, a recorded failure replays as one, a record that never expires stays, a released
/// key is claimed at epoch + 1, an entity is found; the open moves the marker to format 2 and
/// leaves the records it did not write in record format 1, byte for byte.
#[test]
fn records_of_an_earlier_release_answer_as_before() {
    let live = completed(4, START_MS - HOUR_MS, START_MS + HOUR_MS, "live", "kept");
    let failure = failed(
        2,
        START_MS - HOUR_MS,
        START_MS + HOUR_MS,
        "failed",
        "card declined",
    );
    let never = completed(1, START_MS - DAY_MS, EXPIRES_NEVER_MS, "never", "forever");
    let gone = released(6, START_MS - HOUR_MS, START_MS + DAY_MS, "released");
    let entity = completed(1, START_MS - DAY_MS, EXPIRES_NEVER_MS, "cust-1", "Ada");
    let store = earlier_release_store(&[
        (RECORDS, "live", &live),
        (RECORDS, "failed", &failure),
        (RECORDS, "never", &never),
        (RECORDS, "released", &gone),
        (CUSTOMERS, "cust-1", &entity),
    ]);

    {
        let engine = store.open();
        let consumer = engine.consumer(CONSUMER).unwrap();
        assert_eq!(
            duplicate_in_full(
                consumer.begin("live", Fingerprint::of("live")).unwrap(),
                "live"
            ),
            (
                b"kept".to_vec(),
                START_MS - HOUR_MS,
                START_MS + HOUR_MS,
                4,
                true
            )
        );
        match consumer.begin("live", Fingerprint::of("other")).unwrap() {
            Outcome::Conflict {
                stored_fingerprint,
                new_fingerprint,
                first_committed_at_ms,
                ..
            } => {
                assert_eq!(stored_fingerprint, Fingerprint::of("live"));
                assert_eq!(new_fingerprint, Fingerprint::of("other"));
                assert_eq!(first_committed_at_ms, START_MS - HOUR_MS);
            }
            other => panic!("live, other content: expected a conflict, got {other:?}"),
        }
        assert_eq!(consumer.get("live").unwrap(), Some(live.clone()));
        match consumer.begin("failed", Fingerprint::of("failed")).unwrap() {
            Outcome::Duplicate {
                result, succeeded, ..
            } => assert_eq!((&result[..], succeeded), (&b"card declined"[..], false)),
            other => panic!("failed: expected the recorded failure, got {other:?}"),
        }
        assert_duplicate(
            consumer.begin("never", Fingerprint::of("never")).unwrap(),
            1,
            b"forever",
            "never",
        );
        // A released record reads as absent; the next claim takes the next epoch.
        assert_eq!(consumer.get("released").unwrap(), None);
        let Outcome::Fresh(claim) = consumer
            .begin("released", Fingerprint::of("released"))
            .unwrap()
        else {
            panic!("a released key is free");
        };
        assert_eq!(claim.epoch(), 7);
        claim.abort();
        let customers = engine.entity_table(CUSTOMERS).unwrap();
        assert_duplicate(
            customers
                .begin("cust-1", Fingerprint::of("cust-1"))
                .unwrap(),
            1,
            b"Ada",
            "entity",
        );
        assert_eq!(customers.get("cust-1").unwrap(), Some(entity.clone()));
        assert_eq!(engine.record_counts().unwrap(), counts(3, 0, 0, 1));

        // Ten years on: the record that never expires is still there, the others are gone.
        store.clock.advance(Duration::from_millis(3650 * DAY_MS));
        assert_duplicate(
            consumer.begin("never", Fingerprint::of("never")).unwrap(),
            1,
            b"forever",
            "never, ten years on",
        );
        let Outcome::Fresh(claim) = consumer.begin("live", Fingerprint::of("live")).unwrap() else {
            panic!("an expired key is free");
        };
        assert_eq!(claim.epoch(), 5);
        claim.abort();
    }

    assert_eq!(raw_marker(store.dir.path()), FORMAT_2);
    // Nothing above wrote a record: each is still in record format 1, byte for byte.
    for (table, key, record) in [
        (RECORDS, "live", &live),
        (RECORDS, "failed", &failure),
        (RECORDS, "never", &never),
        (RECORDS, "released", &gone),
        (CUSTOMERS, "cust-1", &entity),
    ] {
        assert_eq!(
            raw_value(store.dir.path(), table, key),
            Some(record.encode_v1()),
            "{table} {key}"
        );
    }
}

/// README.md, "Fencing for external claims", on a lease an earlier release wrote: the key is
/// `InProgress` (holder, since, lease, epoch as stored) until the millisecond its lease runs
/// out, then taken over at epoch + 1, by an external claim or a transactional one, told of the
/// earlier attempt; the new records survive a compaction and a reopen.
#[test]
fn a_lease_of_an_earlier_release_holds_until_it_runs_out_then_is_taken_over_at_the_next_epoch() {
    let lease_until_ms = START_MS + 60_000;
    let external = leased(
        5,
        "job",
        START_MS - 1_000,
        lease_until_ms,
        "old-worker",
        0xfeed,
    );
    let transactional = leased(
        2,
        "tx",
        START_MS - 2_000,
        lease_until_ms,
        "old-worker",
        0xbeef,
    );
    let store =
        earlier_release_store(&[(RECORDS, "job", &external), (RECORDS, "tx", &transactional)]);
    let engine = store.open();
    let consumer = engine.consumer(CONSUMER).unwrap();

    assert_eq!(consumer.get("job").unwrap(), Some(external.clone()));
    match consumer.begin("job", Fingerprint::of("job")).unwrap() {
        Outcome::InProgress {
            since_ms,
            holder,
            lease_until_ms: until,
            epoch,
            ..
        } => {
            assert_eq!(since_ms, START_MS - 1_000);
            assert_eq!(holder.as_deref(), Some(&b"old-worker"[..]));
            assert_eq!(until, Some(lease_until_ms));
            assert_eq!(epoch, Some(5));
        }
        other => panic!("expected the stored lease, got {other:?}"),
    }
    let listed = consumer.in_progress(Duration::ZERO, 10).unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(&listed[0].message_key[..], b"job");
    assert_eq!(
        (
            listed[0].epoch,
            &listed[0].holder[..],
            listed[0].since_ms,
            listed[0].lease_until_ms
        ),
        (5, &b"old-worker"[..], START_MS - 1_000, lease_until_ms)
    );

    // One millisecond before the lease runs out, it still holds against both kinds of claim.
    store.clock.set(lease_until_ms - 1);
    assert!(matches!(
        consumer
            .begin_external(
                "job",
                Fingerprint::of("job"),
                Duration::from_secs(30),
                "new"
            )
            .unwrap(),
        Outcome::InProgress { .. }
    ));
    assert!(matches!(
        consumer.begin("tx", Fingerprint::of("tx")).unwrap(),
        Outcome::InProgress { .. }
    ));

    store.clock.set(lease_until_ms);
    let Outcome::Fresh(taken) = consumer
        .begin_external(
            "job",
            Fingerprint::of("job"),
            Duration::from_secs(30),
            "new",
        )
        .unwrap()
    else {
        panic!("a lease that ran out is taken over");
    };
    assert_eq!(taken.epoch(), 6);
    let previous = taken.previous_attempt().expect("the earlier attempt");
    assert_eq!(
        (
            previous.epoch,
            &previous.holder[..],
            previous.since_ms,
            previous.lease_until_ms
        ),
        (5, &b"old-worker"[..], START_MS - 1_000, lease_until_ms)
    );
    assert_eq!(taken.complete(b"done").unwrap(), 6);

    let Outcome::Fresh(claim) = consumer.begin("tx", Fingerprint::of("tx")).unwrap() else {
        panic!("a lease that ran out is taken over by a claim too");
    };
    assert_eq!(claim.epoch(), 3);
    assert_eq!(
        claim.previous_attempt().map(|previous| previous.epoch),
        Some(2)
    );
    assert_eq!(claim.commit(b"tx-done").unwrap().epoch, 3);

    let check = |engine: &idemdb::Engine, when: &str| {
        let consumer = engine.consumer(CONSUMER).unwrap();
        assert_duplicate(
            consumer.begin("job", Fingerprint::of("job")).unwrap(),
            6,
            b"done",
            &format!("job, {when}"),
        );
        assert_duplicate(
            consumer.begin("tx", Fingerprint::of("tx")).unwrap(),
            3,
            b"tx-done",
            &format!("tx, {when}"),
        );
    };
    check(&engine, "taken over");
    engine.compact().unwrap();
    check(&engine, "compacted");
    drop((consumer, engine));
    check(&store.open(), "reopened");
}

/// `Consumer::resolve` ("completes it with a result or releases it, whoever holds it") on
/// in-progress records an earlier release wrote: completed in place at the holder's epoch with
/// the retention from now, or released so the next claim takes epoch + 1; a format-1 record
/// that is not in progress is `NotInProgress`, and nothing is written.
#[test]
fn an_operator_resolves_a_lease_of_an_earlier_release() {
    let stuck = leased(3, "a", START_MS - HOUR_MS, START_MS + HOUR_MS, "w", 0x1234);
    let to_release = leased(8, "b", START_MS - HOUR_MS, START_MS + HOUR_MS, "w", 0x5678);
    let done = completed(2, START_MS - HOUR_MS, START_MS + HOUR_MS, "d", "done");
    let store = earlier_release_store(&[
        (RECORDS, "stuck", &stuck),
        (RECORDS, "to-release", &to_release),
        (RECORDS, "done", &done),
    ]);
    let engine = store.open();
    let consumer = engine.consumer(CONSUMER).unwrap();

    consumer
        .resolve("stuck", Resolution::Complete("by hand".into()))
        .unwrap();
    assert_eq!(
        duplicate_in_full(
            consumer.begin("stuck", Fingerprint::of("a")).unwrap(),
            "the resolved record"
        ),
        (
            b"by hand".to_vec(),
            START_MS,
            START_MS + RETENTION_MS,
            3,
            true
        )
    );

    consumer.resolve("to-release", Resolution::Release).unwrap();
    assert_eq!(consumer.get("to-release").unwrap(), None);
    let Outcome::Fresh(claim) = consumer.begin("to-release", Fingerprint::of("b")).unwrap() else {
        panic!("a released key is free");
    };
    assert_eq!(claim.epoch(), 9);
    claim.abort();

    match consumer.resolve("done", Resolution::Release) {
        Err(Error::NotInProgress { current_epoch, .. }) => assert_eq!(current_epoch, 2),
        other => panic!("expected NotInProgress, got {other:?}"),
    }
    drop((consumer, engine));
    assert_eq!(
        raw_value(store.dir.path(), RECORDS, "done"),
        Some(done.encode_v1()),
        "a refused resolution writes nothing"
    );
}

/// docs/design.md section 2: the marker is rewritten "by the first open for writing of a
/// format-1 store", and only by one: a read-only operator open (which reads the old records)
/// and a refused application open leave the store as it was, file for file; the operator
/// tools' exclusive open, which writes, moves the marker to format 2 and leaves the records it
/// did not write in record format 1.
#[test]
fn only_an_open_that_writes_moves_the_marker_of_an_earlier_release() {
    let live = completed(1, START_MS - HOUR_MS, START_MS + HOUR_MS, "live", "kept");
    let lease = leased(4, "lease", START_MS, START_MS + HOUR_MS, "w", 9);
    let store = earlier_release_store(&[(RECORDS, "live", &live), (RECORDS, "lease", &lease)]);
    let path = store.dir.path();
    let before = store_files(path);

    let reader = Store::builder(path)
        .clock(store.clock.clone())
        .open_read_only()
        .unwrap();
    let entry = reader
        .get(&Target::Consumer(CONSUMER.as_bytes().to_vec()), b"live")
        .unwrap()
        .expect("the format-1 record");
    assert_eq!(entry.record, Ok(live.clone()));
    assert_eq!(reader.verify().unwrap().problems_total, 0);
    drop(reader);
    assert_eq!(raw_marker(path), FORMAT_1, "after a read-only open");

    // `orders` and `counters` left undeclared: refused before RocksDB opens for writing.
    let refused = idemdb::Engine::builder(path)
        .clock(store.clock.clone())
        .entity_table(CUSTOMERS)
        .open();
    assert!(
        matches!(refused, Err(Error::IncompatibleStore { .. })),
        "{refused:?}"
    );
    assert_eq!(raw_marker(path), FORMAT_1, "after a refused open");
    assert_eq!(
        store_files(path),
        before,
        "opens that do not write change no file"
    );

    let tool = Store::builder(path)
        .clock(store.clock.clone())
        .open_exclusive()
        .unwrap();
    assert!(tool.is_exclusive());
    let entry = tool
        .get(&Target::Consumer(CONSUMER.as_bytes().to_vec()), b"lease")
        .unwrap()
        .expect("the format-1 lease");
    assert_eq!(entry.record, Ok(lease.clone()));
    drop(tool);
    assert_eq!(raw_marker(path), FORMAT_2, "after the exclusive open");
    assert_eq!(raw_value(path, RECORDS, "live"), Some(live.encode_v1()));
    assert_eq!(raw_value(path, RECORDS, "lease"), Some(lease.encode_v1()));

    // The application then finds the store as it was, and the marker stays.
    let engine = store.open();
    let consumer = engine.consumer(CONSUMER).unwrap();
    assert_duplicate(
        consumer.begin("live", Fingerprint::of("live")).unwrap(),
        1,
        b"kept",
        "live",
    );
    assert!(matches!(
        consumer.begin("lease", Fingerprint::of("lease")).unwrap(),
        Outcome::InProgress { epoch: Some(4), .. }
    ));
    drop((consumer, engine));
    assert_eq!(raw_marker(path), FORMAT_2);
}

/// docs/design.md section 2: "a store ... with another marker is refused as
/// `IncompatibleStore`", so a store a later release marked (format 3), or one whose marker
/// only starts like this release's, is refused by the application's open and by both operator
/// opens, none of which changes a file; with its marker put back the store has every commit.
#[test]
fn a_store_of_another_format_is_refused_by_every_open_and_left_as_it_was() {
    let store = TestStore::new();
    {
        let engine = store.open();
        let consumer = engine.consumer(CONSUMER).unwrap();
        let Outcome::Fresh(claim) = consumer.begin("kept", Fingerprint::of("kept")).unwrap() else {
            panic!("a new key is fresh");
        };
        claim.commit(b"r").unwrap();
        engine.flush().unwrap();
    }
    let path = store.dir.path();
    for marker in [&b"idemdb store format 3"[..], b"idemdb store format 20"] {
        let what = String::from_utf8_lossy(marker).into_owned();
        write_raw(path, Some(marker), &[]);
        assert_refused_without_change(path, &format!("{what}, engine"), incompatible, || {
            store.builder().open()
        });
        assert_refused_without_change(path, &format!("{what}, exclusive"), incompatible, || {
            Store::builder(path)
                .clock(store.clock.clone())
                .open_exclusive()
        });
        assert_refused_without_change(path, &format!("{what}, read-only"), incompatible, || {
            Store::builder(path)
                .clock(store.clock.clone())
                .open_read_only()
        });
        assert_eq!(raw_marker(path), marker, "{what}");
    }

    write_raw(path, Some(FORMAT_2), &[]);
    let engine = store.open();
    assert_duplicate(
        engine
            .consumer(CONSUMER)
            .unwrap()
            .begin("kept", Fingerprint::of("kept"))
            .unwrap(),
        1,
        b"r",
        "kept",
    );
}

/// docs/design.md section 4, "a store's records change format only when they are written
/// again", and section 6, each record that replaces another has that record's epoch + 1: a
/// format-1 record reads as absent from the millisecond its expiry is reached (README.md,
/// "Exact expiry at read"); the claim then writes its record in format 2 at the next epoch,
/// and so does a lease taken over a plain format-1 record.
#[test]
fn a_format_1_record_that_expires_is_replaced_by_a_format_2_one_at_the_next_epoch() {
    let expiring = completed(7, START_MS - HOUR_MS, START_MS + 1_000, "k1", "first");
    let expired = completed(3, START_MS - DAY_MS, START_MS - HOUR_MS, "k2", "old");
    let store = earlier_release_store(&[(RECORDS, "k1", &expiring), (RECORDS, "k2", &expired)]);
    let replaced_at_ms = START_MS + 1_000;
    {
        let engine = store.open();
        let consumer = engine.consumer(CONSUMER).unwrap();
        assert_duplicate(
            consumer.begin("k1", Fingerprint::of("k1")).unwrap(),
            7,
            b"first",
            "k1 before its expiry",
        );
        store.clock.set(replaced_at_ms - 1);
        assert_duplicate(
            consumer.begin("k1", Fingerprint::of("k1")).unwrap(),
            7,
            b"first",
            "k1 a millisecond before its expiry",
        );
        store.clock.set(replaced_at_ms);
        assert_eq!(consumer.get("k1").unwrap(), None);
        let Outcome::Fresh(claim) = consumer.begin("k1", Fingerprint::of("k1")).unwrap() else {
            panic!("a record is absent from its expiry on");
        };
        assert_eq!(claim.epoch(), 8);
        let committed = claim.commit(b"second").unwrap();
        assert_eq!(
            (
                committed.epoch,
                committed.committed_at_ms,
                committed.expires_at_ms
            ),
            (8, replaced_at_ms, replaced_at_ms + RETENTION_MS)
        );

        let Outcome::Fresh(external) = consumer
            .begin_external("k2", Fingerprint::of("k2"), Duration::from_secs(60), "w")
            .unwrap()
        else {
            panic!("an expired format-1 record's key can be leased");
        };
        assert_eq!(external.epoch(), 4);
        assert!(external.previous_attempt().is_none());
        assert_eq!(external.complete(b"ext").unwrap(), 4);
        engine.flush().unwrap();
    }

    let k1 = raw_value(store.dir.path(), RECORDS, "k1").expect("k1's record");
    assert_eq!(k1[0], 2, "the new record is in record format 2");
    assert_eq!(
        Record::decode(&k1).unwrap(),
        completed(
            8,
            replaced_at_ms,
            replaced_at_ms + RETENTION_MS,
            "k1",
            "second"
        )
    );
    assert!(k1.len() < Record::decode(&k1).unwrap().encode_v1().len());
    let k2 = raw_value(store.dir.path(), RECORDS, "k2").expect("k2's record");
    assert_eq!(k2[0], 2, "the completed lease is in record format 2");
    assert_eq!(
        Record::decode(&k2).unwrap(),
        completed(
            4,
            replaced_at_ms,
            replaced_at_ms + RETENTION_MS,
            "k2",
            "ext"
        )
    );

    let engine = store.open();
    let consumer = engine.consumer(CONSUMER).unwrap();
    match consumer.begin("k1", Fingerprint::of("k1")).unwrap() {
        Outcome::Duplicate {
            epoch,
            result,
            first_committed_at_ms,
            ..
        } => assert_eq!(
            (epoch, &result[..], first_committed_at_ms),
            (8, &b"second"[..], replaced_at_ms)
        ),
        other => panic!("k1 reopened: expected a duplicate, got {other:?}"),
    }
    assert_duplicate(
        consumer.begin("k2", Fingerprint::of("k2")).unwrap(),
        4,
        b"ext",
        "k2 reopened",
    );
}

/// `Engine::compact` ("no record expired by now is stored any more. In-progress records are
/// kept, whatever their lease; released records are kept until ... their removal time") on a
/// store holding records of both formats: it removes the expired ones of either format and
/// released ones past their removal time, keeps the rest, and leaves a kept format-1 record
/// byte for byte (compaction does not write it again). After a key is removed, its epochs
/// start at 1 again (docs/design.md section 4).
#[test]
fn compaction_removes_expired_records_of_either_format_and_keeps_the_rest_as_they_are() {
    let v1_live = completed(
        2,
        START_MS - HOUR_MS,
        START_MS + 30 * DAY_MS,
        "v1-live",
        "a",
    );
    let v1_never = completed(1, START_MS - HOUR_MS, EXPIRES_NEVER_MS, "v1-never", "b");
    let v1_expired = completed(
        5,
        START_MS - 2 * HOUR_MS,
        START_MS - HOUR_MS,
        "v1-expired",
        "c",
    );
    let v1_lease_out = leased(
        3,
        "v1-lease-out",
        START_MS - 2 * HOUR_MS,
        START_MS - HOUR_MS,
        "gone",
        7,
    );
    let v1_released_old = released(4, START_MS - 2 * HOUR_MS, START_MS - HOUR_MS, "v1-rel-old");
    let v1_released_kept = released(6, START_MS - HOUR_MS, START_MS + 30 * DAY_MS, "v1-rel-kept");
    let store = earlier_release_store(&[
        (RECORDS, "v1-live", &v1_live),
        (RECORDS, "v1-never", &v1_never),
        (RECORDS, "v1-expired", &v1_expired),
        (RECORDS, "v1-lease-out", &v1_lease_out),
        (RECORDS, "v1-released-old", &v1_released_old),
        (RECORDS, "v1-released-kept", &v1_released_kept),
    ]);
    let commit = |consumer: &idemdb::Consumer, key: &str| {
        let Outcome::Fresh(claim) = consumer.begin(key, Fingerprint::of(key)).unwrap() else {
            panic!("{key} is new");
        };
        claim.commit(b"v2").unwrap();
    };
    let fresh_epoch = |consumer: &idemdb::Consumer, key: &str| -> u64 {
        let Outcome::Fresh(claim) = consumer.begin(key, Fingerprint::of(key)).unwrap() else {
            panic!("{key} should be free");
        };
        let epoch = claim.epoch();
        claim.abort();
        epoch
    };
    {
        let engine = store.open();
        let consumer = engine.consumer(CONSUMER).unwrap();
        // Format-2 records that expire 7 days on, and one committed 8 days on.
        commit(&consumer, "v2-old-1");
        commit(&consumer, "v2-old-2");
        store.clock.advance(Duration::from_millis(8 * DAY_MS));
        commit(&consumer, "v2-live");

        assert_eq!(engine.record_counts().unwrap(), counts(3, 3, 1, 2));
        // Stored but absent: claims replace them at the next epoch (nothing is committed).
        assert_eq!(fresh_epoch(&consumer, "v1-expired"), 6);
        assert_eq!(fresh_epoch(&consumer, "v1-released-old"), 5);
        assert_eq!(fresh_epoch(&consumer, "v2-old-1"), 2);

        engine.compact().unwrap();
        assert_eq!(engine.record_counts().unwrap(), counts(3, 0, 1, 1));
        // Removed: the next claim starts at epoch 1 again.
        assert_eq!(fresh_epoch(&consumer, "v1-expired"), 1);
        assert_eq!(fresh_epoch(&consumer, "v1-released-old"), 1);
        assert_eq!(fresh_epoch(&consumer, "v2-old-1"), 1);
        // Kept: the released record still makes the next epoch one more than its own.
        assert_eq!(fresh_epoch(&consumer, "v1-released-kept"), 7);
        assert_duplicate(
            consumer
                .begin("v1-live", Fingerprint::of("v1-live"))
                .unwrap(),
            2,
            b"a",
            "v1-live",
        );
        assert_duplicate(
            consumer
                .begin("v1-never", Fingerprint::of("v1-never"))
                .unwrap(),
            1,
            b"b",
            "v1-never",
        );
        assert_duplicate(
            consumer
                .begin("v2-live", Fingerprint::of("v2-live"))
                .unwrap(),
            1,
            b"v2",
            "v2-live",
        );
    }

    let path = store.dir.path();
    for (key, record) in [
        ("v1-live", &v1_live),
        ("v1-never", &v1_never),
        ("v1-lease-out", &v1_lease_out),
        ("v1-released-kept", &v1_released_kept),
    ] {
        assert_eq!(
            raw_value(path, RECORDS, key),
            Some(record.encode_v1()),
            "{key} is kept as it was written"
        );
    }
    for key in ["v1-expired", "v1-released-old", "v2-old-1", "v2-old-2"] {
        assert_eq!(raw_value(path, RECORDS, key), None, "{key} is removed");
    }
    assert_eq!(raw_value(path, RECORDS, "v2-live").expect("kept")[0], 2);
}

/// LEB128 as docs/design.md section 4 spells it: seven bits a byte, lowest first, the high bit
/// on every byte but the last.
fn leb128(mut value: u64) -> Vec<u8> {
    let mut out = Vec::new();
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
    out
}

/// zigzag as section 4 spells it: 2d for d >= 0, -2d - 1 below.
fn zigzag(difference: i128) -> u64 {
    let encoded = if difference >= 0 {
        2 * difference
    } else {
        -2 * difference - 1
    };
    u64::try_from(encoded).unwrap()
}

/// A format-2 value assembled field by field from section 4's table.
fn spelled(
    state: u8,
    epoch: u64,
    at_ms: u64,
    until_delta: i128,
    fingerprint: u128,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = vec![2, state];
    out.extend(leb128(epoch));
    out.extend(leb128(at_ms));
    out.extend(leb128(zigzag(until_delta)));
    out.extend(fingerprint.to_be_bytes());
    out.extend(leb128(payload.len() as u64));
    out.extend_from_slice(payload);
    out
}

const FINGERPRINT: u128 = 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10;

/// docs/design.md section 4, format 2, byte for byte: values assembled from the table (every
/// state, multi-byte varints, a second time before the first, "never" as u64::MAX) decode to
/// the records they describe, and `Record::encode` writes exactly those bytes; the extremes of
/// every integer round-trip through the public API.
#[test]
fn record_format_2_is_the_layout_the_design_spells() {
    let fingerprint = Fingerprint::from_u128(FINGERPRINT);
    let mut token_and_holder = 0xfeed_u64.to_be_bytes().to_vec();
    token_and_holder.extend_from_slice(b"w1");
    let mut failure = Record::new(2, 0, 5, fingerprint, "no".into());
    if let RecordState::Completed { succeeded, .. } = &mut failure.state {
        *succeeded = false;
    }
    let mut gone = Record::new(4, 50, 40, fingerprint, Bytes::new());
    gone.state = RecordState::Released {
        released_at_ms: 50,
        removable_at_ms: 40,
    };
    let cases: Vec<(&str, Vec<u8>, Record)> = vec![
        (
            "completed, expiring before its commit",
            spelled(1, 300, 1_000, -100, FINGERPRINT, b"ok"),
            Record::new(300, 1_000, 900, fingerprint, "ok".into()),
        ),
        (
            "completed, never expiring",
            spelled(1, 1, 1_000, -1_001, FINGERPRINT, b""),
            Record::new(1, 1_000, EXPIRES_NEVER_MS, fingerprint, Bytes::new()),
        ),
        ("failed", spelled(4, 2, 0, 5, FINGERPRINT, b"no"), failure),
        (
            "in progress, a lease of 64 ms",
            spelled(2, 9, 100, 64, FINGERPRINT, &token_and_holder),
            Record::in_progress(9, fingerprint, 100, 164, "w1".into(), 0xfeed),
        ),
        (
            "released, removable before its release",
            spelled(3, 4, 50, -10, FINGERPRINT, b""),
            gone,
        ),
    ];
    for (what, bytes, record) in &cases {
        assert_eq!(Record::decode(bytes).as_ref(), Ok(record), "{what}");
        assert_eq!(&record.encode(), bytes, "{what}");
        assert_eq!(
            Record::decode(&record.encode_v1()).as_ref(),
            Ok(record),
            "{what}, format 1"
        );
    }
    // The varints of the first case, spelled out: epoch 300, at 1000, zigzag(-100) = 199.
    assert_eq!(
        cases[0].1[..8],
        [2u8, 1, 0xAC, 0x02, 0xE8, 0x07, 0xC7, 0x01]
    );
    // "never" from an instant of 0 is a difference of -1: one byte.
    let never = Record::new(1, 0, EXPIRES_NEVER_MS, fingerprint, Bytes::new());
    assert_eq!(never.encode().len(), 1 + 1 + 1 + 1 + 1 + 16 + 1);

    // Every integer at its extremes.
    for (epoch, at_ms, until_ms) in [
        (u64::MAX, u64::MAX, 0),
        (u64::MAX, 0, u64::MAX),
        (1, u64::MAX, u64::MAX),
        (1 << 63, 1 << 63, (1 << 63) - 1),
        (1, 0, 0),
    ] {
        let record = Record::new(epoch, at_ms, until_ms, fingerprint, "r".into());
        let encoded = record.encode();
        assert_eq!(encoded[0], 2);
        assert_eq!(
            Record::decode(&encoded),
            Ok(record.clone()),
            "{epoch} {at_ms} {until_ms}"
        );
        assert_eq!(Record::decode(&record.encode_v1()), Ok(record));
    }
    assert_eq!(
        Record::new(u64::MAX, 0, 0, fingerprint, Bytes::new()).encode()[2..12],
        [0xFFu8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01],
        "u64::MAX takes ten bytes, the tenth carrying its highest bit"
    );
}

/// docs/design.md section 4: "A value is exactly its header and `payload_len` bytes. Anything
/// else ... decodes to a typed `DecodeError` ... never a panic": cut short anywhere, extended by
/// a byte, a varint longer than it needs or above u64::MAX, epoch 0, an oversized length, an
/// in-progress payload shorter than its token, a released record with a payload, an unknown
/// version or state. Stored, such values are `Error::Corrupt` naming the key, and compaction
/// keeps them.
#[test]
fn a_format_2_value_that_is_not_exactly_a_record_is_a_decode_error() {
    let fingerprint = Fingerprint::from_u128(FINGERPRINT);
    let mut gone = Record::new(4, START_MS, START_MS + DAY_MS, fingerprint, Bytes::new());
    gone.state = RecordState::Released {
        released_at_ms: START_MS,
        removable_at_ms: START_MS + DAY_MS,
    };
    let records = [
        Record::new(
            1,
            START_MS,
            START_MS + RETENTION_MS,
            fingerprint,
            "result".into(),
        ),
        Record::new(
            u64::MAX,
            u64::MAX,
            EXPIRES_NEVER_MS,
            fingerprint,
            Bytes::new(),
        ),
        Record::in_progress(3, fingerprint, START_MS, START_MS + 60_000, "w".into(), 42),
        gone,
    ];
    for record in &records {
        for encoded in [record.encode(), record.encode_v1()] {
            for len in 0..encoded.len() {
                assert!(
                    Record::decode(&encoded[..len]).is_err(),
                    "{record:?} cut to {len} bytes"
                );
            }
            for extra in [0x00, 0x01, 0x80, 0xFF] {
                let mut longer = encoded.clone();
                longer.push(extra);
                assert!(
                    matches!(
                        Record::decode(&longer),
                        Err(DecodeError::TrailingBytes { extra: 1 })
                    ),
                    "{record:?} and {extra:#x}"
                );
            }
        }
    }

    let invalid = |what: &str, bytes: &[u8]| {
        assert!(
            matches!(Record::decode(bytes), Err(DecodeError::Invalid { .. })),
            "{what}: {:?}",
            Record::decode(bytes)
        );
    };
    let fp = FINGERPRINT.to_be_bytes();
    let tail = |payload_len: &[u8], payload: &[u8]| {
        let mut tail = fp.to_vec();
        tail.extend_from_slice(payload_len);
        tail.extend_from_slice(payload);
        tail
    };
    // Epoch 1 as [0x81, 0x00]: two bytes where one does.
    let mut overlong = vec![2u8, 1, 0x81, 0x00, 0x00, 0x00];
    overlong.extend(tail(&[0], b""));
    invalid("an overlong epoch", &overlong);
    // An instant of 0 as [0x80, 0x80, 0x00].
    let mut overlong_at = vec![2u8, 1, 0x01, 0x80, 0x80, 0x00, 0x00];
    overlong_at.extend(tail(&[0], b""));
    invalid("an overlong instant", &overlong_at);
    // A tenth byte carrying more than bit 63.
    let mut above = vec![2u8, 1];
    above.extend([0xFF; 9]);
    above.push(0x02);
    above.extend([0x00, 0x00]);
    above.extend(tail(&[0], b""));
    invalid("an epoch above u64::MAX", &above);
    let mut zero = vec![2u8, 1, 0x00, 0x00, 0x00];
    zero.extend(tail(&[0], b""));
    invalid("epoch 0", &zero);
    let mut oversized = vec![2u8, 1, 0x01, 0x00, 0x00];
    oversized.extend(tail(&leb128((64 << 20) + 1), b""));
    invalid("a payload length above 64 MiB", &oversized);
    let mut short_token = vec![2u8, 2, 0x01, 0x00, 0x00];
    short_token.extend(tail(&[7], &[0; 7]));
    invalid(
        "an in-progress payload shorter than its token",
        &short_token,
    );
    let mut released_payload = vec![2u8, 3, 0x01, 0x00, 0x00];
    released_payload.extend(tail(&[1], b"x"));
    invalid("a released record with a payload", &released_payload);
    let mut unknown_state = vec![2u8, 5, 0x01, 0x00, 0x00];
    unknown_state.extend(tail(&[0], b""));
    assert!(matches!(
        Record::decode(&unknown_state),
        Err(DecodeError::UnknownTag { tag: 5, .. })
    ));
    let mut unknown_version = records[0].encode();
    unknown_version[0] = 3;
    assert!(matches!(
        Record::decode(&unknown_version),
        Err(DecodeError::UnknownVersion { version: 3 })
    ));

    // Stored under keys of a store of this release: typed errors naming the key, kept as
    // evidence by compaction.
    let store = TestStore::new();
    drop(store.open());
    let mut trailing_v2 = records[0].encode();
    trailing_v2.push(0);
    let mut trailing_v1 = records[0].encode_v1();
    trailing_v1.push(0);
    let stored = [
        ("trailing-v2", trailing_v2),
        ("trailing-v1", trailing_v1),
        ("overlong", overlong),
    ];
    let values: Vec<(&str, Vec<u8>, Vec<u8>)> = stored
        .iter()
        .map(|(key, value)| (RECORDS, stored_key(RECORDS, key), value.clone()))
        .collect();
    write_raw(store.dir.path(), None, &values);
    let engine = store.open();
    let consumer = engine.consumer(CONSUMER).unwrap();
    for (key, _) in &stored {
        let expected_key = stored_key(RECORDS, key);
        match consumer.begin(key, fingerprint) {
            Err(Error::Corrupt { key: reported, .. }) => assert_eq!(reported, expected_key),
            other => panic!("{key}: expected Corrupt from begin, got {other:?}"),
        }
        match consumer.get(key) {
            Err(Error::Corrupt { key: reported, .. }) => assert_eq!(reported, expected_key),
            other => panic!("{key}: expected Corrupt from get, got {other:?}"),
        }
    }
    assert_eq!(engine.open_claims(), 0);
    engine.compact().unwrap();
    assert_eq!(engine.record_counts().unwrap().corrupt, 3);
}
