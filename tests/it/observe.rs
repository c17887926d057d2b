//! Guards observability: the metrics facade receives outcome counts per consumer, commit
//! counts and duplicate ages, and `Engine::stats` reports the same numbers in process.

use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};

use crate::util::TestStore;
use idemdb::{FailurePolicy, Fingerprint, Outcome};

#[test]
fn outcomes_commits_and_duplicate_age_are_recorded() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let store = TestStore::new();
    metrics::with_local_recorder(&recorder, || {
        let engine = store.open();
        let billing = engine.consumer("billing").unwrap();
        let shipping = engine.consumer("shipping").unwrap();
        let fp = Fingerprint::of(b"m");
        for key in ["a", "b", "c"] {
            let Outcome::Fresh(claim) = billing.begin(key, fp).unwrap() else {
                panic!("fresh expected");
            };
            claim.commit(b"").unwrap();
        }
        store.clock.advance(Duration::from_secs(90));
        for key in ["a", "b"] {
            assert!(matches!(
                billing.begin(key, fp).unwrap(),
                Outcome::Duplicate { .. }
            ));
        }
        assert!(matches!(
            billing.begin("c", Fingerprint::of(b"other")).unwrap(),
            Outcome::Conflict { .. }
        ));
        let Outcome::Fresh(external) = shipping
            .begin_external("p", fp, Duration::from_secs(5), "w")
            .unwrap()
        else {
            panic!("fresh expected");
        };
        assert_eq!(engine.stats().consumers[1].external_in_progress, 1);
        external.fail(FailurePolicy::Release).unwrap();

        let stats = engine.stats();
        let billing_stats = &stats.consumers[0];
        assert_eq!(billing_stats.consumer, "billing");
        assert_eq!(
            (
                billing_stats.fresh,
                billing_stats.duplicate,
                billing_stats.conflict
            ),
            (3, 2, 1)
        );
        assert_eq!(billing_stats.commits, 3);
        assert_eq!(stats.consumers[1].fresh, 1);
        assert_eq!(stats.consumers[1].external_in_progress, 0);
    });

    let mut outcomes = std::collections::HashMap::new();
    let mut duplicate_ages = Vec::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels: std::collections::HashMap<String, String> = key
            .key()
            .labels()
            .map(|label| (label.key().to_owned(), label.value().to_owned()))
            .collect();
        match (key.key().name(), value) {
            ("idemdb_outcomes_total", DebugValue::Counter(count)) => {
                outcomes.insert(
                    (labels["consumer"].clone(), labels["outcome"].clone()),
                    count,
                );
            }
            ("idemdb_duplicate_age_seconds", DebugValue::Histogram(values)) => {
                duplicate_ages.extend(values.into_iter().map(|v| v.into_inner()));
            }
            _ => {}
        }
    }
    let count = |consumer: &str, outcome: &str| {
        outcomes
            .get(&(consumer.to_owned(), outcome.to_owned()))
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(count("billing", "fresh"), 3);
    assert_eq!(count("billing", "duplicate"), 2);
    assert_eq!(count("billing", "conflict"), 1);
    assert_eq!(count("shipping", "fresh"), 1);
    assert_eq!(count("shipping", "duplicate"), 0);
    assert_eq!(duplicate_ages, [90.0, 90.0]);
}
