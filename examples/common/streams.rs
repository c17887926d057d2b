//! What the log consumer (`stream_orders`) and its end-to-end checker (`stream_e2e`) agree on:
//! the streams, the store's layout, where the read position is kept (the three placements the
//! run compares), and the message format (the queue examples' `<order id>:<amount>:<variant>`).

// Each of the two examples uses its own part of this module.
#![allow(dead_code)]

use idemdb::{Durability, Engine, TableOptions, merge_ops};

/// Stream `p` of the run.
pub fn stream_name(stream: usize) -> String {
    format!("orders.stream.{stream}")
}

/// The consumer's name at the broker, for the broker's own offset tracking (the negative
/// controls' position).
pub const BROKER_REFERENCE: &str = "orders-consumer";

/// The consumer id in idemdb.
pub const CONSUMER_ID: &str = "orders";

/// Where a consumer keeps its read position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In idemdb, staged in the same write batch as the marker and the effects.
    Store,
    /// At the broker (`store_offset`), before the commit: a crash in between loses messages.
    BrokerBeforeCommit,
    /// At the broker, after the commit: a crash in between reads committed messages again.
    BrokerAfterCommit,
}

impl Placement {
    pub fn parse(text: &str) -> Option<Placement> {
        match text {
            "store" => Some(Placement::Store),
            "broker-before-commit" => Some(Placement::BrokerBeforeCommit),
            "broker-after-commit" => Some(Placement::BrokerAfterCommit),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Placement::Store => "store",
            Placement::BrokerBeforeCommit => "broker-before-commit",
            Placement::BrokerAfterCommit => "broker-after-commit",
        }
    }
}

/// Opens a stream's store: `orders` (order id -> body), `effects` (counters: order id -> times
/// applied, and the total amount), `conflicts` (order id and fingerprint -> the conflicting
/// body: the dead letters of a log, which has no dead-letter queue) and `reads` ((offset, pid)
/// -> outcome, one row per process whose commit settled the offset: written in the same batch
/// as the position, it tells the checker which processes committed each offset).
pub fn open_stream_store(dir: &std::path::Path) -> idemdb::Result<Engine> {
    Engine::builder(dir)
        .durability(Durability::Sync)
        .business_table(TableOptions::new("orders"))
        .business_table(
            TableOptions::new("effects").associative_merge_operator("add_u64", merge_ops::add_u64),
        )
        .business_table(TableOptions::new("conflicts"))
        .business_table(TableOptions::new("reads"))
        .open()
}

/// The `reads` key of an offset settled by process `pid`: big-endian, so the table sorts by
/// offset.
pub fn read_key(offset: u64, pid: u32) -> [u8; 12] {
    let mut key = [0u8; 12];
    key[..8].copy_from_slice(&offset.to_be_bytes());
    key[8..].copy_from_slice(&pid.to_be_bytes());
    key
}

/// The `conflicts` key of a conflicting content.
pub fn conflict_key(order_id: &str, fingerprint: &idemdb::Fingerprint) -> String {
    format!("{order_id}/{fingerprint}")
}

/// The order id in a body (`<order id>:<amount>:<variant>`).
pub fn order_id_of(body: &str) -> Option<&str> {
    body.split(':').next().filter(|id| !id.is_empty())
}
