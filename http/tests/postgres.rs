//! The layer on the PostgreSQL backend, against a private server (started by the test; skipped
//! with a message where it cannot start): the behaviour table's rows, the handler's SQL
//! committed with the stored response, and `409` between two stores on one database (as two
//! processes or hosts see each other: only through the database's locks).

#[path = "../../postgres/tests/support/server.rs"]
#[allow(dead_code)]
mod server;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::BodyExt;
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal};
use idemdb_postgres::{Names, PgStore, install};
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
    reached: Notify,
    release: Notify,
}

/// One store (schema) and a router behind the layer on it; `connections` counts the ones the
/// layer asked for.
struct App {
    router: Router,
    connections: Arc<AtomicUsize>,
}

fn tenant(request: &axum::http::request::Parts) -> Option<Principal> {
    Principal::new(request.headers.get("x-tenant")?.as_bytes()).ok()
}

/// A router whose handler stages an insert of its run into `<schema>.payments`, waits at the
/// gate with `x-wait`, answers `x-status`, and stages a failing statement with `x-bad-sql`.
async fn app(
    url: &str,
    schema: &str,
    gate: &Arc<Gate>,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Result<App, Failure> {
    let setup = connect(url).await?;
    let store = PgStore::builder()
        .names(Names::new(schema, "records")?)
        .open(&setup)
        .await?;
    let connections = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::postgres(
        store.consumer("http")?,
        {
            let (url, connections) = (url.to_owned(), connections.clone());
            move || {
                let (url, connections) = (url.clone(), connections.clone());
                async move {
                    connections.fetch_add(1, Ordering::SeqCst);
                    connect(&url).await.map(Box::new)
                }
            }
        },
        tenant,
    );
    let layer = configure(layer);
    let (schema, gate) = (schema.to_owned(), gate.clone());
    let handler =
        move |Extension(request): Extension<IdempotentRequest>, headers: HeaderMap, body: Bytes| {
            let (schema, gate) = (schema.clone(), gate.clone());
            async move { handle(&schema, &gate, request, &headers, &body).await }
        };
    Ok(App {
        router: Router::new().route("/payments", post(handler)).layer(layer),
        connections,
    })
}

async fn handle(
    schema: &str,
    gate: &Gate,
    request: IdempotentRequest,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    let run = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
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
    let status = headers
        .get("x-status")
        .map_or(StatusCode::CREATED, |status| {
            StatusCode::from_bytes(status.as_bytes()).unwrap()
        });
    let id = request.derive_key("payment").unwrap();
    (status, format!("{{\"run\":{run},\"id\":\"{id}\"}}")).into_response()
}

struct Reply {
    status: StatusCode,
    replayed: bool,
    retry_after: bool,
    body: Bytes,
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
    let mut request = Request::post("/payments")
        .header("x-tenant", "acme")
        .header("idempotency-key", key);
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    request.body(Body::from(body.to_owned())).unwrap()
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
    let dropped = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay("k1", "b", &[("x-wait", "1")])).await }
    });
    gate.reached.notified().await;
    dropped.abort();
    ensure!(dropped.await.is_err(), "the dropped request finished");
    // The dropped claim's rollback is sent without waiting: the key is free once it lands.
    let mut retry = send(&app, pay("k1", "b", &[])).await;
    for _ in 0..500 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        retry = send(&app, pay("k1", "b", &[])).await;
    }
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
    };
    let reply = send(&broken, pay("k2", "b", &[])).await;
    ensure!(
        reply.status == StatusCode::SERVICE_UNAVAILABLE && reply.retry_after,
        "no connection: {}",
        reply.status
    );
    Ok(())
}

async fn a_lease_asked_of_the_postgresql_backend_is_refused(url: &str) -> Result<(), Failure> {
    fresh_schema(url, "h_lease").await?;
    let gate = Arc::new(Gate::default());
    // The lease path is the embedded engine's: a PostgreSQL layer built with it refuses.
    let app = app(url, "h_lease", &gate, |layer| {
        layer.with_lease(Duration::from_secs(30), "host")
    })
    .await?;
    let reply = send(&app, pay("k1", "b", &[])).await;
    ensure!(
        reply.status == StatusCode::SERVICE_UNAVAILABLE,
        "with_lease on PostgreSQL: {}",
        reply.status
    );
    ensure!(gate.runs.load(Ordering::SeqCst) == 0, "the handler ran");
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
    scenario!(a_lease_asked_of_the_postgresql_backend_is_refused);
    assert!(
        failed.is_empty(),
        "failed: {failed:?}; server log {:?}",
        server.log()
    );
}
