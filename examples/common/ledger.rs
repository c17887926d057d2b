//! The consumers' event ledger: one line per event, which the end-to-end checkers read to tell
//! what happened when, across processes. A line is
//! `<kind> <subject> <partition> <monotonic ns> <pid>`, with a sixth field for something that
//! began earlier (a commit: when its claim began). Evidence for the checker, not part of the
//! effect: a recipe copied into an application leaves it out.

// Each consumer (and the checkers) uses its own part of this module.
#![allow(dead_code)]

use std::io::Write;

/// The system-wide monotonic clock in nanoseconds: the same in every process of the machine,
/// and never stepped, so the checkers can order events of several processes.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(now.tv_nsec).unwrap_or(0)
}

/// A ledger file, appended with one `write` per line to an `O_APPEND` file: a SIGKILL cannot
/// tear a line, and several processes can share the file.
pub struct Ledger {
    file: std::sync::Mutex<std::fs::File>,
}

impl Ledger {
    pub fn open(path: &std::path::Path) -> std::io::Result<Ledger> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Ledger {
            file: std::sync::Mutex::new(file),
        })
    }

    /// Appends one event; `partition` is `-` for a consumer of one queue.
    pub fn event(&self, kind: &str, subject: &str, partition: Option<usize>) {
        self.write(kind, subject, partition, "");
    }

    /// Appends one event of something that began at `began_ns` (a commit: the line's own time
    /// is when it was acknowledged), as a sixth field.
    pub fn event_since(&self, kind: &str, subject: &str, partition: Option<usize>, began_ns: u64) {
        self.write(kind, subject, partition, &format!(" {began_ns}"));
    }

    fn write(&self, kind: &str, subject: &str, partition: Option<usize>, extra: &str) {
        let partition = partition.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let line = format!(
            "{kind} {subject} {partition} {} {}{extra}\n",
            monotonic_ns(),
            std::process::id()
        );
        let mut file = self
            .file
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // A failed write is reported; the message is still acked.
        if let Err(error) = file.write_all(line.as_bytes()) {
            eprintln!("idemdb consumer: ledger: {error}");
        }
    }
}
