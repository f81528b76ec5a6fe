# A local LiveKit server for the test suite and for development. Source this file, then:
#   ensure_livekit   build livekit-server, LiveKit's agent load tester and the SIP bridge's stand-in
#                    (scripts/sip-bridge) at pinned versions into a cache outside the work tree ($CHORUS_CACHE,
#                    default ~/.cache/chorus); a cached build is reused
#   netns_up NAME    (root) a network namespace with no way out: `lo`, and a veth pair with both ends inside
#   start_livekit    the server in dev mode on free ports (with Redis on loopback when redis-server is installed:
#                    the SIP API needs it; behind passwords, see _redis_acl); exports LIVEKIT_URL, LIVEKIT_API_KEY,
#                    LIVEKIT_API_SECRET, and CHORUS_TEST_LIVEKIT_REDIS with its _USERNAME/_PASSWORD (the workers')
#                    and _SERVER_USERNAME/_SERVER_PASSWORD (the server's)
#   stop_livekit
#
# WebRTC gathers a candidate on every interface and libwebrtc leaves loopback out, so the server and every client
# run inside one namespace whose only interfaces are `lo` and the veth pair lkv0/lkv1 (10.99.0.1, 10.99.0.2):
# media flows between those two addresses and never reaches a real interface. start_livekit refuses to run in a
# namespace that has any other interface. Builds and package installs run outside it (they need the registries).
#
# Versions: livekit-server v1.13.5 is the newest release `go install` accepts (v1.13.6 to v1.13.11 carry replace
# directives in go.mod). LiveKit's CLI (`lk`) cannot be built from the proxy: the proxy lists no versions of
# github.com/livekit/livekit-cli/v2 (so `go install ...@version` fails), v2.18.2's pinned
# github.com/livekit/protocol v1.49.1-0.20260712215709-8847d7456816 is refused, and with the newest served
# protocol and server-sdk-go its cmd/lk no longer compiles. Its load tester package does, and
# scripts/agent-load-test runs it with `lk perf agent-load-test`'s flags. The SIP bridge (github.com/livekit/sip)
# is not served at all.

_LK_SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LIVEKIT_SERVER_VERSION="${LIVEKIT_SERVER_VERSION:-v1.13.5}"
LK_CLI_VERSION="${LK_CLI_VERSION:-v2.18.2}"
CHORUS_CACHE="${CHORUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/chorus}"
LIVEKIT_SERVER_BIN="$CHORUS_CACHE/livekit-server-$LIVEKIT_SERVER_VERSION/livekit-server"
# keyed by the module's go.sum, so a change of its pins builds anew
AGENT_LOAD_TEST_BIN="$CHORUS_CACHE/agent-load-test-$LK_CLI_VERSION-$(cksum <"$_LK_SCRIPTS/agent-load-test/go.sum" | cut -d' ' -f1)/agent-load-test"
# the SIP bridge's control plane stand-in (scripts/sip-bridge), keyed by its go.sum and sources
SIP_BRIDGE_BIN="$CHORUS_CACHE/sip-bridge-$(cat "$_LK_SCRIPTS/sip-bridge/go.sum" "$_LK_SCRIPTS"/sip-bridge/*.go | cksum | cut -d' ' -f1)/sip-bridge"
# config, keys, log and pid of the running server: one per network namespace, so that two stacks on one machine
# (each in a namespace of its own) never stop or overwrite each other's
_LK_NETNS="$(ip netns identify $$ 2>/dev/null || true)"
LIVEKIT_DIR="${LIVEKIT_DIR:-/tmp/chorus-livekit-$(id -u)${_LK_NETNS:+-$_LK_NETNS}}"
NETNS_NODE_IP=10.99.0.1
NETNS_PEER_IP=10.99.0.2

# _go_build DIR BIN WHAT: scripts/DIR's Go module built into BIN (once; a cached build is reused)
_go_build() {
    local name=$1 bin=$2 what=$3 t0
    [ -x "$bin" ] && return 0
    t0=$(date +%s)
    echo "building $name ($what) into $(dirname "$bin") ..."
    mkdir -p "$(dirname "$bin")" || return 1
    (cd "$_LK_SCRIPTS/$name" && CGO_ENABLED=0 go build -o "$bin.tmp" .) \
        || { echo "ensure_livekit: building $name failed" >&2; return 1; }
    mv "$bin.tmp" "$bin"
    echo "$name built in $(($(date +%s) - t0)) s"
}

ensure_livekit() {
    if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing redis-server (Debian package)..."
        DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    fi
    if ! command -v go >/dev/null 2>&1; then
        echo "ensure_livekit: no Go toolchain (go 1.26 or newer) on PATH" >&2
        return 1
    fi
    local t0 dir
    if [ ! -x "$LIVEKIT_SERVER_BIN" ]; then
        t0=$(date +%s)
        dir=$(dirname "$LIVEKIT_SERVER_BIN")
        echo "building livekit-server $LIVEKIT_SERVER_VERSION into $dir ..."
        mkdir -p "$dir.tmp" || return 1
        # the module's main package is cmd/server: `go install` names the binary `server`
        GOBIN="$dir.tmp" CGO_ENABLED=0 go install "github.com/livekit/livekit-server/cmd/server@$LIVEKIT_SERVER_VERSION" \
            || { echo "ensure_livekit: building livekit-server failed" >&2; rm -rf "$dir.tmp"; return 1; }
        mv "$dir.tmp/server" "$dir.tmp/livekit-server" && rm -rf "$dir" && mv "$dir.tmp" "$dir"
        echo "livekit-server built in $(($(date +%s) - t0)) s"
    fi
    # LiveKit's agent load tester (`lk perf agent-load-test`'s code): `lk` itself does not build from the proxy
    # (see the top of this file)
    _go_build agent-load-test "$AGENT_LOAD_TEST_BIN" "livekit-cli $LK_CLI_VERSION's loadtester" || return 1
    # a stand-in for the SIP bridge's control plane (psrpc on the server's Redis): github.com/livekit/sip is not
    # served, so no SIP is on the wire here (scripts/sip-bridge/README.md)
    _go_build sip-bridge "$SIP_BRIDGE_BIN" "the SIP bridge's control plane, stood in" || return 1
    export CHORUS_LIVEKIT_SERVER="$LIVEKIT_SERVER_BIN" CHORUS_AGENT_LOAD_TEST="$AGENT_LOAD_TEST_BIN" \
        CHORUS_SIP_BRIDGE="$SIP_BRIDGE_BIN"
}

# netns_up NAME: the namespace (made anew) with lo up and the veth pair inside it. As root; run commands in it
# with `ip netns exec NAME ...`.
netns_up() {
    local name="$1"
    ip netns del "$name" 2>/dev/null || true
    ip netns add "$name" || return 1
    ip netns exec "$name" sh -ec "
        ip link set lo up
        ip link add lkv0 type veth peer name lkv1
        ip addr add $NETNS_NODE_IP/24 dev lkv0
        ip addr add $NETNS_PEER_IP/24 dev lkv1
        ip link set lkv0 up
        ip link set lkv1 up"
}

netns_down() {
    ip netns del "$1" 2>/dev/null || true
}

# the interfaces of this namespace that are neither lo nor one end of a veth pair whose other end is here too
_leaks() {
    ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -vx -e lo -e lkv0 -e lkv1 || true
}

_free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# _redis_acl FILE: Redis's users, with new random passwords (FILE written 0600): nobody without a password
# (`default` off), `livekit` for the server (and the SIP bridge's stand-in: psrpc's channels), and `chorus`
# for the workers, held to the fleet's keys and commands (docs/deployment.md, "Redis: a password and an ACL
# user"). Sets _LK_REDIS_PASSWORD (chorus's) and _LK_REDIS_SERVER_PASSWORD (livekit's).
_redis_acl() {
    _LK_REDIS_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(24))') || return 1
    _LK_REDIS_SERVER_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(24))') || return 1
    (umask 077 && cat >"$1") <<EOF
user default off
user livekit on >$_LK_REDIS_SERVER_PASSWORD ~* &* +@all
user chorus on >$_LK_REDIS_PASSWORD resetkeys ~chorus:* %R~room_node_map resetchannels -@all +get +set +del +exists +mget +hget +eval +ping +multi +exec +discard +client|list +client|setname
EOF
}

start_livekit() {
    local leaks
    leaks=$(_leaks)
    if [ -n "$leaks" ]; then
        echo "start_livekit: this network namespace has interfaces that lead out of it ($(echo $leaks)):" \
            "run inside one made by netns_up (ip netns exec NAME ...)" >&2
        return 1
    fi
    if ! ip -o -4 addr show dev lkv0 2>/dev/null | grep -q "$NETNS_NODE_IP"; then
        echo "start_livekit: no veth pair lkv0/lkv1 here: run inside a namespace made by netns_up" >&2
        return 1
    fi
    [ -x "$LIVEKIT_SERVER_BIN" ] || ensure_livekit || return 1
    stop_livekit
    mkdir -p "$LIVEKIT_DIR"
    local port udp secret
    port=$(_free_port)
    udp=$(_free_port)
    # Redis on loopback: the server's SIP API works only with one (agent dispatch needs none)
    local redis_block=""
    if command -v redis-server >/dev/null 2>&1; then
        local rport
        rport=$(_free_port)
        _redis_acl "$LIVEKIT_DIR/redis.acl" || return 1
        redis-server --bind 127.0.0.1 --port "$rport" --save '' --appendonly no --daemonize yes \
            --aclfile "$LIVEKIT_DIR/redis.acl" \
            --pidfile "$LIVEKIT_DIR/redis.pid" --logfile "$LIVEKIT_DIR/redis.log" >/dev/null
        redis_block="redis: {address: 127.0.0.1:$rport, username: livekit, password: $_LK_REDIS_SERVER_PASSWORD}"
        export CHORUS_TEST_LIVEKIT_REDIS="127.0.0.1:$rport" \
            CHORUS_TEST_LIVEKIT_REDIS_USERNAME=chorus CHORUS_TEST_LIVEKIT_REDIS_PASSWORD="$_LK_REDIS_PASSWORD" \
            CHORUS_TEST_LIVEKIT_REDIS_SERVER_USERNAME=livekit \
            CHORUS_TEST_LIVEKIT_REDIS_SERVER_PASSWORD="$_LK_REDIS_SERVER_PASSWORD"
    fi
    secret=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
    (umask 077 && printf 'chorus: %s\n' "$secret" >"$LIVEKIT_DIR/keys.yaml")
    # the config names Redis's password: readable by its owner only, as keys.yaml
    (umask 077 && cat >"$LIVEKIT_DIR/livekit.yaml") <<EOF
port: $port
bind_addresses: ["127.0.0.1"]
rtc:
  udp_port: $udp
  tcp_port: 0
  use_external_ip: false
  node_ip: $NETNS_NODE_IP
  enable_loopback_candidate: false
  interfaces: {includes: [lkv0]}
  stun_servers: ["127.0.0.1:9"]
logging: {level: info, pion_level: error}
$redis_block
EOF
    "$LIVEKIT_SERVER_BIN" --dev --config "$LIVEKIT_DIR/livekit.yaml" --key-file "$LIVEKIT_DIR/keys.yaml" \
        >"$LIVEKIT_DIR/server.log" 2>&1 &
    echo $! >"$LIVEKIT_DIR/server.pid"
    local i
    for i in $(seq 1 100); do
        if python3 - "$port" <<'EOF' 2>/dev/null; then
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=1).read().strip() == b"OK" else 1)
EOF
            export LIVEKIT_URL="ws://127.0.0.1:$port" LIVEKIT_API_KEY=chorus LIVEKIT_API_SECRET="$secret"
            export CHORUS_TEST_LIVEKIT_URL="$LIVEKIT_URL" CHORUS_TEST_LIVEKIT_API_KEY=chorus \
                CHORUS_TEST_LIVEKIT_API_SECRET="$secret" CHORUS_TEST_LIVEKIT_LOG="$LIVEKIT_DIR/server.log" \
                CHORUS_LIVEKIT_SERVER="$LIVEKIT_SERVER_BIN"
            echo "livekit-server $LIVEKIT_SERVER_VERSION ready at $LIVEKIT_URL (media on $NETNS_NODE_IP:$udp)"
            return 0
        fi
        if ! kill -0 "$(cat "$LIVEKIT_DIR/server.pid")" 2>/dev/null; then
            break
        fi
        sleep 0.2
    done
    echo "start_livekit: the server did not answer; its log:" >&2
    tail -n 20 "$LIVEKIT_DIR/server.log" >&2
    stop_livekit
    return 1
}

stop_livekit() {
    if [ -f "$LIVEKIT_DIR/redis.pid" ]; then
        kill "$(cat "$LIVEKIT_DIR/redis.pid")" 2>/dev/null || true
        rm -f "$LIVEKIT_DIR/redis.pid"
    fi
    if [ -f "$LIVEKIT_DIR/server.pid" ]; then
        local pid
        pid=$(cat "$LIVEKIT_DIR/server.pid")
        kill "$pid" 2>/dev/null && for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$LIVEKIT_DIR/server.pid"
    fi
}
