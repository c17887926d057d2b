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
    apt_install "for the comparison harness" "${missing[@]}"
fi

exec cargo run --release --quiet -p idemdb-compare -- "${@:-all}"
