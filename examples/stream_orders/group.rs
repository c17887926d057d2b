//! One group of messages read together, claimed as one batch: fresh orders stage their
//! effects on their claims, conflicts a row of `conflicts`, and every message its row of
//! `reads`. The caller stages the position and commits (through a pipeline: the next group is
//! claimed while this one's commit is made durable).

use idemdb::{BatchOutcome, ClaimBatch, Consumer, Engine, Fingerprint, Message, Outcome};

use crate::orders::BoxError;
use crate::orders::{TOTAL_AMOUNT_KEY, parse_amount};
use crate::streams::{conflict_key, order_id_of, read_key};

/// One message read: its offset and body.
pub(crate) struct Read {
    pub(crate) offset: u64,
    pub(crate) body: String,
}

/// The business tables a group writes to.
pub(crate) struct Tables {
    pub(crate) orders: idemdb::BusinessTable,
    pub(crate) effects: idemdb::BusinessTable,
    pub(crate) conflicts: idemdb::BusinessTable,
    pub(crate) reads: idemdb::BusinessTable,
}

impl Tables {
    pub(crate) fn of(engine: &Engine) -> Result<Tables, BoxError> {
        Ok(Tables {
            orders: engine.business_table("orders")?,
            effects: engine.business_table("effects")?,
            conflicts: engine.business_table("conflicts")?,
            reads: engine.business_table("reads")?,
        })
    }
}

/// Claims `group` as one batch and stages its writes; nothing is written until the batch
/// commits. `None` when a message of the group is held by a commit still in flight (a resend
/// of an order in an earlier group): the caller waits for its commits and claims again.
pub(crate) fn claim_group(
    consumer: &Consumer,
    tables: &Tables,
    group: &[Read],
) -> Result<Option<ClaimBatch>, BoxError> {
    let pid = std::process::id();
    let mut messages = Vec::with_capacity(group.len());
    for read in group {
        let order_id = order_id_of(&read.body).ok_or("a message without an order id")?;
        messages.push(Message::new(
            order_id,
            Fingerprint::of(read.body.as_bytes()),
        ));
    }
    let mut batch = consumer.begin_batch(&messages)?;
    for (index, read) in group.iter().enumerate() {
        let order_id = order_id_of(&read.body).unwrap_or_default();
        let outcome = match &batch.outcomes()[index] {
            BatchOutcome::Fresh => "fresh",
            // A copy of an earlier message of the group shares its fate: a copy of one
            // that conflicts with the stored record conflicts too, as it would in a later
            // group.
            BatchOutcome::DuplicateInBatch { first } => match &batch.outcomes()[*first] {
                BatchOutcome::Settled(Outcome::Conflict { .. }) => "conflict",
                _ => "duplicate",
            },
            BatchOutcome::ConflictInBatch { .. } => "conflict",
            BatchOutcome::Settled(Outcome::Duplicate { .. }) => "duplicate",
            BatchOutcome::Settled(Outcome::Conflict { .. }) => "conflict",
            BatchOutcome::Settled(Outcome::InProgress { .. }) => return Ok(None),
            // One process reads the stream.
            BatchOutcome::Settled(other) => {
                return Err(format!("offset {}: unexpected {other:?}", read.offset).into());
            }
        };
        match outcome {
            "fresh" => {
                let claim = batch
                    .claim_mut(index)
                    .ok_or("a fresh message without a claim")?;
                let amount = parse_amount(read.body.as_bytes()).unwrap_or(0);
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
    Ok(Some(batch))
}
