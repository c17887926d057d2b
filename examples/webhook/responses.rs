//! The answers: a response stored as the claim's result and replayed to every retry, the JSON
//! error answers, and what a failed store call answers.

use axum::body::Bytes;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idemdb::{Error, StorageErrorKind};

/// The response header marking a replayed response.
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Seconds a client should wait before retrying a 409 or a retryable 503.
pub(crate) const RETRY_AFTER_S: HeaderValue = HeaderValue::from_static("1");
/// First byte of a stored response: its encoding, so a later version of this service can read
/// the responses stored by this one (they live for [`RETENTION`](crate::RETENTION)).
const STORED_RESPONSE_V1: u8 = 1;

/// A response as stored in the claim's result: replayed byte for byte to every retry.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    /// JSON, like every body this service sends.
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// `[STORED_RESPONSE_V1][status: u16 big-endian][body]`.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(3 + self.body.len());
        bytes.push(STORED_RESPONSE_V1);
        bytes.extend_from_slice(&self.status.as_u16().to_be_bytes());
        bytes.extend_from_slice(&self.body);
        bytes
    }

    /// `None` for bytes that [`StoredResponse::encode`] did not produce.
    pub(crate) fn decode(bytes: &Bytes) -> Option<StoredResponse> {
        let (&[version, high, low], _) = bytes.split_first_chunk::<3>()?;
        if version != STORED_RESPONSE_V1 {
            return None;
        }
        Some(StoredResponse {
            status: StatusCode::from_u16(u16::from_be_bytes([high, low])).ok()?,
            body: bytes.slice(3..),
        })
    }

    pub(crate) fn into_response(self, replayed: bool) -> Response {
        let mut response = json(self.status, self.body);
        if replayed {
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        response
    }
}

/// Answers a failed store call. Nothing was stored for the key: the claim (if any) is dropped
/// with the handler, so the client's retry is processed again.
pub(crate) fn storage_failure(failure: &Error) -> Response {
    eprintln!("webhook: store failure: {failure}");
    match failure {
        Error::Storage {
            kind: StorageErrorKind::Retryable,
            ..
        } => {
            let mut response = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the store is busy; retry with the same Idempotency-Key",
            );
            response.headers_mut().insert(RETRY_AFTER, RETRY_AFTER_S);
            response
        }
        // A failed write poisons the engine until the process reopens the store; the operator
        // (or a supervisor restarting the process) has to act, so no Retry-After.
        Error::Storage { .. } | Error::Poisoned => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the store is unavailable; retry with the same Idempotency-Key later",
        ),
        _ => error(StatusCode::INTERNAL_SERVER_ERROR, "internal error"),
    }
}

/// An error answer: `{"error": message}`. Messages are constants without quotes or backslashes,
/// so they need no JSON escaping.
pub(crate) fn error(status: StatusCode, message: &'static str) -> Response {
    json(status, format!("{{\"error\":\"{message}\"}}"))
}

pub(crate) fn json(status: StatusCode, body: impl Into<Bytes>) -> Response {
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body.into(),
    )
        .into_response()
}
