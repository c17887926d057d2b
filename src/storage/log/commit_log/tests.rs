use super::*;

const SEGMENT: u64 = LOG_SEGMENT_BYTES_MIN;

/// A new log whose synced writes are direct or not: the tests below run both ways.
fn create(path: &Path, slots: usize, first_lsn: u64, direct: bool) -> CommitLog {
    let mut log = CommitLog::create(path, slots, SEGMENT, first_lsn).unwrap();
    if direct {
        assert!(
            log.write_direct().unwrap(),
            "the test directory's file system takes direct writes"
        );
    }
    log
}

/// Reopens for appending, direct or not.
fn reopen(path: &Path, from_lsn: u64, direct: bool) -> (CommitLog, Collected) {
    let (mut log, collected) = open_collecting(path, from_lsn).unwrap();
    if direct {
        assert!(log.write_direct().unwrap());
    }
    (log, collected)
}

fn payload(lsn: u64, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (lsn as usize + i) as u8).collect()
}

/// A segment whose size is not a multiple of the direct block keeps `fdatasync`: its last
/// block is short, and a direct write of it would grow the file.
#[test]
fn segments_of_an_odd_size_keep_fdatasync() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let odd = SEGMENT + 512;
    let mut log = CommitLog::create(&path, 2, odd, 1).unwrap();
    assert!(!log.write_direct().unwrap());
    assert!(log.direct.is_none());
    let mut lsn = 1;
    while log.active == 0 {
        lsn = log.append(&payload(lsn, 3_000)).unwrap() + 1;
        log.sync().unwrap();
    }
    drop(log);
    let (_, recovered) = open_collecting(&path, 1).unwrap();
    assert_eq!(recovered.records.len() as u64, lsn - 1);
    for slot in 0..2 {
        let length = std::fs::metadata(slot_path(&path, slot)).unwrap().len();
        assert_eq!(length, odd, "the segment files keep their size");
    }
}

#[test]
fn records_come_back_from_any_lsn_across_segments() {
    records_come_back_from_any_lsn_across_segments_with(false);
    records_come_back_from_any_lsn_across_segments_with(true);
}

fn records_come_back_from_any_lsn_across_segments_with(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 4, 100, direct);
    // About 10 KiB each: six or so per segment, three segments.
    for lsn in 100..118 {
        assert_eq!(log.append(&payload(lsn, 10_000)).unwrap(), lsn);
        if lsn % 5 == 0 {
            log.sync().unwrap();
        }
    }
    log.sync().unwrap();
    drop(log);
    for from in [100, 107, 117, 118] {
        let (log, recovered) = open_collecting(&path, from).unwrap();
        let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
        assert_eq!(lsns, (from..118).collect::<Vec<_>>());
        for (lsn, bytes) in &recovered.records {
            assert_eq!(bytes, &payload(*lsn, 10_000));
        }
        assert_eq!(log.next_lsn(), 118);
    }
}

#[test]
fn unsynced_records_are_not_recovered_but_synced_ones_are() {
    unsynced_records_are_not_recovered_but_synced_ones_are_with(false);
    unsynced_records_are_not_recovered_but_synced_ones_are_with(true);
}

fn unsynced_records_are_not_recovered_but_synced_ones_are_with(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 2, 1, direct);
    log.append(b"synced").unwrap();
    log.sync().unwrap();
    log.append(b"never written").unwrap();
    drop(log); // pending, never written
    let (_, recovered) = open_collecting(&path, 1).unwrap();
    assert_eq!(recovered.records, vec![(1, b"synced".to_vec())]);
    assert_eq!(recovered.end, LogEnd::Unwritten);
}

#[test]
fn the_ring_reuses_released_segments_and_never_reads_an_old_lap() {
    the_ring_reuses_released_segments_and_never_reads_an_old_lap_with(false);
    the_ring_reuses_released_segments_and_never_reads_an_old_lap_with(true);
}

fn the_ring_reuses_released_segments_and_never_reads_an_old_lap_with(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 2, 0, direct);
    let mut lsn = 0;
    // Fill the first segment and start the second.
    while log.active == 0 {
        lsn = log.append(&payload(lsn, 5_000)).unwrap() + 1;
        log.sync().unwrap();
    }
    // Filling the second needs the first back: refused until released.
    let refused = loop {
        match log.append(&payload(lsn, 5_000)) {
            Ok(written) => lsn = written + 1,
            Err(error) => break error,
        }
    };
    assert!(refused.is_retryable(), "{refused:?}");
    log.sync().unwrap();
    log.release_through(lsn);
    // The first slot is written over by a new lap: its old records stay behind the new
    // ones, with older LSNs. The new lap ends on a block's end, so that direct writes,
    // which fill the rest of their last block with zeros, leave old bytes after it too.
    let lap_start = lsn;
    let lap_end = 6 * DIRECT_BLOCK;
    let last = lap_end - LOG_SEGMENT_HEADER_BYTES - 3 * LOG_RECORD_HEADER_BYTES - 2 * 7_000;
    for bytes in [7_000, 7_000, last] {
        lsn = log.append(&payload(lsn, bytes)).unwrap() + 1;
    }
    assert_eq!(log.write_at, lap_end as u64);
    log.sync().unwrap();
    drop(log);
    let (log, recovered) = open_collecting(&path, lap_start).unwrap();
    let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
    assert_eq!(lsns, (lap_start..lsn).collect::<Vec<_>>());
    assert!(
        matches!(
            recovered.end,
            LogEnd::OtherLsn { .. } | LogEnd::Torn | LogEnd::Garbage
        ),
        "the old lap's bytes follow: {:?}",
        recovered.end
    );
    assert_eq!(log.next_lsn(), lsn);
}

#[test]
fn a_torn_tail_ends_the_log_and_the_next_append_writes_over_it() {
    a_torn_tail_ends_the_log_and_the_next_append_writes_over_it_with(false);
    a_torn_tail_ends_the_log_and_the_next_append_writes_over_it_with(true);
}

fn a_torn_tail_ends_the_log_and_the_next_append_writes_over_it_with(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 2, 1, direct);
    log.append(b"one").unwrap();
    log.append(b"two").unwrap();
    log.sync().unwrap();
    let tail_at = log.write_at;
    drop(log);
    // A write cut short: part of a third record's header.
    let file = OpenOptions::new()
        .write(true)
        .open(slot_path(&path, 0))
        .unwrap();
    let mut torn = Vec::new();
    encode_log_record(3, b"three, torn", &mut torn);
    file.write_all_at(&torn[..30], tail_at).unwrap();
    drop(file);
    let (mut log, recovered) = reopen(&path, 1, direct);
    assert_eq!(recovered.records.len(), 2);
    assert_eq!(recovered.end, LogEnd::Torn);
    assert_eq!(log.append(b"three").unwrap(), 3);
    log.sync().unwrap();
    drop(log);
    let (_, recovered) = open_collecting(&path, 1).unwrap();
    assert_eq!(recovered.records.last().unwrap(), &(3, b"three".to_vec()));
}

/// Reopening a full 1 GiB log: the time to find and read every record (the engine's
/// replay adds the memtable writes). Writes 2 GiB (the zero fill and the records), so it
/// runs by hand: `cargo test --release --lib one_gib -- --ignored --nocapture` (the store's
/// disk: set TMPDIR to a directory on it).
#[test]
#[ignore = "writes 2 GiB; run by hand (see the doc comment)"]
#[allow(clippy::print_stdout)] // the figure is the point
fn reopening_a_one_gib_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let segment = 128 << 20;
    let made = std::time::Instant::now();
    let mut log = CommitLog::create(&path, 8, segment, 1).unwrap();
    let made = made.elapsed();
    // Batches of about 64 claims' writes.
    let payload = vec![0xa5u8; 16 << 10];
    let written = std::time::Instant::now();
    let mut bytes = 0u64;
    while bytes + (payload.len() + LOG_RECORD_HEADER_BYTES) as u64 * 2
        < 8 * (segment - LOG_SEGMENT_HEADER_BYTES as u64)
    {
        log.append(&payload).unwrap();
        bytes += (payload.len() + LOG_RECORD_HEADER_BYTES) as u64;
        if log.next_lsn().is_multiple_of(64) {
            log.sync().unwrap();
        }
    }
    log.sync().unwrap();
    let written = written.elapsed();
    let records = log.next_lsn() - 1;
    drop(log);
    // Cold: the page cache dropped, as after a reboot (needs root; skipped otherwise).
    let cold = std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
    let reopened = std::time::Instant::now();
    let mut replayed = 0u64;
    let (_, recovered) = CommitLog::open(&path, 1, |_, payload| {
        replayed += payload.len() as u64;
        Ok(())
    })
    .unwrap();
    let reopened = reopened.elapsed();
    assert_eq!(recovered.recovered, records);
    println!(
        "1 GiB commit log: made in {made:.2?}, {records} records ({} MiB) written in \
         {written:.2?}, reopened and replayed in {reopened:.2?} ({:.0} MiB/s{})",
        bytes >> 20,
        replayed as f64 / f64::from(1 << 20) / reopened.as_secs_f64(),
        if cold { ", cold cache" } else { ", warm cache" }
    );
}

#[test]
fn bad_shapes_and_missing_records_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert!(CommitLog::create(&dir.path().join("a"), 1, SEGMENT, 0).is_err());
    assert!(CommitLog::create(&dir.path().join("b"), 2, 1024, 0).is_err());
    let path = dir.path().join("log");
    let mut log = CommitLog::create(&path, 2, SEGMENT, 50).unwrap();
    // Larger than the whole log (its two segments).
    assert!(matches!(
        log.append(&vec![0; 2 * SEGMENT as usize]),
        Err(Error::InvalidArgument { .. })
    ));
    log.append(b"x").unwrap();
    log.sync().unwrap();
    drop(log);
    // Records before the log's first are gone.
    assert!(open_collecting(&path, 10).is_err());
    // Past its end (table files written from an unsynced tail survived it): the log goes
    // on from there, in a segment of its own.
    let (mut log, collected) = open_collecting(&path, 60).unwrap();
    assert!(collected.records.is_empty());
    assert_eq!(log.append(b"y").unwrap(), 60);
    log.sync().unwrap();
    drop(log);
    let (_, collected) = open_collecting(&path, 60).unwrap();
    assert_eq!(collected.records, vec![(60, b"y".to_vec())]);
    assert!(open_collecting(&dir.path().join("none"), 0).is_err());
}

#[test]
fn a_ring_grows_to_its_most_before_it_is_full_and_reopens_whole() {
    a_ring_grows_to_its_most_before_it_is_full_and_reopens_whole_with(false);
    a_ring_grows_to_its_most_before_it_is_full_and_reopens_whole_with(true);
}

fn a_ring_grows_to_its_most_before_it_is_full_and_reopens_whole_with(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 2, 1, direct);
    log.allow_growth_to(4);
    let mut lsn = 1;
    // About six records a segment: four segments' worth, nothing released. (A slot is made
    // ahead of need, or when the ring is full.)
    loop {
        match log.append(&payload(lsn, 10_000)) {
            Ok(written) => lsn = written + 1,
            Err(error) if error.is_retryable() => {
                if log.grow_for(0).unwrap() {
                    continue;
                }
                break;
            }
            Err(error) => panic!("{error}"),
        }
        log.sync().unwrap();
    }
    assert_eq!(log.slots(), 4, "grown from two slots to four");
    assert!(!log.grow_for(0).unwrap(), "no slot beyond the most");
    drop(log);
    // What a crash while growing further would leave: a half-made slot, under its own name.
    std::fs::write(growing_path(&path, 4), [0u8; 100]).unwrap();
    let (mut log, recovered) = reopen(&path, 1, direct);
    let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
    assert_eq!(lsns, (1..lsn).collect::<Vec<_>>(), "every record, in order");
    assert_eq!(log.slots(), 4);
    assert!(
        !growing_path(&path, 4).exists(),
        "the half-made slot is removed"
    );
    // Reopened, the ring grows no further unless allowed; released, it goes round.
    assert!(!log.grow_for(0).unwrap());
    log.release_through(lsn);
    for _ in 0..20 {
        lsn = log.append(&payload(lsn, 10_000)).unwrap() + 1;
    }
    log.sync().unwrap();
}

#[test]
fn a_record_larger_than_a_segment_gets_a_slot_of_its_own_given_back_once_free() {
    a_record_larger_than_a_segment_gets_a_slot_of_its_own_given_back_once_free_with(false);
    a_record_larger_than_a_segment_gets_a_slot_of_its_own_given_back_once_free_with(true);
}

fn a_record_larger_than_a_segment_gets_a_slot_of_its_own_given_back_once_free_with(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 2, 1, direct);
    log.allow_growth_to(3);
    let large = payload(2, 2 * SEGMENT as usize);
    log.append(&payload(1, 100)).unwrap();
    // No slot holds it: refused retryably until a free slot is enlarged for it.
    let refused = log.append(&large);
    assert!(
        refused.as_ref().is_err_and(Error::is_retryable),
        "{refused:?}"
    );
    assert!(
        log.grow_for((LOG_RECORD_HEADER_BYTES + large.len()) as u64)
            .unwrap()
    );
    assert_eq!(log.slots(), 2, "enlarged in place, not added");
    assert!(std::fs::metadata(slot_path(&path, 1)).unwrap().len() > 2 * SEGMENT);
    assert_eq!(log.append(&large).unwrap(), 2);
    assert_eq!(log.active, 1);
    // The large slot takes nothing after its record; the first slot is not free yet, so the
    // next record needs the ring to grow.
    let refused = log.append(&payload(3, 100));
    assert!(
        refused.as_ref().is_err_and(Error::is_retryable),
        "{refused:?}"
    );
    assert!(log.grow_for(0).unwrap());
    assert_eq!(log.append(&payload(3, 100)).unwrap(), 3);
    assert_eq!(log.active, 2);
    log.sync().unwrap();
    // Still held: kept as it is.
    log.trim().unwrap();
    assert!(std::fs::metadata(slot_path(&path, 1)).unwrap().len() > 2 * SEGMENT);
    drop(log);
    let (mut log, recovered) = reopen(&path, 1, direct);
    let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
    assert_eq!(lsns, vec![1, 2, 3]);
    assert_eq!(recovered.records[1].1, large);
    // Released: cut back to the ring's size.
    log.release_through(3);
    log.trim().unwrap();
    assert_eq!(
        std::fs::metadata(slot_path(&path, 1)).unwrap().len(),
        SEGMENT
    );
    assert_eq!(log.slots(), 3);
    assert_eq!(log.append(&payload(4, 100)).unwrap(), 4);
    log.sync().unwrap();
    drop(log);
    let (_, recovered) = reopen(&path, 3, direct);
    let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
    assert_eq!(lsns, vec![3, 4]);
}

/// When a switch leaves the ring without a free slot, the next one is made on a thread of its
/// own: it is there before the ring is full, and the commit that finds the ring full takes it.
#[test]
fn the_next_slot_is_made_ahead_of_need() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 2, 1, false);
    log.allow_growth_to(3);
    let mut lsn = 1;
    // Into the second slot: no free slot left behind it.
    while log.active == 0 {
        lsn = log.append(&payload(lsn, 10_000)).unwrap() + 1;
    }
    // Until the thread making it has ended: its file is named into the directory a moment
    // before, and an append in that moment finds nothing ready to take (the ring is full then,
    // a retryable error whose caller grows the log, waiting for the slot under way).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !log.ahead_ready() {
        assert!(std::time::Instant::now() < deadline, "no slot made ahead");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(slot_path(&path, 2).exists(), "made ahead, but not named");
    assert_eq!(log.slots(), 2, "made, not yet taken");
    // The ring fills; the switch takes the slot made ahead without growing on its own.
    loop {
        match log.append(&payload(lsn, 10_000)) {
            Ok(written) => lsn = written + 1,
            Err(error) => panic!("{error}"),
        }
        if log.active == 2 {
            break;
        }
    }
    assert_eq!(log.slots(), 3);
    assert!(!log.grow_for(0).unwrap(), "at its most");
    log.sync().unwrap();
    drop(log);
    let (_, recovered) = reopen(&path, 1, false);
    assert_eq!(recovered.records.len() as u64, lsn - 1);
}

/// Appends `payload`, growing the ring by a slot first when it is full: the record's LSN.
fn append_growing(log: &mut CommitLog, payload: &[u8]) -> u64 {
    match log.append(payload) {
        Ok(lsn) => lsn,
        Err(error) if error.is_retryable() => {
            assert!(log.grow_for(0).unwrap(), "the ring grows");
            log.append(payload).unwrap()
        }
        Err(error) => panic!("{error}"),
    }
}

#[test]
fn a_shrink_gives_back_the_grown_slots_only_once_every_record_is_released() {
    a_shrink_gives_back_the_grown_slots_only_once_every_record_is_released_with(false);
    a_shrink_gives_back_the_grown_slots_only_once_every_record_is_released_with(true);
}

/// Waits until no slot is being made ahead of need (the slot, once made, is taken into the
/// ring): a shrink is put off while one is under way, and a test that asks whether a shrink
/// gives slots back must not depend on how fast that thread ran.
fn settle_preparation(log: &mut CommitLog) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        log.adopt_prepared();
        if log.preparing.is_none() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a slot still being made after 30 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn a_shrink_gives_back_the_grown_slots_only_once_every_record_is_released_with(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 2, 1, direct);
    log.allow_growth_to(6);
    let mut lsn = 1;
    // Five segments' worth, nothing released: the ring grows to six slots.
    for _ in 0..30 {
        lsn = append_growing(&mut log, &payload(lsn, 10_000)) + 1;
        log.sync().unwrap();
    }
    let grown = log.slots();
    assert!(grown >= 5, "grown to {grown} slots");
    // Unreleased records, or records appended and not yet written: nothing is given back.
    log.release_through(lsn - 3);
    settle_preparation(&mut log);
    assert!(!log.shrink(2).unwrap());
    assert!(log.slots() >= grown, "a slot given back");
    log.release_through(lsn);
    lsn = log.append(&payload(lsn, 100)).unwrap() + 1;
    settle_preparation(&mut log);
    assert!(
        !log.shrink(2).unwrap(),
        "an appended record not yet written"
    );
    log.sync().unwrap();
    log.release_through(lsn);
    // Every record released: back to two slots, the log's end in one of them.
    settle_preparation(&mut log);
    assert!(log.shrink(2).unwrap());
    assert_eq!(log.slots(), 2);
    assert!(!slot_path(&path, 2).exists());
    // It takes records again, and grows again when they need it.
    let first_after = lsn;
    for _ in 0..20 {
        lsn = append_growing(&mut log, &payload(lsn, 10_000)) + 1;
    }
    log.sync().unwrap();
    assert!(log.slots() > 2);
    drop(log);
    let (log, recovered) = reopen(&path, first_after, direct);
    let lsns: Vec<u64> = recovered.records.iter().map(|(lsn, _)| *lsn).collect();
    assert_eq!(lsns, (first_after..lsn).collect::<Vec<_>>());
    drop(log);
    // A shrunk log reopened from its end holds nothing to replay, and takes the next record
    // at the tables' LSN.
    let (mut log, _) = reopen(&path, lsn, direct);
    log.release_through(lsn);
    settle_preparation(&mut log);
    assert!(log.shrink(2).unwrap());
    drop(log);
    let (mut log, recovered) = reopen(&path, lsn, direct);
    assert!(recovered.records.is_empty());
    assert_eq!(log.append(&payload(lsn, 100)).unwrap(), lsn);
}

#[test]
fn an_orphan_segment_left_by_a_lost_tail_is_not_taken_for_the_log() {
    for direct in [false, true] {
        // The next writer's switch at the orphan's first LSN, and one record later.
        for switch_after in [0, 1] {
            an_orphan_segment_left_by_a_lost_tail_is_not_taken_for_the_log_with(
                direct,
                switch_after,
            );
        }
    }
}

/// A writer fills slot 0 with records 1..=6 and switches into slot 1 for record 7; a power cut
/// keeps slot 1's header and record (the later write) and loses record 6 (the earlier one).
/// The next writer appends from 6 again, under the same LSNs, and switches to a new segment:
/// every record it synced comes back, its own and not the orphan's.
fn an_orphan_segment_left_by_a_lost_tail_is_not_taken_for_the_log_with(
    direct: bool,
    switch_after: u64,
) {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let mut log = create(&path, 4, 1, direct);
    for lsn in 1..=7 {
        assert_eq!(log.append(&payload(lsn, 10_000)).unwrap(), lsn);
    }
    log.sync().unwrap();
    assert_eq!(log.active, 1, "record 7 switched into slot 1");
    drop(log);
    // The lost tail: record 6 gone from slot 0 (zeros where it was).
    let record = (LOG_RECORD_HEADER_BYTES + 10_000) as u64;
    let slot0 = std::fs::OpenOptions::new()
        .write(true)
        .open(slot_path(&path, 0))
        .unwrap();
    slot0
        .write_all_at(
            &vec![0u8; record as usize],
            LOG_SEGMENT_HEADER_BYTES as u64 + 5 * record,
        )
        .unwrap();
    drop(slot0);
    let (mut log, recovered) = reopen(&path, 1, direct);
    assert_eq!(recovered.records.len(), 5);
    assert_eq!(log.next_lsn(), 6);
    // The next writer: other payloads under the same LSNs, a switch at 7 (or 8).
    let theirs = |lsn: u64| payload(lsn + 100, 200);
    let mut lsn = 6;
    for _ in 0..=switch_after {
        assert_eq!(log.append(&theirs(lsn)).unwrap(), lsn);
        lsn += 1;
    }
    let large = |lsn: u64| payload(lsn + 200, 20_000);
    assert_eq!(log.append(&large(lsn)).unwrap(), lsn);
    assert_ne!(log.active, 0, "switched out of slot 0");
    log.sync().unwrap();
    drop(log);
    let (_, recovered) = reopen(&path, 1, direct);
    let expected: Vec<(u64, Vec<u8>)> = (1..=5)
        .map(|l| (l, payload(l, 10_000)))
        .chain((6..lsn).map(|l| (l, theirs(l))))
        .chain([(lsn, large(lsn))])
        .collect();
    assert_eq!(
        recovered
            .records
            .iter()
            .map(|(l, _)| *l)
            .collect::<Vec<_>>(),
        expected.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
        "direct {direct}, switch after {switch_after}"
    );
    assert!(
        recovered.records == expected,
        "direct {direct}, switch after {switch_after}: the orphan's record taken for the log's"
    );
}
