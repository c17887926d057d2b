#!/usr/bin/env bash
# The fleet end-to-end test: one RabbitMQ queue, three competing consumer processes
# (examples/postgres_orders/) whose claims live in PostgreSQL, a primary with a synchronous
# standby; consumers SIGKILLed at random moments, the primary SIGKILLed and its standby promoted;
# then the accounting and the republish check (e2e/src/bin/postgres_fleet.rs). Then the negative
# control: the same fleet with an embedded store per consumer must be caught applying orders
# twice.
#
#   ./scripts/postgres-fleet.sh                    # the CI size: 2,000 orders, 10 kills, 2 failovers
#   ./scripts/postgres-fleet.sh --orders 100000 --rate 600 --min-kills 100 --failovers 5   # long
#
# Arguments go to the checker (see the header of e2e/src/bin/postgres_fleet.rs); the negative
# control always runs at the CI size. The PostgreSQL servers are started by the checker itself
# (Debian's binaries, 127.0.0.1, free ports, folders of their own, stopped by pid).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
source scripts/rabbitmq.sh

rabbitmq_install
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    apt_install "the fleet test starts private PostgreSQL servers" postgresql
fi
# The same features as the test command, so the two share one build of the crate.
cargo build --release --all-features --example postgres_orders
cargo build --release -p idemdb-e2e --bin postgres_fleet

work="$(mktemp -d -t idemdb-fleet-XXXXXX)"
# A failed run keeps its work folder (ledgers, consumer logs) for inspection.
trap 'status=$?; rabbitmq_stop; if [ "$status" = 0 ]; then rm -rf "$work"; else
    echo "idemdb: the run failed; its files are in $work" >&2; fi' EXIT
rabbitmq_start "$work/server"
checker="$CARGO_TARGET_DIR/release/postgres_fleet"
"$checker" --amqp "$RABBITMQ_URL" --work "$work/run" "$@"
echo "== negative control: each consumer keeps its own embedded store"
"$checker" --amqp "$RABBITMQ_URL" --work "$work/negative" --negative-control --orders 1000 \
    --min-kills 0 --seed 2
