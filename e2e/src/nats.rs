//! A private `nats-server` with JetStream for the NATS checker: started on 127.0.0.1 with its
//! store in the run's work folder, SIGKILLed and restarted on the same store, and stopped when
//! dropped (also when the checker dies); the orders' topology, publishing with the stream's
//! acknowledgement, waiting for the consumers to drain, and reading the dead letters.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use futures_lite::StreamExt;

use crate::BoxError;
use crate::amqp::DeadLetter;
use crate::jetstream::{
    DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT, FLEET_CONSUMER, HEADER_ORDER_ID,
    HEADER_RECEIVED_FINGERPRINT, HEADER_STORED_FINGERPRINT, STREAM, consumer_name, subject,
};
use crate::supervisor::{Supervisor, die_with_parent};

/// The server process: `nats-server` with JetStream on 127.0.0.1:`port`, its store under
/// `dir`, every write synced before it is acknowledged where the server can be told to
/// (`sync_interval: always`, from 2.10). The binary is `$IDEMDB_NATS_SERVER` when set (what
/// `scripts/nats-e2e.sh` fetches), else `nats-server` on the `PATH`.
pub struct Server {
    port: u16,
    dir: PathBuf,
    binary: PathBuf,
    /// The server's version, from `--version` (`v2.10.26`).
    pub version: String,
    /// Whether it syncs every write before acknowledging it.
    pub sync_always: bool,
    child: Option<Child>,
    /// Times it was SIGKILLed (and started again).
    pub kills: u64,
}

/// The `(major, minor)` of a `nats-server --version` line (`nats-server: v2.10.26`).
fn major_minor(version: &str) -> Option<(u32, u32)> {
    let digits = version.trim().rsplit('v').next()?;
    let mut parts = digits.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

impl Server {
    /// Starts the server and waits until it accepts connections.
    pub fn start(port: u16, dir: &Path) -> Result<Server, BoxError> {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Err(format!("127.0.0.1:{port} is already in use; pick another --port").into());
        }
        let binary = std::env::var_os("IDEMDB_NATS_SERVER")
            .map_or_else(|| PathBuf::from("nats-server"), PathBuf::from);
        let output = Command::new(&binary)
            .arg("--version")
            .output()
            .map_err(|error| {
                format!(
                    "running {} (scripts/nats-e2e.sh installs it): {error}",
                    binary.display()
                )
            })?;
        let version = String::from_utf8_lossy(&output.stdout)
            .trim()
            .trim_start_matches("nats-server: ")
            .to_owned();
        // 2.9 has no setting for it: its file store leaves writes to the page cache.
        let sync_always = major_minor(&version).is_some_and(|version| version >= (2, 10));
        let mut server = Server {
            port,
            dir: dir.to_owned(),
            binary,
            version,
            sync_always,
            child: None,
            kills: 0,
        };
        server.spawn()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) -> Result<(), BoxError> {
        std::fs::create_dir_all(&self.dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("nats-server.log"))?;
        let store = self.dir.join("jetstream");
        let sync = if self.sync_always {
            "sync_interval: always\n    "
        } else {
            ""
        };
        let config = self.dir.join("server.conf");
        std::fs::write(
            &config,
            format!(
                "listen: \"127.0.0.1:{}\"\njetstream {{\n    {sync}store_dir: {:?}\n}}\n",
                self.port,
                store.display().to_string()
            ),
        )?;
        let mut command = Command::new(&self.binary);
        command
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log);
        die_with_parent(&mut command);
        self.child = Some(command.spawn().map_err(|error| {
            format!(
                "starting {} (scripts/nats-e2e.sh installs it): {error}",
                self.binary.display()
            )
        })?);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                return Err(format!("nats-server did not listen on {} in 30 s", self.port).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// SIGKILLs the server, waits for it, and starts it again on the same store.
    pub fn kill_and_restart(&mut self) -> Result<(), BoxError> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        self.kills += 1;
        self.spawn()
    }
}

/// What [`kill_while_publishing`] did: each consumer SIGKILL (its slot, and when on the
/// monotonic clock), and when each server SIGKILL was made, from which the resume times are
/// measured.
#[derive(Default)]
pub struct Kills {
    pub consumers: Vec<(usize, u64)>,
    pub server_at: Vec<u64>,
}

/// The chaos of a NATS run while `producer` publishes for about `publishing`: the `server`
/// SIGKILLed and restarted `server_kills` times, spread over that time, and a random one of the
/// `consumers`' slots SIGKILLed and restarted every 100-800 ms (a consumer that exited on its
/// own restarted too), until the producer is done and at least `min_kills` consumer kills were
/// made. `label` names the run in what it prints.
#[allow(clippy::too_many_arguments)]
pub async fn kill_while_publishing(
    server: &mut Server,
    consumers: &mut Supervisor,
    producer: &tokio::task::JoinHandle<Result<(), BoxError>>,
    publishing: Duration,
    server_kills: u64,
    min_kills: u64,
    rng: &mut crate::plan::Rng,
    label: &str,
) -> Result<Kills, BoxError> {
    let server_kill_every = publishing / u32::try_from(server_kills + 1)?;
    let mut next_server_kill = Instant::now() + server_kill_every;
    let mut kills = Kills::default();
    loop {
        tokio::time::sleep(Duration::from_millis(100 + rng.below(700))).await;
        consumers.restart_exited()?;
        if producer.is_finished()
            && kills.consumers.len() as u64 >= min_kills
            && server.kills >= server_kills
        {
            return Ok(kills);
        }
        if server.kills < server_kills && Instant::now() >= next_server_kill {
            kills.server_at.push(crate::ledger::monotonic_ns());
            server.kill_and_restart()?;
            next_server_kill += server_kill_every;
            println!("{label}: server SIGKILLed and restarted ({})", server.kills);
            continue;
        }
        let slot = usize::try_from(rng.below(consumers.slots() as u64))?;
        let at_ns = crate::ledger::monotonic_ns();
        if consumers.kill_and_restart(slot)?.is_some() {
            kills.consumers.push((slot, at_ns));
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

/// A durable pull consumer of the orders' stream: its name and the subjects it takes.
pub struct Durable {
    pub name: String,
    pub filter: String,
}

/// The durable consumers of a run: one per shard (each with a process and a store of its own),
/// or, with `shared`, one for every shard that a fleet of processes pulls from together.
pub fn durables(shards: usize, shared: bool) -> Vec<Durable> {
    if shared {
        return vec![Durable {
            name: FLEET_CONSUMER.to_owned(),
            filter: "orders.*".to_owned(),
        }];
    }
    (0..shards)
        .map(|shard| Durable {
            name: consumer_name(shard),
            filter: subject(shard),
        })
        .collect()
}

/// The orders' stream (file storage, with `duplicate_window` for `Nats-Msg-Id`), the
/// dead-letter stream, and the `durables` (explicit acks, redelivery after `ack_wait`), all
/// made anew.
pub async fn topology(
    context: &jetstream::Context,
    durables: &[Durable],
    duplicate_window: Duration,
    ack_wait: Duration,
) -> Result<(), BoxError> {
    for name in [STREAM, DEAD_LETTER_STREAM] {
        // Absent on a fresh server; anything else fails the create below.
        let _ = context.delete_stream(name).await;
    }
    let orders = context
        .create_stream(stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["orders.*".to_owned()],
            storage: stream::StorageType::File,
            duplicate_window,
            ..Default::default()
        })
        .await?;
    context
        .create_stream(stream::Config {
            name: DEAD_LETTER_STREAM.to_owned(),
            subjects: vec![DEAD_LETTER_SUBJECT.to_owned()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?;
    for durable in durables {
        orders
            .create_consumer(consumer::pull::Config {
                durable_name: Some(durable.name.clone()),
                filter_subject: durable.filter.clone(),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait,
                max_ack_pending: 1000,
                ..Default::default()
            })
            .await?;
    }
    Ok(())
}

/// One message to publish.
pub struct Outgoing {
    pub subject: String,
    pub order_id: String,
    pub body: String,
    /// `Nats-Msg-Id`, for the stream's deduplication inside its window.
    pub message_id: Option<String>,
}

/// What publishing saw.
#[derive(Default)]
pub struct Published {
    /// Messages acknowledged by the stream (each counted once, however often it was retried).
    pub acknowledged: AtomicU64,
    /// Of those, the ones the stream dropped as duplicates of a `Nats-Msg-Id` inside its window.
    pub deduplicated: AtomicU64,
    /// Publishes retried after an error (the server was down, or the acknowledgement did not
    /// come).
    pub retried: AtomicU64,
}

/// Publishes `messages` at `rate` per second, each until the stream acknowledges it: a publish
/// that fails while the server restarts is sent again (with the same `Nats-Msg-Id`, if any).
pub async fn publish(
    context: jetstream::Context,
    messages: Vec<Outgoing>,
    rate: u64,
    published: Arc<Published>,
) -> Result<(), BoxError> {
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let started = Instant::now();
    for (n, message) in messages.into_iter().enumerate() {
        let due = started + interval * u32::try_from(n)?;
        tokio::time::sleep_until(due.into()).await;
        let mut headers = HeaderMap::new();
        headers.insert(HEADER_ORDER_ID, message.order_id.as_str());
        if let Some(id) = &message.message_id {
            headers.insert("Nats-Msg-Id", id.as_str());
        }
        loop {
            let sent = context
                .publish_with_headers(
                    message.subject.clone(),
                    headers.clone(),
                    message.body.clone().into(),
                )
                .await;
            let acknowledged = match sent {
                Ok(ack) => tokio::time::timeout(Duration::from_secs(5), ack).await,
                Err(_) => {
                    published.retried.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            match acknowledged {
                Ok(Ok(ack)) => {
                    published.acknowledged.fetch_add(1, Ordering::Relaxed);
                    if ack.duplicate {
                        published.deduplicated.fetch_add(1, Ordering::Relaxed);
                    }
                    break;
                }
                _ => {
                    published.retried.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    Ok(())
}

/// Messages not yet acknowledged by the durable consumers: pending delivery, or delivered and
/// waiting for their ack. `None` while the server cannot say (it is restarting).
async fn outstanding(context: &jetstream::Context, durables: &[Durable]) -> Option<u64> {
    let stream = context.get_stream(STREAM).await.ok()?;
    let mut total = 0;
    for durable in durables {
        let info = stream.consumer_info(&durable.name).await.ok()?;
        total += info.num_pending + info.num_ack_pending as u64;
    }
    Some(total)
}

/// Waits until every durable consumer has acknowledged everything and `progress` (the
/// consumers' ledgers) has not moved for two seconds, restarting exited consumers; then stops
/// them gracefully, and starts them again if anything came back. Ten minutes at most.
pub async fn drain(
    context: &jetstream::Context,
    durables: &[Durable],
    consumers: &mut Supervisor,
    mut progress: impl FnMut() -> Result<u64, BoxError>,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(600);
    for round in 0.. {
        let mut last = (u64::MAX, Instant::now());
        loop {
            consumers.restart_exited()?;
            let left = outstanding(context, durables).await;
            let done = progress()?;
            if left != Some(0) || done != last.0 {
                last = (done, Instant::now());
            } else if last.1.elapsed() >= Duration::from_secs(2) {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("the consumers did not drain ({left:?} outstanding)").into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        consumers.stop_gracefully()?;
        if outstanding(context, durables).await == Some(0) {
            return Ok(());
        }
        if round == 10 {
            return Err("messages keep coming back after ten drain rounds".into());
        }
        consumers.start_all()?;
    }
    Ok(())
}

/// Every dead letter in the dead-letter stream.
pub async fn dead_letters(context: &jetstream::Context) -> Result<Vec<DeadLetter>, BoxError> {
    let mut stream = context.get_stream(DEAD_LETTER_STREAM).await?;
    let state = stream.info().await?.state.clone();
    let mut found = Vec::new();
    if state.messages == 0 {
        return Ok(found);
    }
    let header = |message: &jetstream::message::StreamMessage, name: &str| {
        message
            .headers
            .get(name)
            .map(|value| value.as_str().to_owned())
    };
    for sequence in state.first_sequence..=state.last_sequence {
        let message = stream.get_raw_message(sequence).await?;
        found.push(DeadLetter {
            order_id: header(&message, HEADER_ORDER_ID).unwrap_or_default(),
            received: header(&message, HEADER_RECEIVED_FINGERPRINT).unwrap_or_default(),
            stored: header(&message, HEADER_STORED_FINGERPRINT),
        });
    }
    Ok(found)
}

/// Every shard's messages in the orders' stream, as (stream sequence, body) in stream order:
/// the reference a replaying consumer's reads are checked against. Thirty seconds without the
/// next message fails the run rather than hang it.
pub async fn read_back(
    context: &jetstream::Context,
    shards: usize,
) -> Result<Vec<Vec<(u64, String)>>, BoxError> {
    let mut stream = context.get_stream(STREAM).await?;
    let expected = stream.info().await?.state.messages;
    let mut messages = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: "orders.*".to_owned(),
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?
        .messages()
        .await?;
    let mut shards_read = vec![Vec::new(); shards];
    for _ in 0..expected {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .map_err(|_| "reading the stream back: nothing for 30 s")?
            .ok_or("reading the stream back: the consumer ended")??;
        let shard = (0..shards)
            .find(|&shard| message.subject.as_str() == subject(shard))
            .ok_or_else(|| format!("a message on {}, no shard's subject", message.subject))?;
        let sequence = message.info()?.stream_sequence;
        let body = String::from_utf8_lossy(&message.payload).into_owned();
        shards_read[shard].push((sequence, body));
    }
    Ok(shards_read)
}
