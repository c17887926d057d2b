//! What the engine benches share: a store in a temporary directory and a pre-filled consumer.
//!
//! Durability is `Buffered` (WAL written, not fsynced) unless a bench says otherwise, so the
//! figures show the engine's own cost; an fsync per commit would measure the disk instead. The
//! comparison harness (`compare/`) measures the durable modes against other stores.

#![allow(dead_code)] // each bench file uses part of this

use idemdb::{Durability, Engine, Fingerprint, Outcome, TableOptions};

/// A store in a temporary directory, dropped with it.
pub struct Store {
    pub engine: Engine,
    _dir: tempfile::TempDir,
}

pub fn open() -> Store {
    let dir = tempfile::tempdir().expect("temporary directory");
    let engine = Engine::builder(dir.path())
        .durability(Durability::Buffered)
        .business_table(TableOptions::new("orders"))
        .open()
        .expect("open bench store");
    Store { engine, _dir: dir }
}

/// The 16-byte message key of message number `n`.
pub fn key(n: u64) -> [u8; 16] {
    let mut key = *b"order-0000000000";
    let digits = n.to_string();
    assert!(digits.len() <= 10, "bench keys fit 10 digits");
    key[16 - digits.len()..].copy_from_slice(digits.as_bytes());
    key
}

/// Commits keys `0..count` for `consumer` with the fingerprint of the key.
pub fn fill(store: &Store, consumer: &str, count: u64) {
    let consumer = store.engine.consumer(consumer).expect("consumer");
    for n in 0..count {
        let key = key(n);
        let Outcome::Fresh(claim) = consumer.begin(key, Fingerprint::of(key)).expect("begin")
        else {
            panic!("keys are unique while filling");
        };
        claim.commit(b"stored result").expect("commit");
    }
}
