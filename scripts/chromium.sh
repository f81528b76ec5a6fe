# Headless Chromium for the monitoring page's browser test (tests/test_monitor_browser.py). Source this file,
# then call ensure_chromium: as root (CI) Debian's `chromium` package is installed when it is missing; as an
# ordinary user a missing browser is reported (the test then skips, or fails under CI=true).

source "$(dirname "${BASH_SOURCE[0]}")/debian.sh"

ensure_chromium() {
    if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
        return 0
    fi
    debian_install ensure_chromium chromium "no chromium: install it (Debian: apt-get install chromium)"
}

# The browser caller's page (tests/browser/): livekit-client from the npm registry, installed by `npm ci` from the
# committed lock. Needs the registry, so it runs before the suite enters its network namespace.
ensure_browser_client() {
    local dir
    dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/browser"
    # npm ci leaves node_modules/.package-lock.json: newer than the committed lock means it is up to date
    if [ -f "$dir/node_modules/.package-lock.json" ] && [ ! "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
        return 0
    fi
    if ! command -v npm >/dev/null 2>&1; then
        echo "ensure_browser_client: no npm: install Node.js (Debian: apt-get install npm)" >&2
        return 1
    fi
    echo "installing the browser caller's livekit-client (npm ci in tests/browser)..."
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) ||
        { echo "ensure_browser_client: npm ci failed in $dir" >&2; return 1; }
}
