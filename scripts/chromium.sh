# Headless Chromium for the monitoring page's browser test (tests/test_monitor_browser.py). Source this file,
# then call ensure_chromium: as root (CI) Debian's `chromium` package is installed when it is missing; as an
# ordinary user a missing browser is reported (the test then skips, or fails under CI=true).

ensure_chromium() {
    if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "ensure_chromium: no chromium: install it (Debian: apt-get install chromium)" >&2
        return 1
    fi
    echo "installing chromium (Debian package)..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium >/dev/null
}
