# A Debian package a setup step needs (scripts/chromium.sh, scripts/postgres.sh). Source this file.

# debian_install WHO PACKAGE HINT: as root (CI) with apt-get, PACKAGE is installed; otherwise WHO says what to
# install (HINT) and fails.
debian_install() {
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "$1: $3" >&2
        return 1
    fi
    echo "installing $2 (Debian package)..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "$2" >/dev/null
}
