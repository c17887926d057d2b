//! Stateful target: arbitrary sequences of begin, commit, abort, begin-and-commit (apply),
//! external begin / renew / complete / fail, batches, clock advances, compactions and reopens, checked against the
//! in-memory model after every step (the same checker as the `model` proptest).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../../tests/it/model_core.rs"]
mod model_core;

use model_core::{KEYS, Op, RETENTION_MS, run};

/// Reads operations from the input, a byte for the kind and a few for its arguments, at most
/// 40 operations (each reopen costs a RocksDB open).
fn decode(data: &[u8]) -> Vec<Op> {
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next();
    let mut ops = Vec::new();
    while ops.len() < 40 {
        let Some(kind) = next() else { break };
        let a = next().unwrap_or(0);
        let op = match kind % 12 {
            0 => Op::Begin { key: a % KEYS, content: (a >> 4) % 2 },
            1 => Op::Commit { claim: usize::from(a), result: next().unwrap_or(0) },
            2 => Op::Abort { claim: usize::from(a) },
            3 => Op::BeginExternal { key: a % KEYS, content: (a >> 4) % 2 },
            4 => Op::Renew { claim: usize::from(a) },
            5 => Op::Complete { claim: usize::from(a), result: next().unwrap_or(0) },
            6 => Op::Fail { claim: usize::from(a), record: a & 0x80 != 0 },
            7 => {
                let count = usize::from(a % 4) + 1;
                let messages = (0..count)
                    .map(|_| {
                        let b = next().unwrap_or(0);
                        (b % KEYS, (b >> 4) % 2)
                    })
                    .collect();
                Op::Batch { messages, result: next().unwrap_or(0) }
            }
            8 => Op::AdvanceClock { ms: u64::from(a) * 2 * RETENTION_MS / 255 },
            9 => Op::Compact,
            10 => Op::Apply { key: a % KEYS, content: (a >> 4) % 2, result: next().unwrap_or(0) },
            _ => Op::Reopen,
        };
        ops.push(op);
    }
    ops
}

fuzz_target!(|data: &[u8]| {
    if let Err(failure) = run(decode(data)) {
        panic!("engine and model disagree: {failure}");
    }
});
