//! idemdb-postgres against a real PostgreSQL server (Debian's, started privately by
//! `support/server.rs`; skipped with a message where none is installed). One server for every
//! scenario; each scenario has a schema of its own.
//!
//! Scenarios: schema installation and versioning; outcomes (fresh, duplicate, conflict) with
//! the business row in the claim's transaction; a dropped claim and a failed business
//! statement leave nothing; a held key is `InProgress` at once; expiry at the millisecond and
//! the re-claim of an expired key; a race of many connections over the same keys, where every
//! key has exactly one winner and one business row, among connections of one process and among
//! separate OS processes; external claims: leases, takeover after the
//! lease ran out, and fencing of the stale holder.

#[path = "support/server.rs"]
mod server;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idemdb::{Fingerprint, MockClock, Outcome};
use idemdb_postgres::{Error, Names, PgStore, SCHEMA_VERSION, install};
use tokio_postgres::{Client, NoTls};

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// Set in the processes the cross-process race starts: they run `race_worker` and exit.
const RACE_CHILD_ENV: &str = "IDEMDB_PG_RACE_CHILD";

fn main() {
    if let Ok(url) = std::env::var(RACE_CHILD_ENV) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        match runtime.block_on(race_worker(&url)) {
            Ok(()) => return,
            Err(error) => {
                eprintln!("race worker: {error}");
                std::process::exit(1);
            }
        }
    }
    let server = match server::Server::start() {
        Ok(server) => server,
        Err(why) => {
            println!("idemdb-postgres tests skipped: cannot start PostgreSQL ({why})");
            return;
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    let url = server.url();
    let mut failed = 0;
    macro_rules! scenario {
        ($name:ident) => {
            let result = runtime.block_on($name(&url));
            match result {
                Ok(()) => println!("test {} ... ok", stringify!($name)),
                Err(error) => {
                    failed += 1;
                    println!("test {} ... FAILED: {error}", stringify!($name));
                }
            }
        };
    }
    scenario!(install_is_versioned_and_refuses_a_newer_schema);
    scenario!(outcomes_with_the_business_row_in_the_claims_transaction);
    scenario!(a_dropped_claim_or_a_failed_statement_leaves_nothing);
    scenario!(a_held_key_is_in_progress_at_once);
    scenario!(an_expired_key_is_claimable_again_at_its_expiry_millisecond);
    scenario!(many_connections_racing_for_the_same_keys_have_one_winner_each);
    scenario!(external_claims_are_leased_taken_over_and_fenced);
    scenario!(processes_racing_for_the_same_keys_have_one_winner_each);
    scenario!(an_external_claim_is_released_or_its_failure_recorded);
    if failed > 0 {
        eprintln!(
            "{failed} scenario(s) failed; server log: {}",
            server.log().display()
        );
        drop(server);
        std::process::exit(1);
    }
    println!("test result: ok. 9 passed; 0 failed");
}

async fn connect(url: &str) -> Result<Client, Failure> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// A schema of the scenario's own, installed, with a business table `<schema>.orders`.
async fn fresh_schema(client: &mut Client, schema: &str) -> Result<Names, Failure> {
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await?;
    let names = Names::new(schema, "records")?;
    install(client, &names).await?;
    client
        .batch_execute(&format!(
            "CREATE TABLE {schema}.orders (id text PRIMARY KEY, body text NOT NULL)"
        ))
        .await?;
    Ok(names)
}

macro_rules! ensure {
    ($condition:expr, $($message:tt)*) => {
        if !$condition {
            return Err(format!($($message)*).into());
        }
    };
}

async fn install_is_versioned_and_refuses_a_newer_schema(url: &str) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    client
        .batch_execute("DROP SCHEMA IF EXISTS t_install CASCADE")
        .await?;
    let names = Names::new("t_install", "records")?;
    let missing = PgStore::builder().names(names.clone()).open(&client).await;
    ensure!(
        matches!(missing, Err(Error::SchemaMissing { .. })),
        "before install: {missing:?}"
    );
    install(&mut client, &names).await?;
    install(&mut client, &names).await?; // a second install changes nothing
    PgStore::builder()
        .names(names.clone())
        .open(&client)
        .await?;
    // Several installers at once take turns.
    client
        .batch_execute("DROP SCHEMA t_install CASCADE")
        .await?;
    let mut installers = Vec::new();
    for _ in 0..4 {
        let url = url.to_owned();
        let names = names.clone();
        installers.push(tokio::spawn(async move {
            let mut client = connect(&url).await?;
            install(&mut client, &names).await?;
            Ok::<(), Failure>(())
        }));
    }
    for installer in installers {
        installer.await??;
    }
    PgStore::builder()
        .names(names.clone())
        .open(&client)
        .await?;
    // Tables written by a newer release are refused, by open and by install, and untouched.
    client
        .batch_execute(&format!(
            "UPDATE t_install.records_version SET version = {}",
            SCHEMA_VERSION + 1
        ))
        .await?;
    let newer = PgStore::builder().names(names.clone()).open(&client).await;
    ensure!(
        matches!(newer, Err(Error::SchemaTooNew { .. })),
        "newer at open: {newer:?}"
    );
    let newer = install(&mut client, &names).await;
    ensure!(
        matches!(newer, Err(Error::SchemaTooNew { .. })),
        "newer at install: {newer:?}"
    );
    for bad in ["", "Upper", "1st", "semi;colon", "a-b", &"x".repeat(56)] {
        let refused = Names::new(bad, "records");
        ensure!(
            matches!(refused, Err(Error::InvalidName { .. })),
            "{bad:?}: {refused:?}"
        );
    }
    Ok(())
}

async fn outcomes_with_the_business_row_in_the_claims_transaction(
    url: &str,
) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, "t_outcomes").await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let billing = store.consumer("billing")?;
    let body = Fingerprint::of(b"order 1");
    match billing.begin(&mut client, "order-1", body).await? {
        Outcome::Fresh(claim) => {
            ensure!(claim.epoch() == 1, "epoch {}", claim.epoch());
            claim
                .transaction()
                .execute(
                    "INSERT INTO t_outcomes.orders (id, body) VALUES ('order-1', 'one')",
                    &[],
                )
                .await?;
            claim.commit(b"accepted").await?;
        }
        other => return Err(format!("first delivery: {other:?}").into()),
    }
    match billing.begin(&mut client, "order-1", body).await? {
        Outcome::Duplicate { result, epoch, .. } => {
            ensure!(
                result.as_ref() == b"accepted" && epoch == 1,
                "{result:?} {epoch}"
            );
        }
        other => return Err(format!("redelivery: {other:?}").into()),
    }
    // A database whose sessions default to another isolation level changes nothing: claims run
    // READ COMMITTED.
    client
        .batch_execute("SET default_transaction_isolation = 'repeatable read'")
        .await?;
    let outcome = billing.begin(&mut client, "order-1", body).await?;
    ensure!(
        matches!(outcome, Outcome::Duplicate { .. }),
        "under a repeatable-read default: {outcome:?}"
    );
    drop(outcome);
    client
        .batch_execute("SET default_transaction_isolation = 'read committed'")
        .await?;
    let other_body = Fingerprint::of(b"order 1, changed");
    match billing.begin(&mut client, "order-1", other_body).await? {
        Outcome::Conflict {
            stored_fingerprint,
            new_fingerprint,
            ..
        } => ensure!(
            stored_fingerprint == body && new_fingerprint == other_body,
            "fingerprints"
        ),
        other => return Err(format!("reuse with other content: {other:?}").into()),
    }
    // Another consumer has its own record of the same key.
    let shipping = store.consumer("shipping")?;
    let outcome = shipping.begin(&mut client, "order-1", body).await?;
    ensure!(
        matches!(outcome, Outcome::Fresh(_)),
        "another consumer: {outcome:?}"
    );
    drop(outcome);
    let rows: i64 = client
        .query_one("SELECT count(*) FROM t_outcomes.orders", &[])
        .await?
        .get(0);
    ensure!(rows == 1, "{rows} order rows");
    // Bad input is a typed error, not a panic.
    let too_long = billing
        .begin(&mut client, vec![b'k'; 5000], body)
        .await
        .map(|_| ());
    ensure!(
        matches!(
            too_long,
            Err(Error::Idemdb(idemdb::Error::LimitExceeded { .. }))
        ),
        "{too_long:?}"
    );
    ensure!(
        matches!(store.consumer(""), Err(Error::Idemdb(_))),
        "empty consumer id"
    );
    Ok(())
}

async fn a_dropped_claim_or_a_failed_statement_leaves_nothing(url: &str) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, "t_abort").await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let consumer = store.consumer("c")?;
    let body = Fingerprint::of(b"m");
    if let Outcome::Fresh(claim) = consumer.begin(&mut client, "m-1", body).await? {
        claim
            .transaction()
            .execute("INSERT INTO t_abort.orders VALUES ('m-1', 'x')", &[])
            .await?;
        drop(claim); // a transient failure: the broker will redeliver
    } else {
        return Err("first claim not fresh".into());
    }
    // A failed business statement: the commit fails and writes nothing.
    if let Outcome::Fresh(claim) = consumer.begin(&mut client, "m-1", body).await? {
        let bad = claim
            .transaction()
            .execute("INSERT INTO t_abort.no_such_table VALUES (1)", &[])
            .await;
        ensure!(bad.is_err(), "the bad statement failed");
        let committed = claim.commit(b"ok").await;
        ensure!(
            matches!(committed, Err(Error::Postgres(_))),
            "commit after a failed statement: {committed:?}"
        );
    } else {
        return Err("claim after the drop not fresh".into());
    }
    ensure!(consumer.get(&client, "m-1").await?.is_none(), "no record");
    let rows: i64 = client
        .query_one("SELECT count(*) FROM t_abort.orders", &[])
        .await?
        .get(0);
    ensure!(rows == 0, "{rows} rows left");
    // And the key is free: processed now.
    match consumer.begin(&mut client, "m-1", body).await? {
        Outcome::Fresh(claim) => claim.commit(b"ok").await?,
        other => return Err(format!("after the failures: {other:?}").into()),
    }
    Ok(())
}

async fn a_held_key_is_in_progress_at_once(url: &str) -> Result<(), Failure> {
    let mut holder = connect(url).await?;
    let mut other = connect(url).await?;
    let names = fresh_schema(&mut holder, "t_held").await?;
    let store = PgStore::builder().names(names).open(&holder).await?;
    let consumer = store.consumer("c")?;
    let body = Fingerprint::of(b"m");
    let Outcome::Fresh(claim) = consumer.begin(&mut holder, "k", body).await? else {
        return Err("holder's claim not fresh".into());
    };
    // Bounded by a timeout only so that a regression fails instead of hanging: the answer
    // comes without waiting for the holder.
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.begin(&mut other, "k", body),
    )
    .await??;
    ensure!(
        matches!(outcome, Outcome::InProgress { holder: None, .. }),
        "while held: {outcome:?}"
    );
    drop(outcome);
    claim.commit(b"done").await?;
    let outcome = consumer.begin(&mut other, "k", body).await?;
    ensure!(
        matches!(outcome, Outcome::Duplicate { .. }),
        "after the commit: {outcome:?}"
    );
    Ok(())
}

async fn an_expired_key_is_claimable_again_at_its_expiry_millisecond(
    url: &str,
) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, "t_expiry").await?;
    let clock = MockClock::new(1_000_000);
    let store = PgStore::builder()
        .names(names)
        .retention(Duration::from_millis(500))
        .clock(clock.clone())
        .open(&client)
        .await?;
    let consumer = store.consumer("c")?;
    let body = Fingerprint::of(b"m");
    match consumer.begin(&mut client, "k", body).await? {
        Outcome::Fresh(claim) => claim.commit(b"first").await?,
        other => return Err(format!("first: {other:?}").into()),
    }
    clock.set(1_000_499);
    let outcome = consumer.begin(&mut client, "k", body).await?;
    ensure!(
        matches!(
            outcome,
            Outcome::Duplicate {
                expires_at_ms: 1_000_500,
                ..
            }
        ),
        "one millisecond before expiry: {outcome:?}"
    );
    drop(outcome);
    clock.set(1_000_500);
    match consumer.begin(&mut client, "k", body).await? {
        Outcome::Fresh(claim) => {
            ensure!(claim.epoch() == 2, "the re-claim replaces epoch 1");
            claim.commit(b"second").await?;
        }
        other => return Err(format!("at expiry: {other:?}").into()),
    }
    match consumer.begin(&mut client, "k", body).await? {
        Outcome::Duplicate { result, epoch, .. } => {
            ensure!(
                result.as_ref() == b"second" && epoch == 2,
                "{result:?} {epoch}"
            );
        }
        other => return Err(format!("after the re-claim: {other:?}").into()),
    }
    let rows: i64 = client
        .query_one("SELECT count(*) FROM t_expiry.records", &[])
        .await?
        .get(0);
    ensure!(rows == 1, "one row per key, found {rows}");
    Ok(())
}

async fn many_connections_racing_for_the_same_keys_have_one_winner_each(
    url: &str,
) -> Result<(), Failure> {
    const CONNECTIONS: usize = 8;
    const KEYS: usize = 300;
    const ROUNDS: usize = 3;
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, "t_race").await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let consumer = store.consumer("c")?;
    let wins = Arc::new(std::sync::Mutex::new(HashMap::<usize, usize>::new()));
    let mut workers = Vec::new();
    for _ in 0..CONNECTIONS {
        let (url, consumer, wins) = (url.to_owned(), consumer.clone(), wins.clone());
        workers.push(tokio::spawn(async move {
            let mut client = connect(&url).await?;
            // Sessions defaulting to another isolation level: claims must still read after
            // the lock (READ COMMITTED), or they miss the previous holder's commit.
            client
                .batch_execute("SET default_transaction_isolation = 'repeatable read'")
                .await?;
            let mut in_progress = 0usize;
            for _ in 0..ROUNDS {
                for key in 0..KEYS {
                    // Every worker walks the same keys in the same order: they meet on each.
                    let name = format!("k-{key}");
                    let body = Fingerprint::of(name.as_bytes());
                    match consumer.begin(&mut client, &name, body).await? {
                        Outcome::Fresh(claim) => {
                            claim
                                .transaction()
                                .execute(
                                    "INSERT INTO t_race.orders (id, body) VALUES ($1, 'x')",
                                    &[&name],
                                )
                                .await?;
                            // Hold the key a moment so that others find it held.
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            claim.commit(b"ok").await?;
                            *wins.lock().expect("wins").entry(key).or_default() += 1;
                        }
                        Outcome::InProgress { .. } => in_progress += 1,
                        Outcome::Duplicate { .. } => {}
                        other => return Err(format!("{name}: {other:?}").into()),
                    }
                }
            }
            Ok::<usize, Failure>(in_progress)
        }));
    }
    let mut in_progress = 0;
    for worker in workers {
        in_progress += worker.await??;
    }
    let wins = wins.lock().expect("wins").clone();
    let twice: Vec<_> = wins.iter().filter(|(_, n)| **n > 1).collect();
    ensure!(twice.is_empty(), "keys won more than once: {twice:?}");
    // A key every worker found held or done may have no winner yet: claim the rest now.
    let rows: i64 = client
        .query_one("SELECT count(*) FROM t_race.orders", &[])
        .await?
        .get(0);
    ensure!(
        rows as usize == wins.len(),
        "{rows} business rows for {} winners",
        wins.len()
    );
    println!(
        "    race: {CONNECTIONS} connections x {KEYS} keys x {ROUNDS} rounds: {} keys won once, none twice, {in_progress} in-progress answers",
        wins.len()
    );
    ensure!(in_progress > 0, "the race never found a key held");
    Ok(())
}

async fn external_claims_are_leased_taken_over_and_fenced(url: &str) -> Result<(), Failure> {
    let mut a_client = connect(url).await?;
    let mut b_client = connect(url).await?;
    let names = fresh_schema(&mut a_client, "t_external").await?;
    let clock = MockClock::new(1_000_000);
    let store = PgStore::builder()
        .names(names)
        .clock(clock.clone())
        .open(&a_client)
        .await?;
    let consumer = store.consumer("mailer")?;
    let body = Fingerprint::of(b"welcome mail");
    let lease = Duration::from_secs(1);
    let Outcome::Fresh(mut a) = consumer
        .begin_external(&mut a_client, "mail-1", body, lease, "worker-a")
        .await?
    else {
        return Err("first external claim not fresh".into());
    };
    ensure!(a.epoch() == 1 && a.previous_attempt().is_none(), "a: {a:?}");
    // The in-progress record is committed: another process sees the lease.
    match consumer
        .begin_external(&mut b_client, "mail-1", body, lease, "worker-b")
        .await?
    {
        Outcome::InProgress {
            holder,
            lease_until_ms,
            epoch,
            ..
        } => ensure!(
            holder.as_deref() == Some(&b"worker-a"[..])
                && lease_until_ms == Some(1_001_000)
                && epoch == Some(1),
            "{holder:?} {lease_until_ms:?} {epoch:?}"
        ),
        other => return Err(format!("while leased: {other:?}").into()),
    }
    let outcome = consumer.begin(&mut b_client, "mail-1", body).await?;
    ensure!(
        matches!(outcome, Outcome::InProgress { .. }),
        "transactional claim while leased: {outcome:?}"
    );
    drop(outcome);
    ensure!(
        a.renew(&mut a_client, lease * 2).await? == 1_002_000,
        "renewed"
    );
    clock.set(1_001_500);
    let outcome = consumer
        .begin_external(&mut b_client, "mail-1", body, lease, "worker-b")
        .await?;
    ensure!(
        matches!(outcome, Outcome::InProgress { .. }),
        "the renewed lease holds: {outcome:?}"
    );
    drop(outcome);
    // A reconciler sees the claim in progress, with its holder, once it is old enough.
    let other = consumer
        .begin_external(&mut b_client, "mail-0", body, lease, "worker-c")
        .await?;
    ensure!(matches!(other, Outcome::Fresh(_)), "second key: {other:?}");
    let listed = consumer
        .in_progress(&a_client, Duration::ZERO, usize::MAX)
        .await?;
    let keys: Vec<&[u8]> = listed
        .iter()
        .map(|entry| entry.message_key.as_ref())
        .collect();
    ensure!(
        keys == [&b"mail-0"[..], b"mail-1"],
        "in progress: {listed:?}"
    );
    ensure!(
        listed[1].holder.as_ref() == b"worker-a"
            && listed[1].since_ms == 1_000_000
            && listed[1].lease_until_ms == 1_002_000,
        "{:?}",
        listed[1]
    );
    let old = consumer
        .in_progress(&a_client, Duration::from_millis(1_000), usize::MAX)
        .await?;
    ensure!(
        old.len() == 1 && old[0].message_key.as_ref() == b"mail-1",
        "older than 1 s: {old:?}"
    );
    ensure!(
        consumer
            .in_progress(&a_client, Duration::ZERO, 1)
            .await?
            .len()
            == 1,
        "limit"
    );
    // The lease runs out: worker-b takes over, and is told of worker-a's attempt.
    clock.set(1_002_000);
    let Outcome::Fresh(b) = consumer
        .begin_external(&mut b_client, "mail-1", body, lease, "worker-b")
        .await?
    else {
        return Err("takeover not fresh".into());
    };
    let previous = b.previous_attempt().ok_or("no previous attempt")?;
    ensure!(
        b.epoch() == 2 && previous.epoch == 1 && previous.holder.as_ref() == b"worker-a",
        "takeover: {b:?}"
    );
    ensure!(
        a.derive_key("smtp") == b.derive_key("smtp"),
        "the same downstream key for every attempt"
    );
    // worker-a is fenced: its renew and its completion are refused, its SQL never lands.
    let renewed = a.renew(&mut a_client, lease).await;
    ensure!(
        matches!(
            renewed,
            Err(Error::Idemdb(idemdb::Error::LeaseLost { current_epoch: 2 }))
        ),
        "stale renew: {renewed:?}"
    );
    let completion = a.completion(&mut a_client).await.map(|_| ());
    ensure!(
        matches!(
            completion,
            Err(Error::Idemdb(idemdb::Error::LeaseLost { current_epoch: 2 }))
        ),
        "stale completion: {completion:?}"
    );
    // A completion dropped before its commit changes nothing: the claim still holds the key.
    let dropped = b.completion(&mut b_client).await?;
    dropped
        .transaction()
        .execute(
            "INSERT INTO t_external.orders VALUES ('mail-1', 'dropped')",
            &[],
        )
        .await?;
    drop(dropped);
    let completion = b.completion(&mut b_client).await?;
    completion
        .transaction()
        .execute(
            "INSERT INTO t_external.orders VALUES ('mail-1', 'sent')",
            &[],
        )
        .await?;
    completion.commit(b"sent").await?;
    match consumer.begin(&mut a_client, "mail-1", body).await? {
        Outcome::Duplicate { result, epoch, .. } => {
            ensure!(
                result.as_ref() == b"sent" && epoch == 2,
                "{result:?} {epoch}"
            );
        }
        other => return Err(format!("after completion: {other:?}").into()),
    }
    let body_row: String = a_client
        .query_one("SELECT string_agg(body, ',') FROM t_external.orders", &[])
        .await?
        .get(0);
    ensure!(body_row == "sent", "business rows: {body_row}");
    let listed = consumer
        .in_progress(&a_client, Duration::ZERO, usize::MAX)
        .await?;
    ensure!(
        listed.len() == 1 && listed[0].message_key.as_ref() == b"mail-0",
        "a completed claim is no longer in progress: {listed:?}"
    );
    // Bad input.
    let zero = consumer
        .begin_external(&mut a_client, "mail-2", body, Duration::ZERO, "w")
        .await
        .map(|_| ());
    ensure!(
        matches!(
            zero,
            Err(Error::Idemdb(idemdb::Error::LimitExceeded { .. }))
        ),
        "zero lease: {zero:?}"
    );
    let no_holder = consumer
        .begin_external(&mut a_client, "mail-2", body, lease, "")
        .await
        .map(|_| ());
    ensure!(
        matches!(
            no_holder,
            Err(Error::Idemdb(idemdb::Error::LimitExceeded { .. }))
        ),
        "empty holder: {no_holder:?}"
    );
    Ok(())
}

const PROCESS_RACE_KEYS: usize = 400;

/// One process of the cross-process race: claims every key in order, writes the business row
/// of each key it wins, and prints `WON <key>` once the commit returned.
async fn race_worker(url: &str) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    let store = PgStore::builder()
        .names(Names::new("t_processes", "records")?)
        .open(&client)
        .await?;
    let consumer = store.consumer("c")?;
    let mut held = 0;
    for key in 0..PROCESS_RACE_KEYS {
        let name = format!("k-{key}");
        match consumer
            .begin(&mut client, &name, Fingerprint::of(name.as_bytes()))
            .await?
        {
            Outcome::Fresh(claim) => {
                claim
                    .transaction()
                    .execute(
                        "INSERT INTO t_processes.orders (id, body) VALUES ($1, $2)",
                        &[&name, &std::process::id().to_string()],
                    )
                    .await?;
                tokio::time::sleep(Duration::from_millis(1)).await;
                claim.commit(b"ok").await?;
                println!("WON {key}");
            }
            Outcome::InProgress { .. } => held += 1,
            Outcome::Duplicate { .. } => {}
            other => return Err(format!("{name}: {other:?}").into()),
        }
    }
    println!("HELD {held}");
    Ok(())
}

async fn processes_racing_for_the_same_keys_have_one_winner_each(url: &str) -> Result<(), Failure> {
    const PROCESSES: usize = 4;
    let mut client = connect(url).await?;
    fresh_schema(&mut client, "t_processes").await?;
    let children: Vec<std::process::Child> = (0..PROCESSES)
        .map(|_| {
            std::process::Command::new(std::env::current_exe()?)
                .env(RACE_CHILD_ENV, url)
                .stdout(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut wins: HashMap<usize, usize> = HashMap::new();
    let mut held = 0usize;
    for child in children {
        let output = child.wait_with_output()?;
        ensure!(
            output.status.success(),
            "a race process failed: {:?}",
            output.status
        );
        for line in String::from_utf8(output.stdout)?.lines() {
            if let Some(key) = line.strip_prefix("WON ") {
                *wins.entry(key.parse()?).or_default() += 1;
            } else if let Some(n) = line.strip_prefix("HELD ") {
                held += n.parse::<usize>()?;
            }
        }
    }
    let twice: Vec<_> = wins.iter().filter(|(_, n)| **n > 1).collect();
    ensure!(twice.is_empty(), "keys won by two processes: {twice:?}");
    ensure!(
        wins.len() == PROCESS_RACE_KEYS,
        "{} of {PROCESS_RACE_KEYS} keys won (every key is claimable by someone)",
        wins.len()
    );
    let rows: i64 = client
        .query_one("SELECT count(*) FROM t_processes.orders", &[])
        .await?
        .get(0);
    ensure!(rows as usize == PROCESS_RACE_KEYS, "{rows} business rows");
    println!(
        "    processes: {PROCESSES} processes x {PROCESS_RACE_KEYS} keys: every key won once, {held} in-progress answers"
    );
    ensure!(held > 0, "the processes never met on a key");
    Ok(())
}

async fn an_external_claim_is_released_or_its_failure_recorded(url: &str) -> Result<(), Failure> {
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, "t_release").await?;
    let clock = MockClock::new(5_000_000);
    let store = PgStore::builder()
        .names(names)
        .clock(clock.clone())
        .open(&client)
        .await?;
    let consumer = store.consumer("c")?;
    let body = Fingerprint::of(b"m");
    let lease = Duration::from_secs(1);
    // A transient failure: released, the next delivery processes it again at a higher epoch.
    let Outcome::Fresh(claim) = consumer
        .begin_external(&mut client, "transient", body, lease, "w")
        .await?
    else {
        return Err("transient: not fresh".into());
    };
    claim.release(&mut client).await?;
    match consumer.begin(&mut client, "transient", body).await? {
        Outcome::Fresh(claim) => {
            ensure!(
                claim.epoch() == 2,
                "after the release: epoch {}",
                claim.epoch()
            );
            claim.commit(b"done").await?;
        }
        other => return Err(format!("after the release: {other:?}").into()),
    }
    // A permanent failure: recorded, and replayed to redeliveries.
    let Outcome::Fresh(claim) = consumer
        .begin_external(&mut client, "permanent", body, lease, "w")
        .await?
    else {
        return Err("permanent: not fresh".into());
    };
    claim.fail_permanently(&mut client, b"mailbox gone").await?;
    match consumer.begin(&mut client, "permanent", body).await? {
        Outcome::Duplicate {
            result, succeeded, ..
        } => ensure!(
            result.as_ref() == b"mailbox gone" && !succeeded,
            "{result:?} {succeeded}"
        ),
        other => return Err(format!("after the failure: {other:?}").into()),
    }
    // A holder taken over cannot release the new holder's claim.
    let Outcome::Fresh(stale) = consumer
        .begin_external(&mut client, "contested", body, lease, "old")
        .await?
    else {
        return Err("contested: not fresh".into());
    };
    clock.advance(Duration::from_secs(2));
    let Outcome::Fresh(_new) = consumer
        .begin_external(&mut client, "contested", body, lease, "new")
        .await?
    else {
        return Err("contested takeover: not fresh".into());
    };
    let released = stale.release(&mut client).await;
    ensure!(
        matches!(
            released,
            Err(Error::Idemdb(idemdb::Error::LeaseLost { current_epoch: 2 }))
        ),
        "stale release: {released:?}"
    );
    let listed = consumer.in_progress(&client, Duration::ZERO, 10).await?;
    ensure!(
        listed.len() == 1 && listed[0].holder.as_ref() == b"new",
        "the new holder still holds it: {listed:?}"
    );
    Ok(())
}
