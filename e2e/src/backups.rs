//! The online backups a partitioned fleet took (`Engine::checkpoint` under load, announced by
//! `checkpoint-start` / `checkpoint-done` ledger lines) restored and checked: each restored into
//! a scratch store, with the operator CLI's `idemdb restore` when it is built beside the checker
//! (as an operator would) or a file copy, must hold every claim with all its writes or none of
//! them, a running total equal to its orders' amounts, and every commit on its partition
//! acknowledged before the backup began.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use idemdb::{RecordState, merge_ops};

use crate::BoxError;
use crate::handoffs::percentile;
use crate::ledger::Event;
use crate::orders::{TOTAL_AMOUNT_KEY, open_store, parse_amount};
use crate::plan::Plan;
use crate::report::Report;

/// What the backups held, checked against the stores' rules and the ledgers.
#[derive(Default)]
pub struct Backups {
    /// Backups announced done in the ledgers.
    pub taken: u64,
    /// Checkpoints that returned an error (must be 0).
    pub failed: u64,
    /// Backups restored and checked.
    pub checked: u64,
    /// Whether they were restored with `idemdb restore` (else copied).
    pub restored_with_cli: bool,
    /// A record without its order row or effect, or the reverse (must be 0).
    pub torn: u64,
    /// A commit acknowledged before the backup began, missing from it (must be 0).
    pub missing_acknowledged: u64,
    /// Backups whose running total disagrees with their orders' amounts (must be 0).
    pub total_mismatches: u64,
    /// How long each checkpoint took, ms.
    pub checkpoint_ms: Vec<f64>,
}

/// The operator CLI, when it is built beside the checker (`--features cli`) and answers
/// `restore --help`.
pub fn restore_cli() -> Result<Option<PathBuf>, BoxError> {
    let here = std::env::current_exe()?;
    Ok(here
        .parent()
        .map(|release| release.join("idemdb"))
        .filter(|cli| {
            Command::new(cli)
                .args(["restore", "--help"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        }))
}

/// Restores every backup in `<work>/backups` into a scratch store (`<work>/restored`, removed
/// after each) with `cli`, or a file copy without one, and checks it against the orders of
/// `plan` and the run's `events`.
pub fn check(
    work: &Path,
    events: &[Event],
    plan: &Plan,
    cli: Option<&Path>,
) -> Result<Backups, BoxError> {
    let mut result = Backups {
        restored_with_cli: cli.is_some(),
        ..Backups::default()
    };
    let scratch = work.join("restored");
    std::fs::create_dir_all(&scratch)?;
    result.failed = events
        .iter()
        .filter(|e| e.kind == "checkpoint-failed")
        .count() as u64;
    for done in events.iter().filter(|e| e.kind == "checkpoint-done") {
        result.taken += 1;
        let Some(partition) = done.partition else {
            continue;
        };
        let Some(start) = events
            .iter()
            .find(|e| e.kind == "checkpoint-start" && e.subject == done.subject)
        else {
            return Err(format!("backup {} has no start", done.subject).into());
        };
        result
            .checkpoint_ms
            .push((done.at_ns - start.at_ns) as f64 / 1e6);
        let backup = work.join("backups").join(&done.subject);
        let restored = scratch.join(&done.subject);
        match cli {
            Some(cli) => {
                let status = Command::new(cli)
                    .arg("restore")
                    .arg(&backup)
                    .arg(&restored)
                    .stdout(Stdio::null())
                    .status()?;
                if !status.success() {
                    return Err(format!("idemdb restore {} failed: {status}", done.subject).into());
                }
            }
            None => copy_dir(&backup, &restored)?,
        }
        // Commits on this partition acknowledged (by any owner) before the backup began.
        let acknowledged: HashSet<&str> = events
            .iter()
            .take_while(|e| e.at_ns < start.at_ns)
            .filter(|e| e.kind == "fresh" && e.partition == Some(partition))
            .map(|e| e.subject.as_str())
            .collect();
        check_restored(&restored, &done.subject, plan, &acknowledged, &mut result)?;
        result.checked += 1;
        std::fs::remove_dir_all(&restored)?;
    }
    Ok(result)
}

/// Checks the store restored at `restored` from backup `name`: every order of `plan` whole,
/// every `acknowledged` one committed, the total right; counted into `result`. Every handle
/// closes on return, before the scratch store is removed.
fn check_restored(
    restored: &Path,
    name: &str,
    plan: &Plan,
    acknowledged: &HashSet<&str>,
    result: &mut Backups,
) -> Result<(), BoxError> {
    let engine = open_store(restored)?;
    let consumer = engine.consumer("orders")?;
    let orders = engine.business_table("orders")?;
    let effects = engine.business_table("effects")?;
    let mut sum = 0;
    for order_id in plan.contents.keys() {
        let committed = matches!(
            consumer.get(order_id)?.map(|record| record.state),
            Some(RecordState::Completed { .. })
        );
        let row = orders.get(order_id)?;
        let applied = effects
            .get(order_id)?
            .and_then(|value| merge_ops::read_u64(&value))
            .unwrap_or(0);
        let whole = if committed {
            row.is_some() && applied == 1
        } else {
            row.is_none() && applied == 0
        };
        if !whole {
            result.torn += 1;
            eprintln!(
                "TORN in backup {name}: {order_id}: record {committed}, row {}, effects {applied}",
                row.is_some()
            );
        }
        if let Some(row) = row {
            sum += parse_amount(&row).unwrap_or(0);
        }
        if acknowledged.contains(order_id.as_str()) && !committed {
            result.missing_acknowledged += 1;
            eprintln!("ACKNOWLEDGED BEFORE BACKUP {name} BUT MISSING: {order_id}");
        }
    }
    let total = effects
        .get(TOTAL_AMOUNT_KEY)?
        .and_then(|value| merge_ops::read_u64(&value))
        .unwrap_or(0);
    if total != sum {
        result.total_mismatches += 1;
        eprintln!("TOTAL MISMATCH in backup {name}: {total} vs {sum}");
    }
    Ok(())
}

/// Copies the files of the folder `from` (a backup is flat) into `to`.
fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

impl Backups {
    /// Adds the backups' figures to `report`; failed, torn, missing and mismatched backups
    /// must be 0, and when backups were `expected` at least one must have been checked.
    pub fn report(&self, report: &mut Report, expected: bool) {
        let mut checkpoint_ms = self.checkpoint_ms.clone();
        checkpoint_ms.sort_by(f64::total_cmp);
        let restored_with = if self.restored_with_cli {
            "idemdb restore"
        } else {
            "a file copy"
        };
        report.figure(
            "online backups taken / restored and checked",
            format!(
                "{} / {} (restored with {restored_with})",
                self.taken, self.checked
            ),
        );
        report.figure(
            "backup time (checkpoint under load)",
            format!(
                "p50 {:.1} ms, max {:.1} ms",
                percentile(&checkpoint_ms, 50.0),
                checkpoint_ms.last().copied().unwrap_or(f64::NAN)
            ),
        );
        report.zero("backups that failed", self.failed);
        report.zero("backups: claims and writes torn apart", self.torn);
        report.zero(
            "backups: acknowledged before, missing",
            self.missing_acknowledged,
        );
        report.zero("backups: totals that disagree", self.total_mismatches);
        report.require(
            !expected || self.checked > 0,
            "no backup restored and checked",
        );
    }
}
