#!/usr/bin/env bash
# Instruction profiles of the harness's embedded contenders, with callgrind: where each one's
# CPU goes, per message, counted exactly (instruction counts do not depend on what else the
# machine is doing). Writes docs/bench/profile.md (or the folder given as $1).
#
# The pairs are the targets a CPU profile explains: idemdb's batch path against RocksDB blind
# puts of the same bytes (P1) and against a hand-written batch dedup, a multi-get and one write
# (P12); the duplicate path against the insert path (P6); and idemdb's single claim against the
# hand-written get + write it replaces (P11).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
if ! command -v valgrind >/dev/null 2>&1; then
    echo "idemdb: installing valgrind" >&2
    sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq valgrind >/dev/null
fi
out="${1:-docs/bench}"
messages="${IDEMDB_PROFILE_MESSAGES:-64000}"
cargo build --release -p idemdb-compare
harness="$CARGO_TARGET_DIR/release/idemdb-compare"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

contenders=(
    "idemdb default buffered, batch 64"
    "rocksdb blind put, batch 64"
    "rocksdb multi-get + write batch, batch 64"
    "idemdb default buffered, 1 thread"
    "rocksdb get+write under lock, 1 thread"
    "idemdb duplicates, 1 thread"
)
# Only some of them: IDEMDB_PROFILE_ONLY="name|name" (an extended regular expression).
if [ -n "${IDEMDB_PROFILE_ONLY:-}" ]; then
    chosen=()
    for contender in "${contenders[@]}"; do
        if [[ "$contender" =~ $IDEMDB_PROFILE_ONLY ]]; then chosen+=("$contender"); fi
    done
    contenders=("${chosen[@]}")
fi
mkdir -p "$out"
report="$out/profile.md"
{
    echo "# Instruction profiles (callgrind)"
    echo
    echo "Produced by \`scripts/profile.sh\` with $messages messages per contender (10% re-sent),"
    echo "counting only the deliveries (\`--toggle-collect\` on the harness's delivery loop; store"
    echo "setup and RocksDB's background threads are not counted). Instruction counts are exact"
    echo "for a given binary and input; the top functions are by exclusive cost."
    echo
    echo "| contender | instructions per message |"
    echo "|---|---:|"
} >"$report.head"
: >"$report.body"
for contender in "${contenders[@]}"; do
    slug="$(echo "$contender" | tr -c 'a-z0-9' '-')"
    echo "== callgrind: $contender" >&2
    valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*profiled_deliveries*' \
        --callgrind-out-file="$work/$slug.out" \
        "$harness" profile --contender "$contender" --messages "$messages" \
        >"$work/$slug.log" 2>"$work/$slug.err"
    delivered="$(grep -oE '^profile: [0-9]+' "$work/$slug.log" | grep -oE '[0-9]+')"
    callgrind_annotate --inclusive=no "$work/$slug.out" >"$work/$slug.txt"
    total="$(grep -E 'PROGRAM TOTALS' "$work/$slug.txt" | grep -oE '^[0-9,]+' | tr -d ,)"
    echo "| $contender | $((total / delivered)) |" >>"$report.head"
    {
        echo
        echo "## $contender"
        echo
        echo "$delivered messages, $total instructions. Top functions (exclusive):"
        echo
        echo '```text'
        # The function table: count, share, and the function (file names dropped). awk stops
        # after 25 rows itself: a `head` here would stop reading early, and under pipefail the
        # writer's SIGPIPE would end the script without a word.
        awk '/^-+$/ {rule++; next} rule >= 3 && /^ *[0-9,]+ \(/ {print; if (++rows == 25) exit}' \
            "$work/$slug.txt" |
            sed -E 's/ \[[^]]*\]$//; s/[^ :]*:([^ ])/\1/' | cut -c1-150
        echo '```'
    } >>"$report.body"
done
cat "$report.head" "$report.body" >"$report"
rm -f "$report.head" "$report.body"
echo "wrote $report" >&2
