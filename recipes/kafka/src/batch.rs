//! One partition's messages read together, claimed as one batch: fresh orders stage their
//! effects on their claims, conflicts a row of `conflicts`, every message its row of `reads`
//! (which process settled that offset, and how: the end-to-end check's evidence), and the
//! batch the partition's position at its last offset. One commit writes all of it.

use idemdb::{BatchOutcome, ClaimBatch, Engine, Fingerprint, Message, Outcome};

use crate::BoxError;
use crate::stores::Partition;
use crate::streams::{conflict_key, order_id_of, read_key};

/// The `effects` key of the running total of the amounts applied (the checkers' own
/// `orders::TOTAL_AMOUNT_KEY`).
const TOTAL_AMOUNT_KEY: &str = "total-amount";

/// One message read: its offset and body (`<order id>:<amount>:<variant>`).
pub(crate) struct Read {
    pub(crate) offset: u64,
    pub(crate) body: String,
}

/// Claims `group` (one partition's messages, in offset order) and stages its writes; nothing
/// is written until the caller commits. Commits are made one at a time, so no key of the group
/// is held by another commit.
pub(crate) fn claim(partition: &Partition, group: &[Read]) -> Result<ClaimBatch, BoxError> {
    let tables = Tables::of(&partition.engine)?;
    let pid = std::process::id();
    let mut messages = Vec::with_capacity(group.len());
    for read in group {
        let order_id = order_id_of(&read.body).ok_or("a message without an order id")?;
        messages.push(Message::new(
            order_id,
            Fingerprint::of(read.body.as_bytes()),
        ));
    }
    let mut batch = partition.consumer.begin_batch(&messages)?;
    for (index, read) in group.iter().enumerate() {
        let order_id = order_id_of(&read.body).unwrap_or_default();
        let outcome = match &batch.outcomes()[index] {
            BatchOutcome::Fresh => "fresh",
            // A copy of an earlier message of the group shares its fate.
            BatchOutcome::DuplicateInBatch { first } => match &batch.outcomes()[*first] {
                BatchOutcome::Settled(Outcome::Conflict { .. }) => "conflict",
                _ => "duplicate",
            },
            BatchOutcome::ConflictInBatch { .. } => "conflict",
            BatchOutcome::Settled(Outcome::Duplicate { .. }) => "duplicate",
            BatchOutcome::Settled(Outcome::Conflict { .. }) => "conflict",
            BatchOutcome::Settled(other) => {
                return Err(format!("offset {}: unexpected {other:?}", read.offset).into());
            }
        };
        match outcome {
            "fresh" => {
                let claim = batch
                    .claim_mut(index)
                    .ok_or("a fresh message without a claim")?;
                let amount = amount_of(&read.body);
                claim.put(&tables.orders, order_id, &read.body)?;
                claim.merge(&tables.effects, order_id, 1u64.to_be_bytes())?;
                claim.merge(&tables.effects, TOTAL_AMOUNT_KEY, amount.to_be_bytes())?;
            }
            "conflict" => {
                let key = conflict_key(order_id, &Fingerprint::of(read.body.as_bytes()));
                batch.put(&tables.conflicts, key, &read.body)?;
            }
            _ => {}
        }
        batch.put(&tables.reads, read_key(read.offset, pid), outcome)?;
    }
    Ok(batch)
}

/// The amount in a body, 0 when it has none.
fn amount_of(body: &str) -> u64 {
    body.split(':')
        .nth(1)
        .and_then(|amount| amount.parse().ok())
        .unwrap_or(0)
}

/// The business tables a group writes to.
struct Tables {
    orders: idemdb::BusinessTable,
    effects: idemdb::BusinessTable,
    conflicts: idemdb::BusinessTable,
    reads: idemdb::BusinessTable,
}

impl Tables {
    fn of(engine: &Engine) -> Result<Tables, BoxError> {
        Ok(Tables {
            orders: engine.business_table("orders")?,
            effects: engine.business_table("effects")?,
            conflicts: engine.business_table("conflicts")?,
            reads: engine.business_table("reads")?,
        })
    }
}
