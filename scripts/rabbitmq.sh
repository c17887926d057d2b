# Sourced: starts and stops a private RabbitMQ server for idemdb's end-to-end test.
#
# The server listens on 127.0.0.1 only, on non-default ports (AMQP 15673, Erlang distribution
# 15675, its own epmd on 14369), keeps its data, logs and Erlang cookie under one folder, and is
# stopped by pid. Debian's /usr/sbin/rabbitmq-server switches user; the script under
# /usr/lib/rabbitmq/bin runs the node directly.

RABBITMQ_AMQP_PORT=15673
RABBITMQ_E2E_DIST_PORT=15675
RABBITMQ_E2E_EPMD_PORT=14369
# The stream protocol's listener (the rabbitmq_stream plugin): the log consumers' run.
RABBITMQ_STREAM_PORT=15552
RABBITMQ_URL="amqp://guest:guest@127.0.0.1:${RABBITMQ_AMQP_PORT}/%2f"

rabbitmq_install() {
    if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
        return
    fi
    # apt_install (scripts/setup.sh, sourced first) keeps the package from starting a
    # system-wide server on the default ports.
    apt_install "for the RabbitMQ end-to-end test" rabbitmq-server
}

# rabbitmq_start DIR: starts epmd and the node; returns once the AMQP port accepts connections.
rabbitmq_start() {
    local dir="$1"
    local port
    for port in "$RABBITMQ_AMQP_PORT" "$RABBITMQ_E2E_DIST_PORT" "$RABBITMQ_E2E_EPMD_PORT" \
        "$RABBITMQ_STREAM_PORT"; do
        # Another server there would answer our checks, and the test would purge its queues.
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "idemdb: 127.0.0.1:$port is already in use; stop what listens there first" >&2
            return 1
        fi
    done
    rm -rf "$dir"
    RABBITMQ_E2E_NODE_PID_FILE="$dir/rabbitmq.pid"
    mkdir -p "$dir/home" "$dir/mnesia" "$dir/log"
    : >"$dir/rabbitmq-env.conf"
    # The partitioned fleet's exchange and the log consumers' streams; both plugins ship with
    # the server.
    echo '[rabbitmq_consistent_hash_exchange,rabbitmq_stream].' >"$dir/enabled_plugins"
    cat >"$dir/rabbitmq.conf" <<CONF
listeners.tcp.default = 127.0.0.1:${RABBITMQ_AMQP_PORT}
stream.listeners.tcp.1 = 127.0.0.1:${RABBITMQ_STREAM_PORT}
stream.advertised_host = 127.0.0.1
stream.advertised_port = ${RABBITMQ_STREAM_PORT}
loopback_users.guest = true
disk_free_limit.absolute = 50MB
log.console = false
CONF
    export HOME="$dir/home" \
        RABBITMQ_NODENAME="idemdb-e2e@localhost" \
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
        RABBITMQ_NODE_PORT="$RABBITMQ_AMQP_PORT" \
        RABBITMQ_DIST_PORT="$RABBITMQ_E2E_DIST_PORT" \
        ERL_EPMD_PORT="$RABBITMQ_E2E_EPMD_PORT" \
        ERL_EPMD_ADDRESS=127.0.0.1 \
        RABBITMQ_MNESIA_BASE="$dir/mnesia" \
        RABBITMQ_LOG_BASE="$dir/log" \
        RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
        RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf" \
        RABBITMQ_PID_FILE="$dir/rabbitmq.pid" \
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    epmd -address 127.0.0.1 -port "$RABBITMQ_E2E_EPMD_PORT" >"$dir/log/epmd.out" 2>&1 &
    RABBITMQ_EPMD_PID=$!
    /usr/lib/rabbitmq/bin/rabbitmq-server >"$dir/log/server.out" 2>&1 &
    RABBITMQ_SERVER_PID=$!
    local waited=0
    until (exec 3<>"/dev/tcp/127.0.0.1/$RABBITMQ_AMQP_PORT") 2>/dev/null; do
        if ! kill -0 "$RABBITMQ_SERVER_PID" 2>/dev/null; then
            echo "idemdb: rabbitmq-server exited; its output:" >&2
            tail -n 40 "$dir/log/server.out" >&2
            rabbitmq_stop
            return 1
        fi
        if ((waited >= 120)); then
            echo "idemdb: rabbitmq-server did not listen within 60 s" >&2
            rabbitmq_stop
            return 1
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
    echo "idemdb: rabbitmq-server (pid $RABBITMQ_SERVER_PID) on 127.0.0.1:$RABBITMQ_AMQP_PORT after $((waited / 2)) s" >&2
}

# Stops what rabbitmq_start started, by pid: SIGTERM, then SIGKILL after 30 s. The node's own
# pid (the Erlang VM, which the start script may not have exec'd into) comes from the pid file
# the node writes.
rabbitmq_stop() {
    local node_pid=""
    if [ -n "${RABBITMQ_E2E_NODE_PID_FILE:-}" ] && [ -s "$RABBITMQ_E2E_NODE_PID_FILE" ]; then
        node_pid="$(tr -dc 0-9 <"$RABBITMQ_E2E_NODE_PID_FILE")"
    fi
    # shellcheck disable=SC2086 # an unset pid is left out
    stop_pids ${RABBITMQ_SERVER_PID:-} $node_pid ${RABBITMQ_EPMD_PID:-}
    RABBITMQ_SERVER_PID=""
    RABBITMQ_EPMD_PID=""
}
