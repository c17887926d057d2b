//! `http-peer`: the HTTP layer (`idemdb-http`) against a middleware users find for the same job
//! today, `axum-idempotent` 0.6 (responses cached in a `ruts` session store after the handler
//! ran; its documented in-memory store), on the same concurrent retries.
//!
//! Each key is sent by `racers` requests at once, as a client does that retries on new
//! connections while its first attempt is still being processed (a timeout shorter than the
//! handler). All of a key's requests carry the same payload, and for the peer the same session
//! (its cache is per session). Each handler commits its effect durably in an idemdb table (the
//! layer's handler stages it on its claim; the peer's handler commits it with a claim of its
//! own, as a handler writing to its own database does) and sleeps `work_ms` to be processed
//! for a while. A request answered `409` is retried until it gets another answer. Counted per
//! key in the store: effects committed (1 is right, more is a duplicate effect), and whether
//! every client of the key got the same response.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idemdb::{BusinessTable, Consumer, Engine, Fingerprint, Outcome, TableOptions, merge_ops};
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal};
use ruts::store::SessionStore;
use ruts::store::Ttl;
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, Session, SessionLayer};

use crate::report::machine::Machine;

#[derive(Args, Clone)]
pub struct HttpPeerArgs {
    /// Keys sent; each by `racers` requests at once.
    #[arg(long, default_value_t = 200)]
    pub keys: usize,
    /// Requests racing on each key.
    #[arg(long, default_value_t = 8)]
    pub racers: usize,
    /// How long each handler works before it answers, in ms.
    #[arg(long, default_value_t = 5)]
    pub work_ms: u64,
    /// Where the report (`http-peer.md`) goes.
    #[arg(long, default_value = "docs/bench/http")]
    pub out: PathBuf,
}

#[derive(Clone)]
struct Served {
    effects: BusinessTable,
    attempts: Consumer,
    runs: Arc<AtomicU64>,
    attempt: Arc<AtomicU64>,
    work: Duration,
}

impl Served {
    fn response(&self, key: &str) -> String {
        format!(
            "{{\"key\":\"{key}\",\"run\":{}}}",
            self.runs.fetch_add(1, Ordering::SeqCst)
        )
    }
}

pub(super) fn idempotency_key(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .map(|key| String::from_utf8_lossy(key.as_bytes()).into_owned())
        .unwrap_or_default()
}

/// Behind `idemdb-http`: the effect staged on the request's claim, committed with the response.
async fn with_layer(
    State(served): State<Served>,
    Extension(request): Extension<IdempotentRequest>,
    headers: HeaderMap,
) -> Response {
    let key = idempotency_key(&headers);
    if request
        .merge(&served.effects, format!("idemdb/{key}"), 1u64.to_be_bytes())
        .is_err()
    {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    tokio::time::sleep(served.work).await;
    (StatusCode::CREATED, served.response(&key)).into_response()
}

/// Behind `axum-idempotent`: the effect committed by the handler, the response cached by the
/// middleware afterwards.
async fn with_peer(State(served): State<Served>, headers: HeaderMap) -> Response {
    let key = idempotency_key(&headers);
    tokio::time::sleep(served.work).await;
    // Each run's own claim: the effect's write, as a handler's own database transaction.
    let attempt = format!("{key}/{}", served.attempt.fetch_add(1, Ordering::SeqCst));
    let Ok(Outcome::Fresh(mut claim)) = served.attempts.begin(&attempt, Fingerprint::of(b""))
    else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    if claim
        .merge(&served.effects, format!("peer/{key}"), 1u64.to_be_bytes())
        .is_err()
        || claim.commit_async(b"").await.is_err()
    {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    (StatusCode::CREATED, served.response(&key)).into_response()
}

/// Creates the client's session: the peer caches only for requests that carry one.
pub(super) async fn open_session<S: SessionStore>(session: Session<S>) -> StatusCode {
    match session
        .set("client", &1u8, Ttl::new(3600).expect("a valid TTL"), None)
        .await
    {
        Ok(()) => StatusCode::OK,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

fn routers(engine: &Engine, work: Duration) -> Result<(Router, Router)> {
    let served = Served {
        effects: engine.business_table("effects")?,
        attempts: engine.consumer("attempts")?,
        runs: Arc::new(AtomicU64::new(0)),
        attempt: Arc::new(AtomicU64::new(0)),
        work,
    };
    let layer = IdempotencyLayer::new(engine.consumer("http")?, |_| Principal::new("client").ok());
    let ours = Router::new()
        .route("/payments", post(with_layer))
        .layer(layer)
        .with_state(served.clone());
    let options = axum_idempotent::IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(3600);
    let store = Arc::new(MokaStore::builder().build());
    let peer = Router::new()
        .route("/payments", post(with_peer))
        .layer(axum_idempotent::IdempotentLayer::<MokaStore>::new(options))
        .route("/session", get(open_session::<MokaStore>))
        .layer(
            SessionLayer::new(store)
                .with_cookie_options(CookieOptions::build().name("session").path("/")),
        )
        .layer(tower_cookies::CookieManagerLayer::new())
        .with_state(served);
    Ok((ours, peer))
}

async fn serve(router: Router) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(address)
}

/// An answer: status, `Set-Cookie`, whether it was marked as a replay, body.
pub(super) type Answer = (StatusCode, Option<String>, bool, Bytes);

/// One request on a new connection.
pub(super) async fn send(address: SocketAddr, request: Request<Full<Bytes>>) -> Result<Answer> {
    let stream = tokio::net::TcpStream::connect(address).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let response = sender.send_request(request).await?;
    let status = response.status();
    let cookie = response
        .headers()
        .get("set-cookie")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(str::to_owned);
    // idemdb-http's marker, and axum-idempotent's default one.
    let replayed = ["idempotent-replayed", "idempotency-replayed"]
        .iter()
        .any(|name| response.headers().contains_key(*name));
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, cookie, replayed, body))
}

pub(super) fn payment(key: &str, cookie: Option<&str>) -> Request<Full<Bytes>> {
    let mut request = Request::post("/payments")
        .header("host", "localhost")
        .header("idempotency-key", key);
    if let Some(cookie) = cookie {
        request = request.header("cookie", cookie);
    }
    request
        .body(Full::new(Bytes::from_static(b"{\"amount\":1250}")))
        .expect("a valid request")
}

/// What one middleware did with the racing requests.
#[derive(Default)]
struct Tally {
    requests: u64,
    conflicts_retried: u64,
    /// Keys whose effect was committed more than once, and the extra effects.
    applied_twice: u64,
    extra_effects: u64,
    /// Keys with no effect committed.
    lost: u64,
    /// Keys whose clients got different 2xx responses.
    different_responses: u64,
    /// Keys whose later retry, sent alone after the race, was answered as a replay (the
    /// middleware is set up to replay at all).
    replayed_later: u64,
}

/// Sends every key `racers` times at once to `address`, with `cookie_for(key)`.
async fn race(
    address: SocketAddr,
    args: &HttpPeerArgs,
    prefix: &str,
    session: bool,
) -> Result<(Tally, Vec<String>)> {
    let mut tally = Tally::default();
    let mut keys = Vec::new();
    for n in 0..args.keys {
        let key = format!("key-{n}");
        let cookie = if session {
            let request = Request::get("/session")
                .header("host", "localhost")
                .body(Full::new(Bytes::new()))?;
            let (status, cookie, _, _) = send(address, request).await?;
            if status != StatusCode::OK {
                bail!("no session: {status}");
            }
            Some(cookie.context("the session's cookie")?)
        } else {
            None
        };
        let racers: Vec<_> = (0..args.racers)
            .map(|_| {
                let (key, cookie) = (key.clone(), cookie.clone());
                tokio::spawn(async move {
                    let mut retried = 0u64;
                    loop {
                        let (status, _, _, body) =
                            send(address, payment(&key, cookie.as_deref())).await?;
                        if status != StatusCode::CONFLICT {
                            return anyhow::Ok((status, body, retried));
                        }
                        retried += 1;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                })
            })
            .collect();
        let mut bodies: HashMap<Bytes, u64> = HashMap::new();
        for racer in racers {
            let (status, body, retried) = racer.await??;
            tally.requests += 1 + retried;
            tally.conflicts_retried += retried;
            if !status.is_success() {
                bail!("{prefix} {key}: {status} {body:?}");
            }
            *bodies.entry(body).or_default() += 1;
        }
        if bodies.len() > 1 {
            tally.different_responses += 1;
        }
        let (_, _, replayed, _) = send(address, payment(&key, cookie.as_deref())).await?;
        tally.requests += 1;
        if replayed {
            tally.replayed_later += 1;
        }
        keys.push(format!("{prefix}/{key}"));
    }
    Ok((tally, keys))
}

fn count_effects(engine: &Engine, keys: &[String], tally: &mut Tally) -> Result<()> {
    let effects = engine.business_table("effects")?;
    for key in keys {
        let count = effects
            .get(key)?
            .as_deref()
            .and_then(merge_ops::read_u64)
            .unwrap_or(0);
        match count {
            0 => tally.lost += 1,
            1 => {}
            more => {
                tally.applied_twice += 1;
                tally.extra_effects += more - 1;
            }
        }
    }
    Ok(())
}

pub fn run(args: &HttpPeerArgs) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let machine = Machine::describe(dir.path());
    eprintln!("{machine}");
    let engine = Engine::builder(dir.path())
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .open()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let work = Duration::from_millis(args.work_ms);
    let ((mut ours, our_keys), (mut peer, peer_keys)) = runtime.block_on(async {
        let (our_router, peer_router) = routers(&engine, work)?;
        let (ours, peer) = (serve(our_router).await?, serve(peer_router).await?);
        anyhow::Ok((
            race(ours, args, "idemdb", false).await?,
            race(peer, args, "peer", true).await?,
        ))
    })?;
    count_effects(&engine, &our_keys, &mut ours)?;
    count_effects(&engine, &peer_keys, &mut peer)?;
    let mut md = format!(
        "# HTTP idempotency keys under concurrent retries: idemdb-http against axum-idempotent\n\n\
         {machine}\n\nMade by `cargo run --release -p idemdb-compare -- http-peer --keys {} \
         --racers {} --work-ms {}`. Each key is sent by {} requests at once on new connections \
         (a client retrying while its first attempt is still processed), with one payload, and \
         for axum-idempotent 0.6 one session (its cache is per session; its documented \
         in-memory `ruts` store, `MokaStore`). Each handler works {} ms and commits its effect \
         durably in an idemdb table: behind idemdb-http staged on the request's claim, behind \
         axum-idempotent with a claim of its own, the response cached by the middleware \
         afterwards. A `409` is retried until another answer comes. After each key's race one \
         more request of it is sent alone, which both should answer as a replay. Effects are \
         counted in the store afterwards.\n\n\
         | middleware | keys | requests sent | 409s retried | keys applied more than once | extra effects | keys lost | keys whose clients got different responses | keys replayed to a later retry |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        args.keys, args.racers, args.work_ms, args.racers, args.work_ms
    );
    for (name, tally) in [("idemdb-http", &ours), ("axum-idempotent 0.6", &peer)] {
        md.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            args.keys,
            tally.requests,
            tally.conflicts_retried,
            tally.applied_twice,
            tally.extra_effects,
            tally.lost,
            tally.different_responses,
            tally.replayed_later
        ));
    }
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("http-peer.md"), &md)?;
    println!("{md}");
    Ok(())
}
