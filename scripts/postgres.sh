# Start a throwaway PostgreSQL server on 127.0.0.1 for the test suite. Source this file, then call
# start_postgres; it exports CHORUS_TEST_DATABASE_URL. stop_postgres shuts the server down. ensure_postgres only
# installs the server programs (start_postgres calls it), for a caller that starts the server where no registry is.
#
# Needs PostgreSQL's server programs (initdb, pg_ctl): Debian's under /usr/lib/postgresql/*/bin, or any on PATH.
# As an ordinary user the server runs as that user. As root (CI) the Debian package is installed when they are
# missing, and the server runs as the `postgres` system user (initdb refuses root).

source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"

PG_PORT="${PG_PORT:-55432}"
# the server's data, socket and log: one per network namespace, as scripts/livekit.sh keeps its server's, so that
# two stacks on one machine (each in a namespace of its own) never stop or remove each other's
_PG_NETNS="$(ip netns identify $$ 2>/dev/null || true)"
PG_DIR="${PG_DIR:-/tmp/chorus-pg-$(id -u)${_PG_NETNS:+-$_PG_NETNS}}"

_pg_bin() {
    local dir
    dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$dir" ] && command -v pg_ctl >/dev/null 2>&1; then
        dir=$(dirname "$(command -v pg_ctl)")
    fi
    echo "$dir"
}

# one command line, run as the server's owner
_pg_as() {
    if [ "$(id -u)" = 0 ]; then
        su postgres -c "$1"
    else
        sh -c "$1"
    fi
}

# The server programs, installed (as root, Debian's package) when missing; needs the package registry.
ensure_postgres() {
    [ -n "$(_pg_bin)" ] && return 0
    debian_install ensure_postgres postgresql "no PostgreSQL server programs (initdb, pg_ctl): install \
PostgreSQL (Debian: apt-get install postgresql) or put its bin directory on PATH"
}

start_postgres() {
    local bin
    ensure_postgres || return 1
    bin=$(_pg_bin)
    if [ "$(id -u)" = 0 ]; then
        id postgres >/dev/null 2>&1 || useradd --system --home "$PG_DIR" postgres
    fi
    if [ -f "$PG_DIR/data/postmaster.pid" ]; then
        _pg_as "$bin/pg_ctl -D $PG_DIR/data -m fast stop" >/dev/null 2>&1 || true
    fi
    rm -rf "$PG_DIR"
    mkdir -p "$PG_DIR"
    if [ "$(id -u)" = 0 ]; then
        chown postgres "$PG_DIR"
    fi
    _pg_as "$bin/initdb -D $PG_DIR/data -A trust -U postgres" >/dev/null
    _pg_as "$bin/pg_ctl -D $PG_DIR/data -l $PG_DIR/log -w \
        -o '-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=200' start" >/dev/null
    _pg_as "$bin/createdb -h 127.0.0.1 -p $PG_PORT -U postgres chorus_test"
    export CHORUS_TEST_DATABASE_URL="postgresql://postgres@127.0.0.1:$PG_PORT/chorus_test"
    echo "postgresql ready at $CHORUS_TEST_DATABASE_URL"
}

stop_postgres() {
    local bin
    bin=$(_pg_bin)
    if [ -n "$bin" ] && [ -f "$PG_DIR/data/postmaster.pid" ]; then
        _pg_as "$bin/pg_ctl -D $PG_DIR/data -m fast stop" >/dev/null 2>&1 || true
    fi
}
