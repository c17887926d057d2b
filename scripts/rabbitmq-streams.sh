#!/usr/bin/env bash
# The log consumers' end-to-end run: a private RabbitMQ server on 127.0.0.1 with its stream
# plugin, consumer processes (examples/stream_orders/) reading one stream each, SIGKILLed at
# random moments and at the commit point (and, each once, right after the commit of its stream's
# last offset, when nothing is left to read after a restart) and restarted, then the accounting
# (e2e/src/bin/stream_e2e.rs): lost = 0, applied twice = 0, read again after a restart = 0. Then
# the two negative controls, the position kept at the broker before and after the commit,
# each of which must be caught (lost > 0; read again > 0).
#
#   ./scripts/rabbitmq-streams.sh                 # the CI size
#   ./scripts/rabbitmq-streams.sh --orders 100000 --rate 1500 --min-kills 100   # the long run
#
# Arguments go to the main run's checker (see the header of e2e/src/bin/stream_e2e.rs); the
# controls keep their CI size.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
source scripts/rabbitmq.sh

rabbitmq_install
# The same features as the test command, so the two share one build of the crate.
cargo build --release --all-features --example stream_orders
cargo build --release -p idemdb-e2e --bin stream_e2e

work="$(mktemp -d -t idemdb-streams-XXXXXX)"
# A failed run keeps its folder (the ledgers, the stores, the server's log) for a look.
trap 'status=$?; rabbitmq_stop; if [ "$status" -eq 0 ]; then rm -rf "$work"; else echo "rabbitmq-streams: kept $work" >&2; fi' EXIT
rabbitmq_start "$work/server"
checker="$CARGO_TARGET_DIR/release/stream_e2e"
"$checker" --port "$RABBITMQ_STREAM_PORT" --work "$work/run" --orders 3000 --rate 400 \
    --min-kills 15 --kill-after-last-commit "$@"
"$checker" --port "$RABBITMQ_STREAM_PORT" --work "$work/before" --orders 1500 --rate 400 \
    --min-kills 5 --kill-at-commit-per-mille 30 --position broker-before-commit
"$checker" --port "$RABBITMQ_STREAM_PORT" --work "$work/after" --orders 1500 --rate 400 \
    --min-kills 5 --kill-at-commit-per-mille 30 --position broker-after-commit
