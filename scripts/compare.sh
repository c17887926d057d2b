#!/usr/bin/env bash
# The comparison harness (compare/): idemdb side by side with raw RocksDB, RocksDB's
# TransactionDB, Redis, SQLite and PostgreSQL, plus the scale, expiry and WAL-option runs.
#
#   ./scripts/compare.sh all                 # everything BENCHMARKS.md shows (about 25 minutes)
#   ./scripts/compare.sh peers --seconds 3   # or: scale, ttl, wal-options; --help for options
#
# Installs what it needs when missing (Redis, PostgreSQL and a font for the charts, from Debian's
# packages). The servers it starts listen on 127.0.0.1 only, on ports 16379-16381 by default, with
# their data in a temporary directory, and are stopped by pid when the run ends. Results and
# charts go to docs/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
if ((${#missing[@]})); then
    echo "idemdb compare: installing ${missing[*]}" >&2
    sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    # Debian's packages start their own servers on the default ports when a service manager is
    # running; the harness starts its own instead, so keep the package's from starting.
    policy=/usr/sbin/policy-rc.d
    created_policy=""
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
        $sudo chmod +x "$policy"
        created_policy=1
    fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
    if [ -n "$created_policy" ]; then $sudo rm -f "$policy"; fi
fi

exec cargo run --release --quiet -p idemdb-compare -- "${@:-all}"
