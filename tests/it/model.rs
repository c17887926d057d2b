//! Guards the engine against a plain in-memory model (`model_core.rs`): random sequences of
//! begin, commit, abort, external begin / renew / complete / fail (with takeovers after lease
//! expiry), batch claims, clock advances, compactions and close-and-reopen, compared after
//! every step.

use proptest::prelude::*;

use crate::model_core::{KEYS, Op, RETENTION_MS, run};

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    prop_oneof![
        5 => (key.clone(), 0..2u8).prop_map(|(key, content)| Op::Begin { key, content }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(claim, result)| Op::Commit { claim, result }),
        1 => any::<usize>().prop_map(|claim| Op::Abort { claim }),
        2 => (key.clone(), 0..2u8, any::<u8>())
            .prop_map(|(key, content, result)| Op::Apply { key, content, result }),
        3 => (key.clone(), 0..2u8).prop_map(|(key, content)| Op::BeginExternal { key, content }),
        1 => any::<usize>().prop_map(|claim| Op::Renew { claim }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(claim, result)| Op::Complete { claim, result }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(claim, record)| Op::Fail { claim, record }),
        2 => (prop::collection::vec((key, 0..2u8), 1..5), any::<u8>())
            .prop_map(|(messages, result)| Op::Batch { messages, result }),
        3 => (0..2 * RETENTION_MS).prop_map(|ms| Op::AdvanceClock { ms }),
        1 => Just(Op::Compact),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(ops).map_err(TestCaseError::fail)?;
    }
}
