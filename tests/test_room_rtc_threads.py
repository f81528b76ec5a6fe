"""A room's own process sizes the rtc runtime for one call: its FFI client starts one tokio worker thread,
not one per core of the host (each call's process has a runtime of its own), unless an operator's
TOKIO_WORKER_THREADS or CHORUS_ROOM_RTC_THREADS=0 says otherwise. In a fresh process, as a room's is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testkit.server import ROOT

pytestmark = pytest.mark.serial  # counts a fresh process's threads as they start (tests/conftest.py)

PROBE = """
import os, sys
from agent import room_process
room_process.rtc_threads(int(sys.argv[1]))
from livekit.rtc._ffi_client import FfiClient
import time
FfiClient.instance  # the runtime starts here, as in a room's process


def workers():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sum(n.startswith("tokio-rt-worker") for n in names)


# the runtime's threads start on their own: read until some are up and their number holds for half a second
seen, since, deadline = workers(), time.monotonic(), time.monotonic() + 30
while time.monotonic() < deadline and (seen == 0 or time.monotonic() - since < 0.5):
    time.sleep(0.05)
    now = workers()
    if now != seen:
        seen, since = now, time.monotonic()
print(seen)
"""


def tokio_workers(n: int, **env: str) -> int:
    base = {k: v for k, v in os.environ.items() if k != "TOKIO_WORKER_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(n)],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")
def test_a_rooms_rtc_runtime_runs_one_worker_thread():
    assert len(os.sched_getaffinity(0)) > 1 or pytest.skip("one core: tokio's default is one thread too")
    assert tokio_workers(1) == 1
    assert tokio_workers(1, TOKIO_WORKER_THREADS="3") == 3  # an operator's own setting stands
