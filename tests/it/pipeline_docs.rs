//! Written from the public documentation only (Pipeline, AsyncPipeline, Settled, Durable,
//! PIPELINE_DEPTH_MAX, Consumer::pipeline / async_pipeline, Error::PipelineBroken, the commit
//! log's builder calls and constants, Claim / ClaimBatch::commit_async, README, design.md).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex};

use idemdb::{
    COMMIT_LOG_SEGMENT_BYTES_DEFAULT, COMMIT_LOG_SEGMENT_BYTES_MAX, COMMIT_LOG_SEGMENT_BYTES_MIN,
    COMMIT_LOG_SEGMENTS_MAX, COMMIT_LOG_SEGMENTS_MIN, Claim, Consumer, Durability, Durable, Engine,
    EngineBuilder, Error, Fault, FaultInjector, Fingerprint, IoPoint, Limit, Message, Outcome,
    PIPELINE_DEPTH_MAX, RESULT_BYTES_MAX, RecordState, Settled, TableOptions,
};

// ---------------------------------------------------------------- helpers

fn fp(key: &str) -> Fingerprint {
    Fingerprint::of(key.as_bytes())
}

fn fresh(consumer: &Consumer, key: &str) -> Claim {
    match consumer.begin(key, fp(key)).expect("begin") {
        Outcome::Fresh(claim) => claim,
        other => panic!("{key}: expected Fresh, got {other:?}"),
    }
}

/// The stored result of a completed record, if any.
fn completed(consumer: &Consumer, key: &str) -> Option<Vec<u8>> {
    match consumer.get(key).expect("get")?.state {
        RecordState::Completed { result, .. } => Some(result.to_vec()),
        _ => None,
    }
}

fn is_duplicate(consumer: &Consumer, key: &str) -> bool {
    matches!(
        consumer.begin(key, fp(key)).expect("begin"),
        Outcome::Duplicate { .. }
    )
}

fn tags<T: Clone>(settled: &[Settled<T>]) -> Vec<T> {
    settled.iter().map(|s| s.tag.clone()).collect()
}

fn broken(outcome: &idemdb::Result<Durable>) -> bool {
    matches!(outcome, Err(Error::PipelineBroken { .. }))
}

/// The files in `<store>/idemdb-log` (it holds no folder): (name, length).
fn log_files(store: &Path) -> Vec<(String, u64)> {
    crate::files::lengths(&store.join("idemdb-log"))
}

/// Blocks every `IoPoint::Write` while armed and closed; counts the calls it held.
#[derive(Debug, Default)]
struct Gate {
    armed: AtomicBool,
    open: Mutex<bool>,
    opened: Condvar,
    held: AtomicUsize,
    held_changed: Condvar,
}

impl Gate {
    fn close(&self) {
        *self.open.lock().unwrap() = false;
        self.armed.store(true, Ordering::SeqCst);
    }
    /// Waits until `n` writes are held (a safety bound, not a timing assertion).
    fn wait_held(&self, n: usize) {
        let mut open = self.open.lock().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while self.held.load(Ordering::SeqCst) < n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            assert!(!left.is_zero(), "the injector never saw {n} held writes");
            open = self.held_changed.wait_timeout(open, left).unwrap().0;
        }
    }
    fn release(&self) {
        *self.open.lock().unwrap() = true;
        self.armed.store(false, Ordering::SeqCst);
        self.opened.notify_all();
    }
}

#[derive(Debug, Clone)]
struct GateInjector(Arc<Gate>);

impl FaultInjector for GateInjector {
    fn fault(&self, point: IoPoint) -> Fault {
        if matches!(point, IoPoint::Write) && self.0.armed.load(Ordering::SeqCst) {
            let mut open = self.0.open.lock().unwrap();
            self.0.held.fetch_add(1, Ordering::SeqCst);
            self.0.held_changed.notify_all();
            while !*open {
                open = self.0.opened.wait(open).unwrap();
            }
        }
        Fault::None
    }
}

/// Fails every `IoPoint::Write` while on.
#[derive(Debug, Clone, Default)]
struct FailSwitch(Arc<AtomicBool>);

impl FaultInjector for FailSwitch {
    fn fault(&self, point: IoPoint) -> Fault {
        if matches!(point, IoPoint::Write) && self.0.load(Ordering::SeqCst) {
            Fault::FailBefore
        } else {
            Fault::None
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum LogPath {
    Default,
    Wal,
}

fn builder(dir: &Path, path: LogPath) -> EngineBuilder {
    match path {
        LogPath::Default => Engine::builder(dir),
        LogPath::Wal => Engine::builder(dir).without_commit_log(),
    }
}

// ---------------------------------------------------------------- depth

fn assert_depth_error<P: std::fmt::Debug>(result: idemdb::Result<P>, depth: usize) {
    match result {
        Err(Error::LimitExceeded {
            limit: Limit::PipelineDepth,
            actual,
            min,
            max,
        }) => {
            assert_eq!(actual, depth as u64);
            assert_eq!(min, 1);
            assert_eq!(max, PIPELINE_DEPTH_MAX as u64);
        }
        other => panic!("depth {depth}: expected LimitExceeded(PipelineDepth), got {other:?}"),
    }
}

#[test]
fn depth_limits_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    assert_depth_error(orders.pipeline::<u64>(0), 0);
    assert_depth_error(
        orders.pipeline::<u64>(PIPELINE_DEPTH_MAX + 1),
        PIPELINE_DEPTH_MAX + 1,
    );
    assert_depth_error(orders.pipeline::<u64>(usize::MAX), usize::MAX);
    assert_depth_error(orders.async_pipeline::<u64>(0), 0);
    assert_depth_error(
        orders.async_pipeline::<u64>(PIPELINE_DEPTH_MAX + 1),
        PIPELINE_DEPTH_MAX + 1,
    );
    assert!(orders.pipeline::<u64>(1).is_ok());
    assert!(orders.async_pipeline::<u64>(PIPELINE_DEPTH_MAX).is_ok());

    // PIPELINE_DEPTH_MAX really keeps that many commits: hand over MAX, all settle in order.
    let mut pipeline = orders.pipeline::<usize>(PIPELINE_DEPTH_MAX).unwrap();
    for i in 0..PIPELINE_DEPTH_MAX {
        pipeline.commit(fresh(&orders, &format!("max-{i}")), b"done", i);
        assert!(pipeline.in_flight() <= PIPELINE_DEPTH_MAX);
    }
    let mut all = pipeline.settled();
    all.extend(pipeline.wait());
    assert_eq!(tags(&all), (0..PIPELINE_DEPTH_MAX).collect::<Vec<_>>());
    assert!(
        all.iter()
            .all(|s| matches!(s.outcome, Ok(Durable::Claim(_))))
    );
}

// ---------------------------------------------------------------- order

#[test]
fn doc_example_duplicate_in_flight_passes_in_turn() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    let mut pipeline = orders.pipeline(4).unwrap();
    let mut acknowledged = Vec::new();
    for (tag, key) in [(1_u64, "m-1"), (2, "m-2"), (3, "m-1"), (4, "m-3")] {
        match orders.begin(key, fp(key)).unwrap() {
            Outcome::Fresh(claim) => pipeline.commit(claim, b"done", tag),
            Outcome::Duplicate { .. } | Outcome::InProgress { .. } => pipeline.pass(tag),
            other => panic!("{other:?}"),
        }
        for settled in pipeline.settled() {
            settled.outcome.unwrap();
            acknowledged.push(settled.tag);
        }
    }
    for settled in pipeline.wait() {
        settled.outcome.unwrap();
        acknowledged.push(settled.tag);
    }
    assert_eq!(acknowledged, [1, 2, 3, 4]);
}

fn order_every_tag_once(path: LogPath, durability: Durability) {
    let dir = tempfile::tempdir().unwrap();
    let engine = builder(dir.path(), path)
        .durability(durability)
        .open()
        .unwrap();
    let orders = engine.consumer("orders").unwrap();
    let depth = 8;
    let mut pipeline = orders.pipeline::<usize>(depth).unwrap();
    let mut settled_all: Vec<Settled<usize>> = Vec::new();
    let mut committed_keys = Vec::new();
    let mut kinds = Vec::new(); // true: a commit, false: a pass
    let check_visible =
        |orders: &Consumer, batch: &[Settled<usize>], keys: &HashMap<usize, String>| {
            for s in batch {
                if let (Ok(Durable::Claim(_)), Some(key)) = (&s.outcome, keys.get(&s.tag)) {
                    // "Ok once the entry's commit ... is durable (visible to reads)"
                    assert_eq!(
                        completed(orders, key).as_deref(),
                        Some(&b"done"[..]),
                        "{key}"
                    );
                }
            }
        };
    let mut key_of_tag = HashMap::new();
    for tag in 0..300_usize {
        // every third message repeats an earlier key
        let key = if tag % 3 == 2 {
            format!("k-{}", tag / 2)
        } else {
            format!("k-{tag}")
        };
        match orders.begin(&key, fp(&key)).unwrap() {
            Outcome::Fresh(claim) => {
                pipeline.commit(claim, b"done", tag);
                committed_keys.push(key.clone());
                key_of_tag.insert(tag, key);
                kinds.push(true);
            }
            Outcome::Duplicate { .. } | Outcome::InProgress { .. } => {
                pipeline.pass(tag);
                kinds.push(false);
            }
            other => panic!("{other:?}"),
        }
        assert!(
            pipeline.in_flight() <= depth,
            "in_flight {} > {depth}",
            pipeline.in_flight()
        );
        let batch = pipeline.settled();
        check_visible(&orders, &batch, &key_of_tag);
        settled_all.extend(batch);
    }
    let rest = pipeline.wait();
    check_visible(&orders, &rest, &key_of_tag);
    settled_all.extend(rest);
    assert_eq!(pipeline.in_flight(), 0);
    assert!(pipeline.settled().is_empty(), "an entry came back twice");
    assert!(pipeline.wait().is_empty(), "an entry came back twice");
    assert_eq!(
        tags(&settled_all),
        (0..300).collect::<Vec<_>>(),
        "order or multiplicity"
    );
    for (s, is_commit) in settled_all.iter().zip(&kinds) {
        match (&s.outcome, is_commit) {
            (Ok(Durable::Claim(c)), true) => assert_eq!(c.epoch, 1),
            (Ok(Durable::Passed), false) => {}
            other => panic!("tag {}: {other:?}", s.tag),
        }
    }
    drop(pipeline);
    drop(orders);
    drop(engine);
    let engine = builder(dir.path(), path)
        .durability(durability)
        .open()
        .unwrap();
    let orders = engine.consumer("orders").unwrap();
    for key in &committed_keys {
        assert_eq!(
            completed(&orders, key).as_deref(),
            Some(&b"done"[..]),
            "{key} after reopen"
        );
    }
}

#[test]
fn order_every_tag_once_sync_default_log() {
    order_every_tag_once(LogPath::Default, Durability::Sync);
}

#[test]
fn order_every_tag_once_sync_wal() {
    order_every_tag_once(LogPath::Wal, Durability::Sync);
}

#[test]
fn order_every_tag_once_buffered_default_log() {
    order_every_tag_once(LogPath::Default, Durability::Buffered);
}

#[test]
fn order_every_tag_once_buffered_wal() {
    order_every_tag_once(LogPath::Wal, Durability::Buffered);
}

#[test]
fn pass_on_an_empty_pipeline_settles_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    let mut pipeline = orders.pipeline::<&str>(2).unwrap();
    assert!(pipeline.settled().is_empty());
    assert!(pipeline.wait().is_empty());
    pipeline.pass("a");
    pipeline.pass("b");
    let settled = pipeline.settled();
    assert_eq!(tags(&settled), ["a", "b"]);
    assert!(
        settled
            .iter()
            .all(|s| matches!(s.outcome, Ok(Durable::Passed)))
    );
    assert_eq!(pipeline.in_flight(), 0);
}

// ---------------------------------------------------------------- held commits (gate)

fn gated_pass_waits_for_earlier(path: LogPath) {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let engine = builder(dir.path(), path)
        .fault_injector(GateInjector(gate.clone()))
        .open()
        .unwrap();
    let orders = engine.consumer("orders").unwrap();
    let billing = engine.consumer("billing").unwrap();
    let mut pipeline = orders.pipeline::<u32>(4).unwrap();
    gate.close();
    pipeline.commit(fresh(&orders, "k1"), b"done", 1);
    pipeline.pass(2);
    // The same key while its commit is in flight: held, never Fresh.
    match orders.begin("k1", fp("k1")).unwrap() {
        Outcome::InProgress {
            holder,
            lease_until_ms,
            ..
        } => {
            assert!(
                holder.is_none() && lease_until_ms.is_none(),
                "an in-process claim"
            );
        }
        other => panic!("k1 while its commit is in flight: {other:?}"),
    }
    // Another consumer's key of the same name is its own (composite keys) and may go through
    // this pipeline too.
    pipeline.commit(fresh(&billing, "k1"), b"billed", 3);
    gate.wait_held(1);
    assert!(
        pipeline.settled().is_empty(),
        "settled while the first commit is not durable"
    );
    assert!(
        pipeline.in_flight() >= 1 && pipeline.in_flight() <= 2,
        "{}",
        pipeline.in_flight()
    );
    assert!(completed(&orders, "k1").is_none(), "visible before durable");
    gate.release();
    let all = pipeline.wait();
    assert_eq!(tags(&all), [1, 2, 3]);
    assert!(
        matches!(all[0].outcome, Ok(Durable::Claim(_))),
        "{:?}",
        all[0].outcome
    );
    assert!(
        matches!(all[1].outcome, Ok(Durable::Passed)),
        "{:?}",
        all[1].outcome
    );
    assert!(
        matches!(all[2].outcome, Ok(Durable::Claim(_))),
        "{:?}",
        all[2].outcome
    );
    assert!(is_duplicate(&orders, "k1"));
    assert_eq!(completed(&billing, "k1").as_deref(), Some(&b"billed"[..]));
}

#[test]
fn gated_pass_waits_for_earlier_default_log() {
    gated_pass_waits_for_earlier(LogPath::Default);
}

#[test]
fn gated_pass_waits_for_earlier_wal() {
    gated_pass_waits_for_earlier(LogPath::Wal);
}

#[test]
fn gated_depth_back_pressure() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let engine = Engine::builder(dir.path())
        .without_commit_log()
        .fault_injector(GateInjector(gate.clone()))
        .open()
        .unwrap();
    let orders = engine.consumer("orders").unwrap();
    let mut pipeline = orders.pipeline::<u32>(2).unwrap();
    gate.close();
    pipeline.commit(fresh(&orders, "a"), b"done", 1);
    pipeline.commit(fresh(&orders, "b"), b"done", 2);
    assert_eq!(pipeline.in_flight(), 2);
    assert!(pipeline.settled().is_empty());
    // The third commit must wait for the oldest: let the writes go from another thread.
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || gate.release())
    };
    pipeline.commit(fresh(&orders, "c"), b"done", 3);
    opener.join().unwrap();
    assert!(pipeline.in_flight() <= 2, "{}", pipeline.in_flight());
    let mut all = pipeline.settled();
    assert_eq!(
        all.first().map(|s| s.tag),
        Some(1),
        "the oldest was waited for"
    );
    all.extend(pipeline.wait());
    assert_eq!(tags(&all), [1, 2, 3]);
}

#[test]
fn in_flight_never_exceeds_depth() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    for depth in [1, 2, 3, 16] {
        let mut pipeline = orders.pipeline::<usize>(depth).unwrap();
        let mut n = 0;
        for i in 0..200 {
            pipeline.commit(fresh(&orders, &format!("d{depth}-{i}")), b"x", i);
            assert!(
                pipeline.in_flight() <= depth,
                "depth {depth}: {}",
                pipeline.in_flight()
            );
            n += pipeline.settled().len();
        }
        n += pipeline.wait().len();
        assert_eq!(n, 200);
    }
}

#[test]
fn drop_pipeline_with_commits_in_flight_commits_stand() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    {
        let engine = Engine::builder(dir.path())
            .fault_injector(GateInjector(gate.clone()))
            .open()
            .unwrap();
        let orders = engine.consumer("orders").unwrap();
        let mut pipeline = orders.pipeline::<u32>(8).unwrap();
        gate.close();
        for i in 0..5 {
            pipeline.commit(fresh(&orders, &format!("held-{i}")), b"done", i);
        }
        drop(pipeline);
        gate.release();
        // and many not held, dropped at once
        let mut pipeline = orders.pipeline::<u32>(64).unwrap();
        for i in 0..200 {
            pipeline.commit(fresh(&orders, &format!("free-{i}")), b"done", i);
        }
        drop(pipeline);
    }
    // Engine: "every handle keeps the store open, and it closes when the last clone and
    // handle are dropped". Every handle is dropped here.
    // Pipeline: commits in flight keep the store open until written (a reopen right after may
    // be AlreadyOpen for a few milliseconds).
    let (engine, _refused) = open_eventually(dir.path());
    let orders = engine.consumer("orders").unwrap();
    for i in 0..5 {
        assert!(is_duplicate(&orders, &format!("held-{i}")), "held-{i} lost");
    }
    for i in 0..200 {
        assert!(is_duplicate(&orders, &format!("free-{i}")), "free-{i} lost");
    }
}

/// Opens, retrying while the store is still held by commits in flight (polling, not asserting).
fn open_eventually(dir: &Path) -> (Engine, usize) {
    for tries in 0..2000 {
        match Engine::builder(dir).open() {
            Ok(engine) => return (engine, tries),
            Err(Error::AlreadyOpen { .. }) => {
                std::thread::sleep(std::time::Duration::from_millis(5))
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    panic!("the store never closed after every handle was dropped");
}

// ---------------------------------------------------------------- batches

#[test]
fn mixed_claims_and_batches_durable_variants() {
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        Engine::builder(dir.path())
            .business_table(TableOptions::new("orders"))
            .open()
            .unwrap()
    };
    let engine = open();
    let orders_table = engine.business_table("orders").unwrap();
    let billing = engine.consumer("billing").unwrap();
    // "old" is already committed before the batch.
    fresh(&billing, "old").commit(b"old-result").unwrap();

    let mut pipeline = billing.pipeline::<&str>(4).unwrap();
    let mut claim = fresh(&billing, "solo");
    claim.put(&orders_table, "solo", "solo-row").unwrap();
    pipeline.commit(claim, b"solo-result", "t-solo");

    let keys = ["a", "a", "b", "c", "old"];
    let messages: Vec<Message> = keys.iter().map(|k| Message::new(*k, fp(k))).collect();
    let mut batch = billing.begin_batch(&messages).unwrap();
    assert!(matches!(batch.outcomes()[0], idemdb::BatchOutcome::Fresh));
    assert!(matches!(
        batch.outcomes()[1],
        idemdb::BatchOutcome::DuplicateInBatch { first: 0 }
    ));
    assert!(matches!(batch.outcomes()[2], idemdb::BatchOutcome::Fresh));
    assert!(matches!(batch.outcomes()[3], idemdb::BatchOutcome::Fresh));
    assert!(matches!(
        batch.outcomes()[4],
        idemdb::BatchOutcome::Settled(Outcome::Duplicate { .. })
    ));
    batch
        .claim_mut(2)
        .unwrap()
        .put(&orders_table, "b", "b-row")
        .unwrap();
    batch.release(3);
    pipeline.commit_batch(batch, |i| format!("r{i}"), "t-batch");
    pipeline.pass("t-pass");
    let mut claim = fresh(&billing, "last");
    claim.put(&orders_table, "last", "last-row").unwrap();
    pipeline.commit(claim, b"last-result", "t-last");

    let mut all = pipeline.settled();
    all.extend(pipeline.wait());
    assert_eq!(tags(&all), ["t-solo", "t-batch", "t-pass", "t-last"]);
    match &all[0].outcome {
        Ok(Durable::Claim(c)) => {
            let record = billing.get("solo").unwrap().unwrap();
            assert_eq!(c.epoch, record.epoch);
            match record.state {
                RecordState::Completed {
                    committed_at_ms,
                    expires_at_ms,
                    ..
                } => {
                    assert_eq!(c.committed_at_ms, committed_at_ms);
                    assert_eq!(c.expires_at_ms, expires_at_ms);
                }
                other => panic!("{other:?}"),
            }
        }
        other => panic!("{other:?}"),
    }
    match &all[1].outcome {
        Ok(Durable::Batch(committed)) => {
            assert_eq!(committed.len(), 5);
            let some: Vec<bool> = committed.iter().map(Option::is_some).collect();
            assert_eq!(some, [true, false, true, false, false], "{committed:?}");
            assert_eq!(committed[0].unwrap().epoch, 1);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(all[2].outcome, Ok(Durable::Passed)));
    assert!(matches!(all[3].outcome, Ok(Durable::Claim(_))));

    let check = |engine: &Engine| {
        let billing = engine.consumer("billing").unwrap();
        let table = engine.business_table("orders").unwrap();
        assert_eq!(
            completed(&billing, "solo").as_deref(),
            Some(&b"solo-result"[..])
        );
        assert_eq!(completed(&billing, "a").as_deref(), Some(&b"r0"[..]));
        assert_eq!(completed(&billing, "b").as_deref(), Some(&b"r2"[..]));
        assert_eq!(completed(&billing, "c"), None, "released claim written");
        assert_eq!(
            completed(&billing, "old").as_deref(),
            Some(&b"old-result"[..])
        );
        assert_eq!(
            completed(&billing, "last").as_deref(),
            Some(&b"last-result"[..])
        );
        assert_eq!(
            table.get("solo").unwrap().as_deref(),
            Some(&b"solo-row"[..])
        );
        assert_eq!(table.get("b").unwrap().as_deref(), Some(&b"b-row"[..]));
        assert_eq!(
            table.get("last").unwrap().as_deref(),
            Some(&b"last-row"[..])
        );
        // the released key is free again
        assert!(matches!(
            billing.begin("c", fp("c")).unwrap(),
            Outcome::Fresh(_)
        ));
    };
    check(&engine);
    drop((pipeline, billing, orders_table, engine));
    let engine = open();
    check(&engine);
}

// ---------------------------------------------------------------- threads

fn threads_each_own_pipeline(path: LogPath, durability: Durability) {
    const THREADS: usize = 8;
    const KEYS: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let engine = builder(dir.path(), path)
        .durability(durability)
        .open()
        .unwrap();
    let committed: Arc<Mutex<HashMap<usize, usize>>> = Arc::default();
    let barrier = Arc::new(Barrier::new(THREADS));
    let redelivery = Arc::new(Mutex::new(()));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let redelivery = redelivery.clone();
            let engine = engine.clone();
            let committed = committed.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let orders = engine.consumer("orders").unwrap();
                let mut pipeline = orders.pipeline::<(usize, bool)>(1 + t % 5).unwrap();
                let mut seen = Vec::new();
                let mut nacked = Vec::new();
                let record = |batch: Vec<Settled<(usize, bool)>>, seen: &mut Vec<usize>| {
                    for s in batch {
                        let (key, is_commit) = s.tag;
                        seen.push(key);
                        match s.outcome {
                            Ok(Durable::Claim(_)) => {
                                assert!(is_commit);
                                *committed.lock().unwrap().entry(key).or_default() += 1;
                                assert!(completed(&orders, &format!("k{key}")).is_some());
                            }
                            Ok(Durable::Passed) => assert!(!is_commit),
                            other => panic!("thread {t} key {key}: {other:?}"),
                        }
                    }
                };
                let mut handed = Vec::new();
                for i in 0..KEYS {
                    let key = (i * (2 * t + 1) + t * 7) % KEYS; // every thread, every key
                    let name = format!("k{key}");
                    match orders.begin(&name, fp(&name)).unwrap() {
                        Outcome::Fresh(claim) => {
                            pipeline.commit(claim, b"done", (key, true));
                            handed.push(key);
                        }
                        Outcome::Duplicate { .. } => {
                            pipeline.pass((key, false));
                            handed.push(key);
                        }
                        Outcome::InProgress { .. } => nacked.push(key),
                        other => panic!("{other:?}"),
                    }
                    let batch = pipeline.settled();
                    record(batch, &mut seen);
                }
                let rest = pipeline.wait();
                record(rest, &mut seen);
                assert_eq!(seen, handed, "thread {t}: order handed over");
                barrier.wait();
                // Every pipeline has settled everything: the nacked keys are duplicates now.
                // (One thread at a time: concurrent duplicate checks are another test's.)
                let _one_at_a_time = redelivery.lock().unwrap();
                for key in nacked {
                    let name = format!("k{key}");
                    match orders.begin(&name, fp(&name)).unwrap() {
                        Outcome::Duplicate { .. } => {}
                        other => panic!("thread {t}: {name} after redelivery: {other:?}"),
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    let committed = committed.lock().unwrap();
    for key in 0..KEYS {
        assert_eq!(
            committed.get(&key),
            Some(&1),
            "key {key} committed {:?} times",
            committed.get(&key)
        );
    }
    drop(engine);
    let engine = builder(dir.path(), path)
        .durability(durability)
        .open()
        .unwrap();
    let orders = engine.consumer("orders").unwrap();
    for key in 0..KEYS {
        assert!(
            is_duplicate(&orders, &format!("k{key}")),
            "k{key} after reopen"
        );
    }
}

#[test]
fn threads_each_own_pipeline_sync_default_log() {
    threads_each_own_pipeline(LogPath::Default, Durability::Sync);
}

#[test]
fn threads_each_own_pipeline_sync_wal() {
    threads_each_own_pipeline(LogPath::Wal, Durability::Sync);
}

#[test]
fn threads_each_own_pipeline_buffered() {
    threads_each_own_pipeline(LogPath::Default, Durability::Buffered);
}

/// README: "Of concurrent claims of a key, one gets `Fresh`; the others get `InProgress` while
/// that claim holds the key, then `Duplicate` ... once it has committed." Here every key is
/// committed before the threads start: nobody holds any of them.
#[test]
fn concurrent_redeliveries_of_a_committed_key_are_duplicates() {
    const THREADS: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    for i in 0..20 {
        fresh(&orders, &format!("k{i}")).commit(b"done").unwrap();
    }
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (engine, barrier) = (engine.clone(), barrier.clone());
            std::thread::spawn(move || {
                let orders = engine.consumer("orders").unwrap();
                barrier.wait();
                let mut in_progress = 0;
                for _round in 0..200 {
                    for i in 0..20 {
                        let key = format!("k{i}");
                        match orders.begin(&key, fp(&key)).unwrap() {
                            Outcome::Duplicate { .. } => {}
                            Outcome::InProgress { .. } => in_progress += 1,
                            other => panic!("{key}: {other:?}"),
                        }
                    }
                }
                in_progress
            })
        })
        .collect();
    // README: "A `begin` of a committed key takes no hold on it: concurrent redeliveries of it
    // all get `Duplicate`". Never `Fresh`, never `InProgress`.
    let in_progress: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(in_progress, 0, "a begin of a committed key held it");
    for i in 0..20 {
        assert!(is_duplicate(&orders, &format!("k{i}")));
    }
}

#[test]
fn same_key_while_in_flight_is_never_fresh() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    let mut pipeline = orders.pipeline::<usize>(16).unwrap();
    for i in 0..300 {
        let key = format!("k{i}");
        pipeline.commit(fresh(&orders, &key), b"done", i);
        match orders.begin(&key, fp(&key)).unwrap() {
            Outcome::InProgress { .. } | Outcome::Duplicate { .. } => {}
            other => panic!("{key} claimed twice: {other:?}"),
        }
        pipeline.settled();
    }
    pipeline.wait();
}

#[test]
fn buffered_settles_at_once() {
    for path in [LogPath::Wal, LogPath::Default] {
        let dir = tempfile::tempdir().unwrap();
        let engine = builder(dir.path(), path)
            .durability(Durability::Buffered)
            .open()
            .unwrap();
        let orders = engine.consumer("orders").unwrap();
        let mut pipeline = orders.pipeline::<usize>(4).unwrap();
        for i in 0..50 {
            let key = format!("k{i}");
            pipeline.commit(fresh(&orders, &key), b"done", i);
            // "made in the call": visible at once, a duplicate now
            assert!(
                is_duplicate(&orders, &key),
                "{path:?}: {key} not made in the call"
            );
            let settled = pipeline.settled();
            assert_eq!(
                tags(&settled),
                [i],
                "{path:?}: a buffered commit settles at once"
            );
            assert_eq!(
                pipeline.in_flight(),
                0,
                "{path:?}: in flight after it settled"
            );
        }
    }
}

#[test]
fn buffered_commit_is_not_in_flight_after_the_call() {
    // in_flight(): "How many commits are in flight (handed over and not answered)"; with
    // Buffered "each commit is made in the call ... and settles at once".
    let mut failures = Vec::new();
    for path in [LogPath::Wal, LogPath::Default] {
        let dir = tempfile::tempdir().unwrap();
        let engine = builder(dir.path(), path)
            .durability(Durability::Buffered)
            .open()
            .unwrap();
        let orders = engine.consumer("orders").unwrap();
        let mut pipeline = orders.pipeline::<usize>(4).unwrap();
        pipeline.commit(fresh(&orders, "k"), b"done", 0);
        if pipeline.in_flight() != 0 {
            failures.push(format!("{path:?}: in_flight() = {}", pipeline.in_flight()));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn several_engines_and_consumers_in_one_pipeline() {
    let sync_dir = tempfile::tempdir().unwrap();
    let buffered_dir = tempfile::tempdir().unwrap();
    let sync = Engine::builder(sync_dir.path()).open().unwrap();
    let buffered = Engine::builder(buffered_dir.path())
        .durability(Durability::Buffered)
        .open()
        .unwrap();
    let a = sync.consumer("a").unwrap();
    let b = sync.consumer("b").unwrap();
    let c = buffered.consumer("c").unwrap();
    let mut pipeline = a.pipeline::<usize>(8).unwrap();
    let mut all = Vec::new();
    for i in 0..300 {
        let key = format!("k{i}");
        match i % 3 {
            0 => pipeline.commit(fresh(&a, &key), b"a", i),
            1 => pipeline.commit(fresh(&c, &key), b"c", i), // answered at once, yet settles in turn
            _ => pipeline.commit(fresh(&b, &key), b"b", i),
        }
        all.extend(pipeline.settled());
    }
    all.extend(pipeline.wait());
    assert_eq!(tags(&all), (0..300).collect::<Vec<_>>());
    assert!(all.iter().all(|s| s.outcome.is_ok()));
}

// ---------------------------------------------------------------- failures

fn too_big() -> Vec<u8> {
    vec![7u8; RESULT_BYTES_MAX + 1]
}

#[test]
fn failed_commit_breaks_the_pipeline_failure_known() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    let mut pipeline = orders.pipeline::<&str>(8).unwrap();
    pipeline.commit(fresh(&orders, "a"), b"done", "a");
    pipeline.commit(fresh(&orders, "b"), b"done", "b");
    pipeline.commit(fresh(&orders, "bad"), too_big(), "bad");
    pipeline.pass("p1");
    // Settle until the failure is known.
    let mut all = Vec::new();
    while !all.iter().any(|s: &Settled<&str>| s.tag == "bad") {
        let batch = pipeline.wait();
        assert!(!batch.is_empty(), "the failed entry never settled");
        all.extend(batch);
    }
    // Handed over after the failure is known: not committed, released, settle as broken.
    pipeline.commit(fresh(&orders, "d"), b"done", "d");
    pipeline.pass("p2");
    let messages = [Message::new("e1", fp("e1")), Message::new("e2", fp("e2"))];
    let claims = orders.begin_batch(&messages).unwrap();
    pipeline.commit_batch(claims, |_| b"done".to_vec(), "e");
    all.extend(pipeline.settled());
    all.extend(pipeline.wait());
    assert_eq!(tags(&all), ["a", "b", "bad", "p1", "d", "p2", "e"]);
    assert!(
        matches!(all[0].outcome, Ok(Durable::Claim(_))),
        "{:?}",
        all[0].outcome
    );
    assert!(
        matches!(all[1].outcome, Ok(Durable::Claim(_))),
        "{:?}",
        all[1].outcome
    );
    assert!(
        matches!(
            all[2].outcome,
            Err(Error::LimitExceeded {
                limit: Limit::ResultBytes,
                ..
            })
        ),
        "{:?}",
        all[2].outcome
    );
    for s in &all[3..] {
        assert!(broken(&s.outcome), "{}: {:?}", s.tag, s.outcome);
        if let Err(Error::PipelineBroken { earlier }) = &s.outcome {
            assert!(!earlier.is_empty());
        }
    }
    for key in ["bad", "d", "e1", "e2"] {
        assert_eq!(
            completed(&orders, key),
            None,
            "{key} committed after the failure"
        );
        assert!(
            matches!(orders.begin(key, fp(key)).unwrap(), Outcome::Fresh(_)),
            "{key} not released"
        );
    }
    // A new pipeline works.
    let mut next = orders.pipeline::<&str>(2).unwrap();
    next.commit(fresh(&orders, "d"), b"done", "d");
    assert!(next.wait().iter().all(|s| s.outcome.is_ok()));
    assert!(is_duplicate(&orders, "d"));
}

#[test]
fn failed_commit_breaks_the_pipeline_right_after() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    let mut pipeline = orders.pipeline::<&str>(8).unwrap();
    pipeline.commit(fresh(&orders, "a"), b"done", "a");
    pipeline.commit(fresh(&orders, "bad"), too_big(), "bad");
    // The check fails in the call: handed over right after, without a settled() between.
    pipeline.commit(fresh(&orders, "d"), b"done", "d");
    pipeline.pass("p");
    let mut all = pipeline.settled();
    all.extend(pipeline.wait());
    assert_eq!(tags(&all), ["a", "bad", "d", "p"]);
    assert!(all[0].outcome.is_ok(), "{:?}", all[0].outcome);
    assert!(
        matches!(all[1].outcome, Err(Error::LimitExceeded { .. })),
        "{:?}",
        all[1].outcome
    );
    assert!(broken(&all[2].outcome), "{:?}", all[2].outcome);
    assert!(broken(&all[3].outcome), "{:?}", all[3].outcome);
}

#[test]
fn position_behind_breaks_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let billing = engine.consumer("billing").unwrap();
    let mut pipeline = billing.pipeline::<&str>(8).unwrap();
    let mut a = fresh(&billing, "a");
    a.stage_position("orders", 3, 10).unwrap();
    pipeline.commit(a, b"done", "a");
    let mut b = fresh(&billing, "b");
    b.stage_position("orders", 3, 5).unwrap(); // behind the one in flight (or stored)
    pipeline.commit(b, b"done", "b");
    pipeline.commit(fresh(&billing, "c"), b"done", "c");
    pipeline.pass("p");
    let mut all = pipeline.settled();
    all.extend(pipeline.wait());
    assert_eq!(tags(&all), ["a", "b", "c", "p"]);
    assert!(
        matches!(all[0].outcome, Ok(Durable::Claim(_))),
        "{:?}",
        all[0].outcome
    );
    assert!(
        matches!(
            all[1].outcome,
            Err(Error::PositionBehind {
                stored: 10,
                staged: 5,
                ..
            })
        ),
        "{:?}",
        all[1].outcome
    );
    assert!(broken(&all[2].outcome), "{:?}", all[2].outcome);
    assert!(broken(&all[3].outcome), "{:?}", all[3].outcome);
    assert_eq!(
        completed(&billing, "b"),
        None,
        "a commit behind its position wrote"
    );
    let position = billing
        .positions()
        .get("orders", 3)
        .unwrap()
        .expect("stored");
    assert_eq!(position.next_offset(), 11);
}

fn fault_breaks_the_pipeline(path: LogPath) {
    let dir = tempfile::tempdir().unwrap();
    let switch = FailSwitch::default();
    {
        let engine = builder(dir.path(), path)
            .fault_injector(switch.clone())
            .open()
            .unwrap();
        let orders = engine.consumer("orders").unwrap();
        let mut pipeline = orders.pipeline::<&str>(8).unwrap();
        pipeline.commit(fresh(&orders, "a"), b"done", "a");
        pipeline.commit(fresh(&orders, "b"), b"done", "b");
        let first = pipeline.wait();
        assert!(first.iter().all(|s| s.outcome.is_ok()), "{first:?}");
        switch.0.store(true, Ordering::SeqCst);
        pipeline.commit(fresh(&orders, "c"), b"done", "c");
        // begin may already see the engine poisoned (documented): then the message is passed.
        match orders.begin("d", fp("d")) {
            Ok(Outcome::Fresh(claim)) => pipeline.commit(claim, b"done", "d"),
            Ok(_) | Err(Error::Poisoned) => pipeline.pass("d"),
            Err(other) => panic!("{other:?}"),
        }
        pipeline.pass("e");
        let mut all = pipeline.settled();
        all.extend(pipeline.wait());
        assert_eq!(tags(&all), ["c", "d", "e"]);
        assert!(
            matches!(
                all[0].outcome,
                Err(Error::Storage { .. }) | Err(Error::Poisoned)
            ),
            "{path:?}: the faulted commit: {:?}",
            all[0].outcome
        );
        assert!(broken(&all[1].outcome), "{path:?}: {:?}", all[1].outcome);
        assert!(broken(&all[2].outcome), "{path:?}: {:?}", all[2].outcome);
    }
    let engine = builder(dir.path(), path).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    assert!(is_duplicate(&orders, "a"));
    assert!(is_duplicate(&orders, "b"));
    assert_eq!(completed(&orders, "c"), None, "FailBefore: nothing written");
}

#[test]
fn fault_breaks_the_pipeline_default_log() {
    fault_breaks_the_pipeline(LogPath::Default);
}

#[test]
fn fault_breaks_the_pipeline_wal() {
    fault_breaks_the_pipeline(LogPath::Wal);
}

// ---------------------------------------------------------------- async

#[test]
fn async_pipeline_in_tokio() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..6_usize {
            let engine = engine.clone();
            tasks.push(tokio::spawn(async move {
                let orders = engine.consumer("orders").unwrap();
                let depth = 1 + t;
                let mut pipeline = orders.async_pipeline::<usize>(depth).unwrap();
                let mut all = Vec::new();
                for (next_tag, i) in (0..60).enumerate() {
                    let key = format!("t{t}-{i}");
                    if i % 10 == 9 {
                        let keys = [format!("{key}-x"), format!("{key}-y")];
                        let messages: Vec<Message> =
                            keys.iter().map(|k| Message::new(k, fp(k))).collect();
                        let batch = orders.begin_batch(&messages).unwrap();
                        pipeline
                            .commit_batch(batch, |i| format!("r{i}"), next_tag)
                            .await;
                    } else if i % 7 == 6 {
                        pipeline.pass(next_tag);
                    } else {
                        pipeline
                            .commit(fresh(&orders, &key), b"done", next_tag)
                            .await;
                    }
                    assert!(pipeline.in_flight() <= depth);
                    all.extend(pipeline.settled());
                }
                all.extend(pipeline.wait().await);
                assert_eq!(tags(&all), (0..60).collect::<Vec<_>>(), "task {t}");
                for s in &all {
                    match (&s.outcome, s.tag % 10 == 9, s.tag % 7 == 6) {
                        (Ok(Durable::Batch(v)), true, _) => {
                            assert!(v.iter().all(Option::is_some), "{v:?}")
                        }
                        (Ok(Durable::Passed), false, true) => {}
                        (Ok(Durable::Claim(_)), false, false) => {}
                        other => panic!("task {t} tag {}: {other:?}", s.tag),
                    }
                }
                assert!(completed(&orders, &format!("t{t}-9-y")).is_some());
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        // a failure in an async pipeline
        let orders = engine.consumer("orders").unwrap();
        let mut pipeline = orders.async_pipeline::<u8>(4).unwrap();
        pipeline
            .commit(fresh(&orders, "async-ok"), b"done", 1)
            .await;
        pipeline
            .commit(fresh(&orders, "async-bad"), too_big(), 2)
            .await;
        pipeline
            .commit(fresh(&orders, "async-after"), b"done", 3)
            .await;
        pipeline.pass(4);
        let mut all = pipeline.settled();
        all.extend(pipeline.wait().await);
        assert_eq!(tags(&all), [1, 2, 3, 4]);
        assert!(all[0].outcome.is_ok());
        assert!(
            matches!(all[1].outcome, Err(Error::LimitExceeded { .. })),
            "{:?}",
            all[1].outcome
        );
        assert!(broken(&all[2].outcome), "{:?}", all[2].outcome);
        assert!(broken(&all[3].outcome), "{:?}", all[3].outcome);
    });
}

#[test]
fn commit_async_claim_and_batch() {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = Engine::builder(dir.path()).open().unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let billing = engine.consumer("billing").unwrap();
            let committed = fresh(&billing, "order-42")
                .commit_async(b"charged")
                .await
                .unwrap();
            assert_eq!(committed.epoch, 1);
            let messages = [
                Message::new("x", fp("x")),
                Message::new("x", fp("x")),
                Message::new("y", fp("y")),
            ];
            let batch = billing.begin_batch(&messages).unwrap();
            let done = batch.commit_async(|i| format!("r{i}")).await.unwrap();
            assert_eq!(
                done.iter().map(Option::is_some).collect::<Vec<_>>(),
                [true, false, true]
            );
            // Dropped futures do not cancel their commits.
            drop(fresh(&billing, "dropped").commit_async(b"kept"));
            let batch = billing
                .begin_batch(&[Message::new("dropped-b", fp("dropped-b"))])
                .unwrap();
            drop(batch.commit_async(|_| b"kept".to_vec()));
        });
    }
    // Engine: the store closes once the last commit handed to the committer is written.
    let (engine, _refused) = open_eventually(dir.path());
    let billing = engine.consumer("billing").unwrap();
    for key in ["order-42", "x", "y", "dropped", "dropped-b"] {
        assert!(is_duplicate(&billing, key), "{key}");
    }
}

#[test]
fn commit_async_buffered_is_ready_at_once() {
    use std::future::Future;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path())
        .durability(Durability::Buffered)
        .open()
        .unwrap();
    let billing = engine.consumer("billing").unwrap();
    let mut future = Box::pin(fresh(&billing, "k").commit_async(b"r"));
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        std::task::Poll::Ready(result) => assert_eq!(result.unwrap().epoch, 1),
        std::task::Poll::Pending => panic!("a buffered commit_async was not ready at once"),
    }
}

// ---------------------------------------------------------------- the commit log

#[test]
fn new_store_has_two_default_segments() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path()).open().unwrap();
    let files = log_files(dir.path());
    let segments = files
        .iter()
        .filter(|(_, len)| *len == COMMIT_LOG_SEGMENT_BYTES_DEFAULT)
        .count();
    assert_eq!(segments, 2, "{files:?}");
    let total: u64 = files.iter().map(|(_, len)| len).sum();
    assert!(
        (8 << 20..=(8 << 20) + (64 << 10)).contains(&total),
        "{total} bytes: {files:?}"
    );
    assert_eq!(COMMIT_LOG_SEGMENT_BYTES_DEFAULT, 4 << 20);
    drop(engine);
}

#[test]
fn commit_log_off_and_on_keeps_every_commit() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    let commit_some = |engine: &Engine, n: &mut usize| {
        let orders = engine.consumer("orders").unwrap();
        let mut pipeline = orders.pipeline::<usize>(8).unwrap();
        for _ in 0..50 {
            pipeline.commit(fresh(&orders, &format!("k{n}")), format!("r{n}"), *n);
            *n += 1;
        }
        assert!(pipeline.wait().iter().all(|s| s.outcome.is_ok()));
    };
    let check_all = |engine: &Engine, n: usize, round: &str| {
        let orders = engine.consumer("orders").unwrap();
        for i in 0..n {
            assert_eq!(
                completed(&orders, &format!("k{i}")),
                Some(format!("r{i}").into_bytes()),
                "{round}: k{i}"
            );
        }
    };
    for round in 0..3 {
        let engine = Engine::builder(dir.path())
            .without_commit_log()
            .open()
            .unwrap();
        assert!(
            !dir.path().join("idemdb-log").exists(),
            "round {round}: log left without it"
        );
        check_all(&engine, n, &format!("round {round} without"));
        commit_some(&engine, &mut n);
        drop(engine);
        let engine = Engine::builder(dir.path()).open().unwrap();
        assert!(
            dir.path().join("idemdb-log").exists(),
            "round {round}: no log back"
        );
        let files = log_files(dir.path());
        assert_eq!(
            files
                .iter()
                .filter(|(_, l)| *l == COMMIT_LOG_SEGMENT_BYTES_DEFAULT)
                .count(),
            2,
            "round {round}: {files:?}"
        );
        check_all(&engine, n, &format!("round {round} with"));
        commit_some(&engine, &mut n);
        drop(engine);
    }
    let engine = Engine::builder(dir.path()).open().unwrap();
    check_all(&engine, n, "final");
}

fn assert_log_limit(result: idemdb::Result<Engine>, expected: Limit, actual: u64) {
    match result {
        Err(Error::LimitExceeded {
            limit, actual: got, ..
        }) => {
            assert_eq!(format!("{limit:?}"), format!("{expected:?}"));
            assert_eq!(got, actual);
        }
        other => panic!(
            "expected LimitExceeded({expected:?}), got {:?}",
            other.map(|_| "an engine")
        ),
    }
}

#[test]
fn commit_log_shape_limits() {
    let dir = tempfile::tempdir().unwrap();
    let open = |segments: usize, bytes: u64| {
        Engine::builder(dir.path())
            .commit_log(segments, bytes)
            .open()
    };
    assert_log_limit(
        open(COMMIT_LOG_SEGMENTS_MIN - 1, 1 << 20),
        Limit::CommitLogSegments,
        (COMMIT_LOG_SEGMENTS_MIN - 1) as u64,
    );
    assert_log_limit(
        open(COMMIT_LOG_SEGMENTS_MAX + 1, 1 << 20),
        Limit::CommitLogSegments,
        (COMMIT_LOG_SEGMENTS_MAX + 1) as u64,
    );
    assert_log_limit(
        open(4, COMMIT_LOG_SEGMENT_BYTES_MIN - 1),
        Limit::CommitLogSegmentBytes,
        COMMIT_LOG_SEGMENT_BYTES_MIN - 1,
    );
    assert_log_limit(
        open(4, COMMIT_LOG_SEGMENT_BYTES_MAX + 1),
        Limit::CommitLogSegmentBytes,
        COMMIT_LOG_SEGMENT_BYTES_MAX + 1,
    );
    assert!(
        !dir.path().join("idemdb-log").exists(),
        "a refused open made a log"
    );
    let engine = open(COMMIT_LOG_SEGMENTS_MIN, COMMIT_LOG_SEGMENT_BYTES_MIN).unwrap();
    let files = log_files(dir.path());
    assert_eq!(
        files
            .iter()
            .filter(|(_, l)| *l == COMMIT_LOG_SEGMENT_BYTES_MIN)
            .count(),
        COMMIT_LOG_SEGMENTS_MIN,
        "{files:?}"
    );
    drop(engine);
}

#[test]
fn commit_larger_than_a_segment_on_default_log() {
    let dir = tempfile::tempdir().unwrap();
    let big = |i: u8| vec![i; 6 << 20]; // 1.5 segments
    {
        let engine = Engine::builder(dir.path()).open().unwrap();
        let orders = engine.consumer("orders").unwrap();
        fresh(&orders, "big-0").commit(big(0)).unwrap();
        let mut pipeline = orders.pipeline::<u8>(4).unwrap();
        for i in 1..=3 {
            pipeline.commit(fresh(&orders, &format!("big-{i}")), big(i), i);
            pipeline.commit(fresh(&orders, &format!("small-{i}")), b"s", 10 + i);
        }
        let mut all = pipeline.settled();
        all.extend(pipeline.wait());
        assert_eq!(tags(&all), [1, 11, 2, 12, 3, 13]);
        assert!(
            all.iter().all(|s| s.outcome.is_ok()),
            "{:?}",
            all.iter().map(|s| &s.outcome).collect::<Vec<_>>()
        );
    }
    let engine = Engine::builder(dir.path()).open().unwrap();
    let orders = engine.consumer("orders").unwrap();
    for i in 0..=3u8 {
        assert_eq!(
            completed(&orders, &format!("big-{i}")),
            Some(big(i)),
            "big-{i}"
        );
    }
    for i in 1..=3 {
        assert!(is_duplicate(&orders, &format!("small-{i}")));
    }
}

#[test]
fn commit_larger_than_the_whole_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path())
        .commit_log(2, COMMIT_LOG_SEGMENT_BYTES_MIN)
        .open()
        .unwrap();
    let orders = engine.consumer("orders").unwrap();
    let whole = 2 * COMMIT_LOG_SEGMENT_BYTES_MIN as usize;
    match fresh(&orders, "huge").commit(vec![1u8; whole + 4096]) {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("a commit larger than the log: {other:?}"),
    }
    assert!(
        matches!(orders.begin("huge", fp("huge")).unwrap(), Outcome::Fresh(_)),
        "not released"
    );
    // Larger than a segment, smaller than the log: accepted. The engine is not poisoned.
    fresh(&orders, "mid")
        .commit(vec![2u8; COMMIT_LOG_SEGMENT_BYTES_MIN as usize + 4096])
        .unwrap();
    fresh(&orders, "small").commit(b"s").unwrap();
    // In a pipeline: the refusal breaks it.
    let mut pipeline = orders.pipeline::<u8>(4).unwrap();
    pipeline.commit(fresh(&orders, "p-huge"), vec![1u8; whole + 4096], 1);
    pipeline.commit(fresh(&orders, "p-after"), b"s", 2);
    let mut all = pipeline.settled();
    all.extend(pipeline.wait());
    assert!(
        matches!(all[0].outcome, Err(Error::InvalidArgument { .. })),
        "{:?}",
        all[0].outcome
    );
    assert!(broken(&all[1].outcome), "{:?}", all[1].outcome);
    drop((pipeline, orders, engine));
    let engine = Engine::builder(dir.path())
        .commit_log(2, COMMIT_LOG_SEGMENT_BYTES_MIN)
        .open()
        .unwrap();
    let orders = engine.consumer("orders").unwrap();
    assert!(is_duplicate(&orders, "mid"));
    assert!(is_duplicate(&orders, "small"));
}

#[test]
fn segment_size_is_fixed_when_the_log_is_made() {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = Engine::builder(dir.path())
            .commit_log(3, 1 << 20)
            .open()
            .unwrap();
        let files = log_files(dir.path());
        assert_eq!(
            files.iter().filter(|(_, l)| *l == 1 << 20).count(),
            COMMIT_LOG_SEGMENTS_MIN,
            "{files:?}"
        );
        let orders = engine.consumer("orders").unwrap();
        fresh(&orders, "a").commit(b"a").unwrap();
    }
    {
        // Another shape later: the log goes on with the one it has.
        let engine = Engine::builder(dir.path()).open().unwrap();
        let files = log_files(dir.path());
        assert!(files.iter().all(|(_, l)| *l == 1 << 20), "{files:?}");
        let orders = engine.consumer("orders").unwrap();
        assert!(is_duplicate(&orders, "a"));
        fresh(&orders, "b").commit(b"b").unwrap();
    }
    {
        // Off once, then on: made anew with the default shape.
        drop(
            Engine::builder(dir.path())
                .without_commit_log()
                .open()
                .unwrap(),
        );
        let engine = Engine::builder(dir.path()).open().unwrap();
        let files = log_files(dir.path());
        assert_eq!(
            files
                .iter()
                .filter(|(_, l)| *l == COMMIT_LOG_SEGMENT_BYTES_DEFAULT)
                .count(),
            2,
            "{files:?}"
        );
        let orders = engine.consumer("orders").unwrap();
        assert!(is_duplicate(&orders, "a"));
        assert!(is_duplicate(&orders, "b"));
    }
}
