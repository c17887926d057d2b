//! Test helpers: a temporary store on a mock clock, removed when dropped.

use idemdb::{Durability, Engine, EngineBuilder, MockClock, TableOptions, merge_ops};
use tempfile::TempDir;

/// The mock clock's starting time: a fixed, realistic instant (2026-01-01T00:00:00Z).
pub const START_MS: u64 = 1_767_225_600_000;

/// A store directory that is deleted on drop, with the clock its engines use.
pub struct TestStore {
    pub dir: TempDir,
    pub clock: MockClock,
}

impl TestStore {
    pub fn new() -> TestStore {
        TestStore {
            dir: tempfile::tempdir().expect("temp dir"),
            clock: MockClock::new(START_MS),
        }
    }

    /// The builder every test starts from: mock clock, buffered WAL (crash-safe for a process
    /// crash, which is all these tests simulate), an `orders` table, a `counters` table with an
    /// add-u64 merge operator, and a `customers` entity table.
    pub fn builder(&self) -> EngineBuilder {
        self.builder_at(self.dir.path())
    }

    /// The same declaration for a store at `path` (a copy of this one, say).
    pub fn builder_at(&self, path: &std::path::Path) -> EngineBuilder {
        Engine::builder(path)
            .clock(self.clock.clone())
            .durability(Durability::Buffered)
            .write_buffer_bytes(4 << 20)
            .business_table(TableOptions::new("orders"))
            .business_table(
                TableOptions::new("counters").merge_operator("add_u64", merge_ops::add_u64),
            )
            .entity_table("customers")
    }

    pub fn clock_now(&self) -> u64 {
        idemdb::Clock::now_ms(&self.clock)
    }

    pub fn open(&self) -> Engine {
        self.builder().open().expect("open test store")
    }
}

/// Every column family of a store opened with [`TestStore::builder`], for tests that open it with
/// plain RocksDB.
pub const TABLES: [&str; 7] = [
    "default",
    "idemdb.records",
    "idemdb.versions",
    "idemdb.positions",
    "orders",
    "counters",
    "customers",
];

/// The value of a counter in the `counters` table (0 when absent).
pub fn counter(engine: &Engine, name: &str) -> u64 {
    let counters = engine.business_table("counters").unwrap();
    counters.get(name).unwrap().map_or(0, |value| {
        merge_ops::read_u64(&value).expect("8-byte counter")
    })
}

/// Every file of the store at `path` and its bytes, but RocksDB's info logs (`LOG`,
/// `LOG.old.<time>`), which any open, read-only ones included, starts anew.
pub fn store_files(path: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(path)
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.file_type().unwrap().is_file())
        .map(|entry| entry.file_name().into_string().unwrap())
        .filter(|name| name != "LOG" && !name.starts_with("LOG.old."))
        .map(|name| {
            let bytes = std::fs::read(path.join(&name)).unwrap();
            (name, bytes)
        })
        .collect()
}

/// Asserts that `open` is refused with the error `expected` accepts and leaves every file of
/// the store at `path` as it was.
pub fn assert_refused_without_change<T: std::fmt::Debug>(
    path: &std::path::Path,
    what: &str,
    expected: impl Fn(&idemdb::Error) -> bool,
    open: impl FnOnce() -> idemdb::Result<T>,
) {
    let before = store_files(path);
    match open() {
        Err(error) if expected(&error) => {}
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
    let after = store_files(path);
    let changed: Vec<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|name| before.get(*name) != after.get(*name))
        .collect();
    assert!(
        changed.is_empty(),
        "{what}: the refused open changed {changed:?}"
    );
}

/// An `IncompatibleStore` refusal.
pub fn incompatible(error: &idemdb::Error) -> bool {
    matches!(error, idemdb::Error::IncompatibleStore { .. })
}
