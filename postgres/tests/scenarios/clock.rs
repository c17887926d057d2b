//! An injected clock is read once per call: every call that claims, decides or writes (the
//! claims, `apply` both ways, batches, external claims, their lease steps, resolutions, the
//! commits, a position moved on its own, removal) takes all of its times from one reading,
//! refused past `CLOCK_MS_MAX` before anything is sent. The clock here moves on every read:
//! its first reading is before a record's expiry and within the limits, every later one past
//! `CLOCK_MS_MAX`, so a call that read it twice would decide, or write, on a reading it never
//! checked.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemdb::format::RecordState;
use idemdb::{Clock, Fingerprint, Message, Outcome};
use idemdb_postgres::{Error, PgBatchOutcome, PgConsumer, PgResolution, PgStore};
use tokio_postgres::Client;

use super::{Failure, connect, fresh_schema};

/// Past the limit: a reading no call may decide or write on.
const PAST_LIMIT: u64 = idemdb::CLOCK_MS_MAX + 1;
/// The scenario's start (2001), and the retention of its records.
const START_MS: u64 = 1_000_000_000_000;
const RETENTION_MS: u64 = 3_600_000;
/// A reading within the limits and before the records committed at `START_MS` expire.
const LATER_MS: u64 = START_MS + 1_000;
const LEASE: Duration = Duration::from_secs(600);

/// A clock that answers its scripted readings in order, one per read, then the last one for
/// good; it counts its reads.
#[derive(Clone, Debug, Default)]
struct MovingClock(Arc<Mutex<Script>>);

#[derive(Debug, Default)]
struct Script {
    readings: VecDeque<u64>,
    last: u64,
    reads: u64,
}

impl MovingClock {
    /// The next reads answer `readings`, in order, then the last of them; the count starts
    /// again.
    fn script(&self, readings: &[u64]) {
        let mut script = self.0.lock().expect("clock");
        script.readings = readings.iter().copied().collect();
        script.last = readings.last().copied().unwrap_or(script.last);
        script.reads = 0;
    }

    /// Moves on every read: `LATER_MS` first, past the limit from the second read on.
    fn moving(&self) {
        self.script(&[LATER_MS, PAST_LIMIT]);
    }

    fn reads(&self) -> u64 {
        self.0.lock().expect("clock").reads
    }
}

impl Clock for MovingClock {
    fn now_ms(&self) -> u64 {
        let mut script = self.0.lock().expect("clock");
        script.reads += 1;
        let last = script.last;
        script.readings.pop_front().unwrap_or(last)
    }
}

fn out_of_range<T: std::fmt::Debug>(result: &Result<T, Error>) -> bool {
    matches!(
        result,
        Err(Error::Idemdb(idemdb::Error::ClockOutOfRange { now_ms })) if *now_ms == PAST_LIMIT
    )
}

/// The commit time of `key`'s completed record.
async fn committed_at(consumer: &PgConsumer, client: &Client, key: &str) -> Result<u64, Failure> {
    match consumer.get(client, key).await?.map(|record| record.state) {
        Some(RecordState::Completed {
            committed_at_ms, ..
        }) => Ok(committed_at_ms),
        other => Err(format!("{key}: {other:?}").into()),
    }
}

/// The release time of `key`'s released record.
async fn released_at(consumer: &PgConsumer, client: &Client, key: &str) -> Result<u64, Failure> {
    match consumer.get(client, key).await?.map(|record| record.state) {
        Some(RecordState::Released { released_at_ms, .. }) => Ok(released_at_ms),
        other => Err(format!("{key}: {other:?}").into()),
    }
}

pub async fn every_call_reads_an_injected_clock_once(url: &str) -> Result<(), Failure> {
    let schema = "t_clock_once";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let clock = MovingClock::default();
    let store = PgStore::builder()
        .names(names)
        .retention(Duration::from_millis(RETENTION_MS))
        .clock(clock.clone())
        .open(&client)
        .await?;
    let c = store.consumer("c")?;
    let body = Fingerprint::of(b"m");
    // A live record, committed at the start: at `LATER_MS` it is a duplicate; at any reading
    // past the limit it has expired and would be taken again.
    clock.script(&[START_MS]);
    match c.begin(&mut client, "live", body).await? {
        Outcome::Fresh(claim) => claim.commit(b"done").await?,
        other => return Err(format!("live: {other:?}").into()),
    }
    // Each call below finds the clock moving, and must read it exactly once.
    let once = |call: &str| -> Result<(), Failure> {
        ensure!(
            clock.reads() == 1,
            "{call} read the clock {} times",
            clock.reads()
        );
        Ok(())
    };

    // Claims decide at their one reading: the live record is a duplicate.
    clock.moving();
    let begun = c.begin(&mut client, "live", body).await?;
    ensure!(
        matches!(begun, Outcome::Duplicate { .. }),
        "begin: {begun:?}"
    );
    drop(begun);
    once("begin")?;
    clock.moving();
    let begun = c
        .begin_message(&mut client, &Message::new("live", body))
        .await?;
    ensure!(
        matches!(begun, Outcome::Duplicate { .. }),
        "begin_message: {begun:?}"
    );
    drop(begun);
    once("begin_message")?;
    clock.moving();
    let owned = Box::new(connect(url).await?);
    let begun = c.begin_owned(owned, &Message::new("live", body)).await?;
    ensure!(
        matches!(begun, Outcome::Duplicate { .. }),
        "begin_owned: {begun:?}"
    );
    drop(begun);
    once("begin_owned")?;

    // `apply`: a duplicate decided after its failed insert, at the same reading; a new key in
    // one round trip; the long way (an entity's version), claim and commit at one reading.
    clock.moving();
    let applied = c
        .apply(&mut client, &Message::new("live", body), b"r", &[])
        .await;
    ensure!(
        matches!(applied, Ok(Outcome::Duplicate { .. })),
        "apply of the live key: {applied:?}"
    );
    once("apply of a duplicate")?;
    clock.moving();
    let applied = c
        .apply(&mut client, &Message::new("apply-new", body), b"r", &[])
        .await?;
    ensure!(
        matches!(applied, Outcome::Fresh(applied) if applied.one_round_trip),
        "apply of a new key: {applied:?}"
    );
    once("apply of a new key")?;
    ensure!(
        committed_at(&c, &client, "apply-new").await? == LATER_MS,
        "apply's one round trip committed at another reading"
    );
    clock.moving();
    let long_way = Message::new("apply-long", body).version("entity", 1);
    let applied = c.apply(&mut client, &long_way, b"r", &[]).await?;
    ensure!(
        matches!(applied, Outcome::Fresh(applied) if !applied.one_round_trip),
        "apply the long way: {applied:?}"
    );
    once("apply the long way")?;
    ensure!(
        committed_at(&c, &client, "apply-long").await? == LATER_MS,
        "apply's long way committed at another reading"
    );
    // A reading past the limit is refused before anything is written, on both ways.
    clock.script(&[PAST_LIMIT]);
    let refused = c
        .apply(&mut client, &Message::new("apply-far", body), b"r", &[])
        .await;
    ensure!(out_of_range(&refused), "apply past the limit: {refused:?}");
    ensure!(
        c.get(&client, "apply-far").await?.is_none(),
        "apply past the limit wrote its record"
    );

    // Batches: decided at one reading; their commit reads its own, once.
    clock.moving();
    let batch = c
        .begin_batch(&mut client, &[("live", body), ("batch-new", body)])
        .await?;
    ensure!(
        matches!(
            batch.outcome(0),
            Some(PgBatchOutcome::Settled(Outcome::Duplicate { .. }))
        ) && batch.epoch(1) == Some(1),
        "begin_batch: {:?}",
        batch.outcomes()
    );
    once("begin_batch")?;
    clock.moving();
    batch.commit(|_| b"r").await?;
    once("a batch's commit")?;
    ensure!(
        committed_at(&c, &client, "batch-new").await? == LATER_MS,
        "the batch committed at another reading"
    );
    clock.moving();
    let batch = c
        .begin_batch_messages(&mut client, &[Message::new("live", body)])
        .await?;
    ensure!(
        matches!(
            batch.outcome(0),
            Some(PgBatchOutcome::Settled(Outcome::Duplicate { .. }))
        ),
        "begin_batch_messages: {:?}",
        batch.outcomes()
    );
    once("begin_batch_messages")?;
    drop(batch);

    // A claim's commit reads the clock once, and refuses a reading past the limit.
    clock.script(&[LATER_MS]);
    let Outcome::Fresh(claim) = c.begin(&mut client, "commit-far", body).await? else {
        return Err("commit-far: not fresh".into());
    };
    let mut other = connect(url).await?;
    clock.moving();
    let Outcome::Fresh(kept) = c.begin(&mut other, "commit-once", body).await? else {
        return Err("commit-once: not fresh".into());
    };
    clock.moving();
    kept.commit(b"r").await?;
    once("a claim's commit")?;
    clock.script(&[PAST_LIMIT]);
    let refused = claim.commit(b"r").await;
    ensure!(out_of_range(&refused), "commit past the limit: {refused:?}");
    ensure!(
        c.get(&client, "commit-far").await?.is_none(),
        "a commit past the limit wrote its record"
    );

    // External claims: decided at one reading (the live record is a duplicate), and every
    // lease step and resolution writes the time of its one reading.
    clock.moving();
    let begun = c
        .begin_external(&mut client, "live", body, LEASE, "h")
        .await?;
    ensure!(
        matches!(begun, Outcome::Duplicate { .. }),
        "begin_external: {begun:?}"
    );
    once("begin_external")?;
    let external = async |client: &mut Client, key: &str| {
        clock.script(&[START_MS]);
        match c.begin_external(client, key, body, LEASE, "h").await? {
            Outcome::Fresh(claim) => Ok::<_, Failure>(claim),
            other => Err(format!("{key}: {other:?}").into()),
        }
    };
    let mut renewed = external(&mut client, "renewed").await?;
    clock.moving();
    let until = renewed.renew(&mut client, LEASE).await?;
    once("renew")?;
    ensure!(
        until == LATER_MS + LEASE.as_millis() as u64,
        "renewed until {until}"
    );
    clock.moving();
    renewed.release(&mut client).await?;
    once("release")?;
    ensure!(
        released_at(&c, &client, "renewed").await? == LATER_MS,
        "released at another reading"
    );
    let failed = external(&mut client, "failed").await?;
    clock.moving();
    failed.fail_permanently(&mut client, b"declined").await?;
    once("fail_permanently")?;
    ensure!(
        committed_at(&c, &client, "failed").await? == LATER_MS,
        "the failure recorded at another reading"
    );
    let completed = external(&mut client, "completed").await?;
    clock.moving();
    let completion = completed.completion(&mut client).await?;
    once("completion")?;
    clock.moving();
    completion.commit(b"r").await?;
    once("a completion's commit")?;
    ensure!(
        committed_at(&c, &client, "completed").await? == LATER_MS,
        "the completion committed at another reading"
    );
    let far = external(&mut client, "completed-far").await?;
    clock.script(&[LATER_MS]);
    let completion = far.completion(&mut client).await?;
    clock.script(&[PAST_LIMIT]);
    let refused = completion.commit(b"r").await;
    ensure!(
        out_of_range(&refused),
        "a completion's commit past the limit: {refused:?}"
    );
    drop(external(&mut client, "resolved").await?);
    clock.moving();
    c.resolve(
        &mut client,
        "resolved",
        PgResolution::Complete(bytes::Bytes::from_static(b"by hand")),
    )
    .await?;
    once("resolve (complete)")?;
    ensure!(
        committed_at(&c, &client, "resolved").await? == LATER_MS,
        "resolved at another reading"
    );
    drop(external(&mut client, "released-by-hand").await?);
    clock.moving();
    c.resolve(&mut client, "released-by-hand", PgResolution::Release)
        .await?;
    once("resolve (release)")?;
    ensure!(
        released_at(&c, &client, "released-by-hand").await? == LATER_MS,
        "released by hand at another reading"
    );

    // A position moved on its own, and removal.
    clock.moving();
    c.positions().advance(&client, "orders", 0, 1).await?;
    once("positions().advance")?;
    let position = c.positions().get(&client, "orders", 0).await?;
    ensure!(
        position.as_ref().map(|p| p.updated_at_ms) == Some(LATER_MS),
        "{position:?}"
    );
    clock.script(&[PAST_LIMIT]);
    let refused = c.positions().advance(&client, "orders", 0, 2).await;
    ensure!(
        out_of_range(&refused),
        "advance past the limit: {refused:?}"
    );
    clock.moving();
    store.maintain(&client).await?;
    once("maintain")?;
    Ok(())
}
