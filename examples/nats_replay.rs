//! A NATS JetStream log consumer: one shard's orders replayed from a stream sequence by an
//! ordered consumer (no acks, no durable state at the server), processed with idemdb, with the
//! read position committed in the same write batch as the markers and the effects.
//!
//! ```text
//! cargo run --release --features tokio --example nats_replay -- \
//!     --nats 127.0.0.1:14222 --shard 0 --dir /tmp/nats-replay-0 --ledger /tmp/replay-0.log
//! ```
//!
//! An ordered consumer starts where it is told (`DeliverPolicy::ByStartSequence`) and hands over
//! the shard's messages in stream order, each with its stream sequence. Nothing is acked: after
//! a crash, where to start again is the consumer's own question, and idemdb answers it with
//! what was committed. Each group of messages read together is claimed as one batch, fresh
//! orders stage their effects, every message stages its row in `reads`, and the batch stages
//! the group's last stream sequence as the position (source: the stream's name, partition:
//! the shard). One durable commit writes all of it; a restart reads the position back and asks
//! for the sequence after it. The group's claims and writes are those of the RabbitMQ streams
//! consumer (`stream_orders/group.rs`), whose store layout this one shares.
//!
//! The stream's sequences are shared by every shard's subject: a shard's messages have
//! increasing sequences with gaps, and a position is the last sequence settled, not a count.
//!
//! `--position broker-before-commit` and `--position broker-after-commit` keep the position at
//! the server instead, written before or after the commit, as the last message of the shard's
//! subject in a stream of positions (one message kept per subject: what a key-value bucket is
//! made of; Debian's server 2.9 and this client do not agree on the bucket API itself). That is
//! what a consumer without idemdb's positions would do, and the end-to-end run's negative
//! controls (`e2e/src/bin/nats_replay_e2e.rs`). `--kill-at-commit-per-mille N` SIGKILLs the
//! process at the placement's weak point: right after the commit (store), between the
//! server's write and the commit (before), between the commit and the server's write (after).
//! `--markers off` claims every read under a key of its own (its sequence and the process), so
//! nothing is ever a duplicate: with the position written after the commit, a message read
//! again by the next process is applied again, which the run's third control must catch.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::{self, LastRawMessageErrorKind};
use futures_lite::StreamExt;
use idemdb::{ClaimBatch, Fingerprint, Message, Settled};

#[path = "common/args.rs"]
mod args;
#[path = "stream_orders/group.rs"]
mod group;
#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/jetstream.rs"]
mod names;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/streams.rs"]
mod streams;
use args::Flags;
use group::{Read, Tables, claim_group};
use ledger::Ledger;
use names::{POSITIONS_STREAM, POSITIONS_SUBJECTS, STREAM, position_subject, subject};
use orders::{BoxError, TOTAL_AMOUNT_KEY, chain, parse_amount};
use streams::{CONSUMER_ID, Placement, open_stream_store, order_id_of, read_key};

/// The most messages committed as one group.
const GROUP_MESSAGES_MAX: usize = 64;
/// The most groups whose commits are in flight at once.
const PIPELINE_DEPTH: usize = 4;
/// How long a group waits for one more message before it is committed.
const GROUP_WAIT: Duration = Duration::from_millis(3);

struct Options {
    nats: String,
    shard: u32,
    dir: PathBuf,
    ledger: Option<PathBuf>,
    placement: Placement,
    kill_at_commit_per_mille: u64,
    /// Off: no dedup at all (negative control).
    markers: bool,
    seed: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        nats: "127.0.0.1:14222".into(),
        shard: 0,
        dir: PathBuf::from("/tmp/idemdb-nats-replay-0"),
        ledger: None,
        placement: Placement::Store,
        kill_at_commit_per_mille: 0,
        markers: true,
        seed: u64::from(std::process::id()),
    };
    let mut flags = Flags::from_env();
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--nats" => options.nats = flags.value(&flag)?,
            "--shard" => options.shard = flags.parse(&flag)?,
            "--dir" => options.dir = flags.value(&flag)?.into(),
            "--ledger" => options.ledger = Some(flags.value(&flag)?.into()),
            "--position" => {
                let text = flags.value(&flag)?;
                options.placement =
                    Placement::parse(&text).ok_or_else(|| format!("unknown placement {text}"))?;
            }
            "--kill-at-commit-per-mille" => {
                options.kill_at_commit_per_mille = flags.parse(&flag)?;
            }
            "--markers" => {
                options.markers = match flags.value(&flag)?.as_str() {
                    "on" => true,
                    "off" => false,
                    other => return Err(format!("--markers is on or off, not {other}").into()),
                }
            }
            "--seed" => options.seed = flags.parse(&flag)?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.kill_at_commit_per_mille > 1000 {
        return Err("--kill-at-commit-per-mille is 0..=1000".into());
    }
    Ok(options)
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("nats_replay: {}", chain(error.as_ref()));
        std::process::exit(1);
    }
}

/// The running consumer: its store, its connection, where its position is kept.
struct Replay {
    options: Options,
    consumer: idemdb::Consumer,
    tables: Tables,
    jetstream: jetstream::Context,
    /// The stream of the negative controls' positions, once made.
    positions: Option<stream::Stream>,
    ledger: Option<Ledger>,
    draws: u64,
}

async fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    let engine = open_stream_store(&options.dir)?;
    // Keeps reconnecting while the server restarts.
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(&options.nats)
        .await?;
    let jetstream = jetstream::new(client);
    let mut replay = Replay {
        consumer: engine.consumer(CONSUMER_ID)?,
        tables: Tables::of(&engine)?,
        positions: None,
        ledger: options.ledger.as_deref().map(Ledger::open).transpose()?,
        draws: options.seed,
        jetstream,
        options,
    };
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Groups committed with their position through a pipeline: up to PIPELINE_DEPTH in flight
    // (the store placement; the bucket placements commit one at a time, in their order with
    // the bucket's write).
    let mut pipeline = replay.consumer.async_pipeline::<u64>(PIPELINE_DEPTH)?;
    // The ordered consumer's messages end or fail when the server goes away: the commits in
    // flight settle, and reading starts again after the stored position.
    loop {
        for settled in pipeline.wait().await {
            replay.committed(settled)?;
        }
        let Some(mut messages) = replay.subscribe().await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        loop {
            // A group: the first message waited for (or a SIGTERM: stop between groups), then
            // whatever follows within GROUP_WAIT, up to GROUP_MESSAGES_MAX.
            let first = tokio::select! {
                message = messages.next() => message,
                // A group's commit settles while the stream is quiet.
                Some(settled) = pipeline.next_settled(), if !pipeline.is_empty() => {
                    replay.committed(settled)?;
                    continue;
                }
                _ = terminate.recv() => {
                    for settled in pipeline.wait().await {
                        replay.committed(settled)?;
                    }
                    return Ok(());
                }
            };
            let Some(Ok(first)) = first else {
                eprintln!("nats_replay: the ordered consumer stopped: {first:?}");
                break;
            };
            let mut group = vec![read_of(&first)?];
            let mut broken = false;
            while group.len() < GROUP_MESSAGES_MAX {
                match tokio::time::timeout(GROUP_WAIT, messages.next()).await {
                    Ok(Some(Ok(message))) => group.push(read_of(&message)?),
                    Ok(_) => {
                        broken = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            replay.process(&mut pipeline, group).await?;
            if broken {
                break;
            }
        }
    }
}

impl Replay {
    /// An ordered consumer of the shard's subject from one past the stored position, or
    /// `None` while the server cannot make one (it is restarting).
    async fn subscribe(&mut self) -> Option<pull::Ordered> {
        let stored = match self.stored().await {
            Ok(stored) => stored,
            Err(error) => {
                eprintln!("nats_replay: reading the position: {error}");
                return None;
            }
        };
        let deliver_policy = match stored {
            Some(sequence) => DeliverPolicy::ByStartSequence {
                start_sequence: sequence + 1,
            },
            None => DeliverPolicy::All,
        };
        let stream = match self.jetstream.get_stream(STREAM).await {
            Ok(stream) => stream,
            Err(error) => {
                eprintln!("nats_replay: no stream yet: {error}");
                return None;
            }
        };
        let config = pull::OrderedConfig {
            filter_subject: subject(self.options.shard as usize),
            deliver_policy,
            ..Default::default()
        };
        let messages = match stream.create_consumer(config).await {
            Ok(consumer) => consumer.messages().await,
            Err(error) => {
                eprintln!("nats_replay: cannot make the ordered consumer: {error}");
                return None;
            }
        };
        match messages {
            Ok(messages) => {
                if let Some(ledger) = &self.ledger {
                    // The first sequence asked for (0: the shard's first message, whatever it is).
                    let from = stored.map_or(0, |sequence| sequence + 1);
                    ledger.event("ready", &from.to_string(), None);
                }
                Some(messages)
            }
            Err(error) => {
                eprintln!("nats_replay: cannot pull: {error}");
                None
            }
        }
    }

    /// The last sequence settled, where this placement keeps it.
    async fn stored(&mut self) -> Result<Option<u64>, BoxError> {
        if self.options.placement == Placement::Store {
            let positions = self.consumer.positions();
            return Ok(positions
                .get(STREAM, self.options.shard)?
                .map(|position| position.offset));
        }
        let subject = position_subject(self.options.shard as usize);
        let last = self
            .positions()
            .await?
            .get_last_raw_message_by_subject(&subject)
            .await;
        match last {
            Ok(message) => Ok(Some(std::str::from_utf8(&message.payload)?.parse()?)),
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(error) => Err(error.into()),
        }
    }

    /// Writes the negative controls' position to the server, and waits for the stream's
    /// acknowledgement.
    async fn store_at_server(&mut self, sequence: u64) -> Result<(), BoxError> {
        self.positions().await?;
        let subject = position_subject(self.options.shard as usize);
        self.jetstream
            .publish(subject, sequence.to_string().into())
            .await?
            .await?;
        Ok(())
    }

    /// The negative controls' stream of positions, made on first use (by whichever shard's
    /// process comes first: the same configuration makes the same stream).
    async fn positions(&mut self) -> Result<&stream::Stream, BoxError> {
        if self.positions.is_none() {
            let made = self
                .jetstream
                .get_or_create_stream(stream::Config {
                    name: POSITIONS_STREAM.to_owned(),
                    subjects: vec![POSITIONS_SUBJECTS.to_owned()],
                    storage: stream::StorageType::File,
                    max_messages_per_subject: 1,
                    ..Default::default()
                })
                .await?;
            self.positions = Some(made);
        }
        self.positions
            .as_ref()
            .ok_or_else(|| "no positions' stream".into())
    }

    /// Claims a group and commits it with its position: in the batch (store), or with the
    /// bucket's write before or after the commit.
    async fn process(
        &mut self,
        pipeline: &mut idemdb::AsyncPipeline<u64>,
        group: Vec<Read>,
    ) -> Result<(), BoxError> {
        if let Some(ledger) = &self.ledger {
            for read in &group {
                ledger.event("read", &read.offset.to_string(), None);
            }
        }
        let last = group.last().map_or(0, |read| read.offset);
        let batch = loop {
            if !self.options.markers {
                break claim_unmarked(&self.consumer, &self.tables, &group)?;
            }
            match claim_group(&self.consumer, &self.tables, &group)? {
                Some(batch) => break batch,
                // A resend of an order whose commit is in flight: once it is durable, the
                // message is a duplicate.
                None => {
                    for settled in pipeline.wait().await {
                        self.committed(settled)?;
                    }
                }
            }
        };
        match self.options.placement {
            Placement::Store => {
                let mut batch = batch;
                batch.stage_position(STREAM, self.options.shard, last)?;
                // Durable with its position in the background; the next group is read and
                // claimed meanwhile.
                pipeline.commit_batch(batch, |_| b"applied", last).await;
                for settled in pipeline.settled() {
                    self.committed(settled)?;
                }
            }
            Placement::BrokerBeforeCommit => {
                self.store_at_server(last).await?;
                self.kill_point();
                batch.commit(|_| b"applied")?;
                self.event("commit", last);
            }
            Placement::BrokerAfterCommit => {
                batch.commit(|_| b"applied")?;
                self.kill_point();
                self.store_at_server(last).await?;
                self.event("commit", last);
            }
        }
        Ok(())
    }

    /// A group's commit (tagged with its last sequence) settled: durable with its position, or
    /// the error that stops the process (it restarts from the stored position). The crash
    /// point of the store placement is here, right after the commit.
    fn committed(&mut self, settled: Settled<u64>) -> Result<(), BoxError> {
        settled.outcome?;
        self.kill_point();
        self.event("commit", settled.tag);
        Ok(())
    }

    fn event(&self, kind: &str, sequence: u64) {
        if let Some(ledger) = &self.ledger {
            ledger.event(kind, &sequence.to_string(), None);
        }
    }

    /// The crash point, hit on purpose with probability `--kill-at-commit-per-mille`/1000.
    fn kill_point(&mut self) {
        let per_mille = self.options.kill_at_commit_per_mille;
        if per_mille == 0 {
            return;
        }
        self.draws = self
            .draws
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        if (self.draws >> 33) % 1000 < per_mille {
            // SAFETY: raising a signal at ourselves.
            unsafe { libc::raise(libc::SIGKILL) };
        }
    }
}

/// The negative control without markers: every read claimed under a key of its own (its
/// sequence and this process), each fresh, its effects staged and its `reads` row written.
fn claim_unmarked(
    consumer: &idemdb::Consumer,
    tables: &Tables,
    group: &[Read],
) -> Result<ClaimBatch, BoxError> {
    let pid = std::process::id();
    let keys: Vec<String> = group
        .iter()
        .map(|read| format!("{}/{pid}", read.offset))
        .collect();
    let messages: Vec<Message<'_>> = keys
        .iter()
        .zip(group)
        .map(|(key, read)| Message::new(key.as_str(), Fingerprint::of(read.body.as_bytes())))
        .collect();
    let mut batch = consumer.begin_batch(&messages)?;
    for (index, read) in group.iter().enumerate() {
        let order_id = order_id_of(&read.body).unwrap_or_default();
        let amount = parse_amount(read.body.as_bytes()).unwrap_or(0);
        let claim = batch
            .claim_mut(index)
            .ok_or("a read under a key of its own that is not fresh")?;
        claim.put(&tables.orders, order_id, &read.body)?;
        claim.merge(&tables.effects, order_id, 1u64.to_be_bytes())?;
        claim.merge(&tables.effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
        batch.put(&tables.reads, read_key(read.offset, pid), "fresh")?;
    }
    Ok(batch)
}

/// A message's stream sequence and body.
fn read_of(message: &jetstream::Message) -> Result<Read, BoxError> {
    let sequence = message.info()?.stream_sequence;
    Ok(Read {
        offset: sequence,
        body: String::from_utf8_lossy(&message.payload).into_owned(),
    })
}
