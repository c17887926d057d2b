//! Async commits (feature `tokio`): [`Claim::commit_async`] hands the claim to the engine's
//! committer thread and returns a future that thread completes.
//!
//! Why a thread of our own rather than `spawn_blocking` per message: a durable commit spends
//! almost all its time in the WAL's fsync. One thread that takes every claim waiting for it,
//! appends them all to one `WriteBatch` and writes that batch once (one WAL record, one fsync)
//! turns N waiting commits into one fsync, and while it syncs the next group collects in its
//! queue. `spawn_blocking` would park one runtime blocking thread per message and leave the
//! grouping to RocksDB's write queue.
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

use crate::claim::{Claim, Committed};
use crate::error::{Error, Result};

/// Most claims one group writes. Bounds the latency a claim can wait behind others in one batch.
pub(crate) const GROUP_CLAIMS_MAX: usize = 1024;
/// A group stops taking claims once its batch reaches this size, for the same reason.
pub(crate) const GROUP_BYTES_MAX: usize = 16 << 20;

/// One claim waiting for the committer.
struct Job {
    claim: Claim,
    result: Vec<u8>,
    started: Instant,
    reply: oneshot::Sender<Result<Committed>>,
}

/// The engine's committer: a queue and the thread that drains it. The thread holds no
/// reference to the engine between groups (claims carry their own), so dropping the engine
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
}

/// The committer thread: one group per loop, until the engine is dropped.
fn run(jobs: &Receiver<Job>) {
    while let Ok(first) = jobs.recv() {
        let mut group = vec![first];
        let mut batch = WriteBatch::default();
        let mut appended = Vec::with_capacity(group.len());
        loop {
            for mut job in group.drain(..) {
                match job.claim.append_commit(&mut batch, &job.result) {
                    Ok(committed) => appended.push((job, committed)),
                    // Nothing of this claim was appended: it fails alone, the others go on.
                    Err(error) => finish(job, Err(error)),
                }
            }
            if appended.len() >= GROUP_CLAIMS_MAX || batch.size_in_bytes() >= GROUP_BYTES_MAX {
                break;
            }
            match jobs.try_recv() {
                Ok(job) => group.push(job),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        write_group(batch, appended);
    }
}

/// Writes one group and answers each of its claims. Holds no engine reference of its own: the
/// claims' are the last, so once the last caller is answered nothing here keeps the store open.
fn write_group(batch: WriteBatch, appended: Vec<(Job, Committed)>) {
    let Some((first, _)) = appended.first() else {
        return;
    };
    let written = first.claim.inner().write(batch);
    match written {
        Ok(()) => {
            for (job, committed) in appended {
                job.claim.committed(&committed, job.started);
                finish(job, Ok(committed));
            }
        }
        Err(error) => {
            // The whole group failed as one batch: every claim in it gets the same answer.
            for (job, _) in appended {
                finish(job, Err(error.clone()));
            }
        }
    }
}

/// Releases the claim's key, then answers its future. In this order, a caller that awaited
/// every commit and then drops the engine finds no claim of ours still keeping it open.
fn finish(job: Job, answer: Result<Committed>) {
    let Job { claim, reply, .. } = job;
    drop(claim);
    // The caller may have dropped the future; the commit stands either way.
    let _ = reply.send(answer);
}

/// The future of [`Claim::commit_async`]: resolves to what [`Claim::commit`] would have
/// returned.
///
/// Dropping it does not cancel the commit: the claim was handed over and is written with its
/// group all the same.
#[must_use = "the commit's outcome is only known by awaiting the future"]
#[derive(Debug)]
pub struct CommitFuture {
    state: State,
}

#[derive(Debug)]
enum State {
    /// Settled without the committer (a buffered commit, or a claim that failed its checks).
    Ready(Option<Result<Committed>>),
    Waiting(oneshot::Receiver<Result<Committed>>),
}

impl Future for CommitFuture {
    type Output = Result<Committed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Committed>> {
        match &mut self.state {
            State::Ready(answer) => Poll::Ready(
                answer
                    .take()
                    .expect("a CommitFuture is not polled after it completed"),
            ),
            State::Waiting(receiver) => Pin::new(receiver).poll(cx).map(|answer| {
                // The sender is only dropped unanswered if the committer thread died, which
                // only a panic in it can do.
                answer.unwrap_or_else(|_| {
                    Err(Error::Storage {
                        kind: crate::error::StorageErrorKind::Other,
                        detail: "the committer thread stopped before answering".into(),
                    })
                })
            }),
        }
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
    pub fn commit_async(self, result: impl AsRef<[u8]>) -> CommitFuture {
        let inner = self.inner().clone();
        if !inner.syncs_each_write() {
            return CommitFuture {
                state: State::Ready(Some(self.commit(result))),
            };
        }
        let committer = match inner.committer() {
            Ok(committer) => committer,
            Err(error) => {
                return CommitFuture {
                    state: State::Ready(Some(Err(error))),
                };
            }
        };
        let (reply, receiver) = oneshot::channel();
        let job = Job {
            claim: self,
            result: result.as_ref().to_vec(),
            started: Instant::now(),
            reply,
        };
        if let Err(unsent) = committer.queue.send(job) {
            // The thread holds the receiving end for as long as the engine lives; this is
            // unreachable while we hold `inner`, but answer rather than panic.
            let job = unsent.into_inner();
            finish(
                job,
                Err(Error::Storage {
                    kind: crate::error::StorageErrorKind::Other,
                    detail: "the committer thread is gone".into(),
                }),
            );
        }
        CommitFuture {
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
