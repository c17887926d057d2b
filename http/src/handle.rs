//! What the handler gets: [`IdempotentRequest`], a request extension through which it stages
//! its writes on the request's claim. The layer takes the claim back when the handler returns
//! and commits the writes with the response, or drops them.

use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "embedded")]
use idemdb::{BusinessTable, Claim, ExternalClaim};
use parking_lot::Mutex;

use crate::backend::Held;
#[cfg(feature = "postgres")]
use crate::backend::{PgHeld, PgLeaseHeld, SqlParam, StagedSql};

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
    /// engine, a lost lease, a failed write. On PostgreSQL, a renewal's `LeaseLost` (and any
    /// other refusal idemdb's own error names) comes here too, as on the embedded engine.
    #[error(transparent)]
    Store(#[from] idemdb::Error),
    /// A call this backend does not take: a business-table write on a PostgreSQL layer,
    /// staged SQL on an embedded one, or the blocking [`IdempotentRequest::renew`] of a
    /// PostgreSQL lease (renewed with [`IdempotentRequest::renew_async`]). Nothing was done.
    #[error("this call is not for this backend: {0}")]
    WrongBackend(&'static str),
    /// PostgreSQL failed a lease's renewal ([`IdempotentRequest::renew_async`]): the
    /// connection or the database; the lease is as it was.
    #[cfg(feature = "postgres")]
    #[error(transparent)]
    Postgres(idemdb_postgres::Error),
    /// No connection for a PostgreSQL lease's renewal: the layer's connect function failed.
    #[cfg(feature = "postgres")]
    #[error("no connection: {0}")]
    Connect(crate::backend::BoxError),
}

#[cfg(feature = "postgres")]
impl From<idemdb_postgres::Error> for StageError {
    /// idemdb's own errors (`LeaseLost`, a lease outside the limits) as the embedded engine
    /// gives them; the rest as PostgreSQL's.
    fn from(error: idemdb_postgres::Error) -> StageError {
        match error {
            idemdb_postgres::Error::Idemdb(error) => StageError::Store(error),
            other => StageError::Postgres(other),
        }
    }
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
            #[cfg(feature = "embedded")]
            Some(Held::Batch(_)) => "batch",
            #[cfg(feature = "embedded")]
            Some(Held::Lease(_)) => "lease",
            #[cfg(feature = "postgres")]
            Some(Held::Postgres(_)) => "postgres",
            #[cfg(feature = "postgres")]
            Some(Held::PgLease(_)) => "postgres lease",
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

    #[cfg(feature = "embedded")]
    fn with<R>(
        &self,
        batch: impl FnOnce(&mut Claim) -> idemdb::Result<R>,
        lease: impl FnOnce(&mut ExternalClaim) -> idemdb::Result<R>,
    ) -> Result<R, StageError> {
        match &mut *self.slot.lock() {
            Some(Held::Batch(claim)) => Ok(batch(claim)?),
            Some(Held::Lease(claim)) => Ok(lease(claim)?),
            #[cfg(feature = "postgres")]
            Some(Held::Postgres(_) | Held::PgLease(_)) => Err(StageError::WrongBackend(
                "business tables belong to the embedded engine; stage SQL with `sql`",
            )),
            None => Err(StageError::ClaimGone),
        }
    }

    #[cfg(feature = "embedded")]
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

    #[cfg(feature = "embedded")]
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

    #[cfg(feature = "embedded")]
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
        match &*self.slot.lock() {
            #[cfg(feature = "embedded")]
            Some(Held::Batch(claim)) => Ok(claim.derive_key(step)),
            #[cfg(feature = "embedded")]
            Some(Held::Lease(claim)) => Ok(claim.derive_key(step)),
            #[cfg(feature = "postgres")]
            Some(Held::Postgres(held)) => Ok(held.claim.derive_key(step)),
            #[cfg(feature = "postgres")]
            Some(Held::PgLease(held)) => Ok(held.claim.derive_key(step)),
            None => Err(StageError::ClaimGone),
        }
    }

    /// The epoch the request's record will have: 1 for a key's first request, one more for
    /// each lease held on the key before (taken over after it ran out, or released after a
    /// response that was not stored). On the batch path a response not stored leaves no
    /// record, so a retry's epoch stays 1.
    ///
    /// # Errors
    /// [`StageError::ClaimGone`] after the handler returned.
    pub fn epoch(&self) -> Result<u64, StageError> {
        match &*self.slot.lock() {
            #[cfg(feature = "embedded")]
            Some(Held::Batch(claim)) => Ok(claim.epoch()),
            #[cfg(feature = "embedded")]
            Some(Held::Lease(claim)) => Ok(claim.epoch()),
            #[cfg(feature = "postgres")]
            Some(Held::Postgres(held)) => Ok(held.claim.epoch()),
            #[cfg(feature = "postgres")]
            Some(Held::PgLease(held)) => Ok(held.claim.epoch()),
            None => Err(StageError::ClaimGone),
        }
    }

    /// Stages `sql` with its `params` (PostgreSQL backend): run in the request's transaction,
    /// in the order staged, by the commit that stores the response, in the same round trip;
    /// not run at all if the response is not stored. A statement's failure fails the commit:
    /// nothing of the request is written, the key is free, and the client gets `503`. On the
    /// lease path the statements run in the lease's completion, once it is known to still hold
    /// the key (one round trip each, then the response's write and the commit): a request that
    /// was taken over runs none of them.
    ///
    /// ```no_run
    /// # fn example(request: &idemdb_http::IdempotentRequest, id: String, body: Vec<u8>)
    /// # -> Result<(), idemdb_http::StageError> {
    /// use tokio_postgres::types::Type;
    /// request.sql(
    ///     "INSERT INTO payments (id, body) VALUES ($1, $2)",
    ///     vec![(Box::new(id), Type::TEXT), (Box::new(body), Type::BYTEA)],
    /// )
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`StageError::WrongBackend`] on an embedded layer; [`StageError::ClaimGone`] after the
    /// handler returned.
    #[cfg(feature = "postgres")]
    pub fn sql(&self, sql: impl Into<String>, params: Vec<SqlParam>) -> Result<(), StageError> {
        match &mut *self.slot.lock() {
            Some(
                Held::Postgres(PgHeld { staged, .. }) | Held::PgLease(PgLeaseHeld { staged, .. }),
            ) => {
                staged.push(StagedSql {
                    sql: sql.into(),
                    params,
                });
                Ok(())
            }
            None => Err(StageError::ClaimGone),
            #[cfg(feature = "embedded")]
            Some(_) => Err(StageError::WrongBackend(
                "SQL belongs to the PostgreSQL backend; stage business-table writes",
            )),
        }
    }

    /// Extends the lease to `lease` from now (a handler whose downstream call may outlive the
    /// layer's lease): the new deadline, in ms since the Unix epoch on the engine's clock. One
    /// synced write: call it from a blocking context (`tokio::task::spawn_blocking`) if the
    /// disk is slow, or call [`IdempotentRequest::renew_async`], which also renews a
    /// PostgreSQL lease.
    ///
    /// # Errors
    /// [`StageError::NoLease`] on a layer without leases; [`StageError::Store`] with
    /// `LeaseLost` if another request took the key over; [`StageError::WrongBackend`] for a
    /// PostgreSQL lease, whose renewal waits on the database (use `renew_async`).
    pub fn renew(&self, lease: Duration) -> Result<u64, StageError> {
        match &mut *self.slot.lock() {
            #[cfg(feature = "embedded")]
            Some(Held::Lease(claim)) => Ok(claim.renew(lease)?),
            #[cfg(feature = "postgres")]
            Some(Held::PgLease(_)) => Err(StageError::WrongBackend(
                "a PostgreSQL lease is renewed with `renew_async`",
            )),
            Some(_) => {
                let _ = lease;
                Err(StageError::NoLease)
            }
            None => Err(StageError::ClaimGone),
        }
    }

    /// [`IdempotentRequest::renew`] without blocking the runtime's thread, on either backend:
    /// the embedded engine's synced write runs on tokio's blocking threads; a PostgreSQL lease
    /// is renewed in a transaction of its own (fenced as its completion is) on a connection
    /// the layer's connect function gives, on the database's clock (or the store's injected
    /// one).
    ///
    /// # Errors
    /// As for `renew`; on PostgreSQL also [`StageError::Connect`] when no connection could be
    /// had, [`StageError::Postgres`] when the database failed, and [`StageError::Store`] with
    /// `KeyBusy` when the key's lock was not free in time (its completion or another renewal
    /// held it): the lease is as it was.
    pub async fn renew_async(&self, lease: Duration) -> Result<u64, StageError> {
        #[cfg(feature = "postgres")]
        {
            let pg_lease = match &*self.slot.lock() {
                Some(Held::PgLease(held)) => Some((held.claim.clone(), held.connect.clone())),
                _ => None,
            };
            if let Some((mut claim, connect)) = pg_lease {
                let mut connection = connect().await.map_err(StageError::Connect)?;
                let until = claim.renew(&mut connection, lease).await?;
                // The handle's copy gets the later deadline (its release records it), unless
                // the layer took the claim back meanwhile or a later renewal already wrote one.
                if let Some(Held::PgLease(held)) = &mut *self.slot.lock()
                    && held.claim.lease_until_ms() < until
                {
                    held.claim = claim;
                }
                return Ok(until);
            }
        }
        self.renew_off_thread(lease).await
    }

    /// `renew` on tokio's blocking threads (inline without a runtime): an embedded lease's
    /// renewal is a synced write.
    #[cfg(feature = "embedded")]
    async fn renew_off_thread(&self, lease: Duration) -> Result<u64, StageError> {
        let this = self.clone();
        // A panic in the blocking call comes back as the store's error, as the layer's own
        // blocking calls do.
        crate::backend::blocking(move || Ok(this.renew(lease)))
            .await
            .unwrap_or_else(|error| Err(StageError::Store(error)))
    }

    /// `renew` as it is: without the embedded engine it writes nothing (it answers `NoLease`,
    /// `ClaimGone` or `WrongBackend`).
    #[cfg(not(feature = "embedded"))]
    async fn renew_off_thread(&self, lease: Duration) -> Result<u64, StageError> {
        self.renew(lease)
    }
}

/// Frees the key when the request's future is dropped (a client that went away, a timeout, a
/// panic in the handler) before the layer took the claim back: a latched claim is dropped, a
/// lease released. Without it a clone of the handle kept by the handler (in a task it spawned)
/// would hold the key, and a lease would hold it until it ran out.
pub(crate) struct ReleaseOnDrop(pub(crate) IdempotentRequest);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        // Nothing, a latched claim or a PostgreSQL transaction: dropped here, which frees the
        // key (the transaction sends its rollback without waiting, and its connection goes
        // back to its pool). A lease is released on a blocking thread; a PostgreSQL lease on a
        // task, which asks for a connection.
        match self.0.take() {
            #[cfg(feature = "embedded")]
            Some(Held::Lease(claim)) => release_lease(claim),
            #[cfg(feature = "postgres")]
            Some(Held::PgLease(held)) => release_pg_lease(held),
            other => drop(other),
        }
    }
}

/// Releases a dropped request's PostgreSQL lease on a task of its own (a drop cannot wait for
/// a connection), as the layer frees a lease after a `5xx`. Without a runtime there is no
/// connection to ask for: the lease runs out on its own, and a retry meanwhile gets `409`.
#[cfg(feature = "postgres")]
fn release_pg_lease(held: PgLeaseHeld) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(crate::backend::free(Held::PgLease(held)))),
        Err(_) => tracing::warn!(
            target: "idemdb_http",
            "a dropped request's lease was not released: no runtime to release it on"
        ),
    }
}

/// Releases a dropped request's lease: on tokio's blocking threads, inline without a runtime.
#[cfg(feature = "embedded")]
fn release_lease(claim: ExternalClaim) {
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
