//! The partitions this process owns, each with its own store (the store belongs to the
//! partition, not to the process, so it moves with the partition), and where each starts
//! reading: one past its stored position. Under manual assignment the process takes its
//! partitions once; in a consumer group, the rebalance callback ([`GroupContext`]) takes the
//! partitions Kafka assigns, each at its store's position, and lets go of the revoked ones.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemdb::{Consumer, Engine, Error};
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::BoxError;
use crate::ledger::Ledger;
use crate::streams::{CONSUMER_ID, open_stream_store};

/// How long a new owner waits for a partition's store while its previous owner still holds it
/// (a member that has not noticed its partitions were revoked).
const STORE_WAIT: Duration = Duration::from_secs(60);

/// One owned partition: its store open, its claims' consumer, the ledger of its events.
pub(crate) struct Partition {
    pub(crate) engine: Engine,
    pub(crate) consumer: Consumer,
    pub(crate) ledger: Option<Ledger>,
}

/// Where the partitions' stores and ledgers live.
pub(crate) struct Layout {
    pub(crate) stores: PathBuf,
    pub(crate) ledgers: Option<PathBuf>,
}

impl Layout {
    /// Opens partition `partition`'s store, waiting while another process holds it.
    pub(crate) fn open(&self, partition: i32) -> Result<Partition, BoxError> {
        let dir = self.stores.join(format!("partition-{partition}"));
        let deadline = Instant::now() + STORE_WAIT;
        let engine = loop {
            match open_stream_store(&dir) {
                Ok(engine) => break engine,
                Err(Error::AlreadyOpen { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(error) => return Err(error.into()),
            }
        };
        let consumer = engine.consumer(CONSUMER_ID)?;
        let ledger = match &self.ledgers {
            Some(dir) => Some(Ledger::open(&dir.join(format!("ledger-{partition}.log")))?),
            None => None,
        };
        Ok(Partition {
            engine,
            consumer,
            ledger,
        })
    }
}

/// Where a partition starts: one past the offset `stored` (its position, or in the negative
/// controls the group's committed offset less one), or at its beginning when none is.
pub(crate) fn start_of(stored: Option<u64>) -> Result<Offset, BoxError> {
    Ok(match stored {
        Some(offset) => Offset::Offset(i64::try_from(offset + 1)?),
        None => Offset::Beginning,
    })
}

/// Tells the partition's ledger where it starts reading.
pub(crate) fn log_ready(partition: &Partition, start: Offset) {
    if let Some(ledger) = &partition.ledger {
        let from = match start {
            Offset::Offset(offset) => offset.to_string(),
            _ => "first".to_owned(),
        };
        ledger.event("ready", &from, None);
    }
}

/// The partitions owned now, and how many times the assignment changed: a group of messages
/// read across a change is dropped unclaimed (its partitions may have moved).
#[derive(Default)]
pub(crate) struct Owned {
    pub(crate) partitions: Mutex<BTreeMap<i32, Partition>>,
    pub(crate) generation: AtomicU64,
}

/// The consumer group's context: on an assignment, each partition's store is opened and the
/// partition assigned at its stored position; on a revocation the stores are closed. Both run
/// inside `poll`, on the thread that claims and commits, so no commit is in flight then.
pub(crate) struct GroupContext {
    pub(crate) layout: Layout,
    pub(crate) topic: String,
    pub(crate) owned: Owned,
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn rebalance(
        &self,
        base_consumer: &BaseConsumer<Self>,
        err: rdkafka::types::RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        self.owned.generation.fetch_add(1, Ordering::SeqCst);
        let outcome = match err {
            rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                self.take(tpl).and_then(|()| Ok(base_consumer.assign(tpl)?))
            }
            // Revoked (or a rebalance error): every store is closed before the partitions can
            // be assigned elsewhere.
            _ => {
                self.owned
                    .partitions
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .clear();
                base_consumer.unassign().map_err(BoxError::from)
            }
        };
        if let Err(error) = outcome {
            // Without its stores the process cannot go on: it exits, its partitions go to the
            // other members, and it is restarted.
            eprintln!("kafka recipe: rebalance: {error}");
            std::process::exit(1);
        }
    }
}

impl GroupContext {
    /// Opens the store of every partition in `tpl` and sets its start there.
    fn take(&self, tpl: &mut TopicPartitionList) -> Result<(), BoxError> {
        let mut partitions = self
            .owned
            .partitions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let assigned: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
        for partition in assigned {
            let owned = self.layout.open(partition)?;
            let stored = owned
                .consumer
                .positions()
                .get(&self.topic, u32::try_from(partition)?)?
                .map(|position| position.offset);
            let start = start_of(stored)?;
            tpl.set_partition_offset(&self.topic, partition, start)?;
            log_ready(&owned, start);
            partitions.insert(partition, owned);
        }
        Ok(())
    }
}

/// The manual assignment's context: no rebalances.
pub(crate) struct ManualContext;

impl ClientContext for ManualContext {}
impl ConsumerContext for ManualContext {}

/// The group's committed offsets of `partitions` (the negative controls' position), as the
/// last offset read: one less than the committed next offset.
pub(crate) fn committed<C: ConsumerContext>(
    kafka: &BaseConsumer<C>,
    topic: &str,
    partitions: &[i32],
) -> KafkaResult<BTreeMap<i32, Option<u64>>> {
    let mut list = TopicPartitionList::new();
    for &partition in partitions {
        list.add_partition(topic, partition);
    }
    let committed = kafka.committed_offsets(list, Duration::from_secs(30))?;
    Ok(committed
        .elements()
        .iter()
        .map(|element| {
            let last = match element.offset() {
                Offset::Offset(next) if next > 0 => u64::try_from(next - 1).ok(),
                _ => None,
            };
            (element.partition(), last)
        })
        .collect())
}
