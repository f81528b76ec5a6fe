# A local Jaeger for the test suite and for development: the trace store the worker's spans are read back from
# (docs/monitoring.md). Source this file, then:
#   ensure_jaeger   build Jaeger ($JAEGER_VERSION, its all-in-one binary `cmd/jaeger`) from its Go module into a
#                   cache outside the work tree ($CHORUS_CACHE, default ~/.cache/chorus); a cached build is reused
#   start_jaeger    Jaeger on loopback, on free ports, keeping traces in memory only; exports
#                   OTEL_EXPORTER_OTLP_ENDPOINT (its OTLP/HTTP receiver), JAEGER_OTLP_GRPC_ENDPOINT (its OTLP/gRPC
#                   receiver) and JAEGER_QUERY_URL (its query API and UI, e.g. $JAEGER_QUERY_URL/api/traces/ID);
#                   run it inside the namespace the tests run in (scripts/livekit.sh `netns_up`), as
#                   start_livekit
#   stop_jaeger
#
# Versions: `go install github.com/jaegertracing/jaeger/cmd/jaeger@v1.75.0` is refused (the module's go.mod has
# a replace directive), so the module is downloaded from the proxy (`go mod download`, checked against
# sum.golang.org as any module) and built in a copy of it with `go build`. The UI's assets are not in the module
# (they are built from jaeger-ui with npm): the binary serves the query API and a placeholder page.

JAEGER_VERSION="${JAEGER_VERSION:-v1.75.0}"
CHORUS_CACHE="${CHORUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/chorus}"
JAEGER_BIN="$CHORUS_CACHE/jaeger-$JAEGER_VERSION/jaeger"
# config, log and pid of the running Jaeger: one per network namespace, as the LiveKit server's
_JG_NETNS="$(ip netns identify $$ 2>/dev/null || true)"
JAEGER_DIR="${JAEGER_DIR:-/tmp/chorus-jaeger-$(id -u)${_JG_NETNS:+-$_JG_NETNS}}"

ensure_jaeger() {
    if [ -x "$JAEGER_BIN" ]; then
        export CHORUS_JAEGER="$JAEGER_BIN"
        return 0
    fi
    if ! command -v go >/dev/null 2>&1; then
        echo "ensure_jaeger: no Go toolchain (go 1.25 or newer) on PATH" >&2
        return 1
    fi
    local t0 dir src
    t0=$(date +%s)
    dir=$(dirname "$JAEGER_BIN")
    echo "building jaeger $JAEGER_VERSION into $dir ..."
    src=$(go mod download -json "github.com/jaegertracing/jaeger@$JAEGER_VERSION" \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])') \
        || { echo "ensure_jaeger: downloading jaeger $JAEGER_VERSION failed" >&2; return 1; }
    mkdir -p "$dir.tmp" || return 1
    # the module cache is read-only: the build runs in a copy, which is then removed
    cp -r "$src" "$dir.tmp/src" && chmod -R u+w "$dir.tmp/src" || { rm -rf "$dir.tmp"; return 1; }
    (cd "$dir.tmp/src" && CGO_ENABLED=0 go build -o "$dir.tmp/jaeger" ./cmd/jaeger) \
        || { echo "ensure_jaeger: building jaeger failed" >&2; rm -rf "$dir.tmp"; return 1; }
    rm -rf "$dir.tmp/src" "$dir" && mv "$dir.tmp" "$dir"
    echo "jaeger built in $(($(date +%s) - t0)) s"
    export CHORUS_JAEGER="$JAEGER_BIN"
}

_jg_free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_jaeger() {
    [ -x "$JAEGER_BIN" ] || ensure_jaeger || return 1
    stop_jaeger
    mkdir -p "$JAEGER_DIR"
    local grpc http query qgrpc health
    grpc=$(_jg_free_port)
    http=$(_jg_free_port)
    query=$(_jg_free_port)
    qgrpc=$(_jg_free_port)
    health=$(_jg_free_port)
    # the all-in-one layout (cmd/jaeger/internal/all-in-one.yaml) on loopback: OTLP in, traces in memory, the
    # query API out; no sampling endpoints, no metrics port, and a batch of 100 ms so that a trace is readable
    # a moment after its spans arrive
    cat >"$JAEGER_DIR/jaeger.yaml" <<EOF
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics: {level: none}
    logs: {level: info}
extensions:
  jaeger_query:
    storage: {traces: memstore}
    http: {endpoint: "127.0.0.1:$query"}
    grpc: {endpoint: "127.0.0.1:$qgrpc"}
  jaeger_storage:
    backends:
      memstore:
        memory: {max_traces: 100000}
  healthcheckv2:
    use_v2: true
    http: {endpoint: "127.0.0.1:$health"}
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:$grpc"}
      http: {endpoint: "127.0.0.1:$http"}
processors:
  batch: {timeout: 100ms}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
EOF
    # its own spans nowhere (it would dial an OTLP collector on localhost:4317 for them)
    OTEL_TRACES_EXPORTER=none OTEL_SDK_DISABLED=true \
        "$JAEGER_BIN" --config "$JAEGER_DIR/jaeger.yaml" >"$JAEGER_DIR/jaeger.log" 2>&1 &
    echo $! >"$JAEGER_DIR/jaeger.pid"
    local i
    for i in $(seq 1 150); do
        if python3 - "$query" <<'EOF' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/api/services", timeout=1).read()
EOF
            export OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$http" \
                JAEGER_OTLP_GRPC_ENDPOINT="http://127.0.0.1:$grpc" JAEGER_QUERY_URL="http://127.0.0.1:$query" \
                CHORUS_JAEGER="$JAEGER_BIN"
            echo "jaeger $JAEGER_VERSION ready: OTLP at $OTEL_EXPORTER_OTLP_ENDPOINT, queries at $JAEGER_QUERY_URL"
            return 0
        fi
        if ! kill -0 "$(cat "$JAEGER_DIR/jaeger.pid")" 2>/dev/null; then
            break
        fi
        sleep 0.2
    done
    echo "start_jaeger: jaeger did not answer; its log:" >&2
    tail -n 20 "$JAEGER_DIR/jaeger.log" >&2
    stop_jaeger
    return 1
}

stop_jaeger() {
    if [ -f "$JAEGER_DIR/jaeger.pid" ]; then
        local pid
        pid=$(cat "$JAEGER_DIR/jaeger.pid")
        kill "$pid" 2>/dev/null && for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$JAEGER_DIR/jaeger.pid"
    fi
    unset OTEL_EXPORTER_OTLP_ENDPOINT JAEGER_OTLP_GRPC_ENDPOINT JAEGER_QUERY_URL
}
