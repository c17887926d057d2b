//! The endpoints: `POST /payments` claims the delivery's idempotency key and processes the
//! payment once; `GET /payments/count` reads the counter. The answers are in `responses.rs`.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use idemdb::{
    BusinessTable, Claim, Consumer, Engine, Error, Fingerprint, MESSAGE_KEY_BYTES_MAX, Outcome,
    merge_ops,
};
use tokio::sync::Notify;

use crate::responses::{RETRY_AFTER_S, StoredResponse, error, json, storage_failure};
use crate::{CONSUMER_ID, PAYMENTS_COUNTER, PAYMENTS_TABLE, TOTALS_TABLE};

/// The request header naming the delivery (draft-ietf-httpapi-idempotency-key-header).
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
// The 400 answer to an overlong key quotes the limit as a constant string.
const _: () = assert!(MESSAGE_KEY_BYTES_MAX == 1024);

/// A hook that holds every fresh request between taking its claim and processing it, until
/// released: the tests use it to have a retry arrive while the first delivery is in progress,
/// without sleeping. [`router`] takes `None` in production.
#[derive(Debug, Default)]
pub(crate) struct ProcessingGate {
    /// Notified when a fresh request holds its claim and waits at the gate.
    pub(crate) reached: Notify,
    /// Each permit lets one waiting request go on to processing.
    pub(crate) release: Notify,
}

/// What every handler needs; cheap to clone (handles are `Arc`s).
#[derive(Clone)]
struct AppState {
    consumer: Consumer,
    payments: BusinessTable,
    totals: BusinessTable,
    gate: Option<Arc<ProcessingGate>>,
}

/// The webhook's routes over `engine`, which must have been opened by [`open_engine`](crate::open_engine).
pub(crate) fn router(engine: &Engine, gate: Option<Arc<ProcessingGate>>) -> idemdb::Result<Router> {
    let state = AppState {
        consumer: engine.consumer(CONSUMER_ID)?,
        payments: engine.business_table(PAYMENTS_TABLE)?,
        totals: engine.business_table(TOTALS_TABLE)?,
        gate,
    };
    Ok(Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/count", get(payment_count))
        .with_state(state))
}

/// `POST /payments`: processes a delivery once per idempotency key; see the header of `main.rs`.
async fn create_payment(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = match idempotency_key(&headers) {
        Ok(key) => key,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let outcome = match state.consumer.begin(key, Fingerprint::of(&body)) {
        Ok(outcome) => outcome,
        // The only limit `begin` checks is the key's length (1..=MESSAGE_KEY_BYTES_MAX).
        Err(Error::LimitExceeded { .. }) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the Idempotency-Key must be 1 to 1024 bytes long",
            );
        }
        Err(failure) => return storage_failure(&failure),
    };
    match outcome {
        Outcome::Fresh(mut claim) => {
            if let Some(gate) = &state.gate {
                gate.reached.notify_one();
                gate.release.notified().await;
            }
            let response = match process(&state, &mut claim, &body) {
                Ok(response) => response,
                // Dropping the claim releases the key and writes nothing: a retry runs again.
                Err(failure) => return storage_failure(&failure),
            };
            match claim.commit_async(response.encode()).await {
                Ok(_) => response.into_response(false),
                Err(failure) => storage_failure(&failure),
            }
        }
        Outcome::Duplicate { result, .. } => match StoredResponse::decode(&result) {
            Some(stored) => stored.into_response(true),
            None => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the response stored for this Idempotency-Key does not decode",
            ),
        },
        Outcome::Conflict { .. } => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "this Idempotency-Key was already used for a different request body; \
             use a new key for a new payment",
        ),
        Outcome::InProgress { .. } => {
            let mut response = error(
                StatusCode::CONFLICT,
                "a request with this Idempotency-Key is still being processed; retry later",
            );
            response.headers_mut().insert(RETRY_AFTER, RETRY_AFTER_S);
            response
        }
        // Only a `Message` with a production time or an entity version can get these, and this
        // handler passes neither; answer rather than panic if that ever changes.
        Outcome::TooLate { .. } | Outcome::Stale { .. } => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "unexpected idempotency outcome",
        ),
    }
}

/// The business logic: stages the payment's effects on the claim (nothing is written until the
/// claim commits) and returns the response to store with them.
fn process(state: &AppState, claim: &mut Claim, body: &Bytes) -> idemdb::Result<StoredResponse> {
    // The same for every attempt at this key, also after a restart: had a commit failed after
    // a downstream call, the retry would make that call again under the same id.
    let payment_id = claim.derive_key("payment");
    claim.put(&state.payments, &payment_id, body)?;
    claim.merge(&state.totals, PAYMENTS_COUNTER, 1u64.to_be_bytes())?;
    Ok(StoredResponse {
        status: StatusCode::CREATED,
        body: Bytes::from(format!(
            "{{\"payment_id\":\"{payment_id}\",\"status\":\"accepted\"}}"
        )),
    })
}

/// `GET /payments/count`: how many payments were processed (retries do not count).
async fn payment_count(State(state): State<AppState>) -> Response {
    match state.totals.get(PAYMENTS_COUNTER) {
        Ok(value) => {
            let count = value.as_deref().and_then(merge_ops::read_u64).unwrap_or(0);
            json(StatusCode::OK, format!("{{\"payments\":{count}}}"))
        }
        Err(failure) => storage_failure(&failure),
    }
}

/// The delivery's idempotency key: the header's bytes, without the double quotes of the draft's
/// structured-field string form. Empty or overlong keys are left for `begin` to refuse.
fn idempotency_key(headers: &HeaderMap) -> Result<&[u8], &'static str> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Err("the Idempotency-Key header is required");
    };
    if values.next().is_some() {
        // Which one the client meant is a guess; guessing wrong would replay another payment.
        return Err("send exactly one Idempotency-Key header");
    }
    let raw = value.as_bytes();
    Ok(match raw {
        [b'"', inner @ .., b'"'] => inner,
        _ => raw,
    })
}
