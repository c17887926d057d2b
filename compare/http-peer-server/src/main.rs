//! The peer's server in `idemdb-compare http-peer-crash`: `axum-idempotent` 0.6 in front of a
//! handler that commits its effect (a row of `peer_effects`) and answers; the middleware then
//! caches the response in `ruts`' PostgreSQL session store. Both live in one PostgreSQL
//! database, each write committed durably (`synchronous_commit` on), so a restarted server has
//! every effect and every cached response its predecessor committed.
//!
//! Usage: `http-peer-server <postgres url> <port file> <after-commit permille> <work ms>`: the
//! handler works that long before its effect commits. It writes its
//! port to the port file once it listens, and serves until it is killed; after an effect's
//! commit it SIGKILLs itself with the given chance, before the middleware caches the response.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ruts::store::Ttl;
use ruts::store::postgres::{PostgresStore, PostgresStoreBuilder};
use ruts::{CookieOptions, Session, SessionLayer};
use sqlx::PgPool;

#[derive(Clone)]
struct Served {
    pool: PgPool,
    work: std::time::Duration,
    runs: Arc<AtomicU64>,
    permille: u64,
    random: Arc<AtomicU64>,
}

impl Served {
    /// Whether to die right after this commit (xorshift over a shared state).
    fn die_now(&self) -> bool {
        let mut x = self.random.load(Ordering::SeqCst);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.random.store(x, Ordering::SeqCst);
        x % 1000 < self.permille
    }
}

async fn pay(State(served): State<Served>, headers: HeaderMap) -> Response {
    let key = headers
        .get("idempotency-key")
        .map(|key| String::from_utf8_lossy(key.as_bytes()).into_owned())
        .unwrap_or_default();
    tokio::time::sleep(served.work).await;
    let inserted = sqlx::query("INSERT INTO peer_effects (key) VALUES ($1)")
        .bind(&key)
        .execute(&served.pool)
        .await;
    if inserted.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    if served.die_now() {
        // SAFETY: kill(2) on this process's own pid; SIGKILL ends it here.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let body = format!(
        "{{\"key\":\"{key}\",\"process\":{},\"run\":{}}}",
        std::process::id(),
        served.runs.fetch_add(1, Ordering::SeqCst)
    );
    (StatusCode::CREATED, body).into_response()
}

/// Creates the client's session: the middleware caches only for requests that carry one.
async fn open_session(session: Session<PostgresStore>) -> StatusCode {
    let Ok(ttl) = Ttl::new(3600) else {
        return StatusCode::INTERNAL_SERVER_ERROR;
    };
    match session.set("client", &1u8, ttl, None).await {
        Ok(()) => StatusCode::OK,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, port_file, permille, work_ms] = &args[..] else {
        return Err(
            "usage: http-peer-server <postgres url> <port file> <after-commit permille> <work ms>"
                .into(),
        );
    };
    let pool = PgPool::connect(url).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS peer_effects (key text NOT NULL)")
        .execute(&pool)
        .await?;
    let store = Arc::new(
        PostgresStoreBuilder::new(pool.clone())
            .create_table(true)
            .build()
            .await?,
    );
    let served = Served {
        pool,
        work: std::time::Duration::from_millis(work_ms.parse()?),
        runs: Arc::new(AtomicU64::new(0)),
        permille: permille.parse()?,
        random: Arc::new(AtomicU64::new(u64::from(std::process::id()) | 1)),
    };
    let options = axum_idempotent::IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(3600);
    let router = Router::new()
        .route("/payments", post(pay))
        .layer(axum_idempotent::IdempotentLayer::<PostgresStore>::new(
            options,
        ))
        .route("/session", get(open_session))
        .layer(
            SessionLayer::new(store)
                .with_cookie_options(CookieOptions::build().name("session").path("/")),
        )
        .layer(tower_cookies::CookieManagerLayer::new())
        .with_state(served);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let staged = format!("{port_file}.staged");
    std::fs::write(&staged, port.to_string())?;
    std::fs::rename(&staged, port_file)?;
    axum::serve(listener, router).await?;
    Ok(())
}
