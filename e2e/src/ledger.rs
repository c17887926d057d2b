//! The consumers' ledgers read back (the lines `examples/common/ledger.rs` writes): every event
//! with its kind, subject, partition, pid and times on the system-wide monotonic clock, so that
//! events of several processes can be put in order.

use std::path::Path;

use crate::BoxError;

#[path = "../../examples/common/ledger.rs"]
mod writer;
pub use writer::{Ledger, monotonic_ns};

/// One ledger line.
#[derive(Clone, Debug)]
pub struct Event {
    pub kind: String,
    pub subject: String,
    /// The partition of a partitioned fleet's event (`-` in the line: none).
    pub partition: Option<usize>,
    pub at_ns: u64,
    pub pid: u32,
    /// When what the line reports began: a commit's start (its line is written when it was
    /// acknowledged); the line's own time for every other event.
    pub began_ns: u64,
}

/// Every line of the ledger at `path`, in file order; none if it does not exist yet.
pub fn read(path: &Path) -> Result<Vec<Event>, BoxError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(format!("reading {}: {error}", path.display()).into()),
    };
    let malformed = |line: &str| format!("{}: malformed line {line:?}", path.display());
    let mut events = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let (&[kind, subject, partition, at_ns, pid], began) = fields.split_at(5.min(fields.len()))
        else {
            return Err(malformed(line).into());
        };
        let at_ns = at_ns.parse()?;
        events.push(Event {
            kind: kind.to_owned(),
            subject: subject.to_owned(),
            partition: partition.parse().ok(),
            at_ns,
            pid: pid.parse()?,
            began_ns: match began {
                [] => at_ns,
                [began] => began.parse()?,
                _ => return Err(malformed(line).into()),
            },
        });
    }
    Ok(events)
}

/// The ledgers in `work` whose names start with `prefix` and end with `.log`.
fn files(work: &Path, prefix: &str) -> Result<Vec<std::path::PathBuf>, BoxError> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(work)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(prefix) && name.ends_with(".log") {
            found.push(path);
        }
    }
    Ok(found)
}

/// Every line of the ledgers `<prefix>*.log` in `work`, in time order.
pub fn read_all(work: &Path, prefix: &str) -> Result<Vec<Event>, BoxError> {
    let mut events = Vec::new();
    for path in files(work, prefix)? {
        events.extend(read(&path)?);
    }
    events.sort_by_key(|event| event.at_ns);
    Ok(events)
}

/// The total size of the ledgers `<prefix>*.log` in `work`: still growing means the consumers
/// are still processing.
pub fn bytes(work: &Path, prefix: &str) -> Result<u64, BoxError> {
    let mut total = 0;
    for path in files(work, prefix)? {
        total += std::fs::metadata(path).map_or(0, |metadata| metadata.len());
    }
    Ok(total)
}

/// How many of `events` are of `kind` and happened at or after `since_ns`.
pub fn count(events: &[Event], kind: &str, since_ns: u64) -> u64 {
    events
        .iter()
        .filter(|event| event.kind == kind && event.at_ns >= since_ns)
        .count() as u64
}
