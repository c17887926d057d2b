//! What the handler gets: [`IdempotentRequest`], a request extension through which it stages
//! its writes on the request's claim. The layer takes the claim back when the handler returns
//! and commits the writes with the response, or drops them.

use std::sync::Arc;
use std::time::Duration;

use idemdb::{BusinessTable, Claim, ExternalClaim};
use parking_lot::Mutex;

/// The claim a fresh request holds: a latched claim whose writes commit in one batch with the
/// response, or a durable lease for a handler with side effects outside the batch.
pub(crate) enum Held {
    Batch(Claim),
    Lease(ExternalClaim),
}

/// Why a staging call on an [`IdempotentRequest`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StageError {
    /// The handler already returned: the layer took the claim back (a clone of the handle
    /// kept by a task the handler spawned, used too late). Nothing was staged.
    #[error("the request's claim is gone: its handler returned")]
    ClaimGone,
    /// [`IdempotentRequest::renew`] on a layer without leases
    /// ([`crate::IdempotencyLayer::with_lease`]).
    #[error("the request holds no lease: the layer was built without one")]
    NoLease,
    /// The store refused the call: a key or value outside its limits, a table of another
    /// engine, a lost lease, a failed write.
    #[error(transparent)]
    Store(#[from] idemdb::Error),
}

/// The request's claim, as the handler sees it: stage business writes (they commit with the
/// stored response, or not at all), derive keys for downstream calls, renew a lease. Put in
/// the request's extensions by the layer for every request with a key it claimed: in axum,
/// take it with `Extension<IdempotentRequest>` (`Option<Extension<_>>` on a route whose key is
/// optional). Cheap to clone; every clone stages on the same claim.
#[derive(Clone)]
pub struct IdempotentRequest {
    slot: Arc<Mutex<Option<Held>>>,
}

impl std::fmt::Debug for IdempotentRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &*self.slot.lock() {
            Some(Held::Batch(_)) => "batch",
            Some(Held::Lease(_)) => "lease",
            None => "gone",
        };
        f.debug_struct("IdempotentRequest")
            .field("claim", &state)
            .finish()
    }
}

impl IdempotentRequest {
    pub(crate) fn new(held: Held) -> IdempotentRequest {
        IdempotentRequest {
            slot: Arc::new(Mutex::new(Some(held))),
        }
    }

    /// Takes the claim back (the layer, once the handler returned); later staging calls fail
    /// with [`StageError::ClaimGone`].
    pub(crate) fn take(&self) -> Option<Held> {
        self.slot.lock().take()
    }

    fn with<R>(
        &self,
        batch: impl FnOnce(&mut Claim) -> idemdb::Result<R>,
        lease: impl FnOnce(&mut ExternalClaim) -> idemdb::Result<R>,
    ) -> Result<R, StageError> {
        match &mut *self.slot.lock() {
            Some(Held::Batch(claim)) => Ok(batch(claim)?),
            Some(Held::Lease(claim)) => Ok(lease(claim)?),
            None => Err(StageError::ClaimGone),
        }
    }

    /// Stages `value` under `key` in `table`: written with the stored response, or not at all.
    ///
    /// # Errors
    /// [`StageError::Store`] with idemdb's error for a key or value outside its limits or a
    /// table of another engine (nothing is staged); [`StageError::ClaimGone`] after the
    /// handler returned.
    pub fn put(
        &self,
        table: &BusinessTable,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
    ) -> Result<(), StageError> {
        let (key, value) = (key.as_ref(), value.as_ref());
        self.with(
            |claim| claim.put(table, key, value),
            |claim| claim.put(table, key, value),
        )
    }

    /// Stages a delete of `key` in `table`.
    ///
    /// # Errors
    /// As for [`IdempotentRequest::put`].
    pub fn delete(&self, table: &BusinessTable, key: impl AsRef<[u8]>) -> Result<(), StageError> {
        let key = key.as_ref();
        self.with(
            |claim| claim.delete(table, key),
            |claim| claim.delete(table, key),
        )
    }

    /// Stages a merge of `operand` into `key` of `table` (a table with a merge operator).
    ///
    /// # Errors
    /// As for [`IdempotentRequest::put`], and idemdb's `NoMergeOperator` for a table without
    /// one.
    pub fn merge(
        &self,
        table: &BusinessTable,
        key: impl AsRef<[u8]>,
        operand: impl AsRef<[u8]>,
    ) -> Result<(), StageError> {
        let (key, operand) = (key.as_ref(), operand.as_ref());
        self.with(
            |claim| claim.merge(table, key, operand),
            |claim| claim.merge(table, key, operand),
        )
    }

    /// The key to give a downstream call made for this request at `step` (a payment
    /// provider's own idempotency key): the same principal, key and step give the same value
    /// across retries, restarts and takeovers of a lease.
    ///
    /// # Errors
    /// [`StageError::ClaimGone`] after the handler returned.
    pub fn derive_key(&self, step: &str) -> Result<String, StageError> {
        self.with(
            |claim| Ok(claim.derive_key(step)),
            |claim| Ok(claim.derive_key(step)),
        )
    }

    /// The epoch the request's record will have: 1 for a key's first request, one more for
    /// each lease held on the key before (taken over after it ran out, or released after a
    /// response that was not stored). On the batch path a response not stored leaves no
    /// record, so a retry's epoch stays 1.
    ///
    /// # Errors
    /// [`StageError::ClaimGone`] after the handler returned.
    pub fn epoch(&self) -> Result<u64, StageError> {
        self.with(|claim| Ok(claim.epoch()), |claim| Ok(claim.epoch()))
    }

    /// Extends the lease to `lease` from now (a handler whose downstream call may outlive the
    /// layer's lease): the new deadline, in ms since the Unix epoch on the engine's clock. One
    /// synced write: call it from a blocking context (`tokio::task::spawn_blocking`) if the
    /// disk is slow.
    ///
    /// # Errors
    /// [`StageError::NoLease`] on a layer without leases; [`StageError::Store`] with
    /// `LeaseLost` if another request took the key over.
    pub fn renew(&self, lease: Duration) -> Result<u64, StageError> {
        match &mut *self.slot.lock() {
            Some(Held::Lease(claim)) => Ok(claim.renew(lease)?),
            Some(Held::Batch(_)) => Err(StageError::NoLease),
            None => Err(StageError::ClaimGone),
        }
    }
}

/// Frees the key when the request's future is dropped (a client that went away, a timeout, a
/// panic in the handler) before the layer took the claim back: a latched claim is dropped, a
/// lease released. Without it a clone of the handle kept by the handler (in a task it spawned)
/// would hold the key, and a lease would hold it until it ran out.
pub(crate) struct ReleaseOnDrop(pub(crate) IdempotentRequest);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(Held::Lease(claim)) = self.0.take() else {
            // Nothing, or a latched claim: dropped here, which frees its key.
            return;
        };
        let release = move || {
            if let Err(error) = claim.release() {
                // The lease runs out on its own; a retry meanwhile gets 409.
                tracing::warn!(target: "idemdb_http", %error, "a dropped request's lease was not released");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(release)),
            Err(_) => release(),
        }
    }
}
