//! The orders a run publishes, reproducible from `--seed`: every order once, some resent by the
//! producer with the same content, some ids reused with other content (each a conflict for
//! whichever content comes second), shuffled together.

use std::collections::BTreeMap;

use crate::orders::order_body;

/// A small deterministic generator (splitmix64): the run is reproducible from `--seed`.
pub struct Rng(pub u64);

impl Rng {
    /// The next draw.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A draw in `0..bound` (0 when `bound` is 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound.max(1)
    }
}

/// One message the producer publishes.
#[derive(Clone)]
pub struct Publish {
    pub order_id: String,
    pub body: String,
}

/// What the producer meant to publish, per order id: the contents (variant 0 first).
pub struct Plan {
    pub messages: Vec<Publish>,
    pub contents: BTreeMap<String, Vec<String>>,
}

/// `orders` distinct orders; `resend_percent` of them published twice with the same content;
/// the first `reused` of them published once more with other content.
pub fn plan(orders: usize, resend_percent: u64, reused: usize, rng: &mut Rng) -> Plan {
    let mut messages = Vec::new();
    let mut contents = BTreeMap::new();
    for n in 0..orders {
        let order_id = format!("order-{n:07}");
        let amount = 1 + rng.below(1000);
        let body = order_body(&order_id, amount, 0);
        let mut variants = vec![body.clone()];
        messages.push(Publish {
            order_id: order_id.clone(),
            body: body.clone(),
        });
        if rng.below(100) < resend_percent {
            // A producer-side resend: same order, same content (a retried publish).
            messages.push(Publish {
                order_id: order_id.clone(),
                body,
            });
        }
        if n < reused {
            // The same order id reused for other content: a conflict for whichever comes second.
            let other = order_body(&order_id, amount + 1, 1);
            variants.push(other.clone());
            messages.push(Publish {
                order_id: order_id.clone(),
                body: other,
            });
        }
        contents.insert(order_id, variants);
    }
    // Fisher-Yates: resends and reuses land anywhere in the stream, before or after the first.
    for i in (1..messages.len()).rev() {
        let j = usize::try_from(rng.below(i as u64 + 1)).expect("index fits");
        messages.swap(i, j);
    }
    Plan { messages, contents }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_plan_with_every_order_its_resends_and_its_reused_ids() {
        let draw = |seed| plan(500, 20, 10, &mut Rng(seed));
        let (one, again, other) = (draw(7), draw(7), draw(8));
        let bodies = |plan: &Plan| {
            plan.messages
                .iter()
                .map(|m| m.body.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(bodies(&one), bodies(&again));
        assert_ne!(bodies(&one), bodies(&other));
        assert_eq!(one.contents.len(), 500);
        let reused = one
            .contents
            .values()
            .filter(|variants| variants.len() == 2)
            .count();
        assert_eq!(reused, 10);
        // Every order once, plus its resend (about a fifth) and its other content (ten).
        let extra = one.messages.len() - 500 - 10;
        assert!((50..=150).contains(&extra), "{extra} resends");
    }
}
