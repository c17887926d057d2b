//! A run's accounting: the figures, in the order they are added, each either shown as is or
//! required to be 0 (or some other condition required to hold); then the verdict line. A
//! negative control (a consumer built to be wrong) passes only when the checker catches it.

use std::fmt::Display;

use crate::verdict::Verdict;

/// Whether the run is the real one or a negative control.
pub enum Control<'a> {
    /// Passes when every condition holds; `claim` is what the passing line says held.
    Run { claim: &'a str },
    /// Passes when the checker caught the flaw built in (`caught`); `flaw` names what it found.
    Negative { caught: bool, flaw: &'a str },
}

pub struct Report {
    name: String,
    rows: Vec<(String, String)>,
    failures: Vec<String>,
}

impl Report {
    /// The accounting of the checker (or the run) `name`.
    pub fn new(name: &str) -> Report {
        Report {
            name: name.to_owned(),
            rows: Vec::new(),
            failures: Vec::new(),
        }
    }

    /// A figure shown as is.
    pub fn figure(&mut self, label: &str, value: impl Display) {
        self.rows.push((label.to_owned(), value.to_string()));
    }

    /// A figure that must be 0 for the run to pass.
    pub fn zero(&mut self, label: &str, value: u64) {
        self.figure(label, value);
        if value != 0 {
            self.failures.push(format!("{label} = {value}"));
        }
    }

    /// A condition the run needs that is not a row of its own.
    pub fn require(&mut self, holds: bool, what: &str) {
        if !holds {
            self.failures.push(what.to_owned());
        }
    }

    /// The check of every order: each way of getting one wrong (all must be 0). `conflicts`
    /// says what happens to a conflict ("dead-lettered", "recorded"); `stores` what a store is
    /// ("shards", "streams"), when each store's running total was checked ([`verify`]; `None`
    /// after [`check_applied`] alone, which checks no total).
    ///
    /// [`verify`]: crate::verdict::verify
    /// [`check_applied`]: crate::verdict::check_applied
    pub fn verdict(&mut self, verdict: &Verdict, conflicts: &str, stores: Option<&str>) {
        self.zero("lost", verdict.lost);
        self.zero("applied twice", verdict.applied_twice);
        self.zero(
            "applied with content never published",
            verdict.wrong_content,
        );
        self.zero(
            &format!("conflicting content not {conflicts}"),
            verdict.missing_conflicts,
        );
        self.zero(
            &format!("{conflicts} without a conflict"),
            verdict.false_conflicts,
        );
        if let Some(stores) = stores {
            let label = format!("{stores} whose total amount disagrees");
            self.zero(&label, verdict.total_mismatches);
        }
    }

    /// Prints the rows, and returns whether the run passed, after printing the verdict line.
    pub fn finish(&self, control: Control) -> bool {
        let width = self
            .rows
            .iter()
            .map(|(label, _)| label.len())
            .max()
            .unwrap_or(0)
            .max(44);
        for (label, value) in &self.rows {
            println!("  {label:<width$} {value:>9}");
        }
        let name = &self.name;
        match control {
            Control::Run { claim } => {
                for failure in &self.failures {
                    println!("  FAILED: {failure}");
                }
                let passed = self.failures.is_empty();
                if passed {
                    println!("{name}: PASSED: {claim}");
                } else {
                    println!("{name}: FAILED");
                }
                passed
            }
            Control::Negative { caught, flaw } => {
                if caught {
                    println!("{name}: negative control PASSED: the checker caught it: {flaw}");
                } else {
                    println!("{name}: negative control FAILED: the checker missed it: {flaw}");
                }
                caught
            }
        }
    }
}

/// The median and the largest of `values` (none when empty).
pub fn median_max(values: &[f64]) -> Option<(f64, f64)> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = *sorted.get(sorted.len() / 2)?;
    Some((median, sorted[sorted.len() - 1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_figure_required_zero_fails_the_run_and_passes_a_negative_control_that_sees_it() {
        let mut report = Report::new("test");
        report.figure("published", 10);
        report.zero("lost", 0);
        assert!(report.finish(Control::Run { claim: "lost = 0" }));
        report.zero("applied twice", 2);
        assert!(!report.finish(Control::Run { claim: "" }));
        let caught = Control::Negative {
            caught: true,
            flaw: "applied twice > 0",
        };
        assert!(report.finish(caught));
        let missed = Control::Negative {
            caught: false,
            flaw: "applied twice > 0",
        };
        assert!(!report.finish(missed));
    }

    #[test]
    fn a_condition_that_does_not_hold_fails_the_run() {
        let mut report = Report::new("test");
        report.require(false, "fewer kills than asked");
        assert!(!report.finish(Control::Run { claim: "" }));
        assert_eq!(median_max(&[3.0, 1.0, 2.0]), Some((2.0, 3.0)));
        assert_eq!(median_max(&[]), None);
    }
}
