//! Guards the operator API (`idemdb::admin`): tables found without declarations, read-only
//! access beside a live engine, every record state reported, writes refused on a live store,
//! and the repairs (resolve, invalidate, purge, import) keeping epochs and business data intact.

use std::ops::ControlFlow;
use std::time::Duration;

use crate::util::{TestStore, counter};
use idemdb::admin::{
    Cursor, Entry, EntryState, Filter, ImportRecord, Invalidation, Store, StoreBuilder, TableKind,
    Target,
};
use idemdb::{Error, Fingerprint, Outcome, RecordState, Resolution, format};

const DAY: Duration = Duration::from_secs(24 * 3600);
const LEASE: Duration = Duration::from_secs(30);

fn fp(content: &str) -> Fingerprint {
    Fingerprint::of(content)
}

fn admin(store: &TestStore) -> StoreBuilder {
    Store::builder(store.dir.path()).clock(store.clock.clone())
}

/// Commits `key` for consumer `c` with result `key`, a row in `orders` and +1 on the counter
/// `n` (a business table with a merge operator).
fn commit(engine: &idemdb::Engine, consumer: &str, key: &str) {
    let consumer = engine.consumer(consumer).unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();
    match consumer.begin(key, fp(key)).unwrap() {
        Outcome::Fresh(mut claim) => {
            claim.put(&orders, key, key).unwrap();
            claim.merge(&counters, "n", 1u64.to_be_bytes()).unwrap();
            claim.commit(key).unwrap();
        }
        other => panic!("{key}: expected fresh, got {other:?}"),
    }
}

/// A store with a record in every state: `c/old` expired, `c/live-1` and `c/live-2` live,
/// `p/stuck` in progress (lease run out), `p/busy` in progress (lease live), `p/gone`
/// released, and `customers/cust-1` in the entity table. The engine is returned open.
fn populated(store: &TestStore) -> idemdb::Engine {
    let engine = store.open();
    commit(&engine, "c", "old");
    store.clock.advance(8 * DAY);
    commit(&engine, "c", "live-1");
    commit(&engine, "c", "live-2");
    let payments = engine.consumer("p").unwrap();
    for (key, holder) in [("stuck", "worker-1"), ("gone", "worker-3")] {
        let Outcome::Fresh(claim) = payments
            .begin_external(key, fp(key), LEASE, holder)
            .unwrap()
        else {
            panic!("{key}: expected fresh");
        };
        if key == "gone" {
            claim.release().unwrap();
        }
    }
    store.clock.advance(Duration::from_secs(3600));
    let Outcome::Fresh(_busy) = payments
        .begin_external("busy", fp("busy"), LEASE, "worker-2")
        .unwrap()
    else {
        panic!("busy: expected fresh");
    };
    let customers = engine.entity_table("customers").unwrap();
    let Outcome::Fresh(claim) = customers.begin("cust-1", fp("cust-1")).unwrap() else {
        panic!("cust-1: expected fresh");
    };
    claim.commit("Ada").unwrap();
    engine
}

fn all_entries(store: &Store) -> Vec<Entry> {
    let mut entries = Vec::new();
    store
        .scan(&Filter::new(), None, |entry| {
            entries.push(entry);
            ControlFlow::Continue(())
        })
        .unwrap();
    entries
}

fn state_of(store: &Store, consumer: &str, key: &str) -> Option<EntryState> {
    let target = Target::Consumer(consumer.as_bytes().to_vec());
    store
        .get(&target, key.as_bytes())
        .unwrap()
        .map(|entry| entry.state_at(store.now_ms()))
}

#[test]
fn read_only_open_beside_a_live_engine_sees_every_state_and_writes_are_refused() {
    let store = TestStore::new();
    let _engine = populated(&store);
    let admin_store = admin(&store).open_read_only().unwrap();
    assert!(!admin_store.is_exclusive());

    let kinds: Vec<(&str, TableKind)> = admin_store
        .tables()
        .iter()
        .map(|table| (table.name.as_str(), table.kind))
        .collect();
    for expected in [
        ("idemdb.records", TableKind::Consumers),
        ("customers", TableKind::Entity),
        ("orders", TableKind::Business),
        ("counters", TableKind::Business),
        ("idemdb.versions", TableKind::Internal),
        ("idemdb.positions", TableKind::Internal),
    ] {
        assert!(kinds.contains(&expected), "{expected:?} in {kinds:?}");
    }
    assert_eq!(
        kinds[0].0, "idemdb.records",
        "the consumers' table lists first"
    );

    for (consumer, key, state) in [
        ("c", "old", EntryState::Expired),
        ("c", "live-1", EntryState::Live),
        ("p", "stuck", EntryState::InProgress),
        ("p", "busy", EntryState::InProgress),
        ("p", "gone", EntryState::Released),
    ] {
        assert_eq!(
            state_of(&admin_store, consumer, key),
            Some(state),
            "{consumer}/{key}"
        );
    }
    assert_eq!(state_of(&admin_store, "c", "never-seen"), None);
    let entity = admin_store
        .get(&Target::Entity("customers".into()), b"cust-1")
        .unwrap()
        .unwrap();
    assert_eq!(entity.record.unwrap().result().unwrap(), "Ada");

    let stats = admin_store.stats().unwrap();
    let totals = stats.totals();
    assert_eq!(
        (
            totals.live,
            totals.expired,
            totals.in_progress,
            totals.released,
            totals.corrupt
        ),
        (3, 1, 2, 1, 0)
    );
    let consumer_c = stats
        .groups
        .iter()
        .find(|group| group.consumer.as_deref() == Some(&b"c"[..]))
        .unwrap();
    assert_eq!((consumer_c.counts.live, consumer_c.counts.expired), (2, 1));
    assert_eq!(consumer_c.oldest_ms, Some(crate::util::START_MS));
    assert!(stats.disk_bytes > 0 && stats.disk_files > 0);

    // The in-progress view: taken at least 30 minutes ago finds only the stuck key.
    let stuck = admin_store
        .list(
            &Filter::new()
                .state(EntryState::InProgress)
                .older_than(Duration::from_secs(1800)),
            None,
            10,
        )
        .unwrap();
    let keys: Vec<&[u8]> = stuck.entries.iter().map(|entry| &entry.key[..]).collect();
    assert_eq!(keys, [&b"stuck"[..]]);

    assert!(matches!(
        admin_store.resolve(b"p", b"stuck", Resolution::Release),
        Err(Error::ReadOnly)
    ));
    assert!(matches!(
        admin(&store).open_exclusive(),
        Err(Error::AlreadyOpen { .. })
    ));
}

#[test]
fn pages_cover_every_entry_once() {
    let store = TestStore::new();
    drop(populated(&store));
    let admin_store = admin(&store).open_read_only().unwrap();
    let everything = all_entries(&admin_store);
    assert_eq!(everything.len(), 7);
    let mut paged = Vec::new();
    let mut after: Option<Cursor> = None;
    loop {
        let page = admin_store.list(&Filter::new(), after.as_ref(), 2).unwrap();
        assert!(page.entries.len() <= 2);
        paged.extend(page.entries);
        match page.next {
            // The text form is what the CLI prints and takes back.
            Some(next) => after = Some(Cursor::parse(&next.to_string()).unwrap()),
            None => break,
        }
    }
    assert_eq!(paged, everything);

    let only_c = admin_store
        .list(&Filter::new().consumer("c"), None, 100)
        .unwrap();
    assert_eq!(only_c.entries.len(), 3);
    assert!(only_c.next.is_none());
    assert!(matches!(
        admin_store.list(&Filter::new().table("orders"), None, 10),
        Err(Error::UnknownTable { .. })
    ));
}

#[test]
fn resolve_and_release_in_progress_keys_of_a_stopped_store() {
    let store = TestStore::new();
    drop(populated(&store));
    let admin_store = admin(&store).open_exclusive().unwrap();
    admin_store
        .resolve(b"p", b"stuck", Resolution::Complete("settled".into()))
        .unwrap();
    admin_store
        .resolve(b"p", b"busy", Resolution::Release)
        .unwrap();
    assert!(matches!(
        admin_store.resolve(b"c", b"live-1", Resolution::Release),
        Err(Error::NotInProgress { current_epoch: 1 })
    ));
    drop(admin_store);

    let engine = store.open();
    let payments = engine.consumer("p").unwrap();
    match payments.begin("stuck", fp("stuck")).unwrap() {
        Outcome::Duplicate { result, .. } => assert_eq!(result, "settled"),
        other => panic!("expected the resolved result, got {other:?}"),
    }
    match payments
        .begin_external("busy", fp("busy"), LEASE, "worker-4")
        .unwrap()
    {
        Outcome::Fresh(claim) => assert_eq!(claim.epoch(), 2),
        other => panic!("expected the released key to be free, got {other:?}"),
    }
}

#[test]
fn invalidate_makes_the_next_delivery_fresh_at_the_next_epoch() {
    let store = TestStore::new();
    drop(populated(&store));
    let admin_store = admin(&store).open_exclusive().unwrap();
    let target = Target::Consumer(b"c".to_vec());
    assert_eq!(
        admin_store.invalidate(&target, b"live-1").unwrap(),
        Invalidation::Invalidated { epoch: 1 }
    );
    assert_eq!(
        admin_store.invalidate(&target, b"live-1").unwrap(),
        Invalidation::NotCompleted {
            state: Some(EntryState::Released),
            epoch: 1
        }
    );
    for (key, state) in [("old", Some(EntryState::Expired)), ("never-seen", None)] {
        assert!(matches!(
            admin_store.invalidate(&target, key.as_bytes()).unwrap(),
            Invalidation::NotCompleted { state: found, .. } if found == state
        ));
    }
    let customers = Target::Entity("customers".into());
    assert_eq!(
        admin_store.invalidate(&customers, b"cust-1").unwrap(),
        Invalidation::Invalidated { epoch: 1 }
    );
    drop(admin_store);

    let engine = store.open();
    let consumer = engine.consumer("c").unwrap();
    assert!(consumer.get("live-1").unwrap().is_none());
    assert_eq!(
        consumer.get("live-2").unwrap().unwrap().epoch,
        1,
        "others untouched"
    );
    match consumer.begin("live-1", fp("live-1")).unwrap() {
        Outcome::Fresh(claim) => assert_eq!(claim.commit("again").unwrap().epoch, 2),
        other => panic!("expected fresh after invalidate, got {other:?}"),
    }
    let customers = engine.entity_table("customers").unwrap();
    assert!(matches!(
        customers.begin("cust-1", fp("cust-1")).unwrap(),
        Outcome::Fresh(_)
    ));
}

#[test]
fn exclusive_open_keeps_unflushed_business_merges() {
    // The counters table has a merge operator the admin store does not know; its operands are
    // only in the WAL (nothing was flushed). Opening, writing and purging must neither fail on
    // them nor lose them.
    let store = TestStore::new();
    let engine = populated(&store);
    assert_eq!(counter(&engine, "n"), 3);
    drop(engine);
    let admin_store = admin(&store).open_exclusive().unwrap();
    admin_store
        .invalidate(&Target::Consumer(b"c".to_vec()), b"live-2")
        .unwrap();
    admin_store.purge_expired(|_, _, _| {}).unwrap();
    drop(admin_store);
    let engine = store.open();
    assert_eq!(counter(&engine, "n"), 3);
    commit(&engine, "c", "live-2");
    assert_eq!(counter(&engine, "n"), 4);
}

#[test]
fn after_an_exclusive_open_a_changed_merge_operator_is_still_refused() {
    // The tools' stand-in operator takes the application's name, so the OPTIONS file they
    // write still names `add_u64` and the next application open is checked against it.
    let store = TestStore::new();
    drop(populated(&store));
    let admin_store = admin(&store).open_exclusive().unwrap();
    admin_store
        .invalidate(&Target::Consumer(b"c".to_vec()), b"live-2")
        .unwrap();
    drop(admin_store);
    let without_operator = idemdb::Engine::builder(store.dir.path())
        .clock(store.clock.clone())
        .business_table(idemdb::TableOptions::new("orders"))
        .business_table(idemdb::TableOptions::new("counters"))
        .entity_table("customers")
        .open();
    assert!(
        matches!(&without_operator, Err(idemdb::Error::IncompatibleStore { reason, .. }) if reason.contains("add_u64")),
        "{without_operator:?}"
    );
    let engine = store.open();
    assert_eq!(counter(&engine, "n"), 3);
}

#[test]
fn purge_expired_removes_expired_records_only() {
    let store = TestStore::new();
    drop(populated(&store));
    let admin_store = admin(&store).open_exclusive().unwrap();
    let mut steps = Vec::new();
    let report = admin_store
        .purge_expired(|table, index, count| steps.push((table.to_owned(), index, count)))
        .unwrap();
    assert_eq!(steps[0], ("idemdb.records".to_owned(), 0, 2));
    assert_eq!(steps.len(), 2);
    assert_eq!((report.before.expired, report.after.expired), (1, 0));
    assert_eq!(report.after.live, report.before.live);
    assert_eq!(report.after.in_progress, 2);
    assert_eq!(
        report.after.released, 1,
        "released records are kept for the retention"
    );
}

#[test]
fn import_round_trips_an_export_and_leaves_existing_records_alone() {
    let source = TestStore::new();
    drop(populated(&source));
    let exported = all_entries(&admin(&source).open_read_only().unwrap());
    let records: Vec<ImportRecord> = exported
        .iter()
        .map(|entry| {
            let record = entry.record.clone().unwrap();
            ImportRecord::new(
                entry.table.clone(),
                entry.consumer.as_deref(),
                &entry.key,
                record.epoch,
                record.fingerprint,
                record.state,
            )
            .unwrap()
        })
        .collect();

    let target = TestStore::new();
    drop(target.open());
    let admin_store = admin(&target).open_exclusive().unwrap();
    let counts = admin_store.import(&records, false).unwrap();
    assert_eq!(
        (counts.imported, counts.overwritten, counts.skipped),
        (7, 0, 0)
    );
    assert_eq!(all_entries(&admin_store), exported);
    let again = admin_store.import(&records, false).unwrap();
    assert_eq!((again.imported, again.skipped), (0, 7));
    let replaced = admin_store.import(&records, true).unwrap();
    assert_eq!((replaced.imported, replaced.overwritten), (0, 7));
    assert_eq!(all_entries(&admin_store), exported);

    let twice = [records[0].clone(), records[0].clone()];
    assert!(matches!(
        admin_store.import(&twice, true),
        Err(Error::InvalidArgument { .. })
    ));
    let unknown = ImportRecord::new(
        "no-such-table",
        None,
        b"k",
        1,
        fp("k"),
        RecordState::Released {
            released_at_ms: 1,
            removable_at_ms: 2,
        },
    )
    .unwrap();
    assert!(matches!(
        admin_store.import(&[unknown], false),
        Err(Error::UnknownTable { .. })
    ));
}

#[test]
fn verify_reports_undecodable_values() {
    let store = TestStore::new();
    let engine = populated(&store);
    // Plain RocksDB has no merge operator for `counters`: nothing may be left for its
    // recovery to flush.
    engine.flush().unwrap();
    drop(engine);
    {
        let names = rocksdb::DB::list_cf(&rocksdb::Options::default(), store.dir.path()).unwrap();
        let db =
            rocksdb::DB::open_cf(&rocksdb::Options::default(), store.dir.path(), names).unwrap();
        let records = db.cf_handle("idemdb.records").unwrap();
        let key = format::encode_key(b"c", b"broken").unwrap();
        db.put_cf(records, key, b"not a record").unwrap();
    }
    let admin_store = admin(&store).open_read_only().unwrap();
    let report = admin_store.verify().unwrap();
    assert_eq!(report.problems_total, 1);
    assert_eq!(report.checked, 8);
    let problem = &report.problems[0];
    assert_eq!(problem.table, "idemdb.records");
    assert_eq!(
        &problem.stored_key[..],
        &format::encode_key(b"c", b"broken").unwrap()[..]
    );
    assert_eq!(
        state_of(&admin_store, "c", "broken"),
        Some(EntryState::Corrupt)
    );
    assert_eq!(admin_store.stats().unwrap().totals().corrupt, 1);
}

#[test]
fn directories_without_an_idemdb_store_are_refused() {
    let empty = tempfile::tempdir().unwrap();
    let missing = empty.path().join("missing");
    for path in [empty.path(), missing.as_path()] {
        assert!(matches!(
            Store::builder(path).open_read_only(),
            Err(Error::IncompatibleStore { .. })
        ));
        assert!(matches!(
            Store::builder(path).open_exclusive(),
            Err(Error::IncompatibleStore { .. })
        ));
    }
    assert!(!missing.exists(), "opening must not create a store");
    // A plain RocksDB database is not a store either.
    let plain = tempfile::tempdir().unwrap();
    let mut options = rocksdb::Options::default();
    options.create_if_missing(true);
    drop(rocksdb::DB::open(&options, plain.path()).unwrap());
    assert!(matches!(
        Store::builder(plain.path()).open_read_only(),
        Err(Error::IncompatibleStore { .. })
    ));
}
