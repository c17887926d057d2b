//! `http-peer-crash`: the crash half of the HTTP peer run. The server process behind each
//! middleware is SIGKILLed at random moments and right after its effect's commit while clients
//! retry, restarted on the same stores, and every key's effects are counted afterwards; the
//! same schedule for both.
//!
//! Behind `idemdb-http` the effect is staged on the request's claim and commits with the stored
//! response (the server is this binary run again: `http-peer-serve`, hidden). Behind
//! `axum-idempotent` 0.6 the handler commits its effect durably (a row in PostgreSQL) and the
//! middleware then caches the response in `ruts`' PostgreSQL session store, also durable, so
//! that a restarted server still has every response it cached (the server is
//! `compare/http-peer-server`, a package of its own: see its manifest). `ruts`' Redis store
//! needs Redis 7.4's field expiry; Debian 12 ships 7.0.
//!
//! Each client sends its keys one at a time until it gets a 2xx, then once more (a client that
//! lost the first answer would send exactly this), and compares the two. Counted per key:
//! effects committed (0 is lost, more than 1 applied twice) and whether the retry's answer
//! differed from the first (the first response lost).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use clap::Args;
use http_body_util::Full;
use idemdb::{BusinessTable, Engine, TableOptions, merge_ops};
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal};

use super::http_peer::{Answer, idempotency_key, payment, send};
use crate::report::machine::Machine;
use crate::servers;

#[derive(Args, Clone)]
pub struct HttpPeerCrashArgs {
    /// Keys sent by each middleware's clients.
    #[arg(long, default_value_t = 2000)]
    pub keys: usize,
    /// Clients, each sending its keys one after another.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// How long each handler works before its effect commits, in ms.
    #[arg(long, default_value_t = 5)]
    pub work_ms: u64,
    /// Chance, in thousandths, that a server kills itself right after an effect's commit.
    #[arg(long, default_value_t = 5)]
    pub after_commit_permille: u64,
    /// Port of the PostgreSQL server the run starts (the peer's session store).
    #[arg(long, default_value_t = 16482)]
    pub pg_port: u16,
    /// Where the report (`http-peer-crash.md`) goes.
    #[arg(long, default_value = "docs/bench/http")]
    pub out: PathBuf,
}

/// The server behind idemdb-http, until it is killed (run by `http-peer-crash`).
#[derive(Args, Clone)]
pub struct HttpPeerServeArgs {
    /// The engine's folder (the effects, and the layer's claims).
    #[arg(long)]
    dir: PathBuf,
    /// Where the server writes its port once it listens.
    #[arg(long)]
    port_file: PathBuf,
    #[arg(long)]
    after_commit_permille: u64,
    #[arg(long)]
    work_ms: u64,
}

const OURS: &str = "idemdb-http";
const PEER: &str = "axum-idempotent";

fn open(dir: &Path) -> Result<Engine> {
    Ok(Engine::builder(dir)
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()?)
}

/// A small seeded generator: the few random numbers the schedule needs.
struct Random(u64);

impl Random {
    fn seeded() -> Random {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|since| since.as_nanos() as u64)
            .unwrap_or(0);
        Random((nanos ^ u64::from(std::process::id())) | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn kill_myself() -> ! {
    // SAFETY: kill(2) on this process's own pid; SIGKILL ends it here.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL did not end the process")
}

// ---------------------------------------------------------------------------------------------
// The child: a server on the stores, until it is killed.

#[derive(Clone)]
struct Served {
    effects: BusinessTable,
    work: Duration,
    runs: Arc<AtomicU64>,
    permille: u64,
    random: Arc<std::sync::Mutex<Random>>,
}

impl Served {
    /// Whether to die right after this commit.
    fn die_now(&self) -> bool {
        let mut random = self
            .random
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        random.below(1000) < self.permille
    }

    /// Names the process and the run: a second run of a key answers differently.
    fn response(&self, key: &str) -> String {
        format!(
            "{{\"key\":\"{key}\",\"process\":{},\"run\":{}}}",
            std::process::id(),
            self.runs.fetch_add(1, Ordering::SeqCst)
        )
    }
}

/// The effect staged on the request's claim.
async fn pay(
    State(served): State<Served>,
    Extension(request): Extension<IdempotentRequest>,
    headers: HeaderMap,
) -> Response {
    let key = idempotency_key(&headers);
    if request
        .merge(&served.effects, &key, 1u64.to_be_bytes())
        .is_err()
    {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    tokio::time::sleep(served.work).await;
    (StatusCode::CREATED, served.response(&key)).into_response()
}

pub fn serve(args: &HttpPeerServeArgs) -> Result<()> {
    let engine = open(&args.dir)?;
    let served = Served {
        effects: engine.business_table("effects")?,
        work: Duration::from_millis(args.work_ms),
        runs: Arc::new(AtomicU64::new(0)),
        permille: args.after_commit_permille,
        random: Arc::new(std::sync::Mutex::new(Random::seeded())),
    };
    let layer = IdempotencyLayer::new(engine.consumer("http")?, |_| Principal::new("clients").ok());
    let fate = served.clone();
    // Outermost: runs once the layer has committed, before the client hears.
    let router = Router::new()
        .route("/payments", post(pay))
        .layer(layer)
        .with_state(served)
        .layer(axum::middleware::map_response(move |response: Response| {
            let fate = fate.clone();
            async move {
                if response.status() == StatusCode::CREATED && fate.die_now() {
                    kill_myself();
                }
                response
            }
        }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let staged = args.port_file.with_extension("staged");
        std::fs::write(&staged, port.to_string())?;
        std::fs::rename(&staged, &args.port_file)?;
        axum::serve(listener, router).await?;
        anyhow::Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// The parent: clients, kills, restarts, and the accounting.

/// The server process of one middleware, and where it listens.
struct Server {
    program: PathBuf,
    args: Vec<String>,
    port_file: PathBuf,
    child: Option<Child>,
    address: Arc<std::sync::Mutex<Option<SocketAddr>>>,
    kills: u64,
    self_kills: u64,
}

impl Server {
    fn start(&mut self) -> Result<()> {
        let _ = std::fs::remove_file(&self.port_file);
        let child = Command::new(&self.program)
            .args(&self.args)
            .stdout(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        let port = loop {
            if let Ok(port) = std::fs::read_to_string(&self.port_file) {
                break port.parse::<u16>()?;
            }
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("the server exited at start: {status}");
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        *self.address() = Some(SocketAddr::from(([127, 0, 0, 1], port)));
        Ok(())
    }

    fn address(&self) -> std::sync::MutexGuard<'_, Option<SocketAddr>> {
        self.address
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// SIGKILLs the server (unless it killed itself) and waits for it.
    fn kill(&mut self) -> Result<()> {
        *self.address() = None;
        if let Some(mut child) = self.child.take() {
            if child.try_wait()?.is_some() {
                self.self_kills += 1;
            } else {
                child.kill()?;
                child.wait()?;
                self.kills += 1;
            }
        }
        Ok(())
    }

    fn ended(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => true,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One middleware's run.
#[derive(Default)]
struct Tally {
    requests: u64,
    /// Answers other than 2xx, retried (the server was restarting, or refused).
    refused: u64,
    kills: u64,
    self_kills: u64,
    lost: u64,
    applied_twice: u64,
    extra_effects: u64,
    replays: u64,
    replays_differing: u64,
}

/// Tries a key gets before the run gives up on the server (at least 15 s of no 2xx).
const TRIES_MAX: u32 = 5000;

/// Sends `request` to the server, if one listens now: its answer, or why there was none.
async fn try_send(
    address: &std::sync::Mutex<Option<SocketAddr>>,
    request: Request<Full<Bytes>>,
) -> Option<std::result::Result<Answer, String>> {
    let current = (*address
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()))?;
    Some(
        match tokio::time::timeout(Duration::from_secs(5), send(current, request)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("no answer in 5 s".to_owned()),
        },
    )
}

/// Sends `key` until a 2xx; a failed connection and any other status are retried.
async fn until_answered(
    address: &std::sync::Mutex<Option<SocketAddr>>,
    key: &str,
    cookie: Option<&str>,
    tally: &std::sync::Mutex<Tally>,
) -> Result<Bytes> {
    let mut last = String::from("no server");
    for _ in 0..TRIES_MAX {
        if let Some(sent) = try_send(address, payment(key, cookie)).await {
            let mut tally = tally
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            tally.requests += 1;
            match sent {
                Ok((status, _, _, body)) if status.is_success() => return Ok(body),
                Ok((status, _, _, body)) => {
                    tally.refused += 1;
                    last = format!("{status} {body:?}");
                }
                Err(why) => last = why,
            }
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    bail!("{key}: no 2xx in {TRIES_MAX} tries; the last: {last}")
}

/// A session for one client (the peer caches per session), asked for until the server answers.
async fn session(address: &std::sync::Mutex<Option<SocketAddr>>) -> Result<String> {
    let mut last = String::from("no server");
    for _ in 0..TRIES_MAX {
        let request = Request::get("/session")
            .header("host", "localhost")
            .body(Full::new(Bytes::new()))?;
        match try_send(address, request).await {
            Some(Ok((StatusCode::OK, Some(cookie), _, _))) => return Ok(cookie),
            Some(Ok((status, _, _, _))) => last = status.to_string(),
            Some(Err(why)) => last = why,
            None => {}
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    bail!("no session in {TRIES_MAX} tries; the last: {last}")
}

/// Builds the peer's server (a package of its own) and gives its executable.
fn peer_server() -> Result<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("http-peer-server/Cargo.toml");
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args([
            "build",
            "--release",
            "--message-format=json",
            "--manifest-path",
        ])
        .arg(&manifest)
        .stderr(Stdio::inherit())
        .output()
        .context("building compare/http-peer-server")?;
    if !output.status.success() {
        bail!("compare/http-peer-server did not build");
    }
    let marker = "\"executable\":\"";
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| {
            let start = line.find(marker)? + marker.len();
            let end = start + line[start..].find('"')?;
            Some(PathBuf::from(&line[start..end]))
        })
        .next_back()
        .context("no executable in cargo's output")
}

/// Runs the schedule against one middleware's server: `program` with `args`.
fn run_one(
    program: PathBuf,
    args: Vec<String>,
    run: &HttpPeerCrashArgs,
    port_file: PathBuf,
    with_session: bool,
) -> Result<Tally> {
    let server = Arc::new(std::sync::Mutex::new(Server {
        program,
        args,
        port_file,
        child: None,
        address: Arc::new(std::sync::Mutex::new(None)),
        kills: 0,
        self_kills: 0,
    }));
    server
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .start()?;
    let address = server
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .address
        .clone();
    let done = Arc::new(AtomicBool::new(false));
    // A SIGKILL every 10-50 ms of serving, and a restart after each, also of a server that
    // killed itself after a commit.
    let killer = std::thread::spawn({
        let (server, done) = (server.clone(), done.clone());
        move || -> Result<()> {
            let mut random = Random::seeded();
            while !done.load(Ordering::SeqCst) {
                let wait = 10 + random.below(40);
                for _ in 0..wait {
                    let ended = server
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .ended();
                    if done.load(Ordering::SeqCst) || ended {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                let mut server = server
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                server.kill()?;
                if !done.load(Ordering::SeqCst) {
                    server.start()?;
                }
            }
            Ok(())
        }
    });
    let tally = Arc::new(std::sync::Mutex::new(Tally::default()));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let keys = run.keys;
    runtime.block_on(async {
        let next = Arc::new(AtomicUsize::new(0));
        let clients: Vec<_> = (0..run.clients)
            .map(|_| {
                let (next, address, tally) = (next.clone(), address.clone(), tally.clone());
                tokio::spawn(async move {
                    let cookie = if with_session {
                        Some(session(&address).await?)
                    } else {
                        None
                    };
                    loop {
                        let n = next.fetch_add(1, Ordering::SeqCst);
                        if n >= keys {
                            break;
                        }
                        let key = format!("order-{n}");
                        let first =
                            until_answered(&address, &key, cookie.as_deref(), &tally).await?;
                        let again =
                            until_answered(&address, &key, cookie.as_deref(), &tally).await?;
                        let mut tally = tally
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner());
                        tally.replays += 1;
                        if again != first {
                            tally.replays_differing += 1;
                        }
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        for client in clients {
            client.await??;
        }
        anyhow::Ok(())
    })?;
    done.store(true, Ordering::SeqCst);
    killer
        .join()
        .map_err(|_| anyhow::anyhow!("the killer panicked"))??;
    let mut tally = Arc::try_unwrap(tally)
        .map_err(|_| anyhow::anyhow!("a client outlived the run"))?
        .into_inner()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    {
        let mut server = server
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        server.kill()?;
        tally.kills = server.kills;
        tally.self_kills = server.self_kills;
    }
    Ok(tally)
}

/// Counts each key's effects into `tally`.
fn count(tally: &mut Tally, keys: usize, effects: &HashMap<String, u64>) {
    for n in 0..keys {
        match effects.get(&format!("order-{n}")).copied().unwrap_or(0) {
            0 => tally.lost += 1,
            1 => {}
            more => {
                tally.applied_twice += 1;
                tally.extra_effects += more - 1;
            }
        }
    }
}

pub fn run(args: &HttpPeerCrashArgs) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let machine = Machine::describe(dir.path());
    eprintln!("{machine}");
    // Stopped when dropped, at the end of the run (also on an error).
    let _database = servers::postgres(&dir.path().join("pg"), args.pg_port)?;
    let pg_url = format!("postgres://postgres@127.0.0.1:{}/postgres", args.pg_port);
    let peer = peer_server()?;
    let mut rows: HashMap<&str, Tally> = HashMap::new();

    eprintln!("{OURS}: {} keys under SIGKILLs", args.keys);
    let store = dir.path().join("store");
    let port_file = dir.path().join("ours.port");
    let serve = vec![
        "http-peer-serve".to_owned(),
        "--dir".to_owned(),
        store.display().to_string(),
        "--port-file".to_owned(),
        port_file.display().to_string(),
        "--after-commit-permille".to_owned(),
        args.after_commit_permille.to_string(),
        "--work-ms".to_owned(),
        args.work_ms.to_string(),
    ];
    let mut ours = run_one(std::env::current_exe()?, serve, args, port_file, false)?;
    let engine = open(&store)?;
    let table = engine.business_table("effects")?;
    let mut effects = HashMap::new();
    for n in 0..args.keys {
        let key = format!("order-{n}");
        if let Some(count) = table.get(&key)?.as_deref().and_then(merge_ops::read_u64) {
            effects.insert(key, count);
        }
    }
    count(&mut ours, args.keys, &effects);
    rows.insert(OURS, ours);

    eprintln!("{PEER}: {} keys under SIGKILLs", args.keys);
    let port_file = dir.path().join("peer.port");
    let serve = vec![
        pg_url.clone(),
        port_file.display().to_string(),
        args.after_commit_permille.to_string(),
        args.work_ms.to_string(),
    ];
    let mut theirs = run_one(peer, serve, args, port_file, true)?;
    let mut client =
        postgres::Client::connect(&servers::postgres_url(args.pg_port), postgres::NoTls)?;
    let effects: HashMap<String, u64> = client
        .query("SELECT key, count(*) FROM peer_effects GROUP BY key", &[])?
        .iter()
        .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1) as u64))
        .collect();
    count(&mut theirs, args.keys, &effects);
    rows.insert(PEER, theirs);
    drop(client);
    let mut md = format!(
        "# HTTP idempotency keys under crashes: idemdb-http against axum-idempotent\n\n\
         {machine}\n\nMade by `cargo run --release -p idemdb-compare -- http-peer-crash --keys {} \
         --clients {} --work-ms {} --after-commit-permille {}`. Each handler works {} ms before \
         its effect commits. The server behind each middleware is \
         SIGKILLed every 10-50 ms of serving and, with a chance of {}/1000, right after an \
         effect's commit; it is restarted on the same stores each time. {} clients send {} keys, \
         each until a 2xx answer and then once more, as a client that lost the first answer \
         would. Behind idemdb-http the effect is staged on the request's claim and commits with \
         the stored response. Behind axum-idempotent 0.6 the handler commits its effect durably \
         (a row in PostgreSQL, `synchronous_commit` on) and the middleware caches the response \
         afterwards in `ruts`' PostgreSQL session store (durable too; one session per client, \
         kept across restarts). Effects are counted afterwards, each in the store it was \
         committed to.\n\n\
         | middleware | keys | requests sent | answers other than 2xx | SIGKILLs at random | SIGKILLs right after a commit | keys lost | keys applied more than once | extra effects | retries answered differently from the first |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        args.keys,
        args.clients,
        args.work_ms,
        args.after_commit_permille,
        args.work_ms,
        args.after_commit_permille,
        args.clients,
        args.keys
    );
    for which in [OURS, PEER] {
        let tally = &rows[which];
        md.push_str(&format!(
            "| {which} | {} | {} | {} | {} | {} | {} | {} | {} | {} of {} |\n",
            args.keys,
            tally.requests,
            tally.refused,
            tally.kills,
            tally.self_kills,
            tally.lost,
            tally.applied_twice,
            tally.extra_effects,
            tally.replays_differing,
            tally.replays
        ));
    }
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("http-peer-crash.md"), &md)?;
    println!("{md}");
    Ok(())
}
