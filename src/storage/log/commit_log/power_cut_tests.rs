//! The log under power cuts: a FUSE file system that keeps only what was synced
//! (`powercut/`), cut at random writes, sometimes tearing the last one, over many cycles of
//! appends, syncs, segment switches and reuses. Skipped where FUSE cannot be mounted.

use std::collections::HashMap;

use idemdb_powercut::{Event, PowerCut};

use super::*;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

/// A folder for a power-cut file system (its backing directory and mount point) where FUSE
/// mounts (it needs root, or fusermount3, and the kernel's fuse module); `None`, with why,
/// where it does not: the test `what` is skipped.
#[allow(clippy::print_stdout)] // why the test is skipped
fn power_cut_disk(
    what: &str,
) -> Option<(tempfile::TempDir, std::path::PathBuf, std::path::PathBuf)> {
    let dir = tempfile::tempdir().unwrap();
    let (backing, mnt) = (dir.path().join("disk"), dir.path().join("mnt"));
    std::fs::create_dir(&backing).unwrap();
    std::fs::create_dir(&mnt).unwrap();
    match PowerCut::mount(&backing, &mnt) {
        Ok(fs) => drop(fs.unmount()),
        Err(error) => {
            println!("{what} skipped: cannot mount FUSE here ({error})");
            return None;
        }
    }
    Some((dir, backing, mnt))
}

/// What the cycles counted.
#[derive(Debug, Default)]
struct Tally {
    cuts: u32,
    torn_ends: u32,
    stale_lap_ends: u32,
    switches: u32,
    reuses: u32,
    recovered: u64,
}

#[test]
fn every_synced_record_survives_power_cuts_at_any_write() {
    every_synced_record_survives_power_cuts_at_any_write_with(false);
    every_synced_record_survives_power_cuts_at_any_write_with(true);
}

#[allow(clippy::print_stdout)] // the tally, or why it was skipped
fn every_synced_record_survives_power_cuts_at_any_write_with(direct: bool) {
    let Some((_dir, backing, mnt)) = power_cut_disk("commit log power cuts") else {
        return;
    };
    let mut rng = Rng(0x1de3_5eed);
    let mut appended: HashMap<u64, Vec<u8>> = HashMap::new();
    // Stored elsewhere (as table files would hold them): records before this LSN.
    let mut stored_before = 1u64;
    // Every record up to here was synced (acknowledged) before its cut, or recovered since.
    let mut synced_through = 0u64;
    let mut created = false;
    let mut tally = Tally::default();
    for cycle in 0..80 {
        let fs = PowerCut::mount(&backing, &mnt).unwrap();
        let path = fs.path().join("log");
        // Cut at a random write of this cycle (some cycles, inside the log's creation).
        fs.arm(Event::Write(String::new()), rng.below(60) as u32);
        let opened = if created {
            open_collecting(&path, stored_before).map(Some)
        } else {
            match CommitLog::create(&path, 3, LOG_SEGMENT_BYTES_MIN, 1) {
                Ok(log) => {
                    created = true;
                    Ok(Some((
                        log,
                        Collected {
                            records: Vec::new(),
                            end: LogEnd::Unwritten,
                        },
                    )))
                }
                // Cut while being made: the next cycle makes it again from nothing.
                Err(_) => Ok(None),
            }
        };
        let Some((mut log, recovered)) = opened
            .unwrap_or_else(|error| panic!("cycle {cycle}: the log does not reopen: {error}"))
        else {
            drop(fs.power_off(None));
            let _ = std::fs::remove_dir_all(backing.join("log"));
            continue;
        };
        // Every acknowledged record is back, in order, each exactly as appended.
        let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
        let expected: Vec<u64> = (stored_before..stored_before + lsns.len() as u64).collect();
        assert_eq!(
            lsns, expected,
            "cycle {cycle}: contiguous from {stored_before}"
        );
        let through = stored_before + lsns.len() as u64;
        assert!(
            through > synced_through,
            "cycle {cycle}: synced through {synced_through}, recovered up to {}",
            through - 1
        );
        for (lsn, payload) in &recovered.records {
            assert_eq!(
                appended.get(lsn),
                Some(payload),
                "cycle {cycle}: LSN {lsn} is not what was appended"
            );
        }
        match recovered.end {
            LogEnd::Torn => tally.torn_ends += 1,
            LogEnd::OtherLsn { .. } => tally.stale_lap_ends += 1,
            _ => {}
        }
        tally.recovered += lsns.len() as u64;
        // What came back is the log now (a torn write may keep a whole unsynced record).
        synced_through = through - 1;
        if direct {
            match log.write_direct() {
                Ok(true) => {}
                Ok(false) => panic!("the power-cut file system refuses direct writes"),
                // Cut while the log's last block was written back.
                Err(_) => {
                    tally.cuts += 1;
                    drop(log);
                    fs.power_off(None).unwrap();
                    continue;
                }
            }
        }
        // Appends until the power goes.
        loop {
            // Sizes at random, then one size for every record: a lap of the ring then
            // lays its records exactly over the previous lap's, so a stale record, whole
            // and with a good checksum, follows the last new one.
            let bytes = if cycle < 40 {
                100 + rng.below(9_000) as usize
            } else {
                3_000
            };
            let lsn = log.next_lsn();
            let payload: Vec<u8> = (0..bytes).map(|i| (lsn as usize * 31 + i) as u8).collect();
            let before = log.active;
            match log.append(&payload) {
                Ok(written) => {
                    assert_eq!(written, lsn);
                    appended.insert(lsn, payload);
                    if log.active != before {
                        tally.switches += 1;
                        if log.slots[log.active].header.is_some_and(|h| h.segment >= 3) {
                            tally.reuses += 1;
                        }
                    }
                }
                Err(error) if error.is_retryable() => {
                    // The ring is full: "flush" what is synced, as the engine would.
                    stored_before = synced_through + 1;
                    log.release_through(stored_before);
                    continue;
                }
                Err(error) => panic!("cycle {cycle}: {error}"),
            }
            if rng.below(3) == 0 {
                continue;
            }
            match log.sync() {
                Ok(()) => synced_through = log.next_lsn() - 1,
                Err(_) => break,
            }
            if fs.is_cut() {
                break;
            }
        }
        tally.cuts += 1;
        drop(log);
        let tear = (rng.below(2) == 0).then(|| rng.below(1 << 20));
        fs.power_off(tear).unwrap();
    }
    println!("commit log power cuts (direct writes: {direct}): {tally:?}");
    assert!(tally.cuts >= 60, "{tally:?}");
    assert!(
        tally.switches > 0 && tally.reuses > 0,
        "the ring went round: {tally:?}"
    );
    assert!(tally.torn_ends > 0, "some cuts tore a record: {tally:?}");
    // Direct writes fill their last block out with zeros, so the old lap's records follow
    // the new ones only after a block boundary: the plain run checks that they are refused.
    assert!(
        direct || tally.stale_lap_ends > 0,
        "some ends were a stale lap's record: {tally:?}"
    );
}

/// A ring that grows under power cuts: each cycle makes a new log of two slots that may grow to
/// six, and appends and syncs until the power goes at a random write (while a slot is made,
/// renamed, named in its directory, or written). Every record synced before the cut comes back.
/// A slot whose name was not synced before records went into it loses them here.
#[test]
#[allow(clippy::print_stdout)] // the tally, or why it was skipped
fn records_synced_into_grown_slots_survive_power_cuts() {
    let Some((_dir, backing, mnt)) = power_cut_disk("commit log growth power cuts") else {
        return;
    };
    let mut rng = Rng(0x96_0a7);
    let (mut cuts, mut grown, mut recovered_in_grown) = (0, 0, 0);
    for cycle in 0..60 {
        let _ = std::fs::remove_dir_all(backing.join("log"));
        let fs = PowerCut::mount(&backing, &mnt).unwrap();
        let path = fs.path().join("log");
        let Ok(mut log) = CommitLog::create(&path, 2, LOG_SEGMENT_BYTES_MIN, 1) else {
            drop(fs.power_off(None));
            continue;
        };
        log.allow_growth_to(6);
        fs.arm(Event::Write(String::new()), rng.below(150) as u32);
        let mut synced_through = 0;
        loop {
            let lsn = log.next_lsn();
            let payload: Vec<u8> = (0..6_000).map(|i| (lsn as usize * 7 + i) as u8).collect();
            match log.append(&payload) {
                Ok(_) => {}
                Err(error) if error.is_retryable() => match log.grow_for(0) {
                    Ok(true) => continue,
                    // Cut while the slot was made, or the ring is at its most.
                    Ok(false) | Err(_) => break,
                },
                Err(error) => panic!("cycle {cycle}: {error}"),
            }
            match log.sync() {
                Ok(()) => synced_through = lsn,
                Err(_) => break,
            }
            if fs.is_cut() {
                break;
            }
        }
        let slots = log.slots();
        grown += slots - 2;
        drop(log);
        cuts += 1;
        let tear = (rng.below(2) == 0).then(|| rng.below(1 << 20));
        fs.power_off(tear).unwrap();
        let fs = PowerCut::mount(&backing, &mnt).unwrap();
        let (log, recovered) = open_collecting(&fs.path().join("log"), 1)
            .unwrap_or_else(|error| panic!("cycle {cycle}: the log does not reopen: {error}"));
        let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
        assert!(
            lsns.len() as u64 >= synced_through,
            "cycle {cycle}: synced through {synced_through} in {slots} slots, recovered {}",
            lsns.len()
        );
        assert_eq!(
            lsns,
            (1..=lsns.len() as u64).collect::<Vec<_>>(),
            "cycle {cycle}"
        );
        if slots > 2 && synced_through > 0 {
            recovered_in_grown += 1;
        }
        drop(log);
        fs.unmount().unwrap();
    }
    println!(
        "commit log growth power cuts: {cuts} cuts, {grown} slots grown, {recovered_in_grown} cycles with grown slots recovered"
    );
    assert!(cuts >= 50 && grown > 20 && recovered_in_grown > 10);
}

/// A ring that grows and shrinks under power cuts: each cycle appends and syncs into a log
/// that may grow to six slots, and now and then the "tables" take the records through some
/// synced LSN (released) and the ring is asked to shrink back to two; the power goes at a
/// random operation (a write, a slot made or removed, a sync of a file or of the directory).
/// Reopened from the first LSN the tables lack, every synced record after it comes back, in
/// order. A shrink that removed a slot still holding records the tables lack loses them here.
#[test]
#[allow(clippy::print_stdout)] // the tally, or why it was skipped
fn records_survive_power_cuts_while_the_ring_grows_and_shrinks() {
    let Some((_dir, backing, mnt)) = power_cut_disk("commit log shrink power cuts") else {
        return;
    };
    let mut rng = Rng(0x5_4121);
    let (mut cuts, mut shrinks, mut refused, mut grown) = (0, 0, 0, 0);
    for cycle in 0..60 {
        let _ = std::fs::remove_dir_all(backing.join("log"));
        let fs = PowerCut::mount(&backing, &mnt).unwrap();
        let path = fs.path().join("log");
        let Ok(mut log) = CommitLog::create(&path, 2, LOG_SEGMENT_BYTES_MIN, 1) else {
            drop(fs.power_off(None));
            continue;
        };
        log.allow_growth_to(6);
        fs.arm(Event::Write(String::new()), 20 + rng.below(400) as u32);
        // The tables hold every record before `held`.
        let (mut synced_through, mut held) = (0, 1);
        loop {
            let lsn = log.next_lsn();
            let payload: Vec<u8> = (0..6_000).map(|i| (lsn as usize * 7 + i) as u8).collect();
            let slots = log.slots();
            let appended = log.append(&payload);
            grown += log.slots().saturating_sub(slots);
            match appended {
                Ok(_) => {}
                Err(error) if error.is_retryable() => match log.grow_for(0) {
                    Ok(true) => {
                        grown += 1;
                        continue;
                    }
                    // At its most: the tables take everything synced (as a flush would).
                    Ok(false) => {
                        held = synced_through + 1;
                        log.release_through(held);
                        continue;
                    }
                    Err(_) => break,
                },
                Err(error) => panic!("cycle {cycle}: {error}"),
            }
            match log.sync() {
                Ok(()) => synced_through = lsn,
                Err(_) => break,
            }
            if rng.below(12) == 0 {
                // A flush of the tables: through a synced LSN, often the last one.
                held = if rng.below(2) == 0 {
                    synced_through + 1
                } else {
                    held + rng.below(synced_through + 2 - held)
                };
                log.release_through(held);
                let slots = log.slots();
                match log.shrink(2) {
                    Ok(true) if slots > 2 => shrinks += 1,
                    Ok(true) => {}
                    Ok(false) => refused += 1,
                    Err(_) => break,
                }
            }
            if fs.is_cut() {
                break;
            }
        }
        drop(log);
        cuts += 1;
        let tear = (rng.below(2) == 0).then(|| rng.below(1 << 20));
        fs.power_off(tear).unwrap();
        let fs = PowerCut::mount(&backing, &mnt).unwrap();
        let (log, recovered) = open_collecting(&fs.path().join("log"), held)
            .unwrap_or_else(|error| panic!("cycle {cycle}: the log does not reopen: {error}"));
        let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
        let wanted: Vec<u64> = (held..=synced_through).collect();
        assert!(
            lsns.len() >= wanted.len() && lsns[..wanted.len()] == wanted[..],
            "cycle {cycle}: the tables hold through {}, synced through {synced_through}; \
             recovered {:?}..{:?} ({} records)",
            held - 1,
            lsns.first(),
            lsns.last(),
            lsns.len()
        );
        assert_eq!(
            lsns,
            (held..held + lsns.len() as u64).collect::<Vec<_>>(),
            "cycle {cycle}"
        );
        drop(log);
        fs.unmount().unwrap();
    }
    println!(
        "commit log shrink power cuts: {cuts} cuts, {grown} slots grown, {shrinks} shrinks, \
         {refused} refused"
    );
    assert!(cuts >= 50 && grown > 20 && shrinks > 20 && refused > 5);
}
