//! How long each primary failover kept the fleet from committing, from the consumers' ledgers:
//! from the primary's SIGKILL to the first commit the new primary acknowledged (the consumers
//! reconnect on their own), taken as the first `fresh` line whose claim began after the kill
//! (a commit whose claim began before may have been acknowledged by the old primary; `fresh`
//! lines always carry when their claim began). The accounting shows each failover's promotion
//! and first commit, then the median and the largest of the latter.

use crate::ledger::Event;
use crate::pg_cluster::Failover;
use crate::report::Report;

/// Milliseconds from the kill of `failover` to the first commit whose claim began after it;
/// none if no commit came after it.
pub fn first_commit_ms(failover: &Failover, events: &[Event]) -> Option<u64> {
    events
        .iter()
        .filter(|event| event.kind == "fresh" && event.began_ns > failover.killed_ns)
        .map(|event| (event.at_ns - failover.killed_ns) / 1_000_000)
        .min()
}

/// The median of `values` (for an even number of them, the mean of the two middle ones) and
/// the largest; none when empty.
pub fn median_max(values: &[u64]) -> Option<(u64, u64)> {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let middle = sorted.len() / 2;
    let median = match sorted.len() {
        0 => return None,
        n if n % 2 == 0 => (sorted[middle - 1] + sorted[middle]) / 2,
        _ => sorted[middle],
    };
    Some((median, sorted[sorted.len() - 1]))
}

/// Adds each failover's promotion and first commit, and their median and largest, to `report`.
pub fn report(report: &mut Report, failovers: &[Failover], events: &[Event]) {
    let mut times_ms = Vec::new();
    for (index, failover) in failovers.iter().enumerate() {
        let promotion_ms = (failover.promoted_ns - failover.killed_ns) / 1_000_000;
        report.figure(
            &format!("failover {}: promotion (ms)", index + 1),
            promotion_ms,
        );
        let label = format!("failover {}: kill to first commit (ms)", index + 1);
        match first_commit_ms(failover, events) {
            Some(ms) => {
                report.figure(&label, ms);
                times_ms.push(ms);
            }
            None => report.figure(&label, "none"),
        }
    }
    if let Some((median, max)) = median_max(&times_ms) {
        report.figure("kill to first commit, median (ms)", median);
        report.figure("kill to first commit, max (ms)", max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_even_number_is_the_mean_of_the_middle_two() {
        assert_eq!(median_max(&[150, 52]), Some((101, 150)));
        assert_eq!(median_max(&[3, 1, 2]), Some((2, 3)));
        assert_eq!(median_max(&[]), None);
    }
}
