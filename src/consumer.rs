//! [`Consumer`]: the handle on one consumer's records, the application's entry to claims,
//! batches and leases on them. [`crate::Engine::consumer`] makes it; it holds the open store.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use rocksdb::IteratorMode;

use crate::format::error::{Error, Result};
use crate::format::fingerprint::Fingerprint;
use crate::format::key::{decode_key, encode_with_prefix, stored_key};
use crate::format::message::Message;
use crate::format::record::{Record, RecordState};
use crate::operations::claim::{Expiry, Outcome, Request, begin_at};
use crate::operations::lease::{ExternalClaim, InProgressEntry, LeaseTicket, Resolution};
use crate::storage::observe::{ConsumerMetrics, OutcomeKind};
use crate::storage::store::{RECORDS_MARKER, Storage};

/// A handle on one consumer's records: `begin` claims message keys, `get` inspects them.
#[derive(Clone)]
pub struct Consumer {
    pub(crate) inner: Arc<Storage>,
    pub(crate) id: String,
    pub(crate) prefix: Vec<u8>,
    pub(crate) metrics: Arc<ConsumerMetrics>,
}

impl Consumer {
    /// Claims `message_key` for processing, or reports why not. See [`Outcome`].
    ///
    /// `fingerprint` identifies the content: a redelivery whose fingerprint differs from the
    /// completed one is an [`Outcome::Conflict`].
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for a bad key, [`Error::Corrupt`] if the stored record does not
    /// decode, [`Error::Storage`] if the read fails, [`Error::Poisoned`] after a failed write
    /// (nothing can be committed until the store is reopened).
    pub fn begin(
        &self,
        message_key: impl AsRef<[u8]>,
        fingerprint: Fingerprint,
    ) -> Result<Outcome> {
        self.begin_message(&Message::new(message_key.as_ref(), fingerprint))
    }

    /// Like [`Consumer::begin`], for a [`Message`] that may carry its production time (admission
    /// floor), an entity version (ordering guard) and a correlation id.
    ///
    /// # Errors
    /// As for [`Consumer::begin`]; the entity key of a version follows the message-key limits.
    pub fn begin_message(&self, message: &Message<'_>) -> Result<Outcome> {
        let started = Instant::now();
        let request = self.request(message)?;
        // Read once: the claim's decision and a duplicate's age take the same instant.
        let now_ms = self.inner.clock.now_ms();
        let mut outcome = begin_at(&self.inner, RECORDS_MARKER, request, now_ms)?;
        if let Outcome::Fresh(claim) = &mut outcome {
            claim.observe(self.metrics.clone(), message.correlation_id);
        }
        self.observe(message, &outcome, started, now_ms);
        Ok(outcome)
    }

    /// Counts an outcome decided at `now_ms` and logs it.
    fn observe<C>(
        &self,
        message: &Message<'_>,
        outcome: &Outcome<C>,
        started: Instant,
        now_ms: u64,
    ) {
        let age_ms = outcome.duplicate_age_ms(now_ms);
        self.metrics
            .outcome(outcome.kind(), started.elapsed(), age_ms);
        tracing::debug!(
            target: "idemdb",
            consumer = %self.id,
            key = %crate::format::printable::printable(message.key),
            outcome = outcome.kind().label(),
            correlation_id = message.correlation_id,
            "begin"
        );
    }

    /// Claims a whole broker batch: one RocksDB multi-get for every key, an outcome per message
    /// (a repeated key is a [`crate::BatchOutcome::DuplicateInBatch`] of its first copy, or,
    /// with another fingerprint, a conflict: [`crate::BatchOutcome::ConflictInBatch`]), and
    /// [`crate::ClaimBatch::commit`] writes every claim still held in one write batch.
    ///
    /// # Errors
    /// As for [`Consumer::begin_message`], checked for every message before any key is taken;
    /// [`Error::LimitExceeded`] past [`crate::BATCH_MESSAGES_MAX`] messages.
    pub fn begin_batch(
        &self,
        messages: &[Message<'_>],
    ) -> Result<crate::operations::batch::ClaimBatch> {
        let started = Instant::now();
        let requests = messages
            .iter()
            .map(|message| self.request(message))
            .collect::<Result<Vec<_>>>()?;
        let mut batch = crate::operations::batch::begin_batch(
            &self.inner,
            RECORDS_MARKER,
            self.prefix.clone(),
            requests,
        )?;
        let now_ms = self.inner.clock.now_ms();
        // Each message gets an equal share of the batch's latency.
        let share = started.elapsed() / u32::try_from(messages.len().max(1)).unwrap_or(u32::MAX);
        for (index, message) in messages.iter().enumerate() {
            if let Some(claim) = batch.claim_mut(index) {
                claim.observe(self.metrics.clone(), message.correlation_id);
            }
            let kind = match &batch.outcomes()[index] {
                crate::operations::batch::BatchOutcome::Fresh => OutcomeKind::Fresh,
                crate::operations::batch::BatchOutcome::DuplicateInBatch { .. } => {
                    OutcomeKind::DuplicateInBatch
                }
                crate::operations::batch::BatchOutcome::ConflictInBatch { .. } => {
                    OutcomeKind::Conflict
                }
                crate::operations::batch::BatchOutcome::Settled(outcome) => {
                    let age_ms = outcome.duplicate_age_ms(now_ms);
                    self.metrics.outcome(outcome.kind(), share, age_ms);
                    continue;
                }
            };
            self.metrics.count(kind);
        }
        Ok(batch)
    }

    /// The engine-side form of a message: keys encoded and checked.
    pub(crate) fn request(&self, message: &Message<'_>) -> Result<Request> {
        let version = match message.version {
            Some((entity, version)) => Some((encode_with_prefix(&self.prefix, entity)?, version)),
            None => None,
        };
        Ok(Request {
            stored_key: stored_key(&self.prefix, message.key)?,
            fingerprint: message.fingerprint,
            produced_at_ms: message.produced_at_ms,
            version,
            expiry: self.default_expiry(),
        })
    }

    /// The record for `message_key`, if any: completed and not expired, or in progress (an
    /// expired or released record reads as `None`).
    ///
    /// # Errors
    /// As for [`Consumer::begin`].
    pub fn get(&self, message_key: impl AsRef<[u8]>) -> Result<Option<Record>> {
        let stored_key = stored_key(&self.prefix, message_key.as_ref())?;
        self.inner.read_record(RECORDS_MARKER, &stored_key)
    }

    /// Takes `message_key` under a durable lease for a side effect outside the batch: the
    /// in-progress record, with `holder`'s identity, the lease deadline and a new fencing epoch,
    /// is written (honouring the durability mode) before this returns. A key whose holder's
    /// lease ran out is taken over: the claim's [`ExternalClaim::previous_attempt`] says so.
    ///
    /// # Errors
    /// As for [`Consumer::begin`], and [`Error::LimitExceeded`] for a lease outside
    /// [`crate::LEASE_MS_MIN`]..=[`crate::LEASE_MS_MAX`] or a holder longer than
    /// [`crate::HOLDER_BYTES_MAX`]; a failed write as for [`crate::Claim::commit`].
    pub fn begin_external(
        &self,
        message_key: impl AsRef<[u8]>,
        fingerprint: Fingerprint,
        lease: std::time::Duration,
        holder: impl AsRef<[u8]>,
    ) -> Result<Outcome<ExternalClaim>> {
        let message = Message::new(message_key.as_ref(), fingerprint);
        self.begin_external_message(&message, lease, holder)
    }

    /// Like [`Consumer::begin_external`], for a [`Message`] (production time, correlation id).
    ///
    /// # Errors
    /// As for [`Consumer::begin_external`], and [`Error::InvalidArgument`] for a message with a
    /// version: the ordering guard works with [`Consumer::begin_message`] and batches, whose
    /// claims hold the entity until they commit.
    pub fn begin_external_message(
        &self,
        message: &Message<'_>,
        lease: std::time::Duration,
        holder: impl AsRef<[u8]>,
    ) -> Result<Outcome<ExternalClaim>> {
        if message.version.is_some() {
            return Err(Error::invalid_argument(
                "the ordering guard (Message::version) works with begin_message and batches, \
                 not with begin_external",
            ));
        }
        let started = Instant::now();
        let request = self.request(message)?;
        let mut outcome = crate::operations::lease::begin_external(
            &self.inner,
            RECORDS_MARKER,
            request.stored_key,
            request.fingerprint,
            lease,
            holder.as_ref(),
            request.expiry,
            request.produced_at_ms,
        )?;
        if let Outcome::Fresh(claim) = &mut outcome {
            claim.observe(self.metrics.clone(), message.correlation_id);
        }
        self.observe(message, &outcome, started, self.inner.clock.now_ms());
        Ok(outcome)
    }

    /// Rebuilds an external claim from its ticket, for example after a restart. Nothing is
    /// checked until the claim's next call, which fails with [`Error::LeaseLost`] if the key
    /// changed hands meanwhile.
    ///
    /// # Errors
    /// [`Error::ForeignTicket`] if the ticket was issued by another consumer.
    pub fn resume(&self, ticket: &LeaseTicket) -> Result<ExternalClaim> {
        let ours = ticket.stored_key.starts_with(&self.prefix)
            && decode_key(&ticket.stored_key).is_ok_and(|(id, _)| id == self.id.as_bytes());
        if !ours {
            return Err(Error::ForeignTicket);
        }
        let mut claim = ExternalClaim::resumed(
            self.inner.clone(),
            RECORDS_MARKER,
            ticket.clone(),
            self.default_expiry(),
        );
        claim.observe(self.metrics.clone(), None);
        Ok(claim)
    }

    /// Lists up to `limit` of this consumer's in-progress records taken at least `older_than`
    /// ago, in key order, whether their lease is live or not: the candidates for reconciliation.
    ///
    /// # Errors
    /// [`Error::Storage`] if the scan fails; [`Error::Corrupt`] for a record that does not decode.
    pub fn in_progress(
        &self,
        older_than: std::time::Duration,
        limit: usize,
    ) -> Result<Vec<InProgressEntry>> {
        let now_ms = self.inner.clock.now_ms();
        let age_ms = u64::try_from(older_than.as_millis()).unwrap_or(u64::MAX);
        let cf = self.inner.marker_cf(RECORDS_MARKER);
        let mode = IteratorMode::From(&self.prefix, rocksdb::Direction::Forward);
        let mut found = Vec::new();
        for entry in self.inner.db().iterator_cf(cf, mode) {
            let (key, value) = entry?;
            if !key.starts_with(&self.prefix) || found.len() >= limit {
                break;
            }
            let record = Record::decode(&value).map_err(|reason| Error::Corrupt {
                key: key.to_vec(),
                reason,
            })?;
            if let RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                ..
            } = record.state
                && now_ms.saturating_sub(since_ms) >= age_ms
            {
                found.push(InProgressEntry {
                    message_key: Bytes::copy_from_slice(&key[self.prefix.len()..]),
                    epoch: record.epoch,
                    holder,
                    since_ms,
                    lease_until_ms,
                });
            }
        }
        Ok(found)
    }

    /// Resolves an in-progress key by hand (an operator's reconciliation): completes it with a
    /// result or releases it, whoever holds it. The holder's next call gets
    /// [`Error::LeaseLost`].
    ///
    /// # Errors
    /// [`Error::NotInProgress`] if the key is not in progress; as for [`Consumer::begin`].
    pub fn resolve(&self, message_key: impl AsRef<[u8]>, resolution: Resolution) -> Result<()> {
        let stored_key = stored_key(&self.prefix, message_key.as_ref())?;
        crate::operations::lease::resolve(
            &self.inner,
            RECORDS_MARKER,
            &stored_key,
            resolution,
            self.default_expiry(),
        )
    }

    fn default_expiry(&self) -> Expiry {
        Expiry::After(std::time::Duration::from_millis(self.inner.retention_ms))
    }

    /// This consumer's read positions in the logs it consumes (Kafka topic partitions,
    /// RabbitMQ streams): stage one with each commit ([`crate::Claim::stage_position`],
    /// [`crate::ClaimBatch::stage_position`]) and resume from it after a restart, and the
    /// effects and the position are stored together or not at all: no message is lost and
    /// none read again past the last commit.
    ///
    /// ```
    /// use idemdb::{Engine, Fingerprint, Outcome};
    /// let dir = tempfile::tempdir()?;
    /// let engine = Engine::builder(dir.path()).open()?;
    /// let billing = engine.consumer("billing")?;
    /// let positions = billing.positions();
    /// // Nothing committed yet: start at the beginning of partition 3 of "orders".
    /// assert!(positions.get("orders", 3)?.is_none());
    ///
    /// // The message at offset 41: its effects and its position in one write batch.
    /// if let Outcome::Fresh(mut claim) = billing.begin(b"order-42", Fingerprint::of(b"payload"))? {
    ///     claim.stage_position("orders", 3, 41)?;
    ///     claim.commit(b"charged")?;
    /// }
    /// // A message that needs no claim (filtered out, a duplicate) moves it on its own.
    /// positions.advance("orders", 3, 42)?;
    ///
    /// let position = positions.get("orders", 3)?.expect("stored");
    /// assert_eq!(position.next_offset(), 43); // resume here after a restart
    ///
    /// // A stale reader, behind the stored position, is refused and writes nothing.
    /// let stale = positions.advance("orders", 3, 40).unwrap_err();
    /// assert!(matches!(stale, idemdb::Error::PositionBehind { stored: 42, staged: 40, .. }));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn positions(&self) -> crate::operations::position::Positions {
        crate::operations::position::Positions::new(self.inner.clone(), self.prefix.clone())
    }

    /// A pipeline through which this thread keeps up to `depth` commits (claims' or
    /// batches') in flight and hears of each, with its tag, in the order handed over, once it
    /// is durable: see [`crate::Pipeline`]. Commits of this engine's other consumers may go
    /// through it too.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] unless `depth` is 1..=[`crate::PIPELINE_DEPTH_MAX`].
    pub fn pipeline<T>(&self, depth: usize) -> Result<crate::operations::pipeline::Pipeline<T>> {
        crate::operations::pipeline::Pipeline::new(depth)
    }

    /// [`Consumer::pipeline`] for async code (feature `tokio`): see [`crate::AsyncPipeline`].
    ///
    /// # Errors
    /// As [`Consumer::pipeline`].
    #[cfg(feature = "tokio")]
    pub fn async_pipeline<T>(
        &self,
        depth: usize,
    ) -> Result<crate::operations::pipeline::AsyncPipeline<T>> {
        crate::operations::pipeline::AsyncPipeline::new(depth)
    }

    /// The consumer id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer").field("id", &self.id).finish()
    }
}
