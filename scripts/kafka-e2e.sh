#!/usr/bin/env bash
# The Kafka end-to-end run: the Kafka recipe (recipes/kafka, rdkafka) against a private
# Kafka-protocol broker on 127.0.0.1, consumers SIGKILLed at random moments, right after a
# commit and (manual shape) once right after the commit of their partition's last offset, and
# restarted, then the accounting (e2e/src/bin/kafka_e2e.rs): lost = 0, applied twice
# = 0, read again after a restart = 0. On each broker: the manual-assignment shape, the
# consumer-group shape (partitions moved between members as they are SIGKILLed), and the two
# negative controls, the position kept in the group's committed offsets before and after the
# commit, each of which must be caught (lost > 0; read again > 0).
#
#   ./scripts/kafka-e2e.sh                         # both brokers, the CI size
#   ./scripts/kafka-e2e.sh apache                  # one broker (apache: Kafka 0.9.0.1; tansu)
#   ./scripts/kafka-e2e.sh apache --shape manual --orders 100000 --rate 1200 --min-kills 100
#                                                  # one long run, no controls
#
# The brokers install into the build cache when missing (scripts/kafka.sh). Arguments after the
# broker go to one checker run instead of the CI set (see the header of
# e2e/src/bin/kafka_e2e.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
source scripts/kafka.sh

brokers=(apache tansu)
if (($#)); then
    brokers=("$1")
    shift
fi
for broker in "${brokers[@]}"; do kafka_install "$broker"; done
cargo build --release -p idemdb-kafka-recipe
cargo build --release -p idemdb-e2e --bin kafka_e2e

work="$(mktemp -d -t idemdb-kafka-XXXXXX)"
# A failed run keeps its folder (the ledgers, the stores, the broker's output) for a look.
trap 'status=$?; kafka_stop; if [ "$status" -eq 0 ]; then rm -rf "$work"; else echo "kafka-e2e: kept $work" >&2; fi' EXIT
checker="$CARGO_TARGET_DIR/release/kafka_e2e"

# run BROKER NAME ARGS...: one checker run on a topic of its own.
run() {
    local broker="$1" name="$2"
    shift 2
    kafka_create_topic "$broker" "orders.$name" 3
    "$checker" --bootstrap "$KAFKA_BOOTSTRAP" --protocol "$KAFKA_PROTOCOL" \
        --topic "orders.$name" --partitions 3 --work "$work/$broker-$name" "$@"
}

for broker in "${brokers[@]}"; do
    started=$SECONDS
    kafka_start "$broker" "$work/$broker-server"
    if (($#)); then
        run "$broker" custom "$@"
    else
        run "$broker" manual --orders 3000 --rate 400 --min-kills 15 --kill-after-last-commit
        # Members killed every 7 to 10 s: a dead member's partitions move once its session
        # (6 s) times out.
        run "$broker" group --shape group --members 3 --orders 3000 --rate 150 --min-kills 4 \
            --kill-gap-ms 7000 --kill-spread-ms 3000 --kill-at-commit-per-mille 0
        run "$broker" before --orders 1500 --rate 400 --min-kills 5 \
            --kill-at-commit-per-mille 30 --position broker-before-commit
        run "$broker" after --orders 1500 --rate 400 --min-kills 5 \
            --kill-at-commit-per-mille 30 --position broker-after-commit
    fi
    kafka_stop
    echo "kafka-e2e: $broker done in $((SECONDS - started)) s" >&2
done
