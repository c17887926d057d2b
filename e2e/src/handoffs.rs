//! A partitioned fleet's ownership, read from the ledgers (the consumers' `open`, `release`,
//! `active`, `submit`, `fresh`, `lost` lines and the checker's `kill`, `stop`, `cont`): every
//! commit begun by the partition's latest opener, the handoffs and how long each took after a
//! SIGKILL, and what the SIGSTOPped consumer (the zombie) did once it woke: it must notice its
//! lost connection, commit nothing more on its old partitions, and release their stores, which
//! their next owners must have waited for. The checker's own faults go through [`Faults`],
//! which logs each to `ledger-checker.log` before it is done.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::BoxError;
use crate::ledger::{self, Event, Ledger, monotonic_ns};
use crate::report::Report;
use crate::supervisor::Supervisor;

/// The fewest handoffs after a SIGKILL a passing run has timed: fewer means the kills did not
/// hit owners, and the run proved little.
pub const MIN_TIMED_HANDOFFS: usize = 5;

/// Every ledger line of the run in `work` (the consumers' and the checker's), in time order.
pub fn events(work: &Path) -> Result<Vec<Event>, BoxError> {
    ledger::read_all(work, "ledger-")
}

/// How many deliveries the consumers in `work` have handled so far: still growing means still
/// processing. (Backups are not counted: an owner takes one after its last commit.)
pub fn deliveries_handled(work: &Path) -> Result<u64, BoxError> {
    Ok(events(work)?
        .iter()
        .filter(|event| !event.kind.starts_with("checkpoint"))
        .count() as u64)
}

/// The checker's faults, each logged (`kill`, `stop`, `cont`, with the pid as subject) before
/// it is done: the handoff times start from a kill, and the zombie is the stopped process.
pub struct Faults {
    ledger: Ledger,
    work: PathBuf,
}

/// A consumer paused (SIGSTOP) while it owned partitions.
pub struct Paused {
    /// Its slot in the fleet.
    pub slot: usize,
    /// When it was paused.
    pub since: Instant,
    /// Its pid, and when it was stopped on the monotonic clock.
    pid: u32,
    stop_ns: u64,
    /// The partitions it owned then.
    owned: Vec<usize>,
}

impl Faults {
    /// The faults of the run in `work`, logged to its `ledger-checker.log`.
    pub fn open(work: &Path) -> Result<Faults, BoxError> {
        let ledger = Ledger::open(&work.join("ledger-checker.log"))?;
        let work = work.to_owned();
        Ok(Faults { ledger, work })
    }

    /// SIGKILLs the consumer in `slot`, logged first; false if it had exited already.
    pub fn kill(&self, consumers: &mut Supervisor, slot: usize) -> Result<bool, BoxError> {
        if !consumers.running(slot)? {
            return Ok(false);
        }
        if let Some(pid) = consumers.pid(slot) {
            self.ledger.event("kill", &pid.to_string(), None);
        }
        Ok(consumers.kill(slot)?.is_some())
    }

    /// SIGSTOPs the first consumer that owns partitions now, by the ledgers; none if none
    /// does.
    pub fn pause_an_owner(&self, consumers: &Supervisor) -> Result<Option<Paused>, BoxError> {
        let events = &events(&self.work)?;
        let now = monotonic_ns();
        let owner = (0..consumers.slots()).find(|slot| {
            consumers
                .pid(*slot)
                .is_some_and(|pid| !owned_at(events, pid, now).is_empty())
        });
        let Some(slot) = owner else {
            return Ok(None);
        };
        let pid = consumers.pid(slot).unwrap_or(0);
        let stop_ns = monotonic_ns();
        self.signal(consumers, slot, libc::SIGSTOP)?;
        Ok(Some(Paused {
            slot,
            since: Instant::now(),
            pid,
            stop_ns,
            owned: owned_at(events, pid, now),
        }))
    }

    /// Whether a partition the `paused` consumer owned when it was stopped became active on
    /// another consumer since, by the ledgers: the broker noticed the pause and handed it on.
    pub fn handed_on(&self, paused: &Paused) -> Result<bool, BoxError> {
        Ok(events(&self.work)?.iter().any(|event| {
            event.kind == "active"
                && event.pid != paused.pid
                && event.at_ns > paused.stop_ns
                && event.partition.is_some_and(|p| paused.owned.contains(&p))
        }))
    }

    /// SIGCONTs the paused consumer.
    pub fn resume(&self, consumers: &Supervisor, paused: &Paused) -> Result<(), BoxError> {
        self.signal(consumers, paused.slot, libc::SIGCONT)
    }

    /// SIGSTOP or SIGCONT to the consumer in `slot`, logged.
    fn signal(
        &self,
        consumers: &Supervisor,
        slot: usize,
        signal: libc::c_int,
    ) -> Result<(), BoxError> {
        if let Some(pid) = consumers.pid(slot) {
            let kind = if signal == libc::SIGSTOP {
                "stop"
            } else {
                "cont"
            };
            self.ledger.event(kind, &pid.to_string(), None);
            consumers.signal(slot, signal)?;
        }
        Ok(())
    }
}

/// The partitions process `pid` owns at `at_ns`: opened by it and not released since.
pub fn owned_at(events: &[Event], pid: u32, at_ns: u64) -> Vec<usize> {
    let mut owner: BTreeMap<usize, bool> = BTreeMap::new();
    for event in events.iter().take_while(|event| event.at_ns <= at_ns) {
        let (Some(partition), true) = (event.partition, event.pid == pid) else {
            continue;
        };
        match event.kind.as_str() {
            "open" => {
                owner.insert(partition, true);
            }
            "release" => {
                owner.insert(partition, false);
            }
            _ => {}
        }
    }
    // A process that SIGKILLed itself owns nothing any more.
    if events
        .iter()
        .any(|event| event.kind == "self-kill" && event.pid == pid && event.at_ns < at_ns)
    {
        return Vec::new();
    }
    owner
        .into_iter()
        .filter_map(|(partition, owned)| owned.then_some(partition))
        .collect()
}

/// Nearest-rank percentile `p` of `sorted` (ascending); NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What the ledgers say about ownership, handoffs and the zombie.
#[derive(Default)]
pub struct Handoffs {
    /// Opens of a partition by another process than its previous opener.
    pub handoffs: u64,
    /// Kill (of an owner) -> the new owner's first commit on each partition it owned, ms.
    pub to_first_commit_ms: Vec<f64>,
    /// Kill -> the first delivery to the new owner (the broker's detection and redelivery), ms.
    pub to_active_ms: Vec<f64>,
    /// Kills of a process that owned no partition, or whose partitions saw no commit after.
    pub kills_without_handoff: u64,
    /// Handoffs after a kill that overlap the zombie's pause (not in the handoff times).
    pub overlapping_pause: u64,
    /// Commits begun by a process that was not the partition's latest opener (must be 0).
    pub foreign_commits: u64,
    /// What the stopped consumer did, if one was stopped and continued.
    pub zombie: Option<Zombie>,
}

/// What the consumer paused past the heartbeat timeout did, from its SIGSTOP on.
pub struct Zombie {
    /// The partitions it owned when it was stopped.
    pub partitions: Vec<usize>,
    /// SIGSTOP -> first delivery of one of its partitions to another process, ms.
    pub broker_detection_ms: Option<f64>,
    /// SIGCONT -> the zombie notices its connection is gone, ms.
    pub noticed_after_cont_ms: Option<f64>,
    /// SIGCONT -> the zombie SIGKILLs itself at a commit point, before it opened a store again,
    /// ms: its death stands for noticing (if it had not) and for releasing every store it still
    /// held (the system drops a dead process's locks), as a dead process writes neither `lost`
    /// nor `release`.
    pub died_after_cont_ms: Option<f64>,
    /// Commits between SIGCONT and noticing (safe: it still held the stores).
    pub commits_before_noticing: u64,
    /// Commits on its old partitions after it noticed, before it opened them again (must be 0).
    pub commits_after_noticing: u64,
    /// Of its partitions, those it released after noticing.
    pub released: usize,
    /// Of its partitions, those delivered to another process before the zombie released them.
    pub contested: usize,
    /// Of those, the ones opened next (by anyone) only after the zombie released them (must
    /// be all).
    pub held_back: usize,
    /// Its release -> the new owner's first commit, ms (per partition).
    pub release_to_commit_ms: Vec<f64>,
    /// Claims it withheld (did not commit) on waking.
    pub withheld: u64,
}

impl Zombie {
    /// Whether the zombie proved what it is there for: it owned partitions, the broker handed
    /// one on, it noticed (or died), committed nothing after noticing, released every store, and
    /// at least one partition was contested, each contested one opened only after its release.
    pub fn behaved(&self) -> bool {
        self.commits_after_noticing == 0
            && !self.partitions.is_empty()
            && self.released >= self.partitions.len()
            && self.contested > 0
            && self.held_back >= self.contested
            && self.broker_detection_ms.is_some()
            && (self.noticed_after_cont_ms.is_some() || self.died_after_cont_ms.is_some())
    }

    /// Adds the zombie's figures to `report` (whether it behaved is [`Zombie::behaved`]).
    fn report(&self, report: &mut Report) {
        let time = |value: Option<f64>| value.map_or("never".to_owned(), |v| format!("{v:.0} ms"));
        report.figure(
            "zombie: partitions it owned when stopped",
            format!("{:?}", self.partitions),
        );
        report.figure(
            "zombie: SIGSTOP -> broker hands a partition on",
            time(self.broker_detection_ms),
        );
        report.figure(
            "zombie: SIGCONT -> it notices the lost channel",
            time(self.noticed_after_cont_ms),
        );
        if self.died_after_cont_ms.is_some() {
            report.figure(
                "zombie: SIGCONT -> it SIGKILLed itself at a commit point",
                time(self.died_after_cont_ms),
            );
        }
        report.figure(
            "zombie: commits before it noticed (lock held)",
            self.commits_before_noticing,
        );
        report.figure("zombie: claims withheld (not committed)", self.withheld);
        report.figure(
            "zombie: commits after it noticed",
            self.commits_after_noticing,
        );
        report.figure(
            "zombie: stores released",
            format!("{} of {}", self.released, self.partitions.len()),
        );
        let slowest = self
            .release_to_commit_ms
            .iter()
            .copied()
            .max_by(f64::total_cmp);
        report.figure(
            "zombie: release -> new owner's commit",
            format!("max {:.0} ms", slowest.unwrap_or(f64::NAN)),
        );
        report.figure(
            "zombie: contested partitions whose next owner waited",
            format!("{} of {}", self.held_back, self.contested),
        );
    }
}

/// Reads ownership, handoffs and the zombie out of the run's `events` (in time order).
pub fn analyse(events: &[Event]) -> Handoffs {
    let mut result = Handoffs::default();
    let mut latest_opener: HashMap<usize, u32> = HashMap::new();
    for event in events {
        let Some(partition) = event.partition else {
            continue;
        };
        match event.kind.as_str() {
            "open" => {
                if let Some(previous) = latest_opener.insert(partition, event.pid)
                    && previous != event.pid
                {
                    result.handoffs += 1;
                }
            }
            // A commit is checked when it begins: one begun by the latest opener stays safe,
            // as no other process can open the store before it is written.
            "submit" if latest_opener.get(&partition) != Some(&event.pid) => {
                result.foreign_commits += 1;
                eprintln!(
                    "COMMIT BY A NON-OWNER: pid {} on partition {partition}",
                    event.pid
                );
            }
            _ => {}
        }
    }
    let pause = events
        .iter()
        .find(|e| e.kind == "stop")
        .zip(events.iter().find(|e| e.kind == "cont"))
        .map(|(stop, cont)| (stop.at_ns, cont.at_ns));
    for kill in events
        .iter()
        .filter(|e| e.kind == "kill" || e.kind == "self-kill")
    {
        let pid = if kill.kind == "kill" {
            kill.subject.parse().unwrap_or(0)
        } else {
            kill.pid
        };
        let mut handed = false;
        for partition in owned_at(events, pid, kill.at_ns) {
            let Some(committed) = first_after(events, "fresh", partition, pid, kill.at_ns) else {
                continue;
            };
            handed = true;
            // While the zombie is paused the broker may hand a partition to it (first in
            // line), which answers only after the heartbeat timeout: such handoffs are
            // counted apart.
            if pause.is_some_and(|(stop, cont)| kill.at_ns < cont && committed > stop) {
                result.overlapping_pause += 1;
                continue;
            }
            result.to_first_commit_ms.push(ms(kill.at_ns, committed));
            if let Some(at) = first_after(events, "active", partition, pid, kill.at_ns) {
                result.to_active_ms.push(ms(kill.at_ns, at));
            }
        }
        if !handed {
            result.kills_without_handoff += 1;
        }
    }
    let stop = events.iter().find(|e| e.kind == "stop");
    let cont = events.iter().find(|e| e.kind == "cont");
    if let (Some(stop), Some(cont)) = (stop, cont) {
        result.zombie = Some(zombie(events, stop, cont));
    }
    result
}

/// When the first event of `kind` on `partition` by another process than `not_pid` happened
/// after `after`.
fn first_after(
    events: &[Event],
    kind: &str,
    partition: usize,
    not_pid: u32,
    after: u64,
) -> Option<u64> {
    events
        .iter()
        .find(|e| {
            e.kind == kind && e.partition == Some(partition) && e.pid != not_pid && e.at_ns > after
        })
        .map(|e| e.at_ns)
}

/// Milliseconds from `from` to `to` (0 if `to` came first).
fn ms(from: u64, to: u64) -> f64 {
    (to.saturating_sub(from)) as f64 / 1e6
}

/// What the process stopped at `stop` and continued at `cont` did.
fn zombie(events: &[Event], stop: &Event, cont: &Event) -> Zombie {
    let pid: u32 = stop.subject.parse().unwrap_or(0);
    let partitions = owned_at(events, pid, stop.at_ns);
    let noticed = events
        .iter()
        .find(|e| e.kind == "lost" && e.pid == pid && e.at_ns > cont.at_ns)
        .map(|e| e.at_ns);
    // A SIGKILL at a commit point still in the session the pause ended (before the zombie
    // opened a store again): the death releases whatever it had not released yet.
    let reopened_any = events
        .iter()
        .find(|e| e.kind == "open" && e.pid == pid && e.at_ns > cont.at_ns)
        .map_or(u64::MAX, |e| e.at_ns);
    let died = events
        .iter()
        .find(|e| e.kind == "self-kill" && e.pid == pid && e.at_ns > cont.at_ns)
        .map(|e| e.at_ns)
        .filter(|died| *died < reopened_any);
    let detection = partitions
        .iter()
        .filter_map(|p| first_after(events, "active", *p, pid, stop.at_ns))
        .min();
    let mut zombie = Zombie {
        partitions: partitions.clone(),
        broker_detection_ms: detection.map(|at| ms(stop.at_ns, at)),
        noticed_after_cont_ms: noticed.map(|at| ms(cont.at_ns, at)),
        died_after_cont_ms: died.map(|at| ms(cont.at_ns, at)),
        commits_before_noticing: 0,
        commits_after_noticing: 0,
        released: 0,
        contested: 0,
        held_back: 0,
        release_to_commit_ms: Vec::new(),
        withheld: 0,
    };
    let noticed = noticed.or(died).unwrap_or(u64::MAX);
    for partition in &partitions {
        let ours_since_cont =
            |e: &&Event| e.pid == pid && e.partition == Some(*partition) && e.at_ns > cont.at_ns;
        let reopened = events
            .iter()
            .filter(ours_since_cont)
            .find(|e| e.kind == "open")
            .map_or(u64::MAX, |e| e.at_ns);
        for event in events.iter().filter(ours_since_cont) {
            match event.kind.as_str() {
                // A commit counts from when it began: one the zombie started before it
                // noticed may be acknowledged just after.
                "fresh" if event.began_ns < noticed => zombie.commits_before_noticing += 1,
                "fresh" if event.began_ns < reopened => zombie.commits_after_noticing += 1,
                "withheld" => zombie.withheld += 1,
                _ => {}
            }
        }
        let released = events
            .iter()
            .filter(ours_since_cont)
            .find(|e| e.kind == "release")
            .map(|e| e.at_ns)
            .or(died);
        if let Some(released) = released {
            zombie.released += 1;
            if let Some(at) = first_after(events, "fresh", *partition, pid, released) {
                zombie.release_to_commit_ms.push(ms(released, at));
            }
        }
        // The lock at work: a partition delivered to its next owner while the zombie still
        // held its store (contested) was refused, and opened only after the zombie let go.
        // (One with no delivery until then was never contested.)
        let contested = first_after(events, "active", *partition, pid, stop.at_ns)
            .zip(released)
            .is_some_and(|(active, released)| active < released);
        if !contested {
            continue;
        }
        zombie.contested += 1;
        // The next open by anyone: the zombie itself may win the partition back, once it
        // has released it and reconnected.
        let next_open = events
            .iter()
            .find(|e| e.kind == "open" && e.partition == Some(*partition) && e.at_ns > stop.at_ns);
        // (The wait shows as refusals, or inside one open: an open waits up to 0.5 s for
        // the lock before it refuses.)
        if let (Some(open), Some(released)) = (next_open, released)
            && open.at_ns > released
        {
            zombie.held_back += 1;
        }
    }
    zombie
}

impl Handoffs {
    /// Adds the handoff and zombie figures to `report`, and what a passing run needs: no commit
    /// by a non-owner, a handoff, at least [`MIN_TIMED_HANDOFFS`] timed after a SIGKILL, and a
    /// zombie that [behaved](Zombie::behaved). `negative_control` says a missing zombie is
    /// expected (that run checks none).
    pub fn report(&self, report: &mut Report, negative_control: bool) {
        report.figure(
            "partition handoffs (store opened by a new owner)",
            self.handoffs,
        );
        let times = |values: &[f64]| {
            let mut sorted = values.to_vec();
            sorted.sort_by(f64::total_cmp);
            format!(
                "p50 {:.0} ms, p99 {:.0} ms (n={})",
                percentile(&sorted, 50.0),
                percentile(&sorted, 99.0),
                sorted.len()
            )
        };
        report.figure(
            "handoff after SIGKILL: kill -> new owner's delivery",
            times(&self.to_active_ms),
        );
        report.figure(
            "handoff after SIGKILL: kill -> new owner's commit",
            times(&self.to_first_commit_ms),
        );
        report.figure(
            "kills followed by no handoff (owned nothing, or idle)",
            self.kills_without_handoff,
        );
        report.figure(
            "handoffs overlapping the zombie's pause (not timed)",
            self.overlapping_pause,
        );
        report.zero(
            "commits begun by a process not the latest opener",
            self.foreign_commits,
        );
        match &self.zombie {
            Some(zombie) => zombie.report(report),
            None if negative_control => report.figure("zombie", "none (negative control)"),
            None => report.figure("zombie", "NONE: no consumer owned a partition"),
        }
        report.require(self.handoffs > 0, "no partition handoff");
        report.require(
            self.to_first_commit_ms.len() >= MIN_TIMED_HANDOFFS,
            &format!("fewer than {MIN_TIMED_HANDOFFS} handoffs after a SIGKILL timed"),
        );
        report.require(
            self.zombie.as_ref().is_some_and(Zombie::behaved),
            "the zombie did not prove its case (or there was none)",
        );
    }
}
