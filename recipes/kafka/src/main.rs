//! A Kafka consumer with exactly-once effects and no offset commits to Kafka: the read
//! position of each partition lives in idemdb, written in the same write batch as the
//! messages' markers and their effects.
//!
//! ```text
//! cargo run --release -p idemdb-kafka-recipe -- --bootstrap 127.0.0.1:9092 --topic orders \
//!     --partitions 0,1,2 --dir /var/lib/orders          # manual assignment
//! cargo run --release -p idemdb-kafka-recipe -- --bootstrap 127.0.0.1:9092 --topic orders \
//!     --group orders --dir /var/lib/orders              # a consumer group
//! ```
//!
//! - **One store per partition** (`<dir>/partition-<p>`): the store moves with the partition, so
//!   whichever process owns a partition opens its store and finds its position there.
//! - **Manual assignment** (`--partitions`): the process `assign`s its partitions, each at the
//!   offset after its stored position (in the assignment itself: a `seek` right after `assign`
//!   fails until the partition is being fetched), or at the beginning when none is stored.
//! - **A consumer group** (`--group`): Kafka decides who owns which partition; on each
//!   assignment the rebalance callback opens the partitions' stores and assigns each at its
//!   stored position, on a revocation it closes them (`stores.rs`). A SIGKILLed member's
//!   partitions go to the others once its session times out, and each new owner resumes where
//!   the store says.
//! - **Nothing committed to Kafka.** `enable.auto.commit=false`, and `commit` is never called:
//!   the group's offsets would be a second, non-atomic copy of the position. So the consumer
//!   needs no broker transactions, no `read_committed` and no offset commits: it runs on
//!   Kafka 0.9 (`--protocol 0.9`, librdkafka's `api.version.request=false` and
//!   `broker.version.fallback=0.9.0.1`) as on a current broker.
//! - **Per poll**: the messages read within a few milliseconds (up to 64), grouped by partition;
//!   each partition's group claimed as one batch (`batch.rs`: fresh orders stage their effects,
//!   conflicts a row of `conflicts`), with the group's last offset as the position
//!   (`ClaimBatch::stage_position`), committed: one write batch, one fsync. After a crash the
//!   partition resumes exactly after the last group whose effects are stored.
//!
//! For the end-to-end run (`e2e/src/bin/kafka_e2e.rs`, `scripts/kafka-e2e.sh`) it also writes
//! an event ledger per partition (`--ledgers DIR`), a `reads` row per offset, SIGKILLs itself
//! right after a commit (`--kill-at-commit-per-mille N`; `--kill-at-commit-of OFFSET`: surely,
//! once, after the commit that reaches OFFSET, having written `planned-kill` to the ledger, so
//! that the restarted process finds nothing left to read), and, as the negative controls, keeps
//! its position in the group's committed offsets instead, before or after the commit
//! (`--position broker-before-commit`, `broker-after-commit`). A recipe copied into an
//! application leaves those out.

mod batch;
#[path = "../../../examples/common/ledger.rs"]
mod ledger;
mod stores;
#[path = "../../../examples/common/streams.rs"]
mod streams;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};

use batch::Read;
use stores::{GroupContext, Layout, ManualContext, Owned, committed, log_ready, start_of};
use streams::Placement;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The most messages read into one group.
const GROUP_MESSAGES_MAX: usize = 64;
/// How long a group waits for one more message before it is claimed.
const GROUP_WAIT: Duration = Duration::from_millis(3);

struct Options {
    bootstrap: String,
    topic: String,
    partitions: Vec<i32>,
    group: Option<String>,
    dir: PathBuf,
    ledgers: Option<PathBuf>,
    old_protocol: bool,
    placement: Placement,
    kill_at_commit_per_mille: u64,
    kill_at_commit_of: Option<u64>,
    seed: u64,
}

fn parse_options() -> Result<Options, BoxError> {
    let mut options = Options {
        bootstrap: "127.0.0.1:9092".to_owned(),
        topic: "orders".to_owned(),
        partitions: Vec::new(),
        group: None,
        dir: PathBuf::from("/tmp/idemdb-kafka"),
        ledgers: None,
        old_protocol: false,
        placement: Placement::Store,
        kill_at_commit_per_mille: 0,
        kill_at_commit_of: None,
        seed: u64::from(std::process::id()),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--bootstrap" => options.bootstrap = value()?,
            "--topic" => options.topic = value()?,
            "--partitions" => {
                let list = value()?;
                options.partitions = list.split(',').map(str::parse).collect::<Result<_, _>>()?;
            }
            "--group" => options.group = Some(value()?),
            "--dir" => options.dir = value()?.into(),
            "--ledgers" => options.ledgers = Some(value()?.into()),
            "--protocol" => options.old_protocol = value()? == "0.9",
            "--position" => {
                let text = value()?;
                options.placement =
                    Placement::parse(&text).ok_or_else(|| format!("unknown placement {text}"))?;
            }
            "--kill-at-commit-per-mille" => options.kill_at_commit_per_mille = value()?.parse()?,
            "--kill-at-commit-of" => options.kill_at_commit_of = Some(value()?.parse()?),
            "--seed" => options.seed = value()?.parse()?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if options.partitions.is_empty() == options.group.is_none() {
        return Err("give either --partitions (manual assignment) or --group".into());
    }
    if options.group.is_some() && options.placement != Placement::Store {
        return Err("the consumer group keeps its position in the store only".into());
    }
    Ok(options)
}

/// Set by SIGTERM: stop between groups.
static TERMINATED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_terminate(_: libc::c_int) {
    TERMINATED.store(true, Ordering::SeqCst);
}

fn main() {
    if let Err(error) = run() {
        eprintln!("kafka recipe: {error}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), BoxError> {
    let options = parse_options()?;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_terminate as extern "C" fn(libc::c_int) as libc::sighandler_t,
        )
    };
    let layout = Layout {
        stores: options.dir.clone(),
        ledgers: options.ledgers.clone(),
    };
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &options.bootstrap)
        // Under manual assignment librdkafka still wants a group id; no group is joined.
        .set(
            "group.id",
            options.group.as_deref().unwrap_or("idemdb-orders"),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        // Only if a stored offset fell out of the topic's retention.
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .set("fetch.wait.max.ms", "100");
    if options.old_protocol {
        // Kafka 0.9 answers no ApiVersions request: the client must be told what it speaks.
        config
            .set("api.version.request", "false")
            .set("broker.version.fallback", "0.9.0.1");
    }

    match &options.group {
        None => {
            let kafka: BaseConsumer<ManualContext> = config.create_with_context(ManualContext)?;
            let owned = Owned::default();
            let stored = match options.placement {
                Placement::Store => None,
                _ => Some(committed(&kafka, &options.topic, &options.partitions)?),
            };
            let mut list = TopicPartitionList::new();
            let mut partitions = owned.partitions.lock().map_err(|_| "poisoned")?;
            for &number in &options.partitions {
                let partition = layout.open(number)?;
                let last = match &stored {
                    None => partition
                        .consumer
                        .positions()
                        .get(&options.topic, u32::try_from(number)?)?
                        .map(|position| position.offset),
                    Some(committed) => committed.get(&number).copied().flatten(),
                };
                let start = start_of(last)?;
                list.add_partition_offset(&options.topic, number, start)?;
                log_ready(&partition, start);
                partitions.insert(number, partition);
            }
            drop(partitions);
            kafka.assign(&list)?;
            consume(&kafka, &owned, &options)
        }
        Some(_) => {
            let context = GroupContext {
                layout,
                topic: options.topic.clone(),
                owned: Owned::default(),
            };
            let kafka: BaseConsumer<GroupContext> = config.create_with_context(context)?;
            kafka.subscribe(&[&options.topic])?;
            let result = consume(&kafka, &kafka.context().owned, &options);
            // Leave the group at once, so the others take the partitions without waiting
            // for this member's session to time out.
            kafka.unsubscribe();
            result
        }
    }
}

/// Reads, claims and commits until SIGTERM.
fn consume<C: ConsumerContext>(
    kafka: &BaseConsumer<C>,
    owned: &Owned,
    options: &Options,
) -> Result<(), BoxError> {
    let mut draws = options.seed;
    while !TERMINATED.load(Ordering::SeqCst) {
        let generation = owned.generation.load(Ordering::SeqCst);
        // A group: the first message waited for, then whatever follows within GROUP_WAIT.
        let mut groups: BTreeMap<i32, Vec<Read>> = BTreeMap::new();
        let mut count = 0;
        let mut wait = Duration::from_millis(100);
        while count < GROUP_MESSAGES_MAX {
            let Some(delivery) = kafka.poll(wait) else {
                break;
            };
            let message = match delivery {
                Ok(message) => message,
                // librdkafka retries broker and transport failures itself.
                Err(error) => {
                    eprintln!("kafka recipe: {error}");
                    break;
                }
            };
            let body = message.payload().ok_or("a message without a payload")?;
            groups.entry(message.partition()).or_default().push(Read {
                offset: u64::try_from(message.offset())?,
                body: String::from_utf8_lossy(body).into_owned(),
            });
            count += 1;
            wait = GROUP_WAIT;
        }
        // Read across a rebalance: its partitions may belong to another member now. Nothing
        // of it is committed; the owner reads it from the stored position.
        if owned.generation.load(Ordering::SeqCst) != generation {
            continue;
        }
        let partitions = owned.partitions.lock().map_err(|_| "poisoned")?;
        for (number, group) in groups {
            let Some(partition) = partitions.get(&number) else {
                continue;
            };
            let Some(last) = group.last().map(|read| read.offset) else {
                continue;
            };
            if let Some(ledger) = &partition.ledger {
                for read in &group {
                    ledger.event("read", &read.offset.to_string(), None);
                }
            }
            let mut batch = batch::claim(partition, &group)?;
            let per_mille = options.kill_at_commit_per_mille;
            match options.placement {
                Placement::Store => {
                    // The position, the markers, the effects: one write batch, one fsync.
                    batch.stage_position(&options.topic, u32::try_from(number)?, last)?;
                    batch.commit(|_| b"applied")?;
                    if options
                        .kill_at_commit_of
                        .is_some_and(|offset| last >= offset)
                    {
                        // The planned kill, once the ledger says so (nothing after it can be).
                        if let Some(ledger) = &partition.ledger {
                            ledger.event("planned-kill", &last.to_string(), None);
                        }
                        // SAFETY: raising a signal at ourselves.
                        unsafe { libc::raise(libc::SIGKILL) };
                    }
                    kill_point(&mut draws, per_mille);
                }
                Placement::BrokerBeforeCommit => {
                    commit_offset(kafka, &options.topic, number, last)?;
                    kill_point(&mut draws, per_mille);
                    batch.commit(|_| b"applied")?;
                }
                Placement::BrokerAfterCommit => {
                    batch.commit(|_| b"applied")?;
                    kill_point(&mut draws, per_mille);
                    commit_offset(kafka, &options.topic, number, last)?;
                }
            }
            if let Some(ledger) = &partition.ledger {
                ledger.event("commit", &last.to_string(), None);
            }
        }
    }
    Ok(())
}

/// The negative controls' position: the group's committed offset (the next to read).
fn commit_offset<C: ConsumerContext>(
    kafka: &BaseConsumer<C>,
    topic: &str,
    partition: i32,
    last: u64,
) -> Result<(), BoxError> {
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(topic, partition, Offset::Offset(i64::try_from(last + 1)?))?;
    kafka.commit(&list, CommitMode::Sync)?;
    Ok(())
}

/// The crash point, hit on purpose with probability `per_mille`/1000: a SIGKILL of this process.
fn kill_point(draws: &mut u64, per_mille: u64) {
    if per_mille == 0 {
        return;
    }
    *draws = draws
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    if (*draws >> 33) % 1000 < per_mille {
        // SAFETY: raising a signal at ourselves.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}
