//! An HTTP webhook receiver that deduplicates deliveries by their `Idempotency-Key` header.
//!
//! `POST /payments` takes a payment (any body: JSON or plain text) and an `Idempotency-Key`
//! header. The first delivery of a key is processed: a row in the `payments` table and one more
//! on the `totals` counter, staged on an idemdb claim and committed in one write batch together
//! with the response (status and body) as the claim's result. Every later delivery of the key
//! gets an answer without a second effect:
//!
//! | delivery | answer |
//! |---|---|
//! | first (the key is new) | `201 Created`, processed; the response is stored |
//! | retry, same body, after the first completed | the stored status and body, plus `Idempotent-Replayed: true` |
//! | same key, different body | `422 Unprocessable Content` (RFC 9110's name for hyper's "Unprocessable Entity"): the key was reused for another payload |
//! | retry while the first is still being processed | `409 Conflict` with `Retry-After: 1` |
//! | no `Idempotency-Key`, an empty one, one over 1024 bytes, or two of them | `400 Bad Request` |
//! | the store fails | `503 Service Unavailable` (`500` for a corrupt record); nothing is stored |
//!
//! The status codes are the ones the IETF httpapi draft "The Idempotency-Key HTTP Header Field"
//! (draft-ietf-httpapi-idempotency-key-header) chose: 400 for a missing key, 422 for a key
//! reused with a different payload, 409 for a request made while the first with the same key is
//! still being processed. The key may be sent as the draft's structured-field string
//! (`Idempotency-Key: "8e03978e"`) or bare (`Idempotency-Key: 8e03978e`); both name the same key.
//! `GET /payments/count` reads the counter, to see that retries had no effect.
//!
//! ```text
//! source scripts/setup.sh && cargo run --release --features tokio --example webhook -- [--port N] [--dir PATH]
//! ```
//!
//! It listens on 127.0.0.1 only (default port 18080) and keeps its store in `--dir` (default
//! `idemdb-webhook` in the system's temporary directory), so a restart still replays.
//!
//! How the answers come about, and what to keep when adapting this:
//!
//! - **In progress is the claim's latch.** The handler holds its [`idemdb::Claim`] across the
//!   `.await`s of processing; while it does, the key is latched in this process and every other
//!   `begin` of it is `InProgress` (a 409). The latch is in memory, and one process owns a store
//!   (a second open is `AlreadyOpen`): run one receiver per store, and shard keys across
//!   receivers if one is not enough.
//! - **Cancellation writes nothing.** If the handler's future is dropped before it commits (the
//!   client disconnects, and hyper drops the request's future), the claim is dropped with it: no
//!   staged write lands and the key is free again, so the client's retry is processed afresh.
//!   Once `commit_async` has been called the commit goes ahead without the handler; a retry then
//!   replays its response.
//! - **Only successes are stored.** A failure (a storage error, a 5xx) drops the claim, so a
//!   retry with the same key runs again, which is what a client retrying a 5xx expects. Store a
//!   final 4xx the same way as the 201 if the business logic can reject a payment for good.
//! - **The commit does not block the runtime.** [`idemdb::Claim::commit_async`] hands the write
//!   batch (and its fsync) to the engine's committer thread, which writes concurrent commits as
//!   one group. `begin` runs inline: it is a point read, without a write or an fsync.
//! - **Scope of a key.** One consumer (`webhook`) holds the keys of the one endpoint, and the
//!   fingerprint covers the body only (the method and path are fixed). A service with several
//!   endpoints uses a consumer per endpoint; one with several clients puts the authenticated
//!   client's id in front of the key, or one client could replay another's response.
//! - **Expiry.** Keys are remembered for [`RETENTION`]; a retry after that is processed again.
//!   Publish it to clients, as the draft asks.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idemdb::{
    BusinessTable, Claim, Consumer, Engine, Error, Fingerprint, MESSAGE_KEY_BYTES_MAX, Outcome,
    StorageErrorKind, TableOptions, merge_ops,
};
use tokio::net::TcpListener;
use tokio::sync::Notify;

/// The consumer under which the endpoint's idempotency keys are recorded.
const CONSUMER_ID: &str = "webhook";
/// The port used without `--port`: not a common default, so it rarely collides.
const PORT_DEFAULT: u16 = 18080;
/// How long a key is remembered. Longer than any client keeps retrying a delivery.
const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// The business table of payments, keyed by payment id.
const PAYMENTS_TABLE: &str = "payments";
/// The business table of counters (`add_u64` merge operator).
const TOTALS_TABLE: &str = "totals";
/// The counter of processed payments in [`TOTALS_TABLE`].
const PAYMENTS_COUNTER: &[u8] = b"payments";
/// The request header naming the delivery (draft-ietf-httpapi-idempotency-key-header).
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header marking a replayed response.
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Seconds a client should wait before retrying a 409 or a retryable 503.
const RETRY_AFTER_S: HeaderValue = HeaderValue::from_static("1");
// The 400 answer to an overlong key quotes the limit as a constant string.
const _: () = assert!(MESSAGE_KEY_BYTES_MAX == 1024);
/// First byte of a stored response: its encoding, so a later version of this service can read
/// the responses stored by this one (they live for [`RETENTION`]).
const STORED_RESPONSE_V1: u8 = 1;

/// Opens (or creates) the store with the tables the webhook writes.
fn open_engine(dir: &Path) -> idemdb::Result<Engine> {
    Engine::builder(dir)
        .retention(RETENTION)
        .business_table(TableOptions::new(PAYMENTS_TABLE))
        .business_table(
            TableOptions::new(TOTALS_TABLE)
                .associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()
}

/// A hook that holds every fresh request between taking its claim and processing it, until
/// released: the tests use it to have a retry arrive while the first delivery is in progress,
/// without sleeping. [`router`] takes `None` in production.
#[derive(Debug, Default)]
struct ProcessingGate {
    /// Notified when a fresh request holds its claim and waits at the gate.
    reached: Notify,
    /// Each permit lets one waiting request go on to processing.
    release: Notify,
}

/// What every handler needs; cheap to clone (handles are `Arc`s).
#[derive(Clone)]
struct AppState {
    consumer: Consumer,
    payments: BusinessTable,
    totals: BusinessTable,
    gate: Option<Arc<ProcessingGate>>,
}

/// The webhook's routes over `engine`, which must have been opened by [`open_engine`].
fn router(engine: &Engine, gate: Option<Arc<ProcessingGate>>) -> idemdb::Result<Router> {
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

/// `POST /payments`: processes a delivery once per idempotency key; see the file's header.
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

/// A response as stored in the claim's result: replayed byte for byte to every retry.
#[derive(Debug, PartialEq, Eq)]
struct StoredResponse {
    status: StatusCode,
    /// JSON, like every body this service sends.
    body: Bytes,
}

impl StoredResponse {
    /// `[STORED_RESPONSE_V1][status: u16 big-endian][body]`.
    fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(3 + self.body.len());
        bytes.push(STORED_RESPONSE_V1);
        bytes.extend_from_slice(&self.status.as_u16().to_be_bytes());
        bytes.extend_from_slice(&self.body);
        bytes
    }

    /// `None` for bytes that [`StoredResponse::encode`] did not produce.
    fn decode(bytes: &Bytes) -> Option<StoredResponse> {
        let (&[version, high, low], _) = bytes.split_first_chunk::<3>()?;
        if version != STORED_RESPONSE_V1 {
            return None;
        }
        Some(StoredResponse {
            status: StatusCode::from_u16(u16::from_be_bytes([high, low])).ok()?,
            body: bytes.slice(3..),
        })
    }

    fn into_response(self, replayed: bool) -> Response {
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
fn storage_failure(failure: &Error) -> Response {
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
fn error(status: StatusCode, message: &'static str) -> Response {
    json(status, format!("{{\"error\":\"{message}\"}}"))
}

fn json(status: StatusCode, body: impl Into<Bytes>) -> Response {
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body.into(),
    )
        .into_response()
}

struct Args {
    port: u16,
    dir: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        port: PORT_DEFAULT,
        dir: std::env::temp_dir().join("idemdb-webhook"),
    };
    let mut words = std::env::args().skip(1);
    while let Some(flag) = words.next() {
        let mut value = || words.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--port" => args.port = value()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--dir" => args.dir = PathBuf::from(value()?),
            other => return Err(format!("unknown argument {other} (--port N, --dir PATH)")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("webhook: {message}");
            return ExitCode::from(2);
        }
    };
    let engine = match open_engine(&args.dir) {
        Ok(engine) => engine,
        Err(failure) => {
            eprintln!(
                "webhook: cannot open the store at {:?}: {failure}",
                args.dir
            );
            return ExitCode::FAILURE;
        }
    };
    let app = match router(&engine, None) {
        Ok(app) => app,
        Err(failure) => {
            eprintln!("webhook: {failure}");
            return ExitCode::FAILURE;
        }
    };
    // Loopback only: this is an example, not a hardened public endpoint (no TLS, no auth).
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, args.port));
    let listener = match TcpListener::bind(address).await {
        Ok(listener) => listener,
        Err(failure) => {
            eprintln!("webhook: cannot listen on {address}: {failure}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "webhook: POST http://{address}/payments with an Idempotency-Key header \
         (store {:?}, keys kept {} h); Ctrl-C or SIGTERM stops",
        args.dir,
        RETENTION.as_secs() / 3600
    );
    // Graceful: requests in flight finish (and commit) before the store is closed.
    if let Err(failure) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
    {
        eprintln!("webhook: server failed: {failure}");
        return ExitCode::FAILURE;
    }
    println!("webhook: stopped");
    ExitCode::SUCCESS
}

/// Resolves on Ctrl-C, or on SIGTERM (what service managers and container runtimes send).
/// A signal whose handler cannot be installed never fires.
async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                terminate.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    //! Drives the webhook over loopback TCP with a minimal HTTP/1.1 client and checks each
    //! answer of the file's header, and that each delivery's effect was applied at most once.

    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::oneshot;
    use tokio::task::JoinHandle;

    /// A server on an ephemeral loopback port.
    struct Server {
        address: SocketAddr,
        stop: oneshot::Sender<()>,
        task: JoinHandle<std::io::Result<()>>,
    }

    impl Server {
        async fn start(engine: &Engine, gate: Option<Arc<ProcessingGate>>) -> Server {
            let app = router(engine, gate).expect("router");
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .await
                .expect("bind");
            let address = listener.local_addr().expect("local address");
            let (stop, stopped) = oneshot::channel::<()>();
            let task = tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await
            });
            Server {
                address,
                stop,
                task,
            }
        }

        /// Stops serving and waits until the router (and its engine handles) is dropped.
        async fn stop(self) {
            let _ = self.stop.send(());
            self.task.await.expect("server task").expect("server");
        }
    }

    /// An HTTP response, as the test client read it.
    #[derive(Debug)]
    struct Reply {
        status: u16,
        /// Header names in lower case.
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(candidate, _)| candidate == name)
                .map(|(_, value)| value.as_str())
        }

        fn replayed(&self) -> bool {
            self.header("idempotent-replayed") == Some("true")
        }
    }

    /// A `POST /payments` request with `keys` as its `Idempotency-Key` headers.
    fn payment_request(keys: &[&str], body: &str) -> Vec<u8> {
        let mut request = format!(
            "POST /payments HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for key in keys {
            request.push_str(&format!("Idempotency-Key: {key}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
        request.into_bytes()
    }

    /// Sends one request on a new connection and reads the response until the server closes
    /// the connection (`Connection: close`).
    async fn send(address: SocketAddr, request: &[u8]) -> Reply {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        stream.write_all(request).await.expect("write request");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read response");
        parse_reply(&raw)
    }

    fn parse_reply(raw: &[u8]) -> Reply {
        let text = std::str::from_utf8(raw).expect("UTF-8 response");
        let (head, body) = text.split_once("\r\n\r\n").expect("response head");
        let mut lines = head.split("\r\n");
        let status_line = lines.next().expect("status line");
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let headers: Vec<(String, String)> = lines
            .map(|line| {
                let (name, value) = line.split_once(':').expect("header line");
                (name.to_ascii_lowercase(), value.trim().to_owned())
            })
            .collect();
        let reply = Reply {
            status,
            headers,
            body: body.to_owned(),
        };
        // The body is read to the end of the connection; a chunked body would need decoding.
        assert_eq!(reply.header("transfer-encoding"), None, "{reply:?}");
        reply
    }

    async fn post(address: SocketAddr, key: &str, body: &str) -> Reply {
        send(address, &payment_request(&[key], body)).await
    }

    /// The effect count: payments processed, read from the store itself.
    fn payments_processed(engine: &Engine) -> u64 {
        let totals = engine.business_table(TOTALS_TABLE).expect("totals table");
        let value = totals.get(PAYMENTS_COUNTER).expect("read the counter");
        value.as_deref().and_then(merge_ops::read_u64).unwrap_or(0)
    }

    const PAYMENT: &str = r#"{"amount":1250,"currency":"EUR","to":"acct-17"}"#;

    #[tokio::test]
    async fn first_delivery_is_processed_and_retries_replay_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let engine = open_engine(dir.path()).expect("open");
        let server = Server::start(&engine, None).await;

        let first = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(first.status, 201, "{first:?}");
        assert!(!first.replayed(), "{first:?}");
        assert!(first.body.contains("\"payment_id\":\"idk1-"), "{first:?}");

        // The quoted (structured-field) form names the same key.
        for key in ["delivery-1", "\"delivery-1\""] {
            let retry = post(server.address, key, PAYMENT).await;
            assert_eq!(retry.status, first.status, "{retry:?}");
            assert_eq!(retry.body, first.body);
            assert!(retry.replayed(), "{retry:?}");
        }
        assert_eq!(payments_processed(&engine), 1);

        let count = send(
            server.address,
            b"GET /payments/count HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(count.status, 200, "{count:?}");
        assert_eq!(count.body, r#"{"payments":1}"#);

        // Another key is another payment.
        let second = post(server.address, "delivery-2", PAYMENT).await;
        assert_eq!(second.status, 201, "{second:?}");
        assert!(!second.replayed());
        assert_ne!(second.body, first.body);
        assert_eq!(payments_processed(&engine), 2);
        server.stop().await;
    }

    #[tokio::test]
    async fn same_key_with_another_body_is_422_without_effect() {
        let dir = tempfile::tempdir().expect("temp dir");
        let engine = open_engine(dir.path()).expect("open");
        let server = Server::start(&engine, None).await;

        let first = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(first.status, 201, "{first:?}");
        let other = post(server.address, "delivery-1", r#"{"amount":9999}"#).await;
        assert_eq!(other.status, 422, "{other:?}");
        assert!(!other.replayed());
        assert!(other.body.contains("different request body"), "{other:?}");
        assert_eq!(payments_processed(&engine), 1);

        // The conflict changed nothing: the original body still replays.
        let retry = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        server.stop().await;
    }

    #[tokio::test]
    async fn retry_while_the_first_is_processed_is_409_then_replays() {
        let dir = tempfile::tempdir().expect("temp dir");
        let engine = open_engine(dir.path()).expect("open");
        let gate = Arc::new(ProcessingGate::default());
        let server = Server::start(&engine, Some(gate.clone())).await;
        let address = server.address;

        let first = tokio::spawn(async move { post(address, "delivery-1", PAYMENT).await });
        // The first request now holds its claim and waits at the gate.
        gate.reached.notified().await;
        for body in [PAYMENT, r#"{"amount":9999}"#] {
            // The latch cannot tell a retry from a conflicting reuse until the first completes.
            // A retry that got through to processing would wait at the gate: fail, not hang.
            let busy = tokio::select! {
                busy = post(address, "delivery-1", body) => busy,
                () = gate.reached.notified() => panic!("a retry was processed during the first"),
            };
            assert_eq!(busy.status, 409, "{busy:?}");
            assert_eq!(busy.header("retry-after"), Some("1"), "{busy:?}");
            assert!(!busy.replayed());
        }
        assert_eq!(payments_processed(&engine), 0);

        gate.release.notify_one();
        let first = first.await.expect("first request");
        assert_eq!(first.status, 201, "{first:?}");
        assert!(!first.replayed());

        // Replays do not reach the gate: nothing is processed for them.
        let retry = post(address, "delivery-1", PAYMENT).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        assert_eq!(payments_processed(&engine), 1);
        server.stop().await;
    }

    #[tokio::test]
    async fn client_gone_during_processing_writes_nothing_and_frees_the_key() {
        let dir = tempfile::tempdir().expect("temp dir");
        let engine = open_engine(dir.path()).expect("open");
        let gate = Arc::new(ProcessingGate::default());
        let server = Server::start(&engine, Some(gate.clone())).await;

        let mut stream = TcpStream::connect(server.address).await.expect("connect");
        stream
            .write_all(&payment_request(&["delivery-1"], PAYMENT))
            .await
            .expect("write request");
        gate.reached.notified().await;
        assert_eq!(engine.open_claims(), 1);
        // The client gives up: hyper sees the connection close and drops the handler's future,
        // and with it the claim. There is no event to await for that, so yield to the server
        // until it happens (a hang here means the claim outlived its request).
        drop(stream);
        while engine.open_claims() != 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(payments_processed(&engine), 0);

        // The key is free: the retry is processed, not answered 409 or replayed.
        gate.release.notify_one();
        let retry = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert!(!retry.replayed(), "{retry:?}");
        assert_eq!(payments_processed(&engine), 1);
        server.stop().await;
    }

    #[tokio::test]
    async fn missing_or_unusable_key_is_400() {
        let dir = tempfile::tempdir().expect("temp dir");
        let engine = open_engine(dir.path()).expect("open");
        let server = Server::start(&engine, None).await;

        let too_long = "k".repeat(MESSAGE_KEY_BYTES_MAX + 1);
        let longest = "k".repeat(MESSAGE_KEY_BYTES_MAX);
        let cases: [(&[&str], &str); 4] = [
            (&[], "required"),
            (&["\"\""], "1 to 1024 bytes"),
            (&[too_long.as_str()], "1 to 1024 bytes"),
            (&["delivery-1", "delivery-2"], "exactly one"),
        ];
        for (keys, reason) in cases {
            let reply = send(server.address, &payment_request(keys, PAYMENT)).await;
            assert_eq!(reply.status, 400, "{keys:?}: {reply:?}");
            assert!(reply.body.contains(reason), "{keys:?}: {reply:?}");
        }
        assert_eq!(payments_processed(&engine), 0);

        // The server is still up, and the longest allowed key works.
        let reply = post(server.address, &longest, PAYMENT).await;
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(payments_processed(&engine), 1);
        server.stop().await;
    }

    #[tokio::test]
    async fn responses_replay_after_the_store_is_reopened() {
        let dir = tempfile::tempdir().expect("temp dir");
        let first = {
            let engine = open_engine(dir.path()).expect("open");
            let server = Server::start(&engine, None).await;
            let first = post(server.address, "delivery-1", PAYMENT).await;
            assert_eq!(first.status, 201, "{first:?}");
            server.stop().await;
            first
            // The engine is dropped here, closing the store.
        };

        let engine = open_engine(dir.path()).expect("reopen");
        let server = Server::start(&engine, None).await;
        let retry = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, first.body);
        let other = post(server.address, "delivery-1", r#"{"amount":9999}"#).await;
        assert_eq!(other.status, 422, "{other:?}");
        assert_eq!(payments_processed(&engine), 1);
        server.stop().await;
    }

    /// Makes every write fail while armed, as a failing disk would.
    #[derive(Clone, Debug, Default)]
    struct FailingWrites {
        armed: Arc<AtomicBool>,
    }

    impl idemdb::FaultInjector for FailingWrites {
        fn fault(&self, point: idemdb::IoPoint) -> idemdb::Fault {
            if point == idemdb::IoPoint::Write && self.armed.load(Ordering::SeqCst) {
                idemdb::Fault::FailBefore
            } else {
                idemdb::Fault::None
            }
        }
    }

    #[tokio::test]
    async fn failed_commit_stores_nothing_and_the_retry_is_processed() {
        let dir = tempfile::tempdir().expect("temp dir");
        {
            let faults = FailingWrites::default();
            let engine = Engine::builder(dir.path())
                .retention(RETENTION)
                .business_table(TableOptions::new(PAYMENTS_TABLE))
                .business_table(
                    TableOptions::new(TOTALS_TABLE)
                        .associative_merge_operator("add_u64", merge_ops::add_u64),
                )
                .fault_injector(faults.clone())
                .open()
                .expect("open");
            let server = Server::start(&engine, None).await;
            faults.armed.store(true, Ordering::SeqCst);
            let failed = post(server.address, "delivery-1", PAYMENT).await;
            assert_eq!(failed.status, 503, "{failed:?}");
            // The failed write poisoned the engine: the store refuses writes until reopened,
            // and the retry is refused too rather than replayed or half applied.
            faults.armed.store(false, Ordering::SeqCst);
            let refused = post(server.address, "delivery-1", PAYMENT).await;
            assert_eq!(refused.status, 503, "{refused:?}");
            assert_eq!(payments_processed(&engine), 0);
            server.stop().await;
        }

        let engine = open_engine(dir.path()).expect("reopen");
        let server = Server::start(&engine, None).await;
        let retry = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert!(
            !retry.replayed(),
            "nothing was stored for the failed attempt"
        );
        assert_eq!(payments_processed(&engine), 1);
        server.stop().await;
    }
}
