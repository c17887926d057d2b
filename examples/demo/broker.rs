//! The simulated at-least-once broker: the producer's publication (every order once, some a
//! second time, shuffled), the queue of deliveries, and the redelivery of whatever is not
//! acknowledged.

use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam::channel::{Receiver, Sender, unbounded};

/// Share of orders the producer publishes twice, in percent.
const RESEND_PERCENT: u64 = 10;

/// A delivery as the broker hands it out.
#[derive(Clone, Copy)]
pub(crate) struct Delivery {
    pub(crate) order: u64,
}

/// SplitMix64: a small, seeded generator, so a run is reproducible without extra dependencies.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The producer's publication of `messages` deliveries, and how many distinct orders it holds.
pub(crate) fn publication(messages: u64) -> (Vec<Delivery>, u64) {
    // The producer's publication: every order once, and ~10% of them a second time, shuffled.
    let mut rng = Rng(42);
    let distinct = messages * 100 / (100 + RESEND_PERCENT);
    let mut published: Vec<Delivery> = (0..distinct).map(|order| Delivery { order }).collect();
    while (published.len() as u64) < messages {
        published.push(Delivery {
            order: rng.below(distinct),
        });
    }
    for i in (1..published.len()).rev() {
        published.swap(i, rng.below(i as u64 + 1) as usize);
    }
    (published, distinct)
}

/// The broker: a queue of deliveries; anything not acknowledged goes back on it.
pub(crate) struct Broker {
    queue: Sender<Delivery>,
    pub(crate) deliveries: Receiver<Delivery>,
    pub(crate) unacked: AtomicUsize,
}

impl Broker {
    /// A broker holding every delivery of `published`, none acknowledged yet.
    pub(crate) fn new(published: &[Delivery]) -> Broker {
        let (queue, deliveries) = unbounded();
        let broker = Broker {
            queue,
            deliveries,
            unacked: AtomicUsize::new(published.len()),
        };
        for delivery in published {
            broker.redeliver(*delivery);
        }
        broker
    }

    pub(crate) fn redeliver(&self, delivery: Delivery) {
        self.queue.send(delivery).expect("broker queue open");
    }
    pub(crate) fn ack(&self) {
        self.unacked.fetch_sub(1, Ordering::SeqCst);
    }
}
