#!/usr/bin/env bash
# Runs the demo: a simulated at-least-once broker feeding 1,000,000 deliveries to an idempotent
# consumer on the embedded store, with resends, worker crashes and a process crash; it ends by
# checking that every order's effect was applied exactly once. Arguments go to the demo
# (--messages N, --workers N, --durability sync|buffered, --dir PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo run --release --all-features --example demo -- "$@"
