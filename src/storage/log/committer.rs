//! The engine's committer thread: commits handed to it ([`crate::Claim::commit_async`] and
//! [`crate::ClaimBatch::commit_async`] with feature `tokio`, a [`crate::Pipeline`]'s) are written
//! as groups, and each commit's finish function is told its outcome.
//!
//! Why a thread of our own rather than `spawn_blocking` per message: a durable commit spends
//! almost all its time in the WAL's fsync. One thread that takes every batch waiting for it,
//! joins them into one `WriteBatch` and writes that once (one WAL record, one fsync) turns N
//! waiting commits into one fsync, and while it syncs the next group collects in its queue.
//! `spawn_blocking` would park one runtime blocking thread per message and leave the grouping
//! to RocksDB's write queue. With the commit log the work is split between two threads: the
//! committer makes a group durable in the log and goes straight on to the next (it never
//! sleeps while jobs wait), and an applier applies each durable group to RocksDB, in order,
//! and answers its jobs (`storage/log/logged_writes.rs`). The callers build their own batches (the CPU part of a commit), so
//! the committer only joins bytes and writes.
//!
//! Each claim's writes stay atomic: a group is one batch, so every claim in it lands or none
//! does. Claims in one group never share a key (each holds its key's latch until its commit is
//! visible).

use std::sync::Arc;

use crossbeam::channel::{Receiver, Sender, TryRecvError};
use rocksdb::WriteBatch;

use crate::format::error::{Error, Result};

/// Most claims one group writes. Bounds the latency a claim can wait behind others in one batch.
pub(crate) const GROUP_CLAIMS_MAX: usize = 1024;
/// A group stops taking jobs once its batches reach this size, for the same reason.
pub(crate) const GROUP_BYTES_MAX: usize = 16 << 20;

/// A write `Storage::write_durable` started: done (the numbers of its batches and their
/// one outcome), or durable in the commit log and still to be applied to the tables.
pub(crate) enum StagedWrite {
    Done(Vec<usize>, Result<()>),
    Logged(crate::storage::log::logged_writes::DurableGroup),
}

/// The engine's one write path, as a job carries it: a reference to the store that writes,
/// which the store implements. (The store owns its committer, so the committer cannot hold
/// the store; each job holds it until its group is written.)
pub(crate) trait BatchWriter: Send + Sync {
    /// Makes `batches` (one per job, numbered) durable with the engine's durability: with the
    /// commit log, in the log (the tables are written by [`BatchWriter::complete_write`]),
    /// returning those the log had no room for yet; without it, joined and written whole.
    fn write_durable(
        &self,
        batches: Vec<(usize, WriteBatch)>,
    ) -> (StagedWrite, Vec<(usize, WriteBatch)>);
    /// Finishes a write [`BatchWriter::write_durable`] started: each batch's outcome, by its
    /// number.
    fn complete_write(&self, staged: StagedWrite) -> Vec<(usize, Result<()>)>;
}

/// What a job does once its group is written (or failed): report, release its claims' keys,
/// then answer its caller, in that order, so a caller that awaited every commit and then drops
/// the engine finds no claim of ours still keeping it open.
pub(crate) type FinishFn = Box<dyn FnOnce(Result<()>) + Send>;

/// One commit waiting for the committer: a claim's, or a claim batch's. The committer knows
/// neither: it joins batches, writes them through the first job's write path (every job of one
/// committer belongs to one engine) and tells each job the outcome.
pub(crate) struct Job {
    /// Every write of the commit, prepared by the caller.
    pub(crate) batch: WriteBatch,
    /// How many claims it commits: a group's size is bounded in claims.
    pub(crate) claims: usize,
    /// The engine's one write path.
    pub(crate) writer: Arc<dyn BatchWriter>,
    /// Told the group's outcome.
    pub(crate) finish: FinishFn,
}

pub(crate) fn committer_error(detail: &str) -> Error {
    Error::Storage {
        kind: crate::format::error::StorageErrorKind::Other,
        detail: detail.into(),
    }
}

/// The engine's committer: a queue and the thread that drains it. The thread holds no
/// reference to the engine between groups (jobs carry their claims'), so dropping the engine
/// closes the queue and the thread ends.
pub(crate) struct Committer {
    queue: Sender<Job>,
}

impl Committer {
    /// Starts the committer. `staged` (with the commit log): two threads, one that makes each
    /// group durable in the log and goes straight on to the next group, and one that applies
    /// the durable groups to the tables, in order, and answers their jobs. Without the log one
    /// thread does both.
    fn spawn(staged: bool) -> Result<Committer> {
        let (queue, jobs) = crossbeam::channel::unbounded();
        let start = |name: &str, run: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(run)
                .map_err(|error| Error::Storage {
                    kind: crate::format::error::StorageErrorKind::Io,
                    detail: format!("cannot start the committer thread: {error}"),
                })
        };
        if staged {
            let (durable, applier) = crossbeam::channel::unbounded();
            start(
                "idemdb-committer",
                Box::new(move || run(&jobs, Some(&durable))),
            )?;
            start("idemdb-applier", Box::new(move || apply(&applier)))?;
        } else {
            start("idemdb-committer", Box::new(move || run(&jobs, None)))?;
        }
        Ok(Committer { queue })
    }

    /// Queues a prepared job; its `finish` is told the outcome.
    pub(crate) fn submit(&self, job: Job) {
        if let Err(unsent) = self.queue.send(job) {
            // The thread holds the receiving end for as long as the engine lives; this is
            // unreachable while the job's claims hold the engine, but answer rather than panic.
            (unsent.into_inner().finish)(Err(committer_error("the committer thread is gone")));
        }
    }
}

/// A group made durable, on its way to the applier thread.
struct DurableJobs {
    writer: Arc<dyn BatchWriter>,
    staged: StagedWrite,
    /// The finish of each job the write holds, by the job's number.
    finishes: Vec<(usize, FinishFn)>,
}

/// The committer thread: one group per loop, until the engine is dropped. With `applier`, it
/// hands each durable group on and takes the next; without, it finishes each itself.
fn run(jobs: &Receiver<Job>, applier: Option<&Sender<DurableJobs>>) {
    while let Ok(first) = jobs.recv() {
        let mut claims = first.claims;
        let mut bytes = first.batch.size_in_bytes();
        let mut group = vec![first];
        while claims < GROUP_CLAIMS_MAX && bytes < GROUP_BYTES_MAX {
            match jobs.try_recv() {
                Ok(job) => {
                    claims += job.claims;
                    bytes += job.batch.size_in_bytes();
                    group.push(job);
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        // Each write goes on as soon as it is durable: with the commit log, the next write of
        // the same group may wait for it to be applied (a full ring).
        write_group(group, &mut |durable| match applier {
            Some(applier) => {
                if let Err(unsent) = applier.send(durable) {
                    // The applier ends only when this thread does: unreachable.
                    finish_group(unsent.into_inner());
                }
            }
            None => finish_group(durable),
        });
    }
}

/// The applier thread: finishes the durable groups in the order they come.
fn apply(groups: &Receiver<DurableJobs>) {
    while let Ok(group) = groups.recv() {
        finish_group(group);
    }
}

/// Makes one group's jobs durable: one write, or, with the commit log, as many as its ring
/// needs; each is handed to `deliver` at once.
fn write_group(group: Vec<Job>, deliver: &mut dyn FnMut(DurableJobs)) {
    let Some(writer) = group.first().map(|job| job.writer.clone()) else {
        return;
    };
    let mut finishes: Vec<Option<FinishFn>> = Vec::with_capacity(group.len());
    let mut batches = Vec::with_capacity(group.len());
    for (number, job) in group.into_iter().enumerate() {
        batches.push((number, job.batch));
        finishes.push(Some(job.finish));
    }
    let mut writer = Some(writer);
    while let Some(current) = writer.take() {
        let (staged, left) = current.write_durable(std::mem::take(&mut batches));
        // The jobs this write holds: every one not left for the next (linear in the group).
        let mut waiting = vec![false; finishes.len()];
        for (number, _) in &left {
            waiting[*number] = true;
        }
        let held: Vec<(usize, FinishFn)> = (0..finishes.len())
            .filter(|&number| !waiting[number])
            .filter_map(|number| finishes[number].take().map(|finish| (number, finish)))
            .collect();
        // The last write takes this thread's reference to the store with it: once its jobs
        // are answered, nothing here keeps the store open.
        if !left.is_empty() {
            writer = Some(current.clone());
        }
        deliver(DurableJobs {
            writer: current,
            staged,
            finishes: held,
        });
        batches = left;
    }
}

/// Completes a write and answers each of its jobs. Holds no engine reference of its own once
/// written: the claims' are the last, so once the last caller is answered nothing here keeps
/// the store open.
fn finish_group(group: DurableJobs) {
    let DurableJobs {
        writer,
        staged,
        finishes,
    } = group;
    let mut outcomes: std::collections::HashMap<usize, Result<()>> =
        writer.complete_write(staged).into_iter().collect();
    drop(writer);
    for (number, finish) in finishes {
        let outcome = outcomes
            .remove(&number)
            .unwrap_or_else(|| Err(committer_error("the write did not answer for a commit")));
        finish(outcome);
    }
}

/// Where the engine keeps its committer: started by the first async commit.
#[derive(Default)]
pub(crate) struct CommitterSlot(std::sync::OnceLock<Committer>);

impl CommitterSlot {
    /// The committer, started by the first call (`staged`: see [`Committer::spawn`]).
    pub(crate) fn get_or_start(&self, staged: bool) -> Result<&Committer> {
        if let Some(committer) = self.0.get() {
            return Ok(committer);
        }
        let started = Committer::spawn(staged)?;
        // Two first callers may race: the loser's queue is dropped unused and its thread ends.
        Ok(self.0.get_or_init(|| started))
    }
}
