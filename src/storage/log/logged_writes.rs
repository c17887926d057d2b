//! The durable path through the commit log (`EngineBuilder::commit_log`): each
//! write batch is appended to the log under the next log sequence number (LSN), made durable
//! there, and only then written to RocksDB, whose tables run without their WAL and flush
//! atomically (all together). A group's batches go to RocksDB as one write batch that also
//! puts the group's last LSN ([`LOG_LSN_KEY`]): RocksDB applies a batch whole, so the table
//! files always hold exactly the batches up to the LSN they record. (Each batch carried its own
//! LSN put before: one memtable insert more per commit, and one RocksDB write per batch; logs
//! written then still open, their records' puts being the same values.)
//!
//! Group commit: writers queue their batches; one of them at a time leads, takes the queue,
//! appends it to the log under the lock, then writes and syncs the log without the lock while
//! the next group queues. Pipelined: once its records are durable the leader gives up the lead,
//! and the group is applied to RocksDB, after the groups before it, while the next one syncs.
//! Every writer of a group gets its outcome. The async committer drives the same two halves
//! ([`LogWriter::write_durable`], [`LogWriter::apply`]) from two threads.
//!
//! Recovery (at open): the table files' LSN says where the log's replay starts; the records
//! after it are written to RocksDB in order, each exactly once (merge operands are not
//! idempotent). A reader beside the owner gets them as a RocksDB WAL file instead
//! (`reader_wal.rs`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use rocksdb::{DB, WriteBatch, WriteOptions};

use crate::format::error::{Error, Result};
use crate::storage::log::commit_log::{CommitLog, LOG_SLOTS_FIRST, perform_writes};
use crate::storage::log::replay::{
    LOG_DIR, LOG_LSN_KEY, default_table, no_wal, numbered, persisted_lsn, tables_lsn,
};

/// The options of a durable group's write to the tables (their memtables; they have no WAL of
/// their own): never waiting inside RocksDB (`storage/unstalled_write.rs`), as the commit is in
/// the log already, and needs no new space of its own. Made once: made for every group, they
/// cost 150 instructions a commit.
fn table_write_options() -> WriteOptions {
    let mut options = no_wal();
    options.set_no_slowdown(true);
    options
}

/// The fault seam around the log's writes: runs the call it is given (whose argument says
/// whether to sync).
type LogIo<'a> = dyn Fn(&dyn Fn(bool) -> Result<()>) -> Result<()> + 'a;

/// A writer waiting in [`LogWriter::write`]: its thread, and its outcome once its group is
/// applied. Each writer is answered in its own slot, without the log's lock: with 32 writers
/// on 2 cores, each woken writer taking that lock to read its outcome kept the leader and the
/// applier spinning and yielding for it.
struct Waiter {
    thread: std::thread::Thread,
    outcome: parking_lot::Mutex<Option<Result<()>>>,
}

impl Waiter {
    fn answer(&self, outcome: Result<()>) {
        *self.outcome.lock() = Some(outcome);
        self.thread.unpark();
    }

    fn take(&self) -> Option<Result<()>> {
        self.outcome.lock().take()
    }
}

/// Whose a batch in a group is.
#[derive(Clone)]
enum Member {
    /// A queued writer's ([`LogWriter::write`]).
    Queued(Arc<Waiter>),
    /// One of the batches given to [`LogWriter::write_durable`], by the caller's number.
    Own(usize),
}

/// Batches given to [`LogWriter::lead`] by their caller, by the caller's numbers (not queued):
/// the async committer's, or a lone writer's one, kept inline.
type OwnBatches = smallvec::SmallVec<[(usize, WriteBatch); 1]>;

/// The outcomes of a group's own batches ([`OwnBatches`]), by the caller's numbers.
pub(crate) type OwnOutcomes = smallvec::SmallVec<[(usize, Result<()>); 1]>;

/// A group's batches, each with whose it is: kept inline for a lone writer's group of one.
type GroupBatches = smallvec::SmallVec<[(Member, WriteBatch); 1]>;

/// A group whose records [`LogWriter::lead`] made durable in the log (or failed to), to be
/// applied to RocksDB by [`LogWriter::apply`].
pub(crate) struct DurableGroup {
    group: u64,
    /// Each batch with whose it is.
    batches: GroupBatches,
    /// Batches the log refused (larger than the whole log, or a full ring that a flush could
    /// not free), with why.
    refused: Vec<(Member, Error)>,
    last_lsn: u64,
    /// Whether the log's write and sync succeeded.
    durable: Result<()>,
}

/// The commit log and its group commit.
pub(crate) struct LogWriter {
    state: parking_lot::Mutex<State>,
    /// Set when the ring grew with no shrinker running; taken by the store, which starts one
    /// ([`LogWriter::take_growth`]).
    grew: std::sync::atomic::AtomicBool,
    /// Every write fsyncs the log ([`crate::Durability::Sync`]).
    sync_each: bool,
    /// How groups are written to the tables ([`table_write_options`]).
    table_writes: WriteOptions,
}

struct State {
    log: CommitLog,
    queue: Vec<(Arc<Waiter>, WriteBatch)>,
    /// A leader is appending, writing or syncing its group's records.
    leading: bool,
    /// The number the next group gets: groups are applied to RocksDB in this order.
    next_group: u64,
    /// How many groups have been applied to RocksDB (or failed): group `g` applies when this
    /// is `g`.
    applied_groups: u64,
    /// The first failure of a group's log write or apply: every later group fails with it, so
    /// that the tables never hold a batch whose predecessor they lack.
    failed: Option<Error>,
    /// The LSN of the last batch written to RocksDB.
    written_lsn: u64,
    /// Threads waiting for the lead without a queued batch ([`LogWriter::write_durable`]).
    lead_waiters: Vec<std::thread::Thread>,
    /// Leaders waiting for the groups before theirs to be applied, by group.
    turn_waiters: HashMap<u64, std::thread::Thread>,
    /// A shrinker runs (or was asked for): set when the ring grows beyond its first slots,
    /// cleared by the shrinker under this lock as it ends, so that a growth after that moment
    /// asks for a new one ([`LogWriter::take_growth`]).
    shrinker: bool,
}

/// Adds a slot to a full ring (`CommitLog::grow_for`, large enough for a record of
/// `payload_bytes`) before anything is flushed for room: whether it did. A slot that cannot be made (a failing disk) is reported and the ring stays as it is:
/// the flush that makes room without a new slot goes on, and meets the disk's error itself if
/// the disk has one.
fn grow(log: &mut CommitLog, payload_bytes: usize) -> bool {
    let record = (crate::format::commit_log::LOG_RECORD_HEADER_BYTES + payload_bytes) as u64;
    match log.grow_for(record) {
        Ok(grown) => {
            if grown {
                tracing::debug!(target: "idemdb", slots = log.slots(), "commit log grown");
            }
            grown
        }
        Err(error) => {
            tracing::warn!(target: "idemdb", %error, "the commit log could not grow");
            false
        }
    }
}

/// Gives back a slot made for one large record once the tables hold it (`CommitLog::trim`).
/// One that cannot be removed is reported and kept: it is a free slot like any other.
fn trim(log: &mut CommitLog) {
    if let Err(error) = log.trim() {
        tracing::warn!(target: "idemdb", %error, "the commit log kept a large slot");
    }
}

/// The bytes of `batch`'s log record.
fn record_bytes(batch: &WriteBatch) -> u64 {
    (crate::format::commit_log::LOG_RECORD_HEADER_BYTES + batch.data().len()) as u64
}

/// Frees the segments whose records RocksDB's own flushes put into table files, when
/// appending `bytes` would switch into the ring's last free slot. RocksDB flushes the tables
/// on its own once a memtable fills: those segments are free again, and the ring need not
/// grow for them. Asked before the switch that takes the last free slot, which would start
/// making one more (not before every group: a read, while the segment has room, for nothing).
fn release_flushed(state: &mut State, db: &DB, bytes: u64) {
    if !state.log.switch_would_fill(bytes) {
        return;
    }
    match persisted_lsn(db) {
        Ok(persisted) => {
            state.log.release_through(persisted + 1);
            trim(&mut state.log);
        }
        Err(error) => {
            tracing::warn!(target: "idemdb", %error, "the tables' flushed LSN unread");
        }
    }
}

/// How many times a waiting writer yields its processor and looks again before it parks.
///
/// The wait is usually a few microseconds (another writer's log write or its batch's apply),
/// and waking a parked thread took tens: with two writers on two cores, parking at once held
/// each commit to one wake-up, and two threads committed at a quarter of one thread's rate
/// (38,000 against 170,000 a second in the scale run). Yielding, rather than spinning, hands
/// the processor to the thread being waited for when it waits for one: with more writers
/// than cores, the one that leads or applies runs.
const YIELDS_BEFORE_PARKING: u32 = 64;

/// Waits until every group before `group` is applied to the tables (or failed).
fn wait_for_turn(state: &mut parking_lot::MutexGuard<'_, State>, group: u64) {
    let mut yields = YIELDS_BEFORE_PARKING;
    while state.applied_groups != group {
        if yields > 0 {
            yields -= 1;
            parking_lot::MutexGuard::unlocked(state, std::thread::yield_now);
            continue;
        }
        state.turn_waiters.insert(group, std::thread::current());
        park(state);
    }
}

/// Waits for `group`'s turn at the tables ([`wait_for_turn`]): whether it may write them, that
/// is its records' `durable` outcome unless an earlier group failed (the tables must never hold
/// a batch without the ones before it).
fn take_turn(
    state: &mut parking_lot::MutexGuard<'_, State>,
    group: u64,
    durable: Result<()>,
) -> Result<()> {
    wait_for_turn(state, group);
    match &state.failed {
        Some(earlier) => Err(earlier.clone()),
        None => durable,
    }
}

/// Ends a group's turn at the tables with its `outcome`: `written` is its last LSN when it
/// wrote batches. A failure fails every later group; the next group's leader is woken if it
/// waits for its turn.
fn end_turn(state: &mut State, outcome: &Result<()>, written: Option<u64>) {
    state.applied_groups += 1;
    match (outcome, written) {
        (Ok(()), Some(last_lsn)) => state.written_lsn = last_lsn,
        (Ok(()), None) => {}
        (Err(error), _) => {
            state.failed.get_or_insert_with(|| error.clone());
        }
    }
    let next = state.applied_groups;
    // (Looked up only when some leader waits: hashing the group for an empty map cost a lone
    // writer 130 instructions a commit.)
    if !state.turn_waiters.is_empty()
        && let Some(waiter) = state.turn_waiters.remove(&next)
    {
        waiter.unpark();
    }
}

/// Releases `state`'s lock and parks the thread until it is unparked (or spuriously: callers
/// check their condition again).
fn park(state: &mut parking_lot::MutexGuard<'_, State>) {
    parking_lot::MutexGuard::unlocked(state, std::thread::park);
}

impl LogWriter {
    /// Opens the store's log (making it if there is none) and replays into `db` every record
    /// after the LSN the tables hold.
    pub(crate) fn open(
        store: &Path,
        db: &DB,
        segments: usize,
        segment_bytes: u64,
        sync_each: bool,
    ) -> Result<LogWriter> {
        let dir = store.join(LOG_DIR);
        let tables = tables_lsn(db)?;
        let (mut log, written_lsn) = if dir.exists() {
            let mut last = tables;
            let (log, recovered) = CommitLog::open(&dir, tables + 1, |lsn, payload| {
                db.write_opt(numbered(db, payload, lsn), &no_wal())?;
                last = lsn;
                Ok(())
            })?;
            tracing::info!(
                target: "idemdb",
                tables_lsn = tables,
                replayed = recovered.recovered,
                end = ?recovered.end,
                "commit log replayed"
            );
            (log, last)
        } else {
            (
                CommitLog::create(
                    &dir,
                    LOG_SLOTS_FIRST.min(segments),
                    segment_bytes,
                    tables + 1,
                )?,
                tables,
            )
        };
        log.allow_growth_to(segments);
        // A ring an earlier open grew is given back too, once this one is quiet.
        let grown = log.grown_beyond(LOG_SLOTS_FIRST);
        if sync_each {
            // Every write is synced: direct writes make it durable in less time than the page
            // cache and an fdatasync (storage/log/commit_log/direct.rs).
            let direct = log.write_direct()?;
            tracing::debug!(target: "idemdb", direct, "commit log writes");
        }
        Ok(LogWriter {
            state: parking_lot::Mutex::new(State {
                log,
                queue: Vec::new(),
                leading: false,
                next_group: 0,
                applied_groups: 0,
                failed: None,
                written_lsn,
                lead_waiters: Vec::new(),
                turn_waiters: HashMap::new(),
                shrinker: grown,
            }),
            grew: std::sync::atomic::AtomicBool::new(grown),
            sync_each,
            table_writes: table_write_options(),
        })
    }

    /// Writes `batch` durably (with `Durability::Sync`) through the log, then to `db`.
    /// `io` runs the log's writes and sync (the fault seam; its argument says whether to sync);
    /// `flush` flushes every table (when the log needs room).
    ///
    /// Group commit: writers queue; one of them leads the next group (every batch queued) while
    /// the others wait. Pipelined: a leader gives up the lead once its group's records are
    /// durable, so the next group's records are written and synced while this one is applied
    /// to RocksDB. Groups are applied in LSN order, each after the one before it.
    pub(crate) fn write(
        &self,
        db: &DB,
        batch: WriteBatch,
        io: impl Fn(&dyn Fn(bool) -> Result<()>) -> Result<()>,
        flush: impl Fn() -> Result<()>,
    ) -> Result<()> {
        let mut state = self.state.lock();
        if !state.leading && state.queue.is_empty() {
            // No group is being led and no writer waits: this one leads its batch as a group of
            // one, without queueing (a waiter to answer is an allocation and a lock more: 300
            // instructions a commit), and without a group's lists of batches and members (700
            // more) while its record fits the ring.
            release_flushed(&mut state, db, record_bytes(&batch));
            match state.log.append(batch.data()) {
                Ok(_) => return self.write_alone(state, db, batch, &io, &flush),
                // Larger than the whole log: refused, nothing appended.
                Err(error) if !error.is_retryable() => return Err(error),
                // The ring is full: the group's way below grows it or flushes for room.
                Err(_) => {}
            }
            // Its record is the group's first, which is never left for a later group.
            let (group, _) = self.lead(
                &mut state,
                db,
                OwnBatches::from_buf([(0, batch)]),
                &io,
                &flush,
            );
            drop(state);
            return match self.apply(db, group, &flush).pop() {
                Some((_, outcome)) => outcome,
                // (Never: the batch is written, refused or failed, and answered either way.)
                None => Err(Error::Storage {
                    kind: crate::format::error::StorageErrorKind::Other,
                    detail: "a lone writer's group gave no outcome for its batch".to_owned(),
                }),
            };
        }
        let waiter = Arc::new(Waiter {
            thread: std::thread::current(),
            outcome: parking_lot::Mutex::new(None),
        });
        state.queue.push((waiter.clone(), batch));
        // A synced group's leader waits for its sync (a hundred microseconds and more here),
        // longer than the yields last: a queued writer then parks at once (yielding first cost
        // two synced writers 10-19%).
        let mut yields = if self.sync_each {
            0
        } else {
            YIELDS_BEFORE_PARKING
        };
        loop {
            if state.leading || state.queue.is_empty() {
                // Another leader has the log, or took this batch into its group: woken with
                // the outcome, or to lead the next group (threads waiting on a `Thread` may
                // also wake for nothing: the loop looks again). It looks a few times before
                // it parks (`YIELDS_BEFORE_PARKING`).
                drop(state);
                if yields > 0 {
                    yields -= 1;
                    std::thread::yield_now();
                } else {
                    std::thread::park();
                }
                if let Some(outcome) = waiter.take() {
                    return outcome;
                }
                state = self.state.lock();
                continue;
            }
            let (group, _) = self.lead(&mut state, db, OwnBatches::new(), &io, &flush);
            drop(state);
            // The caller's own outcome is among the members'.
            let _ = self.apply(db, group, &flush);
            if let Some(outcome) = waiter.take() {
                return outcome;
            }
            state = self.state.lock();
        }
    }

    /// The rest of a lone writer's write whose record the log took ([`CommitLog::append`]
    /// under `state`, with no group led and none queued): it leads a group of that record,
    /// writes it (and syncs it with `Durability::Sync`) and gives up the lead, then writes
    /// `batch` to the tables in the group's turn.
    fn write_alone(
        &self,
        mut state: parking_lot::MutexGuard<'_, State>,
        db: &DB,
        batch: WriteBatch,
        io: &LogIo<'_>,
        flush: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        state.leading = true;
        let group = state.next_group;
        state.next_group += 1;
        let (last_lsn, durable) = self.write_records(&mut state, io);
        let durable = take_turn(&mut state, group, durable);
        drop(state);
        let outcome = durable.and_then(|()| self.write_to_tables(db, batch, last_lsn, flush));
        end_turn(&mut self.state.lock(), &outcome, Some(last_lsn));
        outcome
    }

    /// The first half of a write for a caller that keeps the log busy (the async committer):
    /// waits for the lead, then leads a group of `batches` (each its own record, numbered by
    /// the caller) and every batch queued, and returns once their records are durable in the
    /// log (or failed), with the batches the group had no room for (the ring was full: the
    /// caller hands those to the next call, which flushes the tables once this group is
    /// applied). [`LogWriter::apply`] finishes the group; meanwhile the caller may start the
    /// next one. Groups are applied in the order they were led.
    pub(crate) fn write_durable(
        &self,
        db: &DB,
        batches: Vec<(usize, WriteBatch)>,
        io: impl Fn(&dyn Fn(bool) -> Result<()>) -> Result<()>,
        flush: impl Fn() -> Result<()>,
    ) -> (DurableGroup, Vec<(usize, WriteBatch)>) {
        let mut state = self.state.lock();
        while state.leading {
            state.lead_waiters.push(std::thread::current());
            park(&mut state);
        }
        self.lead(&mut state, db, OwnBatches::from_vec(batches), &io, &flush)
    }

    /// Leads a group: `own` (a caller's batches, not queued) and every batch queued get their
    /// LSNs and are appended, written and synced (without the lock), and the lead is given up.
    /// The state must have no leader. When the ring fills after the group's first record, the
    /// rest wait for the next group (their segments can only be freed once this group is in the
    /// tables): queued batches go back to the front of the queue, `own` ones are returned.
    fn lead(
        &self,
        state: &mut parking_lot::MutexGuard<'_, State>,
        db: &DB,
        own: OwnBatches,
        io: &LogIo<'_>,
        flush: &dyn Fn() -> Result<()>,
    ) -> (DurableGroup, Vec<(usize, WriteBatch)>) {
        state.leading = true;
        let group = state.next_group;
        state.next_group += 1;
        let mut members = own
            .into_iter()
            .map(|(index, batch)| (Member::Own(index), batch))
            .chain(
                std::mem::take(&mut state.queue)
                    .into_iter()
                    .map(|(waiter, batch)| (Member::Queued(waiter), batch)),
            )
            .collect::<GroupBatches>()
            .into_iter();
        let bytes = members
            .as_slice()
            .iter()
            .map(|(_, batch)| record_bytes(batch))
            .sum();
        release_flushed(state, db, bytes);
        let mut batches = GroupBatches::with_capacity(members.len());
        let mut refused = Vec::new();
        let mut deferred = Vec::new();
        let mut own_left = Vec::new();
        while let Some((member, batch)) = members.next() {
            let mut appended = state.log.append(batch.data());
            if appended.as_ref().is_err_and(Error::is_retryable)
                && grow(&mut state.log, batch.data().len())
            {
                appended = state.log.append(batch.data());
            }
            let appended = match appended {
                Err(full) if full.is_retryable() && !batches.is_empty() => {
                    // The ring is full with this group's own records among those it holds:
                    // this batch and the rest wait for the next group.
                    for (member, batch) in std::iter::once((member, batch)).chain(members.by_ref())
                    {
                        match member {
                            Member::Queued(waiter) => deferred.push((waiter, batch)),
                            Member::Own(index) => own_left.push((index, batch)),
                        }
                    }
                    break;
                }
                Err(full) if full.is_retryable() => {
                    // The ring is full: once every earlier group is in RocksDB, every batch
                    // written so far goes to table files, and their segments are free again.
                    wait_for_turn(state, group);
                    flush().and_then(|()| {
                        let written = state.written_lsn;
                        state.log.release_through(written + 1);
                        trim(&mut state.log);
                        // Every slot is free now; a record larger than a segment still needs
                        // one enlarged.
                        let appended = state.log.append(batch.data());
                        if appended.as_ref().is_err_and(Error::is_retryable)
                            && grow(&mut state.log, batch.data().len())
                        {
                            state.log.append(batch.data())
                        } else {
                            appended
                        }
                    })
                }
                other => other,
            };
            match appended {
                Ok(_) => batches.push((member, batch)),
                Err(error) => refused.push((member, error)),
            }
        }
        if !deferred.is_empty() {
            // Ahead of what was queued meanwhile: they were queued first.
            deferred.append(&mut state.queue);
            state.queue = deferred;
        }
        let (last_lsn, durable) = self.write_records(state, io);
        (
            DurableGroup {
                group,
                batches,
                refused,
                last_lsn,
                durable,
            },
            own_left,
        )
    }

    /// The end of a lead: the records appended are written (and synced with
    /// `Durability::Sync`) without the lock, and the lead is given up. Returns the last LSN
    /// appended and whether the records are durable.
    fn write_records(
        &self,
        state: &mut parking_lot::MutexGuard<'_, State>,
        io: &LogIo<'_>,
    ) -> (u64, Result<()>) {
        self.ask_for_shrinker(state);
        let writes = state.log.take_writes();
        let last_lsn = state.log.next_lsn() - 1;
        // The log first (durable with Sync), without the lock: the next group queues meanwhile.
        let sync_each = self.sync_each;
        let durable = writes.and_then(|writes| {
            parking_lot::MutexGuard::unlocked(state, || {
                io(&|synced| perform_writes(&writes, synced && sync_each))
            })
        });
        // The next group may write and sync its records while this one is applied: one
        // writer with a queued batch is woken to lead it (any of them may), and whoever waits
        // to lead without one.
        state.leading = false;
        if let Some((waiter, _)) = state.queue.first() {
            waiter.thread.unpark();
        }
        // (Drained only when someone waits: draining the empty list cost a lone writer 25
        // instructions a commit.)
        if !state.lead_waiters.is_empty() {
            for waiter in state.lead_waiters.drain(..) {
                waiter.unpark();
            }
        }
        (last_lsn, durable)
    }

    /// Writes a group's `batch` to the tables, with a put of its last LSN.
    fn write_to_tables(
        &self,
        db: &DB,
        mut batch: WriteBatch,
        last_lsn: u64,
        flush: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        batch.put_cf(default_table(db), LOG_LSN_KEY, last_lsn.to_be_bytes());
        crate::storage::unstalled_write::write_unstalled(db, batch, &self.table_writes, flush)
    }

    /// Applies a group led by [`LogWriter::lead`] to `db` once every earlier group is applied,
    /// and answers its queued members. Returns the outcomes of the group's own batches (those
    /// given to [`LogWriter::write_durable`]), by the caller's numbers.
    ///
    /// `flush` flushes every table, for a write RocksDB holds back while a background error
    /// stands (`storage/unstalled_write.rs`).
    pub(crate) fn apply(
        &self,
        db: &DB,
        group: DurableGroup,
        flush: &dyn Fn() -> Result<()>,
    ) -> OwnOutcomes {
        let DurableGroup {
            group,
            batches,
            refused,
            last_lsn,
            durable,
        } = group;
        let durable = take_turn(&mut self.state.lock(), group, durable);
        let mut members = smallvec::SmallVec::<[Member; 1]>::with_capacity(batches.len());
        let mut writes = smallvec::SmallVec::<[WriteBatch; 1]>::with_capacity(batches.len());
        for (member, batch) in batches {
            members.push(member);
            writes.push(batch);
        }
        let outcome = durable.and_then(|()| {
            if writes.is_empty() {
                return Ok(());
            }
            let group = crate::storage::log::wal_file::join(writes);
            self.write_to_tables(db, group, last_lsn, flush)
        });
        let written = (!members.is_empty()).then_some(last_lsn);
        end_turn(&mut self.state.lock(), &outcome, written);
        let mut own = OwnOutcomes::new();
        let answers = members
            .into_iter()
            .map(|member| (member, outcome.clone()))
            .chain(
                refused
                    .into_iter()
                    .map(|(member, error)| (member, Err(error))),
            );
        for (member, answer) in answers {
            match member {
                Member::Queued(waiter) => waiter.answer(answer),
                Member::Own(index) => own.push((index, answer)),
            }
        }
        own
    }

    /// Syncs the log's files: every commit so far becomes durable (`Engine::flush_wal`).
    pub(crate) fn sync(&self) -> Result<()> {
        self.state.lock().log.sync_files()
    }

    /// After every table was flushed (all of them together): the records up to the last
    /// written LSN are in table files; their segments may be reused.
    pub(crate) fn flushed(&self, written_before_flush: u64) {
        let log = &mut self.state.lock().log;
        log.release_through(written_before_flush + 1);
        trim(log);
    }

    /// The LSN of the last batch written to the tables.
    pub(crate) fn written_lsn(&self) -> u64 {
        self.state.lock().written_lsn
    }

    /// The LSN the next record gets: unchanged while nothing is written.
    pub(crate) fn next_lsn(&self) -> u64 {
        self.state.lock().log.next_lsn()
    }

    /// Asks the store for a shrinker when the ring has grown beyond its first slots (more
    /// slots, one being made, or one enlarged for a large record) and none runs.
    fn ask_for_shrinker(&self, state: &mut State) {
        if !state.shrinker && state.log.grown_beyond(LOG_SLOTS_FIRST) {
            state.shrinker = true;
            self.grew.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Whether the store must start a shrinker: the ring grew while none ran (one cheap load
    /// while it did not). The one before, if any, has ended or is ending.
    pub(crate) fn take_growth(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.grew.load(Ordering::Relaxed) && self.grew.swap(false, Ordering::Relaxed)
    }

    /// The shrinker ends without having given the segments back (a failure, reported): the
    /// next growth asks for another.
    pub(crate) fn shrinker_ended(&self) {
        self.state.lock().shrinker = false;
    }

    /// Gives back the ring's grown segments (`CommitLog::shrink`) if nothing was appended
    /// since the log's next LSN was `seen` and no group is under way (led, or durable and not
    /// yet applied): whether the ring is back to its first segments (the shrinker then ends).
    /// A store that failed a write keeps its ring as it is.
    ///
    /// # Errors
    /// [`Error::Storage`] if the shrink's header write, removal or sync fails.
    pub(crate) fn shrink_if_quiet(&self, seen: u64) -> Result<bool> {
        let mut state = self.state.lock();
        let busy = state.leading
            || !state.queue.is_empty()
            || state.applied_groups != state.next_group
            || state.failed.is_some();
        if busy || state.log.next_lsn() != seen {
            return Ok(false);
        }
        let shrunk = state.log.shrink(LOG_SLOTS_FIRST);
        if let Ok(true) = shrunk {
            // The shrinker ends: a growth from now on asks for a new one.
            state.shrinker = false;
        }
        shrunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::log::commit_log::LOG_SEGMENT_BYTES_MIN;
    use crate::storage::log::reader_wal::{log_as_wal, without_lsn_put};

    fn value(db: &DB, key: &[u8]) -> Option<Vec<u8>> {
        db.get(key).unwrap()
    }

    /// Logs written before a group's write to the tables put its LSN once carry a put of its
    /// LSN in every record: such a log, followed by records without one, replays whole, and the
    /// tables say the last LSN. A reader's copy of either kind has no LSN put.
    #[test]
    fn records_with_and_without_their_lsn_put_replay_alike() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = rocksdb::Options::default();
        options.create_if_missing(true);
        let db = DB::open_cf(&options, dir.path().join("tables"), ["default"]).unwrap();
        let writer = LogWriter::open(dir.path(), &db, 2, LOG_SEGMENT_BYTES_MIN, true).unwrap();
        let mut payloads = Vec::new();
        {
            let mut state = writer.state.lock();
            for lsn in 1..=4u64 {
                let mut batch = WriteBatch::default();
                batch.put(format!("key-{lsn}"), format!("value-{lsn}"));
                if lsn <= 2 {
                    // The earlier format.
                    batch.put(LOG_LSN_KEY, lsn.to_be_bytes());
                }
                assert_eq!(state.log.append(batch.data()).unwrap(), lsn);
                payloads.push(batch.data().to_vec());
            }
            state.log.sync().unwrap();
        }
        // A crash before the tables were written: the next open replays all four.
        drop(writer);
        assert_eq!(tables_lsn(&db).unwrap(), 0);
        let writer = LogWriter::open(dir.path(), &db, 2, LOG_SEGMENT_BYTES_MIN, true).unwrap();
        assert_eq!(tables_lsn(&db).unwrap(), 4);
        for lsn in 1..=4 {
            assert_eq!(
                value(&db, format!("key-{lsn}").as_bytes()),
                Some(format!("value-{lsn}").into_bytes())
            );
        }
        // A group written now: one write with the group's last LSN.
        let mut batch = WriteBatch::default();
        batch.put("key-5", "value-5");
        writer
            .write(&db, batch, |call| call(true), || Ok(()))
            .unwrap();
        assert_eq!(tables_lsn(&db).unwrap(), 5);
        // The reader's copies: the old records lose their put, the new ones are as written.
        for (lsn, payload) in (1..).zip(&payloads) {
            let copy = without_lsn_put(lsn, payload).unwrap();
            assert_eq!(WriteBatch::from_data(&copy).len(), 1, "LSN {lsn}");
            assert!(!copy.windows(LOG_LSN_KEY.len()).any(|w| w == LOG_LSN_KEY));
        }
        assert!(without_lsn_put(9, &[0u8; 4]).is_err());
    }

    /// A reader beside the owner reads the segment headers, then the records; the owner may
    /// reuse a segment in between. The records read then end at once: that must not pass for
    /// a log with nothing after the tables' LSN.
    #[test]
    fn a_segment_reused_during_a_read_is_not_taken_for_the_end_of_the_log() {
        use crate::format::commit_log::{
            LOG_SEGMENT_HEADER_BYTES, LogSegmentHeader, encode_log_record,
        };
        use crate::storage::log::commit_log::AFTER_HEADERS_READ;
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let mut log =
            CommitLog::create(&dir.path().join(LOG_DIR), 2, LOG_SEGMENT_BYTES_MIN, 1).unwrap();
        for lsn in 1..=3u64 {
            let mut batch = WriteBatch::default();
            batch.put(format!("key-{lsn}"), "value");
            log.append(batch.data()).unwrap();
        }
        log.sync().unwrap();
        drop(log);
        // Undisturbed: the three records, from the tables' LSN 0 on.
        assert!(log_as_wal(dir.path(), 0, 0).unwrap().is_some());
        // The owner reuses the first slot for a later segment between the two reads.
        let slot = dir.path().join(LOG_DIR).join("segment-0");
        AFTER_HEADERS_READ.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                let file = std::fs::OpenOptions::new().write(true).open(&slot).unwrap();
                let header = LogSegmentHeader {
                    segment: 9,
                    first_lsn: 100,
                };
                file.write_all_at(&header.encode(), 0).unwrap();
                let mut record = Vec::new();
                encode_log_record(100, WriteBatch::default().data(), &mut record);
                file.write_all_at(&record, LOG_SEGMENT_HEADER_BYTES as u64)
                    .unwrap();
            }));
        });
        let read = log_as_wal(dir.path(), 0, 0);
        AFTER_HEADERS_READ.with(|hook| hook.borrow_mut().take());
        match read {
            Err(error) => assert!(error.is_retryable(), "{error:?}"),
            Ok(found) => panic!(
                "a read cut short by a reused segment passed for a whole one: {}",
                if found.is_some() {
                    "some records"
                } else {
                    "no records"
                }
            ),
        }
    }
}
