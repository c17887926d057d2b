//! `backup` and `restore`: a stopped store copied into a new directory, and a backup copied
//! back into a new store directory. The rules (what may be copied, how, what is fsynced) live
//! in `idemdb::admin`; this module opens, shows the progress of the copies and the summary.

use std::io::{self, IsTerminal, Write};
use std::time::{Duration, Instant};

use idemdb::Error;
use idemdb::admin::{Backup, TransferReport, check_new_dir};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{BackupArgs, RestoreArgs};
use crate::json::{transfer_json, write_json};
use crate::render::write_transfer;
use crate::repair::open_write;
use crate::{EXIT_OK, Failure};

/// What the busy message tells the operator of a backup.
const BACKUP_REMEDY: &str = "An offline backup needs it stopped (or --wait DURATION); a running \
                             application takes online backups itself with Engine::checkpoint.";
/// What the busy message tells the operator of a restore whose backup is open as a store.
const RESTORE_REMEDY: &str = "A store in use is no backup (its files change while they are \
                              copied): restore from a backup made by `idemdb backup` or \
                              Engine::checkpoint.";

pub fn backup(args: &BackupArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    // Before the store is opened: a wrong target leaves the store untouched.
    check_new_dir(&args.dir)?;
    let store = open_write(&args.store, None, &args.wait).map_err(|failure| match failure {
        Failure::Store {
            error: Error::AlreadyOpen { path },
            ..
        } => Failure::Busy {
            path,
            remedy: BACKUP_REMEDY,
        },
        other => other,
    })?;
    let (report, elapsed) = with_progress("copying", |progress| store.backup(&args.dir, progress))?;
    if json {
        write_json(
            out,
            &transfer_json(&args.store, &report.path, &report, elapsed),
        )?;
    } else {
        write_transfer(out, "backup", &args.store, &report.path, &report, elapsed)?;
    }
    Ok(EXIT_OK)
}

pub fn restore(args: &RestoreArgs, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    let backup = Backup::open(&args.backup).map_err(|error| match error {
        Error::AlreadyOpen { path } => Failure::Busy {
            path,
            remedy: RESTORE_REMEDY,
        },
        error => Failure::opening(error),
    })?;
    let (report, elapsed) = with_progress("restoring", |progress| {
        backup.restore(&args.store, progress)
    })?;
    if json {
        write_json(
            out,
            &transfer_json(&report.path, &args.backup, &report, elapsed),
        )?;
    } else {
        write_transfer(out, "restore", &args.backup, &report.path, &report, elapsed)?;
    }
    Ok(EXIT_OK)
}

/// Runs one copy (`copy` reports its progress through the callback it is given) under a
/// progress bar labelled `message`, and returns what it wrote and how long it took.
fn with_progress(
    message: &'static str,
    copy: impl FnOnce(&mut dyn FnMut(u64, u64)) -> idemdb::Result<TransferReport>,
) -> Result<(TransferReport, Duration), Failure> {
    let started = Instant::now();
    let mut bar = CopyProgress::new(message);
    let report = copy(&mut |copied, total| bar.update(copied, total));
    bar.finish();
    Ok((report?, started.elapsed()))
}

/// The bar shown while bytes are copied: on standard error, only when it is a terminal (a
/// script's log gets the summary alone), and only once there is something to copy (a backup
/// made of hard links has no copy to show).
struct CopyProgress {
    bar: Option<ProgressBar>,
    message: &'static str,
}

impl CopyProgress {
    fn new(message: &'static str) -> CopyProgress {
        CopyProgress { bar: None, message }
    }

    fn update(&mut self, copied: u64, total: u64) {
        let message = self.message;
        let bar = self.bar.get_or_insert_with(|| {
            let bar = if io::stderr().is_terminal() {
                ProgressBar::new(total)
            } else {
                ProgressBar::hidden()
            };
            if let Ok(style) = ProgressStyle::with_template(
                "{msg} [{bar:32}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(message);
            bar
        });
        bar.set_length(total);
        bar.set_position(copied);
    }

    fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
