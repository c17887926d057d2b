//! Batch-native claims: a broker batch of N messages claimed with one RocksDB multi-get and
//! its winners committed with one write batch (one WAL write, one fsync).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use rocksdb::WriteBatch;

use crate::decision::inspect_record;
use crate::format::error::{Error, Limit, Result, check_limit};
use crate::format::fingerprint::Fingerprint;
use crate::format::record::{Committed, Record};
use crate::operations::claim::{Claim, Outcome, Pending, Request, begin, decide_in_place};
use crate::operations::position::StagedPositions;
use crate::operations::staging::{Staged, batch_for};
use crate::storage::business_table::BusinessTable;
use crate::storage::latch::KeyHashBuilder;
use crate::storage::store::{AcceptedPositions, Storage};

/// The most messages one batch claims.
pub const BATCH_MESSAGES_MAX: usize = 4096;

/// What one message of a batch got.
#[derive(Debug)]
pub enum BatchOutcome {
    /// Claimed: stage its writes with [`ClaimBatch::claim_mut`]; [`ClaimBatch::commit`] commits
    /// it unless it was [released](ClaimBatch::release).
    Fresh,
    /// The same key, with the same fingerprint, appears earlier in this batch at index
    /// `first`: this copy is a duplicate of that message. Acknowledge it with the batch.
    DuplicateInBatch {
        /// The index of the first copy.
        first: usize,
    },
    /// The same key appears earlier in this batch, at index `first`, with another fingerprint,
    /// and that first copy is [`BatchOutcome::Fresh`]: it will be committed with the batch, so
    /// this copy's content conflicts with it. Route it like an [`Outcome::Conflict`]:
    /// dead-letter and alert (or, if the first copy is [released](ClaimBatch::release), let
    /// the broker redeliver it). A repeat with another fingerprint whose first copy is not
    /// fresh is decided on its own, after the first copy, exactly as
    /// [`crate::Consumer::begin`] would decide it: against the stored record (a duplicate of
    /// it, or a conflict with it), `InProgress` while the key is held, or fresh.
    ConflictInBatch {
        /// The index of the first copy.
        first: usize,
        /// The first copy's fingerprint.
        first_fingerprint: Fingerprint,
        /// This copy's fingerprint.
        new_fingerprint: Fingerprint,
    },
    /// Anything but fresh, exactly as [`crate::Consumer::begin`] would report it.
    Settled(Outcome<Infallible>),
}

/// The claims of one batch of messages, in the order given.
pub struct ClaimBatch {
    inner: Arc<Storage>,
    claims: Vec<Option<Claim>>,
    outcomes: Vec<BatchOutcome>,
    /// The consumer's records prefix, for the keys of staged positions.
    prefix: Vec<u8>,
    /// Read positions staged on the batch itself (those of its claims join them at commit).
    positions: StagedPositions,
    /// Business writes staged on the batch itself, not on one of its claims.
    staged: Staged,
}

/// For each request, the index of the first request with the same key (itself if none before).
fn first_occurrences(requests: &[Request], hasher: KeyHashBuilder) -> Vec<usize> {
    let mut first_index: HashMap<&[u8], usize, KeyHashBuilder> =
        HashMap::with_capacity_and_hasher(requests.len(), hasher);
    requests
        .iter()
        .enumerate()
        .map(|(index, request)| *first_index.entry(&request.stored_key).or_insert(index))
        .collect()
}

/// Claims a batch: latches every distinct key, reads all latched keys with one multi-get, then
/// decides each message as `begin` would; a repeated key with the first copy's fingerprint is a
/// duplicate of it, one with another fingerprint a conflict with a fresh first copy, or else
/// decided by `begin` after the first copy.
pub(crate) fn begin_batch(
    inner: &Arc<Storage>,
    marker: usize,
    prefix: Vec<u8>,
    requests: Vec<Request>,
) -> Result<ClaimBatch> {
    check_limit(Limit::BatchMessages, requests.len(), 0, BATCH_MESSAGES_MAX)?;
    inner.check_not_poisoned()?;
    let now_ms = inner.clock.now_ms();
    let first_of = first_occurrences(&requests, inner.markers[marker].latches.hash_builder());
    let fingerprints: Vec<Fingerprint> = requests.iter().map(|r| r.fingerprint).collect();
    let mut batch = ClaimBatch {
        inner: inner.clone(),
        claims: Vec::with_capacity(requests.len()),
        outcomes: Vec::with_capacity(requests.len()),
        prefix,
        positions: StagedPositions::default(),
        staged: Staged::default(),
    };
    // On any error below, dropping `batch` releases every latch taken so far.
    let (pending, other_content) =
        batch.latch_first_copies(marker, requests, &first_of, &fingerprints, now_ms);
    let records = batch.read_latched(marker)?;
    batch.decide_latched(records, pending, now_ms)?;
    batch.decide_other_content(marker, other_content, &first_of, &fingerprints)?;
    Ok(batch)
}

/// A non-fresh outcome as a batch reports it.
fn settled_outcome(outcome: Outcome) -> BatchOutcome {
    BatchOutcome::Settled(outcome.map_fresh(|_| unreachable!("only called with a settled outcome")))
}

/// What deciding a latched message needs besides its claim, by message index.
type PendingByIndex = Vec<Option<Pending>>;

impl ClaimBatch {
    /// Latches the key of each first copy (`Fresh` for now, or `InProgress` if held elsewhere)
    /// and marks each repeat a duplicate of its first copy. Returns what deciding each latched
    /// message needs, and the repeats whose content differs from their first copy's.
    fn latch_first_copies(
        &mut self,
        marker: usize,
        requests: Vec<Request>,
        first_of: &[usize],
        fingerprints: &[Fingerprint],
        now_ms: u64,
    ) -> (PendingByIndex, Vec<(usize, Request)>) {
        let inner = self.inner.clone();
        let latches = &inner.markers[marker].latches;
        let mut pending = Vec::with_capacity(requests.len());
        let mut other_content = Vec::new();
        for (index, request) in requests.into_iter().enumerate() {
            let first = first_of[index];
            let (claim, rest, outcome) = if first != index {
                if fingerprints[index] != fingerprints[first] {
                    other_content.push((index, request));
                }
                (None, None, BatchOutcome::DuplicateInBatch { first })
            } else {
                match latches.try_acquire(&request.stored_key, now_ms) {
                    Err(since_ms) => {
                        let held = Outcome::held_by_claim(since_ms);
                        (None, None, BatchOutcome::Settled(held))
                    }
                    Ok(()) => {
                        // The claim owns the latch from here.
                        let (claim, rest) = request.into_latched_claim(&inner, marker, now_ms);
                        (Some(claim), Some(rest), BatchOutcome::Fresh)
                    }
                }
            };
            self.claims.push(claim);
            pending.push(rest);
            self.outcomes.push(outcome);
        }
        (pending, other_content)
    }

    /// Reads the record of every latched key with one multi-get: `(message index, record)`.
    fn read_latched(&self, marker: usize) -> Result<Vec<(usize, Option<Record>)>> {
        let inner = &self.inner;
        let latched: Vec<(usize, &Claim)> = self
            .claims
            .iter()
            .enumerate()
            .filter_map(|(index, claim)| Some((index, claim.as_ref()?)))
            .collect();
        let cf = inner.marker_cf(marker);
        let keys = latched.iter().map(|(_, claim)| claim.stored_key());
        let values = inner.db().batched_multi_get_cf(cf, keys, false);
        let mut records = Vec::with_capacity(latched.len());
        for ((index, claim), value) in latched.into_iter().zip(values) {
            let record = match value? {
                None => None,
                Some(bytes) => Some(Record::decode(&bytes).map_err(|reason| Error::Corrupt {
                    key: claim.stored_key().to_vec(),
                    reason,
                })?),
            };
            records.push((index, record));
        }
        Ok(records)
    }

    /// Decides each latched message from its record, as `begin` would: its claim stays if it
    /// is fresh, and is dropped (its latch released) otherwise.
    fn decide_latched(
        &mut self,
        records: Vec<(usize, Option<Record>)>,
        mut pending: PendingByIndex,
        now_ms: u64,
    ) -> Result<()> {
        for (index, record) in records {
            let (Some(claim), Some(rest)) = (self.claims[index].as_mut(), pending[index].take())
            else {
                continue;
            };
            let found = inspect_record(record, claim.fingerprint(), now_ms);
            // Decided where it lies: a claim is a few hundred bytes, and moving it out and back
            // for every message showed up in the profile's memcpy.
            if let Some(settled) = decide_in_place(claim, found, rest, now_ms)? {
                self.claims[index] = None;
                self.outcomes[index] = BatchOutcome::Settled(settled);
            }
        }
        Ok(())
    }

    /// Decides each repeat whose content differs from its first copy's: a conflict with a
    /// first copy committed with this batch; otherwise a message of its own, decided as `begin`
    /// decides it now (against the stored record, the latch, its own production time and
    /// version).
    fn decide_other_content(
        &mut self,
        marker: usize,
        other_content: Vec<(usize, Request)>,
        first_of: &[usize],
        fingerprints: &[Fingerprint],
    ) -> Result<()> {
        for (index, request) in other_content {
            let first = first_of[index];
            self.outcomes[index] = if matches!(self.outcomes[first], BatchOutcome::Fresh) {
                BatchOutcome::ConflictInBatch {
                    first,
                    first_fingerprint: fingerprints[first],
                    new_fingerprint: fingerprints[index],
                }
            } else {
                match begin(&self.inner, marker, request)? {
                    Outcome::Fresh(claim) => {
                        self.claims[index] = Some(claim);
                        BatchOutcome::Fresh
                    }
                    settled => settled_outcome(settled),
                }
            };
        }
        Ok(())
    }
    /// Each message's outcome, in the order the messages were given.
    #[must_use]
    pub fn outcomes(&self) -> &[BatchOutcome] {
        &self.outcomes
    }

    /// The number of messages in the batch.
    #[must_use]
    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    /// True for a batch of no messages.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// The claim of message `index`, to stage its business writes; `None` unless it is fresh
    /// and not released.
    pub fn claim_mut(&mut self, index: usize) -> Option<&mut Claim> {
        self.claims.get_mut(index)?.as_mut()
    }

    /// Releases the claim of message `index` without writing anything (its handler failed): it
    /// is left out of the commit and its key is free again.
    pub fn release(&mut self, index: usize) {
        if let Some(slot) = self.claims.get_mut(index) {
            *slot = None;
        }
    }

    /// Stages the read position of a log consumer for the whole batch: written in the batch's
    /// one write batch with every claim still held, even if none is (a batch of duplicates
    /// still moves the position). Staged more than once for a partition, here or on the
    /// batch's claims ([`Claim::stage_position`]), the highest offset is written: stage the
    /// offset of the batch's last message, settled or fresh.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a source outside
    /// [`crate::POSITION_SOURCE_BYTES_MIN`]..=[`crate::POSITION_SOURCE_BYTES_MAX`] bytes,
    /// [`Error::InvalidArgument`] for one containing NUL. The commit fails with [`Error::PositionBehind`], writing nothing, if an offset is then
    /// behind its partition's position.
    pub fn stage_position(&mut self, source: &str, partition: u32, offset: u64) -> Result<()> {
        let key = crate::format::position::encode_position_key(&self.prefix, source, partition)?;
        self.positions.stage(key, offset);
        Ok(())
    }

    crate::operations::staging::business_write_methods!(
        "with the batch's commit, even if no claim is left in it (a record of the batch's \
         settled messages, say, written with the position that moves past them); the batch's \
         own staged writes count against the limits on their own, as one claim's do"
    );

    /// Commits every claim still held in **one** write batch (one WAL write, and with
    /// [`crate::Durability::Sync`] one fsync): each one's marker, with the result `result_of`
    /// gives for its index, and its staged writes. Returns what each committed, by index.
    ///
    /// # Errors
    /// As for [`crate::Claim::commit`]; on any error nothing of the batch is written.
    pub fn commit<R: AsRef<[u8]>>(
        mut self,
        result_of: impl FnMut(usize) -> R,
    ) -> Result<Vec<Option<Committed>>> {
        let started = std::time::Instant::now();
        let (batch, committed, positions) = self.prepare(result_of)?;
        if !batch.is_empty() {
            // Every latch is still held until `self` drops, after the batch is visible.
            self.inner.write(batch)?;
        }
        if let Some(positions) = positions {
            positions.written();
        }
        for (claim, committed) in self.claims.iter().zip(&committed) {
            if let (Some(claim), Some(committed)) = (claim, committed) {
                claim.report_commit(committed, started);
            }
        }
        Ok(committed)
    }

    /// Builds the batch of every claim still held (staged writes, versions, markers) and what
    /// each will have committed, by index, with the acceptance of its read positions (to be
    /// settled by the write). On error nothing is kept of the batch.
    pub(crate) fn prepare<R: AsRef<[u8]>>(
        &mut self,
        mut result_of: impl FnMut(usize) -> R,
    ) -> Result<(
        WriteBatch,
        Vec<Option<Committed>>,
        Option<AcceptedPositions>,
    )> {
        // Results are not known yet: room for every claim's entries but its result.
        let bytes = self
            .claims
            .iter()
            .flatten()
            .map(|claim| claim.commit_bytes(0))
            .sum::<usize>()
            + self.positions.batch_bytes()
            + self.staged.writes() * crate::operations::staging::BATCH_ENTRY_OVERHEAD_BYTES
            + self.staged.bytes;
        let mut batch = batch_for(bytes);
        let mut committed: Vec<Option<Committed>> = Vec::with_capacity(self.claims.len());
        // The write clock is read once for the whole batch (its claims commit together), when
        // the first claim still held needs it.
        let mut now_ms = None;
        for (index, claim) in self.claims.iter_mut().enumerate() {
            committed.push(match claim {
                Some(claim) => {
                    let at = match now_ms {
                        Some(at) => at,
                        None => *now_ms.insert(self.inner.write_clock_ms()?),
                    };
                    Some(claim.append_commit(&mut batch, result_of(index).as_ref(), at)?)
                }
                None => None,
            });
        }
        self.staged.drain_into(&self.inner, &mut batch);
        // Every position of the batch is checked and written at once: per partition the
        // highest offset staged here or on any claim still held.
        let mut positions = std::mem::take(&mut self.positions);
        for claim in self.claims.iter_mut().flatten() {
            positions.absorb(&mut claim.positions);
        }
        let mut accepted = None;
        if !positions.is_empty() {
            let now_ms = match committed.iter().flatten().next() {
                Some(first) => first.committed_at_ms,
                None => self.inner.write_clock_ms()?,
            };
            accepted = positions.append_to(&self.inner, &mut batch, now_ms)?;
        }
        Ok((batch, committed, accepted))
    }
}

impl std::fmt::Debug for ClaimBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimBatch")
            .field("outcomes", &self.outcomes)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "tokio")]
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
        self,
        result_of: impl FnMut(usize) -> R,
    ) -> crate::storage::log::commit_future::BatchCommitFuture {
        let (reply, receiver) = tokio::sync::oneshot::channel();
        self.submit(result_of, move |answer| {
            // The caller may have dropped the future; the commit stands either way.
            let _ = reply.send(answer);
        });
        crate::storage::log::commit_future::BatchCommitFuture::waiting(receiver)
    }
}

impl ClaimBatch {
    /// Commits like [`ClaimBatch::commit`] and tells `reply` the outcome: from the engine's
    /// committer thread with [`crate::Durability::Sync`], before returning with `Buffered` or
    /// when the commit fails its checks. What [`ClaimBatch::commit_async`] and
    /// [`crate::Pipeline`] share.
    pub(crate) fn submit<R: AsRef<[u8]>>(
        mut self,
        result_of: impl FnMut(usize) -> R,
        reply: impl FnOnce(Result<Vec<Option<Committed>>>) + Send + 'static,
    ) {
        use crate::storage::log::committer::Job;
        let storage = self.inner.clone();
        if !storage.syncs_each_write() {
            return reply(self.commit(result_of));
        }
        let started = std::time::Instant::now();
        let prepared = storage
            .committer()
            .and_then(|committer| Ok((committer, self.prepare(result_of)?)));
        let (committer, (batch, committed, positions)) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => return reply(Err(error)),
        };
        if batch.is_empty() {
            // No claim left to commit and no position: nothing to write or wait for.
            return reply(Ok(committed));
        }
        let claims = std::mem::take(&mut self.claims);
        committer.submit(Job {
            batch,
            claims: claims.iter().flatten().count(),
            writer: storage.clone(),
            finish: Box::new(move |written| {
                if let Some(positions) = positions {
                    positions.settle(&written);
                }
                if written.is_ok() {
                    for (claim, committed) in claims.iter().zip(&committed) {
                        if let (Some(claim), Some(committed)) = (claim, committed) {
                            claim.report_commit(committed, started);
                        }
                    }
                }
                // The keys are released before the caller hears of it.
                drop(claims);
                reply(written.map(|()| committed));
            }),
        });
    }
}
