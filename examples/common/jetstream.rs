//! What the NATS JetStream consumer (`nats_orders`) and its end-to-end checker (`nats_e2e`)
//! agree on: the stream, its subjects, the durable consumers' names, and the headers.

// Each side uses its own part of this module.
#![allow(dead_code)]

/// The stream holding the orders: shard `n`'s orders on subject `orders.<n>`.
pub const STREAM: &str = "ORDERS";
/// The stream holding the dead letters, on its one subject.
pub const DEAD_LETTER_STREAM: &str = "ORDERS_DEAD";
pub const DEAD_LETTER_SUBJECT: &str = "orders-dead";
/// The order id of a message (the body is `<order id>:<amount>:<variant>`).
pub const HEADER_ORDER_ID: &str = "Idemdb-Order-Id";
/// A conflict's two fingerprints, on its dead letter.
pub const HEADER_STORED_FINGERPRINT: &str = "Idemdb-Stored-Fingerprint";
pub const HEADER_RECEIVED_FINGERPRINT: &str = "Idemdb-Received-Fingerprint";

/// The subject of shard `shard`'s orders.
pub fn subject(shard: usize) -> String {
    format!("orders.{shard}")
}

/// The durable pull consumer of shard `shard`: one process and one store consume it.
pub fn consumer_name(shard: usize) -> String {
    format!("orders-{shard}")
}

/// The durable pull consumer of every shard's orders that a fleet of processes shares when
/// their claims are in PostgreSQL: each message goes to one of them.
pub const FLEET_CONSUMER: &str = "orders-fleet";
