//! HTTP idempotency keys for tower services (axum, tonic, hyper-util), on idemdb: a retry of a
//! request either replays the response its first attempt stored or runs the handler for the
//! first time, never both, and **the handler's writes and its stored response commit in one
//! write batch**. A crash between the two cannot leave effects without a response to replay,
//! or a response without its effects.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Extension, Router, body::Bytes, http::StatusCode, routing::post};
//! use idemdb::{Engine, TableOptions};
//! use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal};
//! # use tower::ServiceExt;
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path())
//!     .business_table(TableOptions::new("payments"))
//!     .open()?;
//! let payments = engine.business_table("payments")?;
//!
//! // Keys are scoped by the caller: here an `X-Tenant` header an authenticating layer in
//! // front has checked. A request without one is refused with 401.
//! let layer = IdempotencyLayer::new(engine.consumer("payments")?, |request| {
//!     let tenant = request.headers.get("x-tenant")?;
//!     Principal::new(tenant.as_bytes()).ok()
//! });
//!
//! let app = Router::new()
//!     .route(
//!         "/payments",
//!         post(move |Extension(request): Extension<IdempotentRequest>, body: Bytes| async move {
//!             // Staged on the request's claim: written with the response below, or not at all.
//!             let id = request.derive_key("payment").map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
//!             request.put(&payments, &id, &body).map_err(|_| StatusCode::BAD_REQUEST)?;
//!             Ok::<_, StatusCode>((StatusCode::CREATED, id))
//!         }),
//!     )
//!     .layer(layer);
//!
//! let send = || {
//!     axum::http::Request::post("/payments")
//!         .header("x-tenant", "acme")
//!         .header("idempotency-key", "\"8e03978e\"")
//!         .body(axum::body::Body::from("{\"amount\": 100}"))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(send()).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! let retry = app.oneshot(send()).await?; // the handler does not run again
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # Ok(())
//! # }
//! ```
//!
//! # What a request gets
//!
//! The statuses are those of the IETF httpapi draft "The Idempotency-Key HTTP Header Field";
//! the layer's own answers are [`Rejection`]s, sent as RFC 9457 problems.
//!
//! | request | answer |
//! |---|---|
//! | first with its key | the handler runs; a `2xx` response (and any status [`IdempotencyLayer::store_when`] adds) is stored with the handler's writes, in one batch |
//! | retry after the first completed, same request | the stored status, kept headers ([`IdempotencyLayer::replay_headers`]) and body, byte for byte, with `Idempotent-Replayed: true`; the handler does not run |
//! | same key, another request (method, path, query or body; [`IdempotencyLayer::fingerprint`]) | `422` |
//! | retry while the first is being processed | `409` with `Retry-After` |
//! | no key on a route that requires one (the default) | `400`; with [`IdempotencyLayer::key_optional`] the request passes through untouched |
//! | two keys, an empty one, one over [`KEY_BYTES_MAX`] bytes, or neither a quoted string of printable ASCII nor a bare token of visible ASCII | `400` (checked before the principal) |
//! | no principal for the request | `401` |
//! | request body over [`IdempotencyLayer::request_body_limit`] | `413`; the handler does not run |
//! | the handler answers `5xx`, or a status not stored | the response goes out; nothing is stored, the handler's writes are dropped and the key is free: a retry runs the handler again |
//! | the handler's future is dropped (client gone, timeout, panic) | nothing is stored and the key is free |
//! | a response to store over [`IdempotencyLayer::response_body_limit`] | `500` instead of it; nothing is stored and the key is free |
//! | the store fails | `503` (with `Retry-After` when transient); nothing is stored |
//! | on the lease path, the handler outlives its lease and another request takes the key over | `503` with `Retry-After`, its writes dropped; a retry gets the response of the request that took over |
//!
//! **The key is scoped by a principal.** Every constructor of [`IdempotencyLayer`] (`new` on
//! the embedded engine, `postgres` on PostgreSQL) takes the function that finds a request's
//! [`Principal`] (the authenticated tenant or client): the same key from two
//! principals names two requests, so one client is never answered with another's response.
//!
//! **Retention.** A stored response is kept for the store's retention
//! (`EngineBuilder::retention`, or `StoreBuilder::retention` on PostgreSQL; 7 days by default)
//! and expires exactly then, whether or not compaction or removal has deleted it yet: a retry
//! after that runs the handler again. Tell clients, as the draft asks (in the API's
//! documentation).
//!
//! **In progress is the claim's latch** on the embedded engine's batch path: the key is held in
//! this process while the handler runs. One process owns a store; shard keys across processes,
//! or use the lease path ([`IdempotencyLayer::with_lease`]) for handlers with effects outside
//! the batch, whose lease also holds the key across a restart of the process. On PostgreSQL the
//! key is held across every process on the database, by the claim's transaction or, on the
//! lease path, by a committed lease.
//!
//! # Backends
//!
//! - **The embedded engine** (feature `embedded`, the default): `IdempotencyLayer::new` over an
//!   `idemdb::Consumer`; the handler stages writes on business tables (`put`, `merge`,
//!   `delete`), committed in one write batch with the response.
//! - **PostgreSQL** (feature `postgres`; without `embedded` the crate builds without RocksDB):
//!   `IdempotencyLayer::postgres` over an `idemdb_postgres::PgConsumer` and a function that
//!   gives a connection (a pooled one). Each keyed request's claim is a transaction holding the
//!   key's lock, so a retry from any process or host on the database gets `409` while the first
//!   runs; the handler stages SQL (`IdempotentRequest::sql`), run in that transaction by the
//!   commit that stores the response, in one round trip. With `with_lease` each request's
//!   claim is instead an external claim whose in-progress record is committed before the
//!   handler runs (no connection is held meanwhile); its completion is fenced, and runs the
//!   staged SQL and the response's write in one transaction. `IdempotentRequest::renew_async`
//!   renews it.

mod backend;
mod handle;
mod key;
mod layer;
mod rejection;
mod stored;

#[cfg(feature = "postgres")]
pub use backend::SqlParam;
pub use handle::{IdempotentRequest, StageError};
pub use key::{IDEMPOTENCY_KEY, InvalidPrincipal, KEY_BYTES_MAX, PRINCIPAL_BYTES_MAX, Principal};
pub use layer::{
    IDEMPOTENT_REPLAYED, Idempotency, IdempotencyLayer, REQUEST_BODY_BYTES_DEFAULT,
    RESPONSE_BODY_BYTES_DEFAULT, RETRY_AFTER_DEFAULT,
};
pub use rejection::Rejection;
