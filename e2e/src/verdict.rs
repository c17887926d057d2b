//! Every order checked against what the consumers did: applied exactly once, with content that
//! was published; every other content of a reused id dead-lettered (or recorded as a conflict)
//! with both fingerprints; nothing dead-lettered without a conflict; each store's running total
//! equal to the amounts of the orders it applied.

use std::collections::{HashMap, HashSet};

use idemdb::{Engine, Fingerprint, merge_ops};

use crate::BoxError;
use crate::amqp::DeadLetter;
use crate::orders::{TOTAL_AMOUNT_KEY, parse_amount};
use crate::plan::Plan;

/// What the check of every order against the stores found.
#[derive(Default)]
pub struct Verdict {
    pub effects_applied: u64,
    pub lost: u64,
    pub applied_twice: u64,
    pub wrong_content: u64,
    pub missing_conflicts: u64,
    pub false_conflicts: u64,
    pub conflicts_dead_lettered: u64,
    pub total_mismatches: u64,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.applied_twice == 0
            && self.wrong_content == 0
            && self.missing_conflicts == 0
            && self.false_conflicts == 0
            && self.total_mismatches == 0
    }
}

/// Checks every planned order against all `stores` (name, engine) and the dead letters (see
/// [`check_applied`]), and each store's running total against the amounts of the orders it
/// applied.
pub fn verify(
    stores: &[(String, Engine)],
    plan: &Plan,
    dead_letters: &[DeadLetter],
) -> Result<Verdict, BoxError> {
    let mut tables = Vec::new();
    for (_, engine) in stores {
        tables.push((
            engine.business_table("effects")?,
            engine.business_table("orders")?,
        ));
    }
    let mut applied: HashMap<String, Applied> = HashMap::new();
    let mut expected_totals = vec![0u64; stores.len()];
    for order_id in plan.contents.keys() {
        for (index, (effects, orders)) in tables.iter().enumerate() {
            let here = effects
                .get(order_id)?
                .and_then(|value| merge_ops::read_u64(&value))
                .unwrap_or(0);
            if here == 0 {
                continue;
            }
            let stored = orders.get(order_id)?.unwrap_or_default();
            let stored = String::from_utf8_lossy(&stored).into_owned();
            expected_totals[index] += here * parse_amount(stored.as_bytes()).unwrap_or(0);
            let entry = applied.entry(order_id.clone()).or_insert(Applied {
                times: 0,
                body: stored,
            });
            entry.times += here;
        }
    }
    let mut verdict = check_applied(plan, dead_letters, &applied);
    for (index, (effects, _)) in tables.iter().enumerate() {
        let total = effects
            .get(TOTAL_AMOUNT_KEY)?
            .and_then(|value| merge_ops::read_u64(&value))
            .unwrap_or(0);
        if total != expected_totals[index] {
            verdict.total_mismatches += 1;
            eprintln!(
                "TOTAL MISMATCH in {}: stored {total}, orders applied sum to {}",
                stores[index].0, expected_totals[index]
            );
        }
    }
    Ok(verdict)
}

/// How often an order's effect was applied, over every store, and the content it was applied
/// with (the first store's, when it was applied in several).
pub struct Applied {
    pub times: u64,
    pub body: String,
}

/// Checks every planned order against what was `applied` and the dead letters: each order
/// applied exactly once, with content that was published; every other content dead-lettered
/// with the right fingerprints; nothing dead-lettered without a conflict.
pub fn check_applied(
    plan: &Plan,
    dead_letters: &[DeadLetter],
    applied: &HashMap<String, Applied>,
) -> Verdict {
    let mut verdict = Verdict::default();
    let dead: HashSet<(&str, &str)> = dead_letters
        .iter()
        .map(|letter| (letter.order_id.as_str(), letter.received.as_str()))
        .collect();
    let mut applied_fingerprint: HashMap<&str, String> = HashMap::new();
    for (order_id, variants) in &plan.contents {
        let Some(Applied { times, body }) = applied.get(order_id).filter(|a| a.times > 0) else {
            verdict.lost += 1;
            eprintln!("LOST: {order_id}");
            continue;
        };
        verdict.effects_applied += times;
        if *times > 1 {
            verdict.applied_twice += 1;
            eprintln!("APPLIED {times} TIMES: {order_id}");
        }
        if !variants.contains(body) {
            verdict.wrong_content += 1;
            eprintln!("WRONG CONTENT: {order_id}: {body:?}");
            continue;
        }
        let winner = Fingerprint::of(body).to_string();
        // Every other content published under this id must have been dead-lettered.
        for other in variants.iter().filter(|variant| *variant != body) {
            let fingerprint = Fingerprint::of(other).to_string();
            if !dead.contains(&(order_id.as_str(), fingerprint.as_str())) {
                verdict.missing_conflicts += 1;
                eprintln!("CONFLICT NOT DEAD-LETTERED: {order_id}: {other:?}");
            }
        }
        applied_fingerprint.insert(order_id, winner);
    }
    let mut distinct_conflicts = HashSet::new();
    for letter in dead_letters {
        let winner = applied_fingerprint.get(letter.order_id.as_str());
        let genuine = winner.is_some_and(|winner| {
            *winner != letter.received && letter.stored.as_deref() == Some(winner.as_str())
        });
        if genuine {
            distinct_conflicts.insert((letter.order_id.as_str(), letter.received.as_str()));
        } else {
            verdict.false_conflicts += 1;
            eprintln!(
                "DEAD-LETTERED WITHOUT A CONFLICT: {} received {} stored {:?}",
                letter.order_id, letter.received, letter.stored
            );
        }
    }
    verdict.conflicts_dead_lettered = distinct_conflicts.len() as u64;
    verdict
}
