//! [`IdempotencyLayer`] and the service it wraps around a handler: what the layer decides
//! before the handler runs (the key, the principal, the claim) and after (store the response
//! with the handler's writes, or drop both).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, LOCATION};
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idemdb::{Fingerprint, Outcome};
use tower_layer::Layer;
use tower_service::Service;

use crate::backend::{Backend, BoxError, commit, free};
use crate::handle::{IdempotentRequest, ReleaseOnDrop};
use crate::key::{KeyProblem, Principal, request_key, scoped_key};
use crate::rejection::Rejection;
use crate::stored::StoredResponse;

/// The response header marking a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The default limit of a request body the layer reads (to fingerprint it): 1 MiB.
pub const REQUEST_BODY_BYTES_DEFAULT: usize = 1 << 20;
/// The default limit of a response the layer stores: 1 MiB.
pub const RESPONSE_BODY_BYTES_DEFAULT: usize = 1 << 20;
/// The default `Retry-After` of a `409` (and of a retryable `503`): 1 s.
pub const RETRY_AFTER_DEFAULT: Duration = Duration::from_secs(1);

type PrincipalFn = dyn Fn(&Parts) -> Option<Principal> + Send + Sync;
type FingerprintFn = dyn Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync;
type StoreFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// What every request of a layer shares.
#[derive(Clone)]
struct Policy {
    backend: Backend,
    principal: Arc<PrincipalFn>,
    key_required: bool,
    request_limit: usize,
    response_limit: usize,
    store: Arc<StoreFn>,
    kept_headers: Vec<HeaderName>,
    fingerprint: Arc<FingerprintFn>,
    retry_after_s: u64,
}

/// A tower layer that makes the routes under it idempotent by the `Idempotency-Key` request
/// header: a request's handler runs once per (principal, key), and every retry is answered
/// with the response it stored, byte for byte. What the handler stages on its
/// [`IdempotentRequest`] commits in one write batch with that response. The crate's docs have
/// the whole behaviour.
#[derive(Clone)]
pub struct IdempotencyLayer {
    policy: Arc<Policy>,
}

impl IdempotencyLayer {
    /// A layer whose keys are claimed by `consumer` (one consumer per endpoint, or per set of
    /// endpoints sharing keys; its engine's retention is how long a response is kept), scoped
    /// by the principal `principal` finds for each request: typically the authenticated
    /// tenant or API client from a request extension an earlier layer put there. A request
    /// without one is refused with `401` ([`Rejection::NoPrincipal`]); the key is checked
    /// first, so a request with neither gets the key's `400`. A service that truly has one
    /// caller gives a constant principal, which is a decision made here, in sight.
    #[cfg(feature = "embedded")]
    pub fn new(
        consumer: idemdb::Consumer,
        principal: impl Fn(&Parts) -> Option<Principal> + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        IdempotencyLayer::on(
            Backend::Embedded {
                consumer,
                lease: None,
            },
            principal,
        )
    }

    /// A layer on the PostgreSQL backend: each keyed request's claim is a transaction on a
    /// connection `connect` gives (a pooled one: anything that dereferences to a
    /// `tokio_postgres::Client`), holding the key's lock while the handler runs, across every
    /// process and host on the database. The handler stages SQL with
    /// [`IdempotentRequest::sql`]; it runs with the stored response's write in the commit's one
    /// round trip. The connection goes back (is dropped) when the claim ends. `principal`
    /// finds the request's [`Principal`], which scopes its key; the retention is the store's. A request
    /// for which `connect` fails gets `503` with `Retry-After`.
    #[cfg(feature = "postgres")]
    pub fn postgres<F, Fut, C, E>(
        consumer: idemdb_postgres::PgConsumer,
        connect: F,
        principal: impl Fn(&Parts) -> Option<Principal> + Send + Sync + 'static,
    ) -> IdempotencyLayer
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<C, E>> + Send + 'static,
        C: std::ops::DerefMut<Target = tokio_postgres::Client> + Send + 'static,
        E: Into<BoxError>,
    {
        let connect = Arc::new(move || {
            let connecting = connect();
            Box::pin(async move {
                connecting
                    .await
                    .map(|client| Box::new(client) as crate::backend::PgConnection)
                    .map_err(Into::into)
            }) as Pin<Box<dyn Future<Output = _> + Send>>
        });
        IdempotencyLayer::on(
            Backend::Postgres {
                consumer,
                connect,
                lease: None,
            },
            principal,
        )
    }

    fn on(
        backend: Backend,
        principal: impl Fn(&Parts) -> Option<Principal> + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        IdempotencyLayer {
            policy: Arc::new(Policy {
                backend,
                principal: Arc::new(principal),
                key_required: true,
                request_limit: REQUEST_BODY_BYTES_DEFAULT,
                response_limit: RESPONSE_BODY_BYTES_DEFAULT,
                store: Arc::new(|status: StatusCode| status.is_success()),
                kept_headers: vec![CONTENT_TYPE, LOCATION],
                fingerprint: Arc::new(fingerprint_of_request),
                retry_after_s: RETRY_AFTER_DEFAULT.as_secs(),
            }),
        }
    }

    fn with(mut self, change: impl FnOnce(&mut Policy)) -> IdempotencyLayer {
        change(Arc::make_mut(&mut self.policy));
        self
    }

    /// Lets requests without an `Idempotency-Key` through to the handler, untouched: no
    /// principal is asked for, the body is not read or limited, and the handler gets no
    /// [`IdempotentRequest`] (by default they are refused with `400`). A request with a key is
    /// handled as on any route, a malformed key refused with `400`.
    #[must_use]
    pub fn key_optional(self) -> IdempotencyLayer {
        self.with(|policy| policy.key_required = false)
    }

    /// The most bytes of a request body the layer reads (it fingerprints the body before the
    /// handler runs); a larger body is refused with `413`. Default
    /// [`REQUEST_BODY_BYTES_DEFAULT`].
    #[must_use]
    pub fn request_body_limit(self, bytes: usize) -> IdempotencyLayer {
        self.with(|policy| policy.request_limit = bytes)
    }

    /// The most bytes of a response body the layer stores. A larger response of a status it
    /// stores is not sent: the handler's writes are dropped, the key is freed and the client
    /// gets `500` ([`Rejection::ResponseTooLarge`]). Default [`RESPONSE_BODY_BYTES_DEFAULT`];
    /// at most `idemdb::RESULT_BYTES_MAX` minus the status and kept headers.
    #[must_use]
    pub fn response_body_limit(self, bytes: usize) -> IdempotencyLayer {
        self.with(|policy| policy.response_limit = bytes)
    }

    /// Which statuses are stored (with the handler's writes) besides the default, the `2xx`
    /// ones: for instance the `4xx` a request will get again however often it is retried
    /// (`|status| status.is_success() || status == StatusCode::PAYMENT_REQUIRED`). A response
    /// not stored drops the handler's writes and frees the key, so a retry runs the handler
    /// again. A `5xx` is never stored, whatever `store` says.
    #[must_use]
    pub fn store_when(
        self,
        store: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        self.with(|policy| policy.store = Arc::new(store))
    }

    /// The response headers stored and replayed with the status and body (every value of
    /// each, in order), replacing the default list: `content-type` and `location`. Headers
    /// describing the connection or the moment (`date`, `set-cookie` of a session) are usually
    /// better left out. A kept header value over 64 KiB cannot be stored: the response is
    /// answered as one over the size limit (`500`, nothing stored, the key free).
    #[must_use]
    pub fn replay_headers(self, names: impl IntoIterator<Item = HeaderName>) -> IdempotencyLayer {
        let names = names.into_iter().collect();
        self.with(|policy| policy.kept_headers = names)
    }

    /// How a request is told apart from another sent with the same key (a reused key gets
    /// `422`). Default: the method, the path, the query and the body.
    #[must_use]
    pub fn fingerprint(
        self,
        fingerprint: impl Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        self.with(|policy| policy.fingerprint = Arc::new(fingerprint))
    }

    /// The `Retry-After` of a `409` (a retry while the first request is in progress) and of a
    /// retryable `503`: whole seconds, rounded up, at least 1. Default [`RETRY_AFTER_DEFAULT`].
    #[must_use]
    pub fn retry_after(self, after: Duration) -> IdempotencyLayer {
        let seconds = after
            .as_secs()
            .saturating_add(u64::from(after.subsec_nanos() > 0))
            .max(1);
        self.with(|policy| policy.retry_after_s = seconds)
    }

    /// The lease path, for handlers with effects outside the write batch (a payment provider's
    /// call): a fresh request takes a durable lease of `lease` as `holder` (this process's
    /// name, kept with the lease for operators) before its handler runs. A retry meanwhile
    /// gets `409`, from this process or any other opening the store after a restart. Once the
    /// lease runs out, a retry takes the key over under a new epoch and runs the handler
    /// again: downstream calls made with [`IdempotentRequest::derive_key`] repeat with the
    /// same key, so a downstream service that deduplicates does the work once. A request that
    /// outlived its lease and was taken over cannot store its response: it gets `503`
    /// ([`Rejection::LeaseLost`]) and its writes are dropped; one that outlived its lease with
    /// no takeover stores its response as usual. A dropped request, and one whose response is
    /// not stored, releases its lease. Each lease costs two synced writes (taking it,
    /// completing it) against the batch path's one.
    ///
    /// On the PostgreSQL backend the lease is an external claim whose in-progress record is
    /// committed before the handler runs, so it holds the key across every process on the
    /// database and across their restarts, and no connection is held while the handler runs:
    /// one is asked of the layer's connect function to take the lease, again to complete it
    /// (the fence, the staged SQL and the stored response in one transaction), and for a
    /// release or a renewal ([`IdempotentRequest::renew_async`]). Its clock is the store's
    /// (the database's unless one was injected).
    #[must_use]
    pub fn with_lease(self, lease: Duration, holder: impl AsRef<[u8]>) -> IdempotencyLayer {
        let holder: Arc<[u8]> = holder.as_ref().into();
        self.with(|policy| match &mut policy.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded { lease: slot, .. } => *slot = Some((lease, holder)),
            #[cfg(feature = "postgres")]
            Backend::Postgres { lease: slot, .. } => *slot = Some((lease, holder)),
        })
    }
}

/// The default fingerprint: xxh3-128 over the method, the path, the query (each with its
/// length, so that no two requests meet by moving bytes between them) and the body.
fn fingerprint_of_request(parts: &Parts, body: &[u8]) -> Fingerprint {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for part in [
        parts.method.as_str(),
        parts.uri.path(),
        parts.uri.query().unwrap_or(""),
    ] {
        hasher.update(&(part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.update(body);
    Fingerprint::from_u128(hasher.digest128())
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency {
            inner,
            policy: self.policy.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around `S`.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    policy: Arc<Policy>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + From<Bytes> + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was polled ready serves this call; the fresh clone waits for the next
        // poll_ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let policy = self.policy.clone();
        Box::pin(serve(policy, inner, request))
    }
}

/// One request, start to end.
async fn serve<S, ReqBody, ResBody>(
    policy: Arc<Policy>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + From<Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let reject = |rejection: Rejection| Ok(rejection.into_response(policy.retry_after_s));
    let (mut parts, body) = request.into_parts();
    let key = match request_key(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if !policy.key_required => {
            return inner.call(Request::from_parts(parts, body)).await;
        }
        Ok(None) => return reject(Rejection::KeyMissing),
        Err(KeyProblem::Repeated) => return reject(Rejection::KeyRepeated),
        Err(KeyProblem::Malformed) => return reject(Rejection::KeyMalformed),
    };
    let Some(principal) = (policy.principal)(&parts) else {
        return reject(Rejection::NoPrincipal);
    };
    let body = match Limited::new(body, policy.request_limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => {
            return reject(Rejection::RequestTooLarge);
        }
        Err(_) => return reject(Rejection::RequestBodyUnreadable),
    };
    let fingerprint = (policy.fingerprint)(&parts, &body);
    let outcome = match policy
        .backend
        .begin(scoped_key(&principal, &key), fingerprint)
        .await
    {
        Ok(outcome) => outcome,
        Err(failure) => return reject(failure.rejection()),
    };
    let handle = match outcome {
        Outcome::Fresh(held) => IdempotentRequest::new(held),
        Outcome::Duplicate { result, .. } => {
            return match StoredResponse::decode(&result) {
                Some(stored) => Ok(replay(stored)),
                None => reject(Rejection::StoredResponseCorrupt),
            };
        }
        Outcome::Conflict { .. } => return reject(Rejection::KeyReused),
        Outcome::InProgress { .. } => return reject(Rejection::InProgress),
        // Only messages with a production time or an entity version get the other outcomes,
        // and the layer claims with neither.
        _ => return reject(Rejection::StoreUnavailable { retryable: false }),
    };
    // From here until the claim is taken back, a dropped future frees a lease.
    let guard = ReleaseOnDrop(handle.clone());
    parts.extensions.insert(handle.clone());
    let response = inner
        .call(Request::from_parts(parts, ReqBody::from(body)))
        .await?;
    // Taken back before the guard goes: the guard frees only a claim still in the handle.
    let held = handle.take();
    drop(guard);
    let Some(held) = held else {
        // Only this function takes it, once.
        return reject(Rejection::StoreUnavailable { retryable: false });
    };
    let status = response.status();
    if status.is_server_error() || !(policy.store)(status) {
        free(held).await;
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    let body = match Limited::new(body, policy.response_limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            free(held).await;
            return reject(if error.is::<LengthLimitError>() {
                Rejection::ResponseTooLarge
            } else {
                Rejection::ResponseBodyFailed
            });
        }
    };
    let stored = StoredResponse::new(status, &parts.headers, &policy.kept_headers, body.clone());
    let Some(encoded) = stored.encode() else {
        free(held).await;
        return reject(Rejection::ResponseTooLarge);
    };
    match commit(held, encoded).await {
        Ok(()) => Ok(Response::from_parts(parts, ResBody::from(body))),
        Err(failure) => reject(failure.rejection()),
    }
}

/// A stored response, replayed: its status, kept headers and body, marked as a replay.
fn replay<B: From<Bytes>>(stored: StoredResponse) -> Response<B> {
    let mut response = Response::new(B::from(stored.body));
    *response.status_mut() = stored.status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        headers.append(name, value);
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}
