# Start a throwaway PostgreSQL server on 127.0.0.1 for the test suite. Source this file, then call
# start_postgres; it exports CHORUS_TEST_DATABASE_URL. stop_postgres shuts the server down.

PG_PORT="${PG_PORT:-55432}"
PG_DIR="${PG_DIR:-/tmp/chorus-pg}"

_pg_bin() {
    local dir
    dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    [ -n "$dir" ] && echo "$dir"
}

start_postgres() {
    if [ -z "$(_pg_bin)" ]; then
        echo "installing postgresql (Debian package)..."
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq postgresql >/dev/null
    fi
    local bin
    bin=$(_pg_bin)
    id postgres >/dev/null 2>&1 || useradd --system --home "$PG_DIR" postgres
    if [ -f "$PG_DIR/data/postmaster.pid" ]; then
        su postgres -c "$bin/pg_ctl -D $PG_DIR/data -m fast stop" >/dev/null 2>&1 || true
    fi
    rm -rf "$PG_DIR"
    mkdir -p "$PG_DIR"
    chown postgres "$PG_DIR"
    su postgres -c "$bin/initdb -D $PG_DIR/data -A trust -U postgres" >/dev/null
    su postgres -c "$bin/pg_ctl -D $PG_DIR/data -l $PG_DIR/log -w \
        -o '-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=200' start" >/dev/null
    su postgres -c "$bin/createdb -h 127.0.0.1 -p $PG_PORT chorus_test"
    export CHORUS_TEST_DATABASE_URL="postgresql://postgres@127.0.0.1:$PG_PORT/chorus_test"
    echo "postgresql ready at $CHORUS_TEST_DATABASE_URL"
}

stop_postgres() {
    local bin
    bin=$(_pg_bin)
    [ -n "$bin" ] && su postgres -c "$bin/pg_ctl -D $PG_DIR/data -m fast stop" >/dev/null 2>&1 || true
}
