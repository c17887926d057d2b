//! Read positions of log consumers on PostgreSQL: written in the claim's (or batch's, or
//! `apply_at`'s) transaction with its record and business rows or not at all, the highest
//! offset per partition for a batch, never moving backwards (a stale writer refused with
//! nothing written, connections racing over one partition leaving the highest), checked
//! inputs, an operator's set and remove, the migration of a version 5 schema, and imports of
//! positions (forward only unless overwritten, waiting for a writer of the row).

use idemdb::{Fingerprint, Message, Outcome};
use idemdb_postgres::{Applied, Error, PgConsumer, PgStore, ReadPosition, install};
use tokio_postgres::Client;
use tokio_postgres::types::Type;

use super::{Failure, connect, fresh_schema, order_rows};

async fn offset(
    consumer: &PgConsumer,
    client: &Client,
    partition: u32,
) -> Result<Option<u64>, Failure> {
    Ok(consumer
        .positions()
        .get(client, "orders", partition)
        .await?
        .map(|position| position.offset))
}

fn behind<T>(result: &Result<T, Error>) -> Option<(u32, u64, u64)> {
    match result {
        Err(Error::Idemdb(idemdb::Error::PositionBehind {
            partition,
            stored,
            staged,
            source_name,
        })) if source_name == "orders" => Some((*partition, *stored, *staged)),
        _ => None,
    }
}

/// Claims `key` and commits it with its order row and the position `partition`/`offset`.
async fn commit_at(
    consumer: &PgConsumer,
    client: &mut Client,
    schema: &str,
    key: &str,
    partition: u32,
    offset: u64,
) -> Result<Result<(), Error>, Failure> {
    let Outcome::Fresh(mut claim) = consumer
        .begin(client, key, Fingerprint::of(key.as_bytes()))
        .await?
    else {
        return Err(format!("{key}: not fresh").into());
    };
    claim.stage_position("orders", partition, offset)?;
    let sql = format!("INSERT INTO {schema}.orders (id, body) VALUES ($1, 'x')");
    Ok(claim
        .commit_with(b"ok", &[(sql.as_str(), &[(&key, Type::TEXT)])])
        .await)
}

pub async fn a_claims_position_lands_with_its_record_and_business_row_or_not_at_all(
    url: &str,
) -> Result<(), Failure> {
    let schema = "t_positions_claim";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let c = store.consumer("c")?;
    ensure!(offset(&c, &client, 2).await?.is_none(), "none before");
    commit_at(&c, &mut client, schema, "m-7", 2, 7).await??;
    let position = c
        .positions()
        .get(&client, "orders", 2)
        .await?
        .ok_or("stored")?;
    ensure!(
        (position.offset, position.next_offset()) == (7, 8),
        "{position:?}"
    );
    ensure!(offset(&c, &client, 3).await?.is_none(), "other partition");
    ensure!(
        store
            .consumer("d")?
            .positions()
            .get(&client, "orders", 2)
            .await?
            .is_none(),
        "other consumer"
    );
    // A stale writer: behind the stored position, refused; nothing of it lands.
    let refused = commit_at(&c, &mut client, schema, "m-5", 2, 5).await?;
    ensure!(behind(&refused) == Some((2, 7, 5)), "{refused:?}");
    ensure!(
        c.get(&client, "m-5").await?.is_none(),
        "record of the refused"
    );
    ensure!(
        order_rows(&client, schema, "m-5").await? == 0,
        "row of the refused"
    );
    ensure!(offset(&c, &client, 2).await? == Some(7), "unchanged");
    // Its key is free again; at the stored offset it is accepted.
    commit_at(&c, &mut client, schema, "m-5", 2, 7).await??;
    ensure!(order_rows(&client, schema, "m-5").await? == 1, "row once");
    // A dropped claim leaves the position.
    let Outcome::Fresh(mut claim) = c.begin(&mut client, "m-9", Fingerprint::of(b"m-9")).await?
    else {
        return Err("m-9 not fresh".into());
    };
    claim.stage_position("orders", 2, 9)?;
    claim.abort().await?;
    ensure!(offset(&c, &client, 2).await? == Some(7), "after abort");
    // Advancing alone, forwards and (refused) backwards.
    c.positions().advance(&client, "orders", 2, 8).await?;
    let refused = c.positions().advance(&client, "orders", 2, 1).await;
    ensure!(behind(&refused) == Some((2, 8, 1)), "{refused:?}");
    let listed = c.positions().list(&client).await?;
    ensure!(
        listed.len() == 1 && listed[0].offset == 8 && listed[0].partition == 2,
        "{listed:?}"
    );
    Ok(())
}

pub async fn a_batch_writes_the_highest_offset_per_partition_even_of_duplicates(
    url: &str,
) -> Result<(), Failure> {
    let schema = "t_positions_batch";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let c = store.consumer("c")?;
    let messages = [("a", Fingerprint::of(b"a")), ("b", Fingerprint::of(b"b"))];
    let mut batch = c.begin_batch(&mut client, &messages).await?;
    batch.stage_position("orders", 0, 11)?;
    batch.stage_position("orders", 0, 10)?;
    batch.stage_position("orders", 1, 4)?;
    batch.commit(|_| b"ok").await?;
    ensure!(offset(&c, &client, 0).await? == Some(11), "p0");
    ensure!(offset(&c, &client, 1).await? == Some(4), "p1");
    // Replayed: every message a duplicate, the position still moves.
    let mut batch = c.begin_batch(&mut client, &messages).await?;
    ensure!(
        batch.epoch(0).is_none() && batch.epoch(1).is_none(),
        "duplicates"
    );
    batch.stage_position("orders", 0, 13)?;
    batch.commit(|_| b"ok").await?;
    ensure!(
        offset(&c, &client, 0).await? == Some(13),
        "p0 moved by duplicates"
    );
    // One partition behind: the whole batch is refused, its claims included.
    let fresh = [("c", Fingerprint::of(b"c"))];
    let mut batch = c.begin_batch(&mut client, &fresh).await?;
    batch.stage_position("orders", 0, 14)?;
    batch.stage_position("orders", 1, 3)?;
    let refused = batch.commit(|_| b"ok").await;
    ensure!(behind(&refused) == Some((1, 4, 3)), "{refused:?}");
    ensure!(
        c.get(&client, "c").await?.is_none(),
        "claim of the refused batch"
    );
    ensure!(offset(&c, &client, 0).await? == Some(13), "p0 unchanged");
    Ok(())
}

pub async fn connections_racing_over_one_partition_leave_the_highest_offset(
    url: &str,
) -> Result<(), Failure> {
    let schema = "t_positions_race";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let mut workers = Vec::new();
    for worker in 0..6u64 {
        let url = url.to_owned();
        let store = store.clone();
        workers.push(tokio::spawn(async move {
            let mut client = connect(&url).await?;
            let c = store.consumer("c")?;
            let mut committed = Vec::new();
            let mut refused = 0u64;
            for round in 0..40u64 {
                let offset = (round * 11 + worker * 17) % 300;
                let key = format!("w{worker}-{round}");
                let result = commit_at(&c, &mut client, schema, &key, 0, offset).await?;
                let stale = behind(&result).is_some();
                match result {
                    Ok(()) => committed.push(offset),
                    Err(_) if stale => {
                        refused += 1;
                        if c.get(&client, &key).await?.is_some()
                            || order_rows(&client, schema, &key).await? != 0
                        {
                            return Err(format!("{key}: refused but written").into());
                        }
                    }
                    Err(error) => return Err(error.into()),
                }
            }
            Ok::<_, Failure>((committed, refused))
        }));
    }
    let mut highest = 0;
    let mut refused = 0;
    for worker in workers {
        let (committed, worker_refused) = worker.await??;
        highest = committed.into_iter().fold(highest, u64::max);
        refused += worker_refused;
    }
    ensure!(
        refused > 0,
        "offsets go backwards: some commits must be refused"
    );
    let c = store.consumer("c")?;
    ensure!(
        offset(&c, &client, 0).await? == Some(highest),
        "stored {:?}, highest committed {highest}",
        offset(&c, &client, 0).await?
    );
    Ok(())
}

pub async fn bad_positions_are_refused_before_anything_is_sent(url: &str) -> Result<(), Failure> {
    let schema = "t_positions_input";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let c = store.consumer("c")?;
    for source in [
        String::new(),
        "s".repeat(idemdb::POSITION_SOURCE_BYTES_MAX + 1),
    ] {
        let refused = c.positions().advance(&client, &source, 0, 1).await;
        ensure!(
            matches!(
                refused,
                Err(Error::Idemdb(idemdb::Error::LimitExceeded {
                    limit: idemdb::Limit::PositionSourceBytes,
                    ..
                }))
            ),
            "{refused:?}"
        );
    }
    let too_far = c
        .positions()
        .advance(
            &client,
            "orders",
            0,
            idemdb_postgres::POSITION_OFFSET_MAX + 1,
        )
        .await;
    ensure!(
        matches!(
            too_far,
            Err(Error::Idemdb(idemdb::Error::InvalidArgument { .. }))
        ),
        "{too_far:?}"
    );
    // NUL, which PostgreSQL's text cannot hold: refused up front (it failed the statement
    // with 22021), on every path.
    let nul = "orders\0eu";
    let advanced = c.positions().advance(&client, nul, 0, 1).await;
    let read = c.positions().get(&client, nul, 0).await;
    let Outcome::Fresh(mut claim) = c
        .begin(&mut client, "m-nul", Fingerprint::of(b"nul"))
        .await?
    else {
        return Err("m-nul: not fresh".into());
    };
    let staged = claim.stage_position(nul, 0, 1);
    drop(claim);
    for (what, refused) in [("advance", advanced), ("stage_position", staged)] {
        ensure!(
            matches!(
                refused,
                Err(Error::Idemdb(idemdb::Error::InvalidArgument { .. }))
            ),
            "{what} of a source with NUL: {refused:?}"
        );
    }
    ensure!(
        matches!(
            read,
            Err(Error::Idemdb(idemdb::Error::InvalidArgument { .. }))
        ),
        "get of a source with NUL: {read:?}"
    );
    let longest = "s".repeat(idemdb::POSITION_SOURCE_BYTES_MAX);
    c.positions()
        .advance(
            &client,
            &longest,
            u32::MAX,
            idemdb_postgres::POSITION_OFFSET_MAX,
        )
        .await?;
    let stored = c.positions().get(&client, &longest, u32::MAX).await?;
    ensure!(
        stored.as_ref().map(|p| p.offset) == Some(idemdb_postgres::POSITION_OFFSET_MAX),
        "{stored:?}"
    );
    Ok(())
}

pub async fn a_version_5_schema_gains_positions_on_install(url: &str) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    // As version 5 left it: no positions table, no function (and none of the claims').
    let names = super::older_schema(
        &mut client,
        "t_positions_v5",
        5,
        "DROP FUNCTION {schema}.records_advance_positions; DROP TABLE {schema}.records_position; \
         DROP FUNCTION {schema}.records_claim; DROP FUNCTION {schema}.records_apply; \
         DROP FUNCTION {schema}.records_claim_many;",
    )
    .await?;
    install(&mut client, &names).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let c = store.consumer("c")?;
    ensure!(c.get(&client, "kept").await?.is_some(), "record kept");
    c.positions().advance(&client, "orders", 0, 3).await?;
    ensure!(offset(&c, &client, 0).await? == Some(3), "positions work");
    Ok(())
}

/// `apply_at` of `key` with its order row, at `offset` of partition 0 of "orders".
async fn apply_at(
    consumer: &PgConsumer,
    client: &mut Client,
    schema: &str,
    message: &Message<'_>,
    offset: u64,
) -> Result<Outcome<Applied>, Error> {
    let sql = format!("INSERT INTO {schema}.orders (id, body) VALUES ($1, 'x')");
    let key = std::str::from_utf8(message.key()).unwrap_or("?");
    consumer
        .apply_at(
            client,
            message,
            ReadPosition::new("orders", 0, offset),
            b"ok",
            &[(sql.as_str(), &[(&key, Type::TEXT)])],
        )
        .await
}

fn one_trip(outcome: &Result<Outcome<Applied>, Error>) -> Option<bool> {
    match outcome {
        Ok(Outcome::Fresh(applied)) => Some(applied.one_round_trip),
        _ => None,
    }
}

pub async fn apply_at_moves_the_position_with_its_record_in_one_round_trip_or_not_at_all(
    url: &str,
) -> Result<(), Failure> {
    let schema = "t_positions_apply";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let c = store.consumer("c")?;
    let message = |key: &'static str| Message::new(key, Fingerprint::of(key.as_bytes()));
    // The store's first call learns the database's clock (the long way); the position lands
    // with it all the same.
    let first = apply_at(&c, &mut client, schema, &message("m-1"), 1).await;
    ensure!(one_trip(&first).is_some(), "m-1: {first:?}");
    ensure!(offset(&c, &client, 0).await? == Some(1), "after m-1");
    // A new key: one round trip, the record, the row and the position committed together.
    let fresh = apply_at(&c, &mut client, schema, &message("m-2"), 2).await;
    ensure!(one_trip(&fresh) == Some(true), "m-2: {fresh:?}");
    ensure!(offset(&c, &client, 0).await? == Some(2), "after m-2");
    ensure!(order_rows(&client, schema, "m-2").await? == 1, "m-2's row");
    ensure!(c.get(&client, "m-2").await?.is_some(), "m-2's record");
    // A duplicate, and a conflict, write nothing: the position stays, as it does for a claim
    // that is not won.
    let again = apply_at(&c, &mut client, schema, &message("m-2"), 3).await;
    ensure!(
        matches!(again, Ok(Outcome::Duplicate { .. })),
        "m-2 again: {again:?}"
    );
    let reused = Message::new("m-2", Fingerprint::of(b"other body"));
    let conflict = apply_at(&c, &mut client, schema, &reused, 3).await;
    ensure!(
        matches!(conflict, Ok(Outcome::Conflict { .. })),
        "m-2 reused: {conflict:?}"
    );
    ensure!(
        offset(&c, &client, 0).await? == Some(2),
        "moved by a duplicate or a conflict"
    );
    // A key held by a claim in flight: InProgress, nothing written.
    let mut holder = connect(url).await?;
    let Outcome::Fresh(held) = c.begin(&mut holder, "m-6", Fingerprint::of(b"m-6")).await? else {
        return Err("m-6: not fresh".into());
    };
    let busy = apply_at(&c, &mut client, schema, &message("m-6"), 9).await;
    ensure!(
        matches!(busy, Ok(Outcome::InProgress { .. })),
        "m-6 held: {busy:?}"
    );
    held.abort().await?;
    ensure!(
        offset(&c, &client, 0).await? == Some(2),
        "moved by InProgress"
    );
    // A stale reader, behind the stored position: refused, nothing of it written, its key
    // free again; at the stored offset it is accepted.
    let stale = apply_at(&c, &mut client, schema, &message("m-3"), 1).await;
    ensure!(behind(&stale) == Some((0, 2, 1)), "m-3 behind: {stale:?}");
    ensure!(c.get(&client, "m-3").await?.is_none(), "m-3's record");
    ensure!(order_rows(&client, schema, "m-3").await? == 0, "m-3's row");
    let level = apply_at(&c, &mut client, schema, &message("m-3"), 2).await;
    ensure!(
        one_trip(&level) == Some(true),
        "m-3 at the stored offset: {level:?}"
    );
    // A failing statement of the caller's: nothing written, the position included.
    client
        .execute(
            &format!("INSERT INTO {schema}.orders (id, body) VALUES ('m-7', 'there')"),
            &[],
        )
        .await?;
    let failed = apply_at(&c, &mut client, schema, &message("m-7"), 7).await;
    ensure!(
        matches!(failed, Err(Error::Postgres(_))),
        "m-7's failing insert: {failed:?}"
    );
    ensure!(c.get(&client, "m-7").await?.is_none(), "m-7's record");
    ensure!(
        offset(&c, &client, 0).await? == Some(2),
        "moved by a failure"
    );
    // The long way (an entity's version): the position with the claim's commit, and refused
    // behind it as well, the entity's version unrecorded then.
    let versioned = message("m-4").version("e", 1);
    let long_way = apply_at(&c, &mut client, schema, &versioned, 5).await;
    ensure!(one_trip(&long_way) == Some(false), "m-4: {long_way:?}");
    ensure!(offset(&c, &client, 0).await? == Some(5), "after m-4");
    let stale = message("m-5").version("e", 2);
    let refused = apply_at(&c, &mut client, schema, &stale, 4).await;
    ensure!(
        behind(&refused) == Some((0, 5, 4)),
        "m-5 behind: {refused:?}"
    );
    ensure!(
        c.get(&client, "m-5").await?.is_none() && order_rows(&client, schema, "m-5").await? == 0,
        "m-5 written"
    );
    let retried = apply_at(&c, &mut client, schema, &stale, 6).await;
    ensure!(
        one_trip(&retried) == Some(false),
        "m-5 again, version 2 still new: {retried:?}"
    );
    ensure!(offset(&c, &client, 0).await? == Some(6), "after m-5");
    // Bad positions, refused before anything is sent.
    for (source, at) in [
        ("", 1),
        ("orders", idemdb_postgres::POSITION_OFFSET_MAX + 1),
    ] {
        let refused = c
            .apply_at(
                &mut client,
                &message("m-8"),
                ReadPosition::new(source, 0, at),
                b"ok",
                &[],
            )
            .await;
        ensure!(
            matches!(
                refused,
                Err(Error::Idemdb(
                    idemdb::Error::LimitExceeded { .. } | idemdb::Error::InvalidArgument { .. }
                ))
            ),
            "{source:?} at {at}: {refused:?}"
        );
    }
    ensure!(c.get(&client, "m-8").await?.is_none(), "m-8's record");
    Ok(())
}

/// Checks `counts` against (imported, advanced, overwritten, skipped).
fn expect_counts(
    counts: idemdb_postgres::PositionImportCounts,
    expected: (u64, u64, u64, u64),
) -> Result<(), Failure> {
    let got = (
        counts.imported,
        counts.advanced,
        counts.overwritten,
        counts.skipped,
    );
    ensure!(got == expected, "counts {got:?}, expected {expected:?}");
    Ok(())
}

pub async fn an_import_moves_positions_forward_only_and_waits_for_a_writer_of_the_row(
    url: &str,
) -> Result<(), Failure> {
    use idemdb::Position;
    use idemdb::transfer::TransferPosition;
    let schema = "t_positions_import";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let c = store.consumer("c")?;
    let d = store.consumer("d")?;
    commit_at(&c, &mut client, schema, "k1", 0, 10).await??;
    let given = |consumer: &str, partition: u32, offset: u64| {
        TransferPosition::new(
            consumer.as_bytes().to_vec(),
            Position::new("orders", partition, offset, 1_000),
        )
    };

    // Behind the stored one: kept. New partitions and consumers: written, time as given.
    let counts = store
        .import_positions(
            &mut client,
            &[given("c", 0, 5)?, given("c", 1, 3)?, given("d", 0, 7)?],
            false,
        )
        .await?;
    expect_counts(counts, (2, 0, 0, 1))?;
    ensure!(offset(&c, &client, 0).await? == Some(10), "kept ahead");
    ensure!(offset(&c, &client, 1).await? == Some(3), "imported");
    let moved = d.positions().get(&client, "orders", 0).await?;
    ensure!(
        moved.as_ref().map(|p| (p.offset, p.updated_at_ms)) == Some((7, 1_000)),
        "imported with its time: {moved:?}"
    );
    // Equal: kept. Ahead: advanced, and a consumer's later commit is held to it.
    expect_counts(
        store
            .import_positions(&mut client, &[given("c", 0, 10)?], false)
            .await?,
        (0, 0, 0, 1),
    )?;
    expect_counts(
        store
            .import_positions(&mut client, &[given("c", 0, 20)?], false)
            .await?,
        (0, 1, 0, 0),
    )?;
    let stale = commit_at(&c, &mut client, schema, "k2", 0, 15).await?;
    ensure!(
        behind(&stale) == Some((0, 20, 15)),
        "a commit behind the imported position is refused: {stale:?}"
    );
    // Overwrite: backwards too.
    expect_counts(
        store
            .import_positions(&mut client, &[given("c", 0, 2)?, given("c", 2, 1)?], true)
            .await?,
        (1, 0, 1, 0),
    )?;
    ensure!(offset(&c, &client, 0).await? == Some(2), "overwritten");

    // Refused before anything is written: an offset past bigint, a position given twice.
    for refused in [
        vec![given("c", 3, 1)?, given("c", 0, u64::MAX)?],
        vec![given("c", 3, 1)?, given("c", 0, 9)?, given("c", 0, 9)?],
    ] {
        match store.import_positions(&mut client, &refused, true).await {
            Err(Error::NotImportable { position, .. }) => {
                ensure!(position >= 2, "names the bad position: {position}")
            }
            other => return Err(format!("expected NotImportable, got {other:?}").into()),
        }
        ensure!(offset(&c, &client, 3).await?.is_none(), "nothing written");
        ensure!(offset(&c, &client, 0).await? == Some(2), "nothing written");
    }

    // A writer of the row holds it (a consumer's commit in flight): the import waits for it
    // and compares against what it committed, so its count says what happened.
    let mut holder = connect(url).await?;
    let held = holder.transaction().await?;
    held.execute(
        &format!(
            "UPDATE {schema}.records_position SET read_offset = 30 \
             WHERE consumer = 'c'::bytea AND source = 'orders' AND partition = 0"
        ),
        &[],
    )
    .await?;
    let importer = {
        let store = store.clone();
        let url = url.to_owned();
        let position = given("c", 0, 25)?;
        tokio::spawn(async move {
            let mut client = connect(&url).await?;
            Ok::<_, Failure>(
                store
                    .import_positions(&mut client, &[position], false)
                    .await?,
            )
        })
    };
    let mut waiting = false;
    for _ in 0..2_000 {
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND datname = current_database()",
                &[],
            )
            .await?;
        if row.get::<_, i64>(0) > 0 {
            waiting = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    ensure!(waiting, "the import never waited for the row's writer");
    held.commit().await?;
    expect_counts(importer.await??, (0, 0, 0, 1))?;
    ensure!(
        offset(&c, &client, 0).await? == Some(30),
        "the writer's offset stays"
    );
    Ok(())
}
