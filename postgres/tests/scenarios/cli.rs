//! The `idemdb-pg` operator binary, run as a process against the private server: `positions
//! list`, `set` and `remove` (what each prints, what it changed as the library reads it back,
//! a missing position's removal told with exit code 1, nonsense refused with exit code 2 and
//! nothing changed), and `maintain --busy-percent` (the share it ran at, and values outside
//! 1..=100 refused before anything is removed).

use std::process::{Command, Output};
use std::time::Duration;

use idemdb::{Fingerprint, MockClock, Outcome};
use idemdb_postgres::{PgConsumer, PgStore};
use tokio_postgres::Client;

use super::{Failure, connect, fresh_schema};

/// Runs the `idemdb-pg` built with these tests, with `args`.
fn idemdb_pg(args: &[&str]) -> Result<Output, Failure> {
    Ok(Command::new(env!("CARGO_BIN_EXE_idemdb-pg"))
        .args(args)
        .env_remove("IDEMDB_PG_URL")
        .output()?)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Checks the exit code, naming the output otherwise.
fn expect_code(output: &Output, code: i32, what: &str) -> Result<(), Failure> {
    ensure!(
        output.status.code() == Some(code),
        "{what}: exit {:?}, not {code}; stdout {:?}, stderr {:?}",
        output.status.code(),
        stdout(output),
        stderr(output)
    );
    Ok(())
}

/// The consumer's positions as the library lists them: (source, partition, offset).
async fn listed(
    consumer: &PgConsumer,
    client: &Client,
) -> Result<Vec<(String, u32, u64)>, Failure> {
    Ok(consumer
        .positions()
        .list(client)
        .await?
        .into_iter()
        .map(|position| (position.source, position.partition, position.offset))
        .collect())
}

pub async fn the_operator_tool_lists_sets_and_removes_read_positions(
    url: &str,
) -> Result<(), Failure> {
    let schema = "t_cli_positions";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    let store = PgStore::builder().names(names).open(&client).await?;
    let billing = store.consumer("billing")?;
    let Outcome::Fresh(mut claim) = billing
        .begin(&mut client, "order-1", Fingerprint::of(b"order-1"))
        .await?
    else {
        return Err("order-1: not fresh".into());
    };
    claim.stage_position("orders", 3, 41)?;
    claim.commit(b"ok").await?;
    billing.positions().advance(&client, "orders", 0, 7).await?;
    let run = |words: &[&str]| {
        let mut args = vec!["positions"];
        args.extend_from_slice(words);
        args.extend_from_slice(&["--url", url, "--schema", schema]);
        idemdb_pg(&args)
    };

    let output = run(&["list", "--consumer", "billing"])?;
    expect_code(&output, 0, "list")?;
    let lines: Vec<Vec<String>> = stdout(&output)
        .lines()
        .map(|line| line.split_whitespace().map(str::to_owned).collect())
        .collect();
    ensure!(
        lines.len() == 3
            && lines[0][..5] == ["SOURCE", "PARTITION", "OFFSET", "RESUME", "AT"]
            && lines[1][..4] == ["orders", "0", "7", "8"]
            && lines[2][..4] == ["orders", "3", "41", "42"],
        "list: {:?}",
        stdout(&output)
    );
    let output = run(&["list", "--consumer", "nobody"])?;
    expect_code(&output, 0, "list of a consumer without positions")?;
    ensure!(
        stdout(&output).contains("no read positions for consumer nobody"),
        "{:?}",
        stdout(&output)
    );

    // Backwards, as an operator replays; and a new partition.
    let output = run(&["set", "--consumer", "billing", "orders", "3", "9"])?;
    expect_code(&output, 0, "set backwards")?;
    ensure!(
        stdout(&output).trim()
            == "billing orders partition 3: offset 9 (was offset 41); the consumer resumes at \
                10 when it next starts",
        "{:?}",
        stdout(&output)
    );
    let output = run(&["set", "orders", "5", "0", "--consumer", "billing"])?;
    expect_code(&output, 0, "set of a new partition")?;
    ensure!(
        stdout(&output).contains("(was none)"),
        "{:?}",
        stdout(&output)
    );
    ensure!(
        listed(&billing, &client).await?
            == [
                ("orders".to_owned(), 0, 7),
                ("orders".to_owned(), 3, 9),
                ("orders".to_owned(), 5, 0)
            ],
        "after set: {:?}",
        listed(&billing, &client).await?
    );
    // The consumer goes on from the position set: behind it refused, past it accepted.
    let behind = billing.positions().advance(&client, "orders", 3, 8).await;
    ensure!(
        matches!(
            behind,
            Err(idemdb_postgres::Error::Idemdb(
                idemdb::Error::PositionBehind { stored: 9, .. }
            ))
        ),
        "behind the position set: {behind:?}"
    );
    billing
        .positions()
        .advance(&client, "orders", 3, 10)
        .await?;

    let output = run(&["remove", "--consumer", "billing", "orders", "5"])?;
    expect_code(&output, 0, "remove")?;
    ensure!(
        stdout(&output).trim()
            == "billing orders partition 5: removed (was offset 0); the consumer starts \
                without a position",
        "{:?}",
        stdout(&output)
    );
    let output = run(&["remove", "--consumer", "billing", "orders", "5"])?;
    expect_code(&output, 1, "remove of a missing position")?;
    ensure!(
        stdout(&output).contains("billing orders partition 5: no position stored, nothing removed"),
        "{:?}",
        stdout(&output)
    );
    let expected = [("orders".to_owned(), 0, 7), ("orders".to_owned(), 3, 10)];
    ensure!(
        listed(&billing, &client).await? == expected,
        "after remove: {:?}",
        listed(&billing, &client).await?
    );

    // Nonsense: refused with code 2 and a sentence that names what is wrong; nothing changes.
    let long_source = "s".repeat(idemdb::POSITION_SOURCE_BYTES_MAX + 1);
    let past_max = (idemdb_postgres::POSITION_OFFSET_MAX + 1).to_string();
    let refused: [(&[&str], &str); 16] = [
        (
            &["set", "--consumer", "billing", "orders", "3", "-1"],
            "OFFSET takes",
        ),
        (
            &["set", "--consumer", "billing", "orders", "3", "ten"],
            "OFFSET takes",
        ),
        (
            &["set", "--consumer", "billing", "orders", "3", &past_max],
            "OFFSET takes",
        ),
        (
            &["set", "--consumer", "billing", "orders", "x", "1"],
            "PARTITION takes",
        ),
        (
            &["set", "--consumer", "billing", "orders", "4294967296", "1"],
            "PARTITION takes",
        ),
        (
            &["set", "--consumer", "billing", "orders", "3"],
            "SOURCE PARTITION OFFSET",
        ),
        (
            &["set", "--consumer", "billing", "orders", "3", "1", "2"],
            "SOURCE PARTITION OFFSET",
        ),
        (
            &["set", "--consumer", "billing", "", "3", "1"],
            "SOURCE is empty",
        ),
        (
            &["set", "--consumer", "billing", &long_source, "3", "1"],
            "source",
        ),
        (&["set", "orders", "3", "1"], "needs --consumer"),
        (&["set", "--consumer", "", "orders", "3", "1"], "consumer"),
        (
            &["remove", "--consumer", "billing", "orders"],
            "SOURCE PARTITION",
        ),
        (&["list", "--consumer", "billing", "orders"], "no operands"),
        (&["list"], "needs --consumer"),
        (&["reset", "--consumer", "billing"], "list, set or remove"),
        (&[], "list, set or remove"),
    ];
    for (words, says) in refused {
        let output = run(words)?;
        expect_code(&output, 2, &format!("positions {words:?}"))?;
        ensure!(
            stderr(&output)
                .to_lowercase()
                .contains(&says.to_lowercase()),
            "positions {words:?}: {:?} does not say {says:?}",
            stderr(&output)
        );
    }
    ensure!(
        listed(&billing, &client).await? == expected,
        "after the refusals: {:?}",
        listed(&billing, &client).await?
    );
    Ok(())
}

pub async fn the_operator_tools_maintain_runs_at_the_busy_share_it_is_given(
    url: &str,
) -> Result<(), Failure> {
    const DAY_MS: u64 = 24 * 3600 * 1000;
    let schema = "t_cli_maintain";
    let mut client = connect(url).await?;
    let names = fresh_schema(&mut client, schema).await?;
    // Records committed ten days ago with an hour's retention: expired by the database's
    // clock, which the tool goes by.
    let now_ms = u64::try_from(
        client
            .query_one(
                "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8",
                &[],
            )
            .await?
            .get::<_, i64>(0),
    )?;
    let past = PgStore::builder()
        .names(names.clone())
        .retention(Duration::from_secs(3600))
        .clock(MockClock::new(now_ms - 10 * DAY_MS))
        .open(&client)
        .await?;
    let old = past.consumer("c")?;
    for key in ["old-1", "old-2", "old-3"] {
        super::commit_one(&old, &mut client, key, key, "ok").await?;
    }
    let live = PgStore::builder().names(names).open(&client).await?;
    super::commit_one(&live.consumer("c")?, &mut client, "live", "live", "ok").await?;
    let rows = async || -> Result<i64, Failure> {
        Ok(client
            .query_one(&format!("SELECT count(*) FROM {schema}.records"), &[])
            .await?
            .get(0))
    };
    let run = |words: &[&str]| {
        let mut args = vec!["maintain", "--url", url, "--schema", schema];
        args.extend_from_slice(words);
        idemdb_pg(&args)
    };

    // Outside 1..=100, or not a whole number: refused before anything is removed.
    for value in ["0", "101", "-5", "ten", "50.5", "", "1000"] {
        let output = run(&["--busy-percent", value])?;
        expect_code(&output, 2, &format!("--busy-percent {value:?}"))?;
        ensure!(
            stderr(&output).contains("--busy-percent takes a whole number from 1 to 100"),
            "--busy-percent {value:?}: {:?}",
            stderr(&output)
        );
    }
    let output = run(&["--busy-percent"])?;
    expect_code(&output, 2, "--busy-percent without a value")?;
    ensure!(
        stderr(&output).contains("--busy-percent needs a value"),
        "{:?}",
        stderr(&output)
    );
    let output = idemdb_pg(&[
        "export",
        "--url",
        url,
        "--schema",
        schema,
        "--busy-percent",
        "5",
    ])?;
    expect_code(&output, 2, "export --busy-percent")?;
    ensure!(rows().await? == 4, "removed by a refused call");

    let output = run(&["--busy-percent", "100"])?;
    expect_code(&output, 0, "maintain --busy-percent 100")?;
    ensure!(
        stdout(&output).trim() == "removed 3 expired records in 1 batches, busy 100% of the time",
        "{:?}",
        stdout(&output)
    );
    ensure!(rows().await? == 1, "the live record only");
    let output = run(&[])?;
    expect_code(&output, 0, "maintain")?;
    ensure!(
        stdout(&output).trim() == "removed 0 expired records in 1 batches, busy 10% of the time",
        "{:?}",
        stdout(&output)
    );
    let output = run(&["--busy-percent", "1"])?;
    expect_code(&output, 0, "maintain --busy-percent 1")?;
    ensure!(
        stdout(&output).contains("busy 1% of the time"),
        "{:?}",
        stdout(&output)
    );
    Ok(())
}
