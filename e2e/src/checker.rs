//! What the two RabbitMQ end-to-end checkers (`rabbitmq_e2e`, `rabbitmq_handoff`) share: the
//! published plan, the consumer processes' setup, the dead-letter queue, and the check of every
//! order against the stores.

// Each checker uses its own part of this module.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use idemdb::{Engine, Fingerprint, merge_ops};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};

pub use crate::orders::BoxError;
use crate::orders::{
    DEAD_LETTER_QUEUE, HEADER_ORDER_ID, HEADER_RECEIVED_FINGERPRINT, HEADER_STORED_FINGERPRINT,
    TOTAL_AMOUNT_KEY, order_body, parse_amount,
};

/// A small deterministic generator (splitmix64): the run is reproducible from `--seed`.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }
}

/// One message the producer publishes.
#[derive(Clone)]
pub struct Publish {
    pub order_id: String,
    pub body: String,
}

/// What the producer meant to publish, per order id: the contents (variant 0 first).
pub struct Plan {
    pub messages: Vec<Publish>,
    pub contents: BTreeMap<String, Vec<String>>,
}

/// `orders` distinct orders; `resend_percent` of them published twice with the same content;
/// the first `reused` of them published once more with other content.
pub fn plan(orders: usize, resend_percent: u64, reused: usize, rng: &mut Rng) -> Plan {
    let mut messages = Vec::new();
    let mut contents = BTreeMap::new();
    for n in 0..orders {
        let order_id = format!("order-{n:07}");
        let amount = 1 + rng.below(1000);
        let body = order_body(&order_id, amount, 0);
        let mut variants = vec![body.clone()];
        messages.push(Publish {
            order_id: order_id.clone(),
            body: body.clone(),
        });
        if rng.below(100) < resend_percent {
            // A producer-side resend: same order, same content (a retried publish).
            messages.push(Publish {
                order_id: order_id.clone(),
                body,
            });
        }
        if n < reused {
            // The same order id reused for other content: a conflict for whichever comes second.
            let other = order_body(&order_id, amount + 1, 1);
            variants.push(other.clone());
            messages.push(Publish {
                order_id: order_id.clone(),
                body: other,
            });
        }
        contents.insert(order_id, variants);
    }
    // Fisher-Yates: resends and reuses land anywhere in the stream, before or after the first.
    for i in (1..messages.len()).rev() {
        let j = usize::try_from(rng.below(i as u64 + 1)).expect("index fits");
        messages.swap(i, j);
    }
    Plan { messages, contents }
}

/// Children get SIGKILL if this process dies, so no consumer outlives its run.
pub fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches only the child's own state.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

pub async fn connect(amqp: &str) -> Result<Connection, BoxError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Connection::connect(amqp, ConnectionProperties::default()).await {
            Ok(connection) => return Ok(connection),
            Err(error) if Instant::now() < deadline => {
                eprintln!("checker: waiting for the broker ({error})");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Declares the durable queue `queue` with `arguments`, binds it to `exchange` with
/// `binding_key` if given, and empties it: a run starts from no message.
pub async fn declare_empty_queue(
    channel: &Channel,
    queue: &str,
    arguments: FieldTable,
    binding: Option<(&str, &str)>,
) -> Result<(), BoxError> {
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await?;
    if let Some((exchange, binding_key)) = binding {
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                binding_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    channel
        .queue_purge(queue.into(), QueuePurgeOptions::default())
        .await?;
    Ok(())
}

/// Messages ready in `queues` (not counting those delivered and not yet acked).
pub async fn ready_messages(channel: &Channel, queues: &[String]) -> Result<u64, BoxError> {
    let mut ready = 0;
    for queue in queues {
        // A passive declare only reads the queue: its arguments are not compared.
        let declared = channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        ready += u64::from(declared.message_count());
    }
    Ok(ready)
}

/// Waits until no message is ready in `queues` and `progress` (the consumers' count of work
/// done) has not moved for a second, restarting exited consumers meanwhile. Ten minutes at
/// most.
pub async fn wait_quiet(
    channel: &Channel,
    queues: &[String],
    mut restart_exited: impl FnMut() -> Result<(), BoxError>,
    mut progress: impl FnMut() -> Result<u64, BoxError>,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last = (u64::MAX, Instant::now());
    loop {
        restart_exited()?;
        let ready = ready_messages(channel, queues).await?;
        let done = progress()?;
        if ready > 0 || done != last.0 {
            last = (done, Instant::now());
        } else if last.1.elapsed() >= Duration::from_secs(1) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the queues did not drain ({ready} messages ready)").into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One dead-lettered message as found in the DLQ.
pub struct DeadLetter {
    pub order_id: String,
    pub received: String,
    pub stored: Option<String>,
}

pub fn header(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

pub async fn drain_dead_letters(channel: &Channel) -> Result<Vec<DeadLetter>, BoxError> {
    let mut found = Vec::new();
    while let Some(message) = channel
        .basic_get(DEAD_LETTER_QUEUE.into(), BasicGetOptions::default())
        .await?
    {
        let delivery = message.delivery;
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        found.push(DeadLetter {
            order_id: header(&headers, HEADER_ORDER_ID).unwrap_or_default(),
            received: header(&headers, HEADER_RECEIVED_FINGERPRINT).unwrap_or_default(),
            stored: header(&headers, HEADER_STORED_FINGERPRINT),
        });
        delivery.ack(BasicAckOptions::default()).await?;
    }
    Ok(found)
}

/// What the check of every order against the stores found.
#[derive(Default)]
pub struct Verdict {
    pub effects_applied: u64,
    pub lost: u64,
    pub applied_twice: u64,
    pub wrong_content: u64,
    pub missing_conflicts: u64,
    pub false_conflicts: u64,
    pub conflicts_dead_lettered: u64,
    pub total_mismatches: u64,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.applied_twice == 0
            && self.wrong_content == 0
            && self.missing_conflicts == 0
            && self.false_conflicts == 0
            && self.total_mismatches == 0
    }
}

/// Checks every planned order against all `stores` (name, engine) and the dead letters (see
/// [`check_applied`]), and each store's running total against the amounts of the orders it
/// applied.
pub fn verify(
    stores: &[(String, Engine)],
    plan: &Plan,
    dead_letters: &[DeadLetter],
) -> Result<Verdict, BoxError> {
    let mut tables = Vec::new();
    for (_, engine) in stores {
        tables.push((
            engine.business_table("effects")?,
            engine.business_table("orders")?,
        ));
    }
    let mut applied: HashMap<String, Applied> = HashMap::new();
    let mut expected_totals = vec![0u64; stores.len()];
    for order_id in plan.contents.keys() {
        for (index, (effects, orders)) in tables.iter().enumerate() {
            let here = effects
                .get(order_id)?
                .and_then(|value| merge_ops::read_u64(&value))
                .unwrap_or(0);
            if here == 0 {
                continue;
            }
            let stored = orders.get(order_id)?.unwrap_or_default();
            let stored = String::from_utf8_lossy(&stored).into_owned();
            expected_totals[index] += here * parse_amount(stored.as_bytes()).unwrap_or(0);
            let entry = applied.entry(order_id.clone()).or_insert(Applied {
                times: 0,
                body: stored,
            });
            entry.times += here;
        }
    }
    let mut verdict = check_applied(plan, dead_letters, &applied);
    for (index, (effects, _)) in tables.iter().enumerate() {
        let total = effects
            .get(TOTAL_AMOUNT_KEY)?
            .and_then(|value| merge_ops::read_u64(&value))
            .unwrap_or(0);
        if total != expected_totals[index] {
            verdict.total_mismatches += 1;
            eprintln!(
                "TOTAL MISMATCH in {}: stored {total}, orders applied sum to {}",
                stores[index].0, expected_totals[index]
            );
        }
    }
    Ok(verdict)
}

/// How often an order's effect was applied, over every store, and the content it was applied
/// with (the first store's, when it was applied in several).
pub struct Applied {
    pub times: u64,
    pub body: String,
}

/// Checks every planned order against what was `applied` and the dead letters: each order
/// applied exactly once, with content that was published; every other content dead-lettered
/// with the right fingerprints; nothing dead-lettered without a conflict.
pub fn check_applied(
    plan: &Plan,
    dead_letters: &[DeadLetter],
    applied: &HashMap<String, Applied>,
) -> Verdict {
    let mut verdict = Verdict::default();
    let dead: HashSet<(&str, &str)> = dead_letters
        .iter()
        .map(|letter| (letter.order_id.as_str(), letter.received.as_str()))
        .collect();
    let mut applied_fingerprint: HashMap<&str, String> = HashMap::new();
    for (order_id, variants) in &plan.contents {
        let Some(Applied { times, body }) = applied.get(order_id).filter(|a| a.times > 0) else {
            verdict.lost += 1;
            eprintln!("LOST: {order_id}");
            continue;
        };
        verdict.effects_applied += times;
        if *times > 1 {
            verdict.applied_twice += 1;
            eprintln!("APPLIED {times} TIMES: {order_id}");
        }
        if !variants.contains(body) {
            verdict.wrong_content += 1;
            eprintln!("WRONG CONTENT: {order_id}: {body:?}");
            continue;
        }
        let winner = Fingerprint::of(body).to_string();
        // Every other content published under this id must have been dead-lettered.
        for other in variants.iter().filter(|variant| *variant != body) {
            let fingerprint = Fingerprint::of(other).to_string();
            if !dead.contains(&(order_id.as_str(), fingerprint.as_str())) {
                verdict.missing_conflicts += 1;
                eprintln!("CONFLICT NOT DEAD-LETTERED: {order_id}: {other:?}");
            }
        }
        applied_fingerprint.insert(order_id, winner);
    }
    let mut distinct_conflicts = HashSet::new();
    for letter in dead_letters {
        let winner = applied_fingerprint.get(letter.order_id.as_str());
        let genuine = winner.is_some_and(|winner| {
            *winner != letter.received && letter.stored.as_deref() == Some(winner.as_str())
        });
        if genuine {
            distinct_conflicts.insert((letter.order_id.as_str(), letter.received.as_str()));
        } else {
            verdict.false_conflicts += 1;
            eprintln!(
                "DEAD-LETTERED WITHOUT A CONFLICT: {} received {} stored {:?}",
                letter.order_id, letter.received, letter.stored
            );
        }
    }
    verdict.conflicts_dead_lettered = distinct_conflicts.len() as u64;
    verdict
}

/// The consumer processes of a run, by slot (a shard, or a fleet member). Every one still
/// running is SIGKILLed when this is dropped, so a failing run leaves nothing behind.
pub struct Children {
    slots: Vec<Option<Child>>,
    /// Processes that died of SIGKILL on their own (between a commit and its ack, on purpose).
    pub self_kills: usize,
    /// Processes that exited any other way: a bug even when nothing was lost.
    pub unexpected_exits: usize,
}

impl Children {
    pub fn new(slots: usize) -> Children {
        Children {
            slots: (0..slots).map(|_| None).collect(),
            self_kills: 0,
            unexpected_exits: 0,
        }
    }

    pub fn set(&mut self, slot: usize, child: Child) {
        self.slots[slot] = Some(child);
    }

    pub fn pid(&self, slot: usize) -> Option<u32> {
        self.slots[slot].as_ref().map(Child::id)
    }

    /// Whether a process runs in `slot` (one that has exited is left for
    /// [`Children::exited`]).
    pub fn running(&mut self, slot: usize) -> Result<bool, BoxError> {
        match &mut self.slots[slot] {
            Some(child) => Ok(child.try_wait()?.is_none()),
            None => Ok(false),
        }
    }

    /// SIGKILLs the process in `slot` and returns its pid; `None` if it had exited already
    /// (it is then left for [`Children::exited`], and no kill is counted).
    pub fn kill(&mut self, slot: usize) -> Result<Option<u32>, BoxError> {
        let Some(child) = &mut self.slots[slot] else {
            return Ok(None);
        };
        if child.try_wait()?.is_some() {
            return Ok(None);
        }
        let pid = child.id();
        child.kill()?; // SIGKILL
        child.wait()?;
        self.slots[slot] = None;
        Ok(Some(pid))
    }

    /// Sends `signal` to the process in `slot`, if one runs there.
    pub fn signal(&self, slot: usize, signal: libc::c_int) -> Result<Option<u32>, BoxError> {
        let Some(child) = &self.slots[slot] else {
            return Ok(None);
        };
        let pid = libc::pid_t::try_from(child.id())?;
        // SAFETY: signalling a child of ours by its pid; it has not been waited for yet.
        unsafe { libc::kill(pid, signal) };
        Ok(Some(child.id()))
    }

    /// The slots with no running process (reaped and counted here), to be started again.
    pub fn exited(&mut self) -> Result<Vec<usize>, BoxError> {
        use std::os::unix::process::ExitStatusExt;
        let mut empty = Vec::new();
        for (slot, child) in self.slots.iter_mut().enumerate() {
            if let Some(running) = child {
                let Some(status) = running.try_wait()? else {
                    continue;
                };
                if status.signal() == Some(libc::SIGKILL) {
                    self.self_kills += 1;
                } else {
                    self.unexpected_exits += 1;
                    eprintln!("checker: consumer {slot} exited with {status}; restarting");
                }
                *child = None;
            }
            empty.push(slot);
        }
        Ok(empty)
    }

    /// SIGTERM to every process, then waits: they finish what is in flight and exit. One that
    /// has not stopped within a minute is stuck: it is SIGKILLed and counted unexpected, so a
    /// hang fails the run instead of stalling it.
    pub fn stop_gracefully(&mut self) -> Result<(), BoxError> {
        for slot in 0..self.slots.len() {
            self.signal(slot, libc::SIGTERM)?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for child in &mut self.slots {
            let Some(mut child) = child.take() else {
                continue;
            };
            let status = loop {
                if let Some(status) = child.try_wait()? {
                    break status;
                }
                if Instant::now() > deadline {
                    eprintln!("checker: a consumer did not stop within a minute; SIGKILL");
                    self.unexpected_exits += 1;
                    child.kill()?;
                    break child.wait()?;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            if std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGKILL) {
                self.self_kills += 1;
            } else if !status.success() {
                eprintln!("checker: a consumer stopped with {status}");
                self.unexpected_exits += 1;
            }
        }
        Ok(())
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in self.slots.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
