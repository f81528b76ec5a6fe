"""The monitoring page shows what callers hear beside the missed deadlines: the gaps in the agent's audio and
the late frames its playout absorbed, summed over the live calls of each worker, from the figures the rooms'
playouts report (real engine, tiny preset, served by its own SnapshotServer; ui/monitor.py rendered by
Streamlit's AppTest)."""

from __future__ import annotations

import pytest

from engine_support import run_ticks
from test_monitor import FAR_S, Worker, metrics, page
from test_monitor import store_env as store_env  # the page's bookings database, a fixture

LABEL = "Gaps heard / late absorbed"


@pytest.fixture(scope="module")
def heard():
    """Two workers: one whose rooms' playouts heard 2 + 1 gaps and absorbed 7 + 4 late frames, one quiet."""
    loud, quiet = Worker(slots=3, sessions=2), Worker(slots=2, sessions=1)
    a, b = loud.handles
    a.report_playout(0.12, 2, 0.25, 0.03, 0.0, 7)
    b.report_playout(0.1, 1, 0.04, 0.02, 0.0, 4)
    quiet.handles[0].report_playout(0.1, 0, 0.0, 0.02, 0.0, 0)
    for w in (loud, quiet):
        run_ticks(w.engine, w.engine.tick + 1, 1, FAR_S)
    yield loud, quiet
    loud.close()
    quiet.close()


@pytest.mark.usefixtures("store_env")
def test_one_worker_shows_its_calls_gaps_and_absorbed_late_frames(heard, monkeypatch):
    loud, _ = heard
    m = metrics(page(monkeypatch, loud.url))
    assert m[LABEL] == ["3 / 11"]
    assert "Missed deadlines" in m


@pytest.mark.usefixtures("store_env")
def test_each_worker_of_a_fleet_shows_its_own(heard, monkeypatch):
    loud, quiet = heard
    m = metrics(page(monkeypatch, loud.url, quiet.url))
    assert sorted(m[LABEL]) == ["0 / 0", "3 / 11"]
