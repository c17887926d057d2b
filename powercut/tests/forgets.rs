//! The power-cut file system forgets exactly what a power cut may take: each test writes
//! through a real FUSE mount, cuts the power, and reads what the backing directory kept.
//! Where mounting is refused (not root, no FUSE), each test says so and passes without running.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use idemdb_powercut::{Event, PowerCut, SECTOR};

/// A backing directory and a mount point, both temporary.
struct Volume {
    _dir: tempfile::TempDir,
    backing: PathBuf,
    mnt: PathBuf,
}

impl Volume {
    /// Lays out `files` (path, contents) in the backing directory, as durable.
    fn new(files: &[(&str, &[u8])]) -> Volume {
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("backing");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&backing).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        for (path, contents) in files {
            let path = backing.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, contents).unwrap();
        }
        Volume {
            _dir: dir,
            backing,
            mnt,
        }
    }

    /// `None` (after saying why) where the mount is refused.
    fn mount(&self) -> Option<PowerCut> {
        match PowerCut::mount(&self.backing, &self.mnt) {
            Ok(fs) => Some(fs),
            Err(error) => {
                eprintln!("skipped: cannot mount the power-cut file system here ({error})");
                None
            }
        }
    }

    fn kept(&self, path: &str) -> Option<Vec<u8>> {
        match std::fs::read(self.backing.join(path)) {
            Ok(bytes) => Some(bytes),
            Err(error) if error.kind() == ErrorKind::NotFound => None,
            Err(error) => panic!("reading {path}: {error}"),
        }
    }
}

fn sync_dir(dir: &Path) {
    File::open(dir).unwrap().sync_all().unwrap();
}

#[test]
fn a_write_is_kept_only_if_its_file_was_fsynced() {
    let volume = Volume::new(&[("db/synced", b""), ("db/unsynced", b"")]);
    let Some(fs) = volume.mount() else { return };
    let db = fs.path().join("db");
    let mut synced = OpenOptions::new()
        .append(true)
        .open(db.join("synced"))
        .unwrap();
    synced.write_all(b"durable").unwrap();
    synced.sync_data().unwrap();
    synced.write_all(b" and then lost").unwrap();
    let mut unsynced = OpenOptions::new()
        .append(true)
        .open(db.join("unsynced"))
        .unwrap();
    unsynced.write_all(b"never synced").unwrap();
    // Everything is readable while the power is on.
    assert_eq!(
        std::fs::read(db.join("synced")).unwrap(),
        b"durable and then lost"
    );
    drop((synced, unsynced));
    let stats = fs.stats();
    assert_eq!(
        stats.file_syncs, 1,
        "the kernel forwards fdatasync: {stats:?}"
    );
    fs.power_off(None).unwrap();
    assert_eq!(volume.kept("db/synced").unwrap(), b"durable");
    assert_eq!(volume.kept("db/unsynced").unwrap(), b"");
}

#[test]
fn a_new_file_survives_only_if_its_directory_was_fsynced() {
    let volume = Volume::new(&[("a/.keep", b""), ("b/.keep", b"")]);
    let Some(fs) = volume.mount() else { return };
    for dir in ["a", "b"] {
        let mut file = File::create(fs.path().join(dir).join("new")).unwrap();
        file.write_all(b"content").unwrap();
        file.sync_all().unwrap();
    }
    sync_dir(&fs.path().join("b"));
    assert_eq!(fs.stats().dir_syncs, 1);
    fs.power_off(None).unwrap();
    assert_eq!(
        volume.kept("a/new"),
        None,
        "its entry was never made durable"
    );
    assert_eq!(volume.kept("b/new").unwrap(), b"content");
}

#[test]
fn a_rename_without_a_directory_fsync_is_undone() {
    let volume = Volume::new(&[("undone/CURRENT", b"old\n"), ("kept/CURRENT", b"old\n")]);
    let Some(fs) = volume.mount() else { return };
    for dir in ["undone", "kept"] {
        // The write-a-temporary-then-rename pattern RocksDB uses for CURRENT.
        let dir = fs.path().join(dir);
        let mut tmp = File::create(dir.join("tmp")).unwrap();
        tmp.write_all(b"new\n").unwrap();
        tmp.sync_all().unwrap();
        std::fs::rename(dir.join("tmp"), dir.join("CURRENT")).unwrap();
    }
    sync_dir(&fs.path().join("kept"));
    fs.power_off(None).unwrap();
    assert_eq!(volume.kept("undone/CURRENT").unwrap(), b"old\n");
    assert_eq!(volume.kept("undone/tmp"), None);
    assert_eq!(volume.kept("kept/CURRENT").unwrap(), b"new\n");
    assert_eq!(volume.kept("kept/tmp"), None);
}

#[test]
fn an_unlinked_file_comes_back_with_its_durable_bytes_unless_its_directory_was_fsynced() {
    let volume = Volume::new(&[("undone/f", b"synced"), ("kept/f", b"synced")]);
    let Some(fs) = volume.mount() else { return };
    for dir in ["undone", "kept"] {
        let path = fs.path().join(dir).join("f");
        OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b" plus unsynced")
            .unwrap();
        std::fs::remove_file(&path).unwrap();
    }
    sync_dir(&fs.path().join("kept"));
    fs.power_off(None).unwrap();
    assert_eq!(volume.kept("undone/f").unwrap(), b"synced");
    assert_eq!(volume.kept("kept/f"), None);
}

#[test]
fn an_overwrite_and_a_truncation_without_fsync_are_undone() {
    let volume = Volume::new(&[("overwritten", b"0123456789"), ("truncated", b"0123456789")]);
    let Some(fs) = volume.mount() else { return };
    let overwritten = OpenOptions::new()
        .write(true)
        .open(fs.path().join("overwritten"))
        .unwrap();
    overwritten.write_all_at(b"abc", 2).unwrap();
    OpenOptions::new()
        .write(true)
        .open(fs.path().join("truncated"))
        .unwrap()
        .set_len(4)
        .unwrap();
    assert_eq!(
        std::fs::read(fs.path().join("overwritten")).unwrap(),
        b"01abc56789"
    );
    drop(overwritten);
    fs.power_off(None).unwrap();
    assert_eq!(volume.kept("overwritten").unwrap(), b"0123456789");
    assert_eq!(volume.kept("truncated").unwrap(), b"0123456789");
}

#[test]
fn a_torn_write_keeps_whole_sectors_of_it_and_nothing_after() {
    let durable = vec![b'd'; 512];
    let volume = Volume::new(&[("wal", &durable)]);
    let Some(fs) = volume.mount() else { return };
    // One write(2) inside one page, so that the kernel hands it over as one request.
    let appended: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    let mut wal = OpenOptions::new()
        .append(true)
        .open(fs.path().join("wal"))
        .unwrap();
    wal.write_all(&appended).unwrap();
    drop(wal);
    let report = fs.power_off(Some(3)).unwrap();
    let kept = volume.kept("wal").unwrap();
    // The write covers sectors 1..=6 (bytes 512..3512); three of them are kept whole, so the
    // file ends at the start of sector 4.
    assert_eq!(kept.len() as u64, 4 * SECTOR);
    assert_eq!(&kept[..512], &durable[..]);
    assert_eq!(&kept[512..], &appended[..kept.len() - 512]);
    assert_eq!(report.torn, Some(("wal".to_owned(), 3 * SECTOR, 3000)));
}

#[test]
fn a_clean_unmount_keeps_everything() {
    let volume = Volume::new(&[("dir/old", b"x")]);
    let Some(fs) = volume.mount() else { return };
    std::fs::write(fs.path().join("dir/new"), b"unsynced").unwrap();
    std::fs::rename(fs.path().join("dir/old"), fs.path().join("dir/renamed")).unwrap();
    fs.unmount().unwrap();
    assert_eq!(volume.kept("dir/new").unwrap(), b"unsynced");
    assert_eq!(volume.kept("dir/renamed").unwrap(), b"x");
    assert_eq!(volume.kept("dir/old"), None);
}

#[test]
fn an_armed_cut_refuses_the_matching_operation_and_everything_after_it() {
    let volume = Volume::new(&[("db/000004.log", b"old wal")]);
    let Some(fs) = volume.mount() else { return };
    let db = fs.path().join("db");
    fs.arm(Event::Rename(".log".into()), 0);
    std::fs::write(db.join("other"), b"not a match").unwrap();
    assert!(!fs.is_cut());
    let refused = std::fs::rename(db.join("000004.log"), db.join("000009.log")).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::EIO));
    assert!(fs.is_cut());
    assert!(std::fs::write(db.join("after"), b"x").is_err());
    fs.power_off(None).unwrap();
    assert_eq!(volume.kept("db/000004.log").unwrap(), b"old wal");
    assert_eq!(volume.kept("db/000009.log"), None);
}

#[test]
fn an_armed_cut_lets_the_counted_operations_through() {
    let volume = Volume::new(&[("db/.keep", b"")]);
    let Some(fs) = volume.mount() else { return };
    let db = fs.path().join("db");
    fs.arm(Event::Create("phase-flush".into()), 3);
    let mut file = File::create(db.join("phase-flush")).unwrap(); // 1: the create
    file.write_all(b"a").unwrap(); // 2
    file.sync_all().unwrap(); // 3
    assert!(!fs.is_cut());
    let refused = file.write_all(b"b").unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::EIO));
    assert!(fs.wait_cut(std::time::Duration::ZERO));
    drop(file);
    fs.power_off(None).unwrap();
    // The file's bytes were synced, but its entry never was.
    assert_eq!(volume.kept("db/phase-flush"), None);
}
