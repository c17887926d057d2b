//! The workload every contender runs: the same keys, values, duplicate ratio and thread count,
//! driven for a fixed time, with per-call latencies.
//!
//! The runs beside it, each a workload of its own: `scale` (the store as it grows, and over many
//! retention periods), `tuning` (RocksDB options on idemdb's access patterns), `pg_expiry`
//! (PostgreSQL commits while expired records are removed), `pg_cost` (what the PostgreSQL
//! server spends per claim), `neighbour` (durable commits
//! while another process writes to the same file system), `profile` (one contender under a
//! profiler).

pub mod footprint;
pub mod http_peer;
pub mod http_peer_crash;
pub mod neighbour;
pub mod pg_cost;
pub mod pg_expiry;
pub mod profile;
pub mod scale;
pub mod tuning;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Bytes of a message key (`TTCCCCCCCCCCCCCC`: thread, then counter, as ASCII digits).
pub const MESSAGE_KEY_BYTES: usize = 16;
/// Bytes of the business value written for each new message.
pub const VALUE_BYTES: usize = 64;
/// The consumer id. idemdb stores `[len][consumer][key]`, 22 bytes; the peers get the same
/// 22 bytes as their dedup key (`bench:` + key).
pub const CONSUMER: &str = "bench";

/// One delivery of a message, identified by its key.
#[derive(Clone, Copy, Debug)]
pub struct Delivery {
    pub key: [u8; MESSAGE_KEY_BYTES],
}

impl Delivery {
    /// The 22-byte dedup key the peers store: `bench:` + the message key.
    pub fn peer_key(&self) -> [u8; 6 + MESSAGE_KEY_BYTES] {
        let mut out = [0u8; 6 + MESSAGE_KEY_BYTES];
        out[..6].copy_from_slice(b"bench:");
        out[6..].copy_from_slice(&self.key);
        out
    }

    /// The business value: derived from the key, so a redelivery carries the same content.
    pub fn value(&self) -> [u8; VALUE_BYTES] {
        let mut out = [b'v'; VALUE_BYTES];
        out[..MESSAGE_KEY_BYTES].copy_from_slice(&self.key);
        out
    }
}

/// Deterministic per-thread stream: new keys, with `duplicate_ratio` of deliveries re-sending
/// one of the last 1024 keys of the same thread (so a duplicate never races its original).
pub struct Generator {
    thread: usize,
    next: u64,
    rng: SplitMix64,
    recent: Vec<[u8; MESSAGE_KEY_BYTES]>,
    duplicate_per_mille: u64,
    replay: Option<u64>,
}

const RECENT_KEYS: usize = 1024;

impl Generator {
    pub fn new(thread: usize, seed: u64, duplicate_ratio: f64) -> Generator {
        assert!(thread < 100, "thread numbers are two digits");
        Generator {
            thread,
            next: 0,
            rng: SplitMix64(seed ^ (thread as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            recent: Vec::with_capacity(RECENT_KEYS),
            duplicate_per_mille: (duplicate_ratio * 1000.0).round() as u64,
            replay: None,
        }
    }

    /// Re-delivers keys `0..stored` of thread 0 (stored by [`fill`]) in a scattered order:
    /// every delivery is a duplicate.
    pub fn replaying(mut self, stored: u64) -> Generator {
        self.replay = Some(stored);
        self
    }

    pub fn next_delivery(&mut self) -> Delivery {
        if let Some(stored) = self.replay {
            return Delivery {
                key: message_key(0, self.rng.next() % stored),
            };
        }
        let roll = self.rng.next() % 1000;
        if roll < self.duplicate_per_mille && !self.recent.is_empty() {
            let pick = (self.rng.next() % self.recent.len() as u64) as usize;
            return Delivery {
                key: self.recent[pick],
            };
        }
        let key = message_key(self.thread, self.next);
        self.next += 1;
        if self.recent.len() < RECENT_KEYS {
            self.recent.push(key);
        } else {
            let slot = (self.next % RECENT_KEYS as u64) as usize;
            self.recent[slot] = key;
        }
        Delivery { key }
    }
}

fn message_key(thread: usize, counter: u64) -> [u8; MESSAGE_KEY_BYTES] {
    let mut key = [0u8; MESSAGE_KEY_BYTES];
    write_digits(&mut key, thread as u64 * 100_000_000_000_000 + counter);
    key
}

fn write_digits(out: &mut [u8; MESSAGE_KEY_BYTES], mut n: u64) {
    for byte in out.iter_mut().rev() {
        *byte = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// SplitMix64: a tiny, well-mixed generator; the workload only needs repeatable variety.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The key space of warm-up writes, apart from every producer's.
pub const WARM_UP_THREAD: usize = 99;

/// How one run drives a contender.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Concurrent producers (threads, or client connections).
    pub threads: usize,
    /// Deliveries per call (1 = one message per commit / transaction / command).
    pub batch: usize,
    /// Commands in flight per round trip (Redis pipelining); 1 elsewhere.
    pub pipeline: usize,
}

/// One thread's connection to a contender: delivers a slice of messages in one call (one
/// commit, one transaction, one pipelined round trip).
pub trait Session: Send {
    fn deliver(&mut self, deliveries: &[Delivery]) -> anyhow::Result<()>;
}

/// What one timed run measured.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub messages: u64,
    pub elapsed: Duration,
    /// Latency of every call, in nanoseconds, sorted ascending.
    pub latencies_ns: Vec<u32>,
}

impl Sample {
    pub fn per_second(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }

    /// The latency at quantile `q` (0..=1) of the calls, in microseconds.
    pub fn latency_us(&self, q: f64) -> f64 {
        quantile(&self.latencies_ns, q) / 1000.0
    }
}

/// Nanoseconds since `start`, saturated to `u32` (4.3 s: no call here lasts that long).
pub fn elapsed_ns(start: Instant) -> u32 {
    u32::try_from(start.elapsed().as_nanos()).unwrap_or(u32::MAX)
}

/// The `q` quantile of sorted values (nearest rank).
pub fn quantile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    f64::from(sorted[rank - 1])
}

/// Delivers keys `0..count` of `thread` through `session`, 256 per call: what a duplicate-path
/// run re-delivers (thread 0), or a warm-up (thread [`WARM_UP_THREAD`]).
pub fn fill(session: &mut dyn Session, thread: usize, count: u64) -> anyhow::Result<()> {
    let mut deliveries = Vec::with_capacity(256);
    for n in 0..count {
        deliveries.push(Delivery {
            key: message_key(thread, n),
        });
        if deliveries.len() == 256 || n + 1 == count {
            session.deliver(&deliveries)?;
            deliveries.clear();
        }
    }
    Ok(())
}

/// Runs `sessions` (one per thread) for `duration`, each delivering `shape.batch *
/// shape.pipeline` messages per call from its own generator (`generator(thread)`).
pub fn drive(
    sessions: Vec<Box<dyn Session>>,
    shape: Shape,
    duration: Duration,
    generator: impl Fn(usize) -> Generator,
) -> anyhow::Result<Sample> {
    let stop = Arc::new(AtomicBool::new(false));
    let per_call = shape.batch * shape.pipeline;
    let started = Instant::now();
    let handles: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(thread, mut session)| {
            let stop = stop.clone();
            let mut generator = generator(thread);
            std::thread::spawn(move || -> anyhow::Result<Sample> {
                let mut sample = Sample {
                    latencies_ns: Vec::with_capacity(1 << 16),
                    ..Sample::default()
                };
                let mut deliveries = Vec::with_capacity(per_call);
                while !stop.load(Ordering::Relaxed) {
                    deliveries.clear();
                    deliveries.extend((0..per_call).map(|_| generator.next_delivery()));
                    let call = Instant::now();
                    session.deliver(&deliveries)?;
                    sample.latencies_ns.push(elapsed_ns(call));
                    sample.messages += per_call as u64;
                }
                Ok(sample)
            })
        })
        .collect();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    let mut total = Sample::default();
    for handle in handles {
        let sample = handle
            .join()
            .map_err(|_| anyhow::anyhow!("a producer thread panicked"))??;
        total.messages += sample.messages;
        total.latencies_ns.extend(sample.latencies_ns);
    }
    // Calls in flight when the stop flag was set finished after `duration`: count the time.
    total.elapsed = started.elapsed();
    total.latencies_ns.sort_unstable();
    Ok(total)
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_follow_the_ratio_and_reuse_earlier_keys() {
        let mut generator = Generator::new(3, 1, 0.1);
        let mut seen = std::collections::HashSet::new();
        let mut duplicates = 0;
        for _ in 0..100_000 {
            let delivery = generator.next_delivery();
            assert_eq!(&delivery.key[..2], b"03");
            if !seen.insert(delivery.key) {
                duplicates += 1;
            }
        }
        assert!((9_000..11_000).contains(&duplicates), "{duplicates}");
    }

    #[test]
    fn quantiles_use_nearest_rank() {
        let sorted: Vec<u32> = (1..=100).collect();
        assert_eq!(quantile(&sorted, 0.5), 50.0);
        assert_eq!(quantile(&sorted, 0.99), 99.0);
        assert_eq!(quantile(&sorted, 1.0), 100.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    }
}
