//! The layer on the PostgreSQL backend, against a private server (started by the test; skipped
//! with a message where it cannot start): the behaviour table's rows, the handler's SQL
//! committed with the stored response, `409` between two stores on one database (as two
//! processes or hosts see each other: only through the database's locks), and the lease path
//! (an external claim per request, fenced at its completion), its time on a mock clock
//! injected into the store.

#[path = "../../postgres/tests/support/server.rs"]
#[allow(dead_code)]
mod server;

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::BodyExt;
use idemdb::MockClock;
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal, StageError};
use idemdb_postgres::{Names, PgStore, StoreBuilder, install};
use tokio::sync::Notify;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls};
use tower::ServiceExt;

type Failure = Box<dyn std::error::Error + Send + Sync>;

macro_rules! ensure {
    ($condition:expr, $($message:tt)*) => {
        if !$condition {
            return Err(format!($($message)*).into());
        }
    };
}

async fn connect(url: &str) -> Result<Client, Failure> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// What the handler shares with the test.
#[derive(Default)]
struct Gate {
    runs: AtomicUsize,
    /// A request with `x-wait` notifies `reached` once it staged its SQL, then waits for
    /// `release`.
    reached: Notify,
    release: Notify,
    /// The handle of the last request that staged, kept past its handler's return.
    kept: parking_lot::Mutex<Option<IdempotentRequest>>,
}

/// One store (schema) and a router behind the layer on it; `connections` counts the ones the
/// layer asked for, `live` the ones it holds now.
struct App {
    router: Router,
    connections: Arc<AtomicUsize>,
    live: Arc<AtomicUsize>,
}

/// A connection the layer holds, counted in `live` until it is given back (dropped).
struct Counted {
    client: Client,
    live: Arc<AtomicUsize>,
}

impl Deref for Counted {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for Counted {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

fn tenant(request: &axum::http::request::Parts) -> Option<Principal> {
    Principal::new(request.headers.get("x-tenant")?.as_bytes()).ok()
}

/// The mock clock's start (a lease's and a retention's time is the store's clock).
const START_MS: u64 = 1_700_000_000_000;

/// A router whose handler stages an insert of its run into `<schema>.payments`, waits at the
/// gate with `x-wait`, answers `x-status`, and stages a failing statement with `x-bad-sql`.
async fn app(
    url: &str,
    schema: &str,
    gate: &Arc<Gate>,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Result<App, Failure> {
    app_on(url, schema, gate, |store| store, configure).await
}

/// [`app`] on a store built with `store` (a mock clock, a retention).
async fn app_on(
    url: &str,
    schema: &str,
    gate: &Arc<Gate>,
    store: impl FnOnce(StoreBuilder) -> StoreBuilder,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Result<App, Failure> {
    let setup = connect(url).await?;
    let store = store(PgStore::builder().names(Names::new(schema, "records")?))
        .open(&setup)
        .await?;
    let connections = Arc::new(AtomicUsize::new(0));
    let live = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::postgres(
        store.consumer("http")?,
        {
            let (url, connections, live) = (url.to_owned(), connections.clone(), live.clone());
            move || {
                let (url, connections, live) = (url.clone(), connections.clone(), live.clone());
                async move {
                    connections.fetch_add(1, Ordering::SeqCst);
                    let client = connect(&url).await?;
                    live.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Failure>(Counted { client, live })
                }
            }
        },
        tenant,
    );
    let layer = configure(layer);
    let (schema, gate) = (schema.to_owned(), gate.clone());
    let handler =
        move |request: Option<Extension<IdempotentRequest>>, headers: HeaderMap, body: Bytes| {
            let (schema, gate) = (schema.clone(), gate.clone());
            async move { handle(&schema, &gate, request.map(|e| e.0), &headers, &body).await }
        };
    Ok(App {
        router: Router::new().route("/payments", post(handler)).layer(layer),
        connections,
        live,
    })
}

/// The handler: stages its run's row, and answers as the request's `x-` headers say: `x-wait`
/// (wait at the gate), `x-bad-sql` (stage a failing statement), `x-panic`, `x-status`,
/// `x-body-bytes` (padding in the body). The body tells the run, the derived key and the
/// epoch.
async fn handle(
    schema: &str,
    gate: &Gate,
    request: Option<IdempotentRequest>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let Some(request) = request else {
        return (StatusCode::OK, format!("run {run} without a key")).into_response();
    };
    let staged = request.sql(
        format!("INSERT INTO {schema}.payments (run, body) VALUES ($1, $2)"),
        vec![
            (Box::new(run as i64), Type::INT8),
            (Box::new(body.to_vec()), Type::BYTEA),
        ],
    );
    if staged.is_err() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    *gate.kept.lock() = Some(request.clone());
    if headers.contains_key("x-bad-sql") {
        request
            .sql(
                format!("INSERT INTO {schema}.missing VALUES (1)"),
                Vec::new(),
            )
            .unwrap();
    }
    if headers.contains_key("x-wait") {
        gate.reached.notify_one();
        gate.release.notified().await;
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
    let epoch = request.epoch().unwrap();
    let padding = "x".repeat(padding);
    (
        status,
        format!("{{\"run\":{run},\"id\":\"{id}\",\"epoch\":{epoch},\"padding\":\"{padding}\"}}"),
    )
        .into_response()
}

struct Reply {
    status: StatusCode,
    replayed: bool,
    retry_after: bool,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

async fn send(app: &App, request: Request<Body>) -> Reply {
    let response = app.router.clone().oneshot(request).await.unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let retry_after = response.headers().contains_key("retry-after");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        replayed,
        retry_after,
        body,
    }
}

fn pay(key: &str, body: &str, extra: &[(&str, &str)]) -> Request<Body> {
    payment(Some(key), body, extra)
}

/// A POST of `body` to `/payments` by tenant `acme`, with `key` if any and `extra` headers.
fn payment(key: Option<&str>, body: &str, extra: &[(&str, &str)]) -> Request<Body> {
    let mut request = Request::post("/payments").header("x-tenant", "acme");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

/// Sends `request` on a task of its own.
fn spawn_send(app: &Arc<App>, request: Request<Body>) -> tokio::task::JoinHandle<Reply> {
    let app = app.clone();
    tokio::spawn(async move { send(&app, request).await })
}

/// Sends `key` with `x-wait` and, once its handler waits at the gate, drops the request's
/// future (a client gone, a timeout).
async fn drop_a_waiting_request(app: &Arc<App>, gate: &Gate, key: &str) -> Result<(), Failure> {
    let request = spawn_send(app, pay(key, "b", &[("x-wait", "1")]));
    gate.reached.notified().await;
    request.abort();
    ensure!(
        request.await.is_err_and(|error| error.is_cancelled()),
        "the dropped request finished"
    );
    Ok(())
}

/// Sends `request` until the answer is not `409`: a dropped claim's rollback is sent without
/// waiting, and a dropped lease is released by a task of its own, each landing a moment later.
async fn send_until_not_in_progress(app: &App, request: impl Fn() -> Request<Body>) -> Reply {
    let mut reply = send(app, request()).await;
    for _ in 0..500 {
        if reply.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        reply = send(app, request()).await;
    }
    reply
}

/// A schema of the scenario's own, installed, with `<schema>.payments`.
async fn fresh_schema(url: &str, schema: &str) -> Result<Client, Failure> {
    let mut client = connect(url).await?;
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await?;
    install(&mut client, &Names::new(schema, "records")?).await?;
    client
        .batch_execute(&format!(
            "CREATE TABLE {schema}.payments (run int8 PRIMARY KEY, body bytea NOT NULL)"
        ))
        .await?;
    Ok(client)
}

async fn runs_stored(client: &Client, schema: &str) -> Result<Vec<i64>, Failure> {
    let rows = client
        .query(
            &format!("SELECT run FROM {schema}.payments ORDER BY run"),
            &[],
        )
        .await?;
    Ok(rows.iter().map(|row| row.get(0)).collect())
}

async fn replays_with_the_handlers_sql_committed_once(url: &str) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_replay").await?;
    let gate = Arc::new(Gate::default());
    let app = app(url, "h_replay", &gate, |layer| layer).await?;
    let first = send(&app, pay("k1", "{\"amount\":1}", &[])).await;
    ensure!(
        first.status == StatusCode::CREATED,
        "first: {}",
        first.status
    );
    ensure!(!first.replayed, "the first answer is marked as a replay");
    for _ in 0..3 {
        let retry = send(&app, pay("\"k1\"", "{\"amount\":1}", &[])).await;
        ensure!(
            retry.replayed && retry.body == first.body,
            "retry not replayed"
        );
    }
    ensure!(
        gate.runs.load(Ordering::SeqCst) == 1,
        "the handler ran again"
    );
    ensure!(
        runs_stored(&client, "h_replay").await? == [1],
        "the handler's SQL was not committed once"
    );
    let other = send(&app, pay("k1", "{\"amount\":2}", &[])).await;
    ensure!(
        other.status == StatusCode::UNPROCESSABLE_ENTITY,
        "a reused key: {}",
        other.status
    );
    // Another tenant's same key is another request.
    let globex = Request::post("/payments")
        .header("x-tenant", "globex")
        .header("idempotency-key", "k1")
        .body(Body::from("{\"amount\":1}"))
        .unwrap();
    let globex = send(&app, globex).await;
    ensure!(
        globex.status == StatusCode::CREATED && !globex.replayed,
        "another tenant was answered with acme's response"
    );
    ensure!(
        runs_stored(&client, "h_replay").await? == [1, 2],
        "the tenants' runs"
    );
    Ok(())
}

async fn a_request_in_progress_on_another_store_of_the_database_is_409(
    url: &str,
) -> Result<(), Failure> {
    fresh_schema(url, "h_busy").await?;
    let gate = Arc::new(Gate::default());
    // Two layers, each with its own store handle and connections: two processes, as the
    // database sees them.
    let first_app = Arc::new(app(url, "h_busy", &gate, |layer| layer).await?);
    let other_app = app(url, "h_busy", &gate, |layer| {
        layer.retry_after(Duration::from_secs(2))
    })
    .await?;
    let first = tokio::spawn({
        let first_app = first_app.clone();
        async move { send(&first_app, pay("k1", "b", &[("x-wait", "1")])).await }
    });
    gate.reached.notified().await;
    let busy = tokio::time::timeout(
        Duration::from_secs(30),
        send(&other_app, pay("k1", "b", &[])),
    )
    .await?;
    ensure!(
        busy.status == StatusCode::CONFLICT,
        "while held: {}",
        busy.status
    );
    ensure!(busy.retry_after, "409 without Retry-After");
    gate.release.notify_one();
    let first = first.await?;
    ensure!(
        first.status == StatusCode::CREATED,
        "first: {}",
        first.status
    );
    let after = send(&other_app, pay("k1", "b", &[])).await;
    ensure!(
        after.replayed && after.body == first.body,
        "the other store's retry"
    );
    Ok(())
}

async fn a_5xx_a_failing_statement_or_a_dropped_request_stores_nothing(
    url: &str,
) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_nothing").await?;
    let gate = Arc::new(Gate::default());
    let app = Arc::new(app(url, "h_nothing", &gate, |layer| layer).await?);
    let failed = send(&app, pay("k1", "b", &[("x-status", "500")])).await;
    ensure!(
        failed.status == StatusCode::INTERNAL_SERVER_ERROR,
        "5xx: {}",
        failed.status
    );
    let bad = send(&app, pay("k1", "b", &[("x-bad-sql", "1")])).await;
    ensure!(
        bad.status == StatusCode::SERVICE_UNAVAILABLE,
        "a failing statement: {}",
        bad.status
    );
    drop_a_waiting_request(&app, &gate, "k1").await?;
    // The dropped claim's rollback is sent without waiting: the key is free once it lands.
    let retry = send_until_not_in_progress(&app, || pay("k1", "b", &[])).await;
    ensure!(
        retry.status == StatusCode::CREATED && !retry.replayed,
        "after a 5xx, a failed statement and a drop: {}",
        retry.status
    );
    ensure!(
        runs_stored(&client, "h_nothing").await? == [4],
        "only the fourth run's SQL is committed"
    );
    Ok(())
}

async fn connections_are_given_back_and_a_failed_connect_is_503(url: &str) -> Result<(), Failure> {
    fresh_schema(url, "h_pool").await?;
    let gate = Arc::new(Gate::default());
    let app = app(url, "h_pool", &gate, |layer| layer).await?;
    send(&app, pay("k1", "b", &[])).await;
    send(&app, pay("k1", "b", &[])).await;
    ensure!(
        app.connections.load(Ordering::SeqCst) == 2,
        "one connection per keyed request"
    );
    ensure!(
        app.live.load(Ordering::SeqCst) == 0,
        "a connection was kept after its request"
    );
    // A layer whose pool fails.
    let setup = connect(url).await?;
    let store = PgStore::builder()
        .names(Names::new("h_pool", "records")?)
        .open(&setup)
        .await?;
    let broken = IdempotencyLayer::postgres(
        store.consumer("http")?,
        || async { Err::<Box<Client>, _>("the pool is exhausted") },
        tenant,
    );
    let broken = App {
        router: Router::new()
            .route("/payments", post(|| async { StatusCode::CREATED }))
            .layer(broken),
        connections: Arc::default(),
        live: Arc::default(),
    };
    let reply = send(&broken, pay("k2", "b", &[])).await;
    ensure!(
        reply.status == StatusCode::SERVICE_UNAVAILABLE && reply.retry_after,
        "no connection: {}",
        reply.status
    );
    Ok(())
}

async fn keys_missing_repeated_empty_or_too_long_are_400_and_optional_keys_pass_through(
    url: &str,
) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_keys").await?;
    let gate = Arc::new(Gate::default());
    let required = app(url, "h_keys", &gate, |layer| layer).await?;
    let missing = send(&required, payment(None, "{}", &[])).await;
    ensure!(
        missing.status == StatusCode::BAD_REQUEST && missing.text().contains("required"),
        "no key: {} {}",
        missing.status,
        missing.text()
    );
    let twice = Request::post("/payments")
        .header("x-tenant", "acme")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from("{}"))
        .unwrap();
    let twice = send(&required, twice).await;
    ensure!(
        twice.status == StatusCode::BAD_REQUEST,
        "two keys: {}",
        twice.status
    );
    let empty = send(&required, pay("\"\"", "{}", &[])).await;
    ensure!(
        empty.status == StatusCode::BAD_REQUEST,
        "an empty key: {}",
        empty.status
    );
    let long = "k".repeat(idemdb_http::KEY_BYTES_MAX + 1);
    let long = send(&required, pay(&long, "{}", &[])).await;
    ensure!(
        long.status == StatusCode::BAD_REQUEST,
        "a key too long: {}",
        long.status
    );
    ensure!(
        gate.runs.load(Ordering::SeqCst) == 0 && required.connections.load(Ordering::SeqCst) == 0,
        "a refused key ran the handler or asked for a connection"
    );
    let longest = "k".repeat(idemdb_http::KEY_BYTES_MAX);
    let longest = send(&required, pay(&longest, "{}", &[])).await;
    ensure!(
        longest.status == StatusCode::CREATED,
        "the longest key: {}",
        longest.status
    );

    let optional = app(url, "h_keys", &gate, IdempotencyLayer::key_optional).await?;
    for run in 2..=3 {
        let reply = send(&optional, payment(None, "{}", &[])).await;
        ensure!(
            reply.status == StatusCode::OK && reply.text() == format!("run {run} without a key"),
            "a keyless request on an optional route: {} {}",
            reply.status,
            reply.text()
        );
    }
    ensure!(
        optional.connections.load(Ordering::SeqCst) == 0,
        "a keyless request asked for a connection"
    );
    // A key on an optional route is still honoured.
    let keyed = send(&optional, pay("k1", "{}", &[])).await;
    ensure!(
        keyed.status == StatusCode::CREATED,
        "keyed: {}",
        keyed.status
    );
    ensure!(
        send(&optional, pay("k1", "{}", &[])).await.replayed,
        "a keyed retry on an optional route was not replayed"
    );
    ensure!(
        runs_stored(&client, "h_keys").await? == [1, 4],
        "the keyed runs' SQL"
    );
    Ok(())
}

async fn a_request_without_a_principal_is_401(url: &str) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_principal").await?;
    let gate = Arc::new(Gate::default());
    let app = app(url, "h_principal", &gate, |layer| layer).await?;
    let anonymous = Request::post("/payments")
        .header("idempotency-key", "k1")
        .body(Body::from("{}"))
        .unwrap();
    let anonymous = send(&app, anonymous).await;
    ensure!(
        anonymous.status == StatusCode::UNAUTHORIZED,
        "no principal: {}",
        anonymous.status
    );
    ensure!(gate.runs.load(Ordering::SeqCst) == 0, "the handler ran");
    ensure!(
        app.connections.load(Ordering::SeqCst) == 0,
        "a connection was asked for"
    );
    ensure!(
        runs_stored(&client, "h_principal").await?.is_empty(),
        "something was stored"
    );
    Ok(())
}

async fn a_4xx_chosen_for_storing_is_stored_with_its_sql_and_a_5xx_never_is(
    url: &str,
) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_store_when").await?;
    let gate = Arc::new(Gate::default());
    let chosen = app(url, "h_store_when", &gate, |layer| {
        layer.store_when(|status| status.is_client_error())
    })
    .await?;
    let declined = send(&chosen, pay("k1", "b", &[("x-status", "402")])).await;
    ensure!(
        declined.status == StatusCode::PAYMENT_REQUIRED,
        "402: {}",
        declined.status
    );
    ensure!(
        runs_stored(&client, "h_store_when").await? == [1],
        "the stored 402's SQL was not committed"
    );
    let retry = send(&chosen, pay("k1", "b", &[])).await;
    ensure!(
        retry.status == StatusCode::PAYMENT_REQUIRED
            && retry.replayed
            && retry.body == declined.body,
        "the 402 was not replayed: {}",
        retry.status
    );
    // The predicate says no to 2xx here: a 201 goes out unstored, its SQL with it.
    let created = send(&chosen, pay("k2", "b", &[])).await;
    ensure!(
        created.status == StatusCode::CREATED,
        "201: {}",
        created.status
    );
    let again = send(&chosen, pay("k2", "b", &[])).await;
    ensure!(!again.replayed, "an unstored 201 was replayed");
    ensure!(
        runs_stored(&client, "h_store_when").await? == [1],
        "an unstored response's SQL was committed"
    );

    let client = fresh_schema(url, "h_store_always").await?;
    let always = app(url, "h_store_always", &gate, |layer| {
        layer.store_when(|_| true)
    })
    .await?;
    let failed = send(&always, pay("k1", "b", &[("x-status", "503")])).await;
    ensure!(
        failed.status == StatusCode::SERVICE_UNAVAILABLE,
        "503: {}",
        failed.status
    );
    ensure!(
        runs_stored(&client, "h_store_always").await?.is_empty(),
        "a 5xx's SQL was committed"
    );
    let retry = send(&always, pay("k1", "b", &[])).await;
    ensure!(
        retry.status == StatusCode::CREATED && !retry.replayed,
        "after a 5xx: {}",
        retry.status
    );
    Ok(())
}

/// How a scenario builds its layer.
type Configure = fn(IdempotencyLayer) -> IdempotencyLayer;

/// The layer without and with a lease (the two paths on PostgreSQL), for the rows both take.
fn both_paths() -> [(&'static str, Configure); 2] {
    [
        ("batch", |layer| layer),
        ("lease", |layer| {
            layer.with_lease(Duration::from_secs(3600), "host-a")
        }),
    ]
}

async fn a_handler_that_panics_stores_nothing_and_frees_the_key(url: &str) -> Result<(), Failure> {
    for (path, configure) in both_paths() {
        let schema = format!("h_panic_{path}");
        let client = fresh_schema(url, &schema).await?;
        let gate = Arc::new(Gate::default());
        let app = Arc::new(app(url, &schema, &gate, configure).await?);
        let panicked = spawn_send(&app, pay("k1", "b", &[("x-panic", "1")])).await;
        ensure!(
            panicked.is_err_and(|error| error.is_panic()),
            "{path}: the handler's panic did not unwind the request"
        );
        // A dropped claim's rollback, or a dropped lease's release, lands a moment later.
        let retry = send_until_not_in_progress(&app, || pay("k1", "b", &[])).await;
        ensure!(
            retry.status == StatusCode::CREATED && !retry.replayed,
            "{path}: after a panic: {} {}",
            retry.status,
            retry.text()
        );
        ensure!(
            runs_stored(&client, &schema).await? == [2],
            "{path}: the panicking run's SQL was committed"
        );
    }
    Ok(())
}

async fn bodies_over_the_limits_are_refused_and_nothing_is_stored(
    url: &str,
) -> Result<(), Failure> {
    for (path, configure) in both_paths() {
        let schema = format!("h_limits_{path}");
        let client = fresh_schema(url, &schema).await?;
        let gate = Arc::new(Gate::default());
        let app = app(url, &schema, &gate, |layer| {
            configure(layer.request_body_limit(8).response_body_limit(200))
        })
        .await?;
        let large = send(&app, pay("k1", "123456789", &[])).await;
        ensure!(
            large.status == StatusCode::PAYLOAD_TOO_LARGE,
            "{path}: a body over the limit: {}",
            large.status
        );
        ensure!(
            gate.runs.load(Ordering::SeqCst) == 0 && app.connections.load(Ordering::SeqCst) == 0,
            "{path}: a 413 ran the handler or asked for a connection"
        );
        let too_large = send(&app, pay("k2", "{}", &[("x-body-bytes", "300")])).await;
        ensure!(
            too_large.status == StatusCode::INTERNAL_SERVER_ERROR
                && too_large.text().contains("over the limit"),
            "{path}: a response over the limit: {} {}",
            too_large.status,
            too_large.text()
        );
        ensure!(
            runs_stored(&client, &schema).await?.is_empty(),
            "{path}: the SQL of an unstorable response was committed"
        );
        // Freed before the 500 went out: no wait.
        let retry = send(&app, pay("k2", "{}", &[])).await;
        ensure!(
            retry.status == StatusCode::CREATED && !retry.replayed,
            "{path}: after a response over the limit: {} {}",
            retry.status,
            retry.text()
        );
        ensure!(
            runs_stored(&client, &schema).await? == [2],
            "{path}: the retry's SQL"
        );
    }
    Ok(())
}

async fn a_stored_response_expires_exactly_at_the_retention(url: &str) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_retention").await?;
    let gate = Arc::new(Gate::default());
    // The store's clock decides expiry: a mock one, injected, and an hour's retention.
    let clock = MockClock::new(START_MS);
    let store = |builder: StoreBuilder| {
        builder
            .clock(clock.clone())
            .retention(Duration::from_secs(3600))
    };
    let app = app_on(url, "h_retention", &gate, store, |layer| layer).await?;
    let first = send(&app, pay("k1", "b", &[])).await;
    ensure!(
        first.status == StatusCode::CREATED,
        "first: {}",
        first.status
    );
    // Another store on the database (another process, or this one restarted) replays it.
    let other = app_on(url, "h_retention", &gate, store, |layer| layer).await?;
    let elsewhere = send(&other, pay("k1", "b", &[])).await;
    ensure!(
        elsewhere.replayed && elsewhere.body == first.body,
        "another store did not replay the response"
    );
    // The last millisecond replays, the next runs afresh.
    clock.advance(Duration::from_millis(3_600_000 - 1));
    ensure!(
        send(&app, pay("k1", "b", &[])).await.replayed,
        "not replayed at the retention's last millisecond"
    );
    clock.advance(Duration::from_millis(1));
    let expired = send(&app, pay("k1", "b", &[])).await;
    ensure!(
        expired.status == StatusCode::CREATED && !expired.replayed,
        "at the retention: {} (replayed: {})",
        expired.status,
        expired.replayed
    );
    ensure!(
        runs_stored(&client, "h_retention").await? == [1, 2],
        "the runs' SQL"
    );
    Ok(())
}

async fn a_handle_kept_past_its_handler_stages_nothing(url: &str) -> Result<(), Failure> {
    for (path, configure) in both_paths() {
        let schema = format!("h_kept_{path}");
        let client = fresh_schema(url, &schema).await?;
        let gate = Arc::new(Gate::default());
        let app = app(url, &schema, &gate, configure).await?;
        let first = send(&app, pay("k1", "b", &[])).await;
        ensure!(
            first.status == StatusCode::CREATED,
            "{path}: {}",
            first.status
        );
        let kept = gate.kept.lock().take().ok_or("no handle kept")?;
        let late = kept.sql(
            format!("INSERT INTO {schema}.payments (run, body) VALUES (99, '')"),
            Vec::new(),
        );
        ensure!(
            matches!(late, Err(StageError::ClaimGone)),
            "{path}: staging after the handler returned: {late:?}"
        );
        ensure!(
            matches!(
                kept.renew_async(Duration::from_secs(60)).await,
                Err(StageError::ClaimGone)
            ) && matches!(
                kept.renew(Duration::from_secs(60)),
                Err(StageError::ClaimGone)
            ) && matches!(kept.derive_key("late"), Err(StageError::ClaimGone)),
            "{path}: a renewal or a derived key after the handler returned"
        );
        // Nor does a later request's commit carry it.
        let next = send(&app, pay("k2", "b", &[])).await;
        ensure!(
            next.status == StatusCode::CREATED,
            "{path}: {}",
            next.status
        );
        ensure!(
            runs_stored(&client, &schema).await? == [1, 2],
            "{path}: the late statement was committed"
        );
    }
    Ok(())
}

async fn on_the_lease_path_a_handler_that_outlives_its_lease_and_is_taken_over_is_fenced(
    url: &str,
) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_lease_takeover").await?;
    let gate = Arc::new(Gate::default());
    let clock = MockClock::new(START_MS);
    let store = |builder: StoreBuilder| builder.clock(clock.clone());
    let lease = |holder: &'static str| {
        move |layer: IdempotencyLayer| layer.with_lease(Duration::from_secs(30), holder)
    };
    // Two stores on the database: two processes, as the database sees them.
    let host_a = Arc::new(app_on(url, "h_lease_takeover", &gate, store, lease("host-a")).await?);
    let host_b = app_on(url, "h_lease_takeover", &gate, store, lease("host-b")).await?;
    let slow = spawn_send(&host_a, pay("k1", "b", &[("x-wait", "1")]));
    gate.reached.notified().await;
    let slow_handle = gate.kept.lock().clone().ok_or("no handle kept")?;
    // The lease is a committed record: no connection is held while the handler runs.
    ensure!(
        host_a.live.load(Ordering::SeqCst) == 0,
        "a connection is held while the lease's handler runs"
    );
    let busy = send(&host_b, pay("k1", "b", &[])).await;
    ensure!(
        busy.status == StatusCode::CONFLICT && busy.retry_after,
        "while the lease is live: {}",
        busy.status
    );
    // The lease runs out: a retry on the other host takes the key over under a new epoch.
    clock.advance(Duration::from_secs(31));
    let takeover = send(&host_b, pay("k1", "b", &[])).await;
    ensure!(
        takeover.status == StatusCode::CREATED && takeover.text().contains("\"epoch\":2"),
        "the takeover: {} {}",
        takeover.status,
        takeover.text()
    );
    let renewal = slow_handle.renew_async(Duration::from_secs(60)).await;
    ensure!(
        matches!(
            renewal,
            Err(StageError::Store(idemdb::Error::LeaseLost {
                current_epoch: 2
            }))
        ),
        "the taken-over request's renewal: {renewal:?}"
    );
    // The slow request finishes: fenced off, it stores nothing and runs none of its SQL.
    gate.release.notify_one();
    let slow = slow.await?;
    ensure!(
        slow.status == StatusCode::SERVICE_UNAVAILABLE && slow.retry_after,
        "the fenced request: {} {} (Retry-After: {})",
        slow.status,
        slow.text(),
        slow.retry_after
    );
    ensure!(
        runs_stored(&client, "h_lease_takeover").await? == [2],
        "the fenced request's SQL was committed"
    );
    let retry = send(&host_a, pay("k1", "b", &[])).await;
    ensure!(
        retry.replayed && retry.body == takeover.body,
        "the retry did not replay the takeover's response: {}",
        retry.text()
    );
    ensure!(
        host_a.live.load(Ordering::SeqCst) == 0 && host_b.live.load(Ordering::SeqCst) == 0,
        "a connection was kept"
    );
    Ok(())
}

async fn on_the_lease_path_a_renewed_lease_holds_the_key_and_one_that_ran_out_alone_completes(
    url: &str,
) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_lease_renew").await?;
    let gate = Arc::new(Gate::default());
    let clock = MockClock::new(START_MS);
    let app = Arc::new(
        app_on(
            url,
            "h_lease_renew",
            &gate,
            |builder| builder.clock(clock.clone()),
            |layer| layer.with_lease(Duration::from_secs(30), "host-a"),
        )
        .await?,
    );
    let slow = spawn_send(&app, pay("k1", "b", &[("x-wait", "1")]));
    gate.reached.notified().await;
    let handle = gate.kept.lock().clone().ok_or("no handle kept")?;
    let blocking = handle.renew(Duration::from_secs(60));
    ensure!(
        matches!(blocking, Err(StageError::WrongBackend(_))),
        "the blocking renewal of a PostgreSQL lease: {blocking:?}"
    );
    clock.advance(Duration::from_secs(20));
    let until = handle.renew_async(Duration::from_secs(60)).await?;
    ensure!(
        until == START_MS + 80_000,
        "renewed until {until}, not 80 s from the start"
    );
    // Past the first lease, within the renewed one: still held.
    clock.advance(Duration::from_secs(20));
    let busy = send(&app, pay("k1", "b", &[])).await;
    ensure!(
        busy.status == StatusCode::CONFLICT,
        "within the renewed lease: {}",
        busy.status
    );
    // Past the renewed lease too, with nobody taking over: the request completes as usual.
    clock.advance(Duration::from_secs(60));
    gate.release.notify_one();
    let slow = slow.await?;
    ensure!(
        slow.status == StatusCode::CREATED && slow.text().contains("\"epoch\":1"),
        "a lease that ran out alone: {} {}",
        slow.status,
        slow.text()
    );
    let retry = send(&app, pay("k1", "b", &[])).await;
    ensure!(
        retry.replayed && retry.body == slow.body,
        "the retry did not replay"
    );
    ensure!(
        runs_stored(&client, "h_lease_renew").await? == [1],
        "the run's SQL"
    );
    Ok(())
}

async fn on_the_lease_path_a_5xx_a_failing_statement_or_a_dropped_request_releases_the_lease(
    url: &str,
) -> Result<(), Failure> {
    let client = fresh_schema(url, "h_lease_release").await?;
    let gate = Arc::new(Gate::default());
    // An hour's lease, on the database's clock: only a release frees the key in this test.
    let app = Arc::new(
        app(url, "h_lease_release", &gate, |layer| {
            layer.with_lease(Duration::from_secs(3600), "host-a")
        })
        .await?,
    );
    let failed = send(&app, pay("k1", "b", &[("x-status", "502")])).await;
    ensure!(
        failed.status == StatusCode::BAD_GATEWAY,
        "5xx: {}",
        failed.status
    );
    // Released before the 502 went out: no wait. The released lease counts in the epoch.
    let retry = send(&app, pay("k1", "b", &[])).await;
    ensure!(
        retry.status == StatusCode::CREATED && retry.text().contains("\"epoch\":2"),
        "after a 5xx: {} {}",
        retry.status,
        retry.text()
    );
    let bad = send(&app, pay("k2", "b", &[("x-bad-sql", "1")])).await;
    ensure!(
        bad.status == StatusCode::SERVICE_UNAVAILABLE,
        "a failing statement: {} {}",
        bad.status,
        bad.text()
    );
    let retry = send(&app, pay("k2", "b", &[])).await;
    ensure!(
        retry.status == StatusCode::CREATED && !retry.replayed,
        "after a failing statement: {} {}",
        retry.status,
        retry.text()
    );
    drop_a_waiting_request(&app, &gate, "k3").await?;
    // Released by a task of its own once the request's future is dropped.
    let after = send_until_not_in_progress(&app, || pay("k3", "b", &[])).await;
    ensure!(
        after.status == StatusCode::CREATED && after.text().contains("\"epoch\":2"),
        "after a dropped request: {} {}",
        after.status,
        after.text()
    );
    ensure!(
        runs_stored(&client, "h_lease_release").await? == [2, 4, 6],
        "a released request's SQL was committed"
    );
    Ok(())
}

#[test]
fn every_row_on_postgresql() {
    let server = match server::Server::start() {
        Ok(server) => server,
        Err(why) => {
            println!("idemdb-http PostgreSQL tests skipped: cannot start PostgreSQL ({why})");
            return;
        }
    };
    let url = server.url();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut failed = Vec::new();
    macro_rules! scenario {
        ($name:ident) => {
            match runtime.block_on($name(&url)) {
                Ok(()) => println!("scenario {} ... ok", stringify!($name)),
                Err(error) => {
                    println!("scenario {} ... FAILED: {error}", stringify!($name));
                    failed.push(stringify!($name));
                }
            }
        };
    }
    scenario!(replays_with_the_handlers_sql_committed_once);
    scenario!(a_request_in_progress_on_another_store_of_the_database_is_409);
    scenario!(a_5xx_a_failing_statement_or_a_dropped_request_stores_nothing);
    scenario!(connections_are_given_back_and_a_failed_connect_is_503);
    scenario!(keys_missing_repeated_empty_or_too_long_are_400_and_optional_keys_pass_through);
    scenario!(a_request_without_a_principal_is_401);
    scenario!(a_4xx_chosen_for_storing_is_stored_with_its_sql_and_a_5xx_never_is);
    scenario!(a_handler_that_panics_stores_nothing_and_frees_the_key);
    scenario!(bodies_over_the_limits_are_refused_and_nothing_is_stored);
    scenario!(a_stored_response_expires_exactly_at_the_retention);
    scenario!(a_handle_kept_past_its_handler_stages_nothing);
    scenario!(on_the_lease_path_a_handler_that_outlives_its_lease_and_is_taken_over_is_fenced);
    scenario!(on_the_lease_path_a_renewed_lease_holds_the_key_and_one_that_ran_out_alone_completes);
    scenario!(on_the_lease_path_a_5xx_a_failing_statement_or_a_dropped_request_releases_the_lease);
    assert!(
        failed.is_empty(),
        "failed: {failed:?}; server log {:?}",
        server.log()
    );
}
