//! The claim latch: which keys of one marker table a live [`crate::Claim`] holds in this process.
//!
//! Taking a latch is an atomic insert-if-absent into a mutex-guarded set, so of any number of
//! concurrent `begin` calls for one key exactly one takes it. The winner reads the stored record
//! and writes its commit while holding the latch; RocksDB's LOCK file keeps every other process
//! out of the store. Together they leave no unguarded window between the read and the write.
//!
//! A claimant may also read first and latch after ([`Latches::look`], then
//! [`Latches::try_acquire_after`]): every write of a record is made under its key's latch, and
//! each shard counts the latches released in it, so a claimant that finds the count unchanged
//! when it takes the latch knows that no record of the shard was written since it read.

use std::collections::HashMap;
use std::collections::hash_map::{Entry, RandomState};
use std::hash::{BuildHasher, Hasher};

#[cfg(not(loom))]
use crossbeam::utils::CachePadded;
#[cfg(loom)]
use loom::sync::Mutex;
#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use parking_lot::Mutex;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

/// Under loom the shard is loom's mutex, unpadded (loom models the lock, not cache lines).
#[cfg(loom)]
type CachePadded<T> = T;

/// Locks a shard. parking_lot's lock does not poison; loom's (std-like) does, and a poisoned
/// shard can only come from a panic inside the few lines below, which the model would report.
fn lock<T>(mutex: &Mutex<T>) -> impl std::ops::DerefMut<Target = T> + '_ {
    #[cfg(loom)]
    return mutex.lock().expect("latch shard poisoned");
    #[cfg(not(loom))]
    return mutex.lock();
}

/// Shards spread unrelated keys over separate mutexes so that claims on different keys rarely
/// contend. A power of two, so the shard is a mask of the hash.
const SHARDS: usize = 64;

/// One shard: latched keys with the time each claim was taken. Padded to a cache line so that
/// threads locking neighbouring shards do not contend on one line. Hashed with seeded xxh3
/// ([`KeyHashBuilder`]), not std's SipHash: a latch is taken and released on every claim, and
/// the seed (random per table) keeps message keys chosen by a producer from piling into one
/// bucket.
type Shard = CachePadded<ShardState>;

/// A shard's latched keys, with the time each was taken, and how many latches were released in
/// it: the count changes after every write of a record of the shard (each is made under its
/// key's latch), which is what [`Latches::try_acquire_after`] compares.
struct ShardState {
    held: Mutex<HashMap<LatchKey, u64, KeyHashBuilder>>,
    releases: AtomicU64,
}

/// Where a claimant looked before reading a record without the latch ([`Latches::look`]): the
/// key's shard and its count of releases then.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Look {
    shard: usize,
    releases: u64,
}

/// A latch's copy of its key: inline up to 48 bytes (the claim's own copy keeps as many inline,
/// `crate::format::key::StoredKey`), so taking a latch on a common key does not allocate.
type LatchKey = smallvec::SmallVec<[u8; 48]>;

/// Builds [`KeyHasher`]s: seeded one-shot xxh3 of a whole key.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyHashBuilder {
    seed: u64,
}

impl KeyHashBuilder {
    pub(crate) fn new(seed: u64) -> KeyHashBuilder {
        KeyHashBuilder { seed }
    }
}

impl BuildHasher for KeyHashBuilder {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            seed: self.seed,
            hash: 0,
        }
    }
}

/// Hashes a byte-string key with one call of seeded one-shot xxh3. `xxhash_rust`'s streaming
/// `Xxh3Builder` sets up several hundred bytes of state (and, with a seed, derives a secret)
/// for every hash: a callgrind profile of the batch path counted ~900 instructions per claim in
/// it. A key is always hashed whole, so the streaming state buys nothing.
pub(crate) struct KeyHasher {
    seed: u64,
    hash: u64,
}

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.hash = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.seed ^ self.hash);
    }

    /// The length prefix `[u8]`'s `Hash` writes first: mixed into the seed of the one hash of
    /// the bytes that follows, rather than hashed on its own.
    fn write_usize(&mut self, length: usize) {
        self.hash ^= (length as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.hash
    }
}

#[cfg(not(loom))]
fn pad<T>(value: T) -> CachePadded<T> {
    CachePadded::new(value)
}

#[cfg(loom)]
fn pad<T>(value: T) -> T {
    value
}

/// The latched keys of one marker table.
pub(crate) struct Latches {
    shards: Box<[Shard]>,
    seed: u64,
}

impl Latches {
    pub(crate) fn new() -> Latches {
        let seed = RandomState::new().hash_one(0x1de3_u64);
        Latches {
            shards: (0..SHARDS)
                .map(|_| {
                    pad(ShardState {
                        held: Mutex::new(HashMap::with_hasher(KeyHashBuilder::new(seed))),
                        releases: AtomicU64::new(0),
                    })
                })
                .collect(),
            seed,
        }
    }

    /// A hasher of keys seeded like this table's latches (random per table).
    pub(crate) fn hash_builder(&self) -> KeyHashBuilder {
        KeyHashBuilder::new(self.seed)
    }

    fn shard_index(&self, key: &[u8]) -> usize {
        let hash = xxhash_rust::xxh3::xxh3_64_with_seed(key, self.seed);
        // The top bits pick the shard: the map inside hashes the same way and places entries by
        // the low bits, which would otherwise be equal for every key of a shard.
        (hash >> (64 - SHARDS.trailing_zeros())) as usize
    }

    fn shard(&self, key: &[u8]) -> &Shard {
        &self.shards[self.shard_index(key)]
    }

    /// Takes the latch on `key`, or returns when the current holder took it.
    pub(crate) fn try_acquire(&self, key: &[u8], now_ms: u64) -> Result<(), u64> {
        self.try_acquire_after(key, now_ms, self.look(key))
            .map(drop)
    }

    /// Looks at `key`'s shard before a read of its record made without the latch: pass the
    /// answer to [`Latches::try_acquire_after`].
    pub(crate) fn look(&self, key: &[u8]) -> Look {
        let shard = self.shard_index(key);
        Look {
            shard,
            // Acquire: a release counted here was made after its write, which the read that
            // follows then sees.
            releases: self.shards[shard].releases.load(Ordering::Acquire),
        }
    }

    /// Takes the latch on `key` as [`Latches::try_acquire`] does, after a read of its record
    /// made since `look`: `Ok(true)` when no latch of the shard was released since, so that no
    /// record of it was written since the read (which then stands), `Ok(false)` when one was.
    pub(crate) fn try_acquire_after(
        &self,
        key: &[u8],
        now_ms: u64,
        look: Look,
    ) -> Result<bool, u64> {
        let shard = &self.shards[look.shard];
        let mut held = lock(&shard.held);
        match held.entry(LatchKey::from_slice(key)) {
            Entry::Occupied(held) => Err(*held.get()),
            Entry::Vacant(slot) => {
                slot.insert(now_ms);
                // Under the shard's lock, as every release counts: this is the count now.
                Ok(shard.releases.load(Ordering::Relaxed) == look.releases)
            }
        }
    }

    /// Takes the latch on `key` as a guard that releases it on drop, or returns when the
    /// current holder took it.
    pub(crate) fn try_guard<'a>(
        &'a self,
        key: &'a [u8],
        now_ms: u64,
    ) -> Result<LatchGuard<'a>, u64> {
        self.try_acquire(key, now_ms)?;
        Ok(LatchGuard { latches: self, key })
    }

    /// Takes the latch on `key`, waiting up to `wait` (real time) for the current holder to
    /// release it; `None` if it did not. Latches are held for a read and a write, except by a
    /// transactional claim, which holds its key until it commits or drops: an unbounded wait
    /// could deadlock a thread that holds such a claim itself. Waiting backs off from yielding
    /// to sleeps of up to 1 ms.
    pub(crate) fn acquire_waiting<'a>(
        &'a self,
        key: &'a [u8],
        now_ms: u64,
        wait: std::time::Duration,
    ) -> Option<LatchGuard<'a>> {
        let deadline = std::time::Instant::now() + wait;
        let mut attempt = 0u32;
        while self.try_acquire(key, now_ms).is_err() {
            if std::time::Instant::now() >= deadline {
                return None;
            }
            attempt = attempt.saturating_add(1);
            if attempt < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(u64::from(
                    attempt.min(1_000),
                )));
            }
        }
        Some(LatchGuard { latches: self, key })
    }

    /// Releases the latch on `key`. The caller must hold it.
    pub(crate) fn release(&self, key: &[u8]) {
        let shard = self.shard(key);
        let mut held = lock(&shard.held);
        let removed = held.remove(key);
        // Release: a claimant that looks and sees this count sees the holder's write too.
        shard.releases.fetch_add(1, Ordering::Release);
        drop(held);
        assert!(removed.is_some(), "released a latch that was not held");
    }

    /// How many keys are latched right now.
    pub(crate) fn held(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| lock(&shard.held).len())
            .sum()
    }
}

/// A latch taken by [`Latches::acquire_waiting`], released on drop.
pub(crate) struct LatchGuard<'a> {
    latches: &'a Latches,
    key: &'a [u8],
}

impl Drop for LatchGuard<'_> {
    fn drop(&mut self) {
        self.latches.release(self.key);
    }
}

/// Exhaustive interleavings (loom, within its bounds) of the claim arbitration: of three
/// threads racing for one key exactly one wins, and the key never has two holders while threads
/// acquire and release it. The `loom/` crate compiles this file under loom:
/// `cd loom && RUSTFLAGS="--cfg loom" cargo test --release`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicUsize;

    #[test]
    fn loom_exactly_one_of_three_wins() {
        loom::model(|| {
            let latches = Arc::new(Latches::new());
            let wins = Arc::new(AtomicUsize::new(0));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let (latches, wins) = (latches.clone(), wins.clone());
                    loom::thread::spawn(move || {
                        if latches.try_acquire(b"key", 0).is_ok() {
                            wins.fetch_add(1, Ordering::SeqCst);
                        }
                    })
                })
                .collect();
            if latches.try_acquire(b"key", 0).is_ok() {
                wins.fetch_add(1, Ordering::SeqCst);
            }
            for thread in threads {
                thread.join().unwrap();
            }
            assert_eq!(wins.load(Ordering::SeqCst), 1);
        });
    }

    /// A claimant that reads a record before taking its latch keeps that read only if no
    /// write could have come between: a write made under the latch and released before the
    /// claimant took it is always seen (RocksDB's write and read are modelled as a release
    /// store and an acquire load of the record).
    #[test]
    fn loom_a_read_before_the_latch_stands_only_if_nothing_was_written_since() {
        loom::model(|| {
            let latches = Arc::new(Latches::new());
            let record = Arc::new(loom::sync::atomic::AtomicU64::new(0));
            let writer = {
                let (latches, record) = (latches.clone(), record.clone());
                loom::thread::spawn(move || {
                    if latches.try_acquire(b"key", 0).is_ok() {
                        record.store(1, Ordering::Release);
                        latches.release(b"key");
                    }
                })
            };
            let look = latches.look(b"key");
            let read = record.load(Ordering::Acquire);
            if let Ok(unchanged) = latches.try_acquire_after(b"key", 0, look) {
                if unchanged {
                    assert_eq!(read, record.load(Ordering::Acquire), "a stale read stood");
                }
                latches.release(b"key");
            }
            writer.join().unwrap();
        });
    }

    #[test]
    fn loom_never_two_holders_across_release() {
        loom::model(|| {
            let latches = Arc::new(Latches::new());
            let holders = Arc::new(AtomicUsize::new(0));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let (latches, holders) = (latches.clone(), holders.clone());
                    loom::thread::spawn(move || {
                        if latches.try_acquire(b"key", 0).is_ok() {
                            assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                            holders.fetch_sub(1, Ordering::SeqCst);
                            latches.release(b"key");
                        }
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
            assert_eq!(latches.held(), 0);
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn second_acquire_sees_the_first() {
        let latches = Latches::new();
        assert_eq!(latches.try_acquire(b"k", 5), Ok(()));
        assert_eq!(latches.try_acquire(b"k", 9), Err(5));
        latches.release(b"k");
        assert_eq!(latches.try_acquire(b"k", 9), Ok(()));
        assert_eq!(latches.held(), 1);
    }

    #[test]
    fn exactly_one_thread_wins_each_round() {
        let latches = Arc::new(Latches::new());
        let wins = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (latches, wins) = (latches.clone(), wins.clone());
                std::thread::spawn(move || {
                    for round in 0u32..2000 {
                        if latches.try_acquire(&round.to_be_bytes(), 0).is_ok() {
                            wins.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        // Nobody releases, so each of the 2000 keys was won exactly once.
        assert_eq!(wins.load(Ordering::SeqCst), 2000);
    }
}
