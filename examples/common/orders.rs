//! What the example consumers and their end-to-end checkers agree on: the store's layout, the
//! message format, RabbitMQ's exchanges and queue names and dead-letter headers, and the effect
//! of the consumers that claim in PostgreSQL.

// Each of the examples uses its own part of this module.
#![allow(dead_code)]

use idemdb::{Durability, Engine, TableOptions, merge_ops};

/// The examples' error type: anything, across tasks.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An error with its sources (a database error's message is in its source).
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    message
}

/// The effect of the consumers that claim in PostgreSQL (`postgres_orders`, `nats_orders
/// --pg`): a row of `fleet.applied` per order, counting how often it was applied. The checkers
/// create the table (`e2e/src/effects_table.rs`).
pub const APPLY_EFFECT: &str = "INSERT INTO fleet.applied (order_id, body, times) \
     VALUES ($1, $2, 1) \
     ON CONFLICT (order_id) DO UPDATE SET times = fleet.applied.times + 1";

/// The exchange orders are published to; queue `orders.<shard>` is bound with key `<shard>`.
pub const EXCHANGE: &str = "orders";
/// Where conflicts (a reused order id with other content) and unusable messages go.
pub const DEAD_LETTER_QUEUE: &str = "orders.dead";
/// The dead-letter headers: the order id and both fingerprints of a conflict.
pub const HEADER_ORDER_ID: &str = "x-idemdb-order-id";
pub const HEADER_STORED_FINGERPRINT: &str = "x-idemdb-stored-fingerprint";
pub const HEADER_RECEIVED_FINGERPRINT: &str = "x-idemdb-received-fingerprint";
/// The `effects` table key holding the sum of the amounts of every order applied.
pub const TOTAL_AMOUNT_KEY: &str = "total-amount";

/// The queue of shard `shard`.
pub fn queue_name(shard: usize) -> String {
    format!("{EXCHANGE}.{shard}")
}

/// The shard an order id belongs to: each shard is one queue, one consumer process, one store.
pub fn shard_of(order_id: &str, shards: usize) -> usize {
    let hash = xxhash_rust::xxh3::xxh3_64(order_id.as_bytes());
    usize::try_from(hash % shards as u64).expect("a shard index fits in usize")
}

/// The consistent-hash exchange of the partitioned fleet: it routes each order by a hash of its
/// routing key (the order id) to one of the partition queues.
pub const PARTITION_EXCHANGE: &str = "orders.partitioned";

/// The queue of partition `partition` in the partitioned fleet.
pub fn partition_queue(partition: usize) -> String {
    format!("{PARTITION_EXCHANGE}.{partition}")
}

/// The partition queues' arguments: a single active consumer, so the broker delivers a
/// partition to one consumer at a time and hands it to a standby when that one goes.
pub fn partition_queue_arguments() -> lapin::types::FieldTable {
    let mut arguments = lapin::types::FieldTable::default();
    arguments.insert(
        "x-single-active-consumer".into(),
        lapin::types::AMQPValue::Boolean(true),
    );
    arguments
}

/// Opens a partition's store, its metrics labelled with the partition.
pub fn open_partition_store(dir: &std::path::Path, partition: usize) -> idemdb::Result<Engine> {
    builder(dir)
        .metrics_label("partition", &partition.to_string())
        .open()
}

/// Opens a shard's store. The layout is part of the application, so the checker opens it the
/// same way: an `orders` table (order id -> body) and an `effects` table of counters (order id
/// -> times applied, and the total amount).
pub fn open_store(dir: &std::path::Path) -> idemdb::Result<Engine> {
    builder(dir).open()
}

fn builder(dir: &std::path::Path) -> idemdb::EngineBuilder {
    Engine::builder(dir)
        .durability(Durability::Sync)
        .business_table(TableOptions::new("orders"))
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
}

/// An order's body: `<order id>:<amount>:<variant>`.
pub fn order_body(order_id: &str, amount: u64, variant: u32) -> String {
    format!("{order_id}:{amount}:{variant}")
}

/// The amount in an order's body.
pub fn parse_amount(body: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(body).ok()?;
    text.split(':').nth(1)?.parse().ok()
}
