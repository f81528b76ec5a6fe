"""The real LiveKit server for the end-to-end tests: the one scripts/livekit.sh's start_livekit started, in a
network namespace with no way out (netns_up). Without it the tests skip; under CI=true they fail. The worker,
the callers and the SIP stand-in the tests drive are `testkit`'s, shared with the benchmarks.
"""

from __future__ import annotations

import datetime as dt
import json
import os

import pytest

from testkit.server import Server, leaks

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
        os.environ.get("CHORUS_TEST_LIVEKIT_REDIS_USERNAME", ""),
        os.environ.get("CHORUS_TEST_LIVEKIT_REDIS_PASSWORD", ""),
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


def scripted_booking(days_ahead: int, at_s: float) -> tuple[str, dt.date]:
    """A job's metadata whose teacher-forcing script calls `book_room` `at_s` into the session
    (agent/forcing.py), for a stay `days_ahead` from today; and its check-in day."""
    check_in = dt.date.today() + dt.timedelta(days=days_ahead)
    booking = {
        "guest_name": "Test Rowan",
        "contact": "rowan@example.com",
        "check_in": check_in.isoformat(),
        "check_out": (check_in + dt.timedelta(days=2)).isoformat(),
        "guests": 2,
        "room_type": "standard",
    }
    return json.dumps(
        {"script": {"calls": [{"at_s": at_s, "name": "book_room", "arguments": booking}]}}
    ), check_in
