//! A claim's staged business writes and a lone writer's commit through the commit log, tested
//! from the docs alone (docs/design.md, "**Atomic.**", "**Staged writes of a claim that did not
//! win never land.**" and "**The write path with the log.**"; ARCHITECTURE.md's rows for
//! `operations/staging.rs` and `storage/log/logged_writes.rs`; the API docs of `Claim`, its
//! staging methods and `EngineBuilder::commit_log`): the writes staged on a claim from `begin`
//! land with its record or not at all (dropped, aborted, a commit refused by its own checks,
//! writes refused while staging), however many there are; a lone writer's commits on a tiny
//! ring that they fill many times over, and ones larger than a segment, each land exactly once,
//! across reopens without a flush; a claim read by reference from other threads and committed
//! on another; async commits.

use std::ops::Range;

use idemdb::{
    BusinessTable, COMMIT_LOG_SEGMENT_BYTES_MIN, COMMIT_LOG_SEGMENTS_MIN, Claim, Consumer,
    Durability, Engine, Error, Fingerprint, Limit, Outcome, RESULT_BYTES_MAX, STAGED_WRITES_MAX,
    TABLE_KEY_BYTES_MAX, TABLE_VALUE_BYTES_MAX,
};

use crate::util::{TestStore, counter};

/// The smallest segment a commit log takes (64 KiB): a tiny ring.
const SEGMENT: u64 = COMMIT_LOG_SEGMENT_BYTES_MIN;

/// The size of a small commit's order: about 15 commits fill a segment.
const ORDER_BYTES: usize = 4 << 10;

/// The handles the tests' messages use: consumer `c`, `orders`, and `counters` (add-u64).
struct Tables {
    c: Consumer,
    orders: BusinessTable,
    counters: BusinessTable,
}

fn tables(engine: &Engine) -> Tables {
    Tables {
        c: engine.consumer("c").unwrap(),
        orders: engine.business_table("orders").unwrap(),
        counters: engine.business_table("counters").unwrap(),
    }
}

/// A store's builder with `durability`, on the commit log or (`log` false) RocksDB's WAL.
fn builder_for(store: &TestStore, durability: Durability, log: bool) -> idemdb::EngineBuilder {
    let builder = store.builder().durability(durability);
    if log {
        builder
    } else {
        builder.without_commit_log()
    }
}

/// Commits message `seed`, which writes order `old` (`v0`): an order a later handler deletes.
fn seed_old_order(t: &Tables) {
    let mut seed = fresh(&t.c, "seed");
    seed.put(&t.orders, "old", b"v0").unwrap();
    seed.commit(b"").unwrap();
}

/// Runs `check` on `engine` ("committed"), then on the store `builder` reopens once `engine` is
/// dropped without a flush ("reopened": the open replays what the tables did not hold); returns
/// the reopened engine and its handles.
fn check_across_reopen(
    engine: Engine,
    t: Tables,
    builder: idemdb::EngineBuilder,
    check: impl Fn(&Engine, &Tables, &str),
) -> (Engine, Tables) {
    check(&engine, &t, "committed");
    drop(t);
    drop(engine);
    let engine = builder.open().unwrap();
    let t = tables(&engine);
    check(&engine, &t, "reopened");
    (engine, t)
}

/// The claim `begin` gives for `key` (fingerprinted by the key itself), which must be fresh.
#[track_caller]
fn fresh(c: &Consumer, key: &str) -> Claim {
    match c.begin(key, Fingerprint::of(key)).unwrap() {
        Outcome::Fresh(claim) => claim,
        other => panic!("{key}: expected a fresh claim, got {other:?}"),
    }
}

/// Asserts that a redelivery of `key` is a duplicate carrying `result`.
#[track_caller]
fn assert_duplicate(c: &Consumer, key: &str, result: &[u8]) {
    match c.begin(key, Fingerprint::of(key)).unwrap() {
        Outcome::Duplicate { result: stored, .. } => assert_eq!(&stored[..], result, "{key}"),
        other => panic!("{key}: expected a duplicate, got {other:?}"),
    }
}

/// The result of `key`'s record read through `Consumer::get` (`None`: no record).
#[track_caller]
fn stored_result(c: &Consumer, key: &str) -> Option<Vec<u8>> {
    c.get(key).unwrap().map(|record| {
        record
            .result()
            .unwrap_or_else(|| panic!("{key}: not completed: {record:?}"))
            .to_vec()
    })
}

#[track_caller]
fn assert_limit(result: idemdb::Result<()>, expected: Limit) {
    match result {
        Err(Error::LimitExceeded { limit, .. }) => assert_eq!(limit, expected),
        other => panic!("expected {expected:?} to be exceeded, got {other:?}"),
    }
}

#[track_caller]
fn assert_foreign(result: idemdb::Result<()>) {
    assert!(
        matches!(result, Err(Error::ForeignTable { .. })),
        "expected ForeignTable, got {result:?}"
    );
}

/// Message `i`'s order: `ORDER_BYTES` bytes, different for every message.
fn order(i: u32) -> Vec<u8> {
    let mut value = format!("order-{i}:").into_bytes();
    value.resize(ORDER_BYTES, i as u8);
    value
}

/// Commits messages `m-{i}` for `range`, one after the other from this thread (a lone writer),
/// each putting its order and adding 1 to counter `n`; each commit is read back as soon as it
/// returns.
fn commit_orders(engine: &Engine, range: Range<u32>, what: &str) {
    let t = tables(engine);
    for i in range {
        let key = format!("m-{i}");
        let before = counter(engine, "n");
        let mut claim = fresh(&t.c, &key);
        claim.put(&t.orders, &key, order(i)).unwrap();
        claim.merge(&t.counters, "n", 1u64.to_be_bytes()).unwrap();
        claim
            .commit(&key)
            .unwrap_or_else(|error| panic!("{what}: {key}: {error:?}"));
        assert_eq!(counter(engine, "n"), before + 1, "{what}: {key}");
        assert_eq!(t.orders.get(&key).unwrap(), Some(order(i)), "{what}: {key}");
    }
}

/// The value of a large commit: `bytes` bytes, different for every `seed`.
fn large(bytes: usize, seed: u8) -> Vec<u8> {
    (0..bytes).map(|i| (i as u8).wrapping_add(seed)).collect()
}

/// Commits `key` with an order of `large(bytes, seed)` and 1 added to counter `n`.
fn commit_large(engine: &Engine, key: &str, bytes: usize, seed: u8) -> idemdb::Result<()> {
    let t = tables(engine);
    let mut claim = fresh(&t.c, key);
    claim.put(&t.orders, key, large(bytes, seed)).unwrap();
    claim.merge(&t.counters, "n", 1u64.to_be_bytes()).unwrap();
    claim.commit(key).map(drop)
}

/// Staged put/delete/merge of a dropped or aborted claim never land, the redelivery is fresh, and
/// its commit lands them all with the record (design.md: "Staged writes ... never land", "Atomic").
#[test]
fn staged_writes_land_with_the_commit_and_never_with_a_dropped_or_aborted_claim() {
    for (what, durability, log) in [
        ("sync, commit log", Durability::Sync, true),
        ("buffered, commit log", Durability::Buffered, true),
        ("sync, RocksDB's WAL", Durability::Sync, false),
    ] {
        let store = TestStore::new();
        let builder = builder_for(&store, durability, log);
        let engine = builder.clone().open().unwrap();
        let t = tables(&engine);
        // An order the message's handler deletes.
        seed_old_order(&t);

        let stage = |claim: &mut Claim| {
            claim.put(&t.orders, "new", b"v1").unwrap();
            claim.delete(&t.orders, "old").unwrap();
            claim.merge(&t.counters, "n", 1u64.to_be_bytes()).unwrap();
            assert_eq!(claim.staged_writes(), 3, "{what}");
        };
        let assert_unwritten = |when: &str| {
            assert_eq!(t.orders.get("new").unwrap(), None, "{what}: {when}");
            assert_eq!(
                t.orders.get("old").unwrap().as_deref(),
                Some(&b"v0"[..]),
                "{what}: {when}"
            );
            assert_eq!(counter(&engine, "n"), 0, "{what}: {when}");
            assert!(t.c.get("m-1").unwrap().is_none(), "{what}: {when}");
        };
        let batches = engine.stats().write_batches;

        // Held with its writes staged, the key is in progress: that `begin` gets no claim.
        let mut claim = fresh(&t.c, "m-1");
        stage(&mut claim);
        assert!(
            matches!(
                t.c.begin("m-1", Fingerprint::of("m-1")).unwrap(),
                Outcome::InProgress { .. }
            ),
            "{what}"
        );
        assert_unwritten("staged, not committed");
        assert_eq!(engine.open_claims(), 1, "{what}");
        drop(claim);
        assert_eq!(engine.open_claims(), 0, "{what}");
        assert_unwritten("dropped");

        // The redelivery is fresh; aborted, its writes do not land either.
        let mut claim = fresh(&t.c, "m-1");
        stage(&mut claim);
        claim.abort();
        assert_unwritten("aborted");
        assert_eq!(
            engine.stats().write_batches,
            batches,
            "{what}: a claim that did not commit wrote a batch"
        );

        // Another key's commit carries nothing of theirs.
        let mut other = fresh(&t.c, "m-2");
        other.put(&t.orders, "other", b"v2").unwrap();
        other.commit(b"other").unwrap();
        assert_eq!(
            t.orders.get("other").unwrap().as_deref(),
            Some(&b"v2"[..]),
            "{what}"
        );
        assert_unwritten("after another key's commit");

        // The next redelivery commits: every staged write lands with the record, one batch.
        let batches = engine.stats().write_batches;
        let mut claim = fresh(&t.c, "m-1");
        stage(&mut claim);
        let committed = claim.commit(b"done").unwrap();
        assert_eq!(engine.stats().write_batches, batches + 1, "{what}");
        // Nothing was written for the dropped and aborted claims: the first record.
        assert_eq!(committed.epoch, 1, "{what}");
        let check = |engine: &Engine, t: &Tables, when: &str| {
            assert_eq!(
                t.orders.get("new").unwrap().as_deref(),
                Some(&b"v1"[..]),
                "{what}: {when}"
            );
            assert_eq!(t.orders.get("old").unwrap(), None, "{what}: {when}");
            assert_eq!(
                t.orders.get("other").unwrap().as_deref(),
                Some(&b"v2"[..]),
                "{what}: {when}"
            );
            assert_eq!(counter(engine, "n"), 1, "{what}: {when}");
            let record = t.c.get("m-1").unwrap().expect("the committed record");
            assert_eq!(record.epoch, committed.epoch, "{what}: {when}");
            assert_eq!(record.fingerprint, Fingerprint::of("m-1"), "{what}: {when}");
            assert_eq!(
                record.result().map(|result| &result[..]),
                Some(&b"done"[..]),
                "{what}: {when}"
            );
            assert_duplicate(&t.c, "m-1", b"done");
        };
        check_across_reopen(engine, t, builder, check);
    }
}

/// A commit failing its own checks (result over `RESULT_BYTES_MAX`, a position behind) writes no
/// staged write and frees the key (`Claim::commit`, `Claim::stage_position`: "nothing is written").
#[test]
fn a_commit_refused_by_its_checks_writes_none_of_its_staged_writes_and_frees_the_key() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let engine = store.builder().durability(durability).open().unwrap();
        let t = tables(&engine);
        seed_old_order(&t);
        t.c.positions().advance("orders", 0, 10).unwrap();

        let stage = |claim: &mut Claim, key: &str| {
            claim.put(&t.orders, format!("order-{key}"), key).unwrap();
            claim.delete(&t.orders, "old").unwrap();
            claim.merge(&t.counters, "n", 1u64.to_be_bytes()).unwrap();
        };
        let assert_unwritten = |key: &str| {
            let row = format!("order-{key}");
            assert_eq!(t.orders.get(&row).unwrap(), None, "{durability:?}: {key}");
            assert_eq!(
                t.orders.get("old").unwrap().as_deref(),
                Some(&b"v0"[..]),
                "{durability:?}: {key}"
            );
            assert_eq!(counter(&engine, "n"), 0, "{durability:?}: {key}");
            assert!(t.c.get(key).unwrap().is_none(), "{durability:?}: {key}");
        };
        let batches = engine.stats().write_batches;

        let mut claim = fresh(&t.c, "too-large");
        stage(&mut claim, "too-large");
        match claim.commit(vec![0u8; RESULT_BYTES_MAX + 1]) {
            Err(Error::LimitExceeded {
                limit: Limit::ResultBytes,
                ..
            }) => {}
            other => panic!("{durability:?}: expected the result's limit, got {other:?}"),
        }
        assert_unwritten("too-large");

        let mut claim = fresh(&t.c, "behind");
        stage(&mut claim, "behind");
        claim.stage_position("orders", 0, 5).unwrap();
        match claim.commit(b"behind") {
            Err(Error::PositionBehind {
                stored: 10,
                staged: 5,
                ..
            }) => {}
            other => panic!("{durability:?}: expected PositionBehind, got {other:?}"),
        }
        assert_unwritten("behind");
        assert_unwritten("too-large");
        assert_eq!(
            engine.stats().write_batches,
            batches,
            "{durability:?}: a refused commit wrote a batch"
        );
        assert_eq!(engine.open_claims(), 0, "{durability:?}");
        assert_eq!(
            t.c.positions()
                .get("orders", 0)
                .unwrap()
                .map(|position| position.next_offset()),
            Some(11),
            "{durability:?}"
        );

        // Both keys are free: redelivered, each commits its writes once.
        for key in ["too-large", "behind"] {
            let mut claim = fresh(&t.c, key);
            stage(&mut claim, key);
            claim.commit(key).unwrap();
            assert_eq!(
                t.orders.get(format!("order-{key}")).unwrap().as_deref(),
                Some(key.as_bytes()),
                "{durability:?}"
            );
            assert_eq!(
                stored_result(&t.c, key).as_deref(),
                Some(key.as_bytes()),
                "{durability:?}"
            );
            assert_duplicate(&t.c, key, key.as_bytes());
        }
        assert_eq!(t.orders.get("old").unwrap(), None, "{durability:?}");
        assert_eq!(counter(&engine, "n"), 2, "{durability:?}");
    }
}

/// 1,000 staged puts of 1 KiB (beyond the room a claim reserves) are counted by `staged_writes`
/// and all land with the commit, or none if dropped (ARCHITECTURE.md `operations/staging.rs`).
#[test]
fn a_thousand_staged_writes_all_land_with_the_commit() {
    const WRITES: usize = 1_000;
    let line = |i: usize| -> Vec<u8> {
        let mut value = format!("line-{i}:").into_bytes();
        value.resize(1 << 10, (i % 251) as u8);
        value
    };
    for log in [true, false] {
        let store = TestStore::new();
        let builder = builder_for(&store, Durability::Sync, log);
        let engine = builder.clone().open().unwrap();
        let t = tables(&engine);
        seed_old_order(&t);

        let stage_all = |claim: &mut Claim| {
            for i in 0..WRITES {
                claim.put(&t.orders, format!("line-{i}"), line(i)).unwrap();
                assert_eq!(claim.staged_writes(), i + 1, "log {log}");
            }
            claim.merge(&t.counters, "n", 1u64.to_be_bytes()).unwrap();
            claim.delete(&t.orders, "old").unwrap();
            assert_eq!(claim.staged_writes(), WRITES + 2, "log {log}");
        };

        let mut claim = fresh(&t.c, "lines");
        stage_all(&mut claim);
        drop(claim);
        for i in 0..WRITES {
            assert_eq!(
                t.orders.get(format!("line-{i}")).unwrap(),
                None,
                "log {log}"
            );
        }
        assert_eq!(
            t.orders.get("old").unwrap().as_deref(),
            Some(&b"v0"[..]),
            "log {log}"
        );
        assert_eq!(counter(&engine, "n"), 0, "log {log}");

        let mut claim = fresh(&t.c, "lines");
        stage_all(&mut claim);
        assert_eq!(t.orders.get("line-999").unwrap(), None, "log {log}");
        claim.commit(b"lines").unwrap();
        let check = |engine: &Engine, t: &Tables| {
            for i in 0..WRITES {
                assert_eq!(
                    t.orders.get(format!("line-{i}")).unwrap(),
                    Some(line(i)),
                    "log {log}: line {i}"
                );
            }
            assert_eq!(t.orders.get("old").unwrap(), None, "log {log}");
            assert_eq!(counter(engine, "n"), 1, "log {log}");
            assert_eq!(
                stored_result(&t.c, "lines").as_deref(),
                Some(&b"lines"[..]),
                "log {log}"
            );
        };
        let (_engine, t) = check_across_reopen(engine, t, builder, |engine, t, _| check(engine, t));
        assert_duplicate(&t.c, "lines", b"lines");
    }
}

/// A lone writer's commits filling a tiny ring many times over each land once, also across reopens
/// (design.md, "The write path with the log": "A ring without room sends it the group's way").
#[test]
fn a_lone_writer_filling_a_tiny_ring_many_times_over_lands_each_commit_once() {
    // 300 commits of 4 KiB: about 1.2 MB, 6 to 10 times the ring.
    const COMMITS: u32 = 300;
    for segments in [COMMIT_LOG_SEGMENTS_MIN, 3] {
        for durability in [Durability::Sync, Durability::Buffered] {
            let what = format!("{segments} segments, {durability:?}");
            let store = TestStore::new();
            let builder = store
                .builder()
                .durability(durability)
                .commit_log(segments, SEGMENT);
            let engine = builder.clone().open().unwrap();
            let batches = engine.stats().write_batches;
            commit_orders(&engine, 0..COMMITS / 2, &what);
            assert_eq!(
                engine.stats().write_batches,
                batches + u64::from(COMMITS / 2),
                "{what}: one write batch per commit"
            );
            drop(engine); // not flushed: the next open replays the log
            let engine = builder.clone().open().unwrap();
            assert_eq!(
                counter(&engine, "n"),
                u64::from(COMMITS / 2),
                "{what}: replayed once"
            );
            commit_orders(&engine, COMMITS / 2..COMMITS, &what);
            drop(engine);
            let engine = builder.open().unwrap();
            assert_eq!(counter(&engine, "n"), u64::from(COMMITS), "{what}");
            let t = tables(&engine);
            for i in 0..COMMITS {
                let key = format!("m-{i}");
                assert_eq!(t.orders.get(&key).unwrap(), Some(order(i)), "{what}: {key}");
                assert_eq!(
                    stored_result(&t.c, &key).as_deref(),
                    Some(key.as_bytes()),
                    "{what}"
                );
                assert_duplicate(&t.c, &key, key.as_bytes());
            }
        }
    }
}

/// A lone writer's commit larger than a segment lands, and so does the next; one larger than the
/// whole log is refused and writes nothing (`EngineBuilder::commit_log`: "an enlarged segment").
#[test]
fn a_lone_writers_commit_larger_than_a_segment_lands_and_so_does_the_next() {
    // The 3-segment log holds 3 x (64 KiB - 32) bytes, about 196 KB: each fits in it.
    const LARGE: [usize; 5] = [70_000, 100_000, 130_000, 160_000, 90_000];
    for durability in [Durability::Sync, Durability::Buffered] {
        let what = format!("{durability:?}");
        let store = TestStore::new();
        let builder = store
            .builder()
            .durability(durability)
            .commit_log(3, SEGMENT);
        let engine = builder.clone().open().unwrap();
        let mut next = 0;
        for (round, &bytes) in LARGE.iter().enumerate() {
            // Small commits first (none in the first round): each large one finds the ring at
            // another place.
            let small = round as u32 * 4;
            commit_orders(&engine, next..next + small, &what);
            next += small;
            let key = format!("large-{round}");
            commit_large(&engine, &key, bytes, round as u8)
                .unwrap_or_else(|error| panic!("{what}: {key}: {error:?}"));
            let t = tables(&engine);
            assert_eq!(
                t.orders.get(&key).unwrap(),
                Some(large(bytes, round as u8)),
                "{what}: {key}"
            );
            drop(t);
            // The next small commit.
            commit_orders(&engine, next..next + 1, &what);
            next += 1;
        }
        let total = u64::from(next) + LARGE.len() as u64;
        assert_eq!(counter(&engine, "n"), total, "{what}");

        // Larger than the whole log: refused, nothing written, the key free.
        let refused = commit_large(&engine, "huge", 250_000, 0);
        assert!(
            matches!(refused, Err(Error::InvalidArgument { .. })),
            "{what}: {refused:?}"
        );
        let t = tables(&engine);
        assert_eq!(t.orders.get("huge").unwrap(), None, "{what}");
        assert!(t.c.get("huge").unwrap().is_none(), "{what}");
        assert_eq!(counter(&engine, "n"), total, "{what}");
        drop(t);
        commit_orders(&engine, next..next + 1, &what);
        next += 1;
        let total = total + 1;
        drop(engine); // not flushed: the next open replays the log, large records too

        let engine = builder.open().unwrap();
        assert_eq!(counter(&engine, "n"), total, "{what}: replayed once");
        let t = tables(&engine);
        for (round, &bytes) in LARGE.iter().enumerate() {
            let key = format!("large-{round}");
            assert_eq!(
                t.orders.get(&key).unwrap(),
                Some(large(bytes, round as u8)),
                "{what}: {key}"
            );
            assert_duplicate(&t.c, &key, key.as_bytes());
        }
        for i in 0..next {
            let key = format!("m-{i}");
            assert_eq!(t.orders.get(&key).unwrap(), Some(order(i)), "{what}: {key}");
            assert_duplicate(&t.c, &key, key.as_bytes());
        }
        assert_eq!(t.orders.get("huge").unwrap(), None, "{what}");
        drop(fresh(&t.c, "huge"));
    }
}

fn assert_send<T: Send>() {}

fn assert_sync<T: Sync>() {}

/// `Claim` is `Sync` and `Send`: other threads read a `&Claim` its owner keeps, then it commits on
/// another (`Claim`'s docs: "A claim is `Send` and `Sync`").
#[test]
fn a_claim_is_read_by_reference_from_other_threads_and_commits_on_another() {
    assert_sync::<Claim>();
    assert_send::<Claim>();
    assert_sync::<Outcome>();
    assert_send::<Outcome>();

    let store = TestStore::new();
    let engine = store.open();
    let t = tables(&engine);
    let mut claim = fresh(&t.c, "shared");
    claim.put(&t.orders, "shared", b"v").unwrap();
    let key = claim.stored_key().to_vec();
    let epoch = claim.epoch();
    let derived = claim.derive_key("step");
    let shared = &claim;
    std::thread::scope(|scope| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(move || {
                    (
                        shared.stored_key().to_vec(),
                        shared.staged_writes(),
                        shared.epoch(),
                        shared.fingerprint(),
                        shared.derive_key("step"),
                    )
                })
            })
            .collect();
        // The owner keeps the claim meanwhile: it reads it, and the key stays held.
        assert_eq!(shared.stored_key(), &key[..]);
        assert!(matches!(
            t.c.begin("shared", Fingerprint::of("shared")).unwrap(),
            Outcome::InProgress { .. }
        ));
        for reader in readers {
            let (seen_key, staged, seen_epoch, fingerprint, seen_derived) = reader.join().unwrap();
            assert_eq!(seen_key, key);
            assert_eq!(staged, 1);
            assert_eq!(seen_epoch, epoch);
            assert_eq!(fingerprint, Fingerprint::of("shared"));
            assert_eq!(seen_derived, derived);
        }
    });
    claim.put(&t.orders, "after", b"w").unwrap();
    assert_eq!(claim.staged_writes(), 2);
    let committed = std::thread::spawn(move || claim.commit(b"done").expect("commit"))
        .join()
        .unwrap();
    assert_eq!(committed.epoch, epoch);
    assert_eq!(t.orders.get("shared").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(t.orders.get("after").unwrap().as_deref(), Some(&b"w"[..]));
    assert_eq!(stored_result(&t.c, "shared").as_deref(), Some(&b"done"[..]));
    assert_duplicate(&t.c, "shared", b"done");
}

/// A write refused while staging (`ForeignTable`, limits, no merge operator) stages nothing and
/// the commit lands exactly the rest (the staging methods' docs: "Nothing is staged on error").
#[test]
fn refused_staged_writes_stage_nothing_and_the_commit_lands_the_rest() {
    let store = TestStore::new();
    let engine = store.open();
    let other_store = TestStore::new();
    let other = other_store.open();
    let t = tables(&engine);
    // The other engine declares the same tables; its `orders` holds a row a refused delete
    // names.
    let foreign = tables(&other);
    let mut seed = fresh(&foreign.c, "seed");
    seed.put(&foreign.orders, "theirs", b"kept").unwrap();
    seed.commit(b"").unwrap();
    let other_batches = other.stats().write_batches;

    let mut claim = fresh(&t.c, "m-1");
    // Refused as the claim's first write (nothing staged yet), and after one was staged.
    for staged in [0, 1] {
        if staged == 1 {
            claim.put(&t.orders, 0u32.to_be_bytes(), b"v").unwrap();
        }
        assert_foreign(claim.put(&foreign.orders, "theirs", b"v"));
        assert_foreign(claim.delete(&foreign.orders, "theirs"));
        assert_foreign(claim.merge(&foreign.counters, "n", 1u64.to_be_bytes()));
        assert_limit(claim.put(&t.orders, b"", b"v"), Limit::TableKeyBytes);
        assert_limit(
            claim.delete(&t.orders, vec![7u8; TABLE_KEY_BYTES_MAX + 1]),
            Limit::TableKeyBytes,
        );
        assert_limit(
            claim.put(&t.orders, "big", vec![0u8; TABLE_VALUE_BYTES_MAX + 1]),
            Limit::TableValueBytes,
        );
        assert!(matches!(
            claim.merge(&t.orders, "theirs", b"v"),
            Err(Error::NoMergeOperator { .. })
        ));
        assert_eq!(claim.staged_writes(), staged);
    }
    // Filled to the most writes a claim stages; one more, of any kind, is refused.
    for i in 1..STAGED_WRITES_MAX as u32 {
        claim.put(&t.orders, i.to_be_bytes(), b"v").unwrap();
    }
    assert_eq!(claim.staged_writes(), STAGED_WRITES_MAX);
    assert_limit(claim.put(&t.orders, "theirs", b"v"), Limit::StagedWrites);
    assert_limit(
        claim.delete(&t.orders, 0u32.to_be_bytes()),
        Limit::StagedWrites,
    );
    assert_limit(
        claim.merge(&t.counters, "n", 1u64.to_be_bytes()),
        Limit::StagedWrites,
    );
    assert_eq!(claim.staged_writes(), STAGED_WRITES_MAX);
    claim.commit(b"done").unwrap();

    for i in 0..STAGED_WRITES_MAX as u32 {
        assert_eq!(
            t.orders.get(i.to_be_bytes()).unwrap().as_deref(),
            Some(&b"v"[..]),
            "{i}"
        );
    }
    for key in ["theirs", "big"] {
        assert_eq!(t.orders.get(key).unwrap(), None, "{key}");
    }
    assert_eq!(counter(&engine, "n"), 0);
    assert_eq!(stored_result(&t.c, "m-1").as_deref(), Some(&b"done"[..]));
    // The other engine got nothing.
    assert_eq!(
        foreign.orders.get("theirs").unwrap().as_deref(),
        Some(&b"kept"[..])
    );
    assert_eq!(counter(&other, "n"), 0);
    assert!(foreign.c.get("m-1").unwrap().is_none());
    assert_eq!(other.stats().write_batches, other_batches);
}

/// `Claim::commit_async` ("Commits like `Claim::commit`") lands each claim's staged writes with
/// its record, many in flight on a tiny ring; a claim dropped among them lands none.
#[cfg(feature = "tokio")]
#[test]
fn commit_async_lands_the_staged_writes_as_commit_does() {
    // 60 messages, 48 committed: about 200 KB, more than the 3-segment ring.
    const MESSAGES: u32 = 60;
    let dropped = |i: u32| i % 5 == 4;
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = TestStore::new();
        let builder = store
            .builder()
            .durability(durability)
            .commit_log(3, SEGMENT);
        let engine = builder.clone().open().unwrap();
        let t = tables(&engine);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut commits = Vec::new();
            for i in 0..MESSAGES {
                let key = format!("m-{i}");
                let mut claim = fresh(&t.c, &key);
                claim.put(&t.orders, &key, order(i)).unwrap();
                claim.merge(&t.counters, "n", 1u64.to_be_bytes()).unwrap();
                if dropped(i) {
                    drop(claim);
                } else {
                    commits.push((key.clone(), claim.commit_async(key)));
                }
            }
            for (key, commit) in commits {
                commit
                    .await
                    .unwrap_or_else(|error| panic!("{durability:?}: {key}: {error:?}"));
            }
        });
        let committed = (0..MESSAGES).filter(|&i| !dropped(i)).count() as u64;
        let check = |engine: &Engine, t: &Tables| {
            assert_eq!(counter(engine, "n"), committed, "{durability:?}");
            for i in 0..MESSAGES {
                let key = format!("m-{i}");
                if dropped(i) {
                    assert_eq!(t.orders.get(&key).unwrap(), None, "{durability:?}: {key}");
                    assert!(t.c.get(&key).unwrap().is_none(), "{durability:?}: {key}");
                } else {
                    assert_eq!(
                        t.orders.get(&key).unwrap(),
                        Some(order(i)),
                        "{durability:?}: {key}"
                    );
                    assert_eq!(
                        stored_result(&t.c, &key).as_deref(),
                        Some(key.as_bytes()),
                        "{durability:?}"
                    );
                }
            }
        };
        let (_engine, t) = check_across_reopen(engine, t, builder, |engine, t, _| check(engine, t));
        for i in (0..MESSAGES).filter(|&i| dropped(i)) {
            drop(fresh(&t.c, &format!("m-{i}")));
        }
    }
}
