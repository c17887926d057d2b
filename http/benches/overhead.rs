//! What the layer costs (the HTTP layer issue's overhead goal): a handler that stages one write
//! behind `IdempotencyLayer`, against the same handler claiming its key by hand with idemdb's
//! claim (begin, put, `commit_async` with the response, replay of a duplicate), as a service
//! without the layer would. Both served by one axum server on 127.0.0.1 from one durable store
//! (`Durability::Sync`, the default commit log), side by side: each round runs every contender
//! once, in the same order, and the figures are medians over the rounds.
//!
//! Clients are tasks with one keep-alive HTTP/1 connection each (hyper's client), sending POSTs
//! with a new key each, back to back; latency is per request, at the client.
//!
//! ```text
//! source scripts/setup.sh && cargo bench -p idemdb-http --bench overhead -- [--seconds 3] [--rounds 3] [--out docs/bench/http]
//! ```

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idemdb::{BusinessTable, Consumer, Engine, Fingerprint, Outcome, TableOptions};
use idemdb_http::{IdempotencyLayer, IdempotentRequest, Principal};

const CONCURRENCY: [usize; 3] = [1, 8, 64];
const BODY: &str = "{\"amount\":1250,\"currency\":\"EUR\",\"to\":\"acct-17\"}";

#[derive(Clone)]
struct Tables {
    payments: BusinessTable,
    consumer: Consumer,
}

/// Behind the layer: stage the row; the layer claims, stores the response and commits.
async fn with_layer(
    State(tables): State<Tables>,
    Extension(request): Extension<IdempotentRequest>,
    body: Bytes,
) -> Response {
    let staged = request
        .derive_key("payment")
        .and_then(|id| request.put(&tables.payments, &id, &body).map(|()| id));
    match staged {
        Ok(id) => (StatusCode::CREATED, id).into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// By hand: the same row, the claim and its stored response written by the handler itself
/// (the response's status and body as the claim's result), as the webhook example did before
/// the layer.
async fn by_hand(State(tables): State<Tables>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(key) = headers.get("idempotency-key") else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    match tables
        .consumer
        .begin(key.as_bytes(), Fingerprint::of(&body))
    {
        Ok(Outcome::Fresh(mut claim)) => {
            let id = claim.derive_key("payment");
            if claim.put(&tables.payments, &id, &body).is_err() {
                return StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
            let mut stored = 201u16.to_be_bytes().to_vec();
            stored.extend_from_slice(id.as_bytes());
            match claim.commit_async(stored).await {
                Ok(_) => (StatusCode::CREATED, id).into_response(),
                Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
            }
        }
        Ok(Outcome::Duplicate { result, .. }) => {
            let mut response = (StatusCode::CREATED, result.slice(2..)).into_response();
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            response
        }
        Ok(Outcome::Conflict { .. }) => StatusCode::UNPROCESSABLE_ENTITY.into_response(),
        Ok(Outcome::InProgress { .. }) => StatusCode::CONFLICT.into_response(),
        Ok(_) | Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

struct Args {
    seconds: f64,
    rounds: usize,
    out: std::path::PathBuf,
}

fn args() -> Args {
    let mut args = Args {
        seconds: 3.0,
        rounds: 3,
        out: "docs/bench/http".into(),
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        match flag.as_str() {
            "--seconds" => args.seconds = given.next().and_then(|v| v.parse().ok()).unwrap(),
            "--rounds" => args.rounds = given.next().and_then(|v| v.parse().ok()).unwrap(),
            "--out" => args.out = given.next().unwrap().into(),
            // cargo bench passes --bench; anything else is a mistake.
            "--bench" => {}
            other => panic!("unknown argument {other} (--seconds S, --rounds N, --out DIR)"),
        }
    }
    // cargo runs a bench in its package's folder: a relative --out names a folder of the
    // workspace, as the command in BENCHMARKS.md gives it.
    if args.out.is_relative() {
        args.out = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(&args.out);
    }
    args
}

/// One client: requests back to back on one connection for `duration`, a new key each.
async fn client(
    address: SocketAddr,
    path: &'static str,
    client: usize,
    duration: Duration,
) -> Vec<Duration> {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut latencies = Vec::new();
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < duration {
        n += 1;
        let key = format!("{path}-{client}-{n}-{}", started.elapsed().as_nanos());
        let request = Request::post(path)
            .header("host", "localhost")
            .header("x-tenant", "acme")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
            .unwrap();
        let sent = Instant::now();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        response.into_body().collect().await.unwrap();
        latencies.push(sent.elapsed());
    }
    latencies
}

/// One contender at one concurrency for `duration`: (requests per second, p50 us, p99 us).
async fn measure(
    address: SocketAddr,
    path: &'static str,
    clients: usize,
    duration: Duration,
) -> (f64, f64, f64) {
    let tasks: Vec<_> = (0..clients)
        .map(|n| tokio::spawn(client(address, path, n, duration)))
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    latencies.sort();
    let quantile = |q: f64| {
        let index = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies[index].as_secs_f64() * 1e6
    };
    (
        latencies.len() as f64 / duration.as_secs_f64(),
        quantile(0.5),
        quantile(0.99),
    )
}

/// A contender at a concurrency, `(path, clients)`, with each round's (req/s, p50 us, p99 us).
type Cell = ((&'static str, usize), Vec<(f64, f64, f64)>);

/// The CPU and its cores, for the report.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|name| name.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    format!("machine: {cpu}, {cores} cores; store in the system's temporary directory")
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main]
async fn main() {
    let args = args();
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::builder(dir.path())
        .business_table(TableOptions::new("payments"))
        .open()
        .unwrap();
    let tables = Tables {
        payments: engine.business_table("payments").unwrap(),
        consumer: engine.consumer("by-hand").unwrap(),
    };
    let layer = IdempotencyLayer::new(engine.consumer("layer").unwrap(), |request| {
        Principal::new(request.headers.get("x-tenant")?.as_bytes()).ok()
    });
    let router = Router::new()
        .route("/layer", post(with_layer).layer(layer))
        .route("/by-hand", post(by_hand))
        .with_state(tables);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    let duration = Duration::from_secs_f64(args.seconds);
    let contenders = ["/by-hand", "/layer"];
    let mut cells: Vec<Cell> = contenders
        .iter()
        .flat_map(|&path| CONCURRENCY.map(|clients| ((path, clients), Vec::new())))
        .collect();
    for round in 0..args.rounds {
        for ((path, clients), rounds) in &mut cells {
            let figures = measure(address, path, *clients, duration).await;
            eprintln!(
                "round {}/{}  {path:<9} {clients:>3} clients  {:>8.0} req/s  p50 {:>8.1} us  p99 {:>8.1} us",
                round + 1,
                args.rounds,
                figures.0,
                figures.1,
                figures.2
            );
            rounds.push(figures);
        }
    }
    let figure = |path: &str, clients: usize, pick: fn(&(f64, f64, f64)) -> f64| {
        let rounds = &cells
            .iter()
            .find(|((p, c), _)| *p == path && *c == clients)
            .unwrap()
            .1;
        median(rounds.iter().map(pick).collect())
    };
    let mut md = format!(
        "# The HTTP layer's overhead\n\n{}\n\nMade by `cargo bench -p idemdb-http --bench overhead -- \
         --seconds {} --rounds {}`: {} rounds, each running every contender once in the order \
         below, medians over the rounds. One durable store (`Durability::Sync`, the default \
         commit log) behind one axum server on 127.0.0.1; clients are tasks with one keep-alive \
         HTTP/1 connection each, sending a new key per request. `by hand`: the handler claims its \
         key with idemdb's claim, stages the row and commits the response with `commit_async`; \
         `layer`: the same row staged on `IdempotentRequest` behind `IdempotencyLayer`.\n\n\
         | clients | by hand req/s | layer req/s | by hand p50 us | layer p50 us | layer / by hand p50 | by hand p99 us | layer p99 us |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|\n",
        machine(),
        args.seconds,
        args.rounds,
        args.rounds
    );
    for clients in CONCURRENCY {
        let hand_p50 = figure("/by-hand", clients, |f| f.1);
        let layer_p50 = figure("/layer", clients, |f| f.1);
        md.push_str(&format!(
            "| {clients} | {:.0} | {:.0} | {hand_p50:.1} | {layer_p50:.1} | {:.2}x | {:.1} | {:.1} |\n",
            figure("/by-hand", clients, |f| f.0),
            figure("/layer", clients, |f| f.0),
            layer_p50 / hand_p50,
            figure("/by-hand", clients, |f| f.2),
            figure("/layer", clients, |f| f.2),
        ));
    }
    println!("{md}");
    std::fs::create_dir_all(&args.out).unwrap();
    std::fs::write(args.out.join("overhead.md"), md).unwrap();
}
