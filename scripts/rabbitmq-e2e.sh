#!/usr/bin/env bash
# The RabbitMQ end-to-end test: a private RabbitMQ server on 127.0.0.1, consumer processes
# (examples/rabbitmq_orders.rs) SIGKILLed at random moments and restarted until the queues
# drain, then the accounting (e2e/src/bin/rabbitmq_e2e.rs): lost = 0 and applied twice = 0.
#
#   ./scripts/rabbitmq-e2e.sh                      # the CI size: 2,000 orders, >= 10 kills
#   ./scripts/rabbitmq-e2e.sh --orders 100000 --rate 2000 --min-kills 100   # the long run
#
# Arguments go to the checker (see the header of e2e/src/bin/rabbitmq_e2e.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
source scripts/rabbitmq.sh

rabbitmq_install
# The same features as the test command, so the two share one build of the crate.
cargo build --release --all-features --example rabbitmq_orders
cargo build --release -p idemdb-e2e --bin rabbitmq_e2e

work="$(mktemp -d -t idemdb-rabbitmq-XXXXXX)"
trap 'rabbitmq_stop; rm -rf "$work"' EXIT
rabbitmq_start "$work/server"
"$CARGO_TARGET_DIR/release/rabbitmq_e2e" --amqp "$RABBITMQ_URL" --work "$work/run" "$@"
