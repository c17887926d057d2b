# Sourced by the other scripts: installs what building idemdb needs on a Debian machine, when
# it is missing, and points cargo at a build cache outside the checkout.
#
# RocksDB is compiled from source (librocksdb-sys): that needs clang and libclang (for bindgen)
# besides the C++ compiler. The first build takes about 13 minutes on 2 cores; the cache in
# CARGO_TARGET_DIR makes later builds, in any clone, reuse it.

if ! command -v cargo >/dev/null 2>&1; then
    echo "idemdb: cargo not found; install a Rust toolchain (1.89 or newer) first" >&2
    exit 1
fi

# apt_install WHY PACKAGE...: installs Debian packages, keeping any service they bring from
# starting: the scripts start private servers of their own, on other ports.
apt_install() {
    local why="$1"
    shift
    echo "idemdb: installing $* ($why)" >&2
    local sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    local policy=/usr/sbin/policy-rc.d added_policy=""
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
        $sudo chmod +x "$policy"
        added_policy=1
    fi
    local status=0
    { $sudo apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null; } ||
        status=$?
    # Removed whatever happened: left in place it would keep every later package's service from
    # starting.
    if [ -n "$added_policy" ]; then $sudo rm -f "$policy"; fi
    return "$status"
}

# stop_pids PID...: stops each process of a private server a script started, in the order given:
# SIGTERM, then SIGKILL if it still runs 30 s later; reaped when it is this shell's child.
stop_pids() {
    local pid
    for pid in "$@"; do
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}

missing=()
for package in clang libclang-dev g++; do
    if ! dpkg -s "$package" >/dev/null 2>&1; then
        missing+=("$package")
    fi
done
if ((${#missing[@]})); then
    apt_install "needed to compile RocksDB" "${missing[@]}"
fi

# One build cache shared by the demo, the tests, the benches and every clone on this machine.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idemdb/target}"
mkdir -p "$CARGO_TARGET_DIR"
