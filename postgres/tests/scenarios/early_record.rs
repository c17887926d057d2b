//! A new key's record goes with its claim (schema 10), checked from the documentation
//! (docs/design.md, section 13, "A new key's record goes with the claim"; `PgClaim::commit`;
//! "Upgrading an older install" in the crate's documentation): the claim's transaction reads
//! the record completed before the commit and no other session does; another claimant of the
//! key, by `begin`, `apply` or a batch, is in progress at once and never waits; whatever makes
//! the commit fail (the caller's SQL, a refusal before anything is sent, a read position
//! behind) takes the record away with the rest; a record that stood keeps the claim's time and
//! expires a retention after it, one rewritten (a result, a commit more than a second later, a
//! key that had a row, an entity version) the commit's; a claim whose estimate of the
//! database's clock is off by more than a second inserts nothing; and a version 9 install is
//! taken over by `install`, after which an earlier release's claim call fails.

use std::time::Duration;

use idemdb::format::{Record, RecordState};
use idemdb::{Clock as _, Fingerprint, Message, MockClock, Outcome};
use idemdb_postgres::{
    Error, PgBatchOutcome, PgConsumer, PgStore, SCHEMA_VERSION, TypedStatement, install,
};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::{
    CLOCK_SLACK_MS, Failure, VERSION_9_CLAIM_FUNCTION, connect, db_clock_ms, fresh_schema,
    messages, mock_store, older_schema, order_rows, postgres_error,
};

/// The scenarios' injected clock starts here (2001).
const START_MS: u64 = 1_000_000_000_000;
/// `mock_store`'s retention: an hour.
const RETENTION_MS: u64 = 3_600_000;
/// A bound on calls that must answer without waiting, only so that a regression fails instead
/// of hanging.
const WITHIN: Duration = Duration::from_secs(30);

/// A completed (and succeeded) record as these scenarios compare it.
#[derive(Debug, PartialEq, Eq)]
struct Completed {
    epoch: u64,
    fingerprint: Fingerprint,
    committed_at_ms: u64,
    expires_at_ms: u64,
    result: Vec<u8>,
}

/// `record` as compared here; `None` for no record or a record in another state.
fn completed(record: Option<Record>) -> Option<Completed> {
    let record = record?;
    let (epoch, fingerprint) = (record.epoch, record.fingerprint);
    match record.state {
        RecordState::Completed {
            committed_at_ms,
            expires_at_ms,
            result,
            succeeded: true,
            ..
        } => Some(Completed {
            epoch,
            fingerprint,
            committed_at_ms,
            expires_at_ms,
            result: result.to_vec(),
        }),
        _ => None,
    }
}

/// A fresh `schema` with a store on a mock clock at [`START_MS`], and its consumer `c`.
async fn fresh_store(
    client: &mut Client,
    schema: &str,
) -> Result<(MockClock, PgStore, idemdb_postgres::PgConsumer), Failure> {
    let names = fresh_schema(client, schema).await?;
    let clock = MockClock::new(START_MS);
    let store = mock_store(client, names, &clock, false).await?;
    let consumer = store.consumer("c")?;
    Ok((clock, store, consumer))
}

/// The caller's SQL of a commit whose record may stand: the record the claim inserted stands
/// only behind a statement of the commit's own, whose answer says the transaction stands.
const BUSINESS_SQL: &str = "SELECT 1";

/// The completed record a commit at `committed_at_ms` writes for `key` at `epoch`, with
/// `mock_store`'s retention.
fn expected(epoch: u64, key: &str, committed_at_ms: u64, result: &[u8]) -> Completed {
    Completed {
        epoch,
        fingerprint: Fingerprint::of(key.as_bytes()),
        committed_at_ms,
        expires_at_ms: committed_at_ms + RETENTION_MS,
        result: result.to_vec(),
    }
}

/// The rows of `consumer`'s `key` in `schema.records`, as another session sees them.
async fn rows_of(client: &Client, schema: &str, consumer: &str, key: &str) -> Result<i64, Failure> {
    Ok(client
        .query_one(
            &format!(
                "SELECT count(*) FROM {schema}.records WHERE consumer = $1 AND message_key = $2"
            ),
            &[&consumer.as_bytes(), &key.as_bytes()],
        )
        .await?
        .get(0))
}

/// Nothing of consumer `c`'s `key` is left after a failed commit, seen from another
/// connection right after the error: no record, no row, and the key new to a claim (epoch 1)
/// at once, which is then rolled back.
async fn left_nothing(
    consumer: &PgConsumer,
    other: &mut Client,
    schema: &str,
    key: &str,
) -> Result<(), Failure> {
    let record = consumer.get(&*other, key).await?;
    ensure!(
        record.is_none(),
        "`{key}` has a record after its failed commit: {record:?}"
    );
    let rows = rows_of(&*other, schema, "c", key).await?;
    ensure!(
        rows == 0,
        "`{key}` has {rows} row(s) after its failed commit"
    );
    match consumer
        .begin(other, key, Fingerprint::of(key.as_bytes()))
        .await?
    {
        Outcome::Fresh(claim) => {
            ensure!(
                claim.epoch() == 1,
                "`{key}` after its failed commit: epoch {}",
                claim.epoch()
            );
            claim.abort().await?;
        }
        outcome => return Err(format!("`{key}` after its failed commit: {outcome:?}").into()),
    }
    Ok(())
}

/// The offsets of partitions 0 and 1 of source `orders`, as `client` reads them.
async fn offsets(
    consumer: &PgConsumer,
    client: &Client,
) -> Result<(Option<u64>, Option<u64>), Failure> {
    let positions = consumer.positions();
    let zero = positions.get(client, "orders", 0).await?;
    let one = positions.get(client, "orders", 1).await?;
    Ok((
        zero.map(|position| position.offset),
        one.map(|position| position.offset),
    ))
}

/// Inside the claim's transaction the record that went out with the claim is visible before
/// the commit, completed, with an empty result and the claim's time (its expiry a retention
/// later), whatever result the commit will carry; another session reads nothing of the key
/// until the commit. Committed at once with an empty result, that record is the key's; with a
/// result, the commit's own record replaces it, at the commit's time.
pub async fn a_claims_transaction_reads_its_new_keys_record_before_the_commit(
    url: &str,
) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    let other = connect(url).await?;
    let names = fresh_schema(&mut client, "t_early_docs_1").await?;
    let clock = MockClock::new(START_MS);
    let store = mock_store(&client, names, &clock, false).await?;
    let consumer = store.consumer("c")?;

    // Committed with an empty result: the record read inside is the one that lands.
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, "k-1", Fingerprint::of(b"k-1"))
        .await?
    else {
        return Err("`k-1` is not fresh".into());
    };
    ensure!(claim.epoch() == 1, "`k-1`: epoch {}", claim.epoch());
    let inside = consumer.get(claim.transaction(), "k-1").await?;
    ensure!(
        completed(inside.clone()) == Some(expected(1, "k-1", START_MS, b"")),
        "`k-1` read inside its claim's transaction before the commit: {inside:?}"
    );
    let outside = consumer.get(&other, "k-1").await?;
    ensure!(
        outside.is_none(),
        "`k-1` read by another session before the commit: {outside:?}"
    );
    claim.commit(b"").await?;
    let after = consumer.get(&other, "k-1").await?;
    ensure!(
        completed(after.clone()) == Some(expected(1, "k-1", START_MS, b"")),
        "`k-1` after the commit: {after:?}"
    );

    // Committed with a result 200 ms later: inside, the record that went with the claim is
    // still the empty one at the claim's time; the commit writes its own.
    let claimed_ms = START_MS + 10_000;
    clock.set(claimed_ms);
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, "k-2", Fingerprint::of(b"k-2"))
        .await?
    else {
        return Err("`k-2` is not fresh".into());
    };
    let inside = consumer.get(claim.transaction(), "k-2").await?;
    ensure!(
        completed(inside.clone()) == Some(expected(1, "k-2", claimed_ms, b"")),
        "`k-2` read inside its claim's transaction before the commit: {inside:?}"
    );
    let outside = consumer.get(&other, "k-2").await?;
    ensure!(
        outside.is_none(),
        "`k-2` read by another session before the commit: {outside:?}"
    );
    clock.advance(Duration::from_millis(200));
    claim.commit(b"kept").await?;
    let after = consumer.get(&other, "k-2").await?;
    ensure!(
        completed(after.clone()) == Some(expected(1, "k-2", claimed_ms + 200, b"kept")),
        "`k-2` after a commit with a result: {after:?}"
    );
    Ok(())
}

/// While a claim holds a new key with its record, every other claimant of the key (the same
/// message, another body, a message with an entity version, `apply` with its SQL, a batch) is
/// in progress at once, never waiting and never a conflict with the uncommitted record, and
/// `apply`'s SQL does not run; another consumer's claim of the same key is its own, taken and
/// committed beside it. Rolled back (`abort`, or a drop), the claim takes its row away: the key
/// is new again, at epoch 1, for any content.
pub async fn a_key_held_with_its_record_is_in_progress_at_once_to_every_other_claimant(
    url: &str,
) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_2";
    let mut holder = connect(url).await?;
    let mut other = connect(url).await?;
    let names = fresh_schema(&mut holder, SCHEMA).await?;
    let clock = MockClock::new(START_MS);
    let store = mock_store(&holder, names, &clock, false).await?;
    let consumer = store.consumer("c")?;
    let body = Fingerprint::of(b"m");
    let another_body = Fingerprint::of(b"another body");
    let Outcome::Fresh(claim) = consumer.begin(&mut holder, "k", body).await? else {
        return Err("the first claim of `k` is not fresh".into());
    };
    let inside = consumer.get(claim.transaction(), "k").await?;
    ensure!(
        inside.is_some(),
        "no record of `k` inside its claim's transaction"
    );

    let claimants = [
        ("the same message", Message::new("k", body)),
        ("another body", Message::new("k", another_body)),
        (
            "an entity version",
            Message::new("k", body).version("entity-1", 1),
        ),
    ];
    for (what, message) in &claimants {
        let outcome =
            tokio::time::timeout(WITHIN, consumer.begin_message(&mut other, message)).await??;
        ensure!(
            matches!(outcome, Outcome::InProgress { holder: None, .. }),
            "{what} while `k` is held: {outcome:?}"
        );
        drop(outcome);
    }
    let insert = format!("INSERT INTO {SCHEMA}.orders (id, body) VALUES ('from-apply', 'x')");
    let statements: [TypedStatement<'_>; 1] = [(insert.as_str(), &[])];
    let applied = tokio::time::timeout(
        WITHIN,
        consumer.apply(
            &mut other,
            &Message::new("k", body),
            b"applied",
            &statements,
        ),
    )
    .await??;
    ensure!(
        matches!(applied, Outcome::InProgress { holder: None, .. }),
        "apply while `k` is held: {applied:?}"
    );
    let rows = order_rows(&other, SCHEMA, "from-apply").await?;
    ensure!(rows == 0, "apply's statement ran while `k` was held");
    let batch_messages = messages(&[("k", "m"), ("b", "b")]);
    let batch =
        tokio::time::timeout(WITHIN, consumer.begin_batch(&mut other, &batch_messages)).await??;
    ensure!(
        matches!(
            batch.outcomes(),
            [
                PgBatchOutcome::Settled(Outcome::InProgress { holder: None, .. }),
                PgBatchOutcome::Fresh
            ]
        ),
        "a batch while `k` is held: {:?}",
        batch.outcomes()
    );
    batch.commit(|_| b"batch").await?;

    // Another consumer's record of the key goes with its own claim, beside the held one.
    let shipping = store.consumer("shipping")?;
    let Outcome::Fresh(beside) =
        tokio::time::timeout(WITHIN, shipping.begin(&mut other, "k", body)).await??
    else {
        return Err("another consumer's claim of `k` is not fresh".into());
    };
    let inside = shipping.get(beside.transaction(), "k").await?;
    ensure!(
        inside.is_some(),
        "no record of another consumer's `k` inside its claim's transaction"
    );
    beside.commit(b"").await?;

    // Rolled back: its row goes with it, and the key is new to any content.
    claim.abort().await?;
    let rows = rows_of(&other, SCHEMA, "c", "k").await?;
    ensure!(
        rows == 0,
        "{rows} row(s) of `k` after its claim rolled back"
    );
    let rows = rows_of(&other, SCHEMA, "shipping", "k").await?;
    ensure!(rows == 1, "{rows} row(s) of another consumer's `k`");
    match consumer.begin(&mut other, "k", another_body).await? {
        Outcome::Fresh(claim) => {
            ensure!(
                claim.epoch() == 1,
                "`k` after the rollback: epoch {}",
                claim.epoch()
            );
            claim.commit(b"second").await?;
        }
        outcome => return Err(format!("`k` after the rollback: {outcome:?}").into()),
    }
    match consumer.begin(&mut holder, "k", body).await? {
        Outcome::Conflict {
            stored_fingerprint, ..
        } if stored_fingerprint == another_body => {}
        outcome => {
            return Err(
                format!("the first body of `k` after the second commit: {outcome:?}").into(),
            );
        }
    }

    // Dropped: the rollback it sends runs before the next statement on its connection.
    let Outcome::Fresh(dropped) = consumer.begin(&mut holder, "d", body).await? else {
        return Err("`d` is not fresh".into());
    };
    drop(dropped);
    holder.batch_execute("SELECT 1").await?;
    let record = consumer.get(&other, "d").await?;
    ensure!(
        record.is_none(),
        "`d` after its claim was dropped: {record:?}"
    );
    let rows = rows_of(&other, SCHEMA, "c", "d").await?;
    ensure!(
        rows == 0,
        "{rows} row(s) of `d` after its claim was dropped"
    );
    match consumer.begin(&mut other, "d", body).await? {
        Outcome::Fresh(claim) => {
            ensure!(claim.epoch() == 1, "`d`: epoch {}", claim.epoch());
            claim.abort().await?;
        }
        outcome => return Err(format!("`d` after the drop: {outcome:?}").into()),
    }
    Ok(())
}

/// A caller's statement that fails (a unique violation on the caller's own table) fails the
/// commit with its own error, not `LostKey`, and takes the claim's record away with its other
/// statements: whether the record would have stood (an empty result within a second of the
/// claim, where the commit sends only the caller's SQL and `COMMIT`) or been rewritten (later,
/// or with a result), and whether the statement went with the commit or ran on the claim's
/// transaction before it. The key is new at once afterwards. A statement that succeeds lands
/// with the record that stood.
pub async fn a_failing_business_statement_takes_the_claims_record_away(
    url: &str,
) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_3";
    let mut client = connect(url).await?;
    let mut other = connect(url).await?;
    let (clock, _store, consumer) = fresh_store(&mut client, SCHEMA).await?;
    client
        .batch_execute(&format!(
            "INSERT INTO {SCHEMA}.orders (id, body) VALUES ('taken', 'before')"
        ))
        .await?;
    let insert = format!("INSERT INTO {SCHEMA}.orders (id, body) VALUES ($1, $2)");
    let taken: [(&(dyn ToSql + Sync), Type); 2] = [(&"taken", Type::TEXT), (&"again", Type::TEXT)];
    for (key, held_ms, result) in [
        ("at-once", 0, &b""[..]),
        ("within", 1_000, &b""[..]),
        ("later", 1_001, &b""[..]),
        ("result", 0, &b"r"[..]),
    ] {
        let own_row = format!("{key}-row");
        let own: [(&(dyn ToSql + Sync), Type); 2] = [(&own_row, Type::TEXT), (&"x", Type::TEXT)];
        let statements: [TypedStatement<'_>; 2] =
            [(insert.as_str(), &own), (insert.as_str(), &taken)];
        let Outcome::Fresh(claim) = consumer
            .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
            .await?
        else {
            return Err(format!("`{key}` is not fresh").into());
        };
        clock.advance(Duration::from_millis(held_ms));
        let committed = claim.commit_with(result, &statements).await;
        ensure!(
            postgres_error(&committed, &SqlState::UNIQUE_VIOLATION),
            "`{key}`: a caller's unique violation reported as {committed:?}"
        );
        left_nothing(&consumer, &mut other, SCHEMA, key).await?;
        let rows = order_rows(&other, SCHEMA, &own_row).await?;
        ensure!(
            rows == 0,
            "`{key}`: the statement before the failing one landed"
        );
    }

    // The failing statement run on the claim's transaction, before an empty commit.
    let key = "on-the-transaction";
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    let failed = claim
        .transaction()
        .execute(
            format!("INSERT INTO {SCHEMA}.orders (id, body) VALUES ('taken', 'again')").as_str(),
            &[],
        )
        .await;
    ensure!(failed.is_err(), "the duplicate order row was inserted");
    let committed = claim.commit(b"").await;
    ensure!(
        matches!(committed, Err(Error::Postgres(_))),
        "an empty commit after a failed statement: {committed:?}"
    );
    left_nothing(&consumer, &mut other, SCHEMA, key).await?;

    // A statement that succeeds lands with the record that stood (the claim's time).
    let key = "lands";
    let claimed_ms = clock.now_ms();
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    clock.advance(Duration::from_millis(300));
    let own: [(&(dyn ToSql + Sync), Type); 2] = [(&"lands-row", Type::TEXT), (&"x", Type::TEXT)];
    claim
        .commit_with(b"", &[(insert.as_str(), &own[..])])
        .await?;
    let rows = order_rows(&other, SCHEMA, "lands-row").await?;
    ensure!(rows == 1, "{rows} business row(s) of `{key}`");
    let record = consumer.get(&other, key).await?;
    ensure!(
        completed(record.clone()) == Some(expected(1, key, claimed_ms, b"")),
        "`{key}` after its commit with its statement: {record:?}"
    );
    Ok(())
}

/// A commit refused before anything of it is sent (a result over the limit, the injected
/// clock past `CLOCK_MS_MAX`, a statement that cannot be sent) or whose statement the server
/// refuses (fewer parameters than placeholders) writes nothing: the record that went out with
/// the claim is rolled back with it, even where the commit would have let it stand (an empty
/// result at once), and the key is new to a claim from another connection the moment the error
/// returns.
pub async fn a_refused_commit_takes_the_claims_record_away(url: &str) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_4";
    let mut client = connect(url).await?;
    let mut other = connect(url).await?;
    let (clock, _store, consumer) = fresh_store(&mut client, SCHEMA).await?;
    // Only to show what the refusals below take away: the record goes with the claim.
    match consumer
        .begin(&mut client, "probe", Fingerprint::of(b"probe"))
        .await?
    {
        Outcome::Fresh(claim) => {
            let inside = consumer.get(claim.transaction(), "probe").await?;
            ensure!(
                inside.is_some(),
                "no record of `probe` inside its claim's transaction"
            );
            claim.abort().await?;
        }
        outcome => return Err(format!("`probe`: {outcome:?}").into()),
    }

    // A result over the limit.
    let key = "too-long";
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    let too_long = vec![0_u8; idemdb::RESULT_BYTES_MAX + 1];
    let refused = claim.commit(&too_long).await;
    ensure!(
        matches!(
            refused,
            Err(Error::Idemdb(idemdb::Error::LimitExceeded {
                limit: idemdb::Limit::ResultBytes,
                ..
            }))
        ),
        "a result over the limit: {refused:?}"
    );
    left_nothing(&consumer, &mut other, SCHEMA, key).await?;

    // The injected clock past its limit when the commit reads it.
    let key = "past-the-limit";
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    let past = idemdb::CLOCK_MS_MAX + 1;
    clock.set(past);
    let refused = claim.commit(b"").await;
    clock.set(START_MS + 1_000);
    ensure!(
        matches!(
            &refused,
            Err(Error::Idemdb(idemdb::Error::ClockOutOfRange { now_ms, .. })) if *now_ms == past
        ),
        "a clock past its limit at the commit: {refused:?}"
    );
    left_nothing(&consumer, &mut other, SCHEMA, key).await?;

    // A statement that cannot be sent, with an empty result committed at once.
    let insert = format!("INSERT INTO {SCHEMA}.orders (id, body) VALUES ($1, $2)");
    let key = "unsendable";
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    let number = 5_i64;
    let unencodable: [(&(dyn ToSql + Sync), Type); 2] = [(&number, Type::TEXT), (&"x", Type::TEXT)];
    let refused = claim
        .commit_with(b"", &[(insert.as_str(), &unencodable[..])])
        .await;
    ensure!(
        matches!(refused, Err(Error::BadStatement { statement: 0, .. })),
        "a statement that cannot be sent: {refused:?}"
    );
    left_nothing(&consumer, &mut other, SCHEMA, key).await?;

    // A statement short of a parameter: the server refuses it inside the transaction, so the
    // `COMMIT` behind it cannot commit the record alone.
    let key = "short";
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    let short: [(&(dyn ToSql + Sync), Type); 1] = [(&"short-row", Type::TEXT)];
    let refused = claim
        .commit_with(b"", &[(insert.as_str(), &short[..])])
        .await;
    ensure!(
        matches!(&refused, Err(error @ Error::Postgres(_)) if !error.is_retryable()),
        "a statement short of a parameter: {refused:?}"
    );
    left_nothing(&consumer, &mut other, SCHEMA, key).await?;
    let rows = order_rows(&other, SCHEMA, "short-row").await?;
    ensure!(rows == 0, "{rows} business row(s) of the short statement");
    Ok(())
}

/// A record that stood (an empty result committed within a second of the claim, here exactly
/// 1,000 ms) keeps the claim's time: it is a duplicate until one millisecond before the claim's
/// time plus the retention, its row stays through removal then, and from that millisecond on
/// the key is claimable again (at the next epoch) and its row is removed. A record rewritten
/// (an empty result 1,001 ms after the claim, or a result) runs from the commit's time instead.
/// The row's removal time is the record's expiry.
pub async fn a_record_that_stood_expires_a_retention_after_its_claim(
    url: &str,
) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_5";
    let mut client = connect(url).await?;
    let (clock, store, consumer) = fresh_store(&mut client, SCHEMA).await?;
    let cases = [
        ("stood", 1_000, &b""[..], true),
        ("late", 1_001, &b""[..], false),
        ("result", 500, &b"r"[..], false),
    ];
    for (index, (key, held_ms, result, stands)) in (0_u64..).zip(cases) {
        let claimed_ms = START_MS + index * 10 * RETENTION_MS;
        let body = Fingerprint::of(key.as_bytes());
        clock.set(claimed_ms);
        let Outcome::Fresh(claim) = consumer.begin(&mut client, key, body).await? else {
            return Err(format!("`{key}` is not fresh").into());
        };
        clock.set(claimed_ms + held_ms);
        claim.commit_with(result, &[(BUSINESS_SQL, &[])]).await?;
        let committed_ms = if stands {
            claimed_ms
        } else {
            claimed_ms + held_ms
        };
        let expires_ms = committed_ms + RETENTION_MS;
        let column: i64 = client
            .query_one(
                &format!("SELECT expires_at_ms FROM {SCHEMA}.records WHERE message_key = $1"),
                &[&key.as_bytes()],
            )
            .await?
            .get(0);
        ensure!(
            column == i64::try_from(expires_ms)?,
            "`{key}`: the row's removal time is {column}, its record's expiry {expires_ms}"
        );

        clock.set(expires_ms - 1);
        match consumer.begin(&mut client, key, body).await? {
            Outcome::Duplicate {
                result: stored,
                first_committed_at_ms,
                expires_at_ms,
                epoch,
                ..
            } => ensure!(
                &stored[..] == result
                    && first_committed_at_ms == committed_ms
                    && expires_at_ms == expires_ms
                    && epoch == 1,
                "`{key}` one millisecond before {expires_ms}: committed at \
                 {first_committed_at_ms}, expiring at {expires_at_ms}, epoch {epoch}, {stored:?}"
            ),
            outcome => {
                return Err(format!(
                    "`{key}` one millisecond before {expires_ms} (claimed at {claimed_ms}, \
                     committed at {}): {outcome:?}",
                    claimed_ms + held_ms
                )
                .into());
            }
        }
        store.maintain(&client).await?;
        let rows = rows_of(&client, SCHEMA, "c", key).await?;
        ensure!(
            rows == 1,
            "`{key}`: removal one millisecond before its expiry left {rows} row(s)"
        );

        clock.set(expires_ms);
        match consumer.begin(&mut client, key, body).await? {
            Outcome::Fresh(claim) => {
                ensure!(
                    claim.epoch() == 2,
                    "`{key}` at {expires_ms}: epoch {}",
                    claim.epoch()
                );
                claim.abort().await?;
            }
            outcome => return Err(format!("`{key}` at {expires_ms}: {outcome:?}").into()),
        }
        store.maintain(&client).await?;
        let rows = rows_of(&client, SCHEMA, "c", key).await?;
        ensure!(
            rows == 0,
            "`{key}`: removal at its expiry left {rows} row(s)"
        );
    }
    Ok(())
}

/// The claim's function inserts nothing over a key that has a row: inside a claim of an
/// expired key the row is still the old record, and the commit replaces it in place (one row)
/// at the commit's time and the next epoch, even with an empty result within a second. A key
/// whose row removal took is new again: its record goes with the claim and stands, at epoch 1.
/// A message with an entity's version is committed at the commit's time too, on a new key and
/// on a key that had a row, and records its version (the same version is `Stale` afterwards); a
/// stale message on a new key leaves no record.
pub async fn a_key_that_had_a_row_or_a_version_is_written_at_the_commits_time(
    url: &str,
) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_6";
    let mut client = connect(url).await?;
    let (clock, store, consumer) = fresh_store(&mut client, SCHEMA).await?;
    let fingerprint = |key: &str| Fingerprint::of(key.as_bytes());
    for key in ["old", "gone"] {
        match consumer.begin(&mut client, key, fingerprint(key)).await? {
            Outcome::Fresh(claim) => claim.commit(b"").await?,
            outcome => return Err(format!("`{key}`: {outcome:?}").into()),
        }
    }

    // An expired record: the claim finds its row and replaces it at the commit.
    let reclaimed_ms = START_MS + RETENTION_MS;
    clock.set(reclaimed_ms);
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, "old", fingerprint("old"))
        .await?
    else {
        return Err("`old` is not claimable at its expiry".into());
    };
    ensure!(
        claim.epoch() == 2,
        "`old` taken again: epoch {}",
        claim.epoch()
    );
    let inside = consumer.get(claim.transaction(), "old").await?;
    ensure!(
        completed(inside.clone()) == Some(expected(1, "old", START_MS, b"")),
        "`old` inside its new claim's transaction is not its expired record: {inside:?}"
    );
    clock.advance(Duration::from_millis(500));
    claim.commit(b"").await?;
    let after = consumer.get(&client, "old").await?;
    ensure!(
        completed(after.clone()) == Some(expected(2, "old", reclaimed_ms + 500, b"")),
        "`old` committed 500 ms after its claim over its expired row: {after:?}"
    );
    let rows = rows_of(&client, SCHEMA, "c", "old").await?;
    ensure!(rows == 1, "{rows} row(s) of `old`");

    // Removed by removal: a key without a row again, whose record goes with its claim.
    store.maintain(&client).await?;
    let rows = rows_of(&client, SCHEMA, "c", "gone").await?;
    ensure!(
        rows == 0,
        "removal left {rows} row(s) of the expired `gone`"
    );
    let claimed_ms = clock.now_ms();
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, "gone", fingerprint("gone"))
        .await?
    else {
        return Err("`gone` is not fresh after its removal".into());
    };
    ensure!(
        claim.epoch() == 1,
        "`gone` without a row: epoch {}",
        claim.epoch()
    );
    let inside = consumer.get(claim.transaction(), "gone").await?;
    ensure!(
        completed(inside.clone()) == Some(expected(1, "gone", claimed_ms, b"")),
        "`gone` inside its claim's transaction: {inside:?}"
    );
    clock.advance(Duration::from_millis(300));
    claim.commit_with(b"", &[(BUSINESS_SQL, &[])]).await?;
    let after = consumer.get(&client, "gone").await?;
    ensure!(
        completed(after.clone()) == Some(expected(1, "gone", claimed_ms, b"")),
        "`gone` after its commit: {after:?}"
    );

    // An entity's version on a new key: the commit's time, and the version recorded.
    let versioned_ms = START_MS + 10 * RETENTION_MS;
    clock.set(versioned_ms);
    let message = Message::new("v-3", fingerprint("v-3")).version("customer-7", 3);
    let Outcome::Fresh(claim) = consumer.begin_message(&mut client, &message).await? else {
        return Err("`v-3` is not fresh".into());
    };
    ensure!(
        claim.entity_version() == Some((&b"customer-7"[..], 3)),
        "`v-3`: {:?}",
        claim.entity_version()
    );
    clock.advance(Duration::from_millis(500));
    claim.commit(b"").await?;
    let after = consumer.get(&client, "v-3").await?;
    ensure!(
        completed(after.clone()) == Some(expected(1, "v-3", versioned_ms + 500, b"")),
        "`v-3`, with an entity version, committed 500 ms after its claim: {after:?}"
    );
    let stale = Message::new("v-3-again", fingerprint("v-3-again")).version("customer-7", 3);
    let outcome = consumer.begin_message(&mut client, &stale).await?;
    ensure!(
        matches!(
            outcome,
            Outcome::Stale {
                current_version: 3,
                ..
            }
        ),
        "version 3 again: {outcome:?}"
    );
    drop(outcome);
    let record = consumer.get(&client, "v-3-again").await?;
    ensure!(
        record.is_none(),
        "a stale message left a record: {record:?}"
    );
    let rows = rows_of(&client, SCHEMA, "c", "v-3-again").await?;
    ensure!(rows == 0, "a stale message left {rows} row(s)");

    // An entity's version on a key that had a row (`old` expired long since).
    let claimed_ms = clock.now_ms();
    let message = Message::new("old", fingerprint("old")).version("customer-7", 4);
    let Outcome::Fresh(claim) = consumer.begin_message(&mut client, &message).await? else {
        return Err("`old` with version 4 is not fresh".into());
    };
    ensure!(
        claim.epoch() == 3,
        "`old` with version 4: epoch {}",
        claim.epoch()
    );
    clock.advance(Duration::from_millis(200));
    claim.commit(b"").await?;
    let after = consumer.get(&client, "old").await?;
    ensure!(
        completed(after.clone()) == Some(expected(3, "old", claimed_ms + 200, b"")),
        "`old` with version 4 committed 200 ms after its claim: {after:?}"
    );
    let stale = Message::new("v-4-again", fingerprint("v-4-again")).version("customer-7", 4);
    let outcome = consumer.begin_message(&mut client, &stale).await?;
    ensure!(
        matches!(
            outcome,
            Outcome::Stale {
                current_version: 4,
                ..
            }
        ),
        "version 4 again: {outcome:?}"
    );
    drop(outcome);
    let rows = rows_of(&client, SCHEMA, "c", "old").await?;
    ensure!(rows == 1, "{rows} row(s) of `old` after its third commit");
    Ok(())
}

/// Batches and `apply` beside single claims on the same keys: a batch meets a key held by a
/// claim (with its record) as in progress and commits its other keys; a claim meets a key a
/// batch holds as in progress, and so does `apply`; a key a batch released is new to the next
/// claim, whose record goes with it and stands; keys whose claims rolled back are new to a
/// batch and to `apply` (epoch 1); and both answer a record that stood as a duplicate with the
/// claim's time and its empty result.
pub async fn batches_and_apply_take_turns_with_claims_whose_records_went_with_them(
    url: &str,
) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_7";
    let mut first = connect(url).await?;
    let mut second = connect(url).await?;
    let names = fresh_schema(&mut first, SCHEMA).await?;
    let clock = MockClock::new(START_MS);
    let store = mock_store(&first, names, &clock, false).await?;
    let consumer = store.consumer("c")?;
    let fingerprint = |key: &str| Fingerprint::of(key.as_bytes());

    // A claim holds `a`: a batch of `a` and `b` takes `b` only.
    let Outcome::Fresh(claim) = consumer.begin(&mut first, "a", fingerprint("a")).await? else {
        return Err("`a` is not fresh".into());
    };
    let a_and_b = messages(&[("a", "a"), ("b", "b")]);
    let batch = tokio::time::timeout(WITHIN, consumer.begin_batch(&mut second, &a_and_b)).await??;
    ensure!(
        matches!(
            batch.outcomes(),
            [
                PgBatchOutcome::Settled(Outcome::InProgress { holder: None, .. }),
                PgBatchOutcome::Fresh
            ]
        ),
        "a batch while `a` is held: {:?}",
        batch.outcomes()
    );
    batch.commit(|_| b"batch").await?;
    clock.advance(Duration::from_millis(100));
    claim.commit_with(b"", &[(BUSINESS_SQL, &[])]).await?;
    let batch = consumer.begin_batch(&mut second, &a_and_b).await?;
    match batch.outcomes() {
        [
            PgBatchOutcome::Settled(Outcome::Duplicate {
                result: a_result,
                first_committed_at_ms: a_at,
                ..
            }),
            PgBatchOutcome::Settled(Outcome::Duplicate {
                result: b_result,
                first_committed_at_ms: b_at,
                ..
            }),
        ] => ensure!(
            a_result.is_empty()
                && *a_at == START_MS
                && &b_result[..] == b"batch"
                && *b_at == START_MS,
            "`a` ({a_result:?} at {a_at}) and `b` ({b_result:?} at {b_at}) again"
        ),
        outcomes => return Err(format!("`a` and `b` again: {outcomes:?}").into()),
    }
    batch.commit(|_| b"unused").await?;

    // A batch holds `c`: a claim and `apply` of it are in progress at once.
    let c = messages(&[("c", "c")]);
    let mut batch = consumer.begin_batch(&mut second, &c).await?;
    ensure!(
        matches!(batch.outcomes(), [PgBatchOutcome::Fresh]),
        "`c` in a batch: {:?}",
        batch.outcomes()
    );
    let outcome =
        tokio::time::timeout(WITHIN, consumer.begin(&mut first, "c", fingerprint("c"))).await??;
    ensure!(
        matches!(outcome, Outcome::InProgress { holder: None, .. }),
        "a claim of `c` while a batch holds it: {outcome:?}"
    );
    drop(outcome);
    let applied = tokio::time::timeout(
        WITHIN,
        consumer.apply(
            &mut first,
            &Message::new("c", fingerprint("c")),
            b"applied",
            &[],
        ),
    )
    .await??;
    ensure!(
        matches!(applied, Outcome::InProgress { holder: None, .. }),
        "apply of `c` while a batch holds it: {applied:?}"
    );
    batch.release(0);
    batch.commit(|_| b"released").await?;
    let record = consumer.get(&first, "c").await?;
    ensure!(record.is_none(), "a released `c` was written: {record:?}");
    let claimed_ms = START_MS + 5_000;
    clock.set(claimed_ms);
    let Outcome::Fresh(claim) = consumer.begin(&mut first, "c", fingerprint("c")).await? else {
        return Err("`c` is not fresh after the batch released it".into());
    };
    let inside = consumer.get(claim.transaction(), "c").await?;
    ensure!(
        completed(inside.clone()) == Some(expected(1, "c", claimed_ms, b"")),
        "`c` inside its claim's transaction: {inside:?}"
    );
    clock.advance(Duration::from_millis(100));
    claim.commit_with(b"", &[(BUSINESS_SQL, &[])]).await?;
    let after = consumer.get(&second, "c").await?;
    ensure!(
        completed(after.clone()) == Some(expected(1, "c", claimed_ms, b"")),
        "`c` after its commit: {after:?}"
    );

    // Claims of `d` and `e` rolled back: a batch takes `d`, `apply` takes `e`, both anew.
    for key in ["d", "e"] {
        match consumer.begin(&mut first, key, fingerprint(key)).await? {
            Outcome::Fresh(claim) => claim.abort().await?,
            outcome => return Err(format!("`{key}`: {outcome:?}").into()),
        }
    }
    let d = messages(&[("d", "d")]);
    let batch = consumer.begin_batch(&mut second, &d).await?;
    ensure!(
        matches!(batch.outcomes(), [PgBatchOutcome::Fresh]) && batch.epoch(0) == Some(1),
        "`d` in a batch after its claim rolled back: {:?}, epoch {:?}",
        batch.outcomes(),
        batch.epoch(0)
    );
    batch.commit(|_| b"batch").await?;
    let record = consumer.get(&first, "d").await?;
    ensure!(
        matches!(&record, Some(record) if record.epoch == 1),
        "`d` after the batch: {record:?}"
    );
    let applied = consumer
        .apply(
            &mut second,
            &Message::new("e", fingerprint("e")),
            b"applied",
            &[],
        )
        .await?;
    ensure!(
        matches!(&applied, Outcome::Fresh(applied) if applied.epoch == 1),
        "apply of `e` after its claim rolled back: {applied:?}"
    );

    // `apply` answers the record that stood with the claim's time.
    let applied = consumer
        .apply(
            &mut second,
            &Message::new("a", fingerprint("a")),
            b"applied",
            &[],
        )
        .await?;
    match applied {
        Outcome::Duplicate {
            result,
            first_committed_at_ms,
            epoch,
            ..
        } => ensure!(
            result.is_empty() && first_committed_at_ms == START_MS && epoch == 1,
            "apply of `a`: a duplicate of {result:?} committed at {first_committed_at_ms}, \
             epoch {epoch}"
        ),
        outcome => return Err(format!("apply of `a`: {outcome:?}").into()),
    }
    Ok(())
}

/// A claim's read positions land with a record that stood (an empty result committed within a
/// second, where the commit sends no record of its own); a position behind the stored one fails
/// such a commit with `PositionBehind` and takes the record away too, leaving the position as
/// it was.
pub async fn a_read_position_lands_with_a_record_that_stood_and_one_behind_takes_it_away(
    url: &str,
) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_8";
    let mut client = connect(url).await?;
    let mut other = connect(url).await?;
    let (clock, _store, consumer) = fresh_store(&mut client, SCHEMA).await?;

    let key = "p-1";
    let Outcome::Fresh(mut claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    claim.stage_position("orders", 0, 10)?;
    clock.advance(Duration::from_millis(300));
    claim.commit(b"").await?;
    let record = consumer.get(&other, key).await?;
    ensure!(
        completed(record.clone()) == Some(expected(1, key, START_MS, b"")),
        "`{key}`: {record:?}"
    );
    let positions = offsets(&consumer, &other).await?;
    ensure!(
        positions == (Some(10), None),
        "positions after `{key}`: {positions:?}"
    );

    let key = "p-2";
    let Outcome::Fresh(mut claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    claim.stage_position("orders", 0, 5)?;
    let refused = claim.commit(b"").await;
    ensure!(
        matches!(
            &refused,
            Err(Error::Idemdb(idemdb::Error::PositionBehind {
                partition: 0,
                stored: 10,
                staged: 5,
                ..
            }))
        ),
        "an offset behind the stored one: {refused:?}"
    );
    left_nothing(&consumer, &mut other, SCHEMA, key).await?;
    let positions = offsets(&consumer, &other).await?;
    ensure!(
        positions == (Some(10), None),
        "positions after the refused `{key}`: {positions:?}"
    );

    let key = "p-3";
    let claimed_ms = clock.now_ms();
    let Outcome::Fresh(mut claim) = consumer
        .begin(&mut client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("`{key}` is not fresh").into());
    };
    claim.stage_position("orders", 0, 11)?;
    claim.stage_position("orders", 1, 3)?;
    claim.commit(b"").await?;
    let record = consumer.get(&other, key).await?;
    ensure!(
        completed(record.clone()) == Some(expected(1, key, claimed_ms, b"")),
        "`{key}`: {record:?}"
    );
    let positions = offsets(&consumer, &other).await?;
    ensure!(
        positions == (Some(11), Some(3)),
        "positions after `{key}`: {positions:?}"
    );
    Ok(())
}

/// On the database's clock: a claim's record goes out at the store's estimate of the
/// database's time, and is inserted only within a second of it. With the estimate put 1.5 s
/// off (by an `apply` whose statement sleeps after its insert, as the `apply` scenario does),
/// the claim inserts nothing (its transaction reads no record of the key) and its commit writes
/// the database's time; the next claim, the estimate learned again, reads its record inside
/// its transaction, and that record, at the database's time, is the one that lands.
pub async fn a_claim_whose_clock_estimate_is_off_inserts_nothing_and_commits_the_databases_time(
    url: &str,
) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, "t_early_docs_9").await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let consumer = store.consumer("c")?;
    let committed_at = |record: &Option<Record>| match record.as_ref().map(|r| &r.state) {
        Some(RecordState::Completed {
            committed_at_ms, ..
        }) => Some(*committed_at_ms),
        _ => None,
    };
    let warm = consumer
        .apply(
            &mut client,
            &Message::new("warm", Fingerprint::of(b"w")),
            b"",
            &[],
        )
        .await?;
    ensure!(matches!(warm, Outcome::Fresh(_)), "warm-up: {warm:?}");
    let sleep: [TypedStatement<'_>; 1] = [("SELECT pg_sleep(1.5)", &[])];
    let slow = consumer
        .apply(
            &mut client,
            &Message::new("slow", Fingerprint::of(b"s")),
            b"",
            &sleep,
        )
        .await?;
    ensure!(
        matches!(&slow, Outcome::Fresh(applied) if applied.one_round_trip),
        "the slow apply did not take one round trip, so the estimate is not put off: {slow:?}"
    );

    let before = db_clock_ms(&client).await?;
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, "skewed", Fingerprint::of(b"skewed"))
        .await?
    else {
        return Err("`skewed` is not fresh".into());
    };
    let inside = consumer.get(claim.transaction(), "skewed").await?;
    ensure!(
        inside.is_none(),
        "a record 1.5 s off the database's clock was inserted with the claim: {inside:?}"
    );
    claim.commit(b"").await?;
    let after = db_clock_ms(&client).await?;
    let record = consumer.get(&client, "skewed").await?;
    let Some(at) = committed_at(&record) else {
        return Err(format!("`skewed` after its commit: {record:?}").into());
    };
    ensure!(
        at + CLOCK_SLACK_MS >= before && at <= after + CLOCK_SLACK_MS,
        "`skewed` committed at {at}, database clock {before}..{after}"
    );

    let before = db_clock_ms(&client).await?;
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, "relearned", Fingerprint::of(b"relearned"))
        .await?
    else {
        return Err("`relearned` is not fresh".into());
    };
    let inside = consumer.get(claim.transaction(), "relearned").await?;
    let Some(inside_at) = committed_at(&inside) else {
        return Err(format!(
            "no completed record of `relearned` inside its claim's transaction: {inside:?}"
        )
        .into());
    };
    claim.commit_with(b"", &[(BUSINESS_SQL, &[])]).await?;
    let after = db_clock_ms(&client).await?;
    let record = consumer.get(&client, "relearned").await?;
    ensure!(
        committed_at(&record) == Some(inside_at),
        "`relearned` inside its transaction at {inside_at}, after its commit {record:?}"
    );
    ensure!(
        inside_at + CLOCK_SLACK_MS >= before && inside_at <= after + CLOCK_SLACK_MS,
        "`relearned` committed at {inside_at}, database clock {before}..{after}"
    );
    Ok(())
}

/// Version 9 tables (whose claim function takes the key alone) are refused by a store and left
/// as they are: the earlier release's call still answers and the version stays 9. `install`
/// replaces the function and moves the version to 10, after which the earlier release's call
/// fails (the function it calls is gone), and the new release answers the kept record and
/// claims a new key with its record.
pub async fn an_earlier_releases_claim_call_fails_once_version_9_tables_are_installed_over(
    url: &str,
) -> Result<(), Failure> {
    const SCHEMA: &str = "t_early_docs_10";
    let mut client = connect(url).await?;
    let names = older_schema(&mut client, SCHEMA, 9, VERSION_9_CLAIM_FUNCTION).await?;
    let old_call =
        format!("SELECT o_locked FROM {SCHEMA}.records_claim(1::int8, 'c'::bytea, 'k'::bytea)");
    let version_of = format!("SELECT version FROM {SCHEMA}.records_version");
    let locked: bool = client.query_one(old_call.as_str(), &[]).await?.get(0);
    ensure!(
        locked,
        "the earlier release's claim call before install: not locked"
    );
    let version: i32 = client.query_one(version_of.as_str(), &[]).await?.get(0);
    ensure!(
        version == 9,
        "a refused store moved the version to {version}"
    );

    install(&mut client, &names).await?;
    let version: i32 = client.query_one(version_of.as_str(), &[]).await?.get(0);
    ensure!(
        version == SCHEMA_VERSION,
        "the version after install: {version}"
    );
    let gone = client.query_one(old_call.as_str(), &[]).await;
    ensure!(
        matches!(&gone, Err(error) if error.code() == Some(&SqlState::UNDEFINED_FUNCTION)),
        "the earlier release's claim call after install: {gone:?}"
    );

    let now_ms = db_clock_ms(&client).await?;
    let clock = MockClock::new(now_ms);
    let store = mock_store(&client, names, &clock, false).await?;
    let consumer = store.consumer("c")?;
    let outcome = consumer
        .begin(&mut client, "kept", Fingerprint::of(b"kept"))
        .await?;
    ensure!(
        matches!(&outcome, Outcome::Duplicate { result, .. } if &result[..] == b"done"),
        "the kept record after install: {outcome:?}"
    );
    drop(outcome);
    let Outcome::Fresh(claim) = consumer
        .begin(&mut client, "new", Fingerprint::of(b"new"))
        .await?
    else {
        return Err("`new` is not fresh after install".into());
    };
    let inside = consumer.get(claim.transaction(), "new").await?;
    ensure!(
        completed(inside.clone()) == Some(expected(1, "new", now_ms, b"")),
        "`new` inside its claim's transaction after install: {inside:?}"
    );
    claim.commit(b"").await?;
    let after = consumer.get(&client, "new").await?;
    ensure!(
        completed(after.clone()) == Some(expected(1, "new", now_ms, b"")),
        "`new` after its commit: {after:?}"
    );
    Ok(())
}
