//! Crashes: a server process behind the layer SIGKILLed at random moments and right after its
//! commits while clients retry, restarted on the same store; at the end every key's effect is
//! counted in the store. Nothing lost, nothing applied twice, every replayed response equal to
//! the first. The negative control stores the response after the effects, outside their batch,
//! and the same check must catch it applying effects twice.
//!
//! The server is this test binary run again as a child (`child_server`, which does nothing
//! unless `IDEMDB_HTTP_CHILD` is set). Sizes: `IDEMDB_HTTP_CRASH_KEYS` (default 3000) keys sent
//! by 16 clients; a random kill every 10-50 ms of serving, and each response's commit followed
//! by a SIGKILL with a chance set from the run's keys so that about `AFTER_COMMIT_KILLS_EXPECTED`
//! follow a commit whatever the size (`IDEMDB_HTTP_CRASH_AFTER_COMMIT_PERMILLE` sets the chance
//! per thousand responses instead).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idemdb::{BusinessTable, Consumer, Engine, Fingerprint, Outcome, TableOptions, merge_ops};
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal};

const CHILD: &str = "IDEMDB_HTTP_CHILD";
const CLIENTS: usize = 16;
const AFTER_COMMIT_PERMILLE: &str = "IDEMDB_HTTP_CRASH_AFTER_COMMIT_PERMILLE";
/// Kills right after a commit a run expects. Each key is answered at least twice (the first
/// answer and its retry), so a run of `keys` sees at least `2 * keys` responses. The count is
/// Poisson: with 24 expected, fewer than 3 comes once in 80 million runs (a fixed chance of
/// 2 per thousand expected 4 on PostgreSQL's 1000 keys, and none came in one CI run).
const AFTER_COMMIT_KILLS_EXPECTED: u64 = 24;

/// The chance per thousand responses of a kill right after the commit, for a run of `keys`.
fn after_commit_permille(keys: usize) -> u64 {
    match std::env::var(AFTER_COMMIT_PERMILLE) {
        Ok(permille) => permille.parse().expect("a number per thousand"),
        Err(_) => (AFTER_COMMIT_KILLS_EXPECTED * 1000).div_ceil(2 * keys.max(1) as u64),
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn open(dir: &Path) -> Engine {
    Engine::builder(dir)
        .business_table(TableOptions::new("payments"))
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()
        .unwrap()
}

/// A small generator, seeded: no dependency for the few random numbers the run needs.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    (nanos ^ u64::from(std::process::id())) | 1
}

fn kill_myself() -> ! {
    // SAFETY: kill(2) on this process's own pid; SIGKILL ends it here.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL did not end the process")
}

// ---------------------------------------------------------------------------------------------
// The child: a server on the store, until it is killed.

/// What every server mode shares: its runs, and when it kills itself.
#[derive(Clone)]
struct Fate {
    /// Each run's response names the process and the run: a second run differs.
    runs: Arc<AtomicU64>,
    after_commit_permille: u64,
    random: Arc<parking_lot::Mutex<Random>>,
}

#[derive(Clone)]
struct Served {
    payments: BusinessTable,
    effects: BusinessTable,
    /// The negative control's records: the effects' own claims, and the stored responses.
    attempts: Consumer,
    responses: Consumer,
    fate: Fate,
}

impl Fate {
    fn new() -> Fate {
        Fate {
            runs: Arc::new(AtomicU64::new(0)),
            after_commit_permille: env_or(AFTER_COMMIT_PERMILLE, 0),
            random: Arc::new(parking_lot::Mutex::new(Random(seed()))),
        }
    }

    fn die_now(&self) -> bool {
        self.random.lock().below(1000) < self.after_commit_permille
    }

    fn response_body(&self, key: &[u8]) -> String {
        let run = self.runs.fetch_add(1, Ordering::SeqCst);
        format!(
            "{{\"key\":\"{}\",\"process\":{},\"run\":{run}}}",
            String::from_utf8_lossy(key),
            std::process::id()
        )
    }
}

/// Behind the layer: the row and the effect staged, committed with the response.
async fn with_layer(
    State(served): State<Served>,
    Extension(request): Extension<IdempotentRequest>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers["idempotency-key"].as_bytes().to_vec();
    let id = request.derive_key("payment").unwrap();
    request.put(&served.payments, &id, &body).unwrap();
    request
        .merge(&served.effects, &key, 1u64.to_be_bytes())
        .unwrap();
    (StatusCode::CREATED, served.fate.response_body(&key)).into_response()
}

/// The negative control: the effects committed first (a claim of their own), the response
/// stored after them by a second commit, as middleware that caches responses beside the
/// handler's store does.
async fn outside(State(served): State<Served>, headers: HeaderMap, body: Bytes) -> Response {
    let key = headers["idempotency-key"].as_bytes().to_vec();
    if let Ok(Some(record)) = served.responses.get(&key)
        && let Some(result) = record.result()
    {
        return (StatusCode::CREATED, result.clone()).into_response();
    }
    let attempt = format!(
        "{}-{}-{}",
        String::from_utf8_lossy(&key),
        std::process::id(),
        served.fate.runs.load(Ordering::SeqCst)
    );
    let Ok(Outcome::Fresh(mut effects)) = served.attempts.begin(&attempt, Fingerprint::of(&body))
    else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    effects.put(&served.payments, &attempt, &body).unwrap();
    effects
        .merge(&served.effects, &key, 1u64.to_be_bytes())
        .unwrap();
    if effects.commit_async(b"").await.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    if served.fate.die_now() {
        kill_myself();
    }
    let response = served.fate.response_body(&key);
    match served.responses.begin(&key, Fingerprint::of(&body)) {
        Ok(Outcome::Fresh(claim)) => match claim.commit_async(response.as_bytes()).await {
            Ok(_) => (StatusCode::CREATED, response).into_response(),
            Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        },
        _ => StatusCode::CONFLICT.into_response(),
    }
}

/// Runs the server of `IDEMDB_HTTP_CHILD`'s mode, writing its port to `IDEMDB_HTTP_PORT_FILE`.
fn serve_until_killed(mode: &str) {
    let dir = PathBuf::from(std::env::var("IDEMDB_HTTP_DIR").unwrap());
    let port_file = PathBuf::from(std::env::var("IDEMDB_HTTP_PORT_FILE").unwrap());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    #[cfg(feature = "postgres")]
    if mode.starts_with("postgres") {
        runtime.block_on(async move {
            listen(on_postgres::router(mode).await, &port_file).await;
        });
        return;
    }
    runtime.block_on(async move {
        let engine = open(&dir);
        let served = Served {
            payments: engine.business_table("payments").unwrap(),
            effects: engine.business_table("effects").unwrap(),
            attempts: engine.consumer("attempts").unwrap(),
            responses: engine.consumer("responses").unwrap(),
            fate: Fate::new(),
        };
        let router = match mode {
            "layer" => {
                let layer = IdempotencyLayer::new(engine.consumer("http").unwrap(), |_| {
                    Principal::new("clients").ok()
                });
                let fate = served.fate.clone();
                after_commit(
                    Router::new()
                        .route("/payments", post(with_layer))
                        .layer(layer)
                        .with_state(served),
                    fate,
                )
            }
            _ => Router::new()
                .route("/payments", post(outside))
                .with_state(served),
        };
        listen(router, &port_file).await;
    });
}

/// Wraps `router` (behind its layer) in the kill right after a commit: outermost, it runs once
/// the layer has committed and before the client hears.
fn after_commit(router: Router, fate: Fate) -> Router {
    router.layer(axum::middleware::map_response(move |response: Response| {
        let fate = fate.clone();
        async move {
            if response.status() == StatusCode::CREATED && fate.die_now() {
                kill_myself();
            }
            response
        }
    }))
}

/// Serves `router` on a port of 127.0.0.1, written to `port_file` for the parent.
async fn listen(router: Router, port_file: &Path) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let staged = port_file.with_extension("staged");
    std::fs::write(&staged, port.to_string()).unwrap();
    std::fs::rename(&staged, port_file).unwrap();
    axum::serve(listener, router).await.unwrap();
}

#[cfg(feature = "postgres")]
#[path = "../../postgres/tests/support/server.rs"]
#[allow(dead_code)]
mod server;

/// The PostgreSQL backend's server modes: the effect a row of `crash.effects`, staged on the
/// request's transaction (`postgres`), or inserted on a connection of its own before the
/// layer stores the response (`postgres-outside`, the negative control).
#[cfg(feature = "postgres")]
mod on_postgres {
    use super::*;
    use tokio_postgres::types::Type;

    pub(super) const SCHEMA: &str = "crash";

    pub(super) async fn connect(url: &str) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
    }

    #[derive(Clone)]
    struct PgServed {
        url: Arc<str>,
        fate: Fate,
        /// `postgres-gated`'s folder of gate files (the child's `IDEMDB_HTTP_DIR`).
        gate: Option<Arc<Path>>,
    }

    async fn staged(
        State(served): State<PgServed>,
        Extension(request): Extension<IdempotentRequest>,
        headers: HeaderMap,
    ) -> Response {
        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
        request
            .sql(
                format!("INSERT INTO {SCHEMA}.effects (key) VALUES ($1)"),
                vec![(Box::new(key.clone()), Type::TEXT)],
            )
            .unwrap();
        (
            StatusCode::CREATED,
            served.fate.response_body(key.as_bytes()),
        )
            .into_response()
    }

    async fn outside(State(served): State<PgServed>, headers: HeaderMap) -> Response {
        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
        let client = connect(&served.url).await;
        client
            .execute(
                &format!("INSERT INTO {SCHEMA}.effects (key) VALUES ($1)"),
                &[&key],
            )
            .await
            .unwrap();
        if served.fate.die_now() {
            kill_myself();
        }
        (
            StatusCode::CREATED,
            served.fate.response_body(key.as_bytes()),
        )
            .into_response()
    }

    /// `postgres-gated`: the effect staged as in `postgres`, after the handler has said it
    /// runs (a file `<key>.reached` in the gate folder) and been let go (a file `<key>.go`).
    async fn gated(
        State(served): State<PgServed>,
        request: Extension<IdempotentRequest>,
        headers: HeaderMap,
    ) -> Response {
        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
        let gate = served.gate.as_deref().unwrap();
        std::fs::write(gate.join(format!("{key}.reached")), b"").unwrap();
        while !gate.join(format!("{key}.go")).exists() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        staged(State(served), request, headers).await
    }

    pub(super) async fn router(mode: &str) -> Router {
        let url: Arc<str> = std::env::var("IDEMDB_HTTP_PG_URL").unwrap().into();
        let setup = connect(&url).await;
        let store = idemdb_postgres::PgStore::builder()
            .names(idemdb_postgres::Names::new(SCHEMA, "records").unwrap())
            .open(&setup)
            .await
            .unwrap();
        let layer = IdempotencyLayer::postgres(
            store.consumer("http").unwrap(),
            {
                let url = url.clone();
                move || {
                    let url = url.clone();
                    async move {
                        let (client, connection) =
                            tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
                        tokio::spawn(connection);
                        Ok::<_, tokio_postgres::Error>(Box::new(client))
                    }
                }
            },
            |_| Principal::new("clients").ok(),
        );
        let served = PgServed {
            url,
            fate: Fate::new(),
            gate: std::env::var_os("IDEMDB_HTTP_DIR").map(|dir| PathBuf::from(dir).into()),
        };
        let fate = served.fate.clone();
        let routes = match mode {
            "postgres" => Router::new().route("/payments", post(staged)),
            "postgres-gated" => Router::new().route("/payments", post(gated)),
            _ => Router::new().route("/payments", post(outside)),
        };
        let router = routes.layer(layer).with_state(served);
        if mode == "postgres-gated" {
            // The two-process test kills its servers itself, at chosen moments.
            return router;
        }
        after_commit(router, fate)
    }

    /// A private server with the store's tables and `crash.effects`: the server, its URL.
    pub(super) fn start() -> Option<(server::Server, String)> {
        let server = match server::Server::start() {
            Ok(server) => server,
            Err(why) => {
                println!("the PostgreSQL crash runs skipped: cannot start PostgreSQL ({why})");
                return None;
            }
        };
        let url = server.url();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut client = connect(&url).await;
            idemdb_postgres::install(
                &mut client,
                &idemdb_postgres::Names::new(SCHEMA, "records").unwrap(),
            )
            .await
            .unwrap();
            client
                .batch_execute(&format!(
                    "CREATE TABLE {SCHEMA}.effects (key text NOT NULL)"
                ))
                .await
                .unwrap();
        });
        Some((server, url))
    }

    /// Each key's effects, counted.
    pub(super) fn effects(url: &str) -> HashMap<String, u64> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let client = connect(url).await;
            client
                .query(
                    &format!("SELECT key, count(*) FROM {SCHEMA}.effects GROUP BY key"),
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1) as u64))
                .collect()
        })
    }
}

#[test]
fn child_server() {
    // The server the crash tests run as a child process; nothing when run as a test.
    if let Ok(mode) = std::env::var(CHILD) {
        serve_until_killed(&mode);
    }
}

// ---------------------------------------------------------------------------------------------
// The parent: clients, kills, restarts, and the accounting.

/// The server process and where it listens.
struct Server {
    mode: &'static str,
    dir: PathBuf,
    /// The PostgreSQL modes' database.
    pg_url: Option<String>,
    port_file: PathBuf,
    /// The child's chance per thousand responses of a kill right after the commit.
    after_commit_permille: u64,
    child: Option<Child>,
    address: Arc<parking_lot::Mutex<Option<SocketAddr>>>,
    /// SIGKILLs sent by the killer, and servers found dead of their own SIGKILL after a commit.
    kills: u64,
    self_kills: u64,
}

impl Server {
    fn start(&mut self) {
        let _ = std::fs::remove_file(&self.port_file);
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--exact", "child_server", "--nocapture", "--test-threads=1"])
            .env(CHILD, self.mode)
            .env("IDEMDB_HTTP_DIR", &self.dir)
            .env("IDEMDB_HTTP_PORT_FILE", &self.port_file)
            .env(
                AFTER_COMMIT_PERMILLE,
                self.after_commit_permille.to_string(),
            )
            .stdout(std::process::Stdio::null());
        if let Some(url) = &self.pg_url {
            command.env("IDEMDB_HTTP_PG_URL", url);
        }
        let child = command.spawn().unwrap();
        self.child = Some(child);
        let port = loop {
            if let Ok(port) = std::fs::read_to_string(&self.port_file) {
                break port.parse::<u16>().unwrap();
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("the server exited at start: {status}");
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        *self.address.lock() = Some(SocketAddr::from(([127, 0, 0, 1], port)));
    }

    /// SIGKILLs the server (if it has not killed itself) and waits for it.
    fn kill(&mut self) {
        *self.address.lock() = None;
        if let Some(mut child) = self.child.take() {
            if child.try_wait().unwrap().is_some() {
                self.self_kills += 1;
            } else {
                child.kill().unwrap();
                child.wait().unwrap();
                self.kills += 1;
            }
        }
    }

    /// Whether the server ended on its own (a SIGKILL after a commit).
    fn ended(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().unwrap().is_some(),
            None => true,
        }
    }
}

impl Drop for Server {
    /// A failed run must not leave its server running (it holds the test's output open).
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sets its flag when dropped.
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// What the clients saw, per key: the first 2xx body and how many later ones differed.
#[derive(Default)]
struct Seen {
    first: HashMap<String, Bytes>,
    replays: u64,
    replay_mismatches: u64,
}

async fn send(address: SocketAddr, key: &str) -> Option<(StatusCode, Bytes)> {
    let stream = tokio::net::TcpStream::connect(address).await.ok()?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(connection);
    let request = Request::post("/payments")
        .header("host", "localhost")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(format!("{{\"order\":\"{key}\"}}"))))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), sender.send_request(request))
        .await
        .ok()?
        .ok()?;
    let status = response.status();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, body))
}

/// Sends `key` until it gets a 2xx; connection failures, 409 and 503 are retried.
async fn until_answered(address: &parking_lot::Mutex<Option<SocketAddr>>, key: &str) -> Bytes {
    loop {
        let current = *address.lock();
        if let Some(current) = current
            && let Some((status, body)) = send(current, key).await
        {
            if status.is_success() {
                return body;
            }
            assert!(
                status == StatusCode::CONFLICT || status == StatusCode::SERVICE_UNAVAILABLE,
                "{key}: {status} {body:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
}

struct Accounting {
    keys: usize,
    kills: u64,
    self_kills: u64,
    lost: usize,
    applied_twice: usize,
    replays: u64,
    replay_mismatches: u64,
}

/// Runs the schedule against a server of `mode`, on the store it opens (embedded) or on the
/// database at `pg_url`; `count` then gives each key's effects.
fn run(
    mode: &'static str,
    keys: usize,
    pg_url: Option<String>,
    count: impl FnOnce(&Path) -> HashMap<String, u64>,
) -> Accounting {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let server = Arc::new(parking_lot::Mutex::new(Server {
        mode,
        dir: store.clone(),
        pg_url,
        port_file: dir.path().join("port"),
        after_commit_permille: after_commit_permille(keys),
        child: None,
        address: Arc::new(parking_lot::Mutex::new(None)),
        kills: 0,
        self_kills: 0,
    }));
    server.lock().start();
    let address = server.lock().address.clone();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The killer: a SIGKILL every 10-50 ms of serving, and a restart after each, also of a
    // server that killed itself after a commit.
    let killer = std::thread::spawn({
        let (server, done) = (server.clone(), done.clone());
        move || {
            let mut random = Random(seed());
            while !done.load(Ordering::SeqCst) {
                let wait = 10 + random.below(40);
                for _ in 0..wait {
                    if done.load(Ordering::SeqCst) || server.lock().ended() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                let mut server = server.lock();
                server.kill();
                if !done.load(Ordering::SeqCst) {
                    server.start();
                }
            }
        }
    });
    // However the run ends (a failed client panics), the killer stops, and the last handle on
    // the server kills it.
    let _stop_killer = StopOnDrop(done.clone());
    let seen = Arc::new(parking_lot::Mutex::new(Seen::default()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (next, address, seen) = (next.clone(), address.clone(), seen.clone());
                tokio::spawn(async move {
                    loop {
                        let n = next.fetch_add(1, Ordering::SeqCst);
                        if n >= keys {
                            break;
                        }
                        let key = format!("order-{n}");
                        // The first answer, then a retry of it (a client that lost the first
                        // answer would send exactly this).
                        let first = until_answered(&address, &key).await;
                        let again = until_answered(&address, &key).await;
                        let mut seen = seen.lock();
                        seen.replays += 1;
                        if again != first {
                            seen.replay_mismatches += 1;
                        }
                        seen.first.insert(key, first);
                    }
                })
            })
            .collect();
        for client in clients {
            client.await.unwrap();
        }
    });
    done.store(true, Ordering::SeqCst);
    killer.join().unwrap();
    let (kills, self_kills) = {
        let mut server = server.lock();
        server.kill();
        (server.kills, server.self_kills)
    };
    let effects = count(&store);
    let (mut lost, mut applied_twice) = (0, 0);
    for n in 0..keys {
        match effects.get(&format!("order-{n}")).copied().unwrap_or(0) {
            0 => lost += 1,
            1 => {}
            _ => applied_twice += 1,
        }
    }
    let seen = seen.lock();
    Accounting {
        keys,
        kills,
        self_kills,
        lost,
        applied_twice,
        replays: seen.replays,
        replay_mismatches: seen.replay_mismatches,
    }
}

impl Accounting {
    /// Nothing lost, nothing applied twice, every replay the first answer, after at least 3
    /// random SIGKILLs and 3 right after a commit (`AFTER_COMMIT_KILLS_EXPECTED` are expected).
    fn assert_exactly_once(&self) {
        assert!(
            self.kills >= 3 && self.self_kills >= 3,
            "too few kills to mean anything: {} random, {} right after a commit",
            self.kills,
            self.self_kills
        );
        assert_eq!(self.lost, 0);
        assert_eq!(self.applied_twice, 0);
        assert_eq!(self.replay_mismatches, 0);
    }
}

fn crash_keys() -> usize {
    env_or("IDEMDB_HTTP_CRASH_KEYS", 3000) as usize
}

/// Each key's effects in the embedded store the server left.
fn embedded_effects(store: &Path) -> HashMap<String, u64> {
    let engine = open(store);
    let effects = engine.business_table("effects").unwrap();
    (0..crash_keys())
        .map(|n| format!("order-{n}"))
        .filter_map(|key| {
            let count = effects
                .get(&key)
                .unwrap()
                .as_deref()
                .and_then(merge_ops::read_u64)?;
            Some((key, count))
        })
        .collect()
}

fn report(name: &str, accounting: &Accounting) {
    println!(
        "{name}: {} keys, {} SIGKILLs at random moments, {} right after a commit, lost = {}, applied twice = {}, replays {} of which differing = {}",
        accounting.keys,
        accounting.kills,
        accounting.self_kills,
        accounting.lost,
        accounting.applied_twice,
        accounting.replays,
        accounting.replay_mismatches
    );
}

#[test]
fn a_server_sigkilled_while_clients_retry_loses_nothing_and_applies_nothing_twice() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let accounting = run("layer", crash_keys(), None, embedded_effects);
    report("http crash", &accounting);
    accounting.assert_exactly_once();
}

#[test]
fn negative_control_a_response_stored_after_the_effects_is_caught_applying_them_twice() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let accounting = run("outside", crash_keys(), None, embedded_effects);
    report("http crash, negative control", &accounting);
    assert!(
        accounting.applied_twice > 0,
        "the check did not catch effects applied twice with the response stored outside their batch"
    );
}

/// Keys of the PostgreSQL runs: each request opens a connection, so fewer than the embedded's.
#[cfg(feature = "postgres")]
fn pg_keys() -> usize {
    env_or("IDEMDB_HTTP_CRASH_PG_KEYS", 1000) as usize
}

#[cfg(feature = "postgres")]
#[test]
fn on_postgresql_a_server_sigkilled_while_clients_retry_loses_nothing_and_applies_nothing_twice() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let Some((_server, url)) = on_postgres::start() else {
        return;
    };
    let accounting = run("postgres", pg_keys(), Some(url.clone()), |_| {
        on_postgres::effects(&url)
    });
    report("http crash on PostgreSQL", &accounting);
    accounting.assert_exactly_once();
}

#[cfg(feature = "postgres")]
#[test]
fn on_postgresql_negative_control_an_effect_committed_outside_the_claims_transaction_is_caught() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let Some((_server, url)) = on_postgres::start() else {
        return;
    };
    let accounting = run("postgres-outside", pg_keys(), Some(url.clone()), |_| {
        on_postgres::effects(&url)
    });
    report("http crash on PostgreSQL, negative control", &accounting);
    assert!(
        accounting.applied_twice > 0,
        "the check did not catch effects committed outside the claim's transaction"
    );
}

/// A request as a client sends it: status, `Retry-After`, whether marked a replay, body.
#[cfg(feature = "postgres")]
async fn send_once(address: SocketAddr, key: &str) -> (StatusCode, Option<String>, bool, Bytes) {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::post("/payments")
        .header("host", "localhost")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(format!("{{\"order\":\"{key}\"}}"))))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_owned());
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, retry_after, replayed, body)
}

/// Waits (without a deadline on the outcome, only on the test) until `path` exists.
#[cfg(feature = "postgres")]
async fn reached(path: &Path) {
    for _ in 0..6000 {
        if path.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{} never appeared", path.display());
}

#[cfg(feature = "postgres")]
#[test]
fn on_postgresql_a_request_in_flight_in_another_process_is_409_and_a_killed_holder_frees_its_key() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let Some((_database, url)) = on_postgres::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().to_path_buf();
    // Two server processes on one database: they see each other only through it.
    let mut servers: Vec<Server> = ["a", "b"]
        .iter()
        .map(|name| Server {
            mode: "postgres-gated",
            dir: gate.clone(),
            pg_url: Some(url.clone()),
            port_file: dir.path().join(format!("port-{name}")),
            after_commit_permille: 0,
            child: None,
            address: Arc::new(parking_lot::Mutex::new(None)),
            kills: 0,
            self_kills: 0,
        })
        .collect();
    for server in &mut servers {
        server.start();
    }
    let [a, b] = [0, 1].map(|n| servers[n].address.lock().unwrap());
    let b_process = servers[1].child.as_ref().unwrap().id();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        // In flight on A: B answers 409 with Retry-After and does not run its handler.
        let first = tokio::spawn(send_once(a, "order-1"));
        reached(&gate.join("order-1.reached")).await;
        std::fs::remove_file(gate.join("order-1.reached")).unwrap();
        let second = tokio::spawn(send_once(b, "order-1"));
        while !second.is_finished() {
            assert!(
                !gate.join("order-1.reached").exists(),
                "B ran the handler of a key A holds"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (status, retry_after, _, body) = second.await.unwrap();
        assert_eq!(status, StatusCode::CONFLICT, "{body:?}");
        let seconds: u64 = retry_after
            .expect("Retry-After on the 409")
            .parse()
            .unwrap();
        assert!(seconds >= 1);
        // A finishes; B replays A's response byte for byte without running the handler.
        std::fs::write(gate.join("order-1.go"), b"").unwrap();
        let (status, _, replayed, stored) = first.await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(!replayed);
        let (status, _, replayed, body) = send_once(b, "order-1").await;
        assert_eq!(
            (status, replayed, &body),
            (StatusCode::CREATED, true, &stored)
        );

        // A SIGKILLed while it holds a key: its transaction ends with its connection, and B
        // runs the request for the first time (409 until the database has seen A go).
        let held = tokio::spawn(send(a, "order-2"));
        reached(&gate.join("order-2.reached")).await;
        std::fs::remove_file(gate.join("order-2.reached")).unwrap();
        servers[0].kill();
        assert!(
            held.await.unwrap().is_none(),
            "A answered after its SIGKILL"
        );
        std::fs::write(gate.join("order-2.go"), b"").unwrap();
        let mut conflicts = 0;
        let body = loop {
            let (status, _, replayed, body) = send_once(b, "order-2").await;
            if status == StatusCode::CONFLICT {
                conflicts += 1;
                assert!(conflicts < 2000, "A's key was never freed");
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            assert_eq!((status, replayed), (StatusCode::CREATED, false), "{body:?}");
            break body;
        };
        assert!(
            String::from_utf8_lossy(&body).contains(&format!("\"process\":{b_process}")),
            "order-2 was not run by B: {body:?}"
        );
    });
    for server in &mut servers {
        server.kill();
    }
    let effects = on_postgres::effects(&url);
    assert_eq!(effects.get("order-1"), Some(&1), "order-1 applied once");
    assert_eq!(
        effects.get("order-2"),
        Some(&1),
        "order-2 applied once, by B"
    );
    assert_eq!(effects.len(), 2);
}
