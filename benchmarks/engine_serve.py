"""`python -m benchmarks.engine_bench serve`: the capacity benchmark on the wall clock.

N sessions hear caller audio in real time; some of them call tools again and again (a forced call of a given
length, answered after a given latency with a result of a given length; teacher forcing, since dummy weights
decide nothing). Reports tick times, deadlines, frames and tool latencies, plus the same workload with
cadence-locked tools (one tool token per tick) and a naive per-session loop. Last line: one JSON object.
Knows the engine's session API and its counters; nothing of LiveKit or rooms.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import torch

from benchmarks.scripted_serve import main_scripted
from benchmarks.tick_accounting import PlayoutGaps, plot_ticks
from engine.api import AudioFrame, FunctionCall, Output, ToolResultConsumed
from engine.config.presets import load_preset
from engine.observe.metrics import pct
from engine.tick.engine import Engine, EngineConfig
from testkit.concierge import PROMPT, TOOLS


def _call_of_length(engine: Engine, n: int) -> list[int]:
    """A complete forced tool call (start, `<TOOLCALL>[...]</TOOLCALL>`, end) of exactly n tokens."""
    words = ""
    best: list[int] = []
    for _ in range(4 * n):
        ids = engine.tokens.call_ids([{"name": "check_availability", "arguments": {"note": words}}])
        if len(ids) == n:
            return ids
        if len(ids) > n:
            break
        best, words = ids, words + "a"
    raise ValueError(f"cannot build a tool call of exactly {n} tokens (closest {len(best)})")


def _result_of_length(engine: Engine, n: int) -> str:
    """An output whose `<TOOL_RESPONSE>` encoding is about n tokens; n < 0: exactly -n characters (a result
    too long to prefill whole, which the engine cuts at `max_result_chars`)."""
    if n < 0:
        return ("room 12 free; " * (-n // 14 + 1))[:-n]
    text = ""
    while len(engine.tokens.response_ids([{"name": "check_availability", "output": text}])) < n:
        text += "room 12 free; "
    return text


class _Workload:
    """Feeds audio in real time and answers tool calls after a latency; counts what comes back."""

    def __init__(
        self,
        engine: Engine,
        sessions: int,
        tool_sessions: int,
        call_tokens: int,
        result_tokens: int,
        tool_latency_s: float,
        call_every_s: float,
        playout_lead_ms: float = 80.0,
    ) -> None:
        self.e = engine
        self.call_ids = _call_of_length(engine, call_tokens)
        self.result = _result_of_length(engine, result_tokens)
        self.latency = tool_latency_s
        self.every = call_every_s
        self.frames_out = [0] * sessions
        self.gaps = PlayoutGaps(playout_lead_ms, engine.tick_ms)
        self.resumed: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.handles = [engine.open_session(PROMPT, TOOLS, sink=self._sink(i)) for i in range(sessions)]
        self.tool_rooms = set(range(tool_sessions))
        self.next_call = {i: time.monotonic() + 1.0 + 0.1 * i for i in self.tool_rooms}
        self.clock = engine.model_cfg.clock
        rng = np.random.default_rng(0)
        self.audio = (0.1 * rng.standard_normal(self.clock.input_rate * 4)).astype(np.float32)  # 4 s of noise

    def _sink(self, i: int):
        def sink(items: list[Output]) -> None:
            for item in items:
                if isinstance(item, FunctionCall):
                    t = threading.Timer(self.latency, self._answer, (i, item.call_id))
                    t.daemon = True
                    t.start()
                elif isinstance(item, ToolResultConsumed):
                    with self.lock:
                        self.resumed.append(item.resume_ms)
                    self.next_call[i] = time.monotonic() + self.every
                elif isinstance(item, AudioFrame):
                    self.frames_out[i] += 1
                    self.gaps.frame(i, item.tick, time.monotonic())

        return sink

    def _answer(self, i: int, call_id: str) -> None:
        if not self.stop.is_set():
            self.handles[i].submit_tool_result(call_id, self.result)

    def feed(self) -> None:
        """One input frame per session per frame period on the wall clock, with one frame of jitter buffer."""
        n, period_s = self.clock.input_samples, self.clock.frame_ms / 1000
        for h in self.handles:
            h.push_audio(self.audio[:n])
        t0 = time.monotonic()
        k = 0
        while not self.stop.is_set():
            off = (k * n) % (self.audio.size - n)
            for h in self.handles:
                h.push_audio(self.audio[off : off + n])
            now = time.monotonic()
            for i in self.tool_rooms:
                if now >= self.next_call.get(i, float("inf")) and self.handles[i].phase == "live":
                    self.next_call[i] = float("inf")
                    self.handles[i].force_function(self.call_ids)
            k += 1
            self.stop.wait(max(0.0, t0 + k * period_s - time.monotonic()))


def run_workload(
    cfg: EngineConfig,
    sessions: int,
    tool_sessions: int,
    seconds: float,
    call_tokens: int,
    result_tokens: int,
    tool_latency_s: float,
    call_every_s: float,
    progress: bool = True,
    playout_lead_ms: float = 80.0,
) -> dict:
    with Engine(cfg) as engine:
        w = _Workload(
            *(engine, sessions, tool_sessions, call_tokens, result_tokens, tool_latency_s, call_every_s),
            playout_lead_ms,
        )
        feeder = threading.Thread(target=w.feed, name="bench-feeder", daemon=True)
        feeder.start()
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            time.sleep(min(5.0, max(0.0, t_end - time.monotonic())))
            if engine.failure:
                raise RuntimeError("the tick thread failed") from engine.failure
            if progress:
                s = engine.snapshot()
                print(
                    f"  t={seconds - (t_end - time.monotonic()):5.1f}s ticks {s.ticks:5d}  tick p50 "
                    f"{s.live_ms_p50:6.2f} p99 {s.live_ms_p99:6.2f} ms  missed {s.missed_deadlines}  "
                    f"tool calls {s.tool_calls}  phases {s.phases}",
                    flush=True,
                )
        w.stop.set()
        snap = engine.snapshot()
        a = engine.acct
        return {
            "ticks": snap.ticks,
            "live_ms_p50": snap.live_ms_p50,
            "live_ms_p99": snap.live_ms_p99,
            "live_ms_max": snap.live_ms_max,
            "missed_deadlines": snap.missed_deadlines,
            "overruns": snap.overruns,
            "slipped_ticks": snap.slipped_ticks,
            "dropped_frames": snap.dropped_frames,
            "skipped_frames": snap.skipped_frames,
            "phases_at_end": snap.phases,
            "underruns": snap.underruns,
            "tool_calls": snap.tool_calls,
            "tool_call_ms_p50": pct(a.tool_call_ms, 50),
            "tool_call_ms_p99": pct(a.tool_call_ms, 99),
            "tool_call_ticks_p50": pct(a.tool_call_ticks, 50),
            "tool_call_ticks_p99": pct(a.tool_call_ticks, 99),
            "tool_call_ticks_max": max(a.tool_call_ticks, default=0),
            "result_prefill_ms_p50": pct(w.resumed, 50),
            "frames_out": sum(w.frames_out),
            "audible_gaps": w.gaps.report(list(range(sessions))),
            "accounting": engine.ticker.ledger.report(),
            "tick_series": engine.ticker.ledger.series(),
        }


def naive_live_ms(cfg: EngineConfig, sessions: int, ticks: int = 8) -> float:
    """The same model stepped one session at a time (a one-slot pipeline, `sessions` steps per tick)."""
    with Engine(cfg.model_copy(update={"num_slots": 1, "start": False, "metrics_port": None})) as e:
        p, dev = e.pipeline, e.device
        audio = torch.zeros(1, e.model_cfg.clock.input_samples, device=dev)
        active = torch.ones(1, dtype=torch.bool, device=dev)
        minus = torch.full((1,), -1, dtype=torch.long, device=dev)
        ms = []
        for _ in range(ticks + 1):
            t = time.perf_counter()
            for _ in range(sessions):
                p.live_step(audio, active, minus, minus)
            ms.append((time.perf_counter() - t) * 1e3)
        return pct(ms[1:], 50)


def serve(args) -> dict:
    base = EngineConfig(
        preset=args.preset,
        num_slots=args.sessions,
        device=args.device,
        threads=args.threads,
        checkpoint=args.checkpoint,
        tokenizer=args.tokenizer,
        speaker=args.speaker,
        dtype=getattr(args, "dtype", "auto"),
        talker_window=args.talker_window,
        thinker_window=args.thinker_window,
        capacity_mode=args.capacity,
        start=True,
    )
    common = dict(
        call_tokens=args.call_tokens,
        result_tokens=-args.result_chars if args.result_chars else args.result_tokens,
        tool_latency_s=args.tool_latency_ms / 1000,
        call_every_s=args.call_every_s,
        playout_lead_ms=args.playout_lead_ms,
    )
    if args.sweep:
        return sweep(base, args, common)
    print(
        f"serve: {args.sessions} sessions ({args.tool_sessions} calling tools), {args.seconds:g} s, "
        f"preset {args.preset}",
        flush=True,
    )
    main = run_workload(base, args.sessions, args.tool_sessions, args.seconds, **common)
    cadence: dict = {
        "tool_call_ticks_p50": None,
        "tool_call_ms_p50": None,
        "result_prefill_ms_p50": None,
        "missed_deadlines": None,
    }
    naive = None
    if args.baseline_seconds > 0:  # the baselines: tools at the cadence, and one session per forward
        print(f"cadence-locked baseline ({args.baseline_seconds:g} s)...", flush=True)
        cadence = run_workload(
            base.model_copy(update={"cadence_locked_tools": True}),
            args.sessions,
            args.tool_sessions,
            args.baseline_seconds,
            progress=False,
            **common,
        )
        print("naive per-session baseline...", flush=True)
        naive = naive_live_ms(base, args.sessions)
    series = main.pop("tick_series")
    cadence.pop("tick_series", None)
    if args.plot:
        title = f"{args.sessions} sessions, {args.tool_sessions} with tools"
        plot_ticks(series, args.plot, title, load_preset(args.preset).clock.frame_ms)
    print(
        f"ticks {main['ticks']}, live step p50 {main['live_ms_p50']} ms p99 {main['live_ms_p99']} ms, "
        f"missed deadlines {main['missed_deadlines']}, dropped frames {main['dropped_frames']}"
    )
    print(
        f"tool call: {main['tool_call_ticks_p50']} ticks p50 ({main['tool_call_ms_p50']} ms) vs "
        f"{cadence['tool_call_ticks_p50']} ticks cadence-locked; naive per-session tick {naive} ms"
    )
    return {
        "bench": "serve",
        "preset": args.preset,
        "sessions": args.sessions,
        "tool_sessions": args.tool_sessions,
        "seconds": args.seconds,
        "result_chars": args.result_chars,
        **main,
        "tick_series_len": len(series["live"]),
        "cadence_tool_call_ticks_p50": cadence["tool_call_ticks_p50"],
        "cadence_tool_call_ms_p50": cadence["tool_call_ms_p50"],
        "cadence_result_prefill_ms_p50": cadence["result_prefill_ms_p50"],
        "cadence_missed_deadlines": cadence["missed_deadlines"],
        "naive_live_ms_p50": naive,
    }


def sweep(base: EngineConfig, args, common: dict) -> dict:
    """The most sessions (a quarter calling tools) with zero missed deadlines, by doubling then bisecting, up
    to `--sweep-max` sessions and within `--sweep-budget-s` seconds (then the best found so far; a size that
    runs out of device memory counts as a failure)."""
    t0 = time.monotonic()
    tried: dict[int, dict] = {}

    def ok(n: int) -> bool:
        try:
            r = run_workload(
                base.model_copy(update={"num_slots": n}),
                n,
                n // 4,
                args.sweep_seconds,
                progress=False,
                **common,
            )
        except torch.OutOfMemoryError:
            tried[n] = {"oom": True}
            print(f"  {n:5d} sessions: out of device memory", flush=True)
            return False
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        tried[n] = {"live_ms_p99": r["live_ms_p99"], "missed_deadlines": r["missed_deadlines"]}
        print(
            f"  {n:5d} sessions: live p99 {r['live_ms_p99']:7.2f} ms, missed {r['missed_deadlines']}",
            flush=True,
        )
        return r["missed_deadlines"] == 0

    def spent() -> bool:
        return args.sweep_budget_s is not None and time.monotonic() - t0 > args.sweep_budget_s

    lo, hi = 0, min(args.sessions, args.sweep_max)
    while not spent() and ok(hi):
        lo = hi
        if hi >= args.sweep_max:
            break
        hi = min(hi * 2, args.sweep_max)
    while lo < hi and hi - lo > max(1, lo // 16) and not spent():
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    print(f"most sessions with zero missed deadlines: {lo}" + (" (the budget ran out)" if spent() else ""))
    return {
        "bench": "serve-sweep",
        "preset": args.preset,
        "max_sessions": lo,
        "sweep_seconds": args.sweep_seconds,
        "bounded_by_budget": spent(),
        "tried": {str(n): r for n, r in sorted(tried.items())},
    }


def add_arguments(p) -> None:
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--tool-sessions", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--baseline-seconds", type=float, default=20.0, help="0: no baselines")
    p.add_argument("--call-tokens", type=int, default=40)
    p.add_argument("--result-tokens", type=int, default=200)
    p.add_argument(
        "--result-chars",
        type=int,
        default=0,
        help="answer every call with this many characters instead (e.g. 1000000: an oversized result)",
    )
    p.add_argument("--tool-latency-ms", type=float, default=300.0)
    p.add_argument("--call-every-s", type=float, default=2.0, help="live time between a session's tool calls")
    p.add_argument("--checkpoint", default=None, help="the release folder (model.safetensors, config.json)")
    p.add_argument("--tokenizer", default=None, help="the Nano-9B-v2 tokenizer.json or its folder")
    p.add_argument("--speaker", default=None, help="speaker latent of the checkpoint (default: Aria)")
    p.add_argument("--plot", default=None, help="draw every tick's parts, stacked, to this PNG")
    p.add_argument(
        "--device-costs",
        default=None,
        help="run on the scripted device with these costs (e.g. benchmarks/device_costs/h100.json), "
        "--seconds of simulated time",
    )
    p.add_argument("--side-scale", type=float, default=1.0, help="scripted device: side work's costs x this")
    p.add_argument("--playout-lead-ms", type=float, default=80.0, help="the callers' playout lead")
    p.add_argument("--sweep", action="store_true", help="find the most sessions with zero missed deadlines")
    p.add_argument("--sweep-seconds", type=float, default=15.0)
    p.add_argument("--sweep-max", type=int, default=4096, help="the sweep tries no more sessions than this")
    p.add_argument(
        "--sweep-budget-s", type=float, default=None, help="stop the sweep after this many seconds"
    )


def main_serve(args) -> int:
    out = main_scripted(args) if args.device_costs else serve(args)
    print(json.dumps(out))
    return 0
