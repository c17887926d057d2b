//! The engine's clock: injected, so TTL and expiry tests run on a mock clock instead of sleeping.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The latest clock reading at which the engine writes, in ms since the Unix epoch (2^62 ms,
/// some 146 million years). Beyond it a write returns [`crate::Error::ClockOutOfRange`]: adding
/// a retention to the clock must never saturate, or a record could be born expired. Reads work
/// at any reading.
pub const CLOCK_MS_MAX: u64 = 1 << 62;

/// A source of wall-clock time in milliseconds since the Unix epoch.
///
/// The engine reads it when it stamps a commit (`committed_at_ms`, `expires_at_ms`), when it
/// decides at read time whether a record has expired, and inside the compaction filter. It must
/// be cheap and callable from any thread, including RocksDB's background threads.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The system's real-time clock (the default).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        // A clock set before 1970 reads as 0: records then simply expire later than intended.
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only when told to. Clones share the same time.
///
/// ```
/// use idemdb::{Clock, MockClock};
/// use std::time::Duration;
/// let clock = MockClock::new(1_000);
/// clock.advance(Duration::from_secs(2));
/// assert_eq!(clock.now_ms(), 3_000);
/// ```
#[derive(Clone, Debug, Default)]
pub struct MockClock {
    now_ms: Arc<AtomicU64>,
}

impl MockClock {
    /// A clock reading `start_ms`.
    #[must_use]
    pub fn new(start_ms: u64) -> MockClock {
        MockClock {
            now_ms: Arc::new(AtomicU64::new(start_ms)),
        }
    }

    /// Moves the clock forward by `by` (saturating at `u64::MAX` ms).
    pub fn advance(&self, by: Duration) {
        let by_ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        // fetch_update never fails with a closure that always returns Some.
        let _ = self
            .now_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(by_ms))
            });
    }

    /// Sets the clock to `now_ms`, forwards or backwards.
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for MockClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}
