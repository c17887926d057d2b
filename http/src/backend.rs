//! Where a layer's claims live: the embedded engine (a latched claim, or a durable lease) or
//! PostgreSQL (a transaction on a pooled connection). The layer asks the same three things of
//! either: claim a key, commit a claim with its stored response, drop a claim's writes.

#[cfg(feature = "postgres")]
use std::future::Future;
#[cfg(feature = "postgres")]
use std::pin::Pin;
use std::sync::Arc;
#[cfg(feature = "embedded")]
use std::time::Duration;

use idemdb::{Fingerprint, Outcome};

use crate::handle::Held;
use crate::rejection::Rejection;

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
        /// `with_lease` was called on it: not offered on PostgreSQL yet, so every keyed
        /// request is refused rather than served without the lease it was built for.
        lease_asked: bool,
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
    /// A PostgreSQL layer built with `with_lease`.
    #[cfg(feature = "postgres")]
    NoLeaseOnPostgres,
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
            #[cfg(feature = "postgres")]
            Failure::NoLeaseOnPostgres => {
                write!(f, "the PostgreSQL backend has no lease path (with_lease)")
            }
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
            #[cfg(feature = "postgres")]
            Failure::NoLeaseOnPostgres => Rejection::StoreUnavailable { retryable: false },
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
    /// write, off the runtime's thread) on the engine; a transaction holding the key's lock on
    /// a connection of its own on PostgreSQL.
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
                lease_asked,
            } => {
                if *lease_asked {
                    return Err(Failure::NoLeaseOnPostgres);
                }
                let connection = connect().await.map_err(Failure::Connect)?;
                let message = idemdb::Message::new(&key, fingerprint);
                consumer
                    .begin_owned(Pooled(connection), &message)
                    .await
                    .map(|outcome| {
                        outcome.map_fresh(|claim| {
                            Held::Postgres(crate::handle::PgHeld {
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
            let params: Vec<Vec<(&(dyn tokio_postgres::types::ToSql + Sync), _)>> = held
                .staged
                .iter()
                .map(|statement| {
                    statement
                        .params
                        .iter()
                        .map(|(value, kind)| {
                            let value: &(dyn tokio_postgres::types::ToSql + Sync) = &**value;
                            (value, kind.clone())
                        })
                        .collect()
                })
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
    }
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
    }
}

/// Runs a synced write on tokio's blocking threads; inline without a runtime.
#[cfg(feature = "embedded")]
async fn blocking<R: Send + 'static>(
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
