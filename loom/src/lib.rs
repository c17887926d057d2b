//! Compiles idemdb's claim latch alone, so loom can explore its interleavings without building
//! RocksDB. Run: `RUSTFLAGS="--cfg loom" cargo test --release` in this folder. The tests live
//! in `src/storage/latch.rs` (module `loom_tests`).
#![allow(dead_code)]

#[path = "../../src/storage/latch.rs"]
mod latch;
