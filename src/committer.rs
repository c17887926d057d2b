//! Async commits (feature `tokio`): [`Claim::commit_async`] and [`ClaimBatch::commit_async`]
//! hand their prepared write batch to the engine's committer thread and return a future that
//! thread completes.
//!
//! Why a thread of our own rather than `spawn_blocking` per message: a durable commit spends
//! almost all its time in the WAL's fsync. One thread that takes every batch waiting for it,
//! joins them into one `WriteBatch` and writes that once (one WAL record, one fsync) turns N
//! waiting commits into one fsync, and while it syncs the next group collects in its queue.
//! `spawn_blocking` would park one runtime blocking thread per message and leave the grouping
//! to RocksDB's write queue. The callers build their own batches (the CPU part of a commit), so
//! the committer only joins bytes and writes.
//!
//! Each claim's writes stay atomic: a group is one batch, so every claim in it lands or none
//! does. Claims in one group never share a key (each holds its key's latch until its commit is
//! visible).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender, TryRecvError};
use rocksdb::WriteBatch;
use tokio::sync::oneshot;

use crate::batch::ClaimBatch;
use crate::claim::{Claim, Committed};
use crate::error::{Error, Result};

/// Most claims one group writes. Bounds the latency a claim can wait behind others in one batch.
pub(crate) const GROUP_CLAIMS_MAX: usize = 1024;
/// A group stops taking jobs once its batches reach this size, for the same reason.
pub(crate) const GROUP_BYTES_MAX: usize = 16 << 20;

/// RocksDB's write batch layout (`WriteBatch::rep_` in write_batch.cc): an 8-byte sequence
/// number, a 4-byte little-endian record count, then the records.
const WRITE_BATCH_HEADER_BYTES: usize = 12;

/// One commit waiting for the committer: a claim's, or a claim batch's.
struct Job {
    /// Every write of the commit, prepared by the caller.
    batch: WriteBatch,
    /// The claims it commits, by message index (`None`: nothing to commit at that index). They
    /// keep their keys latched until the batch is visible.
    claims: Vec<Option<Claim>>,
    committed: Vec<Option<Committed>>,
    started: Instant,
    reply: Reply,
}

/// Where a job's answer goes.
enum Reply {
    Claim(oneshot::Sender<Result<Committed>>),
    Batch(oneshot::Sender<Result<Vec<Option<Committed>>>>),
}

impl Job {
    fn claims(&self) -> usize {
        self.claims.iter().flatten().count()
    }

    /// Reports each commit to its consumer's metrics and logs.
    fn observe(&self) {
        for (claim, committed) in self.claims.iter().zip(&self.committed) {
            if let (Some(claim), Some(committed)) = (claim, committed) {
                claim.committed(committed, self.started);
            }
        }
    }

    /// Releases the claims' keys, then answers the future. In this order, a caller that awaited
    /// every commit and then drops the engine finds no claim of ours still keeping it open.
    fn finish(self, written: Result<()>) {
        let Job {
            claims,
            committed,
            reply,
            ..
        } = self;
        drop(claims);
        // The caller may have dropped the future; the commit stands either way.
        match reply {
            Reply::Claim(sender) => {
                let answer = written.and_then(|()| {
                    committed.into_iter().flatten().next().ok_or_else(|| {
                        committer_error("a claim's commit was sent without its record")
                    })
                });
                let _ = sender.send(answer);
            }
            Reply::Batch(sender) => {
                let _ = sender.send(written.map(|()| committed));
            }
        }
    }
}

fn committer_error(detail: &str) -> Error {
    Error::Storage {
        kind: crate::error::StorageErrorKind::Other,
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
    fn spawn() -> Result<Committer> {
        let (queue, jobs) = crossbeam::channel::unbounded();
        std::thread::Builder::new()
            .name("idemdb-committer".into())
            .spawn(move || run(&jobs))
            .map_err(|error| Error::Storage {
                kind: crate::error::StorageErrorKind::Io,
                detail: format!("cannot start the committer thread: {error}"),
            })?;
        Ok(Committer { queue })
    }

    /// Queues a prepared job; a future of its answer.
    fn submit(&self, job: Job) {
        if let Err(unsent) = self.queue.send(job) {
            // The thread holds the receiving end for as long as the engine lives; this is
            // unreachable while the job's claims hold the engine, but answer rather than panic.
            unsent
                .into_inner()
                .finish(Err(committer_error("the committer thread is gone")));
        }
    }
}

/// The committer thread: one group per loop, until the engine is dropped.
fn run(jobs: &Receiver<Job>) {
    while let Ok(first) = jobs.recv() {
        let mut claims = first.claims();
        let mut bytes = first.batch.size_in_bytes();
        let mut group = vec![first];
        while claims < GROUP_CLAIMS_MAX && bytes < GROUP_BYTES_MAX {
            match jobs.try_recv() {
                Ok(job) => {
                    claims += job.claims();
                    bytes += job.batch.size_in_bytes();
                    group.push(job);
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        write_group(group);
    }
}

/// Writes one group as one batch and answers each of its jobs. Holds no engine reference of its
/// own: the claims' are the last, so once the last caller is answered nothing here keeps the
/// store open.
fn write_group(mut group: Vec<Job>) {
    let Some(inner) = group
        .iter()
        .flat_map(|job| job.claims.iter().flatten())
        .next()
        .map(|claim| claim.inner().clone())
    else {
        return;
    };
    let batch = if group.len() == 1 {
        std::mem::take(&mut group[0].batch)
    } else {
        join(group.iter().map(|job| &job.batch))
    };
    let written = inner.write(batch);
    drop(inner);
    if written.is_ok() {
        group.iter().for_each(Job::observe);
    }
    // A group is one batch: on failure every job in it gets the same answer.
    for job in group {
        job.finish(written.clone());
    }
}

/// One write batch holding every record of `batches`, in order: RocksDB applies it atomically,
/// as it would each of them.
fn join<'a>(batches: impl Iterator<Item = &'a WriteBatch> + Clone) -> WriteBatch {
    let records: usize = batches.clone().map(|batch| batch.len()).sum();
    let bytes: usize = batches
        .clone()
        .map(|batch| batch.data().len() - WRITE_BATCH_HEADER_BYTES)
        .sum();
    let mut rep = Vec::with_capacity(WRITE_BATCH_HEADER_BYTES + bytes);
    // The sequence number is assigned by the write.
    rep.extend_from_slice(&0u64.to_le_bytes());
    // A group stops taking jobs at GROUP_CLAIMS_MAX claims, and one job (a batch) holds at most
    // BATCH_MESSAGES_MAX claims of at most STAGED_WRITES_MAX + 2 records each: about 335
    // million records, well inside a u32.
    let count = u32::try_from(records).expect("a group's record count fits RocksDB's u32");
    rep.extend_from_slice(&count.to_le_bytes());
    for batch in batches {
        rep.extend_from_slice(&batch.data()[WRITE_BATCH_HEADER_BYTES..]);
    }
    WriteBatch::from_data(&rep)
}

/// The future of [`Claim::commit_async`]: resolves to what [`Claim::commit`] would have
/// returned.
///
/// Dropping it does not cancel the commit: the claim was handed over and is written with its
/// group all the same.
#[must_use = "the commit's outcome is only known by awaiting the future"]
#[derive(Debug)]
pub struct CommitFuture {
    state: State<Committed>,
}

/// The future of [`ClaimBatch::commit_async`]: resolves to what [`ClaimBatch::commit`] would
/// have returned. Dropping it does not cancel the commit.
#[must_use = "the commit's outcome is only known by awaiting the future"]
#[derive(Debug)]
pub struct BatchCommitFuture {
    state: State<Vec<Option<Committed>>>,
}

#[derive(Debug)]
enum State<T> {
    /// Settled without the committer (a buffered commit, or one that failed its checks).
    Ready(Option<Result<T>>),
    Waiting(oneshot::Receiver<Result<T>>),
}

impl<T> State<T> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<T>> {
        match self {
            State::Ready(answer) => Poll::Ready(
                answer
                    .take()
                    .expect("a commit future is not polled after it completed"),
            ),
            State::Waiting(receiver) => Pin::new(receiver).poll(cx).map(|answer| {
                // The sender is only dropped unanswered if the committer thread died, which
                // only a panic in it can do.
                answer.unwrap_or_else(|_| {
                    Err(committer_error(
                        "the committer thread stopped before answering",
                    ))
                })
            }),
        }
    }
}

impl Future for CommitFuture {
    type Output = Result<Committed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Committed>> {
        self.state.poll(cx)
    }
}

impl Future for BatchCommitFuture {
    type Output = Result<Vec<Option<Committed>>>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<Option<Committed>>>> {
        self.state.poll(cx)
    }
}

impl Claim {
    /// Commits like [`Claim::commit`], without blocking the calling thread on the WAL's fsync.
    ///
    /// With [`crate::Durability::Sync`] the claim goes to the engine's committer thread, which
    /// writes every claim waiting for it as one batch (one WAL write, one fsync) and completes
    /// their futures; a runtime's worker thread is never blocked. With
    /// [`crate::Durability::Buffered`] nothing waits for a disk, so the commit is made here and
    /// the future is ready at once.
    ///
    /// The key stays claimed until the commit is visible, as with [`Claim::commit`]. Dropping
    /// the future does not cancel the commit.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use idemdb::{Engine, Fingerprint, Outcome};
    /// let dir = tempfile::tempdir()?;
    /// let engine = Engine::builder(dir.path()).open()?; // Durability::Sync
    /// let billing = engine.consumer("billing")?;
    /// if let Outcome::Fresh(claim) = billing.begin(b"order-42", Fingerprint::of(b"payload"))? {
    ///     let committed = claim.commit_async(b"charged").await?; // durable here
    ///     assert_eq!(committed.epoch, 1);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// The future resolves to the errors of [`Claim::commit`]. In a group whose write fails,
    /// every claim gets the same error.
    pub fn commit_async(mut self, result: impl AsRef<[u8]>) -> CommitFuture {
        let inner = self.inner().clone();
        if !inner.syncs_each_write() {
            return CommitFuture {
                state: State::Ready(Some(self.commit(result))),
            };
        }
        let started = Instant::now();
        let committer = match inner.committer() {
            Ok(committer) => committer,
            Err(error) => {
                return CommitFuture {
                    state: State::Ready(Some(Err(error))),
                };
            }
        };
        let mut batch = WriteBatch::default();
        // Nothing is appended on error, and the claim is released as `commit` would.
        let committed = match self.append_commit(&mut batch, result.as_ref()) {
            Ok(committed) => committed,
            Err(error) => {
                return CommitFuture {
                    state: State::Ready(Some(Err(error))),
                };
            }
        };
        let (reply, receiver) = oneshot::channel();
        committer.submit(Job {
            batch,
            claims: vec![Some(self)],
            committed: vec![Some(committed)],
            started,
            reply: Reply::Claim(reply),
        });
        CommitFuture {
            state: State::Waiting(receiver),
        }
    }
}

impl ClaimBatch {
    /// Commits like [`ClaimBatch::commit`] (one write batch for every claim still held),
    /// without blocking the calling thread on the WAL's fsync: with
    /// [`crate::Durability::Sync`] the batch goes to the engine's committer thread, which may
    /// write it together with other waiting commits (still one atomic batch). With
    /// [`crate::Durability::Buffered`] the commit is made here and the future is ready at once.
    /// Dropping the future does not cancel the commit.
    ///
    /// # Errors
    /// The future resolves to the errors of [`ClaimBatch::commit`].
    pub fn commit_async<R: AsRef<[u8]>>(
        mut self,
        result_of: impl FnMut(usize) -> R,
    ) -> BatchCommitFuture {
        let inner = self.inner().clone();
        if !inner.syncs_each_write() {
            return BatchCommitFuture {
                state: State::Ready(Some(self.commit(result_of))),
            };
        }
        let started = Instant::now();
        let prepared = inner
            .committer()
            .and_then(|committer| Ok((committer, self.prepare(result_of)?)));
        let (committer, (batch, committed)) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                return BatchCommitFuture {
                    state: State::Ready(Some(Err(error))),
                };
            }
        };
        if batch.is_empty() {
            // No claim left to commit: nothing to write or wait for.
            return BatchCommitFuture {
                state: State::Ready(Some(Ok(committed))),
            };
        }
        let (reply, receiver) = oneshot::channel();
        committer.submit(Job {
            batch,
            claims: self.take_claims(),
            committed,
            started,
            reply: Reply::Batch(reply),
        });
        BatchCommitFuture {
            state: State::Waiting(receiver),
        }
    }
}

/// Where the engine keeps its committer: started by the first async commit.
#[derive(Default)]
pub(crate) struct CommitterSlot(std::sync::OnceLock<Committer>);

impl CommitterSlot {
    pub(crate) fn get_or_start(&self) -> Result<&Committer> {
        if let Some(committer) = self.0.get() {
            return Ok(committer);
        }
        let started = Committer::spawn()?;
        // Two first callers may race: the loser's queue is dropped unused and its thread ends.
        Ok(self.0.get_or_init(|| started))
    }
}
