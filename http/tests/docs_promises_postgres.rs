//! The PostgreSQL backend of idemdb-http against what its documentation promises (the crate
//! docs, guide chapter 6, the HTTP section of docs/design.md, README's HTTP section), written
//! from those alone. One private server for the file; each scenario in its own schema. A
//! scenario listed in `FINDINGS` is expected to fail (a place where the code and the docs
//! disagree): it is reported, not asserted.

#[path = "../../postgres/tests/support/server.rs"]
#[allow(dead_code)]
mod server;

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, request::Parts};
use axum::response::Response;
use axum::routing::any;
use axum::{Extension, Router};
use idemdb::{Clock, Fingerprint, MockClock, RecordState, SystemClock};
use idemdb_http::{
    IDEMPOTENT_REPLAYED, IdempotencyLayer, IdempotentRequest, Principal,
    REQUEST_BODY_BYTES_DEFAULT, RESPONSE_BODY_BYTES_DEFAULT, StageError,
};
use idemdb_postgres::{Names, PgConsumer, PgStore};
use tokio::sync::{Semaphore, mpsc};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls};
use tower::ServiceExt;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Outcome = Result<(), BoxError>;

/// Scenarios expected to fail: each a finding, explained where the scenario is written.
const FINDINGS: &[&str] = &[];

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Harness: the database, connections, the layer, the handler, requests.

#[derive(Clone)]
struct Ctx {
    url: String,
    schema: String,
}

impl Ctx {
    async fn client(&self) -> Result<Client, BoxError> {
        let (client, connection) = tokio_postgres::connect(&self.url, NoTls).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    fn names(&self) -> Result<Names, BoxError> {
        Ok(Names::new(&self.schema, "records")?)
    }

    /// The scenario's schema: idemdb's tables and a business table.
    async fn install(&self) -> Outcome {
        let mut client = self.client().await?;
        client
            .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {}", self.schema))
            .await?;
        idemdb_postgres::install(&mut client, &self.names()?).await?;
        client
            .batch_execute(&format!(
                "CREATE TABLE {}.payments (seq bigserial, id text NOT NULL, body bytea NOT NULL)",
                self.schema
            ))
            .await?;
        Ok(())
    }

    /// A store of its own (another process, as the database sees it).
    async fn store(
        &self,
        clock: Option<&MockClock>,
        retention: Option<Duration>,
    ) -> Result<PgStore, BoxError> {
        let client = self.client().await?;
        let mut builder = PgStore::builder().names(self.names()?);
        if let Some(clock) = clock {
            builder = builder.clock(clock.clone());
        }
        if let Some(retention) = retention {
            builder = builder.retention(retention);
        }
        Ok(builder.open(&client).await?)
    }

    async fn consumer(&self, clock: Option<&MockClock>) -> Result<PgConsumer, BoxError> {
        Ok(self.store(clock, None).await?.consumer("payments")?)
    }

    fn pool(&self) -> Pool {
        Pool {
            url: self.url.clone(),
            live: Arc::default(),
            connects: Arc::default(),
            fail: Arc::default(),
        }
    }

    /// A fresh store's consumer and a pool of its own.
    async fn pg(&self) -> Result<(PgConsumer, Pool), BoxError> {
        Ok((self.consumer(None).await?, self.pool()))
    }

    fn insert(&self) -> String {
        format!(
            "INSERT INTO {}.payments (id, body) VALUES ($1, $2)",
            self.schema
        )
    }

    /// The business rows, in the order inserted.
    async fn rows(&self) -> Result<Vec<(String, Vec<u8>)>, BoxError> {
        let client = self.client().await?;
        let rows = client
            .query(
                &format!("SELECT id, body FROM {}.payments ORDER BY seq", self.schema),
                &[],
            )
            .await?;
        Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
    }

    /// How many times the business table's sequence was advanced: by every INSERT sent to the
    /// database, whether its transaction committed or not.
    async fn inserts_sent(&self) -> Result<i64, BoxError> {
        let client = self.client().await?;
        let row = client
            .query_one(
                &format!(
                    "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {}.payments_seq_seq",
                    self.schema
                ),
                &[],
            )
            .await?;
        Ok(row.get(0))
    }

    async fn row_ids(&self) -> Result<Vec<String>, BoxError> {
        Ok(self.rows().await?.into_iter().map(|(id, _)| id).collect())
    }

    /// The business rows are exactly those of `ids`, in that order.
    async fn expect_rows(&self, ids: &[&str]) -> Outcome {
        let rows = self.row_ids().await?;
        ensure!(rows == ids, "rows {rows:?}");
        Ok(())
    }

    /// One INSERT reached the database in all: the runs whose response was not stored never
    /// sent their SQL, not even in a transaction rolled back (see `inserts_sent`).
    async fn expect_one_insert_sent(&self) -> Outcome {
        let sent = self.inserts_sent().await?;
        ensure!(
            sent == 1,
            "{sent} INSERTs sent: the SQL of a response not stored was run"
        );
        Ok(())
    }

    /// `retry` followed a first run that stored nothing: the key was free, so it ran the
    /// handler a second time (no replay), only that run's row is written, and the first run's
    /// SQL never reached the database.
    async fn expect_second_run(&self, retry: &Answer, h: &Handler) -> Outcome {
        retry.expect(StatusCode::CREATED)?;
        ensure!(
            !retry.replayed() && h.runs() == 2,
            "the retry did not run the handler"
        );
        self.expect_rows(&["a-2"]).await?;
        self.expect_one_insert_sent().await
    }

    /// One process on `path`: a store of its own on `clock`, a pool of its own, its layer (a
    /// lease held as `holder`).
    async fn process(
        &self,
        path: Path,
        clock: Option<&MockClock>,
        holder: &str,
    ) -> Result<IdempotencyLayer, BoxError> {
        Ok(path.layer(self.consumer(clock).await?, &self.pool(), holder))
    }

    /// The usual layer on `path`: one process, holder `host-a`, the path's clock.
    async fn layer(&self, path: Path) -> Result<IdempotencyLayer, BoxError> {
        self.process(path, path.clock().as_ref(), "host-a").await
    }

    /// The plain handler (`a`, as `Handler::new` makes it) behind the usual layer on `path`.
    async fn serve(&self, path: Path) -> Result<(Handler, Router), BoxError> {
        let h = Handler::new(self, "a");
        let app = app(self.layer(path).await?, &h);
        Ok((h, app))
    }
}

/// The layer's connect function: a new connection each time, counted while alive.
#[derive(Clone)]
struct Pool {
    url: String,
    live: Arc<AtomicUsize>,
    connects: Arc<AtomicUsize>,
    fail: Arc<AtomicBool>,
}

struct Conn {
    client: Client,
    live: Arc<AtomicUsize>,
}

impl Deref for Conn {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.live.fetch_sub(1, SeqCst);
    }
}

impl Pool {
    async fn get(self) -> Result<Conn, BoxError> {
        if self.fail.load(SeqCst) {
            return Err("no connection (the test's pool refuses)".into());
        }
        let (client, connection) = tokio_postgres::connect(&self.url, NoTls).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        self.connects.fetch_add(1, SeqCst);
        self.live.fetch_add(1, SeqCst);
        Ok(Conn {
            client,
            live: self.live.clone(),
        })
    }

    fn live(&self) -> usize {
        self.live.load(SeqCst)
    }

    fn connects(&self) -> usize {
        self.connects.load(SeqCst)
    }

    async fn until_none_live(&self) -> Outcome {
        for _ in 0..200 {
            if self.live() == 0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Err(format!("{} connections still held after 5 s", self.live()).into())
    }
}

fn tenant(parts: &Parts) -> Option<Principal> {
    Principal::new(parts.headers.get("x-tenant")?.as_bytes()).ok()
}

fn pg_layer(consumer: PgConsumer, pool: &Pool) -> IdempotencyLayer {
    let pool = pool.clone();
    IdempotencyLayer::postgres(consumer, move || pool.clone().get(), tenant)
}

const LEASE: Duration = Duration::from_secs(10);

/// The two ways the layer runs a keyed request on PostgreSQL. Most promises hold on both: such
/// a scenario is written once, takes the path, and is listed under a name for each.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    /// `IdempotencyLayer::postgres`: the claim is a transaction held while the handler runs.
    Batch,
    /// `.with_lease(LEASE, holder)`: an in-progress record committed before the handler runs.
    Lease,
}

use Path::{Batch, Lease};

impl Path {
    /// `layer` as this path runs it (`holder` names the lease; the batch path has none).
    fn with(self, layer: IdempotencyLayer, holder: &str) -> IdempotencyLayer {
        match self {
            Batch => layer,
            Lease => layer.with_lease(LEASE, holder),
        }
    }

    /// The layer on this path over `consumer`, its connections from `pool`.
    fn layer(self, consumer: PgConsumer, pool: &Pool, holder: &str) -> IdempotencyLayer {
        self.with(pg_layer(consumer, pool), holder)
    }

    /// The stores' clock: on the lease path a mock that stands still until a scenario moves it,
    /// so a key free at once was released (its lease did not run out); the batch path keeps
    /// the database's clock, as the batch scenarios always had it.
    fn clock(self) -> Option<MockClock> {
        (self == Lease).then(mock_clock)
    }
}

/// Holds the handler's first run until opened, handing the test a clone of its request.
#[derive(Clone)]
struct Gate {
    entered: mpsc::UnboundedSender<IdempotentRequest>,
    open: Arc<Semaphore>,
}

fn gate() -> (Gate, mpsc::UnboundedReceiver<IdempotentRequest>) {
    let (entered, rx) = mpsc::unbounded_channel();
    (
        Gate {
            entered,
            open: Arc::new(Semaphore::new(0)),
        },
        rx,
    )
}

impl Gate {
    async fn pass(&self, request: IdempotentRequest) {
        let _ = self.entered.send(request);
        if let Ok(permit) = self.open.acquire().await {
            permit.forget();
        }
    }

    fn open(&self) {
        self.open.add_permits(1_000);
    }
}

async fn entered(
    rx: &mut mpsc::UnboundedReceiver<IdempotentRequest>,
) -> Result<IdempotentRequest, BoxError> {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .map_err(|_| "the handler did not start within 30 s")?
        .ok_or_else(|| "the gate's channel closed".into())
}

type Extra = Arc<dyn Fn(&IdempotentRequest, usize) + Send + Sync>;

/// The handler: counts its runs, stages one INSERT (`{name}-{run}`, the request's body), then
/// whatever `extra` stages, waits at the gate on its first run, and answers `status(run)` with
/// `content-type`, `location`, two `x-custom` values and a body naming the run (or `respond`).
#[derive(Clone)]
struct Handler {
    name: &'static str,
    insert: String,
    runs: Arc<AtomicUsize>,
    status: fn(usize) -> StatusCode,
    respond: Option<fn(usize, String) -> Response>,
    extra: Option<Extra>,
    gate: Option<Gate>,
}

impl Handler {
    fn new(ctx: &Ctx, name: &'static str) -> Handler {
        Handler {
            name,
            insert: ctx.insert(),
            runs: Arc::default(),
            status: |_| StatusCode::CREATED,
            respond: None,
            extra: None,
            gate: None,
        }
    }

    fn status(mut self, status: fn(usize) -> StatusCode) -> Handler {
        self.status = status;
        self
    }

    fn respond(mut self, respond: fn(usize, String) -> Response) -> Handler {
        self.respond = Some(respond);
        self
    }

    fn extra(
        mut self,
        extra: impl Fn(&IdempotentRequest, usize) + Send + Sync + 'static,
    ) -> Handler {
        self.extra = Some(Arc::new(extra));
        self
    }

    fn gated(mut self, gate: &Gate) -> Handler {
        self.gate = Some(gate.clone());
        self
    }

    fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }

    async fn run(self, request: IdempotentRequest, body: Bytes) -> Response {
        let n = self.runs.fetch_add(1, SeqCst) + 1;
        let id = match request.derive_key("payment") {
            Ok(id) => id,
            Err(error) => return unexpected(error),
        };
        if let Err(error) = request.sql(
            self.insert.clone(),
            vec![
                (Box::new(format!("{}-{n}", self.name)), Type::TEXT),
                (Box::new(body.to_vec()), Type::BYTEA),
            ],
        ) {
            return unexpected(error);
        }
        if let Some(extra) = &self.extra {
            extra(&request, n);
        }
        if n == 1
            && let Some(gate) = &self.gate
        {
            gate.pass(request.clone()).await;
        }
        if let Some(respond) = self.respond {
            return respond(n, id);
        }
        Response::builder()
            .status((self.status)(n))
            .header("content-type", "text/plain")
            .header("location", format!("/payments/{id}"))
            .header("x-custom", "one")
            .header("x-custom", "two")
            .body(Body::from(format!("{} run {n} {id}", self.name)))
            .unwrap()
    }
}

/// A staging call failed where the test expected none to: a status no scenario expects.
fn unexpected(error: StageError) -> Response {
    Response::builder()
        .status(StatusCode::IM_A_TEAPOT)
        .body(Body::from(format!("unexpected staging error: {error}")))
        .unwrap()
}

fn app(layer: IdempotencyLayer, handler: &Handler) -> Router {
    let h = handler.clone();
    let route = any(
        move |Extension(request): Extension<IdempotentRequest>, body: Bytes| {
            h.clone().run(request, body)
        },
    );
    Router::new()
        .route("/payments", route.clone())
        .route("/other", route)
        .layer(layer)
}

fn request(
    method: &str,
    uri: &str,
    key: Option<&str>,
    tenant: Option<&str>,
    body: impl Into<Body>,
) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(uri);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    if let Some(tenant) = tenant {
        builder = builder.header("x-tenant", tenant);
    }
    builder.body(body.into()).unwrap()
}

/// `POST /payments` by tenant `acme` with `key`.
fn post(key: &str, body: impl Into<Body>) -> Request<Body> {
    request("POST", "/payments", Some(key), Some("acme"), body)
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|value| value == "true")
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    fn all(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn expect(&self, status: StatusCode) -> Outcome {
        ensure!(
            self.status == status,
            "expected {status}, got {} ({})",
            self.status,
            self.text()
        );
        Ok(())
    }
}

async fn send(app: &Router, request: Request<Body>) -> Result<Answer, BoxError> {
    let response = app.clone().oneshot(request).await?;
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await?;
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

fn spawn_send(
    app: &Router,
    request: Request<Body>,
) -> tokio::task::JoinHandle<Result<Answer, BoxError>> {
    let app = app.clone();
    tokio::spawn(async move { send(&app, request).await })
}

/// Sends until the answer is not `409` (a key freed a moment after a drop), 15 s at most.
async fn until_not_409(app: &Router, make: impl Fn() -> Request<Body>) -> Result<Answer, BoxError> {
    for _ in 0..300 {
        let answer = send(app, make()).await?;
        if answer.status != StatusCode::CONFLICT {
            return Ok(answer);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("the key was still in progress (409) after 15 s".into())
}

/// The message key the design gives a request: `[principal_len: u8][principal][key]`.
fn scoped(principal: &str, key: &str) -> Vec<u8> {
    let mut scoped = vec![u8::try_from(principal.len()).unwrap()];
    scoped.extend_from_slice(principal.as_bytes());
    scoped.extend_from_slice(key.as_bytes());
    scoped
}

fn mock_clock() -> MockClock {
    MockClock::new(SystemClock.now_ms())
}

fn problem_ok(answer: &Answer) -> Outcome {
    ensure!(
        answer.header("content-type") == Some("application/problem+json"),
        "{}: content-type {:?}",
        answer.status,
        answer.header("content-type")
    );
    let compact: String = answer
        .text()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    ensure!(
        compact.contains(&format!("\"status\":{}", answer.status.as_u16()))
            && compact.contains("\"title\":"),
        "{}: body {compact}",
        answer.status
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Both paths: a promise the docs make of the batch path and of the lease path, written once
// with the path as its parameter; the runner lists it under each path's scenario name.

/// "first with its key: the handler runs; a 2xx is stored with the handler's writes"; on the
/// lease path "the handler's staged SQL run, in the completion's transaction, with the stored
/// response's write and the commit". Retries replay it; another request with its key is 422.
async fn first_request_commits_sql(ctx: Ctx, path: Path) -> Outcome {
    let (h, app) = ctx.serve(path).await?;
    let first = send(&app, post("k1", "{\"amount\":100}")).await?;
    first.expect(StatusCode::CREATED)?;
    ensure!(!first.replayed(), "a first answer is marked as a replay");
    ensure!(h.runs() == 1, "runs {}", h.runs());
    let rows = ctx.rows().await?;
    ensure!(
        rows == vec![("a-1".to_owned(), b"{\"amount\":100}".to_vec())],
        "rows {rows:?}"
    );
    let retry = send(&app, post("k1", "{\"amount\":100}")).await?;
    ensure!(retry.replayed() && retry.body == first.body, "no replay");
    ensure!(
        retry.header("location") == first.header("location"),
        "location differs"
    );
    ensure!(h.runs() == 1, "runs {}", h.runs());
    send(&app, post("k1", "other"))
        .await?
        .expect(StatusCode::UNPROCESSABLE_ENTITY)
}

/// "a retry on any of them gets 409 while the first attempt runs anywhere" with `Retry-After`
/// (1 s by default, `retry_after` rounded up); on the lease path "every process on the database
/// answers a retry 409 until it runs out". Then another process replays the first's response
/// without running its handler.
async fn in_flight_409_then_replay(ctx: Ctx, path: Path) -> Outcome {
    let clock = path.clock();
    let (gate, mut rx) = gate();
    let a = Handler::new(&ctx, "a").gated(&gate);
    let app_a = app(ctx.process(path, clock.as_ref(), "host-a").await?, &a);
    let b = Handler::new(&ctx, "b");
    let app_b = app(ctx.process(path, clock.as_ref(), "host-b").await?, &b);
    let c = Handler::new(&ctx, "c");
    let layer_c = ctx.process(path, clock.as_ref(), "host-c").await?;
    let app_c = app(layer_c.retry_after(Duration::from_millis(2_500)), &c);

    let first = spawn_send(&app_a, post("k1", "x"));
    let _held = entered(&mut rx).await?;
    if let Some(clock) = &clock {
        // Half the lease gone: it still holds the key.
        clock.advance(LEASE / 2);
    }
    let other = send(&app_b, post("k1", "x")).await?;
    other.expect(StatusCode::CONFLICT)?;
    ensure!(
        other.header("retry-after") == Some("1"),
        "409's Retry-After {:?}",
        other.header("retry-after")
    );
    let custom = send(&app_c, post("k1", "x")).await?;
    custom.expect(StatusCode::CONFLICT)?;
    ensure!(
        custom.header("retry-after") == Some("3"),
        "retry_after(2.5 s): Retry-After {:?}",
        custom.header("retry-after")
    );
    let same = send(&app_a, post("k1", "x")).await?;
    same.expect(StatusCode::CONFLICT)?;
    ensure!(
        b.runs() == 0 && c.runs() == 0 && a.runs() == 1,
        "a handler ran during the 409s"
    );
    gate.open();
    let first = first.await??;
    first.expect(StatusCode::CREATED)?;
    let replay = send(&app_b, post("k1", "x")).await?;
    replay.expect(StatusCode::CREATED)?;
    ensure!(
        replay.replayed() && replay.body == first.body,
        "B did not replay A's response"
    );
    ensure!(b.runs() == 0, "B's handler ran");
    ctx.expect_rows(&["a-1"]).await
}

/// "A larger response of a status it stores is not sent: the handler's writes are dropped, the
/// key is freed and the client gets 500 (ResponseTooLarge)"; on the lease path "a response to
/// store over the limit: 500; nothing stored, key free" (the lease released).
async fn response_too_large_500_key_free(ctx: Ctx, path: Path) -> Outcome {
    let h = Handler::new(&ctx, "a").respond(|n, _| {
        Response::builder()
            .status(StatusCode::CREATED)
            .body(Body::from(vec![b'r'; if n == 1 { 101 } else { 100 }]))
            .unwrap()
    });
    let app = app(ctx.layer(path).await?.response_body_limit(100), &h);
    let too_large = send(&app, post("k1", "x")).await?;
    too_large.expect(StatusCode::INTERNAL_SERVER_ERROR)?;
    ensure!(
        !too_large.body.starts_with(b"rrrr"),
        "the oversized response was sent"
    );
    ensure!(ctx.rows().await?.is_empty(), "rows written");
    let again = send(&app, post("k1", "x")).await?;
    again.expect(StatusCode::CREATED)?;
    ensure!(again.body.len() == 100 && !again.replayed(), "second run");
    ctx.expect_rows(&["a-2"]).await?;
    ctx.expect_one_insert_sent().await
}

/// "A statement that fails fails the commit: nothing of the request is written, the key is
/// free, and the client gets 503"; on the lease path "A statement that fails there ...
/// releases the lease: nothing is written and the key is free".
async fn failing_statement_503_key_free(ctx: Ctx, path: Path) -> Outcome {
    let schema = ctx.schema.clone();
    let h = Handler::new(&ctx, "a").extra(move |request, n| {
        if n == 1 {
            let _ = request.sql(
                format!("INSERT INTO {schema}.missing_table VALUES (1)"),
                vec![],
            );
        }
    });
    let app = app(ctx.layer(path).await?, &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::SERVICE_UNAVAILABLE)?;
    let rows = ctx.row_ids().await?;
    ensure!(
        rows.is_empty(),
        "the statement before the failing one was committed: rows {rows:?}"
    );
    let retry = send(&app, post("k1", "x")).await?;
    retry.expect(StatusCode::CREATED)?;
    ensure!(!retry.replayed() && h.runs() == 2, "the key was not free");
    ctx.expect_rows(&["a-2"]).await
}

/// "the future is dropped (... panic): nothing stored, key free" (on the lease path: the lease
/// released, so the retry runs at once).
async fn panicking_handler_key_free(ctx: Ctx, path: Path) -> Outcome {
    let h = Handler::new(&ctx, "a").extra(|_, n| {
        if n == 1 {
            panic!("the handler panics (planted by the test)");
        }
    });
    let app = app(ctx.layer(path).await?, &h);
    let first = spawn_send(&app, post("k1", "x")).await;
    if let Ok(Ok(answer)) = &first {
        ensure!(
            answer.status.is_server_error(),
            "a panic answered {}",
            answer.status
        );
    }
    let retry = until_not_409(&app, || post("k1", "x")).await?;
    ctx.expect_second_run(&retry, &h).await
}

/// "A connection that cannot be had is 503 with Retry-After" (to claim the key, or to take the
/// lease); `retry_after`: "whole seconds, rounded up, at least 1" for a retryable 503 too. The
/// handler does not run, and nothing was claimed: once connections can be had, the same layer
/// runs the key.
async fn connect_failure_503(ctx: Ctx, path: Path) -> Outcome {
    let pool = ctx.pool();
    pool.fail.store(true, SeqCst);
    let h = Handler::new(&ctx, "a");
    let mut apps = Vec::new();
    for (after, expected) in [
        (None, "1"),
        (Some(Duration::from_millis(2_500)), "3"),
        (Some(Duration::ZERO), "1"),
        (Some(Duration::from_secs(2)), "2"),
    ] {
        let mut layer = path.layer(ctx.consumer(None).await?, &pool, "host-a");
        if let Some(after) = after {
            layer = layer.retry_after(after);
        }
        let app = app(layer, &h);
        let answer = send(&app, post("k1", "x")).await?;
        answer.expect(StatusCode::SERVICE_UNAVAILABLE)?;
        ensure!(
            answer.header("retry-after") == Some(expected),
            "retry_after {after:?}: Retry-After {:?}, expected {expected}",
            answer.header("retry-after")
        );
        apps.push(app);
    }
    let without = match path {
        Batch => "a connection",
        Lease => "a lease",
    };
    ensure!(h.runs() == 0, "the handler ran without {without}");
    pool.fail.store(false, SeqCst);
    send(&apps[0], post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)
}

/// "A handler that keeps a clone of its IdempotentRequest past its return gets ClaimGone from
/// it"; "Nothing was staged": the stored response replays unchanged. On the lease path a
/// renewal through the kept handle is ClaimGone too (the batch path has no lease to renew; see
/// `renew_while_running`).
async fn kept_handle_claim_gone_on(ctx: Ctx, path: Path) -> Outcome {
    let slot: Arc<Mutex<Option<IdempotentRequest>>> = Arc::default();
    let keep = slot.clone();
    let h = Handler::new(&ctx, "a").extra(move |request, _| {
        *keep.lock().unwrap() = Some(request.clone());
    });
    let app = app(ctx.layer(path).await?, &h);
    let first = send(&app, post("k1", "x")).await?;
    first.expect(StatusCode::CREATED)?;
    let kept = slot.lock().unwrap().take().ok_or("no handle kept")?;
    if path == Lease {
        let renewed = kept.renew_async(LEASE).await;
        ensure!(
            matches!(renewed, Err(StageError::ClaimGone)),
            "renew_async: {renewed:?}"
        );
    }
    let staged = kept.sql(
        ctx.insert(),
        vec![
            (Box::new("late".to_owned()), Type::TEXT),
            (Box::new(Vec::<u8>::new()), Type::BYTEA),
        ],
    );
    ensure!(
        matches!(staged, Err(StageError::ClaimGone)),
        "sql: {staged:?}"
    );
    ensure!(
        matches!(kept.derive_key("x"), Err(StageError::ClaimGone)),
        "derive_key"
    );
    ensure!(matches!(kept.epoch(), Err(StageError::ClaimGone)), "epoch");
    let retry = send(&app, post("k1", "x")).await?;
    ensure!(
        retry.replayed() && retry.body == first.body,
        "replay changed"
    );
    ctx.expect_rows(&["a-1"]).await
}

/// What renewing answers while the handler runs, with and without a connection to be had.
/// Batch: "`renew`: NoLease on a layer without leases"; `renew_async` "As for renew". Lease:
/// "the blocking `renew` answers WrongBackend there"; renew_async's "Connect when no connection
/// could be had ... the lease is as it was", then a renewal. The request completes either way.
async fn renew_while_running(ctx: Ctx, path: Path) -> Outcome {
    let (gate, mut rx) = gate();
    let pool = ctx.pool();
    let h = Handler::new(&ctx, "a").gated(&gate);
    let app = app(path.layer(ctx.consumer(None).await?, &pool, "host-a"), &h);
    let first = spawn_send(&app, post("k1", "x"));
    let held = entered(&mut rx).await?;
    let blocking = {
        let held = held.clone();
        tokio::task::spawn_blocking(move || held.renew(LEASE)).await?
    };
    pool.fail.store(true, SeqCst);
    let no_connection = held.renew_async(LEASE).await;
    pool.fail.store(false, SeqCst);
    let renewed = held.renew_async(LEASE).await;
    gate.open();
    let first = first.await??;
    let (blocking_ok, no_connection_ok, renewed_ok) = match path {
        Batch => (
            matches!(blocking, Err(StageError::NoLease)),
            matches!(no_connection, Err(StageError::NoLease)),
            matches!(renewed, Err(StageError::NoLease)),
        ),
        Lease => (
            matches!(blocking, Err(StageError::WrongBackend(_))),
            matches!(no_connection, Err(StageError::Connect(_))),
            renewed.is_ok(),
        ),
    };
    ensure!(blocking_ok, "renew: {blocking:?}");
    ensure!(
        no_connection_ok,
        "renew_async without a connection: {no_connection:?}"
    );
    ensure!(renewed_ok, "renew_async: {renewed:?}");
    first.expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["a-1"]).await
}

/// "The retention is the store's (StoreBuilder::retention), on the database's clock unless the
/// store is given one (StoreBuilder::clock, for tests)"; "expires exactly then": a replay
/// through the last millisecond, the handler again from the expiry on. On the lease path the
/// record is the completion's, on the store's (injected) clock too.
async fn retention_expiry(ctx: Ctx, path: Path) -> Outcome {
    let clock = mock_clock();
    let consumer = ctx
        .store(Some(&clock), Some(Duration::from_secs(60)))
        .await?
        .consumer("payments")?;
    let h = Handler::new(&ctx, "a");
    let app = app(path.layer(consumer, &ctx.pool(), "host-a"), &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    clock.advance(Duration::from_millis(59_999));
    let last = send(&app, post("k1", "x")).await?;
    ensure!(
        last.replayed(),
        "no replay at the retention's last millisecond: {}",
        last.status
    );
    clock.advance(Duration::from_millis(1));
    let expired = send(&app, post("k1", "x")).await?;
    expired.expect(StatusCode::CREATED)?;
    ensure!(
        !expired.replayed() && h.runs() == 2,
        "a replay after the retention ran out"
    );
    Ok(())
}

/// "A client that retries a request with the same Idempotency-Key gets either the response the
/// first attempt stored or a first run of the handler, never both": clients racing on keys
/// through two processes (on either path); each key's handler runs once, every client gets its one response.
async fn concurrent(ctx: Ctx, path: Path) -> Outcome {
    let h = Handler::new(&ctx, "a").extra(|_, _| std::thread::sleep(Duration::from_millis(5)));
    let mut apps = Vec::new();
    for holder in ["host-a", "host-b"] {
        apps.push(app(ctx.process(path, None, holder).await?, &h));
    }
    let mut clients = Vec::new();
    for client in 0..32 {
        let app = apps[client % 2].clone();
        let key = format!("key-{}", client % 4);
        clients.push(tokio::spawn(async move {
            for _ in 0..600 {
                let answer = send(&app, post(&key, "x")).await?;
                if answer.status != StatusCode::CONFLICT {
                    return Ok::<_, BoxError>((key, answer.status, answer.body));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(format!("{key}: still 409 after 600 tries").into())
        }));
    }
    let mut answers: std::collections::BTreeMap<String, Vec<Bytes>> = Default::default();
    for client in clients {
        let (key, status, body) = client.await??;
        ensure!(status == StatusCode::CREATED, "{key}: {status}");
        answers.entry(key).or_default().push(body);
    }
    for (key, bodies) in &answers {
        ensure!(
            bodies.iter().all(|body| body == &bodies[0]),
            "{key}: clients got different answers"
        );
    }
    ensure!(h.runs() == 4, "{} handler runs for 4 keys", h.runs());
    ensure!(
        ctx.rows().await?.len() == 4,
        "{} rows for 4 keys",
        ctx.rows().await?.len()
    );
    Ok(())
}

/// "a connection the layer asks for (a pooled one: anything that dereferences to a
/// tokio_postgres::Client)": one connection handed to every request in turn (an owned mutex
/// guard), through stores, replays, a 5xx, a failing statement and a dropped request (on the lease path:
/// take, complete and release on that one connection).
async fn reused_connection(ctx: Ctx, path: Path) -> Outcome {
    let shared = Arc::new(tokio::sync::Mutex::new(ctx.client().await?));
    let schema = ctx.schema.clone();
    let (gate, mut rx) = gate();
    let h = Handler::new(&ctx, "a")
        .status(|n| {
            if n == 2 {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::CREATED
            }
        })
        .extra(move |request, n| {
            if n == 3 {
                let _ = request.sql(
                    format!("INSERT INTO {schema}.missing_table VALUES (1)"),
                    vec![],
                );
            }
        })
        .gated(&gate);
    let connect = {
        let shared = shared.clone();
        move || {
            let shared = shared.clone();
            async move { Ok::<_, std::convert::Infallible>(shared.lock_owned().await) }
        }
    };
    let layer = IdempotencyLayer::postgres(ctx.consumer(None).await?, connect, tenant);
    let app = app(path.with(layer, "host-a"), &h);
    // Run 1 is held at the gate and dropped.
    let dropped = spawn_send(&app, post("k1", "x"));
    let _held = entered(&mut rx).await?;
    dropped.abort();
    let _ = dropped.await;
    gate.open();
    // Run 2: a 5xx; run 3: a failing statement; run 4 stored.
    let second = until_not_409(&app, || post("k1", "x")).await?;
    second.expect(StatusCode::INTERNAL_SERVER_ERROR)?;
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::SERVICE_UNAVAILABLE)?;
    let stored = send(&app, post("k1", "x")).await?;
    stored.expect(StatusCode::CREATED)?;
    ensure!(!stored.replayed(), "run 4 was a replay");
    let replay = send(&app, post("k1", "x")).await?;
    ensure!(replay.replayed() && replay.body == stored.body, "no replay");
    send(&app, post("k2", "y"))
        .await?
        .expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["a-4", "a-5"]).await
}

// ---------------------------------------------------------------------------------------------
// The batch path: `IdempotencyLayer::postgres`.

/// "the stored status, kept headers and body, byte for byte, plus `Idempotent-Replayed: true`;
/// the handler does not run".
async fn replay_byte_for_byte(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a").respond(|n, id| {
        let mut body: Vec<u8> = (0..=255u8).collect();
        body.extend_from_slice(format!("run {n}").as_bytes());
        Response::builder()
            .status(StatusCode::ACCEPTED)
            .header("content-type", "application/octet-stream")
            .header("location", format!("/payments/{id}"))
            .body(Body::from(body))
            .unwrap()
    });
    let app = app(ctx.layer(Batch).await?, &h);
    let first = send(&app, post("k1", "x")).await?;
    first.expect(StatusCode::ACCEPTED)?;
    for _ in 0..2 {
        let retry = send(&app, post("k1", "x")).await?;
        retry.expect(StatusCode::ACCEPTED)?;
        ensure!(retry.replayed(), "no Idempotent-Replayed: true");
        ensure!(retry.body == first.body, "body differs");
        ensure!(
            retry.header("content-type") == first.header("content-type")
                && retry.header("location") == first.header("location"),
            "kept headers differ: {:?}",
            retry.headers
        );
    }
    ensure!(h.runs() == 1, "handler ran {} times", h.runs());
    ctx.expect_rows(&["a-1"]).await
}

/// "`content-type` and `location` are replayed by default": other headers are not.
async fn replay_keeps_only_default_headers(ctx: Ctx) -> Outcome {
    let (_, app) = ctx.serve(Batch).await?;
    let first = send(&app, post("k1", "x")).await?;
    first.expect(StatusCode::CREATED)?;
    ensure!(first.all("x-custom").len() == 2, "first lacks x-custom");
    let retry = send(&app, post("k1", "x")).await?;
    ensure!(
        retry.header("content-type") == Some("text/plain"),
        "content-type not replayed"
    );
    ensure!(
        retry.header("location") == first.header("location"),
        "location not replayed"
    );
    ensure!(retry.headers.get("x-custom").is_none(), "x-custom replayed");
    Ok(())
}

/// "`replay_headers` replaces that list ... every value of each, in order".
async fn replay_headers_replaces_list(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a");
    let layer = ctx
        .layer(Batch)
        .await?
        .replay_headers([HeaderName::from_static("x-custom")]);
    let app = app(layer, &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    let retry = send(&app, post("k1", "x")).await?;
    ensure!(retry.replayed(), "not a replay");
    ensure!(
        retry.all("x-custom") == [b"one".as_slice(), b"two".as_slice()],
        "x-custom {:?}",
        retry.all("x-custom")
    );
    ensure!(
        retry.headers.get("content-type").is_none() && retry.headers.get("location").is_none(),
        "a header of the replaced default list was replayed: {:?}",
        retry.headers
    );
    Ok(())
}

/// "same key, another request (method, path, query or body): 422".
async fn reused_key_other_request_422(ctx: Ctx) -> Outcome {
    let (h, app) = ctx.serve(Batch).await?;
    send(&app, post("k1", "a"))
        .await?
        .expect(StatusCode::CREATED)?;
    let others = [
        (
            "body",
            request("POST", "/payments", Some("k1"), Some("acme"), "b"),
        ),
        (
            "path",
            request("POST", "/other", Some("k1"), Some("acme"), "a"),
        ),
        (
            "query",
            request("POST", "/payments?x=1", Some("k1"), Some("acme"), "a"),
        ),
        (
            "method",
            request("PUT", "/payments", Some("k1"), Some("acme"), "a"),
        ),
    ];
    for (what, other) in others {
        let answer = send(&app, other).await?;
        ensure!(
            answer.status == StatusCode::UNPROCESSABLE_ENTITY,
            "another {what}: {}",
            answer.status
        );
    }
    ensure!(h.runs() == 1, "runs {}", h.runs());
    let retry = send(&app, post("k1", "a")).await?;
    ensure!(retry.replayed(), "the original no longer replays");
    Ok(())
}

/// "the layer's own answers are Rejections, sent as RFC 9457 problems": `{"title", "status"}`
/// as `application/problem+json`.
async fn rejections_are_problem_json(ctx: Ctx) -> Outcome {
    let (_, app) = ctx.serve(Batch).await?;
    send(&app, post("k1", "a"))
        .await?
        .expect(StatusCode::CREATED)?;
    let reused = send(&app, post("k1", "b")).await?;
    reused.expect(StatusCode::UNPROCESSABLE_ENTITY)?;
    problem_ok(&reused)?;
    let keyless = send(&app, request("POST", "/payments", None, Some("acme"), "a")).await?;
    keyless.expect(StatusCode::BAD_REQUEST)?;
    problem_ok(&keyless)?;
    let anonymous = send(&app, request("POST", "/payments", Some("k2"), None, "a")).await?;
    anonymous.expect(StatusCode::UNAUTHORIZED)?;
    problem_ok(&anonymous)
}

/// "`fingerprint`: how a request is told apart from another sent with the same key".
async fn custom_fingerprint(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a");
    let layer = ctx
        .layer(Batch)
        .await?
        .fingerprint(|parts, _body| Fingerprint::of(parts.uri.path().as_bytes()));
    let app = app(layer, &h);
    send(&app, post("k1", "a"))
        .await?
        .expect(StatusCode::CREATED)?;
    let other_body = send(&app, post("k1", "b")).await?;
    other_body.expect(StatusCode::CREATED)?;
    ensure!(
        other_body.replayed(),
        "a body the fingerprint ignores was not replayed"
    );
    let other_path = send(
        &app,
        request("POST", "/other", Some("k1"), Some("acme"), "a"),
    )
    .await?;
    other_path.expect(StatusCode::UNPROCESSABLE_ENTITY)?;
    ensure!(h.runs() == 1, "runs {}", h.runs());
    Ok(())
}

/// "no key on a route that requires one: 400"; "two keys: 400".
async fn missing_or_repeated_key_400(ctx: Ctx) -> Outcome {
    let (h, app) = ctx.serve(Batch).await?;
    send(&app, request("POST", "/payments", None, Some("acme"), "x"))
        .await?
        .expect(StatusCode::BAD_REQUEST)?;
    let twice = Request::post("/payments")
        .header("x-tenant", "acme")
        .header("idempotency-key", "k1")
        .header("idempotency-key", "k1")
        .body(Body::from("x"))?;
    send(&app, twice).await?.expect(StatusCode::BAD_REQUEST)?;
    ensure!(h.runs() == 0, "runs {}", h.runs());
    ensure!(ctx.rows().await?.is_empty(), "rows written");
    Ok(())
}

/// "an empty one, one over KEY_BYTES_MAX bytes, or neither a quoted string of printable ASCII
/// nor a bare token of visible ASCII: 400".
async fn malformed_keys_400(ctx: Ctx) -> Outcome {
    let (h, app) = ctx.serve(Batch).await?;
    let long_bare = "a".repeat(256);
    let long_quoted = format!("\"{}\"", "a".repeat(256));
    let values: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"\"\"".to_vec(),
        long_bare.into_bytes(),
        long_quoted.into_bytes(),
        b"a b".to_vec(),
        b"a\"b".to_vec(),
        b"\"abc".to_vec(),
        b"\"a\\nb\"".to_vec(),
        b"\xff\xfe".to_vec(),
        b"a\tb".to_vec(),
        b"\"a\tb\"".to_vec(),
        b"\"caf\xc3\xa9\"".to_vec(),
    ];
    for value in values {
        let bad = Request::post("/payments")
            .header("x-tenant", "acme")
            .header("idempotency-key", HeaderValue::from_bytes(&value)?)
            .body(Body::from("x"))?;
        let answer = send(&app, bad).await?;
        ensure!(
            answer.status == StatusCode::BAD_REQUEST,
            "key {:?}: {}",
            String::from_utf8_lossy(&value),
            answer.status
        );
    }
    ensure!(h.runs() == 0, "runs {}", h.runs());
    Ok(())
}

/// "Keys are 1 to 255 ASCII characters (KEY_BYTES_MAX)", counted "after the quotes and
/// escapes of the draft's string form are taken off"; "spaces allowed" when quoted.
async fn key_limits_after_unquoting(ctx: Ctx) -> Outcome {
    let (h, app) = ctx.serve(Batch).await?;
    let bare = "b".repeat(255);
    let quoted = format!("\"{}\\\\\"", "q".repeat(254)); // 254 + an escaped backslash
    for key in [
        bare.as_str(),
        quoted.as_str(),
        "\"with spaces inside\"",
        "x",
    ] {
        let answer = send(&app, post(key, "x")).await?;
        ensure!(
            answer.status == StatusCode::CREATED,
            "key {key:?}: {} {}",
            answer.status,
            answer.text()
        );
    }
    ensure!(h.runs() == 4, "runs {}", h.runs());
    Ok(())
}

/// "The draft's string form (`"8e03978e"`) and a bare token (`8e03978e`) name the same key",
/// escapes taken off.
async fn quoted_and_bare_forms_same_key(ctx: Ctx) -> Outcome {
    let (h, app) = ctx.serve(Batch).await?;
    send(&app, post("\"8e03978e\"", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    let bare = send(&app, post("8e03978e", "x")).await?;
    ensure!(
        bare.replayed(),
        "bare form of a quoted key ran again: {}",
        bare.status
    );
    send(&app, post("\"a\\\\b\"", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    let bare = send(&app, post("a\\b", "x")).await?;
    ensure!(
        bare.replayed(),
        "bare a\\b did not replay quoted \"a\\\\b\": {}",
        bare.status
    );
    ensure!(h.runs() == 2, "runs {}", h.runs());
    Ok(())
}

/// "no principal: 401", the key "checked before the principal": neither is 400.
async fn no_principal_401_key_checked_first(ctx: Ctx) -> Outcome {
    let (h, app) = ctx.serve(Batch).await?;
    send(&app, request("POST", "/payments", Some("k1"), None, "x"))
        .await?
        .expect(StatusCode::UNAUTHORIZED)?;
    send(&app, request("POST", "/payments", None, None, "x"))
        .await?
        .expect(StatusCode::BAD_REQUEST)?;
    send(&app, request("POST", "/payments", Some("a b"), None, "x"))
        .await?
        .expect(StatusCode::BAD_REQUEST)?;
    ensure!(h.runs() == 0, "runs {}", h.runs());
    Ok(())
}

/// "the same key from two principals names two requests": each runs, each replays its own.
async fn principals_scope_keys(ctx: Ctx) -> Outcome {
    let (h, app) = ctx.serve(Batch).await?;
    let by = |tenant: &str| request("POST", "/payments", Some("k1"), Some(tenant), "x");
    let acme = send(&app, by("acme")).await?;
    acme.expect(StatusCode::CREATED)?;
    let globex = send(&app, by("globex")).await?;
    globex.expect(StatusCode::CREATED)?;
    ensure!(!globex.replayed(), "globex got a replay of acme's response");
    ensure!(h.runs() == 2, "runs {}", h.runs());
    let acme_again = send(&app, by("acme")).await?;
    let globex_again = send(&app, by("globex")).await?;
    ensure!(
        acme_again.replayed() && acme_again.body == acme.body,
        "acme's replay"
    );
    ensure!(
        globex_again.replayed() && globex_again.body == globex.body,
        "globex's replay"
    );
    Ok(())
}

/// "`key_optional()` lets keyless requests through untouched: no principal is asked for, the
/// body is not read or limited, and the handler gets no IdempotentRequest"; "a request with a
/// key is handled as on any route, a malformed key refused with 400".
async fn key_optional(ctx: Ctx) -> Outcome {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let layer = ctx.layer(Batch).await?.key_optional().request_body_limit(8);
    let app = Router::new()
        .route(
            "/payments",
            any(
                move |request: Option<Extension<IdempotentRequest>>, body: Bytes| {
                    let n = counted.fetch_add(1, SeqCst) + 1;
                    async move {
                        let has = if request.is_some() { "with" } else { "without" };
                        format!("{has} {n} {}", body.len())
                    }
                },
            ),
        )
        .layer(layer);
    let big = "y".repeat(100);
    let keyless = send(&app, request("POST", "/payments", None, None, big.clone())).await?;
    keyless.expect(StatusCode::OK)?;
    ensure!(
        keyless.text() == "without 1 100",
        "keyless answer {}",
        keyless.text()
    );
    let keyless = send(&app, request("POST", "/payments", None, None, big)).await?;
    ensure!(
        keyless.text() == "without 2 100" && !keyless.replayed(),
        "keyless again {}",
        keyless.text()
    );
    let keyed = send(&app, post("k1", "x")).await?;
    ensure!(keyed.text() == "with 3 1", "keyed answer {}", keyed.text());
    let keyed = send(&app, post("k1", "x")).await?;
    ensure!(
        keyed.replayed() && keyed.text() == "with 3 1",
        "keyed retry not replayed"
    );
    send(&app, post("a b", "x"))
        .await?
        .expect(StatusCode::BAD_REQUEST)?;
    send(&app, request("POST", "/payments", Some("k2"), None, "x"))
        .await?
        .expect(StatusCode::UNAUTHORIZED)?;
    send(&app, post("k3", "123456789"))
        .await?
        .expect(StatusCode::PAYLOAD_TOO_LARGE)?;
    ensure!(runs.load(SeqCst) == 3, "runs {}", runs.load(SeqCst));
    Ok(())
}

/// "request body over the limit: 413, before the handler runs" (and nothing claimed: the key
/// then runs with a body within the limit).
async fn request_body_limit_413(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a");
    let app = app(ctx.layer(Batch).await?.request_body_limit(16), &h);
    send(&app, post("k1", "x".repeat(17)))
        .await?
        .expect(StatusCode::PAYLOAD_TOO_LARGE)?;
    ensure!(h.runs() == 0, "the handler ran on a 413");
    send(&app, post("k1", "x".repeat(16)))
        .await?
        .expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["a-1"]).await
}

/// "request body over the limit (1 MiB by default): 413"; "a response to store over the limit
/// (1 MiB by default): 500; nothing stored, key free".
async fn default_body_limits(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a").respond(|n, _| {
        let len = RESPONSE_BODY_BYTES_DEFAULT + usize::from(n == 1);
        Response::builder()
            .status(StatusCode::OK)
            .body(Body::from(vec![b'r'; len]))
            .unwrap()
    });
    let app = app(ctx.layer(Batch).await?, &h);
    send(&app, post("k1", vec![b'q'; REQUEST_BODY_BYTES_DEFAULT + 1]))
        .await?
        .expect(StatusCode::PAYLOAD_TOO_LARGE)?;
    ensure!(h.runs() == 0, "the handler ran on a 413");
    let body = vec![b'q'; REQUEST_BODY_BYTES_DEFAULT];
    send(&app, post("k2", body.clone()))
        .await?
        .expect(StatusCode::INTERNAL_SERVER_ERROR)?;
    ensure!(
        ctx.rows().await?.is_empty(),
        "an oversized response's SQL was committed"
    );
    let second = send(&app, post("k2", body.clone())).await?;
    second.expect(StatusCode::OK)?;
    ensure!(
        second.body.len() == RESPONSE_BODY_BYTES_DEFAULT && !second.replayed(),
        "second run"
    );
    let replay = send(&app, post("k2", body)).await?;
    ensure!(
        replay.replayed() && replay.body == second.body,
        "a 1 MiB response did not replay"
    );
    ctx.expect_rows(&["a-2"]).await
}

/// "A kept header value over 64 KiB cannot be stored: the response is answered as one over
/// the size limit (500, nothing stored, the key free)".
async fn kept_header_over_64k_500(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a").respond(|n, _| {
        let len = if n == 1 { 70_000 } else { 10 };
        Response::builder()
            .status(StatusCode::CREATED)
            .header("x-big", "v".repeat(len))
            .body(Body::from("ok"))
            .unwrap()
    });
    let layer = ctx
        .layer(Batch)
        .await?
        .replay_headers([HeaderName::from_static("x-big")]);
    let app = app(layer, &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::INTERNAL_SERVER_ERROR)?;
    ensure!(ctx.rows().await?.is_empty(), "rows written");
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    let replay = send(&app, post("k1", "x")).await?;
    ensure!(
        replay.replayed() && replay.header("x-big") == Some("vvvvvvvvvv"),
        "replay"
    );
    Ok(())
}

/// "the handler answers 5xx: sent as is; nothing stored, writes dropped, key free: a retry runs
/// the handler again".
async fn handler_5xx_not_stored_key_free(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a").status(|n| {
        if n == 1 {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::CREATED
        }
    });
    let app = app(ctx.layer(Batch).await?, &h);
    let failed = send(&app, post("k1", "x")).await?;
    failed.expect(StatusCode::INTERNAL_SERVER_ERROR)?;
    ensure!(
        failed.text().starts_with("a run 1 "),
        "the handler's 500 was not sent as is: {}",
        failed.text()
    );
    ensure!(ctx.rows().await?.is_empty(), "a 5xx's SQL was committed");
    let retry = send(&app, post("k1", "x")).await?;
    ctx.expect_second_run(&retry, &h).await
}

/// "A 5xx is never stored, whatever `store` says".
async fn store_when_never_stores_5xx(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a").status(|n| {
        if n == 1 {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::CREATED
        }
    });
    let app = app(ctx.layer(Batch).await?.store_when(|_| true), &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::SERVICE_UNAVAILABLE)?;
    ensure!(ctx.rows().await?.is_empty(), "a 503's SQL was committed");
    let retry = send(&app, post("k1", "x")).await?;
    retry.expect(StatusCode::CREATED)?;
    ensure!(!retry.replayed(), "a 5xx was stored");
    ctx.expect_one_insert_sent().await
}

/// "By default only 2xx responses are stored; everything else frees the key".
async fn unstored_4xx_and_3xx_key_free(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a").status(|n| match n {
        1 => StatusCode::BAD_REQUEST,
        2 => StatusCode::SEE_OTHER,
        _ => StatusCode::CREATED,
    });
    let app = app(ctx.layer(Batch).await?, &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::BAD_REQUEST)?;
    let redirect = send(&app, post("k1", "x")).await?;
    redirect.expect(StatusCode::SEE_OTHER)?;
    ensure!(!redirect.replayed(), "a 400 was stored");
    let created = send(&app, post("k1", "x")).await?;
    created.expect(StatusCode::CREATED)?;
    ensure!(!created.replayed(), "a 303 was stored");
    ctx.expect_rows(&["a-3"]).await?;
    ctx.expect_one_insert_sent().await
}

/// "A 4xx that a retry would get again (a declined card: 402) can be stored with
/// `store_when`", with the handler's writes.
async fn store_when_402_stored_with_sql(ctx: Ctx) -> Outcome {
    let h = Handler::new(&ctx, "a").status(|_| StatusCode::PAYMENT_REQUIRED);
    let layer = ctx
        .layer(Batch)
        .await?
        .store_when(|status| status.is_success() || status == StatusCode::PAYMENT_REQUIRED);
    let app = app(layer, &h);
    let first = send(&app, post("k1", "x")).await?;
    first.expect(StatusCode::PAYMENT_REQUIRED)?;
    ctx.expect_rows(&["a-1"]).await?;
    let retry = send(&app, post("k1", "x")).await?;
    retry.expect(StatusCode::PAYMENT_REQUIRED)?;
    ensure!(
        retry.replayed() && retry.body == first.body,
        "the 402 was not replayed"
    );
    ensure!(h.runs() == 1, "runs {}", h.runs());
    Ok(())
}

/// "`sql`: run in the request's transaction, in the order staged, by the commit".
async fn sql_runs_in_order_staged(ctx: Ctx) -> Outcome {
    let schema = ctx.schema.clone();
    let h = Handler::new(&ctx, "a").extra(move |request, n| {
        let _ = request.sql(
            format!(
                "UPDATE {schema}.payments SET body = convert_to('second', 'UTF8') WHERE id = $1"
            ),
            vec![(Box::new(format!("a-{n}")), Type::TEXT)],
        );
    });
    let app = app(ctx.layer(Batch).await?, &h);
    send(&app, post("k1", "first"))
        .await?
        .expect(StatusCode::CREATED)?;
    let rows = ctx.rows().await?;
    ensure!(
        rows == vec![("a-1".to_owned(), b"second".to_vec())],
        "rows {rows:?}"
    );
    Ok(())
}

/// "the future is dropped (client gone, timeout, panic): nothing stored, key free" — even with
/// a clone of the handle still alive (the test holds one).
async fn dropped_request_stores_nothing(ctx: Ctx) -> Outcome {
    let (gate, mut rx) = gate();
    let h = Handler::new(&ctx, "a").gated(&gate);
    let app = app(ctx.layer(Batch).await?, &h);
    let first = spawn_send(&app, post("k1", "x"));
    let kept = entered(&mut rx).await?;
    first.abort();
    let _ = first.await;
    let retry = until_not_409(&app, || post("k1", "x")).await?;
    // Checked with the clone gone too: dropping it late sends nothing.
    drop(kept);
    ctx.expect_second_run(&retry, &h).await
}

/// "`epoch`: 1 for a key's first request ... On the batch path a response not stored leaves
/// no record, so a retry's epoch stays 1".
async fn epoch_stays_1_on_batch_path(ctx: Ctx) -> Outcome {
    let epochs: Arc<Mutex<Vec<u64>>> = Arc::default();
    let seen = epochs.clone();
    let h = Handler::new(&ctx, "a")
        .status(|n| {
            if n == 1 {
                StatusCode::BAD_GATEWAY
            } else {
                StatusCode::CREATED
            }
        })
        .extra(move |request, _| seen.lock().unwrap().push(request.epoch().unwrap_or(0)));
    let app = app(ctx.layer(Batch).await?, &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::BAD_GATEWAY)?;
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    let epochs = epochs.lock().unwrap().clone();
    ensure!(epochs == [1, 1], "epochs {epochs:?}");
    Ok(())
}

/// "`derive_key`: the same principal, key and step give the same value across retries";
/// design: `"idk1-"` and 32 lowercase hex digits.
async fn derive_key_stable_across_retries(ctx: Ctx) -> Outcome {
    let keys: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let seen = keys.clone();
    let h = Handler::new(&ctx, "a")
        .status(|n| {
            if n == 1 {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::CREATED
            }
        })
        .extra(move |request, _| {
            let payment = request.derive_key("payment").unwrap_or_default();
            let refund = request.derive_key("refund").unwrap_or_default();
            seen.lock().unwrap().push((payment, refund));
        });
    let app = app(ctx.layer(Batch).await?, &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::SERVICE_UNAVAILABLE)?;
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    send(
        &app,
        request("POST", "/payments", Some("k1"), Some("globex"), "x"),
    )
    .await?
    .expect(StatusCode::CREATED)?;
    let keys = keys.lock().unwrap().clone();
    ensure!(keys.len() == 3, "runs {}", keys.len());
    ensure!(
        keys[0] == keys[1],
        "derive_key changed across retries: {keys:?}"
    );
    ensure!(keys[0].0 != keys[0].1, "two steps gave one key");
    ensure!(keys[2].0 != keys[0].0, "two principals gave one key");
    let payment = &keys[0].0;
    ensure!(
        payment.len() == 37
            && payment.starts_with("idk1-")
            && payment[5..]
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
        "derived key {payment:?} is not idk1- and 32 lowercase hex digits"
    );
    Ok(())
}

/// "Each keyed request's claim is a transaction on a connection the layer asks for ... The
/// connection goes back (is dropped) when the claim ends".
async fn one_connection_per_keyed_request(ctx: Ctx) -> Outcome {
    let (gate, mut rx) = gate();
    let (consumer, pool) = ctx.pg().await?;
    let h = Handler::new(&ctx, "a").gated(&gate);
    let app = app(pg_layer(consumer, &pool), &h);
    let first = spawn_send(&app, post("k1", "x"));
    let _held = entered(&mut rx).await?;
    ensure!(
        pool.live() == 1 && pool.connects() == 1,
        "while the handler runs: {} live, {} asked",
        pool.live(),
        pool.connects()
    );
    gate.open();
    first.await??.expect(StatusCode::CREATED)?;
    pool.until_none_live().await?;
    ensure!(send(&app, post("k1", "x")).await?.replayed(), "no replay");
    pool.until_none_live().await?;
    ensure!(
        pool.connects() == 2,
        "{} connections for two keyed requests",
        pool.connects()
    );
    Ok(())
}

/// design.md: the claim's result is `[1][status u16 BE][count u16 BE]`, per kept header
/// `[name len u16][name][value len u16][value]`, then the body; kept for the retention (7 days
/// by default).
async fn stored_record_format(ctx: Ctx) -> Outcome {
    let (consumer, pool) = ctx.pg().await?;
    let h = Handler::new(&ctx, "a");
    let app = app(pg_layer(consumer.clone(), &pool), &h);
    let first = send(&app, post("k1", "x")).await?;
    first.expect(StatusCode::CREATED)?;
    let location = first.header("location").ok_or("no location")?.to_owned();
    let client = ctx.client().await?;
    let record = consumer
        .get(&client, scoped("acme", "k1"))
        .await?
        .ok_or("no record under [len][principal][key]")?;
    let mut expected = vec![1u8, 0, 201, 0, 2];
    for (name, value) in [
        ("content-type", "text/plain"),
        ("location", location.as_str()),
    ] {
        expected.extend_from_slice(&u16::try_from(name.len())?.to_be_bytes());
        expected.extend_from_slice(name.as_bytes());
        expected.extend_from_slice(&u16::try_from(value.len())?.to_be_bytes());
        expected.extend_from_slice(value.as_bytes());
    }
    expected.extend_from_slice(&first.body);
    match record.state {
        RecordState::Completed {
            committed_at_ms,
            expires_at_ms,
            result,
            ..
        } => {
            ensure!(
                result.as_ref() == expected.as_slice(),
                "stored {:?}\nexpected {:?}",
                result,
                expected
            );
            ensure!(
                expires_at_ms - committed_at_ms == 7 * 24 * 3600 * 1000,
                "kept {} ms",
                expires_at_ms - committed_at_ms
            );
        }
        other => return Err(format!("record state {other:?}").into()),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The lease path: `IdempotencyLayer::postgres(...).with_lease(lease, holder)`.

/// "its in-progress record is committed before the handler runs", the holder "kept with the
/// lease for operators", the lease on the store's clock.
async fn lease_in_progress_committed_before_handler(ctx: Ctx) -> Outcome {
    let clock = mock_clock();
    let start = clock.now_ms();
    let (gate, mut rx) = gate();
    let consumer = ctx.consumer(Some(&clock)).await?;
    let pool = ctx.pool();
    let h = Handler::new(&ctx, "a").gated(&gate);
    let app = app(Lease.layer(consumer, &pool, "host-a"), &h);
    let first = spawn_send(&app, post("k1", "x"));
    let _held = entered(&mut rx).await?;
    let admin = ctx.consumer(Some(&clock)).await?;
    let client = ctx.client().await?;
    let listed = admin.in_progress(&client, Duration::ZERO, 10).await?;
    gate.open();
    let answer = first.await??;
    ensure!(
        listed.len() == 1,
        "{} in progress while the handler runs",
        listed.len()
    );
    let entry = &listed[0];
    ensure!(
        entry.message_key.as_ref() == scoped("acme", "k1").as_slice(),
        "message key {:?}",
        entry.message_key
    );
    ensure!(
        entry.holder.as_ref() == b"host-a",
        "holder {:?}",
        entry.holder
    );
    ensure!(entry.epoch == 1, "epoch {}", entry.epoch);
    ensure!(
        entry.lease_until_ms == start + 10_000,
        "lease until {} (mock clock {start} + 10 s = {})",
        entry.lease_until_ms,
        start + 10_000
    );
    answer.expect(StatusCode::CREATED)?;
    let after = admin.in_progress(&client, Duration::ZERO, 10).await?;
    ensure!(
        after.is_empty(),
        "still in progress after completing: {after:?}"
    );
    Ok(())
}

/// "no connection is held while the handler runs. The layer asks its connect function for one
/// to take the lease, again to complete it".
async fn lease_no_connection_held_while_handler_runs(ctx: Ctx) -> Outcome {
    let (gate, mut rx) = gate();
    let consumer = ctx.consumer(None).await?;
    let pool = ctx.pool();
    let h = Handler::new(&ctx, "a").gated(&gate);
    let app = app(Lease.layer(consumer, &pool, "host-a"), &h);
    let first = spawn_send(&app, post("k1", "x"));
    let _held = entered(&mut rx).await?;
    let (live, asked) = (pool.live(), pool.connects());
    gate.open();
    first.await??.expect(StatusCode::CREATED)?;
    ensure!(live == 0, "{live} connections held while the handler runs");
    ensure!(
        asked == 1,
        "{asked} connections asked for before the handler ran"
    );
    pool.until_none_live().await?;
    ensure!(
        pool.connects() == 2,
        "{} connections asked for: take and complete",
        pool.connects()
    );
    Ok(())
}

/// Two lease layers on one database sharing a mock clock; A's first run held at a gate.
struct Takeover {
    clock: MockClock,
    gate: Gate,
    held: IdempotentRequest,
    first: tokio::task::JoinHandle<Result<Answer, BoxError>>,
    a: Handler,
    app_a: Router,
    b: Handler,
    app_b: Router,
}

async fn takeover(ctx: &Ctx, b_extra: Option<Extra>) -> Result<Takeover, BoxError> {
    let clock = mock_clock();
    let (gate, mut rx) = gate();
    let a = Handler::new(ctx, "a").gated(&gate);
    let app_a = app(ctx.process(Lease, Some(&clock), "host-a").await?, &a);
    let mut b = Handler::new(ctx, "b");
    b.extra = b_extra;
    let app_b = app(ctx.process(Lease, Some(&clock), "host-b").await?, &b);
    let first = spawn_send(&app_a, post("k1", "x"));
    let held = entered(&mut rx).await?;
    Ok(Takeover {
        clock,
        gate,
        held,
        first,
        a,
        app_a,
        b,
        app_b,
    })
}

/// "Once it runs out, a retry takes the key over ... The request that outlived its lease and
/// was taken over is fenced: its completion fails, nothing it staged is written, and it answers
/// 503 with Retry-After; the client's retry gets the response of the request that took over".
async fn lease_takeover_late_request_fenced(ctx: Ctx) -> Outcome {
    let t = takeover(&ctx, None).await?;
    t.clock.advance(LEASE);
    let taken = send(&t.app_b, post("k1", "x")).await?;
    taken.expect(StatusCode::CREATED)?;
    ensure!(t.b.runs() == 1, "B did not run its handler");
    t.gate.open();
    let late = t.first.await??;
    late.expect(StatusCode::SERVICE_UNAVAILABLE)?;
    ensure!(
        late.header("retry-after").is_some(),
        "the fenced 503 has no Retry-After"
    );
    ctx.expect_rows(&["b-1"]).await?;
    let retry = send(&t.app_a, post("k1", "x")).await?;
    ensure!(
        retry.replayed() && retry.body == taken.body,
        "A's retry did not get B's response"
    );
    ensure!(t.a.runs() == 1, "A ran again");
    ctx.expect_one_insert_sent().await
}

/// "`renew`: Store with LeaseLost if another request took the key over"; on PostgreSQL
/// "a renewal's LeaseLost ... comes here too".
async fn lease_late_renew_async_lease_lost(ctx: Ctx) -> Outcome {
    let t = takeover(&ctx, None).await?;
    t.clock.advance(LEASE);
    send(&t.app_b, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    let renewed = t.held.renew_async(LEASE).await;
    t.gate.open();
    let _ = t.first.await;
    ensure!(
        matches!(
            renewed,
            Err(StageError::Store(idemdb::Error::LeaseLost { .. }))
        ),
        "late renewal: {renewed:?}"
    );
    Ok(())
}

/// "`epoch`: one more for each lease held on the key before (taken over after it ran out)";
/// `derive_key` the same "across ... takeovers of a lease".
async fn lease_takeover_epoch_and_derive_key(ctx: Ctx) -> Outcome {
    let seen: Arc<Mutex<Vec<(u64, String)>>> = Arc::default();
    let record = seen.clone();
    let t = takeover(
        &ctx,
        Some(Arc::new(move |request: &IdempotentRequest, _| {
            record.lock().unwrap().push((
                request.epoch().unwrap_or(0),
                request.derive_key("charge").unwrap_or_default(),
            ));
        })),
    )
    .await?;
    let a_epoch = t.held.epoch()?;
    let a_key = t.held.derive_key("charge")?;
    t.clock.advance(LEASE);
    send(&t.app_b, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    t.gate.open();
    let _ = t.first.await;
    let seen = seen.lock().unwrap().clone();
    ensure!(a_epoch == 1, "A's epoch {a_epoch}");
    ensure!(seen.len() == 1 && seen[0].0 == 2, "B's epoch: {seen:?}");
    ensure!(seen[0].1 == a_key, "derive_key differs across the takeover");
    Ok(())
}

/// idemdb-postgres: "a lease that runs until lease_until_ms holds the key through
/// lease_until_ms - 1, and from lease_until_ms on another claimant takes it over".
async fn lease_holds_until_last_ms(ctx: Ctx) -> Outcome {
    let t = takeover(&ctx, None).await?;
    t.clock.advance(LEASE - Duration::from_millis(1));
    let held = send(&t.app_b, post("k1", "x")).await?;
    t.clock.advance(Duration::from_millis(1));
    let taken = send(&t.app_b, post("k1", "x")).await?;
    t.gate.open();
    let _ = t.first.await;
    held.expect(StatusCode::CONFLICT)?;
    taken.expect(StatusCode::CREATED)?;
    Ok(())
}

/// "`renew_async`: the new deadline, in ms since the Unix epoch" on "the store's injected" clock;
/// a renewed lease holds the key past its first deadline.
async fn lease_renew_async_extends(ctx: Ctx) -> Outcome {
    let t = takeover(&ctx, None).await?;
    let start = t.clock.now_ms();
    t.clock.advance(Duration::from_secs(5));
    let deadline = t.held.renew_async(Duration::from_secs(60)).await;
    t.clock.advance(Duration::from_secs(30));
    let other = send(&t.app_b, post("k1", "x")).await?;
    t.gate.open();
    let first = t.first.await??;
    ensure!(
        matches!(deadline, Ok(ms) if ms == start + 65_000),
        "renew_async answered {deadline:?}, expected Ok({})",
        start + 65_000
    );
    other.expect(StatusCode::CONFLICT)?;
    first.expect(StatusCode::CREATED)?;
    ensure!(t.b.runs() == 0, "B took a renewed lease over");
    ensure!(
        send(&t.app_b, post("k1", "x")).await?.replayed(),
        "B did not replay"
    );
    Ok(())
}

/// "Outliving the lease with no takeover is harmless: nobody else ran, and its response is
/// stored as usual".
async fn lease_outlived_without_takeover_completes(ctx: Ctx) -> Outcome {
    let t = takeover(&ctx, None).await?;
    t.clock.advance(Duration::from_secs(60));
    t.gate.open();
    let first = t.first.await??;
    first.expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["a-1"]).await?;
    let replay = send(&t.app_b, post("k1", "x")).await?;
    ensure!(
        replay.replayed() && replay.body == first.body,
        "no replay of the late response"
    );
    Ok(())
}

/// "A 5xx, a status not stored and a dropped request release the lease, so that a retry runs at
/// once"; `epoch` "one more for each lease ... released after a response that was not stored".
async fn lease_unstored_responses_release_at_once(ctx: Ctx) -> Outcome {
    let epochs: Arc<Mutex<Vec<u64>>> = Arc::default();
    let seen = epochs.clone();
    let h = Handler::new(&ctx, "a")
        .status(|n| match n {
            1 => StatusCode::INTERNAL_SERVER_ERROR,
            2 => StatusCode::NOT_FOUND,
            _ => StatusCode::CREATED,
        })
        .extra(move |request, _| seen.lock().unwrap().push(request.epoch().unwrap_or(0)));
    let app = app(ctx.process(Lease, None, "host-a").await?, &h);
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::INTERNAL_SERVER_ERROR)?;
    send(&app, post("k1", "x"))
        .await?
        .expect(StatusCode::NOT_FOUND)?;
    let third = send(&app, post("k1", "x")).await?;
    third.expect(StatusCode::CREATED)?;
    ensure!(!third.replayed(), "a replay");
    ctx.expect_rows(&["a-3"]).await?;
    let epochs = epochs.lock().unwrap().clone();
    ensure!(epochs == [1, 2, 3], "epochs {epochs:?}");
    ctx.expect_one_insert_sent().await
}

/// "a dropped request release[s] the lease": another process runs the key with the lease's time
/// not run out (the store's mock clock stands still).
async fn lease_dropped_request_releases(ctx: Ctx) -> Outcome {
    let t = takeover(&ctx, None).await?;
    t.first.abort();
    let _ = t.first.await;
    let retry = until_not_409(&t.app_b, || post("k1", "x")).await?;
    retry.expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["b-1"]).await?;
    drop(t.held);
    ctx.expect_one_insert_sent().await
}

/// "the store fails: 503, with Retry-After when transient; nothing is stored": the completion
/// without a connection; the key runs again once the lease is out.
async fn lease_completion_without_connection(ctx: Ctx) -> Outcome {
    let clock = mock_clock();
    let pool = ctx.pool();
    let refuse = pool.fail.clone();
    let h = Handler::new(&ctx, "a").extra(move |_, n| {
        if n == 1 {
            refuse.store(true, SeqCst);
        }
    });
    let app = app(
        Lease.layer(ctx.consumer(Some(&clock)).await?, &pool, "host-a"),
        &h,
    );
    let answer = send(&app, post("k1", "x")).await?;
    pool.fail.store(false, SeqCst);
    answer.expect(StatusCode::SERVICE_UNAVAILABLE)?;
    ensure!(answer.header("retry-after").is_some(), "no Retry-After");
    ensure!(ctx.rows().await?.is_empty(), "rows written");
    clock.advance(LEASE);
    let retry = send(&app, post("k1", "x")).await?;
    retry.expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["a-2"]).await
}

/// "the lease ... holds the key across every process on the database and across their
/// restarts": a process gone without releasing (its request's future never dropped) holds the
/// key in a new process until the lease runs out, which then takes it over.
async fn lease_holds_across_restart(ctx: Ctx) -> Outcome {
    let clock = mock_clock();
    let (gate, mut rx) = gate();
    let a = Handler::new(&ctx, "a").gated(&gate);
    let app_a = app(ctx.process(Lease, Some(&clock), "host-a").await?, &a);
    // The "process" that dies: its request is left at the gate, never completed nor dropped.
    let first = spawn_send(&app_a, post("k1", "x"));
    let held = entered(&mut rx).await?;
    std::mem::forget(held);
    std::mem::forget(first);
    let b = Handler::new(&ctx, "b");
    let app_b = app(ctx.process(Lease, Some(&clock), "host-b").await?, &b);
    clock.advance(Duration::from_secs(9));
    send(&app_b, post("k1", "x"))
        .await?
        .expect(StatusCode::CONFLICT)?;
    clock.advance(Duration::from_secs(1));
    send(&app_b, post("k1", "x"))
        .await?
        .expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["b-1"]).await?;
    gate.open();
    Ok(())
}

/// "principals 1 to 255 bytes" (`InvalidPrincipal` outside); design: the longest principal
/// with the longest key, "511 bytes at most, within the message-key limit", is stored.
async fn longest_principal_and_key(ctx: Ctx) -> Outcome {
    ensure!(
        Principal::new("").is_err(),
        "an empty principal was accepted"
    );
    ensure!(
        Principal::new("p".repeat(256)).is_err(),
        "a 256-byte principal was accepted"
    );
    ensure!(
        Principal::new("p".repeat(255)).is_ok(),
        "a 255-byte principal was refused"
    );
    let (_, app) = ctx.serve(Batch).await?;
    let principal = "p".repeat(255);
    let key = "k".repeat(255);
    let make = || request("POST", "/payments", Some(&key), Some(&principal), "x");
    send(&app, make()).await?.expect(StatusCode::CREATED)?;
    let retry = send(&app, make()).await?;
    ensure!(
        retry.replayed(),
        "no replay for the longest principal and key: {}",
        retry.status
    );
    Ok(())
}

/// The late request is fenced while the request that took over still runs: `503` with the
/// layer's `Retry-After` (`retry_after`: "of a retryable 503"), nothing of it written; the
/// client's retry meanwhile is `409`, then gets the other's response.
async fn lease_fenced_while_takeover_in_progress(ctx: Ctx) -> Outcome {
    let clock = mock_clock();
    let (gate_a, mut rx_a) = gate();
    let (gate_b, mut rx_b) = gate();
    let a = Handler::new(&ctx, "a").gated(&gate_a);
    let layer_a = ctx
        .process(Lease, Some(&clock), "host-a")
        .await?
        .retry_after(Duration::from_secs(4));
    let app_a = app(layer_a, &a);
    let b = Handler::new(&ctx, "b").gated(&gate_b);
    let app_b = app(ctx.process(Lease, Some(&clock), "host-b").await?, &b);
    let first = spawn_send(&app_a, post("k1", "x"));
    let _a = entered(&mut rx_a).await?;
    clock.advance(LEASE);
    let second = spawn_send(&app_b, post("k1", "x"));
    let _b = entered(&mut rx_b).await?;
    gate_a.open();
    let late = first.await??;
    let meanwhile = send(&app_a, post("k1", "x")).await?;
    gate_b.open();
    let taken = second.await??;
    late.expect(StatusCode::SERVICE_UNAVAILABLE)?;
    ensure!(
        late.header("retry-after") == Some("4"),
        "fenced 503's Retry-After {:?}",
        late.header("retry-after")
    );
    meanwhile.expect(StatusCode::CONFLICT)?;
    taken.expect(StatusCode::CREATED)?;
    ctx.expect_rows(&["b-1"]).await?;
    let retry = send(&app_a, post("k1", "x")).await?;
    ensure!(
        retry.replayed() && retry.body == taken.body,
        "A's retry did not get B's response"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The runner.

type Scenario = fn(Ctx) -> Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// `name` runs the scenario `name(ctx)`; `name = shared(Path)` runs `shared(ctx, Path)`
/// under that name, so a body shared by both paths keeps each path's scenario name.
macro_rules! scenarios {
    (@one $name:ident) => {
        (stringify!($name), (|ctx| Box::pin($name(ctx))) as Scenario)
    };
    (@one $name:ident $shared:ident $path:ident) => {
        (stringify!($name), (|ctx| Box::pin($shared(ctx, $path))) as Scenario)
    };
    ($($name:ident $(= $shared:ident($path:ident))?),* $(,)?) => {
        vec![$(scenarios!(@one $name $($shared $path)?)),*]
    };
}

#[test]
fn docs_promises_postgres() {
    let server = match server::Server::start() {
        Ok(server) => server,
        Err(why) => {
            eprintln!("docs_promises_postgres skipped: no PostgreSQL server ({why})");
            return;
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let all: Vec<(&str, Scenario)> = scenarios![
        first_request_runs_handler_and_commits_sql = first_request_commits_sql(Batch),
        replay_byte_for_byte,
        replay_keeps_only_default_headers,
        replay_headers_replaces_list,
        reused_key_other_request_422,
        rejections_are_problem_json,
        custom_fingerprint,
        in_flight_409_from_other_store_then_replay = in_flight_409_then_replay(Batch),
        missing_or_repeated_key_400,
        malformed_keys_400,
        key_limits_after_unquoting,
        quoted_and_bare_forms_same_key,
        no_principal_401_key_checked_first,
        principals_scope_keys,
        key_optional,
        request_body_limit_413,
        default_body_limits,
        response_body_limit_500_key_free = response_too_large_500_key_free(Batch),
        kept_header_over_64k_500,
        handler_5xx_not_stored_key_free,
        store_when_never_stores_5xx,
        unstored_4xx_and_3xx_key_free,
        store_when_402_stored_with_sql,
        failing_statement_503_nothing_written = failing_statement_503_key_free(Batch),
        sql_runs_in_order_staged,
        dropped_request_stores_nothing,
        panicking_handler_stores_nothing = panicking_handler_key_free(Batch),
        connect_failure_503_retry_after = connect_failure_503(Batch),
        kept_handle_claim_gone = kept_handle_claim_gone_on(Batch),
        renew_without_lease_no_lease = renew_while_running(Batch),
        epoch_stays_1_on_batch_path,
        derive_key_stable_across_retries,
        retention_expiry_exact_ms = retention_expiry(Batch),
        one_connection_per_keyed_request,
        stored_record_format,
        lease_in_progress_committed_before_handler,
        lease_no_connection_held_while_handler_runs,
        lease_409_from_other_store_while_live = in_flight_409_then_replay(Lease),
        lease_completion_commits_sql_and_replays = first_request_commits_sql(Lease),
        lease_takeover_late_request_fenced,
        lease_late_renew_async_lease_lost,
        lease_takeover_epoch_and_derive_key,
        lease_holds_until_last_ms,
        lease_renew_async_extends,
        lease_renew_errors = renew_while_running(Lease),
        lease_outlived_without_takeover_completes,
        lease_unstored_responses_release_at_once,
        lease_dropped_request_releases,
        lease_panic_releases = panicking_handler_key_free(Lease),
        lease_failing_statement_releases = failing_statement_503_key_free(Lease),
        lease_response_too_large_releases = response_too_large_500_key_free(Lease),
        lease_connect_failure_503_retry_after = connect_failure_503(Lease),
        lease_completion_without_connection,
        lease_kept_handle_claim_gone = kept_handle_claim_gone_on(Lease),
        lease_holds_across_restart,
        longest_principal_and_key,
        concurrent_retries_one_run_per_key = concurrent(Batch),
        lease_concurrent_retries_one_run_per_key = concurrent(Lease),
        lease_retention_expiry_exact_ms = retention_expiry(Lease),
        lease_fenced_while_takeover_in_progress,
        one_reused_connection = reused_connection(Batch),
        lease_one_reused_connection = reused_connection(Lease),
    ];
    let only = std::env::var("DOCS_PG_ONLY").ok();
    let mut failed = Vec::new();
    let mut findings = Vec::new();
    let mut run = 0;
    for (i, (name, scenario)) in all.into_iter().enumerate() {
        if only.as_deref().is_some_and(|only| !name.contains(only)) {
            continue;
        }
        run += 1;
        let ctx = Ctx {
            url: server.url(),
            schema: format!("docs_{i}"),
        };
        let result: Outcome = runtime.block_on(async move {
            ctx.install().await?;
            let task = tokio::spawn(scenario(ctx));
            match tokio::time::timeout(Duration::from_secs(90), task).await {
                Err(_) => Err("timed out after 90 s".into()),
                Ok(Err(join)) => Err(format!("panicked: {join}").into()),
                Ok(Ok(result)) => result,
            }
        });
        let expected_failure = FINDINGS.contains(&name);
        match (&result, expected_failure) {
            (Ok(()), false) => println!("scenario {name} ... ok"),
            (Ok(()), true) => println!("scenario {name} ... ok (listed as a finding: now passes)"),
            (Err(why), true) => {
                println!("scenario {name} ... FAILED (finding): {why}");
                findings.push(name);
            }
            (Err(why), false) => {
                println!("scenario {name} ... FAILED: {why}");
                failed.push(name);
            }
        }
    }
    println!(
        "docs_promises_postgres: {run} scenarios, {} passed, {} findings (expected failures), {} unexpected failures",
        run - findings.len() - failed.len(),
        findings.len(),
        failed.len()
    );
    for name in &findings {
        println!("  finding: {name}");
    }
    drop(runtime);
    assert!(failed.is_empty(), "unexpected failures: {failed:?}");
}
