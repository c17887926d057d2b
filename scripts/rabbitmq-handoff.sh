#!/usr/bin/env bash
# The partitioned-fleet end-to-end test: a private RabbitMQ server on 127.0.0.1 routing orders
# through its consistent-hash exchange to partition queues with a single active consumer; a
# fleet of consumers (examples/rabbitmq_partitions/) whose partition stores move with their
# partitions, SIGKILLed, restarted and once SIGSTOPped past the heartbeat timeout; online
# backups restored and checked; then the accounting (e2e/src/bin/rabbitmq_handoff.rs). Then the
# negative control: the same fleet with stores that stay with each consumer must be caught
# applying orders twice.
#
#   ./scripts/rabbitmq-handoff.sh                  # the CI size: 2,000 orders, >= 10 kills
#   ./scripts/rabbitmq-handoff.sh --orders 100000 --rate 1000 --min-kills 300   # the long run
#
# Arguments go to the checker (see the header of e2e/src/bin/rabbitmq_handoff.rs); the negative
# control always runs at the CI size.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
source scripts/rabbitmq.sh

rabbitmq_install
# The same features as the test command, so the two share one build of the crate; the operator
# CLI restores the backups.
cargo build --release --all-features --bin idemdb --example rabbitmq_partitions
cargo build --release -p idemdb-e2e --bin rabbitmq_handoff

work="$(mktemp -d -t idemdb-handoff-XXXXXX)"
# A failed run keeps its work folder (ledgers, stores, consumer logs) for inspection.
trap 'status=$?; rabbitmq_stop; if [ "$status" = 0 ]; then rm -rf "$work"; else
    echo "idemdb: the run failed; its files are in $work" >&2; fi' EXIT
rabbitmq_start "$work/server"
checker="$CARGO_TARGET_DIR/release/rabbitmq_handoff"
"$checker" --amqp "$RABBITMQ_URL" --work "$work/run" "$@"
echo "== negative control: each consumer keeps its own stores"
"$checker" --amqp "$RABBITMQ_URL" --work "$work/negative" --negative-control --orders 1000 \
    --seed 2
