//! Every promise of idemdb-http's documentation (the crate docs, the public items' doc comments
//! and docs/guide/06-http-idempotency-keys.md), tested as a user reads it.

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use idemdb::{
    BusinessTable, Clock, Engine, Fault, FaultInjector, Fingerprint, IoPoint, MockClock,
    TableOptions,
};
use idemdb_http::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer, IdempotentRequest, KEY_BYTES_MAX,
    PRINCIPAL_BYTES_MAX, Principal, REQUEST_BODY_BYTES_DEFAULT, RESPONSE_BODY_BYTES_DEFAULT,
    RETRY_AFTER_DEFAULT, Rejection, StageError,
};
use parking_lot::Mutex;
use tokio::sync::{Semaphore, mpsc};
use tower::ServiceExt;

const T0: u64 = 1_700_000_000_000;
const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Fixture
// ---------------------------------------------------------------------------------------------

/// What the handler saw on one run.
#[derive(Debug, Clone)]
struct Seen {
    epoch: u64,
    derived: String,
}

#[derive(Clone)]
struct Ctx {
    runs: Arc<AtomicUsize>,
    table: BusinessTable,
    clock: MockClock,
    gate: Arc<Semaphore>,
    entered: mpsc::UnboundedSender<usize>,
    seen: Arc<Mutex<Vec<Seen>>>,
    renews: Arc<Mutex<Vec<Renewal>>>,
}

/// A handler's `renew` call: its run and the answer.
type Renewal = (usize, Result<u64, StageError>);

struct Fx {
    dir: tempfile::TempDir,
    clock: MockClock,
    engine: Engine,
    table: BusinessTable,
    ctx: Ctx,
    entered: mpsc::UnboundedReceiver<usize>,
}

fn open_at(path: &Path, clock: &MockClock, retention: Option<Duration>) -> (Engine, BusinessTable) {
    let mut builder = Engine::builder(path)
        .clock(clock.clone())
        .business_table(TableOptions::new("payments"));
    if let Some(retention) = retention {
        builder = builder.retention(retention);
    }
    let engine = builder.open().expect("open the store");
    let table = engine.business_table("payments").unwrap();
    (engine, table)
}

/// Reopens a store whose handles were all dropped (bounded polling: the engine closes when its
/// last handle is gone, which may trail the drop by the committer's last write).
fn reopen_at(
    path: &Path,
    clock: &MockClock,
    retention: Option<Duration>,
) -> (Engine, BusinessTable) {
    for _ in 0..500 {
        let mut builder = Engine::builder(path)
            .clock(clock.clone())
            .business_table(TableOptions::new("payments"));
        if let Some(retention) = retention {
            builder = builder.retention(retention);
        }
        match builder.open() {
            Ok(engine) => {
                let table = engine.business_table("payments").unwrap();
                return (engine, table);
            }
            Err(idemdb::Error::AlreadyOpen { .. }) => std::thread::sleep(Duration::from_millis(10)),
            Err(other) => panic!("reopen failed: {other}"),
        }
    }
    panic!("the store never closed");
}

fn ctx_for(table: &BusinessTable, clock: &MockClock) -> (Ctx, mpsc::UnboundedReceiver<usize>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        Ctx {
            runs: Arc::new(AtomicUsize::new(0)),
            table: table.clone(),
            clock: clock.clone(),
            gate: Arc::new(Semaphore::new(0)),
            entered: tx,
            seen: Arc::default(),
            renews: Arc::default(),
        },
        rx,
    )
}

fn fx_with(retention: Option<Duration>) -> Fx {
    let dir = tempfile::tempdir().unwrap();
    let clock = MockClock::new(T0);
    let (engine, table) = open_at(dir.path(), &clock, retention);
    let (ctx, entered) = ctx_for(&table, &clock);
    Fx {
        dir,
        clock,
        engine,
        table,
        ctx,
        entered,
    }
}

fn fx() -> Fx {
    fx_with(None)
}

/// The principal is the `x-tenant` header.
fn tenant(parts: &Parts) -> Option<Principal> {
    Principal::new(parts.headers.get("x-tenant")?.as_bytes()).ok()
}

impl Fx {
    fn layer(&self) -> IdempotencyLayer {
        IdempotencyLayer::new(self.engine.consumer("payments").unwrap(), tenant)
    }
    fn app(&self, layer: IdempotencyLayer) -> Router {
        make_app(layer, &self.ctx)
    }
    fn runs(&self) -> usize {
        self.ctx.runs.load(Ordering::SeqCst)
    }
    fn stored(&self, key: &str) -> Option<Vec<u8>> {
        self.table.get(key.as_bytes()).unwrap()
    }
}

fn make_app(layer: IdempotencyLayer, ctx: &Ctx) -> Router {
    let c = ctx.clone();
    let h =
        move |Extension(request): Extension<IdempotentRequest>, headers: HeaderMap, body: Bytes| {
            let c = c.clone();
            async move { handle(c, request, headers, body).await }
        };
    Router::new()
        .route("/p", post(h.clone()).put(h.clone()))
        .route("/q", post(h))
        .layer(layer)
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.to_str().unwrap())
}

/// The test handler. It stages `body` under `x-write` (default `w`) and answers `x-status`
/// (default 201) with `run N` (or `x-len` bytes), plus headers `content-type`, `location`,
/// `x-custom` and two `x-multi`. `x-hold` waits at the gate, `x-hang` never returns, `x-panic`
/// panics after staging, `x-yield` yields a few times, `x-advance-ms` advances the mock clock,
/// `x-renew-ms` renews the lease first, `x-renew-after-ms` renews after the hold.
async fn handle(c: Ctx, request: IdempotentRequest, headers: HeaderMap, body: Bytes) -> Response {
    let run = c.runs.fetch_add(1, Ordering::SeqCst) + 1;
    c.seen.lock().push(Seen {
        epoch: request.epoch().unwrap(),
        derived: request.derive_key("charge").unwrap(),
    });
    if let Some(ms) = header(&headers, "x-renew-ms") {
        let result = request.renew(Duration::from_millis(ms.parse().unwrap()));
        c.renews.lock().push((run, result));
    }
    let write = header(&headers, "x-write").unwrap_or("w").to_owned();
    request.put(&c.table, write.as_bytes(), &body).unwrap();
    if let Some(ms) = header(&headers, "x-advance-ms") {
        c.clock.advance(Duration::from_millis(ms.parse().unwrap()));
    }
    if headers.contains_key("x-yield") {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }
    if headers.contains_key("x-hold") {
        c.entered.send(run).unwrap();
        c.gate.acquire().await.unwrap().forget();
    }
    if headers.contains_key("x-hang") {
        c.entered.send(run).unwrap();
        std::future::pending::<()>().await;
    }
    if let Some(ms) = header(&headers, "x-renew-after-ms") {
        let result = request.renew(Duration::from_millis(ms.parse().unwrap()));
        c.renews.lock().push((run, result));
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panics on purpose");
    }
    let status: u16 = header(&headers, "x-status").map_or(201, |s| s.parse().unwrap());
    let out = match header(&headers, "x-len") {
        Some(len) => vec![b'r'; len.parse().unwrap()],
        None => format!("run {run}").into_bytes(),
    };
    Response::builder()
        .status(status)
        .header("content-type", "text/plain")
        .header("location", "/p/1")
        .header("x-custom", "c")
        .header("x-multi", "1")
        .header("x-multi", "2")
        .body(Body::from(out))
        .unwrap()
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn replayed(&self) -> bool {
        match self.headers.get(IDEMPOTENT_REPLAYED) {
            None => false,
            Some(v) => {
                assert_eq!(v, "true", "Idempotent-Replayed is `true` when present");
                true
            }
        }
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    fn retry_after(&self) -> Option<&str> {
        header(&self.headers, "retry-after")
    }
}

async fn call(app: &Router, request: Request<Body>) -> Reply {
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// Sends `request` on a task of its own.
fn spawn_call(app: &Router, request: Request<Body>) -> tokio::task::JoinHandle<Reply> {
    let app = app.clone();
    tokio::spawn(async move { call(&app, request).await })
}

/// Sends a request with `x-hold` (its handler waits at the gate) on a task of its own.
fn spawn_held(
    app: &Router,
    key: &'static str,
    body: &'static str,
) -> tokio::task::JoinHandle<Reply> {
    spawn_call(
        app,
        rq(key)
            .header("x-hold", "1")
            .body(Body::from(body))
            .unwrap(),
    )
}

/// A POST to /p by tenant `acme` with `key` as the raw header value.
fn rq(key: &str) -> axum::http::request::Builder {
    Request::post("/p")
        .header("x-tenant", "acme")
        .header(IDEMPOTENCY_KEY, key)
}

fn post_key(key: &str, body: &str) -> Request<Body> {
    rq(key).body(Body::from(body.to_owned())).unwrap()
}

/// A body whose every read fails.
struct FailingBody;

impl http_body::Body for FailingBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        Poll::Ready(Some(Err(std::io::Error::other("the body fails"))))
    }
}

#[derive(Debug, Clone, Default)]
struct FailWrites(Arc<AtomicBool>);

impl FaultInjector for FailWrites {
    fn fault(&self, point: IoPoint) -> Fault {
        if point == IoPoint::Write && self.0.load(Ordering::SeqCst) {
            Fault::FailBefore
        } else {
            Fault::None
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Constants, principals, rejections
// ---------------------------------------------------------------------------------------------

#[test]
fn constants_are_the_documented_values() {
    assert_eq!(KEY_BYTES_MAX, 255);
    assert_eq!(PRINCIPAL_BYTES_MAX, 255);
    assert_eq!(REQUEST_BODY_BYTES_DEFAULT, MIB);
    assert_eq!(RESPONSE_BODY_BYTES_DEFAULT, MIB);
    assert_eq!(RETRY_AFTER_DEFAULT, Duration::from_secs(1));
    assert_eq!(IDEMPOTENCY_KEY.as_str(), "idempotency-key");
    assert_eq!(IDEMPOTENT_REPLAYED.as_str(), "idempotent-replayed");
}

#[test]
fn principal_is_1_to_255_bytes() {
    let max = vec![0xffu8; 255];
    assert_eq!(Principal::new(&max).unwrap().as_bytes(), &max[..]);
    assert_eq!(Principal::new([0u8]).unwrap().as_bytes(), &[0u8][..]);
    assert!(Principal::new(vec![b'p'; 256]).is_err());
    assert!(Principal::new(b"").is_err());
}

#[test]
fn rejection_statuses_are_the_documented_ones() {
    use Rejection::*;
    let expected = [
        (KeyMissing, 400),
        (KeyRepeated, 400),
        (KeyMalformed, 400),
        (NoPrincipal, 401),
        (RequestTooLarge, 413),
        (RequestBodyUnreadable, 400),
        (KeyReused, 422),
        (InProgress, 409),
        (ResponseTooLarge, 500),
        (ResponseBodyFailed, 500),
        (StoreUnavailable { retryable: true }, 503),
        (StoreUnavailable { retryable: false }, 503),
        (LeaseLost, 503),
        (StoredResponseCorrupt, 500),
    ];
    for (rejection, status) in expected {
        assert_eq!(rejection.status().as_u16(), status, "{rejection:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// First request, replay, headers
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn first_request_runs_and_its_writes_commit_with_the_response() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let first = call(&app, post_key("k1", "{\"amount\": 100}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.text(), "run 1");
    assert!(!first.replayed(), "a first run is not marked as a replay");
    // The first response goes out as the handler made it, unkept headers included.
    assert_eq!(header(&first.headers, "x-custom"), Some("c"));
    assert_eq!(fx.stored("w").as_deref(), Some(&b"{\"amount\": 100}"[..]));
    assert_eq!(fx.runs(), 1);
}

#[tokio::test]
async fn retry_replays_status_kept_headers_and_body_byte_for_byte() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let first = call(
        &app,
        rq("k1")
            .header("x-status", "202")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let retry = call(
        &app,
        rq("k1")
            .header("x-status", "202")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(fx.runs(), 1, "the handler does not run again");
    assert_eq!(retry.status, StatusCode::ACCEPTED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    // Default kept headers: content-type and location, and nothing else but the marker.
    assert_eq!(header(&retry.headers, "content-type"), Some("text/plain"));
    assert_eq!(header(&retry.headers, "location"), Some("/p/1"));
    assert!(
        retry.headers.get("x-custom").is_none(),
        "{:?}",
        retry.headers
    );
    assert!(
        retry.headers.get("x-multi").is_none(),
        "{:?}",
        retry.headers
    );
    // A third time, the same.
    let third = call(
        &app,
        rq("k1")
            .header("x-status", "202")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!((third.status, third.body), (retry.status, retry.body));
    assert_eq!(fx.runs(), 1);
}

#[tokio::test]
async fn replay_of_binary_body_is_byte_for_byte() {
    let fx = fx();
    let c = fx.ctx.clone();
    let payload: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let p2 = payload.clone();
    let h = move |Extension(_r): Extension<IdempotentRequest>| {
        let c = c.clone();
        let p = p2.clone();
        async move {
            c.runs.fetch_add(1, Ordering::SeqCst);
            Response::builder()
                .status(200)
                .header("content-type", "application/octet-stream")
                .body(Body::from(p))
                .unwrap()
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    let first = call(&app, post_key("bin", "")).await;
    let retry = call(&app, post_key("bin", "")).await;
    assert_eq!(first.body.as_ref(), &payload[..]);
    assert_eq!(retry.body.as_ref(), &payload[..]);
    assert!(retry.replayed());
    assert_eq!(fx.runs(), 1);
}

#[tokio::test]
async fn replay_headers_keeps_every_value_of_each_in_order() {
    let fx = fx();
    let layer = fx.layer().replay_headers([
        HeaderName::from_static("x-multi"),
        HeaderName::from_static("content-type"),
    ]);
    let app = fx.app(layer);
    call(&app, post_key("k1", "b")).await;
    let retry = call(&app, post_key("k1", "b")).await;
    assert!(retry.replayed());
    let multi: Vec<_> = retry.headers.get_all("x-multi").iter().collect();
    assert_eq!(multi, ["1", "2"], "every value, in order");
    assert_eq!(header(&retry.headers, "content-type"), Some("text/plain"));
    // The list replaces the default: `location` was not named.
    assert!(
        retry.headers.get("location").is_none(),
        "{:?}",
        retry.headers
    );
    assert!(retry.headers.get("x-custom").is_none());
}

// ---------------------------------------------------------------------------------------------
// Key forms and limits
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn quoted_string_form_and_bare_form_name_the_same_key() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let first = call(&app, post_key("\"8e03978e\"", "b")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let bare = call(&app, post_key("8e03978e", "b")).await;
    assert!(bare.replayed(), "bare after quoted: {bare:?}");
    let first = call(&app, post_key("abc", "b")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let quoted = call(&app, post_key("\"abc\"", "b")).await;
    assert!(quoted.replayed(), "quoted after bare: {quoted:?}");
    assert_eq!(fx.runs(), 2);
}

#[tokio::test]
async fn escapes_in_the_string_form_are_unescaped() {
    let fx = fx();
    let app = fx.app(fx.layer());
    // "a\"b\\c" is the key a"b\c.
    let first = call(&app, post_key(r#""a\"b\\c""#, "b")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let again = call(&app, post_key(r#""a\"b\\c""#, "b")).await;
    assert!(again.replayed());
    // "x\\y" is the key x\y, the same as the bare x\y (both visible ASCII).
    let first = call(&app, post_key(r#""x\\y""#, "b")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let bare = call(&app, post_key(r"x\y", "b")).await;
    assert!(
        bare.replayed(),
        "bare x\\y after quoted \"x\\\\y\": {bare:?}"
    );
    // "x\\y" and "x\y"-as-escape differ from the key x\\y (two backslashes).
    let other = call(&app, post_key(r"x\\y", "b")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_eq!(fx.runs(), 3);
}

#[tokio::test]
async fn invalid_escapes_and_unterminated_strings_are_400() {
    let fx = fx();
    let app = fx.app(fx.layer());
    for key in [r#""a\nb""#, r#""ab\""#, r#""a"b""#] {
        let reply = call(&app, post_key(key, "b")).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "key {key}");
    }
    assert_eq!(fx.runs(), 0);
}

#[tokio::test]
async fn key_of_255_bytes_is_accepted_and_256_refused_in_both_forms() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let k255 = "k".repeat(255);
    let k256 = "k".repeat(256);
    let bare = call(&app, post_key(&k255, "b")).await;
    assert_eq!(bare.status, StatusCode::CREATED);
    let quoted = call(&app, post_key(&format!("\"{k255}\""), "b")).await;
    assert!(
        quoted.replayed(),
        "257-byte header, 255-byte key: {quoted:?}"
    );
    assert_eq!(
        call(&app, post_key(&k256, "b")).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        call(&app, post_key(&format!("\"{k256}\""), "b"))
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    // 255 bytes after unescaping, with escapes making the header longer.
    let escaped_key = format!("{}\"\\", "e".repeat(253)); // 255 bytes
    let escaped_header = format!("\"{}\\\"\\\\\"", "e".repeat(253));
    assert_eq!(escaped_key.len(), 255);
    let reply = call(&app, post_key(&escaped_header, "b")).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    let again = call(&app, post_key(&escaped_header, "b")).await;
    assert!(again.replayed());
    // 256 after unescaping.
    let escaped_256 = format!("\"{}\\\"\\\\\"", "e".repeat(254));
    assert_eq!(
        call(&app, post_key(&escaped_256, "b")).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(fx.runs(), 2);
}

#[tokio::test]
async fn missing_repeated_empty_and_non_visible_keys_are_400_before_the_handler() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let missing = call(
        &app,
        Request::post("/p")
            .header("x-tenant", "acme")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    let repeated = call(
        &app,
        rq("k1")
            .header(IDEMPOTENCY_KEY, "k2")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(repeated.status, StatusCode::BAD_REQUEST);
    // Even two identical values are two keys.
    let same_twice = call(
        &app,
        rq("k1")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(same_twice.status, StatusCode::BAD_REQUEST);
    for key in ["", "\"\"", "a b", "a\tb"] {
        assert_eq!(
            call(&app, post_key(key, "b")).await.status,
            StatusCode::BAD_REQUEST,
            "key {key:?}"
        );
    }
    let non_ascii = call(
        &app,
        Request::post("/p")
            .header("x-tenant", "acme")
            .header(
                IDEMPOTENCY_KEY,
                HeaderValue::from_bytes(b"caf\xe9").unwrap(),
            )
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(non_ascii.status, StatusCode::BAD_REQUEST);
    assert_eq!(fx.runs(), 0);
}

#[tokio::test]
async fn a_space_is_allowed_inside_the_string_form_only() {
    // Guide: keys in "the draft's string form (printable ASCII ..., spaces allowed) or a bare
    // token (visible ASCII, no spaces or double quotes)".
    let fx = fx();
    let app = fx.app(fx.layer());
    let reply = call(&app, post_key("\"a b\"", "b")).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert!(call(&app, post_key("\"a b\"", "b")).await.replayed());
    for bare in ["\"abc", "\"", "ab\"c"] {
        let reply = call(&app, post_key(bare, "b")).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bare}: {reply:?}");
    }
}

#[tokio::test]
async fn rejections_are_rfc9457_problems() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let reply = call(
        &app,
        Request::post("/p")
            .header("x-tenant", "acme")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        header(&reply.headers, "content-type"),
        Some("application/problem+json")
    );
    let text = reply.text().replace(' ', "");
    assert!(text.contains("\"title\":"), "{text}");
    assert!(text.contains("\"status\":400"), "{text}");
}

// ---------------------------------------------------------------------------------------------
// Principals
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn no_principal_is_401_and_the_handler_does_not_run() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let none = call(
        &app,
        Request::post("/p")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(none.status, StatusCode::UNAUTHORIZED);
    let too_long = call(
        &app,
        Request::post("/p")
            .header("x-tenant", "t".repeat(256))
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(
        too_long.status,
        StatusCode::UNAUTHORIZED,
        "Principal::new refuses 256 bytes"
    );
    assert_eq!(fx.runs(), 0);
}

#[tokio::test]
async fn longest_principal_with_longest_key_is_stored_and_replayed() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let send = || {
        Request::post("/p")
            .header("x-tenant", HeaderValue::from_bytes(&[0xfe; 255]).unwrap())
            .header(IDEMPOTENCY_KEY, format!("\"{}\"", "z".repeat(255)))
            .body(Body::from("b"))
            .unwrap()
    };
    let first = call(&app, send()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retry = call(&app, send()).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(fx.runs(), 1);
}

#[tokio::test]
async fn the_same_key_from_two_principals_names_two_requests() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let by = |tenant: &str| {
        Request::post("/p")
            .header("x-tenant", tenant)
            .header(IDEMPOTENCY_KEY, "shared")
            .body(Body::from("b"))
            .unwrap()
    };
    let a = call(&app, by("alpha")).await;
    let b = call(&app, by("beta")).await;
    assert_eq!((a.text().as_str(), a.replayed()), ("run 1", false));
    assert_eq!(
        (b.text().as_str(), b.replayed()),
        ("run 2", false),
        "beta is not answered with alpha's response"
    );
    let a2 = call(&app, by("alpha")).await;
    let b2 = call(&app, by("beta")).await;
    assert_eq!((a2.text().as_str(), a2.replayed()), ("run 1", true));
    assert_eq!((b2.text().as_str(), b2.replayed()), ("run 2", true));
    // derive_key differs across principals.
    let seen = fx.ctx.seen.lock().clone();
    assert_ne!(seen[0].derived, seen[1].derived);
    // No two (principal, key) pairs meet: ("ab", "c") and ("a", "bc").
    let pair = |tenant: &str, key: &str| {
        Request::post("/p")
            .header("x-tenant", tenant)
            .header(IDEMPOTENCY_KEY, key)
            .body(Body::from("b"))
            .unwrap()
    };
    let x = call(&app, pair("ab", "c")).await;
    let y = call(&app, pair("a", "bc")).await;
    assert!(!x.replayed() && !y.replayed());
    assert_eq!(fx.runs(), 4);
}

// ---------------------------------------------------------------------------------------------
// 422 and fingerprints
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn same_key_on_another_request_is_422_and_the_handler_does_not_run() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let first = call(
        &app,
        Request::post("/p?x=1")
            .header("x-tenant", "acme")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("body"))
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let variant = |method: &str, uri: &str, body: &str| {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("x-tenant", "acme")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    for (what, request) in [
        ("body", variant("POST", "/p?x=1", "other")),
        ("path", variant("POST", "/q?x=1", "body")),
        ("query", variant("POST", "/p?x=2", "body")),
        ("no query", variant("POST", "/p", "body")),
        ("method", variant("PUT", "/p?x=1", "body")),
    ] {
        let reply = call(&app, request).await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "another {what}: {reply:?}"
        );
    }
    assert_eq!(fx.runs(), 1);
    let retry = call(&app, variant("POST", "/p?x=1", "body")).await;
    assert!(retry.replayed());
}

#[tokio::test]
async fn a_custom_fingerprint_decides_what_a_reused_key_is() {
    let fx = fx();
    // Only the path: a retry with another body is the same request.
    let layer = fx
        .layer()
        .fingerprint(|parts, _body| Fingerprint::of(parts.uri.path()));
    let app = fx.app(layer);
    call(&app, post_key("k1", "one")).await;
    let other_body = call(&app, post_key("k1", "two")).await;
    assert!(other_body.replayed(), "{other_body:?}");
    let other_path = call(
        &app,
        Request::post("/q")
            .header("x-tenant", "acme")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("one"))
            .unwrap(),
    )
    .await;
    assert_eq!(other_path.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(fx.runs(), 1);
}

// ---------------------------------------------------------------------------------------------
// Statuses stored or not
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_status_not_stored_goes_out_drops_the_writes_and_frees_the_key() {
    let fx = fx();
    let app = fx.app(fx.layer());
    for status in ["402", "404", "303", "409"] {
        let key = format!("k-{status}");
        let send = || {
            rq(&key)
                .header("x-status", status)
                .header("x-write", &key)
                .body(Body::from("b"))
                .unwrap()
        };
        let before = fx.runs();
        let first = call(&app, send()).await;
        assert_eq!(first.status.as_str(), status);
        assert!(
            first.text().starts_with("run "),
            "the handler's response goes out"
        );
        assert_eq!(
            fx.stored(&key),
            None,
            "{status}: the handler's writes are dropped"
        );
        let retry = call(&app, send()).await;
        assert!(!retry.replayed(), "{status}");
        assert_eq!(
            fx.runs(),
            before + 2,
            "{status}: a retry runs the handler again"
        );
    }
}

#[tokio::test]
async fn store_when_stores_a_402_with_the_handlers_writes() {
    let fx = fx();
    let layer = fx
        .layer()
        .store_when(|s| s.is_success() || s == StatusCode::PAYMENT_REQUIRED);
    let app = fx.app(layer);
    let send = || {
        rq("k1")
            .header("x-status", "402")
            .body(Body::from("declined"))
            .unwrap()
    };
    let first = call(&app, send()).await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(fx.stored("w").as_deref(), Some(&b"declined"[..]));
    let retry = call(&app, send()).await;
    assert_eq!(retry.status, StatusCode::PAYMENT_REQUIRED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(fx.runs(), 1);
    // 2xx still stored, 404 still not.
    let ok = call(&app, post_key("k2", "b")).await;
    assert!(!ok.replayed());
    assert!(call(&app, post_key("k2", "b")).await.replayed());
    let nf = || {
        rq("k3")
            .header("x-status", "404")
            .header("x-write", "w3")
            .body(Body::from("b"))
            .unwrap()
    };
    call(&app, nf()).await;
    assert!(!call(&app, nf()).await.replayed());
    assert_eq!(fx.stored("w3"), None);
}

#[tokio::test]
async fn a_5xx_is_never_stored_even_when_store_when_says_so() {
    let fx = fx();
    let layer = fx.layer().store_when(|_| true);
    let app = fx.app(layer);
    for status in ["500", "502", "503", "599"] {
        let key = format!("k-{status}");
        let send = || {
            rq(&key)
                .header("x-status", status)
                .header("x-write", &key)
                .body(Body::from("b"))
                .unwrap()
        };
        let before = fx.runs();
        let first = call(&app, send()).await;
        assert_eq!(first.status.as_str(), status);
        assert!(first.text().starts_with("run "), "sent as is");
        assert_eq!(fx.stored(&key), None, "{status}: writes dropped");
        let retry = call(&app, send()).await;
        assert!(!retry.replayed());
        assert_eq!(fx.runs(), before + 2, "{status}: key free");
    }
    // And |_| true does store a 4xx.
    let send = || {
        rq("k4")
            .header("x-status", "418")
            .body(Body::from("b"))
            .unwrap()
    };
    call(&app, send()).await;
    assert!(call(&app, send()).await.replayed());
}

// ---------------------------------------------------------------------------------------------
// In progress: 409, concurrency
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn the_same_key_sent_concurrently_runs_the_handler_exactly_once() {
    for round in 0..5 {
        let fx = fx();
        let app = fx.app(fx.layer());
        let key = format!("race-{round}");
        let mut tasks = Vec::new();
        for _ in 0..48 {
            let app = app.clone();
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                call(
                    &app,
                    rq(&key)
                        .header("x-yield", "1")
                        .body(Body::from("b"))
                        .unwrap(),
                )
                .await
            }));
        }
        let mut fresh = 0;
        let mut fresh_body = None;
        let mut replays = Vec::new();
        for task in tasks {
            let reply = task.await.unwrap();
            match reply.status {
                StatusCode::CREATED if reply.replayed() => replays.push(reply.body),
                StatusCode::CREATED => {
                    fresh += 1;
                    fresh_body = Some(reply.body);
                }
                StatusCode::CONFLICT => {
                    assert!(reply.retry_after().is_some(), "409 has Retry-After")
                }
                other => panic!("unexpected {other}: {reply:?}"),
            }
        }
        assert_eq!(fresh, 1, "exactly one first run");
        assert_eq!(fx.runs(), 1, "the handler ran once");
        let fresh_body = fresh_body.unwrap();
        assert!(replays.iter().all(|b| *b == fresh_body));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_while_the_first_is_held_get_409_with_retry_after() {
    let mut fx = fx();
    let app = fx.app(fx.layer());
    let first = spawn_held(&app, "k1", "b");
    fx.entered.recv().await.unwrap();
    let mut retries = Vec::new();
    for _ in 0..16 {
        let app = app.clone();
        retries.push(tokio::spawn(async move {
            call(
                &app,
                rq("k1")
                    .header("x-hold", "1")
                    .body(Body::from("b"))
                    .unwrap(),
            )
            .await
        }));
    }
    for retry in retries {
        let reply = retry.await.unwrap();
        assert_eq!(reply.status, StatusCode::CONFLICT);
        assert_eq!(reply.retry_after(), Some("1"));
    }
    fx.ctx.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let after = call(
        &app,
        rq("k1")
            .header("x-hold", "1")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert!(after.replayed());
    assert_eq!(fx.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_sets_the_409_header_in_whole_seconds_rounded_up_at_least_one() {
    // retry_after: "whole seconds, rounded up, at least 1".
    for (after, header) in [(7_900, "8"), (7_000, "7"), (1, "1"), (0, "1")] {
        let mut fx = fx();
        let app = fx.app(fx.layer().retry_after(Duration::from_millis(after)));
        let first = spawn_held(&app, "k1", "b");
        fx.entered.recv().await.unwrap();
        let reply = call(
            &app,
            rq("k1")
                .header("x-hold", "1")
                .body(Body::from("b"))
                .unwrap(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::CONFLICT);
        assert_eq!(reply.retry_after(), Some(header), "{after} ms");
        fx.ctx.gate.add_permits(1);
        first.await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Dropped futures, panics, ClaimGone
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_future_stores_nothing_and_frees_the_key() {
    let mut fx = fx();
    let app = fx.app(fx.layer());
    let task = spawn_call(
        &app,
        rq("k1")
            .header("x-hang", "1")
            .header("x-write", "dropped")
            .body(Body::from("b"))
            .unwrap(),
    );
    fx.entered.recv().await.unwrap();
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let retry = call(
        &app,
        rq("k1")
            .header("x-write", "second")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(fx.runs(), 2);
    assert_eq!(fx.stored("dropped"), None);
    assert!(fx.stored("second").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_stores_nothing_and_frees_the_key() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let task = spawn_call(
        &app,
        rq("k1")
            .header("x-panic", "1")
            .header("x-write", "panicked")
            .body(Body::from("b"))
            .unwrap(),
    );
    assert!(task.await.unwrap_err().is_panic());
    let retry = call(
        &app,
        rq("k1")
            .header("x-write", "second")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(fx.stored("panicked"), None);
    assert_eq!(fx.engine.open_claims(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_kept_past_the_handler_gets_claim_gone() {
    let fx = fx();
    let table = fx.table.clone();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = Arc::new(Mutex::new(Some(go_rx)));
    let (res_tx, mut res_rx) = mpsc::unbounded_channel();
    let h = move |Extension(request): Extension<IdempotentRequest>| {
        let table = table.clone();
        let go = go_rx.lock().take().unwrap();
        let res_tx = res_tx.clone();
        async move {
            let kept = request.clone();
            std::thread::spawn(move || {
                go.recv().unwrap();
                let put = kept.put(&table, b"late", b"v");
                let delete = kept.delete(&table, b"late");
                let derive = kept.derive_key("x");
                let epoch = kept.epoch();
                res_tx.send((put, delete, derive, epoch)).unwrap();
            });
            (StatusCode::CREATED, "done")
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    let reply = call(&app, post_key("k1", "b")).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    go_tx.send(()).unwrap();
    let (put, delete, derive, epoch) = res_rx.recv().await.unwrap();
    assert!(matches!(put, Err(StageError::ClaimGone)), "{put:?}");
    assert!(matches!(delete, Err(StageError::ClaimGone)), "{delete:?}");
    assert!(matches!(derive, Err(StageError::ClaimGone)), "{derive:?}");
    assert!(matches!(epoch, Err(StageError::ClaimGone)), "{epoch:?}");
    assert_eq!(fx.stored("late"), None);
    assert!(call(&app, post_key("k1", "b")).await.replayed());
}

#[tokio::test]
async fn renew_without_a_lease_is_no_lease_and_epoch_starts_at_1() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let reply = call(
        &app,
        rq("k1")
            .header("x-renew-ms", "5000")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let renews = fx.ctx.renews.lock();
    assert!(
        matches!(renews[0].1, Err(StageError::NoLease)),
        "{:?}",
        renews[0].1
    );
    assert_eq!(fx.ctx.seen.lock()[0].epoch, 1);
}

#[tokio::test]
async fn derive_key_is_the_same_across_retries_and_differs_by_step() {
    let fx = fx();
    let c = fx.ctx.clone();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let k = keys.clone();
    let h = move |Extension(request): Extension<IdempotentRequest>| {
        let c = c.clone();
        let k = k.clone();
        async move {
            let n = c.runs.fetch_add(1, Ordering::SeqCst);
            k.lock().push((
                request.derive_key("a").unwrap(),
                request.derive_key("b").unwrap(),
            ));
            if n == 0 {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::OK
            }
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    assert_eq!(
        call(&app, post_key("k1", "b")).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(call(&app, post_key("k1", "b")).await.status, StatusCode::OK);
    let keys = keys.lock();
    assert_eq!(keys.len(), 2);
    assert_eq!(
        keys[0], keys[1],
        "same principal, key and step give the same value"
    );
    assert_ne!(keys[0].0, keys[0].1, "another step, another key");
}

// ---------------------------------------------------------------------------------------------
// Body limits and body failures
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn request_body_over_the_limit_is_413_before_the_handler() {
    let fx = fx();
    let app = fx.app(fx.layer().request_body_limit(10));
    let over = call(&app, post_key("k1", "01234567890")).await;
    assert_eq!(over.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(fx.runs(), 0);
    let at = call(&app, post_key("k1", "0123456789")).await;
    assert_eq!(
        at.status,
        StatusCode::CREATED,
        "a body at the limit, same key: {at:?}"
    );
    assert_eq!(fx.runs(), 1);
}

#[tokio::test]
async fn request_body_default_limit_is_1_mib() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let at = call(&app, rq("k1").body(Body::from(vec![b'a'; MIB])).unwrap()).await;
    assert_eq!(at.status, StatusCode::CREATED);
    let over = call(
        &app,
        rq("k2").body(Body::from(vec![b'a'; MIB + 1])).unwrap(),
    )
    .await;
    assert_eq!(over.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(fx.runs(), 1);
}

#[tokio::test]
async fn response_over_the_limit_is_500_nothing_stored_and_the_key_free() {
    let fx = fx();
    let app = fx.app(fx.layer().response_body_limit(10));
    let big = || {
        rq("k1")
            .header("x-len", "11")
            .body(Body::from("b"))
            .unwrap()
    };
    let first = call(&app, big()).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_ne!(
        first.body.as_ref(),
        &[b'r'; 11][..],
        "the large response is not sent"
    );
    assert_eq!(fx.stored("w"), None, "the handler's writes are dropped");
    let retry = call(&app, big()).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(fx.runs(), 2, "the key was free");
    // At the limit: stored and replayed.
    let fit = || {
        rq("k1")
            .header("x-len", "10")
            .body(Body::from("b"))
            .unwrap()
    };
    let stored = call(&app, fit()).await;
    assert_eq!(stored.status, StatusCode::CREATED);
    let replay = call(&app, fit()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body.as_ref(), &[b'r'; 10][..]);
    // A status not stored is sent as is, however large.
    let nf = call(
        &app,
        rq("k2")
            .header("x-status", "404")
            .header("x-len", "50")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(nf.status, StatusCode::NOT_FOUND);
    assert_eq!(nf.body.len(), 50);
}

#[tokio::test]
async fn response_body_default_limit_is_1_mib() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let at = || {
        rq("k1")
            .header("x-len", MIB.to_string())
            .body(Body::from("b"))
            .unwrap()
    };
    assert_eq!(call(&app, at()).await.status, StatusCode::CREATED);
    let replay = call(&app, at()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body.len(), MIB);
    let over = call(
        &app,
        rq("k2")
            .header("x-len", (MIB + 1).to_string())
            .header("x-write", "w2")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(over.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(fx.stored("w2"), None);
}

#[tokio::test]
async fn a_failing_response_body_is_500_and_nothing_is_stored() {
    let fx = fx();
    let c = fx.ctx.clone();
    let h = move |Extension(request): Extension<IdempotentRequest>| {
        let c = c.clone();
        async move {
            c.runs.fetch_add(1, Ordering::SeqCst);
            request.put(&c.table, b"w", b"v").unwrap();
            Response::builder()
                .status(201)
                .body(Body::new(FailingBody))
                .unwrap()
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    let reply = call(&app, post_key("k1", "b")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(fx.stored("w"), None);
    let retry = call(&app, post_key("k1", "b")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(fx.runs(), 2, "nothing was committed: the key is free");
}

#[tokio::test]
async fn a_failing_request_body_is_400_and_the_handler_does_not_run() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let reply = call(&app, rq("k1").body(Body::new(FailingBody)).unwrap()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(fx.runs(), 0);
}

// ---------------------------------------------------------------------------------------------
// key_optional
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn key_optional_lets_keyless_requests_through_untouched() {
    let fx = fx();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let h = move |request: Option<Extension<IdempotentRequest>>, body: Bytes| {
        let r = r.clone();
        async move {
            let n = r.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                format!(
                    "run {n} has_request={} body={}",
                    request.is_some(),
                    body.len()
                ),
            )
        }
    };
    let app = Router::new()
        .route("/p", post(h))
        .layer(fx.layer().key_optional());
    let keyless = || {
        Request::post("/p")
            .header("x-tenant", "acme")
            .body(Body::from("b"))
            .unwrap()
    };
    let a = call(&app, keyless()).await;
    let b = call(&app, keyless()).await;
    assert_eq!(a.text(), "run 1 has_request=false body=1");
    assert_eq!(b.text(), "run 2 has_request=false body=1");
    assert!(!b.replayed());
    // Untouched: no principal needed, and no body limit applied.
    let anonymous = call(
        &app,
        Request::post("/p")
            .body(Body::from(vec![0u8; MIB + 10]))
            .unwrap(),
    )
    .await;
    assert_eq!(anonymous.status, StatusCode::CREATED, "{anonymous:?}");
    // With a key: claimed and replayed.
    let keyed = call(&app, post_key("k1", "b")).await;
    assert!(keyed.text().contains("has_request=true"));
    assert!(call(&app, post_key("k1", "b")).await.replayed());
    // A malformed key is still refused.
    assert_eq!(
        call(&app, post_key("", "b")).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        call(&app, post_key(&"k".repeat(256), "b")).await.status,
        StatusCode::BAD_REQUEST
    );
}

// ---------------------------------------------------------------------------------------------
// Retention and reopen
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_stored_response_expires_exactly_at_the_retention_compaction_or_not() {
    let fx = fx_with(Some(Duration::from_secs(10)));
    let app = fx.app(fx.layer());
    let send = || {
        rq("k1")
            .header("x-write", "w")
            .body(Body::from("b"))
            .unwrap()
    };
    assert_eq!(call(&app, send()).await.text(), "run 1");
    fx.clock.set(T0 + 10_000 - 1);
    assert!(
        call(&app, send()).await.replayed(),
        "1 ms before the retention ends"
    );
    fx.engine.compact().unwrap();
    assert!(
        call(&app, send()).await.replayed(),
        "after a compaction, still kept"
    );
    fx.clock.set(T0 + 10_000);
    let after = call(&app, send()).await;
    assert!(
        !after.replayed(),
        "expired exactly at the retention: {after:?}"
    );
    assert_eq!(after.text(), "run 2");
    // The new run is stored for the retention from its own completion.
    fx.clock.set(T0 + 20_000 - 1);
    assert!(call(&app, send()).await.replayed());
    fx.clock.set(T0 + 20_000);
    fx.engine.compact().unwrap();
    assert_eq!(call(&app, send()).await.text(), "run 3");
}

#[tokio::test]
async fn retention_counts_from_when_the_response_was_stored() {
    let fx = fx_with(Some(Duration::from_secs(10)));
    let app = fx.app(fx.layer());
    // The handler takes 3 s on the mock clock.
    let send = || {
        rq("k1")
            .header("x-advance-ms", "3000")
            .body(Body::from("b"))
            .unwrap()
    };
    assert_eq!(call(&app, send()).await.text(), "run 1");
    fx.clock.set(T0 + 3_000 + 10_000 - 1);
    let kept = call(&app, send()).await;
    assert!(
        kept.replayed(),
        "kept for the retention after it was stored: {kept:?}"
    );
}

#[tokio::test]
async fn the_default_retention_is_7_days() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let week = 7 * 24 * 3600 * 1000;
    assert_eq!(call(&app, post_key("k1", "b")).await.text(), "run 1");
    fx.clock.set(T0 + week - 1);
    assert!(call(&app, post_key("k1", "b")).await.replayed());
    fx.clock.set(T0 + week);
    assert_eq!(call(&app, post_key("k1", "b")).await.text(), "run 2");
}

#[tokio::test]
async fn a_replay_survives_closing_and_reopening_the_store() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let first = call(
        &app,
        rq("k1")
            .header("x-status", "200")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, StatusCode::OK);
    drop(app);
    let Fx {
        dir,
        clock,
        engine,
        table,
        ctx,
        entered,
    } = fx;
    drop((engine, table, ctx, entered));
    let (engine, table) = reopen_at(dir.path(), &clock, None);
    assert_eq!(table.get(b"w").unwrap().as_deref(), Some(&b"b"[..]));
    let (ctx, _entered) = ctx_for(&table, &clock);
    let app = make_app(
        IdempotencyLayer::new(engine.consumer("payments").unwrap(), tenant),
        &ctx,
    );
    let retry = call(
        &app,
        rq("k1")
            .header("x-status", "200")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(header(&retry.headers, "content-type"), Some("text/plain"));
    assert_eq!(
        ctx.runs.load(Ordering::SeqCst),
        0,
        "the handler does not run after a reopen"
    );
    // Another request with the key is still 422.
    assert_eq!(
        call(&app, post_key("k1", "other")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
}

#[tokio::test]
async fn one_consumer_per_endpoint_keeps_their_keys_apart() {
    let fx = fx();
    let a = IdempotencyLayer::new(fx.engine.consumer("a").unwrap(), tenant);
    let b = IdempotencyLayer::new(fx.engine.consumer("b").unwrap(), tenant);
    let c = fx.ctx.clone();
    let h =
        move |Extension(request): Extension<IdempotentRequest>, headers: HeaderMap, body: Bytes| {
            let c = c.clone();
            async move { handle(c, request, headers, body).await }
        };
    let app = Router::new()
        .route("/p", post(h.clone()).layer(a))
        .route("/q", post(h).layer(b));
    let p = call(&app, post_key("k1", "b")).await;
    let q = call(
        &app,
        Request::post("/q")
            .header("x-tenant", "acme")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(
        (p.status, q.status),
        (StatusCode::CREATED, StatusCode::CREATED),
        "{q:?}"
    );
    assert!(!q.replayed());
    assert_eq!(fx.runs(), 2);
}

// ---------------------------------------------------------------------------------------------
// Store failures
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_failing_store_is_503_and_nothing_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let fail = FailWrites::default();
    let clock = MockClock::new(T0);
    let engine = Engine::builder(dir.path())
        .clock(clock.clone())
        .fault_injector(fail.clone())
        .business_table(TableOptions::new("payments"))
        .open()
        .unwrap();
    let table = engine.business_table("payments").unwrap();
    let (ctx, _entered) = ctx_for(&table, &clock);
    let app = make_app(
        IdempotencyLayer::new(engine.consumer("payments").unwrap(), tenant),
        &ctx,
    );
    fail.0.store(true, Ordering::SeqCst);
    let reply = call(&app, post_key("k1", "b")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    assert_eq!(table.get(b"w").unwrap(), None, "nothing is stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_lease_write_is_503_before_the_handler() {
    let dir = tempfile::tempdir().unwrap();
    let fail = FailWrites::default();
    let clock = MockClock::new(T0);
    let engine = Engine::builder(dir.path())
        .clock(clock.clone())
        .fault_injector(fail.clone())
        .business_table(TableOptions::new("payments"))
        .open()
        .unwrap();
    let table = engine.business_table("payments").unwrap();
    let (ctx, _entered) = ctx_for(&table, &clock);
    let layer = IdempotencyLayer::new(engine.consumer("payments").unwrap(), tenant)
        .with_lease(Duration::from_secs(30), "node-a");
    let app = make_app(layer, &ctx);
    fail.0.store(true, Ordering::SeqCst);
    let reply = call(&app, post_key("k1", "b")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    assert_eq!(ctx.runs.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------------------------------------
// The lease path
// ---------------------------------------------------------------------------------------------

const LEASE_MS: u64 = 30_000;

fn lease_layer(fx: &Fx) -> IdempotencyLayer {
    fx.layer()
        .with_lease(Duration::from_millis(LEASE_MS), "node-a")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_first_request_stores_and_replays() {
    let fx = fx();
    let app = fx.app(lease_layer(&fx));
    let first = call(&app, post_key("k1", "b")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(fx.stored("w").as_deref(), Some(&b"b"[..]));
    let retry = call(&app, post_key("k1", "b")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(
        call(&app, post_key("k1", "other")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(fx.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_takeover_after_it_runs_out_fences_the_late_request() {
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let late = spawn_call(
        &app,
        rq("k1")
            .header("x-hold", "1")
            .header("x-write", "wa")
            .header("x-renew-after-ms", "30000")
            .body(Body::from("b"))
            .unwrap(),
    );
    fx.entered.recv().await.unwrap();
    let retry = || {
        rq("k1")
            .header("x-write", "wc")
            .body(Body::from("b"))
            .unwrap()
    };
    let busy = call(&app, retry()).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert!(busy.retry_after().is_some());
    fx.clock.set(T0 + LEASE_MS - 1);
    let still = call(&app, retry()).await;
    assert_eq!(
        still.status,
        StatusCode::CONFLICT,
        "1 ms before the lease runs out: {still:?}"
    );
    fx.clock.set(T0 + LEASE_MS);
    let over = call(&app, retry()).await;
    assert_eq!(
        over.status,
        StatusCode::CREATED,
        "a takeover once the lease ran out: {over:?}"
    );
    assert!(!over.replayed());
    assert_eq!(over.text(), "run 2");
    // Release the late request: fenced.
    fx.ctx.gate.add_permits(1);
    let late = late.await.unwrap();
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE, "{late:?}");
    assert!(late.retry_after().is_some());
    assert_eq!(
        fx.stored("wa"),
        None,
        "nothing the late request staged is written"
    );
    assert_eq!(fx.stored("wc").as_deref(), Some(&b"b"[..]));
    // Its renew after the takeover is LeaseLost.
    {
        let renews = fx.ctx.renews.lock();
        assert_eq!(renews.len(), 1);
        assert!(
            matches!(
                renews[0].1,
                Err(StageError::Store(idemdb::Error::LeaseLost { .. }))
            ),
            "{:?}",
            renews[0].1
        );
    }
    // Epochs and derived keys.
    let seen = fx.ctx.seen.lock().clone();
    assert_eq!((seen[0].epoch, seen[1].epoch), (1, 2));
    assert_eq!(
        seen[0].derived, seen[1].derived,
        "derive_key is the same across a takeover"
    );
    // The client's retry gets the response of the request that took over.
    let replay = call(&app, retry()).await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "run 2");
    assert_eq!(fx.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renew_extends_the_lease_from_now() {
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let first = spawn_call(
        &app,
        rq("k1")
            .header("x-renew-ms", "60000")
            .header("x-hold", "1")
            .body(Body::from("b"))
            .unwrap(),
    );
    fx.entered.recv().await.unwrap();
    {
        let renews = fx.ctx.renews.lock();
        assert_eq!(
            renews[0].1.as_ref().unwrap(),
            &(T0 + 60_000),
            "the new deadline, on the engine's clock"
        );
    }
    fx.clock.set(T0 + LEASE_MS + 1);
    let busy = call(&app, post_key("k1", "b")).await;
    assert_eq!(
        busy.status,
        StatusCode::CONFLICT,
        "the renewed lease still holds: {busy:?}"
    );
    fx.clock.set(T0 + 60_000 - 1);
    assert_eq!(
        call(&app, post_key("k1", "b")).await.status,
        StatusCode::CONFLICT
    );
    fx.clock.set(T0 + 60_000);
    let over = call(&app, post_key("k1", "b")).await;
    assert_eq!(over.status, StatusCode::CREATED, "{over:?}");
    fx.ctx.gate.add_permits(1);
    assert_eq!(first.await.unwrap().status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renew_before_the_lease_runs_out_lets_the_request_complete() {
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let first = spawn_call(
        &app,
        rq("k1")
            .header("x-hold", "1")
            .header("x-renew-after-ms", "60000")
            .body(Body::from("b"))
            .unwrap(),
    );
    fx.entered.recv().await.unwrap();
    fx.clock.set(T0 + LEASE_MS - 1);
    fx.ctx.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(
        fx.ctx.renews.lock()[0].1.as_ref().unwrap(),
        &(T0 + LEASE_MS - 1 + 60_000)
    );
    assert!(call(&app, post_key("k1", "b")).await.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_is_released_after_a_5xx_and_after_a_dropped_request() {
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let err = call(
        &app,
        rq("k1")
            .header("x-status", "500")
            .header("x-write", "e")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(err.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(fx.stored("e"), None);
    let retry = call(&app, post_key("k1", "b")).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "no wait for the lease after a 5xx: {retry:?}"
    );
    assert!(!retry.replayed());

    let task = spawn_call(
        &app,
        rq("k2")
            .header("x-hang", "1")
            .header("x-write", "dropped")
            .body(Body::from("b"))
            .unwrap(),
    );
    fx.entered.recv().await.unwrap();
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    // The release may be a synced write off the runtime: poll, bounded, without moving the clock.
    let mut reply = None;
    for _ in 0..500 {
        let r = call(&app, post_key("k2", "b")).await;
        if r.status != StatusCode::CONFLICT {
            reply = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reply = reply.expect("a dropped request releases its lease");
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert_eq!(fx.stored("dropped"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_lease_holds_the_key_in_the_next_process() {
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let first = spawn_held(&app, "k1", "b");
    fx.entered.recv().await.unwrap();
    // The next process: a copy of the store taken while the lease is live.
    let copy = fx.dir.path().join("copy");
    fx.engine.checkpoint(&copy).unwrap();
    let clock2 = MockClock::new(fx.clock.now_ms());
    let (engine2, table2) = open_at(&copy, &clock2, None);
    let (ctx2, _e2) = ctx_for(&table2, &clock2);
    let app2 = make_app(
        IdempotencyLayer::new(engine2.consumer("payments").unwrap(), tenant)
            .with_lease(Duration::from_millis(LEASE_MS), "node-a"),
        &ctx2,
    );
    let busy = call(&app2, post_key("k1", "b")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    assert!(busy.retry_after().is_some());
    assert_eq!(ctx2.runs.load(Ordering::SeqCst), 0);
    clock2.set(T0 + LEASE_MS);
    let over = call(&app2, post_key("k1", "b")).await;
    assert_eq!(over.status, StatusCode::CREATED, "{over:?}");
    assert_eq!(ctx2.seen.lock()[0].epoch, 2);
    fx.ctx.gate.add_permits(1);
    first.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_replay_survives_a_reopen() {
    let fx = fx();
    let app = fx.app(lease_layer(&fx));
    let first = call(&app, post_key("k1", "b")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    drop(app);
    let Fx {
        dir,
        clock,
        engine,
        table,
        ctx,
        entered,
    } = fx;
    drop((engine, table, ctx, entered));
    let (engine, table) = reopen_at(dir.path(), &clock, None);
    let (ctx, _entered) = ctx_for(&table, &clock);
    let app = make_app(
        IdempotencyLayer::new(engine.consumer("payments").unwrap(), tenant)
            .with_lease(Duration::from_millis(LEASE_MS), "node-b"),
        &ctx,
    );
    let retry = call(&app, post_key("k1", "b")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(ctx.runs.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------------------------------------
// More edges a user can hit by accident
// ---------------------------------------------------------------------------------------------

/// A body in `chunks` frames of `chunk` bytes each, with no size hint.
struct Chunked {
    left: usize,
    chunk: Vec<u8>,
}

impl http_body::Body for Chunked {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from(
            self.chunk.clone(),
        )))))
    }
}

#[tokio::test]
async fn a_streamed_body_is_limited_and_fingerprinted_by_its_bytes() {
    let fx = fx();
    let app = fx.app(fx.layer().request_body_limit(10));
    let chunked = |n: usize| {
        Body::new(Chunked {
            left: n,
            chunk: b"a".to_vec(),
        })
    };
    let over = call(&app, rq("k1").body(chunked(11)).unwrap()).await;
    assert_eq!(over.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(fx.runs(), 0);
    let at = call(&app, rq("k1").body(chunked(10)).unwrap()).await;
    assert_eq!(at.status, StatusCode::CREATED);
    // The same bytes in one frame are the same request.
    let whole = call(&app, post_key("k1", "aaaaaaaaaa")).await;
    assert!(whole.replayed(), "{whole:?}");
    assert_eq!(fx.stored("w").as_deref(), Some(&b"aaaaaaaaaa"[..]));
}

#[tokio::test]
async fn the_default_fingerprint_does_not_let_bytes_move_between_query_and_body() {
    let fx = fx();
    let app = fx.app(fx.layer());
    let send = |uri: &str, body: &str| {
        Request::post(uri)
            .header("x-tenant", "acme")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    assert_eq!(
        call(&app, send("/p?x=12", "")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        call(&app, send("/p?x=1", "2")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        call(&app, send("/p?x=", "12")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(fx.runs(), 1);
}

#[tokio::test]
async fn keys_are_case_sensitive_and_punctuation_is_visible_ascii() {
    let fx = fx();
    let app = fx.app(fx.layer());
    assert!(!call(&app, post_key("abc", "b")).await.replayed());
    assert!(
        !call(&app, post_key("ABC", "b")).await.replayed(),
        "another key"
    );
    for key in ["a,b", "a;b=c", "(x)", "~!#$%&'*+-.^_`|"] {
        let first = call(&app, post_key(key, "b")).await;
        assert_eq!(first.status, StatusCode::CREATED, "key {key}");
        assert!(call(&app, post_key(key, "b")).await.replayed(), "key {key}");
    }
}

#[tokio::test]
async fn a_replay_adds_no_header_the_handler_did_not_send() {
    let fx = fx();
    let h = |Extension(_r): Extension<IdempotentRequest>| async {
        Response::builder().status(204).body(Body::empty()).unwrap()
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    let first = call(&app, post_key("k1", "b")).await;
    assert_eq!(first.status, StatusCode::NO_CONTENT);
    let retry = call(&app, post_key("k1", "b")).await;
    assert_eq!(retry.status, StatusCode::NO_CONTENT);
    assert!(retry.replayed());
    assert!(
        retry.headers.get("content-type").is_none(),
        "{:?}",
        retry.headers
    );
    assert!(retry.headers.get("location").is_none());
    assert!(retry.body.is_empty());
}

#[tokio::test]
async fn a_huge_kept_header_is_never_replayed_truncated() {
    let fx = fx();
    let big = "v".repeat(70 * 1024);
    let b2 = big.clone();
    let runs = fx.ctx.runs.clone();
    let h = move |Extension(_r): Extension<IdempotentRequest>| {
        let big = b2.clone();
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Response::builder()
                .status(201)
                .header("location", big)
                .body(Body::from("x"))
                .unwrap()
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    let first = call(&app, post_key("k1", "b")).await;
    let retry = call(&app, post_key("k1", "b")).await;
    if retry.replayed() {
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(
            header(&retry.headers, "location"),
            Some(big.as_str()),
            "replayed byte for byte"
        );
    } else {
        // Not stored: then the client must not have been told 201 with nothing stored... it may
        // have been, if the layer sends unstored responses; at least the key must be free.
        assert_eq!(
            fx.runs(),
            2,
            "first {:?} retry {:?}",
            first.status,
            retry.status
        );
    }
}

#[tokio::test]
async fn clones_of_the_request_stage_on_the_same_claim() {
    let fx = fx();
    let table = fx.table.clone();
    let h = move |Extension(request): Extension<IdempotentRequest>, headers: HeaderMap| {
        let table = table.clone();
        async move {
            let clone = request.clone();
            let t2 = table.clone();
            // A task the handler spawns and joins before returning.
            tokio::spawn(async move { clone.put(&t2, b"from-clone", b"1").unwrap() })
                .await
                .unwrap();
            request.put(&table, b"from-handle", b"2").unwrap();
            let status: u16 = header(&headers, "x-status").map_or(201, |s| s.parse().unwrap());
            StatusCode::from_u16(status).unwrap()
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    assert_eq!(
        call(
            &app,
            rq("k0")
                .header("x-status", "500")
                .body(Body::from("b"))
                .unwrap()
        )
        .await
        .status,
        500
    );
    assert_eq!(
        fx.stored("from-clone"),
        None,
        "a clone's writes are dropped with the handle's"
    );
    assert_eq!(
        call(&app, post_key("k1", "b")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(fx.stored("from-clone").as_deref(), Some(&b"1"[..]));
    assert_eq!(fx.stored("from-handle").as_deref(), Some(&b"2"[..]));
}

#[tokio::test]
async fn staging_errors_are_store_errors_and_stage_nothing() {
    let fx = fx();
    let other_dir = tempfile::tempdir().unwrap();
    let (_other_engine, foreign) = open_at(other_dir.path(), &fx.clock, None);
    let table = fx.table.clone();
    let results = Arc::new(Mutex::new(Vec::new()));
    let r = results.clone();
    let h = move |Extension(request): Extension<IdempotentRequest>| {
        let table = table.clone();
        let foreign = foreign.clone();
        let r = r.clone();
        async move {
            let mut r = r.lock();
            r.push(format!("{:?}", request.put(&table, b"", b"v")));
            r.push(format!("{:?}", request.merge(&table, b"m", b"v")));
            r.push(format!("{:?}", request.put(&foreign, b"f", b"v")));
            r.push(format!("{:?}", request.put(&table, b"ok", b"v")));
            StatusCode::CREATED
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    assert_eq!(
        call(&app, post_key("k1", "b")).await.status,
        StatusCode::CREATED
    );
    let results = results.lock().clone();
    assert!(results[0].starts_with("Err(Store("), "{results:?}");
    assert!(results[1].contains("NoMergeOperator"), "{results:?}");
    assert!(results[2].contains("ForeignTable"), "{results:?}");
    assert_eq!(results[3], "Ok(())");
    assert_eq!(fx.stored("m"), None);
    assert_eq!(fx.stored("ok").as_deref(), Some(&b"v"[..]));
}

#[tokio::test]
async fn a_staged_delete_commits_with_the_response_or_not_at_all() {
    let fx = fx();
    let table = fx.table.clone();
    let h = move |Extension(request): Extension<IdempotentRequest>, headers: HeaderMap| {
        let table = table.clone();
        async move {
            if headers.contains_key("x-delete") {
                request.delete(&table, b"d").unwrap();
            } else {
                request.put(&table, b"d", b"v").unwrap();
            }
            let status: u16 = header(&headers, "x-status").map_or(201, |s| s.parse().unwrap());
            StatusCode::from_u16(status).unwrap()
        }
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    call(&app, post_key("k1", "b")).await;
    assert!(fx.stored("d").is_some());
    call(
        &app,
        rq("k2")
            .header("x-delete", "1")
            .header("x-status", "503")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert!(fx.stored("d").is_some(), "a 5xx drops the staged delete");
    call(
        &app,
        rq("k3")
            .header("x-delete", "1")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(fx.stored("d"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn lease_path_the_same_key_sent_concurrently_runs_once() {
    let fx = fx();
    let app = fx.app(lease_layer(&fx));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            call(
                &app,
                rq("race")
                    .header("x-yield", "1")
                    .body(Body::from("b"))
                    .unwrap(),
            )
            .await
        }));
    }
    let mut fresh = 0;
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            StatusCode::CREATED if reply.replayed() => {}
            StatusCode::CREATED => fresh += 1,
            StatusCode::CONFLICT => assert!(reply.retry_after().is_some()),
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    assert_eq!((fresh, fx.runs()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_late_request_is_fenced_while_the_takeover_is_still_running() {
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let spawn = |write: &'static str| {
        spawn_call(
            &app,
            rq("k1")
                .header("x-hold", "1")
                .header("x-write", write)
                .header("x-renew-after-ms", "30000")
                .body(Body::from("b"))
                .unwrap(),
        )
    };
    let late = spawn("wa");
    assert_eq!(fx.entered.recv().await.unwrap(), 1);
    fx.clock.set(T0 + LEASE_MS);
    let takeover = spawn("wc");
    assert_eq!(fx.entered.recv().await.unwrap(), 2);
    // The late one finishes first, while the takeover is in its handler.
    fx.ctx.gate.add_permits(1);
    let late = late.await.unwrap();
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE, "{late:?}");
    assert!(late.retry_after().is_some());
    {
        // renew: "StageError::Store with LeaseLost if another request took the key over".
        let renews = fx.ctx.renews.lock();
        assert!(
            matches!(
                renews[0],
                (1, Err(StageError::Store(idemdb::Error::LeaseLost { .. })))
            ),
            "{:?}",
            renews[0]
        );
    }
    // Meanwhile a retry is 409.
    assert_eq!(
        call(&app, post_key("k1", "b")).await.status,
        StatusCode::CONFLICT
    );
    fx.ctx.gate.add_permits(1);
    let takeover = takeover.await.unwrap();
    assert_eq!(takeover.status, StatusCode::CREATED);
    assert_eq!(fx.stored("wa"), None);
    let replay = call(&app, post_key("k1", "b")).await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "run 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_a_handler_outliving_its_lease_without_a_takeover_stores_its_response() {
    // with_lease: "one that outlived its lease with no takeover stores its response as usual".
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let late = spawn_held(&app, "k1", "b");
    fx.entered.recv().await.unwrap();
    fx.clock.set(T0 + LEASE_MS + 1);
    fx.ctx.gate.add_permits(1);
    let late = late.await.unwrap();
    assert_eq!(late.status, StatusCode::CREATED, "{late:?}");
    let retry = call(&app, post_key("k1", "b")).await;
    assert!(retry.replayed(), "{retry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_a_panicking_handler_releases_its_lease() {
    let fx = fx();
    let app = fx.app(lease_layer(&fx));
    let task = spawn_call(
        &app,
        rq("k1")
            .header("x-panic", "1")
            .header("x-write", "p")
            .body(Body::from("b"))
            .unwrap(),
    );
    assert!(task.await.unwrap_err().is_panic());
    let mut reply = None;
    for _ in 0..500 {
        let r = call(&app, post_key("k1", "b")).await;
        if r.status != StatusCode::CONFLICT {
            reply = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reply = reply.expect("a panicked request releases its lease");
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(fx.stored("p"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_in_progress_for_one_principal_does_not_hold_another_principal() {
    let mut fx = fx();
    let app = fx.app(fx.layer());
    let alpha = spawn_call(
        &app,
        Request::post("/p")
            .header("x-tenant", "alpha")
            .header(IDEMPOTENCY_KEY, "k1")
            .header("x-hold", "1")
            .body(Body::from("b"))
            .unwrap(),
    );
    fx.entered.recv().await.unwrap();
    let beta = call(
        &app,
        Request::post("/p")
            .header("x-tenant", "beta")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(beta.status, StatusCode::CREATED, "{beta:?}");
    fx.ctx.gate.add_permits(1);
    assert_eq!(alpha.await.unwrap().status, StatusCode::CREATED);
}

/// A body that signals when first polled, then never ends.
struct Stalled(Option<mpsc::UnboundedSender<()>>);

impl http_body::Body for Stalled {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        if let Some(tx) = self.0.take() {
            tx.send(()).unwrap();
            return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                b"part",
            )))));
        }
        Poll::Pending
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_its_body_is_read_leaves_the_key_free() {
    for lease in [false, true] {
        let fx = fx();
        let layer = if lease { lease_layer(&fx) } else { fx.layer() };
        let app = fx.app(layer);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = {
            let app = app.clone();
            tokio::spawn(async move {
                call(&app, rq("k1").body(Body::new(Stalled(Some(tx)))).unwrap()).await
            })
        };
        rx.recv().await.unwrap();
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        let retry = call(&app, post_key("k1", "b")).await;
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "lease={lease}: {retry:?}"
        );
        assert_eq!(fx.runs(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_an_unstored_status_or_oversized_response_frees_the_key_at_once() {
    let fx = fx();
    let app = fx.app(lease_layer(&fx).response_body_limit(10));
    let nf = call(
        &app,
        rq("k1")
            .header("x-status", "404")
            .header("x-write", "nf")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(nf.status, StatusCode::NOT_FOUND);
    assert_eq!(fx.stored("nf"), None);
    assert_eq!(
        call(&app, post_key("k1", "b")).await.status,
        StatusCode::CREATED,
        "no wait for the lease"
    );
    let big = call(
        &app,
        rq("k2")
            .header("x-len", "11")
            .header("x-write", "big")
            .body(Body::from("b"))
            .unwrap(),
    )
    .await;
    assert_eq!(big.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(fx.stored("big"), None);
    assert_eq!(
        call(&app, post_key("k2", "b")).await.status,
        StatusCode::CREATED,
        "no wait for the lease"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn derive_key_is_the_same_across_a_restart() {
    for lease in [false, true] {
        let fx = fx();
        let layer = if lease { lease_layer(&fx) } else { fx.layer() };
        let app = fx.app(layer);
        let e = call(
            &app,
            rq("k1")
                .header("x-status", "500")
                .body(Body::from("b"))
                .unwrap(),
        )
        .await;
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        let before = fx.ctx.seen.lock()[0].clone();
        assert_eq!(before.epoch, 1);
        drop(app);
        let Fx {
            dir,
            clock,
            engine,
            table,
            ctx,
            entered,
        } = fx;
        drop((engine, table, ctx, entered));
        let (engine, table) = reopen_at(dir.path(), &clock, None);
        let (ctx, _entered) = ctx_for(&table, &clock);
        let mut layer = IdempotencyLayer::new(engine.consumer("payments").unwrap(), tenant);
        if lease {
            layer = layer.with_lease(Duration::from_millis(LEASE_MS), "node-a");
        }
        let app = make_app(layer, &ctx);
        assert_eq!(
            call(&app, post_key("k1", "b")).await.status,
            StatusCode::CREATED
        );
        let after = ctx.seen.lock()[0].clone();
        assert_eq!(
            after.derived, before.derived,
            "lease={lease}: across a restart"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn epoch_counts_every_lease_held_on_the_key_before() {
    // IdempotentRequest::epoch: "1 for a key's first request, one more for each lease held on
    // the key before (taken over after it ran out, or released after a response that was not
    // stored). On the batch path a response not stored leaves no record, so a retry's epoch
    // stays 1."
    for (lease, expected) in [(false, [1, 1]), (true, [1, 2])] {
        let fx = fx();
        let layer = if lease { lease_layer(&fx) } else { fx.layer() };
        let app = fx.app(layer);
        call(
            &app,
            rq("k1")
                .header("x-status", "500")
                .body(Body::from("b"))
                .unwrap(),
        )
        .await;
        assert_eq!(
            call(&app, post_key("k1", "b")).await.status,
            StatusCode::CREATED
        );
        let epochs: Vec<u64> = fx.ctx.seen.lock().iter().map(|s| s.epoch).collect();
        assert_eq!(epochs, expected, "lease={lease}");
    }
}

#[tokio::test]
async fn kept_header_values_are_replayed_byte_for_byte() {
    let fx = fx();
    let h = |Extension(_r): Extension<IdempotentRequest>| async {
        Response::builder()
            .status(201)
            .header("location", HeaderValue::from_bytes(b"/p/caf\xe9").unwrap())
            .header("content-type", "")
            .body(Body::from("x"))
            .unwrap()
    };
    let app = Router::new().route("/p", post(h)).layer(fx.layer());
    call(&app, post_key("k1", "b")).await;
    let retry = call(&app, post_key("k1", "b")).await;
    assert!(retry.replayed());
    assert_eq!(
        retry.headers.get("location").unwrap().as_bytes(),
        b"/p/caf\xe9"
    );
    assert_eq!(retry.headers.get("content-type").unwrap().as_bytes(), b"");
}

#[derive(Clone)]
struct Tenant(&'static str);

#[tokio::test]
async fn the_principal_can_come_from_an_extension_an_earlier_layer_put_there() {
    let fx = fx();
    let layer = IdempotencyLayer::new(fx.engine.consumer("payments").unwrap(), |parts: &Parts| {
        let tenant = parts.extensions.get::<Tenant>()?;
        Principal::new(tenant.0).ok()
    });
    let runs = fx.ctx.runs.clone();
    let h = move |Extension(_r): Extension<IdempotentRequest>| {
        let runs = runs.clone();
        async move { format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1) }
    };
    let app = Router::new()
        .route("/p", post(h))
        .layer(layer)
        .layer(Extension(Tenant("acme"))); // outer: runs first
    let send = || {
        Request::post("/p")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Body::from("b"))
            .unwrap()
    };
    assert_eq!(call(&app, send()).await.status, StatusCode::OK);
    let retry = call(&app, send()).await;
    assert!(retry.replayed());
    assert_eq!(retry.text(), "run 1");
}

#[tokio::test]
async fn the_layer_wraps_a_plain_tower_service() {
    use http_body_util::Full;
    use tower::Layer;
    let fx = fx();
    let runs = fx.ctx.runs.clone();
    let service = tower::service_fn(move |request: Request<Full<Bytes>>| {
        let runs = runs.clone();
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let has = request.extensions().get::<IdempotentRequest>().is_some();
            Ok::<_, std::convert::Infallible>(
                axum::http::Response::builder()
                    .status(201)
                    .header("content-type", "text/plain")
                    .body(Full::new(Bytes::from(format!("run {n} {has}"))))
                    .unwrap(),
            )
        }
    });
    let service = fx.layer().layer(service);
    let send = || {
        Request::post("/anything")
            .header("x-tenant", "acme")
            .header(IDEMPOTENCY_KEY, "k1")
            .body(Full::new(Bytes::from_static(b"b")))
            .unwrap()
    };
    let body = |r: axum::http::Response<Full<Bytes>>| async move {
        use http_body_util::BodyExt;
        (
            r.headers().contains_key(IDEMPOTENT_REPLAYED),
            r.into_body().collect().await.unwrap().to_bytes(),
        )
    };
    let first = body(service.clone().oneshot(send()).await.unwrap()).await;
    let retry = body(service.clone().oneshot(send()).await.unwrap()).await;
    assert_eq!(first, (false, Bytes::from_static(b"run 1 true")));
    assert_eq!(retry, (true, Bytes::from_static(b"run 1 true")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn lease_many_retries_racing_for_a_takeover_run_the_handler_once() {
    let mut fx = fx();
    let app = fx.app(lease_layer(&fx));
    let late = spawn_held(&app, "k1", "b");
    fx.entered.recv().await.unwrap();
    fx.clock.set(T0 + LEASE_MS);
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            call(
                &app,
                rq("k1")
                    .header("x-yield", "1")
                    .body(Body::from("b"))
                    .unwrap(),
            )
            .await
        }));
    }
    let mut fresh = 0;
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            StatusCode::CREATED if reply.replayed() => assert_eq!(reply.text(), "run 2"),
            StatusCode::CREATED => fresh += 1,
            StatusCode::CONFLICT => assert!(reply.retry_after().is_some()),
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    assert_eq!((fresh, fx.runs()), (1, 2), "one takeover");
    fx.ctx.gate.add_permits(1);
    assert_eq!(late.await.unwrap().status, StatusCode::SERVICE_UNAVAILABLE);
}
