#!/usr/bin/env bash
# Runs every check idemdb's CI runs: formatting, clippy, the format-only build, docs, all tests
# (unit, integration, doc), and a short fuzz smoke run when cargo-fuzz and nightly are present.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

# One profile (release) for tests, benches and the demo: RocksDB's C++ is compiled once. One
# feature set (all of them: the engine, `tokio`, the `cli` binary) for the same reason.
echo "== cargo fmt --check"
cargo fmt --all -- --check
# Layers point down (ARCHITECTURE.md): no import cycle among src/'s modules. The checker lives
# beside the project's checkout on its development machines, not in the repository.
cycles="../shared/tools/module-cycles"
if [ -x "$cycles" ]; then
    echo "== module cycles"
    "$cycles" src
    "$cycles" postgres/src
    "$cycles" e2e/src
    "$cycles" http/src
else
    echo "== module cycles skipped ($cycles not found beside the checkout)"
fi
echo "== clippy"
cargo clippy --release --all-features --all-targets -- -D warnings
cargo clippy --release -p idemdb-powercut --all-targets -- -D warnings
cargo clippy --release -p idemdb-postgres --all-targets -- -D warnings
cargo clippy --release -p idemdb-e2e --all-targets -- -D warnings
cargo clippy --release -p idemdb-http --all-targets --all-features -- -D warnings
cargo clippy --release -p idemdb-http --lib --no-default-features --features postgres -- -D warnings
echo "== the PostgreSQL backend builds without RocksDB (and the HTTP layer on it alone)"
if cargo tree -p idemdb-postgres -e normal | grep -q librocksdb; then
    echo "idemdb-postgres depends on RocksDB" >&2
    exit 1
fi
if cargo tree -p idemdb-http --no-default-features --features postgres -e normal | grep -q librocksdb; then
    echo "idemdb-http with only its PostgreSQL backend depends on RocksDB" >&2
    exit 1
fi
echo "== default features (no tokio, no cli)"
cargo clippy --release --lib -- -D warnings
echo "== format-only build (no RocksDB)"
cargo clippy --release --lib --no-default-features -- -D warnings
echo "== docs (broken links are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --release --all-features --no-deps
RUSTDOCFLAGS="-D warnings" cargo doc --release -p idemdb-postgres -p idemdb-powercut --no-deps
RUSTDOCFLAGS="-D warnings" cargo doc --release -p idemdb-http --all-features --no-deps
RUSTDOCFLAGS="-D warnings" cargo doc --release -p idemdb-http --no-default-features --features postgres --no-deps

echo "== loom: every interleaving of the claim latch (2-3 threads)"
(cd loom && RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/../loom-target" \
    cargo test --release --quiet --lib)

# cargo-fuzz comes from the Rust package registry (about a minute to build); the nightly
# toolchain it needs, with the sanitizer runtimes, comes with the machine's image and cannot be
# fetched here.
if rustup toolchain list 2>/dev/null | grep -q nightly && ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "idemdb: installing cargo-fuzz (the fuzz smoke runs it)" >&2
    cargo install cargo-fuzz --locked --quiet ||
        echo "   (could not install cargo-fuzz; the fuzz smoke is skipped)"
fi
if command -v cargo-fuzz >/dev/null 2>&1 && rustup toolchain list 2>/dev/null | grep -q nightly; then
    seconds="${IDEMDB_FUZZ_SECONDS:-20}"
    # New inputs go to a scratch directory; the committed seed corpus is only read.
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    # The format targets (fuzz/) build without RocksDB. The stateful target (fuzz/engine/)
    # compiles RocksDB once more, with the fuzzer's instrumentation, into a cache of its own:
    # measured here at about 40 minutes on 2 cores (207 of RocksDB's 343 objects after 25), which
    # would take a fresh machine's run past 45 minutes. It runs where that build exists, or
    # with IDEMDB_FUZZ_ENGINE=1 (which builds it).
    specs=("fuzz key_codec" "fuzz record_decoder" "fuzz compaction_filter" "fuzz log_record_decoder")
    engine_binary="$CARGO_TARGET_DIR/../fuzz-engine-target/x86_64-unknown-linux-gnu/release/engine_model"
    if [ -x "$engine_binary" ] || [ "${IDEMDB_FUZZ_ENGINE:-}" = 1 ]; then
        specs+=("fuzz/engine engine_model")
    else
        echo "== fuzz smoke: engine_model skipped (it compiles RocksDB once more, about 40 minutes here; IDEMDB_FUZZ_ENGINE=1 runs it)"
    fi
    for spec in "${specs[@]}"; do
        read -r dir target <<<"$spec"
        echo "== fuzz smoke: $target (${seconds}s)"
        mkdir -p "$scratch/$target"
        log="$scratch/$target.log"
        cache="$CARGO_TARGET_DIR/../fuzz-target"
        if [ "$dir" = fuzz/engine ]; then cache="$CARGO_TARGET_DIR/../fuzz-engine-target"; fi
        if ! cargo +nightly fuzz run --fuzz-dir "$dir" --target-dir "$cache" \
            "$target" "$scratch/$target" "$dir/corpus/$target" \
            -- -max_total_time="$seconds" -print_final_stats=1 >"$log" 2>&1; then
            cat "$log"
            echo "fuzz target $target failed; the crashing input is under $dir/artifacts/$target" >&2
            exit 1
        fi
        grep -E "^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)" "$log" || true
    done
else
    echo "== fuzz smoke skipped (needs a nightly toolchain, and cargo-fuzz, which did not install)"
fi

echo "== the end-to-end checkers' library (e2e/): options, the report and its negative-control switch"
cargo test --release -p idemdb-e2e --lib
echo "== RabbitMQ end to end: consumers SIGKILLed against a real server"
bash scripts/rabbitmq-e2e.sh
echo "== RabbitMQ partitioned fleet: handoffs, a zombie, online backups, the negative control"
bash scripts/rabbitmq-handoff.sh
echo "== RabbitMQ streams: log consumers with their read position in the batch, SIGKILLed; two negative controls"
bash scripts/rabbitmq-streams.sh
echo "== NATS JetStream: acked consumers SIGKILLed, the server SIGKILLed twice; two negative controls"
bash scripts/nats-e2e.sh

echo "== Kafka: the recipe (recipes/kafka) on Kafka 0.9.0.1 and on tansu, manual assignment and a consumer group, SIGKILLed; two negative controls each"
cargo clippy --release -p idemdb-kafka-recipe -- -D warnings
bash scripts/kafka-e2e.sh

echo "== the PostgreSQL backend against a private PostgreSQL server (postgres/)"
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    apt_install "the PostgreSQL backend's tests start a private server" postgresql ||
        echo "   (could not install postgresql; the backend's tests skip)"
fi
cargo test --release -p idemdb-postgres
echo "== HTTP idempotency keys: the tower layer, every row of its behaviour table, on both backends (http/)"
cargo test --release -p idemdb-http --all-features
echo "== PostgreSQL fleet: one queue, 3 competing consumers, SIGKILLs, primary failovers, the negative control"
bash scripts/postgres-fleet.sh

# The power cuts of tests/crash.rs mount a FUSE file system (powercut/). As root it mounts
# through /dev/fuse itself; fuse3's fusermount3 is what it falls back on elsewhere.
if ! dpkg -s fuse3 >/dev/null 2>&1; then
    apt_install "the power-cut tests mount a FUSE file system" fuse3 ||
        echo "   (could not install fuse3; the power-cut tests skip if they cannot mount)"
fi
echo "== the power-cut file system forgets what it must (powercut/)"
cargo test --release -p idemdb-powercut
echo "== the crash harness with a small commit-log ring that grows and shrinks (SIGKILLs, power cuts at growth and shrink)"
IDEMDB_CRASH_COMMIT_LOG=1 IDEMDB_CRASH_CYCLES=30 IDEMDB_CRASH_CUTS=20 \
    cargo test --release --all-features --test crash
echo "== the crash harness on RocksDB's WAL, the opt-out (SIGKILLs, power cuts)"
IDEMDB_CRASH_WAL=1 IDEMDB_CRASH_CYCLES=20 IDEMDB_CRASH_CUTS=10 \
    cargo test --release --all-features --test crash

# Last, so that the run ends with the test runners' own summary lines. tests/cli.rs moves a
# store to PostgreSQL and back with the idemdb-pg binary the postgres crate's tests built above:
# named here, so that test fails instead of skipping if the binary is missing.
echo "== tests"
cargo build --release -p idemdb-postgres --bin idemdb-pg
IDEMDB_PG_BIN="$CARGO_TARGET_DIR/release/idemdb-pg" cargo test --release --all-features
