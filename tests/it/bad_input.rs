//! Guards bad input through the public API: separator-like bytes, extreme clocks and
//! production times, a clock going backwards, oversized batches, paths that are not stores,
//! and read-only directories. Every case is a typed error or documented behaviour, never a
//! panic, and nothing already stored is lost. (Length limits: `limits.rs`; corrupt values on
//! disk: `corrupt.rs`; a store held by another process: `open.rs`.)

use std::time::Duration;

use crate::util::TestStore;
use idemdb::{
    BATCH_MESSAGES_MAX, CLOCK_MS_MAX, Engine, Error, Fingerprint, Limit, Message, Outcome,
};

fn commit(consumer: &idemdb::Consumer, key: &[u8]) {
    let Outcome::Fresh(claim) = consumer.begin(key, Fingerprint::of(key)).unwrap() else {
        panic!("fresh expected for {key:?}");
    };
    claim.commit(b"r").unwrap();
}

#[test]
fn separator_like_bytes_never_collide() {
    let store = TestStore::new();
    let engine = store.open();
    // Each pair would collide under a separator-based encoding ("a" + "\0" + "b\0c" ...).
    let pairs: [(&str, &[u8]); 4] = [
        ("a\0b", b"c"),
        ("a", b"\0b\0c"),
        ("a\0", b"b\0c"),
        ("\x01a", b"\0bc"),
    ];
    for (consumer, key) in pairs {
        let consumer = engine.consumer(consumer).unwrap();
        commit(&consumer, key);
    }
    for (consumer, key) in pairs {
        let record = engine.consumer(consumer).unwrap().get(key).unwrap();
        assert!(record.is_some(), "{consumer:?}/{key:?}");
    }
    assert_eq!(engine.record_counts().unwrap().live, 4);
}

#[test]
fn clock_at_zero_and_at_the_maximum() {
    let store = TestStore::new();
    store.clock.set(0);
    let engine = store
        .builder()
        .retention(Duration::from_secs(60))
        .open()
        .unwrap();
    let consumer = engine.consumer("c").unwrap();
    commit(&consumer, b"at-zero");
    assert_eq!(consumer.get(b"at-zero").unwrap().unwrap().epoch, 1);

    // Past CLOCK_MS_MAX a write would overflow its expiry: refused, and nothing is lost.
    store.clock.set(u64::MAX);
    let Outcome::Fresh(claim) = consumer.begin(b"late", Fingerprint::of(b"")).unwrap() else {
        panic!("fresh expected");
    };
    assert!(matches!(
        claim.commit(b""),
        Err(Error::ClockOutOfRange { now_ms: u64::MAX })
    ));
    assert!(matches!(
        consumer.begin_external(b"late", Fingerprint::of(b""), Duration::from_secs(1), "w"),
        Err(Error::ClockOutOfRange { .. })
    ));
    store.clock.set(CLOCK_MS_MAX);
    commit(&consumer, b"at-max");
    store.clock.set(0);
    assert!(consumer.get(b"at-zero").unwrap().is_some());
    assert!(consumer.get(b"at-max").unwrap().is_some());
}

#[test]
fn production_times_at_both_ends() {
    let store = TestStore::new();
    let engine = store.builder().admission_floor(true).open().unwrap();
    let consumer = engine.consumer("c").unwrap();
    let fp = Fingerprint::of(b"");
    assert!(matches!(
        consumer
            .begin_message(&Message::new("old", fp).produced_at_ms(0))
            .unwrap(),
        Outcome::TooLate { .. }
    ));
    // A production time in the future is not too late.
    assert!(matches!(
        consumer
            .begin_message(&Message::new("future", fp).produced_at_ms(u64::MAX))
            .unwrap(),
        Outcome::Fresh(_)
    ));
}

#[test]
fn a_clock_going_backwards_reads_unremoved_records_as_live_again() {
    let store = TestStore::new();
    let engine = store
        .builder()
        .retention(Duration::from_secs(60))
        .open()
        .unwrap();
    let consumer = engine.consumer("c").unwrap();
    commit(&consumer, b"k");
    let committed_at = store.clock_now();
    store.clock.advance(Duration::from_secs(61));
    assert!(consumer.get(b"k").unwrap().is_none());
    // Documented: before compaction removes it, a clock stepped back sees it live again.
    store.clock.set(committed_at);
    assert!(matches!(
        consumer.begin(b"k", Fingerprint::of(b"k")).unwrap(),
        Outcome::Duplicate { .. }
    ));
    // Once removed, it stays removed whatever the clock does.
    store.clock.advance(Duration::from_secs(61));
    engine.compact().unwrap();
    store.clock.set(committed_at);
    assert!(consumer.get(b"k").unwrap().is_none());
}

#[test]
fn oversized_batches_are_refused_whole() {
    let store = TestStore::new();
    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    let keys: Vec<String> = (0..=BATCH_MESSAGES_MAX).map(|i| format!("k{i}")).collect();
    let messages: Vec<Message> = keys
        .iter()
        .map(|k| Message::new(k, Fingerprint::of(k)))
        .collect();
    match consumer.begin_batch(&messages) {
        Err(Error::LimitExceeded { limit, .. }) => assert_eq!(limit, Limit::BatchMessages),
        other => panic!("expected the batch limit, got {other:?}"),
    }
    assert_eq!(engine.open_claims(), 0);
    // A bad key anywhere refuses the whole batch before any key is taken.
    let bad = [
        Message::new("ok", Fingerprint::of(b"")),
        Message::new("", Fingerprint::of(b"")),
    ];
    assert!(matches!(
        consumer.begin_batch(&bad),
        Err(Error::LimitExceeded { .. })
    ));
    assert_eq!(engine.open_claims(), 0);
    assert!(consumer.begin_batch(&[]).unwrap().is_empty());
}

#[test]
fn a_regular_file_is_not_a_store() {
    let store = TestStore::new();
    let file = store.dir.path().join("file");
    std::fs::write(&file, b"not a database").unwrap();
    let result = Engine::builder(&file).open();
    assert!(matches!(result, Err(Error::Storage { .. })), "{result:?}");
    assert_eq!(std::fs::read(&file).unwrap(), b"not a database");
}

/// Makes a directory immutable (even for root) while alive, with `chattr +i`.
struct Immutable(std::path::PathBuf);

impl Immutable {
    fn new(path: &std::path::Path) -> Option<Immutable> {
        let status = std::process::Command::new("chattr")
            .arg("+i")
            .arg(path)
            .status()
            .ok()?;
        status.success().then(|| Immutable(path.to_path_buf()))
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .arg("-i")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_read_only_directory_is_a_typed_error() {
    let store = TestStore::new();
    let empty = store.dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let existing = store.dir.path().join("existing");
    {
        let engine = Engine::builder(&existing).open().unwrap();
        commit(&engine.consumer("c").unwrap(), b"kept");
    }
    // Permissions do not stop root; the immutable attribute does.
    let (Some(_empty_lock), Some(_existing_lock)) =
        (Immutable::new(&empty), Immutable::new(&existing))
    else {
        eprintln!("skipped: chattr +i is not available here");
        return;
    };
    for path in [&empty, &existing] {
        let result = Engine::builder(path).open();
        assert!(
            matches!(result, Err(Error::Storage { .. })),
            "{path:?}: {result:?}"
        );
    }
    drop((_empty_lock, _existing_lock));
    let engine = Engine::builder(&existing).open().unwrap();
    assert!(
        engine
            .consumer("c")
            .unwrap()
            .get(b"kept")
            .unwrap()
            .is_some()
    );
}
