//! An idempotent NATS JetStream consumer: orders from a durable pull consumer with explicit
//! acks, processed with idemdb, exactly-once effects behind an at-least-once broker.
//!
//! ```text
//! # One process per shard, each with its own embedded store:
//! cargo run --release --features tokio --example nats_orders -- \
//!     --nats 127.0.0.1:14222 --consumer orders-0 --dir /tmp/nats-orders-0
//! # Competing processes on one durable consumer, their claims and effects in PostgreSQL:
//! cargo run --release --features tokio --example nats_orders -- \
//!     --nats 127.0.0.1:14222 --consumer orders-fleet \
//!     --pg 'host=127.0.0.1 port=5432 user=postgres dbname=postgres'
//! ```
//!
//! For each message (order id in the `Idemdb-Order-Id` header, body `<order id>:<amount>:<variant>`):
//!
//! - `Fresh`: the effects are committed with the claim's marker, then the message is acked.
//!   With the embedded store, the order row, a per-order effect counter and the running total
//!   are staged on the claim and committed in one durable batch; with PostgreSQL (`--pg`), the
//!   effect (a row of `fleet.applied`) is written in the claim's transaction, by `begin` and
//!   `commit` or, with `--claim apply`, by one `apply` call.
//! - `Duplicate`: acked without effect. JetStream redelivers a message whose ack did not arrive
//!   within the consumer's ack wait (its consumer died, or the ack was lost), and a producer may
//!   publish an order twice outside the stream's duplicate window (`Nats-Msg-Id` deduplicates
//!   only inside it, and only at publish).
//! - `Conflict` (same order id, other content): published to the dead-letter subject with both
//!   fingerprints in headers, confirmed by the stream, then acked.
//! - `InProgress` (another process holds the order right now), or a retryable error: nacked
//!   with a short delay; JetStream redelivers.
//!
//! A crash anywhere (SIGKILL) is safe: before the commit nothing was written and the message is
//! redelivered after the ack wait; between the commit and the ack the redelivery is a
//! duplicate. An embedded store belongs to one process, so those consumers scale by shard: each
//! process owns one durable consumer (a subject filter on the shard's subject) and its own
//! store. Claims in PostgreSQL are seen by every process, so any number of processes may pull
//! from one durable consumer: JetStream hands each message to one of them, and a redelivery
//! may go to another. `e2e/src/bin/nats_e2e.rs` runs both shapes under SIGKILLs, of the
//! consumers and of the server, against a real `nats-server` (`scripts/nats-e2e.sh`).
//!
//! `--ack before-commit` and `--markers off` exist for the end-to-end checker's negative
//! controls (the ack sent before the commit; the effects applied without idemdb's markers):
//! each breaks exactly-once, and the checker must catch it.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures_lite::StreamExt;
use idemdb::Fingerprint;

#[path = "../common/args.rs"]
mod args;
mod claims;
#[path = "../common/ledger.rs"]
mod ledger;
#[path = "../common/jetstream.rs"]
mod names;
#[path = "../common/orders.rs"]
mod orders;
use args::Flags;
use claims::{Claims, Decision};
use ledger::{Ledger, monotonic_ns};
use names::{
    DEAD_LETTER_SUBJECT, HEADER_ORDER_ID, HEADER_RECEIVED_FINGERPRINT, HEADER_STORED_FINGERPRINT,
    STREAM,
};
use orders::{BoxError, chain};

/// Where the ack goes relative to the commit. Only `AfterCommit` is right.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ack {
    AfterCommit,
    /// Negative control: a SIGKILL between the ack and the commit loses the order.
    BeforeCommit,
}

struct Options {
    nats: String,
    consumer: String,
    /// The embedded store's folder (without `--pg`).
    dir: PathBuf,
    /// A libpq-style connection string: claims and effects in PostgreSQL.
    pg: Option<String>,
    /// With `--pg`: `apply` (one call) instead of `begin` and `commit`.
    apply: bool,
    events: Option<PathBuf>,
    /// Per mille of commits after which the process SIGKILLs itself before the ack.
    kill_after_commit_per_mille: u64,
    ack: Ack,
    /// Off: the effects applied without claiming the order first (negative control).
    markers: bool,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        nats: "127.0.0.1:14222".into(),
        consumer: "orders-0".into(),
        dir: PathBuf::from("/tmp/idemdb-nats-orders-0"),
        pg: None,
        apply: false,
        events: None,
        kill_after_commit_per_mille: 0,
        ack: Ack::AfterCommit,
        markers: true,
    };
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--nats" => options.nats = flags.value(&flag)?,
            "--consumer" => options.consumer = flags.value(&flag)?,
            "--dir" => options.dir = flags.value(&flag)?.into(),
            "--pg" => options.pg = Some(flags.value(&flag)?),
            "--claim" => {
                options.apply = match flags.value(&flag)?.as_str() {
                    "begin" => false,
                    "apply" => true,
                    other => return Err(format!("--claim is begin or apply, not {other}").into()),
                }
            }
            "--events" => options.events = Some(flags.value(&flag)?.into()),
            "--kill-after-commit-per-mille" => {
                options.kill_after_commit_per_mille = flags.parse(&flag)?;
            }
            "--ack" => {
                options.ack = match flags.value(&flag)?.as_str() {
                    "after-commit" => Ack::AfterCommit,
                    "before-commit" => Ack::BeforeCommit,
                    other => {
                        return Err(
                            format!("--ack is after-commit or before-commit, not {other}").into(),
                        );
                    }
                }
            }
            "--markers" => {
                options.markers = match flags.value(&flag)?.as_str() {
                    "on" => true,
                    "off" => false,
                    other => return Err(format!("--markers is on or off, not {other}").into()),
                }
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.kill_after_commit_per_mille > 1000 {
        return Err("--kill-after-commit-per-mille is 0..=1000".into());
    }
    if options.apply && options.pg.is_none() {
        return Err("--claim apply needs --pg".into());
    }
    Ok(options)
}

/// What every message's handling shares.
struct Handler {
    claims: Claims,
    jetstream: jetstream::Context,
    ledger: Option<Ledger>,
    options: Options,
    draws: AtomicU64,
    seed: u64,
}

impl Handler {
    fn event(&self, kind: &str, order_id: &str) {
        if let Some(ledger) = &self.ledger {
            ledger.event(kind, order_id, None);
        }
    }

    /// A draw in `0..bound`, different in every process.
    fn draw(&self, bound: u64) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let mut z = self.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % bound
    }

    fn kill_here(&self, order_id: &str) {
        if self.draw(1000) < self.options.kill_after_commit_per_mille {
            self.event("self-kill", order_id);
            // SAFETY: raising a signal on our own process.
            unsafe { libc::raise(libc::SIGKILL) };
        }
    }

    /// The negative control's ack, sent once the effects are staged and before they are
    /// committed (then, now and then, a SIGKILL: the order is lost).
    async fn ack_before_commit(
        &self,
        message: &jetstream::Message,
        order_id: &str,
    ) -> Result<(), BoxError> {
        if self.options.ack == Ack::BeforeCommit {
            message.double_ack().await?;
            self.kill_here(order_id);
        }
        Ok(())
    }

    async fn handle(&self, message: jetstream::Message) -> Result<(), BoxError> {
        let order_id = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(HEADER_ORDER_ID))
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default();
        if message
            .info()
            .map(|info| info.delivered > 1)
            .unwrap_or(false)
        {
            // Evidence that the kills bite: JetStream hands over what a dead consumer held.
            self.event("redelivered", &order_id);
        }
        let fingerprint = Fingerprint::of(&message.payload);
        let began_ns = monotonic_ns();
        let decision = if self.options.markers {
            self.claims
                .claim_and_apply(self, &message, &order_id, fingerprint)
                .await?
        } else {
            self.claims
                .apply_without_markers(self, &message, &order_id)
                .await?
        };
        match decision {
            Decision::Committed => {
                if let Some(ledger) = &self.ledger {
                    ledger.event_since("fresh", &order_id, None, began_ns);
                }
                if self.options.ack == Ack::AfterCommit {
                    self.kill_here(&order_id);
                    message.ack().await?;
                }
            }
            Decision::Duplicate => {
                self.event("duplicate", &order_id);
                message.ack().await?;
            }
            Decision::Conflict(stored) => {
                self.dead_letter(&order_id, Some(stored), fingerprint)
                    .await?;
                self.event("conflict", &order_id);
                message.ack().await?;
            }
            Decision::Invalid => {
                // No usable order id: a poison message, not something a retry can fix.
                self.dead_letter(&order_id, None, fingerprint).await?;
                self.event("invalid", &order_id);
                message.ack().await?;
            }
            Decision::Skipped => {
                self.event("skipped", &order_id);
                message.ack().await?;
            }
            Decision::Later(why) => {
                // Nothing of it was written: redelivered in 50 ms.
                self.event(why, &order_id);
                message
                    .ack_with(AckKind::Nak(Some(Duration::from_millis(50))))
                    .await?;
            }
        }
        Ok(())
    }

    /// Publishes a conflict to the dead-letter subject and waits for the stream's confirm.
    async fn dead_letter(
        &self,
        order_id: &str,
        stored: Option<Fingerprint>,
        received: Fingerprint,
    ) -> Result<(), BoxError> {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER_ORDER_ID, order_id);
        headers.insert(HEADER_RECEIVED_FINGERPRINT, received.to_string().as_str());
        if let Some(stored) = stored {
            headers.insert(HEADER_STORED_FINGERPRINT, stored.to_string().as_str());
        }
        self.jetstream
            .publish_with_headers(DEAD_LETTER_SUBJECT, headers, Vec::new().into())
            .await?
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("nats_orders: {}", chain(&*error));
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    let ledger = match &options.events {
        Some(path) => Some(Ledger::open(path)?),
        None => None,
    };
    let claims = match &options.pg {
        Some(pg) => Claims::postgres(pg, options.apply).await?,
        None => Claims::embedded(&options.dir)?,
    };
    // Keeps reconnecting while the server restarts; a message whose ack cannot be sent is
    // redelivered after the ack wait, and is then a duplicate.
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(&options.nats)
        .await?;
    let jetstream = jetstream::new(client);
    let handler = Arc::new(Handler {
        claims,
        jetstream: jetstream.clone(),
        ledger,
        seed: u64::from(std::process::id()) ^ monotonic_ns(),
        draws: AtomicU64::new(0),
        options,
    });
    eprintln!(
        "nats_orders: pid {} consuming {} into {}",
        std::process::id(),
        handler.options.consumer,
        handler.claims.describe(&handler.options.dir)
    );
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // The pull consumer's message stream ends or fails when the server goes away; it is opened
    // again until the process is told to stop.
    loop {
        let consumer: jetstream::consumer::Consumer<pull::Config> =
            match jetstream.get_stream(STREAM).await {
                Ok(stream) => match stream.get_consumer(&handler.options.consumer).await {
                    Ok(consumer) => consumer,
                    Err(error) => {
                        eprintln!("nats_orders: no consumer yet: {error}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                },
                Err(error) => {
                    eprintln!("nats_orders: no stream yet: {error}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
        let mut messages = match consumer.messages().await {
            Ok(messages) => messages,
            Err(error) => {
                eprintln!("nats_orders: cannot pull: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        // The checker measures a restart's resume (after a SIGKILL of this process or of the
        // server) up to here.
        handler.event("ready", &handler.options.consumer);
        loop {
            tokio::select! {
                message = messages.next() => match message {
                    Some(Ok(message)) => handler.handle(message).await?,
                    Some(Err(error)) => {
                        eprintln!("nats_orders: pulling: {error}");
                        break;
                    }
                    None => break,
                },
                _ = terminate.recv() => return Ok(()),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
