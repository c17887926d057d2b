//! Guards observability: the metrics facade receives outcome counts per consumer, commit
//! counts and duplicate ages, every series labelled `backend="rocksdb"`, and `Engine::stats`
//! reports the same numbers in process.

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
        assert_eq!(
            labels.get("backend").map(String::as_str),
            Some("rocksdb"),
            "{} is labelled with its backend",
            key.key().name()
        );
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

/// Two stores in one process (two partitions) report separate series, told apart by the
/// label each was opened with; every metric carries it.
#[test]
fn metrics_labels_tell_two_stores_apart() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (first, second) = (TestStore::new(), TestStore::new());
    metrics::with_local_recorder(&recorder, || {
        let a = first
            .builder()
            .metrics_label("partition", "0")
            .open()
            .unwrap();
        let b = second
            .builder()
            .metrics_label("partition", "1")
            .metrics_label("region", "eu")
            .open()
            .unwrap();
        for (engine, commits) in [(&a, 2), (&b, 3)] {
            let orders = engine.consumer("orders").unwrap();
            for n in 0..commits {
                let Outcome::Fresh(claim) = orders
                    .begin(format!("m{n}"), Fingerprint::of(b"x"))
                    .unwrap()
                else {
                    panic!("fresh expected");
                };
                claim.commit(b"").unwrap();
            }
        }
    });
    let mut commits = std::collections::BTreeMap::new();
    let mut names = std::collections::BTreeSet::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels: Vec<(String, String)> = key
            .key()
            .labels()
            .map(|label| (label.key().to_owned(), label.value().to_owned()))
            .collect();
        let partition = labels.iter().find(|(name, _)| name == "partition");
        let partition = partition.map(|(_, value)| value.clone());
        assert!(
            partition.is_some(),
            "{} has no partition label",
            key.key().name()
        );
        names.insert(key.key().name().to_owned());
        if let ("idemdb_commits_total", DebugValue::Counter(count)) = (key.key().name(), value) {
            commits.insert(labels, count);
        }
    }
    let label = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    };
    assert_eq!(
        commits,
        [
            (
                label(&[
                    ("consumer", "orders"),
                    ("backend", "rocksdb"),
                    ("partition", "0")
                ]),
                2
            ),
            (
                label(&[
                    ("consumer", "orders"),
                    ("backend", "rocksdb"),
                    ("partition", "1"),
                    ("region", "eu")
                ]),
                3
            ),
        ]
        .into_iter()
        .collect()
    );
    assert!(names.contains("idemdb_outcomes_total") && names.contains("idemdb_claim_seconds"));
}

#[test]
fn a_bad_metrics_label_is_refused_at_open() {
    let store = TestStore::new();
    let long = "v".repeat(idemdb::METRICS_LABEL_VALUE_BYTES_MAX + 1);
    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("empty name", vec![("", "x")]),
        ("starts with a digit", vec![("1partition", "x")]),
        ("a dash", vec![("part-ition", "x")]),
        ("reserved prefix", vec![("__name", "x")]),
        ("set by the engine", vec![("consumer", "x")]),
        ("set by the engine", vec![("outcome", "x")]),
        ("set by the engine", vec![("backend", "x")]),
        ("twice", vec![("partition", "1"), ("partition", "2")]),
        ("too long a value", vec![("partition", long.as_str())]),
    ];
    for (why, labels) in cases {
        let mut builder = store.builder();
        for (name, value) in labels {
            builder = builder.metrics_label(name, value);
        }
        match builder.open() {
            Err(idemdb::Error::InvalidOption { .. }) => {}
            other => panic!("{why}: expected InvalidOption, got {:?}", other.map(|_| ())),
        }
    }
    let mut builder = store.builder();
    for n in 0..=idemdb::METRICS_LABELS_MAX {
        builder = builder.metrics_label(&format!("l{n}"), "x");
    }
    assert!(matches!(
        builder.open(),
        Err(idemdb::Error::InvalidOption { .. })
    ));
    // Nothing was created by the refusals above; a good label opens.
    store
        .builder()
        .metrics_label("partition_7", "")
        .open()
        .unwrap();
}
