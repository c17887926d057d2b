//! RabbitMQ for the checkers: the connection, queues declared empty, publishing at a steady
//! rate with every publish confirmed, waiting for the consumers to drain the queues, and the
//! dead-letter queue's contents.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
    QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::BoxError;
use crate::orders::{
    DEAD_LETTER_QUEUE, HEADER_ORDER_ID, HEADER_RECEIVED_FINGERPRINT, HEADER_STORED_FINGERPRINT,
};
use crate::supervisor::Supervisor;

/// Connects to `amqp`, waiting up to a minute for the broker to accept connections.
pub async fn connect(amqp: &str) -> Result<Connection, BoxError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Connection::connect(amqp, ConnectionProperties::default()).await {
            Ok(connection) => return Ok(connection),
            Err(error) if Instant::now() < deadline => {
                eprintln!("checker: waiting for the broker ({error})");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// A checker's session with the broker: a channel for the set-up and the checks, and one in
/// confirm mode for publishing.
pub struct Session {
    pub connection: Connection,
    pub channel: Channel,
    pub publisher: Channel,
}

/// Connects to `amqp` (see [`connect`]) and opens the session's two channels.
pub async fn session(amqp: &str) -> Result<Session, BoxError> {
    let connection = connect(amqp).await?;
    let channel = connection.create_channel().await?;
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(Session {
        connection,
        channel,
        publisher,
    })
}

/// Declares the durable queue `queue` with `arguments`, binds it to `exchange` with
/// `binding_key` if given, and empties it: a run starts from no message.
pub async fn declare_empty_queue(
    channel: &Channel,
    queue: &str,
    arguments: FieldTable,
    binding: Option<(&str, &str)>,
) -> Result<(), BoxError> {
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await?;
    if let Some((exchange, binding_key)) = binding {
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                binding_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    channel
        .queue_purge(queue.into(), QueuePurgeOptions::default())
        .await?;
    Ok(())
}

/// Messages ready in `queues` (not counting those delivered and not yet acked).
pub async fn ready_messages(channel: &Channel, queues: &[String]) -> Result<u64, BoxError> {
    let mut ready = 0;
    for queue in queues {
        // A passive declare only reads the queue: its arguments are not compared.
        let declared = channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        ready += u64::from(declared.message_count());
    }
    Ok(ready)
}

/// One message to publish: the exchange's routing key (the queue's name for the default
/// exchange), the order id (its `message_id`) and the body.
pub struct Outgoing {
    pub routing_key: String,
    pub order_id: String,
    pub body: String,
}

/// Publishes `messages` to `exchange` (`""`: the default exchange) at `rate` per second, as
/// persistent messages, each confirmed by the broker before the next (`channel` is in confirm
/// mode); `published` counts the confirmed ones as they go.
pub async fn publish(
    channel: Channel,
    exchange: &str,
    messages: Vec<Outgoing>,
    rate: u64,
    published: Arc<AtomicU64>,
) -> Result<(), BoxError> {
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / rate.max(1)));
    for message in messages {
        ticker.tick().await;
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(message.order_id.as_str()))
            .with_delivery_mode(2);
        let confirm = channel
            .basic_publish(
                exchange.into(),
                message.routing_key.as_str().into(),
                BasicPublishOptions::default(),
                message.body.as_bytes(),
                properties,
            )
            .await?
            .await?;
        if !confirm.is_ack() {
            return Err("the broker refused a publish".into());
        }
        published.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Waits until no message is ready in `queues` and `progress` (the consumers' count of work
/// done) has not moved for a second, restarting exited consumers meanwhile. Ten minutes at
/// most.
pub async fn wait_quiet(
    channel: &Channel,
    queues: &[String],
    mut restart_exited: impl FnMut() -> Result<(), BoxError>,
    mut progress: impl FnMut() -> Result<u64, BoxError>,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last = (u64::MAX, Instant::now());
    loop {
        restart_exited()?;
        let ready = ready_messages(channel, queues).await?;
        let done = progress()?;
        if ready > 0 || done != last.0 {
            last = (done, Instant::now());
        } else if last.1.elapsed() >= Duration::from_secs(1) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the queues did not drain ({ready} messages ready)").into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `queues` have drained and the consumers are idle (`progress` still), runs
/// `when_quiet` (while the consumers still run: a checker scrapes their metrics there), then
/// stops the consumers gracefully; starts them again and repeats until nothing came back to the
/// queues (a message delivered to a stopping consumer goes back to its queue). The consumers
/// are stopped on return.
pub async fn drain(
    channel: &Channel,
    queues: &[String],
    consumers: &mut Supervisor,
    mut progress: impl FnMut() -> Result<u64, BoxError>,
    mut when_quiet: impl FnMut(),
) -> Result<(), BoxError> {
    for round in 0.. {
        wait_quiet(
            channel,
            queues,
            || consumers.restart_exited(),
            &mut progress,
        )
        .await?;
        when_quiet();
        consumers.stop_gracefully()?;
        if ready_messages(channel, queues).await? == 0 {
            break;
        }
        if round == 10 {
            return Err("messages keep coming back after ten drain rounds".into());
        }
        consumers.start_all()?;
    }
    Ok(())
}

/// One dead-lettered message as found in the DLQ.
pub struct DeadLetter {
    pub order_id: String,
    pub received: String,
    pub stored: Option<String>,
}

pub fn header(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

pub async fn drain_dead_letters(channel: &Channel) -> Result<Vec<DeadLetter>, BoxError> {
    let mut found = Vec::new();
    while let Some(message) = channel
        .basic_get(DEAD_LETTER_QUEUE.into(), BasicGetOptions::default())
        .await?
    {
        let delivery = message.delivery;
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        found.push(DeadLetter {
            order_id: header(&headers, HEADER_ORDER_ID).unwrap_or_default(),
            received: header(&headers, HEADER_RECEIVED_FINGERPRINT).unwrap_or_default(),
            stored: header(&headers, HEADER_STORED_FINGERPRINT),
        });
        delivery.ack(BasicAckOptions::default()).await?;
    }
    Ok(found)
}
