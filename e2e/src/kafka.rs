//! A Kafka-protocol broker as the Kafka checker uses it (librdkafka through `rdkafka`): the
//! client settings of the broker's protocol (Kafka 0.9 answers no ApiVersions request), the
//! topic's partitions waited for, the orders published at a rate with every delivery
//! acknowledged by the broker, and each partition read back from its start as the reference.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message as _;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer as _, ProducerContext};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};

use crate::BoxError;

/// The protocol a broker speaks: `0.9` (Kafka 0.9.0.1: no ApiVersions request, the client told
/// the broker's version) or `modern`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Old,
    Modern,
}

impl Protocol {
    pub fn parse(text: &str) -> Option<Protocol> {
        match text {
            "0.9" => Some(Protocol::Old),
            "modern" => Some(Protocol::Modern),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Protocol::Old => "0.9",
            Protocol::Modern => "modern",
        }
    }
}

/// A client configuration for `bootstrap` speaking `protocol`.
pub fn config(bootstrap: &str, protocol: Protocol) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    if protocol == Protocol::Old {
        config
            .set("api.version.request", "false")
            .set("broker.version.fallback", "0.9.0.1");
    }
    config
}

/// A consumer that joins no group and commits nothing: the checker's reads.
fn reader(bootstrap: &str, protocol: Protocol) -> Result<BaseConsumer, BoxError> {
    Ok(config(bootstrap, protocol)
        .set("group.id", "idemdb-checker")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()?)
}

/// Waits up to a minute until `topic` has `partitions` partitions, each with a leader.
pub fn wait_for_topic(
    bootstrap: &str,
    protocol: Protocol,
    topic: &str,
    partitions: usize,
) -> Result<(), BoxError> {
    let client = reader(bootstrap, protocol)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = match client.fetch_metadata(Some(topic), Duration::from_secs(5)) {
            Ok(metadata) => metadata.topics().iter().any(|found| {
                found.name() == topic
                    && found.error().is_none()
                    && found.partitions().len() == partitions
                    && found.partitions().iter().all(|p| p.leader() >= 0)
            }),
            Err(_) => false,
        };
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(
                format!("topic {topic} without {partitions} led partitions in 60 s").into(),
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Counts the deliveries the broker acknowledged, per partition, and those it refused.
#[derive(Default)]
struct Deliveries {
    acknowledged: std::sync::Mutex<std::collections::BTreeMap<i32, u64>>,
    failed: AtomicU64,
}

struct Counting(Arc<Deliveries>);

impl ClientContext for Counting {}

impl ProducerContext for Counting {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(message) => {
                let mut acknowledged = self
                    .0
                    .acknowledged
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                *acknowledged.entry(message.partition()).or_default() += 1;
            }
            Err((error, _)) => {
                eprintln!("checker: a publish failed: {error}");
                self.0.failed.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

/// Publishes `messages` (partition, key, body) to `topic` in order, `rate` per second, each
/// acknowledged by the broker (`acks=all`); returns how many were, per partition. A refused
/// publish fails the run: the reference would then not be what the plan says.
pub fn publish(
    bootstrap: &str,
    protocol: Protocol,
    topic: &str,
    messages: &[(i32, String, String)],
    rate: u64,
) -> Result<std::collections::BTreeMap<i32, u64>, BoxError> {
    let deliveries = Arc::new(Deliveries::default());
    let producer: rdkafka::producer::BaseProducer<Counting> = config(bootstrap, protocol)
        .set("acks", "all")
        .set("linger.ms", "2")
        // One in flight: a retried request cannot overtake the next, so each partition holds
        // the messages in the plan's order.
        .set("max.in.flight.requests.per.connection", "1")
        .create_with_context(Counting(deliveries.clone()))?;
    let interval = Duration::from_micros(1_000_000 / rate.max(1));
    let started = Instant::now();
    for (index, (partition, key, body)) in messages.iter().enumerate() {
        let due = started + interval * u32::try_from(index)?;
        while Instant::now() < due {
            producer.poll(due.saturating_duration_since(Instant::now()));
        }
        let mut record = BaseRecord::to(topic)
            .partition(*partition)
            .key(key)
            .payload(body);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                // The local queue is full: serve deliveries, then try again.
                Err((error, returned)) => {
                    if !matches!(
                        error,
                        rdkafka::error::KafkaError::MessageProduction(
                            rdkafka::types::RDKafkaErrorCode::QueueFull
                        )
                    ) {
                        return Err(error.into());
                    }
                    record = returned;
                    producer.poll(Duration::from_millis(10));
                }
            }
        }
    }
    producer.flush(Duration::from_secs(60))?;
    let failed = deliveries.failed.load(Ordering::SeqCst);
    if failed > 0 {
        return Err(format!("the broker refused {failed} publishes").into());
    }
    let acknowledged = deliveries
        .acknowledged
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    Ok(acknowledged.clone())
}

/// Every message of `partition` from its start: (offset, body), to its high watermark and at
/// least `published` messages (the publishes to it the broker acknowledged). The watermark is
/// asked again once both are reached, until it stands still. The count is needed because tansu
/// answers a ListOffsets for the latest offset with the first offset of the partition's last
/// record batch, not the offset after it: a reader that trusted the watermark alone would stop
/// short of the batch. Thirty seconds without the next message fails the run rather than hang
/// it (and so does an acknowledged message the broker does not deliver).
pub fn read_partition(
    bootstrap: &str,
    protocol: Protocol,
    topic: &str,
    partition: i32,
    published: u64,
) -> Result<Vec<(u64, String)>, BoxError> {
    let client = reader(bootstrap, protocol)?;
    let watermarks = Duration::from_secs(10);
    let (low, high) = client.fetch_watermarks(topic, partition, watermarks)?;
    let mut high = high.max(low + i64::try_from(published)?);
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(topic, partition, Offset::Offset(low))?;
    client.assign(&list)?;
    let mut messages: Vec<(u64, String)> = Vec::new();
    let mut next = low;
    let mut last_progress = Instant::now();
    loop {
        if next >= high {
            let (_, again) = client.fetch_watermarks(topic, partition, watermarks)?;
            if again == high {
                return Ok(messages);
            }
            high = again;
            continue;
        }
        if last_progress.elapsed() > Duration::from_secs(30) {
            let read = messages.len();
            return Err(
                format!("{topic}/{partition}: {read} read, next {next}, high {high}").into(),
            );
        }
        let Some(delivery) = client.poll(Duration::from_millis(200)) else {
            continue;
        };
        let message = delivery?;
        let offset = u64::try_from(message.offset())?;
        let body = message.payload().unwrap_or_default();
        if messages
            .last()
            .is_some_and(|(previous, _)| *previous >= offset)
        {
            return Err(format!("{topic}/{partition}: offset {offset} read out of order").into());
        }
        messages.push((offset, String::from_utf8_lossy(body).into_owned()));
        next = message.offset() + 1;
        last_progress = Instant::now();
    }
}
