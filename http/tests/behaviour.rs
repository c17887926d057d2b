//! The layer's behaviour, row by row of the crate docs' table: an axum router behind the layer,
//! served on 127.0.0.1, and hyper's HTTP/1 client, one connection per request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use idemdb::{BusinessTable, Engine, MockClock, TableOptions, merge_ops};
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal, StageError};
use tokio::sync::Notify;

/// The store, the handler's counters and the router under test.
struct App {
    dir: tempfile::TempDir,
    /// The engine and its table, dropped together to close the store.
    store: Option<(Engine, BusinessTable)>,
    clock: MockClock,
    state: Arc<State>,
    server: Option<Server>,
}

/// The router served on a port of 127.0.0.1 the system chose.
struct Server {
    address: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    fn start(router: Router) -> Server {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let address = listener.local_addr().unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Server {
            address,
            stop,
            task,
        }
    }

    /// Stops serving and waits until the router (and the store handles it holds) is gone.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }
}

/// What the handler shares with the test.
#[derive(Default)]
struct State {
    /// Handler runs, counted as each starts.
    runs: AtomicUsize,
    /// A request with `x-wait` notifies `reached` once it staged its writes, then waits for
    /// `release`.
    reached: Notify,
    release: Notify,
    /// The handle of the last request, kept past its handler's return.
    kept: parking_lot::Mutex<Option<IdempotentRequest>>,
}

const START_MS: u64 = 1_700_000_000_000;

fn open(dir: &std::path::Path, clock: &MockClock) -> Engine {
    Engine::builder(dir)
        .clock(clock.clone())
        .retention(Duration::from_secs(3600))
        .business_table(TableOptions::new("payments"))
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()
        .unwrap()
}

fn tenant(request: &axum::http::request::Parts) -> Option<Principal> {
    Principal::new(request.headers.get("x-tenant")?.as_bytes()).ok()
}

impl App {
    fn new(configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> App {
        let dir = tempfile::tempdir().unwrap();
        let clock = MockClock::new(START_MS);
        let engine = open(dir.path(), &clock);
        let state = Arc::new(State::default());
        let server = Some(Server::start(router(&engine, &state, configure)));
        let payments = engine.business_table("payments").unwrap();
        App {
            dir,
            store: Some((engine, payments)),
            clock,
            state,
            server,
        }
    }

    fn payments(&self) -> &BusinessTable {
        &self.store.as_ref().unwrap().1
    }

    fn runs(&self) -> usize {
        self.state.runs.load(Ordering::SeqCst)
    }

    /// Whether run `run`'s staged row is in the table.
    fn row_of_run(&self, run: usize) -> bool {
        self.payments().get(format!("run-{run}")).unwrap().is_some()
    }

    async fn send(&self, request: Request<Body>) -> Reply {
        self.try_send(request)
            .await
            .expect("the server closed the connection")
    }

    /// Sends `request` on a new connection: `None` if the server closed it without an answer.
    async fn try_send(&self, request: Request<Body>) -> Option<Reply> {
        let address = self.server.as_ref().unwrap().address;
        let (mut parts, body) = request.into_parts();
        parts
            .headers
            .insert("host", HeaderValue::from_static("localhost"));
        let body = body.collect().await.unwrap().to_bytes();
        let stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        let request = Request::from_parts(parts, http_body_util::Full::new(body));
        let response = sender.send_request(request).await.ok()?;
        let (parts, body) = response.into_parts();
        Some(Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.ok()?.to_bytes(),
        })
    }

    /// Stops the server, closes the store, opens it again and serves it behind a new router.
    async fn reopen(&mut self, configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) {
        self.server.take().unwrap().stop().await;
        drop(self.store.take());
        let engine = open(self.dir.path(), &self.clock);
        self.server = Some(Server::start(router(&engine, &self.state, configure)));
        let payments = engine.business_table("payments").unwrap();
        self.store = Some((engine, payments));
    }
}

fn router(
    engine: &Engine,
    state: &Arc<State>,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Router {
    let layer = configure(IdempotencyLayer::new(
        engine.consumer("payments").unwrap(),
        tenant,
    ));
    let tables = Tables {
        payments: engine.business_table("payments").unwrap(),
        effects: engine.business_table("effects").unwrap(),
    };
    let state = state.clone();
    let handler =
        move |request: Option<Extension<IdempotentRequest>>, headers: HeaderMap, body: Bytes| {
            let (tables, state) = (tables.clone(), state.clone());
            async move { handle(&tables, &state, request.map(|e| e.0), &headers, &body).await }
        };
    Router::new()
        .route("/payments", post(handler.clone()))
        .route("/refunds", post(handler))
        .layer(layer)
}

/// The tables the handler writes.
#[derive(Clone)]
struct Tables {
    /// A row per run (`run-N`), with the request's body.
    payments: BusinessTable,
    /// A count per idempotency key, merged once per run.
    effects: BusinessTable,
}

/// The handler: stages a row for its run and one more effect on its key, and answers as the
/// request's `x-` headers say.
async fn handle(
    tables: &Tables,
    state: &State,
    request: Option<IdempotentRequest>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    let run = state.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let Some(request) = request else {
        return (StatusCode::OK, format!("run {run} without a key")).into_response();
    };
    request
        .put(&tables.payments, format!("run-{run}"), body)
        .unwrap();
    let key = headers.get("idempotency-key").unwrap().as_bytes();
    request
        .merge(&tables.effects, key, 1u64.to_be_bytes())
        .unwrap();
    if let Some(ms) = headers.get("x-sleep-ms") {
        let ms = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    *state.kept.lock() = Some(request.clone());
    if headers.contains_key("x-wait") {
        state.reached.notify_one();
        state.release.notified().await;
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panicked, as the test asked");
    }
    let status = headers
        .get("x-status")
        .map_or(StatusCode::CREATED, |status| {
            StatusCode::from_bytes(status.as_bytes()).unwrap()
        });
    let padding = headers
        .get("x-body-bytes")
        .map_or(0, |n| n.to_str().unwrap().parse::<usize>().unwrap());
    let id = request.derive_key("payment").unwrap();
    let body = format!(
        "{{\"run\":{run},\"id\":\"{id}\",\"epoch\":{},\"padding\":\"{}\"}}",
        request.epoch().unwrap(),
        "x".repeat(padding)
    );
    (
        status,
        [
            ("content-type", "application/json"),
            ("location", "/payments/7"),
            ("x-not-kept", "1"),
        ],
        body,
    )
        .into_response()
}

/// A response, read whole.
#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed") == Some(&HeaderValue::from_static("true"))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl App {
    /// How many times the handler's effect on `key` was committed.
    fn effects_of(&self, key: &str) -> u64 {
        let (engine, _) = self.store.as_ref().unwrap();
        let effects = engine.business_table("effects").unwrap();
        effects
            .get(key)
            .unwrap()
            .as_deref()
            .and_then(merge_ops::read_u64)
            .unwrap_or(0)
    }
}

/// A POST to `path` with `body`, tenant `acme`, key `key`, and `extra` headers.
fn post_to(path: &str, key: Option<&str>, body: &str, extra: &[(&str, &str)]) -> Request<Body> {
    let mut builder = Request::post(path).header("x-tenant", "acme");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    for (name, value) in extra {
        builder = builder.header(*name, *value);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

fn pay(key: &str, extra: &[(&str, &str)]) -> Request<Body> {
    post_to("/payments", Some(key), "{\"amount\":100}", extra)
}

#[tokio::test]
async fn a_retry_replays_the_stored_response_byte_for_byte_and_the_handler_runs_once() {
    let app = App::new(|layer| layer);
    let first = app.send(pay("k1", &[])).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert!(!first.replayed());
    assert_eq!(first.headers["x-not-kept"], "1");
    assert!(
        app.row_of_run(1),
        "the handler's write committed with the response"
    );
    for _ in 0..3 {
        let retry = app.send(pay("k1", &[])).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.headers["content-type"], "application/json");
        assert_eq!(retry.headers["location"], "/payments/7");
        assert!(!retry.headers.contains_key("x-not-kept"));
    }
    assert_eq!(app.runs(), 1);
    // The draft's string form names the same key.
    let quoted = app.send(pay("\"k1\"", &[])).await;
    assert!(quoted.replayed());
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_key_reused_for_another_body_or_path_is_422_and_runs_nothing() {
    let app = App::new(|layer| layer);
    assert_eq!(app.send(pay("k1", &[])).await.status, StatusCode::CREATED);
    let other_body = app
        .send(post_to("/payments", Some("k1"), "{\"amount\":999}", &[]))
        .await;
    assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other_body.headers["content-type"],
        "application/problem+json"
    );
    let other_path = app
        .send(post_to("/refunds", Some("k1"), "{\"amount\":100}", &[]))
        .await;
    assert_eq!(other_path.status, StatusCode::UNPROCESSABLE_ENTITY);
    let other_query = app
        .send(post_to(
            "/payments?x=1",
            Some("k1"),
            "{\"amount\":100}",
            &[],
        ))
        .await;
    assert_eq!(other_query.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_retry_while_the_first_is_in_flight_is_409_with_retry_after() {
    let app = Arc::new(App::new(|layer| layer.retry_after(Duration::from_secs(3))));
    let first = spawn_send(&app, pay("k1", &[("x-wait", "1")]));
    app.state.reached.notified().await;
    let during = app.send(pay("k1", &[])).await;
    assert_eq!(during.status, StatusCode::CONFLICT);
    assert_eq!(during.headers["retry-after"], "3");
    app.state.release.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let after = app.send(pay("k1", &[])).await;
    assert!(after.replayed());
    assert_eq!(after.body, first.body);
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn keys_missing_repeated_empty_or_too_long_are_400_and_optional_keys_pass_through() {
    let app = App::new(|layer| layer);
    let missing = app.send(post_to("/payments", None, "{}", &[])).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert!(missing.text().contains("required"), "{}", missing.text());
    let twice = Request::post("/payments")
        .header("x-tenant", "acme")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(app.send(twice).await.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        app.send(pay("\"\"", &[])).await.status,
        StatusCode::BAD_REQUEST
    );
    let long = "k".repeat(idemdb_http::KEY_BYTES_MAX + 1);
    assert_eq!(
        app.send(pay(&long, &[])).await.status,
        StatusCode::BAD_REQUEST
    );
    let longest = "k".repeat(idemdb_http::KEY_BYTES_MAX);
    assert_eq!(
        app.send(pay(&longest, &[])).await.status,
        StatusCode::CREATED
    );
    assert_eq!(app.runs(), 1);

    let optional = App::new(IdempotencyLayer::key_optional);
    for run in 1..=2 {
        let reply = optional.send(post_to("/payments", None, "{}", &[])).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.text(), format!("run {run} without a key"));
    }
    // A key on an optional route is still honoured.
    assert_eq!(
        optional.send(pay("k1", &[])).await.status,
        StatusCode::CREATED
    );
    assert!(optional.send(pay("k1", &[])).await.replayed());
}

#[tokio::test]
async fn a_request_without_a_principal_is_401_and_principals_never_share_a_key() {
    let app = App::new(|layer| layer);
    let anonymous = Request::post("/payments")
        .header("idempotency-key", "k1")
        .body(Body::from("{\"amount\":100}"))
        .unwrap();
    assert_eq!(app.send(anonymous).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(app.runs(), 0);

    let acme = app.send(pay("k1", &[])).await;
    let globex = Request::post("/payments")
        .header("x-tenant", "globex")
        .header("idempotency-key", "k1")
        .body(Body::from("{\"amount\":100}"))
        .unwrap();
    let globex = app.send(globex).await;
    assert_eq!(globex.status, StatusCode::CREATED);
    assert!(!globex.replayed(), "another tenant's response was replayed");
    assert_ne!(globex.body, acme.body);
    assert_eq!(app.runs(), 2);
    let acme_again = app.send(pay("k1", &[])).await;
    assert_eq!(acme_again.body, acme.body);
}

#[tokio::test]
async fn a_5xx_or_an_unstored_4xx_stores_nothing_and_frees_the_key() {
    let app = App::new(|layer| layer);
    let failed = app.send(pay("k1", &[("x-status", "500")])).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!app.row_of_run(1), "a 5xx's writes were committed");
    let rejected = app.send(pay("k1", &[("x-status", "400")])).await;
    assert_eq!(rejected.status, StatusCode::BAD_REQUEST);
    assert!(!app.row_of_run(2));
    let retry = app.send(pay("k1", &[])).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert!(app.row_of_run(3));
    assert_eq!(app.runs(), 3);
}

#[tokio::test]
async fn a_4xx_chosen_for_storing_is_stored_with_its_writes_and_a_5xx_never_is() {
    let app = App::new(|layer| layer.store_when(|status| status.is_client_error()));
    let declined = app.send(pay("k1", &[("x-status", "402")])).await;
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    assert!(app.row_of_run(1));
    let retry = app.send(pay("k1", &[])).await;
    assert_eq!(retry.status, StatusCode::PAYMENT_REQUIRED);
    assert!(retry.replayed());
    // The predicate says no to 2xx here: a 201 goes out unstored.
    assert_eq!(app.send(pay("k2", &[])).await.status, StatusCode::CREATED);
    assert!(!app.send(pay("k2", &[])).await.replayed());

    let always = App::new(|layer| layer.store_when(|_| true));
    let failed = always.send(pay("k1", &[("x-status", "503")])).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!always.row_of_run(1));
    assert!(!always.send(pay("k1", &[])).await.replayed());
}

/// Sends `request` on a task of its own.
fn spawn_send(app: &Arc<App>, request: Request<Body>) -> tokio::task::JoinHandle<Reply> {
    let app = app.clone();
    tokio::spawn(async move { app.send(request).await })
}

/// Sends `key` with `x-wait` and, once its handler waits at the gate, drops it: the client goes
/// away, its connection closes, and the server drops the request's future.
async fn drop_a_waiting_request(app: &Arc<App>, key: &str) {
    let request = spawn_send(app, pay(key, &[("x-wait", "1")]));
    app.state.reached.notified().await;
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
}

/// Sends `request` until the answer is not `409`: the server drops a request's future once it
/// sees its connection closed, which it learns on its own time.
async fn send_until_not_in_progress(app: &App, request: impl Fn() -> Request<Body>) -> Reply {
    for _ in 0..500 {
        let reply = app.send(request()).await;
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the key stayed in progress for 5 s after its request was dropped");
}

#[tokio::test]
async fn a_dropped_request_stores_nothing_and_frees_the_key() {
    let app = Arc::new(App::new(|layer| layer));
    drop_a_waiting_request(&app, "k1").await;
    let retry = send_until_not_in_progress(&app, || pay("k1", &[])).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert!(
        !app.row_of_run(1),
        "the dropped request's write was committed"
    );
    assert!(app.row_of_run(2));
}

#[tokio::test]
async fn a_handler_that_panics_stores_nothing_and_frees_the_key() {
    let app = App::new(|layer| layer);
    // The connection's task unwinds: the client gets no answer.
    assert!(app.try_send(pay("k1", &[("x-panic", "1")])).await.is_none());
    let retry = send_until_not_in_progress(&app, || pay("k1", &[])).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!app.row_of_run(1));
    assert!(app.row_of_run(2));
}

#[tokio::test]
async fn bodies_over_the_limits_are_refused_and_nothing_is_stored() {
    let app = App::new(|layer| layer.request_body_limit(8).response_body_limit(200));
    let large = app
        .send(post_to("/payments", Some("k1"), "123456789", &[]))
        .await;
    assert_eq!(large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(app.runs(), 0);

    let too_large = app
        .send(post_to(
            "/payments",
            Some("k2"),
            "{}",
            &[("x-body-bytes", "300")],
        ))
        .await;
    assert_eq!(too_large.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        too_large.text().contains("over the limit"),
        "{}",
        too_large.text()
    );
    assert!(
        !app.row_of_run(1),
        "the writes of an unstorable response were committed"
    );
    let retry = app.send(post_to("/payments", Some("k2"), "{}", &[])).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert!(app.row_of_run(2));
}

#[tokio::test]
async fn a_stored_response_outlives_a_reopen_and_expires_exactly_at_the_retention() {
    let mut app = App::new(|layer| layer);
    let first = app.send(pay("k1", &[])).await;
    app.reopen(|layer| layer).await;
    let after_reopen = app.send(pay("k1", &[])).await;
    assert!(after_reopen.replayed());
    assert_eq!(after_reopen.body, first.body);
    // The engine's retention is an hour: the last millisecond replays, the next runs afresh.
    app.clock.advance(Duration::from_millis(3_600_000 - 1));
    assert!(app.send(pay("k1", &[])).await.replayed());
    app.clock.advance(Duration::from_millis(1));
    let expired = app.send(pay("k1", &[])).await;
    assert_eq!(expired.status, StatusCode::CREATED);
    assert!(!expired.replayed());
    assert_eq!(app.runs(), 2);
}

#[tokio::test]
async fn a_handle_kept_past_its_handler_stages_nothing() {
    let app = App::new(|layer| layer);
    assert_eq!(app.send(pay("k1", &[])).await.status, StatusCode::CREATED);
    let kept = app.state.kept.lock().take().unwrap();
    assert!(matches!(
        kept.put(app.payments(), "late", "write"),
        Err(StageError::ClaimGone)
    ));
    assert!(app.payments().get("late").unwrap().is_none());
    assert!(matches!(
        kept.renew(Duration::from_secs(1)),
        Err(StageError::ClaimGone)
    ));
}

#[tokio::test]
async fn on_the_lease_path_a_handler_that_outlives_its_lease_cannot_store_its_response() {
    let app = Arc::new(App::new(|layer| {
        layer.with_lease(Duration::from_secs(30), "host-a")
    }));
    let slow = spawn_send(&app, pay("k1", &[("x-wait", "1")]));
    app.state.reached.notified().await;
    assert_eq!(app.send(pay("k1", &[])).await.status, StatusCode::CONFLICT);
    // The lease runs out: a retry takes the key over under a new epoch and completes.
    app.clock.advance(Duration::from_secs(31));
    let takeover = app.send(pay("k1", &[])).await;
    assert_eq!(takeover.status, StatusCode::CREATED, "{}", takeover.text());
    assert!(
        takeover.text().contains("\"epoch\":2"),
        "{}",
        takeover.text()
    );
    // The slow request finishes: fenced off, it stores nothing.
    app.state.release.notify_one();
    let slow = slow.await.unwrap();
    assert_eq!(
        slow.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        slow.text()
    );
    assert!(slow.headers.contains_key("retry-after"));
    assert!(
        !app.row_of_run(1),
        "the fenced request's write was committed"
    );
    assert!(app.row_of_run(2));
    let retry = app.send(pay("k1", &[])).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, takeover.body);
}

#[tokio::test]
async fn on_the_lease_path_a_5xx_or_a_dropped_request_releases_the_lease() {
    let app = Arc::new(App::new(|layer| {
        layer.with_lease(Duration::from_secs(3600), "host-a")
    }));
    assert_eq!(
        app.send(pay("k1", &[("x-status", "502")])).await.status,
        StatusCode::BAD_GATEWAY
    );
    let retry = app.send(pay("k1", &[])).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!app.row_of_run(1));

    drop_a_waiting_request(&app, "k2").await;
    // The release runs on a blocking thread once the server dropped the request's future: the
    // key is free once it has (no clock moves).
    let after = send_until_not_in_progress(&app, || pay("k2", &[])).await;
    assert_eq!(after.status, StatusCode::CREATED, "{}", after.text());
    assert!(
        !app.row_of_run(3),
        "the dropped request's write was committed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_clients_racing_on_the_same_keys_get_one_effect_per_key_and_one_answer() {
    const KEYS: usize = 16;
    const CLIENTS_PER_KEY: usize = 24;
    let app = Arc::new(App::new(|layer| layer));
    let mut clients = Vec::new();
    for key in 0..KEYS {
        for client in 0..CLIENTS_PER_KEY {
            // One client in four reuses the key for another payment.
            let payload = if client % 4 == 3 { "other" } else { "same" };
            let app = app.clone();
            clients.push(tokio::spawn(async move {
                let key = format!("key-{key}");
                let request = || {
                    post_to(
                        "/payments",
                        Some(&key),
                        &format!("{{\"payload\":\"{payload}\"}}"),
                        &[("x-sleep-ms", "2")],
                    )
                };
                // A client retries a 409 as the draft asks, and keeps the first other answer.
                for _ in 0..2_000 {
                    let reply = app.send(request()).await;
                    if reply.status != StatusCode::CONFLICT {
                        return (key, payload, reply);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                panic!("{key}: still 409 after 2000 tries");
            }));
        }
    }
    let mut replies: std::collections::HashMap<String, Vec<(&str, Reply)>> = Default::default();
    for client in clients {
        let (key, payload, reply) = client.await.unwrap();
        replies.entry(key).or_default().push((payload, reply));
    }
    assert_eq!(app.runs(), KEYS, "the handler ran more than once for a key");
    for (key, replies) in &replies {
        assert_eq!(app.effects_of(key), 1, "{key}: effects committed");
        let firsts: Vec<_> = replies
            .iter()
            .filter(|(_, reply)| reply.status == StatusCode::CREATED && !reply.replayed())
            .collect();
        assert_eq!(firsts.len(), 1, "{key}: one request ran the handler");
        let (winner, first) = firsts[0];
        for (payload, reply) in replies {
            if payload == winner {
                assert_eq!(reply.status, StatusCode::CREATED, "{key}: {}", reply.text());
                assert_eq!(reply.body, first.body, "{key}: another response replayed");
            } else {
                assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{key}");
            }
        }
    }
}
