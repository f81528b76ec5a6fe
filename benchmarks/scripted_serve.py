"""`python -m benchmarks.engine_bench serve --device-costs FILE`: the serving workload on the scripted device.

The real scheduler and the real tick (`engine.tick.ticker.Ticker`) run over a device double
(benchmarks/scripted_device.py) on a simulated clock: no model runs and no time passes but the device's
and the host's scripted costs, so ten simulated minutes of 64 sessions take seconds of CPU. Sessions open
one every `open_every_ticks`; the tool sessions force a call of `call_tokens` every `call_every_s` of live
time, answered `tool_latency_s` later with a result of about `result_tokens`. Reports the missed ticks, the
bounds (a new session live within 2 s, a result prefilled within 1 s, live again 2 s after) as the worst
seen, the tick's accounting (engine/tick/ledger.py) and the callers' audible gaps
(benchmarks/tick_accounting.py). Knows the engine's tick parts and outputs; nothing of a model.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from benchmarks.scripted_device import DeviceCosts, ScriptedRunner, SimClock
from benchmarks.tick_accounting import PlayoutGaps
from engine.api import AudioFrame, ForceTokens, FunctionCall, SubmitResult, ToolResultConsumed
from engine.config.engine_config import EngineConfig
from engine.config.presets import load_preset
from engine.config.stage_config import TokenConfig
from engine.observe.metrics import Accounting
from engine.process.priority import TickPriority
from engine.text.tokens import Tokens
from engine.tick import build
from engine.tick.opening import requested_prompt
from engine.tick.phase import TickPhase
from engine.tick.scheduler import Scheduler
from engine.tick.session import Phase, Session
from engine.tick.slots import FrameInbox, SlotPool
from engine.tick.ticker import Ticker
from testkit.concierge import PROMPT, TOOLS

TICK_S = 0.08


def call_of_length(tokens: Tokens, n: int) -> list[int]:
    """A complete forced tool call of exactly n tokens."""
    words = ""
    for _ in range(4 * n):
        ids = tokens.call_ids([{"name": "check_availability", "arguments": {"note": words}}])
        if len(ids) >= n:
            return ids
        words += "a"
    raise ValueError(f"cannot build a tool call of {n} tokens")


def result_of_length(tokens: Tokens, n: int) -> str:
    text = ""
    while len(tokens.response_ids([{"name": "check_availability", "output": text}])) < n:
        text += "room 12 free; "
    return text


@dataclass
class _Caller:
    """One simulated session's side: what it heard, when, and its phases."""

    session: Session | None = None
    opened: int = 0
    first_live: int | None = None
    phase: Phase = Phase.PROMPT
    entered: int = 0
    next_call: float = float("inf")
    frames: int = 0
    stints: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))


def simulate(
    costs: DeviceCosts,
    sessions: int = 64,
    tool_sessions: int = 16,
    seconds: float = 600.0,
    call_tokens: int = 40,
    result_tokens: int = 300,
    tool_latency_s: float = 0.3,
    call_every_s: float = 2.0,
    side_scale: float = 1.0,
    open_every_ticks: int = 2,
    playout_lead_ms: float = 80.0,
    config: EngineConfig | None = None,
) -> dict:
    """Run the workload on the scripted device for `seconds` of simulated time; the figures."""
    cfg = config or EngineConfig(num_slots=costs.slots, start=False, metrics_port=None)
    S = cfg.num_slots
    clock = SimClock(1000.0)
    tokens = Tokens(TokenConfig())
    runner = ScriptedRunner(costs, clock, tokens.pad, S, side_scale)
    limits = build.limits(cfg, load_preset("nemotron-voicechat-11b"))
    pool = SlotPool(S, clock)
    sch = Scheduler(S, tokens, 1280, limits, clock, prompts=runner.prompts)
    acct = Accounting()
    phase = TickPhase(TICK_S, step_s=0.0)
    ticker = Ticker(pool, sch, runner, acct, cfg, clock, threading.Event(), phase, TickPriority(0), [])
    for key, ms in runner.time_slack():  # the cost model starts from each bucket timed once, as at warm-up
        sch.costs.observe(*key, ms)
    # the run starts on a whole second whatever the warm-up took: the ticks' phase against the device's
    # clock moves the figures (the skipped frames by a third), and should not move with the buckets timed
    clock.until(math.floor(clock()) + 1.0)
    names, prompt_ids, prefix_len = requested_prompt(tokens, PROMPT, TOOLS, "")
    key, prefix_key = hash(tuple(prompt_ids)), hash(tuple(prompt_ids[:prefix_len]))
    call_ids = call_of_length(tokens, call_tokens)
    result = result_of_length(tokens, result_tokens)
    callers = [_Caller() for _ in range(sessions)]
    gaps = PlayoutGaps(playout_lead_ms, TICK_S * 1000)
    answers: list[tuple[float, int, str]] = []  # (when, caller, call id)
    frame = np.full(1280, 0.01, np.float32)
    now_tick = [0]

    def sink(i: int):
        c = callers[i]

        def deliver(items) -> None:
            t = clock()
            for item in items:
                if isinstance(item, AudioFrame):
                    c.frames += 1
                    if c.first_live is None:
                        c.first_live = item.tick
                    gaps.frame(i, item.tick, t)
                elif isinstance(item, FunctionCall):
                    heapq.heappush(answers, (t + tool_latency_s, i, item.call_id))
                elif isinstance(item, ToolResultConsumed):
                    c.next_call = t + call_every_s

        return deliver

    def open_one(i: int) -> None:
        def make(session_id: str, slot: int) -> Session:
            return Session(
                session_id, slot, frozenset(names), FrameInbox(1280, 375, clock=clock), sink(i),
                prefill_ids=prompt_ids, prompt_key=key, prefix_key=prefix_key, prefix_len=prefix_len,
                opened_at=clock(),
            )  # fmt: skip

        c = callers[i]
        c.session, c.opened, c.entered = pool.open(make), now_tick[0], now_tick[0]
        c.session.inbox.push(frame)
        if i < tool_sessions:
            c.next_call = clock() + 1.0 + 0.1 * i

    ticks = int(seconds / TICK_S)
    t0 = clock()
    k_anchor, slipped, late_ms = 0, 0, []
    for k in range(ticks):
        now_tick[0] = k
        due = t0 + (k - k_anchor) * TICK_S
        if clock() - due > TICK_S:  # a whole tick behind: re-anchor, as the tick thread does
            slipped += 1
            t0, k_anchor, due = clock(), k, clock()
        if k % open_every_ticks == 0 and k // open_every_ticks < sessions:
            open_one(k // open_every_ticks)
        clock.until(due)
        while answers and answers[0][0] <= clock():
            _, i, call_id = heapq.heappop(answers)
            callers[i].session.requests.put(SubmitResult(call_id, result))
        for c in callers:
            s = c.session
            if s is None:
                continue
            if k > c.opened:
                s.inbox.push(frame)
            if c.next_call <= clock() and s.phase is Phase.LIVE:
                c.next_call = float("inf")
                s.requests.put(ForceTokens("function", tuple(call_ids)))
        ticker.run(k, due + TICK_S, due)
        late_ms.append((clock() - due - TICK_S) * 1e3)
        for c in callers:
            s = c.session
            if s is not None and s.phase is not c.phase:
                c.stints[c.phase.value].append(k - c.entered)
                c.phase, c.entered = s.phase, k
    opened = [c for c in callers if c.session is not None]
    stints = defaultdict(list)
    for c in opened:
        for name, v in c.stints.items():
            stints[name] += v
    admit = [(c.first_live if c.first_live is not None else ticks) - c.opened for c in opened]
    return {
        "bench": "serve-scripted",
        "device_costs": costs.source,
        "side_scale": side_scale,
        "sessions": sessions,
        "tool_sessions": tool_sessions,
        "seconds": seconds,
        "ticks": acct.ticks,
        "missed_deadlines": acct.missed_deadlines,
        "overruns": acct.overruns,
        "slipped_ticks": slipped,
        "late_ms_max": round(max(late_ms), 3),
        "live_ms_p50": float(np.percentile(acct.live_ms, 50)),
        "live_ms_p99": float(np.percentile(acct.live_ms, 99)),
        "live_ms_max": float(max(acct.live_ms)),
        "tool_calls": acct.tool_calls,
        "owed": dict(acct.owed),
        "device_busy_share": round(runner.device.busy_s / max(1e-9, clock() - 1000.0), 3),
        "bounds_ticks": {
            "admission": limits.admission_ticks,
            "result": limits.result_ticks,
            "replay": limits.replay_ticks,
        },
        "worst_ticks": {
            "admission": max(admit),
            "result": max(stints["prefill"], default=0),
            "replay": max(stints["replay"], default=0),
        },
        # caller audio held through a tool call that was not replayed by the bound, and skipped there
        "skipped_frames": sum(c.session.inbox.skipped for c in opened),
        "audible_gaps": gaps.report([i for i, c in enumerate(callers) if c.session is not None]),
        "frames_out": sum(c.frames for c in opened),
        "accounting": ticker.ledger.report(),
        "tick_series": ticker.ledger.series(),
    }


def main_scripted(args) -> dict:
    """`serve --device-costs FILE`: the workload of the serve flags on the scripted device; the tick plot
    with `--plot`."""
    costs = DeviceCosts.load(args.device_costs)
    print(
        f"serve on the scripted device ({args.device_costs}, side work x{args.side_scale:g}): "
        f"{args.sessions} sessions ({args.tool_sessions} calling tools), {args.seconds:g} simulated s",
        flush=True,
    )
    out = simulate(
        costs,
        sessions=args.sessions,
        tool_sessions=args.tool_sessions,
        seconds=args.seconds,
        call_tokens=args.call_tokens,
        result_tokens=args.result_tokens,
        tool_latency_s=args.tool_latency_ms / 1000,
        call_every_s=args.call_every_s,
        side_scale=args.side_scale,
        playout_lead_ms=args.playout_lead_ms,
    )
    series = out.pop("tick_series")
    if args.plot:
        from benchmarks.tick_accounting import plot_ticks

        title = f"{args.sessions} sessions, {args.tool_sessions} with tools, scripted device"
        plot_ticks(series, args.plot, title, TICK_S * 1000)
    print(
        f"ticks {out['ticks']}, missed {out['missed_deadlines']}, "
        f"late ticks {out['accounting']['late_ticks']}, "
        f"worst ticks {out['worst_ticks']} (bounds {out['bounds_ticks']}), "
        f"audible gaps {out['audible_gaps']['gaps']}"
    )
    return out
