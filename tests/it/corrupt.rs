//! Guards the handling of undecodable stored values: reads and `begin` report a typed
//! `Corrupt` error naming the key, nothing panics, and compaction keeps the evidence.

use crate::util::{TABLES, TestStore};
use idemdb::{Error, Fingerprint, format};

/// Writes raw values under the consumer `c`'s keys with plain RocksDB, bypassing idemdb.
fn write_raw(store: &TestStore, values: &[(&str, Vec<u8>)]) {
    let db = rocksdb::DB::open_cf(&rocksdb::Options::default(), store.dir.path(), TABLES).unwrap();
    let records = db.cf_handle("idemdb.records").unwrap();
    for (key, value) in values {
        let stored_key = format::encode_key(b"c", key.as_bytes()).unwrap();
        db.put_cf(records, stored_key, value).unwrap();
    }
}

#[test]
fn undecodable_records_are_typed_errors_and_survive_compaction() {
    let store = TestStore::new();
    drop(store.open());
    let mut unknown_version =
        format::Record::new(1, 0, u64::MAX, Fingerprint::of(b""), Default::default()).encode();
    unknown_version[0] = 9;
    let valid = format::Record::new(1, 0, u64::MAX, Fingerprint::of(b""), "r".into()).encode();
    write_raw(
        &store,
        &[
            ("empty", Vec::new()),
            ("version", unknown_version),
            ("truncated", valid[..valid.len() - 1].to_vec()),
        ],
    );

    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    for key in ["empty", "version", "truncated"] {
        let stored_key = format::encode_key(b"c", key.as_bytes()).unwrap();
        match consumer.get(key) {
            Err(Error::Corrupt { key: reported, .. }) => assert_eq!(reported, stored_key),
            other => panic!("{key}: expected Corrupt, got {other:?}"),
        }
        match consumer.begin(key, Fingerprint::of(b"")) {
            Err(error @ Error::Corrupt { .. }) => {
                assert!(error.to_string().contains(&format::printable(&stored_key)));
            }
            other => panic!("{key}: expected Corrupt from begin, got {other:?}"),
        }
    }
    // A failed begin does not leave the key claimed.
    assert_eq!(engine.open_claims(), 0);
    engine.compact().unwrap();
    assert_eq!(engine.record_counts().unwrap().corrupt, 3);
}
