//! What the NATS JetStream consumers (`nats_orders`, `nats_replay`) and their end-to-end checkers
//! (`nats_e2e`, `nats_replay_e2e`) agree on: the stream, its subjects, the durable consumers'
//! names, the headers, and where the replaying consumer's negative controls keep positions.

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

/// The stream where the replaying consumer's negative controls keep their position
/// (`nats_replay --position broker-...`), outside idemdb's batch: the last message of each
/// shard's subject, one kept per subject.
pub const POSITIONS_STREAM: &str = "REPLAY_POSITIONS";
/// Its subjects: [`position_subject`] of every shard.
pub const POSITIONS_SUBJECTS: &str = "replay-positions.*";

/// The subject of shard `shard`'s position in [`POSITIONS_STREAM`].
pub fn position_subject(shard: usize) -> String {
    format!("replay-positions.{shard}")
}
