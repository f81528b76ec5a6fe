"""The real LiveKit server for the end-to-end tests: the one scripts/livekit.sh's start_livekit started, in a
network namespace with no way out (netns_up). Without it the tests skip; under CI=true they fail. The worker,
the callers and the SIP stand-in the tests drive are `benchmarks.support`'s, shared with the benchmarks.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.support.server import Server, leaks

# how often a test asks the worker (its snapshot, its log) or its callers whether what it waits for has come:
# each question costs the shared machine that runs the server, the worker and every caller's WebRTC stack
POLL_S = 0.1


def require_livekit() -> Server:
    """The test server from scripts/livekit.sh's start_livekit, in a namespace with no way out; else skip
    (fail under CI=true)."""
    miss = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if leaks():
        miss(f"this network namespace has interfaces that lead out of it: {leaks()} (scripts/livekit.sh)")
    url = os.environ.get("CHORUS_TEST_LIVEKIT_URL")
    if not url:
        miss("no LiveKit server: run the suite as .ci/run does (scripts/livekit.sh: netns_up, start_livekit)")
    return Server(
        url,
        os.environ["CHORUS_TEST_LIVEKIT_API_KEY"],
        os.environ["CHORUS_TEST_LIVEKIT_API_SECRET"],
        os.environ.get("CHORUS_TEST_LIVEKIT_REDIS", ""),
    )


def server_lines(*words: str, limit: int = 40) -> list[str]:
    """The test server's log lines (CHORUS_TEST_LIVEKIT_LOG, set by start_livekit) naming any of `words`: what
    it did with a room's agent job (offered, turned down, assigned, or no worker to take it), for a failure's
    message. The last `limit`; none without the log."""
    path = os.environ.get("CHORUS_TEST_LIVEKIT_LOG")
    if not path or not words:
        return []
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if any(w in line for w in words)]
    except OSError:
        return []
    return lines[-limit:]
