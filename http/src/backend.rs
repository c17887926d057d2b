//! Where a layer's claims live: the embedded engine (a latched claim, or a durable lease) or
//! PostgreSQL (a transaction on a pooled connection, or a durable lease whose steps each ask for
//! a connection). The layer asks the same three things of either: claim a key, commit a claim
//! with its stored response, drop a claim's writes.

#[cfg(feature = "postgres")]
use std::future::Future;
#[cfg(feature = "postgres")]
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "embedded")]
use idemdb::{Claim, ExternalClaim};
use idemdb::{Fingerprint, Outcome};

use crate::rejection::Rejection;

/// The claim a fresh request holds: a latched claim whose writes commit in one batch with the
/// response, a durable lease for a handler with side effects outside the batch, or on
/// PostgreSQL a transaction whose SQL commits with the response, or a durable lease whose
/// completion commits the SQL with the response.
pub(crate) enum Held {
    #[cfg(feature = "embedded")]
    Batch(Claim),
    #[cfg(feature = "embedded")]
    Lease(ExternalClaim),
    #[cfg(feature = "postgres")]
    Postgres(PgHeld),
    #[cfg(feature = "postgres")]
    PgLease(PgLeaseHeld),
}

/// A parameter of staged SQL, owned so that it can wait in the request until the commit.
#[cfg(feature = "postgres")]
pub type SqlParam = (
    Box<dyn tokio_postgres::types::ToSql + Send + Sync>,
    tokio_postgres::types::Type,
);

/// A statement staged by the handler: run in the claim's transaction by its commit.
#[cfg(feature = "postgres")]
pub(crate) struct StagedSql {
    pub(crate) sql: String,
    pub(crate) params: Vec<SqlParam>,
}

/// A PostgreSQL claim and the SQL staged on it.
#[cfg(feature = "postgres")]
pub(crate) struct PgHeld {
    pub(crate) claim: idemdb_postgres::PgClaim<'static>,
    pub(crate) staged: Vec<StagedSql>,
}

/// A PostgreSQL lease (its in-progress record committed), the SQL staged on it, and where its
/// next step gets a connection: it holds none while the handler runs.
#[cfg(feature = "postgres")]
pub(crate) struct PgLeaseHeld {
    pub(crate) claim: idemdb_postgres::PgExternalClaim,
    pub(crate) staged: Vec<StagedSql>,
    pub(crate) connect: Arc<ConnectFn>,
}

/// A boxed error: of a body (the layer's bounds) or of a connection (the PostgreSQL backend).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A connection the PostgreSQL backend's `connect` gave: anything that dereferences to a
/// client (a pooled connection goes back to its pool when dropped).
#[cfg(feature = "postgres")]
pub(crate) type PgConnection = Box<dyn std::ops::DerefMut<Target = tokio_postgres::Client> + Send>;

#[cfg(feature = "postgres")]
pub(crate) type ConnectFn =
    dyn Fn() -> Pin<Box<dyn Future<Output = Result<PgConnection, BoxError>> + Send>> + Send + Sync;

/// A [`PgConnection`] as a value that dereferences to the client itself, which
/// `PgConsumer::begin_owned` takes.
#[cfg(feature = "postgres")]
struct Pooled(PgConnection);

#[cfg(feature = "postgres")]
impl std::ops::Deref for Pooled {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        &self.0
    }
}

#[cfg(feature = "postgres")]
impl std::ops::DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut tokio_postgres::Client {
        &mut self.0
    }
}

#[derive(Clone)]
pub(crate) enum Backend {
    #[cfg(feature = "embedded")]
    Embedded {
        consumer: idemdb::Consumer,
        /// The lease path: each fresh request takes a durable lease of this length, as this
        /// holder.
        lease: Option<(Duration, Arc<[u8]>)>,
    },
    #[cfg(feature = "postgres")]
    Postgres {
        consumer: idemdb_postgres::PgConsumer,
        connect: Arc<ConnectFn>,
        /// The lease path: each fresh request takes an external claim of this length, as this
        /// holder, its in-progress record committed before the handler runs.
        lease: Option<(Duration, Arc<[u8]>)>,
    },
}

/// Why a store call failed.
#[derive(Debug)]
pub(crate) enum Failure {
    #[cfg(feature = "embedded")]
    Store(idemdb::Error),
    #[cfg(feature = "postgres")]
    Postgres(idemdb_postgres::Error),
    /// No connection for the PostgreSQL backend.
    #[cfg(feature = "postgres")]
    Connect(BoxError),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            #[cfg(feature = "embedded")]
            Failure::Store(error) => write!(f, "{error}"),
            #[cfg(feature = "postgres")]
            Failure::Postgres(error) => write!(f, "{error}"),
            #[cfg(feature = "postgres")]
            Failure::Connect(error) => write!(f, "no connection: {error}"),
        }
    }
}

impl Failure {
    /// What the layer answers for it. Nothing was committed.
    pub(crate) fn rejection(&self) -> Rejection {
        let store = |error: &idemdb::Error| match error {
            idemdb::Error::LeaseLost { .. } => Rejection::LeaseLost,
            idemdb::Error::LimitExceeded { .. } => Rejection::ResponseTooLarge,
            other => Rejection::StoreUnavailable {
                retryable: other.is_retryable(),
            },
        };
        let rejection = match self {
            #[cfg(feature = "embedded")]
            Failure::Store(error) => store(error),
            #[cfg(feature = "postgres")]
            Failure::Postgres(idemdb_postgres::Error::Idemdb(error)) => store(error),
            #[cfg(feature = "postgres")]
            Failure::Postgres(error) => Rejection::StoreUnavailable {
                retryable: error.is_retryable(),
            },
            #[cfg(feature = "postgres")]
            Failure::Connect(_) => Rejection::StoreUnavailable { retryable: true },
        };
        if !matches!(
            rejection,
            Rejection::LeaseLost | Rejection::ResponseTooLarge
        ) {
            tracing::warn!(target: "idemdb_http", error = %self, "the store failed a request");
        }
        rejection
    }
}

impl Backend {
    /// Claims the request's key: a latched claim (a point read) or a durable lease (a synced
    /// write, off the runtime's thread) on the engine; on PostgreSQL, a transaction holding the
    /// key's lock on a connection of its own, or a lease whose in-progress record is committed
    /// before this returns.
    pub(crate) async fn begin(
        &self,
        key: Vec<u8>,
        fingerprint: Fingerprint,
    ) -> Result<Outcome<Held>, Failure> {
        match self {
            #[cfg(feature = "embedded")]
            Backend::Embedded { consumer, lease } => {
                let Some((lease, holder)) = lease else {
                    return consumer
                        .begin(key, fingerprint)
                        .map(|outcome| outcome.map_fresh(Held::Batch))
                        .map_err(Failure::Store);
                };
                let (consumer, lease, holder) = (consumer.clone(), *lease, holder.clone());
                blocking(move || consumer.begin_external(key, fingerprint, lease, &holder))
                    .await
                    .map(|outcome| outcome.map_fresh(Held::Lease))
                    .map_err(Failure::Store)
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres {
                consumer,
                connect,
                lease,
            } => {
                let mut connection = connect().await.map_err(Failure::Connect)?;
                if let Some((lease, holder)) = lease {
                    // Committed before it returns: the connection goes back (dropped here)
                    // while the handler runs, and one is asked for again for the next step.
                    return consumer
                        .begin_external(&mut connection, &key, fingerprint, *lease, &**holder)
                        .await
                        .map(|outcome| {
                            outcome.map_fresh(|claim| {
                                Held::PgLease(PgLeaseHeld {
                                    claim,
                                    staged: Vec::new(),
                                    connect: connect.clone(),
                                })
                            })
                        })
                        .map_err(Failure::Postgres);
                }
                let message = idemdb::Message::new(&key, fingerprint);
                consumer
                    .begin_owned(Pooled(connection), &message)
                    .await
                    .map(|outcome| {
                        outcome.map_fresh(|claim| {
                            Held::Postgres(PgHeld {
                                claim,
                                staged: Vec::new(),
                            })
                        })
                    })
                    .map_err(Failure::Postgres)
            }
        }
    }
}

/// Commits the claim with `stored` as its result: the handler's writes (or SQL) and the
/// response land together.
pub(crate) async fn commit(held: Held, stored: Vec<u8>) -> Result<(), Failure> {
    match held {
        #[cfg(feature = "embedded")]
        Held::Batch(claim) => claim
            .commit_async(stored)
            .await
            .map(drop)
            .map_err(Failure::Store),
        #[cfg(feature = "embedded")]
        Held::Lease(claim) => blocking(move || claim.complete(stored))
            .await
            .map(drop)
            .map_err(Failure::Store),
        #[cfg(feature = "postgres")]
        Held::Postgres(held) => {
            let params: Vec<Vec<TypedParam<'_>>> = held
                .staged
                .iter()
                .map(|statement| typed(&statement.params))
                .collect();
            let statements: Vec<idemdb_postgres::TypedStatement<'_>> = held
                .staged
                .iter()
                .zip(&params)
                .map(|(statement, params)| (statement.sql.as_str(), params.as_slice()))
                .collect();
            held.claim
                .commit_with(stored, &statements)
                .await
                .map_err(Failure::Postgres)
        }
        #[cfg(feature = "postgres")]
        Held::PgLease(held) => complete_lease(held, stored).await,
    }
}

/// A staged parameter as tokio-postgres takes it.
#[cfg(feature = "postgres")]
type TypedParam<'a> = (
    &'a (dyn tokio_postgres::types::ToSql + Sync),
    tokio_postgres::types::Type,
);

#[cfg(feature = "postgres")]
fn typed(params: &[SqlParam]) -> Vec<TypedParam<'_>> {
    params
        .iter()
        .map(|(value, kind)| {
            let value: &(dyn tokio_postgres::types::ToSql + Sync) = &**value;
            (value, kind.clone())
        })
        .collect()
}

/// Completes a PostgreSQL lease on a connection asked for now: the completion's transaction is
/// opened once the record is found still this request's (the fence: `LeaseLost` when another
/// request took the key over, and nothing of this one is sent), the staged SQL runs in it in
/// order, then the stored response's write and the commit. A failure past the fence releases
/// the lease on the same connection, so that the key is free as after a failed commit on the
/// batch path; one before it (no connection, the key's lock busy) leaves the lease to run out.
#[cfg(feature = "postgres")]
async fn complete_lease(held: PgLeaseHeld, stored: Vec<u8>) -> Result<(), Failure> {
    let PgLeaseHeld {
        claim,
        staged,
        connect,
    } = held;
    let mut connection = connect().await.map_err(Failure::Connect)?;
    let completion = claim
        .completion(&mut connection)
        .await
        .map_err(Failure::Postgres)?;
    let mut failed = None;
    for statement in &staged {
        // One round trip each: the completion's transaction takes them as plain statements.
        let params = typed(&statement.params);
        if let Err(error) = completion
            .transaction()
            .query_typed(&statement.sql, &params)
            .await
        {
            failed = Some(idemdb_postgres::Error::from(error));
            break;
        }
    }
    let completed = match failed {
        Some(error) => {
            // Dropped, the completion sends its rollback; the release below queues behind it.
            drop(completion);
            Err(error)
        }
        None => completion.commit(stored).await,
    };
    let Err(error) = completed else {
        return Ok(());
    };
    if let Err(release) = claim.release(&mut connection).await {
        // The lease runs out on its own; a retry meanwhile gets 409.
        tracing::warn!(target: "idemdb_http", error = %release, "a lease was not released after its completion failed");
    }
    Err(Failure::Postgres(error))
}

/// Drops the handler's writes and frees the key.
pub(crate) async fn free(held: Held) {
    match held {
        #[cfg(feature = "embedded")]
        Held::Batch(claim) => claim.abort(),
        #[cfg(feature = "embedded")]
        Held::Lease(claim) => {
            if let Err(error) = blocking(move || claim.release()).await {
                // The lease runs out on its own; a retry meanwhile gets 409.
                tracing::warn!(target: "idemdb_http", %error, "a lease was not released");
            }
        }
        #[cfg(feature = "postgres")]
        Held::Postgres(held) => {
            // Waited for: the key is free when the response goes out.
            if let Err(error) = held.claim.abort().await {
                // The server rolls back on its own when it notices the connection gone.
                tracing::warn!(target: "idemdb_http", %error, "a claim's rollback failed");
            }
        }
        #[cfg(feature = "postgres")]
        Held::PgLease(held) => {
            // Waited for, on a connection asked for now: the key is free when the response
            // goes out. Failed, the lease runs out on its own; a retry meanwhile gets 409.
            match (held.connect)().await {
                Ok(mut connection) => {
                    if let Err(error) = held.claim.release(&mut connection).await {
                        tracing::warn!(target: "idemdb_http", %error, "a lease was not released");
                    }
                }
                Err(error) => {
                    tracing::warn!(target: "idemdb_http", %error, "a lease was not released: no connection");
                }
            }
        }
    }
}

/// Runs a synced write on tokio's blocking threads; inline without a runtime.
#[cfg(feature = "embedded")]
pub(crate) async fn blocking<R: Send + 'static>(
    call: impl FnOnce() -> idemdb::Result<R> + Send + 'static,
) -> idemdb::Result<R> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => runtime.spawn_blocking(call).await.unwrap_or_else(|_| {
            Err(idemdb::Error::Storage {
                kind: idemdb::StorageErrorKind::Other,
                detail: "a blocking store call panicked".into(),
            })
        }),
        Err(_) => call(),
    }
}
