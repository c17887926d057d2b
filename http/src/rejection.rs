//! The layer's own answers: what it says instead of running the handler, or instead of the
//! handler's response when that response cannot be stored. Each is a [`Rejection`] with a
//! documented status, sent as an RFC 9457 problem (`application/problem+json`).

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

/// Why the layer answered itself. [`Rejection::status`] is the status it answers with; the
/// body is `{"title": ..., "status": ...}` as `application/problem+json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// `400`: the route requires an `Idempotency-Key` and the request has none.
    #[error("the Idempotency-Key header is required")]
    KeyMissing,
    /// `400`: more than one `Idempotency-Key` header.
    #[error("send exactly one Idempotency-Key header")]
    KeyRepeated,
    /// `400`: an empty key, one over [`crate::KEY_BYTES_MAX`] bytes, or neither a quoted string
    /// of printable ASCII nor a bare token of visible ASCII (no spaces, no double quotes).
    #[error("the Idempotency-Key must be 1 to 255 ASCII characters, quoted or a bare token")]
    KeyMalformed,
    /// `401`: the layer's principal function found no principal for the request.
    #[error("the request has no principal to scope its Idempotency-Key by")]
    NoPrincipal,
    /// `413`: the request's body is over the layer's request limit; the handler did not run.
    #[error("the request body is over the limit for idempotent requests")]
    RequestTooLarge,
    /// `400`: the request's body failed while it was read.
    #[error("the request body could not be read")]
    RequestBodyUnreadable,
    /// `422`: the key was used before for a different request (method, path, query or body, by
    /// the layer's fingerprint). Use a new key for a new request.
    #[error("this Idempotency-Key was already used for a different request")]
    KeyReused,
    /// `409` with `Retry-After`: a request with this key is being processed now.
    #[error("a request with this Idempotency-Key is still being processed")]
    InProgress,
    /// `500`: the handler's response is over the layer's response limit, so it could not be
    /// stored; nothing the handler staged was committed, and the key is free again.
    #[error("the response is over the limit for stored responses; nothing was stored")]
    ResponseTooLarge,
    /// `500`: the handler's response body failed while it was read; nothing was committed.
    #[error("the response body could not be read; nothing was stored")]
    ResponseBodyFailed,
    /// `503` (with `Retry-After` when `retryable`): the store failed; nothing was committed.
    #[error("the store is unavailable; retry with the same Idempotency-Key")]
    StoreUnavailable {
        /// The failure is transient.
        retryable: bool,
    },
    /// `503` with `Retry-After`: on the lease path, the handler outlived its lease and another
    /// request took the key over; this one's response is not stored and its writes are
    /// dropped. A retry gets the other's response once it completes. (A handler that outlived
    /// its lease with no takeover stores its response as usual: nobody else ran.)
    #[error("the request outlived its lease; retry with the same Idempotency-Key")]
    LeaseLost,
    /// `500`: the response stored for the key does not decode.
    #[error("the response stored for this Idempotency-Key does not decode")]
    StoredResponseCorrupt,
}

impl Rejection {
    /// The status the layer answers with.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::KeyMissing
            | Rejection::KeyRepeated
            | Rejection::KeyMalformed
            | Rejection::RequestBodyUnreadable => StatusCode::BAD_REQUEST,
            Rejection::NoPrincipal => StatusCode::UNAUTHORIZED,
            Rejection::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Rejection::InProgress => StatusCode::CONFLICT,
            Rejection::ResponseTooLarge
            | Rejection::ResponseBodyFailed
            | Rejection::StoredResponseCorrupt => StatusCode::INTERNAL_SERVER_ERROR,
            Rejection::StoreUnavailable { .. } | Rejection::LeaseLost => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// Whether the answer carries `Retry-After`.
    fn retry_after(&self) -> bool {
        matches!(
            self,
            Rejection::InProgress
                | Rejection::LeaseLost
                | Rejection::StoreUnavailable { retryable: true }
        )
    }

    /// The answer, with `retry_after_s` in `Retry-After` where it has one.
    pub(crate) fn into_response<B: From<Bytes>>(self, retry_after_s: u64) -> Response<B> {
        let status = self.status();
        // The messages are constants without quotes or backslashes: no JSON escaping needed.
        let body = format!("{{\"title\":\"{self}\",\"status\":{}}}", status.as_u16());
        let mut response = Response::new(B::from(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if self.retry_after() {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_s));
        }
        response
    }
}
