//! Guards the operator tools' offline backup and restore (`admin::Store::backup`,
//! `admin::Backup`): a business table's unflushed merge operands reach the backup unfolded,
//! through the WAL, and are summed by the application's operator once the restored store opens;
//! table files are hard-linked on the store's file system; restoring and opening the restored
//! store leave the backup unchanged.

use std::path::Path;

use crate::files::{contents, names};
use crate::util::{TestStore, counter};
use idemdb::admin::{Backup, Store, Transfer};
use idemdb::{Engine, Error, Fingerprint, Outcome};

/// Checks that no file of `copy` is a hard link to a file of `original` (same inode): a
/// restore must survive the loss of the backup's disk, and the other way round.
#[track_caller]
fn assert_no_shared_file(original: &Path, copy: &Path) {
    use std::os::unix::fs::MetadataExt;
    let inodes = |dir: &Path| -> Vec<(u64, u64)> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| {
                let metadata = entry.unwrap().metadata().unwrap();
                (metadata.dev(), metadata.ino())
            })
            .collect()
    };
    let original = inodes(original);
    assert!(
        inodes(copy).iter().all(|inode| !original.contains(inode)),
        "a restored file is a hard link to the backup's"
    );
}

fn files_ending(dir: &Path, suffix: &str) -> Vec<String> {
    contents(dir)
        .into_iter()
        .filter(|(name, bytes)| name.ends_with(suffix) && !bytes.is_empty())
        .map(|(name, _)| name)
        .collect()
}

/// Commits `key` for consumer `c` with a row in `orders`; `counter` adds to (or, with `Set`,
/// puts) the counter `n`.
fn commit(engine: &Engine, key: &str, counter: Counter) {
    let consumer = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    let counters = engine.business_table("counters").unwrap();
    let Outcome::Fresh(mut claim) = consumer.begin(key, Fingerprint::of(key)).unwrap() else {
        panic!("{key}: expected fresh");
    };
    claim.put(&orders, key, key).unwrap();
    match counter {
        Counter::Set(value) => claim.put(&counters, "n", value.to_be_bytes()).unwrap(),
        Counter::Add(value) => claim.merge(&counters, "n", value.to_be_bytes()).unwrap(),
    }
    claim.commit(key).unwrap();
}

enum Counter {
    Set(u64),
    Add(u64),
}

#[test]
fn a_backup_keeps_unflushed_merge_operands_and_restores_their_sum() {
    let store = TestStore::new();
    let engine = store.open();
    // Flushed: table files for the backup to hard-link.
    for index in 0..20 {
        commit(&engine, &format!("old-{index}"), Counter::Add(1));
    }
    engine.flush().unwrap();
    // Unflushed: a base value and merge operands on top of it, in the WAL only. A flush under
    // the tools' stand-in operator would have to fold them, and must not happen.
    commit(&engine, "base", Counter::Set(100));
    for index in 0..5 {
        commit(&engine, &format!("new-{index}"), Counter::Add(index + 1));
    }
    assert_eq!(counter(&engine, "n"), 115);
    drop(engine);

    let elsewhere = tempfile::tempdir().unwrap();
    let backup_dir = elsewhere.path().join("backup");
    let admin = Store::builder(store.dir.path()).open_exclusive().unwrap();
    let report = admin.backup(&backup_dir, |_, _| {}).unwrap();
    drop(admin);
    assert_eq!(report.transfer, Transfer::HardLinks);
    assert!(report.linked_files > 0, "{report:?}");
    assert_eq!(report.files, contents(&backup_dir).len() as u64);
    assert!(
        !files_ending(&backup_dir, ".log").is_empty(),
        "the unflushed commits are in the backup's WAL"
    );
    let before = contents(&backup_dir);

    let restored = elsewhere.path().join("restored");
    let backup = Backup::open(&backup_dir).unwrap();
    let restore = backup.restore(&restored, |_, _| {}).unwrap();
    drop(backup);
    assert_eq!(restore.transfer, Transfer::Copy);
    assert_eq!(restore.files, before.len() as u64);
    assert_eq!(
        contents(&backup_dir),
        before,
        "the restore wrote into the backup"
    );
    assert_no_shared_file(&backup_dir, &restored);

    let engine = store.builder_at(&restored).open().unwrap();
    assert_eq!(counter(&engine, "n"), 115, "100 + 1 + 2 + 3 + 4 + 5");
    let consumer = engine.consumer("c").unwrap();
    let orders = engine.business_table("orders").unwrap();
    for key in (0..20)
        .map(|index| format!("old-{index}"))
        .chain(["base".to_owned()])
        .chain((0..5).map(|index| format!("new-{index}")))
    {
        assert!(consumer.get(&key).unwrap().is_some(), "{key}: no record");
        assert!(orders.get(&key).unwrap().is_some(), "{key}: no orders row");
    }
    // Writes, flushes (which retire the replayed WAL files) and a compaction in the restored
    // store: none may reach the backup.
    for round in 0..3 {
        commit(&engine, &format!("after-{round}"), Counter::Add(1));
        engine.flush().unwrap();
    }
    commit(&engine, "after-flushes", Counter::Add(1));
    engine.compact().unwrap();
    drop(engine);
    assert_eq!(
        contents(&backup_dir),
        before,
        "the restored store's writes reached the backup"
    );
    // The store itself still opens with every commit, and only those.
    assert_eq!(counter(&store.open(), "n"), 115);
}

#[test]
fn backup_and_restore_refuse_existing_targets_and_read_only_stores() {
    let store = TestStore::new();
    commit(&store.open(), "k", Counter::Add(1));
    let elsewhere = tempfile::tempdir().unwrap();
    let existing = elsewhere.path().join("existing");
    std::fs::create_dir(&existing).unwrap();

    let read_only = Store::builder(store.dir.path()).open_read_only().unwrap();
    let fresh = elsewhere.path().join("fresh");
    assert!(matches!(
        read_only.backup(&fresh, |_, _| {}),
        Err(Error::ReadOnly)
    ));
    drop(read_only);
    let admin = Store::builder(store.dir.path()).open_exclusive().unwrap();
    for target in [
        existing.clone(),
        elsewhere.path().join("missing-parent/backup"),
    ] {
        assert!(matches!(
            admin.backup(&target, |_, _| {}),
            Err(Error::InvalidArgument { .. })
        ));
    }
    let store_files = names(store.dir.path());
    assert!(matches!(
        admin.backup(&store.dir.path().join("inside"), |_, _| {}),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(
        names(store.dir.path()),
        store_files,
        "a backup inside the store"
    );
    admin.backup(&fresh, |_, _| {}).unwrap();
    drop(admin);
    let backup = Backup::open(&fresh).unwrap();
    let backup_files = contents(&fresh);
    for target in [existing.clone(), fresh.join("inside")] {
        assert!(matches!(
            backup.restore(&target, |_, _| {}),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert_eq!(
        contents(&fresh),
        backup_files,
        "a restore inside the backup"
    );
    assert!(matches!(
        Backup::open(&existing),
        Err(Error::IncompatibleStore { .. })
    ));
    // Nothing but the one backup was written.
    assert_eq!(names(elsewhere.path()), ["existing", "fresh"]);
    assert!(contents(&existing).is_empty());
}
