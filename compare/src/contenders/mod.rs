//! The list of contenders and how to set each up fresh for one timed run.
//!
//! Each contender's code is a file here: `embedded` (idemdb and what a user would write on
//! RocksDB), `peers` (Redis, SQLite, PostgreSQL), `pg_backend` (idemdb-postgres), `pg_floor` (the
//! least a claim costs on PostgreSQL). A new contender is a variant of [`Kind`] and its file.

pub mod embedded;
pub mod peers;
pub mod pg_backend;
pub mod pg_floor;

use std::path::Path;

use anyhow::Result;
use idemdb::Durability;

use crate::contenders::embedded::{Idemdb, Raw, RawMode, Transactional};
use crate::contenders::peers::{PostgresSession, RedisSession, SqliteSession, SqliteSync};
use crate::contenders::pg_floor::FloorShape;
use crate::workloads::{Session, Shape, WARM_UP_THREAD};

/// What runs: a store and its settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// idemdb as a user opens it: the default durable path (the commit log).
    Idemdb(Durability),
    /// idemdb on RocksDB's WAL (`EngineBuilder::without_commit_log`).
    IdemdbWal(Durability),
    /// idemdb's default path, `Durability::Sync`, batches through the library's pipeline
    /// (`Consumer::pipeline`), up to `depth` in flight.
    IdemdbLibraryPipeline {
        depth: usize,
    },
    /// idemdb, `Durability::Sync`, with the commit log instead of RocksDB's WAL
    /// (`EngineBuilder::commit_log`: 4 segments of 64 MiB).
    IdemdbCommitLog,
    /// [`Kind::IdemdbPipelined`] with the commit log.
    IdemdbCommitLogPipelined {
        depth: usize,
    },
    /// idemdb, `Durability::Sync`, batches committed with `commit_async`, up to `depth` in
    /// flight.
    IdemdbPipelined {
        depth: usize,
    },
    /// idemdb, re-delivering keys stored before the timed run (the duplicate path): still in
    /// the memtable, or flushed to table files first.
    IdemdbDuplicates {
        flushed: bool,
    },
    Raw(Durability, RawMode),
    Transaction(Durability),
    Redis {
        fsync_always: bool,
    },
    Sqlite(SqliteSync),
    Postgres {
        synchronous_commit: bool,
    },
    /// The raw insert of [`Kind::Postgres`] (`synchronous_commit` on) that also writes the
    /// business row of each message it inserted, in the same statement: the least a
    /// hand-written deduplication with a business row costs, beside [`Kind::IdemdbPostgres`].
    PostgresWithRow,
    /// The least a claim can cost on the same server as statements between `BEGIN` and
    /// `COMMIT`, with the business row (`crate::contenders::pg_floor`): the ceiling of a design of
    /// idemdb-postgres built that way. Its shape says how many round trips a single claim and
    /// a batch take (with `two_trips`, the claim's answer is waited for before the business
    /// row and `COMMIT` are sent, as a claim API that answers before the caller's SQL runs
    /// must; with `one_trip_batch`, the markers' `INSERT ... ON CONFLICT DO NOTHING RETURNING`
    /// and the winners' business rows are one statement sent with `BEGIN` and `COMMIT`), and
    /// whether it claims into idemdb's table or a key-only one.
    PostgresClaimFloor(FloorShape),
    /// idemdb's PostgreSQL backend on the same server, `synchronous_commit` on: a claim, the
    /// business row in its transaction, the commit; or with `apply`, the deliveries through
    /// `PgConsumer::apply` (the business row sent with the claim, one round trip for a new
    /// key).
    IdemdbPostgres {
        apply: bool,
    },
    /// 4 KiB write + fdatasync of a preallocated, already written file: the disk's own
    /// durable-write latency. With `append`, a 200-byte record appended to a file preallocated
    /// the way RocksDB preallocates its WAL (allocated, size kept): each fdatasync then also
    /// journals the file's new size, as a WAL's does. With `direct`, the 4 KiB in place go
    /// through an `O_DIRECT | O_DSYNC` descriptor instead (the commit log's synced writes).
    Fdatasync {
        append: bool,
        direct: bool,
    },
}

#[derive(Clone, Debug)]
pub struct Spec {
    pub name: String,
    pub kind: Kind,
    pub shape: Shape,
}

impl Spec {
    fn new(name: &str, kind: Kind, threads: usize, batch: usize, pipeline: usize) -> Spec {
        Spec {
            name: name.to_owned(),
            kind,
            shape: Shape {
                threads,
                batch,
                pipeline,
            },
        }
    }

    pub fn needs_redis(&self) -> bool {
        matches!(self.kind, Kind::Redis { .. })
    }

    pub fn needs_postgres(&self) -> bool {
        matches!(
            self.kind,
            Kind::Postgres { .. }
                | Kind::PostgresWithRow
                | Kind::PostgresClaimFloor(_)
                | Kind::IdemdbPostgres { .. }
        )
    }
}

/// Durable thread counts swept for the "durable throughput vs producers" chart.
pub const SWEEP_THREADS: [usize; 6] = [1, 2, 4, 8, 16, 32];

/// Every contender of a full run. Names are unique; the targets refer to them.
pub fn all() -> Vec<Spec> {
    use Durability::{Buffered, Sync};
    let mut specs = vec![
        // No fsync: the engine's own cost.
        Spec::new(
            "idemdb default buffered, 1 thread",
            Kind::Idemdb(Buffered),
            1,
            1,
            1,
        ),
        Spec::new(
            "idemdb default buffered, 2 threads",
            Kind::Idemdb(Buffered),
            2,
            1,
            1,
        ),
        Spec::new(
            "idemdb default buffered, batch 64",
            Kind::Idemdb(Buffered),
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb duplicates, 1 thread",
            Kind::IdemdbDuplicates { flushed: false },
            1,
            1,
            1,
        ),
        Spec::new(
            "idemdb duplicates from table files, 1 thread",
            Kind::IdemdbDuplicates { flushed: true },
            1,
            1,
            1,
        ),
        Spec::new(
            "rocksdb blind put, batch 64",
            Kind::Raw(Buffered, RawMode::BlindPut),
            1,
            64,
            1,
        ),
        Spec::new(
            "rocksdb get+write under lock, 1 thread",
            Kind::Raw(Buffered, RawMode::GetThenWrite),
            1,
            1,
            1,
        ),
        Spec::new(
            "rocksdb multi-get + write batch, batch 64",
            Kind::Raw(Buffered, RawMode::MultiGetThenWrite),
            1,
            64,
            1,
        ),
        Spec::new(
            "rocksdb TransactionDB, 2 threads",
            Kind::Transaction(Buffered),
            2,
            1,
            1,
        ),
        Spec::new(
            "redis no persistence, 50 clients",
            Kind::Redis {
                fsync_always: false,
            },
            50,
            1,
            1,
        ),
        Spec::new(
            "redis no persistence, 50 clients -P 16",
            Kind::Redis {
                fsync_always: false,
            },
            50,
            1,
            16,
        ),
        Spec::new(
            "sqlite NORMAL, 1 row/txn",
            Kind::Sqlite(SqliteSync::Normal),
            1,
            1,
            1,
        ),
        Spec::new(
            "postgres sync off, 1 client",
            Kind::Postgres {
                synchronous_commit: false,
            },
            1,
            1,
            1,
        ),
        Spec::new(
            "postgres sync off, 8 clients",
            Kind::Postgres {
                synchronous_commit: false,
            },
            8,
            1,
            1,
        ),
        Spec::new(
            "postgres sync off, 32 clients",
            Kind::Postgres {
                synchronous_commit: false,
            },
            32,
            1,
            1,
        ),
        // Durable: every acknowledged message survives a power loss.
        Spec::new(
            "fdatasync 4 KiB",
            Kind::Fdatasync {
                append: false,
                direct: false,
            },
            1,
            1,
            1,
        ),
        Spec::new(
            "direct write 4 KiB",
            Kind::Fdatasync {
                append: false,
                direct: true,
            },
            1,
            1,
            1,
        ),
        Spec::new(
            "fdatasync append 200 B",
            Kind::Fdatasync {
                append: true,
                direct: false,
            },
            1,
            1,
            1,
        ),
        Spec::new(
            "rocksdb get+write under lock sync, 1 thread",
            Kind::Raw(Sync, RawMode::GetThenWrite),
            1,
            1,
            1,
        ),
        Spec::new(
            "idemdb default sync, batch 64, library pipeline 4",
            Kind::IdemdbLibraryPipeline { depth: 4 },
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb default sync, batch 64, library pipeline 8",
            Kind::IdemdbLibraryPipeline { depth: 8 },
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb default sync, batch 64",
            Kind::Idemdb(Sync),
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync on RocksDB's WAL, batch 64",
            Kind::IdemdbWal(Sync),
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync on RocksDB's WAL, 1 thread",
            Kind::IdemdbWal(Sync),
            1,
            1,
            1,
        ),
        Spec::new(
            "idemdb sync on RocksDB's WAL, 32 threads",
            Kind::IdemdbWal(Sync),
            32,
            1,
            1,
        ),
        Spec::new(
            "idemdb buffered on RocksDB's WAL, batch 64",
            Kind::IdemdbWal(Buffered),
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync + commit log, batch 64",
            Kind::IdemdbCommitLog,
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync + commit log, batch 64, 2 in flight",
            Kind::IdemdbCommitLogPipelined { depth: 2 },
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync + commit log, batch 64, 3 in flight",
            Kind::IdemdbCommitLogPipelined { depth: 3 },
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync + commit log, batch 64, 4 in flight",
            Kind::IdemdbCommitLogPipelined { depth: 4 },
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync + commit log, batch 64, 8 in flight",
            Kind::IdemdbCommitLogPipelined { depth: 8 },
            1,
            64,
            1,
        ),
        Spec::new(
            "idemdb sync + commit log, 1 thread",
            Kind::IdemdbCommitLog,
            1,
            1,
            1,
        ),
        Spec::new(
            "idemdb sync + commit log, 32 threads",
            Kind::IdemdbCommitLog,
            32,
            1,
            1,
        ),
        Spec::new(
            "idemdb default sync, batch 64, 2 in flight",
            Kind::IdemdbPipelined { depth: 2 },
            1,
            64,
            1,
        ),
        Spec::new(
            "rocksdb blind put sync, batch 64",
            Kind::Raw(Sync, RawMode::BlindPut),
            1,
            64,
            1,
        ),
        // The commit log's floor: the same writes, made durable by a log written in place.
        Spec::new(
            "rocksdb blind put, own log in place, batch 64",
            Kind::Raw(Sync, RawMode::BlindPutOwnLog),
            1,
            64,
            1,
        ),
        Spec::new(
            "rocksdb blind put, own log in place, 1 thread",
            Kind::Raw(Sync, RawMode::BlindPutOwnLog),
            1,
            1,
            1,
        ),
        Spec::new(
            "rocksdb blind put sync, 1 thread",
            Kind::Raw(Sync, RawMode::BlindPut),
            1,
            1,
            1,
        ),
        Spec::new(
            "redis fsync always, 50 clients -P 16",
            Kind::Redis { fsync_always: true },
            50,
            1,
            16,
        ),
        Spec::new(
            "sqlite FULL, 1 row/txn",
            Kind::Sqlite(SqliteSync::Full),
            1,
            1,
            1,
        ),
        Spec::new(
            "sqlite FULL, 64 rows/txn",
            Kind::Sqlite(SqliteSync::Full),
            1,
            64,
            1,
        ),
        Spec::new(
            "postgres sync on, 8 clients, 64 rows/txn",
            Kind::Postgres {
                synchronous_commit: true,
            },
            8,
            64,
            1,
        ),
    ];
    for threads in SWEEP_THREADS {
        specs.push(sweep("idemdb default sync", Kind::Idemdb(Sync), threads));
        specs.push(sweep(
            "postgres sync on",
            Kind::Postgres {
                synchronous_commit: true,
            },
            threads,
        ));
        specs.push(sweep(
            "redis fsync always",
            Kind::Redis { fsync_always: true },
            threads,
        ));
    }
    specs.push(sweep(
        "redis fsync always",
        Kind::Redis { fsync_always: true },
        50,
    ));
    // The PostgreSQL backend beside the raw inserts of the sweep and the 64-row batches.
    for threads in POSTGRES_BACKEND_CLIENTS {
        specs.push(sweep("idemdb-postgres", PG_CLAIM, threads));
        specs.push(sweep("idemdb-postgres apply", PG_APPLY, threads));
        specs.push(sweep(
            "postgres sync on + business row",
            Kind::PostgresWithRow,
            threads,
        ));
        for (label, records) in [
            ("postgres claim floor", false),
            ("postgres record floor", true),
        ] {
            specs.push(sweep(label, floor(false, false, records), threads));
            specs.push(sweep(
                &format!("{label}, two round trips"),
                floor(true, false, records),
                threads,
            ));
        }
    }
    specs.push(Spec::new(
        "postgres sync on + business row, 8 clients, 64 rows/txn",
        Kind::PostgresWithRow,
        8,
        64,
        1,
    ));
    for (label, records) in [
        ("postgres claim floor", false),
        ("postgres record floor", true),
    ] {
        specs.push(Spec::new(
            &format!("{label}, 8 clients, batch 64"),
            floor(false, false, records),
            8,
            64,
            1,
        ));
        specs.push(Spec::new(
            &format!("{label} answering duplicates, 8 clients, batch 64"),
            floor(false, true, records),
            8,
            64,
            1,
        ));
    }
    specs.push(Spec::new(
        "idemdb-postgres, 8 clients, batch 64",
        PG_CLAIM,
        8,
        64,
        1,
    ));
    specs
}

/// A claim floor of this shape (see [`FloorShape`]).
const fn floor(two_trips: bool, one_trip_batch: bool, records: bool) -> Kind {
    Kind::PostgresClaimFloor(FloorShape {
        two_trips,
        one_trip_batch,
        records,
    })
}

/// The PostgreSQL backend's contenders: through `begin` + `commit_with`, or through `apply`.
const PG_CLAIM: Kind = Kind::IdemdbPostgres { apply: false };
const PG_APPLY: Kind = Kind::IdemdbPostgres { apply: true };

/// Client counts of the PostgreSQL backend's runs (each against the raw insert's).
pub const POSTGRES_BACKEND_CLIENTS: [usize; 3] = [1, 8, 32];

/// A point of the durable sweep: `"{label}, {threads} threads"`.
pub fn sweep(label: &str, kind: Kind, threads: usize) -> Spec {
    let unit = if matches!(
        kind,
        Kind::Redis { .. }
            | Kind::Postgres { .. }
            | Kind::PostgresWithRow
            | Kind::PostgresClaimFloor(_)
            | Kind::IdemdbPostgres { .. }
    ) {
        "clients"
    } else {
        "threads"
    };
    let unit = if threads == 1 {
        &unit[..unit.len() - 1]
    } else {
        unit
    };
    Spec::new(&format!("{label}, {threads} {unit}"), kind, threads, 1, 1)
}

/// Ports of the servers the harness starts.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub redis: u16,
    pub redis_fsync: u16,
    pub postgres: u16,
}

/// A contender set up fresh for one run: its sessions, and what must live until they finish.
pub struct Prepared {
    pub sessions: Vec<Box<dyn Session>>,
    /// The store (idemdb, RocksDB) the sessions share; dropped after the run.
    pub store: Option<Box<dyn std::any::Any>>,
}

impl Prepared {
    /// `threads` sessions on one embedded store, which lives as long as the result.
    fn sharing<S: 'static>(
        store: S,
        threads: usize,
        session: impl Fn(&S) -> Result<Box<dyn Session>>,
    ) -> Result<Prepared> {
        let sessions = (0..threads)
            .map(|_| session(&store))
            .collect::<Result<_>>()?;
        Ok(Prepared {
            sessions,
            store: Some(Box::new(store)),
        })
    }

    /// Sessions on a server, which outlives the run.
    fn connected(
        threads: usize,
        connect: impl Fn() -> Result<Box<dyn Session>>,
    ) -> Result<Prepared> {
        let sessions = (0..threads).map(|_| connect()).collect::<Result<_>>()?;
        Ok(Prepared {
            sessions,
            store: None,
        })
    }
}

/// Messages written before each of the two memtable flushes that bring a durable embedded store
/// to its steady state (its first WAL files obsolete), as after any real uptime.
const WARM_UP_MESSAGES: u64 = 50_000;

/// Brings a durable store to its steady state: two rounds of writes, each followed by a flush.
fn warm_up(
    session: impl Fn() -> Result<Box<dyn Session>>,
    flush: impl Fn() -> Result<()>,
) -> Result<()> {
    for _ in 0..2 {
        crate::workloads::fill(&mut *session()?, WARM_UP_THREAD, WARM_UP_MESSAGES)?;
        flush()?;
    }
    Ok(())
}

/// Keys stored before a duplicate-path run, re-delivered during it.
pub const DUPLICATE_RUN_KEYS: u64 = 200_000;

pub fn prepare(spec: &Spec, dir: &Path, ports: Ports) -> Result<Prepared> {
    let threads = spec.shape.threads;
    match spec.kind {
        Kind::Idemdb(durability) => {
            let store = Idemdb::open(dir, durability)?;
            if durability == Durability::Sync {
                warm_up(|| store.session(), || store.flush())?;
            }
            Prepared::sharing(store, threads, Idemdb::session)
        }
        Kind::IdemdbWal(durability) => {
            let store = Idemdb::open_wal(dir, durability)?;
            if durability == Durability::Sync {
                warm_up(|| store.session(), || store.flush())?;
            }
            Prepared::sharing(store, threads, Idemdb::session)
        }
        Kind::IdemdbLibraryPipeline { depth } => {
            let store = Idemdb::open(dir, Durability::Sync)?;
            warm_up(|| store.session(), || store.flush())?;
            Prepared::sharing(store, threads, move |store: &Idemdb| {
                store.library_pipeline_session(depth)
            })
        }
        Kind::IdemdbCommitLog => {
            let store = Idemdb::open_with_commit_log(dir)?;
            warm_up(|| store.session(), || store.flush())?;
            Prepared::sharing(store, threads, Idemdb::session)
        }
        Kind::IdemdbCommitLogPipelined { depth } => {
            let store = Idemdb::open_with_commit_log(dir)?;
            warm_up(|| store.session(), || store.flush())?;
            Prepared::sharing(store, threads, move |store: &Idemdb| {
                store.pipelined_session(depth)
            })
        }
        Kind::IdemdbPipelined { depth } => {
            let store = Idemdb::open(dir, Durability::Sync)?;
            warm_up(|| store.session(), || store.flush())?;
            Prepared::sharing(store, threads, move |store: &Idemdb| {
                store.pipelined_session(depth)
            })
        }
        Kind::IdemdbDuplicates { flushed } => {
            let store = Idemdb::open(dir, Durability::Buffered)?;
            crate::workloads::fill(&mut *store.session()?, 0, DUPLICATE_RUN_KEYS)?;
            if flushed {
                store.flush()?;
            }
            Prepared::sharing(store, threads, Idemdb::session)
        }
        Kind::Raw(durability, mode) => {
            let store = Raw::open(dir, durability, mode)?;
            if durability == Durability::Sync {
                warm_up(|| Ok(store.session()), || store.flush())?;
            }
            Prepared::sharing(store, threads, |store| Ok(store.session()))
        }
        Kind::Transaction(durability) => {
            let store = Transactional::open(dir, durability)?;
            Prepared::sharing(store, threads, |store| Ok(store.session()))
        }
        Kind::Redis { fsync_always } => {
            let port = if fsync_always {
                ports.redis_fsync
            } else {
                ports.redis
            };
            RedisSession::flush_all(port)?;
            Prepared::connected(threads, || Ok(Box::new(RedisSession::connect(port)?)))
        }
        Kind::Sqlite(sync) => {
            let path = dir.join("inbox.sqlite");
            Prepared::connected(threads, || Ok(Box::new(SqliteSession::open(&path, sync)?)))
        }
        Kind::Postgres { synchronous_commit } => {
            PostgresSession::reset(ports.postgres)?;
            Prepared::connected(threads, || {
                Ok(Box::new(PostgresSession::connect(
                    ports.postgres,
                    synchronous_commit,
                    false,
                )?))
            })
        }
        Kind::PostgresWithRow => {
            PostgresSession::reset(ports.postgres)?;
            Prepared::connected(threads, || {
                Ok(Box::new(PostgresSession::connect(
                    ports.postgres,
                    true,
                    true,
                )?))
            })
        }
        Kind::PostgresClaimFloor(shape) => {
            crate::contenders::pg_floor::reset(ports.postgres)?;
            Prepared::connected(threads, || {
                Ok(Box::new(
                    crate::contenders::pg_floor::ClaimFloorSession::connect(ports.postgres, shape)?,
                ))
            })
        }
        Kind::IdemdbPostgres { apply } => {
            crate::contenders::pg_backend::reset(ports.postgres)?;
            Prepared::connected(threads, || {
                Ok(Box::new(
                    crate::contenders::pg_backend::IdemdbPgSession::connect(
                        ports.postgres,
                        true,
                        apply,
                    )?,
                ))
            })
        }
        Kind::Fdatasync { append, direct } => Ok(Prepared {
            sessions: vec![Box::new(crate::contenders::embedded::Fdatasync::create(
                dir, append, direct,
            )?)],
            store: None,
        }),
    }
}
