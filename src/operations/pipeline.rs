//! Several commits in flight from one thread, settled in the order they were handed over:
//! [`Pipeline`] (blocking) and [`AsyncPipeline`] (feature `tokio`).
//!
//! Why: a durable commit spends most of its time waiting for the disk. A consumer that waits
//! for each before it claims the next message leaves the disk idle while it works and its CPU
//! idle while the disk syncs. Handed to the engine's committer thread, commits are written in
//! groups while the caller prepares the next ones; the pipeline keeps at most `depth` of them
//! in flight (back-pressure) and gives each caller's tag back once its commit and every commit
//! before it are settled, so that an acknowledgement never runs ahead of one still at risk.
//!
//! Order: the committer answers in the order commits reach it, but a pipeline may hold commits
//! of several engines, and a buffered engine answers at once, so the entries are numbered and
//! settled by their numbers, never by arrival. Past a failed commit nothing settles as
//! durable: every later entry settles as [`Error::PipelineBroken`], and those handed over after
//! the failure is known are not committed at all (their claims are dropped, which releases
//! them).

use std::collections::VecDeque;

use crate::format::error::{Error, Limit, Result, check_limit};
use crate::format::record::Committed;
use crate::operations::batch::ClaimBatch;
use crate::operations::claim::Claim;

/// The most commits a pipeline keeps in flight.
pub const PIPELINE_DEPTH_MAX: usize = 1024;

/// What a pipeline's entry became once settled without error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Durable {
    /// A claim's commit ([`Pipeline::commit`]): what [`Claim::commit`] returns.
    Claim(Committed),
    /// A batch's commit ([`Pipeline::commit_batch`]): what [`ClaimBatch::commit`] returns.
    Batch(Vec<Option<Committed>>),
    /// An entry with nothing to commit ([`Pipeline::pass`]): every entry before it is durable.
    Passed,
}

/// One entry of a pipeline, settled: the tag it was handed over with, and its outcome.
#[derive(Clone, Debug)]
pub struct Settled<T> {
    /// The caller's tag (a broker's delivery tag, say).
    pub tag: T,
    /// `Ok` once the entry's commit, and every entry's before it, is durable (visible to
    /// reads); the commit's error; or [`Error::PipelineBroken`] after an earlier entry failed.
    pub outcome: Result<Durable>,
}

/// A commit's answer, numbered by its entry.
type Answer = (u64, Result<Durable>);

/// The entries both flavours keep: in the order handed over, each with its answer once it has
/// one.
struct Entries<T> {
    depth: usize,
    /// The number of the front entry; the entries behind it follow one by one.
    front: u64,
    entries: VecDeque<(T, Option<Result<Durable>>)>,
    /// Entries handed to a committer and not answered yet.
    in_flight: usize,
    /// The first failure answered (not necessarily settled yet): later entries are not
    /// committed.
    failed: Option<String>,
    /// The first failure settled: every later entry settles as broken.
    broken: Option<String>,
}

impl<T> Entries<T> {
    fn new(depth: usize) -> Result<Entries<T>> {
        check_limit(Limit::PipelineDepth, depth, 1, PIPELINE_DEPTH_MAX)?;
        Ok(Entries {
            depth,
            front: 0,
            entries: VecDeque::new(),
            in_flight: 0,
            failed: None,
            broken: None,
        })
    }

    /// Adds an entry; `answer` is `None` for a commit still to be answered. Its number.
    fn push(&mut self, tag: T, answer: Option<Result<Durable>>) -> u64 {
        if answer.is_none() {
            self.in_flight += 1;
        }
        self.entries.push_back((tag, answer));
        self.front + self.entries.len() as u64 - 1
    }

    /// Whether a commit handed over now would exceed the depth.
    fn full(&self) -> bool {
        self.in_flight >= self.depth
    }

    /// Records an answer. (An answer for no entry cannot come: each is sent once, for an entry
    /// that stays until it is answered.)
    fn answer(&mut self, (number, answer): Answer) {
        let Some(index) = number.checked_sub(self.front) else {
            return;
        };
        if let Some((_, slot @ None)) = self.entries.get_mut(index as usize) {
            if let (Err(error), None) = (&answer, &self.failed) {
                self.failed = Some(error.to_string());
            }
            *slot = Some(answer);
            self.in_flight -= 1;
        }
    }

    /// Whether the front entry is answered.
    fn front_answered(&self) -> bool {
        matches!(self.entries.front(), Some((_, Some(_))))
    }

    /// The front entry, if it is answered.
    fn pop_settled(&mut self) -> Option<Settled<T>> {
        if !self.front_answered() {
            return None;
        }
        let (tag, answer) = self.entries.pop_front()?;
        self.front += 1;
        let mut outcome = answer?;
        match (&self.broken, &outcome) {
            (Some(earlier), _) => {
                outcome = Err(Error::PipelineBroken {
                    earlier: earlier.clone(),
                });
            }
            (None, Err(error)) => self.broken = Some(error.to_string()),
            (None, Ok(_)) => {}
        }
        Some(Settled { tag, outcome })
    }

    /// Every entry settled now, in order.
    fn drain_settled(&mut self) -> Vec<Settled<T>> {
        std::iter::from_fn(|| self.pop_settled()).collect()
    }

    /// An entry handed over after a failure is known: settled at once as broken, not
    /// committed (`None`); else its tag back, for a commit.
    fn unless_broken(&mut self, tag: T) -> Option<T> {
        let Some(earlier) = &self.failed else {
            return Some(tag);
        };
        let refusal = Err(Error::PipelineBroken {
            earlier: earlier.clone(),
        });
        self.push(tag, Some(refusal));
        None
    }

    /// Adds an entry for a commit about to be handed over, and the function that answers for
    /// it through `sender` (the pipeline may be gone by then; the commit stands either way).
    fn reply(
        &mut self,
        tag: T,
        sender: &impl AnswerSender,
    ) -> impl FnOnce(Result<Durable>) + Send + 'static {
        let number = self.push(tag, None);
        let sender = sender.clone();
        move |answer| sender.answer((number, answer))
    }
}

/// The sending end of a flavour's channel of answers.
trait AnswerSender: Clone + Send + 'static {
    fn answer(&self, answer: Answer);
}

impl AnswerSender for crossbeam::channel::Sender<Answer> {
    fn answer(&self, answer: Answer) {
        let _ = self.send(answer);
    }
}

#[cfg(feature = "tokio")]
impl AnswerSender for tokio::sync::mpsc::UnboundedSender<Answer> {
    fn answer(&self, answer: Answer) {
        let _ = self.send(answer);
    }
}

/// Commits in flight from one thread, blocking ([`crate::Consumer::pipeline`]): each commit is
/// handed to the engine's committer and the call returns at once, unless `depth` commits are
/// in flight, then it waits for the oldest. Every entry comes back once, in the order handed
/// over, through [`Pipeline::settled`] or [`Pipeline::wait`], with the caller's tag.
///
/// With [`crate::Durability::Buffered`] each commit is made in the call (nothing waits for a
/// disk) and settles at once. Dropping a pipeline does not cancel its commits: they stand, and
/// their messages (not acknowledged) come back as duplicates. Until they are written they keep
/// the store open, as its handles do: a store reopened right after its last handle and a
/// pipeline with commits in flight were dropped may still be [`Error::AlreadyOpen`] for a few
/// milliseconds ([`Pipeline::wait`] first, to close it at once).
///
/// ```
/// use idemdb::{Durable, Engine, Fingerprint, Outcome};
///
/// let dir = tempfile::tempdir()?;
/// let engine = Engine::builder(dir.path()).open()?; // Durability::Sync
/// let orders = engine.consumer("orders")?;
/// let mut pipeline = orders.pipeline(4)?; // at most 4 commits in flight
/// let mut acknowledged = Vec::new();
/// for (tag, key) in [(1_u64, "m-1"), (2, "m-2"), (3, "m-1"), (4, "m-3")] {
///     match orders.begin(key, Fingerprint::of(key.as_bytes()))? {
///         Outcome::Fresh(claim) => pipeline.commit(claim, b"done", tag),
///         // A duplicate (or a message another commit in flight holds) is acknowledged in
///         // its turn: after every commit before it is durable.
///         _ => pipeline.pass(tag),
///     }
///     for settled in pipeline.settled() {
///         settled.outcome?; // on an error: leave the message unacknowledged
///         acknowledged.push(settled.tag);
///     }
/// }
/// for settled in pipeline.wait() {
///     settled.outcome?;
///     acknowledged.push(settled.tag);
/// }
/// assert_eq!(acknowledged, [1, 2, 3, 4]); // in the order handed over
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Pipeline<T> {
    entries: Entries<T>,
    sender: crossbeam::channel::Sender<Answer>,
    answers: crossbeam::channel::Receiver<Answer>,
}

impl<T> Pipeline<T> {
    /// A pipeline of at most `depth` commits in flight (1..=[`PIPELINE_DEPTH_MAX`], else
    /// [`Error::LimitExceeded`]).
    pub(crate) fn new(depth: usize) -> Result<Pipeline<T>> {
        let (sender, answers) = crossbeam::channel::unbounded();
        Ok(Pipeline {
            entries: Entries::new(depth)?,
            sender,
            answers,
        })
    }

    /// Commits `claim` with `result` ([`Claim::commit`]) in flight: returns once it is handed
    /// over, after waiting for the oldest commit if `depth` are in flight. Its entry settles
    /// with `tag`. After a failure, the claim is not committed (it is dropped, which releases
    /// it) and its entry settles as [`Error::PipelineBroken`].
    pub fn commit(&mut self, claim: Claim, result: impl AsRef<[u8]>, tag: T) {
        let Some(tag) = self.entries.unless_broken(tag) else {
            return;
        };
        self.wait_for_room();
        let reply = self.entries.reply(tag, &self.sender);
        claim.submit(result.as_ref(), move |answer| {
            reply(answer.map(Durable::Claim));
        });
        self.take_answers();
    }

    /// Commits `batch` ([`ClaimBatch::commit`], `result_of` giving each claim's result by its
    /// index) in flight, as [`Pipeline::commit`] does a claim.
    pub fn commit_batch<R: AsRef<[u8]>>(
        &mut self,
        batch: ClaimBatch,
        result_of: impl FnMut(usize) -> R,
        tag: T,
    ) {
        let Some(tag) = self.entries.unless_broken(tag) else {
            return;
        };
        self.wait_for_room();
        let reply = self.entries.reply(tag, &self.sender);
        batch.submit(result_of, move |answer| reply(answer.map(Durable::Batch)));
        self.take_answers();
    }

    /// An entry with nothing to commit (a duplicate's message, say): it settles, as
    /// [`Durable::Passed`], once every entry before it has.
    pub fn pass(&mut self, tag: T) {
        self.entries.push(tag, Some(Ok(Durable::Passed)));
    }

    /// The entries settled by now, in the order handed over, without waiting.
    pub fn settled(&mut self) -> Vec<Settled<T>> {
        self.take_answers();
        self.entries.drain_settled()
    }

    /// Records the answers already sent (a buffered commit's, made in the call, among them).
    fn take_answers(&mut self) {
        while let Ok(answer) = self.answers.try_recv() {
            self.entries.answer(answer);
        }
    }

    /// Waits for the oldest entry not yet returned to settle, and returns it; `None` when the
    /// pipeline holds no entry.
    pub fn next_settled(&mut self) -> Option<Settled<T>> {
        while !self.entries.front_answered() && self.entries.in_flight > 0 {
            self.receive();
        }
        self.entries.pop_settled()
    }

    /// Waits for every commit in flight; every entry not yet returned, in order.
    pub fn wait(&mut self) -> Vec<Settled<T>> {
        while self.entries.in_flight > 0 {
            self.receive();
        }
        self.settled()
    }

    /// How many entries are not returned yet (in flight, or settled and not taken).
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.entries.len()
    }

    /// Whether every entry handed over has been returned.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.entries.is_empty()
    }

    /// How many commits are in flight (handed over and not answered).
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.entries.in_flight
    }

    fn wait_for_room(&mut self) {
        while self.entries.full() {
            self.receive();
        }
    }

    fn receive(&mut self) {
        // This pipeline holds a sender, so the channel never closes under it; each commit in
        // flight answers once (its claim or batch promises it).
        if let Ok(answer) = self.answers.recv() {
            self.entries.answer(answer);
        }
    }
}

impl<T> std::fmt::Debug for Pipeline<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("depth", &self.entries.depth)
            .field("in_flight", &self.entries.in_flight)
            .field("entries", &self.entries.entries.len())
            .finish_non_exhaustive()
    }
}

/// [`Pipeline`] for async code (feature `tokio`, [`crate::Consumer::async_pipeline`]): the
/// waits are awaited, never a runtime thread blocked.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use idemdb::{Engine, Fingerprint, Outcome};
///
/// let dir = tempfile::tempdir()?;
/// let engine = Engine::builder(dir.path()).open()?;
/// let orders = engine.consumer("orders")?;
/// let mut pipeline = orders.async_pipeline(4)?;
/// for tag in 0..10_u64 {
///     let key = format!("m-{tag}");
///     if let Outcome::Fresh(claim) = orders.begin(&key, Fingerprint::of(key.as_bytes()))? {
///         pipeline.commit(claim, b"done", tag).await;
///     }
///     for settled in pipeline.settled() {
///         settled.outcome?; // durable: acknowledge settled.tag
///     }
/// }
/// let rest = pipeline.wait().await;
/// assert!(rest.iter().all(|settled| settled.outcome.is_ok()));
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "tokio")]
pub struct AsyncPipeline<T> {
    entries: Entries<T>,
    sender: tokio::sync::mpsc::UnboundedSender<Answer>,
    answers: tokio::sync::mpsc::UnboundedReceiver<Answer>,
}

#[cfg(feature = "tokio")]
impl<T> AsyncPipeline<T> {
    /// As [`Pipeline`]'s.
    pub(crate) fn new(depth: usize) -> Result<AsyncPipeline<T>> {
        let (sender, answers) = tokio::sync::mpsc::unbounded_channel();
        Ok(AsyncPipeline {
            entries: Entries::new(depth)?,
            sender,
            answers,
        })
    }

    /// [`Pipeline::commit`], awaiting room instead of blocking.
    pub async fn commit(&mut self, claim: Claim, result: impl AsRef<[u8]>, tag: T) {
        let Some(tag) = self.entries.unless_broken(tag) else {
            return;
        };
        self.wait_for_room().await;
        let reply = self.entries.reply(tag, &self.sender);
        claim.submit(result.as_ref(), move |answer| {
            reply(answer.map(Durable::Claim));
        });
        self.take_answers();
    }

    /// [`Pipeline::commit_batch`], awaiting room instead of blocking.
    pub async fn commit_batch<R: AsRef<[u8]>>(
        &mut self,
        batch: ClaimBatch,
        result_of: impl FnMut(usize) -> R,
        tag: T,
    ) {
        let Some(tag) = self.entries.unless_broken(tag) else {
            return;
        };
        self.wait_for_room().await;
        let reply = self.entries.reply(tag, &self.sender);
        batch.submit(result_of, move |answer| reply(answer.map(Durable::Batch)));
        self.take_answers();
    }

    /// [`Pipeline::pass`].
    pub fn pass(&mut self, tag: T) {
        self.entries.push(tag, Some(Ok(Durable::Passed)));
    }

    /// [`Pipeline::settled`].
    pub fn settled(&mut self) -> Vec<Settled<T>> {
        self.take_answers();
        self.entries.drain_settled()
    }

    fn take_answers(&mut self) {
        while let Ok(answer) = self.answers.try_recv() {
            self.entries.answer(answer);
        }
    }

    /// [`Pipeline::next_settled`], awaited. Cancel-safe (in a `tokio::select!`, say): an
    /// answer received before the cancellation is kept.
    pub async fn next_settled(&mut self) -> Option<Settled<T>> {
        while !self.entries.front_answered() && self.entries.in_flight > 0 {
            self.receive().await;
        }
        self.entries.pop_settled()
    }

    /// [`Pipeline::wait`], awaited.
    pub async fn wait(&mut self) -> Vec<Settled<T>> {
        while self.entries.in_flight > 0 {
            self.receive().await;
        }
        self.settled()
    }

    /// [`Pipeline::len`].
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.entries.len()
    }

    /// [`Pipeline::is_empty`].
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.entries.is_empty()
    }

    /// [`Pipeline::in_flight`].
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.entries.in_flight
    }

    async fn wait_for_room(&mut self) {
        while self.entries.full() {
            self.receive().await;
        }
    }

    async fn receive(&mut self) {
        if let Some(answer) = self.answers.recv().await {
            self.entries.answer(answer);
        }
    }
}

#[cfg(feature = "tokio")]
impl<T> std::fmt::Debug for AsyncPipeline<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncPipeline")
            .field("depth", &self.entries.depth)
            .field("in_flight", &self.entries.in_flight)
            .field("entries", &self.entries.entries.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed() -> Result<Durable> {
        Ok(Durable::Passed)
    }

    fn tags(settled: Vec<Settled<u32>>) -> Vec<(u32, bool)> {
        settled
            .into_iter()
            .map(|settled| (settled.tag, settled.outcome.is_ok()))
            .collect()
    }

    #[test]
    fn entries_settle_in_the_order_handed_over_whatever_order_answers_come_in() {
        let mut entries = Entries::new(4).unwrap();
        let first = entries.push(1, None);
        let second = entries.push(2, None);
        entries.push(3, Some(committed()));
        entries.answer((second, committed()));
        assert!(
            entries.drain_settled().is_empty(),
            "the first is not durable yet"
        );
        entries.answer((first, committed()));
        assert_eq!(
            tags(entries.drain_settled()),
            [(1, true), (2, true), (3, true)]
        );
    }

    #[test]
    fn nothing_after_a_failure_settles_as_durable() {
        let mut entries = Entries::new(4).unwrap();
        let first = entries.push(1, None);
        let second = entries.push(2, None);
        entries.answer((second, committed()));
        entries.answer((first, Err(Error::KeyBusy)));
        assert_eq!(
            entries.unless_broken(3),
            None,
            "later entries are not committed"
        );
        entries.push(4, Some(committed()));
        let settled = entries.drain_settled();
        assert_eq!(
            tags(settled.clone()),
            [(1, false), (2, false), (3, false), (4, false)]
        );
        assert!(matches!(settled[0].outcome, Err(Error::KeyBusy)));
        assert!(
            settled[1..]
                .iter()
                .all(|s| matches!(s.outcome, Err(Error::PipelineBroken { .. })))
        );
    }

    #[test]
    fn depth_bounds_the_commits_in_flight_not_the_passes() {
        let mut entries = Entries::<u32>::new(2).unwrap();
        entries.push(1, None);
        entries.push(2, Some(committed()));
        assert!(!entries.full());
        let third = entries.push(3, None);
        assert!(entries.full());
        entries.answer((third, committed()));
        assert!(!entries.full());
        assert!(matches!(
            Entries::<u32>::new(0),
            Err(Error::LimitExceeded {
                limit: Limit::PipelineDepth,
                ..
            })
        ));
        assert!(Entries::<u32>::new(PIPELINE_DEPTH_MAX + 1).is_err());
    }
}
