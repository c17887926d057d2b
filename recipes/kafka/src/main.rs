//! A Kafka consumer with exactly-once effects and no offset commits to Kafka: the read
//! position of each partition lives in idemdb, written in the same write batch as the
//! message's marker and its effects.
//!
//! - **Manual assignment.** The consumer `assign`s the partitions it owns (no consumer-group
//!   rebalancing: which process owns which partition is decided outside, as the store of an
//!   embedded engine belongs to one process), each at the offset after its stored position,
//!   or at the beginning when none is stored.
//! - **Nothing committed to Kafka.** `enable.auto.commit=false`, and `commit` is never called:
//!   the group's offsets would be a second, non-atomic copy of the position.
//! - **Per message**: claim its key; fresh, stage the effect and the position and commit them
//!   together; a duplicate (a producer's retry, at another offset) or a conflict moves the
//!   position on its own. After a crash the consumer resumes exactly after the last message
//!   whose effects are stored: nothing is lost, nothing read again.
//!
//! ```text
//! cargo run --release -p idemdb-kafka-recipe -- <bootstrap servers> <topic> <partitions, e.g. 0,1,2> <store dir>
//! ```
//!
//! The same shape runs on RabbitMQ streams in `examples/stream_orders/` (with batches, under
//! SIGKILLs, checked end to end by `scripts/rabbitmq-streams.sh`); this one is compiled by the
//! test command but was not run against a Kafka broker.

use std::time::Duration;

use idemdb::{Consumer, Durability, Engine, Fingerprint, Outcome, TableOptions};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let [_, bootstrap, topic, partitions, store] = args.as_slice() else {
        return Err(
            "usage: idemdb-kafka-recipe <bootstrap servers> <topic> <partitions: 0,1,2> \
                    <store dir>"
                .into(),
        );
    };
    let partitions: Vec<i32> = partitions
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;

    let engine = Engine::builder(store)
        .durability(Durability::Sync)
        .business_table(TableOptions::new("orders"))
        .open()?;
    let consumer = engine.consumer("orders")?;
    let orders = engine.business_table("orders")?;

    let kafka: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        // librdkafka wants a group id even under manual assignment; no group is joined and no
        // offset is fetched from it, since every partition starts at an explicit offset.
        .set("group.id", "idemdb-orders")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        // Only if the stored offset fell out of the topic's retention.
        .set("auto.offset.reset", "earliest")
        .create()?;
    kafka.assign(&assignment(&consumer, topic, &partitions)?)?;

    loop {
        let Some(delivery) = kafka.poll(Duration::from_millis(500)) else {
            continue;
        };
        let message = match delivery {
            Ok(message) => message,
            // librdkafka retries broker and transport failures itself.
            Err(error) => {
                eprintln!("kafka: {error}");
                continue;
            }
        };
        let (Some(key), Some(payload)) = (message.key(), message.payload()) else {
            eprintln!("offset {}: no key or no payload; skipped", message.offset());
            continue;
        };
        let partition = u32::try_from(message.partition())?;
        let offset = u64::try_from(message.offset())?;
        match consumer.begin(key, Fingerprint::of(payload))? {
            Outcome::Fresh(mut claim) => {
                // The effect, the marker and the position: one write batch, one fsync.
                claim.put(&orders, key, payload)?;
                claim.stage_position(message.topic(), partition, offset)?;
                claim.commit(b"applied")?;
            }
            // Already applied (a producer's retry), or the key reused with other content
            // (alert, or record it: a batch's own writes land with its position, see
            // `ClaimBatch::put`): no effect, but the position moves past it.
            Outcome::Duplicate { .. } | Outcome::Conflict { .. } => {
                consumer
                    .positions()
                    .advance(message.topic(), partition, offset)?;
            }
            other => return Err(format!("offset {offset}: unexpected {other:?}").into()),
        }
    }
}

/// Each partition at the offset after its stored position, or at the beginning.
fn assignment(
    consumer: &Consumer,
    topic: &str,
    partitions: &[i32],
) -> Result<TopicPartitionList, BoxError> {
    let mut list = TopicPartitionList::new();
    for &partition in partitions {
        let stored = consumer.positions().get(topic, u32::try_from(partition)?)?;
        let start = match stored {
            Some(position) => Offset::Offset(i64::try_from(position.next_offset())?),
            None => Offset::Beginning,
        };
        // The start goes in the assignment itself: a `seek` right after `assign` fails until
        // the partition is being fetched.
        list.add_partition_offset(topic, partition, start)?;
    }
    Ok(list)
}
