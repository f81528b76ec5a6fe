"""Every tick's device time accounted for: the cost model learns what a piece costs on the device (not what
its launch costs the host), a piece starts only where that fits, the tick fences its side work before the
next live step, and the serving benchmark's JSON and plot carry the accounting."""

import json
import threading

import numpy as np
import pytest

from benchmarks import engine_bench
from benchmarks.scripted_device import COSTS_DIR, DeviceCosts, ScriptedRunner, SimClock
from engine.api import EngineOverloaded
from engine.config.engine_config import EngineConfig
from engine.config.stage_config import TokenConfig
from engine.observe.metrics import Accounting
from engine.process.priority import TickPriority
from engine.text.tokens import Tokens
from engine.tick.headroom import Headroom
from engine.tick.phase import TickPhase
from engine.tick.plan import Limits
from engine.tick.scheduler import Scheduler
from engine.tick.session import Phase, Session
from engine.tick.slots import FrameInbox, SlotPool
from engine.tick.ticker import Ticker

S, TICK = 64, 0.08
TOK = Tokens(TokenConfig())


def ticker_on_the_double(side_scale: float = 1.0) -> tuple[Ticker, ScriptedRunner, SimClock, SlotPool]:
    costs = DeviceCosts.load(COSTS_DIR / "h100.json")
    clock = SimClock(0.0)
    runner = ScriptedRunner(costs, clock, TOK.pad, S, side_scale)
    pool = SlotPool(S, clock)
    sch = Scheduler(S, TOK, 1280, Limits(), clock, prompts=runner.prompts)
    cfg = EngineConfig(num_slots=S, start=False, metrics_port=None)
    t = Ticker(
        *(pool, sch, runner, Accounting(), cfg, clock, threading.Event()),
        *(TickPhase(TICK, step_s=0.0), TickPriority(0), []),
    )
    for key, ms in runner.time_slack():  # every bucket timed once, as the engine's warm-up does on a GPU
        sch.costs.observe(*key, ms)
    assert clock() < 100.0 - TICK  # the warm-up is over before the first tick is due
    return t, runner, clock, pool


def prompting(pool: SlotPool, clock: SimClock, n: int, length: int = 600) -> list[Session]:
    """`n` sessions, each with a prompt of its own to prefill (no state to share)."""
    out = []
    for i in range(n):

        def make(sid: str, slot: int, i=i) -> Session:
            ids = [40 + (i + j) % 200 for j in range(length)]
            box = FrameInbox(1280, 400, clock=clock)
            return Session(sid, slot, frozenset(), box, lambda items: None, prefill_ids=ids, prompt_key=i + 1)

        out.append(pool.open(make))
    return out


def run(ticker: Ticker, clock: SimClock, k: int, sessions: list[Session]) -> float:
    """Tick k at its due time, every session with its frame in; the tick's deadline."""
    due = 100.0 + k * TICK
    clock.until(due)
    for s in sessions:
        s.inbox.push(np.zeros(1280, np.float32))
    ticker.run(k, due + TICK, due)
    return due + TICK


def test_the_cost_model_learns_a_pieces_device_time_not_its_launch():
    ticker, runner, clock, pool = ticker_on_the_double()
    sessions = prompting(pool, clock, 4)
    for k in range(3):
        run(ticker, clock, k, sessions)
    rec = ticker.ledger.ticks[-1]
    assert rec.pieces and all(p.kind == "prompt" for p in rec.pieces)
    costs = runner.costs
    for p in rec.pieces:
        real = costs.side(p.kind, p.rows, p.positions)
        assert p.device_ms == pytest.approx(real)  # the device's time, though the launch returned at once
        assert ticker.scheduler.costs.bucket(p.kind, p.rows, p.positions) == pytest.approx(real)
        assert real > 20 * costs.launch_ms


def test_side_work_ends_on_the_device_before_the_deadline_and_the_live_step_never_waits():
    ticker, runner, clock, pool = ticker_on_the_double()
    sessions = prompting(pool, clock, 8)
    margin = ticker.config.safety_margin_ms / 1000
    for k in range(12):
        deadline = run(ticker, clock, k, sessions)
        # the fence: the tick returns once the device has run everything, before the deadline's margin
        assert runner.device.free_at <= clock() <= deadline - margin + 1e-9
    led = ticker.ledger
    assert led.late == 0 and all(t.wait_ms == 0 for t in led.ticks)
    # the slack was used: every tick ran side work until the next piece no longer fitted
    assert all(t.side_ms > 10 for t in list(led.ticks)[3:])


def test_a_tick_whose_side_work_overran_says_by_how_much_and_why():
    ticker, runner, clock, pool = ticker_on_the_double()
    sessions = prompting(pool, clock, 8)
    run(ticker, clock, 0, sessions)
    # the device turns slow: the pieces the model predicts from what it measured take three times as long
    runner.side_scale = 3.0
    late = [run(ticker, clock, k, sessions) for k in range(1, 4)]
    assert late and ticker.ledger.late >= 1
    (first, *_) = ticker.ledger.missed
    assert first.late_ms > 0 and "more than predicted" in first.why
    report = ticker.ledger.report()
    assert report["missed"][0]["ran"] and report["late_ms_max"] > 0
    # ...and learns: once the ticks that started late have caught up, nothing overruns again
    for k in range(4, 6):
        run(ticker, clock, k, sessions)
    before = ticker.ledger.late
    for k in range(6, 20):
        run(ticker, clock, k, sessions)
    assert ticker.ledger.late == before
    assert all(p.device_ms <= p.predicted_ms + 1e-6 for t in list(ticker.ledger.ticks)[6:] for p in t.pieces)


def test_the_serving_benchmark_reports_the_accounting_on_the_scripted_device(tmp_path, capsys):
    png = tmp_path / "ticks.png"
    argv = ["serve", "--device-costs", str(COSTS_DIR / "h100.json"), "--seconds", "30", "--plot", str(png)]
    assert engine_bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "serve-scripted" and out["ticks"] == 375 and out["missed_deadlines"] == 0
    acct = out["accounting"]
    pieces = acct["pieces"]
    for kind in ("call", "result", "prompt"):
        assert any(k.startswith(kind + "/") for k in pieces), kind
    for v in pieces.values():
        assert v["n"] > 0 and v["measured_ms_p99"] >= v["measured_ms_p50"] > 0
        assert v["predicted_ms_p50"] is not None
    assert acct["live_ms"]["p50"] == pytest.approx(46.4, abs=0.2)
    assert acct["live_wait_ms"]["max"] == 0
    assert acct["late_ticks"] == 0 and acct["missed"] == []
    gaps = out["audible_gaps"]
    assert len(gaps["per_session"]) == 64 and gaps["gaps"] == 0
    assert png.stat().st_size > 1000


def test_sessions_found_past_their_bounds_stop_admission():
    """Where the slack no longer holds the bounds (a result not prefilled in time), no session is taken on,
    though no tick missed."""
    sch = Scheduler(8, TOK, 1280, Limits(), SimClock(0.0))
    s = Session("s0", 0, frozenset(), FrameInbox(1280, 100), lambda items: None, phase=Phase.PREFILL)
    s.progress.prefill_ids, s.progress.prefill_by = list(range(40, 340)), 3
    acct = Accounting()
    for _ in range(20):
        acct.record_tick(30.0, 60.0, False)
    headroom = Headroom(acct, 80.0, 0.9, 0.75, slips=lambda: sum(sch.slipped))
    for k in range(4):  # within the bound
        sch.plan_live(sch.begin_tick(k, [s]), np.zeros(8, bool))
    assert not headroom.overloaded
    for k in range(4, 10):  # past it
        sch.plan_live(sch.begin_tick(k, [s]), np.zeros(8, bool))
    assert sum(sch.slipped) == 6 and headroom.overloaded
    with pytest.raises(EngineOverloaded, match="past a session's bound"):
        headroom.check()
