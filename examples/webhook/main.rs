//! An HTTP webhook receiver that deduplicates deliveries by their `Idempotency-Key` header,
//! with the `idemdb-http` layer.
//!
//! ```text
//! source scripts/setup.sh && cargo run --release --features tokio --example webhook -- [--port N] [--dir PATH]
//! ```
//!
//! It listens on 127.0.0.1 only (default port 18080) and keeps its store in `--dir` (default
//! `idemdb-webhook` in the system's temporary directory), so a restart still replays.
//!
//! `POST /payments` takes a payment (any body) and an `Idempotency-Key` header. The first
//! delivery of a key runs the handler: a row in the `payments` table and one more on the
//! `totals` counter, staged on the request's claim and committed in one write batch with the
//! response (`201 Created`). Every later delivery of the key is answered by the layer without a
//! second effect: the stored response with `Idempotent-Replayed: true`; `422` for the key
//! reused with another body; `409` with `Retry-After` while the first is in progress; `400` for
//! a missing or malformed key; `503` when the store fails, storing nothing. The table of every
//! answer is in the `idemdb-http` crate's documentation and in the guide's chapter "HTTP
//! idempotency keys". `GET /payments/count` reads the counter, to see that retries had no
//! effect.
//!
//! What to keep when adapting this: the principal ([`SENDER`] here, one sender; the
//! authenticated client in a service with several), the retention ([`RETENTION`]: publish it
//! to clients), and writes staged on the [`idemdb_http::IdempotentRequest`] rather than made
//! directly, so that they commit with the response.

#[path = "../common/args.rs"]
mod args;
mod payments;
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
/// The principal the keys are scoped by: this receiver has one sender.
const SENDER: &str = "payment-provider";
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
