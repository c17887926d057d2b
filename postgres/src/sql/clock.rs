//! The clocks: the database's, read with a statement, this process's, and the offset between
//! them last seen ([`ClockOffset`]).

use std::sync::atomic::{AtomicI64, Ordering};

use crate::error::Result;

/// The database's clock, in milliseconds since the Unix epoch.
pub(crate) async fn database_now_ms(client: &impl tokio_postgres::GenericClient) -> Result<u64> {
    let now_ms: i64 = client
        .query_one(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8",
            &[],
        )
        .await?
        .get(0);
    Ok(u64::try_from(now_ms).unwrap_or(0))
}

/// This process's clock, in milliseconds since the Unix epoch.
pub(crate) fn local_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// The database's clock minus this process's, in milliseconds, as last seen by a claim of the
/// store (`i64::MIN`: not seen yet).
#[derive(Debug)]
pub(crate) struct ClockOffset(AtomicI64);

impl ClockOffset {
    pub(crate) fn unknown() -> ClockOffset {
        ClockOffset(AtomicI64::new(i64::MIN))
    }

    /// Keeps the offset of a reading `db_now_ms` of the database's clock, taken just now.
    pub(crate) fn learn(&self, db_now_ms: i64) {
        let offset = db_now_ms.saturating_sub(local_now_i64());
        self.0.store(offset.max(i64::MIN + 1), Ordering::Relaxed);
    }

    /// This process's clock corrected by the last offset seen, if one was.
    pub(crate) fn estimate_ms(&self) -> Option<u64> {
        let offset = self.0.load(Ordering::Relaxed);
        (offset != i64::MIN)
            .then(|| u64::try_from(local_now_i64().saturating_add(offset)).unwrap_or(0))
    }
}

/// [`local_now_ms`] as the database's clock readings are typed.
fn local_now_i64() -> i64 {
    i64::try_from(local_now_ms()).unwrap_or(i64::MAX)
}
