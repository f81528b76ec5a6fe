"""The tick on a scripted GPU (benchmarks/scripted_device.py): the real scheduler and tick over a device
double whose pieces return at once and are paid for at the next read back, at the H100's measured costs."""

import json

import numpy as np
import pytest

from benchmarks.scripted_device import COSTS_DIR, DeviceCosts, ScriptedRunner, SimClock, derive_costs
from benchmarks.scripted_serve import simulate
from engine.tick.plan import LivePlan, ToolWork

H100 = COSTS_DIR / "h100.json"
S = 64


def plan(slots: int = S) -> LivePlan:
    z = np.zeros(slots, bool)
    minus = np.full(slots, -1, np.int64)
    return LivePlan(0, z, np.zeros((slots, 1280), np.float32), minus, minus.copy(), z.copy(), z.copy())


def test_the_double_returns_side_work_at_once_and_the_next_read_back_pays_for_it():
    costs = DeviceCosts.load(H100)
    clock = SimClock(0.0)
    runner = ScriptedRunner(costs, clock, pad=0, slots=S)
    runner.live(plan())
    after_live = clock()
    assert after_live * 1e3 == pytest.approx(costs.live(S) + costs.launch_ms)
    work = ToolWork("result", [], np.array([3]), np.zeros((1, 64), np.int64))
    runner.tool(work)
    # a prefill piece returns after its launch alone, as a CUDA launch does
    assert (clock() - after_live) * 1e3 == pytest.approx(costs.launch_ms)
    runner.live(plan())
    # ...and the next live step's copy to the host waits for it
    waited = (clock() - after_live) * 1e3
    assert waited == pytest.approx(costs.launch_ms + costs.side("result", 1, 64) + costs.live(S))
    # a call step reads its tokens back: it pays for itself at once
    t = clock()
    res = runner.tool(ToolWork("call", [], np.array([1, 2]), np.array([[7], [-1]])))
    assert (clock() - t) * 1e3 == pytest.approx(costs.side("call", 2, 1) + costs.launch_ms)
    assert res.func.tolist() == [7, 0]


def test_the_h100_costs_file_is_the_derivation_from_the_measured_step():
    on_disk = json.loads(H100.read_text())
    assert on_disk == json.loads(json.dumps(derive_costs()))
    assert on_disk["live_ms"] == {"1": 19.6, "64": 46.4}
    # the call step at 1 row is the thinker's share of the 1-slot step
    assert on_disk["buckets"]["call/1x1"] == pytest.approx(19.6 * 15.3 / 49.7, rel=0.01)


@pytest.mark.parametrize("side_scale", [1.0, 2.0])
def test_64_sessions_for_ten_simulated_minutes_miss_no_tick_and_hold_the_bounds(side_scale):
    r = simulate(DeviceCosts.load(H100), sessions=64, tool_sessions=16, seconds=600, side_scale=side_scale)
    assert r["ticks"] == 7500
    assert r["missed_deadlines"] == 0 and r["slipped_ticks"] == 0, r
    # every tick's side work ended on the device before the deadline
    assert r["late_ms_max"] <= 0, r
    assert r["tool_calls"] >= 16 * 50  # every tool session kept calling (a call every few seconds)
    bounds, worst = r["bounds_ticks"], r["worst_ticks"]
    assert worst["admission"] <= bounds["admission"], r
    assert worst["result"] <= bounds["result"], r
    assert worst["replay"] <= bounds["replay"], r
    assert r["audible_gaps"]["gaps"] == 0, r["audible_gaps"]


@pytest.mark.xfail(
    strict=True,
    reason="a session back from a tool holds 37-48 frames; a replay piece of k frames a row costs k "
    "one-frame pieces, and the slack that calls and owed results leave holds one a tick: the bound holds by "
    "skipping held audio (docs/engine.md)",
)
def test_the_worst_replay_at_64_sessions_catches_up_within_its_bound_and_skips_no_caller_audio():
    """The held audio of every session back from a tool is replayed before the bound, none of it skipped
    there."""
    r = simulate(DeviceCosts.load(H100), sessions=64, tool_sessions=16, seconds=120)
    assert r["missed_deadlines"] == 0, r
    assert r["tool_calls"] >= 16 * 10
    assert r["worst_ticks"]["replay"] < r["bounds_ticks"]["replay"], r["worst_ticks"]
    assert r["skipped_frames"] == 0, r["skipped_frames"]
