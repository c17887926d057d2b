#!/usr/bin/env bash
# Runs every check idemdb's CI runs: formatting, clippy, the format-only build, all tests
# (unit, integration, doc), and a short fuzz smoke run when cargo-fuzz and nightly are present.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

# One profile (release) for tests, benches and the demo: RocksDB's C++ is compiled once.
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --release --all-targets -- -D warnings
echo "== format-only build (no RocksDB)"
cargo clippy --release --lib --no-default-features -- -D warnings
echo "== tests"
cargo test --release

if command -v cargo-fuzz >/dev/null 2>&1 && rustup toolchain list 2>/dev/null | grep -q nightly; then
    seconds="${IDEMDB_FUZZ_SECONDS:-20}"
    for target in key_codec record_decoder; do
        echo "== fuzz smoke: $target (${seconds}s)"
        (cd fuzz && cargo +nightly fuzz run "$target" -- -max_total_time="$seconds" -print_final_stats=1 2>&1 | tail -n 3)
    done
else
    echo "== fuzz smoke skipped (needs: cargo install cargo-fuzz, and a nightly toolchain)"
fi
