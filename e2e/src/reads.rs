//! A log consumer's reads of its RabbitMQ stream, checked: the stream-protocol connection, the
//! stream read back from its start as the reference, and, against the `reads` rows the
//! consumers' commits wrote (one per offset and committing process) and their ledger, every
//! offset settled by a commit with the outcome the stream's order makes, and none read again
//! by a later process once an earlier one had committed it. A log has no dead-letter queue: the
//! conflicts recorded in the store stand in for the dead letters of the shared check. The checks
//! take a log read back as (offset, body) pairs, so the Kafka checker runs them on its
//! partitions (read back by `kafka.rs`) as they are.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use idemdb::{Engine, Fingerprint};
use rabbitmq_stream_client::Environment;
use rabbitmq_stream_client::types::OffsetSpecification;

use crate::BoxError;
use crate::amqp::DeadLetter;
use crate::ledger::{self, Event};
use crate::streams::{Placement, conflict_key, order_id_of, read_key};
use crate::supervisor::Supervisor;

/// Connects to the broker's stream port on 127.0.0.1, waiting up to a minute for it to accept
/// connections.
pub async fn connect(port: u16) -> Result<Environment, BoxError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Environment::builder()
            .host("127.0.0.1")
            .port(port)
            .build()
            .await
        {
            Ok(environment) => return Ok(environment),
            Err(error) if Instant::now() < deadline => {
                eprintln!("checker: waiting for the broker's stream port ({error})");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Every message of `stream` from its start: (offset, body), `expected` of them. Thirty
/// seconds without the next one fails the run rather than hang it.
pub async fn read_stream(
    environment: &Environment,
    stream: &str,
    expected: usize,
) -> Result<Vec<(u64, String)>, BoxError> {
    let mut consumer = environment
        .consumer()
        .offset(OffsetSpecification::First)
        .build(stream)
        .await?;
    let mut messages = Vec::with_capacity(expected);
    while messages.len() < expected {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .map_err(|_| format!("{stream}: {} of {expected} messages read", messages.len()))?
            .ok_or("the stream's connection closed")??;
        let body = delivery
            .message()
            .data()
            .map(|data| String::from_utf8_lossy(data).into_owned())
            .unwrap_or_default();
        messages.push((delivery.offset(), body));
    }
    let _ = consumer.handle().close().await;
    Ok(messages)
}

/// The highest offset among a stream's ledger events of `kind` ("commit": committed; "read":
/// read).
pub fn highest_offset(events: &[Event], kind: &str) -> Option<u64> {
    events
        .iter()
        .filter(|event| event.kind == kind)
        .filter_map(|event| event.subject.parse::<u64>().ok())
        .max()
}

/// The highest offset a stream's ledger shows committed: its highest `commit` event, or below
/// a `ready N` (a process starting at N) where the position it was read from is written with
/// the commit or after it, which a SIGKILL between a commit and its `commit` event leaves as
/// the only evidence. With the position at the broker before the commit, `ready N` proves
/// nothing: the offsets below N may be lost.
pub fn committed_through(events: &[Event], placement: Placement) -> Option<u64> {
    let committed = highest_offset(events, "commit");
    if placement == Placement::BrokerBeforeCommit {
        return committed;
    }
    let resumed = highest_offset(events, "ready").and_then(|start| start.checked_sub(1));
    committed.max(resumed)
}

/// How long a log's ledger must stand still, its last offset read, before the
/// broker-before-commit control stops waiting for a commit of it that will never come.
const LEDGER_STILL: Duration = Duration::from_secs(5);

/// Waits (restarting exited consumers) until each log of `reference` (a stream, a shard or a
/// partition: `what`, for the error) is committed to its last offset by its consumers, as the
/// ledger at `ledger_of(log)` shows; five minutes at most. With the position stored at the
/// broker before the commit, a consumer killed between the two never reads that offset again:
/// there a log is done once its last offset was read and its ledger has stood still for a
/// while (what was read and not committed is what the control loses).
pub async fn wait_until_consumed(
    consumers: &mut Supervisor,
    reference: &[Vec<(u64, String)>],
    ledger_of: impl Fn(usize) -> PathBuf,
    placement: Placement,
    what: &str,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut still_since: Vec<(usize, Instant)> = vec![(0, Instant::now()); reference.len()];
    loop {
        consumers.restart_exited()?;
        let mut behind = Vec::new();
        for (log, messages) in reference.iter().enumerate() {
            let last = messages.last().map(|(offset, _)| *offset);
            let events = ledger::read(&ledger_of(log))?;
            let committed = committed_through(&events, placement);
            if last.is_none() || committed >= last {
                continue;
            }
            let read = highest_offset(&events, "read");
            if placement == Placement::BrokerBeforeCommit {
                if events.len() != still_since[log].0 {
                    still_since[log] = (events.len(), Instant::now());
                }
                if read >= last && still_since[log].1.elapsed() >= LEDGER_STILL {
                    continue;
                }
            }
            behind.push(format!(
                "{what} {log}: last offset {last:?}, committed up to {committed:?}, read up to \
                 {read:?}"
            ));
        }
        if behind.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            let (count, behind) = (behind.len(), behind.join("; "));
            let error = format!("{count} {what}(s) not consumed to the end in 300 s ({behind})");
            return Err(error.into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the check of the streams' offsets found, summed over the streams.
#[derive(Default)]
pub struct Reads {
    /// Offsets whose first commit settled them as a duplicate (a true resend).
    pub duplicates: u64,
    /// Offsets the stream's order makes duplicates: a later message of an order with the
    /// content of its first.
    pub duplicates_expected: u64,
    /// Offsets whose first commit settled them with another outcome than the stream's order
    /// makes.
    pub outcome_mismatches: u64,
    /// Offsets no commit settled.
    pub unsettled_offsets: u64,
    /// Reads, by a process, of an offset an earlier process had committed.
    pub read_again: u64,
}

/// Checks one stream's offsets (`reference`, the stream read back) against the `reads` rows
/// its consumers committed and their ledger `events`, and adds what it found to `found`: each
/// offset settled by at least one commit, the first with the outcome the stream's order makes,
/// and no process reading an offset an earlier process had committed.
pub fn check_reads(
    engine: &Engine,
    reference: &[(u64, String)],
    events: &[Event],
    found: &mut Reads,
) -> Result<(), BoxError> {
    let reads = engine.business_table("reads")?;
    // Processes in the order they started.
    let mut started: Vec<u32> = Vec::new();
    for event in events.iter().filter(|event| event.kind == "ready") {
        if !started.contains(&event.pid) {
            started.push(event.pid);
        }
    }
    let rank: HashMap<u32, usize> = started
        .iter()
        .enumerate()
        .map(|(index, pid)| (*pid, index))
        .collect();
    // For each offset, the processes whose commit settled it, with the outcome; and the
    // outcome the stream's order makes: an order's first message is fresh, a later one with
    // its content a duplicate, with other content a conflict.
    let mut committers: BTreeMap<u64, Vec<(u32, String)>> = BTreeMap::new();
    let mut winners: HashMap<&str, &str> = HashMap::new();
    for (offset, body) in reference {
        let order_id = order_id_of(body).unwrap_or_default();
        let expected = match winners.get(order_id) {
            None => {
                winners.insert(order_id, body);
                "fresh"
            }
            Some(winner) if winner == body => "duplicate",
            Some(_) => "conflict",
        };
        if expected == "duplicate" {
            found.duplicates_expected += 1;
        }
        for pid in &started {
            if let Some(outcome) = reads.get(read_key(*offset, *pid))? {
                committers
                    .entry(*offset)
                    .or_default()
                    .push((*pid, String::from_utf8_lossy(&outcome).into_owned()));
            }
        }
        match committers.get(offset) {
            None => found.unsettled_offsets += 1,
            Some(by) => {
                // The first commit's outcome (a later one, of a message read again, finds the
                // first's record).
                let first = by
                    .iter()
                    .min_by_key(|(pid, _)| rank.get(pid).copied().unwrap_or(usize::MAX))
                    .map(|(_, outcome)| outcome.as_str());
                if first == Some("duplicate") {
                    found.duplicates += 1;
                }
                if first != Some(expected) {
                    found.outcome_mismatches += 1;
                    eprintln!(
                        "OUTCOME: offset {offset} ({body}): {first:?}, the stream's order makes \
                         {expected}"
                    );
                }
            }
        }
    }
    for event in events.iter().filter(|event| event.kind == "read") {
        let offset: u64 = event.subject.parse()?;
        let reader = rank.get(&event.pid).copied().unwrap_or(usize::MAX);
        let committed_before = committers.get(&offset).is_some_and(|by| {
            by.iter()
                .any(|(pid, _)| *pid != event.pid && rank.get(pid).copied().unwrap_or(0) < reader)
        });
        if committed_before {
            found.read_again += 1;
        }
    }
    Ok(())
}

/// The conflicts a stream's consumers recorded (its store's `conflicts` table), as the dead
/// letters the shared check expects: each once, with the fingerprint of the content stored
/// under its order id.
pub fn recorded_conflicts(
    engine: &Engine,
    reference: &[(u64, String)],
) -> Result<Vec<DeadLetter>, BoxError> {
    let conflicts = engine.business_table("conflicts")?;
    let orders = engine.business_table("orders")?;
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    for (_, body) in reference {
        let Some(order_id) = order_id_of(body) else {
            continue;
        };
        let fingerprint = Fingerprint::of(body.as_bytes());
        let key = conflict_key(order_id, &fingerprint);
        if !seen.insert(key.clone()) || conflicts.get(&key)?.is_none() {
            continue;
        }
        let stored = orders
            .get(order_id)?
            .map(|winner| Fingerprint::of(&winner).to_string());
        found.push(DeadLetter {
            order_id: order_id.to_owned(),
            received: fingerprint.to_string(),
            stored,
        });
    }
    Ok(found)
}
