//! An idempotent NATS JetStream consumer: orders from one durable pull consumer with explicit
//! acks, processed with idemdb, exactly-once effects behind an at-least-once broker.
//!
//! ```text
//! cargo run --release --features tokio --example nats_orders -- \
//!     --nats 127.0.0.1:14222 --consumer orders-0 --dir /tmp/nats-orders-0
//! ```
//!
//! For each message (order id in the `Idemdb-Order-Id` header, body `<order id>:<amount>:<variant>`):
//!
//! - `Fresh`: the order row, a per-order effect counter and the running total are staged on the
//!   claim and committed with its marker in one durable batch; then the message is acked.
//! - `Duplicate`: acked without effect. JetStream redelivers a message whose ack did not arrive
//!   within the consumer's ack wait (its consumer died, or the ack was lost), and a producer may
//!   publish an order twice outside the stream's duplicate window (`Nats-Msg-Id` deduplicates
//!   only inside it, and only at publish).
//! - `Conflict` (same order id, other content): published to the dead-letter subject with both
//!   fingerprints in headers, confirmed by the stream, then acked.
//! - `InProgress`, or a retryable idemdb error: nacked with a short delay; JetStream redelivers.
//!
//! A crash anywhere (SIGKILL) is safe: before the commit nothing was written and the message is
//! redelivered after the ack wait; between the commit and the ack the redelivery is a
//! duplicate. An embedded store belongs to one process, so consumers scale by shard: each
//! process owns one durable consumer (a subject filter on the shard's subject) and its own
//! store. `e2e/src/bin/nats_e2e.rs` runs several under SIGKILLs, of themselves and of the
//! server, against a real `nats-server` (`scripts/nats-e2e.sh`).
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
use idemdb::{Fingerprint, Outcome};

#[path = "common/args.rs"]
mod args;
#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/jetstream.rs"]
mod names;
#[path = "common/orders.rs"]
mod orders;
use args::Flags;
use ledger::{Ledger, monotonic_ns};
use names::{
    DEAD_LETTER_SUBJECT, HEADER_ORDER_ID, HEADER_RECEIVED_FINGERPRINT, HEADER_STORED_FINGERPRINT,
    STREAM,
};
use orders::{BoxError, TOTAL_AMOUNT_KEY, open_store, parse_amount};

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
    dir: PathBuf,
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
    Ok(options)
}

/// What every message's handling shares.
struct Handler {
    consumer: idemdb::Consumer,
    orders: idemdb::BusinessTable,
    effects: idemdb::BusinessTable,
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
        if !self.options.markers {
            return self.apply_without_markers(message, &order_id).await;
        }
        let fingerprint = Fingerprint::of(&message.payload);
        let outcome = match self.consumer.begin(&order_id, fingerprint) {
            Ok(outcome) => outcome,
            Err(idemdb::Error::LimitExceeded { .. }) => {
                // No usable order id: a poison message, not something a retry can fix.
                self.dead_letter(&order_id, None, fingerprint).await?;
                self.event("invalid", &order_id);
                message.ack().await?;
                return Ok(());
            }
            Err(error) if error.is_retryable() => {
                return self.later(&message, "retry", &order_id).await;
            }
            Err(error) => return Err(error.into()),
        };
        match outcome {
            Outcome::Fresh(mut claim) => {
                let amount = parse_amount(&message.payload).unwrap_or(0);
                claim.put(&self.orders, &order_id, &message.payload)?;
                claim.merge(&self.effects, &order_id, 1u64.to_be_bytes())?;
                claim.merge(&self.effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
                if self.options.ack == Ack::BeforeCommit {
                    message.double_ack().await?;
                    self.kill_here(&order_id);
                }
                let began_ns = monotonic_ns();
                self.event("submit", &order_id);
                match claim.commit_async(b"accepted").await {
                    Ok(_) => {}
                    Err(error) if error.is_retryable() => {
                        return self.later(&message, "retry", &order_id).await;
                    }
                    Err(error) => return Err(error.into()),
                }
                if let Some(ledger) = &self.ledger {
                    ledger.event_since("fresh", &order_id, None, began_ns);
                }
                if self.options.ack == Ack::AfterCommit {
                    self.kill_here(&order_id);
                    message.ack().await?;
                }
            }
            Outcome::Duplicate { .. } => {
                self.event("duplicate", &order_id);
                message.ack().await?;
            }
            Outcome::Conflict {
                stored_fingerprint, ..
            } => {
                self.dead_letter(&order_id, Some(stored_fingerprint), fingerprint)
                    .await?;
                self.event("conflict", &order_id);
                message.ack().await?;
            }
            Outcome::InProgress { .. } => {
                self.later(&message, "in_progress", &order_id).await?;
            }
            // Neither the admission floor nor the ordering guard is used here.
            Outcome::TooLate { .. } | Outcome::Stale { .. } => {
                self.event("skipped", &order_id);
                message.ack().await?;
            }
        }
        Ok(())
    }

    /// Nacks `message` for redelivery in 50 ms: nothing of it was written.
    async fn later(
        &self,
        message: &jetstream::Message,
        why: &str,
        order_id: &str,
    ) -> Result<(), BoxError> {
        self.event(why, order_id);
        message
            .ack_with(AckKind::Nak(Some(Duration::from_millis(50))))
            .await?;
        Ok(())
    }

    /// The negative control without markers: the same writes committed under a key of their
    /// own for every delivery (a store that does not deduplicate), then the ack. A redelivery
    /// applies the order again.
    async fn apply_without_markers(
        &self,
        message: jetstream::Message,
        order_id: &str,
    ) -> Result<(), BoxError> {
        let delivery = format!(
            "{order_id}/{}/{}",
            std::process::id(),
            self.draws.fetch_add(1, Ordering::Relaxed)
        );
        let Outcome::Fresh(mut claim) = self
            .consumer
            .begin(&delivery, Fingerprint::of(&message.payload))?
        else {
            return Err(format!("{delivery} was not fresh").into());
        };
        let amount = parse_amount(&message.payload).unwrap_or(0);
        claim.put(&self.orders, order_id, &message.payload)?;
        claim.merge(&self.effects, order_id, 1u64.to_be_bytes())?;
        claim.merge(&self.effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
        claim.commit_async(b"accepted").await?;
        self.event("fresh", order_id);
        self.kill_here(order_id);
        message.ack().await?;
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
        eprintln!("nats_orders: {error}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    let engine = open_store(&options.dir)?;
    // Keeps reconnecting while the server restarts; a message whose ack cannot be sent is
    // redelivered after the ack wait, and is then a duplicate.
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(&options.nats)
        .await?;
    let jetstream = jetstream::new(client);
    let ledger = match &options.events {
        Some(path) => Some(Ledger::open(path)?),
        None => None,
    };
    let handler = Arc::new(Handler {
        consumer: engine.consumer("orders")?,
        orders: engine.business_table("orders")?,
        effects: engine.business_table("effects")?,
        jetstream: jetstream.clone(),
        ledger,
        seed: u64::from(std::process::id()) ^ engine.now_ms(),
        draws: AtomicU64::new(0),
        options,
    });
    eprintln!(
        "nats_orders: pid {} consuming {} into {}",
        std::process::id(),
        handler.options.consumer,
        handler.options.dir.display()
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
