//! An HTTP webhook receiver that deduplicates deliveries by their `Idempotency-Key` header.
//!
//! ```text
//! source scripts/setup.sh && cargo run --release --features tokio --example webhook -- [--port N] [--dir PATH]
//! ```
//!
//! It listens on 127.0.0.1 only (default port 18080) and keeps its store in `--dir` (default
//! `idemdb-webhook` in the system's temporary directory), so a restart still replays.
//!
//! `POST /payments` takes a payment (any body: JSON or plain text) and an `Idempotency-Key`
//! header. The first delivery of a key is processed: a row in the `payments` table and one more
//! on the `totals` counter, staged on an idemdb claim and committed in one write batch together
//! with the response (status and body) as the claim's result. Every later delivery of the key
//! gets an answer without a second effect:
//!
//! | delivery | answer |
//! |---|---|
//! | first (the key is new) | `201 Created`, processed; the response is stored |
//! | retry, same body, after the first completed | the stored status and body, plus `Idempotent-Replayed: true` |
//! | same key, different body | `422 Unprocessable Content` (RFC 9110's name for hyper's "Unprocessable Entity"): the key was reused for another payload |
//! | retry while the first is still being processed | `409 Conflict` with `Retry-After: 1` |
//! | no `Idempotency-Key`, an empty one, one over 1024 bytes, or two of them | `400 Bad Request` |
//! | the store fails | `503 Service Unavailable` (`500` for a corrupt record); nothing is stored |
//!
//! The status codes are the ones the IETF httpapi draft "The Idempotency-Key HTTP Header Field"
//! (draft-ietf-httpapi-idempotency-key-header) chose: 400 for a missing key, 422 for a key
//! reused with a different payload, 409 for a request made while the first with the same key is
//! still being processed. The key may be sent as the draft's structured-field string
//! (`Idempotency-Key: "8e03978e"`) or bare (`Idempotency-Key: 8e03978e`); both name the same key.
//! `GET /payments/count` reads the counter, to see that retries had no effect.
//!
//! How the answers come about, and what to keep when adapting this:
//!
//! - **In progress is the claim's latch.** The handler holds its [`idemdb::Claim`] across the
//!   `.await`s of processing; while it does, the key is latched in this process and every other
//!   `begin` of it is `InProgress` (a 409). The latch is in memory, and one process owns a store
//!   (a second open is `AlreadyOpen`): run one receiver per store, and shard keys across
//!   receivers if one is not enough.
//! - **Cancellation writes nothing.** If the handler's future is dropped before it commits (the
//!   client disconnects, and hyper drops the request's future), the claim is dropped with it: no
//!   staged write lands and the key is free again, so the client's retry is processed afresh.
//!   Once `commit_async` has been called the commit goes ahead without the handler; a retry then
//!   replays its response.
//! - **Only successes are stored.** A failure (a storage error, a 5xx) drops the claim, so a
//!   retry with the same key runs again, which is what a client retrying a 5xx expects. Store a
//!   final 4xx the same way as the 201 if the business logic can reject a payment for good.
//! - **The commit does not block the runtime.** [`idemdb::Claim::commit_async`] hands the write
//!   batch (and its fsync) to the engine's committer thread, which writes concurrent commits as
//!   one group. `begin` runs inline: it is a point read, without a write or an fsync.
//! - **Scope of a key.** One consumer (`webhook`) holds the keys of the one endpoint, and the
//!   fingerprint covers the body only (the method and path are fixed). A service with several
//!   endpoints uses a consumer per endpoint; one with several clients puts the authenticated
//!   client's id in front of the key, or one client could replay another's response.
//! - **Expiry.** Keys are remembered for [`RETENTION`]; a retry after that is processed again.
//!   Publish it to clients, as the draft asks.

#[path = "../common/args.rs"]
mod args;
mod payments;
mod responses;
#[cfg(test)]
mod tests;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use idemdb::{Engine, EngineBuilder, TableOptions, merge_ops};
use tokio::net::TcpListener;

use args::Flags;
use payments::router;

/// The consumer under which the endpoint's idempotency keys are recorded.
const CONSUMER_ID: &str = "webhook";
/// The port used without `--port`: not a common default, so it rarely collides.
const PORT_DEFAULT: u16 = 18080;
/// How long a key is remembered. Longer than any client keeps retrying a delivery.
const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// The business table of payments, keyed by payment id.
const PAYMENTS_TABLE: &str = "payments";
/// The business table of counters (`add_u64` merge operator).
const TOTALS_TABLE: &str = "totals";
/// The counter of processed payments in [`TOTALS_TABLE`].
const PAYMENTS_COUNTER: &[u8] = b"payments";

/// Opens (or creates) the store with the tables the webhook writes.
fn open_engine(dir: &Path) -> idemdb::Result<Engine> {
    engine_builder(dir).open()
}

/// The store's options: the retention and the tables.
fn engine_builder(dir: &Path) -> EngineBuilder {
    Engine::builder(dir)
        .retention(RETENTION)
        .business_table(TableOptions::new(PAYMENTS_TABLE))
        .business_table(
            TableOptions::new(TOTALS_TABLE)
                .associative_merge_operator("add_u64", merge_ops::add_u64),
        )
}

struct Args {
    port: u16,
    dir: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        port: PORT_DEFAULT,
        dir: std::env::temp_dir().join("idemdb-webhook"),
    };
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--port" => args.port = flags.parse(&flag)?,
            "--dir" => args.dir = PathBuf::from(flags.value(&flag)?),
            other => return Err(format!("unknown argument {other} (--port N, --dir PATH)")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("webhook: {message}");
            return ExitCode::from(2);
        }
    };
    let engine = match open_engine(&args.dir) {
        Ok(engine) => engine,
        Err(failure) => {
            eprintln!(
                "webhook: cannot open the store at {:?}: {failure}",
                args.dir
            );
            return ExitCode::FAILURE;
        }
    };
    let app = match router(&engine, None) {
        Ok(app) => app,
        Err(failure) => {
            eprintln!("webhook: {failure}");
            return ExitCode::FAILURE;
        }
    };
    // Loopback only: this is an example, not a hardened public endpoint (no TLS, no auth).
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, args.port));
    let listener = match TcpListener::bind(address).await {
        Ok(listener) => listener,
        Err(failure) => {
            eprintln!("webhook: cannot listen on {address}: {failure}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "webhook: POST http://{address}/payments with an Idempotency-Key header \
         (store {:?}, keys kept {} h); Ctrl-C or SIGTERM stops",
        args.dir,
        RETENTION.as_secs() / 3600
    );
    // Graceful: requests in flight finish (and commit) before the store is closed.
    if let Err(failure) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
    {
        eprintln!("webhook: server failed: {failure}");
        return ExitCode::FAILURE;
    }
    println!("webhook: stopped");
    ExitCode::SUCCESS
}

/// Resolves on Ctrl-C, or on SIGTERM (what service managers and container runtimes send).
/// A signal whose handler cannot be installed never fires.
async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                terminate.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}
