//! The endpoints: `POST /payments` behind `idemdb_http::IdempotencyLayer`, which claims each
//! delivery's idempotency key and stores the response with the payment; `GET /payments/count`
//! reads the counter.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header::CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use idemdb::{BusinessTable, Engine, merge_ops};
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal};
use tokio::sync::Notify;

use crate::{CONSUMER_ID, PAYMENTS_COUNTER, PAYMENTS_TABLE, SENDER, TOTALS_TABLE};

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
    payments: BusinessTable,
    totals: BusinessTable,
    gate: Option<Arc<ProcessingGate>>,
}

/// The webhook's routes over `engine`, which must have been opened by [`open_engine`](crate::open_engine).
pub(crate) fn router(engine: &Engine, gate: Option<Arc<ProcessingGate>>) -> idemdb::Result<Router> {
    let state = AppState {
        payments: engine.business_table(PAYMENTS_TABLE)?,
        totals: engine.business_table(TOTALS_TABLE)?,
        gate,
    };
    // One sender posts to this receiver (a payment provider, authenticated in front of it by
    // its signature): its keys need no scoping by caller, and the constant principal says so.
    // A service with several clients gives each its own principal.
    let sender = Principal::new(SENDER).expect("a constant principal of 1..=255 bytes");
    let idempotent =
        IdempotencyLayer::new(engine.consumer(CONSUMER_ID)?, move |_| Some(sender.clone()));
    Ok(Router::new()
        .route("/payments", post(create_payment).layer(idempotent))
        .route("/payments/count", get(payment_count))
        .with_state(state))
}

/// `POST /payments`: runs once per idempotency key (the layer answers retries); its writes are
/// staged on the request's claim and committed with the response.
async fn create_payment(
    State(state): State<AppState>,
    Extension(request): Extension<IdempotentRequest>,
    body: Bytes,
) -> Response {
    if let Some(gate) = &state.gate {
        gate.reached.notify_one();
        gate.release.notified().await;
    }
    // The same for every attempt at this key, also after a restart: had a commit failed after
    // a downstream call, the retry would make that call again under the same id.
    let staged = request.derive_key("payment").and_then(|payment_id| {
        request.put(&state.payments, &payment_id, &body)?;
        request.merge(&state.totals, PAYMENTS_COUNTER, 1u64.to_be_bytes())?;
        Ok(payment_id)
    });
    match staged {
        Ok(payment_id) => json(
            StatusCode::CREATED,
            format!("{{\"payment_id\":\"{payment_id}\",\"status\":\"accepted\"}}"),
        ),
        // A 5xx is never stored: the staged writes are dropped and a retry runs again.
        Err(failure) => {
            eprintln!("webhook: staging failed: {failure}");
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                "{\"error\":\"the payment could not be recorded; retry\"}",
            )
        }
    }
}

/// `GET /payments/count`: how many payments were processed (retries do not count).
async fn payment_count(State(state): State<AppState>) -> Response {
    match state.totals.get(PAYMENTS_COUNTER) {
        Ok(value) => {
            let count = value.as_deref().and_then(merge_ops::read_u64).unwrap_or(0);
            json(StatusCode::OK, format!("{{\"payments\":{count}}}"))
        }
        Err(failure) => {
            eprintln!("webhook: store failure: {failure}");
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                "{\"error\":\"the store is unavailable\"}",
            )
        }
    }
}

fn json(status: StatusCode, body: impl Into<Bytes>) -> Response {
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body.into(),
    )
        .into_response()
}
